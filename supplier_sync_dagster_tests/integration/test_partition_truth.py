"""Each city partition shows its own truth in the Dagster UI, read back as the UI reads it.

A backfill of six cities runs under ``supplier-sync daemon`` on the embedded instance (and on
a user's plain instance, which the daemon opens through the pooled storages), in one ranged
run (the backfill policy groups up to 50 cities). One city is stopped by the
bad-record gate, and one fails: the supplier lists it but answers 404 for its hotels. Over the
webserver's GraphQL API:

- the four cities that published are materialized for all five assets, each with its own
  metadata; the gated city only for raw snapshots and normalized hotels, with its
  ``bad_record_ratio`` check failed on its partition; the failed city for nothing;
- the partitions the run did not complete are failed, the backfill ends failed;
- after the gate is overridden and the supplier mended, "re-execute from failure" of the
  backfill syncs exactly those two cities, in the same batch, and every partition ends
  materialized with the published catalog equal to the supplier's ground truth.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.cli.main import main
from supplier_sync_dagster.core.leasing.batches import TaskSpec
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.tasks import change_task, ensure_task
from supplier_sync_dagster.dagster_instance.deployment import (
    ASSETS,
    ROOT,
    DagsterProcesses,
    profile_env,
)
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.simulator import FaultProfile, Simulator
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, serve_simulator

TASK = "hotel_supplier_full_resource"


@pytest.fixture
def simulator() -> Iterator[tuple[Simulator, str]]:
    faults = FaultProfile.clean().with_(bad_record_rate=0.04)
    with serve_simulator(
        faults, seed=23, n_cities=6, total_hotels=900, empty_city_share=0.0
    ) as served:
        yield served


def _bad_ratios(sim: Simulator) -> dict[str, float]:
    truth = sim.ground_truth()
    return {
        city: sum(1 for h in listed if h in truth.bad) / len(listed)
        for city, listed in truth.listed_by_city.items()
        if listed
    }


def _wait(dagster: DagsterProcesses, instance: dg.DagsterInstance, backfill_id: str) -> str:
    return dagster.wait_for_backfill(instance, backfill_id, timeout=300)[0]


@pytest.mark.parametrize("instance_yaml", ["repository", "plain"])
def test_each_city_partition_shows_its_own_outcome_and_reexecution_heals_exactly_the_rest(
    instance_yaml: str,
    db_url: str,
    simulator: tuple[Simulator, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):
    sim, sim_url = simulator
    ratios = _bad_ratios(sim)
    gated = max(ratios, key=lambda c: ratios[c])
    others = sorted((r for c, r in ratios.items() if c != gated), reverse=True)
    assert ratios[gated] > others[0], ratios  # one city stands out
    broken = next(c for c in sorted(ratios) if c != gated)
    sim.config = replace(
        sim.config, faults=sim.config.faults.with_(unlisted_hotels_city_codes=(broken,))
    )
    codes = sim.city_codes()
    keys = {c: encode_city_key(c) for c in codes}
    good = {keys[c] for c in codes if c not in (gated, broken)}
    assert len(good) == 4

    # The operator's threshold: between the gated city's ratio and every other city's.
    db = SyncDatabase.open(db_url)
    ensure_task(db, TaskSpec(task_code=TASK, supplier_id=1001), created_by="it", reason="setup")
    change_task(
        db,
        TASK,
        changed_by="it",
        reason="test",
        thresholds={"max_bad_ratio": (ratios[gated] + others[0]) / 2},
    )

    home = tmp_path / "dagster_home"
    home.mkdir()
    if instance_yaml == "plain":  # Dagster's stock storage, as `dagster dev` leaves it
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    else:
        shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    env = profile_env(
        dagster_home=home,
        extra={
            "SUPPLIER_SYNC_DB_URL": db_url,
            "SUPPLIER_SYNC_SUPPLIER_URL": sim_url,
            "SUPPLIER_SYNC_SUPPLIER_API_KEY": SIM_API_KEY,
            "SUPPLIER_SYNC_PAYLOAD_URL": f"file://{tmp_path / 'payloads'}",
        },
    )
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    try:
        # The instance's storage is created here, before the webserver and the daemon start
        # (three processes creating one SQLite storage at once can race on its migrations).
        with (
            dg.DagsterInstance.get() as instance,
            DagsterProcesses(env, tmp_path / "logs") as dagster,
        ):
            instance.add_dynamic_partitions("supplier_city", list(keys.values()))
            first = dagster.launch_backfill(list(keys.values()), title="truth per city")
            assert _wait(dagster, instance, first) in ("COMPLETED_FAILED", "FAILED")
            runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": first}))
            assert [r.status for r in runs] == [dg.DagsterRunStatus.FAILURE]  # one ranged run
            assert runs[0].tags.get("dagster/asset_partition_range_start")

            view = {a: dagster.partitions(a, list(keys.values())) for a in ASSETS}
            truth = sim.ground_truth()
            for asset in ASSETS:
                done = good | ({keys[gated]} if asset in ASSETS[:2] else set())
                assert view[asset].statuses["materialized"] == done, asset
                assert view[asset].statuses["failed"] == set(keys.values()) - done, asset
            # Each city carries its own metadata, not the run's.
            published = view["published_hotels"].latest
            for code in codes:
                if keys[code] in good:
                    meta = published[keys[code]]
                    assert meta["city"] == code and meta["city_status"] == "SUCCESS"
                    assert meta["published"] == len(truth.valid_by_city[code])
                    assert (
                        meta["records"]
                        == meta["published"] + meta["skipped"] + meta["dead_letters"]
                    )
                    assert meta["dead_letters"] == sum(meta["dead_letters_by_code"].values())
            assert len({m["published"] for m in published.values()}) > 1
            normalized = view["normalized_hotels"].latest[keys[gated]]
            assert normalized["city_status"] == "GATED"
            assert normalized["bad_record_ratio"] == pytest.approx(ratios[gated], abs=1e-3)
            assert view["raw_hotel_snapshots"].latest[keys[gated]]["pages"] >= 1
            # The gates' results are on the cities they judged.
            checks = view["normalized_hotels"].checks
            assert checks["bad_record_ratio"]["failed"] == {keys[gated]}
            assert checks["bad_record_ratio"]["succeeded"] == good
            assert checks["record_count"]["succeeded"] >= good

            # Mend: override the gate (as an operator does) and fix the supplier's data.
            batch_id = _batch_id(db, first)
            assert (
                main(
                    [
                        "--db-url",
                        db_url,
                        *("gate", "override", "--batch", batch_id, "--city", gated),
                        *("--check", "bad_record_ratio", "--by", "dana", "--reason", "checked"),
                    ]
                )
                == 0
            )
            capsys.readouterr()
            sim.config = replace(
                sim.config, faults=FaultProfile.clean().with_(bad_record_rate=0.04)
            )

            second = dagster.reexecute_backfill(first)
            status = _wait(dagster, instance, second)
            reruns = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": second}))
            assert status in ("COMPLETED", "COMPLETED_SUCCESS"), _errors(instance, reruns)
            assert reruns and all(r.status == dg.DagsterRunStatus.SUCCESS for r in reruns)
            after = {a: dagster.partitions(a, list(keys.values())) for a in ASSETS}
            for asset in ASSETS:
                assert after[asset].statuses["materialized"] == set(keys.values()), asset
                assert after[asset].statuses["failed"] == set(), asset
                # The good cities keep the materialization of the first backfill's run.
                assert {after[asset].latest_run[k] for k in good} == {runs[0].run_id}, asset
            assert after["published_hotels"].latest[keys[gated]]["published"] == len(
                truth.valid_by_city[gated]
            )
            assert after["normalized_hotels"].checks["bad_record_ratio"]["succeeded"] == set(
                keys.values()
            )
    finally:
        db.dispose()

    db = SyncDatabase.open(db_url)
    try:
        h, s, b = schema.platform_hotel.c, schema.shard.c, schema.batch.c
        with db.engine.connect() as conn:
            hotels = dict(conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version)).all())
            batches = conn.execute(sa.select(b.batch_id, b.status, b.trigger_id)).all()
            claims = {
                str(k): int(n) for k, n in conn.execute(sa.select(s.shard_key, s.claim_count))
            }
        assert hotels == dict(truth.valid)
        # One batch: the re-execution continued it, and synced only the two cities.
        assert [(x.batch_id, x.status, x.trigger_id) for x in batches] == [
            (batch_id, "SUCCESS", first)
        ]
        assert {c for c, n in claims.items() if n > 1} == {gated, broken}
    finally:
        db.dispose()


def _batch_id(db: SyncDatabase, trigger_id: str) -> str:
    b = schema.batch.c
    with db.engine.connect() as conn:
        return str(conn.execute(sa.select(b.batch_id).where(b.trigger_id == trigger_id)).scalar())


def _errors(instance: dg.DagsterInstance, runs: Sequence[dg.DagsterRun]) -> list[str]:
    """The error lines of the runs' logs, to say why a backfill failed."""
    return [
        f"{run.run_id[:8]} {run.tags.get('dagster/asset_partition_range_start')}: {e.message}"
        for run in runs
        for e in instance.all_logs(run.run_id)
        if e.level in ("ERROR", "CRITICAL", 40, 50)
    ]
