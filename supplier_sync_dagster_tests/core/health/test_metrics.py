"""Sync health's request-budget figures: the seconds waited for the rate limiter, 429s per
minute of syncing and the rate an adaptive limiter had learnt, from the runs' stats rows."""

from __future__ import annotations

import pytest

from supplier_sync_dagster.core.health.metrics import sync_health
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.model import CityReport
from supplier_sync_dagster.core.sync.run import CityOutcome, SupplierUse, record_run_stats

TASK = "governed_task"


def outcome(city: str, *, seconds: float, throttled: int, waited: float) -> CityOutcome:
    return CityOutcome(
        CityReport(city),
        seconds=seconds,
        supplier=SupplierUse(requests=100, throttled=throttled, waited=waited),
    )


def test_the_request_budget_figures_come_from_the_runs(db: SyncDatabase) -> None:
    fixed = sync_health(db, task_code=TASK).values()
    assert fixed["supplier_governed_rate"] == -1.0  # no run: nothing learnt
    assert fixed["supplier_429_per_minute_24h"] == 0.0
    record_run_stats(
        db,
        batch_id="b1",
        task_code=TASK,
        worker_id="w1",
        outcomes=[outcome("BKK", seconds=60, throttled=3, waited=12.5)],
        rate=None,  # a fixed rate
    )
    record_run_stats(
        db,
        batch_id="b2",
        task_code=TASK,
        worker_id="w2",
        outcomes=[
            outcome("TYO", seconds=30, throttled=1, waited=2.0),
            outcome("PAR", seconds=30, throttled=2, waited=0.5),
        ],
        rate=57.25,
    )
    record_run_stats(
        db, batch_id="b3", task_code="another_task", worker_id="w3", outcomes=[], rate=99.0
    )
    values = sync_health(db, task_code=TASK).values()
    assert values["supplier_governed_rate"] == pytest.approx(57.25)
    assert values["supplier_429_per_minute_24h"] == pytest.approx(6 / 2)  # 6 in two minutes
    assert values["supplier_limiter_wait_seconds_24h"] == pytest.approx(15.0)
    assert values["supplier_429_24h"] == 6.0
