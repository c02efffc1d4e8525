"""One city's sync, stage by stage, under one shard lease.

``fetch → normalize → (gate) → map → diff → publish``, as plain Python over the sync
database, the payload store and the supplier client; the Dagster assets call these stages
and report what they return.

- **fetch**: walks the city page by page (cursor or page numbers) from the shard's
  checkpoint; each page's exact bytes go to the payload store, a RAW snapshot row and the
  checkpoint past the page commit in one fenced transaction (a crash re-fetches at most the
  page in flight).
- **normalize**: a walk from the city's first page normalizes each page as soon as it is
  committed; a resumed walk or a replay reads the RAW snapshots back from the store (never
  the supplier: replay is free). Each page's normalized hotels are stored as a NORMALIZED
  snapshot (JSON lines), every rejected record as a dead letter.
- **map/diff/publish**: chunk by chunk, from memory for a small city, else read back from
  its NORMALIZED snapshots (memory stays bounded whatever the city's size): allocates
  mappings, diffs against what is published, builds every row, then writes the diff log
  and publishes AUTO_PUBLISH diffs with their outbox events in one transaction per chunk.

A dry run (:func:`dry_run_stages`, used by ``replay.dry_run_city``) runs the same normalize
and publish stages over stored raw pages without a lease: no writer, and a publisher
(:class:`DiffCollector`) that diffs each validated chunk through read-only connections, so
it writes nothing and its memory stays bounded by a chunk.

Every record fetched ends in exactly one bucket (invariant 4): published (success), dead
letter (failed), or skipped: unchanged, stale, a duplicate of a record on another page, or
held for review. The shard finishes with those counts, and ``total = success + failed +
skipped = records in the city's stored pages``.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import hashlib
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Literal, NamedTuple, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import (
    CountsDoNotAddUp,
    LeaseLost,
    LeaseNotAcquired,
    SupplierError,
    SupplierNotFound,
)
from supplier_sync_dagster.core.leasing.batches import Batch
from supplier_sync_dagster.core.leasing.leases import (
    Checkpoint,
    LeaseSettings,
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
from supplier_sync_dagster.core.records.diff import (
    Candidate,
    HotelDiff,
    RiskPolicy,
    collapse_duplicates,
    compute_diffs,
    default_risk_policy,
    record_diffs,
)
from supplier_sync_dagster.core.records.gates import (
    GATED_PREFIX,
    CityProfile,
    FieldCounts,
    GateResult,
    PipelineGate,
    check_first_pages,
    failure_reason,
    record_city_profile,
)
from supplier_sync_dagster.core.records.mapping import (
    HotelMappings,
    chunks,
    ensure_hotel_mappings,
)
from supplier_sync_dagster.core.records.normalize import (
    NormalizedDocuments,
    canonical_dumps,
    loads_canonical,
    normalize_documents,
)
from supplier_sync_dagster.core.records.publish import (
    CandidateRows,
    PublishPlan,
    candidate_rows,
    prepare_publish,
    publish_hotels,
)
from supplier_sync_dagster.core.records.quality import check_quality
from supplier_sync_dagster.core.records.review import hold_for_review
from supplier_sync_dagster.core.records.tombstones import (
    DEFAULT_MISSING_SYNCS,
    Presence,
    record_presence,
    unpublish_missing,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase, insert_ignore, retry_deadlocks
from supplier_sync_dagster.core.store.payloads import PayloadStore, StoredPayload
from supplier_sync_dagster.core.supplier import PagePosition, SupplierClient
from supplier_sync_dagster.core.supplier.models import (
    MALFORMED_RECORD_KEY,
    decode_json,
    page_records,
)

log = logging.getLogger(__name__)

RAW = schema.RAW
NORMALIZED = schema.NORMALIZED
# gzip level of stored RAW and NORMALIZED pages: much cheaper than the store's default of 6
# for somewhat larger objects. Any level reads
# back the same bytes and hashes, so replay and traceability do not depend on it.
PAGE_COMPRESSLEVEL = 1
# Young-generation GC threshold set by prepare_process (CPython's default is 700).
GC_GEN0_THRESHOLD = 50_000

_prepared = False
_prepare_lock = threading.Lock()


def prepare_process() -> None:
    """Tunes the cyclic garbage collector for a long sync in this process; idempotent.

    A sync keeps many long-lived objects (modules, compiled statements, a chunk of
    documents) while allocating millions of short-lived ones, and CPython's collector keeps
    re-scanning the long-lived heap: that nearly doubles the cost of normalization. So, once
    per process: collect the young generations' garbage, ``gc.freeze()`` everything that
    survives (it is never scanned again; frozen objects are still freed by reference
    counting) and raise the young-generation threshold so collections run less often.
    The oldest generation is not collected first: it holds what survived every earlier
    collection (the imports' modules and classes), and a full collection of a start-up heap
    costs ~0.2 s of a command and freed a few hundred objects, which stay frozen.
    Reference counting still frees every acyclic object at once; only cyclic garbage waits
    a little longer. :func:`sync_city` calls this itself; entry points may call it earlier,
    after their imports, to freeze more of the start-up heap.
    """
    global _prepared
    with _prepare_lock:
        if _prepared:
            return
        _prepared = True
        gc.collect(1)
        gc.freeze()
        gen0, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD), gen1, gen2)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


GC_INTERVAL_SECONDS = 2.0
# SyncSettings.publish_chunk_hotels unless set.
DEFAULT_PUBLISH_CHUNK_HOTELS = 1000
_last_collect = 0.0


def collect_garbage() -> None:
    """A full collection at most every ``GC_INTERVAL_SECONDS``; call it once per page or chunk.

    With the young generation's threshold raised (:func:`prepare_process`), cyclic garbage
    (HTTP responses, parsed pages) that survives into the oldest generation would wait for
    a rare full collection, and a large city's peak memory would grow with its size. After
    ``gc.freeze()`` a full collection only scans what the sync itself holds, so doing it on
    a clock bounds memory by what two seconds of work leave behind (a shorter interval costs
    more CPU for the same peak: ``bench_scale.py memory``).
    """
    global _last_collect
    now = time.monotonic()
    if now - _last_collect >= GC_INTERVAL_SECONDS:
        gc.collect()
        _last_collect = time.monotonic()


@dataclass(frozen=True)
class SyncSettings:
    """What one sync needs to know besides its inputs.

    Attributes:
        task_code: The task being run (dead letters name it).
        supplier_id: The platform's id of the supplier.
        sync_mode: FULL or INCREMENTAL (dead letters name it).
        page_size: Hotels per supplier page (1-500).
        chunk_hotels: Hotels normalized and checked per quality pass (its cost is mostly
            per call), and normalized pages written per flush.
        publish_chunk_hotels: Hotels per map/diff/publish transaction. Each event of a
            chunk carries the transaction's database time and no dispatcher sees it before
            the commit, so the chunk's length is a floor under the search index's lag
            while a sync runs (1,000: p95 1.3 s against 2.3 s with 2,000 on this 2-core
            machine, ``bench_dispatch.py --mode with-sync``). An incremental window left at
            this default publishes ``WINDOW_PUBLISH_CHUNK_HOTELS`` instead
            (``core.incremental``).
        memory_hotels: Normalized hotels of a city kept in memory for publishing; a larger
            city's are read back from its NORMALIZED pages (memory stays bounded).
        lease: Lease duration and heartbeat interval.
        risk_policy: Decides each diff's risk level and action.
        missing_syncs: Complete syncs of a city without a hotel before it is unpublished.
        publish_processes: Forked processes that publish a shard's chunks held in memory
            (all but the last, which finishes the shard here); 0 or 1 publishes them in
            this process. For one large shard (an incremental window): a full sync's cities
            already run in worker processes of their own.
        normalize_processes: Forked processes that normalize and judge a shard's pages
            while this process fetches and stores them (0: this process does). For one
            large shard (an incremental window), as ``publish_processes``.
    """

    task_code: str
    supplier_id: int
    sync_mode: str = "FULL"
    page_size: int = 100
    chunk_hotels: int = 2000
    publish_chunk_hotels: int = DEFAULT_PUBLISH_CHUNK_HOTELS
    memory_hotels: int = 5000
    lease: LeaseSettings = field(default_factory=LeaseSettings)
    risk_policy: RiskPolicy = default_risk_policy
    missing_syncs: int = DEFAULT_MISSING_SYNCS
    publish_processes: int = 0
    normalize_processes: int = 0


Stage = Literal["fetch", "normalize", "publish"]
"""A city's stages as a worker completes them: every page fetched and stored; every record
normalized (or dead-lettered) and checked; mapped, diffed and published."""


@dataclass
class CityReport:
    """What a city's sync did, stage by stage (counts, timings), for metadata and summaries."""

    city_code: str
    status: str = "SUCCESS"
    resumed_from_page: int | None = None
    pages_fetched: int = 0
    records: int = 0
    published: int = 0
    dead_letters: int = 0
    skipped: int = 0
    duplicates: int = 0
    moved: int = 0  # listed in this city but located in another: published under their own
    held_for_review: int = 0
    checks: list[GateResult] = field(default_factory=list)  # the gate's, when it ran
    dead_letters_by_code: Counter[str] = field(default_factory=Counter)
    diffs_by_type: Counter[str] = field(default_factory=Counter)
    diffs_by_action: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    error: str | None = None
    stages_done: list[Stage] = field(default_factory=list)  # what this worker completed
    # For the gate: the profile normalization recorded, and whether the city had gate
    # overrides when claimed (None: unknown, read them).
    profile: CityProfile | None = None
    gate_overrides: bool | None = None
    # What the complete listing did to the catalog's presence marks (tombstones).
    presence: Presence | None = None

    @property
    def gate_failures(self) -> list[str]:
        """The checks that stopped the city (failed and not overridden)."""
        return [r.check_name for r in self.checks if not r.passed]

    @property
    def counts(self) -> PageCounts:
        """The shard's outcome counts: published, dead letters, everything else."""
        return PageCounts(success=self.published, failed=self.dead_letters, skipped=self.skipped)


Gate = PipelineGate


class FetchedPage(NamedTuple):
    """One page of a shard's walk, as the fetch stores and checkpoints it.

    Attributes:
        raw: The page's exact bytes (stored and hashed).
        page_number: Its number in the walk (1-based).
        records: Its records as decoded (non-object entries unwrapped by the client).
        total_pages: The supplier's page count, when it says.
        checkpoint: Where the walk goes on once this page is committed.
    """

    raw: bytes
    page_number: int
    records: list[dict[str, Any]]
    total_pages: int | None
    checkpoint: Checkpoint


class PageSource(Protocol):
    """Where a shard's pages come from when it is not a city listing (a change feed window).

    ``sync_city`` runs the same stages over its pages; the source says where the walk starts
    and goes on, may change the settings publishing runs with once every page is normalized
    (a window far above its usual volume is held for review), and writes its own state in
    the transaction that finishes the shard (an incremental task's watermark).
    """

    def pages(
        self, client: SupplierClient | None, start: Checkpoint | None, shard_key: str
    ) -> Iterator[FetchedPage]:
        """The pages from ``start`` (None: the beginning) on (``client`` None: a source that
        needs no supplier, an operator's fixed record)."""

    def publish_settings(self, report: CityReport, settings: SyncSettings) -> SyncSettings:
        """The settings to publish with, given what fetching and normalizing found."""

    def finish(self, conn: Connection, report: CityReport) -> None:
        """Runs in the transaction that finishes the shard SUCCESS."""


def sync_city(
    db: SyncDatabase,
    store: PayloadStore,
    client: SupplierClient | None,
    *,
    batch: Batch,
    city_code: str,
    worker_id: str,
    settings: SyncSettings,
    gate: Gate | None = None,
    fetch: bool = True,
    city_countries: Mapping[str, str] | None = None,
    report: CityReport | None = None,
    source: PageSource | None = None,
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
            incremental window: ``core.incremental``); its records then belong to their
            own cities.

    Returns:
        The city's report. ``status`` is SUCCESS, ALREADY_DONE (the shard had finished),
        LEASE_LOST, HELD_BY_OTHER (a live lease elsewhere) or GATED.

    Raises:
        SupplierError: The supplier failed beyond retries (the shard is FAILED, resumable).
    """
    prepare_process()
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
    normalizer: _Normalizer | None = None
    try:
        with work as heartbeat:
            normalizer = _Normalizer(
                db,
                batch.batch_id,
                city_code,
                store,
                heartbeat,
                settings,
                report,
                city_countries or {},
                writer=_NormalizedWriter(lease, store, settings),
                drift_check=gate is not None,
                listing_city=city_code if source is None else None,
            )
            if fetch:
                if client is None and source is None:
                    raise ValueError("fetching needs a supplier client")
                # A walk from the city's first page normalizes each page as it arrives (no
                # re-read of what was just fetched); a resumed walk normalizes afterwards,
                # in page order, with the pages stored by the earlier attempt.
                fresh = lease.checkpoint is None
                # Every stored page of a fresh walk reaches the normalizer as it is fetched:
                # it has none to read back.
                normalizer.stored_pages_seen = fresh
                _fetch(
                    lease,
                    store,
                    _walk(client, lease, settings, source),
                    heartbeat,
                    settings,
                    report,
                    on_page=normalizer.add if fresh else None,
                )
            report.stages_done.append("fetch")
            if gate is not None:
                drift = normalizer.drift()
                if drift is not None:
                    # Stop before normalizing: a renamed field would otherwise turn every
                    # record of the city into a dead letter.
                    report.records = sum(
                        int(r.record_count or 0)
                        for r in _snapshots(db, batch.batch_id, city_code, RAW)
                    )
                    _stop_gated(lease, report, [drift])
                    return report
            writer = normalizer.writer
            if (
                writer is not None
                and source is None
                and normalizer.candidates is not None
                and report.records <= ONE_TRANSACTION_HOTELS
            ):
                # A small city: its last normalize writes go with the shard's end.
                writer.defer = True
            normalizer.finish()
            report.stages_done.append("normalize")
            if gate is not None:
                report.checks = gate(db, batch.batch_id, city_code, report)
                if report.gate_failures:
                    _stop_gated(lease, report, report.checks, writer)
                    return report

            def finish(conn: Connection) -> None:
                _check_counts(report)
                heartbeat.check()
                if writer is not None:
                    writer.write_deferred(conn)
                lease.finish_in(conn, "SUCCESS", counts=report.counts)
                if source is not None:
                    source.finish(conn, report)
                elif fetch:
                    # The city's listing is complete: what it lacks counts a miss.
                    report.presence = record_presence(
                        conn,
                        db.clock,
                        supplier_id=settings.supplier_id,
                        city_code=city_code,
                        listed=normalizer.listed,
                        batch_id=batch.batch_id,
                        at=db.clock.now(),
                        missing_syncs=settings.missing_syncs,
                    )

            publishing = settings if source is None else source.publish_settings(report, settings)
            if _publish(
                lease, store, heartbeat, publishing, report, normalizer.candidates, finish=finish
            ):
                lease.mark_lost(f"shard {city_code!r} already finished", expected=True)
            else:

                def finish_alone() -> None:
                    with db.begin() as conn:
                        finish(conn)

                retry_deadlocks(finish_alone)
                lease.mark_lost(f"shard {city_code!r} already finished", expected=True)
            report.stages_done.append("publish")
    except Exception as err:  # the shard is FAILED (see ShardWork); the report says so too
        report.status, report.error = "FAILED", work.error or f"{type(err).__name__}: {err}"
        raise
    finally:
        if normalizer is not None:
            normalizer.close()
    if work.lost is not None:
        report.status, report.error = "LEASE_LOST", str(work.lost)
    elif client is not None and report.presence is not None and report.presence.missing:
        confirm_missing(db, client, report, batch_id=batch.batch_id, settings=settings)
    return report


# A city's newly missing hotels asked for one by one at most (each costs a request).
CONFIRM_MISSING_MAX = 50


def confirm_missing(
    db: SyncDatabase,
    client: SupplierClient,
    report: CityReport,
    *,
    batch_id: str,
    settings: SyncSettings,
) -> None:
    """Asks the supplier for each hotel the city's listing newly lacked: a 404 is certain,
    and the hotel is unpublished now (a 200 leaves the count: it may be listed elsewhere).
    A failed request changes nothing; the next complete sync counts again."""
    assert report.presence is not None
    gone: list[str] = []
    unconfirmed: list[DeadLetter] = []
    for hotel_id in report.presence.missing[:CONFIRM_MISSING_MAX]:
        try:
            client.get_hotel(hotel_id)
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


DRIFT_SAMPLE_PAGES = 2


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
    writer: _NormalizedWriter | None = None,
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
    else:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="helper") as pool:
            for future in [pool.submit(loop) for _ in range(threads)]:
                future.result()
    return done


def _gated_counts(report: CityReport) -> PageCounts:
    # Nothing published: valid records are held (skipped) until the gate is overridden.
    return PageCounts(
        success=0, failed=report.dead_letters, skipped=report.records - report.dead_letters
    )


def snapshot_id(batch_id: str, city_code: str, kind: str, payload_hash: str) -> str:
    """Deterministic snapshot id: one row per (batch, city, kind, page bytes)."""
    key = f"{batch_id}\0{city_code}\0{kind}\0{payload_hash}"
    return ("rs_" if kind == RAW else "ns_") + hashlib.sha256(key.encode()).hexdigest()[:61]


def _snapshot_row(
    lease: ShardLease,
    *,
    kind: str,
    key_hash: str,
    stored: StoredPayload,
    page_number: int | None,
    record_count: int,
    source_hash: str | None = None,
) -> dict[str, Any]:
    return {
        "snapshot_id": snapshot_id(lease.batch_id, lease.shard_key, kind, key_hash),
        "payload_ref": stored.ref,
        "payload_hash": stored.sha256,
        "page_number": page_number,
        "record_count": record_count,
        # For a NORMALIZED page: the raw page it came from (the trace to the supplier).
        "derived_from": source_hash,
    }


def _record_snapshots(
    conn: Connection,
    lease: ShardLease,
    settings: SyncSettings,
    kind: str,
    rows: Sequence[dict[str, Any]],
) -> None:
    """Snapshot rows for stored pages (idempotent: their ids derive from their content)."""
    insert_ignore(
        conn,
        schema.snapshot,
        rows,
        batch_id=lease.batch_id,
        supplier_id=settings.supplier_id,
        category_code="HOTEL",
        shard_key=lease.shard_key,
        snapshot_type=kind,
        snapshot_version=1,
        created_at=lease.db.clock.now(),
    )


class _RawPage(NamedTuple):
    """A stored page: the fields of its snapshot row that normalization needs."""

    payload_ref: str
    payload_hash: str
    page_number: int | None
    record_count: int | None


PageSink = Callable[[_RawPage, list[Any]], None]
"""Takes each page right after it is committed: its RAW snapshot and its records."""


def _walk(
    client: SupplierClient | None,
    lease: ShardLease,
    settings: SyncSettings,
    source: PageSource | None,
) -> Iterator[FetchedPage]:
    """The shard's pages from its checkpoint: the city's listing, or ``source``'s pages."""
    cp = lease.checkpoint
    if cp is not None and cp.done:
        return iter(())
    if source is not None:
        return source.pages(client, cp, lease.shard_key)
    if client is None:
        raise ValueError("fetching needs a supplier client")
    start = (
        PagePosition(page=cp.page, cursor=cp.cursor, last_hotel_id=cp.last_supplier_hotel_id)
        if cp is not None
        else None
    )
    city = lease.shard_key
    return (
        FetchedPage(
            page.raw,
            page.page_number,
            page.page.hotels,
            page.page.total_pages,
            Checkpoint(
                city,
                page=page.position.page,
                cursor=page.position.cursor,
                last_supplier_hotel_id=page.position.last_hotel_id,
                done=page.position.done,
            ),
        )
        for page in client.iter_city(city, page_size=settings.page_size, start=start)
    )


def _fetch(
    lease: ShardLease,
    store: PayloadStore,
    pages: Iterator[FetchedPage],
    heartbeat: Progress,
    settings: SyncSettings,
    report: CityReport,
    *,
    on_page: PageSink | None = None,
) -> None:
    """Stores and checkpoints each page of the walk, then gives it to ``on_page``.

    The next page is requested while ``on_page`` works on the current one, but only after
    the current one is committed: a crash re-fetches at most one page, as without overlap.
    """
    city = lease.shard_key
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch") as ahead:
        pending = ahead.submit(next, pages, None)
        try:
            while True:
                began = time.perf_counter()
                page = pending.result()
                if page is None:
                    report.seconds["fetch"] += time.perf_counter() - began
                    break
                heartbeat.check()
                heartbeat.report("FETCHING", f"city={city} page={page.page_number}")
                stored = store.put(page.raw, kind="raw", compresslevel=PAGE_COMPRESSLEVEL)
                row = _snapshot_row(
                    lease,
                    kind=RAW,
                    key_hash=stored.sha256,
                    stored=stored,
                    page_number=page.page_number,
                    record_count=len(page.records),
                )
                with lease.db.begin() as conn:
                    _record_snapshots(conn, lease, settings, RAW, [row])
                    lease.advance(
                        page.checkpoint,
                        PageCounts(),
                        total_pages=page.total_pages,
                        fetched=len(page.records),
                        conn=conn,
                    )
                report.pages_fetched += 1
                pending = ahead.submit(next, pages, None)
                report.seconds["fetch"] += time.perf_counter() - began
                if on_page is not None:
                    on_page(
                        _RawPage(stored.ref, stored.sha256, page.page_number, row["record_count"]),
                        _unwrap(page.records),
                    )
                collect_garbage()
        finally:
            # The generator must not be closed while the prefetch thread is inside it.
            with contextlib.suppress(Exception):  # that error is already on its way
                pending.result()
            close = getattr(pages, "close", None)
            if close is not None:
                close()


def _unwrap(records: list[dict[str, Any]]) -> list[Any]:
    """The page's records as decoded from JSON (the client wraps non-object entries)."""
    return [
        r[MALFORMED_RECORD_KEY] if len(r) == 1 and MALFORMED_RECORD_KEY in r else r for r in records
    ]


def _snapshots(db: SyncDatabase, batch_id: str, city: str, kind: str) -> list[_RawPage]:
    s = schema.snapshot.c
    with db.engine.connect() as conn:
        return [
            _RawPage(*row)
            for row in conn.execute(
                sa.select(s.payload_ref, s.payload_hash, s.page_number, s.record_count)
                .where(s.batch_id == batch_id, s.shard_key == city, s.snapshot_type == kind)
                .order_by(s.id)
            )
        ]


class Progress(Protocol):
    """Where a stage says what it is doing and learns whether it may go on.

    A :class:`HeartbeatRunner` for a sync under a lease; :data:`NO_PROGRESS` for a dry run,
    which holds no lease.
    """

    def check(self) -> None:
        """Raises when the work must stop (the lease is lost)."""

    def report(self, stage: str, message: str = "") -> None:
        """Says what the work is doing now."""


class _NoProgress:
    def check(self) -> None:
        return None

    def report(self, stage: str, message: str = "") -> None:
        return None


NO_PROGRESS: Progress = _NoProgress()


@dataclass
class _Page:
    """A raw page being normalized: its snapshot, outcomes and canonical documents."""

    raw: _RawPage
    result: NormalizedDocuments


class _NormalizedWriter:
    """Writes what normalization produced under the lease: NORMALIZED pages, dead letters
    and the city's profile. A dry run has none and writes nothing."""

    def __init__(self, lease: ShardLease, store: PayloadStore, settings: SyncSettings) -> None:
        self.lease, self.store, self.settings = lease, store, settings
        self.city = lease.shard_key
        # Only an earlier claim of the shard can have stored its NORMALIZED pages.
        self.done = (
            {
                row.payload_hash
                for row in _snapshots(lease.db, lease.batch_id, self.city, NORMALIZED)
            }
            if lease.resumed
            else set()
        )
        self.rows: list[dict[str, Any]] = []
        self.letters: list[DeadLetter] = []
        # A small city's last normalize writes (its last rows and its profile) wait for the
        # transaction that ends the shard: one transaction, fence and commit fewer per city,
        # and a crash before it only repeats normalizing a page or two.
        self.defer = False
        self.deferred: tuple[int, int, FieldCounts] | None = None

    def page(self, raw: _RawPage, lines: list[bytes], letters: list[DeadLetter]) -> None:
        """Stores a page's kept documents (JSON lines) and keeps its rows for :meth:`flush`."""
        body = b"\n".join(lines)
        if hashlib.sha256(body).hexdigest() in self.done and not letters:
            return
        stored = self.store.put(body, kind="normalized", compresslevel=PAGE_COMPRESSLEVEL)
        self.rows.append(
            _snapshot_row(
                self.lease,
                kind=NORMALIZED,
                key_hash=raw.payload_hash,
                stored=stored,
                page_number=raw.page_number,
                record_count=len(lines),
                source_hash=raw.payload_hash,
            )
        )
        self.letters.extend(letters)

    def flush(self) -> None:
        """Writes the kept rows in one fenced transaction."""
        # Normalizing is a pure function of the stored raw pages, so its rows are written
        # every few pages rather than per page: a crash only repeats that work, and a
        # concurrent worker waits for the write lock (SQLite) less often.
        if not self.rows and not self.letters:
            return
        with self.lease.db.begin() as conn:
            self.lease.fence(conn, "NORMALIZING", f"city={self.city}")
            self._write(conn)

    def _write(self, conn: Connection, *, clear: bool = True) -> None:
        lease, settings = self.lease, self.settings
        _record_snapshots(conn, lease, settings, NORMALIZED, self.rows)
        if self.letters:
            record_dead_letters(
                conn,
                lease.db.clock,
                batch_id=lease.batch_id,
                task_code=settings.task_code,
                sync_mode=settings.sync_mode,
                supplier_id=settings.supplier_id,
                letters=self.letters,
            )
        if clear:
            self.rows.clear()
            self.letters.clear()

    def profile(self, report: CityReport, fields: FieldCounts) -> None:
        """Records the city's profile, which the batch gates judge, with the rows not
        flushed yet (the last pages): one fenced transaction, or, when :attr:`defer` is
        set, the transaction that ends the shard (:meth:`write_deferred`)."""
        if self.defer:
            self.deferred = (report.records, report.dead_letters, fields)
        else:
            lease = self.lease
            with lease.db.begin() as conn:
                lease.fence(conn, "NORMALIZING", f"city={self.city} profile")
                self._write(conn)
                self._record_profile(conn, report.records, report.dead_letters, fields)
        # As stored (the stored field counts are capped), for the gate to judge.
        report.profile = CityProfile(
            self.lease.batch_id,
            self.settings.task_code,
            self.city,
            report.records,
            report.dead_letters,
            FieldCounts.from_json(fields.to_json()),
        )

    def _record_profile(
        self, conn: Connection, records: int, bad: int, fields: FieldCounts
    ) -> None:
        record_city_profile(
            conn,
            self.lease.db.clock,
            batch_id=self.lease.batch_id,
            task_code=self.settings.task_code,
            shard_key=self.city,
            record_count=records,
            bad_count=bad,
            field_counts=fields,
        )

    def write_deferred(self, conn: Connection) -> None:
        """Writes the deferred rows and profile in the caller's transaction (the shard's
        last, fenced by its finish). It may run again after a rollback (a deadlock's retry),
        so nothing is cleared here."""
        if self.deferred is None:
            return
        self._write(conn, clear=False)
        self._record_profile(conn, *self.deferred)


KeptSink = Callable[[list[Candidate]], None]
"""Takes each validated chunk's kept documents as publish candidates."""


class _Normalizer:
    """Normalizes a city's raw pages, page by page, validating them a chunk at a time.

    Pages come from the fetch as they are committed (:meth:`add`) and, in :meth:`finish`,
    from the store for every stored RAW page of ``batch_id`` not seen yet (a resumed walk, a
    replay, a dry run). With a ``writer``, each page's kept documents are stored as a
    NORMALIZED page and its rejected records become dead letters; without one nothing is
    written. With ``drift_check``, the first ``DRIFT_SAMPLE_PAGES`` pages wait until schema
    drift has been judged on them: a drifted city is not normalized at all.

    Each validated chunk's kept documents go to ``on_kept`` when given (a dry run diffs
    them at once: memory stays bounded by a chunk); otherwise, while the city stays within
    ``settings.memory_hotels`` kept documents, they are kept as publish candidates
    (:attr:`candidates`), so publishing does not read them back.
    """

    def __init__(
        self,
        db: SyncDatabase,
        batch_id: str,
        city: str,
        store: PayloadStore,
        progress: Progress,
        settings: SyncSettings,
        report: CityReport,
        city_countries: Mapping[str, str],
        *,
        writer: _NormalizedWriter | None,
        drift_check: bool,
        on_kept: KeptSink | None = None,
        listing_city: str | None = None,
    ) -> None:
        self.db, self.batch_id, self.city = db, batch_id, city
        # The city whose listing the pages are (None: a change feed, no listing city).
        self.listing_city = listing_city
        self.store, self.progress, self.writer = store, progress, writer
        self.settings, self.report, self.city_countries = settings, report, city_countries
        self.on_kept = on_kept
        report.records = 0
        report.dead_letters = 0
        report.moved = 0
        report.dead_letters_by_code.clear()
        self.fields = FieldCounts()
        self.seen: set[str] = set()
        # Every hotel id on the pages (valid or not): what the listing holds (tombstones).
        self.listed: set[str] = set()
        self.pages: list[_Page] = []
        self.buffered = 0
        self.candidates: list[Candidate] | None = None if on_kept is not None else []
        # Pages waiting for the drift judgement; None once judged (or with no drift check).
        self._pending: list[tuple[_RawPage, list[Any]]] | None = [] if drift_check else None
        self._drift: GateResult | None = None
        # True when every stored RAW page was given to add(): finish() reads none back.
        self.stored_pages_seen = False
        # Pages being normalized and judged in forked processes (settings.normalize_processes).
        self._workers: ProcessPoolExecutor | None = None
        self._inflight: deque[tuple[_RawPage, Future[_JudgedPage]]] = deque()

    def drift(self) -> GateResult | None:
        """Judges schema drift (once) on the first pages; the failed check, or None."""
        pending, self._pending = self._pending, None
        if pending is None:
            return self._drift
        if pending:
            sample = [records for _, records in pending]
        else:  # nothing arrived from a fetch: the stored pages (resumed walk, replay)
            raws = _snapshots(self.db, self.batch_id, self.city, RAW)
            sample = [self._load(raw) for raw in raws[:DRIFT_SAMPLE_PAGES]]
        self._drift = check_first_pages(
            self.db,
            batch_id=self.batch_id,
            task_code=self.settings.task_code,
            shard_key=self.city,
            pages=sample,
        )
        if self._drift is None:
            for raw, records in pending:
                self._normalize(raw, records)
        return self._drift

    def add(self, raw: _RawPage, records: list[Any]) -> None:
        """Takes a page just committed by the fetch."""
        if self._pending is not None:
            self._pending.append((raw, records))
            if len(self._pending) >= DRIFT_SAMPLE_PAGES:
                self.drift()
        elif self._drift is None:
            self._normalize(raw, records)

    def finish(self) -> None:
        """Normalizes the stored pages not seen yet, validates the rest, records the profile."""
        if self.drift() is not None:
            raise RuntimeError("a city with schema drift is not normalized")
        if not self.stored_pages_seen:
            for raw in _snapshots(self.db, self.batch_id, self.city, RAW):
                if raw.payload_hash not in self.seen:
                    self._normalize(raw, self._load(raw))
        began = time.perf_counter()
        self._validate(flush=False)
        self.close()
        if self.writer is not None:
            self.writer.profile(self.report, self.fields)  # with the rows not flushed
        self.report.seconds["normalize"] += time.perf_counter() - began

    def _load(self, raw: _RawPage) -> list[Any]:
        return page_records(decode_json(self.store.get(raw.payload_ref)))

    def _normalize(self, raw: _RawPage, records: list[Any]) -> None:
        if raw.payload_hash in self.seen:
            return  # the same page bytes again (a walk re-reads overlapping pages)
        began = time.perf_counter()
        self.seen.add(raw.payload_hash)
        self.listed.update(
            r["hotel_id"]
            for r in records
            if isinstance(r, dict) and isinstance(r.get("hotel_id"), str)
        )
        self.progress.check()
        self.progress.report("NORMALIZING", f"city={self.city} page={raw.page_number}")
        self.report.records += int(raw.record_count or 0)
        self.fields.add(records)
        if self.settings.normalize_processes > 0 and self.on_kept is None:
            self._submit(raw, records)
        else:
            result = normalize_documents(records)
            self.pages.append(_Page(raw, result))
            self.buffered += len(result.docs)
            if self.buffered >= self.settings.chunk_hotels:
                self._validate()
        collect_garbage()
        self.report.seconds["normalize"] += time.perf_counter() - began

    def _validate(self, *, flush: bool = True) -> None:
        if self._workers is not None:
            self._collect(block=True)
            if self.writer is not None and flush:
                self.writer.flush()
            return
        # Row-level quality runs over many pages at once: its cost is mostly per call.
        pages = self.pages
        moved, judged = _judge(pages, self.listing_city, self.city_countries)
        self.report.moved += moved
        kept_chunk: list[Candidate] = []
        for page, (kept, letters) in zip(pages, judged, strict=True):
            lines = [canonical_dumps(d) for d in kept]
            self._keep(page.raw, lines, kept, letters, kept_chunk)
        pages.clear()
        self.buffered = 0
        if self.writer is not None and flush:
            self.writer.flush()
        self._hand_over(kept_chunk)

    def _keep(
        self,
        raw: _RawPage,
        lines: list[bytes],
        kept: Sequence[dict[str, Any]] | None,
        letters: list[DeadLetter],
        kept_chunk: list[Candidate],
    ) -> None:
        """Counts a judged page, keeps its documents as candidates and stores it (``kept``:
        the documents of ``lines``, decoded from them when None)."""
        report = self.report
        # Dead letters are counted from every page, also pages normalized by an earlier
        # attempt, so that the shard's counts describe all of its records.
        report.dead_letters += len(letters)
        report.dead_letters_by_code.update(d.error_code for d in letters)
        if self.on_kept is not None or self.candidates is not None:
            docs = kept if kept is not None else [loads_canonical(line) for line in lines]
            kept_chunk.extend(
                Candidate(doc, hashlib.sha256(line).hexdigest(), raw.payload_ref, raw.payload_hash)
                for doc, line in zip(docs, lines, strict=True)
            )
        if self.writer is not None:
            self.writer.page(raw, lines, letters)

    def _hand_over(self, kept_chunk: list[Candidate]) -> None:
        if self.on_kept is not None:
            if kept_chunk:
                self.on_kept(kept_chunk)
        elif self.candidates is not None:
            if len(self.candidates) + len(kept_chunk) > self.settings.memory_hotels:
                self.candidates = None  # a large city: publishing reads its pages back
            else:
                self.candidates.extend(kept_chunk)

    # -- pages judged in forked processes ----------------------------------------------

    def _submit(self, raw: _RawPage, records: list[Any]) -> None:
        """Hands a page to a forked process, which normalizes and judges it."""
        if self._workers is None:
            self._workers = ProcessPoolExecutor(
                max_workers=self.settings.normalize_processes,
                mp_context=multiprocessing.get_context("fork"),
                initializer=_start_forked_judge,
                initargs=(self.db, self.listing_city, self.city_countries),
            )
        self._inflight.append((raw, self._workers.submit(_judge_page, raw, records)))
        # Two pages ahead per process: enough to keep them busy, and memory bounded.
        self._collect(block=False)

    def _collect(self, *, block: bool) -> None:
        """Takes in the judged pages in page order: every one with ``block``; otherwise
        those done, waiting only while too many are in flight."""
        limit = 0 if block else 2 * self.settings.normalize_processes
        kept_chunk: list[Candidate] = []
        inflight = self._inflight
        while inflight and (len(inflight) > limit or inflight[0][1].done()):
            raw, future = inflight.popleft()
            judged = future.result()
            self.report.moved += judged.moved
            self._keep(raw, judged.lines, None, judged.letters, kept_chunk)
            self.buffered += len(judged.lines) + len(judged.letters)
        if self.writer is not None and self.buffered >= self.settings.chunk_hotels:
            self.writer.flush()
            self.buffered = 0
        self._hand_over(kept_chunk)

    def close(self) -> None:
        """Stops the forked processes, if any ran (idempotent)."""
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.shutdown(wait=True, cancel_futures=True)
        self._inflight.clear()


class _JudgedPage(NamedTuple):
    """A page normalized and judged in a forked process: its kept documents as canonical
    JSON lines, its dead letters, and how many of its hotels moved to another city."""

    lines: list[bytes]
    letters: list[DeadLetter]
    moved: int


_judge_context: tuple[str | None, Mapping[str, str]] | None = None


def _start_forked_judge(
    db: SyncDatabase, listing_city: str | None, city_countries: Mapping[str, str]
) -> None:
    global _judge_context
    # The parent's pooled connections stay the parent's; this process writes nothing.
    db.engine.dispose(close=False)
    gc.freeze()
    _judge_context = (listing_city, city_countries)


def _judge_page(raw: _RawPage, records: list[Any]) -> _JudgedPage:
    assert _judge_context is not None, "not a forked judge"
    listing_city, city_countries = _judge_context
    moved, judged = _judge([_Page(raw, normalize_documents(records))], listing_city, city_countries)
    kept, letters = judged[0]
    return _JudgedPage([canonical_dumps(d) for d in kept], letters, moved)


def _judge(
    pages: Sequence[_Page], listing_city: str | None, city_countries: Mapping[str, str]
) -> tuple[int, list[tuple[list[dict[str, Any]], list[DeadLetter]]]]:
    """The quality pass over normalized pages at once: how many hotels moved to another
    city, and each page's kept documents and dead letters (its rejected records, then its
    documents that failed a check)."""
    docs = [d for page in pages for d in page.result.docs]
    failed: dict[int, DeadLetter] = {}
    moved = 0
    if docs:
        # Every document comes straight from normalize_documents, whose phone rule
        # already parsed and validated its number with libphonenumber; the second net
        # keeps the vectorised E.164 shape check without a second parse of each number
        # (bench_quality, chunks of 2,000 new numbers: 57 -> 32 us per hotel).
        quality = check_quality(
            docs,
            city_code=listing_city,
            city_countries=city_countries,
            parse_phones=False,
        )
        moved = len(quality.moved)
        starts = list(itertools.accumulate((len(p.result.docs) for p in pages), initial=0))
        for f in quality.failures:
            k = bisect.bisect_right(starts, f.index) - 1
            page = pages[k]
            pos = page.result.doc_index[f.index - starts[k]]
            city = listing_city or docs[f.index].get("city_code")
            failed[f.index] = replace(
                f.dead_letter(
                    page.raw.payload_ref,
                    page.raw.payload_hash,
                    record_position=f"record#{pos}",
                ),
                city_code=city if isinstance(city, str) else None,
            )
    offset = 0
    judged: list[tuple[list[dict[str, Any]], list[DeadLetter]]] = []
    for page in pages:
        raw, result = page.raw, page.result
        page_letters = [
            DeadLetter(
                r.supplier_hotel_id,
                r.stage,
                "NON_RETRYABLE",
                r.error_code,
                r.message,
                raw.payload_ref,
                raw.payload_hash,
                # The record's place on its page: two unreadable records of one page
                # stay two dead letters, and a re-run finds the same key.
                record_position=f"record#{index}",
                city_code=listing_city,
            )
            for r, index in zip(result.rejections, result.rejection_index, strict=True)
        ]
        kept = []
        for i, doc in enumerate(result.docs):
            letter = failed.get(offset + i)
            if letter is None:
                kept.append(doc)
            else:
                page_letters.append(letter)
        offset += len(result.docs)
        judged.append((kept, page_letters))
    return moved, judged


def _normalized_chunks(
    db: SyncDatabase, store: PayloadStore, batch_id: str, city: str, chunk_hotels: int
) -> Iterator[list[Candidate]]:
    """Candidates of the city, chunk by chunk, each traced to its raw page."""
    s = schema.snapshot.c
    with db.engine.connect() as conn:
        rows = list(
            conn.execute(
                sa.select(s.payload_ref, s.derived_from)
                .where(s.batch_id == batch_id, s.shard_key == city, s.snapshot_type == NORMALIZED)
                .order_by(s.id)
            )
        )
        raw_refs = dict(
            conn.execute(
                sa.select(s.payload_hash, s.payload_ref).where(
                    s.batch_id == batch_id, s.shard_key == city, s.snapshot_type == RAW
                )
            ).all()
        )
    chunk: list[Candidate] = []
    for row in rows:
        raw_hash = row.derived_from
        raw_ref = raw_refs.get(raw_hash)
        # A NORMALIZED page is JSON lines of canonical documents: a line's sha256 is the
        # hotel's fingerprint (normalize.fingerprint), no re-encoding needed.
        for line in store.get(row.payload_ref).split(b"\n"):
            if line:
                fp = hashlib.sha256(line).hexdigest()
                chunk.append(Candidate(loads_canonical(line), fp, raw_ref, raw_hash))
        if len(chunk) >= chunk_hotels:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class ChunkPublished(NamedTuple):
    """What publishing one chunk did (or, for a dry run, would do).

    Attributes:
        diffs: One diff per distinct hotel of the chunk.
        published: Hotels published.
        not_newer: Publishes the version guard refused (a newer version was published).
        held: Diffs held for review.
    """

    diffs: list[HotelDiff]
    published: int
    not_newer: int
    held: int


Publisher = Callable[[list[Candidate]], ChunkPublished]
"""The last stage for one chunk of distinct candidates: maps, diffs and publishes them
(:class:`_LeasePublisher`), or only diffs them (:class:`DiffCollector`, a dry run)."""


ChunkSink = Callable[[Connection, ChunkPublished], None]
"""Runs in the transaction that published a city's last chunk, with what it published."""

# A last chunk of at most this many hotels is mapped, diffed and published in the one
# transaction that also finishes the shard: the write lock is held a few milliseconds
# longer, and a small city commits two transactions fewer.
ONE_TRANSACTION_HOTELS = 250


class _LeasePublisher:
    """Maps, diffs and publishes chunks under the city's lease."""

    def __init__(self, lease: ShardLease, settings: SyncSettings) -> None:
        self.lease, self.settings = lease, settings
        # The resource id of each of the shard's hotels, once :meth:`ensure_mappings` made
        # every mapping of its candidates.
        self.resource_ids: dict[str, int] | None = None

    def __call__(self, cands: list[Candidate]) -> ChunkPublished:
        return self.publish(cands)

    def publish(self, cands: list[Candidate], then: ChunkSink | None = None) -> ChunkPublished:
        """Publishes a chunk; ``then`` runs in the publishing transaction (the last chunk's,
        which finishes the shard with :meth:`ShardLease.finish_in`: that fenced write, not
        a fence first, guards the transaction).

        The rows are built before any transaction, as far as they do not depend on the
        diffs (:func:`~supplier_sync_dagster.core.records.publish.candidate_rows`): a write
        transaction holds SQLite's one write lock, which every worker of a run waits for.
        """
        lease, settings = self.lease, self.settings
        db = lease.db
        rows = candidate_rows(cands, supplier_id=settings.supplier_id, batch_id=lease.batch_id)
        if then is not None and len(cands) <= ONE_TRANSACTION_HOTELS:
            with db.begin() as conn:
                lease.ensure_held()
                # One database time per transaction: a bulk insert would otherwise
                # evaluate the clock's SQL expression on every row.
                at = db.clock.read(conn)
                maps = self._mappings(conn, cands, at, published=True)
                diffs = compute_diffs(
                    conn,
                    cands,
                    maps.resource_ids,
                    policy=settings.risk_policy,
                    published_ids=maps.published,
                )
                items, plan = self._plan(diffs, cands, rows)
                return self._write(conn, items, plan, then, at, diffs_current=True)
        # Each transaction is fenced at its end, like a shard's finish: a lost lease still
        # rolls all of it back, and the shard's row is locked (InnoDB) only from the fence
        # to the commit, so processes publishing chunks of one shard (an incremental
        # window's) write at once instead of queueing on that row.
        found = self.resource_ids
        if found is None or any(c.supplier_hotel_id not in found for c in cands):
            with db.begin() as conn:
                found = self._mappings(
                    conn, cands, db.clock.read(conn), published=False
                ).resource_ids
                lease.fence(conn, "PUBLISHING", f"city={lease.shard_key} mappings")
        # Otherwise no query and no write lock: a mapping never changes once made, and a
        # forked process has the shard's from its parent's memory. It diffs while another
        # one writes (SQLite's write lock is one for the whole database).
        with db.engine.connect() as conn:
            diffs = compute_diffs(conn, cands, found, policy=settings.risk_policy)
        items, plan = self._plan(diffs, cands, rows)
        with db.begin() as conn:
            if then is not None:
                lease.ensure_held()
                return self._write(conn, items, plan, then, db.clock.read(conn))
            done = self._write(conn, items, plan, None, db.clock.read(conn))
            lease.fence(conn, "PUBLISHING", f"city={lease.shard_key}")
            return done

    def ensure_mappings(self, cands: Sequence[Candidate]) -> dict[str, int]:
        """Creates the missing mappings of ``cands`` in one fenced transaction.

        Returns:
            The resource id of each candidate's hotel.
        """
        lease, db = self.lease, self.lease.db

        def attempt() -> dict[str, int]:
            with db.begin() as conn:
                # Only the ids: the chunks' diffs read what is published.
                found = self._mappings(conn, list(cands), db.clock.read(conn), published=False)
                lease.fence(conn, "PUBLISHING", f"city={lease.shard_key} mappings")
                return found.resource_ids

        self.resource_ids = retry_deadlocks(attempt)
        return self.resource_ids

    def _mappings(
        self, conn: Connection, cands: Sequence[Candidate], at: datetime, *, published: bool
    ) -> HotelMappings:
        return ensure_hotel_mappings(
            conn,
            self.lease.db.clock,
            supplier_id=self.settings.supplier_id,
            batch_id=self.lease.batch_id,
            hotel_ids=[c.supplier_hotel_id for c in cands],
            at=at,
            published=published,
        )

    def _plan(
        self, diffs: list[HotelDiff], cands: list[Candidate], rows: Mapping[str, CandidateRows]
    ) -> tuple[list[tuple[HotelDiff, Candidate]], PublishPlan]:
        """The chunk's (diff, candidate) pairs and its publish's rows."""
        by_id = {c.supplier_hotel_id: c for c in cands}
        items = [(d, by_id[d.supplier_hotel_id]) for d in diffs]
        plan = prepare_publish(
            supplier_id=self.settings.supplier_id,
            batch_id=self.lease.batch_id,
            items=items,
            rows=rows,
        )
        return items, plan

    def _write(
        self,
        conn: Connection,
        items: list[tuple[HotelDiff, Candidate]],
        plan: PublishPlan,
        then: ChunkSink | None,
        at: datetime,
        *,
        diffs_current: bool = False,
    ) -> ChunkPublished:
        """Writes the diff log, the reviews and the publish of a chunk in ``conn``
        (``items``: its (diff, candidate) pairs; ``plan``: their rows; ``at``: its database
        time; ``diffs_current``: the diffs were read in its transaction)."""
        lease, settings = self.lease, self.settings
        db, city = lease.db, lease.shard_key
        diffs = [d for d, _ in items]
        record_diffs(
            conn,
            db.clock,
            batch_id=lease.batch_id,
            shard_key=city,
            supplier_id=settings.supplier_id,
            diffs=diffs,
            at=at,
            raw_payload_hashes=[c.raw_payload_hash for _, c in items],
        )
        held = hold_for_review(
            conn,
            db.clock,
            batch_id=lease.batch_id,
            shard_key=city,
            supplier_id=settings.supplier_id,
            items=[(d, c) for d, c in items if d.action == "REVIEW"],
        )
        result = publish_hotels(
            conn,
            db.clock,
            supplier_id=settings.supplier_id,
            batch_id=lease.batch_id,
            items=items,
            plan=plan,
            diffs_current=diffs_current,
            at=at,
        )
        done = ChunkPublished(diffs, len(result.published), len(result.not_newer), held)
        if then is not None:
            then(conn, done)
        return done


class DiffCollector:
    """A dry run's publisher: diffs each chunk against what is published, through read-only
    connections, and keeps a sample of the changes; it allocates and writes nothing.

    Hotels without a mapping yet get ids that match nothing published (so: NEW), never a
    real one.

    Args:
        db: The sync database (read only).
        settings: The supplier and the risk policy.
        sample: How many changes (not NO_CHANGE or NEW) to keep, for people.
    """

    def __init__(self, db: SyncDatabase, settings: SyncSettings, *, sample: int = 20) -> None:
        self.db, self.settings, self.sample = db, settings, sample
        self.changes: list[dict[str, Any]] = []
        self._unmapped = 0

    def __call__(self, cands: list[Candidate]) -> ChunkPublished:
        m = schema.hotel_mapping.c
        ids = sorted({c.supplier_hotel_id for c in cands})
        resource_ids: dict[str, int] = {}
        with self.db.engine.connect() as conn:
            for part in chunks(ids):
                for hid, rid in conn.execute(
                    sa.select(m.supplier_hotel_id, m.id).where(
                        m.supplier_id == self.settings.supplier_id, m.supplier_hotel_id.in_(part)
                    )
                ):
                    resource_ids[str(hid)] = int(rid)
            for hid in ids:
                if hid not in resource_ids:
                    self._unmapped += 1
                    resource_ids[hid] = -self._unmapped
            diffs = compute_diffs(conn, cands, resource_ids, policy=self.settings.risk_policy)
        for d in diffs:
            if len(self.changes) < self.sample and d.diff_type not in ("NO_CHANGE", "NEW"):
                self.changes.append(
                    {
                        "supplier_hotel_id": d.supplier_hotel_id,
                        "diff_type": d.diff_type,
                        "action": d.action,
                        "changed_fields": d.changed_fields[:10],
                    }
                )
        would_publish = sum(1 for d in diffs if d.action == "AUTO_PUBLISH")
        held = sum(1 for d in diffs if d.action == "REVIEW")
        return ChunkPublished(diffs, would_publish, 0, held)


def _start_publish(report: CityReport) -> None:
    report.published = 0
    report.skipped = 0
    report.duplicates = 0
    report.held_for_review = 0


def _publish_chunk(
    publisher: Publisher,
    chunk: Sequence[Candidate],
    progress: Progress,
    report: CityReport,
    then: Callable[[Connection], None] | None = None,
) -> None:
    """Publishes one chunk of a city's candidates and counts what became of each.

    ``then`` (a lease publisher's last chunk) runs in the publishing transaction, after
    the chunk is counted.
    """
    progress.check()
    progress.report("PUBLISHING", f"city={report.city_code} chunk of {len(chunk)}")
    cands = collapse_duplicates(chunk)
    report.duplicates += len(chunk) - len(cands)
    if then is None:
        _count_chunk(report, len(chunk), retry_deadlocks(lambda: publisher(cands)))
        return
    assert isinstance(publisher, _LeasePublisher)
    # The last chunk counts inside its transaction (the shard's finish checks the sums): a
    # deadlock's rollback takes the counts back too.
    before = _publish_counts(report)

    def last(conn: Connection, done: ChunkPublished) -> None:
        _count_chunk(report, len(chunk), done)
        then(conn)

    def attempt() -> ChunkPublished:
        _restore_publish_counts(report, before)
        return publisher.publish(cands, last)

    retry_deadlocks(attempt)


def _publish_counts(report: CityReport) -> tuple[Any, ...]:
    """What :func:`_count_chunk` and a shard's finish change in a report."""
    return (
        report.held_for_review,
        Counter(report.diffs_by_type),
        Counter(report.diffs_by_action),
        report.published,
        report.skipped,
        report.presence,
    )


def _restore_publish_counts(report: CityReport, saved: tuple[Any, ...]) -> None:
    held, by_type, by_action, published, skipped, presence = saved
    report.held_for_review, report.published, report.skipped = held, published, skipped
    report.diffs_by_type, report.diffs_by_action = Counter(by_type), Counter(by_action)
    report.presence = presence


class _ChunkCounts(NamedTuple):
    """What became of a chunk's candidates, small enough to send between processes."""

    held: int
    by_type: Counter[str]
    by_action: Counter[str]
    published: int
    skipped: int

    @classmethod
    def of(cls, size: int, done: ChunkPublished) -> _ChunkCounts:
        """The counts of a chunk of ``size`` candidates (one diff per distinct hotel)."""
        return cls(
            done.held,
            Counter(d.diff_type for d in done.diffs),
            Counter(d.action for d in done.diffs),
            done.published,
            # Not published: duplicates, diffs whose action is not AUTO_PUBLISH (unchanged,
            # stale, held for review), and publishes the version guard refused.
            size
            - len(done.diffs)
            + sum(1 for d in done.diffs if d.action != "AUTO_PUBLISH")
            + done.not_newer,
        )

    def add_to(self, report: CityReport) -> None:
        """Adds these counts to the city's report."""
        report.held_for_review += self.held
        report.diffs_by_type.update(self.by_type)
        report.diffs_by_action.update(self.by_action)
        report.published += self.published
        report.skipped += self.skipped


def _count_chunk(report: CityReport, size: int, done: ChunkPublished) -> None:
    """Counts what became of a chunk of ``size`` candidates (one diff per distinct hotel)."""
    # No collection per chunk: publishing makes little cyclic garbage, and a full
    # collection would re-scan the city's candidates held in memory each time.
    _ChunkCounts.of(size, done).add_to(report)


# A shard's chunks published in forked processes (see _publish_in_processes): set in each
# process by its initializer, before its first chunk.
_forked_publisher: _LeasePublisher | None = None
_forked_parts: Sequence[Sequence[Candidate]] = ()


def _publish_in_processes(
    publisher: _LeasePublisher,
    parts: Sequence[Sequence[Candidate]],
    progress: Progress,
    report: CityReport,
) -> None:
    """Publishes chunks of a shard in ``publish_processes`` forked processes.

    Each process opens its own connections (the engine's pool is not shared across a fork)
    and publishes under the shard's lease: its writes are fenced by the same worker id and
    token, so a lost lease stops them as it stops this process. The candidates reach the
    processes through the fork's memory, not pickled; only each chunk's counts come back.
    This process keeps the heartbeat; the caller publishes the last chunk, which finishes
    the shard, once every other chunk is in. The caller made every mapping of ``parts``
    (:meth:`_LeasePublisher.ensure_mappings`).
    """
    lease = publisher.lease
    workers = min(publisher.settings.publish_processes, len(parts))
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("fork"),
        initializer=_start_forked_publisher,
        initargs=(publisher, parts),
    )
    try:
        futures = [pool.submit(_publish_forked_part, i) for i in range(len(parts))]
        for future in futures:
            progress.check()
            progress.report("PUBLISHING", f"city={report.city_code} chunks in {workers} processes")
            duplicates, counts = future.result()
            report.duplicates += duplicates
            counts.add_to(report)
    except LeaseLost as err:
        lease.mark_lost(str(err))
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _start_forked_publisher(
    publisher: _LeasePublisher, parts: Sequence[Sequence[Candidate]]
) -> None:
    global _forked_publisher, _forked_parts
    # The parent's pooled connections stay the parent's: this process opens its own.
    publisher.lease.db.engine.dispose(close=False)
    prepare_process()
    # What the fork copied (the shard's candidates among it) is this process's read-only
    # input: a full collection would walk all of it, and touch every page it sits on.
    gc.freeze()
    _forked_publisher, _forked_parts = publisher, parts


def _publish_forked_part(index: int) -> tuple[int, _ChunkCounts]:
    publisher = _forked_publisher
    assert publisher is not None, "not a forked publisher"
    chunk = _forked_parts[index]
    cands = collapse_duplicates(chunk)
    done = retry_deadlocks(lambda: publisher(cands))
    return len(chunk) - len(cands), _ChunkCounts.of(len(chunk), done)


# The chunk that finishes a shard published in processes: small, since it waits for every
# other chunk and then runs alone (and within ONE_TRANSACTION_HOTELS: one transaction).
LAST_CHUNK_HOTELS = 200


def split_for_processes(
    candidates: Sequence[Candidate], size: int, processes: int
) -> tuple[list[Sequence[Candidate]], Sequence[Candidate]]:
    """Splits a shard's candidates into chunks for ``processes`` publishing processes and a
    last chunk of at most ``LAST_CHUNK_HOTELS``.

    The chunks are of equal size, close to ``size``, and their number is a multiple of
    ``processes``: each process gets the same work, so none waits for a straggler, and the
    last chunk, which runs only when all of them are in, is short.

    Returns:
        The processes' chunks and the last chunk.
    """
    tail = min(LAST_CHUNK_HOTELS, max(1, len(candidates) // (processes * 4)))
    rest, last = candidates[:-tail], candidates[-tail:]
    count = processes * max(1, round(len(rest) / (size * processes)))
    each = -(-len(rest) // count)
    return [p for p in chunks(rest, each) if p], last


def _check_counts(report: CityReport) -> None:
    if report.published + report.dead_letters + report.skipped != report.records:
        raise CountsDoNotAddUp(
            f"city {report.city_code!r}: {report.records} records but {report.published} "
            f"published + {report.dead_letters} dead letters + {report.skipped} skipped"
        )


def _publish(
    lease: ShardLease,
    store: PayloadStore,
    progress: Progress,
    settings: SyncSettings,
    report: CityReport,
    candidates: Sequence[Candidate] | None = None,
    *,
    finish: Callable[[Connection], None] | None = None,
) -> bool:
    """Maps, diffs and publishes the city chunk by chunk.

    ``candidates`` are the city's normalized documents when normalization kept them all in
    memory; otherwise they are read back from the city's NORMALIZED pages. With them,
    ``finish`` runs in the transaction that publishes the last chunk.

    Returns:
        Whether ``finish`` ran (it did not when the city is read back or has no candidate).
    """
    began = time.perf_counter()
    size = settings.publish_chunk_hotels
    publisher = _LeasePublisher(lease, settings)
    _start_publish(report)
    finished = False
    if candidates is None:
        for chunk in _normalized_chunks(lease.db, store, lease.batch_id, lease.shard_key, size):
            _publish_chunk(publisher, chunk, progress, report)
    else:
        parts = list(chunks(candidates, size))
        if settings.publish_processes > 1 and len(parts) > 2:
            # Every mapping exists before the processes start: they look theirs up without
            # taking SQLite's write lock, so each diffs its next chunk while another writes.
            ids = publisher.ensure_mappings(candidates)
            # Each publish is version-guarded, so the order of a shard's hotels does not
            # matter (the shard finishes with the last chunk): they go in the catalog's
            # order. An incremental window's changes lie all over the catalog, and a chunk
            # of neighbouring hotels reads and writes fewer pages, each in fewer
            # transactions (a day's 8,373 changes of 100k hotels on SQLite: publish 1.85 s
            # -> 1.58 s). A stable sort keeps two versions of one hotel in feed order.
            candidates = sorted(candidates, key=lambda c: ids[c.supplier_hotel_id])
            head, tail = split_for_processes(candidates, size, settings.publish_processes)
            _publish_in_processes(publisher, head, progress, report)
            parts = [tail]
        last = len(parts) - 1
        for i, part in enumerate(parts):
            then = finish if i == last else None
            _publish_chunk(publisher, part, progress, report, then)
            finished = then is not None
    _check_counts(report)
    report.seconds["publish"] += time.perf_counter() - began
    return finished


def dry_run_stages(
    db: SyncDatabase,
    store: PayloadStore,
    *,
    batch_id: str,
    city_code: str,
    settings: SyncSettings,
    publisher: Publisher,
    city_countries: Mapping[str, str] | None = None,
) -> CityReport:
    """The normalize and publish stages over a batch's stored raw pages, writing nothing.

    The same stages as :func:`sync_city` without a lease: no normalized page, dead letter,
    profile or diff is written; each validated chunk goes straight to ``publisher`` (a
    :class:`DiffCollector`), so memory stays bounded by a chunk whatever the city's size.
    The report's ``published`` counts what a replay would publish.

    Args:
        db: The sync database (read only).
        store: The payload store (read only).
        batch_id: The batch whose RAW pages of the city are read.
        city_code: The city.
        settings: Task and tuning settings (``chunk_hotels`` bounds memory).
        publisher: Takes each chunk; it must not write.
        city_countries: City -> country code, for the country rule.

    Raises:
        CountsDoNotAddUp: A record ended in no bucket, or in two.
    """
    report = CityReport(city_code)
    _start_publish(report)
    normalizer = _Normalizer(
        db,
        batch_id,
        city_code,
        store,
        NO_PROGRESS,
        settings,
        report,
        city_countries or {},
        writer=None,
        drift_check=False,
        on_kept=lambda kept: _publish_chunk(publisher, kept, NO_PROGRESS, report),
        listing_city=city_code,
    )
    normalizer.finish()
    _check_counts(report)
    return report
