"""The outbox stage machine and its dispatcher, on SQLite and MariaDB, with the embedded read
models (SQLite FTS5 search, in-process cache, JSON-lines subscribers' feed)."""

from __future__ import annotations

import json
import random
import sqlite3
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import (
    InvalidTransition,
    ProjectionUnavailable,
    UnknownOutboxEvent,
)
from supplier_sync_dagster.core.outbox.dispatch import Dispatcher
from supplier_sync_dagster.core.outbox.machine import (
    OUTBOX_MOVES,
    STAGE_POLICIES,
    StagePolicy,
    advance,
    cancel_events,
    claim,
    move_events,
    outbox_status,
    release_stuck,
    retry_events,
    stage_after,
)
from supplier_sync_dagster.core.outbox.projections import (
    CITY_KEY,
    HOTEL_KEY,
    InProcessHotelCache,
    JsonLinesNotifier,
    Notification,
    Projections,
    SearchQuery,
    SqliteSearchIndex,
    reconcile_projection,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.core.conftest import run_concurrently
from supplier_sync_dagster_tests.core.records.test_catalog import hotel, sync


class BrokenNotifier:
    """A broker that is down."""

    def __init__(self) -> None:
        self.calls = 0

    def publish(self, notes: Sequence[Notification]) -> None:
        self.calls += 1
        raise ProjectionUnavailable("broker down (test)")

    def close(self) -> None:
        pass


@pytest.fixture
def projections(tmp_path: Path) -> Iterator[Projections]:
    p = Projections(
        SqliteSearchIndex(tmp_path / "search.sqlite3"),
        InProcessHotelCache(),
        JsonLinesNotifier(tmp_path / "notifications.jsonl"),
    )
    yield p
    p.close()


def notified(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "notifications.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def outbox_rows(db: SyncDatabase) -> list[dict[str, Any]]:
    with db.engine.connect() as conn:
        return [
            dict(r._mapping)
            for r in conn.execute(sa.select(schema.outbox).order_by(schema.outbox.c.id))
        ]


def publish(db: SyncDatabase, batch: str, n: int, version: int = 1, **changes: Any) -> None:
    sync(db, batch, [hotel(f"H{i}", version, **changes) for i in range(n)])


def test_the_table_of_moves_is_closed_and_end_states_are_final():
    assert set(OUTBOX_MOVES) == {"READY", "PROCESSING", "SUCCEEDED", "FAILED", "CANCELLED"}
    for targets in OUTBOX_MOVES.values():
        assert targets <= set(OUTBOX_MOVES)
    assert OUTBOX_MOVES["SUCCEEDED"] == frozenset()
    assert stage_after("HotelResourceUpdated", "SEARCH_INDEX") == "CACHE"
    assert stage_after("HotelResourceUpdated", "CACHE") == "NOTIFY"
    assert stage_after("HotelResourceUpdated", "NOTIFY") == "END"
    assert stage_after("HotelMappingCreated", "NOTIFY") == "END"


def test_a_move_the_table_forbids_writes_nothing(db: SyncDatabase):
    publish(db, "b1", 1)
    ids = [r["id"] for r in outbox_rows(db)]
    with pytest.raises(InvalidTransition, match="no outbox event moves from"), db.begin() as c:
        move_events(c, "SUCCEEDED", ids, sources=["READY"])
    assert {r["status"] for r in outbox_rows(db)} == {"READY"}


def test_a_drain_runs_every_event_through_its_chain_once(
    db: SyncDatabase, projections: Projections, tmp_path: Path
):
    publish(db, "b1", 30, name="Shinjuku Ryokan")
    projections.cache.set(HOTEL_KEY.format(resource_id=1), b"stale", 600)
    dispatcher = Dispatcher(db, projections, batch_size=7)
    report = dispatcher.drain()
    rows = outbox_rows(db)
    assert len(rows) == 90  # 30 hotels x (updated, content changed, mapping created)
    assert {(r["status"], r["current_stage"], r["next_stage"]) for r in rows} == {
        ("SUCCEEDED", "NOTIFY", "END")
    }
    assert all(r["lease_owner"] is None and r["finished_at"] is not None for r in rows)
    projected = [r for r in rows if r["event_type"] == "HotelResourceUpdated"]
    assert all(r["projected_at"] is not None for r in projected)
    assert report.stages["SEARCH_INDEX"].advanced == 30
    assert report.stages["CACHE"].advanced == 30
    assert report.stages["NOTIFY"].advanced == 90
    # Subscribers got every event exactly once, with its id to deduplicate by.
    feed = notified(tmp_path)
    assert Counter(m["message_id"] for m in feed) == Counter({r["event_id"]: 1 for r in rows})
    assert {m["routing_key"] for m in feed} == {
        "HotelResourceUpdated",
        "HotelContentChanged",
        "HotelMappingCreated",
    }
    # The search index holds every hotel at its published version; the cache key is gone.
    found = projections.search.search(
        SearchQuery(text="shinjuku ryokan", city_code="BKK", limit=50)
    )
    assert len(found) == 30 and {h.publish_version for h in found} == {1}
    assert found[0].lowest_price is not None and str(found[0].lowest_price) == "99.00"
    assert projections.cache.get(HOTEL_KEY.format(resource_id=1)) is None
    status = outbox_status(db)
    assert status.total("SUCCEEDED") == 90 and status.stuck == 0
    assert status.projection_lag.count == 30 and status.end_to_end_lag.count == 90
    assert status.projection_lag.p95 is not None and status.projection_lag.p95 >= 0


def test_a_newer_version_wins_whatever_order_its_events_are_projected_in(
    db: SyncDatabase, projections: Projections
):
    publish(db, "b1", 1, name="First Name")
    publish(db, "b2", 1, version=2, name="Second Name")
    d = Dispatcher(db, projections)
    # Both versions' SEARCH_INDEX events are READY; the index reads the catalog, which holds
    # version 2, so even the version-1 event projects version 2, and nothing goes back.
    d.drain()
    (doc,) = projections.search.search(SearchQuery(text="name"))
    assert (doc.publish_version, doc.name) == (2, "Second Name")
    # An old document replayed directly is refused by the index's version guard.
    from supplier_sync_dagster.core.outbox.projections import load_search_docs

    with db.engine.connect() as conn:
        current = load_search_docs(conn, [doc.resource_id])[doc.resource_id]
    older = current.__class__(**{**current.__dict__, "publish_version": 1, "name": "Stale"})
    projections.search.upsert([older])
    (again,) = projections.search.search(SearchQuery(text="name"))
    assert (again.publish_version, again.name) == (2, "Second Name")


def test_claims_of_concurrent_dispatchers_are_disjoint(db: SyncDatabase):
    publish(db, "b1", 40)  # 40 SEARCH_INDEX events

    def take(i: int) -> list[int]:
        got: list[int] = []
        while True:
            events = claim(db, "SEARCH_INDEX", owner=f"d{i}", limit=3)
            if not events:
                return got
            got += [e.id for e in events]

    results, errors = run_concurrently(4, take)
    assert not errors, errors
    taken = [i for r in results for i in r]
    assert len(taken) == len(set(taken)) == 40
    rows = [r for r in outbox_rows(db) if r["next_stage"] == "SEARCH_INDEX"]
    assert {r["status"] for r in rows} == {"PROCESSING"}
    assert {r["lease_owner"] for r in rows} <= {"d0", "d1", "d2", "d3"}


def test_a_failing_stage_retries_with_backoff_then_fails_and_an_operator_retries_it(
    db: SyncDatabase, projections: Projections, tmp_path: Path
):
    publish(db, "b1", 3)
    broken = BrokenNotifier()
    projections.notifier = broken
    d = Dispatcher(db, projections)
    d.drain()
    rows = outbox_rows(db)
    # SEARCH_INDEX and CACHE went on: one stage failing does not hold the others back.
    assert {(r["event_type"], r["current_stage"]) for r in rows if r["status"] == "READY"} == {
        ("HotelResourceUpdated", "CACHE"),
        ("HotelContentChanged", "PUBLISHED"),
        ("HotelMappingCreated", "PUBLISHED"),
    }
    waiting = [r for r in rows if r["next_stage"] == "NOTIFY"]
    assert len(waiting) == 9
    assert {r["retry_count"] for r in waiting} == {1}
    assert all("broker down" in r["last_error"] for r in waiting)
    assert all(r["next_attempt_at"] is not None for r in waiting)
    # Not due yet: nothing is claimed until the backoff passed (the database's clock).
    assert claim(db, "NOTIFY", owner="x") == []
    policy = STAGE_POLICIES["NOTIFY"]
    for _attempt in range(2, policy.max_attempts + 1):
        db.clock.advance(policy.cap_seconds * 2)
        d.drain()
    rows = outbox_rows(db)
    failed = [r for r in rows if r["status"] == "FAILED"]
    assert len(failed) == 9 and {r["retry_count"] for r in failed} == {policy.max_attempts}
    # One call more than attempts: in the first round the hotels' events, carried on from
    # CACHE, and the six events claimed at NOTIFY were two batches.
    assert broken.calls == policy.max_attempts + 1
    status = outbox_status(db)
    assert status.counts[("FAILED", "NOTIFY")] == 9
    # The broker is back; an operator retries the failed events and they are delivered.
    projections.notifier = JsonLinesNotifier(tmp_path / "notifications.jsonl")
    ids = [r["id"] for r in failed]
    with db.begin() as conn:
        assert retry_events(conn, ids) == 9
    d.drain()
    assert {r["status"] for r in outbox_rows(db)} == {"SUCCEEDED"}
    assert len(notified(tmp_path)) == 9


class BrokenCache(InProcessHotelCache):
    """A cache that is down."""

    def invalidate(self, keys: Sequence[str]) -> None:
        raise ProjectionUnavailable("cache down (test)")


def test_a_claimed_batch_is_carried_through_its_chain_and_settled_once(
    db: SyncDatabase, projections: Projections, tmp_path: Path
):
    publish(db, "b1", 4)
    d = Dispatcher(db, projections)
    report = d.run_from("SEARCH_INDEX")
    assert report.stages["SEARCH_INDEX"].claimed == 4
    assert [report.stages[s].advanced for s in ("SEARCH_INDEX", "CACHE", "NOTIFY")] == [4, 4, 4]
    rows = outbox_rows(db)
    hotels = [r for r in rows if r["event_type"] == "HotelResourceUpdated"]
    assert {(r["status"], r["current_stage"], r["next_stage"]) for r in hotels} == {
        ("SUCCEEDED", "NOTIFY", "END")
    }
    # Projected when the index was written, before the rest of the chain finished.
    assert all(r["created_at"] <= r["projected_at"] <= r["finished_at"] for r in hotels)
    assert len(projections.search.versions()) == 4
    # The other events were not claimed: they wait at NOTIFY.
    others = [r for r in rows if r["event_type"] != "HotelResourceUpdated"]
    assert {(r["status"], r["next_stage"]) for r in others} == {("READY", "NOTIFY")}
    assert {m["message_id"] for m in notified(tmp_path)} == {r["event_id"] for r in hotels}


class RecordingCache(InProcessHotelCache):
    """A cache that remembers the keys it was told to invalidate."""

    def __init__(self) -> None:
        super().__init__()
        self.invalidated: list[str] = []

    def invalidate(self, keys: Sequence[str]) -> None:
        self.invalidated.extend(keys)
        super().invalidate(keys)


def test_a_carried_batch_invalidates_the_cities_its_search_stage_read(
    db: SyncDatabase, projections: Projections
):
    publish(db, "b1", 3)
    cache = projections.cache = RecordingCache()
    hotel_reads: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "platform_hotel_resource" in (
            statement
        ):
            hotel_reads.append(statement)

    sa.event.listen(db.engine, "before_cursor_execute", count)
    try:
        Dispatcher(db, projections).run_from("SEARCH_INDEX")
    finally:
        sa.event.remove(db.engine, "before_cursor_execute", count)
    rids = sorted({r["aggregate_id"] for r in outbox_rows(db)})
    city = CITY_KEY.format(supplier_id=1001, city_code="BKK")
    assert sorted(cache.invalidated) == sorted(
        [city, *(HOTEL_KEY.format(resource_id=rid) for rid in rids)]
    )
    assert len(hotel_reads) == 1  # the search documents' read; CACHE asked nothing more
    # A batch claimed at CACHE (left there by a search-only dispatcher) reads its cities.
    publish(db, "b2", 2, version=2, facilities=["wifi"])
    Dispatcher(db, projections, stages=["SEARCH_INDEX"]).drain()
    cache.invalidated.clear()
    Dispatcher(db, projections).run_from("CACHE")
    assert city in cache.invalidated and len(cache.invalidated) == 3


def test_a_full_search_batch_is_projected_and_left_for_the_next_stage(
    db: SyncDatabase, projections: Projections
):
    publish(db, "b1", 3)
    d = Dispatcher(db, projections, batch_size=2)
    report = d.run_from("SEARCH_INDEX")  # full: more search work waits, so not carried
    assert report.stages["SEARCH_INDEX"].advanced == 2 and report.stages["CACHE"].advanced == 0
    hotels = [r for r in outbox_rows(db) if r["event_type"] == "HotelResourceUpdated"]
    assert sorted((r["status"], r["next_stage"]) for r in hotels) == [
        ("READY", "CACHE"),
        ("READY", "CACHE"),
        ("READY", "SEARCH_INDEX"),
    ]
    assert all(r["projected_at"] is not None for r in hotels if r["next_stage"] == "CACHE")
    report = d.run_from("SEARCH_INDEX")  # the last one: not full, carried to the end
    assert report.stages["NOTIFY"].advanced == 1
    d.drain()
    assert {r["status"] for r in outbox_rows(db)} == {"SUCCEEDED"}


def test_a_carried_event_stops_at_the_stage_that_fails_and_keeps_what_passed(
    db: SyncDatabase, projections: Projections
):
    publish(db, "b1", 3)
    projections.cache = BrokenCache()
    report = Dispatcher(db, projections).run_from("SEARCH_INDEX")
    assert report.stages["CACHE"].retrying == 3 and report.stages["NOTIFY"].advanced == 0
    hotels = [r for r in outbox_rows(db) if r["event_type"] == "HotelResourceUpdated"]
    for r in hotels:
        assert (r["status"], r["current_stage"], r["next_stage"]) == (
            "READY",
            "SEARCH_INDEX",
            "CACHE",
        )
        assert r["retry_count"] == 1 and "cache down" in r["last_error"]
        assert r["projected_at"] is not None and r["next_attempt_at"] is not None
        assert r["lease_owner"] is None
    # A dispatcher that runs only SEARCH_INDEX leaves what it projected READY at CACHE.
    publish(db, "b2", 2, version=2, facilities=["wifi"])
    Dispatcher(db, projections, stages=["SEARCH_INDEX"]).drain()
    again = [r for r in outbox_rows(db) if r["batch_id"] == "b2"]
    hotels2 = [r for r in again if r["event_type"] == "HotelResourceUpdated"]
    assert len(hotels2) == 2
    assert {(r["status"], r["next_stage"], r["retry_count"]) for r in hotels2} == {
        ("READY", "CACHE", 0)
    }


def test_backoff_grows_with_jitter_and_is_capped():
    policy = StagePolicy(max_attempts=5, base_seconds=1.0, cap_seconds=10.0, jitter=0.2)
    rng = random.Random(1)
    delays = [policy.delay(n, rng) for n in range(1, 7)]
    for n, d in zip(range(1, 7), delays, strict=True):
        raw = min(10.0, 2.0 ** (n - 1))
        assert raw * 0.8 <= d <= raw * 1.2
    assert len({round(policy.delay(3, rng), 6) for _ in range(20)}) > 1  # jitter


def test_the_stuck_pass_frees_a_killed_dispatcher_s_events_and_its_late_move_is_refused(
    db: SyncDatabase, projections: Projections
):
    publish(db, "b1", 5)
    taken = claim(db, "SEARCH_INDEX", owner="killed", limit=10, lease_seconds=30)
    assert len(taken) == 5
    assert release_stuck(db) == {}  # the lease holds
    assert outbox_status(db).stuck == 0
    db.clock.advance(31)
    assert outbox_status(db).stuck == 5
    assert release_stuck(db) == {"SEARCH_INDEX": 5}
    # The killed dispatcher comes back: its move matches nothing and changes nothing.
    assert advance(db, "SEARCH_INDEX", taken, owner="killed") == 0
    assert {r["status"] for r in outbox_rows(db) if r["next_stage"] == "SEARCH_INDEX"} == {"READY"}
    Dispatcher(db, projections).drain()
    assert {r["status"] for r in outbox_rows(db)} == {"SUCCEEDED"}
    assert len(projections.search.versions()) == 5


def test_operators_cancel_and_retry_only_what_the_table_allows(db: SyncDatabase):
    publish(db, "b1", 2)
    rows = outbox_rows(db)
    ids = [r["id"] for r in rows]
    with db.begin() as conn:
        assert cancel_events(conn, ids[:2]) == 2
    with pytest.raises(UnknownOutboxEvent, match="999999"), db.begin() as conn:
        cancel_events(conn, [999999])
    claimed = claim(db, "NOTIFY", owner="d", limit=1)
    with pytest.raises(InvalidTransition, match="PROCESSING"), db.begin() as conn:
        cancel_events(conn, [claimed[0].id])
    with pytest.raises(InvalidTransition, match="READY"), db.begin() as conn:
        retry_events(conn, [ids[-1]])  # READY: nothing to retry
    with db.begin() as conn:
        assert retry_events(conn, ids[:2]) == 2
    by_id = {r["id"]: r for r in outbox_rows(db)}
    assert [by_id[i]["status"] for i in ids[:2]] == ["READY", "READY"]


def test_reconciliation_finds_missing_and_stale_documents_per_city_and_repairs_them(
    db: SyncDatabase, projections: Projections, tmp_path: Path
):
    publish(db, "b1", 20)
    Dispatcher(db, projections).drain()
    clean = reconcile_projection(db, projections)
    assert (clean.cities, clean.hotels, clean.differences, clean.repaired) == (1, 20, [], 0)
    # Two documents lost, and a new version of three hotels not projected yet.
    with sqlite3.connect(tmp_path / "search.sqlite3") as conn:
        conn.execute("DELETE FROM hotel_search WHERE resource_id IN (1, 2)")
    sync(db, "b2", [hotel(f"H{i}", 2, facilities=["wifi"]) for i in range(10, 13)])
    report = reconcile_projection(db, projections, repair=False)
    (diff,) = report.differences
    assert (diff.city_code, diff.catalog_count, diff.projected_count) == ("BKK", 20, 18)
    assert (diff.missing, diff.stale, diff.extra) == (2, 3, 0)
    assert diff.catalog_checksum != diff.projected_checksum and report.repaired == 0
    repaired = reconcile_projection(db, projections)
    assert repaired.repaired == 5
    assert reconcile_projection(db, projections).differences == []
    with db.engine.connect() as conn:
        catalog = dict(
            conn.execute(
                sa.select(
                    schema.platform_hotel.c.resource_id, schema.platform_hotel.c.publish_version
                )
            ).all()
        )
    assert projections.search.versions() == catalog
