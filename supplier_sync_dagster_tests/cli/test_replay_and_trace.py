"""``replay --dry-run`` and ``trace`` as an operator reads them, after real syncs over HTTP,
on SQLite and MariaDB: a dry run speaks to people unless ``--json`` (its sample shows NEW
hotels as well as changes), and the trace of a hotel the sync unpublished says so."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster_tests.cli.test_main import (
    assert_one_line_error,
    batch_of,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    published,
    query,
    run,
    simulator,
    supplier,
    sync,
)

WHO_WHY = ("--by", "ops", "--reason", "hold day 1 to look at it")


def test_a_dry_run_prints_a_summary_for_people_and_json_only_when_asked(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(
        daily_add_rate=0.2,
        daily_price_change_rate=0.5,
        daily_remove_rate=0.0,
        faults={"bad_record_rate": 0.05},
    )
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url, "--trigger-id", "day-0").code == 0
        # Day 1 is stopped by a stricter gate: its pages are stored, nothing is published.
        tighter = run(
            capsys, "--db-url", db_url, "gate", "thresholds", "--max-bad-ratio", "0.001", *WHO_WHY
        )
        assert tighter.code == 0, tighter
        before = sim.ground_truth()
        sim.advance_day()
        assert sync(capsys, db_url, "--trigger-id", "day-1").code == 1
    truth = sim.ground_truth()
    added = set(truth.valid) - set(before.valid)
    assert added
    city = max(truth.valid_by_city, key=lambda c: len(set(truth.valid_by_city[c]) & added))
    source = batch_of(db_url, "day-1").batch_id
    catalog = published(db_url)

    dry = run(capsys, "--db-url", db_url, "replay", "--city", city, "--dry-run")
    assert dry.code == 0, dry
    assert dry.err == ""
    assert not dry.out.lstrip().startswith("{")  # no JSON for people
    assert dry.lines[0].startswith(f"city {city!r} (stored pages of batch {source}): ")
    assert dry.lines[-1] == "dry run: nothing was written (replay without --dry-run to publish)"
    assert published(db_url) == catalog
    b = schema.batch.c
    assert [t for (t,) in query(db_url, sa.select(b.trigger_id).order_by(b.id))] == [
        "day-0",
        "day-1",
    ]  # no writes

    as_json = run(capsys, "--db-url", db_url, "replay", "--city", city, "--dry-run", "--json")
    assert as_json.code == 0, as_json
    (report,) = [json.loads(line) for line in as_json.lines]
    new_here = set(truth.valid_by_city[city]) & added
    assert report["diffs_by_type"]["NEW"] == len(new_here)
    sampled = {c["diff_type"] for c in report["changes"]}
    assert "NEW" in sampled and "PRICE_CHANGED" in sampled, report["changes"]
    new = [c for c in report["changes"] if c["diff_type"] == "NEW"]
    assert {c["supplier_hotel_id"] for c in new} <= new_here
    assert all(c["name"] and c["action"] == "AUTO_PUBLISH" for c in new)
    for c in new:
        assert f"    {c['supplier_hotel_id']} NEW -> AUTO_PUBLISH: {c['name']!r}" in dry.lines
    assert f"NEW {len(new_here)}" in dry.lines[1]
    assert dry.lines[2] == (
        f"  a sample of {len(report['changes'])} of the "
        f"{sum(n for t, n in report['diffs_by_type'].items() if t != 'NO_CHANGE')} changes:"
    )

    # A city without stored pages: said on stderr, the others still reported.
    some = run(
        capsys, "--db-url", db_url, "replay", "--city", "Atlantis", "--city", city, "--dry-run"
    )
    assert some.code == 1 and "'Atlantis' has no stored raw pages" in some.err
    assert some.lines[0].startswith(f"city {city!r} ") and "{" not in some.lines[0]
    none = run(capsys, "--db-url", db_url, "replay", "--city", "Atlantis", "--dry-run")
    assert "'Atlantis' has no stored raw pages" in assert_one_line_error(none)
    assert none.out == ""


def test_the_trace_of_an_unpublished_hotel_says_so_and_marks_its_offers_inactive(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(
        daily_add_rate=0.0,
        daily_remove_rate=0.05,
        daily_price_change_rate=0.0,
        daily_content_change_rate=0.0,
        daily_status_change_rate=0.0,
    )
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url, "--trigger-id", "day-0").code == 0
        listed = set(sim.ground_truth().valid)
        sim.advance_day()
        # Two complete syncs without it: the tombstone grace is over, the hotel unpublished.
        assert sync(capsys, db_url, "--trigger-id", "day-1a").code == 0
        assert sync(capsys, db_url, "--trigger-id", "day-1b").code == 0
    gone = sorted(listed - set(sim.ground_truth().valid))
    assert gone
    hotel = gone[0]
    kept = sorted(set(sim.ground_truth().valid))[0]
    h = schema.platform_hotel.c
    ((status, when, by_batch),) = query(
        db_url,
        sa.select(h.status, h.published_at, h.last_batch_id).where(h.supplier_hotel_id == hotel),
    )
    assert status == "INACTIVE"
    assert by_batch in {batch_of(db_url, t).batch_id for t in ("day-1a", "day-1b")}

    as_json = json.loads(run(capsys, "--db-url", db_url, "trace", hotel, "--json").out)
    gone_because = {
        # The listing lacked it twice, or the supplier's 404 for it confirmed at once.
        "missing": "the supplier stopped listing it",
        "not_found": "the supplier answered 404 (not found) for it",
    }
    reason = as_json["unpublished"]["reason"]
    assert reason in gone_because
    assert as_json["unpublished"]["batch_id"] == by_batch
    assert as_json["offers"] and not any(o["active"] for o in as_json["offers"])

    traced = run(capsys, "--db-url", db_url, "trace", hotel)
    assert traced.code == 0, traced
    assert traced.lines[1].startswith(
        f"  UNPUBLISHED at {when} by batch {by_batch}: {gone_because[reason]}, missing since "
    ), traced.out
    assert traced.lines[2].startswith("  last published: resource ")
    assert " INACTIVE, " in traced.lines[2]
    offers = [ln for ln in traced.lines if ln.startswith("    offer ")]
    assert len(offers) == len(as_json["offers"])
    assert all(": INACTIVE (last price " in ln for ln in offers), offers

    # A hotel still listed: published, no tombstone, offers with their prices.
    live = run(capsys, "--db-url", db_url, "trace", kept)
    assert live.code == 0, live
    assert "UNPUBLISHED" not in live.out and "INACTIVE" not in live.out
    assert live.lines[1].startswith("  published: resource ")
    assert (
        json.loads(run(capsys, "--db-url", db_url, "trace", kept, "--json").out)["unpublished"]
        is None
    )
