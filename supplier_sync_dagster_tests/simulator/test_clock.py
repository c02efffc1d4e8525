"""The instant clock: changes spread over the day, visible when they happen, late ones in minutes."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from typing import Any

import httpx
import pytest

from supplier_sync_dagster.simulator import FaultProfile, Simulator, SimulatorConfig
from supplier_sync_dagster.simulator.data import (
    ADDED,
    CHANGED,
    REMOVED,
    Event,
    hotel_id,
    rfc3339,
)
from supplier_sync_dagster_tests.helpers import make_simulator
from supplier_sync_dagster_tests.simulator.helpers import hotels_url, make_sim, walk_pages

EPOCH = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
DAY = 86_400
LATE: dict[str, Any] = {
    "n_cities": 3,
    "total_hotels": 1500,
    "late_arrival_rate": 0.3,
    "daily_price_change_rate": 0.2,
}


def _seconds(stamp: str) -> int:
    return int(dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp())


def _move_to(sim: Simulator, at: int) -> None:
    """Advance the clock to the Unix instant ``at`` (never backwards)."""
    clock = at - sim.config.epoch_seconds
    assert clock >= sim.clock
    sim.advance(clock - sim.clock)


def _day_events(sim: Simulator, day: int) -> list[tuple[str, Event]]:
    """Every event that happens during ``day`` (those of day ``day + 1``), with its city code."""
    world = sim.world
    return [(c.code, e) for c in world.cities for e in world.state(c, day + 1).events]


def _feed(client: httpx.Client, params: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    params = {**params, "limit": 1000}
    while True:
        r = client.get("/v1/hotels/changes", params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        out.extend(body["changes"])
        if body["next"] is None:
            return out
        params = {**body["next"], "limit": 1000}


def _versions(client: httpx.Client) -> dict[str, int]:
    return {h["hotel_id"]: h["version"] for h in _feed(client, {"since": "2000-01-01T00:00:00Z"})}


def test_the_clock_counts_seconds_and_advance_day_lands_on_day_starts() -> None:
    sim = make_sim()
    assert (sim.clock, sim.day, sim.now()) == (0, 0, EPOCH)
    assert sim.advance(90) == EPOCH + dt.timedelta(seconds=90)
    assert sim.advance(0) == sim.now() and sim.day == 0
    sim.advance(DAY)
    assert sim.day == 1 and sim.clock == DAY + 90
    assert sim.advance_day() == 2
    assert sim.clock == 2 * DAY and sim.now() == EPOCH + dt.timedelta(days=2)
    assert sim.advance_day(3) == 5 and sim.clock == 5 * DAY
    with pytest.raises(ValueError):
        sim.advance(-1)
    with pytest.raises(ValueError):
        sim.advance_day(0)
    late_start = make_sim(day=2, start_offset_seconds=3600)
    assert late_start.clock == 2 * DAY + 3600 and late_start.day == 2
    assert late_start.now() == EPOCH + dt.timedelta(days=2, hours=1)
    assert sim.stats["now"] == "2026-11-06T00:00:00Z" and sim.stats["day"] == 5


@pytest.mark.parametrize(
    "bad", [{"start_offset_seconds": -1}, {"start_offset_seconds": DAY}, {"late_max_seconds": 29}]
)
def test_clock_settings_are_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SimulatorConfig(**bad)
    assert SimulatorConfig().late_max_seconds == 600


def test_day_starts_are_what_they_were_before_the_instant_clock() -> None:
    # Fingerprints of ground_truth(day=d) computed with the day-lump model; without late
    # arrivals (whose visibility is all that changed) they must stay the same.
    sim = make_sim(
        FaultProfile(moved_hotel_rate=0.05, bad_record_rate=0.05),
        late_arrival_rate=0.0,
        daily_add_rate=0.02,
        daily_remove_rate=0.02,
        price_shock_rate=0.2,
    )
    fingerprints = []
    for d in range(4):
        t = sim.ground_truth(day=d)
        blob = json.dumps(
            [
                sorted(t.versions.items()),
                sorted(t.bad.items()),
                sorted(t.moved.items()),
                t.listed_by_city,
                sorted(t.inactive),
                sorted(t.price_shocks),
                {c: sorted(v.items()) for c, v in t.valid_by_city.items()},
            ],
            sort_keys=True,
        )
        fingerprints.append(hashlib.sha256(blob.encode()).hexdigest()[:16])
    assert fingerprints == [
        "2ebb4dd55b1c887e",
        "f549ccdc2947470c",
        "705a7e39a631e99c",
        "1991432fedf4f706",
    ]


def test_the_days_events_lead_from_one_day_state_to_the_next() -> None:
    sim = make_sim(**LATE, daily_add_rate=0.02, daily_remove_rate=0.02)
    world = sim.world
    start1, start2 = world.day_start(1), world.day_start(2)
    kinds = set()
    for city in world.cities:
        events = world.state(city, 2).events
        kinds |= {e.kind for e in events}
        assert [e.at for e in events] == sorted(e.at for e in events)
        assert all(start1 < e.at <= start2 for e in events)
        assert all(e.hotel is None for e in events if e.kind == REMOVED)
        # Just before the next day starts, only events at exactly its first second are missing.
        before = world.state_at(city, start2 - 1)
        after = world.state(city, 2)
        at_midnight = {e.num for e in events if e.at == start2}
        assert before.ids == after.ids
        assert {n for n in after.hotels if after.hotels[n] != before.hotels[n]} <= at_midnight
        for e in world.state(city, 1).pending:
            assert e.kind == CHANGED and start1 < e.at <= start1 + 600
    assert kinds == {ADDED, CHANGED, REMOVED}


def test_a_change_is_invisible_before_its_time_and_visible_after() -> None:
    sim = make_sim(late_arrival_rate=0.0)
    code, event = next(
        (code, e) for code, e in _day_events(sim, 0) if e.kind == CHANGED and e.at % DAY > 3600
    )
    assert event.hotel is not None
    hid = hotel_id(event.num)
    old = sim.ground_truth(day=0).versions[hid]
    with sim.client() as c:
        _move_to(sim, event.at - 1)
        assert c.get(f"/v1/hotels/{hid}").json()["version"] == old
        since = {"since": rfc3339(event.at)}
        assert hid not in {h["hotel_id"] for h in _feed(c, since)}
        assert sim.ground_truth().versions[hid] == old
        sim.advance(1)
        rec = c.get(f"/v1/hotels/{hid}").json()
        assert (rec["version"], rec["updated_at"]) == (event.hotel.version, rfc3339(event.at))
        assert [h["version"] for h in _feed(c, since) if h["hotel_id"] == hid] == [rec["version"]]
        listed = {h["hotel_id"]: h for h in walk_pages(c, code, 500)}
        assert listed[hid] == rec
        assert sim.ground_truth().versions[hid] == rec["version"]
    assert sim.ground_truth(day=0).versions[hid] == old, "day=d still means its start"


def test_a_late_change_shows_up_after_its_updated_at_with_that_earlier_updated_at() -> None:
    sim = make_sim(**LATE)
    late = [
        e
        for _, e in _day_events(sim, 0)
        if e.kind == CHANGED and e.hotel is not None and e.at != e.hotel.updated_at
    ]
    assert late
    assert all(30 <= e.at - e.hotel.updated_at <= 600 for e in late if e.hotel is not None)
    event = max(late, key=lambda e: e.at - e.hotel.updated_at if e.hotel else 0)
    assert event.hotel is not None
    hid, updated = hotel_id(event.num), event.hotel.updated_at
    with sim.client() as c:
        _move_to(sim, updated)
        since = {"since": rfc3339(updated)}
        assert hid not in {h["hotel_id"] for h in _feed(c, since)}, "changed, but not visible"
        _move_to(sim, event.at - 1)
        assert hid not in {h["hotel_id"] for h in _feed(c, since)}
        old = c.get(f"/v1/hotels/{hid}").json()
        assert old["version"] < event.hotel.version
        sim.advance(1)
        rec = c.get(f"/v1/hotels/{hid}").json()
        assert rec["version"] == event.hotel.version
        assert rec["updated_at"] == rfc3339(updated) < sim.now().strftime("%Y-%m-%dT%H:%M:%SZ")
        # A client that asked from its watermark of a minute ago never sees it.
        recent = {"since": rfc3339(event.at - 29)}
        assert hid not in {h["hotel_id"] for h in _feed(c, recent)}
        assert hid in {h["hotel_id"] for h in _feed(c, since)}


def test_a_late_change_past_midnight_is_applied_in_the_next_day() -> None:
    sim = make_sim(**{**LATE, "late_max_seconds": DAY})
    world = sim.world
    touched: dict[int, int] = {}
    for _, e in _day_events(sim, 1):
        touched[e.num] = touched.get(e.num, 0) + 1
    # One the next day touches in no other way (no newer change, no removal).
    pending = [
        (c, e) for c in world.cities for e in world.state(c, 1).pending if touched[e.num] == 1
    ]
    assert pending
    city, event = min(pending, key=lambda p: p[1].at)
    assert event.hotel is not None
    hid = hotel_id(event.num)
    assert event.hotel.updated_at < world.day_start(1) < event.at
    assert event in world.state(city, 2).events, "an event of the next day"
    sim.advance_day()
    assert sim.ground_truth().versions[hid] < event.hotel.version
    _move_to(sim, event.at)
    assert sim.ground_truth().versions[hid] == event.hotel.version
    with sim.client() as c:
        rec = c.get(f"/v1/hotels/{hid}").json()
    assert rec["version"] == event.hotel.version
    assert rec["updated_at"] == rfc3339(event.hotel.updated_at) < "2026-11-02T00:00:00Z"


def test_removals_give_404_once_their_time_has_passed() -> None:
    sim = make_sim(daily_remove_rate=0.02)
    code, event = next(
        (code, e) for code, e in _day_events(sim, 0) if e.kind == REMOVED and e.at % DAY > 60
    )
    hid = hotel_id(event.num)
    with sim.client() as c:
        _move_to(sim, event.at - 1)
        assert c.get(f"/v1/hotels/{hid}").status_code == 200
        assert hid in {h["hotel_id"] for h in walk_pages(c, code, 500)}
        sim.advance(1)
        r = c.get(f"/v1/hotels/{hid}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "HOTEL_NOT_FOUND"
        assert hid not in {h["hotel_id"] for h in walk_pages(c, code, 500)}
        assert hid not in _versions(c)
    assert hid not in sim.ground_truth().versions


def test_listing_totals_city_counts_and_summaries_move_within_the_day() -> None:
    sim = make_sim(FaultProfile(moved_hotel_rate=0.05), daily_add_rate=0.03, daily_remove_rate=0.01)
    start = sim.ground_truth()
    adds = sorted(e.at for _, e in _day_events(sim, 0) if e.kind == ADDED)
    seen_totals = set()
    with sim.client() as c:
        for at in (adds[0], adds[len(adds) // 2], adds[-1]):
            _move_to(sim, at)
            truth = sim.ground_truth()
            assert truth.at == at and truth.day == 0
            cities = {
                x["city_code"]: x["hotel_count"] for x in c.get("/v1/cities").json()["cities"]
            }
            assert cities == {code: len(ids) for code, ids in truth.listed_by_city.items()}
            seen_totals.add(truth.total)
            for code in sim.city_codes():
                page = c.get(hotels_url(code), params={"page_size": 7}).json()
                assert page["total"] == len(truth.listed_by_city[code])
                hotels = walk_pages(c, code, 100)
                assert [h["hotel_id"] for h in hotels] == list(truth.listed_by_city[code])
                s = c.get(f"/v1/cities/{code}/summary").json()
                assert s["hotel_count"] == len(truth.valid_by_city[code])
                assert s["inactive_count"] == len(truth.inactive & truth.valid_by_city[code].keys())
            assert _versions(c) == dict(truth.versions)
    assert len(seen_totals | {start.total}) > 1, "the number of hotels moved during the day"
    assert sim.ground_truth(day=0) == start


def _poll_day(sim: Simulator, overlap: int) -> dict[str, int]:
    """A client polling the feed every 300 s through day 1; the highest version it saw of each."""
    seen: dict[str, int] = {}

    def note(records: list[dict[str, Any]]) -> None:
        for h in records:
            seen[h["hotel_id"]] = max(seen.get(h["hotel_id"], 0), h["version"])

    with sim.client() as c:
        records = _feed(c, {"since": "2000-01-01T00:00:00Z"})
        note(records)
        watermark = (records[-1]["updated_at"], records[-1]["hotel_id"])
        for _ in range(DAY // 300):
            sim.advance(300)
            if overlap:
                params = {"since": rfc3339(_seconds(watermark[0]) - overlap)}
            else:
                params = {"since": watermark[0], "after_id": watermark[1]}
            records = _feed(c, params)
            note(records)
            if records:
                watermark = max(watermark, (records[-1]["updated_at"], records[-1]["hotel_id"]))
    return seen


@pytest.mark.parametrize("overlap", [0, 600])
def test_polling_the_feed_loses_late_changes_only_without_an_overlap(overlap: int) -> None:
    sim = make_sim(**LATE)
    sim.advance_day()
    seen = _poll_day(sim, overlap)
    assert sim.clock == 2 * DAY
    truth = sim.ground_truth()
    lost = {hid for hid, v in truth.versions.items() if seen.get(hid) != v}
    late = {
        hotel_id(e.num)
        for _, e in _day_events(sim, 1)
        if e.kind == CHANGED and e.hotel is not None and e.at != e.hotel.updated_at
    }
    if overlap:
        assert not lost, "an overlap of late_max_seconds sees every change"
    else:
        assert lost, "a client that never looks back loses late changes"
        assert lost <= late, "only late changes are lost"


def test_polling_a_big_world_stays_cheap() -> None:
    sim = make_simulator(n_cities=100, total_hotels=100_000)
    with sim.client() as c:
        c.get("/v1/hotels/changes", params={"since": "2026-11-01T00:00:00Z", "limit": 1000})
        sim.advance(300)  # the first instant of the day generates its events
        c.get("/v1/hotels/changes", params={"since": "2026-11-01T00:00:00Z", "limit": 1000})
        sim.advance(12 * 3600)
        for _ in range(3):
            sim.advance(300)
            since = rfc3339(sim.config.epoch_seconds + sim.clock - 600)
            started = time.perf_counter()
            r = c.get("/v1/hotels/changes", params={"since": since, "limit": 1000})
            assert r.status_code == 200 and r.json()["changes"]
            assert time.perf_counter() - started < 1.0


def test_advance_admin_path() -> None:
    sim = make_sim()
    with sim.client() as c:
        r = c.post("/_sim/advance", params={"seconds": 90})
        assert r.status_code == 200
        assert r.json() == {"day": 0, "now": "2026-11-01T00:01:30Z"}
        body = c.post("/_sim/advance", params={"seconds": DAY}).json()
        assert body == {"day": 1, "now": "2026-11-02T00:01:30Z"}
        assert sim.clock == DAY + 90
        for bad in ({}, {"seconds": "x"}, {"seconds": -5}):
            r = c.post("/_sim/advance", params=bad)
            assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_PARAMETER"
        assert c.get("/_sim/advance", params={"seconds": 1}).status_code == 404
        assert c.post("/_sim/advance_day").json() == {"day": 2}
        assert c.get("/_sim/stats").json()["now"] == "2026-11-03T00:00:00Z"
    assert sim.clock == 2 * DAY
