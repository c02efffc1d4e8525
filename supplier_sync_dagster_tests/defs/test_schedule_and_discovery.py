"""The nightly schedule asks for one range run; the discovery sensor adds city partitions and
retires the partitions of cities the supplier no longer lists."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.dagster_instance.home import dagster_instance
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE
from supplier_sync_dagster.defs.city_discovery_sensor import city_discovery_sensor
from supplier_sync_dagster.defs.city_sync import build_city_sync
from supplier_sync_dagster.defs.full_sync_schedule import nightly_full_sync
from supplier_sync_dagster.defs.partitions import CITY_PARTITIONS, decode_city_key, encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    HttpSupplierResource,
    PayloadStoreResource,
    SimulatedSupplierResource,
    SyncDatabaseResource,
)
from supplier_sync_dagster.defs.triggers import TRIGGER_TAG
from supplier_sync_dagster.simulator import HOSTILE_CITY_CODES
from supplier_sync_dagster_tests.cli.test_main import (  # noqa: F401 (cli_home: a fixture)
    cli_home,
    query,
    simulator,
    supplier,
    sync,
)
from supplier_sync_dagster_tests.helpers import SIM_API_KEY


def test_discovery_then_nightly_schedule(tmp_path: Path):
    with dg.instance_for_test() as instance:
        _discover_then_schedule(instance, f"sqlite:///{tmp_path / 'sync.db'}")


def _discover_then_schedule(instance: dg.DagsterInstance, db_url: str) -> None:
    supplier = SimulatedSupplierResource(sim_cities=6, sim_hotels=300)
    resources = {"supplier": supplier, "sync_db": SyncDatabaseResource(db_url=db_url)}
    with dg.build_sensor_context(instance=instance, resources=resources) as ctx:
        result = city_discovery_sensor(ctx)
    assert isinstance(result, dg.SensorResult)
    (request,) = result.dynamic_partitions_requests or []
    keys = list(request.partition_keys)
    assert {decode_city_key(k) for k in keys} >= set(HOSTILE_CITY_CODES)
    # build_sensor_context does not apply the request: do what the daemon would.
    instance.add_dynamic_partitions("supplier_city", keys)
    with dg.build_sensor_context(instance=instance, resources=resources) as ctx:
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


# --- retirement: a city the supplier stops listing leaves the active set, and comes back ---


def _discover(instance: dg.DagsterInstance, db_url: str, url: str) -> dg.SensorResult:
    """One evaluation of the discovery sensor, its partition requests applied as the daemon
    would."""
    resources = {
        "supplier": HttpSupplierResource(base_url=url, api_key=SIM_API_KEY),
        "sync_db": SyncDatabaseResource(db_url=db_url),
    }
    with dg.build_sensor_context(instance=instance, resources=resources) as ctx:
        result = city_discovery_sensor(ctx)
    assert isinstance(result, dg.SensorResult)
    for request in result.dynamic_partitions_requests or []:
        keys = list(request.partition_keys or [])
        if isinstance(request, dg.AddDynamicPartitionsRequest):
            instance.add_dynamic_partitions(CITY_PARTITIONS, keys)
        else:
            for key in keys:
                instance.delete_dynamic_partition(CITY_PARTITIONS, key)
    return result


def _cities() -> set[str]:
    with dagster_instance() as instance:
        return {decode_city_key(k) for k in instance.get_dynamic_partitions(CITY_PARTITIONS)}


def _misses(db_url: str, city: str) -> set[int]:
    h = schema.platform_hotel.c
    return {int(m) for (m,) in query(db_url, sa.select(h.missing_count).where(h.city_code == city))}


@pytest.mark.usefixtures("cli_home")
def test_the_sensor_retires_a_dropped_city_and_brings_it_back(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(n_cities=4)
    listed = sim.ground_truth().listed_by_city
    city = max(listed, key=lambda c: len(listed[c]))
    with supplier(sim, monkeypatch) as url:
        assert sync(capsys, db_url).code == 0  # day 0: 4 partitions, a full batch
        sim.set_modes(["dropped_city"], [city])
        with dagster_instance() as instance:
            gone = _discover(instance, db_url, url)
            assert [type(r) for r in gone.dynamic_partitions_requests or []] == [
                dg.DeleteDynamicPartitionsRequest
            ]
            assert city not in _cities() and len(_cities()) == 3
            # The latest full batch synced the city while it was listed: no miss from it.
            assert _misses(db_url, city) == {0}
            when = datetime(2026, 12, 1, 2, 0, tzinfo=UTC)
            with dg.build_schedule_context(instance=instance, scheduled_execution_time=when) as c:
                run = nightly_full_sync(c)
            assert isinstance(run, dg.RunRequest)
            keys = instance.get_dynamic_partitions(CITY_PARTITIONS)
            assert run.tags["dagster/asset_partition_range_start"] == keys[0]
            assert run.tags["dagster/asset_partition_range_end"] == keys[-1]
            assert encode_city_key(city) not in keys
        # A full batch that no longer sees the city counts one miss; the sensor counts no
        # second one against the same batch.
        assert sync(capsys, db_url).code == 0
        assert _misses(db_url, city) == {1}
        with dagster_instance() as instance:
            _discover(instance, db_url, url)
        assert _misses(db_url, city) == {1}
        # It comes back: its partition is added again.
        sim.set_modes([])
        with dagster_instance() as instance:
            back = _discover(instance, db_url, url)
        assert [list(r.partition_keys or []) for r in back.dynamic_partitions_requests or []] == [
            [encode_city_key(city)]
        ]
        assert city in _cities()
        # An empty city list changes nothing, and says why.
        before = _cities()
        sim.set_modes(["dropped_city"])
        with dagster_instance() as instance:
            empty = _discover(instance, db_url, url)
        assert not empty.dynamic_partitions_requests
        assert empty.skip_reason is not None and "EMPTY_CITY_LIST" in str(
            empty.skip_reason.skip_message
        )
        assert _cities() == before


def _nightly(instance: dg.DagsterInstance, db_url: str, url: str, day: int, payloads: str) -> bool:
    """The nightly schedule's run request of ``day``, executed as the daemon would."""
    when = datetime(2026, 12, day, 2, 0, tzinfo=UTC)
    with dg.build_schedule_context(instance=instance, scheduled_execution_time=when) as ctx:
        run = nightly_full_sync(ctx)
    assert isinstance(run, dg.RunRequest)
    result = dg.materialize(
        [build_city_sync(DEFAULT_SCOPE)],
        instance=instance,
        resources={
            "sync_db": SyncDatabaseResource(db_url=db_url),
            "payloads": PayloadStoreResource(url=payloads),
            "supplier": HttpSupplierResource(base_url=url, api_key=SIM_API_KEY),
            "governance": GovernanceResource(),
        },
        tags=run.tags,
        raise_on_error=False,
    )
    return result.success


@pytest.mark.usefixtures("cli_home")
def test_a_scheduled_run_fails_a_dropped_city_once_then_it_is_retired(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without the discovery sensor: the nightly range run meets the dropped city's 404 once,
    retires it (partition out, ticket closed), and the next night's run succeeds."""
    sim = simulator(n_cities=4)
    listed = sim.ground_truth().listed_by_city
    city = max(listed, key=lambda c: len(listed[c]))
    payloads = f"file://{tmp_path / 'payloads'}"
    d = schema.dead_letter.c
    with supplier(sim, monkeypatch) as url:
        assert sync(capsys, db_url).code == 0  # day 0: the partitions and the catalog
        sim.set_modes(["dropped_city"], [city])
        with dagster_instance() as instance:
            assert not _nightly(instance, db_url, url, 1, payloads)
            assert city not in _cities() and len(_cities()) == 3
            found = query(db_url, sa.select(d.error_code, d.status).where(d.city_code == city))
            # The 404 is a person's ticket, closed by the retirement: nothing retries it.
            assert found == [("CITY_NOT_FOUND", "IGNORED")]
            assert _misses(db_url, city) == {1}
            assert _nightly(instance, db_url, url, 2, payloads)
    assert _misses(db_url, city) == {1}  # the run no longer sees the city: the CLI or the
    # sensor counts the next miss against the next full batch
