"""Dispatchers: claim the outbox's READY events stage by stage, run the stage, move them on.

A :class:`Dispatcher` owns one set of targets (:class:`~.projections.Projections`) and one
lease owner id. It claims up to ``batch_size`` READY events of one stage (:func:`.machine.claim`),
runs the stage on the batch, carries the events that passed on to the next stages of their
chain under the same lease, and records the outcome once (:func:`.machine.settle`): one claim
and one guarded move per event rather than two per stage, which is most of what dispatching
costs the sync database. A stage that fails stops its events there, to retry after a backoff;
the stages are independent: a search index that is down holds back only SEARCH_INDEX events,
while the cache and the subscribers' backlog keep moving.

The search index is what users read, so its lag is the one that matters while a sync
publishes: a round runs SEARCH_INDEX before each other stage's batch, batch after batch
while they come back full (up to :data:`SEARCH_BATCHES_PER_TURN`), and a full SEARCH_INDEX
batch is not carried on (more search work waits; the rest of its chain is left READY for
the next stage). :meth:`Dispatcher.drain` runs rounds until no stage has work;
:func:`serve` runs N dispatchers in threads until told to stop, each finishing its batch
first, and runs the stuck-message pass every minute.

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
from dataclasses import dataclass, field, replace

from supplier_sync_dagster.core.outbox.machine import (
    DEFAULT_LEASE_SECONDS,
    END,
    STAGES,
    OutboxEvent,
    Outcome,
    Stage,
    claim,
    make_owner,
    release_stuck,
    settle,
    stage_after,
)
from supplier_sync_dagster.core.outbox.projections import (
    Notification,
    Projections,
    cache_keys,
    hotel_cities,
    load_search_docs,
)
from supplier_sync_dagster.core.store.db import SyncDatabase

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 500
SEARCH_BATCHES_PER_TURN = 8
"""Most SEARCH_INDEX batches run in a row, while each claims a full one, before another
stage's batch."""
IDLE_SECONDS = 0.25
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
        # (supplier id, city code) of the hotels this batch's SEARCH_INDEX read, for its CACHE.
        self._cities: dict[int, tuple[int, str]] = {}
        self._runners: dict[Stage, StageRunner] = {
            "SEARCH_INDEX": self._search_index,
            "CACHE": self._cache,
            "NOTIFY": self._notify,
        }

    def run_from(self, stage: Stage) -> DrainReport:
        """One batch claimed at ``stage``, carried through the rest of each event's chain
        (the stages this dispatcher runs; not a full SEARCH_INDEX batch), then settled."""
        report = DrainReport()
        self._cities = {}
        events = claim(
            self.db,
            stage,
            owner=self.owner,
            limit=self.batch_size,
            lease_seconds=self.lease_seconds,
            full="NOTIFY" in self.stages,
        )
        report.stages[stage].claimed = len(events)
        if not events:
            return report
        outcomes = {e.id: Outcome(e) for e in events}
        waiting: dict[str, list[OutboxEvent]] = {stage: list(events)}
        # A full SEARCH_INDEX batch is not carried: more search work waits (module doc).
        carry = stage != "SEARCH_INDEX" or len(events) < self.batch_size
        # Chains follow the order of STAGES, so one pass in that order carries every event.
        for current in STAGES[STAGES.index(stage) :]:
            batch = waiting.pop(current, [])
            if not batch or current not in self.stages or (current != stage and not carry):
                continue  # settled READY at this stage, for whoever runs it next
            counts = report.stages[current]
            began = time.perf_counter()
            try:
                failures = self._runners[current](batch)
            except Exception as err:  # the whole batch failed: retry it later
                message = f"{type(err).__name__}: {err}"
                failures = {e.id: message for e in batch}
            projected_at = None
            if current == "SEARCH_INDEX" and len(failures) < len(batch):
                with self.db.engine.connect() as conn:
                    projected_at = self.db.clock.read(conn)
            for e in batch:
                if e.id in failures:
                    outcomes[e.id] = replace(outcomes[e.id], error=failures[e.id])
                    continue
                outcomes[e.id] = replace(
                    outcomes[e.id],
                    done=current,
                    projected_at=projected_at or outcomes[e.id].projected_at,
                )
                counts.advanced += 1
                nxt = stage_after(e.event_type, current)
                if nxt != END:
                    waiting.setdefault(nxt, []).append(e)
            if failures:
                counts.last_error = next(iter(failures.values()))
                log.warning(
                    "%s: %d of %d events failed: %s",
                    current,
                    len(failures),
                    len(batch),
                    counts.last_error,
                )
            counts.seconds += time.perf_counter() - began
        settled = settle(self.db, list(outcomes.values()), owner=self.owner)
        for failed_stage, n in settled.retrying.items():
            report.stages[failed_stage].retrying += n
        for failed_stage, n in settled.failed.items():
            report.stages[failed_stage].failed += n
        if settled.total < len(outcomes):
            log.warning(
                "%d of %d events claimed at %s had lost their lease: left where they are",
                len(outcomes) - settled.total,
                len(outcomes),
                stage,
            )
        return report

    def round(self) -> DrainReport:
        """One batch of each stage but SEARCH_INDEX, each after a turn of SEARCH_INDEX
        batches (while they come back full, up to :data:`SEARCH_BATCHES_PER_TURN`)."""
        report = DrainReport()
        others: list[Stage | None] = [s for s in self.stages if s != "SEARCH_INDEX"]
        for stage in others or [None]:
            if "SEARCH_INDEX" in self.stages:
                for _ in range(SEARCH_BATCHES_PER_TURN):
                    one = self.run_from("SEARCH_INDEX")
                    report.add(one)
                    if one.stages["SEARCH_INDEX"].claimed < self.batch_size:
                        break
            if stage is not None:
                report.add(self.run_from(stage))
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
        self._cities = {rid: (d.supplier_id, d.city_code) for rid, d in docs.items()}
        # A hotel missing from the catalog has nothing to project (it never is: hotels are
        # unpublished, not deleted), so its event is done.
        return {}

    def _cache(self, events: Sequence[OutboxEvent]) -> dict[int, str]:
        rids = sorted({e.aggregate_id for e in events})
        # A batch carried on from SEARCH_INDEX read its hotels' cities moments ago.
        cities = {rid: self._cities[rid] for rid in rids if rid in self._cities}
        unknown = [rid for rid in rids if rid not in cities]
        if unknown:
            with self.db.engine.connect() as conn:
                cities.update(hotel_cities(conn, unknown))
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
    idle_seconds: float = IDLE_SECONDS,
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
