"""What ``demo``, ``sync``, ``reconcile`` and ``replay`` do: syncs through Dagster
(:mod:`supplier_sync_dagster.cli.sync_runner`), with a summary and one line on stderr when
the work did not complete. Their arguments: :mod:`supplier_sync_dagster.cli.parsers.sync`.

``sync --full`` exits 0 when every city published; 1 when the sync did not complete (cities
failed or gated: the line names them with their codes and the ``--trigger-id`` that resumes
them); 2 when the supplier refused the API key or could not be reached (the line names the
key's variable, or the code and address); 3 when its batch was cancelled (a CANCEL_PREVIOUS
trigger: the line names it; nothing resumes); 128 + the signal's number (130, 143) when SIGINT
or SIGTERM stopped it (``sync --incremental`` too), with the ``--trigger-id`` that resumes it.
A sync that did not complete runs one alert round at once, as the alert sensor would: a cron
or CLI run alerts without the daemon.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import sys
from typing import Any, Protocol

import sqlalchemy as sa

from supplier_sync_dagster.cli import sync_runner
from supplier_sync_dagster.cli.common import first, open_db, warn
from supplier_sync_dagster.cli.demo_catalogs import claim_demo_catalog
from supplier_sync_dagster.cli.resources import (
    account_scope,
    account_supplier_now,
    configured_supplier,
    storage_resources,
)

# The module, not its functions: a command reads the settings through what the module holds
# when it runs (a test counts those reads).
from supplier_sync_dagster.core import settings as config
from supplier_sync_dagster.core.accounts import Account, SimulatedSupplier
from supplier_sync_dagster.core.errors import ConfigError, SyncInterrupted
from supplier_sync_dagster.core.health import alerts
from supplier_sync_dagster.core.leasing.batches import get_task
from supplier_sync_dagster.core.repair.compensation import resolve_synced_cities
from supplier_sync_dagster.core.repair.reconcile import (
    Reconciliation,
    RepullPlan,
    Tolerance,
    plan_repull,
    reconcile,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.sync.replay import (
    dry_run_city,
    latest_raw_batch,
    stored_city_countries,
)
from supplier_sync_dagster.dagster_instance.home import dagster_instance
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE, AccountScope
from supplier_sync_dagster.defs.health import run_alerts
from supplier_sync_dagster.defs.lineage import CommandLineage
from supplier_sync_dagster.defs.reconciliation import RECONCILIATION
from supplier_sync_dagster.defs.resources import (
    PayloadStoreResource,
    SimulatedSupplierResource,
    SupplierResource,
    SyncDatabaseResource,
)


class Summary(Protocol):
    """What a sync's summary offers the terminal (a full, incremental or replay sync's)."""

    def to_json(self) -> str:
        """The summary as one JSON object."""
        ...

    def render(self) -> str:
        """The summary as text."""
        ...

    def problem(self) -> str | None:
        """Why the sync did not complete (None: it did)."""
        ...

    def exit_status(self) -> int:
        """The command's exit status (0: it completed)."""
        ...


log = logging.getLogger(__name__)


def console_log_level(args: argparse.Namespace) -> str:
    """The log level of the in-process Dagster run's console logger."""
    # The summary and one line on stderr say what happened; the in-process run's own
    # log (a step failure's stack trace among it) is for -v.
    return "INFO" if args.verbose else "CRITICAL"


def finish_sync(summary: Summary, *, as_json: bool) -> int:
    """Prints a sync's summary; a sync that did not complete adds one line on stderr.

    Returns:
        The command's exit status (:meth:`Summary.exit_status`).
    """
    print(summary.to_json() if as_json else summary.render())
    problem = summary.problem()
    if problem is None:
        return 0
    warn(problem)
    return summary.exit_status()


def cmd_demo(args: argparse.Namespace) -> int:
    """``demo``: the simulated supplier synced through Dagster, then a second one, into a
    catalog that is empty or that a demo filled before (else one line, exit 2, nothing
    written: :mod:`supplier_sync_dagster.cli.demo_catalogs`)."""
    storage = config.load_storage_settings()
    claim_demo_catalog(args.db_url or storage.sync_db_url(), command="demo")
    day = sync_runner.demo_day(advance=False)
    supplier = SimulatedSupplierResource(
        sim_cities=args.cities,
        sim_hotels=args.hotels,
        sim_profile=args.profile,
        **_demo_tuning(args, day),
    )
    sync_db, payloads = storage_resources(args, storage)
    print(
        f"demo: a full sync through Dagster of the simulated supplier (day {day}, "
        f"{args.cities} cities, {args.hotels} hotels, {args.profile} profile)",
        flush=True,
    )
    lineage = CommandLineage.of(config.load_settings())
    status = finish_sync(
        _full_sync(args, supplier, DEFAULT_SCOPE, sync_db, payloads, lineage=lineage),
        as_json=False,
    )
    if status == 0 and args.second_hotels > 0:
        status = _demo_second_supplier(args, day, sync_db, payloads)
    if status == 0:
        sync_runner.demo_day(advance=True)
        print(
            f"run `supplier-sync demo` again: the suppliers move to day {day + 1} and only "
            "changes publish"
        )
    return status


def _demo_tuning(args: argparse.Namespace, day: int) -> dict[str, Any]:
    """The fields both demo suppliers take from the options: the day, rate and parallelism."""
    return {
        "sim_day": day,
        "rate_limit_rps": args.rate_limit,
        "city_threads": args.city_threads,
        "worker_processes": args.processes,
    }


def _full_sync(
    args: argparse.Namespace,
    supplier: SupplierResource,
    scope: AccountScope,
    sync_db: SyncDatabaseResource,
    payloads: PayloadStoreResource,
    *,
    as_json: bool = False,
    cities: list[str] | None = None,
    trigger_id: str | None = None,
    signals: sync_runner.SignalLog | None = None,
    lineage: CommandLineage | None = None,
) -> sync_runner.SyncSummary:
    """A full sync through Dagster of the supplier's cities (only ``cities``, when given),
    with progress on stderr unless the output is JSON; the cities the supplier dropped
    retire even in a mass drop when ``args`` asks so (``--retire-dropped-cities``); each
    run's OpenLineage events through ``lineage``."""
    return sync_runner.run_full_sync(
        supplier=supplier,
        sync_db=sync_db,
        payloads=payloads,
        trigger_id=trigger_id,
        progress=None if as_json else sys.stderr,
        console_log_level=console_log_level(args),
        cities=cities,
        scope=scope,
        signals=signals,
        retire_dropped=bool(getattr(args, "retire_dropped_cities", False)),
        lineage=lineage,
    )


def _demo_second_supplier(
    args: argparse.Namespace,
    day: int,
    sync_db: SyncDatabaseResource,
    payloads: PayloadStoreResource,
) -> int:
    """The demo's second supplier: its own account (tasks, partitions, assets, rate limit),
    the same catalog in its own mapping namespace."""
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
    settings = config.load_settings()
    supplier = account_supplier_now(settings, scope, **_demo_tuning(args, day))
    status = finish_sync(
        _full_sync(args, supplier, scope, sync_db, payloads, lineage=CommandLineage.of(settings)),
        as_json=False,
    )
    with open_db(sync_db.db_url) as db, db.engine.connect() as conn:
        h = schema.platform_hotel.c
        counts = conn.execute(
            sa.select(h.supplier_id, sa.func.count())
            .group_by(h.supplier_id)
            .order_by(h.supplier_id)
        ).all()
    print(
        "one catalog, a mapping namespace per supplier: "
        + ", ".join(f"supplier {sid}: {n} hotels" for sid, n in counts)
        + " (several suppliers and accounts in one deployment: README, "
        '"Many suppliers, many accounts")'
    )
    return status


def cmd_sync(args: argparse.Namespace) -> int:
    """``sync --full`` or ``sync --incremental`` against the configured supplier."""
    settings = config.load_settings()
    sync_db, payloads = storage_resources(args, settings)
    scope = account_scope(args, settings)
    if args.incremental:
        with sync_runner.SignalLog() as signals:
            try:
                return _sync_incremental(args, settings, sync_db, payloads, scope, signals)
            except (SyncInterrupted, Exception) as err:
                if (reason := _interruption(err, signals)) is None:
                    raise
                # Before its run started, or after it ended.
                warn(f"incremental sync interrupted ({reason}) outside its run")
                return sync_runner.interrupted_status(reason)
    supplier = configured_supplier(
        settings,
        scope=scope,
        rate_limit=args.rate_limit,
        page_size=args.page_size,
        city_threads=args.city_threads,
        worker_processes=first(args.processes, settings.worker_processes),
    )
    trigger_id = args.trigger_id or sync_runner.new_trigger_id()
    with sync_runner.SignalLog() as signals:
        try:
            summary = _full_sync(
                args,
                supplier,
                scope,
                sync_db,
                payloads,
                as_json=args.json,
                trigger_id=trigger_id,
                signals=signals,
                lineage=CommandLineage.of(settings),
            )
        except (SyncInterrupted, Exception) as err:
            if (reason := _interruption(err, signals)) is None:
                raise
            # Before its run started, or after it ended: no city is in flight.
            resume = sync_runner.resume_hint(sync_db, supplier.task_code, trigger_id)
            warn(f"sync interrupted ({reason}) outside its run: no city was in flight{resume}")
            return sync_runner.interrupted_status(reason)
    if summary.batch_id and not summary.interrupted:
        _heal_city_tickets(sync_db, supplier)
    status = finish_sync(summary, as_json=args.json)
    if not summary.interrupted:
        _alert_round(summary, sync_db, supplier, scope)
    return status


def _heal_city_tickets(sync_db: SyncDatabaseResource, supplier: SupplierResource) -> None:
    """Resolves the CITY_FAILED tickets of the cities this sync finished (a resume, the next
    night): a ticket for a city that synced is a problem fixed, now, not at the next
    compensation pass. Its own trouble never changes the exit status."""
    try:
        with open_db(sync_db.db_url) as db:
            resolve_synced_cities(
                db, supplier_id=supplier.supplier_id, task_codes=[supplier.task_code]
            )
    except Exception as err:  # the compensation schedule resolves them too
        log.info("resolving the tickets of the cities synced failed: %s", err, exc_info=err)


def _interruption(err: BaseException, signals: sync_runner.SignalLog) -> str | None:
    """The signal that ``err`` comes from (its name), or None when it is a failure of its
    own. An error raised once a signal arrived is the signal's doing: the work it interrupted
    (a database driver, a connection pool) fails its next call with an error of its own."""
    if isinstance(err, SyncInterrupted):
        return err.reason
    return signals.received() or None


def _alert_round(
    summary: sync_runner.SyncSummary,
    sync_db: SyncDatabaseResource,
    supplier: SupplierResource,
    scope: AccountScope,
) -> None:
    """One alert round after a sync that did not complete, or while the task has alerts
    firing (a sync that works again clears them): what the alert sensors do, for a sync run
    from cron or by hand without the daemon. Its own trouble never changes the exit status."""
    try:
        if summary.problem() is None:
            with open_db(sync_db.db_url) as db, db.engine.connect() as conn:
                firing = alerts.list_alerts(conn, db.clock, include_resolved=False)
            if not any(a["task_code"] == supplier.task_code for a in firing):
                return
        with dagster_instance() as instance:
            run_alerts(instance, sync_db, supplier, scope=scope)
    except Exception as err:  # the alert sensor retries; the sync's outcome stands
        log.info("alert round after the sync failed: %s", err, exc_info=err)


def _sync_incremental(
    args: argparse.Namespace,
    settings: config.Settings,
    sync_db: SyncDatabaseResource,
    payloads: PayloadStoreResource,
    scope: AccountScope,
    signals: sync_runner.SignalLog | None = None,
) -> int:
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
    summary = sync_runner.run_incremental_sync(
        supplier=configured_supplier(
            settings, scope=scope, rate_limit=args.rate_limit, page_size=args.page_size
        ),
        scope=scope,
        sync_db=sync_db,
        payloads=payloads,
        config=config,
        trigger_id=args.trigger_id,
        console_log_level=console_log_level(args),
        signals=signals,
        lineage=CommandLineage.of(settings),
    )
    return finish_sync(summary, as_json=args.json)


def cmd_reconcile(args: argparse.Namespace) -> int:
    """``reconcile``: each city's supplier summary against the catalog; a re-pull of the
    cities that differ (unless ``--no-repull``). A city that differs only by hotels with open
    dead-letter tickets waits on them and is not re-pulled (the rule of
    :func:`~supplier_sync_dagster.core.repair.reconcile.plan_repull`, the asset's too); a
    ``--city`` the supplier does not know is an error (exit 2)."""
    settings = config.load_settings()
    sync_db, payloads = storage_resources(args, settings)
    scope = account_scope(args, settings)
    supplier = configured_supplier(settings, scope=scope)
    tolerance = Tolerance(args.absolute, args.relative, args.max_lag_hours * 3600)
    lineage = CommandLineage.of(settings)
    compared = lineage.command_run([scope.key(RECONCILIATION.path[-1])], sync_db, scope.tags)
    with compared as run, open_db(sync_db.db_url) as db, supplier.client() as client:
        report = reconcile(
            db,
            client,
            supplier_id=supplier.supplier_id,
            cities=args.city,
            tolerance=tolerance,
            store=payloads.open(),
            task_code=supplier.task_code,
            walk=supplier.walk_limits(),
        )
        if report.failed:
            run.error = (
                f"{len(report.failed)} cities could not be compared ({report.failed[0].error})"
            )
    plan = plan_repull(report, repull=not args.no_repull)
    if args.json:
        for c in report.cities:
            print(json.dumps(c.row(), ensure_ascii=False))
    else:
        _print_reconciliation(report, plan)
    status = 0
    if plan.repull:
        repull = functools.partial(_full_sync, args, supplier, scope, sync_db, payloads)
        summary = repull(as_json=args.json, cities=plan.repull, lineage=lineage)
        problem = summary.problem()
        message = (
            f"re-pulled {summary.cities_done} of {len(plan.repull)} cities in batch "
            f"{summary.batch_id}: {summary.published} published"
        )
        print(json.dumps({"repull": dataclasses.asdict(summary)}) if args.json else message)
        if problem is not None:
            warn(problem)
            status = 1
    if run.error and status == 0:
        warn(run.error)
        status = 1
    return status


def _print_reconciliation(report: Reconciliation, plan: RepullPlan) -> None:
    """A line per city that differs, waits on tickets or was not compared; a summary."""
    for c in report.differing + report.failed:
        print(f"{c.city_code!r}: {'; '.join(c.reasons) or c.error}")
    for c in report.waiting:
        print(
            f"{c.city_code!r}: waiting on the open dead letters of {len(c.tickets)} hotel(s), "
            f"not re-pulled ({'; '.join(c.explained)})"
        )
    print(
        f"{len(report.cities)} cities compared in {report.seconds:.1f} s "
        f"({report.requests} requests): {len(report.differing)} differ, "
        f"{len(plan.waiting)} waiting on open dead letters ({plan.hotels_waiting} hotels), "
        f"{len(report.failed)} not compared"
    )


def cmd_replay(args: argparse.Namespace) -> int:
    """``replay``: cities normalized, checked, diffed and published again from their stored
    raw pages (``--dry-run``: their diffs reported, nothing published)."""
    scope = DEFAULT_SCOPE
    task_code = args.task or config.DEFAULT_TASK_CODE
    if args.account is not None:
        scope = account_scope(args, config.load_settings())
        if args.task is not None and args.task != scope.full_task_code:
            raise ConfigError(
                f"--task {args.task} is not account {scope.code}'s full-sync task "
                f"({scope.full_task_code}): give one of them"
            )
        task_code = scope.full_task_code
    sync_db, payloads = storage_resources(args, config.load_storage_settings())
    with open_db(sync_db.db_url) as db:
        # A replay reads stored pages only: it needs the task and its supplier, no URL.
        with db.engine.connect() as conn:
            task = get_task(conn, task_code)
        cities = list(dict.fromkeys(args.city))
        missing = [
            c for c in cities if latest_raw_batch(db, task_code=task.task_code, city_code=c) is None
        ]
        for city in missing:
            warn(
                f"city {city!r} has no stored raw pages for task {task.task_code!r}: "
                "nothing to replay"
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
                    max_clock_skew_seconds=sync_db.max_clock_skew_seconds,
                )
                if args.json:
                    print(json.dumps(report.to_json(), default=str, ensure_ascii=False))
                else:
                    print("\n".join(report.to_text()))
            if not args.json:
                print("dry run: nothing was written (replay without --dry-run to publish)")
            return 1 if missing else 0
    try:
        lineage: CommandLineage | None = CommandLineage.of(config.load_settings())
    except ConfigError as err:
        warn(f"this replay sends no OpenLineage events: {err}")
        lineage = None
    summary = sync_runner.run_replay(
        # A replay never calls the supplier: the simulator stands in, never started.
        supplier=SimulatedSupplierResource(
            task_code=task.task_code,
            supplier_id=task.supplier_id,
            account=None if scope.account is None else scope.account.code,
        ),
        console_log_level=console_log_level(args),
        cities=cities,
        sync_db=sync_db,
        payloads=payloads,
        trigger_id=args.trigger_id,
        scope=scope,
        lineage=lineage,
    )
    status = finish_sync(summary, as_json=args.json)
    return status or (1 if missing else 0)
