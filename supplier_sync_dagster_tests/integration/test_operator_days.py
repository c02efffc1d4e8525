"""An operator's week with ``supplier-sync`` (issue 40), on SQLite and MariaDB, every step a
command as the operator types it (``main([...])``, or the console script where two syncs
race) against the simulator over HTTP:

- day 0: the first full sync (one city the supplier does not list yet);
- day 1: the supplier drops a city and adds one: the sync succeeds, the dropped city
  retires (its partition leaves the active set), the new one gets its partition;
- day 2: one city's hotel pages answer 503: the sync fails for it alone and files one
  ticket; the supplier mends it and a compensation pass re-syncs it;
- the same bad record seen by every sync keeps one ticket, counted; an operator fixes one;
- day 3: the dropped city is listed again; the task is set to CANCEL_PREVIOUS and a second
  sync cancels a trickling first one, which stops within seconds with exit 3; the second
  brings the city back;
- day 4: a city fails to parse, the sync fails, the operator resumes it with its trigger id.

At the end the catalog is the supplier's truth (with the operator's fix), each problem has
one ticket, the fix rate is what happened, and every city's partition status is true.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.records.tombstones import TOMBSTONE_FINGERPRINT
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.dagster_instance.deployment import ASSETS
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE
from supplier_sync_dagster.defs.partitions import CITY_PARTITIONS, decode_city_key
from supplier_sync_dagster.simulator import FaultProfile, Simulator, running_server
from supplier_sync_dagster_tests.cli.test_dead_letter_tickets import (
    FIXES,
    OPEN,
    all_due,
    dead_letters,
    fix_rate,
)
from supplier_sync_dagster_tests.cli.test_main import (
    Outcome,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    published,
    query,
    run,
)
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, cli_process, make_simulator


def _sync(capsys: pytest.CaptureFixture[str], db_url: str, *extra: str) -> Outcome:
    return run(capsys, "--db-url", db_url, "sync", "--full", "--page-size", "50", *extra)


def _ok(outcome: Outcome) -> Outcome:
    assert outcome.code == 0, outcome
    return outcome


def _partitions() -> set[str]:
    with dg.DagsterInstance.get() as instance:
        return {decode_city_key(k) for k in instance.get_dynamic_partitions(CITY_PARTITIONS)}


def _partition_statuses() -> dict[str, dict[str, str]]:
    """Asset -> active city -> its partition status as the UI shows it."""
    with dg.DagsterInstance.get() as instance:
        keys = instance.get_dynamic_partitions(CITY_PARTITIONS)
        out: dict[str, dict[str, str]] = {}
        for asset in ASSETS:
            found = instance.get_status_by_partition(
                dg.AssetKey(asset), list(keys), DEFAULT_SCOPE.partitions
            )
            out[asset] = {
                decode_city_key(k): (s.value if (s := (found or {}).get(k)) else "-") for k in keys
            }
    return out


def _batch_status(db_url: str, trigger_id: str) -> str | None:
    b = schema.batch.c
    rows = query(db_url, sa.select(b.status).where(b.trigger_id == trigger_id))
    return str(rows[0].status) if rows else None


def _city_hotels(db_url: str, city: str) -> set[str]:
    """'live' or 'tombstoned' for each of the city's hotels in the catalog."""
    h = schema.platform_hotel.c
    rows = query(db_url, sa.select(h.fingerprint).where(h.city_code == city))
    return {"tombstoned" if f == TOMBSTONE_FINGERPRINT else "live" for (f,) in rows}


def _wait_for(what: str, ready: Any, proc: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the sync ended before {what}: {out[-2000:]} {err[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.1)


def _cancel_previous_day(
    capsys: pytest.CaptureFixture[str], db_url: str, sim: Simulator
) -> tuple[Any, str, float]:
    """Day 3: a trickling ``sync --full`` cancelled by the next trigger (CANCEL_PREVIOUS)."""
    policy = run(
        capsys,
        *("--db-url", db_url, "task", "set", "--policy", "CANCEL_PREVIOUS"),
        *("--by", "ops-anna", "--reason", "a new night supersedes the last"),
    )
    assert policy.code == 0, policy
    sim.set_modes(["slow_body"])
    sim.reset_stats()
    base = ("--db-url", db_url, "sync", "--full", "--page-size", "50")
    first = cli_process(
        *base, "--trigger-id", "day-3a", "--city-threads", "1", env=dict(os.environ)
    )
    try:
        b, s = schema.batch.c, schema.shard.c
        _wait_for(
            "a city of day-3a in flight",
            lambda: (
                bool(
                    query(
                        db_url,
                        sa.select(s.shard_key)
                        .join(schema.batch, b.batch_id == s.batch_id)
                        .where(b.trigger_id == "day-3a", s.status == "RUNNING"),
                    )
                )
                # A page request served while the body trickles: the run is held in it, so
                # clearing the mode cannot let day-3a finish before day-3b cancels it.
                and sim.stats["requests_by_endpoint"].get("city_hotels", 0) >= 1
            ),
            first,
        )
        time.sleep(0.2)  # the trickle is set just after the request is counted
        sim.set_modes([])
        second = _sync(capsys, db_url, "--trigger-id", "day-3b")
        cancelled = time.monotonic()
        _, err = first.communicate(timeout=60)
        took = time.monotonic() - cancelled
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    _ok(second)
    return first, err, took


def test_an_operators_week_ends_true(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = make_simulator(
        FaultProfile.clean().with_(bad_record_rate=0.04),
        seed=54,
        n_cities=6,
        total_hotels=480,
        empty_city_share=0,
    )
    codes = sim.city_codes()
    added, dropped, failing, broken = codes[-1], codes[0], codes[1], codes[2]
    bad = sim.ground_truth().bad
    assert len(bad) >= 2
    by_city = sim.ground_truth().listed_by_city
    # A bad record in a city that stays listed and healthy all week: seen by every sync.
    watched = sorted(h for c in codes[3:-1] for h in by_city[c] if h in bad)
    assert watched, "the world needs a bad record in a steady city"
    with running_server(sim) as url:
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", url)
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", SIM_API_KEY)

        # Day 0: the supplier does not list `added` yet.
        sim.set_modes(["dropped_city"], [added])
        _ok(_sync(capsys, db_url, "--trigger-id", "day-0"))
        assert _partitions() == set(codes) - {added}

        # Day 1: `dropped` goes, `added` comes.
        sim.set_modes(["dropped_city"], [dropped])
        day1 = _ok(_sync(capsys, db_url, "--trigger-id", "day-1"))
        assert "retired cities:" in day1.out and dropped in day1.out
        assert _partitions() == set(codes) - {dropped}

        # Day 2: one city's pages answer 503; the others publish, one ticket for it.
        sim.config = dataclasses.replace(
            sim.config, faults=sim.config.faults.with_(failing_city_codes=(failing,))
        )
        day2 = _sync(capsys, db_url, "--trigger-id", "day-2")
        assert day2.code == 1, day2
        assert "Traceback" not in day2.err
        city_tickets = dead_letters(capsys, db_url, "--code", "CITY_FAILED")
        assert [t["city_code"] for t in city_tickets] == [failing], city_tickets
        # The supplier mends it; the compensation pass re-syncs it and says so.
        sim.config = dataclasses.replace(
            sim.config, faults=sim.config.faults.with_(failing_city_codes=())
        )
        all_due(db_url)
        comp = run(capsys, "--db-url", db_url, "dead-letters", "compensate")
        assert comp.code == 0, comp
        assert "re-synced 1 of 1 failed cities" in comp.out, comp.out
        assert "Traceback" not in comp.err

        # The watched bad record: one ticket, seen by day 0, 1 and 2; the operator fixes it.
        seen = [t for h in watched for t in dead_letters(capsys, db_url, "--hotel", h)]
        assert sorted(t["supplier_resource_code"] for t in seen) == watched  # one each
        assert all(t["seen_count"] == 3 and t["status"] in OPEN for t in seen), seen
        ticket = next(t for t in seen if t["error_code"] in FIXES)
        fixed = run(
            capsys, "--db-url", db_url, "dead-letters", "fix", str(ticket["id"]),
            "--patch", json.dumps(FIXES[ticket["error_code"]]),
            "--by", "ops-anna", "--reason", "the supplier confirmed the value",
        )  # fmt: skip
        assert fixed.code == 0, fixed
        # Two syncs missed the dropped city: its hotels are tombstoned after their grace.
        assert _city_hotels(db_url, dropped) == {"tombstoned"}

        # Day 3: the supplier lists the dropped city again; and CANCEL_PREVIOUS.
        first, err, took = _cancel_previous_day(capsys, db_url, sim)
        assert first.returncode == 3, err[-3000:]
        assert took < 10, (took, err[-3000:])
        assert "cancelled by trigger day-3b" in err and "Traceback" not in err, err[-3000:]
        assert _batch_status(db_url, "day-3a") == "CANCELLED"
        assert _batch_status(db_url, "day-3b") == "SUCCESS"

        # Day 4: a city cannot be parsed; the operator resumes the batch once it mends.
        sim.set_modes(["deep_json"], [broken])
        day4 = _sync(capsys, db_url, "--trigger-id", "day-4")
        assert day4.code == 1 and "--trigger-id day-4" in day4.err, day4
        sim.set_modes([])
        _ok(_sync(capsys, db_url, "--trigger-id", "day-4"))
        assert _batch_status(db_url, "day-4") == "SUCCESS"

    truth = sim.ground_truth()
    fixed_hotel = ticket["supplier_resource_code"]
    # The catalog is the supplier's truth: every valid hotel at its version (the returned
    # city's too), and the operator's fix.
    catalog = published(db_url)
    assert catalog == {**dict(truth.valid), fixed_hotel: catalog[fixed_hotel]}
    assert _city_hotels(db_url, dropped) == {"live"}

    letters = dead_letters(capsys, db_url)
    problem = Counter(
        (d["supplier_resource_code"], d["city_code"], d["error_code"]) for d in letters
    )
    open_problem = Counter(
        (d["supplier_resource_code"], d["city_code"], d["error_code"])
        for d in letters
        if d["status"] in OPEN
    )
    assert max(open_problem.values()) == 1, open_problem  # one open ticket per problem
    # A problem that never went away has one ticket all week, whatever the syncs.
    steady = {h for h in bad if h not in by_city[dropped]}
    assert all(problem[k] == 1 for k in problem if k[0] in steady), problem
    fixed_tickets = [d for d in letters if d["supplier_resource_code"] == fixed_hotel]
    assert [d["status"] for d in fixed_tickets] == ["RESOLVED"], fixed_tickets
    # The cities that failed and were mended: their tickets resolved, none left open.
    city_letters = [d for d in letters if d["error_code"] == "CITY_FAILED"]
    assert {d["city_code"] for d in city_letters} >= {failing}
    assert {d["status"] for d in city_letters} == {"RESOLVED"}, city_letters
    # The bad records still bad stay open: every bad hotel but the fixed one.
    still_bad = {d["supplier_resource_code"] for d in letters if d["status"] in OPEN}
    assert still_bad == set(bad) - {fixed_hotel}
    # The fix rate is what happened: resolved tickets over tickets opened.
    resolved = [d for d in letters if d["status"] == "RESOLVED"]
    assert fix_rate(capsys, db_url) == pytest.approx(len(resolved) / len(letters), abs=1e-4)

    # Every city's partition is materialized: the one that came back too.
    statuses = _partition_statuses()
    assert statuses == {asset: dict.fromkeys(codes, "MATERIALIZED") for asset in ASSETS}
