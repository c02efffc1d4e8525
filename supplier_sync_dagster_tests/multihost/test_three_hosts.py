"""Three worker hosts sync one daemon backfill of 200 cities through the celery profile.

The backfill's runs go through RabbitMQ to whichever host takes them; shards are claimed
through the leases. The catalog must equal the simulator's ground truth, every city be
claimed once in the batch, every partition be materialized with its own metadata, and more
than one host must have worked (cities per host are printed). Each run syncs its cities in
two worker processes of its own, as large runs do by default. With ``netns``, each host is
in a network namespace of its own and reaches the services, the simulator and S3 only
through its forwarders (no host relies on loopback).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import dagster as dg
import pytest

from supplier_sync_dagster.defs.partitions import decode_city_key
from supplier_sync_dagster_tests.multihost.deploy import (
    Services,
    catalog,
    deployment,
    host_of,
    shard_rows,
)

pytestmark = [pytest.mark.multihost, pytest.mark.mariadb, pytest.mark.redis]


def failures(instance: dg.DagsterInstance, runs: list[dg.DagsterRun]) -> list[str]:
    """Each run that did not succeed: its id, status and its failed steps' errors."""
    found = []
    for run in runs:
        if run.status == dg.DagsterRunStatus.SUCCESS:
            continue
        errors = [
            entry.dagster_event.step_failure_data.error.to_string()
            for entry in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE)
            if entry.dagster_event is not None
            and entry.dagster_event.step_failure_data.error is not None
        ]
        found.append(f"{run.run_id} {run.status}: {errors}")
    return found


NAMES = ("host-a", "host-b", "host-c")
THREE_HOSTS: dict[str, Any] = {
    "n_cities": 200,
    "total_hotels": 2400,
    "empty_city_share": 0.0,
    "seed": 43,
}


@pytest.mark.parametrize("namespaces", [False, True], ids=["loopback", "netns"])
def test_three_hosts_sync_one_backfill(services: Services, namespaces: bool):
    with deployment(
        services,
        settings={
            "SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN": "67",
            "SUPPLIER_SYNC_WORKER_PROCESSES": "2",
        },
        hosts=NAMES,
        namespaces=namespaces,
        **THREE_HOSTS,
    ) as deployed:
        started = time.monotonic()
        backfill_id = deployed.dagster.launch_backfill(deployed.keys, title="three hosts")
        status, runs = deployed.dagster.wait_for_backfill(
            deployed.instance, backfill_id, timeout=170, poll=2
        )
        assert status in ("COMPLETED", "COMPLETED_SUCCESS"), (
            status,
            deployed.dagster.tail("daemon.log"),
        )
        failed = failures(deployed.instance, runs)
        if failed:  # whole, as pytest shortens an assertion's message
            print("\n\n".join(failed))
        assert not failed, failed

        db_url = deployed.env["SUPPLIER_SYNC_DB_URL"]
        assert catalog(db_url) == dict(deployed.sim.ground_truth().valid)
        shards = shard_rows(db_url)
        assert sorted(row.shard_key for row in shards) == sorted(deployed.sim.city_codes())
        assert {(row.status, row.claim_count) for row in shards} == {("SUCCESS", 1)}

        per_host = Counter(host_of(row.worker_id, NAMES) for row in shards)
        wall = time.monotonic() - started
        print(f"cities per host: {dict(sorted(per_host.items()))}; backfill {wall:.0f} s")
        assert set(per_host) <= set(NAMES)
        assert len(per_host) > 1, per_host

        view = deployed.dagster.partitions("published_hotels", deployed.keys)
        assert view.statuses["materialized"] == set(deployed.keys)
        # Each partition carries its own city's metadata, not one blob shared by a run's range.
        for key in deployed.keys:
            assert view.latest[key]["city"] == decode_city_key(key), view.latest[key]
