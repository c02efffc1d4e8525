"""Three worker hosts sync one daemon backfill of 200 cities through the celery profile.

The backfill's runs go through RabbitMQ to whichever host takes them; shards are claimed
through the leases. The catalog must equal the simulator's ground truth, every city be
claimed once in the batch, every partition be materialized with its own metadata, and more
than one host must have worked (cities per host are printed).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.defs.partitions import decode_city_key
from supplier_sync_dagster_tests.multihost.conftest import Deployment, deployment

pytestmark = [pytest.mark.multihost, pytest.mark.mariadb, pytest.mark.redis]


@pytest.fixture
def three_host_deployment(
    mysql_databases: tuple[str, str],
    moto_s3: tuple[str, str],
    redis_url: str,
    amqp_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    with deployment(
        databases=mysql_databases,
        s3=moto_s3,
        redis_url=redis_url,
        amqp_url=amqp_url,
        root=tmp_path,
        monkeypatch=monkeypatch,
        settings={"SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN": "20"},
        seed=43,
        n_cities=200,
        total_hotels=2400,
        empty_city_share=0.0,
    ) as deployed:
        yield deployed


def shard_rows(db_url: str) -> list[sa.Row]:
    """Every shard of the sync database: key, status, claims, its last worker."""
    db = SyncDatabase.open(db_url)
    try:
        s = schema.shard.c
        with db.engine.connect() as conn:
            return list(
                conn.execute(sa.select(s.shard_key, s.status, s.claim_count, s.worker_id)).all()
            )
    finally:
        db.dispose()


def catalog(db_url: str) -> dict[str, int]:
    """The published catalog: supplier hotel id -> version."""
    db = SyncDatabase.open(db_url)
    try:
        h = schema.platform_hotel.c
        with db.engine.connect() as conn:
            return dict(conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version)).all())
    finally:
        db.dispose()


def host_of(worker_id: str | None, hosts: list[str]) -> str:
    """The host named in a worker id (``supplier-sync-<host>-<pid>-<start>``)."""
    for name in hosts:
        if worker_id and worker_id.startswith(f"supplier-sync-{name}-"):
            return name
    return f"unknown ({worker_id})"


def test_three_hosts_sync_one_backfill(three_host_deployment: Deployment):
    deployed = three_host_deployment
    names = ["host-a", "host-b", "host-c"]
    deployed.hosts(*names)
    backfill_id = deployed.dagster.launch_backfill(deployed.keys, title="three hosts")
    status, runs = deployed.dagster.wait_for_backfill(
        deployed.instance, backfill_id, timeout=170, poll=2
    )
    assert status in ("COMPLETED", "COMPLETED_SUCCESS"), (
        status,
        deployed.dagster.tail("daemon.log"),
    )
    assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs), [
        (r.run_id, r.status) for r in runs
    ]

    db_url = deployed.env["SUPPLIER_SYNC_DB_URL"]
    assert catalog(db_url) == dict(deployed.sim.ground_truth().valid)
    shards = shard_rows(db_url)
    assert sorted(row.shard_key for row in shards) == sorted(deployed.sim.city_codes())
    assert {(row.status, row.claim_count) for row in shards} == {("SUCCESS", 1)}

    per_host = Counter(host_of(row.worker_id, names) for row in shards)
    print(f"cities per host: {dict(sorted(per_host.items()))}")
    assert set(per_host) <= set(names)
    assert len(per_host) > 1, per_host

    view = deployed.dagster.partitions("published_hotels", deployed.keys)
    assert view.statuses["materialized"] == set(deployed.keys)
    # Each partition carries its own city's metadata, not one blob shared by a run's range.
    for key in deployed.keys:
        assert view.latest[key]["city"] == decode_city_key(key), view.latest[key]
