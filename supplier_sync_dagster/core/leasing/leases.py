"""Shard leases: one writer per shard, checkpoints, heartbeats, and stall detection.

A shard is one city of one batch. A worker owns it through a lease (invariant 1):

- :func:`claim_shard` is one conditional UPDATE (``status='PENDING'``, or ``RUNNING`` with
  ``lease_until`` in the past); a live lease is never taken over.
- Every later write (:meth:`ShardLease.heartbeat`, :meth:`ShardLease.advance`,
  :meth:`ShardLease.finish`, :meth:`ShardLease.release`) carries ``worker_id``,
  ``lease_token`` and ``status='RUNNING'`` in its WHERE clause; 0 rows matched raises
  :class:`LeaseLost`, after which the lease refuses every further write.
- Lease expiry is stored as an expiry time computed by the database's clock (invariant 2).
- :meth:`ShardLease.advance` moves the checkpoint only after (or in the same transaction
  as) the page's data (invariant 3).

Every status change is one guarded move of the shard state machine, whose table of
allowed moves is :data:`~supplier_sync_dagster.core.leasing.shards.SHARD_MOVES`.

:class:`ShardWork` owns a claimed shard's lifecycle: it runs the heartbeat while the work
runs, and decides how the work ends (lease lost, failed, interrupted).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import (
    ClaimLockLost,
    ConfigError,
    InvalidCheckpoint,
    InvalidTransition,
    LeaseLost,
    LeaseNotAcquired,
    SyncCancelled,
    UnknownBatch,
    UnknownShard,
    describe_error,
)
from supplier_sync_dagster.core.leasing.batches import (
    Batch,
    count_finish,
    derive_batch,
    get_batch,
    lock_batch,
    refresh_batch,
)
from supplier_sync_dagster.core.leasing.claim_locks import (
    ClaimLock,
    ClaimLockConfig,
    claim_locks_from_env,
    take_claim_lock,
)
from supplier_sync_dagster.core.leasing.processes import (
    DEFAULT_LEASE_SECONDS,
    MAX_WORKER_ID_LEN,
    holder_is_dead_here,
    make_worker_id,
)
from supplier_sync_dagster.core.leasing.shards import (
    ShardStatus,
    move_shard_returning,
    move_shards,
    sources_of,
)
from supplier_sync_dagster.core.redaction import bounded
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import DbClock, SyncDatabase
from supplier_sync_dagster.core.store.engine import db_now

log = logging.getLogger(__name__)

FinishStatus = Literal["SUCCESS", "FAILED"]

MIN_LEASE_SECONDS = 5.0
MAX_LEASE_SECONDS = 1800.0
MAX_CHECKPOINT_LEN = 1024
# Shards that one claim_next_shard call reads and tries, at most.
CANDIDATES = 50
# A claim takes a PENDING shard, or a RUNNING one whose lease expired.
_CLAIM_SOURCES: tuple[ShardStatus, ...] = ("PENDING", "RUNNING")


@dataclass(frozen=True)
class LeaseSettings:
    """How long a lease lasts and how often it is renewed, and whether claims take a Redis
    claim lock first (:mod:`~supplier_sync_dagster.core.leasing.claim_locks`).

    The default is the seed's: renew every 20 s, a lease of 3 minutes. The heartbeat must
    be at most a third of the lease so that two missed beats still leave the lease alive.
    The claim locks default to what the environment says (``SUPPLIER_SYNC_CLAIM_LOCKS``);
    None turns them off.
    """

    lease_seconds: float = DEFAULT_LEASE_SECONDS
    heartbeat_seconds: float = 20.0
    claim_locks: ClaimLockConfig | None = field(default_factory=claim_locks_from_env)

    def __post_init__(self) -> None:
        if not MIN_LEASE_SECONDS <= self.lease_seconds <= MAX_LEASE_SECONDS:
            raise ConfigError(
                f"lease duration {self.lease_seconds!r} s is out of range: it must be between "
                f"{MIN_LEASE_SECONDS:g} and {MAX_LEASE_SECONDS:g} s (2-5 minutes is typical)"
            )
        if not 0.05 <= self.heartbeat_seconds <= self.lease_seconds / 3:
            raise ConfigError(
                f"heartbeat interval {self.heartbeat_seconds!r} s must be positive and at most a "
                f"third of the lease ({self.lease_seconds / 3:g} s)"
            )


@dataclass(frozen=True)
class Checkpoint:
    """Where a shard's traversal stands: the next page to fetch and how to ask for it.

    Attributes:
        city_code: The shard's city (the supplier's code, verbatim).
        page: The next page number to fetch (1-based).
        cursor: The supplier's cursor for the next page, when it offers cursors.
        last_supplier_hotel_id: The last hotel id of the last committed page.
        done: True once the city's last page is committed.
    """

    city_code: str
    page: int = 1
    cursor: str | None = None
    last_supplier_hotel_id: str | None = None
    done: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.city_code, str) or not self.city_code:
            raise InvalidCheckpoint(f"checkpoint city_code must be a non-empty string: {self!r}")
        if not isinstance(self.page, int) or isinstance(self.page, bool) or self.page < 1:
            raise InvalidCheckpoint(f"checkpoint page must be an integer >= 1: {self!r}")
        for name in ("cursor", "last_supplier_hotel_id"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidCheckpoint(f"checkpoint {name} must be a string or null: {self!r}")
        if not isinstance(self.done, bool):
            raise InvalidCheckpoint(f"checkpoint done must be true or false: {self!r}")

    def to_json(self) -> str:
        """Serializes for the ``checkpoint`` column.

        Raises:
            InvalidCheckpoint: The JSON would not fit the column.
        """
        text = json.dumps(
            {
                "city_code": self.city_code,
                "page": self.page,
                "cursor": self.cursor,
                "last_supplier_hotel_id": self.last_supplier_hotel_id,
                "done": self.done,
            },
            ensure_ascii=False,
            separators=(",", ":"),
        )
        if len(text) > MAX_CHECKPOINT_LEN:
            raise InvalidCheckpoint(
                f"checkpoint for city {self.city_code!r} is {len(text)} characters; "
                f"the limit is {MAX_CHECKPOINT_LEN} (is the cursor unreasonably long?)"
            )
        return text

    @classmethod
    def from_json(cls, text: str) -> Checkpoint:
        """Parses a stored checkpoint.

        Raises:
            InvalidCheckpoint: The text is not a checkpoint object, naming what is wrong.
        """
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as err:
            raise InvalidCheckpoint(
                f"checkpoint is not valid JSON ({err}): {text[:200]!r}"
            ) from None
        if not isinstance(data, dict):
            raise InvalidCheckpoint(f"checkpoint must be a JSON object: {text[:200]!r}")
        unknown = set(data) - {"city_code", "page", "cursor", "last_supplier_hotel_id", "done"}
        if unknown:
            raise InvalidCheckpoint(f"checkpoint has unknown fields {sorted(unknown)}")
        if "city_code" not in data:
            raise InvalidCheckpoint(f"checkpoint lacks city_code: {text[:200]!r}")
        return cls(**data)


@dataclass(frozen=True)
class PageCounts:
    """What became of one page's records. ``total`` always equals the sum of the others."""

    success: int = 0
    failed: int = 0
    skipped: int = 0

    def __post_init__(self) -> None:
        for name in ("success", "failed", "skipped"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"page count {name} must be a non-negative integer: {value!r}")

    @property
    def total(self) -> int:
        """Records fetched on the page."""
        return self.success + self.failed + self.skipped


@dataclass(frozen=True)
class ShardInfo:
    """A shard as stored."""

    shard_id: int
    batch_id: str
    shard_key: str
    status: ShardStatus
    checkpoint: Checkpoint | None
    total_count: int
    success_count: int
    failed_count: int
    skipped_count: int
    pages_done: int
    total_pages: int | None
    fetched_count: int
    claim_count: int
    worker_id: str | None
    lease_until: datetime | None
    heartbeat_at: datetime | None
    last_checkpoint_at: datetime | None
    last_heartbeat_stage: str | None
    error_message: str | None


@dataclass(eq=False, repr=False)
class ShardLease:
    """Ownership of one shard by one worker; every write it makes is fenced.

    Obtain one from :func:`claim_shard` or :func:`claim_next_shard`. Once any write matches
    0 rows the lease is lost for good: every later call raises :class:`LeaseLost` without
    touching the database.
    """

    db: SyncDatabase
    _: KW_ONLY
    shard_id: int
    batch_id: str
    shard_key: str
    worker_id: str
    lease_token: str
    settings: LeaseSettings
    checkpoint: Checkpoint | None
    claim_count: int
    # Whether the city had quality gate overrides when claimed (None: not known).
    gate_overrides: bool | None = field(default=None, init=False)
    # The shard's Redis claim lock, renewed and released with the lease (None: no locks).
    claim_lock: ClaimLock | None = field(default=None, init=False)
    # The batch's shards when this one was claimed (batches only grow): whether a finish
    # may count itself instead of summing them (:func:`.batches.count_finish`).
    batch_shards: int = field(default=0, init=False)
    _lost: threading.Event = field(default_factory=threading.Event, init=False)
    _lost_reason: str = field(default="", init=False)
    _lost_as: type[LeaseLost] = field(default=LeaseLost, init=False)

    def __repr__(self) -> str:
        return (
            f"ShardLease(batch={self.batch_id!r}, shard={self.shard_key!r}, "
            f"worker={self.worker_id!r}, token={self.lease_token[:8]}…, lost={self.lost})"
        )

    @property
    def resumed(self) -> bool:
        """True when this claim continues work that an earlier claim started."""
        return self.claim_count > 1

    @property
    def lost(self) -> bool:
        """True once a fenced write found that this worker no longer owns the shard."""
        return self._lost.is_set()

    def ensure_held(self) -> None:
        """Raises :class:`LeaseLost` if the lease is known to be lost (no database call)."""
        if self._lost.is_set():
            raise self._lost_as(self._lost_reason)

    def mark_lost(self, reason: str, *, expected: bool = False) -> None:
        """Records that the lease is lost (or given up); every later write refuses to run."""
        if not self._lost.is_set():
            self._lost_reason = reason
            self._lost.set()
            if not expected:
                log.warning("LEASE_LOST %s", reason)
            if self.claim_lock is not None:
                self.claim_lock.release()

    def heartbeat(self, stage: str = "RUNNING", message: str = "") -> None:
        """Renews the lease, then its Redis claim lock, and reports what the worker is doing.

        Raises:
            LeaseLost: Another worker owns the shard or the batch was cancelled.
            ClaimLockLost: The claim lock expired or another worker holds it: the lease was
                given back (RUNNING -> PENDING, checkpoint kept) and the work must stop.
        """
        now = self.db.clock.now()
        with self.db.begin() as conn:
            self._fenced(
                conn,
                heartbeat_at=now,
                lease_until=self.db.clock.now(self.settings.lease_seconds),
                last_heartbeat_stage=stage[:64],
                last_heartbeat_message=bounded(message, 512),
                updated_at=now,
            )
        if self.claim_lock is not None and self.claim_lock.renew() == "LOST":
            self._give_up_for_lock()

    def _give_up_for_lock(self) -> None:
        reason = (
            f"shard {self.shard_key!r} of batch {self.batch_id}: worker {self.worker_id} no "
            "longer holds its Redis claim lock (it expired or another worker holds it); the "
            "work stops and the lease is given back"
        )
        log.warning("CLAIM_LOCK_LOST %s", reason)
        self._lost_as = ClaimLockLost
        try:
            self.release(reason)
        except Exception as err:  # the lease then expires on its own
            log.warning("could not release shard %r: %s", self.shard_key, err)
        self.mark_lost(reason)
        raise ClaimLockLost(reason)

    def advance(
        self,
        checkpoint: Checkpoint,
        counts: PageCounts,
        *,
        total_pages: int | None = None,
        fetched: int = 0,
        message: str = "",
        conn: Connection | None = None,
    ) -> None:
        """Moves the checkpoint past a committed page, with its counts, progress and a heartbeat.

        One fenced UPDATE. Pass ``conn`` to run it inside the transaction that writes the
        page's data, so that data and checkpoint commit together and a lost lease rolls back
        the page as well; otherwise call it only after that transaction has committed.

        Raises:
            InvalidCheckpoint: The checkpoint is for another city or does not fit.
            LeaseLost: Another worker owns the shard or the batch was cancelled.
        """
        if checkpoint.city_code != self.shard_key:
            raise InvalidCheckpoint(
                f"checkpoint for city {checkpoint.city_code!r} given to shard {self.shard_key!r}"
            )
        message = (message or f"city={self.shard_key} next page={checkpoint.page}")[:512]
        if conn is not None:
            self._advance_in(conn, checkpoint, counts, total_pages, fetched, message)
        else:
            with self.db.begin() as own:
                self._advance_in(own, checkpoint, counts, total_pages, fetched, message)
        self.checkpoint = checkpoint

    def _advance_in(
        self,
        conn: Connection,
        checkpoint: Checkpoint,
        counts: PageCounts,
        total_pages: int | None,
        fetched: int,
        message: str,
    ) -> None:
        """:meth:`advance`'s guarded move in ``conn``: one statement built once, since a
        page's transaction holds SQLite's write lock while it runs. When it matches no row,
        the generic guarded move runs instead: it raises :class:`LeaseLost`, saying why."""
        self.ensure_held()
        params = {
            **self._holder_params(),
            "new_checkpoint": checkpoint.to_json(),
            "add_total": counts.total,
            "add_success": counts.success,
            "add_failed": counts.failed,
            "add_skipped": counts.skipped,
            "add_fetched": fetched,
            "new_total_pages": total_pages,
            "message": message,
        }
        if int(conn.execute(_checkpoint_move(), params).rowcount) == 1:
            return
        clock, c = self.db.clock, schema.shard.c
        values: dict[str, Any] = {
            "checkpoint": params["new_checkpoint"],
            "total_count": c.total_count + counts.total,
            "success_count": c.success_count + counts.success,
            "failed_count": c.failed_count + counts.failed,
            "skipped_count": c.skipped_count + counts.skipped,
            "pages_done": c.pages_done + 1,
            "fetched_count": c.fetched_count + fetched,
            "heartbeat_at": clock.now(),
            "lease_until": clock.now(self.settings.lease_seconds),
            "last_checkpoint_at": clock.now(),
            "last_heartbeat_stage": "CHECKPOINTING",
            "last_heartbeat_message": message,
            "updated_at": clock.now(),
        }
        if total_pages is not None:
            values["total_pages"] = total_pages
        self._fenced(conn, **values)

    def fence(self, conn: Connection, stage: str, message: str = "") -> None:
        """A fenced heartbeat inside the caller's transaction.

        Every write transaction of a shard's work calls this: if the lease is lost the
        transaction fails with :class:`LeaseLost` and its writes roll back with it. A bulk
        transaction calls it last, as :meth:`finish_in` does: on InnoDB the shard's row is
        then locked only until the commit, so several processes publishing one shard's
        chunks do not queue on it.
        """
        self._fenced(
            conn,
            heartbeat_at=self.db.clock.now(),
            lease_until=self.db.clock.now(self.settings.lease_seconds),
            last_heartbeat_stage=stage[:64],
            last_heartbeat_message=bounded(message, 512),
            updated_at=self.db.clock.now(),
        )

    def finish(
        self,
        status: FinishStatus = "SUCCESS",
        error_message: str | None = None,
        *,
        counts: PageCounts | None = None,
    ) -> Batch:
        """Ends the shard and re-derives its batch; returns the batch as it now stands.

        Args:
            status: SUCCESS or FAILED.
            error_message: Why it failed.
            counts: The final outcome of every record of the shard, replacing the counts
                accumulated by :meth:`advance` (for work whose outcome is known only at the end).

        Raises:
            ConfigError: ``status`` is not SUCCESS or FAILED.
            LeaseLost: Another worker owns the shard or the batch was cancelled.
        """
        if status not in ("SUCCESS", "FAILED"):
            raise ConfigError(f"a shard finishes as SUCCESS or FAILED, not {status!r}")
        totals: dict[str, Any] = (
            {
                "total_count": counts.total,
                "success_count": counts.success,
                "failed_count": counts.failed,
                "skipped_count": counts.skipped,
            }
            if counts is not None
            else {}
        )
        batch = self._end(
            status,
            "FINISHED",
            f"finished {status}",
            finished_at=self.db.clock.now(),
            error_message=(error_message or None) and bounded(error_message),
            **totals,
        )
        assert batch is not None  # _end re-derives the batch unless told not to
        self.mark_lost(f"shard {self.shard_key!r} already finished", expected=True)
        return batch

    def finish_in(
        self,
        conn: Connection,
        status: FinishStatus,
        error_message: str | None = None,
        *,
        counts: PageCounts,
    ) -> None:
        """:meth:`finish` inside the caller's transaction, which then holds the shard's
        last writes (a city's last publish, or a gated city's profile) with its end.

        The fenced UPDATE comes after the batch lock and after the caller's writes: a lost
        lease fails it and rolls the whole transaction back. The caller writes nothing
        fenced before it (a fence takes the shard's row lock before the batch's, the
        reverse of every other order) and calls :meth:`mark_lost` (``expected=True``) once
        the transaction has committed; the batch is not read back.

        Raises:
            ConfigError: ``status`` is not SUCCESS or FAILED.
            LeaseLost: Another worker owns the shard or the batch was cancelled.
        """
        if status not in ("SUCCESS", "FAILED"):
            raise ConfigError(f"a shard finishes as SUCCESS or FAILED, not {status!r}")
        self.ensure_held()
        # SQLite: the transaction holds the one write lock from its start; the batch is
        # read with its shards' counts, after this shard's end.
        batch = self.batch_id if self.db.dialect == "sqlite" else lock_batch(conn, self.batch_id)
        error = (error_message or None) and bounded(error_message)
        totals = {
            "total_count": counts.total,
            "success_count": counts.success,
            "failed_count": counts.failed,
            "skipped_count": counts.skipped,
        }
        params = {
            **self._holder_params(),
            **totals,
            "new_status": status,
            "message": f"finished {status}",
            "error": error,
        }
        # One statement built once (the shard's last transaction holds SQLite's write
        # lock); when it matches no row, the generic guarded move raises LeaseLost.
        if int(conn.execute(_finish_move(), params).rowcount) != 1:
            self._fenced(
                conn,
                status,
                lease_until=None,
                last_heartbeat_stage="FINISHED",
                last_heartbeat_message=params["message"],
                updated_at=self.db.clock.now(),
                finished_at=self.db.clock.now(),
                error_message=error,
                **totals,
            )
        shards = self.batch_shards if isinstance(batch, str) else batch.shard_count
        if not count_finish(conn, self.db.clock, self.batch_id, shards):
            derive_batch(conn, self.db.clock, batch)

    def _holder_params(self) -> dict[str, Any]:
        """The parameters of a move built once (:func:`_held`, :func:`_now`): this holder,
        and the database clock's offsets for now and for the lease's expiry."""
        offset = self.db.clock.offset_seconds
        return {
            "shard_id": self.shard_id,
            "holder_worker": self.worker_id,
            "holder_token": self.lease_token,
            "now_us": round(offset * 1_000_000),
            "until_us": round((offset + self.settings.lease_seconds) * 1_000_000),
        }

    def release(self, reason: str = "released") -> None:
        """Gives the shard back (RUNNING → PENDING), keeping its checkpoint, for a quick resume.

        Raises:
            LeaseLost: Another worker already owns the shard.
        """
        self._end("PENDING", "RELEASED", reason, refresh=False)
        self.mark_lost(f"shard {self.shard_key!r} was released: {reason}", expected=True)

    def refresh_batch(self) -> Batch:
        """Re-derives the batch's counts and progress (called by the heartbeat runner); fenced
        after the batch's lock, so a worker that lost the lease writes nothing to its batch.

        Raises:
            LeaseLost: Another worker owns the shard or the batch was cancelled.
        """
        with self.db.begin() as conn:
            batch = refresh_batch(conn, self.db.clock, self.batch_id)
            self._fenced(conn, updated_at=self.db.clock.now())
            return batch

    def _end(
        self,
        target: ShardStatus,
        stage: str,
        message: str,
        *,
        refresh: bool = True,
        **values: Any,
    ) -> Batch | None:
        """Moves the shard out of RUNNING under the batch lock; re-derives the batch if asked."""
        self.ensure_held()
        with self.db.begin() as conn:
            batch = lock_batch(conn, self.batch_id)
            self._fenced(
                conn,
                target,
                lease_until=None,
                last_heartbeat_stage=stage,
                last_heartbeat_message=bounded(message, 512),
                updated_at=self.db.clock.now(),
                **values,
            )
            if not refresh:
                return None
            derive_batch(conn, self.db.clock, batch)
            return get_batch(conn, self.batch_id)

    def _fenced(self, conn: Connection, target: ShardStatus = "RUNNING", **values: Any) -> None:
        self.ensure_held()

        def lost() -> LeaseLost:
            reason = (
                f"shard {self.shard_key!r} of batch {self.batch_id}: worker {self.worker_id} "
                f"(lease {self.lease_token[:8]}) no longer owns it; it was reclaimed after "
                "the lease expired, released, finished, or the batch was cancelled"
            )
            self.mark_lost(reason)
            return LeaseLost(reason)

        move_shards(
            conn,
            target,
            [schema.shard.c.id == self.shard_id],
            sources=["RUNNING"],
            holder=(self.worker_id, self.lease_token),
            on_miss=lost,
            **values,
        )


def _held() -> sa.ColumnElement[bool]:
    """The shard that its holder's move may write: RUNNING, and held by the holder."""
    c = schema.shard.c
    return sa.and_(
        c.id == sa.bindparam("shard_id"),
        c.status == "RUNNING",
        c.worker_id == sa.bindparam("holder_worker"),
        c.lease_token == sa.bindparam("holder_token"),
    )


def _now(name: str = "now_us") -> db_now:
    """The database's time plus the offset in parameter ``name``."""
    return db_now(sa.bindparam(name, type_=sa.BigInteger()))


@functools.cache
def _checkpoint_move() -> sa.Update:
    """The checkpoint's RUNNING -> RUNNING move of its holder (:meth:`ShardLease.advance`),
    with every value a parameter: built and compiled once."""
    if "RUNNING" not in sources_of("RUNNING"):
        raise InvalidTransition("a shard's holder writes RUNNING -> RUNNING")
    c = schema.shard.c
    return (
        sa.update(schema.shard)
        .where(_held())
        .values(
            checkpoint=sa.bindparam("new_checkpoint"),
            total_count=c.total_count + sa.bindparam("add_total"),
            success_count=c.success_count + sa.bindparam("add_success"),
            failed_count=c.failed_count + sa.bindparam("add_failed"),
            skipped_count=c.skipped_count + sa.bindparam("add_skipped"),
            pages_done=c.pages_done + 1,
            fetched_count=c.fetched_count + sa.bindparam("add_fetched"),
            total_pages=sa.func.coalesce(
                sa.bindparam("new_total_pages", type_=sa.Integer()), c.total_pages
            ),
            heartbeat_at=_now(),
            lease_until=_now("until_us"),
            last_checkpoint_at=_now(),
            last_heartbeat_stage="CHECKPOINTING",
            last_heartbeat_message=sa.bindparam("message"),
            updated_at=_now(),
        )
    )


@functools.cache
def _finish_move() -> sa.Update:
    """A holder's RUNNING -> SUCCESS | FAILED move (:meth:`ShardLease.finish_in`), with
    every value a parameter: built and compiled once."""
    if any("RUNNING" not in sources_of(end) for end in ("SUCCESS", "FAILED")):
        raise InvalidTransition("a shard's holder finishes it from RUNNING")
    return (
        sa.update(schema.shard)
        .where(_held())
        .values(
            status=sa.bindparam("new_status"),
            lease_until=None,
            last_heartbeat_stage="FINISHED",
            last_heartbeat_message=sa.bindparam("message"),
            updated_at=_now(),
            finished_at=_now(),
            error_message=sa.bindparam("error", type_=sa.String(1024)),
            total_count=sa.bindparam("total_count"),
            success_count=sa.bindparam("success_count"),
            failed_count=sa.bindparam("failed_count"),
            skipped_count=sa.bindparam("skipped_count"),
        )
    )


def claim_shard(
    db: SyncDatabase,
    batch_id: str,
    shard_key: str,
    *,
    worker_id: str,
    settings: LeaseSettings | None = None,
    reclaim_dead_local: bool = True,
) -> ShardLease:
    """Claims one shard: PENDING, or RUNNING whose lease has expired (a reclaim).

    With ``reclaim_dead_local``, a live lease whose holder is a process of this host that
    provably no longer runs (:func:`holder_is_dead_here`) is taken over at once, by a
    conditional UPDATE on that exact holder and token, instead of waiting for expiry.

    With claim locks (``settings.claim_locks``), the shard's Redis lock is taken first
    and the database is not asked while another worker holds it; a failed claim deletes
    the lock again. Without Redis the database alone decides.

    Returns:
        The lease, carrying the stored checkpoint to resume from (None: start at page 1).

    Raises:
        UnknownShard: The batch has no shard with this key.
        LeaseNotAcquired: A live lease holds it, it is finished or cancelled, or another
            worker claimed it first; ``ClaimLockHeld`` when another holds its claim lock.
    """
    settings = settings or LeaseSettings()
    _check_worker_id(worker_id)
    token = str(uuid.uuid4())
    lock = take_claim_lock(
        settings.claim_locks,
        batch_id,
        shard_key,
        f"{worker_id}:{token}",
        ttl_seconds=settings.lease_seconds,
        holder_is_dead=holder_is_dead_here if reclaim_dead_local else None,
    )
    try:
        lease = _claim_in_db(
            db, settings, batch_id, shard_key, worker_id, token, reclaim_dead_local
        )
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    lease.claim_lock = lock
    return lease


@dataclass(frozen=True)
class _Claim:
    """One claim's request: who claims which shard, and the conditional UPDATE's parts."""

    batch_id: str
    shard_key: str
    worker_id: str
    token: str
    settings: LeaseSettings
    reclaim_dead_local: bool
    where: list[sa.ColumnElement[bool]]
    values: dict[str, Any]


def _claim_in_db(
    db: SyncDatabase,
    settings: LeaseSettings,
    batch_id: str,
    shard_key: str,
    worker_id: str,
    token: str,
    reclaim_dead_local: bool,
) -> ShardLease:
    """:func:`claim_shard`'s conditional UPDATE, and the batch's start with its first claim."""
    clock = db.clock
    c = schema.shard.c
    claim = _Claim(
        batch_id,
        shard_key,
        worker_id,
        token,
        settings,
        reclaim_dead_local,
        where=[c.batch_id == batch_id, c.shard_key == shard_key, _claimable(clock)],
        values={
            "worker_id": worker_id,
            "lease_token": token,
            "lease_until": clock.now(settings.lease_seconds),
            "heartbeat_at": clock.now(),
            "started_at": sa.func.coalesce(c.started_at, clock.now()),
            "claim_count": c.claim_count + 1,
            "last_heartbeat_stage": "CLAIMED",
            "last_heartbeat_message": f"claimed by {worker_id}"[:512],
            "updated_at": clock.now(),
        },
    )
    started = None if db.dialect == "sqlite" else _claim_in_started_batch(db, claim)
    info, overridden, batch_shards = started or _claim_in_any_batch(db, claim)
    lease = ShardLease(
        db,
        shard_id=info.shard_id,
        batch_id=batch_id,
        shard_key=shard_key,
        worker_id=worker_id,
        lease_token=token,
        settings=settings,
        checkpoint=info.checkpoint,
        claim_count=info.claim_count,
    )
    lease.gate_overrides = overridden
    lease.batch_shards = batch_shards
    log.info(
        "claimed shard %r of batch %s as %s (claim #%d, resume from %s)",
        shard_key,
        batch_id,
        worker_id,
        info.claim_count,
        info.checkpoint,
    )
    return lease


def _claim_in_started_batch(db: SyncDatabase, claim: _Claim) -> tuple[ShardInfo, bool, int] | None:
    """A claim of a shard of a started batch on a server database, without the batch's lock.

    A batch that has started stays started (RUNNING, or finished with its start kept), so
    such a claim changes nothing of the batch and need not queue behind the batch's other
    claims and finishes. It is the conditional UPDATE, which locks this one shard row, and
    a read back that locks nothing: it never waits for a lock while it holds one, so it
    cannot close a cycle with a transaction that locks the batch and then this shard.

    Returns:
        The claimed shard, whether it has gate overrides, and the batch's shards; None,
        having changed nothing, when the shard was not claimed or the batch had not
        started. The locked claim then decides, and says why.
    """
    s = schema.shard.c
    with db.engine.connect() as conn, conn.begin() as tx:
        if move_shards(conn, "RUNNING", claim.where, sources=_CLAIM_SOURCES, **claim.values):
            row = conn.execute(
                sa.select(*_claimed_columns(claim.batch_id, claim.shard_key)).where(
                    s.batch_id == claim.batch_id, s.shard_key == claim.shard_key
                )
            ).one()
            if row.batch_status not in (None, "PENDING"):
                return _shard_info(row), bool(row.has_gate_overrides), int(row.batch_shards)
        tx.rollback()
    return None


def _claim_in_any_batch(db: SyncDatabase, claim: _Claim) -> tuple[ShardInfo, bool, int]:
    """A claim under the batch's lock (SQLite's write lock): it starts a PENDING batch,
    takes a shard from a dead local holder, and says why a shard cannot be claimed.

    Raises:
        UnknownBatch, LeaseNotAcquired: See :func:`claim_shard`.
    """
    clock = db.clock
    with db.begin() as conn:
        moved = None
        if db.dialect == "sqlite":
            # The transaction holds SQLite's one write lock from its start (BEGIN
            # IMMEDIATE), the batch's too: the claim reads the shard and the batch back in
            # its own statement. A missed claim reads them as below, to say why.
            moved = move_shard_returning(
                conn,
                "RUNNING",
                claim.where,
                _claimed_columns(claim.batch_id, claim.shard_key),
                sources=_CLAIM_SOURCES,
                **claim.values,
            )
        if moved is not None:
            if moved.batch_status is None:
                raise UnknownBatch(f"unknown batch {claim.batch_id!r}")
            info, overridden = _shard_info(moved), bool(moved.has_gate_overrides)
            batch_pending = moved.batch_status == "PENDING"
            batch_shards = int(moved.batch_shards or 0)
        else:
            info, overridden, batch_pending, batch_shards = _claim_locked(conn, db, claim)
        if batch_pending:  # read under the batch lock: it cannot change meanwhile
            conn.execute(
                sa.update(schema.batch)
                .where(
                    schema.batch.c.batch_id == claim.batch_id, schema.batch.c.status == "PENDING"
                )
                .values(status="RUNNING", started_at=clock.now(), updated_at=clock.now())
            )
    return info, overridden, batch_shards


def _claim_locked(
    conn: Connection, db: SyncDatabase, claim: _Claim
) -> tuple[ShardInfo, bool, bool, int]:
    """A claim under the batch lock: the move (unless SQLite's already missed), the read of
    the shard, and a dead local holder's reclaim.

    Returns:
        The claimed shard, whether it has gate overrides, whether the batch is PENDING, and
        its shards.

    Raises:
        LeaseNotAcquired: The shard cannot be claimed (see :func:`claim_shard`).
    """
    clock = db.clock
    c = schema.shard.c
    batch_id, shard_key = claim.batch_id, claim.shard_key
    batch = lock_batch(conn, batch_id)
    claimed = 0
    if db.dialect != "sqlite":
        claimed = move_shards(conn, "RUNNING", claim.where, sources=_CLAIM_SOURCES, **claim.values)
    info, overridden = _read_claimed(conn, batch_id, shard_key)
    if (
        not claimed
        and claim.reclaim_dead_local
        and info.status == "RUNNING"
        and info.worker_id
        and holder_is_dead_here(info.worker_id)
    ):
        old_token = conn.execute(sa.select(c.lease_token).where(c.id == info.shard_id)).scalar_one()
        claimed = move_shards(
            conn,
            "RUNNING",
            [c.id == info.shard_id],
            sources=["RUNNING"],
            holder=(info.worker_id, old_token),
            worker_id=claim.worker_id,
            lease_token=claim.token,
            lease_until=clock.now(claim.settings.lease_seconds),
            heartbeat_at=clock.now(),
            claim_count=c.claim_count + 1,
            last_heartbeat_stage="CLAIMED",
            last_heartbeat_message=f"taken from dead {info.worker_id}"[:512],
            updated_at=clock.now(),
        )
        if claimed:
            log.warning("took shard %r from dead local worker %s", shard_key, info.worker_id)
            info, overridden = _read_claimed(conn, batch_id, shard_key)
    if not claimed:
        raise LeaseNotAcquired(_why_not_claimable(conn, db, batch_id, shard_key, info), shard=info)
    return info, overridden, batch.status == "PENDING", batch.shard_count


def claim_next_shard(
    db: SyncDatabase,
    batch_id: str,
    *,
    worker_id: str,
    settings: LeaseSettings | None = None,
) -> ShardLease | None:
    """Claims any claimable shard of a batch (PENDING first, then expired); None if none is.

    A candidate whose claim lock another worker holds is skipped without a database claim.
    """
    settings = settings or LeaseSettings()
    c = schema.shard.c
    # Two reads in index order (status; status and lease_until) that stop at the first
    # candidates, rather than one that sorts every claimable shard of the batch per call.
    pending = sa.select(c.shard_key).where(c.batch_id == batch_id, c.status == "PENDING")
    expired = sa.select(c.shard_key).where(
        c.batch_id == batch_id, c.status == "RUNNING", c.lease_until < db.clock.now()
    )
    with db.engine.connect() as conn:
        candidates = list(conn.execute(pending.order_by(c.id).limit(CANDIDATES)).scalars())
        if len(candidates) < CANDIDATES:
            more = expired.order_by(c.id).limit(CANDIDATES - len(candidates))
            candidates += conn.execute(more).scalars()
    for key in candidates:
        try:
            return claim_shard(db, batch_id, key, worker_id=worker_id, settings=settings)
        except LeaseNotAcquired:
            continue  # another worker won this one (or is taking it); try the next
    return None


def reopen_shard(db: SyncDatabase, batch_id: str, shard_key: str, reason: str) -> Batch:
    """Puts a FAILED shard back to PENDING, keeping its checkpoint, so a retry resumes it.

    Raises:
        UnknownShard: No such shard.
        InvalidTransition: The shard is not FAILED.
    """
    clock = db.clock
    with db.begin() as conn:
        lock_batch(conn, batch_id)
        info = _read_shard(conn, batch_id, shard_key)
        move_shards(
            conn,
            "PENDING",
            [schema.shard.c.id == info.shard_id],
            sources=["FAILED"],
            on_miss=lambda: InvalidTransition(
                f"shard {shard_key!r} of batch {batch_id} is {info.status}; only FAILED reopens"
            ),
            finished_at=None,
            last_heartbeat_stage="REOPENED",
            last_heartbeat_message=bounded(reason, 512),
            updated_at=clock.now(),
        )
        return refresh_batch(conn, clock, batch_id)


def get_shard(db: SyncDatabase, batch_id: str, shard_key: str) -> ShardInfo:
    """Reads a shard.

    Raises:
        UnknownShard: No such shard.
        InvalidCheckpoint: Its stored checkpoint is malformed.
    """
    with db.engine.connect() as conn:
        return _read_shard(conn, batch_id, shard_key)


def list_shards(db: SyncDatabase, batch_id: str) -> list[ShardInfo]:
    """All shards of a batch, in creation order."""
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(schema.shard)
            .where(schema.shard.c.batch_id == batch_id)
            .order_by(schema.shard.c.id)
        )
        return [_shard_info(row) for row in rows]


StallKind = Literal["CHECKPOINT_STALLED", "LEASE_EXPIRED"]


@dataclass(frozen=True)
class Stall:
    """A RUNNING shard that is not making progress."""

    kind: StallKind
    batch_id: str
    shard_key: str
    worker_id: str | None
    heartbeat_at: datetime | None
    last_checkpoint_at: datetime | None
    lease_until: datetime | None
    seconds_since_checkpoint: float
    message: str | None


# The stages of a shard that waits for the supplier: claimed, or between two pages.
WAITING_FOR_SUPPLIER_STAGES = ("CLAIMED", "FETCHING", "CHECKPOINTING")
# How long a walk may wait for one page before it counts as stalled (find_stalls): two of
# the supplier client's request deadlines (60 s each by default), so a page retried once
# after a timeout is slow, not stuck.
FETCH_STALL_SECONDS = 120.0


def find_stalls(
    db: SyncDatabase,
    *,
    checkpoint_stall_seconds: float = 600.0,
    heartbeat_fresh_seconds: float = 90.0,
    fetch_stall_seconds: float | None = None,
    limit: int = 500,
) -> list[Stall]:
    """Finds RUNNING shards that are stuck.

    - CHECKPOINT_STALLED: the heartbeat is fresh (the worker lives) but the checkpoint has
      not moved for ``checkpoint_stall_seconds``; or, while the shard waits for the
      supplier's next page (its stage is one of :data:`WAITING_FOR_SUPPLIER_STAGES`), for
      ``fetch_stall_seconds``: longer than the client's bounds let one page take (its
      request deadline, retries and their waits), so the walk is stuck, not slow. Do not
      reclaim these: the worker may be slow, not dead; alert instead.
    - LEASE_EXPIRED: the lease ran out (the worker died); any worker may reclaim it.
    """
    fetch = 1.0 if fetch_stall_seconds is None else fetch_stall_seconds
    thresholds = (checkpoint_stall_seconds, heartbeat_fresh_seconds, fetch)
    if min(thresholds) <= 0:
        raise ConfigError("stall thresholds must be positive numbers of seconds")
    c = schema.shard.c
    clock = db.clock
    progress_at = sa.func.coalesce(c.last_checkpoint_at, c.started_at)
    expired = c.lease_until < clock.now()
    behind = progress_at < clock.now(-checkpoint_stall_seconds)
    if fetch_stall_seconds is not None:
        behind = sa.or_(
            behind,
            sa.and_(
                c.last_heartbeat_stage.in_(WAITING_FOR_SUPPLIER_STAGES),
                progress_at < clock.now(-fetch_stall_seconds),
            ),
        )
    stalled = sa.and_(
        c.lease_until >= clock.now(),
        c.heartbeat_at >= clock.now(-heartbeat_fresh_seconds),
        behind,
    )
    with db.engine.connect() as conn:
        now = clock.read(conn)
        rows = conn.execute(
            sa.select(schema.shard)
            .where(c.status == "RUNNING", sa.or_(expired, stalled))
            .order_by(progress_at)
            .limit(limit)
        ).all()
    out = []
    for row in rows:
        last = row.last_checkpoint_at or row.started_at
        out.append(
            Stall(
                kind="LEASE_EXPIRED" if row.lease_until < now else "CHECKPOINT_STALLED",
                batch_id=row.batch_id,
                shard_key=row.shard_key,
                worker_id=row.worker_id,
                heartbeat_at=row.heartbeat_at,
                last_checkpoint_at=row.last_checkpoint_at,
                lease_until=row.lease_until,
                seconds_since_checkpoint=(now - last).total_seconds() if last else 0.0,
                message=row.last_heartbeat_message,
            )
        )
    return out


class HeartbeatRunner:
    """Renews a lease independently of page processing, from the process's heartbeat thread.

    Use as a context manager around a shard's work. The worker calls :meth:`report` to say
    what it is doing and :meth:`check` between pages (or anywhere) to stop as soon as the
    lease is lost. If renewals keep failing (the database is unreachable) until the lease
    could have expired, the runner declares the lease lost too: another worker may own the
    shard by then.

    Every runner of a process is renewed by one daemon thread (:class:`_Heartbeats`), each
    at its own interval: a city does not start a thread of its own. Once :meth:`stop` has
    returned, the lease is renewed no more.

    Args:
        lease: The lease to renew.
        on_lost: Called once, from the heartbeat thread, when the lease is lost.
        refresh_batch_every: Re-derive the batch's progress every this many beats (0: never).
        monotonic: The local timer that measures how long renewals have been failing.
    """

    def __init__(
        self,
        lease: ShardLease,
        *,
        on_lost: Callable[[LeaseLost], None] | None = None,
        refresh_batch_every: int = 1,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lease = lease
        self._monotonic = monotonic
        self.interval = lease.settings.heartbeat_seconds
        self._on_lost = on_lost
        self._refresh_every = refresh_batch_every
        self._stage = "RUNNING"
        self._message = ""
        # Held while a beat runs: stop() waits for a beat in flight before it returns.
        self._beating = threading.RLock()
        self._stopped = False
        self._started = False
        self._last_ok = 0.0
        self.beats = 0
        self.failures = 0

    def __enter__(self) -> HeartbeatRunner:
        self._last_ok = self._monotonic()
        self._started = True
        _heartbeats.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """True while the lease is renewed: entered, not stopped, and not lost by a beat."""
        return self._started and not self._stopped

    def stop(self) -> None:
        """Stops renewing the lease; waits for a renewal in flight."""
        self._stopped = True
        _heartbeats.remove(self)
        if self._beating.acquire(timeout=max(5.0, self.interval * 2)):
            self._beating.release()

    def report(self, stage: str, message: str = "") -> None:
        """Sets the stage and message that the next heartbeat reports."""
        self._stage, self._message = stage, message

    def check(self) -> None:
        """Raises :class:`LeaseLost` if the lease is lost; cheap, no database call."""
        self.lease.ensure_held()

    @property
    def lost(self) -> bool:
        """True once the lease is lost."""
        return self.lease.lost

    def beat(self) -> bool:
        """One renewal (from the heartbeat thread); False once the lease needs no more."""
        with self._beating:
            if self._stopped:
                return False
            if not self._renew():
                self._stopped = True
                return False
            return True

    def _renew(self) -> bool:
        try:
            self.lease.heartbeat(self._stage, self._message)
        except LeaseLost as err:
            self._lose(err)
            return False
        except Exception as err:
            # A database outage: keep trying while the lease may still be ours.
            self.failures += 1
            log.warning("heartbeat for shard %r failed: %s", self.lease.shard_key, err)
            margin = self.lease.settings.lease_seconds - self.interval
            failing_for = self._monotonic() - self._last_ok
            if failing_for >= margin:
                reason = (
                    f"shard {self.lease.shard_key!r}: heartbeat failed for "
                    f"{failing_for:.0f} s, the lease may have expired ({err})"
                )
                self.lease.mark_lost(reason)
                self._lose(LeaseLost(reason))
                return False
            return True
        self._last_ok = self._monotonic()
        self.beats += 1
        if self._refresh_every and self.beats % self._refresh_every == 0:
            try:
                self.lease.refresh_batch()
            except LeaseLost as err:
                self._lose(err)
                return False
            except Exception as err:  # progress display only; never stop the work for it
                log.warning("batch refresh failed: %s", err)
        return True

    def _lose(self, err: LeaseLost) -> None:
        if self._on_lost is not None:
            self._on_lost(err)


class _Heartbeats:
    """The one daemon thread of a process that renews every running :class:`HeartbeatRunner`.

    Each runner beats every ``interval`` seconds after its previous beat ended, as a thread
    of its own would. The thread starts with the first runner and then waits, idle, for the
    next; a forked process starts with no runner (its parent's leases are not its own).
    """

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._changed = threading.Condition()
        self._due: dict[HeartbeatRunner, float] = {}
        self._thread: threading.Thread | None = None

    def add(self, runner: HeartbeatRunner) -> None:
        """Renews ``runner``'s lease from now on, its first beat one interval from now."""
        with self._changed:
            self._due[runner] = time.monotonic() + runner.interval
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
                self._thread.start()
            self._changed.notify()

    def remove(self, runner: HeartbeatRunner) -> None:
        """Renews ``runner``'s lease no more (a beat in flight ends on its own)."""
        with self._changed:
            self._due.pop(runner, None)

    def _run(self) -> None:
        changed = self._changed
        while True:
            with changed:
                now = time.monotonic()
                due = [r for r, at in self._due.items() if at <= now]
                if not due:
                    changed.wait(min(self._due.values()) - now if self._due else None)
                    continue
            for runner in due:
                again = runner.beat()
                with changed:
                    if runner not in self._due:
                        continue
                    if again:
                        self._due[runner] = time.monotonic() + runner.interval
                    else:
                        del self._due[runner]


_heartbeats = _Heartbeats()


class ShardWork:
    """The lease lifecycle of a claimed shard's work: the one place that decides how it ends.

    Use as ``with ShardWork(lease) as heartbeat:`` around the work; the heartbeat thread
    renews the lease meanwhile, and the work reports its stage and checks the lease through
    it. The work finishes the shard itself (its counts, or a gate's FAILED). How the block
    ends decides what is written and what the caller sees:

    - it completes: nothing more is written;
    - the lease is lost (:class:`LeaseLost`, or any exception once the lease is lost, which
      the loss caused or made moot): nothing more is written; the exception is suppressed
      and kept in :attr:`lost`, and the caller reports the city as LEASE_LOST;
    - any other exception: the shard finishes FAILED with ``"CODE: what happened"``
      (:func:`~supplier_sync_dagster.core.errors.describe_error`, also kept in :attr:`error`)
      and the exception propagates; if that fenced finish finds the lease lost, another
      worker owns the shard and its outcome stands: the work ends as a lost lease (the
      exception is suppressed, the LeaseLost kept in :attr:`lost`), so a stale worker files
      no failure for a city someone else completes;
    - an interruption (KeyboardInterrupt, SystemExit, a closed generator; a run terminated
      from the Dagster UI): the lease is released (RUNNING -> PENDING, checkpoint kept) so
      another worker can resume at once; if the release fails the lease expires on its own;
      the interruption propagates. A cancellation (``SyncCancelled``: the batch was
      cancelled, its shards with it) writes nothing.

    In every case the heartbeat stops.

    Attributes:
        lease: The lease worked under.
        heartbeat: Its heartbeat runner (the value of the ``with``).
        lost: The exception that stopped the work once the lease was lost, else None.
        error: ``"CODE: what happened"`` of the exception that failed the shard, else None.
    """

    def __init__(self, lease: ShardLease) -> None:
        self.lease = lease
        self.heartbeat = HeartbeatRunner(lease)
        self.lost: Exception | None = None
        self.error: str | None = None

    def __enter__(self) -> HeartbeatRunner:
        return self.heartbeat.__enter__()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> bool:
        try:
            return exc is not None and self._end(exc)
        finally:
            self.heartbeat.stop()

    def _end(self, exc: BaseException) -> bool:
        """Writes how the work ended; True suppresses ``exc`` (only a lost lease)."""
        lease = self.lease
        if isinstance(exc, Exception):
            if isinstance(exc, LeaseLost) or lease.lost:
                self.lost = exc
                log.warning("shard %r stopped: %s", lease.shard_key, exc)
                return True
            error = describe_error(exc)
            try:
                lease.finish("FAILED", error)
            except LeaseLost as err:
                # Another worker owns the shard: its outcome stands, and this failure is the
                # stale worker's; it neither fails the city nor files its ticket.
                self.lost = err
                log.warning(
                    "shard %r failed after its lease was lost (%s): %s", lease.shard_key, error, err
                )
                return True
            self.error = error
            return False
        # A cancelled batch's shards are over: nothing to release, nobody to resume.
        if not lease.lost and not isinstance(exc, SyncCancelled):
            try:
                lease.release("worker interrupted")
            except Exception as err:  # the lease will expire on its own instead
                log.warning("could not release shard %r: %s", lease.shard_key, err)
        return False


def _claimable(clock: DbClock) -> sa.ColumnElement[bool]:
    """A shard a worker may claim: PENDING, or RUNNING with an expired lease (a reclaim)."""
    c = schema.shard.c
    return sa.or_(
        c.status == "PENDING", sa.and_(c.status == "RUNNING", c.lease_until < clock.now())
    )


def _check_worker_id(worker_id: str) -> None:
    if not worker_id or len(worker_id) > MAX_WORKER_ID_LEN:
        raise ConfigError(f"worker_id must be 1-{MAX_WORKER_ID_LEN} characters: {worker_id!r}")


def _read_shard(conn: Connection, batch_id: str, shard_key: str) -> ShardInfo:
    row = conn.execute(
        sa.select(schema.shard).where(
            schema.shard.c.batch_id == batch_id, schema.shard.c.shard_key == shard_key
        )
    ).first()
    if row is None:
        raise UnknownShard(f"batch {batch_id!r} has no shard for city {shard_key!r}")
    return _shard_info(row)


def _read_claimed(conn: Connection, batch_id: str, shard_key: str) -> tuple[ShardInfo, bool]:
    """:func:`_read_shard` for a claim, and in the same statement whether the city has
    quality gate overrides in the batch (the gate then need not read them)."""
    s = schema.shard.c
    row = conn.execute(
        sa.select(schema.shard, _has_overrides(batch_id, shard_key)).where(
            s.batch_id == batch_id, s.shard_key == shard_key
        )
    ).first()
    if row is None:
        raise UnknownShard(f"batch {batch_id!r} has no shard for city {shard_key!r}")
    return _shard_info(row), bool(row.has_gate_overrides)


def _claimed_columns(batch_id: str, shard_key: str) -> list[sa.ColumnElement[Any]]:
    """What a claim reads back: the shard, whether it has gate overrides, and its batch's
    status and shards (``batch_status``, ``batch_shards``)."""
    b = schema.batch.c
    return [
        *schema.shard.c,
        _has_overrides(batch_id, shard_key),
        sa.select(b.status).where(b.batch_id == batch_id).scalar_subquery().label("batch_status"),
        sa.select(b.shard_count)
        .where(b.batch_id == batch_id)
        .scalar_subquery()
        .label("batch_shards"),
    ]


def _has_overrides(batch_id: str, shard_key: str) -> sa.Label[bool]:
    """Whether the city has quality gate overrides in the batch, as a column."""
    o = schema.gate_override.c
    return (
        sa.select(o.batch_id)
        .where(o.batch_id == batch_id, o.shard_key == shard_key)
        .exists()
        .label("has_gate_overrides")
    )


def _shard_info(row: sa.Row[Any]) -> ShardInfo:
    m = row._mapping
    checkpoint = None
    if m["checkpoint"] is not None:
        try:
            checkpoint = Checkpoint.from_json(m["checkpoint"])
        except InvalidCheckpoint as err:
            raise InvalidCheckpoint(
                f"shard {m['shard_key']!r} of batch {m['batch_id']}: stored checkpoint is "
                f"malformed: {err}"
            ) from None
    return ShardInfo(
        shard_id=m["id"],
        batch_id=m["batch_id"],
        shard_key=m["shard_key"],
        status=m["status"],
        checkpoint=checkpoint,
        total_count=m["total_count"],
        success_count=m["success_count"],
        failed_count=m["failed_count"],
        skipped_count=m["skipped_count"],
        pages_done=m["pages_done"],
        total_pages=m["total_pages"],
        fetched_count=m["fetched_count"],
        claim_count=m["claim_count"],
        worker_id=m["worker_id"],
        lease_until=m["lease_until"],
        heartbeat_at=m["heartbeat_at"],
        last_checkpoint_at=m["last_checkpoint_at"],
        last_heartbeat_stage=m["last_heartbeat_stage"],
        error_message=m["error_message"],
    )


def _why_not_claimable(
    conn: Connection, db: SyncDatabase, batch_id: str, shard_key: str, info: ShardInfo
) -> str:
    if info.status == "RUNNING":
        return (
            f"shard {shard_key!r} of batch {batch_id} is held by {info.worker_id} until "
            f"{info.lease_until} (database time now {db.clock.read(conn)}); a live lease is "
            "never taken over"
        )
    return f"shard {shard_key!r} of batch {batch_id} is {info.status}; nothing to claim"


__all__ = [
    "Checkpoint",
    "HeartbeatRunner",
    "LeaseSettings",
    "PageCounts",
    "ShardInfo",
    "ShardLease",
    "ShardWork",
    "Stall",
    "claim_next_shard",
    "claim_shard",
    "find_stalls",
    "get_shard",
    "holder_is_dead_here",
    "list_shards",
    "make_worker_id",
    "reopen_shard",
]
