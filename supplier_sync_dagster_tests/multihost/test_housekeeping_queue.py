"""Housekeeping runs on a host of their own: a backfill's city runs go to the hosts that take
the sync queue, an outbox dispatch run (a housekeeping job) to the host that takes only the
housekeeping queue (``housekeeping_queue`` of the profile's launcher), so it neither waits
behind a backfill nor spends a sync host's run start."""

from __future__ import annotations

import time

import dagster as dg
import pytest
from dagster_celery.tags import DAGSTER_CELERY_QUEUE_TAG, DAGSTER_CELERY_TASK_ID_TAG

from supplier_sync_dagster_tests.multihost.deploy import (
    Services,
    catalog,
    deployment,
    host_of,
    shard_rows,
)

pytestmark = [pytest.mark.multihost, pytest.mark.mariadb, pytest.mark.redis]

SYNC_HOST, CHORES_HOST = "sync-host", "chores-host"


def _finished_run(instance: dg.DagsterInstance, run_id: str, timeout: float) -> dg.DagsterRun:
    deadline = time.monotonic() + timeout
    while True:
        run = instance.get_run_by_id(run_id)
        if run is not None and run.is_finished:
            return run
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} not finished: {run and run.status}")
        time.sleep(1)


def test_housekeeping_runs_go_to_the_housekeeping_host_and_city_runs_to_the_sync_host(
    services: Services,
):
    with deployment(
        services,
        settings={"SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN": "10"},
        hosts=(SYNC_HOST, CHORES_HOST),
        queues={SYNC_HOST: ["sync"], CHORES_HOST: ["housekeeping"]},
        n_cities=30,
        total_hotels=300,
        empty_city_share=0.0,
        seed=44,
    ) as deployed:
        backfill_id = deployed.dagster.launch_backfill(deployed.keys, title="sync queue")
        dispatch_id = deployed.dagster.launch_job("outbox_dispatch_job")
        status, runs = deployed.dagster.wait_for_backfill(
            deployed.instance, backfill_id, timeout=170, poll=2
        )
        assert status in ("COMPLETED", "COMPLETED_SUCCESS"), deployed.dagster.tail("daemon.log")
        dispatch = _finished_run(deployed.instance, dispatch_id, timeout=120)
        sync_host, chores_host = deployed.workers
        assert dispatch.status == dg.DagsterRunStatus.SUCCESS, chores_host.tail()
        queue = deployed.env["SUPPLIER_SYNC_CELERY_HOUSEKEEPING_QUEUE"]
        assert dispatch.tags[DAGSTER_CELERY_QUEUE_TAG] == queue

        # Each run's Celery task was received by the host of its queue only.
        received = {w.name: w.log.read_text(errors="replace") for w in deployed.workers}
        task = dispatch.tags[DAGSTER_CELERY_TASK_ID_TAG]
        assert task in received[CHORES_HOST] and task not in received[SYNC_HOST]
        assert runs and all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
        for run in runs:
            city_task = run.tags[DAGSTER_CELERY_TASK_ID_TAG]
            assert city_task in received[SYNC_HOST] and city_task not in received[CHORES_HOST]
            assert DAGSTER_CELERY_QUEUE_TAG not in run.tags

        db_url = deployed.env["SUPPLIER_SYNC_DB_URL"]
        assert catalog(db_url) == dict(deployed.sim.ground_truth().valid)
        hosts = {host_of(row.worker_id, (SYNC_HOST, CHORES_HOST)) for row in shard_rows(db_url)}
        assert hosts == {SYNC_HOST}, (hosts, sync_host.tail())
