"""The MySQL profile for real: dagster-webserver and `supplier-sync daemon` on a MySQL instance.

A backfill of every city is launched through the webserver's GraphQL API; the daemon
queues and launches its runs (grouped by the backfill policy), each run worker syncs its
cities into the MySQL sync database, fetching from the simulator over HTTP through a
shared Redis rate-limit bucket. The end state must equal the simulator's ground truth,
and no city may have been processed by two runs.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.dagster_instance.deployment import (
    ROOT,
    DagsterProcesses,
    migrate_instance,
    profile_env,
)
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.simulator import Simulator
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, mysql_database_pair, serve_simulator


@pytest.fixture
def mysql_databases(mysql_server_url: str) -> Iterator[tuple[str, str]]:
    """Two new databases: the Dagster instance's and the sync database."""
    with mysql_database_pair(mysql_server_url) as urls:
        yield urls


@pytest.fixture
def simulator() -> Iterator[tuple[Simulator, str]]:
    with serve_simulator(seed=91, n_cities=60, total_hotels=1800, empty_city_share=0.0) as served:
        yield served


def test_backfill_through_graphql_on_a_mysql_instance_matches_ground_truth(
    mysql_databases: tuple[str, str],
    redis_url: str,
    simulator: tuple[Simulator, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    dagster_url, sync_url = mysql_databases
    sim, sim_url = simulator
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "deploy" / "mysql" / "dagster.yaml", home / "dagster.yaml")
    env = profile_env(
        dagster_home=home,
        extra={
            "DAGSTER_MYSQL_URL": dagster_url,
            "SUPPLIER_SYNC_DB_URL": sync_url,
            "SUPPLIER_SYNC_SUPPLIER_URL": sim_url,
            "SUPPLIER_SYNC_SUPPLIER_API_KEY": SIM_API_KEY,
            "SUPPLIER_SYNC_PAYLOAD_URL": f"file://{tmp_path / 'payloads'}",
            "SUPPLIER_SYNC_REDIS_URL": redis_url,
            # 60 cities in runs of 25: several runs continue one batch.
            "SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN": "25",
        },
    )
    for name in ("DAGSTER_HOME", "DAGSTER_MYSQL_URL"):
        monkeypatch.setenv(name, env[name])
    migrate_instance(env)

    truth = sim.ground_truth()
    codes = sim.city_codes()
    keys = [encode_city_key(c) for c in codes]
    with DagsterProcesses(env, tmp_path / "logs") as dagster:
        instance = dg.DagsterInstance.get()
        instance.add_dynamic_partitions("supplier_city", keys)
        backfill_id = dagster.launch_backfill(keys, title="integration: every city")
        status, _ = dagster.wait_for_backfill(instance, backfill_id, timeout=420, poll=2)
        assert status in ("COMPLETED", "COMPLETED_SUCCESS"), (status, dagster.tail("daemon.log"))
        runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
        assert len(runs) == 3  # the backfill policy grouped the cities into runs of 25
        assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs), [
            (r.run_id, r.status) for r in runs
        ]
        # The runs' city ranges are disjoint and cover every city.
        covered: list[str] = []
        ordered = instance.get_dynamic_partitions("supplier_city")
        for run in runs:
            part = run.tags.get("dagster/partition")
            if part:
                covered.append(part)
            else:
                start = run.tags["dagster/asset_partition_range_start"]
                end = run.tags["dagster/asset_partition_range_end"]
                covered += ordered[ordered.index(start) : ordered.index(end) + 1]
            assert "cities" in run.tags.get("supplier_sync/progress", "")
        assert sorted(covered) == sorted(keys)

    db = SyncDatabase.open(sync_url)
    try:
        h, s, b = schema.platform_hotel.c, schema.shard.c, schema.batch.c
        with db.engine.connect() as conn:
            published = dict(conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version)).all())
            batches = conn.execute(sa.select(b.batch_id, b.status, b.trigger_id)).all()
            shards = conn.execute(sa.select(s.shard_key, s.status, s.claim_count, s.batch_id)).all()
        assert published == dict(truth.valid)
        assert [(x.status, x.trigger_id) for x in batches] == [("SUCCESS", backfill_id)]
        assert sorted(x.shard_key for x in shards) == sorted(codes)
        # Each city was claimed once: one run, one worker, never two at a time.
        assert {(x.status, x.claim_count) for x in shards} == {("SUCCESS", 1)}
    finally:
        db.dispose()
