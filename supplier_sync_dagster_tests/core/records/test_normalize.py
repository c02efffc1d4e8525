"""Tests of normalization: simulator ground truth, every error code, text/money/time rules,
canonical JSON, and a randomized mutation fuzzer (the normalizer must never raise)."""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
import math
import random
from decimal import Decimal
from typing import Any

import pydantic
import pytest

from supplier_sync_dagster.core.records import normalize as n
from supplier_sync_dagster.core.records import rules
from supplier_sync_dagster.core.records.normalize import (
    ERROR_CODES,
    ERROR_STAGES,
    NormalizedHotel,
    RatePlan,
    Rejection,
    canonical_json,
    content_fields,
    content_fingerprint,
    fingerprint,
    normalize_documents,
    normalize_record,
    normalize_records,
    price_fields,
    price_fingerprint,
    to_primitive,
)
from supplier_sync_dagster.core.records.undecodable import UndecodableRecord
from supplier_sync_dagster.simulator import (
    BAD_RECORD_REASONS,
    GEO_RENAMED_LOCATION,
    FaultProfile,
    Simulator,
    encode_city_code,
)
from supplier_sync_dagster_tests.helpers import make_simulator

# Ground-truth reason (simulator) -> (stage, error code, field) the normalizer must give.
EXPECTED_FOR_REASON: dict[str, tuple[str, str, str]] = {
    "MISSING_REQUIRED_FIELD:name": ("ADAPTER", "MISSING_REQUIRED_FIELD", "name"),
    "MISSING_REQUIRED_FIELD:city_code": ("ADAPTER", "MISSING_REQUIRED_FIELD", "city_code"),
    "MISSING_REQUIRED_FIELD:country_code": ("ADAPTER", "MISSING_REQUIRED_FIELD", "country_code"),
    "MISSING_REQUIRED_FIELD:geo": ("ADAPTER", "MISSING_REQUIRED_FIELD", "geo"),
    "MISSING_REQUIRED_FIELD:status": ("ADAPTER", "MISSING_REQUIRED_FIELD", "status"),
    "MISSING_REQUIRED_FIELD:updated_at": ("ADAPTER", "MISSING_REQUIRED_FIELD", "updated_at"),
    "MISSING_REQUIRED_FIELD:version": ("ADAPTER", "MISSING_REQUIRED_FIELD", "version"),
    "LAT_OUT_OF_RANGE": ("VALIDATION", "LAT_OUT_OF_RANGE", "geo.lat"),
    "STAR_RATING_OUT_OF_RANGE": ("VALIDATION", "STAR_RATING_OUT_OF_RANGE", "star_rating"),
    "UNKNOWN_CURRENCY": (
        "VALIDATION",
        "UNKNOWN_CURRENCY",
        "rooms[0].rate_plans[0].price.currency",
    ),
    "NEGATIVE_PRICE": ("VALIDATION", "NEGATIVE_PRICE", "rooms[0].rate_plans[0].price.amount"),
    "UNKNOWN_STATUS": ("VALIDATION", "UNKNOWN_STATUS", "status"),
    "INVALID_PHONE": ("VALIDATION", "INVALID_PHONE", "phone"),
    "CONTROL_CHARACTERS": ("VALIDATION", "CONTROL_CHARACTERS", "name"),
    "HTML_IN_NAME": ("VALIDATION", "HTML_IN_NAME", "name"),
    "OVERSIZED_STRING": ("VALIDATION", "OVERSIZED_STRING", "name"),
    "GEO_RENAMED_LOCATION": ("ADAPTER", "FIELD_RENAMED", "geo"),
}

EXAMPLE: dict[str, Any] = {
    "hotel_id": "H000123",
    "name": "Riverside Grand Hotel",
    "name_local": "โรงแรมริเวอร์ไซด์",
    "city_code": "BKK",
    "country_code": "TH",
    "address": {"line1": "123 Charoen Krung Rd", "postal_code": "10500"},
    "geo": {"lat": 13.7234, "lng": 100.5143},
    "star_rating": 4.5,
    "phone": "+66 2 123 4567",
    "email": "stay@riverside.example",
    "facilities": ["wifi", "pool", "parking"],
    "images": [{"url": "https://img.example/h/123/1.jpg", "caption": "Lobby"}],
    "rooms": [
        {
            "room_code": "DLX",
            "name": "Deluxe King",
            "bed_type": "KING",
            "max_occupancy": 2,
            "rate_plans": [
                {
                    "code": "BAR",
                    "board": "RO",
                    "refundable": True,
                    "available": True,
                    "price": {"amount": "120.50", "currency": "USD"},
                },
                {
                    "code": "NRF",
                    "board": "RO",
                    "refundable": False,
                    "available": False,
                    "price": {"amount": "99.00", "currency": "USD"},
                },
            ],
        },
        {
            "room_code": "STD",
            "name": "Standard Double",
            "bed_type": "DOUBLE",
            "max_occupancy": 2,
            "rate_plans": [],
        },
    ],
    "status": "ACTIVE",
    "updated_at": "2026-11-20T10:00:00Z",
    "version": 17,
}


def record(**changes: Any) -> dict[str, Any]:
    """A deep copy of the contract's example with top-level changes."""
    rec = copy.deepcopy(EXAMPLE)
    rec.update(changes)
    return rec


def ok(rec: object) -> NormalizedHotel:
    out = normalize_record(rec)
    assert isinstance(out, NormalizedHotel), out
    return out


def rejected(rec: object) -> Rejection:
    out = normalize_record(rec)
    assert isinstance(out, Rejection), out
    return out


def check_rejection(r: Rejection) -> None:
    """Invariants every rejection honours."""
    assert r.error_code in ERROR_CODES
    assert r.stage == ERROR_STAGES[r.error_code]
    assert r.error_code != "INTERNAL_ERROR", r
    assert 0 < len(r.message) <= 1024
    assert r.message.isprintable(), repr(r.message)  # no raw control or line breaks
    r.message.encode("utf-8")
    if r.supplier_hotel_id is not None:
        assert 0 < len(r.supplier_hotel_id) <= 128
        r.supplier_hotel_id.encode("utf-8")


def check_hotel(h: NormalizedHotel, rec: object) -> None:
    """A hotel equals its full re-validation and the slow (reference) path's output."""
    assert NormalizedHotel.model_validate(h.model_dump()) == h
    assert n._normalize(rec) == h
    assert h.updated_at.utcoffset() == dt.timedelta(0)
    canonical_json(h).decode("utf-8")


def walk(sim: Simulator, page_size: int = 200) -> list[dict[str, Any]]:
    """Every record of every city, with page numbers."""
    client = sim.client()
    records: list[dict[str, Any]] = []
    for city in client.get("/v1/cities").json()["cities"]:
        page = 1
        while True:
            r = client.get(
                f"/v1/cities/{encode_city_code(city['city_code'])}/hotels",
                params={"page": page, "page_size": page_size},
            )
            assert r.status_code == 200
            hotels = r.json()["hotels"]
            if not hotels:
                break
            records.extend(hotels)
            page += 1
    return records


# -- against the simulator's ground truth ---------------------------------------------------


@pytest.fixture(scope="module")
def bad_world() -> tuple[Simulator, list[dict[str, Any]]]:
    sim = make_simulator(
        FaultProfile.clean().with_(bad_record_rate=0.2, hostile_city_codes=True),
        n_cities=12,
        total_hotels=3000,
    )
    return sim, walk(sim)


def test_reason_table_covers_every_simulator_reason() -> None:
    assert set(EXPECTED_FOR_REASON) == {*BAD_RECORD_REASONS, GEO_RENAMED_LOCATION}
    for stage, code, _ in EXPECTED_FOR_REASON.values():
        assert ERROR_STAGES[code] == stage


def test_ground_truth_exactly(bad_world: tuple[Simulator, list[dict[str, Any]]]) -> None:
    sim, records = bad_world
    truth = sim.ground_truth()
    result = normalize_records(records)
    assert result.total == len(records) == truth.total

    assert {h.supplier_hotel_id: h.version for h in result.hotels} == dict(truth.valid)
    got: dict[str, tuple[str, str, str | None]] = {}
    for r in result.rejections:
        check_rejection(r)
        assert r.supplier_hotel_id is not None
        got[r.supplier_hotel_id] = (r.stage, r.error_code, r.field)
        reason = truth.bad[r.supplier_hotel_id]
        expected_version = (
            None if reason.endswith(":version") else truth.versions[r.supplier_hotel_id]
        )
        assert r.version == expected_version
    assert got == {hid: EXPECTED_FOR_REASON[reason] for hid, reason in truth.bad.items()}
    # The sample exercises every reason.
    assert set(truth.bad.values()) == set(BAD_RECORD_REASONS)

    by_id = {r["hotel_id"]: r for r in records}
    for h in result.hotels:
        assert h.city_code == by_id[h.supplier_hotel_id]["city_code"]  # verbatim, even hostile
    assert any(h.city_code == "../../etc" for h in result.hotels)


def test_outputs_are_traced_to_input_positions(
    bad_world: tuple[Simulator, list[dict[str, Any]]],
) -> None:
    _, records = bad_world
    page = records[:500]
    result = normalize_records(page)
    assert sorted(result.hotel_index + result.rejection_index) == list(range(len(page)))
    for i, h in zip(result.hotel_index, result.hotels, strict=True):
        assert page[i]["hotel_id"] == h.supplier_hotel_id
    for i, r in zip(result.rejection_index, result.rejections, strict=True):
        assert page[i]["hotel_id"] == r.supplier_hotel_id
    outcomes = result.outcomes()
    assert [o == normalize_record(rec) for o, rec in zip(outcomes, page, strict=True)] == [
        True
    ] * len(page)


@pytest.fixture(scope="module")
def rich_world() -> tuple[Simulator, list[dict[str, Any]]]:
    """Large hotels, most of their text in other scripts, some records bad."""
    sim = make_simulator(
        FaultProfile.clean().with_(bad_record_rate=0.2),
        n_cities=8,
        total_hotels=800,
        data_profile="rich",
    )
    return sim, walk(sim)


def test_rich_records_end_as_the_ground_truth_says(
    rich_world: tuple[Simulator, list[dict[str, Any]]],
) -> None:
    sim, records = rich_world
    truth = sim.ground_truth()
    result = normalize_records(records)
    assert {h.supplier_hotel_id: h.version for h in result.hotels} == dict(truth.valid)
    got = {r.supplier_hotel_id: (r.stage, r.error_code, r.field) for r in result.rejections}
    assert got == {hid: EXPECTED_FOR_REASON[reason] for hid, reason in truth.bad.items()}


def test_rich_text_is_kept_character_for_character(
    rich_world: tuple[Simulator, list[dict[str, Any]]],
) -> None:
    sim, records = rich_world
    by_id = {r["hotel_id"]: r for r in records}
    docs = normalize_documents(records).docs
    assert len(docs) == len(sim.ground_truth().valid)
    kept = []
    for doc in docs:
        rec = by_id[doc["supplier_hotel_id"]]
        pairs = [
            (doc["name"], rec["name"]),
            (doc["name_local"], rec["name_local"]),
            (doc["address_line1"], rec["address"]["line1"]),
            *(
                (d["caption"], i["caption"])
                for d, i in zip(doc["images"], rec["images"], strict=True)
            ),
            *((d["name"], r["name"]) for d, r in zip(doc["rooms"], rec["rooms"], strict=True)),
        ]
        for got, sent in pairs:
            assert got == sent
        kept += [sent for _, sent in pairs if not sent.isascii()]
    # The sample holds every kind of text the rich profile makes.
    text = "".join(kept)
    assert "\u200d" in text and any(ord(c) > 0xFFFF for c in text)
    assert any("\u0600" <= c <= "\u06ff" for c in text)  # Arabic
    assert any("\u4e00" <= c <= "\u9fff" for c in text)  # CJK


@pytest.mark.parametrize(
    "text",
    [
        "Family \U0001f468\u200d\U0001f469\u200d\U0001f467 Inn",  # emoji joined by ZWJ
        "\u0647\u062a\u0644\u200c\u0647\u0627",  # Persian with ZERO WIDTH NON-JOINER
        "Hotel\u00a0Central",  # a no-break space
        "\u200fفندق النخيل",  # a RIGHT-TO-LEFT MARK
        "Ryokan \U00020bb7",  # beyond the Basic Multilingual Plane
    ],
)
def test_text_with_format_characters_takes_the_fast_path_unchanged(text: str) -> None:
    assert not text.isprintable() or not text.isascii()
    rec = record(
        name=text,
        name_local=text,
        address={"line1": text, "postal_code": "10500"},
        images=[{"url": "https://img.example/1.jpg", "caption": text}],
    )
    rec["rooms"][0]["name"] = text
    fast = n._fast(rec)
    assert fast is not None and fast == to_primitive(ok(rec))
    assert fast["name"] == fast["name_local"] == fast["address_line1"] == text
    assert fast["images"][0]["caption"] == fast["rooms"][0]["name"] == text


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("Riverside\tGrand", None),  # valid, collapsed: the reference path's
        ("Riverside\x1b[31m", "CONTROL_CHARACTERS"),
        ("Riverside\x85", "CONTROL_CHARACTERS"),
        ("Riverside\ud800", "INVALID_UNICODE"),
    ],
)
def test_text_with_controls_or_surrogates_leaves_the_fast_path(text: str, code: str | None) -> None:
    assert not rules.formats_only(text)
    for field in ("name", "name_local", "address"):
        rec = record(**{field: {"line1": text} if field == "address" else text})
        assert n._fast(rec) is None
        out = normalize_record(rec)
        assert (out.error_code if isinstance(out, Rejection) else None) == code


@pytest.mark.parametrize("world", ["bad_world", "rich_world"])
def test_valid_records_take_the_fast_path_and_match_the_reference(
    world: str, request: pytest.FixtureRequest
) -> None:
    _, records = request.getfixturevalue(world)
    for rec in records:
        fast = n._fast(rec)
        out = normalize_record(rec)
        if isinstance(out, NormalizedHotel):
            assert fast is not None, rec["hotel_id"]  # no clean record falls to the slow path
            assert fast == to_primitive(out)
            check_hotel(out, rec)
        else:
            assert fast is None


def test_documents_are_the_primitive_form_of_the_outcomes(
    bad_world: tuple[Simulator, list[dict[str, Any]]],
) -> None:
    _, records = bad_world
    page = records[:2000]
    docs = normalize_documents(page)
    ref = normalize_records(page)
    assert docs.doc_index == ref.hotel_index and docs.rejection_index == ref.rejection_index
    assert docs.docs == [to_primitive(h) for h in ref.hotels]
    assert docs.rejections == ref.rejections
    assert ref.rejections and ref.hotels


def test_location_rename_rejects_every_record() -> None:
    sim = make_simulator(
        FaultProfile.clean().with_(location_rename_from_day=0, bad_record_rate=0.2),
        n_cities=5,
        total_hotels=300,
    )
    records = walk(sim)
    assert records
    result = normalize_records(records)
    assert result.hotels == []
    assert {(r.stage, r.error_code, r.field) for r in result.rejections} == {
        ("ADAPTER", "FIELD_RENAMED", "geo")
    }
    assert "location" in result.rejections[0].message
    assert set(sim.ground_truth().bad.values()) == {GEO_RENAMED_LOCATION}


# -- one test per error code -----------------------------------------------------------------


def _set(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    rec = record()
    target: Any = rec
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return rec


def _drop(path: tuple[Any, ...]) -> dict[str, Any]:
    rec = record()
    target: Any = rec
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return rec


PRICE = ("rooms", 0, "rate_plans", 0, "price")
CASES: list[tuple[str, object, str, str | None]] = [
    # (id, record, code, field)
    ("list", [EXAMPLE], "NOT_AN_OBJECT", None),
    ("string", "H1", "NOT_AN_OBJECT", None),
    ("null", None, "NOT_AN_OBJECT", None),
    ("bytes-not-utf8", UndecodableRecord("INVALID_UTF8", "name holds bytes that are not UTF-8"),
     "INVALID_UTF8", None),
    ("text-not-json", UndecodableRecord("INVALID_JSON", "the record is not JSON"), "INVALID_JSON",
     None),
    *[(f"missing-{f}", _drop((f,)), "MISSING_REQUIRED_FIELD", f) for f in n.REQUIRED_FIELDS],
    ("null-name", _set(("name",), None), "MISSING_REQUIRED_FIELD", "name"),
    ("blank-name", _set(("name",), " \t\n "), "MISSING_REQUIRED_FIELD", "name"),
    ("empty-id", _set(("hotel_id",), ""), "MISSING_REQUIRED_FIELD", "hotel_id"),
    ("missing-lat", _drop(("geo", "lat")), "MISSING_REQUIRED_FIELD", "geo.lat"),
    ("missing-currency", _drop((*PRICE, "currency")), "MISSING_REQUIRED_FIELD",
     "rooms[0].rate_plans[0].price.currency"),
    ("missing-url", _set(("images",), [{"caption": "x"}]), "MISSING_REQUIRED_FIELD",
     "images[0].url"),
    ("missing-available", _drop(("rooms", 0, "rate_plans", 1, "available")),
     "MISSING_REQUIRED_FIELD", "rooms[0].rate_plans[1].available"),
    ("renamed-geo", {("location" if k == "geo" else k): v for k, v in record().items()},
     "FIELD_RENAMED", "geo"),
    ("geo-string", _set(("geo",), "13.7,100.5"), "WRONG_TYPE", "geo"),
    ("rooms-object", _set(("rooms",), {"DLX": {}}), "WRONG_TYPE", "rooms"),
    ("room-list", _set(("rooms", 0), []), "WRONG_TYPE", "rooms[0]"),
    ("version-string", _set(("version",), "17"), "WRONG_TYPE", "version"),
    ("version-bool", _set(("version",), True), "WRONG_TYPE", "version"),
    ("version-float", _set(("version",), 17.0), "WRONG_TYPE", "version"),
    ("lat-string", _set(("geo", "lat"), "13.7"), "WRONG_TYPE", "geo.lat"),
    ("lat-bool", _set(("geo", "lat"), True), "WRONG_TYPE", "geo.lat"),
    ("name-number", _set(("name",), 5), "WRONG_TYPE", "name"),
    ("amount-float", _set((*PRICE, "amount"), 120.5), "WRONG_TYPE",
     "rooms[0].rate_plans[0].price.amount"),
    ("facilities-string", _set(("facilities",), "wifi"), "WRONG_TYPE", "facilities"),
    ("facility-number", _set(("facilities",), ["wifi", 3]), "WRONG_TYPE", "facilities[1]"),
    ("refundable-string", _set(("rooms", 0, "rate_plans", 0, "refundable"), "yes"),
     "WRONG_TYPE", "rooms[0].rate_plans[0].refundable"),
    ("status-int", _set(("status",), 1), "WRONG_TYPE", "status"),
    ("occupancy-string", _set(("rooms", 1, "max_occupancy"), "2"), "WRONG_TYPE",
     "rooms[1].max_occupancy"),
    ("date-only", _set(("updated_at",), "2026-11-20"), "INVALID_TIMESTAMP", "updated_at"),
    ("naive", _set(("updated_at",), "2026-11-20T10:00:00"), "INVALID_TIMESTAMP", "updated_at"),
    ("prose", _set(("updated_at",), "yesterday"), "INVALID_TIMESTAMP", "updated_at"),
    ("month-13", _set(("updated_at",), "2026-13-01T00:00:00Z"), "INVALID_TIMESTAMP",
     "updated_at"),
    ("offset-24h", _set(("updated_at",), "2026-11-01T00:00:00+24:00"), "INVALID_TIMESTAMP",
     "updated_at"),
    ("offset-minutes-75", _set(("updated_at",), "2026-11-01T00:00:00+05:75"), "INVALID_TIMESTAMP",
     "updated_at"),
    ("leap-second", _set(("updated_at",), "2026-12-31T23:59:60Z"), "INVALID_TIMESTAMP",
     "updated_at"),
    ("year-0", _set(("updated_at",), "0000-01-01T00:00:00Z"), "INVALID_TIMESTAMP", "updated_at"),
    ("year-overflow", _set(("updated_at",), "9999-12-31T23:00:00-05:00"), "INVALID_TIMESTAMP",
     "updated_at"),
    ("amount-words", _set((*PRICE, "amount"), "abc"), "INVALID_AMOUNT",
     "rooms[0].rate_plans[0].price.amount"),
    ("amount-exp", _set((*PRICE, "amount"), "1e5"), "INVALID_AMOUNT",
     "rooms[0].rate_plans[0].price.amount"),
    ("amount-nan", _set((*PRICE, "amount"), "NaN"), "INVALID_AMOUNT",
     "rooms[0].rate_plans[0].price.amount"),
    ("amount-arabic-digits", _set((*PRICE, "amount"), "١٢٠"), "INVALID_AMOUNT",
     "rooms[0].rate_plans[0].price.amount"),
    ("amount-comma", _set((*PRICE, "amount"), "12,50"), "INVALID_AMOUNT",
     "rooms[0].rate_plans[0].price.amount"),
    ("lat-200", _set(("geo", "lat"), 200.0), "LAT_OUT_OF_RANGE", "geo.lat"),
    ("lat-nan", _set(("geo", "lat"), math.nan), "LAT_OUT_OF_RANGE", "geo.lat"),
    ("lng-inf", _set(("geo", "lng"), math.inf), "LNG_OUT_OF_RANGE", "geo.lng"),
    ("lng-181", _set(("geo", "lng"), -181), "LNG_OUT_OF_RANGE", "geo.lng"),
    ("star-7", _set(("star_rating",), 7), "STAR_RATING_OUT_OF_RANGE", "star_rating"),
    ("star-negative", _set(("star_rating",), -0.5), "STAR_RATING_OUT_OF_RANGE", "star_rating"),
    ("star-4.3", _set(("star_rating",), 4.3), "STAR_RATING_OUT_OF_RANGE", "star_rating"),
    ("version-negative", _set(("version",), -1), "VALUE_OUT_OF_RANGE", "version"),
    ("occupancy-0", _set(("rooms", 0, "max_occupancy"), 0), "VALUE_OUT_OF_RANGE",
     "rooms[0].max_occupancy"),
    ("currency-XXX", _set((*PRICE, "currency"), "XXX"), "UNKNOWN_CURRENCY",
     "rooms[0].rate_plans[0].price.currency"),
    ("currency-gold", _set((*PRICE, "currency"), "XAU"), "UNKNOWN_CURRENCY",
     "rooms[0].rate_plans[0].price.currency"),
    ("currency-ZZZ", _set((*PRICE, "currency"), "ZZZ"), "UNKNOWN_CURRENCY",
     "rooms[0].rate_plans[0].price.currency"),
    ("currency-2", _set((*PRICE, "currency"), "US"), "UNKNOWN_CURRENCY",
     "rooms[0].rate_plans[0].price.currency"),
    ("price-negative", _set((*PRICE, "amount"), "-120.50"), "NEGATIVE_PRICE",
     "rooms[0].rate_plans[0].price.amount"),
    ("price-negative-int", _set((*PRICE, "amount"), -5), "NEGATIVE_PRICE",
     "rooms[0].rate_plans[0].price.amount"),
    ("status-lower", _set(("status",), "active"), "UNKNOWN_STATUS", "status"),
    ("status-suspended", _set(("status",), "SUSPENDED"), "UNKNOWN_STATUS", "status"),
    ("phone-na", _set(("phone",), "N/A"), "INVALID_PHONE", "phone"),
    ("phone-zeros", _set(("phone",), "+00 000"), "INVALID_PHONE", "phone"),
    ("country-ZZ", _set(("country_code",), "ZZ"), "INVALID_COUNTRY", "country_code"),
    ("country-alpha3", _set(("country_code",), "THA"), "INVALID_COUNTRY", "country_code"),
    ("email-two-at", _set(("email",), "a@@b.example"), "INVALID_EMAIL", "email"),
    ("email-no-at", _set(("email",), "reception"), "INVALID_EMAIL", "email"),
    ("email-space", _set(("email",), "a b@c.example"), "INVALID_EMAIL", "email"),
    ("url-js", _set(("images", 0, "url"), "javascript:alert(1)"), "INVALID_URL",
     "images[0].url"),
    ("url-relative", _set(("images", 0, "url"), "/h/1.jpg"), "INVALID_URL", "images[0].url"),
    ("name-esc", _set(("name",), "Riverside\x1b[31m"), "CONTROL_CHARACTERS", "name"),
    ("name-nul", _set(("name",), "River\x00side"), "CONTROL_CHARACTERS", "name"),
    ("name-c1", _set(("name",), "River\x85side"), "CONTROL_CHARACTERS", "name"),
    ("name-del", _set(("name",), "River\x7fside"), "CONTROL_CHARACTERS", "name"),
    ("id-newline", _set(("hotel_id",), "H1\n"), "CONTROL_CHARACTERS", "hotel_id"),
    ("city-tab", _set(("city_code",), "BKK\t"), "CONTROL_CHARACTERS", "city_code"),
    ("caption-bell", _set(("images", 0, "caption"), "Lobby\x07"), "CONTROL_CHARACTERS",
     "images[0].caption"),
    ("name-surrogate", _set(("name",), "River\ud800side"), "INVALID_UNICODE", "name"),
    ("html-bold", _set(("name",), "<b>Riverside</b>"), "HTML_IN_NAME", "name"),
    ("html-script", _set(("name",), "Riverside<script>alert(1)</script>"), "HTML_IN_NAME",
     "name"),
    ("html-onerror", _set(("name",), '<img src=x onerror="alert(1)">Riverside'),
     "HTML_IN_NAME", "name"),
    ("html-local", _set(("name_local",), "<i>x</i>"), "HTML_IN_NAME", "name_local"),
    ("html-room", _set(("rooms", 1, "name"), "Std <a href=x>"), "HTML_IN_NAME",
     "rooms[1].name"),
    ("name-256", _set(("name",), "x" * 256), "OVERSIZED_STRING", "name"),
    ("address-513", _set(("address",), {"line1": "y" * 513}), "OVERSIZED_STRING",
     "address.line1"),
    ("id-129", _set(("hotel_id",), "H" * 129), "OVERSIZED_STRING", "hotel_id"),
    ("city-65", _set(("city_code",), "C" * 65), "OVERSIZED_STRING", "city_code"),
    ("name-100kb", _set(("name",), "Grand · " * 12800), "OVERSIZED_STRING", "name"),
    ("facilities-257", _set(("facilities",), ["wifi"] * 257), "TOO_MANY_ITEMS", "facilities"),
    ("room-twice", _set(("rooms", 1, "room_code"), "DLX"), "DUPLICATE_CODE",
     "rooms[1].room_code"),
    ("plan-twice", _set(("rooms", 0, "rate_plans", 1, "code"), "BAR"), "DUPLICATE_CODE",
     "rooms[0].rate_plans[1].code"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rec", "code", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_error_codes(rec: object, code: str, field: str | None) -> None:
    r = rejected(rec)
    check_rejection(r)
    assert (r.error_code, r.field, r.stage) == (code, field, ERROR_STAGES[code])
    if isinstance(rec, dict) and rec.get("hotel_id") == "H000123":
        assert r.supplier_hotel_id == "H000123"
    elif r.field != "hotel_id":  # only an unreadable hotel_id gives None
        assert r.supplier_hotel_id is None
        assert code in ("NOT_AN_OBJECT", "INVALID_UTF8", "INVALID_JSON")
    if isinstance(rec, dict) and type(rec.get("version")) is int and rec["version"] >= 0:
        assert r.version == rec["version"]


def test_an_undecodable_record_keeps_its_readable_id_and_version() -> None:
    r = rejected(UndecodableRecord("INVALID_UTF8", "name holds bytes...", "H000123", 17))
    check_rejection(r)
    assert (r.error_code, r.stage, r.supplier_hotel_id, r.version) == (
        "INVALID_UTF8",
        "ADAPTER",
        "H000123",
        17,
    )
    assert r.message == "name holds bytes..."
    # An id that could not be shown safely is not one.
    assert rejected(UndecodableRecord("INVALID_JSON", "x", "H\n1")).supplier_hotel_id is None


def test_every_code_is_documented_and_tested() -> None:
    tested = {c[2] for c in CASES}
    # FUTURE_TIMESTAMP needs the database clock's bound: the next test.
    assert tested == set(ERROR_CODES) - {"INTERNAL_ERROR", "FUTURE_TIMESTAMP"}
    assert set(ERROR_STAGES) == set(ERROR_CODES)


def test_a_record_dated_after_the_bound_is_future_timestamp_on_both_paths() -> None:
    bound = dt.datetime(2026, 11, 20, 11, 0, tzinfo=dt.UTC)
    at_bound = record(updated_at="2026-11-20T11:00:00Z")  # the usual spelling: the fast path
    after = record(updated_at="2026-11-20T12:00:00.5+01:00")  # 11:00:00.5 UTC, by itself
    unusual = record(updated_at="2099-01-01T00:00:00Z", country_code="th")  # the reference
    both = record(updated_at="2099-01-01T00:00:00Z", star_rating=9)
    assert n._fast(copy.deepcopy(at_bound)) is not None and n._fast(unusual) is None
    page = normalize_documents([at_bound, after, unusual, both, "x"], not_after=bound)
    assert page.doc_index == [0] and page.rejection_index == [1, 2, 3, 4]
    codes = [(r.error_code, r.field, r.stage) for r in page.rejections]
    assert codes[:2] == [("FUTURE_TIMESTAMP", "updated_at", "VALIDATION")] * 2
    # Another problem of the record is reported first: only a valid record is judged by time.
    assert [c[0] for c in codes[2:]] == ["STAR_RATING_OUT_OF_RANGE", "NOT_AN_OBJECT"]
    future = page.rejections[0]
    check_rejection(future)
    assert (future.supplier_hotel_id, future.version) == ("H000123", EXAMPLE["version"])
    assert "2026-11-20T11:00:00.500000Z" in future.message
    assert "2026-11-20T11:00:00Z" in future.message
    # Without a bound nothing is judged by time (and a bound is the only difference).
    plain = normalize_documents([at_bound, after, unusual, both, "x"])
    assert plain.doc_index == [0, 1, 2]
    assert plain.docs[0] == page.docs[0]


def test_order_adapter_before_validation_and_required_first() -> None:
    rec = record(version="x")
    rec["geo"]["lat"] = 200
    assert rejected(rec).error_code == "WRONG_TYPE"  # although lat comes first
    rec = record(status="nope")
    del rec["name"]
    assert rejected(rec).field == "name"
    rec = record(star_rating=9, status="nope")
    assert rejected(rec).error_code == "STAR_RATING_OUT_OF_RANGE"  # first in field order
    rec = record()
    del rec["name"], rec["geo"]
    rec["location"] = {"lat": 1, "lng": 2}
    assert rejected(rec).field == "name"


def test_unreadable_id_and_version_are_none() -> None:
    r = rejected(record(hotel_id=["H1"], version=10**5000))
    assert r.supplier_hotel_id is None and r.version is None
    assert r.error_code == "WRONG_TYPE" and r.field == "hotel_id"


def test_harmless_names_are_not_html() -> None:
    for name in ("Hotel <3 Paris", "A&B Suites", "Hotel Oberon", "Plaza 5 > 4", "Villa a < b"):
        assert ok(record(name=name)).name == name


# -- text, facilities, money, time, phone ----------------------------------------------------


def test_whitespace_is_collapsed_but_other_spaces_kept() -> None:
    h = ok(record(name="  Riverside \t Grand\r\n  Hotel \n", name_local="ริเวอร์\u00a0ไซด์"))
    assert h.name == "Riverside Grand Hotel"
    assert h.name_local == "ริเวอร์\u00a0ไซด์"  # a no-break space is not ours to change
    h = ok(record(name_local="   ", address={"line1": " 1  Main\tSt ", "postal_code": ""}))
    assert h.name_local is None and h.address_line1 == "1 Main St" and h.postal_code is None


def test_facilities_are_trimmed_lowered_deduplicated_in_order() -> None:
    h = ok(record(facilities=[" WiFi ", "wifi", "Pool", "  ", "Free  Parking", "POOL"]))
    assert h.facilities == ("wifi", "pool", "free parking")
    assert ok(record(facilities=None)).facilities == ()


def test_money_is_exact_decimal() -> None:
    h = ok(record())
    plan = h.rooms[0].rate_plans[0]
    assert plan.price == Decimal("120.50") and str(plan.price) == "120.50"
    assert plan.currency == "USD"
    rec = record()
    rec["rooms"][0]["rate_plans"][0]["price"] = {"amount": 120, "currency": "usd"}
    plan = ok(rec).rooms[0].rate_plans[0]
    assert plan.price == Decimal(120) and plan.currency == "USD"
    rec["rooms"][0]["rate_plans"][0]["price"] = {"amount": "-0.00", "currency": "JPY"}
    assert str(ok(rec).rooms[0].rate_plans[0].price) == "0.00"


def test_timestamps_are_converted_to_utc() -> None:
    h = ok(record(updated_at="2026-11-20T17:00:00+07:00"))
    assert h.updated_at == dt.datetime(2026, 11, 20, 10, 0, tzinfo=dt.UTC)
    assert h.updated_at.utcoffset() == dt.timedelta(0)
    h = ok(record(updated_at="2026-11-20t09:30:00.123456789-00:30"))
    assert h.updated_at == dt.datetime(2026, 11, 20, 10, 0, 0, 123456, tzinfo=dt.UTC)
    assert ok(record()).updated_at.tzinfo is dt.UTC


def test_phone_is_e164_using_the_hotels_country() -> None:
    assert ok(record()).phone_e164 == "+6621234567"
    assert ok(record(phone="02 123 4567")).phone_e164 == "+6621234567"
    assert ok(record(phone="")).phone_e164 is None
    assert ok(record(phone=None)).phone_e164 is None


def test_codes_are_verbatim_and_country_upper_cased() -> None:
    h = ok(record(city_code=" x'; DROP TABLE t;-- ", country_code="th", hotel_id="H 1"))
    assert (h.city_code, h.country_code, h.supplier_hotel_id) == (
        " x'; DROP TABLE t;-- ",
        "TH",
        "H 1",
    )


def test_star_rating_is_a_half_step_decimal() -> None:
    assert ok(record(star_rating=4)).star_rating == Decimal("4.0")
    assert str(ok(record(star_rating=4.5)).star_rating) == "4.5"
    assert ok(record(star_rating=None)).star_rating is None


def test_unknown_extra_fields_are_ignored() -> None:
    assert ok(record(brand="X", geo={"lat": 1, "lng": 2, "alt": 3})).lat == 1.0


# -- the models validate on their own ---------------------------------------------------------


def test_models_validate_when_built_directly() -> None:
    fields = ok(record()).model_dump()
    assert NormalizedHotel(**fields) == ok(record())
    for change in (
        {"country_code": "ZZ"},
        {"version": True},
        {"version": -1},
        {"lat": 91.0},
        {"star_rating": Decimal("4.3")},
        {"name": "<b>x</b>"},
        {"name": "x\x1b"},
        {"phone_e164": "+00"},
        {"updated_at": dt.datetime(2026, 1, 1)},
        {"status": "active"},
    ):
        with pytest.raises(pydantic.ValidationError):
            NormalizedHotel(**{**fields, **change})
    with pytest.raises(pydantic.ValidationError):
        RatePlan(code="B", refundable=True, available=True, price=Decimal(-1), currency="USD")
    with pytest.raises(pydantic.ValidationError):
        RatePlan(code="B", refundable=True, available=True, price=Decimal(1), currency="XXX")
    hotel = ok(record())
    with pytest.raises(pydantic.ValidationError):
        hotel.name = "x"
    assert hash(hotel) == hash(ok(record()))
    # Fast-path models share their fields-set: a copy with changes must not leak into others.
    changed = hotel.model_copy(update={"name": "Other"})
    assert changed.name == "Other" and ok(record()).name == "Riverside Grand Hotel"
    assert hotel.model_fields_set == set(NormalizedHotel.model_fields)


# -- canonical JSON and fingerprints ----------------------------------------------------------


def test_canonical_json_is_stable_and_order_independent() -> None:
    a = ok(record())
    reversed_rec = dict(reversed(list(record().items())))
    reversed_rec["geo"] = {"lng": 100.5143, "lat": 13.7234}
    b = ok(reversed_rec)
    assert canonical_json(a) == canonical_json(b) == canonical_json(ok(record()))
    raw = canonical_json(a)
    data = json.loads(raw)
    assert list(data) == sorted(data)
    assert data["rooms"][0]["rate_plans"][0]["price"] == "120.50"
    assert data["star_rating"] == "4.5" and data["updated_at"] == "2026-11-20T10:00:00Z"
    assert fingerprint(a) == hashlib.sha256(raw).hexdigest()
    assert (
        raw == json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    )


def test_content_and_price_split() -> None:
    base = ok(record())
    rec = record(version=18, updated_at="2026-11-21T10:00:00Z")
    rec["rooms"][0]["rate_plans"][0]["price"]["amount"] = "130.00"
    rec["rooms"][0]["rate_plans"][1]["available"] = True
    repriced = ok(rec)
    assert fingerprint(base) != fingerprint(repriced)
    assert content_fingerprint(base) == content_fingerprint(repriced)
    assert price_fingerprint(base) != price_fingerprint(repriced)
    assert price_fields(repriced)[("DLX", "BAR")] == (Decimal("130.00"), "USD", True)
    assert "price" not in content_fields(base)["rooms"][0]["rate_plans"][0]
    renamed = ok(record(name="Riverside Grander Hotel"))
    assert content_fingerprint(base) != content_fingerprint(renamed)
    assert price_fingerprint(base) == price_fingerprint(renamed)


# -- messages stay safe -----------------------------------------------------------------------


def test_messages_are_truncated_and_safe() -> None:
    huge = "\x1b[2J" + "A" * 100_000
    for rec in (
        record(name=huge),
        record(name="x" * 100_000),
        record(status="\x1b[31m" * 20_000),
        record(updated_at="\n" * 100_000),
        record(version=10**5000),
        record(country_code="\ud800" * 1000),
        record(geo=[0] * 100_000),
    ):
        r = rejected(rec)
        check_rejection(r)
        assert "\x1b" not in r.message and "\n" not in r.message
        assert len(r.message) <= 300  # the shown value is at most 200 characters


def test_show_limits_each_kind() -> None:
    assert len(rules.show("é\x00" * 10_000)) <= 200
    assert rules.show(10**400).startswith("<integer of")
    assert rules.show({"a": 1}) == "<object with 1 keys>"
    assert rules.show(object()) == "<object>"


# -- the fuzzer: mutations of valid records must never raise -----------------------------------

JUNK: list[Any] = [
    None, True, False, 0, -1, 1, 2**70, -(10**30), 0.5, -0.0, 1e308, math.nan, math.inf,
    "", " ", "x", "-1", "1e5", "NaN", "ACTIVE", "USD", "TH", "\x00", "\x1b[31m", "\ud800",
    "<b>", "a" * 300, "é" * 70_000, "2026-11-20T10:00:00Z", "+66 2 123 4567", [], {}, [[[]]],
    {"a": 1}, ["wifi"], [{}], {"amount": "1", "currency": "USD"},
]  # fmt: skip


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(rec: Any, rng: random.Random) -> Any:
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(rec) if p]
        if not paths or rng.random() < 0.02:
            return rng.choice(JUNK)
        path = rng.choice(paths)
        parent: Any = rec
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        op = rng.random()
        if op < 0.25 and isinstance(parent, dict):
            del parent[key]
        elif op < 0.35 and isinstance(parent[key], str):
            s = parent[key]
            i = rng.randrange(len(s) + 1)
            parent[key] = (
                s[:i] + rng.choice(["\t", "\x00", "<i>", "  ", "\ud800", "-", "é"]) + s[i:]
            )
        elif op < 0.45 and isinstance(parent, dict):
            parent[rng.choice(["location", "geo", "price", "zzz"])] = parent.pop(key)
        else:
            parent[key] = copy.deepcopy(rng.choice(JUNK))
    return rec


def test_fuzz_never_raises(bad_world: tuple[Simulator, list[dict[str, Any]]]) -> None:
    _, records = bad_world
    rng = random.Random(1234)
    seeds = [EXAMPLE, *records[:300]]
    kinds = {NormalizedHotel: 0, Rejection: 0}
    codes: set[str] = set()
    for _ in range(3000):
        rec = _mutate(copy.deepcopy(rng.choice(seeds)), rng)
        out = normalize_record(rec)
        assert type(out) in kinds
        kinds[type(out)] += 1
        assert normalize_record(rec) == out  # deterministic
        fast = n._fast(rec) if type(rec) is dict else None
        if isinstance(out, Rejection):
            check_rejection(out)
            codes.add(out.error_code)
            assert fast is None
        else:
            check_hotel(out, rec)
            assert fast is None or fast == to_primitive(out)
    assert kinds[NormalizedHotel] > 100 and kinds[Rejection] > 1000
    assert len(codes) >= 12


# -- the rules module: every limit, enforced alike by both paths at its boundary ---------------


def _put(rec: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    parent: Any = rec
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return rec


def _plan(code: str) -> dict[str, Any]:
    plan = copy.deepcopy(EXAMPLE["rooms"][0]["rate_plans"][0])
    plan["code"] = code
    return plan


# limit name -> (field set, the value at length/count n, the error code at n + 1)
BOUNDARIES: dict[str, tuple[tuple[Any, ...], Any, str]] = {
    "hotel_id": (("hotel_id",), lambda n: "H" * n, "OVERSIZED_STRING"),
    "city_code": (("city_code",), lambda n: "C" * n, "OVERSIZED_STRING"),
    "code": (("rooms", 0, "room_code"), lambda n: "R" * n, "OVERSIZED_STRING"),
    "name": (("name",), lambda n: "n" * n, "OVERSIZED_STRING"),
    "address_line1": (("address", "line1"), lambda n: "a" * n, "OVERSIZED_STRING"),
    "postal_code": (("address", "postal_code"), lambda n: "1" * n, "OVERSIZED_STRING"),
    "phone": (("phone",), lambda n: "+66 2 123 4567".ljust(n), "OVERSIZED_STRING"),
    "email": (("email",), lambda n: "e" * (n - 10) + "@x.example", "OVERSIZED_STRING"),
    "facility": (("facilities",), lambda n: ["f" * n], "OVERSIZED_STRING"),
    "caption": (("images", 0, "caption"), lambda n: "c" * n, "OVERSIZED_STRING"),
    "url": (
        ("images", 0, "url"),
        lambda n: "https://i.example/" + "p" * (n - 18),
        "OVERSIZED_STRING",
    ),
    "facilities": (("facilities",), lambda n: [f"f{i}" for i in range(n)], "TOO_MANY_ITEMS"),
    "images": (
        ("images",),
        lambda n: [{"url": f"https://i.example/{i}"} for i in range(n)],
        "TOO_MANY_ITEMS",
    ),
    "rooms": (
        ("rooms",),
        lambda n: [{"room_code": f"R{i}", "name": "Room", "max_occupancy": 2} for i in range(n)],
        "TOO_MANY_ITEMS",
    ),
    "rate_plans": (
        ("rooms", 0, "rate_plans"),
        lambda n: [_plan(f"P{i}") for i in range(n)],
        "TOO_MANY_ITEMS",
    ),
    "max_occupancy": (("rooms", 0, "max_occupancy"), lambda n: n, "VALUE_OUT_OF_RANGE"),
    # No valid timestamp or amount is this long: the limit bounds what the pattern reads.
    "timestamp": (
        ("updated_at",),
        lambda n: "2026-11-20T10:00:00Z".ljust(n, "0"),
        "INVALID_TIMESTAMP",
    ),
    "amount": (
        ("rooms", 0, "rate_plans", 0, "price", "amount"),
        lambda n: "1" * n,
        "INVALID_AMOUNT",
    ),
}
_NO_VALID_VALUE_AT_LIMIT = {"timestamp", "amount"}


def test_every_limit_has_a_boundary_case() -> None:
    assert set(BOUNDARIES) == set(rules.LIMITS)
    assert n.LIMITS is rules.LIMITS


def _paths_agree(rec: dict[str, Any]) -> NormalizedHotel | Rejection:
    """The outcome of the reference path; the fast path and the page call must agree."""
    out = normalize_record(rec)
    fast = n._fast(copy.deepcopy(rec))
    page = normalize_documents([rec])
    if isinstance(out, Rejection):
        assert fast is None
        assert page.rejections == [out]
    else:
        assert page.docs == [to_primitive(out)]
    return out


@pytest.mark.parametrize("limit", sorted(BOUNDARIES))
def test_each_limit_of_rules_is_enforced_alike_by_both_paths(limit: str) -> None:
    path, value, code = BOUNDARIES[limit]
    size = rules.LIMITS[limit]
    at_limit = _paths_agree(_put(copy.deepcopy(EXAMPLE), path, value(size)))
    if limit not in _NO_VALID_VALUE_AT_LIMIT:
        assert isinstance(at_limit, NormalizedHotel), at_limit
        # The fast path takes the clean record at the limit, and gives the reference's output.
        assert n._fast(_put(copy.deepcopy(EXAMPLE), path, value(size))) == to_primitive(at_limit)
    over = _paths_agree(_put(copy.deepcopy(EXAMPLE), path, value(size + 1)))
    assert isinstance(over, Rejection) and over.error_code == code, over


@pytest.mark.parametrize(
    "amount",
    ["0", "00", "0.5", "00.50", "007.50", "10", "0.000001", "000.000000", "120.000", "1" * 15],
)
def test_the_fast_path_writes_each_amount_as_the_reference_does(amount: str) -> None:
    rec = _set(("rooms", 0, "rate_plans", 0, "price", "amount"), amount)
    out = normalize_record(rec)
    assert isinstance(out, NormalizedHotel)
    fast = n._fast(rec)
    assert fast is not None and fast == to_primitive(out)
    assert fast["rooms"][0]["rate_plans"][0]["price"] == str(Decimal(amount))


# -- the table of string fields: every row, every shape, alike on both paths -------------------

_ABSENT = object()
_SHAPES: list[Any] = [
    _ABSENT,
    None,
    "",
    " ",
    "  Two  Words ",
    "a\tb",
    "a\nb",
    "a\x00b",
    "a\x1bb",
    "a\x85b",
    "\ud800",
    "<b>Hotel</b>",
    "Hotel <3",
    "Café\xa0Bar",
    "ÉCOLE",
    5,
    4.5,
    True,
    ["x"],
    {"x": 1},
]


def _at_source(source: str) -> tuple[Any, ...]:
    """The path into EXAMPLE of a string field's ``source``, item 0 for each ``[]``."""
    path: list[Any] = []
    for part in source.split("."):
        if part.endswith("[]"):
            path += [part[:-2], 0]
        else:
            path.append(part)
    return tuple(path)


def _with_value(source: str, value: Any) -> dict[str, Any]:
    rec = record()
    path = _at_source(source)
    parent: Any = rec
    for key in path[:-1]:
        parent = parent[key]
    if value is _ABSENT:
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
        else:
            del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return rec


@pytest.mark.parametrize("rule", rules.STRING_FIELDS, ids=lambda r: r.source)
def test_each_string_field_is_treated_alike_by_both_paths(rule: rules.StringField) -> None:
    """The fast path tests each value's shape inline: the table's rows must hold for it too."""
    limit = rule.limit
    shapes = [*_SHAPES, "x" * limit, "x" * (limit + 1), "x" * (limit - 1) + "\t", " " * limit]
    for value in shapes:
        rec = _with_value(rule.source, value)
        out = _paths_agree(rec)
        fast = n._fast(copy.deepcopy(rec))
        if fast is not None:
            assert isinstance(out, NormalizedHotel) and fast == to_primitive(out), (rule, value)


@pytest.mark.parametrize(
    "updated_at",
    [
        "2026-11-20T10:00:00Z",
        "2026-11-20t10:00:00z",
        "2026-11-20 10:00:00Z",
        "2026-11-20T10:00:00.5Z",
        "2026-11-20T10:00:00.000000Z",
        "2026-11-20T10:00:00+00:00",
        "2026-11-20T10:00:00-03:30",
        "0001-01-01T00:00:00Z",
        "9999-12-31T23:59:59Z",
        "2026-02-30T00:00:00Z",
        "2026-11-20T24:00:00Z",
        "2026-11-20T10:00:60Z",
        "2026-11-20X10:00:00Z",
    ],
)
def test_the_fast_path_writes_each_timestamp_as_the_reference_does(updated_at: str) -> None:
    rec = record(updated_at=updated_at)
    out = _paths_agree(rec)
    fast = n._fast(copy.deepcopy(rec))
    if isinstance(out, NormalizedHotel):
        assert fast == to_primitive(out)


def test_canonical_lines_are_each_document_s_canonical_json() -> None:
    docs = normalize_documents(
        [
            EXAMPLE,
            {**EXAMPLE, "hotel_id": "Ĥ名\u2028", "name": "é" * 255, "geo": {"lat": 1e-7, "lng": 0}},
        ]
    ).docs
    assert len(docs) == 2
    assert n.canonical_lines(docs) == [n.canonical_dumps(d) for d in docs]
    assert n.canonical_lines([]) == []
