"""A city-sync run that is told to stop without a signal reaching its process: its Dagster
run marked CANCELING (terminated from a UI whose launcher cannot signal it), or its batch
cancelled by a CANCEL_PREVIOUS trigger. Its step polls both and stops within seconds while
every page trickles a byte a second."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import create_batch
from supplier_sync_dagster.core.records.deadletters import CITY_FAILED
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.tasks import change_task
from supplier_sync_dagster.defs.city_sync import city_sync
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    HttpSupplierResource,
    PayloadStoreResource,
    SyncDatabaseResource,
)
from supplier_sync_dagster.simulator import running_server
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, make_simulator

TASK = "hotel_supplier_full_resource"
STOPS_WITHIN = 10.0


def _statuses(db_url: str) -> dict[str, str]:
    s = schema.shard.c
    db = SyncDatabase.open(db_url)
    try:
        with db.engine.connect() as conn:
            return {r.shard_key: r.status for r in conn.execute(sa.select(s.shard_key, s.status))}
    finally:
        db.dispose()


def _tickets(db_url: str) -> list[Any]:
    d = schema.dead_letter.c
    db = SyncDatabase.open(db_url)
    try:
        with db.engine.connect() as conn:
            return list(conn.execute(sa.select(d.city_code).where(d.error_code == CITY_FAILED)))
    finally:
        db.dispose()


def _stop_a_trickling_run(
    db_url: str, tmp_path: Path, stop_it: Callable[[dg.DagsterInstance, SyncDatabase], None]
) -> tuple[Any, float]:
    """A range run over 3 trickling cities, in a thread; ``stop_it`` once a city is in
    flight. The run's result, and how long it took to end after ``stop_it``."""
    sim = make_simulator(seed=61, n_cities=3, total_hotels=300, empty_city_share=0)
    keys = [encode_city_key(c) for c in sim.city_codes()]
    sim.set_modes(["slow_body"], sim.city_codes())
    instance = dg.DagsterInstance.ephemeral(tempdir=str(tmp_path / "dagster"))
    instance.add_dynamic_partitions("supplier_city", keys)
    results: list[Any] = []
    db = SyncDatabase.open(db_url)
    with running_server(sim) as url:

        def materialize() -> None:
            results.append(
                dg.materialize(
                    [city_sync],
                    instance=instance,
                    resources={
                        "sync_db": SyncDatabaseResource(db_url=db_url),
                        "payloads": PayloadStoreResource(url=f"file://{tmp_path}/payloads"),
                        "supplier": HttpSupplierResource(base_url=url, api_key=SIM_API_KEY),
                        "governance": GovernanceResource(),
                    },
                    tags={
                        "dagster/asset_partition_range_start": keys[0],
                        "dagster/asset_partition_range_end": keys[-1],
                    },
                    raise_on_error=False,
                )
            )

        runner = threading.Thread(target=materialize, daemon=True)
        runner.start()
        try:
            deadline = time.monotonic() + 120
            while "RUNNING" not in _statuses(db_url).values():
                assert runner.is_alive() and time.monotonic() < deadline, results
                time.sleep(0.1)
            time.sleep(0.5)  # its first page trickles
            stop_it(instance, db)
            sent = time.monotonic()
            runner.join(60)
            took = time.monotonic() - sent
        finally:
            db.dispose()
    assert not runner.is_alive(), "the run did not stop"
    return results[0], took


def test_a_run_terminated_without_a_signal_stops_and_releases_its_cities(
    db_url: str, tmp_path: Path
):
    def terminate(instance: dg.DagsterInstance, db: SyncDatabase) -> None:
        (run,) = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
        instance.report_run_canceling(run, "terminated from the UI")

    result, took = _stop_a_trickling_run(db_url, tmp_path, terminate)
    assert took < STOPS_WITHIN, took
    assert not result.success
    (failure,) = result.get_step_failure_events()
    error = failure.step_failure_data.error
    assert error is not None and error.cls_name == "DagsterExecutionInterruptedError"
    # Resumable: the city in flight went back to PENDING with its checkpoint.
    assert set(_statuses(db_url).values()) == {"PENDING"}
    assert _tickets(db_url) == []


def test_a_run_whose_batch_is_cancelled_fails_its_step_saying_who_cancelled_it(
    db_url: str, tmp_path: Path
):
    def cancel_previous(instance: dg.DagsterInstance, db: SyncDatabase) -> None:
        change_task(db, TASK, changed_by="ann", reason="supersede", policy="CANCEL_PREVIOUS")
        decision = create_batch(db, task_code=TASK, trigger_id="night-2", trigger_source="CRON")
        assert decision.cancelled_batch_ids

    result, took = _stop_a_trickling_run(db_url, tmp_path, cancel_previous)
    assert took < STOPS_WITHIN, took
    assert not result.success
    (failure,) = result.get_step_failure_events()
    data = failure.step_failure_data.user_failure_data
    assert data is not None
    assert data.description == "run cancelled: cancelled by trigger night-2 (CANCEL_PREVIOUS)"
    assert set(_statuses(db_url).values()) == {"CANCELLED"}
    assert _tickets(db_url) == []
