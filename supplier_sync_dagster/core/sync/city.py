"""One city's sync under its shard lease, and a worker's cities.

:func:`sync_city` claims a city's shard and runs its stages in order: fetch (``fetch``),
normalize with the schema-drift check on the first pages, the batch gate, then map, diff and
publish (``stages``); the last publish transaction finishes the shard. A hotel the city's
complete listing lacks is counted missing, and asked for (:func:`confirm_missing`).
:func:`sync_cities` keeps a worker's cities in flight, largest first
(:func:`largest_first`); :func:`help_other_workers` takes cities of the batch that no
worker has started.

Every record fetched ends in exactly one bucket (invariant 4): published (success), dead
letter (failed), or skipped: unchanged, stale, a duplicate of a record on another page, or
held for review. The shard finishes with those counts, and ``total = success + failed +
skipped = records in the city's stored pages``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import LeaseNotAcquired, SupplierError, SupplierNotFound
from supplier_sync_dagster.core.leasing.batches import Batch
from supplier_sync_dagster.core.leasing.leases import (
    PageCounts,
    ShardInfo,
    ShardLease,
    ShardWork,
    claim_shard,
    list_shards,
    reopen_shard,
)
from supplier_sync_dagster.core.records.deadletters import (
    DeadLetter,
    record_dead_letters,
    supplier_error_code,
)
from supplier_sync_dagster.core.records.gates import GATED_PREFIX, GateResult, failure_reason
from supplier_sync_dagster.core.records.tombstones import record_presence, unpublish_missing
from supplier_sync_dagster.core.store.db import SyncDatabase, retry_deadlocks
from supplier_sync_dagster.core.store.payloads import PayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync.fetch import fetch_pages, record_walk, walk
from supplier_sync_dagster.core.sync.gate import PipelineGate
from supplier_sync_dagster.core.sync.model import (
    CityReport,
    FetchedPage,
    PageSource,
    Progress,
    SyncSettings,
)
from supplier_sync_dagster.core.sync.runtime import prepare_process
from supplier_sync_dagster.core.sync.snapshots import RAW, stored_pages
from supplier_sync_dagster.core.sync.stages import (
    ONE_TRANSACTION_HOTELS,
    NormalizedWriter,
    Normalizer,
    check_counts,
    publish_city,
)
from supplier_sync_dagster.core.sync.stop import Stop, StopAware, reason_of

log = logging.getLogger(__name__)
T = TypeVar("T")


def sync_city(
    db: SyncDatabase,
    store: PayloadStore,
    client: SupplierClient | None,
    *,
    batch: Batch,
    city_code: str,
    worker_id: str,
    settings: SyncSettings,
    gate: PipelineGate | None = None,
    fetch: bool = True,
    city_countries: Mapping[str, str] | None = None,
    report: CityReport | None = None,
    source: PageSource | None = None,
    hotel_count: int | None = None,
    stop: Stop | None = None,
) -> CityReport:
    """Runs every stage of one city under its shard lease and finishes the shard.

    Args:
        db: The sync database.
        store: The payload store for raw and normalized pages.
        client: The supplier client (unused when ``fetch`` is False; None with a ``source``
            that needs none).
        batch: The batch this city belongs to (it must have a shard for the city).
        city_code: The supplier's city code, verbatim.
        worker_id: This worker's id.
        settings: Task and tuning settings.
        gate: Optional batch-level quality gate run before publishing.
        fetch: False replays the stored raw pages of this batch without calling the supplier.
        city_countries: The supplier's city -> country codes (``/v1/cities``), for the rule
            that a hotel's country is its city's; cities missing here skip that rule.
        report: The report to fill in; a caller passes its own to see what a city that
            raised had completed (``stages_done``).
        source: The shard's pages when they are not the listing of city ``city_code`` (an
            incremental window: ``core.repair.incremental``); its records then belong to
            their own cities.
        hotel_count: The city's ``hotel_count`` from ``/v1/cities``, when known: its walk
            stops with ``WALK_RUNAWAY`` well before going far past it.
        stop: The run's stop: the city stops at its next page or chunk once it is asked,
            its lease released with its checkpoint.

    Returns:
        The city's report. ``status`` is SUCCESS, ALREADY_DONE (the shard had finished),
        LEASE_LOST, HELD_BY_OTHER (a live lease elsewhere) or GATED.

    Raises:
        SupplierError: The supplier failed beyond retries, or its listing would never end
            (``WalkRunaway``); the shard is FAILED, resumable (any other exception fails it
            too, its report and shard saying why).
        SyncInterrupted: The run's stop was asked (the shard is PENDING again).
    """
    prepare_process()
    stop = stop or Stop()
    report = report if report is not None else CityReport(city_code)
    try:
        lease = _claim(db, batch.batch_id, city_code, worker_id, settings)
    except LeaseNotAcquired as err:
        report.status, report.error = "HELD_BY_OTHER", str(err)
        return report
    if lease is None:
        report.status = "ALREADY_DONE"
        return report
    if lease.checkpoint is not None:
        report.resumed_from_page = lease.checkpoint.page
    report.gate_overrides = lease.gate_overrides
    work = ShardWork(lease)
    stages: _CityStages | None = None
    try:
        with work as heartbeat:
            stages = _CityStages(
                db,
                store,
                client,
                lease,
                StopAware(heartbeat, stop),
                settings,
                report,
                city_countries=city_countries or {},
                drift_check=gate is not None,
                fetched=fetch,
                source=source,
                hotel_count=hotel_count,
                stop=stop,
            )
            if fetch:
                stages.fetch()
            report.stages_done.append("fetch")
            if gate is not None and stages.stopped_by_drift():
                return report
            stages.normalize()
            report.stages_done.append("normalize")
            if gate is not None and stages.stopped_by_gate(gate):
                return report
            stages.publish()
            report.stages_done.append("publish")
    except Exception as err:  # the shard is FAILED (see ShardWork); the report says so too
        report.fail(err, work.error)
        raise
    finally:
        if stages is not None:
            stages.close()
    if work.lost is not None:
        report.status, report.error = "LEASE_LOST", str(work.lost)
    elif client is not None and report.presence is not None and report.presence.missing:
        confirm_missing(db, client, report, batch_id=batch.batch_id, settings=settings, stop=stop)
    return report


class _CityStages:
    """The stages of one claimed city, in the order :func:`sync_city` runs them."""

    def __init__(
        self,
        db: SyncDatabase,
        store: PayloadStore,
        client: SupplierClient | None,
        lease: ShardLease,
        heartbeat: Progress,
        settings: SyncSettings,
        report: CityReport,
        *,
        city_countries: Mapping[str, str],
        drift_check: bool,
        fetched: bool,
        source: PageSource | None,
        hotel_count: int | None = None,
        stop: Stop,
    ) -> None:
        self.db, self.store, self.client, self.lease = db, store, client, lease
        self.stop = stop
        self.heartbeat, self.settings, self.report = heartbeat, settings, report
        # Whether this claim walks the pages (a listing walked to its end: tombstones).
        self.fetched, self.source, self.hotel_count = fetched, source, hotel_count
        self.batch_id, self.city = lease.batch_id, lease.shard_key
        self.normalizer = Normalizer(
            db,
            self.batch_id,
            self.city,
            store,
            heartbeat,
            settings,
            report,
            city_countries,
            writer=NormalizedWriter(lease, store, settings),
            drift_check=drift_check,
            listing_city=self.city if source is None else None,
        )

    def fetch(self) -> None:
        """Fetches and stores the shard's pages from its checkpoint.

        Raises:
            ValueError: A city's listing without a supplier client.
        """
        if self.client is None and self.source is None:
            raise ValueError("fetching needs a supplier client")
        # A walk from the city's first page normalizes each page as it arrives (no re-read
        # of what was just fetched); a resumed walk normalizes afterwards, in page order,
        # with the pages stored by the earlier attempt.
        fresh = self.lease.checkpoint is None
        # Every stored page of a fresh walk reaches the normalizer as it is fetched: it has
        # none to read back.
        self.normalizer.stored_pages_seen = fresh
        # The walk's requests run on other threads, and the pages are normalized on this
        # one as they arrive: each is counted on its own thread, under its own stage.
        walk_cpu, page_cpu = _ThreadCpu(), _ThreadCpu()
        began = time.thread_time()
        try:
            fetch_pages(
                self.lease,
                self.store,
                walk_cpu.iterate(
                    walk(
                        self.client,
                        self.lease,
                        self.settings,
                        self.source,
                        hotel_count=self.hotel_count,
                        report=self.report,
                    )
                ),
                self.heartbeat,
                self.settings,
                self.report,
                on_page=page_cpu.wrap(self.normalizer.add) if fresh else None,
                stop=self.stop,
            )
        finally:
            cpu = self.report.cpu_seconds
            cpu["fetch"] += time.thread_time() - began - page_cpu.seconds + walk_cpu.seconds
            cpu["normalize"] += page_cpu.seconds

    def stopped_by_drift(self) -> bool:
        """Judges schema drift on the first pages; a drifted city ends GATED here."""
        drift = self.normalizer.drift()
        if drift is None:
            return False
        # Stop before normalizing: a renamed field would otherwise turn every record of the
        # city into a dead letter.
        self.report.records = sum(
            int(r.record_count or 0) for r in stored_pages(self.db, self.batch_id, self.city, RAW)
        )
        _stop_gated(self.lease, self.report, [drift])
        return True

    def normalize(self) -> None:
        """Normalizes and judges every page not normalized yet, and records the profile."""
        writer = self.normalizer.writer
        if (
            writer is not None
            and self.source is None
            and self.normalizer.candidates is not None
            and self.report.records <= ONE_TRANSACTION_HOTELS
        ):
            # A small city: its last normalize writes go with the shard's end.
            writer.defer = True
        with _cpu_of(self.report, "normalize"):
            self.normalizer.finish()

    def stopped_by_gate(self, gate: PipelineGate) -> bool:
        """Runs the batch gate; a city it stops ends GATED here, nothing published."""
        report = self.report
        report.checks = gate(self.db, self.batch_id, self.city, report)
        if not report.gate_failures:
            return False
        _stop_gated(self.lease, report, report.checks, self.normalizer.writer)
        return True

    def publish(self) -> None:
        """Maps, diffs and publishes the city; the shard finishes SUCCESS with its last
        chunk's transaction, or in one of its own when the city is read back."""
        settings, source = self.settings, self.source
        publishing = settings if source is None else source.publish_settings(self.report, settings)
        with _cpu_of(self.report, "publish"):
            finished = publish_city(
                self.lease,
                self.store,
                self.heartbeat,
                publishing,
                self.report,
                self.normalizer.candidates,
                finish=self._finish,
            )
            if not finished:
                retry_deadlocks(self._finish_alone)
        self.lease.mark_lost(f"shard {self.city!r} already finished", expected=True)

    def _finish(self, conn: Connection) -> None:
        report = self.report
        check_counts(report)
        self.heartbeat.check()
        writer = self.normalizer.writer
        if writer is not None:
            writer.write_deferred(conn)
        self.lease.finish_in(conn, "SUCCESS", counts=report.counts)
        if self.source is not None:
            self.source.finish(conn, report)
        elif self.fetched:
            listed: Collection[str] = self.normalizer.listed
            walked = report.walk
            if walked is not None:
                record_walk(conn, self.lease, walked)
                if not walked.complete:
                    # A listing that shifted unseen may lack a hotel it still lists: its
                    # absence decides nothing (a tombstone needs a complete listing).
                    log.warning(
                        "city %r: its walk is %s; hotels it lacks count no miss",
                        self.city,
                        walked.drift,
                    )
                    return
                if walked.listed is not None:
                    # The verification pass: the listing as it stands after a walk that saw
                    # it shift (hotels gone meanwhile count a miss).
                    listed = walked.listed
            # The city's listing is complete: what it lacks counts a miss.
            db = self.db
            report.presence = record_presence(
                conn,
                db.clock,
                supplier_id=self.settings.supplier_id,
                city_code=self.city,
                listed=listed,
                batch_id=self.batch_id,
                at=db.clock.now(),
                missing_syncs=self.settings.missing_syncs,
            )

    def _finish_alone(self) -> None:
        with self.db.begin() as conn:
            self._finish(conn)

    def close(self) -> None:
        """Stops the normalizer's forked processes, if any ran (idempotent)."""
        self.normalizer.close()


class _ThreadCpu:
    """The CPU seconds of the calls it wraps, each on the thread that runs it."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn``, its calls counted."""

        def counted(*args: Any) -> T:
            began = time.thread_time()
            try:
                return fn(*args)
            finally:
                self.seconds += time.thread_time() - began

        return counted

    def iterate(self, items: Iterator[FetchedPage]) -> Iterator[FetchedPage]:
        """``items``, each step counted on the thread that asks for it."""
        step = self.wrap(next)
        while (item := step(items, None)) is not None:
            yield item


@contextmanager
def _cpu_of(report: CityReport, stage: str) -> Iterator[None]:
    """Counts this thread's CPU seconds in the block under ``stage``."""
    began = time.thread_time()
    try:
        yield
    finally:
        report.cpu_seconds[stage] += time.thread_time() - began


# A city's newly missing hotels asked for one by one at most (each costs a request).
CONFIRM_MISSING_MAX = 50


def confirm_missing(
    db: SyncDatabase,
    client: SupplierClient,
    report: CityReport,
    *,
    batch_id: str,
    settings: SyncSettings,
    stop: Stop | None = None,
) -> None:
    """Asks the supplier for each hotel the city's listing newly lacked: a 404 is certain,
    and the hotel is unpublished now (a 200 leaves the count: it may be listed elsewhere).
    A failed request changes nothing; the next complete sync counts again.

    Raises:
        SyncInterrupted: The run's stop was asked (the city is finished already).
    """
    assert report.presence is not None
    stop = stop or Stop()
    gone: list[str] = []
    unconfirmed: list[DeadLetter] = []
    for hotel_id in report.presence.missing[:CONFIRM_MISSING_MAX]:
        try:
            stop.call(client.get_hotel, hotel_id)
        except SupplierNotFound:
            gone.append(hotel_id)
        except SupplierError as err:
            log.info("could not confirm missing hotel %r: %s", hotel_id, err)
            # A retryable dead letter: compensation asks again, and a 404 then unpublishes.
            code = supplier_error_code(err)
            unconfirmed.append(
                DeadLetter(
                    hotel_id,
                    "ADAPTER",
                    "RETRYABLE",
                    code,
                    f"GET /v1/hotels/{{id}} for a hotel its city no longer lists: {err}",
                    None,
                    None,
                    record_position="confirm_missing",
                    city_code=report.city_code,
                )
            )
    if unconfirmed:
        with db.begin() as conn:
            record_dead_letters(
                conn,
                db.clock,
                batch_id=batch_id,
                task_code=settings.task_code,
                sync_mode=settings.sync_mode,
                supplier_id=settings.supplier_id,
                letters=unconfirmed,
            )
    if not gone:
        return
    with db.begin() as conn:
        done = unpublish_missing(
            conn,
            db.clock,
            supplier_id=settings.supplier_id,
            supplier_hotel_ids=gone,
            batch_id=batch_id,
            at=db.clock.now(),
            missing_syncs=settings.missing_syncs,
        )
    report.presence.unpublished += done
    gone_now = set(done)
    report.presence.missing = [h for h in report.presence.missing if h not in gone_now]


def _claim(
    db: SyncDatabase, batch_id: str, city: str, worker_id: str, settings: SyncSettings
) -> ShardLease | None:
    """Claims the city's shard; None when it finished SUCCESS. A FAILED shard is reopened
    and claimed (a retry resumes it from its checkpoint).

    Raises:
        LeaseNotAcquired: A live lease holds it (or it was cancelled).
    """
    try:
        return claim_shard(db, batch_id, city, worker_id=worker_id, settings=settings.lease)
    except LeaseNotAcquired as err:
        # The claim read the shard: no read of its own before claiming.
        if not isinstance(err.shard, ShardInfo) or err.shard.status not in ("SUCCESS", "FAILED"):
            raise
        if err.shard.status == "SUCCESS":
            return None
    reopen_shard(db, batch_id, city, f"retried by {worker_id}")
    return claim_shard(db, batch_id, city, worker_id=worker_id, settings=settings.lease)


def _stop_gated(
    lease: ShardLease,
    report: CityReport,
    checks: list[GateResult],
    writer: NormalizedWriter | None = None,
) -> None:
    """Ends a city that a gate stopped: nothing is published, the shard is FAILED (with the
    profile the gate judged, when ``writer`` deferred it)."""
    reason = failure_reason(checks) or ""
    report.status, report.error, report.checks = "GATED", reason, checks
    counts = _gated_counts(report)
    if writer is None or writer.deferred is None:
        lease.finish("FAILED", GATED_PREFIX + reason, counts=counts)
        return

    def end() -> None:
        with lease.db.begin() as conn:
            writer.write_deferred(conn)
            lease.finish_in(conn, "FAILED", GATED_PREFIX + reason, counts=counts)

    retry_deadlocks(end)
    lease.mark_lost(f"shard {lease.shard_key!r} already finished", expected=True)


def largest_first(cities: Sequence[str], hotel_counts: Mapping[str, int]) -> list[str]:
    """The cities in the order to sync them: largest first (unknown sizes last, in order).

    A city's normalize and publish run after its last page is fetched; ending a run with
    small cities keeps that tail, when no request can use the supplier's budget, short.
    """
    position = {city: i for i, city in enumerate(cities)}
    return sorted(cities, key=lambda c: (-hotel_counts.get(c, -1), position[c]))


def sync_cities(
    cities: Sequence[str],
    *,
    sync_one: Callable[[str], CityReport],
    threads: int = 2,
    on_error: Callable[[str, Exception], None] | None = None,
) -> list[CityReport]:
    """Syncs cities with ``threads`` cities in flight at once; returns their reports.

    One city's normalize and publish are CPU work during which it makes no supplier
    request; with two cities in flight the other one fetches meanwhile, so a worker keeps
    the supplier's request budget busy on its own. Each city runs under its own lease and
    connection; the client, its rate limiter and breaker are shared and thread-safe.

    Args:
        cities: In the order to start them (see :func:`largest_first`).
        sync_one: Syncs one city (``sync_city`` with the worker's arguments).
        threads: Cities in flight (1: one after the other).
        on_error: Called with (city, exception) when ``sync_one`` raises; the other cities
            go on. Without it the first exception is raised after all cities ran.
    """
    reports: list[CityReport] = []
    errors: list[Exception] = []

    def one(city: str) -> None:
        try:
            reports.append(sync_one(city))
        except Exception as err:  # reported; the other cities go on
            if on_error is None:
                errors.append(err)
            else:
                on_error(city, err)

    if threads <= 1:
        for city in cities:
            one(city)
    else:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="city") as pool:
            list(pool.map(one, cities))
    if errors:
        raise errors[0]
    return reports


def help_other_workers(
    db: SyncDatabase,
    batch_id: str,
    *,
    skip: Collection[str],
    sync_one: Callable[[str], CityReport],
    threads: int = 2,
    hotel_counts: Mapping[str, int] | None = None,
    stop: Stop | None = None,
) -> list[CityReport]:
    """Syncs cities of the batch that no worker has started yet; returns their reports.

    A worker (a Dagster run) that has finished its own cities would otherwise leave the
    supplier's request budget unused while cities of slower workers wait. With
    ``hotel_counts``, the largest pending city is taken first: a big city that its owner
    has not reached yet (it is busy with a bigger one) would otherwise start last and
    keep the batch running, fetching at a fraction of the budget and then publishing,
    long after the small cities are done. Without sizes, cities are taken from the end of
    the batch. The shard lease decides who syncs each city; an owner that reaches a city
    being helped with gets HELD_BY_OTHER and goes on with its other cities first.

    Args:
        db: The sync database.
        batch_id: The batch whose PENDING shards may be taken.
        skip: Cities not to take (the worker's own).
        sync_one: Syncs one city (``sync_city`` with the worker's arguments); its
            exceptions are logged and the city is left to its owner.
        threads: Cities in flight at once (see :func:`sync_cities`).
        hotel_counts: The supplier's hotel count per city, when known.
        stop: The run's stop, set by an interruption so that the cities in flight end at
            their next page.
    """
    done: list[CityReport] = []

    def loop() -> None:
        while True:
            pending = [
                s.shard_key
                for s in reversed(list_shards(db, batch_id))
                if s.status == "PENDING" and s.shard_key not in skip
            ]
            if hotel_counts:
                pending = largest_first(pending, hotel_counts)
            progressed = False
            for city in pending:
                try:
                    report = sync_one(city)
                except Exception as err:  # the owner retries or resumes it
                    log.warning("helping with city %r failed: %s", city, err)
                    continue
                if report.status not in ("HELD_BY_OTHER", "ALREADY_DONE"):
                    done.append(report)
                    progressed = True
                    break  # re-read: the picture changes as owners progress
            if not progressed:
                return

    if threads <= 1:
        loop()
        return done
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="helper") as pool:
        try:
            for future in [pool.submit(loop) for _ in range(threads)]:
                future.result()
        except BaseException as err:
            if stop is not None and not isinstance(err, Exception):
                stop.set(reason_of(err))
            raise
    return done


def _gated_counts(report: CityReport) -> PageCounts:
    # Nothing published: valid records are held (skipped) until the gate is overridden.
    return PageCounts(
        success=0, failed=report.dead_letters, skipped=report.records - report.dead_letters
    )
