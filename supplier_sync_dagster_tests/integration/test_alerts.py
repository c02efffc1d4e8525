"""Alerts that fire once and clear, provoked on the simulator over real HTTP and received by a
local webhook, through the CLI as an operator runs it (SQLite and MariaDB).

For each condition: the fault is put in, `supplier-sync alerts check` runs (as the alert
sensor does each minute) and the receiver gets exactly one FIRING message naming the task;
a second check while the fault holds sends nothing; the fault is taken out, and one RESOLVED
message arrives. A receiver that refuses a message gets it again on a later check.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.simulator import FaultProfile, Simulator
from supplier_sync_dagster_tests.cli.test_main import (
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    run,
)
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, Receiver, serve_simulator

TASK = "hotel_supplier_full_resource"


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    with Receiver.serve() as r:
        monkeypatch.setenv("SUPPLIER_SYNC_ALERT_URL", r.url)
        yield r


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> Iterator[Simulator]:
    with serve_simulator(
        FaultProfile(bad_record_rate=0.05),
        seed=29,
        n_cities=4,
        total_hotels=300,
        empty_city_share=0.0,
    ) as (s, url):
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", url)
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", SIM_API_KEY)
        yield s


def _faults(sim: Simulator, **faults: Any) -> None:
    """The request faults of the served simulator (its data, bad records included, stays)."""
    base = FaultProfile(bad_record_rate=sim.config.faults.bad_record_rate)
    sim.config = dataclasses.replace(sim.config, faults=base.with_(**faults))


def _check(capsys: pytest.CaptureFixture[str], db_url: str) -> dict[str, Any]:
    out = run(capsys, "--db-url", db_url, "alerts", "check", "--json")
    assert out.code == 0, out
    return json.loads(out.out)


def _sync(capsys: pytest.CaptureFixture[str], db_url: str) -> int:
    return run(capsys, "--db-url", db_url, "sync", "--full", "--json").code


def _thresholds(capsys: pytest.CaptureFixture[str], db_url: str, *items: str) -> None:
    args = [a for item in items for a in ("--set", item)]
    out = run(
        capsys, "--db-url", db_url, "alerts", "thresholds", *args,
        "--by", "ops-eve", "--reason", "tuned for the test supplier",
    )  # fmt: skip
    assert out.code == 0, out


def test_each_condition_fires_once_and_resolves_once(
    db_url: str, sim: Simulator, receiver: Receiver, capsys: pytest.CaptureFixture[str]
):
    assert _sync(capsys, db_url) == 0
    assert _check(capsys, db_url)["holding"] == [] and receiver.take() == []

    # A dead-letter spike: the day's broken records against quiet days before, once the
    # operator's threshold is below them (the default needs at least 20).
    _thresholds(capsys, db_url, "dead_letter_spike_min=3")
    _check(capsys, db_url)
    assert receiver.take() == [("FIRING", "dead_letter_spike")]
    _check(capsys, db_url)
    assert receiver.take() == []
    _thresholds(capsys, db_url, "dead_letter_spike_min=100000")
    _check(capsys, db_url)
    assert receiver.take() == [("RESOLVED", "dead_letter_spike")]

    _thresholds(capsys, db_url, "consecutive_failed_batches=2", "rate_limit_storm_min_requests=5")

    # N consecutive failed batches: a city the supplier lists but cannot serve.
    city = sorted(sim.ground_truth().listed_by_city)[0]
    _faults(sim, unlisted_hotels_city_codes=(city,))
    assert _sync(capsys, db_url) == 1
    assert "consecutive_failed_batches" not in _check(capsys, db_url)["holding"]  # one so far
    assert _sync(capsys, db_url) == 1
    assert _check(capsys, db_url)["holding"] == ["consecutive_failed_batches"]
    # The message names the task and links the failed batch's run in Dagster.
    (fired,) = receiver.bodies
    assert TASK in fired["text"]
    assert re.search(r"http://localhost:3000/runs/[0-9a-f-]{36}$", fired["text"]), fired["text"]
    assert receiver.take() == [("FIRING", "consecutive_failed_batches")]
    assert _sync(capsys, db_url) == 1
    _check(capsys, db_url)
    assert receiver.take() == []  # it holds: nothing new
    _faults(sim)
    assert _sync(capsys, db_url) == 0
    _check(capsys, db_url)
    assert receiver.take() == [("RESOLVED", "consecutive_failed_batches")]

    # A 429 storm: the supplier throttles half the requests (the client's retries cope).
    _faults(sim, rate_429=0.6, retry_after_seconds=0)
    assert _sync(capsys, db_url) == 0
    _check(capsys, db_url)
    assert receiver.take() == [("FIRING", "rate_limit_storm")]
    _faults(sim)
    assert _sync(capsys, db_url) == 0
    _check(capsys, db_url)
    assert receiver.take() == [("RESOLVED", "rate_limit_storm")]

    # Stuck outbox events: a dispatcher died holding them.
    db = SyncDatabase.open(db_url)
    o = schema.outbox.c
    try:
        with db.begin() as conn:
            ids = list(conn.execute(sa.select(o.id).order_by(o.id).limit(3)).scalars())
            conn.execute(
                sa.update(schema.outbox)
                .where(o.id.in_(ids))
                .values(status="PROCESSING", lease_owner="dead", lease_until=db.clock.now(-60))
            )
    finally:
        db.dispose()
    _check(capsys, db_url)
    assert receiver.take() == [("FIRING", "stuck_outbox")]
    # The channel is down for one message: it arrives on the next check.
    receiver.refuse = 1
    released = run(capsys, "--db-url", db_url, "dispatch", "--once", "--json")
    assert released.code == 0, released
    first = _check(capsys, db_url)
    assert first["failed_deliveries"] == 1 and receiver.take() == []
    _check(capsys, db_url)
    # The retry waits its backoff: make it due.
    db = SyncDatabase.open(db_url)
    try:
        with db.begin() as conn:
            conn.execute(sa.update(schema.alert_delivery).values(next_attempt_at=db.clock.now(-1)))
    finally:
        db.dispose()
    _check(capsys, db_url)
    assert receiver.take() == [("RESOLVED", "stuck_outbox")]

    # A city that had hotels comes back empty (its quality gate stops it, too).
    emptied = sorted(sim.ground_truth().listed_by_city)[1]
    _faults(sim, emptied_city_codes=(emptied,))
    assert _sync(capsys, db_url) == 1
    _check(capsys, db_url)
    assert receiver.take() == [("FIRING", "city_emptied")]
    _faults(sim)
    assert _sync(capsys, db_url) == 0
    _check(capsys, db_url)
    assert receiver.take() == [("RESOLVED", "city_emptied")]

    # The supplier's listings are down: the client's retries fail and its breaker opens
    # (one failing city among healthy ones does not open it: their successes close it).
    _thresholds(capsys, db_url, "breaker_open_minutes=0")
    _faults(sim, failing_city_codes=tuple(sim.ground_truth().listed_by_city))
    assert _sync(capsys, db_url) == 1
    _check(capsys, db_url)
    assert receiver.take() == [("FIRING", "breaker_open")]
    _faults(sim)
    assert _sync(capsys, db_url) == 0
    _check(capsys, db_url)
    assert receiver.take() == [("RESOLVED", "breaker_open")]

    # Freshness over the SLA: an operator tightens it below the last sync's age.
    _thresholds(capsys, db_url, "freshness_sla_hours=0")
    _check(capsys, db_url)
    assert receiver.take() == [("FIRING", "freshness_sla")]
    _thresholds(capsys, db_url, "freshness_sla_hours=26")
    _check(capsys, db_url)
    assert receiver.take() == [("RESOLVED", "freshness_sla")]

    listed = run(capsys, "--db-url", db_url, "alerts", "list", "--json")
    rows = [json.loads(line) for line in listed.lines]
    assert {r["status"] for r in rows} == {"RESOLVED"}
    assert {r["condition_name"] for r in rows} == {
        "consecutive_failed_batches",
        "rate_limit_storm",
        "dead_letter_spike",
        "stuck_outbox",
        "city_emptied",
        "breaker_open",
        "freshness_sla",
    }
    assert all(
        [(d["kind"], d["status"]) for d in r["deliveries"]]
        == [("FIRING", "SENT"), ("RESOLVED", "SENT")]
        for r in rows
    )
    audit = run(capsys, "--db-url", db_url, "audit", "--action", "alert.threshold", "--json")
    assert {json.loads(line)["actor"] for line in audit.lines} == {"ops-eve"}
