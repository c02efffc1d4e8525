"""The stages after the fetch: normalize (and judge), then map, diff and publish.

- **normalize**: a walk from the city's first page normalizes each page as soon as it is
  committed (:meth:`Normalizer.add`); a resumed walk or a replay reads the RAW snapshots
  back from the store (never the supplier: replay is free). Row-level quality judges the
  documents a chunk at a time; each page's kept documents are stored as a NORMALIZED
  snapshot (JSON lines), every rejected record as a dead letter (:class:`NormalizedWriter`);
  a record dated further ahead of the database clock than ``max_clock_skew_seconds`` is
  rejected (``FUTURE_TIMESTAMP``), so that it is never published.
  For one large shard, forked processes normalize and judge its pages while the fetch goes on.
- **map/diff/publish** (:func:`publish_city`): chunk by chunk, from memory for a small city,
  else read back from its NORMALIZED snapshots (memory stays bounded whatever the city's
  size): allocates mappings, diffs against what is published, builds every row, then writes
  the diff log and publishes AUTO_PUBLISH diffs with their outbox events in one transaction
  per chunk; for one large shard, in forked processes.

A dry run (:func:`dry_run_stages`, used by ``replay.dry_run_city``) runs the same normalize
and publish stages over stored raw pages without a lease: no writer, and a publisher
(:class:`DiffCollector`) that diffs each validated chunk through read-only connections, so
it writes nothing and its memory stays bounded by a chunk.

Every record ends in exactly one bucket (invariant 4): published (success), dead letter
(failed), or skipped: unchanged, stale, a duplicate of a record on another page, or held for
review (:func:`check_counts`).
"""

from __future__ import annotations

import bisect
import gc
import hashlib
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import CountsDoNotAddUp, LeaseLost
from supplier_sync_dagster.core.leasing.leases import ShardLease
from supplier_sync_dagster.core.records.deadletters import DeadLetter, record_dead_letters
from supplier_sync_dagster.core.records.diff import (
    Candidate,
    HotelDiff,
    collapse_duplicates,
    compute_diffs,
    record_diffs,
)
from supplier_sync_dagster.core.records.gates import (
    CityProfile,
    FieldCounts,
    GateResult,
    check_first_pages,
    record_city_profile,
)
from supplier_sync_dagster.core.records.mapping import (
    HotelMappings,
    chunks,
    ensure_hotel_mappings,
)
from supplier_sync_dagster.core.records.normalize import (
    NormalizedDocuments,
    canonical_lines,
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
from supplier_sync_dagster.core.records.undecodable import UndecodableRecord
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase, retry_deadlocks
from supplier_sync_dagster.core.store.payloads import PayloadStore
from supplier_sync_dagster.core.supplier.models import decode_page, page_records
from supplier_sync_dagster.core.sync.model import NO_PROGRESS, CityReport, Progress, SyncSettings
from supplier_sync_dagster.core.sync.runtime import ForkPool, collect_garbage, prepare_process
from supplier_sync_dagster.core.sync.snapshots import (
    NORMALIZED,
    PAGE_COMPRESSLEVEL,
    RAW,
    StoredPage,
    record_snapshots,
    snapshot_row,
    stored_pages,
)

# The first pages of a city on which schema drift is judged before any is normalized.
DRIFT_SAMPLE_PAGES = 2
# How old a reading of the database's time a city's first records may be judged against,
# moved on by the time elapsed since (``DbClock.recent_utc``): small cities read it once.
CLOCK_REUSE_SECONDS = 10.0


@dataclass
class _Page:
    """A raw page being normalized: its snapshot, outcomes and canonical documents."""

    raw: StoredPage
    result: NormalizedDocuments


class NormalizedWriter:
    """Writes what normalization produced under the lease: NORMALIZED pages, dead letters
    and the city's profile. A dry run has none and writes nothing."""

    def __init__(self, lease: ShardLease, store: PayloadStore, settings: SyncSettings) -> None:
        self.lease, self.store, self.settings = lease, store, settings
        self.city = lease.shard_key
        # Only an earlier claim of the shard can have stored its NORMALIZED pages.
        self.done = (
            {
                row.payload_hash
                for row in stored_pages(lease.db, lease.batch_id, self.city, NORMALIZED)
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

    def page(self, raw: StoredPage, lines: list[bytes], letters: list[DeadLetter]) -> None:
        """Stores a page's kept documents (JSON lines) and keeps its rows for :meth:`flush`."""
        body = b"\n".join(lines)
        # The store hashes the body again: hash it here only when a resumed claim may skip it.
        if self.done and not letters and hashlib.sha256(body).hexdigest() in self.done:
            return
        stored = self.store.put(body, kind="normalized", compresslevel=PAGE_COMPRESSLEVEL)
        self.rows.append(
            snapshot_row(
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
        record_snapshots(conn, lease, settings.supplier_id, NORMALIZED, self.rows)
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


class Normalizer:
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
        writer: NormalizedWriter | None,
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
        self._pending: list[tuple[StoredPage, list[Any]]] | None = [] if drift_check else None
        self._drift: GateResult | None = None
        # True when every stored RAW page was given to add(): finish() reads none back.
        self.stored_pages_seen = False
        # The latest updated_at a record may carry (the database clock plus the allowed
        # skew), read again once a chunk's worth of records was judged against it: a long
        # walk's later pages hold later changes.
        self._not_after: datetime | None = None
        self._judged_since_clock = 0
        # Pages being normalized and judged in forked processes (settings.normalize_processes).
        self._workers: ForkPool | None = None
        self._inflight: deque[tuple[StoredPage, Future[_JudgedPage]]] = deque()

    def drift(self) -> GateResult | None:
        """Judges schema drift (once) on the first pages; the failed check, or None."""
        pending, self._pending = self._pending, None
        if pending is None:
            return self._drift
        # Each page's fields are counted once: for the sample, then for the city's profile.
        if pending:
            counted = [FieldCounts().add(records) for _, records in pending]
        else:  # nothing arrived from a fetch: the stored pages (resumed walk, replay)
            raws = stored_pages(self.db, self.batch_id, self.city, RAW)
            counted = [FieldCounts().add(self._load(raw)) for raw in raws[:DRIFT_SAMPLE_PAGES]]
        self._drift = check_first_pages(
            self.db,
            batch_id=self.batch_id,
            task_code=self.settings.task_code,
            shard_key=self.city,
            pages=counted,
            overrides=self.report.gate_overrides,
        )
        if self._drift is None and pending:
            for (raw, records), fields in zip(pending, counted, strict=True):
                self._normalize(raw, records, fields)
        return self._drift

    def add(self, raw: StoredPage, records: list[Any]) -> None:
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
            for raw in stored_pages(self.db, self.batch_id, self.city, RAW):
                if raw.payload_hash not in self.seen:
                    self._normalize(raw, self._load(raw))
        began = time.perf_counter()
        self._validate(flush=False)
        self.close()
        if self.writer is not None:
            self.writer.profile(self.report, self.fields)  # with the rows not flushed
        self.report.seconds["normalize"] += time.perf_counter() - began

    def _load(self, raw: StoredPage) -> list[Any]:
        return page_records(decode_page(self.store.get(raw.payload_ref)))

    def _normalize(
        self, raw: StoredPage, records: list[Any], fields: FieldCounts | None = None
    ) -> None:
        """Normalizes a page (``fields``: its records' fields, when counted already)."""
        if raw.payload_hash in self.seen:
            return  # the same page bytes again (a walk re-reads overlapping pages)
        began = time.perf_counter()
        self.seen.add(raw.payload_hash)
        self.listed.update(
            r["hotel_id"]
            for r in records
            if isinstance(r, dict) and isinstance(r.get("hotel_id"), str)
        )
        # A record whose bytes could not be decoded is still listed by its supplier.
        self.listed.update(
            r.hotel_id for r in records if type(r) is UndecodableRecord and r.hotel_id is not None
        )
        self.progress.check()
        self.progress.report("NORMALIZING", f"city={self.city} page={raw.page_number}")
        self.report.records += int(raw.record_count or 0)
        if fields is None:
            self.fields.add(records)
        else:
            self.fields.merge(fields)
        not_after = self._latest_time(len(records))
        if self.settings.normalize_processes > 0 and self.on_kept is None:
            self._submit(raw, records, not_after)
        else:
            result = normalize_documents(records, not_after=not_after)
            self.pages.append(_Page(raw, result))
            self.buffered += len(result.docs)
            if self.buffered >= self.settings.chunk_hotels:
                self._validate()
        collect_garbage()
        self.report.seconds["normalize"] += time.perf_counter() - began

    def _latest_time(self, records: int) -> datetime:
        """The latest ``updated_at`` that ``records`` more records may carry: the database
        clock plus ``settings.max_clock_skew_seconds`` (FUTURE_TIMESTAMP beyond it)."""
        if self._not_after is None or self._judged_since_clock >= self.settings.chunk_hotels:
            # A city's first page may use the time another city read just before; a chunk's
            # worth of records later, the time is read again.
            max_age = CLOCK_REUSE_SECONDS if self._not_after is None else 0.0
            now = self.db.clock.recent_utc(self.db.engine, max_age)
            self._not_after = now + timedelta(seconds=self.settings.max_clock_skew_seconds)
            self._judged_since_clock = 0
        self._judged_since_clock += records
        return self._not_after

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
            self._keep(page.raw, canonical_lines(kept), kept, letters, kept_chunk)
        pages.clear()
        self.buffered = 0
        if self.writer is not None and flush:
            self.writer.flush()
        self._hand_over(kept_chunk)

    def _keep(
        self,
        raw: StoredPage,
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
                Candidate(
                    doc, hashlib.sha256(line).hexdigest(), raw.payload_ref, raw.payload_hash, line
                )
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

    def _submit(self, raw: StoredPage, records: list[Any], not_after: datetime) -> None:
        """Hands a page to a forked process, which normalizes and judges it."""
        if self._workers is None:
            self._workers = ForkPool(
                self.settings.normalize_processes,
                _start_forked_judge,
                (self.db, self.listing_city, self.city_countries),
            )
        self._inflight.append((raw, self._workers.submit(_judge_page, raw, records, not_after)))
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
            workers.close()
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


def _judge_page(raw: StoredPage, records: list[Any], not_after: datetime) -> _JudgedPage:
    assert _judge_context is not None, "not a forked judge"
    listing_city, city_countries = _judge_context
    page = _Page(raw, normalize_documents(records, not_after=not_after))
    moved, judged = _judge([page], listing_city, city_countries)
    kept, letters = judged[0]
    return _JudgedPage(canonical_lines(kept), letters, moved)


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
        # Every document comes straight from normalize_documents, which enforced the rules
        # of layer 3 (its phone rule parsed each number with libphonenumber): a chunk is
        # flattened and checked again only when what normalization leaves open fails.
        quality = check_quality(
            docs,
            city_code=listing_city,
            city_countries=city_countries,
            parse_phones=False,
            normalized=True,
        )
        moved = len(quality.moved)
        starts = list(itertools.accumulate((len(p.result.docs) for p in pages), initial=0))
        for f in quality.failures:
            k = bisect.bisect_right(starts, f.index) - 1
            page = pages[k]
            pos = page.result.doc_index[f.index - starts[k]]
            city = listing_city or docs[f.index].get("city_code")
            version = docs[f.index].get("version")
            failed[f.index] = replace(
                f.dead_letter(
                    page.raw.payload_ref,
                    page.raw.payload_hash,
                    record_position=f"record#{pos}",
                ),
                city_code=city if isinstance(city, str) else None,
                record_version=version if isinstance(version, int) else None,
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
                record_version=r.version,
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
                chunk.append(Candidate(loads_canonical(line), fp, raw_ref, raw_hash, line))
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
                # One database time per transaction, read with the mappings (their few
                # rows take the clock's SQL expression): a bulk insert would otherwise
                # evaluate it on every row.
                maps = self._mappings(conn, cands, None, published=True)
                at = maps.read_at or db.clock.read(conn)
                diffs = compute_diffs(
                    conn,
                    cands,
                    maps.resource_ids,
                    policy=settings.risk_policy,
                    published=maps.versions,
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
        self,
        conn: Connection,
        cands: Sequence[Candidate],
        at: datetime | None,
        *,
        published: bool,
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

    The sample keeps up to ``sample`` changes of each diff type (NEW hotels too, with their
    name; never NO_CHANGE), and :attr:`changes` takes them in turn, one type after the other,
    so that a city of many new hotels still shows its few price changes, and the reverse.

    Args:
        db: The sync database (read only).
        settings: The supplier and the risk policy.
        sample: How many changes to show, for people.
    """

    def __init__(self, db: SyncDatabase, settings: SyncSettings, *, sample: int = 20) -> None:
        self.db, self.settings, self.sample = db, settings, sample
        self._by_type: dict[str, list[dict[str, Any]]] = {}
        self._unmapped = 0

    @property
    def changes(self) -> list[dict[str, Any]]:
        """Up to ``sample`` changes, the diff types in turn (first seen first)."""
        out: list[dict[str, Any]] = []
        kept = list(self._by_type.values())
        for i in range(self.sample):
            out += [found[i] for found in kept if i < len(found)]
        return out[: self.sample]

    def _keep(self, d: HotelDiff, doc: Mapping[str, Any]) -> None:
        kept = self._by_type.setdefault(d.diff_type, [])
        if d.diff_type == "NO_CHANGE" or len(kept) >= self.sample:
            return
        change: dict[str, Any] = {
            "supplier_hotel_id": d.supplier_hotel_id,
            "diff_type": d.diff_type,
            "action": d.action,
            "changed_fields": d.changed_fields[:10],
            "fields_changed": len(d.changed_fields),
        }
        if d.diff_type == "NEW":
            change["name"] = doc.get("name")
        kept.append(change)

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
        docs = {c.supplier_hotel_id: c.doc for c in cands}
        for d in diffs:
            self._keep(d, docs.get(d.supplier_hotel_id, {}))
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
    pool = ForkPool(workers, _start_forked_publisher, (publisher, parts))
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
        pool.close()


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


def check_counts(report: CityReport) -> None:
    """Checks that every record of the city ended in exactly one bucket (invariant 4).

    Raises:
        CountsDoNotAddUp: ``published + dead letters + skipped`` is not ``records``.
    """
    if report.published + report.dead_letters + report.skipped != report.records:
        raise CountsDoNotAddUp(
            f"city {report.city_code!r}: {report.records} records but {report.published} "
            f"published + {report.dead_letters} dead letters + {report.skipped} skipped"
        )


def publish_city(
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
            # transactions. A stable sort keeps two versions of one hotel in feed order.
            candidates = sorted(candidates, key=lambda c: ids[c.supplier_hotel_id])
            head, tail = split_for_processes(candidates, size, settings.publish_processes)
            _publish_in_processes(publisher, head, progress, report)
            parts = [tail]
        last = len(parts) - 1
        for i, part in enumerate(parts):
            then = finish if i == last else None
            _publish_chunk(publisher, part, progress, report, then)
            finished = then is not None
    check_counts(report)
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
    normalizer = Normalizer(
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
    check_counts(report)
    return report
