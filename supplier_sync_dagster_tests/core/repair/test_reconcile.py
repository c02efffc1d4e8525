"""Reconciliation against the simulator's city summaries (SQLite and MariaDB): a city that
lost hotels or changes differs, a re-pull of exactly that city makes it equal again; a
catalog ahead of its supplier differs; a city whose walk drifted is walked again, and a
hotel the drift lost is found although every count agrees."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import TaskSpec, create_batch, upsert_task
from supplier_sync_dagster.core.records.deadletters import DeadLetter, record_dead_letters
from supplier_sync_dagster.core.records.tombstones import TOMBSTONE_FINGERPRINT
from supplier_sync_dagster.core.repair.reconcile import (
    CityCounts,
    Tolerance,
    accounted_for,
    compare,
    drifted_cities,
    reconcile,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.supplier import WalkLimits
from supplier_sync_dagster.core.sync.city import sync_city
from supplier_sync_dagster.simulator import FaultProfile, ModeScale, Simulator
from supplier_sync_dagster_tests.core.sync.test_city import SUPPLIER, full_sync, settings
from supplier_sync_dagster_tests.helpers import make_simulator, supplier_client


def _lose(db: SyncDatabase, city: str, n: int) -> list[str]:
    """Deletes ``n`` hotels of ``city`` from the catalog, as a walk that skipped a page would
    never have written them."""
    h = schema.platform_hotel.c
    with db.begin() as conn:
        ids = (
            conn.execute(
                sa.select(h.supplier_hotel_id)
                .where(h.city_code == city)
                .order_by(h.supplier_hotel_id)
                .limit(n)
            )
            .scalars()
            .all()
        )
        conn.execute(sa.delete(schema.platform_hotel).where(h.supplier_hotel_id.in_(ids)))
    return list(ids)


def test_a_city_that_lost_hotels_differs_and_a_repull_makes_it_equal(
    db: SyncDatabase, tmp_path: Path
):
    sim = make_simulator(FaultProfile.clean(), seed=21, n_cities=6, total_hotels=900)
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=httpx.MockTransport(sim.handle)) as http:
        client = supplier_client(http)
        full_sync(db, store, client, "day0")
        first = reconcile(db, client, supplier_id=SUPPLIER)
        assert first.differing == [] and first.failed == []
        assert first.requests == len(first.cities) + 1  # the city list and a summary each
        biggest = max(first.cities, key=lambda c: c.catalog.hotels).city_code
        _lose(db, biggest, 10)
        second = reconcile(db, client, supplier_id=SUPPLIER)
        assert [c.city_code for c in second.differing] == [biggest]
        (diff,) = second.differing
        assert diff.supplier is not None and diff.supplier.hotels - diff.catalog.hotels == 10
        assert "hotels" in diff.reasons[0]
        # The re-pull: a full sync of exactly that city.
        full_sync_cities(db, store, client, "repull", [biggest])
        third = reconcile(db, client, supplier_id=SUPPLIER, cities=[biggest])
        assert third.differing == [] and third.requests == 1


def full_sync_cities(db, store, client, trigger: str, cities: list[str]) -> None:
    upsert_task(db, TaskSpec(task_code="hotel_full", supplier_id=SUPPLIER))
    decision = create_batch(
        db, task_code="hotel_full", trigger_id=trigger, trigger_source="MANUAL", shard_keys=cities
    )
    assert decision.batch is not None
    for city in cities:
        report = sync_city(
            db,
            store,
            client,
            batch=decision.batch,
            city_code=city,
            worker_id="w",
            settings=settings(),
        )
        assert report.status == "SUCCESS", report


def test_the_tolerance_and_the_lag_decide_what_differs():
    now = datetime(2026, 11, 20, tzinfo=UTC)
    tol = Tolerance(absolute=2, relative=0.02, max_lag_seconds=3600)
    same = CityCounts(1000, 990, now)
    assert not compare("A", same, CityCounts(985, 975, now), tol).differs  # within 2%
    assert compare("A", same, CityCounts(970, 975, now), tol).differs  # 30 apart
    assert not compare("B", CityCounts(10, 10, now), CityCounts(8, 8, now), tol).differs
    behind = compare("C", same, CityCounts(1000, 990, now - timedelta(hours=2)), tol)
    assert behind.differs and "behind" in behind.reasons[0]
    ahead = compare("E", same, CityCounts(1000, 990, now + timedelta(seconds=1)), tol)
    assert ahead.reasons == ("the catalog's newest change is 1 s ahead of the supplier's",)
    lenient = Tolerance(max_ahead_seconds=60)
    assert not compare(
        "E", same, CityCounts(1000, 990, now + timedelta(seconds=1)), lenient
    ).differs
    empty = compare("D", same, CityCounts(), tol)
    assert empty.differs and any("no hotel" in r for r in empty.reasons)


def test_a_catalog_newer_than_its_supplier_differs(db: SyncDatabase, tmp_path: Path):
    sim = make_simulator(FaultProfile.clean(), seed=22, n_cities=4, total_hotels=400)
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=httpx.MockTransport(sim.handle)) as http:
        client = supplier_client(http)
        full_sync(db, store, client, "day0")
        assert reconcile(db, client, supplier_id=SUPPLIER).differing == []
        # A change dated ahead of anything the supplier states (a blinded watermark's kind).
        h = schema.platform_hotel.c
        with db.begin() as conn:
            hotel_id, city = conn.execute(
                sa.select(h.supplier_hotel_id, h.city_code).order_by(h.supplier_hotel_id).limit(1)
            ).one()
            conn.execute(
                sa.update(schema.platform_hotel)
                .where(h.supplier_hotel_id == hotel_id)
                .values(supplier_updated_at=datetime(2099, 1, 1))
            )
        report = reconcile(db, client, supplier_id=SUPPLIER)
    assert [c.city_code for c in report.differing] == [city]
    (diff,) = report.differing
    assert len(diff.reasons) == 1 and "ahead of the supplier's" in diff.reasons[0]
    assert diff.row()["catalog_max_updated_at"] == "2099-01-01T00:00:00Z"


def _drift_sim(shifts: int) -> Simulator:
    faults = FaultProfile.clean().with_(modes=("drift",), mode_scale=ModeScale(drift_shifts=shifts))
    sim = make_simulator(faults, seed=23, n_cities=3, total_hotels=450)
    biggest = max(sim.ground_truth().listed_by_city.items(), key=lambda kv: len(kv[1]))[0]
    sim.set_modes(["drift"], [biggest])
    return sim


def _published(db: SyncDatabase) -> set[str]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return set(
            conn.execute(
                sa.select(h.supplier_hotel_id).where(h.fingerprint != TOMBSTONE_FINGERPRINT)
            ).scalars()
        )


@pytest.mark.parametrize("check", [False, True], ids=["unchecked", "checked"])
def test_a_city_whose_walk_drifted_is_walked_again(db: SyncDatabase, tmp_path: Path, check: bool):
    sim = _drift_sim(shifts=6)
    (city,) = sim.modes.cities
    store = LocalPayloadStore(tmp_path / "payloads")
    limits = WalkLimits(continuity_check=check)
    with httpx.Client(base_url="http://sim", transport=httpx.MockTransport(sim.handle)) as http:
        client = supplier_client(http)
        full_sync(db, store, client, "day0", walk=limits, page_size=20)
        truth = sim.ground_truth()
        lost = set(truth.valid) - _published(db)
        assert drifted_cities(db, "hotel_full") == {city: "SHIFTED" if check else "UNCHECKED"}
        report = reconcile(db, client, supplier_id=SUPPLIER, task_code="hotel_full")
    by_city = {c.city_code: c for c in report.cities}
    drifted = by_city[city]
    assert drifted.rewalked == ("SHIFTED" if check else "UNCHECKED")
    assert all(c.rewalked is None for c in report.cities if c.city_code != city)
    # Every count agrees: only the walk again tells a lost hotel.
    assert drifted.supplier is not None
    assert Tolerance().allows(drifted.supplier.hotels, drifted.catalog.hotels)
    if check:
        assert lost == set() and report.differing == []
    else:
        assert lost and set(drifted.missing) == lost
        assert [c.city_code for c in report.differing] == [city]
        assert drifted.reasons == (
            f"{len(lost)} listed hotel(s) not in the catalog ({', '.join(map(repr, sorted(lost)[:3]))}"
            f"{', …' if len(lost) > 3 else ''}), walked again after a UNCHECKED walk",
        )
    # A summary per city, and the pages of the drifted city (500 hotels a page) once more.
    pages = -(-len(truth.listed_by_city[city]) // 500)
    assert report.requests == len(report.cities) + 1 + pages


def test_a_listed_hotel_that_waits_as_a_dead_letter_is_not_missing(
    db: SyncDatabase, tmp_path: Path
):
    sim = _drift_sim(shifts=6)
    (city,) = sim.modes.cities
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=httpx.MockTransport(sim.handle)) as http:
        client = supplier_client(http)
        batch_id, _ = full_sync(
            db, store, client, "day0", walk=WalkLimits(continuity_check=False), page_size=20
        )
        lost = sorted(set(sim.ground_truth().valid) - _published(db))
        assert len(lost) == 2
        letter = DeadLetter(
            lost[0], "VALIDATION", "NON_RETRYABLE", "INVALID_GEO", "lat 200", None, None
        )
        with db.begin() as conn:
            record_dead_letters(
                conn,
                db.clock,
                batch_id=batch_id,
                task_code="hotel_full",
                sync_mode="FULL",
                supplier_id=SUPPLIER,
                letters=[letter],
            )
        assert accounted_for(db, SUPPLIER, lost) == {lost[0]}
        report = reconcile(db, client, supplier_id=SUPPLIER, task_code="hotel_full")
    (drifted,) = report.differing
    assert drifted.city_code == city and drifted.missing == (lost[1],)
