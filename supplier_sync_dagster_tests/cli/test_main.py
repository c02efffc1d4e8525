"""Every ``supplier-sync`` subcommand as a user runs it: through ``cli.main([...])`` (or the
console script, for the ones that serve or are piped), with real arguments, a real sync
database (SQLite and MariaDB) and the simulated supplier over HTTP.

State is arranged with real syncs (``sync --full`` through ``main``); assertions read
stdout, stderr, the exit status and the database afterwards.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import dagster as dg
import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.cli import main as cli
from supplier_sync_dagster.cli.parsers.sync import CLI_CITY_THREADS
from supplier_sync_dagster.core.leasing.batches import TaskSpec, create_batch, upsert_task
from supplier_sync_dagster.core.leasing.leases import claim_shard, make_worker_id
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.migrations import load_migrations
from supplier_sync_dagster.core.sync.runtime import GC_GEN0_THRESHOLD
from supplier_sync_dagster.dagster_instance.deployment import ROOT
from supplier_sync_dagster.simulator import (
    FaultProfile,
    Simulator,
    encode_city_code,
    running_server,
)
from supplier_sync_dagster.simulator.data import hotel_id
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, make_simulator

TASK = "hotel_supplier_full_resource"
CONSOLE_SCRIPT = Path(sys.executable).parent / "supplier-sync"


@dataclass
class Outcome:
    """What a command did: its exit status and what it printed."""

    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.out.splitlines()


@pytest.fixture(autouse=True)
def cli_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """State, Dagster instance and payloads under the test's folder; no SUPPLIER_SYNC_* leak."""
    for name in (
        "SUPPLIER_SYNC_DB_URL",
        "SUPPLIER_SYNC_PAYLOAD_URL",
        "SUPPLIER_SYNC_REDIS_URL",
        "SUPPLIER_SYNC_SEARCH_URL",
        "SUPPLIER_SYNC_AMQP_URL",
        "SUPPLIER_SYNC_SUPPLIER_URL",
        "SUPPLIER_SYNC_SUPPLIER_API_KEY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "home"))
    dagster_home = tmp_path / "dagster_home"
    dagster_home.mkdir()
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    # main() quietens the supplier client's logger for the process: give it back.
    supplier_log = logging.getLogger("supplier_sync_dagster.core.supplier")
    level = supplier_log.level
    yield tmp_path
    supplier_log.setLevel(level)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> Outcome:
    """``supplier-sync ARGV`` in this process."""
    capsys.readouterr()
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err)


_PROGRESS = re.compile(r"^\[#* *\] +\d+\.\d%  cities ")


def assert_one_line_error(outcome: Outcome, *, code: int = 1) -> str:
    """The command failed with exactly one ``supplier-sync: ...`` line on stderr.

    Progress lines (``[###   ] 42.0%  cities ...``, every 5 s when stderr is not a terminal)
    are not errors: a sync that runs past 5 s on a loaded machine prints some.
    """
    assert outcome.code == code, outcome
    assert "Traceback" not in outcome.err
    lines = [ln for ln in outcome.err.splitlines() if not _PROGRESS.match(ln)]
    assert len(lines) == 1 and lines[0].startswith("supplier-sync: "), outcome.err
    return lines[0]


@contextmanager
def supplier(sim: Simulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The simulator over HTTP, configured through the SUPPLIER_SYNC_* settings."""
    with running_server(sim) as url:
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", url)
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", SIM_API_KEY)
        yield url


def simulator(**config: Any) -> Simulator:
    faults = FaultProfile.clean().with_(**config.pop("faults", {}))
    return make_simulator(faults, **{"seed": 51, "n_cities": 3, "total_hotels": 300, **config})


def sync(capsys: pytest.CaptureFixture[str], db_url: str, *extra: str) -> Outcome:
    return run(capsys, "--db-url", db_url, "sync", "--full", *extra)


def query(db_url: str, stmt: Any) -> list[Any]:
    db = SyncDatabase.open(db_url)
    try:
        with db.engine.connect() as conn:
            return list(conn.execute(stmt).all())
    finally:
        db.dispose()


def published(db_url: str) -> dict[str, int]:
    h = schema.platform_hotel.c
    return dict(query(db_url, sa.select(h.supplier_hotel_id, h.supplier_version)))


def batch_of(db_url: str, trigger_id: str) -> Any:
    b = schema.batch.c
    rows = query(db_url, sa.select(schema.batch).where(b.trigger_id == trigger_id))
    assert len(rows) == 1, rows
    return rows[0]


# --- db init, sync --full, status, stalls, export -----------------------------------------


def test_db_init_then_sync_full_then_status_stalls_and_exports(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    init = run(capsys, "--db-url", db_url, "db", "init")
    assert init.code == 0, init
    db = SyncDatabase.open(db_url)
    # What it did to the empty database (every version, as `db migrate` says it), then that
    # the schema is ready.
    head = load_migrations(db.dialect)
    assert init.lines[0] == f"{db.safe_url} has none of the sync tables: every version applies"
    assert [ln.split(" (")[0] for ln in init.lines[1:-2]] == [f"applied {m.label}" for m in head]
    assert init.lines[-2:] == [
        f"{db.safe_url} is at version {head[-1].version:03d}",
        f"schema ready in {db.safe_url}",
    ]
    assert {schema.batch.name, schema.shard.name, schema.platform_hotel.name} <= set(
        sa.inspect(db.engine).get_table_names()
    )
    db.dispose()
    assert run(capsys, "--db-url", db_url, "status").out == "no batches\n"

    sim = simulator(faults={"bad_record_rate": 0.05})
    truth = sim.ground_truth()
    assert truth.bad
    with supplier(sim, monkeypatch):
        done = sync(capsys, db_url, "--trigger-id", "night-1")
    assert done.code == 0, done
    assert "Traceback" not in done.err
    batch = batch_of(db_url, "night-1")
    assert done.lines[0] == f"batch {batch.batch_id}: SUCCESS (3/3 cities)"
    assert f"dead letters {len(truth.bad)} + skipped 0" in done.out
    assert "DOES NOT ADD UP" not in done.out
    assert published(db_url) == dict(truth.valid)

    status = run(capsys, "--db-url", db_url, "status")
    assert status.code == 0
    assert status.lines[0].startswith(f"{batch.batch_id}  {TASK}  SUCCESS ")
    assert "3/3 cities" in status.out and f"ok={len(truth.valid)}" in status.out
    detail = run(capsys, "--db-url", db_url, "status", "--batch", batch.batch_id)
    shard_lines = [ln for ln in detail.lines if ln.startswith("    ")]
    assert sorted(ln.split()[0] for ln in shard_lines) == sorted(
        repr(c) for c in truth.valid_by_city
    )
    assert all(" SUCCESS " in ln for ln in shard_lines)
    unknown = run(capsys, "--db-url", db_url, "status", "--batch", "b_nope")
    assert "b_nope" in assert_one_line_error(unknown, code=2)

    stalls = run(capsys, "--db-url", db_url, "stalls")
    assert (stalls.code, stalls.out) == (0, "no stalled shards\n")

    hotels = run(capsys, "--db-url", db_url, "export", "published")
    assert hotels.code == 0 and hotels.err == f"exported {len(truth.valid)} published\n"
    rows = [json.loads(line) for line in hotels.lines]
    assert {r["supplier_hotel_id"]: r["supplier_version"] for r in rows} == dict(truth.valid)
    assert all(r["offers"] and r["publish_version"] == 1 for r in rows)

    letters = run(capsys, "--db-url", db_url, "export", "dead-letters", "--batch", batch.batch_id)
    assert letters.code == 0
    dead = [json.loads(line) for line in letters.lines]
    assert {d["supplier_hotel_id"] for d in dead} == set(truth.bad)
    assert all(d["status"] == "MANUAL_FIX" and d["error_code"] for d in dead)
    assert run(capsys, "--db-url", db_url, "export", "dead-letters", "--batch", "b_x").out == ""

    diffs = run(capsys, "--db-url", db_url, "export", "diffs", "--batch", batch.batch_id)
    assert diffs.code == 0
    logged = [json.loads(line) for line in diffs.lines]
    assert len(logged) == len(truth.valid)
    assert {(d["diff_type"], d["action"]) for d in logged} == {("NEW", "AUTO_PUBLISH")}


def test_a_shard_whose_worker_vanished_is_listed_by_stalls(
    db_url: str, capsys: pytest.CaptureFixture[str]
):
    db = SyncDatabase.open(db_url)
    upsert_task(db, TaskSpec(task_code=TASK, supplier_id=1001))
    batch = create_batch(
        db, task_code=TASK, trigger_id="t-1", trigger_source="MANUAL", shard_keys=["São Paulo"]
    ).batch
    assert batch is not None
    # Claimed an hour ago by a worker that never came back: its lease (180 s) has expired.
    db.clock.advance(-3600)
    claim_shard(db, batch.batch_id, "São Paulo", worker_id="w-gone")
    db.dispose()
    stalls = run(capsys, "--db-url", db_url, "stalls")
    assert stalls.code == 0
    assert len(stalls.lines) == 1 and stalls.lines[0].startswith("LEASE_EXPIRED ")
    assert f"batch={batch.batch_id} city='São Paulo' worker=w-gone" in stalls.out


# --- review list / approve / reject -------------------------------------------------------


def test_review_list_reject_and_approve_publish_what_was_held(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    sim = simulator(daily_price_change_rate=0.3, price_shock_rate=0.4)
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url, "--trigger-id", "day-0").code == 0
        sim.advance_day()
        day1 = sync(capsys, db_url, "--trigger-id", "day-1", "--json")
    assert day1.code == 0, day1
    summary = json.loads(day1.out)
    truth = sim.ground_truth()
    shocks = set(truth.price_shocks)
    assert shocks and summary["diffs_by_action"]["REVIEW"] == len(shocks)
    before = published(db_url)
    assert all(before[h] < truth.valid[h] for h in shocks)  # held back

    listed = run(capsys, "--db-url", db_url, "review", "list", "--batch", summary["batch_id"])
    assert listed.code == 0
    assert listed.err == f"reviews by status: {{'PENDING': {len(shocks)}}}\n"
    assert len(listed.lines) == len(shocks)
    assert all(" PENDING " in ln and "PRICE_CHANGED" in ln for ln in listed.lines)
    as_json = run(capsys, "--db-url", db_url, "review", "list", "--json")
    reviews = [json.loads(line) for line in as_json.lines]
    assert {rv["supplier_hotel_id"] for rv in reviews} == shocks
    first, rest = reviews[0], reviews[1:]

    rejected = run(
        capsys,
        "--db-url",
        db_url,
        "review",
        "reject",
        first["review_id"],
        "--by",
        "carol",
        "--reason",
        "feed error",
    )
    assert rejected.code == 0, rejected
    assert json.loads(rejected.out) == {
        "approved": 0,
        "rejected": 1,
        "published": 0,
        "superseded": 0,
    }
    again = run(
        capsys,
        "--db-url",
        db_url,
        "review",
        "approve",
        first["review_id"],
        "--by",
        "carol",
        "--reason",
        "changed my mind",
    )
    assert "must all be PENDING" in assert_one_line_error(again, code=2)
    nothing = run(capsys, "--db-url", db_url, "review", "approve", "--by", "c", "--reason", "r")
    assert "--all" in assert_one_line_error(nothing, code=2)

    approved = run(
        capsys,
        "--db-url",
        db_url,
        "review",
        "approve",
        "--all",
        "--batch",
        summary["batch_id"],
        "--by",
        "carol",
        "--reason",
        "real price rise",
    )
    assert approved.code == 0, approved
    assert json.loads(approved.out) == {
        "approved": len(rest),
        "rejected": 0,
        "published": len(rest),
        "superseded": 0,
    }
    after = published(db_url)
    assert {rv["supplier_hotel_id"]: after[rv["supplier_hotel_id"]] for rv in rest} == {
        rv["supplier_hotel_id"]: truth.valid[rv["supplier_hotel_id"]] for rv in rest
    }
    assert after[first["supplier_hotel_id"]] == before[first["supplier_hotel_id"]]  # rejected
    trail = run(capsys, "--db-url", db_url, "audit", "--target-type", "review", "--json")
    entries = [json.loads(line) for line in trail.lines]
    assert sorted((e["action"], e["target_id"]) for e in entries) == sorted(
        [("review.reject", first["review_id"])]
        + [("review.approve", rv["review_id"]) for rv in rest]
    )
    assert {
        (e["actor"], e["after"]["status"]) for e in entries if e["action"] == "review.approve"
    } == {("carol", "APPROVED")}
    decided = run(capsys, "--db-url", db_url, "review", "list", "--status", "ALL")
    assert decided.err == (
        f"reviews by status: {{'APPROVED': {len(rest)}, 'REJECTED': 1}}\n"
    ) or decided.err == (f"reviews by status: {{'REJECTED': 1, 'APPROVED': {len(rest)}}}\n")
    assert run(capsys, "--db-url", db_url, "review", "list").lines == []


# --- a gated sync, gate show / override / thresholds ---------------------------------------


def test_a_gated_sync_says_so_in_one_line_and_an_override_lets_the_city_publish(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    sim = simulator(faults={"location_rename_from_day": 1})
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url, "--trigger-id", "day-0").code == 0
        before = published(db_url)
        sim.advance_day()  # every record now has `location` instead of `geo`
        gated = sync(capsys, db_url, "--trigger-id", "day-1")
        line = assert_one_line_error(gated)
        batch = batch_of(db_url, "day-1")
        cities = sorted(sim.ground_truth().valid_by_city)
        assert line.startswith("supplier-sync: 3 cities stopped by a quality gate (")
        assert all(f"{c!r}: schema_drift" in line for c in cities)
        assert f"see supplier-sync gate show --batch {batch.batch_id} --city " in line
        assert gated.lines[0] == f"batch {batch.batch_id}: FAILED (3/3 cities)"
        assert any(ln.startswith("gated cities: ") for ln in gated.lines)
        assert published(db_url) == before  # the gate published nothing

        city = cities[0]
        shown = run(
            capsys, "--db-url", db_url, "gate", "show", "--batch", batch.batch_id, "--city", city
        )
        assert shown.code == 0
        drift = next(ln for ln in shown.lines if ln.startswith("schema_drift"))
        assert drift.split()[1] == "FAILED" and "location" in shown.out

        for check in ("schema_drift", "bad_record_ratio"):
            override = run(
                capsys,
                "--db-url",
                db_url,
                "gate",
                "override",
                "--batch",
                batch.batch_id,
                "--city",
                city,
                "--check",
                check,
                "--by",
                "bob",
                "--reason",
                "rename confirmed",
            )
            assert override.code == 0, override
            assert json.loads(override.out)["overridden_by"] == "bob"
            assert override.err == "re-run the city (the same launch) to publish it\n"
        bad = run(
            capsys,
            "--db-url",
            db_url,
            "gate",
            "override",
            "--batch",
            batch.batch_id,
            "--city",
            city,
            "--check",
            "schema_drift",
            "--by",
            "",
            "--reason",
            "x",
        )
        assert_one_line_error(bad, code=2)
        trail = run(capsys, "--db-url", db_url, "audit", "--target-type", "gate_check", "--json")
        assert sorted(json.loads(line)["target_id"] for line in trail.lines) == [
            f"{batch.batch_id}/{city}/{check}" for check in ("bad_record_ratio", "schema_drift")
        ]

        # The same launch again: the overridden city publishes, the others stay gated.
        rerun = sync(capsys, db_url, "--trigger-id", "day-1")
    line = assert_one_line_error(rerun)
    assert "2 cities stopped by a quality gate" in line and repr(city) not in line
    s = schema.shard.c
    statuses = dict(
        query(db_url, sa.select(s.shard_key, s.status).where(s.batch_id == batch.batch_id))
    )
    assert statuses == {c: "SUCCESS" if c == city else "FAILED" for c in cities}
    shown = run(
        capsys, "--db-url", db_url, "gate", "show", "--batch", batch.batch_id, "--city", city
    )
    assert next(ln for ln in shown.lines if ln.startswith("schema_drift")).split()[1] == (
        "overridden"
    )


def test_gate_thresholds_show_and_set(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    shown = run(capsys, "--db-url", db_url, "gate", "thresholds")
    assert shown.code == 0
    defaults = json.loads(shown.out)
    assert defaults["max_bad_ratio"] == 0.2
    who_why = ("--by", "dana", "--reason", "r")
    early = run(
        capsys, "--db-url", db_url, "gate", "thresholds", "--max-bad-ratio", "0.3", *who_why
    )
    assert f"unknown task {TASK!r}" in assert_one_line_error(early, code=2)
    with supplier(simulator(n_cities=2, total_hotels=100), monkeypatch):
        assert sync(capsys, db_url).code == 0  # the task exists once it has synced
    changed = run(
        capsys,
        "--db-url",
        db_url,
        "gate",
        "thresholds",
        "--max-bad-ratio",
        "0.35",
        "--min-previous-records",
        "50",
        "--by",
        "dana",
        "--reason",
        "more bad rows expected",
    )
    assert changed.code == 0
    assert json.loads(changed.out) == {
        **defaults,
        "max_bad_ratio": 0.35,
        "min_previous_records": 50,
    }
    assert json.loads(run(capsys, "--db-url", db_url, "gate", "thresholds").out) == json.loads(
        changed.out
    )
    g = schema.gate_threshold.c
    assert query(db_url, sa.select(g.task_code, g.updated_by)) == [(TASK, "dana")]
    other = run(capsys, "--db-url", db_url, "gate", "thresholds", "--task", "other_task")
    assert json.loads(other.out) == defaults  # thresholds are per task
    refused = run(
        capsys, "--db-url", db_url, "gate", "thresholds", "--max-bad-ratio", "1.5", *who_why
    )
    assert "max_bad_ratio" in assert_one_line_error(refused, code=2)


# --- a skipped sync -----------------------------------------------------------------------


def test_a_skipped_sync_says_why_in_one_line(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    sim = simulator()
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url, "--trigger-id", "night-1").code == 0
        # Another launch is syncing right now: its city holds a live lease.
        db = SyncDatabase.open(db_url)
        city = sorted(sim.ground_truth().valid_by_city)[0]
        running = create_batch(
            db, task_code=TASK, trigger_id="ui-launch", trigger_source="MANUAL", shard_keys=[city]
        ).batch
        assert running is not None
        other = make_worker_id("other")
        claim_shard(db, running.batch_id, city, worker_id=other)
        db.dispose()
        skipped = sync(capsys, db_url, "--trigger-id", "night-2")
        verbose = run(capsys, "-v", "--db-url", db_url, "sync", "--full", "--trigger-id", "night-2")
    # The blocking batch, and what keeps it alive: its city's lease, whose and until when.
    reason = f"SKIP_IF_RUNNING: batch {running.batch_id} is RUNNING (shard {city!r} is leased to {other} until "
    line = assert_one_line_error(skipped)
    assert line.startswith(f"supplier-sync: sync skipped: {reason}") and line.endswith(")"), line
    assert skipped.lines[0].startswith(f"trigger night-2: no batch (skipped: {reason}")
    b = schema.batch.c
    assert query(db_url, sa.select(b.trigger_id).order_by(b.id)) == [("night-1",), ("ui-launch",)]
    # -v shows the run's own log (the step failure among it) for debugging, then the line.
    assert verbose.code == 1 and "STEP_FAILURE" in verbose.err
    assert verbose.err.splitlines()[-1] == line


# --- replay -------------------------------------------------------------------------------


def test_replay_with_and_without_dry_run_reads_stored_pages_only(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    no_task = run(capsys, "--db-url", db_url, "replay", "--city", "X", "--dry-run")
    assert f"unknown task {TASK!r}" in assert_one_line_error(no_task, code=2)
    sim = simulator(faults={"bad_record_rate": 0.05})
    truth = sim.ground_truth()
    city = max(truth.valid_by_city, key=lambda c: len(truth.valid_by_city[c]))
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url, "--trigger-id", "night-1").code == 0
    requests = sim.stats["requests_total"]
    source = batch_of(db_url, "night-1").batch_id
    # A replay needs no supplier: none is configured, and the server is gone.
    monkeypatch.delenv("SUPPLIER_SYNC_SUPPLIER_URL")
    before = published(db_url)

    dry = run(capsys, "--db-url", db_url, "replay", "--city", city, "--dry-run", "--json")
    assert dry.code == 0, dry
    assert dry.err == ""
    (report,) = [json.loads(line) for line in dry.lines]
    letters = set(truth.listed_by_city[city]) & set(truth.bad)
    assert letters
    assert report["city_code"] == city and report["source_batch_id"] == source
    assert report["records"] == len(truth.valid_by_city[city]) + len(letters)
    assert report["dead_letters"] == len(letters)
    assert report["diffs_by_type"] == {"NO_CHANGE": len(truth.valid_by_city[city])}
    assert [b.trigger_id for b in query(db_url, sa.select(schema.batch))] == [
        "night-1"
    ]  # no writes

    replayed = run(
        capsys, "--db-url", db_url, "replay", "--city", city, "--trigger-id", "fix-1", "--json"
    )
    assert replayed.code == 0, replayed
    assert "Traceback" not in replayed.err
    summary = json.loads(replayed.out)
    assert summary["status"] == "SUCCESS" and summary["trigger_id"] == "fix-1"
    assert (summary["cities"], summary["records"]) == (1, report["records"])
    assert summary["diffs_by_type"] == {"NO_CHANGE": len(truth.valid_by_city[city])}
    replay_batch = batch_of(db_url, "replay:fix-1")
    assert (replay_batch.trigger_source, replay_batch.status) == ("COMPENSATION", "SUCCESS")
    assert summary["batch_id"] == replay_batch.batch_id
    assert sim.stats["requests_total"] == requests  # not one supplier request
    assert published(db_url) == before

    unknown = run(capsys, "--db-url", db_url, "replay", "--city", "Atlantis", "--dry-run")
    assert "'Atlantis' has no stored raw pages" in assert_one_line_error(unknown)
    some = run(
        capsys,
        *("--db-url", db_url, "replay", "--city", "Atlantis", "--city", city),
        *("--dry-run", "--json"),
    )
    assert some.code == 1 and "'Atlantis' has no stored raw pages" in some.err
    assert json.loads(some.out)["city_code"] == city
    other_task = run(capsys, "--db-url", db_url, "replay", "--city", city, "--task", "nope")
    assert "unknown task 'nope'" in assert_one_line_error(other_task, code=2)


def test_a_city_whose_stored_pages_are_lost_fails_the_replay_in_one_line(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    sim = simulator()
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url, "--trigger-id", "night-1").code == 0
    lost, kept = sorted(sim.ground_truth().valid_by_city)[:2]
    s = schema.snapshot.c
    refs = query(
        db_url,
        sa.select(s.payload_ref).where(s.shard_key == lost, s.snapshot_type == "RAW"),
    )
    assert refs
    for (ref,) in refs:
        Path(unquote(urlparse(ref).path)).unlink()

    dry = run(capsys, "--db-url", db_url, "replay", "--city", lost, "--dry-run")
    assert assert_one_line_error(dry, code=2).startswith(
        "supplier-sync: error: no payload stored at "
    )
    replay = run(
        capsys,
        "--db-url",
        db_url,
        "replay",
        "--city",
        lost,
        "--city",
        kept,
        "--trigger-id",
        "fix-1",
    )
    line = assert_one_line_error(replay)
    # The city's code first (a lost payload is not the supplier's: INTERNAL_ERROR).
    assert line.startswith(f"supplier-sync: sync failed: 1 city of 2 failed ({lost!r}: ")
    assert f"{lost!r}: INTERNAL_ERROR: PayloadNotFound: " in line
    assert line.endswith("; resume with --trigger-id fix-1")
    assert any(ln.startswith("failed cities: ") for ln in replay.lines)
    sh = schema.shard.c
    batch = batch_of(db_url, "replay:fix-1")
    statuses = dict(
        query(db_url, sa.select(sh.shard_key, sh.status).where(sh.batch_id == batch.batch_id))
    )
    assert statuses == {lost: "FAILED", kept: "SUCCESS"}


# --- demo, lease-demo ---------------------------------------------------------------------


def test_demo_syncs_the_embedded_supplier_and_moves_it_to_the_next_day(
    db_url: str, capsys: pytest.CaptureFixture[str], cli_home: Path
):
    demo = run(
        capsys,
        *("--db-url", db_url, "demo", "--cities", "4", "--hotels", "300"),
        *("--second-hotels", "200", "--second-cities", "3"),
    )
    assert demo.code == 0, demo
    assert "Traceback" not in demo.err
    assert demo.lines[0].startswith("demo: a full sync through Dagster of the simulated supplier")
    assert "(day 0, 4 cities, 300 hotels, flaky profile)" in demo.lines[0]
    # 4 cities and the flaky profile's few hostile city codes, every one synced
    done = re.search(r": SUCCESS \((\d+)/(\d+) cities\)", demo.out)
    assert done and done[1] == done[2] and int(done[1]) >= 4, demo.out
    assert "DOES NOT ADD UP" not in demo.out
    n = int(demo.out.split(" = published ")[1].split()[0])
    second = int(demo.out.split(" = published ")[2].split()[0])
    h = schema.platform_hotel.c
    by_supplier = dict(
        query(db_url, sa.select(h.supplier_id, sa.func.count()).group_by(h.supplier_id))
    )
    assert n > 250 and by_supplier == {1001: n, 2002: second} and second > 150
    assert f"supplier 1001: {n} hotels, supplier 2002: {second} hotels" in demo.out
    assert demo.lines[-1].startswith("run `supplier-sync demo` again: the suppliers move to day 1")
    state = json.loads((cli_home / "home" / "demo_state.json").read_text())
    assert state == {"next_day": 1}


def test_lease_demo_kills_a_worker_and_the_other_resumes_its_city(
    db_url: str, capsys: pytest.CaptureFixture[str]
):
    demo = run(capsys, "--db-url", db_url, "lease-demo", "--lease-seconds", "5")
    assert demo.code == 0, demo.out + demo.err
    assert "KILLED (exit 137)" in demo.out and "resuming at page" in demo.out
    assert demo.lines[-1] == "ALL CHECKS PASSED"
    b = schema.batch.c
    assert [r.status for r in query(db_url, sa.select(b.status))] == ["SUCCESS"]
    with pytest.raises(SystemExit) as out_of_range:  # refused as the command line is read
        run(capsys, "--db-url", db_url, "lease-demo", "--lease-seconds", "1")
    assert out_of_range.value.code == 2
    assert "--lease-seconds: must be within 5..1800, not 1" in capsys.readouterr().err


# --- simulate, daemon (processes that serve until stopped) ---------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_simulate_serves_the_contract_over_http(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    port = _free_port()
    proc = subprocess.Popen(
        [
            str(CONSOLE_SCRIPT),
            "simulate",
            "--port",
            str(port),
            "--cities",
            "4",
            "--hotels",
            "200",
            "--hostile-city-codes",
            "--api-key",
            "k1",
            "--data-profile",
            "rich",
            "--rooms-per-hotel",
            "2,2",
            "--non-ascii-share",
            "1",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                resp = httpx.get(f"http://127.0.0.1:{port}/v1/cities", headers={"X-Api-Key": "k1"})
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "simulator did not start"
                time.sleep(0.2)
        assert resp.status_code == 200
        codes = {c["city_code"] for c in resp.json()["cities"]}
        assert "../../etc" in codes and len(codes) >= 4
        assert httpx.get(f"http://127.0.0.1:{port}/v1/cities").status_code == 401
        city = next(c for c in resp.json()["cities"] if c["hotel_count"])["city_code"]
        page = httpx.get(
            f"http://127.0.0.1:{port}/v1/cities/{encode_city_code(city)}/hotels",
            headers={"X-Api-Key": "k1"},
        ).json()["hotels"]
        assert page and all(len(h["rooms"]) == 2 and h["description"] for h in page)
        assert not any(h["name"].isascii() for h in page)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0].decode()
    assert out.startswith(f"supplier simulator on http://127.0.0.1:{port} (4 cities, 200 hotels")
    assert "Traceback" not in out
    unknown = run(capsys, "simulate", "--profile", "nope")
    assert "unknown fault profile 'nope'" in assert_one_line_error(unknown, code=2)
    for argv, says in (
        (["--data-profile", "huge"], "unknown data profile 'huge'; known: standard, rich"),
        (["--rooms-per-hotel", "1,99"], "rooms_per_hotel must satisfy 1 <= low <= high <= 14"),
        (["--non-ascii-share", "2"], "non_ascii_share must be within [0, 1], got 2.0"),
    ):
        refused = run(capsys, "simulate", *argv)
        assert says in assert_one_line_error(refused, code=2), argv
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["simulate", "--description-chars", "9,3"])
    assert "--description-chars: LOW must not exceed HIGH" in capsys.readouterr().err


def test_daemon_comes_up_heartbeats_and_stops_on_sigterm(tmp_path: Path):
    home = tmp_path / "daemon_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((ROOT / "dagster.yaml").read_text())
    env = dict(os.environ, DAGSTER_HOME=str(home), SUPPLIER_SYNC_HOME=str(tmp_path / "state"))
    proc = subprocess.Popen(
        [str(CONSOLE_SCRIPT), "daemon", "-w", "workspace.yaml"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        deadline = time.monotonic() + 60
        expected = {"SCHEDULER", "SENSOR", "BACKFILL", "QUEUED_RUN_COORDINATOR"}
        while not expected <= set(instance.get_daemon_heartbeats()):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the daemon did not heartbeat"
            time.sleep(0.5)
        statuses = instance.get_daemon_statuses(list(expected))
        assert all(s.healthy for s in statuses.values()), statuses
    finally:
        # SIGTERM to the daemon alone, as `kill PID` or `docker stop` sends it: the daemon stops
        # its threads and then its code server. A signal to the whole group would also kill the
        # code server under a sensor tick that is running, and Dagster logs that tick's error.
        proc.send_signal(signal.SIGTERM)
        try:
            out = proc.communicate(timeout=60)[0].decode()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever the daemon left behind
            instance.dispose()
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "Daemon threads shut down." in out
    # Dagster's daemon logs through its own handlers: each line once, not twice.
    assert out.count("Instance is configured with the following daemons") == 1


# --- the shell's view: a closed pipe, errors ----------------------------------------------


def test_export_into_a_pipe_closed_early_exits_quietly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    db_url = f"sqlite:///{tmp_path}/sync.sqlite3"
    with supplier(simulator(total_hotels=600), monkeypatch):
        assert sync(capsys, db_url).code == 0
    size = sum(
        len(line) + 1 for line in run(capsys, "--db-url", db_url, "export", "published").lines
    )
    assert size > 1_000_000  # far more than a pipe holds: the writer meets the closed end
    script = (
        f"{CONSOLE_SCRIPT} --db-url {db_url} export published 2>{tmp_path}/err | head -1 "
        f'>{tmp_path}/out; echo "${{PIPESTATUS[0]}}"'
    )
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "141"  # 128 + SIGPIPE, as a shell reports `yes | head -1`
    assert (tmp_path / "err").read_text() == ""
    assert json.loads((tmp_path / "out").read_text())["supplier_hotel_id"]


def test_bad_input_and_unexpected_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    wrong = run(capsys, "--db-url", "postgresql://x@y/z", "status")
    line = assert_one_line_error(wrong, code=2)  # the option that gave it is named
    assert "--db-url uses backend 'postgresql'" in line and "SUPPLIER_SYNC_DB_URL" not in line
    not_a_db = tmp_path / "garbage.sqlite3"
    not_a_db.write_bytes(b"this is not a database" * 100)
    garbage = run(capsys, "--db-url", f"sqlite:///{not_a_db}", "status")
    line = assert_one_line_error(garbage)
    assert "DatabaseError" in line and line.endswith("(run with -v for the traceback)")
    verbose = run(capsys, "-v", "--db-url", f"sqlite:///{not_a_db}", "status")
    assert verbose.code == 1 and "Traceback" in verbose.err  # -v keeps it for debugging
    assert verbose.err.splitlines()[-1].startswith("supplier-sync: error: DatabaseError: ")


def test_cli_syncs_two_cities_at_once_unless_told_otherwise(capsys: pytest.CaptureFixture[str]):
    parser = cli.build_parser()
    args = parser.parse_args(["sync", "--full"])
    assert args.city_threads == CLI_CITY_THREADS == 2
    assert parser.parse_args(["sync", "--full", "--city-threads", "1"]).city_threads == 1
    assert parser.parse_args(["demo", "--city-threads", "3"]).city_threads == 3
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["demo", "--city-threads", "0"])
    assert exited.value.code == 2
    assert "--city-threads: must be within 1..64, not 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["sync", "--full", "--city-threads", "two"])
    assert "--city-threads: must be a whole number, not 'two'" in capsys.readouterr().err


def test_sync_full_in_worker_processes_publishes_the_ground_truth(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    sim = simulator(n_cities=5, total_hotels=600, faults={"bad_record_rate": 0.05})
    with supplier(sim, monkeypatch):
        done = sync(capsys, db_url, "--processes", "2", "--json", "--trigger-id", "procs-1")
    assert done.code == 0, done
    summary = json.loads(done.out)
    truth = sim.ground_truth()
    assert summary["status"] == "SUCCESS" and summary["counts_add_up"]
    assert summary["published"] == len(truth.valid)
    assert published(db_url) == truth.valid
    # The cities were synced by the worker processes, under their own leases.
    s = schema.shard.c
    holders = {w for (w,) in query(db_url, sa.select(s.worker_id))}
    assert holders and all(w and f"-{os.getpid()}-" not in w for w in holders)


def test_sync_full_of_a_rich_world_publishes_its_text_unchanged(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    # Large hotels whose names, streets, captions and room names are in many scripts (CJK,
    # Arabic, emoji joined by ZERO WIDTH JOINER, beyond the BMP), some records bad.
    sim = simulator(
        n_cities=4, total_hotels=240, data_profile="rich", faults={"bad_record_rate": 0.05}
    )
    truth = sim.ground_truth()
    assert truth.bad
    with supplier(sim, monkeypatch):
        done = sync(capsys, db_url, "--json", "--trigger-id", "rich-1")
    assert done.code == 0, done
    summary = json.loads(done.out)
    assert summary["status"] == "SUCCESS" and summary["counts_add_up"]
    assert published(db_url) == dict(truth.valid)

    # Only the bad records are dead letters: no valid rich record is.
    letters = run(capsys, "--db-url", db_url, "export", "dead-letters")
    assert {json.loads(line)["supplier_hotel_id"] for line in letters.lines} == set(truth.bad)

    # Every published text is the supplier's, character for character.
    world = sim.world
    records = {
        hotel_id(num): world.valid_record(city, state.hotels[num])
        for city, state in world.all_states(0)
        for num in state.ids
    }
    exported = run(capsys, "--db-url", db_url, "export", "published")
    rows = [json.loads(line) for line in exported.lines]
    assert len(rows) == len(truth.valid)
    foreign = 0
    for row in rows:
        rec = records[row["supplier_hotel_id"]]
        assert row["name"] == rec["name"]
        assert row["name_local"] == rec["name_local"]
        assert row["address_line1"] == rec["address"]["line1"]
        assert [i["caption"] for i in row["images"]] == [i["caption"] for i in rec["images"]]
        rooms = {r["room_code"]: r["name"] for r in rec["rooms"]}
        assert {o["room_code"]: o["room_name"] for o in row["offers"]} == rooms
        assert len(row["offers"]) == sum(len(r["rate_plans"]) for r in rec["rooms"])
        foreign += not row["name"].isascii()
    assert foreign > len(rows) // 2
    assert any(
        "\u200d" in r["name"] or any("\u200d" in i["caption"] for i in r["images"]) for r in rows
    )


def test_processes_option(capsys: pytest.CaptureFixture[str]):
    parser = cli.build_parser()
    assert parser.parse_args(["sync", "--full"]).processes is None
    assert parser.parse_args(["sync", "--full", "--processes", "0"]).processes == 0
    assert parser.parse_args(["demo", "--processes", "3"]).processes == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["sync", "--full", "--processes", "-1"])
    assert "--processes: must be within 0..64, not -1" in capsys.readouterr().err


def test_console_script_passes_its_exit_status_and_output_through_the_quick_exit(
    tmp_path: Path,
) -> None:
    db_url = f"sqlite:///{tmp_path / 'sync.sqlite3'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPPLIER_SYNC_")}
    env["SUPPLIER_SYNC_HOME"] = str(tmp_path / "home")
    SyncDatabase.open(db_url).dispose()  # status only reads: the database must be there
    ok = subprocess.run(
        [str(CONSOLE_SCRIPT), "--db-url", db_url, "status"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "no batches\n", "")
    unknown = subprocess.run(
        [str(CONSOLE_SCRIPT), "--db-url", db_url, "status", "--batch", "b_nope"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.startswith("supplier-sync: error: ") and "b_nope" in unknown.stderr


def test_exit_quickly_waits_for_threads_runs_exit_handlers_and_flushes(tmp_path: Path) -> None:
    script = (
        "import atexit, sys, threading, time\n"
        "from supplier_sync_dagster.cli.main import exit_quickly\n"
        "atexit.register(lambda: sys.stdout.write('handler ran\\n'))\n"
        "def late():\n"
        "    time.sleep(0.3)\n"
        "    sys.stdout.write('thread done\\n')\n"
        "threading.Thread(target=late).start()\n"
        "sys.stdout.write('buffered, not flushed\\n')\n"
        "exit_quickly(3)\n"
        "print('never')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 3
    assert done.stdout == "buffered, not flushed\nthread done\nhandler ran\n"


def test_console_script_raises_the_collector_threshold_before_the_commands_imports(
    tmp_path: Path,
) -> None:
    # What the command sees: the threshold is raised before main() runs (and so before the
    # imports inside the commands), to the value a sync sets anyway.
    script = (
        "import gc, sys\n"
        "import supplier_sync_dagster.cli.main as cli\n"
        "assert 'dagster' not in sys.modules, 'the CLI module itself stays light'\n"
        "cli.main = lambda: print(gc.get_threshold()[0]) or 0\n"
        "cli.run()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert (done.returncode, done.stderr) == (0, "")

    assert int(done.stdout) == cli.START_GC_THRESHOLD == GC_GEN0_THRESHOLD


def test_ctrl_c_while_the_arguments_are_read_is_one_line_and_130(tmp_path: Path) -> None:
    # main() handles an interrupt once the command runs; one while it reads its arguments
    # (argparse, locale) reaches the console script, which says so in one line.
    script = (
        "import supplier_sync_dagster.cli.main as cli\n"
        "def main():\n"
        "    raise KeyboardInterrupt\n"
        "cli.main = main\n"
        "cli.run()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert (done.returncode, done.stderr) == (
        130,
        "supplier-sync: interrupted before the command started\n",
    )


def test_ctrl_c_while_the_command_loads_is_not_lost_to_a_library_that_swallows_it(
    tmp_path: Path,
) -> None:
    # A module imported while the command loads catches everything (as a bare except, or a
    # finalizer, would): the interrupt is still the command's end, in one line.
    (tmp_path / "swallowing.py").write_text(
        "import os, signal, time\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.2)\n"
        "except BaseException:\n"
        "    pass\n"
    )
    script = (
        "import sys\n"
        "import supplier_sync_dagster.cli.main as cli\n"
        "cli._preload_name = lambda argv: 'swallowing'\n"
        "def main():\n"
        "    print('the command ran')\n"
        "    return 0\n"
        "cli.main = main\n"
        "cli.run()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        130,
        "",
        "supplier-sync: interrupted before the command started\n",
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # A command that runs Dagster: its modules are loaded before main(), with the
        # collector off, then frozen; the collector is on again when the command starts.
        (["sync", "--incremental"], "True True True 50000"),
        (["reconcile", "--no-repull"], "True True True 50000"),
        # A light command loads nothing first; --help and a usage error are main()'s to say.
        (["status"], "True False False 50000"),
        (["sync", "--help"], "True False False 50000"),
        (["no-such-command"], "True False False 50000"),
    ],
)
def test_console_script_loads_a_dagster_commands_modules_first_with_the_collector_off(
    tmp_path: Path, argv: list[str], expected: str
) -> None:
    script = (
        "import gc, sys\n"
        "import supplier_sync_dagster.cli.main as cli\n"
        f"sys.argv = ['supplier-sync', *{argv!r}]\n"
        "cli.main = lambda: print(gc.isenabled(), gc.get_freeze_count() > 100_000,\n"
        "    'supplier_sync_dagster.cli.sync_runner' in sys.modules, gc.get_threshold()[0]) or 0\n"
        "cli.run()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert (done.returncode, done.stderr, done.stdout.strip()) == (0, "", expected)
