"""Incremental sync: the supplier's change feed, read in windows from a watermark.

An incremental task (``sync_mode`` INCREMENTAL, its own batches) keeps one **watermark**:
the ``(updated_at, hotel_id)`` of the last change it published. Each run is one batch with
one shard, the **window** (:data:`WINDOW_SHARD`): it reads ``GET /v1/hotels/changes`` from
``watermark - overlap`` until the feed says it is caught up (or ``max_pages``), and runs the
same stages as a city of a full sync (``sync_city`` with a :class:`ChangeWindow`
as its page source): each page's bytes are stored as a RAW snapshot and checkpointed under
the shard's lease, then normalized, checked, mapped, diffed and published with their outbox
events. Hotels of a window belong to their own cities (no listing city, nothing "moved").

- **Late data**: the contract says a change can become visible with an ``updated_at``
  earlier than a watermark already handed out. Reading from ``watermark - overlap``
  (default 5 minutes) sees those again; versions already published are NO_CHANGE or
  STALE for the diff and publish nothing.
- **The watermark never runs ahead of the catalog**: it moves, forward only, in the
  transaction that finishes the window's shard, the one that publishes its last chunk. A
  run killed mid-window leaves it where it was; the next run adopts the abandoned batch
  (the task's SKIP_IF_RUNNING policy) and resumes from the shard's checkpoint.
- **The first window** of a task starts where its supplier's latest successful full sync
  began: the newest ``updated_at`` of the city list that full sync stored. Without one
  there is nothing to be incremental to (:class:`~.errors.NoBaseline`).
- **A supplier's clock cannot blind it**: a change dated further ahead of the database clock
  than ``max_clock_skew_seconds`` is a ``FUTURE_TIMESTAMP`` dead letter (the normalize
  stage) and does not count where the window ends; the watermark never passes the database
  clock plus the skew (:func:`advance_watermark`), so a later window still asks for the
  changes that really come next. The feed is ordered by time, so a window stops at the
  first page whose next position lies beyond: a supplier that dates many changes ahead
  costs each window one page of dead letters, not the whole backlog.
- **Anomaly gates**: the batch gates of a full sync (bad-record ratio, schema drift,
  judged against the previous window) stop a window; a window whose change rate (changes
  per hour of the feed it covered, from its start to its newest change) is far above the
  time-weighted median rate of the task's latest windows (``change_volume``) is processed
  but every diff is held for review (``supplier-sync review``): windows of any length
  compare, and short quiet polls weigh as little as the time they cover; a run of
  ``quiet_windows`` successful windows without a change is reported (``quiet_for``) for
  the alerts to pick up.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import (
    ConfigError,
    InvalidCheckpoint,
    NoBaseline,
    SupplierProtocolError,
)
from supplier_sync_dagster.core.leasing.batches import (
    Batch,
    TaskSpec,
    TriggerSource,
    create_batch,
    get_batch,
    start_batch,
)
from supplier_sync_dagster.core.leasing.leases import Checkpoint
from supplier_sync_dagster.core.records.diff import HotelDiff, RiskPolicy
from supplier_sync_dagster.core.records.gates import (
    GateResult,
    GateThresholds,
    WindowVolume,
    apply_override,
    check_bad_record_ratio,
    check_change_volume,
    check_schema_drift,
    failure_reason,
    gated_checks,
    get_city_profile,
    get_gate_thresholds,
    list_overrides,
    previous_profile,
)
from supplier_sync_dagster.core.settings import (
    DEFAULT_MAX_CLOCK_SKEW_SECONDS,
    DEFAULT_TASK_CODE,
    MAX_CHANGES_LIMIT,
    MAX_OVERLAP_SECONDS,
    MIN_CHANGES_LIMIT,
    require_within,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import DbClock, SyncDatabase, insert_ignore, use_index
from supplier_sync_dagster.core.store.payloads import PayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync.city import sync_city
from supplier_sync_dagster.core.sync.gate import PipelineGate
from supplier_sync_dagster.core.sync.model import (
    DEFAULT_PUBLISH_CHUNK_HOTELS,
    CityReport,
    FetchedPage,
    SyncSettings,
)
from supplier_sync_dagster.core.sync.replay import CITIES, stored_city_countries
from supplier_sync_dagster.core.sync.runtime import usable_cpus
from supplier_sync_dagster.core.sync.tasks import open_task

log = logging.getLogger(__name__)

WINDOW_SHARD = "changes"
"""The one shard of an incremental batch: its window of the change feed."""
DEFAULT_INCREMENTAL_TASK = "hotel_supplier_incremental"
DEFAULT_OVERLAP_SECONDS = 300.0
DEFAULT_CHANGES_LIMIT = 500
DEFAULT_MAX_PAGES = 2000
# Normalized changes of a window kept in memory for publishing (larger: read back).
WINDOW_MEMORY_HOTELS = 20_000
# Hotels per publish transaction of a window whose settings keep the full sync's default.
# A window's hotels lie all over the catalog, so each transaction writes pages all over the
# tables and their indexes; with fewer, larger ones, the pages they share (index pages, the
# outbox's and the diff log's last pages) are written less often.
WINDOW_PUBLISH_CHUNK_HOTELS = 2000
# Successful windows the change_volume baseline (a time-weighted median rate) is taken over.
VOLUME_HISTORY = 12


@dataclass(frozen=True, order=True)
class Watermark:
    """How far a task's change feed is published: the last change's time and hotel id.

    Attributes:
        updated_at: The change's ``updated_at`` (aware, UTC).
        hotel_id: Its hotel id (orders changes of one second).
    """

    updated_at: datetime
    hotel_id: str = ""

    def __post_init__(self) -> None:
        if self.updated_at.tzinfo is None:
            raise ConfigError(f"a watermark time must be timezone-aware: {self.updated_at!r}")

    def text(self) -> str:
        """``2026-11-20T10:00:00Z/H000123`` (for people and metadata)."""
        return f"{_rfc3339(self.updated_at)}/{self.hotel_id}"


@dataclass(frozen=True)
class IncrementalSettings:
    """How an incremental task reads its change feed.

    Attributes:
        task_code: The incremental task (its batches, watermark and thresholds).
        full_task_code: The full-sync task whose latest successful batch gives the first
            window's start (and the city list for the country rule).
        overlap_seconds: How far before the watermark each window starts (late changes).
        limit: Changes per feed request (1-1000).
        max_pages: Pages per window at most; a longer backlog continues in the next run.
    """

    task_code: str = DEFAULT_INCREMENTAL_TASK
    full_task_code: str = DEFAULT_TASK_CODE
    overlap_seconds: float = DEFAULT_OVERLAP_SECONDS
    limit: int = DEFAULT_CHANGES_LIMIT
    max_pages: int = DEFAULT_MAX_PAGES

    def __post_init__(self) -> None:
        require_within("overlap_seconds", self.overlap_seconds, 0, MAX_OVERLAP_SECONDS)
        require_within("the changes limit", self.limit, MIN_CHANGES_LIMIT, MAX_CHANGES_LIMIT)
        if self.max_pages < 1:
            raise ConfigError(f"max_pages must be >= 1; got {self.max_pages!r}")


@dataclass(frozen=True)
class FeedPosition:
    """Where a window of the change feed stands (the shard checkpoint's ``cursor``).

    Attributes:
        start: Where the window began (watermark - overlap).
        since: ``since`` of the next request.
        after_id: ``after_id`` of the next request.
        high: The highest ``(updated_at, hotel_id)`` of a record seen in the window (or the
            watermark it started from): what the watermark becomes when the window ends.
        origin: The watermark the window started from.
    """

    start: datetime
    since: datetime
    after_id: str | None
    high: Watermark | None
    origin: Watermark | None = None

    def to_cursor(self) -> str:
        """The JSON stored in the checkpoint."""
        return json.dumps(
            {
                "start": _rfc3339(self.start),
                "since": _rfc3339(self.since),
                "after_id": self.after_id,
                "high": _mark_json(self.high),
                "origin": _mark_json(self.origin),
            },
            separators=(",", ":"),
        )

    def covered_seconds(self) -> float:
        """The feed time the window covered so far: from where it began reading to the
        newest change it read (its overlap only, when nothing newer than its watermark)."""
        if self.high is None:
            return 0.0
        return max(0.0, (self.high.updated_at - self.start).total_seconds())

    @classmethod
    def from_cursor(cls, text: str) -> FeedPosition:
        """Reads a stored position.

        Raises:
            ConfigError: The checkpoint is not a change-feed position.
        """
        try:
            data = json.loads(text)
            return cls(
                start=_parse_time(data["start"]),
                since=_parse_time(data["since"]),
                after_id=data["after_id"],
                high=_mark_from_json(data["high"]),
                origin=_mark_from_json(data.get("origin")),
            )
        except (TypeError, ValueError, KeyError, IndexError) as err:
            raise ConfigError(f"not a change-feed checkpoint ({err}): {text[:200]!r}") from None


def _mark_json(mark: Watermark | None) -> list[str] | None:
    return None if mark is None else [_rfc3339(mark.updated_at), mark.hotel_id]


def _mark_from_json(value: Any) -> Watermark | None:
    return None if value is None else Watermark(_parse_time(value[0]), str(value[1]))


# -- the watermark -------------------------------------------------------------------------


def get_watermark(conn: Connection, task_code: str) -> Watermark | None:
    """The task's watermark, or None before its first window."""
    w = schema.watermark.c
    row = conn.execute(
        sa.select(w.watermark_at, w.watermark_hotel_id).where(w.task_code == task_code)
    ).first()
    if row is None:
        return None
    return Watermark(_aware(row.watermark_at), str(row.watermark_hotel_id))


def advance_watermark(
    conn: Connection,
    clock: DbClock,
    *,
    task_code: str,
    supplier_id: int,
    to: Watermark,
    batch_id: str,
    max_clock_skew_seconds: float,
) -> bool:
    """Moves the task's watermark forward to ``to`` (never back), in the caller's transaction.

    One guarded UPDATE: it matches only a watermark older than ``to``, so two windows that
    race cannot move it back. A ``to`` past the database clock plus
    ``max_clock_skew_seconds`` moves it only that far: a watermark ahead of every real
    change would make each later window ask from the future and find nothing. Returns
    whether it moved.
    """
    w = schema.watermark.c
    latest = Watermark(clock.read_utc(conn, max_clock_skew_seconds))
    if to > latest:
        log.warning(
            "task %s: watermark %s is past the database clock plus %.0f s; moved to %s only",
            task_code,
            to.text(),
            max_clock_skew_seconds,
            latest.text(),
        )
        to = latest
    at = _naive(to.updated_at)
    created = False
    if get_watermark(conn, task_code) is None:
        # A racing first window may insert first: then the guarded update decides.
        insert_ignore(
            conn,
            schema.watermark,
            [{"task_code": task_code}],
            supplier_id=supplier_id,
            watermark_at=at,
            watermark_hotel_id=to.hotel_id,
            batch_id=batch_id,
            created_at=clock.now(),
            updated_at=clock.now(),
        )
        created = get_watermark(conn, task_code) == to
    moved = conn.execute(
        sa.update(schema.watermark)
        .where(
            w.task_code == task_code,
            sa.or_(
                w.watermark_at < at,
                sa.and_(w.watermark_at == at, w.watermark_hotel_id < to.hotel_id),
            ),
        )
        .values(
            watermark_at=at,
            watermark_hotel_id=to.hotel_id,
            batch_id=batch_id,
            updated_at=clock.now(),
        )
    ).rowcount
    return created or bool(moved)


def baseline_watermark(
    db: SyncDatabase,
    store: PayloadStore,
    *,
    full_task_code: str,
    supplier_id: int,
    not_after: datetime | None = None,
) -> Watermark | None:
    """Where a task with no watermark starts: its supplier's latest successful full sync.

    That batch read the supplier's city list before any city: every change visible then
    has an ``updated_at`` at or before the newest city ``updated_at`` of that list, and the
    batch listed it. A city time after ``not_after`` (the database clock plus the allowed
    skew) is a supplier clock ahead, not a baseline, and is left out. None when no such
    batch stored a city list.
    """
    s, b = schema.snapshot.c, schema.batch.c
    with db.engine.connect() as conn:
        ref = conn.execute(
            sa.select(s.payload_ref)
            .join(schema.batch, b.batch_id == s.batch_id)
            .where(
                b.task_code == full_task_code,
                b.supplier_id == supplier_id,
                b.status == "SUCCESS",
                s.snapshot_type == CITIES,
            )
            .order_by(b.id.desc(), s.id.desc())
            .limit(1)
        ).scalar()
    if ref is None:
        return None
    body = json.loads(store.get(ref))
    times = []
    for city in body.get("cities") or ():
        value = city.get("updated_at") if isinstance(city, dict) else None
        if isinstance(value, str):
            try:
                at = _parse_time(value)
            except ValueError:
                continue
            if not_after is None or at <= not_after:
                times.append(at)
    return Watermark(max(times)) if times else None


def has_baseline(db: SyncDatabase, settings: IncrementalSettings) -> bool:
    """Whether a window can start: the task has a watermark, or its full-sync task a
    successful batch (two indexed reads, for a schedule to decide whether to run)."""
    b = schema.batch.c
    with db.engine.connect() as conn:
        if get_watermark(conn, settings.task_code) is not None:
            return True
        return (
            conn.execute(
                sa.select(b.id)
                .where(b.task_code == settings.full_task_code, b.status == "SUCCESS")
                .limit(1)
            ).first()
            is not None
        )


# -- a window ------------------------------------------------------------------------------


def hold_everything(policy: RiskPolicy) -> RiskPolicy:
    """``policy``, except that whatever it would publish waits for a person instead."""

    def held(diff: HotelDiff) -> tuple[Any, Any]:
        level, action = policy(diff)
        return ("HIGH", "REVIEW") if action == "AUTO_PUBLISH" else (level, action)

    return held


@dataclass
class ChangeWindow:
    """The page source of an incremental window (``core.sync.model.PageSource``).

    Attributes:
        db: The sync database.
        store: The payload store (the baseline's city list).
        batch_id: The window's batch.
        supplier_id: The supplier.
        settings: How the feed is read.
        thresholds: The task's gate thresholds (``change_volume``).
        max_clock_skew_seconds: How far a change's ``updated_at`` may be ahead of the
            database clock and still count where the window ends.
        started_from: The position the window began with (set when it starts or resumes).
        volume: The ``change_volume`` result, once judged.
        watermark: The watermark the window moved to, once finished.
    """

    db: SyncDatabase
    store: PayloadStore
    batch_id: str
    supplier_id: int
    settings: IncrementalSettings
    thresholds: GateThresholds = field(default_factory=GateThresholds)
    max_clock_skew_seconds: float = DEFAULT_MAX_CLOCK_SKEW_SECONDS
    started_from: FeedPosition | None = None
    volume: GateResult | None = None
    watermark: Watermark | None = None

    def first_position(self) -> FeedPosition:
        """The position of a new window: the watermark (or the baseline) minus the overlap.

        Raises:
            NoBaseline: No watermark and no successful full sync to start from.
        """
        with self.db.engine.connect() as conn:
            mark = get_watermark(conn, self.settings.task_code)
        if mark is None:
            mark = baseline_watermark(
                self.db,
                self.store,
                full_task_code=self.settings.full_task_code,
                supplier_id=self.supplier_id,
                not_after=self.latest_time(),
            )
        if mark is None:
            raise NoBaseline(
                f"task {self.settings.task_code!r} has no watermark and task "
                f"{self.settings.full_task_code!r} no successful full sync to start from: "
                "run `supplier-sync sync --full` first"
            )
        overlap = self.settings.overlap_seconds
        start = mark.updated_at - timedelta(seconds=overlap)
        # Without an overlap the window continues right after the watermark's own change.
        after = (mark.hotel_id or None) if overlap == 0 else None
        return FeedPosition(start=start, since=start, after_id=after, high=mark, origin=mark)

    def latest_time(self) -> datetime:
        """The latest ``updated_at`` a change may carry: the database clock plus the skew."""
        with self.db.engine.connect() as conn:
            return self.db.clock.read_utc(conn, self.max_clock_skew_seconds)

    def pages(
        self, client: SupplierClient | None, start: Checkpoint | None, shard_key: str
    ) -> Iterator[FetchedPage]:
        """The window's pages, from the checkpoint (or the watermark) until caught up."""
        if client is None:
            raise ValueError("a change feed window needs a supplier client")
        if start is None or start.cursor is None:
            pos, number = self.first_position(), 1
        else:
            pos, number = FeedPosition.from_cursor(start.cursor), start.page
        self.started_from = pos
        while True:
            fetched = client.get_changes(
                since=pos.since, after_id=pos.after_id, limit=self.settings.limit
            )
            records = fetched.data.changes
            high = pos.high
            # A change dated beyond the clock plus the skew is a dead letter, not news: the
            # window does not end at it.
            latest = self.latest_time()
            for record in records:
                key = _record_key(record)
                if key is not None and key.updated_at <= latest and (high is None or key > high):
                    high = key
            nxt = fetched.data.next
            if nxt is not None:
                since = nxt.since.astimezone(UTC)
                if (since, nxt.after_id) == (pos.since, pos.after_id) and records:
                    raise SupplierProtocolError(
                        "the change feed returned the watermark it was given: the window "
                        "would never end",
                        reason="watermark_loop",
                        status=fetched.status,
                    )
                pos = replace(pos, since=since, after_id=nxt.after_id, high=high)
            else:
                pos = replace(pos, high=high)
            done = nxt is None or not records or number >= self.settings.max_pages
            # The feed is ordered by time: past a next position beyond the clock plus the
            # skew every change is too, and walking there would only file more dead letters.
            done = done or (nxt is not None and nxt.since > latest)
            yield FetchedPage(
                fetched.raw,
                number,
                records,
                None,
                Checkpoint(
                    shard_key,
                    page=number + 1,
                    cursor=pos.to_cursor(),
                    last_supplier_hotel_id=None if high is None else high.hotel_id or None,
                    done=done,
                ),
            )
            if done:
                return
            number += 1

    def publish_settings(self, report: CityReport, settings: SyncSettings) -> SyncSettings:
        """Holds every diff for review when the window's change rate is far above its
        task's usual (``change_volume``)."""
        with self.db.engine.connect() as conn:
            pos = window_position(conn, self.batch_id)
        self.volume = check_change_volume(
            WindowVolume(report.records, 0.0 if pos is None else pos.covered_seconds()),
            window_history(self.db, self.settings.task_code, self.batch_id),
            self.thresholds,
        )
        if self.volume.passed:
            return settings
        log.warning(
            "incremental window %s: %s; its diffs are held for review",
            self.batch_id,
            self.volume.description,
        )
        return replace(settings, risk_policy=hold_everything(settings.risk_policy))

    def finish(self, conn: Connection, report: CityReport) -> None:
        """Moves the watermark to the highest change of the window (its last page's)."""
        pos = window_position(conn, self.batch_id)
        high = None if pos is None else pos.high
        if pos is None or high is None:
            return
        # The batch says where its window began and ended: a window that did not move the
        # watermark found nothing new (quiet_windows counts those).
        conn.execute(
            sa.update(schema.batch)
            .where(schema.batch.c.batch_id == self.batch_id)
            .values(
                start_checkpoint=pos.origin.text() if pos.origin is not None else None,
                end_checkpoint=high.text(),
            )
        )
        advance_watermark(
            conn,
            self.db.clock,
            task_code=self.settings.task_code,
            supplier_id=self.supplier_id,
            to=high,
            batch_id=self.batch_id,
            max_clock_skew_seconds=self.max_clock_skew_seconds,
        )
        self.watermark = get_watermark(conn, self.settings.task_code)


def window_position(conn: Connection, batch_id: str) -> FeedPosition | None:
    """Where a window's feed stands: its shard's checkpoint (None: no page checkpointed)."""
    sh = schema.shard.c
    text = conn.execute(
        sa.select(sh.checkpoint).where(sh.batch_id == batch_id, sh.shard_key == WINDOW_SHARD)
    ).scalar()
    return _position(text)


def _position(text: str | None) -> FeedPosition | None:
    if text is None:
        return None
    cursor = Checkpoint.from_json(text).cursor
    return None if cursor is None else FeedPosition.from_cursor(cursor)


def window_history(db: SyncDatabase, task_code: str, batch_id: str) -> list[WindowVolume]:
    """The task's latest successful windows before ``batch_id``, newest first: each one's
    changes and the feed time it covered (a window whose checkpoint is unreadable is left
    out: its length is unknown)."""
    b, sh = schema.batch.c, schema.shard.c
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(b.total_count, sh.checkpoint)
            .join(
                schema.shard,
                sa.and_(sh.batch_id == b.batch_id, sh.shard_key == WINDOW_SHARD),
            )
            .where(b.task_code == task_code, b.status == "SUCCESS", b.batch_id != batch_id)
            .order_by(b.id.desc())
            .limit(VOLUME_HISTORY)
        ).all()
    history = []
    for records, checkpoint in rows:
        try:
            pos = _position(checkpoint)
        except (ConfigError, InvalidCheckpoint) as err:
            log.warning("task %s: a window's checkpoint is unreadable (%s)", task_code, err)
            continue
        if pos is not None:
            history.append(WindowVolume(int(records), pos.covered_seconds()))
    return history


def quiet_windows(db: SyncDatabase, task_code: str, *, limit: int = 1000) -> int:
    """How many of the task's latest successful windows in a row found nothing new: their
    watermark did not move (re-reading the overlap is not news)."""
    b = schema.batch.c
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(b.start_checkpoint, b.end_checkpoint)
            .where(b.task_code == task_code, b.status == "SUCCESS")
            .order_by(b.id.desc())
            .limit(limit)
        ).all()
    n = 0
    for start, end in rows:
        if start is None or start != end:
            break
        n += 1
    return n


def window_gate(thresholds: GateThresholds) -> PipelineGate:
    """The batch gates of a window: bad-record ratio and schema drift against the previous
    window, for windows of at least ``min_previous_records`` records (a record-count drop is
    no anomaly for a change feed, and its volume is judged apart). A stopped window does not
    move the watermark; once an operator overrides its checks the next run resumes it."""

    def gate(
        db: SyncDatabase, batch_id: str, city_code: str, report: CityReport
    ) -> list[GateResult]:
        with db.engine.connect() as conn:
            current = report.profile or get_city_profile(
                conn, batch_id=batch_id, shard_key=city_code
            )
            if current is None or current.record_count < thresholds.min_previous_records:
                return []
            before = previous_profile(
                conn, task_code=current.task_code, shard_key=city_code, before_batch_id=batch_id
            )
            overrides = list_overrides(conn, batch_id=batch_id, shard_key=city_code)
        results = [check_bad_record_ratio(current, thresholds)]
        if before is not None and before.record_count >= thresholds.min_previous_records:
            results.append(check_schema_drift(current, before, thresholds))
        by_check = {o.check_name: o for o in overrides}
        results = [apply_override(r, by_check.get(r.check_name)) for r in results]
        reason = failure_reason(results)
        if reason is not None:
            log.warning("quality gate stopped window %s: %s", batch_id, reason)
        return results

    return gate


def overridden_window(db: SyncDatabase, task_code: str) -> Batch | None:
    """The task's latest window when a gate stopped it and every check it failed has been
    overridden since: the next run resumes it instead of opening a new window."""
    b = schema.batch.c
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.select(schema.batch).where(b.task_code == task_code).order_by(b.id.desc()).limit(1)
        ).first()
        if row is None:
            return None
        latest = Batch.from_row(row)
        if latest.status == "SUCCESS" or latest.trigger_id is None:
            return None
        shard = conn.execute(
            sa.select(schema.shard.c.error_message).where(
                schema.shard.c.batch_id == latest.batch_id,
                schema.shard.c.shard_key == WINDOW_SHARD,
                schema.shard.c.status == "FAILED",
            )
        ).scalar()
        failed = gated_checks(shard)
        if not failed:
            return None
        done = {
            o.check_name
            for o in list_overrides(conn, batch_id=latest.batch_id, shard_key=WINDOW_SHARD)
        }
    return latest if {name for name, _ in failed} <= done else None


# -- a run ---------------------------------------------------------------------------------


@dataclass
class WindowReport:
    """What one incremental run did.

    Attributes:
        batch: The window's batch, as it ended.
        report: The window's stage report (counts, timings, gate results).
        started_from: The feed position the window began at (or resumed from).
        watermark_before: The task's watermark when the run started.
        watermark_after: The watermark once the run ended.
        cities: City code -> hotels this window published there.
        volume: The ``change_volume`` judgement (None when the window did not get there).
        quiet_for: Successful windows in a row without a change, this one included.
        quiet_alert: ``quiet_for`` reached the task's ``quiet_windows`` threshold.
    """

    batch: Batch
    report: CityReport
    started_from: FeedPosition | None
    watermark_before: Watermark | None
    watermark_after: Watermark | None
    cities: dict[str, int]
    volume: GateResult | None
    quiet_for: int
    quiet_alert: bool

    @property
    def held(self) -> bool:
        """The window's diffs wait for review (its volume was anomalous)."""
        return self.volume is not None and not self.volume.passed


def run_incremental(
    db: SyncDatabase,
    store: PayloadStore,
    client: SupplierClient,
    *,
    settings: SyncSettings,
    incremental: IncrementalSettings,
    trigger_id: str,
    source: TriggerSource,
    worker_id: str,
) -> WindowReport:
    """Runs one window of the task's change feed (or resumes the one a killed run left).

    Args:
        db: The sync database.
        store: The payload store.
        client: The supplier client.
        settings: Tuning and the risk policy (its task code and mode are replaced by the
            incremental task's).
        incremental: How the feed is read.
        trigger_id: The batch's idempotency key (a schedule tick, a run id, a CLI trigger).
        source: Where the trigger came from.
        worker_id: This worker's id.

    Raises:
        TaskDisabled: The task is DISABLED.
        TriggerSkipped: Another window of the task is running (one at a time).
        NoBaseline: No watermark and no successful full sync to start from.
        SupplierError: The feed failed beyond retries (the window resumes next run).
    """
    task_code = incremental.task_code
    open_task(
        db,
        TaskSpec(task_code=task_code, supplier_id=settings.supplier_id, sync_mode="INCREMENTAL"),
        trigger_id=trigger_id,
        run="incremental run",
    )
    with db.engine.connect() as conn:
        thresholds = get_gate_thresholds(conn, task_code)
        before = get_watermark(conn, task_code)
    resumed = overridden_window(db, task_code)
    if resumed is not None and resumed.trigger_id is not None:
        log.info("resuming window %s: its gate failures were overridden", resumed.batch_id)
        trigger_id = resumed.trigger_id
    decision = create_batch(
        db,
        task_code=task_code,
        trigger_id=trigger_id,
        trigger_source=source,
        worker_id=worker_id,
        lease_seconds=settings.lease.lease_seconds,
    )
    batch = start_batch(db, decision, [WINDOW_SHARD], skipped="incremental sync skipped")
    batch_id = batch.batch_id
    window = ChangeWindow(
        db,
        store,
        batch_id,
        settings.supplier_id,
        incremental,
        thresholds,
        max_clock_skew_seconds=settings.max_clock_skew_seconds,
    )
    cpus = usable_cpus()
    run_settings = replace(
        settings,
        task_code=task_code,
        sync_mode="INCREMENTAL",
        # A day's changes of a large supplier publish from memory, not read back, and on
        # every CPU: a window is one shard, where a full sync has a city per process.
        memory_hotels=max(settings.memory_hotels, WINDOW_MEMORY_HOTELS),
        publish_processes=settings.publish_processes or cpus,
        # While this process fetches and stores the pages, a process per CPU normalizes
        # and judges them (one CPU: this process does).
        normalize_processes=settings.normalize_processes or (cpus if cpus > 1 else 0),
        publish_chunk_hotels=(
            WINDOW_PUBLISH_CHUNK_HOTELS
            if settings.publish_chunk_hotels == DEFAULT_PUBLISH_CHUNK_HOTELS
            else settings.publish_chunk_hotels
        ),
    )
    report = sync_city(
        db,
        store,
        client,
        batch=batch,
        city_code=WINDOW_SHARD,
        worker_id=worker_id,
        settings=run_settings,
        gate=window_gate(thresholds),
        city_countries=stored_city_countries(db, store, task_code=incremental.full_task_code),
        source=window,
    )
    with db.engine.connect() as conn:
        batch = get_batch(conn, batch_id)
        after = get_watermark(conn, task_code)
        cities = published_cities(conn, batch_id)
    quiet = quiet_windows(db, task_code)
    return WindowReport(
        batch=batch,
        report=report,
        started_from=window.started_from,
        watermark_before=before,
        watermark_after=after,
        cities=cities,
        volume=window.volume,
        quiet_for=quiet,
        quiet_alert=quiet >= thresholds.quiet_windows,
    )


def published_cities(conn: Connection, batch_id: str) -> dict[str, int]:
    """City code -> hotels that ``batch_id`` published there (its latest publish of each)."""
    h = schema.platform_hotel.c
    d = schema.diff_log.c
    # The batch's hotels through its diff log (every publish writes its diffs in its own
    # transaction), not a scan of the catalog for its last_batch_id: on InnoDB with a buffer
    # pool smaller than the catalog, that scan reads the whole hotel table from disk.
    stmt = use_index(
        sa.select(h.city_code, sa.func.count(sa.distinct(h.resource_id)))
        .select_from(
            schema.diff_log.join(schema.platform_hotel, h.resource_id == d.platform_resource_id)
        )
        .where(d.batch_id == batch_id, h.last_batch_id == batch_id)
        .group_by(h.city_code)
        .order_by(h.city_code),
        schema.diff_log,
        "idx_diff_batch",
    )
    return {str(city): int(n) for city, n in conn.execute(stmt)}


# -- time ----------------------------------------------------------------------------------


def _record_key(record: Any) -> Watermark | None:
    """A record's ``(updated_at, hotel_id)``, when both are readable."""
    if not isinstance(record, dict):
        return None
    hotel_id, updated = record.get("hotel_id"), record.get("updated_at")
    if not isinstance(hotel_id, str) or not isinstance(updated, str):
        return None
    try:
        return Watermark(_parse_time(updated), hotel_id)
    except (ValueError, ConfigError):
        return None


def _parse_time(text: str) -> datetime:
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if value.tzinfo is None:
        raise ValueError(f"time without a zone: {text!r}")
    return value.astimezone(UTC)


def _rfc3339(value: datetime) -> str:
    value = value.astimezone(UTC)
    text = value.strftime("%Y-%m-%dT%H:%M:%S")
    if value.microsecond:
        text += f".{value.microsecond:06d}"
    return text + "Z"


def _aware(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _naive(value: datetime) -> datetime:
    return value.astimezone(UTC).replace(tzinfo=None)


__all__: Sequence[str] = (
    "DEFAULT_INCREMENTAL_TASK",
    "DEFAULT_OVERLAP_SECONDS",
    "WINDOW_SHARD",
    "ChangeWindow",
    "FeedPosition",
    "IncrementalSettings",
    "Watermark",
    "WindowReport",
    "advance_watermark",
    "baseline_watermark",
    "get_watermark",
    "has_baseline",
    "quiet_windows",
    "run_incremental",
    "window_gate",
)
