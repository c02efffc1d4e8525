"""The search projection asset, its job and its schedule, through Dagster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from supplier_sync_dagster.core.outbox.machine import outbox_status
from supplier_sync_dagster.core.outbox.projections import SearchQuery, SqliteSearchIndex
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.defs.outbox import (
    ProjectionsResource,
    hotel_search_projection,
    hotel_search_reconciliation,
    outbox_dispatch_job,
    outbox_dispatch_schedule,
)
from supplier_sync_dagster.defs.resources import SyncDatabaseResource
from supplier_sync_dagster_tests.core.records.test_catalog import hotel, sync


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


def test_materializing_the_projection_drains_the_outbox_and_reports_it(db_url: str, state: Path):
    db = SyncDatabase.open(db_url)
    sync(db, "b1", [hotel(f"H{i}", name=f"Ryokan {i}") for i in range(12)])
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [hotel_search_projection],
            instance=instance,
            resources={
                "sync_db": SyncDatabaseResource(db_url=db_url),
                "projections": ProjectionsResource(),
            },
        )
        assert result.success
        (mat,) = result.asset_materializations_for_node("hotel_search_projection")
        meta: dict[str, Any] = {k: v.value for k, v in mat.metadata.items()}
        assert meta["search_index_done"] == 12
        assert meta["cache_done"] == 12
        assert meta["notify_done"] == 36
        assert meta["ready_left"] == 0 and meta["failed_total"] == 0
        assert meta["projection_lag_p95_s"] >= 0
        # The UI plots these over time: they are numbers on the instance's record.
        record = instance.fetch_materializations(
            dg.AssetKey("hotel_search_projection"), limit=1
        ).records[0]
        assert record.asset_materialization is not None
        assert record.asset_materialization.metadata["notify_done"].value == 36
    assert outbox_status(db).total("SUCCEEDED") == 36
    index = SqliteSearchIndex(state / "search.sqlite3")
    assert len(index.search(SearchQuery(text="ryokan", limit=50))) == 12
    index.close()
    lines = (state / "notifications.jsonl").read_text().splitlines()
    assert len({json.loads(line)["message_id"] for line in lines}) == 36
    db.dispose()


def test_the_reconciliation_asset_repairs_and_reports_a_table(db_url: str, state: Path):
    db = SyncDatabase.open(db_url)
    sync(db, "b1", [hotel(f"R{i}") for i in range(5)])  # published, never dispatched
    resources = {
        "sync_db": SyncDatabaseResource(db_url=db_url),
        "projections": ProjectionsResource(),
    }
    with dg.instance_for_test() as instance:
        first = dg.materialize(
            [hotel_search_reconciliation], instance=instance, resources=resources
        )
        assert first.success
        (mat,) = first.asset_materializations_for_node("hotel_search_reconciliation")
        assert mat.metadata["cities_differing"].value == 1
        assert mat.metadata["hotels_repaired"].value == 5
        table = mat.metadata["differences"].value
        assert isinstance(table, dg.TableMetadataValue)
        assert [r.data["missing"] for r in table.records] == [5]
        second = dg.materialize(
            [hotel_search_reconciliation], instance=instance, resources=resources
        )
        (mat,) = second.asset_materializations_for_node("hotel_search_reconciliation")
        assert mat.metadata["cities_differing"].value == 0
    db.dispose()


def test_the_schedule_requests_the_drain_job_every_minute():
    assert outbox_dispatch_schedule.cron_schedule == "* * * * *"
    assert outbox_dispatch_schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    assert outbox_dispatch_schedule.job_name == outbox_dispatch_job.name
    with (
        dg.instance_for_test() as instance,
        dg.build_schedule_context(instance=instance) as context,
    ):
        data = outbox_dispatch_schedule.evaluate_tick(context)
    assert data.run_requests is not None and len(data.run_requests) == 1
