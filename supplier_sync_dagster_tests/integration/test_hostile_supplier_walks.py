"""Walks that would never end, and a listing that shifts under the walk, through
``supplier-sync sync --full`` as a user runs it (``main([...])``, the simulator's named fault
modes over HTTP, SQLite and MariaDB).

A looping city (``runaway_cursor``, ``cursor_cycle``, ``endless_pages``): the command ends by
itself, exits non-zero with one line that names WALK_RUNAWAY for that city, leaves the batch
finished (not RUNNING), files the city's CITY_FAILED ticket, stores a bounded number of its
pages, and publishes every hotel of the other cities. A drifting city (``drift``): the sync
publishes every listed hotel and ``reconcile`` then finds no difference; with the continuity
check off (``SUPPLIER_SYNC_WALK_CONTINUITY_CHECK=0``) a hotel is lost and ``reconcile``
notices.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.records.tombstones import TOMBSTONE_FINGERPRINT
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.simulator import Simulator
from supplier_sync_dagster_tests.cli.test_main import (
    assert_one_line_error,
    batch_of,
    cli_home,  # noqa: F401 - the CLI tests' state folder and environment, autouse
    query,
    run,
    simulator,
    supplier,
    sync,
)

# The page size of these syncs: every city walks several pages.
PAGE_SIZE = "20"
# What a looping city may store: the pages its size allows (its 54 hotels are 3 pages of
# 20), two of slack.
MAX_LOOP_PAGES = 5


def hostile(mode: str) -> tuple[Simulator, str]:
    """Three cities (54 to 164 hotels); ``mode`` on the smallest one."""
    sim = simulator()
    listed = sim.ground_truth().listed_by_city
    city = min(listed, key=lambda c: len(listed[c]))
    sim.set_modes([mode], [city])
    return sim, city


def live_hotels(db_url: str) -> set[str]:
    h = schema.platform_hotel.c
    stmt = sa.select(h.supplier_hotel_id).where(h.fingerprint != TOMBSTONE_FINGERPRINT)
    return {hotel_id for (hotel_id,) in query(db_url, stmt)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("mode", "rule"),
    [
        ("runaway_cursor", "WALK_RUNAWAY: 2 cursor pages in a row held only hotels seen before"),
        ("cursor_cycle", "WALK_RUNAWAY: cursor 'eyJ"),
        ("endless_pages", "WALK_RUNAWAY: page 6 is past the 5 allowed (its counts say 3 page"),
    ],
)
def test_a_walk_that_would_never_end_fails_its_city_and_the_others_publish(
    db_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    rule: str,
) -> None:
    sim, city = hostile(mode)
    truth = sim.ground_truth()
    with supplier(sim, monkeypatch):
        done = sync(capsys, db_url, "--page-size", PAGE_SIZE, "--trigger-id", f"loop-{mode}")
    line = assert_one_line_error(done)
    assert f"({city!r}: {rule}" in line, line
    batch = batch_of(db_url, f"loop-{mode}")
    assert batch.status not in ("RUNNING", "PENDING"), batch.status
    s, d = schema.shard.c, schema.dead_letter.c
    shards = dict(
        query(db_url, sa.select(s.shard_key, s.status).where(s.batch_id == batch.batch_id))
    )
    assert shards.pop(city) == "FAILED" and set(shards.values()) == {"SUCCESS"}
    others = {h for c, hotels in truth.valid_by_city.items() if c != city for h in hotels}
    assert others and others <= live_hotels(db_url)
    tickets = query(
        db_url,
        sa.select(d.city_code, d.error_message).where(
            d.batch_id == batch.batch_id, d.error_code == "CITY_FAILED"
        ),
    )
    assert [c for c, _ in tickets] == [city] and "WALK_RUNAWAY" in tickets[0][1]
    snap = schema.snapshot.c
    stored = query(
        db_url,
        sa.select(sa.func.count()).where(
            snap.batch_id == batch.batch_id, snap.shard_key == city, snap.snapshot_type == "RAW"
        ),
    )[0][0]
    assert 1 <= stored <= MAX_LOOP_PAGES


@pytest.mark.timeout(180)
def test_drift_under_the_walk_loses_no_hotel_and_reconcile_finds_no_difference(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim, city = hostile("drift")
    with supplier(sim, monkeypatch):
        done = sync(capsys, db_url, "--page-size", PAGE_SIZE, "--trigger-id", "drift-1")
        assert done.code == 0, done
        truth = sim.ground_truth()
        assert live_hotels(db_url) == set(truth.valid)
        w = schema.city_walk.c
        assert query(db_url, sa.select(w.shard_key, w.drift)) == [(city, "SHIFTED")]
        checked = run(capsys, "--db-url", db_url, "reconcile", "--no-repull")
    assert checked.code == 0, checked
    assert checked.lines[-1].startswith("3 cities compared") and " 0 differ" in checked.out


@pytest.mark.timeout(180)
def test_drift_without_the_continuity_check_loses_a_hotel_and_reconcile_notices(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim, city = hostile("drift")
    monkeypatch.setenv("SUPPLIER_SYNC_WALK_CONTINUITY_CHECK", "0")
    with supplier(sim, monkeypatch):
        done = sync(capsys, db_url, "--page-size", PAGE_SIZE, "--trigger-id", "drift-1")
        assert done.code == 0, done
        lost = set(sim.ground_truth().valid) - live_hotels(db_url)
        assert lost
        checked = run(capsys, "--db-url", db_url, "reconcile", "--no-repull")
    assert checked.code == 0, checked
    (line,) = [ln for ln in checked.lines if ln.startswith(repr(city))]
    assert f"{len(lost)} listed hotel(s) not in the catalog" in line
    assert "walked again after a UNCHECKED walk" in line
    assert " 1 differ" in checked.lines[-1]
