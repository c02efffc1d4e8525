"""Tombstones: a hotel that complete city listings lack is unpublished, and restored when it
comes back (SQLite and MariaDB), over a supplier served by a MockTransport."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import TaskSpec, create_batch, upsert_task
from supplier_sync_dagster.core.leasing.leases import LeaseSettings
from supplier_sync_dagster.core.records.tombstones import TOMBSTONE_FINGERPRINT
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync.city import sync_city
from supplier_sync_dagster.core.sync.model import CityReport, SyncSettings
from supplier_sync_dagster_tests.core.repair.test_incremental import hotel

SETTINGS = SyncSettings(
    task_code="full",
    supplier_id=1001,
    page_size=2,
    lease=LeaseSettings(lease_seconds=30, heartbeat_seconds=5),
)


class Listing:
    """Cities listed page by page; single hotels by id (404 when ``gone``)."""

    def __init__(self) -> None:
        self.cities: dict[str, list[dict[str, Any]]] = {"BKK": [], "CNX": []}
        self.gone: set[str] = set()
        self.known: dict[str, dict[str, Any]] = {}  # every hotel ever listed
        self.broken: set[str] = set()  # cities whose second page answers 400

    def handle(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.strip("/").split("/")
        if parts[1:] == ["cities"]:
            return httpx.Response(200, json={"cities": [{"city_code": c} for c in self.cities]})
        if parts[1] == "hotels":
            hid = parts[2]
            if hid in self.gone or hid not in self.known:
                return httpx.Response(404, json={"error": {"code": "NOT_FOUND", "message": hid}})
            return httpx.Response(200, json=self.known[hid])  # unlisted is not gone
        city = parts[2]
        page = int(request.url.params["page"])
        size = int(request.url.params["page_size"])
        if city in self.broken and page == 2:
            return httpx.Response(400, json={"error": {"code": "INVALID", "message": "broken"}})
        hotels = sorted(self.cities[city], key=lambda h: h["hotel_id"])
        self.known.update((h["hotel_id"], h) for h in hotels)
        pages = max(1, -(-len(hotels) // size))
        return httpx.Response(
            200,
            json={
                "city_code": city,
                "page": page,
                "page_size": size,
                "total": len(hotels),
                "total_pages": pages,
                "hotels": hotels[(page - 1) * size : page * size],
            },
        )


@pytest.fixture
def listing() -> Listing:
    lst = Listing()
    lst.cities["BKK"] = [hotel(n, at=n, city_code="BKK") for n in range(1, 6)]
    lst.cities["CNX"] = [hotel(10, at=10, city_code="CNX")]
    return lst


@pytest.fixture
def client(listing: Listing) -> Iterator[SupplierClient]:
    transport = httpx.MockTransport(listing.handle)
    with httpx.Client(base_url="http://supplier", transport=transport) as http:
        yield SupplierClient(http, api_key="k", supplier_id="fake")


def _sync(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, cities: list[str]
) -> dict[str, CityReport]:
    upsert_task(db, TaskSpec(task_code="full", supplier_id=1001))
    decision = create_batch(
        db,
        task_code="full",
        trigger_id=f"t-{uuid.uuid4().hex[:8]}",
        trigger_source="MANUAL",
        shard_keys=cities,
    )
    assert decision.batch is not None
    out = {}
    for city in cities:
        try:
            out[city] = sync_city(
                db,
                store,
                client,
                batch=decision.batch,
                city_code=city,
                worker_id="w",
                settings=SETTINGS,
            )
        except Exception as err:  # a failed city; the test looks at the catalog
            out[city] = CityReport(city, status="FAILED", error=str(err))
    return out


def _hotels(db: SyncDatabase) -> dict[str, tuple[str, int, int]]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return {
            r.supplier_hotel_id: (r.status, r.publish_version, r.missing_count)
            for r in conn.execute(
                sa.select(h.supplier_hotel_id, h.status, h.publish_version, h.missing_count)
            )
        }


def _events(db: SyncDatabase, hotel_id: str) -> list[tuple[str, int]]:
    h, o = schema.platform_hotel.c, schema.outbox.c
    with db.engine.connect() as conn:
        rid = conn.execute(
            sa.select(h.resource_id).where(h.supplier_hotel_id == hotel_id)
        ).scalar_one()
        return [
            (str(t), int(v))
            for t, v in conn.execute(
                sa.select(o.event_type, o.aggregate_version)
                .where(o.aggregate_id == rid)
                .order_by(o.aggregate_version, o.event_type)
            )
        ]


@pytest.fixture
def store(tmp_path: Path) -> LocalPayloadStore:
    return LocalPayloadStore(tmp_path / "payloads")


def test_a_hotel_missing_from_two_complete_listings_is_unpublished_then_restored(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, listing: Listing
):
    _sync(db, store, client, ["BKK", "CNX"])
    removed = listing.cities["BKK"].pop(2)  # H000003, still answering GET (200)
    first = _sync(db, store, client, ["BKK"])["BKK"]
    assert first.presence is not None and first.presence.missing == ["H000003"]
    assert _hotels(db)["H000003"] == ("ACTIVE", 1, 1)
    second = _sync(db, store, client, ["BKK"])["BKK"]
    assert second.presence is not None and second.presence.unpublished == ["H000003"]
    assert _hotels(db)["H000003"] == ("INACTIVE", 2, 2)
    assert ("HotelUnpublished", 2) in _events(db, "H000003")
    assert ("HotelResourceUpdated", 2) in _events(db, "H000003")
    o, h = schema.platform_offer.c, schema.platform_hotel.c
    with db.engine.connect() as conn:
        active = (
            conn.execute(
                sa.select(o.active)
                .join(schema.platform_hotel, h.resource_id == o.resource_id)
                .where(h.supplier_hotel_id == "H000003")
            )
            .scalars()
            .all()
        )
    assert active and not any(active)
    # The others were listed every time: untouched.
    assert {k: v for k, v in _hotels(db).items() if k != "H000003"} == {
        "H000001": ("ACTIVE", 1, 0),
        "H000002": ("ACTIVE", 1, 0),
        "H000004": ("ACTIVE", 1, 0),
        "H000005": ("ACTIVE", 1, 0),
        "H000010": ("ACTIVE", 1, 0),
    }
    # It comes back, same version: restored with a new publish version.
    listing.cities["BKK"].append(removed)
    back = _sync(db, store, client, ["BKK"])["BKK"]
    assert back.published == 1
    assert _hotels(db)["H000003"] == ("ACTIVE", 3, 0)
    with db.engine.connect() as conn:
        fp = conn.execute(
            sa.select(h.fingerprint).where(h.supplier_hotel_id == "H000003")
        ).scalar_one()
    assert fp != TOMBSTONE_FINGERPRINT


def test_a_404_for_a_missing_hotel_unpublishes_it_at_once(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, listing: Listing
):
    _sync(db, store, client, ["BKK", "CNX"])
    listing.cities["BKK"].pop(0)
    listing.gone.add("H000001")
    report = _sync(db, store, client, ["BKK"])["BKK"]
    assert report.presence is not None and report.presence.unpublished == ["H000001"]
    assert _hotels(db)["H000001"][0] == "INACTIVE"


def test_a_city_that_did_not_complete_counts_no_miss(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, listing: Listing
):
    _sync(db, store, client, ["BKK", "CNX"])
    listing.cities["BKK"].pop(0)
    listing.broken.add("BKK")
    for _ in range(3):
        assert _sync(db, store, client, ["BKK"])["BKK"].status == "FAILED"
    assert _hotels(db)["H000001"] == ("ACTIVE", 1, 0)


def test_a_hotel_listed_under_another_city_is_present(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, listing: Listing
):
    _sync(db, store, client, ["BKK", "CNX"])
    # H000010 is in CNX but from now on listed under BKK (it moved in the feed only).
    moved = listing.cities["CNX"].pop()
    listing.cities["BKK"].append(moved)
    listing.cities["CNX"].append(hotel(12, at=12, city_code="CNX"))
    for _ in range(3):
        _sync(db, store, client, ["CNX", "BKK"])
    status, _, _ = _hotels(db)["H000010"]
    assert status == "ACTIVE"
