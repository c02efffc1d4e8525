"""Governance in Dagster: gates as blocking asset checks, overrides, replay by asset selection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import sqlalchemy as sa

from supplier_sync_dagster.core.records.gates import override_gate
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.defs.city_keys import DIFFS, MAPPINGS, NORMALIZED, PUBLISHED, RAW
from supplier_sync_dagster.defs.city_sync import city_sync
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    HttpSupplierResource,
    PayloadStoreResource,
    SyncDatabaseResource,
)
from supplier_sync_dagster.defs.triggers import TRIGGER_TAG
from supplier_sync_dagster.simulator import FaultProfile, Simulator, running_server
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, make_simulator


def _sim(day: int, **faults: Any) -> Simulator:
    return make_simulator(
        FaultProfile.clean().with_(**faults), seed=81, n_cities=3, total_hotels=300, day=day
    )


def _resources(db_url: str, tmp_path: Path, url: str) -> dict[str, Any]:
    return {
        "sync_db": SyncDatabaseResource(db_url=db_url),
        "payloads": PayloadStoreResource(url=f"file://{tmp_path}/payloads"),
        "supplier": HttpSupplierResource(base_url=url, api_key=SIM_API_KEY, rate_limit_rps=10_000),
        "governance": GovernanceResource(),
    }


def _checks(result: dg.ExecuteInJobResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def test_a_failed_gate_is_a_failed_blocking_check_and_an_override_lets_the_city_publish(
    db_url: str, tmp_path: Path
):
    instance = dg.DagsterInstance.ephemeral(tempdir=str(tmp_path / "dagster"))
    day0 = _sim(0)
    city = max(day0.world.cities, key=lambda c: day0.world.listed_count(c, 0)).code
    key = encode_city_key(city)
    instance.add_dynamic_partitions("supplier_city", [key])

    with running_server(day0) as url:
        first = dg.materialize(
            [city_sync],
            instance=instance,
            resources=_resources(db_url, tmp_path, url),
            partition_key=key,
        )
    assert first.success
    checks = _checks(first)
    assert set(checks) == {"bad_record_ratio", "record_count", "schema_drift"}
    assert all(c.passed for c in checks.values())
    assert all(c.asset_key == NORMALIZED for c in checks.values())

    db = SyncDatabase.open(db_url)
    before = _published(db)
    day1 = _sim(1, bad_record_rate=0.5)
    with running_server(day1) as url:
        resources = _resources(db_url, tmp_path, url)
        gated = dg.materialize(
            [city_sync],
            instance=instance,
            resources=resources,
            partition_key=key,
            raise_on_error=False,
        )
        assert not gated.success
        checks = _checks(gated)
        assert not checks["bad_record_ratio"].passed
        assert checks["bad_record_ratio"].severity == dg.AssetCheckSeverity.ERROR
        assert {c.partition for c in checks.values()} == {key}  # the city's own result
        measured = checks["bad_record_ratio"].metadata["measured"].value
        assert isinstance(measured, dict) and measured["ratio"] > 0.2
        assert _published(db) == before  # the gate published nothing
        # Fetched and normalized, but nothing downstream: only those partitions are marked.
        assert {
            (m.asset_key, m.partition) for m in gated.asset_materializations_for_node("city_sync")
        } == {(RAW, key), (NORMALIZED, key)}

        batch_id = _batch_of(db, gated.run_id)
        with db.begin() as conn:
            override_gate(
                conn,
                db.clock,
                batch_id=batch_id,
                shard_key=city,
                check_name="bad_record_ratio",
                who="dana",
                reason="looked at the sample: partial supplier outage, valid rows are fine",
            )
        # The same launch again (same trigger): the override lets the city publish.
        again = dg.materialize(
            [city_sync],
            instance=instance,
            resources=resources,
            partition_key=key,
            tags={TRIGGER_TAG: gated.run_id},
        )
    assert again.success
    assert _checks(again)["bad_record_ratio"].passed
    assert _checks(again)["bad_record_ratio"].metadata["overridden"].value is True
    overridden = _checks(again)["bad_record_ratio"].metadata["measured"].value
    assert isinstance(overridden, dict) and overridden["overridden_by"] == "dana"
    assert {m.asset_key for m in again.asset_materializations_for_node("city_sync")} == {
        RAW,
        NORMALIZED,
        MAPPINGS,
        DIFFS,
        PUBLISHED,
    }
    truth = day1.ground_truth()
    now = _published(db)
    assert {h: now[h] for h in truth.valid_by_city[city]} == dict(truth.valid_by_city[city])
    db.dispose()


def test_materializing_normalized_and_downstream_replays_without_the_supplier(
    db_url: str, tmp_path: Path
):
    instance = dg.DagsterInstance.ephemeral(tempdir=str(tmp_path / "dagster"))
    sim = _sim(0)
    city = max(sim.world.cities, key=lambda c: sim.world.listed_count(c, 0)).code
    key = encode_city_key(city)
    instance.add_dynamic_partitions("supplier_city", [key])
    with running_server(sim) as url:
        resources = _resources(db_url, tmp_path, url)
        assert dg.materialize(
            [city_sync], instance=instance, resources=resources, partition_key=key
        ).success
        requests = sim.stats["requests_total"]
        replay = dg.materialize(
            [city_sync],
            selection=[NORMALIZED, MAPPINGS, DIFFS, PUBLISHED],
            instance=instance,
            resources=resources,
            partition_key=key,
        )
        assert replay.success
        assert sim.stats["requests_total"] == requests  # not one supplier request
    mats = {m.asset_key for m in replay.asset_materializations_for_node("city_sync")}
    assert mats == {NORMALIZED, MAPPINGS, DIFFS, PUBLISHED}
    meta = {
        m.asset_key: {k: v.value for k, v in m.metadata.items()}
        for m in replay.asset_materializations_for_node("city_sync")
    }
    assert meta[PUBLISHED]["counts_add_up"] is True
    assert meta[DIFFS]["diffs_by_type"] == {"NO_CHANGE": meta[PUBLISHED]["skipped"]}


def _published(db: SyncDatabase) -> dict[str, int]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return dict(conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version)).all())


def _batch_of(db: SyncDatabase, trigger_id: str) -> str:
    b = schema.batch.c
    with db.engine.connect() as conn:
        return str(conn.execute(sa.select(b.batch_id).where(b.trigger_id == trigger_id)).scalar())
