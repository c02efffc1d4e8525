"""decode_json must read exactly what ``json.loads(raw.decode("utf-8"))`` reads, nested no deeper
than its limit; decode_page keeps a page's records past one undecodable element."""

from __future__ import annotations

import json
import math

import pytest

from supplier_sync_dagster.core.records.undecodable import UndecodableRecord
from supplier_sync_dagster.core.supplier.models import JsonTooDeep, decode_json, decode_page

SAME = [
    b'{"hotels": [{"hotel_id": "H1", "version": 3, "geo": {"lat": 13.75, "lng": -0.0}}]}',
    b"-0",
    b"1E5",
    b"[1.0e-400]",
    b'"\\u0000"',
    b'{"a": "\\ud83d\\ude00"}',
    b'  {"a" : [ ] }  ',
    b'{"a": 1, "a": 2}',
    b"12345678901234567890",  # beyond int64: orjson would give a float
    b"123456789012345678901234567890",
    b"[9223372036854775808, -9223372036854775809]",  # 19 digits, just beyond int64
    b"10000000000000000000",
    b"[999999999999999999]",  # 18 digits: orjson reads it
    b"[0.1234567890123456789012]",
    b"1.7976931348623157e308",
    '"é\x7f"'.encode(),
]


@pytest.mark.parametrize("raw", SAME)
def test_same_value_and_type_as_the_standard_library(raw: bytes) -> None:
    got, want = decode_json(raw), json.loads(raw.decode("utf-8"))
    assert got == want
    assert repr(got) == repr(want)  # int stays int, -0.0 stays -0.0


@pytest.mark.parametrize("raw", [b"[NaN]", b"[Infinity]", b"1e400"])
def test_what_only_the_standard_library_accepts_is_accepted(raw: bytes) -> None:
    got = decode_json(raw)
    value = got[0] if isinstance(got, list) else got
    assert math.isnan(value) or math.isinf(value)


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"\xff\xfe{}", UnicodeDecodeError),
        (b'{"a": "\xc3"}', UnicodeDecodeError),
        (b"[1,]", ValueError),
        (b"<html>", ValueError),
        (b'{"a": "\\ud800"', ValueError),
        (b"", ValueError),
    ],
)
def test_errors_are_the_standard_librarys(raw: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        decode_json(raw)


# --- nesting --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b"[" * 1025 + b"]" * 1025,  # just past orjson's limit
        b"[" * 5000 + b"12345678901234567890" + b"]" * 5000,  # the standard library's path
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    ],
    ids=["100k", "1025", "long-digits", "objects"],
)
def test_json_nested_too_deep_is_json_too_deep_never_a_recursion_error(raw: bytes) -> None:
    with pytest.raises(JsonTooDeep):
        decode_json(raw)
    with pytest.raises(JsonTooDeep):
        decode_page(raw)


def test_json_nested_within_the_limit_is_read() -> None:
    assert decode_json(b"[" * 500 + b"]" * 500) is not None


# --- pages that keep their records past one undecodable element ------------------------------


def _page(*records: bytes, key: bytes = b"hotels") -> bytes:
    return b'{"city_code": "BKK", "' + key + b'": [' + b", ".join(records) + b'], "total": 3}'


H1 = b'{"hotel_id": "H1", "name": "One", "version": 1}'
H3 = b'{"hotel_id": "H3", "name": "Three", "version": 3, "big": 123456789012345678901}'


@pytest.mark.parametrize("raw", SAME)
def test_decode_page_reads_what_decode_json_reads(raw: bytes) -> None:
    assert repr(decode_page(raw)) == repr(decode_json(raw))


@pytest.mark.parametrize("key", [b"hotels", b"changes", b"details"])
def test_a_record_with_bytes_that_are_not_utf8_is_marked_in_its_place(key: bytes) -> None:
    bad = b'{"hotel_id": "H2", "name": "Caf\xe9 \xff", "version": 2}'
    body = decode_page(_page(H1, bad, H3, key=key))
    one, two, three = body[key.decode()]
    assert one == json.loads(H1) and repr(three) == repr(json.loads(H3))  # exact, big int
    assert isinstance(two, UndecodableRecord)
    assert (two.error_code, two.hotel_id, two.version) == ("INVALID_UTF8", "H2", 2)
    assert two.message == "name holds bytes that are not UTF-8 (0xE9 0xFF): 'Caf\ufffd \ufffd'"
    assert body["city_code"] == "BKK" and body["total"] == 3


def test_a_record_that_is_not_json_is_marked_in_its_place() -> None:
    bad = b'{"hotel_id": "H2", "stars": 4.5.1}'
    one, two, three, four = decode_page(_page(H1, bad, b"null", H3))["hotels"]
    assert (one, three) == (json.loads(H1), None)  # a null element stays null
    assert isinstance(two, UndecodableRecord)
    assert (two.error_code, two.hotel_id, two.version) == ("INVALID_JSON", "H2", None)
    assert "4.5.1" in two.message
    assert four["hotel_id"] == "H3"


def test_an_escaped_lone_surrogate_stays_a_value_for_normalization_to_judge() -> None:
    escaped = b'{"hotel_id": "H2", "name": "x\\udc80"}'
    bad = b'{"hotel_id": "H4", "name": "\xff"}'
    _, two, _, four = decode_page(_page(H1, escaped, H3, bad))["hotels"]
    assert two == {"hotel_id": "H2", "name": "x\udc80"}  # INVALID_UNICODE later, not UTF-8
    assert isinstance(four, UndecodableRecord) and four.error_code == "INVALID_UTF8"


def test_an_unreadable_id_is_not_guessed() -> None:
    bad = b'{"hotel_id": "H\xff2", "name": "x"}'
    (_, two, _) = decode_page(_page(H1, bad, H3))["hotels"]
    assert isinstance(two, UndecodableRecord) and two.hotel_id is None


@pytest.mark.parametrize(
    "raw",
    [
        _page(H1, b"[1, 2}", H3),  # brackets that do not pair
        _page(H1, b'{"hotel_id": "H2", "name": "x}', H3),  # an unterminated string
        b'{"city_code": "BK\xff", "hotels": [' + H1 + b"]}",  # the envelope is not UTF-8
        b'{"city_code": "BKK", "hotels": [' + H1 + b"]",  # the envelope is cut short
        b"[" + H1 + b", \xff]",  # no envelope
        b'{"cities": [{"city_code": "\xff"}]}',  # not a record array
        _page(H1, b'{"hotel_id": "H2", "x": 1 {"hotel_id": "H3"}', H3),  # two records as one
    ],
    ids=["brackets", "string", "envelope", "cut", "no-envelope", "cities", "merged"],
)
def test_a_page_whose_structure_is_broken_fails_as_decode_json_does(raw: bytes) -> None:
    with pytest.raises(ValueError) as expected:
        decode_json(raw)
    with pytest.raises(type(expected.value)):
        decode_page(raw)
