"""A run through Dagster never changes its task; a DISABLED task refuses runs with its reason."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import get_task
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.tasks import change_task, task_audit
from supplier_sync_dagster.defs.city_sync import city_sync
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SimulatedSupplierResource,
    SupplierResource,
    SyncDatabaseResource,
)


def _step_failure(result: dg.ExecuteInJobResult) -> str:
    failures = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert len(failures) == 1, failures
    data = failures[0].step_failure_data
    assert data.user_failure_data is not None, data
    return str(data.user_failure_data.description)


def test_runs_keep_the_task_settings_and_a_disabled_task_refuses_them(db_url: str, tmp_path: Path):
    supplier = SimulatedSupplierResource(
        sim_cities=3, sim_hotels=150, sim_profile="clean", rate_limit_rps=10_000
    )
    with supplier.client() as client:
        keys = [encode_city_key(c.city_code) for c in client.list_cities().data.cities]
    # Entered, so that it is the current instance of this test whatever earlier tests left
    # behind (a schedule context built without `with` leaves a dead one current).
    with dg.DagsterInstance.ephemeral(tempdir=str(tmp_path / "dagster")) as instance:
        _run_and_check(instance, keys, db_url, tmp_path, supplier)


def _run_and_check(
    instance: dg.DagsterInstance,
    keys: list[str],
    db_url: str,
    tmp_path: Path,
    supplier: SupplierResource,
) -> None:
    instance.add_dynamic_partitions("supplier_city", keys)
    resources = {
        "sync_db": SyncDatabaseResource(db_url=db_url),
        "payloads": PayloadStoreResource(url=f"file://{tmp_path}/payloads"),
        "supplier": supplier,
        "governance": GovernanceResource(),
    }
    db = SyncDatabase.open(db_url)
    code = supplier.task_code

    def run(key: str) -> dg.ExecuteInJobResult:
        return dg.materialize(
            [city_sync],
            instance=instance,
            resources=resources,
            partition_key=key,
            raise_on_error=False,
        )

    try:
        assert run(keys[0]).success  # the first run creates the task, with the defaults
        change_task(
            db, code, changed_by="alice", reason="nightly overlaps", policy="CANCEL_PREVIOUS"
        )
        assert run(keys[1]).success
        with db.engine.connect() as conn:
            task = get_task(conn, code)
            assert (task.concurrency_policy, task.status) == ("CANCEL_PREVIOUS", "ENABLED")
            assert [a.field_name for a in task_audit(conn, code)] == ["concurrency_policy", "task"]

        change_task(db, code, changed_by="alice", reason="supplier outage INC-7", status="DISABLED")
        refused = run(keys[2])
        assert not refused.success
        description = _step_failure(refused)
        assert description.startswith("sync refused: task ")
        assert "is DISABLED by alice" in description and "supplier outage INC-7" in description
        assert "\n" not in description
        with db.engine.connect() as conn:
            task = get_task(conn, code)
            assert (task.concurrency_policy, task.status) == ("CANCEL_PREVIOUS", "DISABLED")
            assert len(task_audit(conn, code)) == 3
            batches = conn.execute(
                sa.select(sa.func.count()).select_from(schema.batch)
            ).scalar_one()
        assert batches == 2  # the refused run made none
    finally:
        db.dispose()
