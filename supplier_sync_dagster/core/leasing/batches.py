"""Tasks and batches: what to sync, and one execution of it per trigger.

A trigger (schedule, UI launch or backfill, sensor, compensation) never starts work
directly. It asks :func:`create_batch`, which is idempotent per ``(task_code, trigger_id)``
and applies the task's concurrency policy against the task's unfinished batches. Workers
then claim the batch's shards (:mod:`supplier_sync_dagster.core.leasing.leases`); the batch's status,
counts and progress are derived from its shards by :func:`refresh_batch`. A shard's finish
in a large batch counts itself instead (:func:`count_finish`) while its batch's totals are
recent and it cannot be the last.

An unfinished batch is *live* (it counts as running) only while someone provably works on
it (:func:`batch_liveness`): one of its shards holds an unexpired lease whose holder is not
a dead process of this host, or it was created or adopted less than one lease period ago
by a process that is not dead on this host (the creator's grace: the time a run takes to
start and claim its first city). An unfinished batch that is not live is *abandoned*: its
workers were killed. Under SKIP_IF_RUNNING a new trigger is skipped for a live batch and
**adopts** an abandoned one (outcome ADOPTED): it continues that batch from its shards'
checkpoints instead of waiting forever for a batch nobody will finish.

Batch state machine (every move is one guarded UPDATE)::

    PENDING ──first shard claimed──> RUNNING ──all shards finished──> SUCCESS
       │                                │   <──a failed shard reopened──  PARTIAL_FAILED
       ├──────────── cancel ────────────┴──> CANCELLED                    FAILED
       └── the run could not start (the supplier refused the key, or is unreachable) ──> FAILED

A run that stops (interrupted, or failed) ends its creator's grace (:func:`end_grace`):
the next trigger adopts the batch at once instead of one lease period later.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from decimal import Decimal
from typing import Any, Literal, get_args

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import (
    ConfigError,
    InvalidTransition,
    TaskDisabled,
    TriggerSkipped,
    UnknownBatch,
    UnknownTask,
)
from supplier_sync_dagster.core.leasing.processes import (
    DEFAULT_LEASE_SECONDS,
    MAX_WORKER_ID_LEN,
    holder_is_dead_here,
    make_worker_id,
)
from supplier_sync_dagster.core.leasing.shards import move_shards
from supplier_sync_dagster.core.redaction import bounded
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import DbClock, SyncDatabase, guarded_update, insert_ignore
from supplier_sync_dagster.core.store.engine import db_now

TaskStatus = Literal["ENABLED", "DISABLED"]
ConcurrencyPolicy = Literal["SKIP_IF_RUNNING", "CANCEL_PREVIOUS", "ALLOW_PARALLEL"]
SyncMode = Literal["FULL", "INCREMENTAL", "PUSH", "REFRESH"]
DataScope = Literal["RESOURCE", "PRODUCT", "OFFER", "STOCK_PRICE"]
ScheduleType = Literal["CRON", "MANUAL", "PUSH"]
TriggerSource = Literal["CRON", "MANUAL", "COMPENSATION", "SENSOR", "BACKFILL"]
BatchStatus = Literal["PENDING", "RUNNING", "SUCCESS", "PARTIAL_FAILED", "FAILED", "CANCELLED"]
DecisionOutcome = Literal["CREATED", "EXISTING", "SKIPPED", "ADOPTED"]

ACTIVE_BATCH_STATUSES: tuple[BatchStatus, ...] = ("PENDING", "RUNNING")
TERMINAL_BATCH_STATUSES: tuple[BatchStatus, ...] = (
    "SUCCESS",
    "PARTIAL_FAILED",
    "FAILED",
    "CANCELLED",
)
MAX_CODE_LEN = 64
MAX_SHARD_KEY_LEN = 128


def _check_choice(name: str, value: str, allowed: Any) -> None:
    choices = get_args(allowed)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_code(name: str, value: str, max_len: int = MAX_CODE_LEN) -> None:
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise ConfigError(f"{name} must be a string of 1-{max_len} characters; got {value!r}")


# A finish in a batch of more shards than this re-sums them only when the batch's totals are
# older than RETOTAL_SECONDS or the finish may be its last: summing every shard at every
# finish, under the batch's lock, costs a batch of many cities quadratic time.
EXACT_TOTALS_SHARDS = 500
RETOTAL_SECONDS = 2.0

# The fields of a task that say what it syncs.
_TASK_SCOPE = ("supplier_id", "category_code", "sync_mode", "data_scope")


@dataclass(frozen=True)
class TaskSpec:
    """A sync task definition (a row of ``supplier_sync_task``)."""

    task_code: str
    supplier_id: int
    category_code: str = "HOTEL"
    sync_mode: SyncMode = "FULL"
    data_scope: DataScope = "RESOURCE"
    schedule_type: ScheduleType = "MANUAL"
    cron_expr: str | None = None
    status: TaskStatus = "ENABLED"
    concurrency_policy: ConcurrencyPolicy = "SKIP_IF_RUNNING"
    owner_team: str | None = None

    def __post_init__(self) -> None:
        _check_code("task_code", self.task_code)
        _check_code("category_code", self.category_code, 32)
        if not isinstance(self.supplier_id, int) or self.supplier_id <= 0:
            raise ConfigError(f"supplier_id must be a positive integer; got {self.supplier_id!r}")
        _check_choice("sync_mode", self.sync_mode, SyncMode)
        _check_choice("data_scope", self.data_scope, DataScope)
        _check_choice("schedule_type", self.schedule_type, ScheduleType)
        _check_choice("status", self.status, TaskStatus)
        _check_choice("concurrency_policy", self.concurrency_policy, ConcurrencyPolicy)
        if self.schedule_type == "CRON" and not self.cron_expr:
            raise ConfigError(f"task {self.task_code!r}: schedule_type CRON needs a cron_expr")

    def scope(self) -> dict[str, Any]:
        """What the task syncs, as each of its batches copies it into its own row."""
        return {name: getattr(self, name) for name in _TASK_SCOPE}


@dataclass(frozen=True)
class Batch:
    """A batch as stored; counts and progress are derived from its shards."""

    batch_id: str
    task_code: str
    trigger_source: str
    trigger_id: str | None
    supplier_id: int
    category_code: str
    sync_mode: str
    data_scope: str
    city_scope: tuple[str, ...] | None
    status: BatchStatus
    sync_batch_version: int
    shard_count: int
    shards_done: int
    pages_done: int
    fetched_count: int
    total_count: int
    success_count: int
    failed_count: int
    skipped_count: int
    current_city_code: str | None
    current_page: int | None
    progress_percent: Decimal
    heartbeat_at: datetime | None
    last_checkpoint_at: datetime | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error_message: str | None

    @classmethod
    def from_row(cls, row: sa.Row[Any]) -> Batch:
        """Builds a Batch from a ``supplier_sync_batch`` row."""
        data = row._mapping
        values = {f.name: data[f.name] for f in fields(cls) if f.name != "city_scope"}
        scope = data["city_scope"]
        return cls(city_scope=tuple(json.loads(scope)) if scope is not None else None, **values)

    @property
    def is_terminal(self) -> bool:
        """True once the batch can no longer change status."""
        return self.status in TERMINAL_BATCH_STATUSES


@dataclass(frozen=True)
class BatchDecision:
    """What :func:`create_batch` decided for one trigger.

    Outcomes: CREATED (a new batch), ADOPTED (this trigger continues an abandoned batch of
    another trigger), EXISTING (this trigger asked before: its batch, created or adopted),
    SKIPPED (a live batch blocks it; ``batch`` is None).
    """

    outcome: DecisionOutcome
    batch: Batch | None
    reason: str
    blocking_batch_id: str | None = None
    cancelled_batch_ids: tuple[str, ...] = ()


def upsert_task(db: SyncDatabase, spec: TaskSpec) -> None:
    """Creates the task, or updates its definition if ``task_code`` exists."""
    now = db.clock.now()
    values = {f.name: getattr(spec, f.name) for f in fields(spec)}
    with db.begin() as conn:
        updated = conn.execute(
            sa.update(schema.task)
            .where(schema.task.c.task_code == spec.task_code)
            .values(**values, updated_at=now)
        ).rowcount
        if not updated:
            insert_ignore(conn, schema.task, [values], created_at=now, updated_at=now)


def get_task(conn: Connection, task_code: str, *, for_update: bool = False) -> TaskSpec:
    """Reads a task definition.

    Raises:
        UnknownTask: No task has this code.
    """
    stmt = sa.select(*(schema.task.c[f.name] for f in fields(TaskSpec))).where(
        schema.task.c.task_code == task_code
    )
    row = conn.execute(stmt.with_for_update() if for_update else stmt).first()
    if row is None:
        raise UnknownTask(f"unknown task {task_code!r}: no supplier_sync_task row has this code")
    return TaskSpec(**row._mapping)


def set_task_status(db: SyncDatabase, task_code: str, status: TaskStatus) -> None:
    """Enables or disables a task.

    Raises:
        ConfigError: ``status`` is not ENABLED or DISABLED.
        UnknownTask: No task has this code.
    """
    _check_choice("status", status, TaskStatus)
    with db.begin() as conn:
        guarded_update(
            conn,
            sa.update(schema.task)
            .where(schema.task.c.task_code == task_code)
            .values(status=status, updated_at=db.clock.now()),
            lambda: UnknownTask(f"unknown task {task_code!r}"),
        )


def create_batch(
    db: SyncDatabase,
    *,
    task_code: str,
    trigger_id: str,
    trigger_source: TriggerSource,
    shard_keys: Sequence[str] | None = None,
    worker_id: str | None = None,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    adopt: bool = True,
) -> BatchDecision:
    """Creates the batch for one trigger, idempotently, under the task's concurrency policy.

    The same ``(task_code, trigger_id)`` always gets the same answer: the batch created or
    adopted the first time (outcome EXISTING), or the recorded skip. Concurrent callers are
    serialized on the task row, so a policy decision never races another.

    SKIP_IF_RUNNING skips the trigger while an unfinished batch of the task is live
    (:func:`batch_liveness`); when every unfinished batch is abandoned, the trigger adopts
    the newest one: the batch gets this trigger's shards, and its creator's grace passes to
    ``worker_id``. CANCEL_PREVIOUS cancels every unfinished batch, live or abandoned;
    ALLOW_PARALLEL skips while a live batch of an overlapping scope runs (an abandoned one
    does not block it).

    Args:
        db: The sync database.
        task_code: The task to run.
        trigger_id: The caller's idempotency key (a Dagster backfill or run id, a schedule's
            fire time, an operator's request id).
        trigger_source: Where the trigger came from.
        shard_keys: The cities this batch covers; a shard is created for each. None means
            every city of the supplier (shards are added as work is discovered).
        worker_id: The calling process (:func:`make_worker_id`, the default): it holds the
            creator's grace of a batch it creates or adopts.
        lease_seconds: The grace: how long a new or adopted batch counts as running while
            its creator lives and no shard lease shows work yet (one lease period).
        adopt: False for a batch of its own kind (a replay), which must not continue
            another batch: abandoned batches then neither block it nor get adopted.

    Returns:
        The decision; ``batch`` is None only when the trigger was SKIPPED.

    Raises:
        UnknownTask: The task does not exist.
        TaskDisabled: The task is DISABLED.
        ConfigError: A trigger field or shard key is malformed.
    """
    _check_code("trigger_id", trigger_id)
    _check_choice("trigger_source", trigger_source, TriggerSource)
    keys = _validate_shard_keys(shard_keys) if shard_keys is not None else None
    creator = worker_id or make_worker_id()
    _check_code("worker_id", creator, MAX_WORKER_ID_LEN)
    if not 0 < lease_seconds <= 86_400:
        raise ConfigError(f"lease_seconds must be in (0, 86400]; got {lease_seconds!r}")
    trigger = _Trigger(task_code, trigger_id, trigger_source, keys, creator, lease_seconds)
    clock = db.clock
    with db.begin() as conn:
        task = get_task(conn, task_code, for_update=True)
        recorded = _recorded_decision(conn, trigger)
        if recorded is not None:
            return recorded
        if task.status != "ENABLED":
            raise TaskDisabled(f"task {task_code!r} is DISABLED; enable it to create batches")
        blocked = _blocking_decision(conn, clock, task, trigger, adopt=adopt)
        if blocked is not None:
            return blocked
        cancelled: tuple[str, ...] = ()
        if task.concurrency_policy == "CANCEL_PREVIOUS":
            active = _active_batches(conn, schema.batch.c.task_code == task.task_code)
            cancelled = tuple(b.batch_id for b in active)
            for old in cancelled:
                _cancel(conn, clock, old, f"cancelled by trigger {trigger_id} (CANCEL_PREVIOUS)")
        batch = _insert_batch(conn, clock, task, trigger)
    reason = "batch created" + (f"; cancelled {', '.join(cancelled)}" if cancelled else "")
    return BatchDecision("CREATED", batch, reason, cancelled_batch_ids=cancelled)


def start_batch(
    db: SyncDatabase, decision: BatchDecision, shard_keys: Sequence[str], *, skipped: str
) -> Batch:
    """The batch of a :func:`create_batch` decision, for a run that works it now: a skip
    raises, and the batch gets ``shard_keys`` (:func:`add_shards`, idempotent: a batch this
    trigger created before, or adopted, may have them already).

    Args:
        db: The sync database.
        decision: What :func:`create_batch` decided for the run's trigger.
        shard_keys: The shards the run works.
        skipped: What the skip's message starts with (``"compensation skipped"``).

    Returns:
        The batch as it stands with its shards.

    Raises:
        TriggerSkipped: The task's policy skipped the trigger (with the blocking batch).
        InvalidTransition: The batch is cancelled.
        ConfigError: A shard key is malformed.
    """
    if decision.batch is None:
        raise TriggerSkipped(
            f"{skipped}: {decision.reason}", blocking_batch_id=decision.blocking_batch_id
        )
    batch_id = decision.batch.batch_id
    add_shards(db, batch_id, shard_keys)
    with db.engine.connect() as conn:
        return get_batch(conn, batch_id)


@dataclass(frozen=True)
class _Trigger:
    """One checked request of :func:`create_batch`: what its decision and its log row name."""

    task_code: str
    trigger_id: str
    source: str
    keys: tuple[str, ...] | None
    creator: str
    lease_seconds: float


def _recorded_decision(conn: Connection, trigger: _Trigger) -> BatchDecision | None:
    """The answer this trigger got before (its batch, the batch it adopted, its skip), if any."""
    existing = _batch_by_trigger(conn, trigger.task_code, trigger.trigger_id)
    if existing is not None:
        return BatchDecision("EXISTING", existing, "this trigger already created the batch")
    adopted = _adopted_by_trigger(conn, trigger.task_code, trigger.trigger_id)
    if adopted is not None:
        return BatchDecision("EXISTING", adopted, f"this trigger adopted batch {adopted.batch_id}")
    log = schema.trigger_log.c
    skipped = conn.execute(
        sa.select(log.blocking_batch_id, log.reason).where(
            log.task_code == trigger.task_code,
            log.trigger_id == trigger.trigger_id,
            log.outcome == "SKIPPED",
        )
    ).first()
    if skipped is not None:
        return BatchDecision("SKIPPED", None, skipped.reason, skipped.blocking_batch_id)
    return None


def _blocking_decision(
    conn: Connection, clock: DbClock, task: TaskSpec, trigger: _Trigger, *, adopt: bool
) -> BatchDecision | None:
    """What the task's policy makes of the unfinished batches, unless a new batch may start.

    SKIP_IF_RUNNING: skipped for a live batch, else the newest abandoned one adopted (when
    ``adopt``). ALLOW_PARALLEL: skipped for a live batch whose scope overlaps.
    """
    if task.concurrency_policy == "SKIP_IF_RUNNING":
        active = _active_batches(conn, schema.batch.c.task_code == task.task_code)
        if not active:
            return None
        states = [(b, batch_liveness(conn, clock, b.batch_id)) for b in active]
        for candidate, state in states:
            if state.live:
                reason = (
                    f"SKIP_IF_RUNNING: batch {candidate.batch_id} is {candidate.status} "
                    f"({state.reason})"
                )
                return _skip(conn, clock, trigger, candidate.batch_id, reason)
        # Every unfinished batch is abandoned: continue the newest one.
        newest, state = states[0]
        return _adopt(conn, clock, newest, trigger, why=state.reason) if adopt else None
    if task.concurrency_policy == "ALLOW_PARALLEL":
        # Any task syncing the same supplier, category and data scope can overlap.
        in_scope = _active_batches(
            conn,
            schema.batch.c.supplier_id == task.supplier_id,
            schema.batch.c.category_code == task.category_code,
            schema.batch.c.data_scope == task.data_scope,
        )
        # ...while it runs: an abandoned batch blocks nobody (nor does it get adopted:
        # it may be another task's).
        for other in in_scope:
            if not _overlaps(other.city_scope, trigger.keys):
                continue
            state = batch_liveness(conn, clock, other.batch_id)
            if state.live:
                reason = (
                    f"ALLOW_PARALLEL: batch {other.batch_id} ({other.status}) covers "
                    f"an overlapping {task.data_scope} scope ({state.reason})"
                )
                return _skip(conn, clock, trigger, other.batch_id, reason)
    return None


def _skip(
    conn: Connection, clock: DbClock, trigger: _Trigger, blocking_batch_id: str, reason: str
) -> BatchDecision:
    _log_trigger(conn, clock, trigger, "SKIPPED", reason, blocking_batch_id=blocking_batch_id)
    return BatchDecision("SKIPPED", None, reason, blocking_batch_id)


def _insert_batch(conn: Connection, clock: DbClock, task: TaskSpec, trigger: _Trigger) -> Batch:
    """A new PENDING batch of the trigger, with its shards, its log row and the task's pointer."""
    keys = trigger.keys
    batch_id = f"b_{uuid.uuid4().hex}"[:MAX_CODE_LEN]
    version = conn.execute(
        sa.select(sa.func.coalesce(sa.func.max(schema.batch.c.sync_batch_version), 0) + 1).where(
            schema.batch.c.task_code == task.task_code
        )
    ).scalar_one()
    now = clock.now()
    conn.execute(
        sa.insert(schema.batch).values(
            batch_id=batch_id,
            task_code=task.task_code,
            trigger_source=trigger.source,
            trigger_id=trigger.trigger_id,
            **task.scope(),
            city_scope=json.dumps(list(keys), ensure_ascii=False) if keys is not None else None,
            status="PENDING",
            sync_batch_version=version,
            shard_count=len(keys) if keys else 0,
            # The creator's grace (see batch_liveness); shard leases take over from it.
            worker_id=trigger.creator,
            lease_until=clock.now(trigger.lease_seconds),
            created_at=now,
            updated_at=now,
        )
    )
    if keys:
        _insert_shards(conn, clock, batch_id, keys)
    conn.execute(
        sa.update(schema.task)
        .where(schema.task.c.task_code == task.task_code)
        .values(last_batch_id=batch_id, updated_at=now)
    )
    _log_trigger(conn, clock, trigger, "CREATED", "batch created", batch_id=batch_id)
    return get_batch(conn, batch_id)


@dataclass(frozen=True)
class Liveness:
    """Whether an unfinished batch counts as running, and why (for logs and the trigger log)."""

    live: bool
    reason: str


def batch_liveness(conn: Connection, clock: DbClock, batch_id: str) -> Liveness:
    """Whether someone provably works on a batch (see the module docstring).

    Live: a RUNNING shard's lease has not expired and its holder is not a dead process of
    this host; or the creator's grace (one lease period from creation or adoption) has not
    ended and the creator is not a dead process of this host. Anything else is abandoned:
    expired leases, leases and grace held by processes of this host that no longer run, or
    no lease at all. A holder on another host is presumed alive until its lease expires.
    """
    s = schema.shard.c
    now = clock.read(conn)
    held = conn.execute(
        sa.select(s.shard_key, s.worker_id, s.lease_until)
        .where(s.batch_id == batch_id, s.status == "RUNNING", s.lease_until >= clock.now())
        .order_by(s.lease_until.desc())
    ).all()
    dead: list[str] = []
    for row in held:
        if row.worker_id and holder_is_dead_here(row.worker_id):
            dead.append(row.worker_id)
            continue
        return Liveness(
            True, f"shard {row.shard_key!r} is leased to {row.worker_id} until {row.lease_until}"
        )
    b = schema.batch.c
    creator, grace_until = conn.execute(
        sa.select(b.worker_id, b.lease_until).where(b.batch_id == batch_id)
    ).one()
    in_grace = grace_until is not None and grace_until >= now
    if in_grace and creator and not holder_is_dead_here(creator):
        return Liveness(True, f"created or adopted by {creator}, within its grace to {grace_until}")
    why = ["no live shard lease"]
    if dead:
        why.append(f"{len(dead)} unexpired shard lease(s) of dead processes ({dead[0]})")
    if in_grace:
        why.append(f"its creator {creator} is dead")
    else:
        why.append(f"the creator's grace ended at {grace_until}" if grace_until else "no grace")
    return Liveness(False, "abandoned: " + ", ".join(why))


def batch_for_trigger(conn: Connection, task_code: str, trigger_id: str) -> Batch | None:
    """The batch a trigger works on: the one it created, or the one it adopted; else None."""
    return _batch_by_trigger(conn, task_code, trigger_id) or _adopted_by_trigger(
        conn, task_code, trigger_id
    )


def add_shards(db: SyncDatabase, batch_id: str, shard_keys: Sequence[str]) -> int:
    """Adds shards (idempotently) to a batch; returns the batch's shard count.

    A batch grows as the runs of its trigger arrive (a backfill's runs each bring their
    cities), so a finished batch that gets new shards runs again; a cancelled one refuses.

    Raises:
        UnknownBatch: No such batch.
        InvalidTransition: The batch is cancelled.
        ConfigError: A shard key is malformed.
    """
    keys = _validate_shard_keys(shard_keys)
    with db.begin() as conn:
        current = lock_batch(conn, batch_id)
        if current.status == "CANCELLED":
            raise InvalidTransition(f"batch {batch_id} is CANCELLED; cannot add shards")
        _insert_shards(conn, db.clock, batch_id, keys)
        return refresh_batch(conn, db.clock, batch_id).shard_count


def get_batch(conn: Connection, batch_id: str) -> Batch:
    """Reads a batch.

    Raises:
        UnknownBatch: No batch has this id.
    """
    row = conn.execute(sa.select(schema.batch).where(schema.batch.c.batch_id == batch_id)).first()
    if row is None:
        raise UnknownBatch(f"unknown batch {batch_id!r}")
    return Batch.from_row(row)


def lock_batch(conn: Connection, batch_id: str) -> Batch:
    """Reads a batch with a row lock held until the transaction ends (BEGIN IMMEDIATE on SQLite).

    Every transaction that touches a batch and its shards takes this lock first, so they
    all lock in the same order (batch, then shard) and cannot deadlock. The one exception,
    a claim of one shard of a started batch on a server database, locks that shard alone
    and waits for nothing while it holds it.
    """
    row = conn.execute(
        sa.select(schema.batch).where(schema.batch.c.batch_id == batch_id).with_for_update()
    ).first()
    if row is None:
        raise UnknownBatch(f"unknown batch {batch_id!r}")
    return Batch.from_row(row)


def list_batches(db: SyncDatabase, *, task_code: str | None = None, limit: int = 20) -> list[Batch]:
    """The most recent batches, newest first."""
    stmt = sa.select(schema.batch).order_by(schema.batch.c.id.desc()).limit(limit)
    if task_code is not None:
        stmt = stmt.where(schema.batch.c.task_code == task_code)
    with db.engine.connect() as conn:
        return [Batch.from_row(r) for r in conn.execute(stmt)]


def cancel_batch(db: SyncDatabase, batch_id: str, reason: str) -> None:
    """Cancels an unfinished batch; its workers lose their lease at their next write.

    Raises:
        UnknownBatch: No such batch.
        InvalidTransition: The batch already finished.
    """
    with db.begin() as conn:
        lock_batch(conn, batch_id)
        _cancel(conn, db.clock, batch_id, reason)


def _cancel(conn: Connection, clock: DbClock, batch_id: str, reason: str) -> None:
    now = clock.now()
    guarded_update(
        conn,
        sa.update(schema.batch)
        .where(
            schema.batch.c.batch_id == batch_id, schema.batch.c.status.in_(ACTIVE_BATCH_STATUSES)
        )
        .values(status="CANCELLED", finished_at=now, updated_at=now, error_message=bounded(reason)),
        lambda: InvalidTransition(f"batch {batch_id} is not PENDING or RUNNING; cannot cancel"),
    )
    # Shards leave RUNNING too (one bulk move): every fenced write requires status RUNNING,
    # so the batch's workers fail their next heartbeat or checkpoint with LeaseLost.
    move_shards(
        conn,
        "CANCELLED",
        [schema.shard.c.batch_id == batch_id],
        finished_at=now,
        updated_at=now,
        lease_until=None,
    )


def fail_unstarted(
    db: SyncDatabase, batch_id: str, error: str, *, shard_keys: Sequence[str] | None = None
) -> list[str]:
    """Fails what a run could not start: the batch's PENDING shards (of ``shard_keys`` only,
    when given) move to FAILED with ``error``, and the batch records ``error``; a batch that
    has no shard yet (its city list could not be read) moves PENDING -> FAILED itself.

    Args:
        db: The sync database.
        batch_id: The batch.
        error: Why (``CODE: what happened``, ``core.errors.describe_error``).
        shard_keys: The run's cities; None: every PENDING shard of the batch.

    Returns:
        The cities moved to FAILED (a shard claimed or finished meanwhile is left alone).

    Raises:
        UnknownBatch: No such batch.
    """
    s = schema.shard.c
    clock = db.clock
    where = [s.batch_id == batch_id]
    if shard_keys is not None:
        where.append(s.shard_key.in_(list(dict.fromkeys(shard_keys))))
    with db.begin() as conn:
        current = lock_batch(conn, batch_id)
        keys = [
            str(k)
            for k in conn.execute(
                sa.select(s.shard_key).where(*where, s.status == "PENDING")
            ).scalars()
        ]
        if keys:
            move_shards(
                conn,
                "FAILED",
                [*where, s.shard_key.in_(keys)],
                sources=["PENDING"],
                finished_at=clock.now(),
                updated_at=clock.now(),
                error_message=bounded(error),
                last_heartbeat_stage="NOT_STARTED",
                last_heartbeat_message=bounded(error, 512),
            )
        derive_batch(conn, clock, current)
        b = schema.batch.c
        conn.execute(
            sa.update(schema.batch)
            .where(b.batch_id == batch_id)
            .values(error_message=bounded(error), updated_at=clock.now())
        )
        # A batch without shards derives no status: it failed before it had any.
        conn.execute(
            sa.update(schema.batch)
            .where(b.batch_id == batch_id, b.status == "PENDING", b.shard_count == 0)
            .values(status="FAILED", finished_at=clock.now())
        )
    return keys


def end_grace(db: SyncDatabase, batch_id: str, worker_id: str) -> bool:
    """Ends the creator's grace of a batch (see :func:`batch_liveness`) once its creator's
    run stopped: a new trigger then adopts it at once. Only the creator's own grace ends.

    Returns:
        True when the grace was ``worker_id``'s and still running.
    """
    b = schema.batch.c
    now = db.clock.now()
    with db.begin() as conn:
        return bool(
            conn.execute(
                sa.update(schema.batch)
                .where(b.batch_id == batch_id, b.worker_id == worker_id, b.lease_until > now)
                .values(lease_until=now, updated_at=now)
            ).rowcount
        )


def refresh_batch(conn: Connection, clock: DbClock, batch_id: str) -> Batch:
    """Derives a batch's status, counts, progress and heartbeat from its shards.

    The caller must hold the batch lock (:func:`lock_batch`) in ``conn``'s transaction, so
    two workers finishing the last two shards cannot both see the other still running.

    Status: CANCELLED stays; shards PENDING/RUNNING make it RUNNING (PENDING while none
    started); all finished make it SUCCESS, FAILED, or PARTIAL_FAILED for a mix.

    Returns:
        The batch as it now stands.
    """
    derive_batch(conn, clock, lock_batch(conn, batch_id))
    return get_batch(conn, batch_id)


@functools.cache
def _shard_totals(with_batch: bool) -> sa.Select[Any]:
    """The statement :func:`derive_batch` reads a batch's shards with (``:totals_batch_id``),
    and with them the batch's status and start when ``with_batch``.

    Built once: composing it costs more than running it on a batch of a few hundred shards,
    and every shard's finish runs it.
    """
    s = schema.shard.c
    b = schema.batch.c
    batch_id = sa.bindparam("totals_batch_id", type_=s.batch_id.type)
    read_batch = (
        [
            sa.select(column).where(b.batch_id == batch_id).scalar_subquery().label(name)
            for name, column in (("batch_status", b.status), ("batch_started_at", b.started_at))
        ]
        if with_batch
        else []
    )
    # The shard whose checkpoint moved last (ties: the later shard), read in the same
    # statement as the counts.
    latest = (
        sa.select(s.id)
        .where(s.batch_id == batch_id, s.last_checkpoint_at.is_not(None))
        .order_by(s.last_checkpoint_at.desc(), s.id.desc())
        .limit(1)
        .scalar_subquery()
    )
    latest_shard = schema.shard.alias("latest_shard")
    l_ = latest_shard.c
    return sa.select(
        sa.func.count().label("n"),
        sa.func.sum(sa.case((s.status == "PENDING", 1), else_=0)).label("pending"),
        sa.func.sum(sa.case((s.status == "RUNNING", 1), else_=0)).label("running"),
        sa.func.sum(sa.case((s.status == "SUCCESS", 1), else_=0)).label("success"),
        sa.func.sum(sa.case((s.status == "FAILED", 1), else_=0)).label("failed"),
        sa.func.coalesce(sa.func.sum(s.total_count), 0).label("total_count"),
        sa.func.coalesce(sa.func.sum(s.success_count), 0).label("success_count"),
        sa.func.coalesce(sa.func.sum(s.failed_count), 0).label("failed_count"),
        sa.func.coalesce(sa.func.sum(s.skipped_count), 0).label("skipped_count"),
        sa.func.coalesce(sa.func.sum(s.pages_done), 0).label("pages_done"),
        sa.func.coalesce(sa.func.sum(s.fetched_count), 0).label("fetched_count"),
        sa.func.coalesce(
            sa.func.sum(
                sa.case(
                    (s.status.in_(("SUCCESS", "FAILED", "CANCELLED")), 1.0),
                    (s.total_pages > 0, sa.cast(s.pages_done, sa.Float) / s.total_pages),
                    else_=0.0,
                )
            ),
            0.0,
        ).label("progress"),
        sa.func.max(s.heartbeat_at).label("heartbeat_at"),
        sa.func.max(s.last_checkpoint_at).label("last_checkpoint_at"),
        sa.select(l_.shard_key).where(l_.id == latest).scalar_subquery().label("latest_key"),
        sa.select(l_.checkpoint)
        .where(l_.id == latest)
        .scalar_subquery()
        .label("latest_checkpoint"),
        *read_batch,
    ).where(s.batch_id == batch_id)


def derive_batch(conn: Connection, clock: DbClock, current: Batch | str) -> None:
    """:func:`refresh_batch` for a caller that locked the batch already (``current`` is what
    :func:`lock_batch` returned in this transaction) and needs no read-back.

    On SQLite, whose write lock the transaction holds from its start, ``current`` may be
    the batch id instead: the batch's status is then read with its shards' counts, in the
    same statement.

    Raises:
        UnknownBatch: ``current`` is the id of no batch.
    """
    batch_id = current if isinstance(current, str) else current.batch_id
    agg = conn.execute(_shard_totals(isinstance(current, str)), {"totals_batch_id": batch_id}).one()

    if isinstance(current, str):
        if agg.batch_status is None:
            raise UnknownBatch(f"unknown batch {batch_id!r}")
        current_status: BatchStatus = agg.batch_status
        current_started_at = agg.batch_started_at
    else:
        current_status, current_started_at = current.status, current.started_at
    n = int(agg.n)
    done = int(agg.success or 0) + int(agg.failed or 0)
    status: BatchStatus = current_status
    if current_status != "CANCELLED" and n:
        if agg.pending or agg.running:
            started = bool(agg.running) or done > 0 or current_started_at is not None
            status = "RUNNING" if started else "PENDING"
        elif not agg.failed:
            status = "SUCCESS"
        elif not agg.success:
            status = "FAILED"
        else:
            status = "PARTIAL_FAILED"
    progress = min(100.0, 100.0 * float(agg.progress) / n) if n else 0.0
    values: dict[str, Any] = {
        "status": status,
        "shard_count": n,
        "shards_done": done,
        "total_count": int(agg.total_count),
        "success_count": int(agg.success_count),
        "failed_count": int(agg.failed_count),
        "skipped_count": int(agg.skipped_count),
        "pages_done": int(agg.pages_done),
        "fetched_count": int(agg.fetched_count),
        "progress_percent": Decimal(f"{progress:.2f}"),
        "heartbeat_at": agg.heartbeat_at,
        "last_checkpoint_at": agg.last_checkpoint_at,
    }
    # Columns set to the database's time (its clock's offset is a parameter).
    stamped = ["updated_at"]
    if agg.latest_key is not None:
        values["current_city_code"] = agg.latest_key
        values["current_page"] = _page_of(agg.latest_checkpoint)
        values["end_checkpoint"] = (agg.latest_checkpoint or "")[:512] or None
    if status == "RUNNING" and current_started_at is None:
        stamped.append("started_at")
    if status in TERMINAL_BATCH_STATUSES and current_status not in TERMINAL_BATCH_STATUSES:
        stamped.append("finished_at")
    elif status in ACTIVE_BATCH_STATUSES:
        values["finished_at"] = None  # a reopened shard makes a finished batch run again
        if current_status in TERMINAL_BATCH_STATUSES:
            values["error_message"] = None  # why it failed then is not why it runs now
    params = {f"new_{name}": value for name, value in values.items()}
    params.update(
        derived_batch_id=batch_id,
        derived_from=current_status,
        now_us=round(clock.offset_seconds * 1_000_000),
    )
    if conn.execute(_derived_move(tuple(values), tuple(stamped)), params).rowcount != 1:
        raise InvalidTransition(f"batch {batch_id} changed status while locked")


def count_finish(conn: Connection, clock: DbClock, batch_id: str, shards: int) -> bool:
    """Counts one more finished shard of the RUNNING batch ``batch_id`` (locked in this
    transaction: :func:`lock_batch`) without summing its shards, when that keeps it right.

    That is when the batch has more than :data:`EXACT_TOTALS_SHARDS` shards, its totals
    were derived less than :data:`RETOTAL_SECONDS` ago (its ``updated_at``, on the
    database's clock), and another of its shards is unfinished (``shards_done`` is exact:
    every other move of a shard into or out of SUCCESS or FAILED derives the batch). Its
    other counts and its progress then lag by at most that many seconds; its status cannot
    have changed.

    Args:
        conn: The caller's transaction, holding the batch's lock.
        clock: The database clock.
        batch_id: The batch.
        shards: Its shards as the caller last saw them: no statement at all for a batch
            that small.

    Returns:
        True if counted; False if the caller must derive the batch (:func:`derive_batch`).
    """
    if shards <= EXACT_TOTALS_SHARDS:
        return False
    params = {
        "counted_batch_id": batch_id,
        "exact_limit": EXACT_TOTALS_SHARDS,
        "since_us": round((clock.offset_seconds - RETOTAL_SECONDS) * 1_000_000),
    }
    return int(conn.execute(_counted_finish(), params).rowcount) == 1


@functools.cache
def _counted_finish() -> sa.Update:
    """:func:`count_finish`'s guarded move, built once."""
    b = schema.batch.c
    return (
        sa.update(schema.batch)
        .where(
            b.batch_id == sa.bindparam("counted_batch_id", type_=b.batch_id.type),
            b.status == "RUNNING",
            b.shard_count > sa.bindparam("exact_limit", type_=sa.Integer()),
            b.shards_done + 1 < b.shard_count,
            b.updated_at > db_now(sa.bindparam("since_us", type_=sa.BigInteger())),
        )
        .values(shards_done=b.shards_done + 1)
    )


@functools.cache
def _derived_move(columns: tuple[str, ...], stamped: tuple[str, ...]) -> sa.Update:
    """:func:`derive_batch`'s guarded move of a batch (``:derived_batch_id`` in status
    ``:derived_from``), setting ``columns`` to ``:new_<column>`` and ``stamped`` to the
    database's time: built once per set of columns, as every shard's finish runs it."""
    b = schema.batch.c
    now = db_now(sa.bindparam("now_us", type_=sa.BigInteger()))
    return (
        sa.update(schema.batch)
        .where(
            b.batch_id == sa.bindparam("derived_batch_id", type_=b.batch_id.type),
            b.status == sa.bindparam("derived_from", type_=b.status.type),
        )
        .values(
            {name: sa.bindparam(f"new_{name}", type_=b[name].type) for name in columns}
            | {name: now for name in stamped}
        )
    )


def _page_of(checkpoint: str | None) -> int | None:
    try:
        page = json.loads(checkpoint or "null")["page"]
        return int(page) if page is not None else None
    except (ValueError, TypeError, KeyError):
        return None


def _validate_shard_keys(keys: Sequence[str]) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise ConfigError("shard_keys must be a sequence of city codes, not one string")
    for key in keys:
        _check_code("shard key", key, MAX_SHARD_KEY_LEN)
    return tuple(dict.fromkeys(keys))


def _insert_shards(conn: Connection, clock: DbClock, batch_id: str, keys: Sequence[str]) -> None:
    now = clock.now()
    # Bulk insert: one statement for the whole city list, never a row at a time.
    insert_ignore(
        conn,
        schema.shard,
        [{"shard_key": key} for key in keys],
        batch_id=batch_id,
        shard_type="CITY",
        status="PENDING",
        created_at=now,
        updated_at=now,
    )


def _batch_by_trigger(conn: Connection, task_code: str, trigger_id: str) -> Batch | None:
    row = conn.execute(
        sa.select(schema.batch).where(
            schema.batch.c.task_code == task_code, schema.batch.c.trigger_id == trigger_id
        )
    ).first()
    return Batch.from_row(row) if row is not None else None


def _adopted_by_trigger(conn: Connection, task_code: str, trigger_id: str) -> Batch | None:
    batch_id = conn.execute(
        sa.select(schema.trigger_log.c.batch_id).where(
            schema.trigger_log.c.task_code == task_code,
            schema.trigger_log.c.trigger_id == trigger_id,
            schema.trigger_log.c.outcome == "ADOPTED",
        )
    ).scalar()
    return get_batch(conn, batch_id) if batch_id else None


def _adopt(
    conn: Connection, clock: DbClock, batch: Batch, trigger: _Trigger, *, why: str
) -> BatchDecision:
    """Hands an abandoned batch to a new trigger: its shards, the creator's grace, a log row.

    The caller holds the task lock, so no other trigger decides at the same time; the
    batch's shards keep their checkpoints, and their expired or dead leases are reclaimed
    by the adopter's workers as usual (``claim_shard``).
    """
    current = lock_batch(conn, batch.batch_id)
    keys = trigger.keys
    values: dict[str, Any] = {
        "worker_id": trigger.creator,
        "lease_until": clock.now(trigger.lease_seconds),
        "updated_at": clock.now(),
    }
    if current.city_scope is not None:
        scope = None if keys is None else tuple(dict.fromkeys((*current.city_scope, *keys)))
        values["city_scope"] = (
            json.dumps(list(scope), ensure_ascii=False) if scope is not None else None
        )
    guarded_update(
        conn,
        sa.update(schema.batch)
        .where(schema.batch.c.batch_id == batch.batch_id, schema.batch.c.status == current.status)
        .values(**values),
        lambda: InvalidTransition(f"batch {batch.batch_id} changed status while locked"),
    )
    if keys:
        _insert_shards(conn, clock, batch.batch_id, keys)
        refresh_batch(conn, clock, batch.batch_id)
    reason = f"adopted batch {batch.batch_id} of trigger {batch.trigger_id} ({why})"
    _log_trigger(conn, clock, trigger, "ADOPTED", reason, batch_id=batch.batch_id)
    return BatchDecision("ADOPTED", get_batch(conn, batch.batch_id), reason)


def _active_batches(conn: Connection, *where: sa.ColumnElement[bool]) -> list[Batch]:
    """Unfinished batches matching ``where``, newest first."""
    rows = conn.execute(
        sa.select(schema.batch)
        .where(schema.batch.c.status.in_(ACTIVE_BATCH_STATUSES), *where)
        .order_by(schema.batch.c.id.desc())
    )
    return [Batch.from_row(r) for r in rows]


def _overlaps(a: tuple[str, ...] | None, b: tuple[str, ...] | None) -> bool:
    """Two city scopes overlap unless both are explicit lists with no city in common."""
    if a is None or b is None:
        return True
    return not set(a).isdisjoint(b)


def _log_trigger(
    conn: Connection,
    clock: DbClock,
    trigger: _Trigger,
    outcome: DecisionOutcome,
    reason: str,
    *,
    batch_id: str | None = None,
    blocking_batch_id: str | None = None,
) -> None:
    insert_ignore(
        conn,
        schema.trigger_log,
        [
            {
                "task_code": trigger.task_code,
                "trigger_id": trigger.trigger_id,
                "trigger_source": trigger.source,
                "outcome": outcome,
                "batch_id": batch_id,
                "blocking_batch_id": blocking_batch_id,
                "reason": reason[:512],
            }
        ],
        created_at=clock.now(),
    )


def rate_and_eta(batch: Batch, now: datetime) -> str:
    """Hotels/s since the batch started and the time left at that pace (by the db clock).

    Args:
        batch: The batch, as read (``get_batch``).
        now: The database's current time (``db.clock.read``).
    """
    if batch.started_at is None:
        return "not started"
    end = batch.finished_at or now
    seconds = max((end - batch.started_at).total_seconds(), 1e-6)
    rate = batch.fetched_count / seconds
    pct = float(batch.progress_percent)
    if batch.finished_at is not None or pct >= 100:
        return f"{rate:,.0f} hotels/s, took {seconds:,.0f}s"
    return f"{rate:,.0f} hotels/s, ETA {time_left(seconds, pct)}"


def time_left(elapsed: float, percent: float) -> str:
    """The time left at the pace so far (``"1,234s"``), or ``"unknown"`` until there is
    progress to judge a pace by.

    Args:
        elapsed: Seconds since the work started.
        percent: How much of it is done, 0 to 100.
    """
    if not 0 < percent <= 100 or elapsed <= 0:  # NaN too
        return "unknown"
    return f"{elapsed * (100 - percent) / percent:,.0f}s"


def progress_line(batch: Batch, now: datetime) -> str:
    """One line of a batch's progress: cities, pages, hotels, rate and ETA."""
    return (
        f"{batch.shards_done}/{batch.shard_count} cities, {batch.pages_done} pages, "
        f"{batch.fetched_count} hotels, {batch.progress_percent}%, {rate_and_eta(batch, now)}"
    )
