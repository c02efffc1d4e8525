"""The fetch stage: a shard's walk, page by page, each page stored and checkpointed.

A city's listing is walked from the shard's checkpoint (``core.supplier.walk``); a
:class:`~supplier_sync_dagster.core.sync.model.PageSource` gives the pages of a shard that
is not a listing. Each page's exact bytes go to the payload store, and its RAW snapshot row
and the checkpoint past it commit in one fenced transaction: a crash re-fetches at most the
pages requested ahead (:data:`READ_AHEAD_PAGES`) and the one in flight.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.leasing.leases import Checkpoint, PageCounts, ShardLease
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import insert_ignore
from supplier_sync_dagster.core.store.payloads import PayloadStore
from supplier_sync_dagster.core.supplier import CityWalk, PagePosition, SupplierClient, WalkStats
from supplier_sync_dagster.core.supplier.models import MALFORMED_RECORD_KEY
from supplier_sync_dagster.core.sync.model import (
    CityReport,
    FetchedPage,
    PageSource,
    Progress,
    SyncSettings,
)
from supplier_sync_dagster.core.sync.runtime import collect_garbage, in_spare_thread
from supplier_sync_dagster.core.sync.snapshots import (
    PAGE_COMPRESSLEVEL,
    RAW,
    StoredPage,
    record_snapshots,
    snapshot_row,
)
from supplier_sync_dagster.core.sync.stop import Stop

PageSink = Callable[[StoredPage, list[Any]], None]
"""Takes each page right after it is committed: its RAW snapshot and its records."""

READ_AHEAD_PAGES = 3
"""Pages of a walk requested while the pages before them are stored and normalized: a city
spends its share of the supplier's rate limit while its pages are worked on, and a slow
moment of that work (a busy machine) does not stall its requests."""


def walk(
    client: SupplierClient | None,
    lease: ShardLease,
    settings: SyncSettings,
    source: PageSource | None,
    *,
    hotel_count: int | None = None,
    report: CityReport | None = None,
) -> Iterator[FetchedPage]:
    """The shard's pages from its checkpoint: the city's listing, or ``source``'s pages.

    Args:
        client: The supplier client (None: a source that needs none).
        lease: The shard's lease (its checkpoint says where to start).
        settings: The sync's settings (page size, walk limits).
        source: The shard's pages when they are not a city's listing.
        hotel_count: The city's ``hotel_count`` from ``/v1/cities``, when known: a walk
            never goes far past it (``WALK_RUNAWAY``).
        report: Gets the walk's stats (``report.walk``), filled in as it goes.

    Raises:
        ValueError: A city's listing without a supplier client.
    """
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
    listing = CityWalk(
        client,
        city,
        page_size=settings.page_size,
        start=start,
        hotel_count=hotel_count,
        limits=settings.walk,
    )
    if report is not None:
        report.walk = listing.stats
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
        for page in listing
    )


def fetch_pages(
    lease: ShardLease,
    store: PayloadStore,
    pages: Iterator[FetchedPage],
    heartbeat: Progress,
    settings: SyncSettings,
    report: CityReport,
    *,
    on_page: PageSink | None = None,
    stop: Stop | None = None,
    read_ahead: int = READ_AHEAD_PAGES,
) -> None:
    """Stores and checkpoints each page of the walk, then gives it to ``on_page``.

    The walk runs in a daemon thread of its own (:class:`ReadAhead`), up to ``read_ahead``
    pages ahead of the page being stored: the next pages are requested while this one is
    stored and ``on_page`` works on it. Only committed pages count: a crash re-fetches the
    pages requested ahead. A stop, or any error of this thread, never waits for a request in
    flight, which writes nothing (see :mod:`supplier_sync_dagster.core.sync.stop`).

    Args:
        lease: The shard's lease (every write is fenced by it).
        store: Where the pages' bytes go.
        pages: The walk (:func:`walk`).
        heartbeat: Says what the fetch is doing; raises once the lease is lost.
        settings: The sync's settings (the supplier's id).
        report: Counts the pages and the fetch's time.
        on_page: Takes each page once it is committed (a fresh walk's normalizer).
        stop: The run's stop: waiting for a page ends at once when it is asked.
        read_ahead: Pages requested before the one being stored is committed (>= 1).

    Raises:
        SyncInterrupted: The run's stop was asked (nothing of the pages in flight is written).
    """
    city = lease.shard_key
    stop = stop or Stop()
    ahead = ReadAhead(pages, read_ahead)
    try:
        while True:
            began = time.perf_counter()
            # Waiting for the supplier: what a stall of the walk shows (find_stalls).
            heartbeat.report("FETCHING", f"city={city} waiting for the supplier's next page")
            page = stop.result(ahead.next())
            if page is None:
                report.seconds["fetch"] += time.perf_counter() - began
                break
            heartbeat.check()
            heartbeat.report("FETCHING", f"city={city} page={page.page_number}")
            stored = store.put(page.raw, kind="raw", compresslevel=PAGE_COMPRESSLEVEL)
            row = snapshot_row(
                lease,
                kind=RAW,
                key_hash=stored.sha256,
                stored=stored,
                page_number=page.page_number,
                record_count=len(page.records),
            )
            with lease.db.begin() as conn:
                record_snapshots(conn, lease, settings.supplier_id, RAW, [row])
                lease.advance(
                    page.checkpoint,
                    PageCounts(),
                    total_pages=page.total_pages,
                    fetched=len(page.records),
                    conn=conn,
                )
            report.pages_fetched += 1
            report.seconds["fetch"] += time.perf_counter() - began
            if on_page is not None:
                on_page(
                    StoredPage(stored.ref, stored.sha256, page.page_number, row["record_count"]),
                    _unwrap(page.records),
                )
            collect_garbage()
    finally:
        ahead.close()


class ReadAhead:
    """A walk's pages, requested in a daemon thread up to ``depth`` pages ahead of the taker.

    The thread (a spare one of the process: :func:`in_spare_thread`) alone advances and
    closes the walk, so the walk is never closed while a request is inside it; a walk
    abandoned mid-request ends with its thread, a daemon, which never keeps the process from
    exiting.

    Args:
        pages: The walk.
        depth: Pages requested and not taken yet, at most (>= 1).
    """

    def __init__(self, pages: Iterator[FetchedPage], depth: int) -> None:
        if depth < 1:
            raise ValueError(f"read-ahead depth must be >= 1, got {depth}")
        self._pages = pages
        self._room = threading.Semaphore(depth)
        self._ready: queue.SimpleQueue[Future[FetchedPage | None]] = queue.SimpleQueue()
        self._closed = threading.Event()
        in_spare_thread(self._walk, "supplier-walk")

    def _walk(self) -> None:
        try:
            while True:
                self._room.acquire()
                if self._closed.is_set():
                    return
                # Queued before the request: the taker finds the page's future at once.
                future: Future[FetchedPage | None] = Future()
                future.set_running_or_notify_cancel()
                self._ready.put(future)
                try:
                    page = next(self._pages, None)
                except BaseException as err:  # the taker gets it with the page it waits for
                    future.set_exception(err)
                    return
                future.set_result(page)
                if page is None:
                    return
        finally:
            close = getattr(self._pages, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    def next(self) -> Future[FetchedPage | None]:
        """The future of the walk's next page (None once the walk has ended); call it again
        only after that future is done and held a page."""
        future = self._ready.get()
        self._room.release()
        return future

    def close(self) -> None:
        """Asks for no more pages: the thread closes the walk after the request in flight."""
        self._closed.set()
        self._room.release()


def record_walk(conn: Connection, lease: ShardLease, stats: WalkStats) -> None:
    """Records a finished city walk whose listing shifted (or could have: unchecked) under
    it, in the caller's transaction (the one that finishes the shard): reconciliation walks
    such a city again, metrics count them. A walk without drift leaves no row."""
    if stats.drift is None:
        return
    insert_ignore(
        conn,
        schema.city_walk,
        [
            {
                "batch_id": lease.batch_id,
                "shard_key": lease.shard_key,
                "drift": stats.drift,
                "shifts": stats.shifts,
                "fallbacks": stats.fallbacks,
                "probes": stats.probes,
                "recovered": stats.recovered,
                "requests": stats.requests,
            }
        ],
        created_at=lease.db.clock.now(),
    )


def _unwrap(records: list[dict[str, Any]]) -> list[Any]:
    """The page's records as decoded from JSON (the client wraps non-object entries)."""
    return [
        r[MALFORMED_RECORD_KEY] if len(r) == 1 and MALFORMED_RECORD_KEY in r else r for r in records
    ]
