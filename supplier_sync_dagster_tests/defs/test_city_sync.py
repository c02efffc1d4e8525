"""The city-sync assets in Dagster: partition keys, single-partition and range runs, S3 payloads."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.leasing.leases import LeaseSettings, claim_shard, list_shards
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.run import resolve_batch
from supplier_sync_dagster.definitions import defs
from supplier_sync_dagster.defs.city_sync import city_sync
from supplier_sync_dagster.defs.partitions import decode_city_key, encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SimulatedSupplierResource,
    SupplierResource,
    SyncDatabaseResource,
)
from supplier_sync_dagster.defs.triggers import TRIGGER_TAG, trigger_of
from supplier_sync_dagster.simulator import FaultProfile, running_server
from supplier_sync_dagster_tests.helpers import (
    HOSTILE_CITY_CODES,
    SIM_API_KEY,
    make_simulator,
    moto_bucket,
)

CODES = [*HOSTILE_CITY_CODES, "a~7Cb", "~", "São Paulo", "x" * 64, "a,b", "a b\tc"]


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


def test_the_trigger_of_a_run_and_of_its_reexecutions():
    assert trigger_of({TRIGGER_TAG: "night-1", "supplier_sync/trigger_source": "CRON"}, "r1") == (
        "night-1",
        "CRON",
    )
    assert trigger_of({"dagster/backfill": "bf2"}, "r2") == ("bf2", "BACKFILL")
    # A re-executed backfill continues the batch of the backfill it re-executes.
    tags = {"dagster/backfill": "bf2", "dagster/root_backfill_id": "bf1"}
    assert trigger_of(tags, "r3") == ("bf1", "BACKFILL")
    # A re-executed run continues its original's batch, whose backfill tags Dagster drops
    # when the backfill has ended.
    assert trigger_of({}, "r4", root=({"dagster/backfill": "bf1"}, "r0")) == ("bf1", "BACKFILL")
    assert trigger_of({}, "r5", root=({}, "r0")) == ("r0", "MANUAL")
    assert trigger_of({"dagster/schedule_name": "nightly"}, "r6") == ("r6", "CRON")
    assert trigger_of({TRIGGER_TAG: "x", "supplier_sync/trigger_source": "BOGUS"}, "r7") == (
        "x",
        "MANUAL",
    )


def _setup(tmp_path: Path, **sim: Any) -> tuple[dg.DagsterInstance, SupplierResource, list[str]]:
    supplier = SimulatedSupplierResource(
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


def _per_city(result: dg.ExecuteInJobResult, asset: str) -> dict[str, dict[str, Any]]:
    """Partition key -> metadata of the run's materializations of ``asset`` (one per city)."""
    out: dict[str, dict[str, Any]] = {}
    for m in result.asset_materializations_for_node("city_sync"):
        if m.asset_key.to_user_string() == asset:
            assert m.partition is not None and m.partition not in out, m
            out[m.partition] = {k: v.value for k, v in m.metadata.items()}
    return out


def _metadata(result: dg.ExecuteInJobResult, asset: str) -> dict[str, Any]:
    """The metadata of the one city the run materialized ``asset`` for."""
    per_city = _per_city(result, asset)
    assert len(per_city) == 1, per_city
    return next(iter(per_city.values()))


def test_single_partition_materialize_then_rerun_is_all_unchanged(db_url: str, tmp_path: Path):
    instance, supplier, keys = _setup(tmp_path)
    resources = _resources(db_url, tmp_path, supplier)
    result = dg.materialize(
        [city_sync], instance=instance, resources=resources, partition_key=keys[1]
    )
    assert result.success
    meta = _metadata(result, "published_hotels")
    assert meta["counts_add_up"] is True and meta["city_status"] == "SUCCESS"
    assert meta["city"] == decode_city_key(keys[1])
    assert set(_per_city(result, "published_hotels")) == {keys[1]}
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
    first_meta = _metadata(r1, "published_hotels")
    assert first_meta["city_status"] == "SUCCESS"
    # The city was published by the first launch: the second syncs nothing, and reports the
    # city as published earlier in the batch (its partition stays materialized).
    again_meta = _metadata(r2, "published_hotels")
    assert again_meta["city_status"] == "ALREADY_DONE"
    assert again_meta["published_earlier_in_batch"] == first_meta["batch_id"]
    assert again_meta["published"] == first_meta["published"]
    db = SyncDatabase.open(db_url)
    with db.engine.connect() as conn:
        batches = conn.execute(
            sa.select(schema.batch.c.batch_id).where(schema.batch.c.trigger_id == "fixed-trigger")
        ).all()
    db.dispose()
    assert [b.batch_id for b in batches] == [_metadata(r1, "published_hotels")["batch_id"]]


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
    with moto_bucket() as found:
        yield found


def test_range_run_with_payloads_on_s3(tmp_path: Path, moto_s3: tuple[str, str]):
    endpoint, bucket = moto_s3
    instance, _, keys = _setup(tmp_path, cities=5, hotels=500)
    # Worker processes open the store from the resource too.
    supplier = SimulatedSupplierResource(
        sim_cities=5, sim_hotels=500, sim_profile="flaky", rate_limit_rps=10_000, worker_processes=2
    )
    db_url = f"sqlite:///{tmp_path}/sync.sqlite3"
    resources = {
        "sync_db": SyncDatabaseResource(db_url=db_url),
        "payloads": PayloadStoreResource(
            url=f"s3://{bucket}/supplier-sync",
            s3_endpoint_url=endpoint,
            s3_region_name="us-east-1",
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
    per_city = _per_city(result, "published_hotels")
    assert set(per_city) == set(keys)
    assert all(m["counts_add_up"] and m["city_status"] == "SUCCESS" for m in per_city.values())
    db = SyncDatabase.open(db_url)
    with db.engine.connect() as conn:
        refs = conn.execute(sa.select(schema.snapshot.c.payload_ref)).scalars().all()
        published = dict(
            conn.execute(
                sa.select(
                    schema.platform_hotel.c.supplier_hotel_id,
                    schema.platform_hotel.c.supplier_version,
                )
            ).all()
        )
    db.dispose()
    assert refs and all(r.startswith(f"s3://{bucket}/supplier-sync/") for r in refs)
    objects = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").list_objects_v2(
        Bucket=bucket
    )
    assert objects["KeyCount"] > 0
    truth = make_simulator(FaultProfile.named("flaky"), n_cities=5, total_hotels=500).ground_truth()
    assert published == truth.valid


def test_runs_of_one_backfill_share_one_batch(tmp_path: Path):
    instance, supplier, keys = _setup(tmp_path, cities=4, hotels=300)
    db_url = f"sqlite:///{tmp_path}/sync.sqlite3"
    resources = _resources(db_url, tmp_path, supplier)
    half = len(keys) // 2
    batches: set[str] = set()
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
        batches.update(m["batch_id"] for m in _per_city(result, "published_hotels").values())
    assert len(batches) == 1
    db = SyncDatabase.open(db_url)
    with db.engine.connect() as conn:
        row = conn.execute(sa.select(schema.batch)).one()
    db.dispose()
    assert (row.trigger_id, row.trigger_source, row.status) == ("bf-123", "BACKFILL", "SUCCESS")
    assert row.shard_count == row.shards_done == len(keys)


def test_a_run_that_finishes_early_helps_with_cities_other_runs_have_not_started(
    db_url: str, tmp_path: Path
):
    instance, supplier, keys = _setup(tmp_path, cities=4, hotels=400)
    resources = _resources(db_url, tmp_path, supplier)
    mine, theirs = keys[0], keys[3]
    # Another run of the same backfill has registered its city but not started it yet.
    db = SyncDatabase.open(db_url)
    batch = resolve_batch(
        db,
        task_code=supplier.task_code,
        supplier_id=supplier.supplier_id,
        trigger_id="bf-1",
        source="BACKFILL",
        cities=[decode_city_key(theirs)],
    )

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
    # The helper reported the city it synced on that city's own partition.
    helped = _per_city(first, "published_hotels")
    assert set(helped) == {mine, theirs}
    assert helped[theirs]["helped_another_run"] is True
    assert helped[theirs]["city"] == decode_city_key(theirs) and helped[theirs]["published"] > 0

    second = dg.materialize(
        [city_sync], instance=instance, resources=resources, partition_key=theirs, tags=tags
    )
    assert second.success
    # Already published by the helper: not synced again, reported as published earlier.
    reported = _metadata(second, "published_hotels")
    assert reported["city_status"] == "ALREADY_DONE"
    assert reported["published_earlier_in_batch"] == batch.batch_id
    again = {s.shard_key: s for s in list_shards(db, batch.batch_id)}
    assert again[decode_city_key(theirs)].claim_count == 1
    db.dispose()


def test_a_city_held_by_another_run_is_waited_for_after_the_others(tmp_path: Path):
    """The run's largest city is leased by someone else: the run syncs its other cities
    first, then waits for that lease to end and finishes the city itself."""
    instance, supplier, keys = _setup(tmp_path, cities=4, hotels=400)
    db_url = f"sqlite:///{tmp_path}/sync.sqlite3"
    resources = _resources(db_url, tmp_path, supplier)
    with supplier.client() as client:
        listing = client.list_cities().data.cities
    held = max(listing, key=lambda c: c.hotel_count or 0).city_code
    db = SyncDatabase.open(db_url)
    batch = resolve_batch(
        db,
        task_code=supplier.task_code,
        supplier_id=supplier.supplier_id,
        trigger_id="bf-held",
        source="BACKFILL",
        cities=[held],
    )
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
    # In the order the run reported them.
    done = [
        m["city"]
        for m in _per_city(result, "published_hotels").values()
        if m["city_status"] == "SUCCESS"
    ]
    assert sorted(done) == sorted(decode_city_key(k) for k in keys)
    assert done[-1] == held  # the others did not wait behind it
    shards = {s.shard_key: s for s in list_shards(db, batch.batch_id)}
    assert all(s.status == "SUCCESS" for s in shards.values())
    assert shards[held].claim_count == 2
    db.dispose()


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_a_range_run_with_two_cities_in_flight_ends_at_the_ground_truth(
    db_url: str, tmp_path: Path, mode: str
):
    """Two cities at once, as threads of the run (``city_threads=2``) or in two worker
    processes (``worker_processes=2``, the CLI's default on two cores): the same end state
    as one city at a time, and each city's events on its own partition."""
    instance, _, keys = _setup(tmp_path, cities=6, hotels=900)
    supplier = SimulatedSupplierResource(
        sim_cities=6,
        sim_hotels=900,
        sim_profile="flaky",
        rate_limit_rps=10_000,
        city_threads=2 if mode == "threads" else 1,
        worker_processes=2 if mode == "processes" else 0,
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
    per_city = _per_city(result, "published_hotels")
    assert set(per_city) == set(keys)
    assert all(m["counts_add_up"] is True for m in per_city.values())
    truth = make_simulator(FaultProfile.named("flaky"), n_cities=6, total_hotels=900).ground_truth()
    db = SyncDatabase.open(db_url)
    try:
        with db.engine.connect() as conn:
            h, d = schema.platform_hotel.c, schema.dead_letter.c
            published = dict(conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version)).all())
            dead = set(conn.execute(sa.select(d.supplier_resource_code)).scalars())
    finally:
        db.dispose()
    assert published == truth.valid
    assert dead == set(truth.bad)


def full_sync_job() -> dg.JobDefinition:
    """The project's full-sync job, resources from the SUPPLIER_SYNC_* environment
    (module level: re-execution needs a reconstructable job)."""
    return defs().resolve_job_def("full_sync_job")


def test_reexecuting_a_failed_range_run_from_failure_resyncs_only_the_failed_city(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """What "Re-execute from failure" on a run in the UI does: the same batch continues,
    the cities it published are not synced again, the failed one resumes."""

    sim = make_simulator(seed=7, n_cities=4, total_hotels=400)
    broken = sim.city_codes()[1]
    sim.config = replace(
        sim.config, faults=sim.config.faults.with_(unlisted_hotels_city_codes=(broken,))
    )
    keys = [encode_city_key(c) for c in sim.city_codes()]
    with running_server(sim) as url:
        for name, value in {
            "SUPPLIER_SYNC_DB_URL": db_url,
            "SUPPLIER_SYNC_SUPPLIER_URL": url,
            "SUPPLIER_SYNC_SUPPLIER_API_KEY": SIM_API_KEY,
            "SUPPLIER_SYNC_PAYLOAD_URL": f"file://{tmp_path}/payloads",
        }.items():
            monkeypatch.setenv(name, value)
        job = dg.reconstructable(full_sync_job)
        with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
            instance.add_dynamic_partitions("supplier_city", keys)
            tags = {
                "dagster/asset_partition_range_start": keys[0],
                "dagster/asset_partition_range_end": keys[-1],
            }
            with dg.execute_job(job, instance, tags=tags, raise_on_error=False) as first:
                assert not first.success
                done = set(_per_city(first, "published_hotels"))
                failure = [
                    e for e in first.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE
                ]
            assert done == set(keys) - {encode_city_key(broken)}
            assert "1 FAILED" in str(failure[0].step_failure_data.user_failure_data.description)  # type: ignore[union-attr]

            sim.config = replace(sim.config, faults=FaultProfile.clean())
            options = dg.ReexecutionOptions.from_failure(first.run_id, instance)
            # The UI's re-execution carries the parent run's tags (its range); the Python
            # API takes them explicitly.
            with dg.execute_job(job, instance, tags=tags, reexecution_options=options) as again:
                assert again.success
                # Every city of the range is reported on its partition: the failed one as
                # synced now, the others as published earlier in the batch (not synced again:
                # the claim counts below).
                statuses = {
                    k: m["city_status"] for k, m in _per_city(again, "published_hotels").items()
                }
                assert statuses == {
                    k: "SUCCESS" if k == encode_city_key(broken) else "ALREADY_DONE" for k in keys
                }
    db = SyncDatabase.open(db_url)
    try:
        with db.engine.connect() as conn:
            batches = conn.execute(
                sa.select(schema.batch.c.trigger_id, schema.batch.c.status)
            ).all()
            claims = dict(
                conn.execute(sa.select(schema.shard.c.shard_key, schema.shard.c.claim_count)).all()
            )
            published = dict(
                conn.execute(
                    sa.select(
                        schema.platform_hotel.c.supplier_hotel_id,
                        schema.platform_hotel.c.supplier_version,
                    )
                ).all()
            )
    finally:
        db.dispose()
    assert [(b.trigger_id, b.status) for b in batches] == [(first.run_id, "SUCCESS")]
    assert claims == {c: (2 if c == broken else 1) for c in sim.city_codes()}
    assert published == dict(sim.ground_truth().valid)
