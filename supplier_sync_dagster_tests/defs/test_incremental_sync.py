"""The incremental sync through Dagster: the asset reports its window and each city it
published in (per partition); the schedule runs one window at a time."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._core.test_utils import create_run_for_test

from supplier_sync_dagster.defs.city_keys import PUBLISHED
from supplier_sync_dagster.defs.city_sync import city_sync
from supplier_sync_dagster.defs.incremental_sync import (
    CHANGE_FEED,
    IncrementalConfig,
    hotel_change_feed,
    incremental_sync_job,
    incremental_sync_schedule,
)
from supplier_sync_dagster.defs.partitions import decode_city_key, encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SimulatedSupplierResource,
    SyncDatabaseResource,
)
from supplier_sync_dagster.defs.triggers import TASK_TAG, TRIGGER_TAG


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    """A Dagster instance of the test's own, disposed afterwards (a dangling one would be
    what later definitions loads read their state from)."""
    with dg.instance_for_test() as inst:
        yield inst


def _supplier(day: int) -> SimulatedSupplierResource:
    return SimulatedSupplierResource(
        sim_cities=4, sim_hotels=500, sim_profile="clean", sim_day=day, rate_limit_rps=10_000
    )


def simulated_resources(db_url: str, tmp_path: Path, day: int) -> dict[str, Any]:
    return {
        "sync_db": SyncDatabaseResource(db_url=db_url),
        "payloads": PayloadStoreResource(url=f"file://{tmp_path}/payloads"),
        "supplier": _supplier(day),
        "governance": GovernanceResource(),
    }


def full_sync_of_every_city(instance: dg.DagsterInstance, db_url: str, tmp_path: Path) -> list[str]:
    with _supplier(0).client() as client:
        keys = [encode_city_key(c.city_code) for c in client.list_cities().data.cities]
    instance.add_dynamic_partitions("supplier_city", keys)
    result = dg.materialize(
        [city_sync],
        instance=instance,
        resources=simulated_resources(db_url, tmp_path, 0),
        tags={
            "dagster/asset_partition_range_start": keys[0],
            "dagster/asset_partition_range_end": keys[-1],
        },
    )
    assert result.success
    return keys


def test_a_window_materializes_the_feed_and_each_city_it_published_in(
    db_url: str, tmp_path: Path, instance: dg.DagsterInstance
):
    keys = full_sync_of_every_city(instance, db_url, tmp_path)
    result = dg.materialize(
        [hotel_change_feed],
        instance=instance,
        resources=simulated_resources(db_url, tmp_path, 1),
        run_config=dg.RunConfig(ops={"hotel_change_feed": IncrementalConfig(overlap_seconds=600)}),
    )
    assert result.success
    events = result.asset_materializations_for_node("hotel_change_feed")
    feed = [m for m in events if m.asset_key == CHANGE_FEED]
    cities = {m.partition: m for m in events if m.asset_key == PUBLISHED}
    (window,) = feed
    meta: dict[str, Any] = {k: v.value for k, v in window.metadata.items()}
    assert meta["status"] == "SUCCESS" and meta["published"] > 0
    assert meta["watermark_after"] > meta["watermark_before"]
    assert meta["cities_touched"] == len(cities) > 0
    assert set(cities) <= set(instance.get_dynamic_partitions("supplier_city"))
    per_city: dict[str, Any] = {
        decode_city_key(str(p)): m.metadata["published"].value for p, m in cities.items()
    }
    assert sum(per_city.values()) == meta["published"]
    # Each city's materialization is stored once (they are logged, then handed to the run).
    stored = instance.all_logs(result.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
    partitions = [
        str(e.asset_materialization.partition)
        for e in stored
        if e.asset_materialization and e.asset_materialization.asset_key == PUBLISHED
    ]
    assert sorted(partitions) == sorted(str(p) for p in cities)
    # The city's partition shows the incremental publish as its latest materialization.
    latest = instance.get_latest_materialization_event(PUBLISHED)
    assert latest is not None and latest.asset_materialization is not None
    assert latest.asset_materialization.partition in cities
    assert latest.asset_materialization.metadata["sync_mode"].value == "INCREMENTAL"
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks == {"change_volume": True, "quiet_windows": True}
    assert set(cities) <= set(keys)


def test_without_a_full_sync_the_window_fails_with_what_to_do(
    db_url: str, tmp_path: Path, instance: dg.DagsterInstance
):
    result = dg.materialize(
        [hotel_change_feed],
        instance=instance,
        resources=simulated_resources(db_url, tmp_path, 0),
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = result.get_step_failure_events()
    data = failure.step_failure_data.user_failure_data
    assert data is not None and "sync --full" in (data.description or "")


def test_the_schedule_runs_one_window_at_a_time_and_waits_for_a_full_sync(
    db_url: str, tmp_path: Path
):
    sync_db = SyncDatabaseResource(db_url=db_url)
    when = datetime(2026, 11, 30, 2, 5, tzinfo=UTC)
    with dg.instance_for_test() as instance:
        # Each context is closed in the test: the instance it opens from the reference, left
        # to the collector, would restore a later test's state store to this one's (deleted).
        with _schedule_context(instance, when, sync_db) as ctx:
            skipped = incremental_sync_schedule(ctx)
        assert isinstance(skipped, dg.SkipReason) and "full sync" in (skipped.skip_message or "")
        full_sync_of_every_city(instance, db_url, tmp_path)
        with _schedule_context(instance, when, sync_db) as ctx:
            request = incremental_sync_schedule(ctx)
        assert isinstance(request, dg.RunRequest)
        assert (
            request.run_key == request.tags[TRIGGER_TAG] == "incremental:2026-11-30T02:05:00+00:00"
        )
        assert request.tags[TASK_TAG] == "hotel_supplier_incremental"
        # A window still running: the next tick skips.
        _started_run(instance)
        with _schedule_context(instance, when, sync_db) as ctx:
            assert isinstance(incremental_sync_schedule(ctx), dg.SkipReason)


def _schedule_context(
    instance: dg.DagsterInstance, when: datetime, sync_db: SyncDatabaseResource
) -> dg.ScheduleEvaluationContext:
    return dg.build_schedule_context(
        instance=instance, scheduled_execution_time=when, resources={"sync_db": sync_db}
    )


def _started_run(instance: dg.DagsterInstance) -> None:
    """Records a STARTED run of the job, as the daemon would while a window runs."""
    create_run_for_test(
        instance, job_name=incremental_sync_job.name, status=dg.DagsterRunStatus.STARTED
    )


@pytest.mark.parametrize("status", [dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE])
def test_finished_windows_do_not_hold_the_schedule(db_url: str, tmp_path: Path, status: Any):
    sync_db = SyncDatabaseResource(db_url=db_url)
    with dg.instance_for_test() as instance:
        full_sync_of_every_city(instance, db_url, tmp_path)
        create_run_for_test(instance, job_name=incremental_sync_job.name, status=status)
        # Entered and left: a context left open keeps the instance it opened as the current
        # definitions state storage, which a later test then reads from a deleted folder.
        when = datetime(2026, 11, 30, 2, 10, tzinfo=UTC)
        with _schedule_context(instance, when, sync_db) as ctx:
            assert isinstance(incremental_sync_schedule(ctx), dg.RunRequest)
