"""decode_json must read exactly what ``json.loads(raw.decode("utf-8"))`` reads."""

from __future__ import annotations

import json
import math

import pytest

from supplier_sync_dagster.core.supplier.models import decode_json

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
