"""Reconciliation through Dagster: the asset's table and numbers, the sensor's re-pull runs,
the next reconciliation equal (its remaining differences counted, never re-pulled twice), and
the reconciliation_diff alert a remaining difference starts and a repair clears; a city that
differs only by hotels with open dead-letter tickets waits on them (never re-pulled, never a
remaining difference)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.definitions import defs
from supplier_sync_dagster.defs.city_sync import city_sync
from supplier_sync_dagster.defs.health import alert_sensor
from supplier_sync_dagster.defs.partitions import decode_city_key, encode_city_key
from supplier_sync_dagster.defs.reconciliation import (
    hotel_catalog_reconciliation,
    reconciliation_repull_sensor,
)
from supplier_sync_dagster.defs.resources import SimulatedSupplierResource
from supplier_sync_dagster.defs.triggers import TRIGGER_TAG
from supplier_sync_dagster.simulator import FaultProfile, Simulator, SimulatorConfig
from supplier_sync_dagster_tests.defs.test_incremental_sync import (
    full_sync_of_every_city,
    simulated_resources,
)
from supplier_sync_dagster_tests.helpers import Receiver


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    """A Dagster instance of the test's own, disposed afterwards (a dangling one would be
    what later definitions loads read their state from)."""
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver.serve() as r:
        yield r


def _reconcile(instance: dg.DagsterInstance, db_url: str, tmp_path: Path) -> dict[str, Any]:
    resources = simulated_resources(db_url, tmp_path, 0)
    result = dg.materialize(
        [hotel_catalog_reconciliation],
        instance=instance,
        resources={k: resources[k] for k in ("sync_db", "payloads", "supplier")},
    )
    assert result.success
    (m,) = result.asset_materializations_for_node("hotel_catalog_reconciliation")
    return {k: v.value for k, v in m.metadata.items()}


def repository() -> dg.RepositoryDefinition:
    return defs().get_repository_def()


def _lose_city(db_url: str) -> str:
    db = SyncDatabase.open(db_url)
    h = schema.platform_hotel.c
    try:
        with db.begin() as conn:
            city = (
                conn.execute(
                    sa.select(h.city_code).group_by(h.city_code).order_by(sa.func.count().desc())
                )
                .scalars()
                .first()
            )
            ids = (
                conn.execute(sa.select(h.resource_id).where(h.city_code == city).limit(7))
                .scalars()
                .all()
            )
            conn.execute(sa.delete(schema.platform_hotel).where(h.resource_id.in_(ids)))
        return str(city)
    finally:
        db.dispose()


def _alert_round(instance: dg.DagsterInstance, db_url: str, tmp_path: Path) -> str:
    resources = simulated_resources(db_url, tmp_path, 0)
    with dg.build_sensor_context(
        instance=instance, resources={k: resources[k] for k in ("sync_db", "supplier")}
    ) as ctx:
        said = alert_sensor(ctx)
    assert isinstance(said, dg.SkipReason)
    return str(said.skip_message)


def test_a_differing_city_is_reported_repulled_by_the_sensor_and_then_equal(
    db_url: str,
    tmp_path: Path,
    instance: dg.DagsterInstance,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
):
    full_sync_of_every_city(instance, db_url, tmp_path)
    clean = _reconcile(instance, db_url, tmp_path)
    assert clean["cities_differing"] == 0 and clean["repull_cities"] == []
    lost = _lose_city(db_url)
    found = _reconcile(instance, db_url, tmp_path)
    assert found["cities_differing"] == 1 and found["repull_cities"] == [lost]
    assert found["cities_repulled"] == 1 and found["remaining_differences"] == 0
    table = found["differences"]
    (row,) = table.records
    assert row.data["city"] == lost
    assert row.data["supplier_hotels"] - row.data["catalog_hotels"] == 7

    # The sensor requests one full-sync run for exactly that city.
    # The daemon evaluates a sensor in a partition loading context of its instance.
    with (
        dg.partition_loading_context(dynamic_partitions_store=instance),
        dg.build_sensor_context(instance=instance, repository_def=repository()) as ctx,
    ):
        tick = reconciliation_repull_sensor.evaluate_tick(ctx)
    (request,) = tick.run_requests or []
    assert request.partition_key is not None and decode_city_key(request.partition_key) == lost
    assert request.tags[TRIGGER_TAG].startswith("repull:")
    # What the daemon would launch: that partition of the full sync.
    repull = dg.materialize(
        [city_sync],
        instance=instance,
        resources=simulated_resources(db_url, tmp_path, 0),
        partition_key=request.partition_key,
        tags=request.tags,
    )
    assert repull.success
    equal = _reconcile(instance, db_url, tmp_path)
    assert equal["cities_differing"] == 0 and equal["remaining_differences"] == 0

    # A city a re-pull did not fix is counted as remaining and not re-pulled again.
    lost = _lose_city(db_url)
    assert _reconcile(instance, db_url, tmp_path)["repull_cities"] == [lost]
    again = _reconcile(instance, db_url, tmp_path)
    assert again["remaining_differences"] == 1 and again["repull_cities"] == []
    with dg.build_sensor_context(
        instance=instance, cursor=tick.cursor, repository_def=repository()
    ) as ctx:
        # The newest reconciliation re-pulls nothing: no run.
        later = reconciliation_repull_sensor.evaluate_tick(ctx)
    assert not later.run_requests

    # The difference that remains is an alert: one message over HTTP, none while it holds.
    monkeypatch.setenv("SUPPLIER_SYNC_ALERT_URL", receiver.url)
    assert "reconciliation_diff" in _alert_round(instance, db_url, tmp_path)
    _alert_round(instance, db_url, tmp_path)
    assert receiver.take() == [("FIRING", "reconciliation_diff")]
    # An operator re-syncs the city; the next reconciliation is equal and the alert clears.
    fixed = dg.materialize(
        [city_sync],
        instance=instance,
        resources=simulated_resources(db_url, tmp_path, 0),
        partition_key=encode_city_key(lost),
    )
    assert fixed.success
    assert _reconcile(instance, db_url, tmp_path)["remaining_differences"] == 0
    assert _alert_round(instance, db_url, tmp_path).startswith("0 conditions hold")
    assert receiver.take() == [("RESOLVED", "reconciliation_diff")]


class BadRecordsSupplier(SimulatedSupplierResource):
    """The tests' simulated supplier with a share of records that break the contract."""

    bad_record_rate: float = 0.03

    def _connection(self) -> tuple[httpx.Client, str]:
        config = SimulatorConfig(
            seed=self.sim_seed,
            n_cities=self.sim_cities,
            total_hotels=self.sim_hotels,
            day=self.sim_day,
            faults=FaultProfile.clean().with_(bad_record_rate=self.bad_record_rate),
        )
        sim = Simulator(config)
        return httpx.Client(base_url="http://sim", transport=sim.transport()), config.api_key


def test_a_city_with_dead_lettered_hotels_waits_on_its_tickets_and_is_never_repulled(
    db_url: str, tmp_path: Path, instance: dg.DagsterInstance
):
    bad = BadRecordsSupplier(sim_cities=4, sim_hotels=600, sim_profile="clean")
    resources = {**simulated_resources(db_url, tmp_path, 0), "supplier": bad}
    with bad.client() as client:
        keys = [encode_city_key(c.city_code) for c in client.list_cities().data.cities]
    instance.add_dynamic_partitions("supplier_city", keys)
    synced = dg.materialize(
        [city_sync],
        instance=instance,
        resources=resources,
        tags={
            "dagster/asset_partition_range_start": keys[0],
            "dagster/asset_partition_range_end": keys[-1],
        },
    )
    assert synced.success
    d = schema.dead_letter.c
    db = SyncDatabase.open(db_url)
    try:
        with db.engine.connect() as conn:
            tickets: dict[str, int] = dict(
                conn.execute(
                    sa.select(d.city_code, sa.func.count(sa.distinct(d.supplier_resource_code)))
                    .where(d.status.not_in(("RESOLVED", "IGNORED")))
                    .group_by(d.city_code)
                ).all()
            )
    finally:
        db.dispose()
    assert tickets

    def reconciled() -> dict[str, Any]:
        result = dg.materialize(
            [hotel_catalog_reconciliation],
            instance=instance,
            resources={k: resources[k] for k in ("sync_db", "payloads", "supplier")},
        )
        assert result.success
        (m,) = result.asset_materializations_for_node("hotel_catalog_reconciliation")
        return {k: v.value for k, v in m.metadata.items()}

    for _ in range(2):  # the second pass alike: no remaining difference either
        meta = reconciled()
        assert meta["cities_differing"] == 0 and meta["repull_cities"] == []
        assert meta["remaining_differences"] == 0 and meta["remaining_cities"] == []
        waiting = meta["waiting_cities"]
        assert waiting and set(waiting) <= set(tickets)
        assert meta["cities_waiting_on_tickets"] == len(waiting)
        assert meta["hotels_waiting_on_tickets"] == sum(tickets[c] for c in waiting)
    # The sensor has nothing to re-pull.
    with (
        dg.partition_loading_context(dynamic_partitions_store=instance),
        dg.build_sensor_context(instance=instance, repository_def=repository()) as ctx,
    ):
        assert not reconciliation_repull_sensor.evaluate_tick(ctx).run_requests
