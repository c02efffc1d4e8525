"""A run whose worker died is marked FAILURE by the daemon's run monitoring.

The embedded profile for real (the repository's ``dagster.yaml``): dagster-webserver and
``supplier-sync daemon`` on a SQLite instance. Two deaths that Dagster's default launcher
left STARTED for ever: a launched run's worker killed together with the code server that
spawned it, and a ``supplier-sync sync --full`` killed with SIGKILL. Both must show FAILURE
within a few monitoring polls, and the killed run's pool slot must be given back.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import yaml

from supplier_sync_dagster.dagster_instance.deployment import ROOT, DagsterProcesses, profile_env
from supplier_sync_dagster.dagster_instance.home import dagster_instance
from supplier_sync_dagster.dagster_instance.run_launcher import (
    WORKER_HOST_TAG,
    LocalRunLauncher,
    worker_pid,
)
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.defs.triggers import TRIGGER_TAG
from supplier_sync_dagster.simulator import FaultProfile, Simulator
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, serve_simulator

POOL = "supplier_api"
# poll_interval_seconds (5) plus the daemon's own loop and a slow machine's slack.
FAILURE_WITHIN_SECONDS = 30.0


@pytest.fixture
def simulator() -> Iterator[tuple[Simulator, str]]:
    # Every request takes 0.3 s: a city of 20 pages keeps its run busy long enough to kill.
    faults = FaultProfile.clean().with_(rate_slow=1.0, slow_seconds=0.3)
    with serve_simulator(
        faults, seed=7, n_cities=3, total_hotels=6000, empty_city_share=0.0
    ) as served:
        yield served


def _parent(pid: int) -> tuple[int, str]:
    stat = Path(f"/proc/{pid}/stat").read_text()
    ppid = int(stat.rsplit(")", 1)[1].split()[1])
    return ppid, Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _wait_for_worker(
    instance: dg.DagsterInstance, runs: dg.RunsFilter, deadline: float
) -> tuple[dg.DagsterRun, int]:
    while time.monotonic() < deadline:
        for run in instance.get_runs(filters=runs):
            pid = worker_pid(instance, run.run_id)
            if pid is not None and run.status == dg.DagsterRunStatus.STARTED:
                return run, pid
        time.sleep(0.2)
    raise AssertionError(f"no started run for {runs}")


def _wait_for_failure(instance: dg.DagsterInstance, run_id: str) -> float:
    """Seconds until the run is FAILURE; fails the test past the bound."""
    started = time.monotonic()
    while time.monotonic() - started < FAILURE_WITHIN_SECONDS:
        run = instance.get_run_by_id(run_id)
        assert run is not None
        if run.status == dg.DagsterRunStatus.FAILURE:
            return time.monotonic() - started
        assert run.status == dg.DagsterRunStatus.STARTED, run.status
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} not FAILURE after {FAILURE_WITHIN_SECONDS} s")


def _claimed_slots(instance: dg.DagsterInstance, run_id: str) -> int:
    info = instance.event_log_storage.get_concurrency_info(POOL)
    return sum(1 for slot in info.claimed_slots if slot.run_id == run_id)


def test_runs_whose_worker_died_are_marked_failed_under_the_daemon(
    simulator: tuple[Simulator, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    sim, sim_url = simulator
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    env = profile_env(
        dagster_home=home,
        extra={
            "SUPPLIER_SYNC_HOME": str(tmp_path / "state"),
            "SUPPLIER_SYNC_DB_URL": f"sqlite:///{tmp_path / 'sync.sqlite3'}",
            "SUPPLIER_SYNC_SUPPLIER_URL": sim_url,
            "SUPPLIER_SYNC_SUPPLIER_API_KEY": SIM_API_KEY,
            "SUPPLIER_SYNC_PAYLOAD_URL": f"file://{tmp_path / 'payloads'}",
        },
    )
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    # Created here first: the webserver and the daemon must not race to create its storage.
    instance = dg.DagsterInstance.get()
    assert isinstance(instance.run_launcher, LocalRunLauncher)
    assert instance.run_monitoring_enabled
    keys = [encode_city_key(c) for c in sim.city_codes()]
    instance.add_dynamic_partitions("supplier_city", keys)

    with DagsterProcesses(env, tmp_path / "logs") as dagster:
        # 1. A launched run: its worker and the code server that spawned it are killed.
        backfill = dagster.launch_backfill(keys[:1], title="monitoring: killed worker")
        run, pid = _wait_for_worker(
            instance, dg.RunsFilter(tags={"dagster/backfill": backfill}), time.monotonic() + 120
        )
        assert run.tags[WORKER_HOST_TAG]
        deadline = time.monotonic() + 60
        while not _claimed_slots(instance, run.run_id):  # its step has started
            assert time.monotonic() < deadline, "the run's step never took its pool slot"
            time.sleep(0.2)
        code_server, cmdline = _parent(pid)
        assert "dagster" in cmdline and "grpc" in cmdline, cmdline
        os.kill(pid, signal.SIGKILL)
        os.kill(code_server, signal.SIGKILL)
        _wait_for_failure(instance, run.run_id)
        messages = [e.message for e in instance.all_logs(run.run_id)]
        assert any(f"process {pid} on" in m and "no longer runs" in m for m in messages), messages
        dagster.check()

        # 2. `supplier-sync sync --full` killed with SIGKILL: its run was in its process.
        cli = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "supplier-sync"),
                *("sync", "--full", "--trigger-id", "cli-killed"),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            cli_run, cli_pid = _wait_for_worker(
                instance, dg.RunsFilter(tags={TRIGGER_TAG: "cli-killed"}), time.monotonic() + 120
            )
            assert cli_pid == cli.pid
        finally:
            cli.send_signal(signal.SIGKILL)
            cli.wait(timeout=30)
        _wait_for_failure(instance, cli_run.run_id)

        # 3. The killed runs' pool slots come back (free_slots_after_run_end_seconds).
        deadline = time.monotonic() + 60
        while _claimed_slots(instance, run.run_id) or _claimed_slots(instance, cli_run.run_id):
            assert time.monotonic() < deadline, instance.event_log_storage.get_concurrency_info(
                POOL
            )
            time.sleep(1)
        dagster.check()


def test_the_state_folders_instance_monitors_runs_as_the_repositorys_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("DAGSTER_HOME", "")  # unset for dagster_instance; restored after
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path))
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")  # an older version's
    instance = dagster_instance()
    instance.dispose()
    written = yaml.safe_load((home / "dagster.yaml").read_text())
    repository = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    assert isinstance(instance.run_launcher, LocalRunLauncher)
    for key in ("run_launcher", "run_monitoring"):
        assert written[key] == repository[key], key
    mysql_profile = yaml.safe_load((ROOT / "deploy" / "mysql" / "dagster.yaml").read_text())
    for key in ("run_launcher", "run_monitoring"):
        assert mysql_profile[key] == repository[key], key
