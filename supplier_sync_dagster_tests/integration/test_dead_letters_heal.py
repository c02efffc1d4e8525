"""Dead letters over the flaky and the hostile profiles, through the CLI as an operator runs
it, over real HTTP (SQLite and MariaDB).

Day 0: a full sync of a supplier at the profile's rates (429s, 5xx, truncated bodies,
expired cursors, bad records; the hostile one adds hostile city codes, moved hotels and
shifting pages): every bad record ends in
MANUAL_FIX with its owner team, none is published. Day 1: hotels were removed, and the
supplier's detail service is down while the sync asks about them: each becomes a retryable
dead letter. Then the detail service comes back, still failing one request in five, and
compensation runs on its schedule (a minute passes between runs): every retryable dead
letter heals without an operator, and the removed hotels are unpublished.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.simulator import FaultProfile, Simulator
from supplier_sync_dagster_tests.cli.test_main import (
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    published,
    query,
    run,
)
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, serve_simulator


@pytest.fixture(params=["flaky", "hostile"])
def profile(request: pytest.FixtureRequest) -> FaultProfile:
    """The supplier's faults, without slow answers (they only make the test slower)."""
    return FaultProfile.named(request.param).with_(slow_seconds=0.0, detail_outage_rate=0.0)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch, profile: FaultProfile) -> Iterator[Simulator]:
    with serve_simulator(
        profile,
        seed=19,
        n_cities=4,
        total_hotels=400,
        empty_city_share=0.0,
        daily_remove_rate=0.05,
        daily_add_rate=0.0,
    ) as (sim, url):
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", url)
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", SIM_API_KEY)
        yield sim


def _letters(capsys: pytest.CaptureFixture[str], db_url: str, *filters: str) -> list[dict]:
    out = run(
        capsys, "--db-url", db_url, "dead-letters", "list", "--json", "--limit", "1000", *filters
    )
    assert out.code == 0, out
    return [json.loads(line) for line in out.lines]


def _a_minute_passes(db_url: str) -> None:
    db = SyncDatabase.open(db_url)
    d = schema.dead_letter.c
    try:
        with db.begin() as conn:
            conn.execute(
                sa.update(schema.dead_letter)
                .where(d.status.in_(("PENDING", "FAILED")), d.next_retry_at.is_not(None))
                .values(next_retry_at=db.clock.now(-1))
            )
    finally:
        db.dispose()


def test_dead_letters_heal_or_wait_for_a_person(
    db_url: str, served: Simulator, profile: FaultProfile, capsys: pytest.CaptureFixture[str]
):
    sim = served
    truth = sim.ground_truth()
    assert truth.bad, "the profile served no bad record"
    day0 = run(capsys, "--db-url", db_url, "sync", "--full", "--json")
    assert day0.code == 0, day0
    catalog = published(db_url)
    assert {h: catalog.get(h) for h in truth.valid} == dict(truth.valid)
    assert not set(truth.bad) & set(catalog)  # nothing is published that failed a check
    validation = _letters(capsys, db_url, "--class", "NEEDS_PERSON")
    assert {d["supplier_resource_code"] for d in validation} == set(truth.bad)
    assert {d["status"] for d in validation} == {"MANUAL_FIX"}
    assert all(d["owner_team"] for d in validation)

    sim.advance_day()
    removed = set(catalog) - set(sim.ground_truth().valid) - set(sim.ground_truth().bad)
    assert removed
    sim.config = dataclasses.replace(sim.config, faults=profile.with_(detail_outage_rate=1.0))
    day1 = run(capsys, "--db-url", db_url, "sync", "--full", "--json")
    assert day1.code == 0, day1
    retryable = _letters(capsys, db_url, "--class", "RETRYABLE")
    asked = {d["supplier_resource_code"] for d in retryable}
    # The removed hotels, and any hotel a listing missed that day (the hostile profile's
    # moved hotels and shifting pages): the supplier could not say which.
    assert removed <= asked
    still_there = asked - removed
    day1_truth = sim.ground_truth()
    assert still_there <= set(day1_truth.valid) | set(day1_truth.bad)
    assert {d["status"] for d in retryable} == {"PENDING"}

    # The detail service is back, failing one request in five; compensation runs each minute.
    sim.config = dataclasses.replace(sim.config, faults=profile.with_(detail_outage_rate=0.2))
    for _ in range(6):
        if not [
            d
            for d in _letters(capsys, db_url, "--class", "RETRYABLE")
            if d["status"]
            in (
                "PENDING",
                "FAILED",
                "RETRYING",
            )
        ]:
            break
        _a_minute_passes(db_url)
        out = run(capsys, "--db-url", db_url, "dead-letters", "compensate", "--json")
        assert out.code == 0, out
    healed = _letters(capsys, db_url, "--class", "RETRYABLE")
    assert {d["status"] for d in healed} == {"RESOLVED"}, healed
    notes = {d["supplier_resource_code"]: d["fix_note"] for d in healed}
    assert all("404" in notes[h] for h in removed)
    assert all("re-fetched" in notes[h] for h in still_there), notes
    h = schema.platform_hotel.c
    statuses = dict(
        query(
            db_url,
            sa.select(h.supplier_hotel_id, h.status).where(h.supplier_hotel_id.in_(removed)),
        )
    )
    assert set(statuses.values()) == {"INACTIVE"}
    # No operator was needed: the audit trail is empty.
    audit = run(capsys, "--db-url", db_url, "audit", "--target-type", "dead_letter", "--json")
    assert audit.code == 0 and audit.lines == []
