"""Task settings: created once by a run, changed only by an operator, every change audited.

A run needs its task to exist, so it creates a missing one with the defaults
(:func:`ensure_task`, insert if absent) and never changes an existing one: a run must not
undo what an operator set (a CANCEL_PREVIOUS policy, a DISABLED status). Settings change
through :func:`change_task` (``supplier-sync task set``), which writes one audit row per
changed field, with who and why, in the transaction that changes it. A DISABLED task
refuses runs (:func:`require_enabled`) with the reason the operator gave. A run starts with
both (:func:`open_task`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import ConfigError, InvalidTransition, TaskDisabled
from supplier_sync_dagster.core.inputs.cron import check_cron
from supplier_sync_dagster.core.inputs.text import printable
from supplier_sync_dagster.core.leasing.batches import (
    ConcurrencyPolicy,
    TaskSpec,
    TaskStatus,
    get_task,
)
from supplier_sync_dagster.core.records.gates import (
    GateThresholds,
    get_gate_thresholds,
    set_gate_thresholds,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import (
    IDENTITY_COLUMNS,
    Identity,
    process_identity,
    record_actions,
    require_who_and_why,
)
from supplier_sync_dagster.core.store.db import DbClock, SyncDatabase, guarded_update, insert_ignore

MAX_BY_LEN = 64
MAX_REASON_LEN = 1024
CREATED_FIELD = "task"


@dataclass(frozen=True)
class AuditEntry:
    """One changed field of a task (a row of ``supplier_sync_task_audit``)."""

    task_code: str
    field_name: str
    old_value: str | None
    new_value: str | None
    changed_by: str
    reason: str
    created_at: datetime | None = None
    identity: Identity | None = None


def ensure_task(
    db: SyncDatabase,
    spec: TaskSpec,
    *,
    created_by: str,
    reason: str,
    by_operator: bool = False,
) -> TaskSpec:
    """The task as stored; created from ``spec`` (and audited) only if it does not exist.

    An existing task is returned as it is: its policy, status, cron and thresholds are the
    operator's, whatever ``spec`` says.

    Args:
        db: The sync database.
        spec: The task with the settings it is created with.
        created_by: Who creates it (a run's trigger, or an operator).
        reason: Why.
        by_operator: An operator creates it (``accounts apply``): the creation is also an
            action of the audit trail (``task.create``), as every operator action is; a run
            creating its own task records it in the task's change log only.
    """
    with db.engine.connect() as conn:
        existing = _find_task(conn, spec.task_code)
    if existing is not None:
        return existing
    values = {f.name: getattr(spec, f.name) for f in fields(spec)}
    with db.begin() as conn:
        insert_ignore(
            conn, schema.task, [values], created_at=db.clock.now(), updated_at=db.clock.now()
        )
        # Concurrent first runs serialize on the row lock: one of them records the creation.
        stored = get_task(conn, spec.task_code, for_update=True)
        a = schema.task_audit.c
        recorded = conn.execute(
            sa.select(a.id)
            .where(a.task_code == spec.task_code, a.field_name == CREATED_FIELD)
            .limit(1)
        ).first()
        if recorded is None:
            _audit(
                conn,
                db.clock,
                AuditEntry(
                    spec.task_code,
                    CREATED_FIELD,
                    None,
                    _describe(stored),
                    created_by,
                    reason,
                ),
                by_operator=by_operator,
            )
    return stored


def require_enabled(conn: Connection, task_code: str) -> None:
    """Refuses a run of a DISABLED task, with who disabled it and why; a missing task passes.

    Raises:
        TaskDisabled: The task is DISABLED.
    """
    task = _find_task(conn, task_code)
    if task is None or task.status == "ENABLED":
        return
    a = schema.task_audit.c
    last = conn.execute(
        sa.select(a.changed_by, a.reason, a.created_at)
        .where(a.task_code == task_code, a.field_name == "status")
        .order_by(a.id.desc())
        .limit(1)
    ).first()
    why = (
        printable(f" by {last.changed_by} at {last.created_at:%Y-%m-%d %H:%M:%S}: {last.reason}")
        if last
        else ""
    )
    raise TaskDisabled(
        f"task {task_code!r} is DISABLED{why}; enable it with `supplier-sync task set "
        f"--task {task_code} --status ENABLED --by WHO --reason WHY`"
    )


def open_task(db: SyncDatabase, spec: TaskSpec, *, trigger_id: str, run: str) -> None:
    """What every run of a task does first: creates the task if it is missing
    (:func:`ensure_task`), then refuses to go on if it is DISABLED (:func:`require_enabled`).

    Args:
        db: The sync database.
        spec: The task with the defaults it is created with.
        trigger_id: The run's trigger (the creator recorded in the task's audit).
        run: What kind of run creates it (``"incremental run"``), for the audit's reason.

    Raises:
        TaskDisabled: The task is DISABLED.
    """
    ensure_task(
        db,
        spec,
        created_by=f"run {trigger_id}"[:64],
        reason=f"created by its first {run}, with the default settings",
    )
    with db.engine.connect() as conn:
        require_enabled(conn, spec.task_code)


def change_task(
    db: SyncDatabase,
    task_code: str,
    *,
    changed_by: str,
    reason: str,
    policy: ConcurrencyPolicy | None = None,
    status: TaskStatus | None = None,
    cron: str | None = None,
    thresholds: Mapping[str, Any] | None = None,
    identity: Identity | None = None,
) -> list[AuditEntry]:
    """Changes a task's settings in one transaction, one audit row per field that changed.

    Args:
        db: The sync database.
        task_code: The task.
        changed_by: Who changes it (recorded).
        reason: Why (recorded).
        policy: SKIP_IF_RUNNING, CANCEL_PREVIOUS or ALLOW_PARALLEL.
        status: ENABLED or DISABLED.
        cron: A cron expression (the task becomes CRON-scheduled), or ``"none"`` to clear it
            (MANUAL).
        thresholds: Gate thresholds to change (``GateThresholds`` fields); the others keep
            their stored values.
        identity: Who changes it, as the acting process proves it; None: this process's.

    Returns:
        The changes made; empty when every value given was already the task's.

    Raises:
        ConfigError: Nothing to change, a value is malformed, or who/why is missing.
        UnknownTask: No task has this code (a task is created by its first run).
    """
    by, why = changed_by.strip(), reason.strip()
    if not by or len(by) > MAX_BY_LEN:
        raise ConfigError(f"who changes the task (--by) must be 1-{MAX_BY_LEN} characters")
    if not why or len(why) > MAX_REASON_LEN:
        raise ConfigError(f"why the task changes (--reason) must be 1-{MAX_REASON_LEN} characters")
    require_who_and_why(by, why)
    if policy is None and status is None and cron is None and not thresholds:
        raise ConfigError("nothing to change: give --policy, --status, --cron or a gate threshold")
    cron_expr = _check_cron(cron) if cron is not None else None
    with db.begin() as conn:
        current = get_task(conn, task_code, for_update=True)
        updates: dict[str, Any] = {}
        if policy is not None:
            updates["concurrency_policy"] = policy
        if status is not None:
            updates["status"] = status
        if cron is not None:
            updates["cron_expr"] = cron_expr
            updates["schedule_type"] = "CRON" if cron_expr else "MANUAL"
        # TaskSpec validates every value (policy, status, cron with schedule type).
        wanted = TaskSpec(
            **{**{f.name: getattr(current, f.name) for f in fields(current)}, **updates}
        )
        entries = [
            AuditEntry(task_code, name, _text(getattr(current, name)), _text(value), by, why)
            for name, value in updates.items()
            if getattr(current, name) != getattr(wanted, name)
        ]
        if entries:
            guarded_update(
                conn,
                sa.update(schema.task)
                .where(schema.task.c.task_code == task_code, schema.task.c.status == current.status)
                .values(
                    **{e.field_name: getattr(wanted, e.field_name) for e in entries},
                    updated_at=db.clock.now(),
                ),
                lambda: InvalidTransition(f"task {task_code!r} changed while locked"),
            )
        if thresholds:
            old = get_gate_thresholds(conn, task_code)
            new = GateThresholds.from_dict({**old.to_dict(), **thresholds})
            moved = [
                AuditEntry(task_code, f"gate.{k}", _text(old.to_dict()[k]), _text(v), by, why)
                for k, v in new.to_dict().items()
                if old.to_dict()[k] != v
            ]
            if moved:
                set_gate_thresholds(
                    conn, db.clock, task_code=task_code, thresholds=new, updated_by=by
                )
                entries += moved
        for entry in entries:
            _audit(conn, db.clock, entry, identity=identity)
    return entries


def task_audit(conn: Connection, task_code: str, *, limit: int = 20) -> list[AuditEntry]:
    """A task's most recent audit rows, newest first."""
    a = schema.task_audit.c
    rows = conn.execute(
        sa.select(
            a.task_code,
            a.field_name,
            a.old_value,
            a.new_value,
            a.changed_by,
            a.reason,
            a.created_at,
            *(a[name] for name in IDENTITY_COLUMNS),
        )
        .where(a.task_code == task_code)
        .order_by(a.id.desc())
        .limit(limit)
    )
    return [
        AuditEntry(
            **{k: v for k, v in row._mapping.items() if k not in IDENTITY_COLUMNS},
            identity=Identity.of_row(row._mapping),
        )
        for row in rows
    ]


def _find_task(conn: Connection, task_code: str) -> TaskSpec | None:
    row = conn.execute(
        sa.select(*(schema.task.c[f.name] for f in fields(TaskSpec))).where(
            schema.task.c.task_code == task_code
        )
    ).first()
    return TaskSpec(**row._mapping) if row is not None else None


def _audit(
    conn: Connection,
    clock: DbClock,
    entry: AuditEntry,
    *,
    by_operator: bool = True,
    identity: Identity | None = None,
) -> None:
    """One row of the task's change log and, for an operator's change, of the audit trail;
    ``identity`` None: this process's."""
    proven = identity or process_identity()
    conn.execute(
        sa.insert(schema.task_audit).values(
            task_code=entry.task_code,
            field_name=entry.field_name[:64],
            old_value=entry.old_value[:1024] if entry.old_value is not None else None,
            new_value=entry.new_value[:1024] if entry.new_value is not None else None,
            changed_by=entry.changed_by[:MAX_BY_LEN],
            reason=entry.reason[:MAX_REASON_LEN],
            created_at=clock.now(),
            **proven.columns(),
        )
    )
    created = entry.field_name == CREATED_FIELD
    if by_operator:  # a task created by its first run is no operator action
        record_actions(
            conn,
            clock,
            action="task.create" if created else "task.set",
            target_type="task",
            changes=[
                (
                    entry.task_code,
                    None if created else {entry.field_name: entry.old_value},
                    json.loads(entry.new_value or "null")
                    if created
                    else {entry.field_name: entry.new_value},
                )
            ],
            actor=entry.changed_by[:MAX_BY_LEN],
            reason=entry.reason[:MAX_REASON_LEN],
            identity=proven,
        )


def _describe(task: TaskSpec) -> str:
    return json.dumps({f.name: getattr(task, f.name) for f in fields(task)}, sort_keys=True)


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _check_cron(text: str) -> str | None:
    """A cron expression (:func:`check_cron`); ``none`` (or nothing) clears the cron."""
    if text.strip().lower() in ("", "none"):
        return None
    return check_cron(text, what="--cron")
