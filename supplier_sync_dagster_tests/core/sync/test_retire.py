"""Cities the supplier stops listing retire: their hotels through the tombstone grace, their
tickets closed, a mass drop held for a person, an empty list refused (SQLite and MariaDB)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import EmptyCityList
from supplier_sync_dagster.core.health.metrics import sync_health
from supplier_sync_dagster.core.leasing.batches import (
    TaskSpec,
    create_batch,
    get_batch,
    upsert_task,
)
from supplier_sync_dagster.core.records.deadletters import record_city_failure
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import list_audit
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync.city import sync_city
from supplier_sync_dagster.core.sync.retire import (
    CITY_DROP_HELD,
    RETIRE_ACTION,
    catalog_cities,
    plan_retirement,
    retire_cities,
    retire_limit,
)
from supplier_sync_dagster_tests.core.records.test_tombstones import SETTINGS, Listing
from supplier_sync_dagster_tests.core.repair.test_incremental import hotel

SUPPLIER = 1001


@pytest.fixture
def listing() -> Listing:
    lst = Listing()
    lst.cities = {
        code: [hotel(10 * i + n, at=n, city_code=code) for n in range(1, 4)]
        for i, code in enumerate(("BKK", "CNX", "HKT", "KBV", "USM", "PYX"), start=1)
    }
    return lst


@pytest.fixture
def client(listing: Listing) -> Iterator[SupplierClient]:
    transport = httpx.MockTransport(listing.handle)
    with httpx.Client(base_url="http://supplier", transport=transport) as http:
        yield SupplierClient(http, api_key="k", supplier_id="fake")


@pytest.fixture
def store(tmp_path: Path) -> LocalPayloadStore:
    return LocalPayloadStore(tmp_path / "payloads")


def new_batch(db: SyncDatabase, cities: list[str]) -> str:
    upsert_task(
        db, TaskSpec(task_code="full", supplier_id=SUPPLIER, concurrency_policy="ALLOW_PARALLEL")
    )
    decision = create_batch(
        db,
        task_code="full",
        trigger_id=f"t-{uuid.uuid4().hex[:8]}",
        trigger_source="MANUAL",
        shard_keys=cities,
    )
    assert decision.batch is not None
    return decision.batch.batch_id


def fresh_batch(db: SyncDatabase) -> str:
    """A batch that shares no city with another (the policy would skip it)."""
    return new_batch(db, [f"Z{uuid.uuid4().hex[:8]}"])


def sync_all(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, cities: list[str]
) -> str:
    batch_id = new_batch(db, cities)
    with db.engine.connect() as conn:
        batch = get_batch(conn, batch_id)
    for city in cities:
        report = sync_city(
            db, store, client, batch=batch, city_code=city, worker_id="w", settings=SETTINGS
        )
        assert report.status == "SUCCESS", report
    return batch_id


def city_hotels(db: SyncDatabase, city: str) -> set[tuple[str, int]]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return {
            (str(r.status), int(r.missing_count))
            for r in conn.execute(sa.select(h.status, h.missing_count).where(h.city_code == city))
        }


def tickets(db: SyncDatabase, code: str) -> list[tuple[str, str | None]]:
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        return [
            (str(r.status), r.city_code)
            for r in conn.execute(sa.select(d.status, d.city_code).where(d.error_code == code))
        ]


def unpublished_events(db: SyncDatabase) -> int:
    o = schema.outbox.c
    with db.engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count()).where(o.event_type == "HotelUnpublished")
            ).scalar_one()
        )


@pytest.fixture
def synced(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, listing: Listing
) -> Listing:
    sync_all(db, store, client, sorted(listing.cities))
    return listing


def test_a_dropped_city_retires_through_the_grace_and_comes_back(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, synced: Listing
) -> None:
    listed = [c for c in synced.cities if c != "CNX"]
    plan = plan_retirement(db, supplier_id=SUPPLIER, listed=listed, partitions=[*listed, "CNX"])
    assert plan.retire == ("CNX",) and plan.held == ()
    first = fresh_batch(db)
    out = retire_cities(db, plan, supplier_id=SUPPLIER, batch_id=first, task_code="full")
    assert out.retired == ["CNX"] and len(out.missing) == 3 and out.unpublished == []
    assert city_hotels(db, "CNX") == {("ACTIVE", 1)}  # in its grace, still published
    # The same batch again (a resume): no second miss.
    again = retire_cities(db, plan, supplier_id=SUPPLIER, batch_id=first, task_code="full")
    assert again.retired == [] and city_hotels(db, "CNX") == {("ACTIVE", 1)}
    second = fresh_batch(db)
    out = retire_cities(db, plan, supplier_id=SUPPLIER, batch_id=second, task_code="full")
    assert sorted(out.unpublished) == ["H000021", "H000022", "H000023"]
    assert city_hotels(db, "CNX") == {("INACTIVE", 2)}
    assert unpublished_events(db) == 3
    with db.engine.connect() as conn:
        assert "CNX" not in catalog_cities(conn, SUPPLIER)
        audit = list_audit(conn, action=RETIRE_ACTION)
    assert [a.after["batch_id"] for a in audit] == [second, first]
    # Retired: the next list retires nothing more, and the other cities were never touched.
    assert plan_retirement(db, supplier_id=SUPPLIER, listed=listed).retire == ()
    assert all(city_hotels(db, c) == {("ACTIVE", 0)} for c in listed)
    # It comes back: its hotels publish again.
    sync_all(db, store, client, ["CNX"])
    assert city_hotels(db, "CNX") == {("ACTIVE", 0)}


def test_a_city_back_within_its_grace_has_its_misses_cleared(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, synced: Listing
) -> None:
    listed = [c for c in synced.cities if c != "CNX"]
    plan = plan_retirement(db, supplier_id=SUPPLIER, listed=listed)
    retire_cities(db, plan, supplier_id=SUPPLIER, batch_id=fresh_batch(db), task_code="full")
    assert city_hotels(db, "CNX") == {("ACTIVE", 1)}
    sync_all(db, store, client, ["CNX"])
    assert city_hotels(db, "CNX") == {("ACTIVE", 0)}
    assert unpublished_events(db) == 0


def test_a_retired_city_has_its_open_tickets_closed(db: SyncDatabase, synced: Listing) -> None:
    listed = [c for c in synced.cities if c != "CNX"]
    batch = fresh_batch(db)
    record_city_failure(
        db,
        batch_id=batch,
        task_code="full",
        sync_mode="FULL",
        supplier_id=SUPPLIER,
        city_code="CNX",
        error="SUPPLIER_UNAVAILABLE: 503",
    )
    other = fresh_batch(db)
    record_city_failure(
        db,
        batch_id=other,
        task_code="full",
        sync_mode="FULL",
        supplier_id=SUPPLIER,
        city_code="CNX",
        error="CITY_NOT_FOUND: GET /v1/cities/CNX/hotels -> 404",
        error_code="CITY_NOT_FOUND",
    )
    # A 404 is not retried: a person's ticket, not compensation's.
    assert tickets(db, "CITY_NOT_FOUND") == [("MANUAL_FIX", "CNX")]
    plan = plan_retirement(db, supplier_id=SUPPLIER, listed=listed)
    out = retire_cities(db, plan, supplier_id=SUPPLIER, batch_id=other, task_code="full")
    assert out.tickets_closed == 2
    assert tickets(db, "CITY_NOT_FOUND") == [("IGNORED", "CNX")]
    assert tickets(db, "CITY_FAILED") == [("IGNORED", "CNX")]


def test_a_mass_drop_is_held_with_one_ticket_until_allowed(
    db: SyncDatabase, synced: Listing
) -> None:
    assert retire_limit(6) == 2 and retire_limit(50) == 10
    listed = ["BKK", "CNX", "HKT"]
    plan = plan_retirement(db, supplier_id=SUPPLIER, listed=listed, partitions=[*synced.cities])
    assert plan.retire == () and plan.held == ("KBV", "PYX", "USM")
    for _ in range(2):  # two syncs see the same drop: one ticket
        out = retire_cities(
            db, plan, supplier_id=SUPPLIER, batch_id=fresh_batch(db), task_code="full"
        )
        assert out.retired == [] and out.held == ["KBV", "PYX", "USM"]
    assert tickets(db, CITY_DROP_HELD) == [("MANUAL_FIX", None)]
    assert all(city_hotels(db, c) == {("ACTIVE", 0)} for c in synced.cities)
    allowed = plan_retirement(db, supplier_id=SUPPLIER, listed=listed, allow_mass_drop=True)
    assert allowed.retire == ("KBV", "PYX", "USM") and allowed.held == ()


def test_the_guard_lets_as_many_as_its_limit_retire(db: SyncDatabase, synced: Listing) -> None:
    listed = ["BKK", "CNX", "HKT", "KBV"]
    plan = plan_retirement(db, supplier_id=SUPPLIER, listed=listed)
    assert plan.retire == ("PYX", "USM") and plan.held == ()


def test_partitions_without_hotels_retire_unguarded(db: SyncDatabase, synced: Listing) -> None:
    # Another supplier's cities in a shared Dagster home hold none of this catalog.
    strays = [f"X{n}" for n in range(10)]
    plan = plan_retirement(db, supplier_id=SUPPLIER, listed=list(synced.cities), partitions=strays)
    assert plan.retire == tuple(sorted(strays)) and plan.held == ()


def test_an_empty_city_list_retires_nothing_and_is_an_error(
    db: SyncDatabase, synced: Listing
) -> None:
    with pytest.raises(EmptyCityList, match="listed no city"):
        plan_retirement(db, supplier_id=SUPPLIER, listed=[], partitions=list(synced.cities))
    assert all(city_hotels(db, c) == {("ACTIVE", 0)} for c in synced.cities)


def test_a_retired_city_is_not_stale_until_it_syncs_again(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, synced: Listing
) -> None:
    assert "CNX" in sync_health(db, task_code="full", supplier_id=SUPPLIER).city_lag_hours
    listed = [c for c in synced.cities if c != "CNX"]
    plan = plan_retirement(db, supplier_id=SUPPLIER, listed=listed)
    retire_cities(db, plan, supplier_id=SUPPLIER, batch_id=fresh_batch(db), task_code="full")
    lags = sync_health(db, task_code="full", supplier_id=SUPPLIER).city_lag_hours
    assert "CNX" not in lags and set(listed) <= set(lags)
    # Another supplier's retirement of a city of the same code changes nothing here.
    assert "CNX" in sync_health(db, task_code="full", supplier_id=2002).city_lag_hours
    db.clock.advance(1)  # its next sync finishes after the retirement
    sync_all(db, store, client, ["CNX"])
    assert "CNX" in sync_health(db, task_code="full", supplier_id=SUPPLIER).city_lag_hours
