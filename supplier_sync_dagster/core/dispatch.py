"""Dispatchers: claim the outbox's READY events stage by stage, run the stage, move them on.

A :class:`Dispatcher` owns one set of targets (:class:`~.projections.Projections`) and one
lease owner id. Each round it runs every stage once: claims up to ``batch_size`` events
whose next stage it is (:func:`.outbox.claim`), runs the stage on the batch, and moves the
events on (:func:`.outbox.advance`) or back for a retry (:func:`.outbox.retry_later`). The
stages are independent: a search index that is down holds back only SEARCH_INDEX events,
while the cache and the subscribers' backlog keep moving. :meth:`Dispatcher.drain` runs
rounds until no stage has work; :func:`serve` runs N dispatchers in threads until told to
stop, each finishing its batch first, and runs the stuck-message pass every minute.

What each stage does with a batch:

- SEARCH_INDEX: reads the hotels' current catalog rows (with their lowest offer) in two
  queries and upserts them into the search index in one statement; the index keeps a
  document only at its newest publish version, so an older event re-run changes nothing.
- CACHE: invalidates each hotel's detail key and its city's list key, in one command.
- NOTIFY: publishes each event to the subscribers' exchange and waits for the broker's
  confirms.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from supplier_sync_dagster.core.db import SyncDatabase
from supplier_sync_dagster.core.outbox import (
    DEFAULT_LEASE_SECONDS,
    STAGES,
    OutboxEvent,
    Stage,
    advance,
    claim,
    make_owner,
    release_stuck,
    retry_later,
)
from supplier_sync_dagster.core.projections import (
    Notification,
    Projections,
    cache_keys,
    hotel_cities,
    load_search_docs,
)

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 500
STUCK_PASS_SECONDS = 60.0


@dataclass
class StageCounts:
    """What a stage did over some rounds."""

    claimed: int = 0
    advanced: int = 0
    retrying: int = 0
    failed: int = 0
    seconds: float = 0.0
    last_error: str = ""

    def add(self, other: StageCounts) -> None:
        """Adds ``other``'s counts to these."""
        self.claimed += other.claimed
        self.advanced += other.advanced
        self.retrying += other.retrying
        self.failed += other.failed
        self.seconds += other.seconds
        self.last_error = other.last_error or self.last_error


@dataclass
class DrainReport:
    """What dispatching did: per stage, plus the stuck events released."""

    stages: dict[str, StageCounts] = field(
        default_factory=lambda: {s: StageCounts() for s in STAGES}
    )
    stuck_released: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def moved(self) -> int:
        """Events moved on (a stage done), over every stage."""
        return sum(c.advanced for c in self.stages.values())

    def add(self, other: DrainReport) -> None:
        """Adds ``other``'s counts to these."""
        for stage, counts in other.stages.items():
            self.stages.setdefault(stage, StageCounts()).add(counts)
        for stage, n in other.stuck_released.items():
            self.stuck_released[stage] = self.stuck_released.get(stage, 0) + n


StageRunner = Callable[[Sequence[OutboxEvent]], dict[int, str]]


class Dispatcher:
    """Runs the outbox's stages with one set of targets under one lease owner.

    Args:
        db: The sync database (the outbox and the catalog).
        projections: The stages' targets (this dispatcher's own connections).
        owner: The lease owner id (default: host, process and thread).
        batch_size: Events claimed per stage and round.
        lease_seconds: How long a claim is held before the stuck pass may free it.
        stages: The stages this dispatcher runs.
    """

    def __init__(
        self,
        db: SyncDatabase,
        projections: Projections,
        *,
        owner: str | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        stages: Sequence[Stage] = STAGES,
    ) -> None:
        self.db = db
        self.projections = projections
        self.owner = owner or make_owner()
        self.batch_size = batch_size
        self.lease_seconds = lease_seconds
        self.stages = tuple(stages)
        self._runners: dict[Stage, StageRunner] = {
            "SEARCH_INDEX": self._search_index,
            "CACHE": self._cache,
            "NOTIFY": self._notify,
        }

    def run_stage(self, stage: Stage) -> StageCounts:
        """One batch of one stage: claim, run, move on (or back)."""
        began = time.perf_counter()
        counts = StageCounts()
        events = claim(
            self.db,
            stage,
            owner=self.owner,
            limit=self.batch_size,
            lease_seconds=self.lease_seconds,
        )
        counts.claimed = len(events)
        if not events:
            return counts
        try:
            failures = self._runners[stage](events)
        except Exception as err:  # the whole batch failed: retry it later
            message = f"{type(err).__name__}: {err}"
            failures = {e.id: message for e in events}
        done = [e for e in events if e.id not in failures]
        counts.advanced = advance(self.db, stage, done, owner=self.owner) if done else 0
        if failures:
            counts.retrying, counts.failed = retry_later(
                self.db, stage, failures, events, owner=self.owner
            )
            counts.last_error = next(iter(failures.values()))
            log.warning(
                "%s: %d of %d events failed (%d retry later, %d FAILED): %s",
                stage,
                len(failures),
                len(events),
                counts.retrying,
                counts.failed,
                counts.last_error,
            )
        counts.seconds = time.perf_counter() - began
        return counts

    def round(self) -> DrainReport:
        """Every stage once."""
        report = DrainReport()
        for stage in self.stages:
            report.stages[stage].add(self.run_stage(stage))
        return report

    def drain(
        self, *, max_seconds: float | None = None, stop: threading.Event | None = None
    ) -> DrainReport:
        """Rounds until no stage claims anything (events waiting for their retry time are
        left for later), ``max_seconds`` pass, or ``stop`` is set."""
        began = time.perf_counter()
        total = DrainReport()
        while not (stop is not None and stop.is_set()):
            one = self.round()
            total.add(one)
            if not any(c.claimed for c in one.stages.values()):
                break
            if max_seconds is not None and time.perf_counter() - began >= max_seconds:
                break
        total.seconds = time.perf_counter() - began
        return total

    # -- the stages ------------------------------------------------------------------

    def _search_index(self, events: Sequence[OutboxEvent]) -> dict[int, str]:
        rids = [e.aggregate_id for e in events]
        with self.db.engine.connect() as conn:
            docs = load_search_docs(conn, rids)
        self.projections.search.upsert(list(docs.values()))
        # A hotel missing from the catalog has nothing to project (it never is: hotels are
        # unpublished, not deleted), so its event is done.
        return {}

    def _cache(self, events: Sequence[OutboxEvent]) -> dict[int, str]:
        rids = sorted({e.aggregate_id for e in events})
        with self.db.engine.connect() as conn:
            cities = hotel_cities(conn, rids)
        self.projections.cache.invalidate(cache_keys(cities, rids))
        return {}

    def _notify(self, events: Sequence[OutboxEvent]) -> dict[int, str]:
        self.projections.notifier.publish(
            [
                Notification(
                    event_id=e.event_id,
                    event_type=e.event_type,
                    aggregate_id=e.aggregate_id,
                    aggregate_version=e.aggregate_version,
                    batch_id=e.batch_id,
                    payload=e.payload,
                )
                for e in events
            ]
        )
        return {}


def serve(
    db: SyncDatabase,
    open_projections: Callable[[], Projections],
    *,
    threads: int = 1,
    stop: threading.Event,
    batch_size: int = DEFAULT_BATCH_SIZE,
    idle_seconds: float = 0.5,
    stuck_every: float = STUCK_PASS_SECONDS,
    on_report: Callable[[DrainReport], None] | None = None,
) -> DrainReport:
    """Runs ``threads`` dispatchers until ``stop`` is set; each finishes its batch first.

    Each thread opens its own targets; the first also runs the stuck-message pass every
    ``stuck_every`` seconds (any number of passes at once would be harmless: the moves are
    guarded). ``on_report`` receives each stuck pass's and each busy round's report.
    """
    total = DrainReport()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(index: int) -> None:
        projections = open_projections()
        dispatcher = Dispatcher(
            db, projections, owner=make_owner(f"dispatch{index}"), batch_size=batch_size
        )
        next_stuck = 0.0
        try:
            while not stop.is_set():
                report = DrainReport()
                if index == 0 and time.monotonic() >= next_stuck:
                    report.stuck_released = release_stuck(db)
                    next_stuck = time.monotonic() + stuck_every
                one = dispatcher.round()
                report.add(one)
                with lock:
                    total.add(report)
                if on_report is not None and (report.moved or report.stuck_released):
                    on_report(report)
                if not any(c.claimed for c in one.stages.values()):
                    stop.wait(idle_seconds)
        except BaseException as err:
            errors.append(err)
            stop.set()
        finally:
            projections.close()

    began = time.perf_counter()
    workers = [
        threading.Thread(target=work, args=(i,), name=f"dispatch-{i}", daemon=True)
        for i in range(max(1, threads))
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    total.seconds = time.perf_counter() - began
    if errors:
        raise errors[0]
    return total


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "Dispatcher",
    "DrainReport",
    "StageCounts",
    "serve",
]
