"""``supplier-sync dead-letters list|retry|ignore`` and ``audit`` as a user calls them, after a
real ``sync --full`` over HTTP against a supplier with broken records, on SQLite and MariaDB."""

from __future__ import annotations

import dataclasses
import json

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.simulator import FaultProfile
from supplier_sync_dagster_tests.cli.test_main import (
    assert_one_line_error,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    published,
    query,
    run,
    simulator,
    supplier,
    sync,
)


def _list(capsys: pytest.CaptureFixture[str], db_url: str, *filters: str) -> list[dict]:
    out = run(capsys, "--db-url", db_url, "dead-letters", "list", "--json", *filters)
    assert out.code == 0, out
    return [json.loads(line) for line in out.lines]


def test_list_filter_ignore_and_retry_are_audited(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(faults={"bad_record_rate": 0.08})
    truth = sim.ground_truth()
    assert len(truth.bad) >= 3
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0

    letters = _list(capsys, db_url)
    assert {d["supplier_resource_code"] for d in letters} == set(truth.bad)
    # Bad supplier data needs a person: straight to MANUAL_FIX with its owner team.
    assert {(d["status"], d["error_class"]) for d in letters} == {("MANUAL_FIX", "NEEDS_PERSON")}
    assert all(d["owner_team"] and d["next_retry_at"] is None for d in letters)
    assert _list(capsys, db_url, "--class", "RETRYABLE") == []
    code = letters[0]["error_code"]
    by_code = _list(capsys, db_url, "--code", code)
    assert by_code and {d["error_code"] for d in by_code} == {code}
    one = _list(capsys, db_url, "--hotel", letters[0]["supplier_resource_code"])
    assert [d["id"] for d in one] == [letters[0]["id"]]
    assert _list(capsys, db_url, "--older-than-hours", "1") == []
    assert len(
        _list(capsys, db_url, "--older-than-hours", "0", "--batch", letters[0]["batch_id"])
    ) == len(letters)
    text = run(capsys, "--db-url", db_url, "dead-letters", "list", "--limit", "1")
    assert text.code == 0 and "MANUAL_FIX" in text.out and "NEEDS_PERSON" in text.out

    first, second = letters[0]["id"], letters[1]["id"]
    no_reason = run(
        capsys,
        "--db-url",
        db_url,
        "dead-letters",
        "ignore",
        str(first),
        "--by",
        "ops",
        "--reason",
        " ",
    )
    assert "--reason" in assert_one_line_error(no_reason, code=2)
    ignored = run(
        capsys, "--db-url", db_url, "dead-letters", "ignore", str(first),
        "--by", "ops-anna", "--reason", "hotel closed for good",
    )  # fmt: skip
    assert ignored.code == 0 and "ignore: 1 dead letters" in ignored.out
    assert _list(capsys, db_url, "--status", "IGNORED")[0]["id"] == first
    again = run(
        capsys,
        "--db-url",
        db_url,
        "dead-letters",
        "retry",
        str(first),
        "--by",
        "x",
        "--reason",
        "y",
    )
    assert "requeue" in assert_one_line_error(again, code=2)  # IGNORED is final

    retried = run(
        capsys, "--db-url", db_url, "dead-letters", "retry", str(second),
        "--by", "ops-ben", "--reason", "supplier says it is fixed",
    )  # fmt: skip
    assert retried.code == 0
    row = _list(capsys, db_url, "--status", "PENDING")
    assert [r["id"] for r in row] == [second]
    assert row[0]["next_retry_at"] and row[0]["max_retry_count"] == row[0]["retry_count"] + 1

    audit = run(capsys, "--db-url", db_url, "audit", "--target-type", "dead_letter", "--json")
    entries = [json.loads(line) for line in audit.lines]
    assert [(e["action"], e["actor"]) for e in entries] == [
        ("dead_letter.retry", "ops-ben"),
        ("dead_letter.ignore", "ops-anna"),
    ]
    assert entries[1]["reason"] == "hotel closed for good"
    assert (entries[1]["before"]["status"], entries[1]["after"]["status"]) == (
        "MANUAL_FIX",
        "IGNORED",
    )
    assert (entries[0]["before"]["status"], entries[0]["after"]["status"]) == (
        "MANUAL_FIX",
        "PENDING",
    )

    shown = run(capsys, "--db-url", db_url, "dead-letters", "show", str(first), "--json")
    assert shown.code == 0, shown
    detail = json.loads(shown.out)
    assert (detail["status"], detail["fix_note"]) == (
        "IGNORED",
        "ignored by ops-anna: hotel closed for good",
    )
    assert [a["action"] for a in detail["audit"]] == ["dead_letter.ignore"]
    assert run(capsys, "--db-url", db_url, "dead-letters", "show", str(first)).code == 0
    missing = run(capsys, "--db-url", db_url, "dead-letters", "show", "987654321")
    assert "987654321" in assert_one_line_error(missing, code=2)


# What makes each fixable code pass (the simulator's bad records break one field each).
_FIXES: dict[str, dict[str, object]] = {
    "INVALID_PHONE": {"phone": "+66 2 123 4567"},
    "STAR_RATING_OUT_OF_RANGE": {"star_rating": 4.0},
    "UNKNOWN_STATUS": {"status": "ACTIVE"},
    "HTML_IN_NAME": {"name": "Riverside Hotel"},
    "CONTROL_CHARACTERS": {"name": "Riverside Hotel"},
}


def test_fix_publishes_a_corrected_record_refuses_a_bad_one_and_trace_shows_the_bytes(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(faults={"bad_record_rate": 0.15}, total_hotels=400)
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0
    letters = [d for d in _list(capsys, db_url) if d["error_code"] in _FIXES]
    assert letters, "the simulator served no fixable bad record"
    letter = letters[0]
    hotel, city = letter["supplier_resource_code"], letter["city_code"]
    assert city and [d["id"] for d in _list(capsys, db_url, "--city", city, "--hotel", hotel)] == [
        letter["id"]
    ]
    patch = _FIXES[letter["error_code"]]

    def fix(patch: dict, *extra: str):
        return run(
            capsys, "--db-url", db_url, "dead-letters", "fix", str(letter["id"]),
            "--patch", json.dumps(patch), "--by", "ops-cleo", "--reason", "supplier confirmed",
            *extra,
        )  # fmt: skip

    # Still bad: refused with its code, nothing published, the dead letter unchanged.
    refused = fix({**patch, "star_rating": 9})
    assert "STAR_RATING_OUT_OF_RANGE" in assert_one_line_error(refused, code=1)
    assert hotel not in published(db_url)
    assert (
        _list(capsys, db_url, "--hotel", hotel, "--status", "MANUAL_FIX")[0]["id"] == letter["id"]
    )
    # A fix cannot change whose record it is.
    other = fix({"hotel_id": "H-someone-else"})
    assert "hotel_id" in assert_one_line_error(other, code=2)

    accepted = fix(patch, "--json")
    assert accepted.code == 0, accepted
    outcome = json.loads(accepted.out)
    assert outcome["accepted"] and outcome["action"] == "AUTO_PUBLISH"
    assert hotel in published(db_url)
    row = _list(capsys, db_url, "--hotel", hotel, "--status", "RESOLVED")[0]
    assert row["id"] == letter["id"] and "ops-cleo" in row["fix_note"]
    again = fix(patch)  # closed: nothing to fix
    assert "RESOLVED" in assert_one_line_error(again, code=2)

    audit = run(capsys, "--db-url", db_url, "audit", "--action", "dead_letter.fix", "--json")
    entries = [json.loads(line) for line in audit.lines]
    assert [e["after"]["outcome"].split(":")[0] for e in entries] == ["accepted", "refused"]
    assert entries[0]["after"]["patch"] == patch and entries[0]["actor"] == "ops-cleo"

    traced = run(capsys, "--db-url", db_url, "trace", hotel, "--json")
    assert traced.code == 0, traced
    t = json.loads(traced.out)
    assert t["published"]["last_batch_id"] == outcome["batch_id"]
    assert [d["diff_type"] for d in t["diffs"]] == ["NEW"]
    assert t["diffs"][0]["sync_mode"] == "REFRESH" and t["diffs"][0]["action"] == "AUTO_PUBLISH"
    assert t["normalized"]["document"]["supplier_hotel_id"] == hotel
    assert all(r["verified"] for r in t["raw"]) and len(t["raw"]) >= 2
    records = {r["batch_id"]: r["record"] for r in t["raw"]}
    fixed = records[outcome["batch_id"]]
    assert all(fixed[k] == v for k, v in patch.items())  # the operator's record
    original = records[letter["batch_id"]]  # the supplier's, from the listing's bytes
    assert original["hotel_id"] == hotel and original != fixed
    assert [dl["status"] for dl in t["dead_letters"]][0] == "RESOLVED"
    text = run(capsys, "--db-url", db_url, "trace", hotel)
    assert text.code == 0 and "verified" in text.out and "supplier record" in text.out
    assert "never synced" in assert_one_line_error(
        run(capsys, "--db-url", db_url, "trace", "H-nobody"), code=2
    )


def test_compensate_heals_failed_single_hotel_requests_with_no_operator(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(daily_remove_rate=0.06, daily_add_rate=0.0)
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0
        before = published(db_url)
        sim.advance_day()
        removed = set(before) - set(sim.ground_truth().valid) - set(sim.ground_truth().bad)
        assert removed
        # The day the detail service is down: its city no longer lists a hotel, and the
        # request that would confirm it is gone fails.
        sim.config = dataclasses.replace(sim.config, faults=FaultProfile(detail_outage_rate=1.0))
        assert sync(capsys, db_url).code == 0
        pending = _list(capsys, db_url, "--class", "RETRYABLE")
        assert {d["supplier_resource_code"] for d in pending} == removed
        assert {(d["status"], d["error_code"]) for d in pending} == {
            ("PENDING", "SUPPLIER_UNAVAILABLE")
        }
        nothing = run(capsys, "--db-url", db_url, "dead-letters", "compensate")
        assert nothing.code == 0 and "no retryable dead letter is due" in nothing.out
        # The outage ends, and a minute passes (the first backoff).
        sim.config = dataclasses.replace(sim.config, faults=FaultProfile())
        d = schema.dead_letter.c
        db = SyncDatabase.open(db_url)
        try:
            with db.begin() as conn:
                conn.execute(
                    sa.update(schema.dead_letter)
                    .where(d.status == "PENDING")
                    .values(next_retry_at=db.clock.now(-1))
                )
        finally:
            db.dispose()
        healed = run(capsys, "--db-url", db_url, "dead-letters", "compensate", "--json")
        assert healed.code == 0, healed
        out = json.loads(healed.out)
        assert (out["claimed"], out["gone"], out["batch_status"]) == (
            len(removed),
            len(removed),
            "SUCCESS",
        )
        assert out["supplier_requests"] == len(removed)
    assert {d["status"] for d in _list(capsys, db_url, "--class", "RETRYABLE")} == {"RESOLVED"}
    h = schema.platform_hotel.c
    statuses = dict(
        query(
            db_url,
            sa.select(h.supplier_hotel_id, h.status).where(h.supplier_hotel_id.in_(removed)),
        )
    )
    assert set(statuses.values()) == {"INACTIVE"}  # the 404 made them tombstones


def test_compensate_resyncs_a_city_that_failed_and_resolves_its_ticket(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator()
    broken = sim.ground_truth().listed_by_city
    city = sorted(c for c, listed in broken.items() if listed)[0]
    # Its shard of the supplier is down (503): retryable, unlike a 404 (CITY_NOT_FOUND).
    sim.config = dataclasses.replace(sim.config, faults=FaultProfile(failing_city_codes=(city,)))
    with supplier(sim, monkeypatch):
        failed = sync(capsys, db_url)
        assert failed.code == 1  # the other cities published; this one failed
        (ticket,) = _list(capsys, db_url, "--code", "CITY_FAILED")
        assert (ticket["city_code"], ticket["status"], ticket["error_class"]) == (
            city,
            "PENDING",
            "RETRYABLE",
        )
        sim.config = dataclasses.replace(sim.config, faults=FaultProfile())  # mended
        db = SyncDatabase.open(db_url)
        try:
            with db.begin() as conn:
                conn.execute(sa.update(schema.dead_letter).values(next_retry_at=db.clock.now(-1)))
        finally:
            db.dispose()
        out = run(capsys, "--db-url", db_url, "dead-letters", "compensate", "--json")
        assert out.code == 0, out
        report = json.loads(out.out.splitlines()[-1])
        assert report["resync_cities"] == [city]
        assert report["resync"]["status"] == "SUCCESS" and report["resync"]["resolved"] == 1
    (healed,) = _list(capsys, db_url, "--code", "CITY_FAILED")
    assert healed["status"] == "RESOLVED" and report["resync"]["batch_id"] in healed["fix_note"]
    truth = sim.ground_truth()
    assert {h: v for h, v in published(db_url).items() if h in truth.valid} == dict(truth.valid)
