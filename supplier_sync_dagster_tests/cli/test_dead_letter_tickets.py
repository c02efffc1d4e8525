"""One dead letter per problem, an honest fix rate, and ``dead-letters compensate`` that says
what it did (issue 40, item 5): as an operator sees it, through ``main([...])`` over HTTP
against the simulator, on SQLite and MariaDB."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.cli.test_main import (
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    published,
    run,
    simulator,
    supplier,
    sync,
)

# What makes each fixable code pass (the simulator's bad records break one field each).
FIXES: dict[str, dict[str, object]] = {
    "INVALID_PHONE": {"phone": "+66 2 123 4567"},
    "STAR_RATING_OUT_OF_RANGE": {"star_rating": 4.0},
    "UNKNOWN_STATUS": {"status": "ACTIVE"},
    "HTML_IN_NAME": {"name": "Riverside Hotel"},
    "CONTROL_CHARACTERS": {"name": "Riverside Hotel"},
}
OPEN = {"PENDING", "RETRYING", "FAILED", "MANUAL_FIX"}


def dead_letters(capsys: pytest.CaptureFixture[str], db_url: str, *filters: str) -> list[dict]:
    out = run(capsys, "--db-url", db_url, "dead-letters", "list", "--json", *filters)
    assert out.code == 0, out
    return [json.loads(line) for line in out.lines]


def fix_rate(capsys: pytest.CaptureFixture[str], db_url: str) -> float:
    out = run(capsys, "--db-url", db_url, "metrics", "show", "--json")
    assert out.code == 0, out
    return float(json.loads(out.out)["values"]["dead_letter_fix_rate_24h"])


def all_due(db_url: str) -> None:
    """A retry's backoff has passed for every open ticket."""
    db = SyncDatabase.open(db_url)
    try:
        with db.begin() as conn:
            conn.execute(
                sa.update(schema.dead_letter)
                .where(schema.dead_letter.c.next_retry_at.is_not(None))
                .values(next_retry_at=db.clock.now(-1))
            )
    finally:
        db.dispose()


def test_three_syncs_of_the_same_bad_record_make_one_ticket_and_only_a_fix_resolves_it(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(faults={"bad_record_rate": 0.08})
    truth = sim.ground_truth()
    assert len(truth.bad) >= 3
    with supplier(sim, monkeypatch):
        for _ in range(3):
            assert sync(capsys, db_url).code == 0
        letters = dead_letters(capsys, db_url)
        # One ticket per bad record, seen by each of the three syncs.
        assert sorted(d["supplier_resource_code"] for d in letters) == sorted(truth.bad)
        assert {d["seen_count"] for d in letters} == {3}
        assert {d["status"] for d in letters} == {"MANUAL_FIX"}
        assert len({d["last_batch_id"] for d in letters}) == 1  # the latest sync's
        assert all(d["last_batch_id"] != d["batch_id"] for d in letters)

        fixable = next(d for d in letters if d["error_code"] in FIXES)
        # A fix that changes nothing is refused with the same problem: the ticket stays as
        # the supplier's record left it (not another sight, no second ticket).
        same = run(
            capsys, "--db-url", db_url, "dead-letters", "fix", str(fixable["id"]),
            "--patch", "{}", "--by", "ops-anna", "--reason", "try as is",
        )  # fmt: skip
        assert same.code == 1 and fixable["error_code"] in same.err
        (unchanged,) = dead_letters(capsys, db_url, "--hotel", fixable["supplier_resource_code"])
        keep = ("id", "status", "seen_count", "last_batch_id", "raw_payload_ref", "error_message")
        assert {k: unchanged[k] for k in keep} == {k: fixable[k] for k in keep}
        fixed = run(
            capsys, "--db-url", db_url, "dead-letters", "fix", str(fixable["id"]),
            "--patch", json.dumps(FIXES[fixable["error_code"]]),
            "--by", "ops-anna", "--reason", "the supplier confirmed the value",
        )  # fmt: skip
        assert fixed.code == 0, fixed
        hotel = fixable["supplier_resource_code"]
        assert hotel in published(db_url)
        mine = dead_letters(capsys, db_url, "--hotel", hotel)
        assert [(d["id"], d["status"]) for d in mine] == [(fixable["id"], "RESOLVED")]

        # The supplier still serves another bad record: an operator's retry re-fetches it.
        still_bad = next(d for d in letters if d["supplier_resource_code"] != hotel)
        retried = run(
            capsys, "--db-url", db_url, "dead-letters", "retry", str(still_bad["id"]),
            "--by", "ops-ben", "--reason", "the supplier says it is fixed",
        )  # fmt: skip
        assert retried.code == 0, retried
        all_due(db_url)
        compensated = run(capsys, "--db-url", db_url, "dead-letters", "compensate", "--json")
        assert compensated.code == 0, compensated
        report = json.loads(compensated.out)
        assert (report["claimed"], report["resolved"], report["refused_again"]) == (1, 0, 1)
        again = dead_letters(capsys, db_url, "--hotel", still_bad["supplier_resource_code"])
        assert [d["id"] for d in again] == [still_bad["id"]]  # no new ticket
        (ticket,) = again
        assert ticket["status"] == "MANUAL_FIX" and ticket["retry_count"] == 1
        assert ticket["seen_count"] == 4

    after = dead_letters(capsys, db_url)
    assert len(after) == len(truth.bad)  # still one ticket per bad record
    assert {d["status"] for d in after if d["supplier_resource_code"] != hotel} == {"MANUAL_FIX"}
    # One problem of len(truth.bad) was fixed: the fix rate says so, not more.
    assert fix_rate(capsys, db_url) == pytest.approx(1 / len(truth.bad), abs=1e-4)


def _city_tickets(db_url: str) -> dict[str, Any]:
    d = schema.dead_letter.c
    db = SyncDatabase.open(db_url)
    try:
        with db.engine.connect() as conn:
            rows = conn.execute(
                sa.select(schema.dead_letter).where(d.error_code == "CITY_FAILED")
            ).all()
    finally:
        db.dispose()
    return {str(r.city_code): r for r in rows}


def test_compensate_resyncs_every_due_city_and_reports_true_figures(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(n_cities=5)
    listed = sim.ground_truth().listed_by_city
    broken = sorted(c for c, hotels in listed.items() if hotels)[:4]
    assert len(broken) == 4
    # Their pages cannot be parsed (the simulator's deep_json mode): each city fails alone.
    sim.set_modes(["deep_json"], broken)
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 1
        assert sync(capsys, db_url).code == 1  # the same cities fail again: same tickets
        tickets = _city_tickets(db_url)
        assert sorted(tickets) == broken
        assert {t.seen_count for t in tickets.values()} == {2}
        # Mended but one; the last broken city's ticket is not due yet (left alone).
        still, waiting = broken[0], broken[-1]
        sim.set_modes(["deep_json"], [still])
        all_due(db_url)
        db = SyncDatabase.open(db_url)
        try:
            with db.begin() as conn:
                conn.execute(
                    sa.update(schema.dead_letter)
                    .where(schema.dead_letter.c.id == tickets[waiting].id)
                    .values(next_retry_at=db.clock.now(3600))
                )
        finally:
            db.dispose()
        out = run(capsys, "--db-url", db_url, "dead-letters", "compensate")
    assert out.code == 1, out
    assert "re-synced 2 of 3 failed cities" in out.out and "1 still failing" in out.out
    failing = [line for line in out.err.splitlines() if "still fails" in line]
    assert len(failing) == 1 and f"city {still} still fails" in failing[0]
    for text in (out.out, out.err):
        assert "Traceback" not in text and "dagster._core" not in text
    after = _city_tickets(db_url)
    assert after[still].status == "FAILED" and after[still].retry_count == 1  # still open
    for city in broken[1:-1]:
        assert after[city].status == "RESOLVED" and after[city].retry_count == 1
    assert after[waiting].status == "PENDING" and after[waiting].retry_count == 0
    assert len(_city_tickets(db_url)) == len(broken)  # no new ticket for the still-failing


def test_compensate_json_lists_the_failing_city(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator()
    city = sorted(c for c, hotels in sim.ground_truth().listed_by_city.items() if hotels)[0]
    sim.set_modes(["deep_json"], [city])
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 1
        all_due(db_url)
        out = run(capsys, "--db-url", db_url, "dead-letters", "compensate", "--json")
    assert out.code == 1, out
    resync = json.loads(out.out)["resync"]
    assert (resync["retried"], resync["synced"], list(resync["failing"])) == ([city], [], [city])
    assert resync["charged"] == 1 and resync["resolved"] == 0
    assert "Traceback" not in out.err
