"""``supplier-sync dispatch|outbox|search|audit`` as a user calls them, after a real
``sync --full`` against the simulator over HTTP, on SQLite and MariaDB."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from supplier_sync_dagster.cli.outbox import dispatch_parallelism
from supplier_sync_dagster.cli.parsers.outbox import MAX_AUTO_PROCESSES
from supplier_sync_dagster.core.outbox.machine import claim, outbox_status
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.cli.test_main import (
    assert_one_line_error,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    run,
    simulator,
    supplier,
    sync,
)
from supplier_sync_dagster_tests.core.records.test_catalog import hotel
from supplier_sync_dagster_tests.core.records.test_catalog import sync as publish
from supplier_sync_dagster_tests.helpers import cli_process, free_port, stay, wait_for_http


def test_dispatch_outbox_search_and_audit_after_a_sync(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    sim = simulator(total_hotels=120)
    with supplier(sim, monkeypatch):
        done = sync(capsys, db_url)
    assert done.code == 0, done
    before = json.loads(run(capsys, "--db-url", db_url, "outbox", "status", "--json").out)
    ready = sum(n for k, n in before["counts"].items() if k.startswith("READY/"))
    assert ready > 0 and before["counts"].get("SUCCEEDED/END") is None

    dispatched = run(capsys, "--db-url", db_url, "dispatch", "--once", "--json")
    assert dispatched.code == 0, dispatched
    report = json.loads(dispatched.out)
    assert report["moved"] >= ready  # every event done (the hotel's one thrice)
    after = json.loads(run(capsys, "--db-url", db_url, "outbox", "status", "--json").out)
    assert after["counts"] == {"SUCCEEDED/END": ready}
    assert after["projection_lag"]["count"] > 0 and after["stuck"] == 0
    text = run(capsys, "--db-url", db_url, "outbox", "status").out
    assert "lag publish -> search index: p50" in text

    # The search read model answers, by words and by city.
    db = SyncDatabase.open(db_url)
    with db.engine.connect() as conn:
        name, city = conn.exec_driver_sql(
            "SELECT name, city_code FROM platform_hotel_resource ORDER BY resource_id LIMIT 1"
        ).one()
    found = run(capsys, "search", name.split()[0], "--city", city, "--json")
    assert found.code == 0, found
    hits = [json.loads(line) for line in found.out.splitlines()]
    assert hits and all(h["city_code"] == city for h in hits)
    assert name in {h["name"] for h in hits}
    assert run(capsys, "search", "--city", city, "--limit", "500").code == 0
    nothing = run(capsys, "search")
    assert "give words" in assert_one_line_error(nothing, code=2)

    # Operators: cancel and retry are recorded, each with who, why, before and after.
    listed = run(capsys, "--db-url", db_url, "outbox", "list", "--status", "SUCCEEDED", "--json")
    first = json.loads(listed.out.splitlines()[0])
    refused = run(
        capsys,
        "--db-url",
        db_url,
        "outbox",
        "cancel",
        str(first["id"]),
        "--by",
        "ops",
        "--reason",
        "test",
    )
    assert "only READY/FAILED" in assert_one_line_error(refused, code=2)
    unknown = run(
        capsys, "--db-url", db_url, "outbox", "retry", "987654321", "--by", "ops", "--reason", "x"
    )
    assert "987654321" in assert_one_line_error(unknown, code=2)
    with pytest.raises(SystemExit):  # --by and --reason are required
        run(capsys, "--db-url", db_url, "outbox", "retry", str(first["id"]))

    # A fresh READY event (a republished hotel) to cancel and retry.

    publish(db, "b-cli", [hotel("CLI-1")])
    new = json.loads(
        run(
            capsys, "--db-url", db_url, "outbox", "list", "--status", "READY", "--json"
        ).out.splitlines()[0]
    )
    args = ("--by", "alice", "--reason", "subscriber outage")
    cancelled = run(capsys, "--db-url", db_url, "outbox", "cancel", str(new["id"]), *args)
    assert cancelled.code == 0 and json.loads(cancelled.out)["moved"] == 1
    retried = run(capsys, "--db-url", db_url, "outbox", "retry", str(new["id"]), *args)
    assert retried.code == 0 and json.loads(retried.out)["moved"] == 1
    audit = [
        json.loads(line)
        for line in run(capsys, "--db-url", db_url, "audit", "--json").out.splitlines()
    ]
    assert [(a["action"], a["actor"], a["reason"]) for a in audit[:2]] == [
        ("outbox.retry", "alice", "subscriber outage"),
        ("outbox.cancel", "alice", "subscriber outage"),
    ]
    assert audit[1]["before"]["status"] == "READY" and audit[1]["after"]["status"] == "CANCELLED"
    assert audit[0]["after"]["status"] == "READY"
    assert run(capsys, "--db-url", db_url, "audit").code == 0

    # Reconciliation: the new hotel is published but not projected yet.
    report_only = run(capsys, "--db-url", db_url, "outbox", "reconcile", "--no-repair", "--json")
    assert report_only.code == 1  # a difference left: scripts and alerts see it
    (diff,) = json.loads(report_only.out)["differences"]
    assert (diff["city_code"], diff["missing"]) == ("BKK", 1)
    fixed = run(capsys, "--db-url", db_url, "outbox", "reconcile")
    assert fixed.code == 0 and "1 hotels re-projected" in fixed.out
    again = run(capsys, "--db-url", db_url, "outbox", "reconcile", "--no-repair", "--json")
    assert again.code == 0 and json.loads(again.out)["differences"] == []
    db.dispose()


@pytest.mark.parametrize("processes", [1, 2])
def test_dispatch_serves_until_sigterm_and_finishes_its_batch(tmp_path: Path, processes: int):
    """The long-running dispatcher, as a process (or several): it drains what arrives, and
    SIGTERM stops it cleanly (exit 0), leaving no event PROCESSING."""
    db_url = f"sqlite:///{tmp_path / 'sync.sqlite3'}"
    db = SyncDatabase.open(db_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPPLIER_SYNC_")}
    env["SUPPLIER_SYNC_HOME"] = str(tmp_path / "home")
    proc = cli_process(
        "--db-url",
        db_url,
        "dispatch",
        "--threads",
        "2",
        "--batch-size",
        "20",
        "--processes",
        str(processes),
        env=env,
    )
    try:
        publish(db, "b1", [hotel(f"S{i}") for i in range(60)])
        deadline = time.monotonic() + 60
        while outbox_status(db).total("SUCCEEDED") < 180:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, outbox_status(db)
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "SIGTERM, finishing the batches" in err and "dispatch stopped" in err
    if processes > 1:
        assert f"{processes} processes, exit codes {[0] * processes}" in err
    status = outbox_status(db)
    assert status.total("PROCESSING") == 0 and status.total("SUCCEEDED") == 180
    assert claim(db, "NOTIFY", owner="t") == []
    db.dispose()


def test_serve_api_answers_over_http_after_a_sync(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):

    db_url = f"sqlite:///{tmp_path / 'sync.sqlite3'}"
    sim = simulator(total_hotels=60)
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0
        assert run(capsys, "--db-url", db_url, "dispatch", "--once").code == 0
        db = SyncDatabase.open(db_url)
        with db.engine.connect() as conn:
            rid, city, room, plan = conn.exec_driver_sql(
                "SELECT h.resource_id, h.city_code, o.room_code, o.rate_plan_code "
                "FROM platform_hotel_resource h JOIN platform_hotel_offer o "
                "ON o.resource_id = h.resource_id WHERE o.active = 1 ORDER BY 1 LIMIT 1"
            ).one()
        db.dispose()
        port = free_port()
        env = {k: v for k, v in os.environ.items()}
        # The demo's way: no key, on loopback only.
        proc = cli_process(
            "--db-url", db_url, "serve-api", "--no-auth", "--port", str(port), env=env
        )
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for_http(f"{base}/health", proc)
            found = httpx.get(f"{base}/hotels", params={"city": city}).json()
            assert found["count"] >= 1
            detail = httpx.get(f"{base}/hotels/{rid}")
            assert detail.status_code == 200 and detail.headers["x-cache"] == "MISS"
            assert httpx.get(f"{base}/hotels/{rid}").headers["x-cache"] == "HIT"
            quote = httpx.post(
                f"{base}/offers/confirm",
                json={
                    "hotel_id": rid,
                    "room_code": room,
                    "rate_plan_code": plan,
                    **stay(),
                    "guests": 1,
                },
            )
            assert quote.status_code == 200, quote.text
            assert quote.json()["price"] is not None
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _running(pid: int) -> bool:
    try:  # an orphan that exited may linger as a zombie until init reaps it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_dispatch_defaults_to_two_processes_per_core_on_mariadb_which_stop_with_it(
    fresh_mysql_db: str, tmp_path: Path
):
    """``supplier-sync dispatch`` with no flags on MariaDB: two dispatcher processes per
    core (capped), which drain what a publish wrote; ``kill -9`` of the command leaves no
    dispatcher behind: each child sees its parent gone and stops."""

    db = SyncDatabase.open(fresh_mysql_db)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPPLIER_SYNC_")}
    env["SUPPLIER_SYNC_HOME"] = str(tmp_path / "home")
    expected = min(MAX_AUTO_PROCESSES, 2 * (os.cpu_count() or 1))
    proc = cli_process("--db-url", fresh_mysql_db, "dispatch", "--batch-size", "20", env=env)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(children) < expected:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, children
            time.sleep(0.1)
            children = _children(proc.pid)
        assert len(children) == expected
        publish(db, "b1", [hotel(f"P{i}") for i in range(40)])
        while outbox_status(db).total("SUCCEEDED") < 120:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, outbox_status(db)
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while any(_running(c) for c in children):
            assert time.monotonic() < deadline, [c for c in children if _running(c)]
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in children:
            if _running(c):
                os.kill(c, signal.SIGKILL)
        proc.communicate(timeout=10)
    assert outbox_status(db).total("PROCESSING") == 0  # each finished its batch first
    db.dispose()


def test_dispatch_parallelism_by_database_and_flags():

    auto = min(MAX_AUTO_PROCESSES, 2 * (os.cpu_count() or 1))
    assert dispatch_parallelism("mysql", processes=None, threads=None) == (auto, 1)
    assert dispatch_parallelism("sqlite", processes=None, threads=None) == (1, 2)
    assert dispatch_parallelism("mysql", processes=1, threads=None) == (1, 2)
    assert dispatch_parallelism("sqlite", processes=3, threads=2) == (3, 2)


def test_dispatch_refuses_a_count_below_one(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        run(capsys, "dispatch", "--processes", "0")
    assert exit_info.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err
