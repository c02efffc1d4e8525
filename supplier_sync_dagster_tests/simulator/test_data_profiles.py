"""Data profiles: the standard world unchanged, the rich one large and written in many scripts,
their settings checked."""

from __future__ import annotations

import hashlib
import json
import unicodedata
from typing import Any

import pytest

from supplier_sync_dagster.simulator import (
    FaultProfile,
    Simulator,
    SimulatorConfig,
    render,
    richtext,
)
from supplier_sync_dagster.simulator import config as sim_config
from supplier_sync_dagster.simulator.config import DataProfile
from supplier_sync_dagster_tests.helpers import make_simulator

# sha256 of every record of this world, rendered by the simulator before data profiles
# existed: the standard profile must keep drawing exactly these bytes.
_STANDARD_WORLD = dict(
    seed=42, n_cities=4, total_hotels=400, day=1, faults=FaultProfile.flaky(), price_shock_rate=0.05
)
_STANDARD_DIGEST = "e299ee82f2ad15b7a54a6551480c5bddbba76085c1d081357ee91038f6c0d75d"


def _digest(sim: Simulator, day: int) -> str:
    world, h = sim.world, hashlib.sha256()
    for city, state in world.all_states(day):
        for num in state.ids:
            h.update(world.render(city, state.hotels[num], day))
    return h.hexdigest()


def _records(sim: Simulator, day: int = 0) -> list[dict[str, Any]]:
    world = sim.world
    return [
        world.valid_record(city, state.hotels[num])
        for city, state in world.all_states(day)
        for num in state.ids
    ]


def _has(text: str, *names: str) -> bool:
    """Whether ``text`` holds a character whose Unicode name starts with one of ``names``."""
    return any(unicodedata.name(c, "").startswith(names) for c in text)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"data_profile": "standard"},
        # The standard profile's own values, given explicitly, are the standard profile.
        {"rooms_per_hotel": (1, 4), "description_chars": (0, 0), "non_ascii_share": 0.0},
    ],
)
def test_the_standard_profile_draws_the_same_bytes_as_before_profiles(
    settings: dict[str, Any],
) -> None:
    sim = Simulator(SimulatorConfig(**_STANDARD_WORLD, **settings))  # type: ignore[arg-type]
    assert sim.config.data.is_standard
    assert _digest(sim, 1) == _STANDARD_DIGEST


def test_a_profile_other_than_standard_draws_another_world() -> None:
    sim = Simulator(SimulatorConfig(**_STANDARD_WORLD, rooms_per_hotel=(1, 5)))  # type: ignore[arg-type]
    assert not sim.config.data.is_standard
    assert _digest(sim, 1) != _STANDARD_DIGEST


def test_the_catalogues_match_the_profile_limits() -> None:
    assert len(render.ROOM_TYPES) == sim_config.ROOM_TYPE_KINDS
    assert len(render.RATE_PLANS) == sim_config.RATE_PLAN_KINDS
    assert len(render.FACILITIES) == sim_config.FACILITY_KINDS
    assert len({r[0] for r in render.ROOM_TYPES}) == len(render.ROOM_TYPES)
    assert len({p[0] for p in render.RATE_PLANS}) == len(render.RATE_PLANS)
    assert render.RATE_PLANS[0][4] == 1000  # the first plan is always offered


def test_the_rich_profile_makes_large_hotels_in_many_scripts() -> None:
    sim = make_simulator(seed=5, n_cities=6, total_hotels=600, data_profile="rich")
    profile = sim.config.data
    assert profile == DataProfile.rich()
    records = _records(sim)
    standard = _records(make_simulator(seed=5, n_cities=6, total_hotels=600))
    assert len(records) == len(standard) == 600

    longest_sentence = max(len(s) for s in richtext.SENTENCES)
    for r in records:
        assert profile.rooms_per_hotel[0] <= len(r["rooms"]) <= profile.rooms_per_hotel[1]
        assert profile.images_per_hotel[0] <= len(r["images"]) <= profile.images_per_hotel[1]
        low, high = profile.facilities_per_hotel
        assert low <= len(r["facilities"]) <= high
        assert len({room["room_code"] for room in r["rooms"]}) == len(r["rooms"])
        for room in r["rooms"]:
            codes = [p["code"] for p in room["rate_plans"]]
            assert codes[0] == "BAR" and len(set(codes)) == len(codes)
        low, high = profile.description_chars
        assert low <= len(r["description"]) <= high + longest_sentence
        assert r["description"] == " ".join(r["description"].split())

    def mean(values: list[int]) -> float:
        return sum(values) / len(values)

    def plans(rs: list[dict[str, Any]]) -> float:
        return mean([len(room["rate_plans"]) for r in rs for room in r["rooms"]])

    assert mean([len(r["rooms"]) for r in records]) > 2 * mean([len(r["rooms"]) for r in standard])
    assert plans(records) > 1.5 * plans(standard)
    assert mean([len(json.dumps(r)) for r in records]) > 4 * mean(
        [len(json.dumps(s)) for s in standard]
    )
    assert all("description" not in r for r in standard)

    # Most hotels are written in other scripts: names, streets, captions and room names.
    foreign = [r for r in records if not r["name"].isascii()]
    assert 0.5 < len(foreign) / len(records) < 0.85
    text = " ".join(
        [r["name"] for r in records]
        + [r["address"]["line1"] for r in records]
        + [i["caption"] for r in records for i in r["images"]]
        + [room["name"] for r in records for room in r["rooms"]]
    )
    for script in ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "ARABIC", "CYRILLIC", "GREEK", "THAI"):
        assert _has(text, script), script
    assert _has(text, "LATIN SMALL LETTER E WITH", "LATIN SMALL LETTER A WITH")
    assert "\u200d" in text  # emoji joined by ZERO WIDTH JOINER
    assert any(ord(c) > 0xFFFF for c in text)  # beyond the Basic Multilingual Plane


def test_rich_records_are_the_same_for_the_same_config_and_follow_content_changes() -> None:
    a = make_simulator(seed=9, n_cities=3, total_hotels=200, data_profile="rich", day=3)
    b = make_simulator(seed=9, n_cities=3, total_hotels=200, data_profile="rich", day=3)
    assert _digest(a, 3) == _digest(b, 3)
    # What a hotel is stays; what its content team edits (address, description) moves on.
    before = {r["hotel_id"]: r for r in _records(a, 0)}
    after = {r["hotel_id"]: r for r in _records(a, 3)}
    edited = [h for h in after if h in before and after[h]["version"] != before[h]["version"]]
    assert edited
    for h in edited:
        assert after[h]["name"] == before[h]["name"]
        assert after[h]["geo"] == before[h]["geo"]


def test_overrides_change_the_profile() -> None:
    sim = make_simulator(
        seed=3,
        n_cities=3,
        total_hotels=150,
        data_profile="rich",
        rooms_per_hotel=(12, 12),
        description_chars=(0, 0),
        non_ascii_share=0.0,
    )
    assert sim.config.data.room_kinds == 14
    for r in _records(sim):
        assert len(r["rooms"]) == 12
        assert "description" not in r
    plain = make_simulator(seed=3, n_cities=3, total_hotels=150, non_ascii_share=1.0)
    assert all(not r["name"].isascii() for r in _records(plain))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"data_profile": "huge"}, "unknown data profile 'huge'; known: standard, rich"),
        ({"rooms_per_hotel": (0, 3)}, "rooms_per_hotel must satisfy 1 <= low <= high <= 7"),
        ({"rooms_per_hotel": (5, 2)}, "rooms_per_hotel must satisfy"),
        ({"rooms_per_hotel": (1, 15)}, "rooms_per_hotel must satisfy 1 <= low <= high <= 14"),
        ({"rooms_per_hotel": (1,)}, "rooms_per_hotel must be a pair of whole numbers"),
        ({"description_chars": (10, 5)}, "description_chars must satisfy"),
        ({"description_chars": (0, 10**6)}, "description_chars must satisfy"),
        ({"description_chars": (1.5, 2)}, "description_chars must be a pair of whole numbers"),
        ({"non_ascii_share": 1.5}, "non_ascii_share must be within [0, 1], got 1.5"),
        ({"non_ascii_share": -0.1}, "non_ascii_share must be within [0, 1]"),
    ],
)
def test_bad_profile_settings_are_refused_with_the_reason(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match="^SimulatorConfig: ") as raised:
        SimulatorConfig(**settings)
    assert message in str(raised.value)


def test_a_profile_of_ones_own_is_checked_too() -> None:
    with pytest.raises(ValueError, match="room_kinds must be within 1..14"):
        DataProfile(room_kinds=20)
    with pytest.raises(ValueError, match="rate_plan_kinds must be within 1..10"):
        DataProfile.rich().with_(rate_plan_kinds=0)
    with pytest.raises(ValueError, match="images_per_hotel must satisfy 0 <= low <= high <= 256"):
        DataProfile(images_per_hotel=(0, 300))
    assert DataProfile.named("rich").with_(name="mine").is_standard is False
    assert DataProfile(name="mine").is_standard
