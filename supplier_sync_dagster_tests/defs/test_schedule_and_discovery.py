"""The nightly schedule asks for one range run; the discovery sensor adds city partitions."""

from __future__ import annotations

from datetime import UTC, datetime

import dagster as dg

from supplier_sync_dagster.defs.city_discovery_sensor import city_discovery_sensor
from supplier_sync_dagster.defs.full_sync_schedule import nightly_full_sync
from supplier_sync_dagster.defs.partitions import decode_city_key
from supplier_sync_dagster.defs.resources import SimulatedSupplierResource
from supplier_sync_dagster.defs.triggers import TRIGGER_TAG
from supplier_sync_dagster.simulator import HOSTILE_CITY_CODES


def test_discovery_then_nightly_schedule():
    with dg.instance_for_test() as instance:
        _discover_then_schedule(instance)


def _discover_then_schedule(instance: dg.DagsterInstance) -> None:
    supplier = SimulatedSupplierResource(sim_cities=6, sim_hotels=300)
    with dg.build_sensor_context(instance=instance, resources={"supplier": supplier}) as ctx:
        result = city_discovery_sensor(ctx)
    assert isinstance(result, dg.SensorResult)
    (request,) = result.dynamic_partitions_requests or []
    keys = list(request.partition_keys)
    assert {decode_city_key(k) for k in keys} >= set(HOSTILE_CITY_CODES)
    # build_sensor_context does not apply the request: do what the daemon would.
    instance.add_dynamic_partitions("supplier_city", keys)
    with dg.build_sensor_context(instance=instance, resources={"supplier": supplier}) as ctx:
        again = city_discovery_sensor(ctx)
    assert isinstance(again, dg.SensorResult) and not again.dynamic_partitions_requests

    when = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
    with dg.build_schedule_context(instance=instance, scheduled_execution_time=when) as ctx2:
        run = nightly_full_sync(ctx2)
    assert isinstance(run, dg.RunRequest)
    assert run.tags["dagster/asset_partition_range_start"] == keys[0]
    assert run.tags["dagster/asset_partition_range_end"] == keys[-1]
    assert run.tags[TRIGGER_TAG] == run.run_key == "nightly:2026-11-30T02:00:00+00:00"


def test_nightly_schedule_skips_without_partitions():
    with (
        dg.instance_for_test() as instance,
        dg.build_schedule_context(instance=instance) as ctx,
    ):
        assert isinstance(nightly_full_sync(ctx), dg.SkipReason)
