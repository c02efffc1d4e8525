"""Reconciliation against the simulator's city summaries (SQLite and MariaDB): a city that
lost hotels or changes differs, a re-pull of exactly that city makes it equal again."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import TaskSpec, create_batch, upsert_task
from supplier_sync_dagster.core.repair.reconcile import CityCounts, Tolerance, compare, reconcile
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.sync.city import sync_city
from supplier_sync_dagster.simulator import FaultProfile
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
    empty = compare("D", same, CityCounts(), tol)
    assert empty.differs and any("no hotel" in r for r in empty.reasons)
