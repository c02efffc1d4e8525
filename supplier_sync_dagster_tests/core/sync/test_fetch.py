"""The fetch stage under a hostile listing (SQLite and MariaDB): a walk that would never end
fails its city with WALK_RUNAWAY and a CITY_FAILED ticket, having stored a bounded number of
pages, while the other cities publish; a listing that shifts under a page-number walk loses
no hotel and is recorded; a walk that could have missed a hotel never counts it missing.
And its order: the next pages are requested while a page is stored and committed; a page's bytes are durable before its row commits; a page that cannot be
stored gets no row nor checkpoint."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import PayloadError, SupplierError, WalkRunaway
from supplier_sync_dagster.core.health.metrics import sync_health
from supplier_sync_dagster.core.leasing.batches import Batch
from supplier_sync_dagster.core.leasing.leases import (
    Checkpoint,
    ShardLease,
    claim_shard,
    list_shards,
)
from supplier_sync_dagster.core.records.tombstones import TOMBSTONE_FINGERPRINT
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore, StoredPayload
from supplier_sync_dagster.core.supplier import SupplierClient, WalkLimits
from supplier_sync_dagster.core.sync import fetch as fetch_module
from supplier_sync_dagster.core.sync.city import sync_city
from supplier_sync_dagster.core.sync.fetch import ReadAhead, fetch_pages
from supplier_sync_dagster.core.sync.model import NO_PROGRESS, CityReport, FetchedPage
from supplier_sync_dagster.core.sync.run import RunRequest, plan_run, run_cities
from supplier_sync_dagster.core.sync.snapshots import StoredPage
from supplier_sync_dagster_tests.core.conftest import MakeBatch
from supplier_sync_dagster_tests.core.supplier.fakes import (
    FakeCatalog,
    hotel,
    ids,
    json_response,
    make_client,
)
from supplier_sync_dagster_tests.core.supplier.test_walk import Drifting
from supplier_sync_dagster_tests.core.sync.test_city import settings

Listing = Callable[[httpx.Request], httpx.Response]


class Supplier:
    """A supplier of a few cities over ``httpx.MockTransport``: each city's listing is its
    own handler; ``/v1/cities`` states their sizes; a hotel's detail is 404 unless listed."""

    def __init__(self, cities: dict[str, tuple[Listing, int]]) -> None:
        self.cities = cities
        self.listing_requests: dict[str, int] = dict.fromkeys(cities, 0)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.split("/")
        if parts[-1] == "cities":
            body = [
                {"city_code": c, "country_code": "TH", "hotel_count": n}
                for c, (_, n) in self.cities.items()
            ]
            return json_response(200, {"cities": body, "total": len(body)})
        if parts[-1] == "hotels" and parts[-3] == "cities":
            city = parts[-2]
            self.listing_requests[city] += 1
            assert self.listing_requests[city] <= 200, "the walk did not stop"
            return self.cities[city][0](request)
        return json_response(404, {"error": {"code": "NOT_FOUND", "message": "no such hotel"}})


def one_hotel_runaway(request: httpx.Request) -> httpx.Response:
    """A city of one hotel that hands out a new cursor on every page."""
    n = int(request.url.params.get("cursor", "c0")[1:]) + 1
    body = {
        "city_code": "LOOP",
        "total": 1,
        "hotels": [hotel("L1", "LOOP")],
        "next_cursor": f"c{n}",
    }
    return json_response(200, body)


def growing(request: httpx.Request) -> httpx.Response:
    """A city that hands out a new cursor and new hotels on every page, stating no total."""
    n = int(request.url.params.get("cursor", "c0")[1:]) + 1
    body = {"hotels": [hotel(f"G{n:03d}{i}", "GROW") for i in range(10)], "next_cursor": f"c{n}"}
    return json_response(200, body)


def snapshot_rows(db: SyncDatabase, city: str) -> int:
    s = schema.snapshot.c
    with db.engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count()).where(s.shard_key == city, s.snapshot_type == "RAW")
            ).scalar_one()
        )


def published_ids(db: SyncDatabase) -> set[str]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return set(conn.execute(sa.select(h.supplier_hotel_id)).scalars())


def test_a_runaway_city_fails_with_a_ticket_after_a_few_pages_and_the_others_publish(
    db: SyncDatabase, tmp_path: Path
) -> None:
    supplier = Supplier(
        {
            "LOOP": (one_hotel_runaway, 1),
            "GROW": (growing, 5),
            "BKK": (FakeCatalog(ids(25)), 25),
        }
    )
    client, _ = make_client(supplier)
    store = LocalPayloadStore(tmp_path / "payloads")
    request = RunRequest(trigger_id="t-runaway", source="MANUAL", cities=list(supplier.cities))
    plan = plan_run(db, store, client, request, settings(page_size=10))
    assert plan.sizes == {"LOOP": 1, "GROW": 5, "BKK": 25}
    outcomes = {
        o.city_code: o
        for o in run_cities(db, store, client, plan, request, settings(page_size=10), worker_id="w")
    }
    loop = outcomes["LOOP"].report
    assert loop.status == "FAILED" and loop.error is not None
    assert "WALK_RUNAWAY" in loop.error and "'LOOP'" in loop.error
    # GROW's pages state no size: its hotel_count in the city list bounds the walk
    grow = outcomes["GROW"].report
    assert grow.status == "FAILED" and "page 4 is past the 3 allowed" in (grow.error or "")
    assert snapshot_rows(db, "GROW") == 3
    assert outcomes["BKK"].status == "SUCCESS"
    assert published_ids(db) == set(ids(25))
    # page 1, one cursor page of the same hotel let through, the next one stops the walk
    assert supplier.listing_requests["LOOP"] == 3
    assert snapshot_rows(db, "LOOP") == 2
    # raw payloads: the city list, BKK's 3 pages, GROW's 3 and LOOP's 2
    assert len([f for f in (tmp_path / "payloads" / "raw").rglob("*") if f.is_file()]) == 9
    (shard,) = [s for s in list_shards(db, plan.batch.batch_id) if s.shard_key == "LOOP"]
    assert shard.status == "FAILED"
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        tickets = conn.execute(
            sa.select(d.error_code, d.error_message).where(d.city_code == "LOOP")
        ).all()
    assert [code for code, _ in tickets] == ["CITY_FAILED"]
    assert "WALK_RUNAWAY" in tickets[0][1]
    with db.engine.connect() as conn:
        cities = conn.execute(sa.select(d.city_code).where(d.error_code == "CITY_FAILED")).all()
    assert sorted(c for (c,) in cities) == ["GROW", "LOOP"]


def _sync(
    db: SyncDatabase,
    store: LocalPayloadStore,
    client: SupplierClient,
    batch: Batch,
    **kw: Any,
) -> CityReport:
    return sync_city(
        db,
        store,
        client,
        batch=batch,
        city_code="BKK",
        worker_id="w",
        settings=settings(task_code=batch.task_code, page_size=10, **kw),
        hotel_count=60,
    )


def test_a_city_whose_size_forbids_more_pages_fails_before_storing_them(
    db: SyncDatabase, make_batch: MakeBatch, tmp_path: Path
) -> None:
    def endless(request: httpx.Request) -> httpx.Response:
        page = int(request.url.params["page"])
        size = int(request.url.params["page_size"])
        return json_response(
            200,
            {"hotels": [hotel(f"H{i:06d}") for i in range((page - 1) * size, page * size)]},
        )

    client, _ = make_client(Supplier({"BKK": (endless, 60)}))
    store = LocalPayloadStore(tmp_path / "payloads")
    batch = make_batch(["BKK"])
    with pytest.raises(WalkRunaway, match="page 9 is past the 8 allowed"):
        _sync(db, store, client, batch)
    assert snapshot_rows(db, "BKK") == 8


def walk_rows(db: SyncDatabase) -> list[dict[str, Any]]:
    w = schema.city_walk.c
    with db.engine.connect() as conn:
        return [
            dict(r._mapping)
            for r in conn.execute(sa.select(w.shard_key, w.drift, w.shifts, w.recovered))
        ]


def test_a_listing_that_shifts_under_the_walk_loses_no_hotel_and_is_recorded(
    db: SyncDatabase, make_batch: MakeBatch, tmp_path: Path
) -> None:
    drifting = Drifting()
    client, _ = make_client(Supplier({"BKK": (drifting, 60)}))
    store = LocalPayloadStore(tmp_path / "payloads")
    batch = make_batch(["BKK"])
    report = _sync(db, store, client, batch)
    assert drifting.shifted and report.status == "SUCCESS"
    assert set(ids(59, start=2)) | {"H000061"} <= published_ids(db)
    assert report.walk is not None and report.walk.drift == "SHIFTED"
    assert report.presence is not None  # a verified listing: absences count
    assert walk_rows(db) == [{"shard_key": "BKK", "drift": "SHIFTED", "shifts": 1, "recovered": 0}]
    health = sync_health(db, task_code=batch.task_code).values()
    assert health["listing_drifted_cities_24h"] == 1 and health["listing_shifts_24h"] == 1
    assert health["listing_unverified_cities_24h"] == 0


def test_without_the_continuity_check_drift_loses_a_hotel_and_it_is_recorded(
    db: SyncDatabase, make_batch: MakeBatch, tmp_path: Path
) -> None:
    client, _ = make_client(Supplier({"BKK": (Drifting(), 60)}))
    store = LocalPayloadStore(tmp_path / "payloads")
    report = _sync(db, store, client, make_batch(["BKK"]), walk=WalkLimits(continuity_check=False))
    assert set(ids(59, start=2)) - published_ids(db) == {"H000051"}
    assert report.walk is not None and report.walk.drift == "UNCHECKED"
    assert [r["drift"] for r in walk_rows(db)] == ["UNCHECKED"]


def missing_counts(db: SyncDatabase) -> dict[str, int]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return {
            str(k): int(v)
            for k, v in conn.execute(
                sa.select(h.supplier_hotel_id, h.missing_count).where(h.missing_count > 0)
            )
        }


def test_a_walk_that_could_have_skipped_a_hotel_never_counts_it_missing(
    db: SyncDatabase, make_batch: MakeBatch, tmp_path: Path
) -> None:
    store = LocalPayloadStore(tmp_path / "payloads")
    task = f"full_{tmp_path.name[-12:]}"
    clean, _ = make_client(Supplier({"BKK": (FakeCatalog(ids(60)), 60)}))
    assert _sync(db, store, clean, make_batch(["BKK"], task_code=task)).status == "SUCCESS"
    # The first hotel really goes; under the unchecked walk H000051 is skipped, though listed.
    client, _ = make_client(Supplier({"BKK": (Drifting(), 60)}))
    unchecked = WalkLimits(continuity_check=False)
    report = _sync(db, store, client, make_batch(["BKK"], task_code=task), walk=unchecked)
    assert report.presence is None and missing_counts(db) == {}
    # A checked walk of the same drift is complete: its verification is the listing as it
    # stands, which lacks the first hotel only (gone: its detail is a 404, unpublished now).
    client, _ = make_client(Supplier({"BKK": (Drifting(), 60)}))
    report = _sync(db, store, client, make_batch(["BKK"], task_code=task))
    assert report.presence is not None and report.presence.unpublished == ["H000001"]
    assert set(missing_counts(db)) == {"H000001"}
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        live = set(
            conn.execute(
                sa.select(h.supplier_hotel_id).where(h.fingerprint != TOMBSTONE_FINGERPRINT)
            ).scalars()
        )
    assert live == set(ids(59, start=2)) | {"H000061"}


# -- the read-ahead of a walk ----------------------------------------------------------------

WAIT = 30.0  # a generous bound on waits for another thread: never a measurement


class _Walk:
    """A walk of ``n`` pages whose requests are logged, and can be held or made to fail."""

    def __init__(self, n: int, *, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at
        self.asked: list[int] = []
        self.closed_by: str | None = None
        self.changed = threading.Condition()
        self.release = threading.Event()
        self.release.set()
        self.in_request = False

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, timeout=WAIT)

    def __iter__(self) -> Iterator[Any]:
        try:
            for i in range(self.n):
                with self.changed:
                    self.asked.append(i)
                    self.in_request = True
                    self.changed.notify_all()
                assert self.release.wait(WAIT)
                with self.changed:
                    self.in_request = False
                if i == self.fail_at:
                    raise SupplierError(f"page {i} failed")
                yield i
        finally:
            with self.changed:
                self.closed_by = threading.current_thread().name
                self.changed.notify_all()


def test_a_walk_is_requested_ahead_up_to_its_depth_and_no_further() -> None:
    walk = _Walk(10)
    ahead = ReadAhead(iter(walk), 3)
    try:
        walk.wait_for(lambda: len(walk.asked) == 3)
        # Nothing taken: the fourth page is not asked for, however long we look.
        assert not ahead._room.acquire(timeout=0)  # every slot is held by a requested page
        assert walk.asked == [0, 1, 2]
        assert ahead.next().result(WAIT) == 0
        walk.wait_for(lambda: len(walk.asked) == 4)
        got = [ahead.next().result(WAIT) for _ in range(10)]
        assert got == [*range(1, 10), None]
    finally:
        ahead.close()
    walk.wait_for(lambda: walk.closed_by is not None)
    assert walk.closed_by == "supplier-walk"


def test_a_failed_request_reaches_the_taker_and_ends_the_walk() -> None:
    walk = _Walk(10, fail_at=1)
    ahead = ReadAhead(iter(walk), 3)
    assert ahead.next().result(WAIT) == 0
    with pytest.raises(SupplierError, match="page 1 failed"):
        ahead.next().result(WAIT)
    walk.wait_for(lambda: walk.closed_by is not None)
    assert walk.asked == [0, 1]
    ahead.close()


def test_closing_mid_request_asks_no_more_and_closes_the_walk_after_the_request() -> None:
    walk = _Walk(10)
    walk.release.clear()  # the first request hangs
    ahead = ReadAhead(iter(walk), 3)
    first = ahead.next()
    walk.wait_for(lambda: walk.in_request)
    ahead.close()  # the taker gives up (a stop, a lost lease)
    assert not first.done() and walk.closed_by is None  # never closed under a request
    walk.release.set()
    walk.wait_for(lambda: walk.closed_by is not None)
    assert walk.closed_by == "supplier-walk" and walk.asked == [0]
    assert first.result(WAIT) == 0


def test_a_read_ahead_needs_a_depth() -> None:
    with pytest.raises(ValueError, match="depth must be >= 1"):
        ReadAhead(iter(()), 0)


class _Watched:
    """Events of a fetch, in order: a page requested, a payload stored (``put`` returned),
    a RAW row written; a waiter wakes on each."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self._changed = threading.Condition()

    def add(self, *event: Any) -> None:
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    def wait_for(self, *event: Any) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: event in self.events, timeout=10)

    def requested(self, pages: list[FetchedPage]) -> Iterator[FetchedPage]:
        for page in pages:
            self.add("requested", page.page_number)
            yield page


class _WatchedStore(LocalPayloadStore):
    """A local store whose puts are events; it can be told to fail for one payload, and to
    hold each put until the page after it is requested."""

    def __init__(self, root: Path, watched: _Watched, *, fail_on: bytes | None = None) -> None:
        super().__init__(root)
        self.watched = watched
        self.fail_on = fail_on
        self.hold_until_next: dict[bytes, int] = {}
        self.overlapped: list[bool] = []

    def put(self, data: Any, *, kind: str, compresslevel: int | None = None) -> StoredPayload:
        if bytes(data) == self.fail_on:
            raise PayloadError("disk full")
        if bytes(data) in self.hold_until_next:
            page = self.hold_until_next[bytes(data)]
            self.overlapped.append(self.watched.wait_for("requested", page + 1))
        stored = super().put(data, kind=kind, compresslevel=compresslevel)
        self.watched.add("stored", stored.sha256)
        return stored


def _pages(n: int) -> list[FetchedPage]:
    return [
        FetchedPage(
            json.dumps({"hotels": [hotel(f"H{page}")], "page": page}).encode(),
            page,
            [hotel(f"H{page}")],
            n,
            Checkpoint("BKK", page=page + 1, done=page == n),
        )
        for page in range(1, n + 1)
    ]


def _fetch(
    lease: ShardLease,
    store: _WatchedStore,
    pages: list[FetchedPage],
    on_page: Callable[[StoredPage, list[Any]], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``fetch_pages`` over ``pages`` of the lease's city; each RAW row written is an event."""
    real = fetch_module.record_snapshots

    def record(conn: Any, lease: ShardLease, supplier: int, kind: str, rows: Any) -> None:
        for row in rows:
            store.watched.add("row", row["payload_hash"])
        real(conn, lease, supplier, kind, rows)

    monkeypatch.setattr(fetch_module, "record_snapshots", record)
    walk = store.watched.requested(pages)
    fetch_pages(lease, store, walk, NO_PROGRESS, settings(), CityReport("BKK"), on_page=on_page)


def test_the_next_page_is_requested_while_one_is_stored_and_its_row_waits_for_its_bytes(
    db: SyncDatabase, make_batch: MakeBatch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    watched = _Watched()
    store = _WatchedStore(tmp_path / "payloads", watched)
    pages = _pages(4)
    # Each page's put waits for the next page's request: it comes before the put returns.
    store.hold_until_next = {p.raw: p.page_number for p in pages[:-1]}
    processed: list[int | None] = []
    lease = claim_shard(db, make_batch(["BKK"]).batch_id, "BKK", worker_id="w")
    _fetch(lease, store, pages, lambda p, _: processed.append(p.page_number), monkeypatch)
    assert store.overlapped == [True, True, True]
    assert processed == [1, 2, 3, 4]
    # Every row is written after its page's bytes are stored (durable), never before.
    for page in pages:
        sha = hashlib.sha256(page.raw).hexdigest()
        assert watched.events.index(("stored", sha)) < watched.events.index(("row", sha))
    assert snapshot_rows(db, "BKK") == 4
    (shard,) = list_shards(db, lease.batch_id)
    assert shard.checkpoint is not None and shard.checkpoint.done and shard.pages_done == 4


def test_a_page_whose_bytes_cannot_be_stored_gets_no_row_and_no_checkpoint(
    db: SyncDatabase, make_batch: MakeBatch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages = _pages(3)
    store = _WatchedStore(tmp_path / "payloads", _Watched(), fail_on=pages[1].raw)
    processed: list[int | None] = []
    lease = claim_shard(db, make_batch(["BKK"]).batch_id, "BKK", worker_id="w")
    with pytest.raises(PayloadError, match="disk full"):
        _fetch(lease, store, pages, lambda p, _: processed.append(p.page_number), monkeypatch)
    assert processed == [1]
    assert snapshot_rows(db, "BKK") == 1
    (shard,) = list_shards(db, lease.batch_id)
    assert shard.checkpoint == pages[0].checkpoint and shard.pages_done == 1
