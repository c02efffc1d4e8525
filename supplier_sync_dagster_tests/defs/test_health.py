"""Sync health and alerts through Dagster: the sync_health asset's metadata and its per-city
freshness evaluations, the city_freshness check run alone, the alert sensor and the run
failure sensor (SQLite and MariaDB)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from supplier_sync_dagster.core.health.alerts import set_thresholds
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.tasks import change_task
from supplier_sync_dagster.defs.city_sync import city_sync
from supplier_sync_dagster.defs.health import (
    alert_on_run_failure,
    alert_sensor,
    sync_health_asset,
)
from supplier_sync_dagster_tests.defs.test_incremental_sync import (
    full_sync_of_every_city,
    simulated_resources,
)


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def _health(instance: dg.DagsterInstance, db_url: str, tmp_path: Path) -> dg.ExecuteInJobResult:
    resources = simulated_resources(db_url, tmp_path, 0)
    result = dg.materialize(
        [sync_health_asset],
        instance=instance,
        resources={k: resources[k] for k in ("sync_db", "supplier")},
    )
    assert result.success
    return result


def _freshness(result: dg.ExecuteInJobResult) -> dict[str, bool]:
    return {
        str(e.event_specific_data.partition): bool(e.event_specific_data.passed)
        for e in result.all_events
        if e.event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION
    }


def test_sync_health_plots_the_figures_and_judges_each_city(
    db_url: str, tmp_path: Path, instance: dg.DagsterInstance
):
    keys = full_sync_of_every_city(instance, db_url, tmp_path)
    first = _health(instance, db_url, tmp_path)
    (m,) = first.asset_materializations_for_node("sync_health")
    meta: dict[str, Any] = {k: v.value for k, v in m.metadata.items()}
    assert meta["batch_success_rate_24h"] == 1.0 and meta["latest_records"] == 500
    assert meta["cities_over_sla"] == 0 and meta["supplier_requests_24h"] > 0
    assert isinstance(meta["freshness_max_hours"], float)
    assert _freshness(first) == {k: True for k in keys}
    db = SyncDatabase.open(db_url)
    try:
        set_thresholds(
            db, "hotel_supplier_full_resource", {"freshness_sla_hours": 0}, actor="ops",
            reason="test",
        )  # fmt: skip
    finally:
        db.dispose()
    late = _health(instance, db_url, tmp_path)
    assert _freshness(late) == {k: False for k in keys}
    # Each materialization is a point on the UI's plots.
    assert len(instance.fetch_materializations(dg.AssetKey("sync_health"), limit=5).records) == 2


def test_the_alert_sensors_send_once_and_clear(
    db_url: str, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
):
    channel = tmp_path / "alerts.jsonl"
    monkeypatch.setenv("SUPPLIER_SYNC_ALERT_URL", f"file://{channel}")
    monkeypatch.setenv("SUPPLIER_SYNC_DAGSTER_URL", "http://dagster.example:3000")
    keys = full_sync_of_every_city(instance, db_url, tmp_path)
    resources = simulated_resources(db_url, tmp_path, 0)
    sensor_resources = {k: resources[k] for k in ("sync_db", "supplier")}

    def tick() -> str:
        with dg.build_sensor_context(instance=instance, resources=sensor_resources) as ctx:
            skipped = alert_sensor(ctx)
        assert isinstance(skipped, dg.SkipReason)
        return str(skipped.skip_message)

    assert tick().startswith("0 conditions hold")
    db = SyncDatabase.open(db_url)
    try:
        set_thresholds(
            db, "hotel_supplier_full_resource",
            {"freshness_sla_hours": 0, "consecutive_failed_batches": 1},
            actor="ops", reason="test",
        )  # fmt: skip
        assert "freshness_sla" in tick()
        tick()
        messages = [json.loads(line) for line in channel.read_text().splitlines()]
        assert [(m["alert"]["kind"], m["alert"]["condition"]) for m in messages] == [
            ("FIRING", "freshness_sla")
        ]
        assert "hotel_supplier_full_resource" in messages[0]["text"]

        # A run that fails: the run-failure sensor alerts at once, linking it.
        change_task(
            db, "hotel_supplier_full_resource", changed_by="ops", reason="maintenance",
            status="DISABLED",
        )  # fmt: skip
        failed = dg.materialize(
            [city_sync], instance=instance, resources=resources, partition_key=keys[0],
            raise_on_error=False,
        )  # fmt: skip
        assert not failed.success
        failure = next(
            e for e in failed.all_events if e.event_type == dg.DagsterEventType.RUN_FAILURE
        )
    finally:
        db.dispose()
    # The refused run made no batch: its failure is linked, but no batch failed.
    ctx = dg.build_run_status_sensor_context(
        sensor_name="alert_on_run_failure",
        dagster_instance=instance,
        dagster_run=failed.dagster_run,
        dagster_event=failure,
        resources=sensor_resources,
    ).for_run_failure()
    alert_on_run_failure(ctx)
    messages = [json.loads(line) for line in channel.read_text().splitlines()]
    assert len(messages) == 1  # still one: the freshness alert holds, nothing new started
