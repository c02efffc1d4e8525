"""What ``review``, ``gate`` and ``task`` do: diffs held for review, batch quality gates and
a sync task's settings, each decision recorded with who and why. Their arguments:
:mod:`supplier_sync_dagster.cli.parsers.governance`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from sqlalchemy.engine import Connection

from supplier_sync_dagster.cli.common import dumps, open_db
from supplier_sync_dagster.core.errors import ConfigError, ProfileMissing
from supplier_sync_dagster.core.inputs.text import printable
from supplier_sync_dagster.core.leasing.batches import get_batch, get_task
from supplier_sync_dagster.core.leasing.leases import get_shard
from supplier_sync_dagster.core.records.gates import (
    CHECK_NAMES,
    GateCheck,
    GateResult,
    GateThresholds,
    evaluate_gates,
    gated_checks,
    get_gate_thresholds,
    list_overrides,
    override_gate_check,
)
from supplier_sync_dagster.core.records.review import (
    approve_reviews,
    count_reviews,
    list_reviews,
    reject_reviews,
)
from supplier_sync_dagster.core.store.audit import describe_identity, require_who_and_why
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.tasks import change_task, task_audit


def threshold_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The gate thresholds given on the command line, by field name."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(GateThresholds)}
    return {name: value for name, value in given.items() if value is not None}


def cmd_review(args: argparse.Namespace) -> int:
    """``review list|approve|reject``."""
    with open_db(args.db_url) as db:
        if args.review_command == "list":
            _list_reviews(db, args)
            return 0
        ids = None if args.all else list(args.ids)
        if ids is not None and not ids:
            raise ConfigError("name the reviews to decide, or pass --all")
        decide = approve_reviews if args.review_command == "approve" else reject_reviews
        decision = decide(db, review_ids=ids, who=args.by, reason=args.reason, batch_id=args.batch)
        print(json.dumps(decision.__dict__))
        return 0


def _list_reviews(db: SyncDatabase, args: argparse.Namespace) -> None:
    status = None if args.status == "ALL" else args.status
    with db.engine.connect() as conn:
        reviews = list_reviews(conn, status=status, batch_id=args.batch, limit=args.limit)
        counts = count_reviews(conn, batch_id=args.batch)
    for rv in reviews:
        if args.json:
            print(json.dumps(rv.__dict__, default=str, ensure_ascii=False))
            continue
        fields = ", ".join(f"{c['field']}: {c['old']} -> {c['new']}" for c in rv.changed_fields[:4])
        print(
            f"{rv.review_id}  {rv.status:<10} {rv.supplier_hotel_id} v{rv.supplier_version}"
            f"  {rv.diff_type}  {fields}"
        )
    print(f"reviews by status: {counts}", file=sys.stderr)


def cmd_gate(args: argparse.Namespace) -> int:
    """``gate show|override|thresholds``."""
    with open_db(args.db_url) as db:
        if args.gate_command == "override":
            done = override_gate_check(
                db, GateCheck(args.batch, args.city, args.check), who=args.by, reason=args.reason
            )
            print(json.dumps(done.__dict__, default=str, ensure_ascii=False))
            print("re-run the city (the same launch) to publish it", file=sys.stderr)
            return 0
        if args.gate_command == "show":
            _show_gates(db, args.batch, args.city)
            return 0
        _set_thresholds(db, args)
        with db.engine.connect() as conn:
            print(json.dumps(get_gate_thresholds(conn, args.task).to_dict()))
        return 0


def _set_thresholds(db: SyncDatabase, args: argparse.Namespace) -> None:
    """The thresholds given on the command line set on the task as ``task set`` sets them:
    with who and why, one audit row per changed value; none given: nothing to do.

    Raises:
        ConfigError: A threshold is given without ``--by`` and ``--reason``, or is malformed.
        UnknownTask: No task has this code.
    """
    changes = threshold_changes(args)
    if not changes:
        return
    who, why = require_who_and_why(args.by, args.reason)
    moved = change_task(db, args.task, changed_by=who, reason=why, thresholds=changes)
    for c in moved:
        print(f"{c.field_name}: {c.old_value} -> {c.new_value} (audited)", file=sys.stderr)
    if not moved:
        print("no change: the task already has these thresholds", file=sys.stderr)


def _show_gates(db: SyncDatabase, batch_id: str, city: str) -> None:
    with db.engine.connect() as conn:
        task = get_batch(conn, batch_id).task_code
        try:
            results = evaluate_gates(
                conn,
                batch_id=batch_id,
                task_code=task,
                shard_key=city,
                thresholds=get_gate_thresholds(conn, task),
            )
        except ProfileMissing:
            results = _stopped_early(db, conn, batch_id, city)
    for r in results:
        state = "overridden" if r.overridden else ("passed" if r.passed else "FAILED")
        print(f"{r.check_name:<18} {state:<10} {r.description}")
        print(f"    {json.dumps(r.metadata, default=str, ensure_ascii=False)}")


def _stopped_early(
    db: SyncDatabase, conn: Connection, batch_id: str, city: str
) -> list[GateResult]:
    """The checks that stopped a city on its first pages, before it had a full profile.

    Raises:
        ProfileMissing: The city was not stopped by a gate (it is not normalized yet).
    """
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


def cmd_task(args: argparse.Namespace) -> int:
    """``task show|set``."""
    with open_db(args.db_url) as db:
        if args.task_command == "set":
            changes = change_task(
                db,
                args.task,
                changed_by=args.by,
                reason=args.reason,
                policy=args.policy,
                status=args.status,
                cron=args.cron,
                thresholds=threshold_changes(args),
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
            dumps(
                {
                    "task": dataclasses.asdict(task),
                    "gate_thresholds": thresholds_now.to_dict(),
                    "audit": [dataclasses.asdict(a) for a in audit],
                }
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
        # Rows stored before control characters were refused are escaped, not obeyed.
        print(
            printable(
                f"  {a.created_at:%Y-%m-%d %H:%M:%S}  {a.changed_by} "
                f"[{describe_identity(a.identity)}]  {a.field_name}: "
                f"{a.old_value} -> {a.new_value}  ({a.reason})"
            )
        )
    return 0
