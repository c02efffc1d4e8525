"""``supplier-sync sync --incremental`` (and ``reconcile``) as a user calls it: after a full
sync, over the simulator on real HTTP, on SQLite and MariaDB."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.cli.test_main import (  # noqa: F401  (cli_home: an autouse fixture)
    assert_one_line_error,
    cli_home,
    published,
    query,
    run,
    simulator,
    supplier,
    sync,
)


def test_sync_incremental_publishes_the_days_changes_and_moves_the_watermark(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db_url: str
):
    sim = simulator(n_cities=4, total_hotels=600, late_arrival_rate=0.0)
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0
        sim.advance_day()
        out = run(capsys, "--db-url", db_url, "sync", "--incremental", "--json")
        assert out.code == 0, out
        summary = json.loads(out.out)
        truth = sim.ground_truth()
        pub = published(db_url)
        assert {h: pub.get(h) for h in truth.valid} == dict(truth.valid)
        window = summary["window"]
        assert summary["status"] == "SUCCESS" and window["published"] > 0
        assert window["watermark_after"] > window["watermark_before"]
        assert summary["cities"] and sum(summary["cities"].values()) == window["published"]
        # Nothing new: the next window re-reads the overlap only and publishes nothing.
        again = run(capsys, "--db-url", db_url, "sync", "--incremental")
        assert again.code == 0, again
        assert "published 0" in again.out and "window " in again.out
    w = schema.watermark.c
    (row,) = query(db_url, sa.select(w.task_code, w.batch_id))
    assert row.task_code == "hotel_supplier_incremental"


def test_sync_incremental_before_any_full_sync_says_what_to_do(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db_url: str
):
    with supplier(simulator(), monkeypatch):
        out = run(capsys, "--db-url", db_url, "sync", "--incremental")
    line = assert_one_line_error(out)
    assert "sync --full" in line


def test_sync_needs_exactly_one_mode(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        run(capsys, "sync")
    with pytest.raises(SystemExit):
        run(capsys, "sync", "--full", "--incremental")


def test_reconcile_reports_a_city_that_lost_hotels_and_repulls_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db_url: str
):
    sim = simulator(n_cities=4, total_hotels=600)
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0
        h = schema.platform_hotel.c
        (city,) = query(
            db_url,
            sa.select(h.city_code).group_by(h.city_code).order_by(sa.func.count().desc()).limit(1),
        )[0]
        lost = [r[0] for r in query(db_url, sa.select(h.resource_id).where(h.city_code == city))][
            :9
        ]

        db = SyncDatabase.open(db_url)
        with db.begin() as conn:
            conn.execute(sa.delete(schema.platform_hotel).where(h.resource_id.in_(lost)))
        db.dispose()
        out = run(capsys, "--db-url", db_url, "reconcile")
        assert out.code == 0, out
        assert f"{city!r}: hotels" in out.out and "1 differ" in out.out
        assert "re-pulled 1 of 1 cities" in out.out
        after = run(capsys, "--db-url", db_url, "reconcile", "--no-repull", "--json")
        assert after.code == 0, after
        rows = [json.loads(line) for line in after.out.splitlines()]
        assert rows and not any(r["differs"] for r in rows)
        assert {r["city"] for r in rows} == set(sim.ground_truth().listed_by_city)


def _batches(db_url: str) -> int:
    return len(query(db_url, sa.select(schema.batch.c.batch_id)))


def test_reconcile_waits_on_dead_lettered_hotels_and_never_repulls_them(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db_url: str
):
    sim = simulator(n_cities=4, total_hotels=600, faults={"bad_record_rate": 0.03})
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0
        d = schema.dead_letter.c
        ticketed = {str(city) for (city,) in query(db_url, sa.select(d.city_code).distinct())}
        assert ticketed
        before = _batches(db_url)
        for _ in range(2):  # every call alike: the cities wait, nothing is re-pulled
            out = run(capsys, "--db-url", db_url, "reconcile")
            assert out.code == 0, out
            assert "0 differ" in out.out, out.out
            assert not any(ln.startswith("re-pulled") for ln in out.lines), out.out
            waiting = [ln for ln in out.lines if "waiting on the open dead letters of" in ln]
            assert waiting and {ln.split(":")[0].strip("'") for ln in waiting} <= ticketed
            assert f"{len(waiting)} waiting on open dead letters (" in out.lines[-1]
            assert _batches(db_url) == before
        rows = [
            json.loads(line)
            for line in run(capsys, "--db-url", db_url, "reconcile", "--json").out.splitlines()
        ]
    assert not any(r["differs"] for r in rows)
    assert sum(r["waiting_on_tickets"] for r in rows) == len(waiting)
    assert all(r["open_ticket_hotels"] > 0 for r in rows if r["waiting_on_tickets"])


def test_reconcile_of_a_city_the_supplier_does_not_know_is_an_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db_url: str
):
    sim = simulator(n_cities=3, total_hotels=150)
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0
        before = _batches(db_url)
        out = run(capsys, "--db-url", db_url, "reconcile", "--city", "NOPE")
        line = assert_one_line_error(out, code=2)
        assert "'NOPE'" in line and "does not know city" in line and "differ" not in out.out
        known = next(iter(sim.ground_truth().listed_by_city))
        mixed = run(capsys, "--db-url", db_url, "reconcile", "--city", known, "--city", "NOPE")
        assert "'NOPE'" in assert_one_line_error(mixed, code=2)
        assert _batches(db_url) == before
        fine = run(capsys, "--db-url", db_url, "reconcile", "--city", known)
    assert fine.code == 0 and "1 cities compared" in fine.out and "0 differ" in fine.out


def _window(capsys: pytest.CaptureFixture[str], db_url: str) -> dict[str, Any]:
    out = run(capsys, "--db-url", db_url, "sync", "--incremental", "--json")
    assert out.code == 0, out
    window: dict[str, Any] = json.loads(out.out)["window"]
    return window


def test_quiet_polls_do_not_get_a_normal_day_held_for_review_but_a_spike_is(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db_url: str
):
    # The days: ~250 changes a day (the default thresholds: 5x, 100 changes), two
    # quiet polls minutes after a day's window, then the next day's window.
    world = {"n_cities": 4, "total_hotels": 3000, "late_arrival_rate": 0.0}
    sim = simulator(**world)
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0
        sim.advance_day()
        day1 = _window(capsys, db_url)
        assert 150 < day1["changes"] < 400 and not day1["held_window"]
        for _ in range(2):
            sim.advance(600)
            quiet = _window(capsys, db_url)
            assert quiet["changes"] < 10 and not quiet["held_window"]
        sim.advance_day()
        day2 = run(capsys, "--db-url", db_url, "sync", "--incremental")
        assert day2.code == 0, day2
        assert "held for review 0)" in day2.out and "far above its usual" not in day2.out
    # A spike: the same supplier on a day when most of its hotels change.
    spiky = simulator(**world, daily_price_change_rate=0.9)
    spiky.advance_day(3)
    with supplier(spiky, monkeypatch):
        spike = run(capsys, "--db-url", db_url, "sync", "--incremental")
    assert spike.code == 0, spike
    assert "far above its usual" in spike.out and "review list --batch" in spike.out
