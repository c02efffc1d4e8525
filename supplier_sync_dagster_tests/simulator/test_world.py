"""The simulated world: determinism, realism, laziness and daily churn."""

from __future__ import annotations

import math
import re
import time
import unicodedata
from decimal import Decimal

import phonenumbers
import pycountry
import pytest

from supplier_sync_dagster.simulator import (
    HOSTILE_CITY_CODES,
    FaultProfile,
    Simulator,
    SimulatorConfig,
    locales,
)
from supplier_sync_dagster.simulator.data import World
from supplier_sync_dagster_tests.helpers import make_simulator
from supplier_sync_dagster_tests.simulator.contract_check import violation
from supplier_sync_dagster_tests.simulator.helpers import make_sim, walk_pages


def _all_records(sim: Simulator) -> list[dict]:
    with sim.client() as c:
        return [h for code in sim.city_codes() for h in walk_pages(c, code, 500)]


def test_same_seed_same_bytes_other_seed_other_world() -> None:
    a, b, other = make_sim(seed=7), make_sim(seed=7), make_sim(seed=8)
    with a.client() as ca, b.client() as cb, other.client() as co:
        assert ca.get("/v1/cities").content == cb.get("/v1/cities").content
        code = a.city_codes()[0]
        pa = ca.get(f"/v1/cities/{code}/hotels", params={"page_size": 50}).json()
        pb = cb.get(f"/v1/cities/{code}/hotels", params={"page_size": 50}).json()
        # Cursors carry their issue time; everything else is identical.
        pa.pop("next_cursor"), pb.pop("next_cursor")
        assert pa == pb
        assert co.get("/v1/cities").content != ca.get("/v1/cities").content
    assert a.ground_truth() == b.ground_truth()


def test_hotel_counts_are_skewed_with_a_long_tail_and_empty_cities() -> None:
    world = World(SimulatorConfig(n_cities=40, total_hotels=40_000))
    counts = [c.initial_hotels for c in world.cities]
    assert sum(counts) == 40_000
    non_empty = [n for n in counts if n]
    assert non_empty == sorted(non_empty, reverse=True), "bigger cities get more hotels"
    assert any(n == 0 for n in counts), "some cities have no hotel"
    assert counts[0] > 5 * sorted(counts)[len(counts) // 2], "the biggest city dwarfs the median"
    assert len({c.country_code for c in world.cities}) > 15, "cities spread over the world"
    assert len({c.code for c in world.cities}) == 40


def test_big_world_is_lazy() -> None:
    started = time.monotonic()
    sim = make_simulator(n_cities=1000, total_hotels=1_000_000)
    with sim.client() as c:
        body = c.get("/v1/cities").json()
    assert body["total"] == 1000
    assert sum(x["hotel_count"] for x in body["cities"]) == 1_000_000
    assert not sim.world._states, "listing cities generates no hotel"
    small = min((x for x in body["cities"] if x["hotel_count"]), key=lambda x: x["hotel_count"])
    with sim.client() as c:
        page = c.get(f"/v1/cities/{small['city_code']}/hotels", params={"page_size": 5}).json()
    assert page["total"] == small["hotel_count"]
    assert len(sim.world._states) == 1, "only the asked city was generated"
    assert time.monotonic() - started < 20


def test_records_are_realistic_and_valid(clean_sim: Simulator) -> None:
    records = _all_records(clean_sim)
    assert len(records) == 600
    cities = {c.code: c for c in clean_sim.world.cities}
    for rec in records:
        assert violation(rec) is None, (rec["hotel_id"], violation(rec))
        city = cities[rec["city_code"]]
        assert rec["country_code"] == city.country_code
        assert pycountry.countries.get(alpha_2=city.country_code) is not None
        # Near the city centre (a few tens of km at most).
        assert abs(rec["geo"]["lat"] - city.lat) < 1.0
        assert abs(((rec["geo"]["lng"] - city.lng + 180) % 360) - 180) < 3.0
        number = phonenumbers.parse(rec["phone"], None)
        assert phonenumbers.is_valid_number(number)
        assert phonenumbers.region_code_for_number(number) == city.country_code or (
            number.country_code == phonenumbers.country_code_for_region(city.country_code)
        )
        decimals = locales.minor_units(city.currency)
        for room in rec["rooms"]:
            for plan in room["rate_plans"]:
                assert plan["price"]["currency"] == city.currency
                amount = plan["price"]["amount"]
                assert Decimal(amount) > 0
                assert len(amount.partition(".")[2]) == decimals
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rec["updated_at"])
        assert rec["status"] in ("ACTIVE", "INACTIVE")


def test_names_follow_the_local_language() -> None:
    # Cities from a few script families, forced by building worlds with many cities.
    world = World(SimulatorConfig(n_cities=300, total_hotels=3000))
    scripts_seen = set()
    for city in world.cities:
        if (
            city.language.code not in ("ja", "zh", "th", "ru", "ar", "ko", "el", "hi")
            or not city.initial_hotels
        ):
            continue
        state = world.state(city, 0)
        rec = world.record(city, state.hotels[state.ids[0]], 0)
        local = rec["name_local"]
        assert local != rec["name"]
        assert any(ord(ch) > 0x2FF for ch in local), local
        scripts_seen.add(unicodedata.name(next(ch for ch in local if ord(ch) > 0x2FF)).split()[0])
        assert (
            rec["name"].isascii()
            or city.language.code == "ar"
            or rec["name"].replace("«", "").isascii()
        )
    assert len(scripts_seen) >= 3, scripts_seen


def test_advance_day_changes_versions_adds_and_removes() -> None:
    sim = make_sim(n_cities=5, total_hotels=4000, daily_add_rate=0.01, daily_remove_rate=0.01)
    before = sim.ground_truth()
    assert sim.advance_day() == 1
    after = sim.ground_truth()
    assert before.day == 0 and after.day == 1
    kept = before.versions.keys() & after.versions.keys()
    bumped = [h for h in kept if after.versions[h] > before.versions[h]]
    assert all(after.versions[h] >= before.versions[h] for h in kept), "versions never go back"
    share = len(bumped) / len(kept)
    # ~7 % prices + ~0.8 % content + ~0.2 % status, minus late arrivals.
    assert 0.04 < share < 0.13, share
    assert after.versions.keys() - before.versions.keys(), "hotels were added"
    assert before.versions.keys() - after.versions.keys(), "hotels were removed"
    with sim.client() as c:
        listed = sum(x["hotel_count"] for x in c.get("/v1/cities").json()["cities"])
        hid = bumped[0]
        rec = c.get(f"/v1/hotels/{hid}").json()
    assert listed == after.total
    assert rec["version"] == after.versions[hid]
    assert rec["updated_at"] > "2026-10-31T00:00:00Z"
    assert sim.ground_truth(day=0) == before, "a past day can still be reconstructed"


def test_prices_change_more_often_than_content() -> None:
    sim = make_sim(n_cities=3, total_hotels=3000, late_arrival_rate=0.0)
    world = sim.world
    sim.advance_day()
    price = content = 0
    for city in world.cities:
        s0, s1 = world.state(city, 0), world.state(city, 1)
        for num, h1 in s1.hotels.items():
            h0 = s0.hotels.get(num)
            if h0 is not None:
                price += h1.price_epoch > h0.price_epoch
                content += h1.content_epoch > h0.content_epoch
    assert price > 4 * content > 0


def test_hostile_cities_are_real_cities_with_a_few_hotels() -> None:
    sim = make_sim(FaultProfile(hostile_city_codes=True))
    hostile = [c for c in sim.world.cities if c.hostile]
    assert {c.code for c in hostile} == set(HOSTILE_CITY_CODES)
    assert any(len(c.code) == 64 and not c.code.isascii() for c in hostile)
    for c in hostile:
        assert 3 <= c.initial_hotels <= 6
        assert not math.isnan(c.lat) and c.name


@pytest.mark.parametrize("bad", [{"n_cities": 0}, {"total_hotels": -1}, {"api_key": ""}])
def test_config_is_validated(bad: dict) -> None:
    with pytest.raises(ValueError):
        SimulatorConfig(**bad)
    with pytest.raises(ValueError):
        FaultProfile(rate_500=1.5)
    with pytest.raises(ValueError):
        FaultProfile.named("nope")
    assert FaultProfile.named("clean") == FaultProfile()
    assert FaultProfile.named("flaky").rate_429 > 0
    hostile = FaultProfile.named("hostile")
    assert hostile.rate_429 > FaultProfile.flaky().rate_429 and hostile.detail_outage_rate > 0
