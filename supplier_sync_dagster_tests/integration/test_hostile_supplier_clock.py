"""A supplier whose clock lies (the simulator's ``future_timestamp`` mode: one hotel dated
2099 in its city's listing and at the end of the change feed), through ``supplier-sync sync
--full`` and ``sync --incremental`` as a user runs them, over HTTP, on SQLite and MariaDB.

The record of 2099 is a ``FUTURE_TIMESTAMP`` dead letter and never published; every other
hotel is; the watermark stays at or before the database clock plus the skew, and the next
window still receives the changes that really come next.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.settings import DEFAULT_MAX_CLOCK_SKEW_SECONDS
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.simulator import Simulator
from supplier_sync_dagster_tests.cli.test_main import (  # noqa: F401  (cli_home: an autouse fixture)
    cli_home,
    published,
    query,
    run,
    simulator,
    supplier,
    sync,
)

FUTURE = "future_timestamp"


def _lying_simulator() -> tuple[Simulator, str]:
    """A small world whose first city's first hotel is dated 2099; that hotel's id."""
    sim = simulator(n_cities=4, total_hotels=600, late_arrival_rate=0.0)
    city = sim.city_codes()[0]
    sim.set_modes([FUTURE], [city])
    (liar,) = [h for h, why in sim.ground_truth().bad.items() if why == "FUTURE_TIMESTAMP"]
    return sim, liar


def _letters(db_url: str) -> list[tuple[str, str, str]]:
    d = schema.dead_letter.c
    rows = query(
        db_url,
        sa.select(d.supplier_resource_code, d.error_code, d.batch_id).order_by(d.id),
    )
    return [(str(h), str(code), str(batch)) for h, code, batch in rows]


def _watermark_and_now(db_url: str) -> tuple[datetime, datetime]:
    db = SyncDatabase.open(db_url)
    try:
        with db.engine.connect() as conn:
            at = conn.execute(sa.select(schema.watermark.c.watermark_at)).scalar_one()
            return at.replace(tzinfo=UTC), db.clock.read_utc(conn)
    finally:
        db.dispose()


def _json(out: Any) -> dict[str, Any]:
    assert out.code == 0, out
    summary: dict[str, Any] = json.loads(out.out)
    return summary


def test_a_full_sync_dead_letters_the_hotel_dated_2099_and_publishes_the_rest(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db_url: str
):
    sim, liar = _lying_simulator()
    with supplier(sim, monkeypatch):
        summary = _json(sync(capsys, db_url, "--json"))
        truth = sim.ground_truth()
    assert summary["status"] == "SUCCESS"
    assert summary["dead_letters_by_code"] == {"FUTURE_TIMESTAMP": 1}
    assert [(h, code) for h, code, _ in _letters(db_url)] == [(liar, "FUTURE_TIMESTAMP")]
    assert liar not in truth.valid
    assert published(db_url) == dict(truth.valid)


def test_the_watermark_is_not_blinded_and_the_next_window_gets_the_next_changes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db_url: str
):
    sim, liar = _lying_simulator()
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0
        # A day of real changes; the feed ends with the record of 2099.
        sim.advance_day()
        first = _json(run(capsys, "--db-url", db_url, "sync", "--incremental", "--json"))
        window = first["window"]
        assert first["status"] == "SUCCESS" and window["published"] > 0
        assert window["dead_letters"] == 1
        mark, now = _watermark_and_now(db_url)
        assert mark <= now + timedelta(seconds=DEFAULT_MAX_CLOCK_SKEW_SECONDS)
        assert mark < datetime(2099, 1, 1, tzinfo=UTC) - timedelta(days=1)
        # The supplier moves on: the next window asks from before its real next changes
        # (not from 2098) and publishes them.
        sim.advance_day()
        second = _json(run(capsys, "--db-url", db_url, "sync", "--incremental", "--json"))
        assert second["status"] == "SUCCESS" and second["window"]["published"] > 0
        assert second["window"]["watermark_after"] > window["watermark_after"]
        truth = sim.ground_truth()
    # Every valid hotel at its version (a window does not unpublish hotels the day removed:
    # tombstones are the full sync's), and never the liar.
    pub = published(db_url)
    assert {h: pub.get(h) for h in truth.valid} == dict(truth.valid)
    assert liar not in pub
    # One ticket for the one problem: each window that reads the record again counts a sight
    # on it (the full sync's, then both windows'), the latest window's batch last.
    assert [(h, code) for h, code, _ in _letters(db_url)] == [(liar, "FUTURE_TIMESTAMP")]
    d = schema.dead_letter.c
    assert query(db_url, sa.select(d.seen_count, d.last_batch_id)) == [(3, second["batch_id"])]
