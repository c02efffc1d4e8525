"""``supplier-sync sync --full`` cancelled, or stopped while it waits, as a user meets it.

- A CANCEL_PREVIOUS task: a second ``sync --full`` cancels the first one's batch while its
  city's page trickles a byte a second and its other cities wait. The first command exits
  within seconds, 3, with one line naming who cancelled it (no resume hint: a cancelled
  batch is over); the second syncs the catalog to the supplier's truth.
- SIGTERM to a ``sync --full`` that waits for a city another process of its batch holds:
  it exits within seconds, 143, with the line that says how to resume it.
- SIGTERM to a ``sync --incremental`` whose window trickles: 143 and the line that says how
  to resume it, not Dagster's ``DagsterExecutionInterruptedError``; the resume completes.
- The progress line says "ETA unknown" until the sync has a pace, never "ETA nans"
  (``core/leasing/test_time_left.py``: the same for ``batches`` and the step's log).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.records.deadletters import CITY_FAILED
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.simulator import Simulator, running_server
from supplier_sync_dagster_tests.cli.test_main import (
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    published,
    query,
    run,
)
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, cli_process, make_simulator

# A stop is "within a few seconds": the cancellation is polled each second, a trickling
# page takes minutes.
STOPS_WITHIN = 10.0


def _world(seed: int, cities: int) -> Simulator:
    return make_simulator(seed=seed, n_cities=cities, total_hotels=100 * cities, empty_city_share=0)


def _use(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", url)
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", SIM_API_KEY)


def _shards(db_url: str, trigger_id: str) -> dict[str, Any]:
    b, s = schema.batch.c, schema.shard.c
    rows = query(
        db_url,
        sa.select(s.shard_key, s.status, s.worker_id)
        .join(schema.batch, b.batch_id == s.batch_id)
        .where(b.trigger_id == trigger_id),
    )
    return {r.shard_key: r for r in rows}


def _batch_status(db_url: str, trigger_id: str) -> str | None:
    b = schema.batch.c
    rows = query(db_url, sa.select(b.status).where(b.trigger_id == trigger_id))
    return str(rows[0].status) if rows else None


def _wait_for(what: str, ready: Any, *procs: Any, timeout: float = 120.0) -> float:
    """Waits until ``ready()`` while every process runs; the moment it held."""
    deadline = time.monotonic() + timeout
    while not ready():
        for proc in procs:
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"a sync ended before {what}: {out[-2000:]} {err[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.1)
    return time.monotonic()


def _started_runs() -> int:
    """Dagster runs of the test's instance (``$DAGSTER_HOME``) that have started."""
    with dg.DagsterInstance.get() as instance:
        return len(instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED])))


def _ended(proc: Any, timeout: float) -> tuple[str, str, float]:
    """The process's output once it ends, and when it ended (killed past ``timeout``)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return out, err, time.monotonic()


def _lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("supplier-sync: ")]


def test_a_cancel_previous_trigger_stops_the_running_sync_within_seconds(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    sim = _world(seed=43, cities=4)
    sim.set_modes(["slow_body"])  # every page trickles: the first sync never gets far
    with running_server(sim) as url:
        _use(monkeypatch, url)
        base = ("--db-url", db_url, "sync", "--full", "--page-size", "50")
        first = cli_process(
            *base, "--trigger-id", "night-1", "--city-threads", "1", env=dict(os.environ)
        )
        second = None
        try:
            _wait_for(
                "a city of night-1 in flight",
                lambda: any(s.status == "RUNNING" for s in _shards(db_url, "night-1").values()),
                first,
            )
            time.sleep(5.5)  # its progress line (every 5 s off a terminal) has shown
            policy = run(
                capsys,
                *("--db-url", db_url, "task", "set", "--policy", "CANCEL_PREVIOUS"),
                *("--by", "ann", "--reason", "a new night supersedes the last"),
            )
            assert policy.code == 0, policy
            sim.set_modes([])
            second = cli_process(*base, "--trigger-id", "night-2", env=dict(os.environ))
            cancelled = _wait_for(
                "night-1 cancelled", lambda: _batch_status(db_url, "night-1") == "CANCELLED", first
            )
            out, err, ended = _ended(first, timeout=60)
            took = ended - cancelled
            second_out, second_err, _ = _ended(second, timeout=300)
        finally:
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    assert took < STOPS_WITHIN, (took, err[-3000:])
    assert first.returncode == 3, (first.returncode, err[-3000:])
    assert _lines(err) == [
        "supplier-sync: sync cancelled by trigger night-2 (CANCEL_PREVIOUS); "
        "0 of 4 cities done before it"
    ], err[-3000:]
    assert "Traceback" not in err and "DagsterExecutionInterruptedError" not in err, err[-3000:]
    assert "--trigger-id" not in err  # nothing of a cancelled batch resumes
    # Its progress lines, every 5 s: no page done, so no pace to judge the time left by.
    assert "ETA unknown" in err and "nan" not in err, err[-3000:]
    assert second.returncode == 0, (second_out[-2000:], second_err[-3000:])
    assert {s.status for s in _shards(db_url, "night-1").values()} == {"CANCELLED"}
    assert {s.status for s in _shards(db_url, "night-2").values()} == {"SUCCESS"}
    d = schema.dead_letter.c
    assert query(db_url, sa.select(d.city_code).where(d.error_code == CITY_FAILED)) == []
    assert published(db_url) == dict(sim.ground_truth().valid)


def test_sigterm_while_waiting_for_a_city_another_sync_holds_stops_within_seconds(
    db_url: str, monkeypatch: pytest.MonkeyPatch
):
    """Two commands of one trigger: the second finds the one city held by the first (its
    page trickles) and waits for its lease. SIGTERM to it while it waits: it exits within
    seconds with 143 and the one line that says how to resume, no Dagster class path."""
    sim = _world(seed=47, cities=1)
    sim.set_modes(["slow_body"], sim.city_codes())
    with running_server(sim) as url:
        _use(monkeypatch, url)
        argv = (
            "--db-url",
            db_url,
            "sync",
            "--full",
            "--page-size",
            "50",
            "--trigger-id",
            "night-1",
        )
        holder = cli_process(*argv, env=dict(os.environ))
        waiter = None
        try:
            _wait_for(
                "the city in flight",
                lambda: any(s.status == "RUNNING" for s in _shards(db_url, "night-1").values()),
                holder,
            )
            waiter = cli_process(*argv, env=dict(os.environ))
            _wait_for("the second sync's run", lambda: _started_runs() == 2, holder, waiter)
            time.sleep(3)  # its step finds the city held, and waits
            assert waiter.poll() is None, waiter.communicate()
            sent = time.monotonic()
            waiter.send_signal(signal.SIGTERM)
            out, err, ended = _ended(waiter, timeout=60)
        finally:
            for proc in (holder, waiter):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    assert ended - sent < STOPS_WITHIN, (ended - sent, err[-3000:])
    assert waiter.returncode == 128 + signal.SIGTERM, (waiter.returncode, err[-3000:])
    assert _lines(err) == [
        "supplier-sync: sync interrupted (SIGTERM): 0 of 1 city done, the others stopped at "
        "a page boundary; resume with --trigger-id night-1"
    ], err[-3000:]
    assert "Traceback" not in err and "DagsterExecutionInterruptedError" not in err, err[-3000:]


def test_sigterm_during_an_incremental_window_says_how_to_resume_it(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    sim = _world(seed=53, cities=3)
    with running_server(sim) as url:
        _use(monkeypatch, url)
        full = run(capsys, "--db-url", db_url, "sync", "--full")
        assert full.code == 0, full
        sim.advance_day()
        sim.set_modes(["slow_body"])  # the change feed trickles too
        argv = ("--db-url", db_url, "sync", "--incremental", "--trigger-id", "inc-1")
        proc = cli_process(*argv, env=dict(os.environ))
        try:
            _wait_for("the window's batch", lambda: _batch_status(db_url, "inc-1"), proc)
            time.sleep(1.0)  # its first change page trickles
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            out, err, ended = _ended(proc, timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert ended - sent < STOPS_WITHIN, (ended - sent, err[-3000:])
        assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-3000:])
        assert _lines(err) == [
            "supplier-sync: incremental sync interrupted (SIGTERM); resume with --trigger-id inc-1"
        ], err[-3000:]
        assert "Traceback" not in err and "dagster._core" not in err, err[-3000:]

        sim.set_modes([])
        resumed = run(capsys, *argv)
        assert resumed.code == 0, resumed
        truth = sim.ground_truth()
        pub = published(db_url)
    assert {h: pub.get(h) for h in truth.valid} == dict(truth.valid)


def test_ctrl_c_while_the_command_loads_is_one_line_not_a_traceback(
    db_url: str, monkeypatch: pytest.MonkeyPatch
):
    """SIGINT a second after the start: the command is loading Dagster (or, on a fast
    machine, has started its trickling sync): either way one line and 130, never an
    import's traceback."""
    sim = _world(seed=59, cities=1)
    sim.set_modes(["slow_body"])
    with running_server(sim) as url:
        _use(monkeypatch, url)
        proc = cli_process("--db-url", db_url, "sync", "--full", env=dict(os.environ))
        try:
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
            out, err, _ = _ended(proc, timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    (line,) = _lines(err)
    assert "interrupted" in line, err
