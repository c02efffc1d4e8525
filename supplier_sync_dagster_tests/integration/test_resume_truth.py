"""Every path that continues a batch leaves each city's partition status true in the UI.

A full sync of four cities where two fail (the simulator's ``deep_json`` mode on them: their
first page cannot be parsed), then the batch goes on by each way an operator has:

- ``sync --full --trigger-id`` again (the resume the failure line suggests);
- "Re-execute from failure" of the run (``execute_job`` with ``ReexecutionOptions``);
- a new ``sync --full`` that adopts the batch a killed run left behind;
- a backfill under ``supplier-sync daemon`` and its "re-execute from failure", read over
  the webserver's GraphQL API (``failedPartitions`` / ``materializedPartitions``).

Each continuing run is made to fail once more (one city still broken): a run that plans a
partition and does not materialize it marks it failed when it fails, which is how the
cities published earlier in the batch used to turn failed. Afterwards a city published
anywhere in the batch is materialized (its latest metadata saying it was published earlier
in that batch, without being synced again), a city that failed is failed.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.event_api import PartitionKeyFilter

from supplier_sync_dagster.core.records.gates import CHECK_NAMES
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.dagster_instance.deployment import (
    ASSETS,
    ROOT,
    DagsterProcesses,
    profile_env,
)
from supplier_sync_dagster.definitions import defs
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.simulator import Simulator, running_server
from supplier_sync_dagster_tests.cli.test_main import (
    Outcome,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    published,
    query,
    run,
)
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, cli_process, make_simulator

BROKEN_MODE = "deep_json"


@pytest.fixture
def sim() -> Simulator:
    """Four cities, the second and fourth failing (their pages cannot be parsed)."""
    world = make_simulator(seed=41, n_cities=4, total_hotels=400, empty_city_share=0)
    codes = world.city_codes()
    world.set_modes([BROKEN_MODE], [codes[1], codes[3]])
    return world


@pytest.fixture
def served(sim: Simulator, db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The simulator over HTTP and the SUPPLIER_SYNC_* settings a run reads."""
    with running_server(sim) as url:
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", url)
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", SIM_API_KEY)
        monkeypatch.setenv("SUPPLIER_SYNC_DB_URL", db_url)
        yield url


def _statuses(instance: dg.DagsterInstance, codes: Sequence[str]) -> dict[str, dict[str, str]]:
    """Asset -> city -> its partition's status as the UI shows it (MATERIALIZED, FAILED,
    IN_PROGRESS; ``-`` for none), from the instance's partition status cache."""
    keys = [encode_city_key(c) for c in codes]
    out: dict[str, dict[str, str]] = {}
    for asset in ASSETS:
        found = instance.get_status_by_partition(dg.AssetKey(asset), keys, DEFAULT_SCOPE.partitions)
        out[asset] = {
            code: (s.value if (s := (found or {}).get(key)) is not None else "-")
            for code, key in zip(codes, keys, strict=True)
        }
    return out


def _truth(codes: Sequence[str], failed: set[str]) -> dict[str, dict[str, str]]:
    """What every asset should show: the failed cities failed, the others materialized."""
    return {
        asset: {c: "FAILED" if c in failed else "MATERIALIZED" for c in codes} for asset in ASSETS
    }


def _gates(instance: dg.DagsterInstance, codes: Sequence[str]) -> dict[str, dict[str, str]]:
    """Gate -> city -> the status of the gate's latest execution on its partition
    (SUCCEEDED, FAILED, SKIPPED, EXECUTION_FAILED, PLANNED; ``-`` for none)."""
    out: dict[str, dict[str, str]] = {}
    for name in CHECK_NAMES:
        check = dg.AssetCheckKey(dg.AssetKey("normalized_hotels"), name)
        out[name] = {}
        for code in codes:
            records = instance.event_log_storage.get_asset_check_execution_history(
                check, limit=1, partition_filter=PartitionKeyFilter(key=encode_city_key(code))
            )
            out[name][code] = records[0].status.value if records else "-"
    return out


def _gates_passed(
    instance: dg.DagsterInstance, codes: Sequence[str], published: Sequence[str]
) -> None:
    """Each gate passed on each city the batch published."""
    found = _gates(instance, codes)
    for name in CHECK_NAMES:
        assert {c: found[name][c] for c in published} == dict.fromkeys(published, "SUCCEEDED"), (
            name,
            found[name],
        )


def _latest(instance: dg.DagsterInstance, code: str) -> dict[str, Any]:
    """The metadata of the city's latest ``published_hotels`` materialization."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(
            asset_key=dg.AssetKey("published_hotels"), asset_partitions=[encode_city_key(code)]
        ),
        limit=1,
    ).records
    assert records, code
    mat = records[0].asset_materialization
    assert mat is not None
    return {k: v.value for k, v in mat.metadata.items()}


def _shards(db_url: str) -> dict[str, Any]:
    """City -> its shard (status, claims) in the one batch of the test."""
    s = schema.shard.c
    rows = query(db_url, sa.select(s.batch_id, s.shard_key, s.status, s.claim_count))
    assert len({r.batch_id for r in rows}) == 1, rows
    return {r.shard_key: r for r in rows}


def _sync(capsys: pytest.CaptureFixture[str], db_url: str, *extra: str) -> Outcome:
    return run(capsys, "--db-url", db_url, "sync", "--full", "--page-size", "50", *extra)


def _assert_published_earlier(
    instance: dg.DagsterInstance, codes: Sequence[str], batch_id: str
) -> None:
    for code in codes:
        meta = _latest(instance, code)
        assert meta["city_status"] == "ALREADY_DONE", (code, meta)
        assert meta["published_earlier_in_batch"] == batch_id, (code, meta)
        assert meta["published"] > 0 and meta["counts_add_up"] is True, (code, meta)


def test_cli_resume_keeps_each_city_partition_true(
    db_url: str, sim: Simulator, served: str, capsys: pytest.CaptureFixture[str]
):
    codes = sim.city_codes()
    good, broken = [codes[0], codes[2]], [codes[1], codes[3]]
    first = _sync(capsys, db_url, "--trigger-id", "night-1")
    assert first.code == 1, first
    with dg.DagsterInstance.get() as instance:
        assert _statuses(instance, codes) == _truth(codes, set(broken))
    batch_id = next(iter(_shards(db_url).values())).batch_id

    # One city mended, one still broken: the resume fails again, for that city only.
    sim.set_modes([BROKEN_MODE], [broken[1]])
    again = _sync(capsys, db_url, "--trigger-id", "night-1")
    assert again.code == 1, again
    assert repr(broken[1]) in again.err and repr(broken[0]) not in again.err, again.err
    with dg.DagsterInstance.get() as instance:
        assert _statuses(instance, codes) == _truth(codes, {broken[1]})
        # Reported as published earlier in the batch, from the sync database.
        _assert_published_earlier(instance, good, batch_id)
        assert _latest(instance, broken[0])["city_status"] == "SUCCESS"
        _gates_passed(instance, codes, [*good, broken[0]])

    sim.set_modes([])
    last = _sync(capsys, db_url, "--trigger-id", "night-1")
    assert last.code == 0, last
    with dg.DagsterInstance.get() as instance:
        assert _statuses(instance, codes) == _truth(codes, set())
        _assert_published_earlier(instance, [*good, broken[0]], batch_id)
    # Reported, not synced again: each city was claimed until it published, no more.
    claims = {c: s.claim_count for c, s in _shards(db_url).items()}
    assert claims == {codes[0]: 1, codes[1]: 2, codes[2]: 1, codes[3]: 3}
    assert published(db_url) == dict(sim.ground_truth().valid)


def full_sync_job() -> dg.JobDefinition:
    """The project's full-sync job, resources from the SUPPLIER_SYNC_* environment
    (module level: re-execution needs a reconstructable job)."""
    return defs().resolve_job_def("full_sync_job")


def test_reexecution_from_failure_keeps_each_city_partition_true(
    db_url: str, sim: Simulator, served: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("SUPPLIER_SYNC_PAYLOAD_URL", f"file://{tmp_path}/payloads")
    codes = sim.city_codes()
    good, broken = [codes[0], codes[2]], [codes[1], codes[3]]
    keys = [encode_city_key(c) for c in codes]
    job = dg.reconstructable(full_sync_job)
    # The UI's re-execution carries the parent run's tags (its range); the Python API
    # takes them explicitly.
    tags = {
        "dagster/asset_partition_range_start": keys[0],
        "dagster/asset_partition_range_end": keys[-1],
    }
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        instance.add_dynamic_partitions(DEFAULT_SCOPE.partitions_name, keys)
        with dg.execute_job(job, instance, tags=tags, raise_on_error=False) as first:
            assert not first.success
        assert _statuses(instance, codes) == _truth(codes, set(broken))
        batch_id = next(iter(_shards(db_url).values())).batch_id

        sim.set_modes([BROKEN_MODE], [broken[1]])
        options = dg.ReexecutionOptions.from_failure(first.run_id, instance)
        with dg.execute_job(
            job, instance, tags=tags, reexecution_options=options, raise_on_error=False
        ) as second:
            assert not second.success
        assert _statuses(instance, codes) == _truth(codes, {broken[1]})
        _assert_published_earlier(instance, good, batch_id)
        _gates_passed(instance, codes, [*good, broken[0]])

        sim.set_modes([])
        options = dg.ReexecutionOptions.from_failure(second.run_id, instance)
        with dg.execute_job(job, instance, tags=tags, reexecution_options=options) as third:
            assert third.success
        assert _statuses(instance, codes) == _truth(codes, set())
        _assert_published_earlier(instance, [*good, broken[0]], batch_id)
    assert published(db_url) == dict(sim.ground_truth().valid)


def _wait_for(what: str, ready: Any, proc: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the sync ended before {what}: {out[-2000:]} {err[-2000:]}")
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.1)


def test_a_run_that_adopts_a_killed_runs_batch_keeps_each_city_partition_true(
    db_url: str,
    sim: Simulator,
    served: str,
    capsys: pytest.CaptureFixture[str],
):
    """A ``sync --full`` killed (SIGKILL) while one city trickles: the next ``sync --full``
    (a new trigger) adopts its batch; the cities the killed run published are reported as
    published earlier, and the trickling one, broken now, fails the adopting run."""
    codes = sim.city_codes()
    slow = codes[0]
    sim.set_modes(["slow_body"], [slow])
    argv = ("--db-url", db_url, "sync", "--full", "--page-size", "50", "--trigger-id", "night-1")
    proc = cli_process(*argv, env=dict(os.environ))
    try:

        def only_the_trickling_city_left() -> bool:
            shards = query(db_url, sa.select(schema.shard.c.shard_key, schema.shard.c.status))
            status = {r.shard_key: r.status for r in shards}
            return (
                len(status) == 4
                and status[slow] == "RUNNING"
                and all(status[c] == "SUCCESS" for c in codes if c != slow)
            )

        _wait_for("the other cities done", only_the_trickling_city_left, proc)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    batch_id = next(iter(_shards(db_url).values())).batch_id
    done = [c for c in codes if c != slow]

    # The trickling city now fails outright: the adopting run fails, for it only.
    sim.set_modes([BROKEN_MODE], [slow])
    adopted = _sync(capsys, db_url)
    assert adopted.code == 1, adopted
    shards = _shards(db_url)  # one batch: adopted, not a new one
    assert shards[slow].status == "FAILED" and shards[slow].claim_count == 2
    assert {c: shards[c].claim_count for c in done} == dict.fromkeys(done, 1)
    with dg.DagsterInstance.get() as instance:
        assert _statuses(instance, codes) == _truth(codes, {slow})
        _assert_published_earlier(instance, done, batch_id)
        _gates_passed(instance, codes, done)


def test_a_backfill_rerun_from_failure_keeps_each_city_partition_true_over_graphql(
    db_url: str,
    sim: Simulator,
    served: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    codes = sim.city_codes()
    broken = [codes[1], codes[3]]
    keys = {c: encode_city_key(c) for c in codes}
    home = tmp_path / "backfill_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    env = profile_env(
        dagster_home=home,
        extra={
            "SUPPLIER_SYNC_DB_URL": db_url,
            "SUPPLIER_SYNC_SUPPLIER_URL": served,
            "SUPPLIER_SYNC_SUPPLIER_API_KEY": SIM_API_KEY,
            "SUPPLIER_SYNC_PAYLOAD_URL": f"file://{tmp_path / 'payloads'}",
            # Two runs of two cities: a run that finishes helps the other's cities.
            "SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN": "2",
        },
    )
    monkeypatch.setenv("DAGSTER_HOME", str(home))

    def view(dagster: DagsterProcesses) -> dict[str, dict[str, str]]:
        found: dict[str, dict[str, str]] = {}
        for asset in ASSETS:
            statuses = dagster.partitions(asset, list(keys.values())).statuses
            # A partition failed and never materialized is listed as unmaterialized too.
            found[asset] = {
                c: next(
                    (
                        name.upper()
                        for name in ("failed", "materializing", "materialized", "unmaterialized")
                        if keys[c] in statuses[name]
                    ),
                    "-",
                )
                for c in codes
            }
        return found

    def truth(failed: set[str]) -> dict[str, dict[str, str]]:
        return {a: {c: "FAILED" if c in failed else "MATERIALIZED" for c in codes} for a in ASSETS}

    with (
        dg.DagsterInstance.get() as instance,
        DagsterProcesses(env, tmp_path / "logs") as dagster,
    ):
        instance.add_dynamic_partitions(DEFAULT_SCOPE.partitions_name, list(keys.values()))
        first = dagster.launch_backfill(list(keys.values()), title="resume truth")
        status, _ = dagster.wait_for_backfill(instance, first, timeout=300)
        assert status in ("COMPLETED_FAILED", "FAILED")
        assert view(dagster) == truth(set(broken))

        sim.set_modes([BROKEN_MODE], [broken[1]])
        second = dagster.reexecute_backfill(first)
        status, _ = dagster.wait_for_backfill(instance, second, timeout=300)
        assert status in ("COMPLETED_FAILED", "FAILED")
        assert view(dagster) == truth({broken[1]})

        # Re-executed in full: every city's partition is planned again, in the same batch;
        # those published earlier are reported so, the broken one fails again.
        again = dagster.reexecute_backfill(first, from_failure=False)
        status, _ = dagster.wait_for_backfill(instance, again, timeout=300)
        assert status in ("COMPLETED_FAILED", "FAILED")
        assert view(dagster) == truth({broken[1]})
        latest = dagster.partitions("published_hotels", list(keys.values())).latest
        published_before = [c for c in codes if c != broken[1]]
        assert {c: latest[keys[c]]["city_status"] for c in published_before} == dict.fromkeys(
            published_before, "ALREADY_DONE"
        )
        assert keys[broken[1]] not in latest
        checks = dagster.partitions("normalized_hotels", list(keys.values())).checks
        for name in CHECK_NAMES:
            assert checks[name]["succeeded"] == {keys[c] for c in published_before}, checks

        sim.set_modes([])
        third = dagster.reexecute_backfill(again)
        status, runs = dagster.wait_for_backfill(instance, third, timeout=300)
        assert status in ("COMPLETED", "COMPLETED_SUCCESS"), runs
        assert view(dagster) == truth(set())
    assert published(db_url) == dict(sim.ground_truth().valid)
    assert len({s.batch_id for s in _shards(db_url).values()}) == 1
