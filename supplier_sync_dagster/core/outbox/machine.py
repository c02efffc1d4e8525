"""The outbox stage machine: each event moves through its chain of stages, one guarded move
at a time.

Every publish writes its events into ``supplier_sync_outbox`` in the publish's transaction
(invariant 7). This module drives them on, as ``seeds/local-message-table.md`` describes:
one table whose ``current_stage`` (the stage done last), ``next_stage`` (the stage to run)
and ``status`` say where each event is. A hotel's ``HotelResourceUpdated`` event runs
``SEARCH_INDEX -> CACHE -> NOTIFY -> END``; the other event types only notify subscribers
(``HotelSearchIndexRefreshRequired`` is the SEARCH_INDEX stage of the hotel's event now, and
no longer written). The statuses::

    READY ──claim──> PROCESSING ──advance──> READY (next stage) | SUCCEEDED (END)
      ^                  │  │
      │                  │  └──give up (max attempts)──> FAILED ──operator retry──> READY
      └──retry later─────┘      (and the stuck pass: an expired lease, its holder killed)
    READY | FAILED ──operator cancel──> CANCELLED ──operator retry──> READY

Every move is :func:`move_events`: one conditional UPDATE whose WHERE clause carries the
states the table :data:`OUTBOX_MOVES` allows (and, for a dispatcher's move, its lease), with
its affected-row count checked. A dispatcher claims READY events of one stage in a batch
(``FOR UPDATE SKIP LOCKED`` on MySQL/MariaDB; on SQLite one ``UPDATE ... RETURNING`` under the
database's single write lock), holding a lease (owner, until: the database's clock) while it
runs the stage; many dispatchers can run at once, and each event is handled by one of them
at a time. A failed attempt retries later with exponential backoff and jitter
(:data:`STAGE_POLICIES`); past its stage's max attempts the event is FAILED, visible in
``supplier-sync outbox list --status FAILED`` and retryable there. A dispatcher killed
mid-batch leaves PROCESSING rows whose lease expires: :func:`release_stuck` (every minute)
returns them to READY and reports what it moved.

Consumers see an event at least once (a stage that succeeded but whose move was lost runs
again) and deduplicate by ``event_id``; the search projection never goes back to an older
``publish_version`` (it is guarded by it), so events of one hotel apply in version order.
"""

from __future__ import annotations

import math
import os
import random
import socket
import threading
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import ConfigError, InvalidTransition, UnknownOutboxEvent
from supplier_sync_dagster.core.redaction import bounded
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import Identity, record_actions, require_who_and_why
from supplier_sync_dagster.core.store.db import SyncDatabase, use_index

OutboxStatus = Literal["READY", "PROCESSING", "SUCCEEDED", "FAILED", "CANCELLED"]
Stage = Literal["SEARCH_INDEX", "CACHE", "NOTIFY"]

STAGES: tuple[Stage, ...] = ("SEARCH_INDEX", "CACHE", "NOTIFY")
PUBLISHED = "PUBLISHED"  # an event's current_stage before its first stage ran
END = "END"  # the next_stage of an event whose chain is done

CHAINS: Mapping[str, tuple[Stage, ...]] = MappingProxyType(
    {
        "HotelResourceUpdated": ("SEARCH_INDEX", "CACHE", "NOTIFY"),
        "HotelContentChanged": ("NOTIFY",),
        "HotelMappingCreated": ("NOTIFY",),
        # Written before the SEARCH_INDEX stage existed: subscribers may still expect it.
        "HotelSearchIndexRefreshRequired": ("NOTIFY",),
        # A live quote differed from the catalog (the read API): whoever re-syncs the hotel.
        "HotelRefreshRequested": ("NOTIFY",),
    }
)
"""Each event type's stages, in order."""

OUTBOX_MOVES: Mapping[OutboxStatus, frozenset[OutboxStatus]] = MappingProxyType(
    {
        "READY": frozenset({"PROCESSING", "CANCELLED"}),
        "PROCESSING": frozenset({"READY", "SUCCEEDED", "FAILED"}),
        "FAILED": frozenset({"READY", "CANCELLED"}),
        "CANCELLED": frozenset({"READY"}),
        "SUCCEEDED": frozenset(),
    }
)
"""Each outbox status and the statuses it may move to; nothing else is ever written."""


@dataclass(frozen=True)
class StagePolicy:
    """How a stage retries.

    Attributes:
        max_attempts: Attempts before the event is FAILED (an operator may retry it).
        base_seconds: The first retry's delay; each further retry doubles it.
        cap_seconds: The longest delay.
        jitter: The delay varies by up to this share either way, so that events that
            failed together do not all come back at the same moment.
    """

    max_attempts: int
    base_seconds: float
    cap_seconds: float
    jitter: float = 0.2

    def delay(self, retry_count: int, rng: random.Random | None = None) -> float:
        """Seconds before retry number ``retry_count`` (1 for the first retry)."""
        raw = min(self.cap_seconds, self.base_seconds * 2 ** max(0, retry_count - 1))
        spread = (rng or random).uniform(-self.jitter, self.jitter)
        return max(0.0, raw * (1 + spread))


STAGE_POLICIES: Mapping[Stage, StagePolicy] = MappingProxyType(
    {
        # The projections are ours: a failure is an outage that passes (a restart).
        "SEARCH_INDEX": StagePolicy(max_attempts=10, base_seconds=1.0, cap_seconds=300.0),
        "CACHE": StagePolicy(max_attempts=10, base_seconds=1.0, cap_seconds=300.0),
        # Subscribers' broker: longer outages, so more patience.
        "NOTIFY": StagePolicy(max_attempts=12, base_seconds=2.0, cap_seconds=900.0),
    }
)

_READY: tuple[OutboxStatus, ...] = ("READY",)
_PROCESSING: tuple[OutboxStatus, ...] = ("PROCESSING",)
_STOPPED: tuple[OutboxStatus, ...] = ("FAILED", "CANCELLED")
_CANCELLABLE: tuple[OutboxStatus, ...] = ("READY", "FAILED")

DEFAULT_LEASE_SECONDS = 60.0
MAX_ERROR_LENGTH = 1024


def first_stage(event_type: str) -> Stage:
    """The stage an event of this type starts with (an unknown type: NOTIFY only)."""
    return CHAINS.get(event_type, ("NOTIFY",))[0]


def stage_after(event_type: str, stage: Stage) -> Stage | Literal["END"]:
    """The stage after ``stage`` in the event type's chain, or END."""
    chain = CHAINS.get(event_type, ("NOTIFY",))
    i = chain.index(stage) if stage in chain else len(chain) - 1
    if i + 1 < len(chain):
        return chain[i + 1]
    return "END"


def make_owner(name: str = "dispatch") -> str:
    """A lease owner naming the host, process and thread (what ``outbox list`` shows)."""
    return f"{name}@{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"[:128]


@dataclass(frozen=True)
class OutboxEvent:
    """A claimed event, as its stage needs it: SEARCH_INDEX and CACHE claims read the hotel
    only (no payload, event id or batch: empty), NOTIFY claims every field."""

    id: int
    event_id: str
    event_type: str
    aggregate_type: str
    aggregate_id: int
    aggregate_version: int
    batch_id: str
    payload: str
    next_stage: str
    retry_count: int
    created_at: datetime


# What a claim reads: the stages that project the catalog need the hotel, not the payload.
_LEAN_COLUMNS = ("id", "event_type", "aggregate_id", "aggregate_version", "retry_count")
_FULL_COLUMNS = (*_LEAN_COLUMNS, "event_id", "batch_id", "payload")
_STAGE_COLUMNS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"SEARCH_INDEX": _LEAN_COLUMNS, "CACHE": _LEAN_COLUMNS, "NOTIFY": _FULL_COLUMNS}
)


def _event(row: Sequence[Any], stage: str) -> OutboxEvent:
    """The event of a claim's row: the columns ``_LEAN_COLUMNS``, then the rest of
    ``_FULL_COLUMNS`` when the claim read every field (by position: a claim makes one per
    event, on every dispatcher's hot path)."""
    event_id = batch_id = payload = ""
    if len(row) > len(_LEAN_COLUMNS):
        event_id, batch_id, payload = row[5], row[6], row[7]
    return OutboxEvent(
        id=int(row[0]),
        event_id=event_id,
        event_type=row[1],
        aggregate_type="HOTEL",
        aggregate_id=int(row[2]),
        aggregate_version=int(row[3]),
        batch_id=batch_id,
        payload=payload,
        next_stage=stage,
        retry_count=int(row[4]),
        created_at=datetime.min,
    )


# -- the one guarded move --------------------------------------------------------------


def sources_of(target: OutboxStatus) -> frozenset[OutboxStatus]:
    """The statuses from which :data:`OUTBOX_MOVES` allows a move to ``target``."""
    return frozenset(s for s, targets in OUTBOX_MOVES.items() if target in targets)


def move_events(
    conn: Connection,
    target: OutboxStatus,
    ids: Collection[int],
    *,
    sources: Collection[OutboxStatus] | None = None,
    owner: str | None = None,
    where: Sequence[sa.ColumnElement[bool]] = (),
    expected: int | None = None,
    **values: Any,
) -> int:
    """The one guarded move of the outbox state machine: one conditional UPDATE.

    Args:
        conn: Connection in the caller's transaction.
        target: The status the events move to.
        ids: The events (outbox row ids).
        sources: The statuses to move from; by default every status that may reach it.
        owner: The lease owner the rows must still carry (a dispatcher's move).
        where: More conditions the move needs (the stage it expects, an expired lease).
        expected: How many rows must move; None returns the count unchecked (a bulk move
            of rows that may have moved meanwhile, such as the stuck pass).
        **values: The other columns to set (values or SQL expressions).

    Returns:
        How many events moved.

    Raises:
        InvalidTransition: ``sources`` names a status the table does not allow to reach
            ``target`` (a bug), or fewer than ``expected`` rows matched: they are no longer
            where the move expects them (a lost lease, an operator's cancel); nothing of
            this move is kept when the caller's transaction rolls back.
    """
    if not ids:
        return 0
    allowed = sources_of(target)
    chosen = allowed if sources is None else frozenset(sources)
    if not chosen or not chosen <= allowed:
        raise InvalidTransition(
            f"no outbox event moves from {sorted(chosen - allowed) or 'nowhere'} to "
            f"{target}; only from {sorted(allowed) or 'nowhere'}"
        )
    o = schema.outbox.c
    moved = 0
    for part in _chunks(sorted(ids)):
        stmt = sa.update(schema.outbox).where(o.id.in_(part), o.status.in_(sorted(chosen)), *where)
        if owner is not None:
            stmt = stmt.where(o.lease_owner == owner)
        moved += int(conn.execute(stmt.values(status=target, **values)).rowcount)
    if expected is not None and moved != expected:
        raise InvalidTransition(
            f"{expected - moved} of {expected} outbox events were not "
            f"{'/'.join(sorted(chosen))}{' under lease ' + owner if owner else ''} any more"
        )
    return moved


def _chunks(ids: Sequence[int], size: int = 500) -> list[Sequence[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


# -- a dispatcher's moves --------------------------------------------------------------


def claim(
    db: SyncDatabase,
    stage: Stage,
    *,
    owner: str,
    limit: int = 500,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    full: bool = False,
) -> list[OutboxEvent]:
    """Claims up to ``limit`` READY events whose next stage is ``stage`` and that are due,
    oldest first, under a lease of ``owner`` until ``lease_seconds`` from now (database
    clock). Concurrent claimers get disjoint events. The events carry what ``stage`` needs,
    or every field with ``full`` (for a claimer that runs NOTIFY after it)."""
    o = schema.outbox.c
    clock = db.clock
    due = sa.or_(o.next_attempt_at.is_(None), o.next_attempt_at <= clock.now())
    pick = (
        sa.select(o.id)
        .where(o.status == "READY", o.next_stage == stage, due)
        .order_by(o.id)
        .limit(limit)
    )
    lease: dict[str, Any] = {"lease_owner": owner, "lease_until": clock.now(lease_seconds)}
    columns = [o[name] for name in (_FULL_COLUMNS if full else _STAGE_COLUMNS[stage])]
    with db.begin() as conn:
        if conn.dialect.name == "sqlite":
            # One statement under SQLite's write lock: nobody else claims meanwhile.
            rows = conn.execute(
                sa.update(schema.outbox)
                .where(o.id.in_(pick.scalar_subquery()), o.status == "READY")
                .values(status="PROCESSING", **lease)
                .returning(*columns)
            ).all()
            return sorted((_event(r, stage) for r in rows), key=lambda e: e.id)
        # The rows are read with their locks (others skip them), then leased by id.
        locked = use_index(
            pick.with_only_columns(*columns), schema.outbox, "idx_outbox_claim"
        ).with_for_update(skip_locked=True)
        rows = conn.execute(locked).all()
        if not rows:
            return []
        ids = [int(r.id) for r in rows]
        move_events(conn, "PROCESSING", ids, sources=_READY, expected=len(ids), **lease)
    return [_event(r, stage) for r in rows]


@dataclass(frozen=True)
class Outcome:
    """What a dispatcher did with one claimed event, for :func:`settle` to record.

    Attributes:
        event: The event as claimed: its ``next_stage`` is the stage its row still names.
        done: The last stage of the event's chain that passed under this claim (None: none).
        error: Why the stage after ``done`` failed (None: it did not fail).
        projected_at: When SEARCH_INDEX passed (the database's clock); None: when the event
            is settled.
    """

    event: OutboxEvent
    done: Stage | None = None
    error: str | None = None
    projected_at: datetime | None = None


@dataclass
class Settled:
    """How many claimed events :func:`settle` moved, by where they went.

    Attributes:
        moved_on: Events whose stages passed (READY at their next stage, or SUCCEEDED).
        retrying: By the stage that failed: events that retry it after its backoff.
        failed: By the stage that failed: events past its max attempts (FAILED).
    """

    moved_on: int = 0
    retrying: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        """Every event moved."""
        return self.moved_on + sum(self.retrying.values()) + sum(self.failed.values())


_NOW: Any = object()  # settle's stand-in for the database's clock, replaced in the move


def settle(
    db: SyncDatabase,
    outcomes: Sequence[Outcome],
    *,
    owner: str,
    rng: random.Random | None = None,
) -> Settled:
    """Records what a dispatcher did with the events it claimed, in guarded moves of groups.

    A dispatcher holding an event's lease may run several stages of its chain before it
    lets go (one claim and one move instead of two per stage); the row records the outcome:

    - every stage passed: SUCCEEDED at the END, or READY at the next stage;
    - a stage failed: READY at that stage after its backoff (the stages before it are done:
      ``current_stage``), or FAILED past the stage's max attempts.

    Each move is guarded by the lease and by the stage the row named when it was claimed;
    events whose lease was lost meanwhile (the stuck pass gave them to another dispatcher)
    stay where that dispatcher put them and are not counted.
    """
    o = schema.outbox.c
    clock = db.clock
    groups: dict[tuple[Any, ...], list[int]] = {}
    for p in outcomes:
        e = p.event
        values: dict[str, Any] = {"lease_owner": None, "lease_until": None}
        if p.done is not None:
            values["current_stage"] = p.done
        if p.done is not None and e.next_stage == "SEARCH_INDEX":
            values["projected_at"] = p.projected_at or _NOW
        if p.error is None:
            if p.done is None:
                raise ValueError(f"outbox event {e.id}: nothing passed and nothing failed")
            nxt = stage_after(e.event_type, p.done)
            target: OutboxStatus = "SUCCEEDED" if nxt == END else "READY"
            values.update(next_stage=nxt, retry_count=0, next_attempt_at=None, last_error=None)
            if nxt == END:
                values["finished_at"] = _NOW
            retry_stage = None
        else:
            stage = stage_after(e.event_type, p.done) if p.done is not None else e.next_stage
            assert stage != END, "a failure is a stage's"
            attempt = (e.retry_count if p.done is None else 0) + 1
            give_up = attempt >= STAGE_POLICIES[stage].max_attempts  # type: ignore[index]
            target = "FAILED" if give_up else "READY"
            values.update(
                next_stage=stage, retry_count=attempt, last_error=bounded(p.error, MAX_ERROR_LENGTH)
            )
            if give_up:
                values["next_attempt_at"] = None
            retry_stage = None if give_up else stage
        key = (e.next_stage, target, retry_stage or "", tuple(sorted(values.items())))
        groups.setdefault(key, []).append(e.id)
    settled = Settled()
    with db.begin() as conn:
        for (claimed, target, retry_stage, items), ids in groups.items():
            values = {k: (clock.now() if v is _NOW else v) for k, v in items}
            if retry_stage:
                policy = STAGE_POLICIES[retry_stage]
                values["next_attempt_at"] = clock.now(policy.delay(values["retry_count"], rng))
            n = move_events(
                conn,
                target,
                ids,
                sources=_PROCESSING,
                owner=owner,
                where=[o.next_stage == claimed],
                **values,
            )
            if target == "FAILED":
                settled.failed[values["next_stage"]] += n
            elif retry_stage:
                settled.retrying[retry_stage] += n
            else:
                settled.moved_on += n
    return settled


def advance(db: SyncDatabase, stage: Stage, events: Sequence[OutboxEvent], *, owner: str) -> int:
    """Moves events claimed at ``stage`` on after it passed: to their next stage (READY), or
    SUCCEEDED at the end of their chain (:func:`settle`). Returns how many moved."""
    return settle(db, [Outcome(e, done=stage) for e in events], owner=owner).moved_on


def release_stuck(db: SyncDatabase) -> dict[str, int]:
    """The stuck-message pass: PROCESSING events whose lease expired (their dispatcher was
    killed or hung) return to READY at the stage they were in; returns how many, by stage.

    A dispatcher that is merely slow and comes back finds its move refused (the rows no
    longer carry its lease) and leaves them to whoever claims them next."""
    o = schema.outbox.c
    expired = [o.status == "PROCESSING", o.lease_until < db.clock.now()]
    with db.begin() as conn:
        rows = conn.execute(sa.select(o.id, o.next_stage).where(*expired)).all()
        if not rows:
            return {}
        ids = [int(r.id) for r in rows]
        move_events(
            conn,
            "READY",
            ids,
            sources=_PROCESSING,
            where=expired,
            expected=len(ids),
            lease_owner=None,
            lease_until=None,
        )
    return dict(Counter(str(r.next_stage) for r in rows))


# -- an operator's moves ---------------------------------------------------------------


def retry_events(conn: Connection, ids: Sequence[int]) -> int:
    """FAILED or CANCELLED events become READY at the stage they stopped at, attempts reset.

    Raises:
        UnknownOutboxEvent: An id is not in the outbox.
        InvalidTransition: An event is not FAILED or CANCELLED.
    """
    _require(conn, ids, _STOPPED)
    return move_events(
        conn,
        "READY",
        ids,
        sources=_STOPPED,
        expected=len(set(ids)),
        retry_count=0,
        next_attempt_at=None,
    )


def cancel_events(conn: Connection, ids: Sequence[int]) -> int:
    """READY or FAILED events are CANCELLED: no stage runs them (until an operator retry).

    Raises:
        UnknownOutboxEvent: An id is not in the outbox.
        InvalidTransition: An event is PROCESSING (let it finish) or already done.
    """
    _require(conn, ids, _CANCELLABLE)
    return move_events(
        conn,
        "CANCELLED",
        ids,
        sources=_CANCELLABLE,
        expected=len(set(ids)),
        next_attempt_at=None,
    )


def _require(conn: Connection, ids: Sequence[int], statuses: Collection[str]) -> None:
    o = schema.outbox.c
    found = {
        int(r.id): str(r.status)
        for r in conn.execute(sa.select(o.id, o.status).where(o.id.in_(list(ids))))
    }
    missing = sorted(set(ids) - set(found))
    if missing:
        raise UnknownOutboxEvent(f"no outbox event with id {', '.join(map(str, missing))}")
    wrong = {i: s for i, s in found.items() if s not in statuses}
    if wrong:
        shown = ", ".join(f"{i} is {s}" for i, s in sorted(wrong.items())[:10])
        raise InvalidTransition(f"only {'/'.join(statuses)} events can be moved so: {shown}")


def operate(
    db: SyncDatabase,
    action: Literal["retry", "cancel"],
    ids: Sequence[int],
    *,
    actor: str | None,
    reason: str | None,
    identity: Identity | None = None,
) -> int:
    """An operator's retry or cancel of events, recorded in the audit trail (who, why, each
    event's state before and after, and ``identity``, the acting process's when None) in
    the same transaction as the move.

    Raises:
        ConfigError: ``actor`` or ``reason`` is missing, or no event is named.
        UnknownOutboxEvent: An id is not in the outbox.
        InvalidTransition: An event is not in a state the action applies to.
    """
    who, why = require_who_and_why(actor, reason)
    wanted = sorted(set(ids))
    if not wanted:
        raise ConfigError("name the outbox events (their ids, from supplier-sync outbox list)")
    with db.begin() as conn:
        before = _states(conn, wanted)
        moved = (retry_events if action == "retry" else cancel_events)(conn, wanted)
        after = _states(conn, wanted)
        record_actions(
            conn,
            db.clock,
            action=f"outbox.{action}",
            target_type="outbox_event",
            changes=[(str(i), before.get(i), after.get(i)) for i in wanted],
            actor=who,
            reason=why,
            identity=identity,
        )
    return moved


def _states(conn: Connection, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    o = schema.outbox.c
    rows = conn.execute(
        sa.select(
            o.id, o.event_id, o.status, o.current_stage, o.next_stage, o.retry_count, o.last_error
        ).where(o.id.in_(list(ids)))
    ).all()
    return {int(r.id): {k: v for k, v in r._mapping.items() if k != "id"} for r in rows}


# -- what operators read -----------------------------------------------------------------


@dataclass
class Lag:
    """Seconds from publish (the event's creation, in the publish's transaction) to a point.

    Attributes:
        count: Events measured.
        p50, p95, max: The percentiles (None when no event was measured).
    """

    count: int = 0
    p50: float | None = None
    p95: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Lag:
        """The lag of these measurements."""
        if not seconds:
            return cls()
        ordered = sorted(seconds)

        def pct(p: float) -> float:
            return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))]

        return cls(len(ordered), pct(0.50), pct(0.95), ordered[-1])


@dataclass
class OutboxStatusReport:
    """The outbox at a glance.

    Attributes:
        counts: (status, next stage) -> events.
        oldest_ready_seconds: Age of the oldest READY event (None: none is READY).
        stuck: PROCESSING events whose lease expired (the next stuck pass frees them).
        projection_lag: publish -> SEARCH_INDEX done, over the last ``window`` projected.
        end_to_end_lag: publish -> the end of the chain, over the last ``window`` finished.
    """

    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    oldest_ready_seconds: float | None = None
    stuck: int = 0
    projection_lag: Lag = field(default_factory=Lag)
    end_to_end_lag: Lag = field(default_factory=Lag)

    def total(self, status: str) -> int:
        """Events in ``status``, over every stage."""
        return sum(n for (s, _), n in self.counts.items() if s == status)


def outbox_status(db: SyncDatabase, *, window: int = 10_000) -> OutboxStatusReport:
    """Counts by status and stage, the oldest READY event, stuck events, and the lags of the
    most recent ``window`` events (bounded reads: no scan of the whole outbox's history
    beyond its status index)."""
    o = schema.outbox.c
    clock = db.clock
    report = OutboxStatusReport()
    with db.engine.connect() as conn:
        now = clock.read(conn)
        for status, stage, n in conn.execute(
            sa.select(o.status, o.next_stage, sa.func.count())
            .where(o.status.in_(["READY", "PROCESSING", "FAILED"]))
            .group_by(o.status, o.next_stage)
        ):
            report.counts[(str(status), str(stage))] = int(n)
        done = conn.execute(
            sa.select(sa.func.count()).select_from(schema.outbox).where(o.status == "SUCCEEDED")
        ).scalar_one()
        cancelled = conn.execute(
            sa.select(sa.func.count()).select_from(schema.outbox).where(o.status == "CANCELLED")
        ).scalar_one()
        if done:
            report.counts[("SUCCEEDED", END)] = int(done)
        if cancelled:
            report.counts[("CANCELLED", "")] = int(cancelled)
        oldest = conn.execute(
            sa.select(sa.func.min(o.created_at)).where(o.status == "READY")
        ).scalar_one()
        if oldest is not None:
            report.oldest_ready_seconds = max(0.0, (now - oldest).total_seconds())
        report.stuck = int(
            conn.execute(
                sa.select(sa.func.count())
                .select_from(schema.outbox)
                .where(o.status == "PROCESSING", o.lease_until < clock.now())
            ).scalar_one()
        )
        recent = conn.execute(
            sa.select(o.created_at, o.projected_at, o.finished_at)
            .where(o.status == "SUCCEEDED")
            .order_by(o.id.desc())
            .limit(window)
        ).all()
    report.projection_lag = Lag.of([(p - c).total_seconds() for c, p, _ in recent if p is not None])
    report.end_to_end_lag = Lag.of([(f - c).total_seconds() for c, _, f in recent if f is not None])
    return report


def list_events(
    db: SyncDatabase,
    *,
    status: str | None = None,
    stage: str | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """Events for people: newest first, filtered by status and next stage."""
    o = schema.outbox.c
    stmt = sa.select(
        o.id,
        o.event_id,
        o.event_type,
        o.aggregate_id,
        o.aggregate_version,
        o.status,
        o.current_stage,
        o.next_stage,
        o.retry_count,
        o.next_attempt_at,
        o.lease_owner,
        o.lease_until,
        o.last_error,
        o.created_at,
        o.projected_at,
        o.finished_at,
    ).order_by(o.id.desc())
    if status:
        stmt = stmt.where(o.status == status)
    if stage:
        stmt = stmt.where(o.next_stage == stage)
    with db.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(stmt.limit(limit))]


__all__ = [
    "CHAINS",
    "END",
    "OUTBOX_MOVES",
    "PUBLISHED",
    "STAGES",
    "STAGE_POLICIES",
    "Lag",
    "OutboxEvent",
    "OutboxStatus",
    "OutboxStatusReport",
    "Outcome",
    "Settled",
    "Stage",
    "StagePolicy",
    "advance",
    "cancel_events",
    "claim",
    "first_stage",
    "list_events",
    "make_owner",
    "move_events",
    "operate",
    "outbox_status",
    "release_stuck",
    "retry_events",
    "settle",
    "sources_of",
    "stage_after",
]
