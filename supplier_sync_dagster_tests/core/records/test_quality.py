"""Tests of the row-level quality layer: every code from a crafted document, one failure per
record, precedence, moved hotels, duplicates, error types, and a large clean chunk."""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import pytest

from supplier_sync_dagster.core.records import quality as q
from supplier_sync_dagster.core.records import rules
from supplier_sync_dagster.core.records.deadletters import DeadLetter
from supplier_sync_dagster.core.records.normalize import (
    ERROR_CODES,
    NormalizedHotel,
    canonical_json,
    normalize_records,
)
from supplier_sync_dagster.simulator import (
    encode_city_code,
)
from supplier_sync_dagster_tests.core.records.test_normalize import EXAMPLE
from supplier_sync_dagster_tests.helpers import make_simulator

CITY = "BKK"
COUNTRIES = {"BKK": "TH", "CNX": "TH", "PAR": "FR"}


def _thai_record() -> dict[str, Any]:
    """normalize's example record, priced in baht (the city's currency), one plan edited."""
    record = copy.deepcopy(EXAMPLE)
    dlx = record["rooms"][0]
    for plan in dlx["rate_plans"]:
        plan["price"]["currency"] = "THB"
    dlx["rate_plans"][1].update(board="BB", available=True)
    record["rooms"] = [
        dlx,
        {"room_code": "STD", "name": "Standard", "max_occupancy": 2, "rate_plans": []},
    ]
    return record


RECORD: dict[str, Any] = _thai_record()


def _normalized(record: dict[str, Any]) -> dict[str, Any]:
    result = normalize_records([record])
    assert not result.rejections, result.rejections
    hotel = result.hotels[0]
    assert isinstance(hotel, NormalizedHotel)
    doc: dict[str, Any] = json.loads(canonical_json(hotel))
    return doc


BASE = _normalized(RECORD)


def doc(hotel_id: str = "H1", **changes: Any) -> dict[str, Any]:
    """A real normalized document (a deep copy) with a new id and top-level changes."""
    d = copy.deepcopy(BASE)
    d["supplier_hotel_id"] = hotel_id
    d.update(changes)
    return d


def with_plan(d: dict[str, Any], room: int, plan: int, **changes: Any) -> dict[str, Any]:
    d["rooms"][room]["rate_plans"][plan].update(changes)
    return d


def check(docs: list[dict[str, Any]], **kwargs: Any) -> q.QualityResult:
    kwargs.setdefault("city_code", CITY)
    kwargs.setdefault("city_countries", COUNTRIES)
    result = q.check_quality(docs, **kwargs)
    # Every input position is in exactly one bucket.
    buckets = (
        list(result.valid)
        + [f.index for f in result.failures]
        + [m.index for m in result.moved]
        + [d.index for d in result.duplicates]
    )
    assert sorted(buckets) == list(range(len(docs)))
    assert result.total == len(docs)
    for f in result.failures:
        assert f.error_code in q.QUALITY_CODES
        assert f.error_type == q.ERROR_TYPES[f.error_code]
        assert 0 < len(f.message) <= 1024
        assert f.message.isprintable(), repr(f.message)
    return result


def only_failure(d: dict[str, Any]) -> q.QualityFailure:
    result = check([doc("OK"), d, doc("OK2")])
    assert result.valid == (0, 2)
    assert len(result.failures) == 1
    failure = result.failures[0]
    assert failure.index == 1
    return failure


CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("lat", doc(lat=200.0), "LAT_OUT_OF_RANGE", "lat"),
    ("lat_low", doc(lat=-90.5), "LAT_OUT_OF_RANGE", "lat"),
    ("lng", doc(lng=-181.0), "LNG_OUT_OF_RANGE", "lng"),
    ("star_high", doc(star_rating="7"), "STAR_RATING_OUT_OF_RANGE", "star_rating"),
    ("star_step", doc(star_rating="3.3"), "STAR_RATING_OUT_OF_RANGE", "star_rating"),
    ("star_text", doc(star_rating="five"), "STAR_RATING_OUT_OF_RANGE", "star_rating"),
    ("status", doc(status="DELETED"), "UNKNOWN_STATUS", "status"),
    ("country", doc(country_code="ZZ"), "INVALID_COUNTRY", "country_code"),
    ("country_case", doc(country_code="th"), "INVALID_COUNTRY", "country_code"),
    ("phone_junk", doc(phone_e164="call us"), "INVALID_PHONE", "phone_e164"),
    ("phone_short", doc(phone_e164="+1234"), "INVALID_PHONE", "phone_e164"),
    ("phone_invalid", doc(phone_e164="+66000000000"), "INVALID_PHONE", "phone_e164"),
    ("version", doc(version=-1), "VALUE_OUT_OF_RANGE", "version"),
    ("control_name", doc(name="Hotel\x1b[31m"), "CONTROL_CHARACTERS", "name"),
    ("control_tab", doc(address_line1="1\tRoad"), "CONTROL_CHARACTERS", "address_line1"),
    ("control_c1", doc(name_local="A\x85B"), "CONTROL_CHARACTERS", "name_local"),
    ("oversized", doc(name="x" * 256), "OVERSIZED_STRING", "name"),
    ("oversized_postal", doc(postal_code="1" * 33), "OVERSIZED_STRING", "postal_code"),
    ("oversized_facility", doc(facilities=["wifi", "y" * 65]), "OVERSIZED_STRING", "facilities[1]"),
    (
        "control_caption",
        doc(images=[{"url": "https://a.example/1.jpg", "caption": "a\x00b"}]),
        "CONTROL_CHARACTERS",
        "images[0].caption",
    ),
    (
        "currency",
        with_plan(doc(), 0, 0, currency="XXX"),
        "UNKNOWN_CURRENCY",
        "rooms[0].rate_plans[0].currency",
    ),
    (
        "negative",
        with_plan(doc(), 0, 1, price="-0.01"),
        "NEGATIVE_PRICE",
        "rooms[0].rate_plans[1].price",
    ),
    (
        "amount",
        with_plan(doc(), 0, 1, price="12,50"),
        "INVALID_AMOUNT",
        "rooms[0].rate_plans[1].price",
    ),
    (
        "mixed",
        with_plan(doc(), 0, 1, currency="USD"),
        "MIXED_ROOM_CURRENCY",
        "rooms[0].rate_plans[1].currency",
    ),
    ("mismatch", doc(country_code="FR"), "COUNTRY_CITY_MISMATCH", "country_code"),
    ("malformed_type", doc(lat="13.7"), "MALFORMED_DOCUMENT", "lat"),
    ("malformed_missing", doc(name=None), "MALFORMED_DOCUMENT", "name"),
    ("malformed_facilities", doc(facilities=None), "MALFORMED_DOCUMENT", "facilities"),
]


@pytest.mark.parametrize(("d", "code", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_codes(d: dict[str, Any], code: str, field: str) -> None:
    failure = only_failure(d)
    assert (failure.error_code, failure.field) == (code, field), failure
    assert failure.supplier_hotel_id == "H1"
    assert failure.version == d["version"]


def test_every_code_is_documented_and_tested() -> None:
    tested = {c[2] for c in CASES}
    assert tested == set(q.QUALITY_CODES)
    assert set(q.RULES) | {"MALFORMED_DOCUMENT"} == set(q.QUALITY_CODES)
    for code, meaning in q.QUALITY_CODES.items():
        assert meaning
        if code in ERROR_CODES:
            assert meaning == ERROR_CODES[code]  # same name, same meaning


def test_malformed_key_missing() -> None:
    d = doc()
    del d["rooms"]
    failure = only_failure(d)
    assert (failure.error_code, failure.field) == ("MALFORMED_DOCUMENT", "rooms")
    unreadable = doc()
    del unreadable["version"]
    failure = only_failure(unreadable)
    assert (failure.error_code, failure.version) == ("MALFORMED_DOCUMENT", None)


def test_a_normalized_hotel_passes() -> None:
    result = check([doc("A"), doc("B", city_code="CNX"), BASE])
    assert result.valid == (0, 2)
    assert [m.index for m in result.moved] == [1]


def test_one_failure_per_record_in_precedence_order() -> None:
    # Control characters beat everything, then strings, then layer 3 in code order, layer 4
    # last; within one code the first field in document order.
    many = with_plan(
        doc("A", name="a\x1b", lat=500.0, status="X", country_code="FR"), 0, 0, currency="XXX"
    )
    no_control = with_plan(doc("B", lat=500.0, status="X", country_code="FR"), 0, 1, price="-1")
    layer4 = with_plan(doc("C", country_code="FR"), 0, 1, currency="USD")
    two_strings = doc("D", name="x" * 300, email="e" * 300 + "@x.example")
    result = check([many, no_control, layer4, two_strings])
    codes = [(f.error_code, f.field) for f in result.failures]
    assert codes == [
        ("CONTROL_CHARACTERS", "name"),
        ("LAT_OUT_OF_RANGE", "lat"),
        ("COUNTRY_CITY_MISMATCH", "country_code"),
        ("OVERSIZED_STRING", "name"),
    ]
    order = list(q.QUALITY_CODES)
    assert order.index("COUNTRY_CITY_MISMATCH") > order.index("NEGATIVE_PRICE")


def test_valid_records_of_the_same_chunk_pass() -> None:
    docs = [doc(f"H{i}") for i in range(10)]
    docs[3]["lat"] = 91.0
    docs[7]["rooms"][0]["rate_plans"][0]["currency"] = "XTS"
    result = check(docs)
    assert [f.index for f in result.failures] == [3, 7]
    assert result.valid == (0, 1, 2, 4, 5, 6, 8, 9)


def test_moved_hotels_are_routed_not_failed() -> None:
    docs = [doc("A"), doc("B", city_code="PAR", country_code="FR"), doc("C", city_code="NEW")]
    result = check(docs)
    assert result.valid == (0,)
    assert not result.failures
    assert [(m.index, m.supplier_hotel_id, m.city_code) for m in result.moved] == [
        (1, "B", "PAR"),
        (2, "C", "NEW"),  # a city missing from the city list: the country rule is skipped
    ]


def test_a_moved_hotel_is_validated_against_its_own_city() -> None:
    result = check([doc("B", city_code="PAR"), doc("C", city_code="PAR", lat=100.0)])
    assert [(f.index, f.error_code) for f in result.failures] == [
        (0, "COUNTRY_CITY_MISMATCH"),
        (1, "LAT_OUT_OF_RANGE"),
    ]
    assert not result.moved


def test_duplicates_collapse_to_the_highest_version() -> None:
    docs = [
        doc("A", version=3),
        doc("B", version=1),
        doc("A", version=5, name="newest"),
        doc("A", version=4),
        doc("B", version=1),  # a tie keeps the first seen
    ]
    result = check(docs)
    assert result.valid == (1, 2)
    assert [(d.index, d.supplier_hotel_id, d.version, d.kept_index) for d in result.duplicates] == [
        (0, "A", 3, 2),
        (3, "A", 4, 2),
        (4, "B", 1, 1),
    ]
    assert not result.failures


def test_a_failing_highest_version_fails_and_older_ones_are_duplicates() -> None:
    result = check([doc("A", version=1), doc("A", version=2, lat=999.0)])
    assert [(f.index, f.error_code) for f in result.failures] == [(1, "LAT_OUT_OF_RANGE")]
    assert [d.index for d in result.duplicates] == [0]
    assert result.valid == ()


def test_mixed_currencies_fail_only_within_a_room() -> None:
    mixed = with_plan(doc("A"), 0, 1, currency="EUR")
    per_room = doc("B")
    per_room["rooms"][1]["rate_plans"] = [
        {
            "code": "BAR",
            "board": None,
            "refundable": True,
            "available": True,
            "price": "10",
            "currency": "USD",
        }
    ]
    result = check([mixed, per_room])
    assert [(f.index, f.error_code) for f in result.failures] == [(0, "MIXED_ROOM_CURRENCY")]
    message = result.failures[0].message
    assert "'EUR'" in message and "'THB'" in message
    assert result.valid == (1,)


def test_country_mismatch_needs_a_mapping() -> None:
    result = check([doc("A", country_code="VN")])
    failure = result.failures[0]
    assert failure.error_code == "COUNTRY_CITY_MISMATCH"
    assert failure.error_type == "MAPPING_REQUIRED"
    assert failure.message == "country_code 'VN' is not the country of city 'BKK' ('TH')"
    assert check([doc("A", country_code="VN")], city_countries={}).valid == (0,)


def test_domain_failures_are_non_retryable_and_become_dead_letters() -> None:
    failure = only_failure(doc(lat=-100.0))
    assert failure.error_type == "NON_RETRYABLE"
    letter = failure.dead_letter("raw/abc", "f" * 64)
    assert letter == DeadLetter(
        "H1",
        "VALIDATION",
        "NON_RETRYABLE",
        "LAT_OUT_OF_RANGE",
        "lat is not within [-90, 90]: -100.0",
        "raw/abc",
        "f" * 64,
    )


def test_messages_are_truncated_and_safe() -> None:
    huge = "\x1b" + "x" * 100_000
    failure = only_failure(doc(name=huge))
    assert failure.error_code == "CONTROL_CHARACTERS"
    assert len(failure.message) < 300
    assert "...<100001 chars>" in failure.message
    failure = only_failure(doc(address_line1="y" * 100_000))
    assert failure.error_code == "OVERSIZED_STRING"
    assert "100000 characters long, over the limit of 512" in failure.message
    assert len(failure.message) < 400


def test_phone_parsing_can_be_left_to_normalization() -> None:
    # "+66000000000" has the E.164 shape of a real calling code but is not a valid number.
    shaped = doc(phone_e164="+66000000000")
    assert check([shaped], parse_phones=False).valid == (0,)
    assert check([shaped]).failures[0].error_code == "INVALID_PHONE"
    assert check([doc(phone_e164="+66 2 123")], parse_phones=False).failures


def test_empty_chunk() -> None:
    result = check([])
    assert result.valid == () and result.failures == ()


def test_pandera_global_settings_cannot_switch_the_checks_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pandera.config import ValidationDepth, config_context

    with config_context(validation_enabled=False, validation_depth=ValidationDepth.SCHEMA_ONLY):
        assert only_failure(doc(lat=300.0)).error_code == "LAT_OUT_OF_RANGE"


def test_does_not_import_dagster() -> None:
    import subprocess

    code = (
        "import sys, supplier_sync_dagster.core.records.quality; "
        "sys.exit(1 if any(m.split('.')[0] == 'dagster' for m in sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -- a large clean chunk from the simulator ----------------------------------------------------


def _simulator_docs(total: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
    sim = make_simulator(n_cities=4, total_hotels=total)
    client = sim.client()
    cities = client.get("/v1/cities").json()["cities"]
    records: list[Any] = []
    for city in cities:
        page = 1
        while True:
            r = client.get(
                f"/v1/cities/{encode_city_code(city['city_code'])}/hotels",
                params={"page": page, "page_size": 500},
            )
            hotels = r.json()["hotels"]
            if not hotels:
                break
            records.extend(hotels)
            page += 1
    result = normalize_records(records)
    assert not result.rejections
    docs = [json.loads(canonical_json(h)) for h in result.hotels]
    return docs, {c["city_code"]: c["country_code"] for c in cities}


def test_a_large_clean_chunk_passes_completely() -> None:
    docs, countries = _simulator_docs(2000)
    assert len(docs) >= 2000
    by_city: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_city.setdefault(d["city_code"], []).append(d)
    city, mine = max(by_city.items(), key=lambda kv: len(kv[1]))
    result = check(docs, city_code=city, city_countries=countries)
    assert not result.failures, result.failures[:5]
    assert not result.duplicates
    assert len(result.valid) == len(mine)
    assert len(result.moved) == len(docs) - len(mine)
    # And a damaged copy of the same chunk fails exactly where it was damaged.
    damaged = copy.deepcopy(docs)
    damaged[10]["lat"] = 123.0
    damaged[20]["country_code"] = "AQ"
    result = check(damaged, city_code=city, city_countries=countries)
    assert [(f.index, f.error_code) for f in result.failures] == [
        (10, "LAT_OUT_OF_RANGE"),
        (20, "COUNTRY_CITY_MISMATCH"),
    ]


@pytest.mark.parametrize("key", ["supplier_hotel_id", "name", "city_code", "postal_code"])
def test_string_limits_are_the_rules_limits(key: str) -> None:
    limit = rules.LIMITS[{"supplier_hotel_id": "hotel_id"}.get(key, key)]
    assert check([doc(**{key: "1" * limit})], city_countries={}).failures == ()
    (failure,) = check([doc(**{key: "1" * (limit + 1)})], city_countries={}).failures
    assert (failure.error_code, failure.field) == ("OVERSIZED_STRING", key)
    assert dict(q._STRING_FIELDS)[key] == limit


# -- the screen: pandera runs only when a rule finds a failing row ----------------------------


def _failing(docs: list[dict[str, Any]], countries: dict[str, str] = COUNTRIES) -> list[str]:
    return q._failing(q._collect(docs, range(len(docs))), countries)


_FAILING_CASES = [c for c in CASES if c[2] != "MALFORMED_DOCUMENT"]


@pytest.mark.parametrize(
    ("d", "code"), [c[1:3] for c in _FAILING_CASES], ids=[c[0] for c in _FAILING_CASES]
)
def test_the_screen_sends_every_failure_to_pandera(d: dict[str, Any], code: str) -> None:
    assert _failing([doc("OK")]) == []
    assert _failing([doc("OK"), d]) == [q.RULES[code].frame]


@pytest.mark.parametrize(
    ("d", "code"),
    [
        # Harmless non-printable characters: the screen's fast pass fails, the rule passes.
        (doc(name="Caf\xe9\xa0Bar", name_local="\u2028x"), None),
        # A price in another form than normalization's: parsed, not matched.
        (with_plan(doc(), 0, 0, price="1E+2"), None),
        # A line break cannot hide a bad price between two good ones.
        (with_plan(doc(), 0, 0, price="1\n2"), "INVALID_AMOUNT"),
        (with_plan(doc(), 0, 0, price="-1\n2"), "INVALID_AMOUNT"),
        # Null optional strings are not strings to check.
        (doc(name_local=None, email=None, phone_e164=None), None),
        (doc(star_rating=None), None),
    ],
)
def test_the_screen_and_pandera_agree(
    d: dict[str, Any], code: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    screened = check([doc("OK"), d])
    monkeypatch.setattr(q, "_failing", lambda *_: list(q._SCHEMAS))
    validated = check([doc("OK"), d])
    assert screened.failures == validated.failures
    assert [f.error_code for f in screened.failures] == ([code] if code else [])


def test_a_large_chunk_gives_the_same_result_without_the_screen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs, countries = _simulator_docs(1000)
    damaged = copy.deepcopy(docs)
    damaged[3]["rooms"][0]["rate_plans"][0]["price"] = "-5.00"
    damaged[7]["phone_e164"] = "+66000000000"
    damaged[9]["facilities"].append("z" * 65)
    city = docs[0]["city_code"]
    for chunk in (docs, damaged):
        screened = check(chunk, city_code=city, city_countries=countries)
        with monkeypatch.context() as m:
            m.setattr(q, "_failing", lambda *_: list(q._SCHEMAS))
            validated = check(chunk, city_code=city, city_countries=countries)
        assert (screened.valid, screened.failures, screened.moved) == (
            validated.valid,
            validated.failures,
            validated.moved,
        )
    assert [f.index for f in screened.failures] == [3, 7, 9]


# -- documents straight from normalization: the short pass gives the full pass's result --------


def _both(docs: list[dict[str, Any]], **kwargs: Any) -> q.QualityResult:
    """check_quality with ``normalized=True``, asserted equal to the full pass's result."""
    short = check(docs, parse_phones=False, normalized=True, **kwargs)
    full = check(docs, parse_phones=False, **kwargs)
    assert (short.valid, short.failures, short.moved, short.duplicates) == (
        full.valid,
        full.failures,
        full.moved,
        full.duplicates,
    )
    return short


def _normalized_docs(records: list[Any]) -> list[dict[str, Any]]:
    from supplier_sync_dagster.core.records.normalize import normalize_documents

    return normalize_documents(records).docs


def test_a_clean_normalized_chunk_is_not_flattened() -> None:
    docs = _normalized_docs([{**RECORD, "hotel_id": f"H{i}"} for i in range(50)])
    result = _both(docs)
    assert result.valid == tuple(range(50))
    assert result.seconds["flatten"] == 0.0  # the short pass decided


@pytest.mark.parametrize(
    ("change", "code"),
    [
        # Lower-casing lengthens "İ": normalization checked the facility as sent.
        (lambda r: r.update(facilities=["İ" * rules.LIMITS["facility"]]), "OVERSIZED_STRING"),
        (lambda r: r["rooms"][0]["rate_plans"][1]["price"].update(currency="USD"), None),
        (lambda r: r.update(country_code="FR"), "COUNTRY_CITY_MISMATCH"),
        (lambda r: r.update(city_code="PAR"), "COUNTRY_CITY_MISMATCH"),
        (lambda r: r.update(city_code="CNX"), None),  # moved, same country
        (lambda r: r.update(city_code="ZZZ"), None),  # moved to a city not listed
        (lambda r: r.update(name="名" * rules.LIMITS["name"]), None),
        (lambda r: r.update(facilities=["ß" * rules.LIMITS["facility"]]), None),
        (lambda r: r.update(phone=None, email=None, address=None), None),
    ],
)
def test_normalized_documents_fail_as_in_the_full_pass(change: Any, code: str | None) -> None:
    record = copy.deepcopy(RECORD)
    record["hotel_id"] = "BAD"
    change(record)
    docs = _normalized_docs([*({**RECORD, "hotel_id": f"H{i}"} for i in range(5)), record])
    assert len(docs) == 6
    result = _both(docs)
    if record["rooms"][0]["rate_plans"][1]["price"]["currency"] == "USD":
        code = "MIXED_ROOM_CURRENCY"
    assert [f.error_code for f in result.failures] == ([code] if code else [])
    assert len(result.valid) + len(result.moved) + len(result.failures) == 6


def test_normalized_duplicates_and_moves_are_the_full_pass_s() -> None:
    records = [
        {**RECORD, "hotel_id": "A", "version": 3},
        {**RECORD, "hotel_id": "A", "version": 5},
        {**RECORD, "hotel_id": "B", "city_code": "CNX"},
        {**RECORD, "hotel_id": "A", "version": 5},
    ]
    result = _both(_normalized_docs(records))
    assert result.valid == (1,) and [m.index for m in result.moved] == [2]
    assert sorted(d.index for d in result.duplicates) == [0, 3]
    assert _both(_normalized_docs(records), city_code=None).moved == ()


def test_fuzzed_normalized_chunks_give_the_full_pass_s_result() -> None:
    import random

    from supplier_sync_dagster_tests.core.records.test_normalize import EXAMPLE, _mutate

    rng = random.Random(42)
    seeds = [RECORD, EXAMPLE]
    docs: list[dict[str, Any]] = []
    for i in range(1200):
        record = copy.deepcopy(rng.choice(seeds))
        if rng.random() < 0.6:
            record = _mutate(record, rng)
        else:  # valid, but maybe moved, mismatched, mixed or lengthened by lower-casing
            record["city_code"] = rng.choice([*COUNTRIES, "ZZZ", "BKK", "BKK"])
            record["country_code"] = rng.choice(["TH", "TH", "TH", "FR"])
            plan = rng.choice([p for room in record["rooms"] for p in room["rate_plans"]])
            plan["price"]["currency"] = rng.choice(["THB"] * 8 + ["USD"])
            record["facilities"] = rng.choice([["wifi"], ["İ" * 64], ["İ" * 32, "Spa"]])
        if type(record) is dict:
            record["hotel_id"] = f"F{i % 700}"
        docs += _normalized_docs([record])
    assert len(docs) > 400
    short_passes = 0
    for start in range(0, len(docs), 4):
        chunk = docs[start : start + 4]
        short_passes += _both(chunk).seconds["flatten"] == 0.0
        if start % 40 == 0:
            _both(chunk, city_code=None)
            _both(chunk, city_countries={})
    assert 0 < short_passes < len(docs) // 4
