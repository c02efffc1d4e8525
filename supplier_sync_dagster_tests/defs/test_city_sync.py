"""The city-sync assets in Dagster: partition keys, single-partition and range runs, S3 payloads."""

from __future__ import annotations

import ast
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import dagster as dg
import pytest
import sqlalchemy as sa
from dagster_aws.s3 import S3Resource
from moto.server import ThreadedMotoServer

from supplier_sync_dagster.core import schema as t
from supplier_sync_dagster.core.db import SyncDatabase
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.defs.city_sync import TRIGGER_TAG, city_sync, resolve_batch
from supplier_sync_dagster.defs.partitions import decode_city_key, encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SupplierResource,
    SyncDatabaseResource,
)
from supplier_sync_dagster.simulator import (
    HOSTILE_CITY_CODES,
    FaultProfile,
    Simulator,
    SimulatorConfig,
)

CODES = [*HOSTILE_CITY_CODES, "BKK", "bkk", "a~7Cb", "~", "São Paulo", "x" * 64, "a,b", "a b\tc"]


@pytest.mark.parametrize("code", CODES)
def test_partition_keys_are_safe_and_reversible(code: str):
    key = encode_city_key(code)
    assert decode_city_key(key) == code
    for forbidden in ("...", "|", ",", "/", " ", "\t", "[", "]", "*", "'"):
        assert forbidden not in key
    assert len({encode_city_key(c) for c in CODES}) == len(CODES)


@pytest.mark.parametrize("bad", ["a~", "a~zz", "a|b", "a.b", "~C3"])
def test_malformed_partition_keys_are_clear_errors(bad: str):
    with pytest.raises(ConfigError, match="partition key"):
        decode_city_key(bad)


def _setup(tmp_path: Path, **sim: Any) -> tuple[dg.DagsterInstance, SupplierResource, list[str]]:
    supplier = SupplierResource(
        sim_cities=sim.get("cities", 4),
        sim_hotels=sim.get("hotels", 400),
        sim_profile="flaky",
        rate_limit_rps=10_000,
    )
    with supplier.client() as client:
        codes = [c.city_code for c in client.list_cities().data.cities]
    instance = dg.DagsterInstance.ephemeral(tempdir=str(tmp_path / "dagster"))
    keys = [encode_city_key(c) for c in codes]
    instance.add_dynamic_partitions("supplier_city", keys)
    return instance, supplier, keys


def _resources(db_url: str, tmp_path: Path, supplier: SupplierResource) -> dict[str, Any]:
    """The asset's resources: the given sync database, payloads in a local folder."""
    return {
        "sync_db": SyncDatabaseResource(db_url=db_url),
        "payloads": PayloadStoreResource(url=f"file://{tmp_path}/payloads"),
        "supplier": supplier,
        "governance": GovernanceResource(),
    }


def _metadata(result: dg.ExecuteInJobResult, asset: str) -> dict[str, Any]:
    mats = [
        m
        for m in result.asset_materializations_for_node("city_sync")
        if m.asset_key.to_user_string() == asset
    ]
    assert mats, asset
    return {k: v.value for k, v in mats[0].metadata.items()}


def test_single_partition_materialize_then_rerun_is_all_unchanged(db_url: str, tmp_path: Path):
    instance, supplier, keys = _setup(tmp_path)
    resources = _resources(db_url, tmp_path, supplier)
    result = dg.materialize(
        [city_sync], instance=instance, resources=resources, partition_key=keys[1]
    )
    assert result.success
    meta = _metadata(result, "published_hotels")
    assert (
        meta["counts_add_up"] is True and meta["cities"] == 1 and meta["batch_status"] == "SUCCESS"
    )
    assert {
        m.asset_key.to_user_string() for m in result.asset_materializations_for_node("city_sync")
    } == {
        "raw_hotel_snapshots",
        "normalized_hotels",
        "hotel_mappings",
        "hotel_diffs",
        "published_hotels",
    }
    first_published = meta["published"]
    assert first_published > 0

    again = dg.materialize(
        [city_sync], instance=instance, resources=resources, partition_key=keys[1]
    )
    assert again.success
    meta2 = _metadata(again, "published_hotels")
    assert meta2["batch_id"] != meta["batch_id"]  # a new launch is a new batch
    assert meta2["published"] == 0 and meta2["skipped"] >= first_published
    assert "NO_CHANGE" in _metadata(again, "hotel_diffs")["diffs_by_type"]

    # Relaunching with the same trigger id is the same batch: nothing is redone.
    tags = {TRIGGER_TAG: "fixed-trigger"}
    r1 = dg.materialize(
        [city_sync], instance=instance, resources=resources, partition_key=keys[2], tags=tags
    )
    r2 = dg.materialize(
        [city_sync], instance=instance, resources=resources, partition_key=keys[2], tags=tags
    )
    assert r1.success and r2.success
    assert (
        _metadata(r1, "published_hotels")["batch_id"]
        == _metadata(r2, "published_hotels")["batch_id"]
    )
    assert _metadata(r2, "published_hotels")["city_status"] == {"ALREADY_DONE": 1}


@pytest.fixture
def moto_s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[str, str]]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }.items():
        monkeypatch.setenv(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    bucket = f"sync-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    try:
        yield endpoint, bucket
    finally:
        server.stop()


def test_range_run_with_payloads_on_s3(tmp_path: Path, moto_s3: tuple[str, str]):
    endpoint, bucket = moto_s3
    instance, supplier, keys = _setup(tmp_path, cities=5, hotels=500)
    db_url = f"sqlite:///{tmp_path}/sync.sqlite3"
    resources = {
        "sync_db": SyncDatabaseResource(db_url=db_url),
        "payloads": PayloadStoreResource(
            url=f"s3://{bucket}/supplier-sync",
            s3=S3Resource(endpoint_url=endpoint, region_name="us-east-1"),
        ),
        "supplier": supplier,
        "governance": GovernanceResource(),
    }
    result = dg.materialize(
        [city_sync],
        instance=instance,
        resources=resources,
        tags={
            "dagster/asset_partition_range_start": keys[0],
            "dagster/asset_partition_range_end": keys[-1],
        },
    )
    assert result.success
    assert _metadata(result, "published_hotels")["cities"] == len(keys)
    db = SyncDatabase.open(db_url)
    with db.engine.connect() as conn:
        refs = conn.execute(sa.select(t.snapshot.c.payload_ref)).scalars().all()
        published = dict(
            conn.execute(
                sa.select(t.platform_hotel.c.supplier_hotel_id, t.platform_hotel.c.supplier_version)
            ).all()
        )
    db.dispose()
    assert refs and all(r.startswith(f"s3://{bucket}/supplier-sync/") for r in refs)
    objects = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").list_objects_v2(
        Bucket=bucket
    )
    assert objects["KeyCount"] > 0
    truth = Simulator(
        SimulatorConfig(n_cities=5, total_hotels=500, faults=FaultProfile.named("flaky"))
    ).ground_truth()
    assert published == truth.valid


def test_runs_of_one_backfill_share_one_batch(tmp_path: Path):
    instance, supplier, keys = _setup(tmp_path, cities=4, hotels=300)
    db_url = f"sqlite:///{tmp_path}/sync.sqlite3"
    resources = _resources(db_url, tmp_path, supplier)
    half = len(keys) // 2
    batches = set()
    for first, last in ((keys[0], keys[half - 1]), (keys[half], keys[-1])):
        result = dg.materialize(
            [city_sync],
            instance=instance,
            resources=resources,
            tags={
                "dagster/backfill": "bf-123",
                "dagster/asset_partition_range_start": first,
                "dagster/asset_partition_range_end": last,
            },
        )
        assert result.success
        batches.add(_metadata(result, "published_hotels")["batch_id"])
    assert len(batches) == 1
    db = SyncDatabase.open(db_url)
    with db.engine.connect() as conn:
        row = conn.execute(sa.select(t.batch)).one()
    db.dispose()
    assert (row.trigger_id, row.trigger_source, row.status) == ("bf-123", "BACKFILL", "SUCCESS")
    assert row.shard_count == row.shards_done == len(keys)


def test_a_run_that_finishes_early_helps_with_cities_other_runs_have_not_started(
    db_url: str, tmp_path: Path
):
    from supplier_sync_dagster.core.leases import list_shards

    instance, supplier, keys = _setup(tmp_path, cities=4, hotels=400)
    resources = _resources(db_url, tmp_path, supplier)
    mine, theirs = keys[0], keys[3]
    # Another run of the same backfill has registered its city but not started it yet.
    db = SyncDatabase.open(db_url)
    batch = resolve_batch(db, supplier, "bf-1", "BACKFILL", [decode_city_key(theirs)])

    tags = {TRIGGER_TAG: "bf-1", "supplier_sync/trigger_source": "BACKFILL"}
    first = dg.materialize(
        [city_sync], instance=instance, resources=resources, partition_key=mine, tags=tags
    )
    assert first.success
    progress = instance.get_run_by_id(first.run_id).tags["supplier_sync/progress"]  # type: ignore[union-attr]
    assert progress.startswith("1/2 cities") or progress.startswith("2/2 cities"), progress
    assert "hotels/s" in progress
    shards = {s.shard_key: s for s in list_shards(db, batch.batch_id)}
    assert shards[decode_city_key(theirs)].status == "SUCCESS"  # helped
    assert shards[decode_city_key(theirs)].claim_count == 1
    assert shards[decode_city_key(mine)].worker_id == shards[decode_city_key(theirs)].worker_id

    second = dg.materialize(
        [city_sync], instance=instance, resources=resources, partition_key=theirs, tags=tags
    )
    assert second.success
    assert _metadata(second, "published_hotels")["city_status"] == {"ALREADY_DONE": 1}
    db.dispose()


def test_a_city_held_by_another_run_is_waited_for_after_the_others(tmp_path: Path):
    """The run's largest city is leased by someone else: the run syncs its other cities
    first, then waits for that lease to end and finishes the city itself."""
    from supplier_sync_dagster.core.leases import LeaseSettings, claim_shard, list_shards

    instance, supplier, keys = _setup(tmp_path, cities=4, hotels=400)
    db_url = f"sqlite:///{tmp_path}/sync.sqlite3"
    resources = _resources(db_url, tmp_path, supplier)
    with supplier.client() as client:
        listing = client.list_cities().data.cities
    held = max(listing, key=lambda c: c.hotel_count or 0).city_code
    db = SyncDatabase.open(db_url)
    batch = resolve_batch(db, supplier, "bf-held", "BACKFILL", [held])
    # A worker that then stops renewing: its 5 s lease must run out before anyone else syncs.
    claim_shard(
        db,
        batch.batch_id,
        held,
        worker_id="other-worker",
        settings=LeaseSettings(lease_seconds=5, heartbeat_seconds=1),
    )
    result = dg.materialize(
        [city_sync],
        instance=instance,
        resources=resources,
        tags={
            "dagster/backfill": "bf-held",
            "dagster/asset_partition_range_start": keys[0],
            "dagster/asset_partition_range_end": keys[-1],
        },
    )
    assert result.success
    done = [
        ast.literal_eval(e.message[len("city ") :].split(": SUCCESS,")[0])
        for e in instance.all_logs(result.run_id)
        if e.message.startswith("city ") and ": SUCCESS," in e.message
    ]
    assert sorted(done) == sorted(decode_city_key(k) for k in keys)
    assert done[-1] == held  # the others did not wait behind it
    shards = {s.shard_key: s for s in list_shards(db, batch.batch_id)}
    assert all(s.status == "SUCCESS" for s in shards.values())
    assert shards[held].claim_count == 2
    db.dispose()


def test_a_range_run_with_two_cities_in_flight_ends_at_the_ground_truth(
    db_url: str, tmp_path: Path
):
    """``city_threads=2`` (the CLI's single run): same end state as one city at a time."""
    instance, _, keys = _setup(tmp_path, cities=6, hotels=900)
    supplier = SupplierResource(
        sim_cities=6, sim_hotels=900, sim_profile="flaky", rate_limit_rps=10_000, city_threads=2
    )
    result = dg.materialize(
        [city_sync],
        instance=instance,
        resources=_resources(db_url, tmp_path, supplier),
        tags={
            "dagster/asset_partition_range_start": keys[0],
            "dagster/asset_partition_range_end": keys[-1],
        },
    )
    assert result.success
    meta = _metadata(result, "published_hotels")
    assert meta["cities"] == len(keys) and meta["counts_add_up"] is True
    truth = Simulator(
        SimulatorConfig(n_cities=6, total_hotels=900, faults=FaultProfile.named("flaky"))
    ).ground_truth()
    db = SyncDatabase.open(db_url)
    try:
        with db.engine.connect() as conn:
            h, d = t.platform_hotel.c, t.dead_letter.c
            published = dict(conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version)).all())
            dead = set(conn.execute(sa.select(d.supplier_resource_code)).scalars())
    finally:
        db.dispose()
    assert published == truth.valid
    assert dead == set(truth.bad)
