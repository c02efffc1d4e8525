"""The publish history's retention asset, its job and its daily schedule, through Dagster."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.defs.history_retention import (
    history_retention_job,
    history_retention_schedule,
    publish_history_retention,
)
from supplier_sync_dagster.defs.resources import SyncDatabaseResource
from supplier_sync_dagster_tests.core.records.test_catalog import hotel, sync
from supplier_sync_dagster_tests.defs.test_outbox_assets import state  # noqa: F401 (fixture)


def repriced(hid: str) -> dict[str, Any]:
    """The hotel's next version with a new price (published without review)."""
    doc = hotel(hid, 2)
    doc["rooms"][0]["rate_plans"][0]["price"] = "150.00"
    return doc


def materialize(db_url: str, **config: Any) -> dict[str, Any]:
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [publish_history_retention],
            instance=instance,
            resources={"sync_db": SyncDatabaseResource(db_url=db_url)},
            run_config={"ops": {"publish_history_retention": {"config": config}}},
        )
        assert result.success
        (mat,) = result.asset_materializations_for_node("publish_history_retention")
        return {k: v.value for k, v in mat.metadata.items()}


@pytest.mark.usefixtures("state")
def test_the_daily_job_prunes_superseded_versions_and_keeps_the_window(
    db_url: str, monkeypatch: pytest.MonkeyPatch
):
    db = SyncDatabase.open(db_url)
    ids = [f"H{i}" for i in range(6)]
    sync(db, "b1", [hotel(h) for h in ids])
    sync(db, "b2", [repriced(h) for h in ids[:4]])
    v, d = schema.hotel_version.c, schema.published_document.c
    # Nothing is older than the window yet: nothing goes.
    assert materialize(db_url)["versions_pruned"] == 0
    # Ten days later (every row moved back): the 4 replaced first versions go, the current stay.
    with db.begin() as conn:
        for table, column in (
            (schema.hotel_version, v.published_at),
            (schema.published_document, d.last_used_at),
        ):
            for row_id, at in conn.execute(sa.select(table.c.id, column)).all():
                conn.execute(
                    sa.update(table)
                    .where(table.c.id == row_id)
                    .values({column.name: at - timedelta(days=10)})
                )
    monkeypatch.setenv("SUPPLIER_SYNC_HISTORY_RETENTION_DAYS", "5")
    meta = materialize(db_url)
    assert (meta["retention_days"], meta["versions_pruned"], meta["documents_pruned"]) == (5, 4, 4)
    with db.engine.connect() as conn:
        kept = dict(conn.execute(sa.select(v.supplier_hotel_id, v.publish_version)).all())
    assert kept == {h: (2 if h in ids[:4] else 1) for h in ids}
    # The launchpad's value wins over the setting; a second pass finds nothing more.
    assert materialize(db_url, retention_days=1)["versions_pruned"] == 0
    db.dispose()


@pytest.mark.usefixtures("state")
def test_a_mistyped_retention_is_refused_before_anything_is_pruned(db_url: str):
    with (
        dg.instance_for_test() as instance,
        pytest.raises(dg.DagsterInvalidConfigError, match="retention_days"),
    ):
        dg.materialize(
            [publish_history_retention],
            instance=instance,
            resources={"sync_db": SyncDatabaseResource(db_url=db_url)},
            run_config={
                "ops": {"publish_history_retention": {"config": {"retention_days": "a year"}}}
            },
        )


def test_the_schedule_runs_the_job_daily():
    assert history_retention_schedule.cron_schedule == "45 3 * * *"
    assert history_retention_schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    assert history_retention_schedule.job_name == history_retention_job.name
    with (
        dg.instance_for_test() as instance,
        dg.build_schedule_context(instance=instance) as context,
    ):
        data = history_retention_schedule.evaluate_tick(context)
    assert data.run_requests is not None and len(data.run_requests) == 1
