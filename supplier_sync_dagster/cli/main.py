"""The ``supplier-sync`` command line."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import gc
import importlib
import io
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from supplier_sync_dagster.cli.accounts import (
    ACCOUNT_HELP,
    account_scope,
    account_supplier_now,
    add_account_commands,
)
from supplier_sync_dagster.cli.health import add_commands as add_health_commands
from supplier_sync_dagster.cli.operators import add_commands as add_operator_commands
from supplier_sync_dagster.cli.outbox import add_commands as add_outbox_commands
from supplier_sync_dagster.core.errors import ConfigError, SupplierSyncError
from supplier_sync_dagster.dagster_instance.deployment import (
    BACKFILL_DAEMON_INTERVAL_SECONDS,
    run_daemon,
)

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from supplier_sync_dagster.cli.sync_runner import SyncSummary
    from supplier_sync_dagster.core.records.gates import GateResult
    from supplier_sync_dagster.core.settings import StorageSettings
    from supplier_sync_dagster.core.store.db import SyncDatabase


def _cmd_run(args: argparse.Namespace) -> int:
    from supplier_sync_dagster.cli.lease_demo import format_report, run_demo

    report = run_demo(
        db_url=args.db_url,
        lease_seconds=args.lease_seconds,
        crash=not args.no_crash,
        trigger_id=args.trigger_id,
    )
    print(format_report(report))
    return 0 if not report.problems else 1


def _console_log_level(args: argparse.Namespace) -> str:
    # The summary and one line on stderr say what happened; the in-process run's own
    # log (a step failure's stack trace among it) is for -v.
    return "INFO" if args.verbose else "CRITICAL"


def _finish_sync(summary: SyncSummary, *, as_json: bool) -> int:
    """Prints a sync's summary; a sync that did not complete adds one line on stderr."""
    print(summary.to_json() if as_json else summary.render())
    problem = summary.problem()
    if problem is None:
        return 0
    print(f"supplier-sync: {problem}", file=sys.stderr)
    return 1


def _resources(args: argparse.Namespace, settings: StorageSettings) -> tuple[Any, Any]:
    """The database and payload store resources: ``--db-url``, else the settings."""
    from supplier_sync_dagster.defs.resources import PayloadStoreResource, SyncDatabaseResource

    return (
        SyncDatabaseResource(db_url=args.db_url or settings.db_url),
        PayloadStoreResource(url=settings.payload_url),
    )


def _supplier(
    settings: Any, *, rate_limit: float | None = None, scope: Any = None, **fields: Any
) -> Any:
    """The configured supplier's resource: the settings, then these fields; the rate limit
    is the option, else the setting, else the resource's default (unset fields: defaults).
    With the ``scope`` of an account of the suppliers file: that account's, then these."""
    from supplier_sync_dagster.defs.resources import supplier_resource

    extra = {k: v for k, v in fields.items() if v is not None}
    if scope is not None and scope.account is not None:
        return account_supplier_now(settings, scope, rate_limit_rps=rate_limit, **extra)
    if settings.suppliers_file is not None:
        # Never the SUPPLIER_SYNC_SUPPLIER_* supplier by mistake in a deployment of accounts.
        raise ConfigError(
            f"the suppliers file {settings.suppliers_file} describes the accounts: name one "
            "with --account supplier.account (supplier-sync accounts list shows them)"
        )
    rate = _first(rate_limit, settings.supplier_rate_limit)
    if rate is not None:
        extra["rate_limit_rps"] = rate
    return supplier_resource(
        base_url=settings.supplier_url,
        api_key=settings.api_key(),
        redis_url=settings.redis_url,
        **extra,
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    from supplier_sync_dagster.cli.sync_runner import demo_day, run_full_sync
    from supplier_sync_dagster.core.settings import load_storage_settings
    from supplier_sync_dagster.defs.resources import SimulatedSupplierResource

    day = demo_day(advance=False)
    supplier = SimulatedSupplierResource(
        sim_cities=args.cities,
        sim_hotels=args.hotels,
        sim_profile=args.profile,
        sim_day=day,
        rate_limit_rps=args.rate_limit,
        city_threads=args.city_threads,
        worker_processes=args.processes,
    )
    sync_db, payloads = _resources(args, load_storage_settings())
    print(
        f"demo: a full sync through Dagster of the simulated supplier (day {day}, "
        f"{args.cities} cities, {args.hotels} hotels, {args.profile} profile)",
        flush=True,
    )
    summary = run_full_sync(
        supplier=supplier,
        sync_db=sync_db,
        payloads=payloads,
        progress=sys.stderr,
        console_log_level=_console_log_level(args),
    )
    status = _finish_sync(summary, as_json=False)
    if status == 0 and args.second_hotels > 0:
        status = _demo_second_supplier(args, day, sync_db, payloads)
    if status == 0:
        demo_day(advance=True)
        print(
            f"run `supplier-sync demo` again: the suppliers move to day {day + 1} and only "
            "changes publish"
        )
    return status


def _demo_second_supplier(args: argparse.Namespace, day: int, sync_db: Any, payloads: Any) -> int:
    """The demo's second supplier: its own account (tasks, partitions, assets, rate limit),
    the same catalog in its own mapping namespace."""
    import sqlalchemy as sa

    from supplier_sync_dagster.cli.sync_runner import run_full_sync
    from supplier_sync_dagster.core.accounts import Account, SimulatedSupplier
    from supplier_sync_dagster.core.settings import load_settings
    from supplier_sync_dagster.core.store import schema
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.defs.accounts import AccountScope

    world = SimulatedSupplier(
        seed=7, cities=args.second_cities, hotels=args.second_hotels, profile="clean"
    )
    scope = AccountScope(
        Account(
            supplier="globex",
            name="main",
            supplier_id=2002,
            simulator=world,
            simulator_profile="clean",
        )
    )
    print(
        f"demo: a second supplier, globex (supplier 2002, account {scope.code}: its own tasks, "
        f"partitions {scope.partitions_name} and assets {'/'.join(scope.prefix)}/...; day {day}, "
        f"{world.cities} cities, {world.hotels} hotels, clean profile)",
        flush=True,
    )
    summary = run_full_sync(
        supplier=account_supplier_now(
            load_settings(),
            scope,
            sim_day=day,
            rate_limit_rps=args.rate_limit,
            city_threads=args.city_threads,
            worker_processes=args.processes,
        ),
        scope=scope,
        sync_db=sync_db,
        payloads=payloads,
        progress=sys.stderr,
        console_log_level=_console_log_level(args),
    )
    status = _finish_sync(summary, as_json=False)
    db = SyncDatabase.open(sync_db.db_url)
    try:
        h = schema.platform_hotel.c
        with db.engine.connect() as conn:
            counts = conn.execute(
                sa.select(h.supplier_id, sa.func.count())
                .group_by(h.supplier_id)
                .order_by(h.supplier_id)
            ).all()
    finally:
        db.dispose()
    print(
        "one catalog, a mapping namespace per supplier: "
        + ", ".join(f"supplier {sid}: {n} hotels" for sid, n in counts)
        + " (several suppliers and accounts in one deployment: README, "
        '"Many suppliers, many accounts")'
    )
    return status


def _cmd_sync(args: argparse.Namespace) -> int:
    from supplier_sync_dagster.cli.sync_runner import run_full_sync
    from supplier_sync_dagster.core.settings import load_settings

    settings = load_settings()
    sync_db, payloads = _resources(args, settings)
    scope = account_scope(args, settings)
    if args.incremental:
        return _cmd_sync_incremental(args, settings, sync_db, payloads, scope)
    summary = run_full_sync(
        supplier=_supplier(
            settings,
            scope=scope,
            rate_limit=args.rate_limit,
            page_size=args.page_size,
            city_threads=args.city_threads,
            worker_processes=_first(args.processes, settings.worker_processes),
        ),
        scope=scope,
        sync_db=sync_db,
        payloads=payloads,
        trigger_id=args.trigger_id,
        progress=None if args.json else sys.stderr,
        console_log_level=_console_log_level(args),
    )
    return _finish_sync(summary, as_json=args.json)


def _cmd_sync_incremental(
    args: argparse.Namespace, settings: Any, sync_db: Any, payloads: Any, scope: Any
) -> int:
    from supplier_sync_dagster.cli.sync_runner import run_incremental_sync

    config = {
        key: value
        for key, value in (
            ("task_code", args.task),
            ("overlap_seconds", args.overlap_seconds),
            ("max_pages", args.max_pages),
            ("changes_per_request", args.changes_limit),
        )
        if value is not None
    }
    summary = run_incremental_sync(
        supplier=_supplier(
            settings, scope=scope, rate_limit=args.rate_limit, page_size=args.page_size
        ),
        scope=scope,
        sync_db=sync_db,
        payloads=payloads,
        config=config,
        trigger_id=args.trigger_id,
        console_log_level=_console_log_level(args),
    )
    print(summary.to_json() if args.json else summary.render())
    problem = summary.problem()
    if problem is None:
        return 0
    print(f"supplier-sync: {problem}", file=sys.stderr)
    return 1


def _cmd_reconcile(args: argparse.Namespace) -> int:
    import json

    from supplier_sync_dagster.cli.sync_runner import run_full_sync
    from supplier_sync_dagster.core.repair.reconcile import Tolerance, reconcile
    from supplier_sync_dagster.core.settings import load_settings
    from supplier_sync_dagster.core.store.db import SyncDatabase

    settings = load_settings()
    sync_db, payloads = _resources(args, settings)
    scope = account_scope(args, settings)
    supplier = _supplier(settings, scope=scope)
    tolerance = Tolerance(args.absolute, args.relative, args.max_lag_hours * 3600)
    db = SyncDatabase.open(sync_db.db_url)
    try:
        with supplier.client() as client:
            report = reconcile(
                db,
                client,
                supplier_id=supplier.supplier_id,
                cities=args.city,
                tolerance=tolerance,
                store=payloads.open(),
                task_code=supplier.task_code,
            )
    finally:
        db.dispose()
    differing = [c.city_code for c in report.differing]
    if args.json:
        for c in report.cities:
            print(json.dumps(c.row(), ensure_ascii=False))
    else:
        for c in report.differing + report.failed:
            print(f"{c.city_code!r}: {'; '.join(c.reasons) or c.error}")
        print(
            f"{len(report.cities)} cities compared in {report.seconds:.1f} s "
            f"({report.requests} requests): {len(differing)} differ, "
            f"{len(report.failed)} not compared"
        )
    status = 0
    if differing and not args.no_repull:
        summary = run_full_sync(
            supplier=supplier,
            scope=scope,
            sync_db=sync_db,
            payloads=payloads,
            cities=differing,
            progress=None if args.json else sys.stderr,
            console_log_level=_console_log_level(args),
        )
        problem = summary.problem()
        message = (
            f"re-pulled {summary.cities_done} of {len(differing)} cities in batch "
            f"{summary.batch_id}: {summary.published} published"
        )
        print(json.dumps({"repull": asdict_summary(summary)}) if args.json else message)
        if problem is not None:
            print(f"supplier-sync: {problem}", file=sys.stderr)
            status = 1
    if report.failed and status == 0:
        print(
            f"supplier-sync: {len(report.failed)} cities could not be compared "
            f"({report.failed[0].error})",
            file=sys.stderr,
        )
        status = 1
    return status


def asdict_summary(summary: Any) -> dict[str, Any]:
    """A sync summary as a plain mapping (for JSON)."""
    return dataclasses.asdict(summary)


def _cmd_export(args: argparse.Namespace) -> int:
    from supplier_sync_dagster.core.repair.export import export_jsonl
    from supplier_sync_dagster.core.store.db import SyncDatabase

    db = SyncDatabase.open(args.db_url)
    try:
        n = export_jsonl(db, args.what, sys.stdout, batch_id=args.batch)
    finally:
        db.dispose()
    print(f"exported {n} {args.what}", file=sys.stderr)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from supplier_sync_dagster.core.store.db import SyncDatabase

    db = SyncDatabase.open(args.db_url)
    try:
        return _print_status(db, args)
    finally:
        db.dispose()


def _print_status(db: SyncDatabase, args: argparse.Namespace) -> int:
    from supplier_sync_dagster.core.leasing.batches import get_batch, list_batches, rate_and_eta
    from supplier_sync_dagster.core.leasing.leases import list_shards

    if args.batch:
        with db.engine.connect() as conn:
            batches = [get_batch(conn, args.batch)]
    else:
        batches = list_batches(db, task_code=args.task, limit=args.limit)
    if not batches:
        print("no batches")
        return 0
    with db.engine.connect() as conn:
        now = db.clock.read(conn)
    for b in batches:
        print(
            f"{b.batch_id}  {b.task_code}  {b.status:<14} {b.shards_done}/{b.shard_count} cities  "
            f"{b.progress_percent}%  pages={b.pages_done} hotels={b.fetched_count}  "
            f"total={b.total_count} ok={b.success_count} failed={b.failed_count} "
            f"skipped={b.skipped_count}  {rate_and_eta(b, now)}  "
            f"current={b.current_city_code!r} page={b.current_page}  heartbeat={b.heartbeat_at}"
        )
        if args.batch:
            for s in list_shards(db, b.batch_id):
                print(
                    f"    {s.shard_key!r:<30} {s.status:<9} pages={s.pages_done}/{s.total_pages} "
                    f"total={s.total_count} claims={s.claim_count} worker={s.worker_id} "
                    f"stage={s.last_heartbeat_stage}"
                )
    return 0


def _cmd_stalls(args: argparse.Namespace) -> int:
    from supplier_sync_dagster.core.leasing.leases import find_stalls
    from supplier_sync_dagster.core.store.db import SyncDatabase

    db = SyncDatabase.open(args.db_url)
    try:
        stalls = find_stalls(db, checkpoint_stall_seconds=args.checkpoint_stall_seconds)
    finally:
        db.dispose()
    for s in stalls:
        print(
            f"{s.kind:<19} batch={s.batch_id} city={s.shard_key!r} worker={s.worker_id} "
            f"since_checkpoint={s.seconds_since_checkpoint:.0f}s heartbeat={s.heartbeat_at}"
        )
    if not stalls:
        print("no stalled shards")
    return 0


def _cmd_db_migrate(args: argparse.Namespace) -> int:
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.store.migrations import migrate

    db = SyncDatabase.open(args.db_url, create_schema=False)
    try:
        dry_run = getattr(args, "dry_run", False)
        result = migrate(db, dry_run=dry_run)
    finally:
        db.dispose()
    if result.baseline:
        print(
            f"{'would record' if dry_run else 'recorded'} {db.safe_url} at version "
            f"{result.baseline:03d} (baseline: it had no schema history and the structure of "
            f"version {result.baseline:03d})"
        )
    elif result.baseline == 0:
        print(f"{db.safe_url} has none of the sync tables: every version applies")
    for applied in result.applied:
        print(
            f"would apply {applied.label}"
            if dry_run
            else f"applied {applied.label} ({applied.seconds * 1000:.0f} ms)"
        )
    if dry_run:
        print(f"dry run: nothing changed; {db.safe_url} would be at version {result.head:03d}")
    elif not result.applied:
        print(f"{db.safe_url} is at version {result.version:03d}: nothing to apply")
    else:
        print(f"{db.safe_url} is at version {result.version:03d}")
    if args.db_command == "init" and not dry_run:
        print(f"schema ready in {db.safe_url}")
    return 0


def _cmd_db_status(args: argparse.Namespace) -> int:
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.store.migrations import migration_status

    db = SyncDatabase.open(args.db_url, create_schema=False)
    try:
        status = migration_status(db)
    finally:
        db.dispose()
    rows = {r.version: r for r in status.history}
    edited = {r.version for r in status.edited}
    for m in status.migrations:
        row = rows.get(m.version)
        if row is None:
            state = "pending"
            if status.baseline and m.version <= status.baseline:
                state = "present, not recorded (baseline)"
            print(f"{m.version:03d}  {m.description:<28} {state}")
            continue
        when = f"{row.installed_at:%Y-%m-%d %H:%M:%S} UTC" if row.installed_at else "?"
        if not row.success:
            state = f"NOT FINISHED (started {when} by {row.installed_by}): see `db repair`"
        elif m.version in edited:
            state = f"EDITED since it was applied ({m.script})"
        elif row.kind == "BASELINE":
            state = f"baseline, recorded {when}"
        else:
            state = f"applied {when} ({row.execution_ms} ms)"
        print(f"{m.version:03d}  {m.description:<28} {state}")
    for row in status.unknown:
        print(f"{row.version:03d}  {row.description:<28} applied by a newer release")
    if not status.versioned:
        print(
            f"{db.safe_url} has no schema history: "
            + (
                f"its structure is that of version {status.baseline:03d}; "
                if status.baseline
                else "it is empty; "
            )
            + "`supplier-sync db migrate` records it and applies the rest"
        )
    verdict = "up to date" if status.up_to_date else "NOT up to date"
    print(f"{db.safe_url}: version {status.version:03d} of {status.head:03d}, {verdict}")
    return 0 if status.up_to_date else 1


def _cmd_db_repair(args: argparse.Namespace) -> int:
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.store.migrations import repair

    db = SyncDatabase.open(args.db_url, create_schema=False)
    try:
        repaired = repair(db, mark_applied=args.mark_applied)
    finally:
        db.dispose()
    if not repaired:
        print(f"{db.safe_url}: no unfinished migration to repair")
    for row in repaired:
        done = (
            "recorded as applied" if args.mark_applied else "forgotten: `db migrate` runs it again"
        )
        print(f"{row.version:03d} {row.description}: {done}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from supplier_sync_dagster.simulator import FaultProfile, SimulatorConfig, serve

    try:
        faults = FaultProfile.named(args.profile)
    except (KeyError, ValueError) as err:
        raise ConfigError(f"unknown fault profile {args.profile!r}: {err}") from None
    if args.hostile_city_codes:
        faults = faults.with_(hostile_city_codes=True)
    config = SimulatorConfig(
        seed=args.seed,
        n_cities=args.cities,
        total_hotels=args.hotels,
        api_key=args.api_key,
        day=args.day,
        rate_limit_rps=args.rate_limit,
        faults=faults,
    )
    print(
        f"supplier simulator on http://{args.host}:{args.port} ({args.cities} cities, "
        f"{args.hotels} hotels, profile {args.profile}, day {args.day})",
        flush=True,
    )
    serve(config, host=args.host, port=args.port)
    return 0


def _cmd_review(args: argparse.Namespace) -> int:
    import json

    from supplier_sync_dagster.core.records.review import (
        approve_reviews,
        count_reviews,
        list_reviews,
        reject_reviews,
    )
    from supplier_sync_dagster.core.store.db import SyncDatabase

    db = SyncDatabase.open(args.db_url)
    try:
        if args.review_command == "list":
            status = None if args.status == "ALL" else args.status
            with db.engine.connect() as conn:
                reviews = list_reviews(conn, status=status, batch_id=args.batch, limit=args.limit)
                counts = count_reviews(conn, batch_id=args.batch)
            for rv in reviews:
                if args.json:
                    print(json.dumps(rv.__dict__, default=str, ensure_ascii=False))
                    continue
                fields = ", ".join(
                    f"{c['field']}: {c['old']} -> {c['new']}" for c in rv.changed_fields[:4]
                )
                print(
                    f"{rv.review_id}  {rv.status:<10} {rv.supplier_hotel_id} v{rv.supplier_version}"
                    f"  {rv.diff_type}  {fields}"
                )
            print(f"reviews by status: {counts}", file=sys.stderr)
            return 0
        ids = None if args.all else list(args.ids)
        if ids is not None and not ids:
            raise ConfigError("name the reviews to decide, or pass --all")
        decide = approve_reviews if args.review_command == "approve" else reject_reviews
        decision = decide(db, review_ids=ids, who=args.by, reason=args.reason, batch_id=args.batch)
        print(json.dumps(decision.__dict__))
        return 0
    finally:
        db.dispose()


def _cmd_gate(args: argparse.Namespace) -> int:
    import json

    from supplier_sync_dagster.core.errors import ProfileMissing
    from supplier_sync_dagster.core.leasing.batches import get_batch
    from supplier_sync_dagster.core.records.gates import (
        GateThresholds,
        evaluate_gates,
        get_gate_thresholds,
        override_gate,
        set_gate_thresholds,
    )
    from supplier_sync_dagster.core.store.db import SyncDatabase

    db = SyncDatabase.open(args.db_url)
    try:
        if args.gate_command == "override":
            with db.begin() as conn:
                done = override_gate(
                    conn,
                    db.clock,
                    batch_id=args.batch,
                    shard_key=args.city,
                    check_name=args.check,
                    who=args.by,
                    reason=args.reason,
                )
            print(json.dumps(done.__dict__, default=str, ensure_ascii=False))
            print("re-run the city (the same launch) to publish it", file=sys.stderr)
            return 0
        if args.gate_command == "show":
            with db.engine.connect() as conn:
                task = get_batch(conn, args.batch).task_code
                try:
                    results = evaluate_gates(
                        conn,
                        batch_id=args.batch,
                        task_code=task,
                        shard_key=args.city,
                        thresholds=get_gate_thresholds(conn, task),
                    )
                except ProfileMissing:
                    results = _stopped_early(db, conn, args.batch, args.city)
            for r in results:
                state = "overridden" if r.overridden else ("passed" if r.passed else "FAILED")
                print(f"{r.check_name:<18} {state:<10} {r.description}")
                print(f"    {json.dumps(r.metadata, default=str, ensure_ascii=False)}")
            return 0
        # thresholds
        changes = _threshold_changes(args)
        with db.begin() as conn:
            current = get_gate_thresholds(conn, args.task)
            if changes:
                current = GateThresholds.from_dict({**current.to_dict(), **changes})
                set_gate_thresholds(
                    conn, db.clock, task_code=args.task, thresholds=current, updated_by=args.by
                )
        print(json.dumps(current.to_dict()))
        return 0
    finally:
        db.dispose()


def _cmd_task(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from supplier_sync_dagster.core.leasing.batches import get_task
    from supplier_sync_dagster.core.records.gates import get_gate_thresholds
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.sync.tasks import change_task, task_audit

    db = SyncDatabase.open(args.db_url)
    try:
        if args.task_command == "set":
            changes = change_task(
                db,
                args.task,
                changed_by=args.by,
                reason=args.reason,
                policy=args.policy,
                status=args.status,
                cron=args.cron,
                thresholds=_threshold_changes(args),
            )
            for c in changes:
                print(f"{c.field_name}: {c.old_value} -> {c.new_value}")
            if not changes:
                print("no change: the task already has these settings")
            return 0
        with db.engine.connect() as conn:
            task = get_task(conn, args.task)
            thresholds_now = get_gate_thresholds(conn, args.task)
            audit = task_audit(conn, args.task, limit=args.history)
        if args.json:
            print(
                json.dumps(
                    {
                        "task": asdict(task),
                        "gate_thresholds": thresholds_now.to_dict(),
                        "audit": [asdict(a) for a in audit],
                    },
                    default=str,
                    ensure_ascii=False,
                )
            )
            return 0
        print(
            f"task {task.task_code}: {task.status}, policy {task.concurrency_policy}, "
            f"schedule {task.schedule_type}{f' {task.cron_expr!r}' if task.cron_expr else ''}, "
            f"supplier {task.supplier_id}, {task.category_code}/{task.sync_mode}/{task.data_scope}"
        )
        print("gate thresholds: " + json.dumps(thresholds_now.to_dict()))
        for a in audit:
            print(
                f"  {a.created_at:%Y-%m-%d %H:%M:%S}  {a.changed_by}  {a.field_name}: "
                f"{a.old_value} -> {a.new_value}  ({a.reason})"
            )
        return 0
    finally:
        db.dispose()


def _stopped_early(
    db: SyncDatabase, conn: Connection, batch_id: str, city: str
) -> list[GateResult]:
    """The checks that stopped a city on its first pages, before it had a full profile.

    Raises:
        ProfileMissing: The city was not stopped by a gate (it is not normalized yet).
    """
    from supplier_sync_dagster.core.errors import ProfileMissing
    from supplier_sync_dagster.core.leasing.leases import get_shard
    from supplier_sync_dagster.core.records.gates import (
        CHECK_NAMES,
        GateResult,
        gated_checks,
        list_overrides,
    )

    shard = get_shard(db, batch_id, city)
    stopped = gated_checks(shard.error_message)
    if stopped is None:
        raise ProfileMissing(
            f"city {city!r} of batch {batch_id} is {shard.status} and has no gate results yet"
        )
    overrides = {o.check_name for o in list_overrides(conn, batch_id=batch_id, shard_key=city)}
    meta = {"stopped": "on its first pages; the other checks run once it passes"}
    results = []
    for name, why in stopped:
        check = next((c for c in CHECK_NAMES if c == name), None)
        if check is not None:
            overridden = check in overrides
            results.append(GateResult(check, overridden, "ERROR", why, meta, overridden))
    return results


def _cmd_replay(args: argparse.Namespace) -> int:
    import json

    from supplier_sync_dagster.core.leasing.batches import get_task
    from supplier_sync_dagster.core.settings import (
        DEFAULT_TASK_CODE,
        load_settings,
        load_storage_settings,
    )
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.sync.replay import (
        dry_run_city,
        latest_raw_batch,
        stored_city_countries,
    )
    from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE
    from supplier_sync_dagster.defs.resources import SimulatedSupplierResource

    scope = DEFAULT_SCOPE
    task_code = args.task or DEFAULT_TASK_CODE
    if args.account is not None:
        scope = account_scope(args, load_settings())
        if args.task is not None and args.task != scope.full_task_code:
            raise ConfigError(
                f"--task {args.task} is not account {scope.account.code}'s full-sync task "
                f"({scope.full_task_code}): give one of them"
            )
        task_code = scope.full_task_code
    sync_db, payloads = _resources(args, load_storage_settings())
    db = SyncDatabase.open(sync_db.db_url)
    try:
        # A replay reads stored pages only: it needs the task and its supplier, no URL.
        with db.engine.connect() as conn:
            task = get_task(conn, task_code)
        cities = list(dict.fromkeys(args.city))
        missing = [
            c for c in cities if latest_raw_batch(db, task_code=task.task_code, city_code=c) is None
        ]
        for city in missing:
            print(
                f"supplier-sync: city {city!r} has no stored raw pages for task "
                f"{task.task_code!r}: nothing to replay",
                file=sys.stderr,
            )
        if len(missing) == len(cities):
            return 1
        cities = [c for c in cities if c not in missing]
        if args.dry_run:
            store = payloads.open()
            countries = stored_city_countries(db, store, task_code=task.task_code)
            for city in cities:
                report = dry_run_city(
                    db,
                    store,
                    task_code=task.task_code,
                    supplier_id=task.supplier_id,
                    city_code=city,
                    city_countries=countries,
                )
                print(json.dumps(report.to_json(), default=str, ensure_ascii=False))
            return 1 if missing else 0
    finally:
        db.dispose()
    from supplier_sync_dagster.cli.sync_runner import run_replay

    summary = run_replay(
        # A replay never calls the supplier: the simulator stands in, never started.
        supplier=SimulatedSupplierResource(
            task_code=task.task_code,
            supplier_id=task.supplier_id,
            account=None if scope.account is None else scope.account.code,
        ),
        cities=cities,
        sync_db=sync_db,
        payloads=payloads,
        trigger_id=args.trigger_id,
        console_log_level=_console_log_level(args),
        scope=scope,
    )
    status = _finish_sync(summary, as_json=args.json)
    return status or (1 if missing else 0)


# Cities in flight in the CLI's run. It is the only run, so a second city can use the time
# one city waits on the database server. A backfill's runs keep the default of 1.
CLI_CITY_THREADS = 2
_THREADS = "cities in flight at once in the run"


def _positive_int(text: str, least: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
    return value


T = TypeVar("T")


def _first(*values: T | None) -> T | None:
    return next((v for v in values if v is not None), None)


def _processes(text: str) -> int:
    return _positive_int(text, least=0)


_PROCESSES = (
    "worker processes that sync the cities (0: the run's own process; default: one per CPU "
    "plus one, at most 4, when the cities hold at least 5,000 hotels)"
)


def _add_threshold_options(parser: argparse.ArgumentParser) -> None:
    """One option per gate threshold (``--max-bad-ratio``...), each unset by default."""
    from supplier_sync_dagster.core.records.gates import GateThresholds

    for f in dataclasses.fields(GateThresholds):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None)


def _threshold_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The gate thresholds given on the command line, by field name."""
    from supplier_sync_dagster.core.records.gates import GateThresholds

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(GateThresholds)}
    return {name: value for name, value in given.items() if value is not None}


# What a command that runs Dagster imports: :func:`run` imports it before the command starts
# (see there). A subcommand names the modules it needs with ``set_defaults(preload=...)``.
_DAGSTER_RUNNER = ("supplier_sync_dagster.cli.sync_runner",)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``supplier-sync``."""
    from supplier_sync_dagster.core.records.gates import CHECK_NAMES
    from supplier_sync_dagster.core.settings import DEFAULT_TASK_CODE, env_name

    parser = argparse.ArgumentParser(prog="supplier-sync", description=__doc__)
    parser.add_argument(
        "--db-url",
        default=None,
        help=f"sync database URL (default: ${env_name('db_url')}, else a SQLite file in "
        f"${env_name('home')} or ./.supplier_sync)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at INFO level, with the Dagster run's log and the traceback of an error",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="the main job on the embedded defaults: a full sync through Dagster of the "
        "simulated supplier (flaky), then of a second supplier through its own account, with "
        "progress and summaries; run again for the next day",
    )
    demo.add_argument("--cities", type=int, default=50)
    demo.add_argument("--hotels", type=int, default=20_000)
    demo.add_argument(
        "--profile", default="flaky", help="simulator fault profile: clean, flaky or hostile"
    )
    demo.add_argument("--rate-limit", type=float, default=1000.0, help="requests/s")
    demo.add_argument("--city-threads", type=_positive_int, default=CLI_CITY_THREADS, help=_THREADS)
    demo.add_argument("--processes", type=_processes, default=None, help=_PROCESSES)
    demo.add_argument(
        "--second-hotels",
        type=int,
        default=2_000,
        help="hotels of the second simulated supplier, synced through its own account (0: none)",
    )
    demo.add_argument("--second-cities", type=_positive_int, default=10)
    demo.set_defaults(func=_cmd_demo, preload=_DAGSTER_RUNNER)

    sync = sub.add_parser("sync", help="a sync against the configured supplier (SUPPLIER_SYNC_*)")
    mode = sync.add_mutually_exclusive_group(required=True)
    mode.add_argument("--full", action="store_true", help="every city (full sync)")
    mode.add_argument(
        "--incremental",
        action="store_true",
        help="one window of the change feed, from the watermark until caught up",
    )
    sync.add_argument(
        "--overlap-seconds",
        type=float,
        default=None,
        help="incremental: how far before the watermark the window starts (default 300)",
    )
    sync.add_argument(
        "--max-pages",
        type=_positive_int,
        default=None,
        help="incremental: pages per window at most (default 2000)",
    )
    sync.add_argument(
        "--changes-limit",
        type=_positive_int,
        default=None,
        help="incremental: changes per feed request, 1-1000 (default 500)",
    )
    sync.add_argument(
        "--task",
        default=None,
        help="incremental: the incremental task (default hotel_supplier_incremental)",
    )
    sync.add_argument("--json", action="store_true", help="print the summary as JSON")
    sync.add_argument("--account", default=None, help=ACCOUNT_HELP)
    sync.add_argument("--trigger-id", default=None, help="idempotency key: a retry continues it")
    sync.add_argument("--page-size", type=int, default=None, help="hotels per page (default 100)")
    sync.add_argument(
        "--rate-limit",
        type=float,
        default=None,
        help="requests/s allowed (default: SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT, else 50)",
    )
    sync.add_argument("--city-threads", type=_positive_int, default=CLI_CITY_THREADS, help=_THREADS)
    sync.add_argument("--processes", type=_processes, default=None, help=_PROCESSES)
    sync.set_defaults(func=_cmd_sync, preload=_DAGSTER_RUNNER)

    export = sub.add_parser("export", help="JSON lines of published hotels, dead letters or diffs")
    export.add_argument("what", choices=["published", "dead-letters", "diffs"])
    export.add_argument("--format", choices=["jsonl"], default="jsonl")
    export.add_argument("--batch", default=None, help="only this batch (dead letters, diffs)")
    export.set_defaults(func=_cmd_export)

    run = sub.add_parser(
        "lease-demo",
        help="the lease/checkpoint demonstration: two worker processes, one killed mid-city, "
        "the other reclaims its city and resumes from the checkpoint",
    )
    run.add_argument("--lease-seconds", type=float, default=6.0, help="lease duration (5-1800)")
    run.add_argument("--no-crash", action="store_true", help="do not kill worker A")
    run.add_argument("--trigger-id", default=None, help="idempotency key of this launch")
    run.set_defaults(func=_cmd_run)

    status = sub.add_parser("status", help="batches with their progress (and shards with --batch)")
    status.add_argument("--batch", default=None, help="show this batch and its shards")
    status.add_argument("--task", default=None, help="only this task's batches")
    status.add_argument("--limit", type=int, default=10)
    status.set_defaults(func=_cmd_status)

    stalls = sub.add_parser("stalls", help="running shards that are stuck or whose lease expired")
    stalls.add_argument("--checkpoint-stall-seconds", type=float, default=600.0)
    stalls.set_defaults(func=_cmd_stalls)

    sim = sub.add_parser("simulate", help="serve the supplier simulator over HTTP (uvicorn)")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8080)
    sim.add_argument("--seed", type=int, default=42)
    sim.add_argument("--cities", type=int, default=50)
    sim.add_argument("--hotels", type=int, default=20_000)
    sim.add_argument("--day", type=int, default=0)
    sim.add_argument("--api-key", default="sim-key", help="the key clients must send")
    sim.add_argument("--rate-limit", type=float, default=None, help="requests/s per API key")
    sim.add_argument("--profile", default="clean", help="fault profile: clean, flaky or hostile")
    sim.add_argument("--hostile-city-codes", action="store_true")
    sim.set_defaults(func=_cmd_simulate)

    daemon = sub.add_parser(
        "daemon",
        help="dagster-daemon run, with the backfill daemon looking for new backfills every "
        "--backfill-interval seconds instead of Dagster's fixed 30",
    )
    daemon.add_argument(
        "--backfill-interval",
        type=float,
        default=BACKFILL_DAEMON_INTERVAL_SECONDS,
        help="seconds between backfill daemon ticks",
    )
    daemon.add_argument(
        "-w",
        "--workspace",
        default="workspace.yaml",
        help="the workspace file, as for dagster-daemon run",
    )
    daemon.set_defaults(func=_cmd_daemon)

    review = sub.add_parser("review", help="diffs held for review: list, approve, reject")
    review_sub = review.add_subparsers(dest="review_command", required=True)
    rlist = review_sub.add_parser("list", help="reviews (PENDING by default)")
    rlist.add_argument(
        "--status",
        default="PENDING",
        choices=["PENDING", "APPROVED", "REJECTED", "SUPERSEDED", "ALL"],
    )
    rlist.add_argument("--batch", default=None)
    rlist.add_argument("--limit", type=int, default=100)
    rlist.add_argument("--json", action="store_true")
    rlist.set_defaults(func=_cmd_review)
    for name, what in (
        ("approve", "publish them (version-guarded)"),
        ("reject", "keep what is live"),
    ):
        decide = review_sub.add_parser(name, help=f"{name} reviews: {what}")
        decide.add_argument("ids", nargs="*", help="review ids")
        decide.add_argument("--all", action="store_true", help="every PENDING review (of --batch)")
        decide.add_argument("--batch", default=None)
        decide.add_argument("--by", required=True, help="who decides (recorded)")
        decide.add_argument("--reason", required=True, help="why (recorded)")
        decide.set_defaults(func=_cmd_review)

    gate = sub.add_parser("gate", help="batch quality gates: show, override, thresholds")
    gate_sub = gate.add_subparsers(dest="gate_command", required=True)
    show = gate_sub.add_parser("show", help="a city's gate results in a batch")
    show.add_argument("--batch", required=True)
    show.add_argument("--city", required=True, help="the supplier's city code, verbatim")
    show.set_defaults(func=_cmd_gate)
    override = gate_sub.add_parser("override", help="let a city pass a failed check (recorded)")
    override.add_argument("--batch", required=True)
    override.add_argument("--city", required=True, help="the supplier's city code, verbatim")
    override.add_argument("--check", required=True, choices=CHECK_NAMES)
    override.add_argument("--by", required=True, help="who overrides (recorded)")
    override.add_argument("--reason", required=True, help="why (recorded)")
    override.set_defaults(func=_cmd_gate)
    thresholds = gate_sub.add_parser("thresholds", help="show or set a task's gate thresholds")
    thresholds.add_argument("--task", default=DEFAULT_TASK_CODE)
    _add_threshold_options(thresholds)
    thresholds.add_argument("--by", default=None, help="who changes them (recorded)")
    thresholds.set_defaults(func=_cmd_gate)

    task = sub.add_parser(
        "task",
        help="a sync task's settings: show them, or set them (audited; runs never change them)",
    )
    task_sub = task.add_subparsers(dest="task_command", required=True)
    task_show = task_sub.add_parser("show", help="the settings, gate thresholds and change log")
    task_set = task_sub.add_parser(
        "set", help="change policy, status, cron or gate thresholds (recorded with who and why)"
    )
    for p in (task_show, task_set):
        p.add_argument("--task", default=DEFAULT_TASK_CODE, help="the task code")
        p.set_defaults(func=_cmd_task)
    task_show.add_argument("--history", type=int, default=10, help="change-log rows to show")
    task_show.add_argument("--json", action="store_true")
    task_set.add_argument(
        "--policy", choices=["SKIP_IF_RUNNING", "CANCEL_PREVIOUS", "ALLOW_PARALLEL"], default=None
    )
    task_set.add_argument("--status", choices=["ENABLED", "DISABLED"], default=None)
    task_set.add_argument(
        "--cron", default=None, help="a cron expression ('0 2 * * *', @daily), or none to clear"
    )
    _add_threshold_options(task_set)
    task_set.add_argument("--by", required=True, help="who changes it (recorded)")
    task_set.add_argument("--reason", required=True, help="why (recorded)")

    replay = sub.add_parser(
        "replay",
        help="normalize, check, diff and publish cities again from their stored raw pages "
        "(no supplier request), e.g. after a rule was fixed",
    )
    replay.add_argument("--city", action="append", required=True, help="a city code (repeatable)")
    replay.add_argument("--dry-run", action="store_true", help="report the diffs, publish nothing")
    replay.add_argument("--json", action="store_true")
    replay.add_argument("--trigger-id", default=None, help="idempotency key of this replay")
    replay.add_argument(
        "--task",
        default=None,
        help=f"the task whose pages are replayed (default {DEFAULT_TASK_CODE}, or the "
        "account's full-sync task)",
    )
    replay.add_argument(
        "--account",
        default=None,
        metavar="SUPPLIER.ACCOUNT",
        help="an account of the suppliers file: its full-sync task and its assets",
    )
    replay.set_defaults(func=_cmd_replay, preload=_DAGSTER_RUNNER)

    recon = sub.add_parser(
        "reconcile",
        help="each city's supplier summary against the catalog; re-pull the cities that differ",
    )
    recon.add_argument("--city", action="append", default=None, help="a city code (repeatable)")
    recon.add_argument("--absolute", type=int, default=2, help="hotels apart that are fine")
    recon.add_argument("--relative", type=float, default=0.02, help="...or this share")
    recon.add_argument(
        "--max-lag-hours", type=float, default=6.0, help="newest change may trail this long"
    )
    recon.add_argument(
        "--no-repull", action="store_true", help="report only; do not re-pull what differs"
    )
    recon.add_argument("--json", action="store_true", help="JSON lines: one per city, a summary")
    recon.add_argument("--account", default=None, help=ACCOUNT_HELP)
    recon.set_defaults(func=_cmd_reconcile, preload=_DAGSTER_RUNNER)

    add_outbox_commands(sub)
    add_operator_commands(sub)
    add_health_commands(sub)
    add_account_commands(sub)

    db = sub.add_parser(
        "db",
        help="sync database schema: versioned migrations of sql/ (migrate, status, repair)",
        description="The schema is the numbered files of sql/ (sql/sqlite/ on SQLite), each "
        "applied once and recorded with its checksum in supplier_sync_schema_history. Every "
        "command that opens the database applies the pending ones first; these commands "
        "show and do it explicitly.",
    )
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_migrate = db_sub.add_parser(
        "migrate",
        help="bring the schema to the newest version: record an unversioned database's "
        "version from its structure, then apply the pending files in order, printing each",
    )
    db_migrate.add_argument(
        "--dry-run", action="store_true", help="print what would be applied, change nothing"
    )
    db_migrate.set_defaults(func=_cmd_db_migrate)
    db_init = db_sub.add_parser("init", help="create the schema, or upgrade it (same as migrate)")
    db_init.set_defaults(func=_cmd_db_migrate)
    db_status = db_sub.add_parser(
        "status",
        help="each version: applied, baseline, pending, edited or unfinished; "
        "exit 1 unless up to date",
    )
    db_status.set_defaults(func=_cmd_db_status)
    db_repair = db_sub.add_parser(
        "repair",
        help="after a MySQL migration stopped half-way and you undid its statements by hand: "
        "forget the attempt so that migrate runs it again",
    )
    db_repair.add_argument(
        "--mark-applied",
        action="store_true",
        help="you completed its statements by hand instead: record it as applied",
    )
    db_repair.set_defaults(func=_cmd_db_repair)
    return parser


def _cmd_daemon(args: argparse.Namespace) -> int:
    return run_daemon(["-w", args.workspace], backfill_interval_seconds=args.backfill_interval)


def _stdout_to_devnull() -> None:
    """Points stdout at /dev/null, so that the interpreter's last flush finds no closed pipe
    (the Python docs' recipe for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass  # stdout is no file (in-process callers): nothing is flushed at exit


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``supplier-sync`` console script.

    Returns:
        0 on success; 1 when the work did not complete (a sync failed, was gated or
        skipped) or on an unexpected error; 2 on an error the program names (bad input or
        configuration, an unknown batch or task, an unreachable database or supplier);
        130 when interrupted; 141 (128 + SIGPIPE) when stdout was closed (``| head``).
    """
    args = build_parser().parse_args(argv)
    if args.func is not _cmd_daemon:
        # The daemon's loggers have their own handlers: a root handler would print each
        # of its lines twice.
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.WARNING,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    if not args.verbose:
        # Retries are expected (and counted); the summary reports them, not the terminal.
        logging.getLogger("supplier_sync_dagster.core.supplier").setLevel(logging.ERROR)
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        # The reader of stdout (`| head -1`) has what it wanted: stop quietly, as a Unix
        # tool killed by SIGPIPE does.
        _stdout_to_devnull()
        return 128 + signal.SIGPIPE
    except SupplierSyncError as err:
        print(f"supplier-sync: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("supplier-sync: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if args.verbose:
            traceback.print_exc()
        hint = "" if args.verbose else " (run with -v for the traceback)"
        print(f"supplier-sync: error: {_one_line(err)}{hint}", file=sys.stderr)
        return 1


# The young-generation threshold of the console script's process, from its start: the
# one a sync sets anyway (``core.sync.runtime.GC_GEN0_THRESHOLD``, an import to avoid here).
START_GC_THRESHOLD = 50_000


def run() -> NoReturn:
    """The ``supplier-sync`` console script: :func:`main` with the process's arguments, then
    a quick exit (:func:`exit_quickly`).

    A command that runs Dagster imports Dagster, SQLAlchemy, pandas and pandera: millions of
    objects, all kept. While they load, CPython's cyclic collector would re-scan them again
    and again (0.3-0.5 s of a ~2 s start, even with a raised threshold), and they are
    garbage only at exit. So the parser (whose options import settings and gates) is built
    and the modules a command names (``preload``) are imported with the collector off, then
    frozen (never scanned again; reference counting still frees them), and the collector
    runs from then on with the young-generation threshold a sync sets anyway.
    """
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, START_GC_THRESHOLD), gen1, gen2)
    gc.disable()
    try:
        preload = _preload_names(sys.argv[1:])
        for name in preload:
            importlib.import_module(name)
        if preload:
            gc.freeze()
    finally:
        gc.enable()
    exit_quickly(main())


def _preload_names(argv: Sequence[str]) -> tuple[str, ...]:
    """The modules the command of ``argv`` asks :func:`run` to import first (none when the
    arguments do not parse: :func:`main` then says why)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit:  # --help, a usage error: main() prints it
        return ()
    return tuple(getattr(args, "preload", ()))


def exit_quickly(code: int) -> NoReturn:
    """Ends the process with ``code`` without Python's module teardown.

    Interpreter finalization frees every object of every loaded module one by one: with
    Dagster, SQLAlchemy, pandas and pandera loaded that is 0.5-1 s at the end of each
    command, for memory the operating system takes back at once. What finalization does that
    matters still happens, in its order: other threads are waited for (and executors told
    to stop), exit handlers run (logging's, multiprocessing's, Dagster's), the standard
    streams are flushed.
    """
    shutdown = getattr(threading, "_shutdown", None)  # what finalization calls first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # A closed pipe or stream: nothing is left to say there.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
