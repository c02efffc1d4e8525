"""The MySQL profile for real: dagster-webserver and `supplier-sync daemon` on a MySQL instance.

A backfill of every city is launched through the webserver's GraphQL API; the daemon
queues and launches its runs (grouped by the backfill policy), each run worker syncs its
cities into the MySQL sync database, fetching from the simulator over HTTP through a
shared Redis rate-limit bucket. The end state must equal the simulator's ground truth,
and no city may have been processed by two runs. Each city's partition shows its five
materializations and each gate's result on the materialization of ``normalized_hotels`` it
judged (the pooled MySQL event log inserts a city's events together).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.event_api import PartitionKeyFilter

from supplier_sync_dagster.core.records.gates import CHECK_NAMES
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.dagster_instance.deployment import (
    ROOT,
    DagsterProcesses,
    migrate_instance,
    profile_env,
)
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE
from supplier_sync_dagster.defs.city_keys import NORMALIZED, STAGE_ASSETS
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.simulator import Simulator
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, mysql_database_pair, serve_simulator


@pytest.fixture
def mysql_databases(mysql_server_url: str) -> Iterator[tuple[str, str]]:
    """Two new databases: the Dagster instance's and the sync database."""
    with mysql_database_pair(mysql_server_url) as urls:
        yield urls


def _partitions_show_their_city(instance: dg.DagsterInstance, keys: list[str]) -> None:
    """Every partition of the five assets materialized, and each gate passed on the
    partition's latest materialization of ``normalized_hotels``.

    A city another run helped with has two materializations and two results per gate (the
    helper's, and its own run's repeated on its own materialization); Dagster orders a
    partition's results by row, and the helper's row can come after the planned one.
    """
    for asset in {key for keys_ in STAGE_ASSETS.values() for key in keys_}:
        found = instance.get_status_by_partition(asset, keys, DEFAULT_SCOPE.partitions) or {}
        assert {k: found.get(k) for k in keys} == dict.fromkeys(
            keys, dg.AssetPartitionStatus.MATERIALIZED
        ), asset
    for key in keys:
        latest = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=NORMALIZED, asset_partitions=[key]), limit=1
        ).records
        assert latest, key
        for name in CHECK_NAMES:
            records = instance.event_log_storage.get_asset_check_execution_history(
                dg.AssetCheckKey(NORMALIZED, name),
                limit=5,
                partition_filter=PartitionKeyFilter(key=key),
            )
            assert records and {r.status.value for r in records} == {"SUCCEEDED"}, (key, name)
            judged = set()
            for record in records:
                assert record.event is not None and record.event.dagster_event is not None
                evaluation = record.event.dagster_event.event_specific_data
                assert isinstance(evaluation, dg.AssetCheckEvaluation)
                target = evaluation.target_materialization_data
                judged.add(target.storage_id if target is not None else None)
            assert latest[0].storage_id in judged, (key, name, judged)


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
        _partitions_show_their_city(instance, keys)

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
