"""A worker host lost mid-backfill: killed (SIGKILL of its tree), or frozen (SIGSTOP past
its leases, then SIGCONT).

Killed: run monitoring finds that the host no longer answers, fails its run, and the
deployment's ``run_retries`` launch it again; the hosts left take its cities over once
their leases expire. The backfill completes, the catalog equals the ground truth, no hotel
is published twice, and each city fetched at most one page twice.

Frozen: the same takeover happens while it sleeps; when it wakes, its next write is fenced
(LEASE_LOST), its run stops, and the catalog is what it was before it woke.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa
from celery.result import AsyncResult
from dagster_celery.tags import DAGSTER_CELERY_TASK_ID_TAG

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster_tests.multihost.deploy import (
    Deployment,
    Services,
    catalog,
    deployment,
    query,
    shard_rows,
)
from supplier_sync_dagster_tests.multihost.hosts import WorkerHost

pytestmark = [pytest.mark.multihost, pytest.mark.mariadb, pytest.mark.redis]

# Cities of three pages, paced by a shared budget so that a host is lost mid-city.
LOST_HOST: dict[str, Any] = {
    "n_cities": 24,
    "total_hotels": 7200,
    "empty_city_share": 0.0,
    "seed": 7,
}
HOSTS = ("host-a", "host-b", "host-c")
SETTINGS = {
    "SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN": "6",
    "SUPPLIER_SYNC_LEASE_SECONDS": "8",
    "SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT": "6",
}


def wait_for(what: str, condition: Callable[[], bool], timeout: float) -> None:
    """Polls ``condition`` every half second until it holds.

    Raises:
        TimeoutError: It did not hold within ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.5)


def holding(db_url: str, host: WorkerHost) -> list[str]:
    """The cities whose lease ``host`` holds now."""
    return [
        row.shard_key
        for row in shard_rows(db_url)
        if row.status == "RUNNING"
        and (row.worker_id or "").startswith(f"supplier-sync-{host.name}-")
    ]


def outbox_per_hotel(db_url: str) -> dict[tuple[int, int], int]:
    """(hotel, version) -> its outbox events of each type together."""
    o = schema.outbox.c
    rows = query(
        db_url,
        sa.select(o.aggregate_id, o.aggregate_version, o.event_type, sa.func.count()).group_by(
            o.aggregate_id, o.aggregate_version, o.event_type
        ),
    )
    return {(r[0], r[1], r[2]): r[3] for r in rows}  # type: ignore[misc]


def launch_and_lose(
    deployed: Deployment, lose: Callable[[WorkerHost], None]
) -> tuple[WorkerHost, list[str], str]:
    """Three hosts, a backfill, and ``lose`` applied to the first host that holds a city."""
    hosts = deployed.workers
    backfill_id = deployed.dagster.launch_backfill(deployed.keys, title="a host lost")
    db_url = deployed.env["SUPPLIER_SYNC_DB_URL"]
    victim: list[tuple[WorkerHost, list[str]]] = []

    def someone_holds() -> bool:
        for host in hosts:
            cities = holding(db_url, host)
            if cities:
                victim.append((host, cities))
                return True
        return False

    wait_for("a host holding a city", someone_holds, timeout=120)
    host, cities = victim[0]
    lose(host)
    return host, cities, backfill_id


def check_completed(
    deployed: Deployment, backfill_id: str, lost: WorkerHost
) -> list[dg.DagsterRun]:
    """The backfill completes by itself; its catalog is the ground truth, nothing doubled."""
    status, runs = deployed.dagster.wait_for_backfill(
        deployed.instance, backfill_id, timeout=150, poll=2
    )
    assert status in ("COMPLETED", "COMPLETED_SUCCESS"), (
        status,
        deployed.dagster.tail("daemon.log"),
    )
    failed = [r for r in runs if r.status == dg.DagsterRunStatus.FAILURE]
    # The lost host's run failed, and was retried (a new run) by the deployment's policy.
    assert failed, [(r.run_id, r.status) for r in runs]
    retried = {
        r.tags.get("dagster/parent_run_id") for r in runs if r.tags.get("dagster/retry_number")
    }
    assert {r.run_id for r in failed} <= retried, (failed, retried)
    db_url = deployed.env["SUPPLIER_SYNC_DB_URL"]
    assert catalog(db_url) == dict(deployed.sim.ground_truth().valid)
    assert {row.status for row in shard_rows(db_url)} == {"SUCCESS"}
    # Each hotel version was published once: one event of each type, never two.
    assert set(outbox_per_hotel(db_url).values()) == {1}
    # Every page was counted (three or more per city), so "no page twice" is not vacuous.
    assert sum(deployed.counter.pages.values()) >= 3 * len(deployed.keys)
    refetched = deployed.counter.refetched()
    print(f"lost {lost.name}; pages fetched twice per city: {dict(refetched)}")
    assert all(extra <= 1 for extra in refetched.values()), refetched
    return runs


def test_a_killed_host_is_failed_retried_and_taken_over(services: Services):
    with deployment(services, settings=SETTINGS, hosts=HOSTS, **LOST_HOST) as deployed:
        killed, cities, backfill_id = launch_and_lose(deployed, WorkerHost.kill)
        check_completed(deployed, backfill_id, killed)
        # Its cities were claimed again by another host.
        claims = {row.shard_key: row for row in shard_rows(deployed.env["SUPPLIER_SYNC_DB_URL"])}
        for city in cities:
            assert claims[city].claim_count >= 2, claims[city]
            assert not claims[city].worker_id.startswith(f"supplier-sync-{killed.name}-")


def events_text(instance: dg.DagsterInstance, run_id: str) -> str:
    """Everything a run's event log says, as text."""
    return "\n".join(str(record) for record in instance.all_logs(run_id))


def test_a_frozen_host_is_taken_over_and_fenced_when_it_wakes(services: Services):
    with deployment(services, settings=SETTINGS, hosts=HOSTS, **LOST_HOST) as deployed:
        frozen, cities, backfill_id = launch_and_lose(deployed, WorkerHost.freeze)
        db_url = deployed.env["SUPPLIER_SYNC_DB_URL"]
        runs = check_completed(deployed, backfill_id, frozen)
        shards = {row.shard_key: row for row in shard_rows(db_url)}
        for city in cities:  # taken over while it slept
            assert shards[city].claim_count >= 2, shards[city]
            assert not shards[city].worker_id.startswith(f"supplier-sync-{frozen.name}-")
        before = (catalog(db_url), outbox_per_hotel(db_url), shard_rows(db_url))

        instance = deployed.instance
        launcher = instance.run_launcher

        def task(run: dg.DagsterRun) -> AsyncResult:
            return launcher.celery.AsyncResult(run.tags[DAGSTER_CELERY_TASK_ID_TAG])  # type: ignore[attr-defined]

        # Its run: failed by run monitoring, its task still STARTED on the frozen host.
        (its_run,) = [
            r
            for r in runs
            if r.status == dg.DagsterRunStatus.FAILURE
            and isinstance(task(r).info, dict)
            and task(r).info.get("hostname") == frozen.node
        ]
        frozen.thaw()
        # Awake, it tries to go on: every write is refused (LEASE_LOST) and its run stops.
        wait_for("the woken run to stop", lambda: task(its_run).ready(), timeout=90)
        wait_for(
            "LEASE_LOST in the woken run's log",
            lambda: "LEASE_LOST" in events_text(instance, its_run.run_id),
            timeout=30,
        )
        assert (catalog(db_url), outbox_per_hotel(db_url), shard_rows(db_url)) == before
