"""SupplierClient's bounds with httpx.MockTransport: the byte caps, the deadline between body
chunks, JSON nested too deep, pages that keep their records past one undecodable element."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from supplier_sync_dagster.core.errors import (
    DecompressionBomb,
    ResponseTooLarge,
    SupplierProtocolError,
    SupplierTimeout,
)
from supplier_sync_dagster.core.records.undecodable import UndecodableRecord
from supplier_sync_dagster.core.supplier import MALFORMED_RECORD_KEY, BreakerState, RetryPolicy
from supplier_sync_dagster_tests.core.supplier.fakes import (
    CITIES,
    FakeClock,
    Script,
    hotel,
    json_response,
    make_client,
)

CITIES_BODY = json.dumps(CITIES).encode()


class Chunks(httpx.SyncByteStream):
    """A response body given chunk by chunk; counts how many chunks were read."""

    def __init__(self, chunks: list[bytes], on_chunk: object = None) -> None:
        self.chunks = chunks
        self.read = 0
        self.closed = False
        self.on_chunk = on_chunk

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks:
            self.read += 1
            if callable(self.on_chunk):
                self.on_chunk()
            yield chunk

    def close(self) -> None:
        self.closed = True


def streamed(stream: Chunks, *headers: tuple[str, str]) -> httpx.Response:
    return httpx.Response(200, stream=stream, headers=list(headers))


def page(*records: object) -> dict[str, object]:
    return {"city_code": "BKK", "page": 1, "total_pages": 1, "hotels": list(records)}


# --- the caps ---------------------------------------------------------------------------------


def test_a_declared_length_over_the_cap_is_refused_unread() -> None:
    stream = Chunks([b"x" * 100])
    script = Script(streamed(stream, ("Content-Length", "5000")))
    client, clock = make_client(script, max_body_bytes=4096)
    with pytest.raises(ResponseTooLarge) as info:
        client.list_cities()
    assert stream.read == 0 and stream.closed
    assert info.value.limit == 4096 and info.value.status == 200
    assert "5,000 bytes (Content-Length) over the 4,096 byte cap" in str(info.value)
    assert clock.sleeps == [] and len(script.requests) == 1  # never retried
    assert client.breaker.state is BreakerState.CLOSED


def test_an_undeclared_body_stops_at_the_first_chunk_past_the_cap() -> None:
    stream = Chunks([b" " * 1000] * 100)
    client, _ = make_client(Script(streamed(stream)), max_body_bytes=4096)
    with pytest.raises(ResponseTooLarge):
        client.list_cities()
    assert stream.read == 5 and stream.closed
    assert client.stats().bytes_received == 5000


def test_a_gzip_bomb_is_inflated_one_byte_past_the_cap_and_no_further() -> None:
    bomb = gzip.compress(bytes(10 * 2**20))
    stream = Chunks([bomb[i : i + 1000] for i in range(0, len(bomb), 1000)])
    script = Script(streamed(stream, ("Content-Encoding", "gzip")))
    client, _ = make_client(script, max_decoded_bytes=2**20)
    with pytest.raises(DecompressionBomb) as info:
        client.list_cities()
    assert info.value.error_code == "DECOMPRESSION_BOMB" and info.value.limit == 2**20
    assert stream.read < len(stream.chunks) and stream.closed
    stats = client.stats()
    assert stats.bytes_decoded == 2**20 + 1
    assert stats.bytes_received == 1000 * stream.read
    assert len(script.requests) == 1


def test_an_identity_body_is_held_to_the_smaller_cap() -> None:
    stream = Chunks([b" " * 3000] * 3)
    client, _ = make_client(Script(streamed(stream)), max_body_bytes=10_000, max_decoded_bytes=5000)
    with pytest.raises(ResponseTooLarge) as info:
        client.list_cities()
    assert info.value.limit == 5000
    assert "SUPPLIER_SYNC_SUPPLIER_MAX_DECODED_BYTES" in str(info.value)


def test_a_gzip_body_that_ends_early_is_a_bad_body() -> None:
    packed = gzip.compress(CITIES_BODY)[:-12]
    script = Script(
        streamed(Chunks([packed]), ("Content-Encoding", "gzip")), json_response(200, CITIES)
    )
    client, _ = make_client(script)
    assert client.list_cities().raw == CITIES_BODY
    assert client.stats().retries_by_reason == {"bad_body": 1}


def test_a_chunked_gzip_body_is_inflated_chunk_by_chunk() -> None:
    packed = gzip.compress(CITIES_BODY)
    stream = Chunks([packed[:10], packed[10:20], packed[20:]])
    client, _ = make_client(Script(streamed(stream, ("Content-Encoding", "gzip"))))
    assert client.list_cities().raw == CITIES_BODY
    assert client.stats().bytes_received == len(packed)


def test_deflate_is_inflated_and_an_unknown_encoding_is_a_bad_body() -> None:
    deflated = zlib.compress(CITIES_BODY)
    script = Script(
        streamed(Chunks([b"\x00\x01"]), ("Content-Encoding", "br")),
        streamed(Chunks([deflated]), ("Content-Encoding", "deflate")),
    )
    client, _ = make_client(script)
    assert client.list_cities().raw == CITIES_BODY
    assert client.stats().retries_by_reason == {"bad_body": 1}
    assert script.requests[0].headers["Accept-Encoding"] == "gzip"


# --- time -------------------------------------------------------------------------------------


def test_a_body_still_coming_at_the_deadline_is_a_timeout() -> None:
    clock = FakeClock()

    def slow_stream() -> httpx.Response:
        return streamed(Chunks([b" "] * 100, on_chunk=lambda: clock.advance(1.0)))

    script = Script(slow_stream(), slow_stream())
    client, _ = make_client(
        script, clock=clock, request_deadline=10.0, retry=RetryPolicy(max_attempts=2)
    )
    with pytest.raises(SupplierTimeout) as info:
        client.list_cities()
    err = info.value
    assert err.error_code == "SUPPLIER_TIMEOUT" and err.reason == "timeout"
    assert err.attempts == 2
    assert "GET /v1/cities: body not complete within the 10 s request deadline" in (str(err))
    # Headers came at once: the supplier answered, its breaker does not count it.
    assert client.breaker.stats().consecutive_failures == 0


def test_every_operation_timeout_is_at_most_the_deadline() -> None:
    script = Script(json_response(200, CITIES))
    client, _ = make_client(script, request_deadline=3.0, read_timeout=30.0)
    client.list_cities()
    assert script.requests[0].extensions["timeout"] == {
        "connect": 3.0,
        "read": 3.0,
        "write": 3.0,
        "pool": 3.0,
    }


@pytest.mark.parametrize("name", ["request_deadline", "max_body_bytes", "max_decoded_bytes"])
def test_limits_must_be_positive(name: str) -> None:
    zero: dict[str, Any] = {name: 0}
    with pytest.raises(ValueError, match=name):
        make_client(Script(), **zero)


# --- bodies that cannot be decoded whole -------------------------------------------------------


def test_json_nested_100k_deep_is_refused_at_once() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    script = Script(httpx.Response(200, content=deep), json_response(200, CITIES))
    client, clock = make_client(script)
    with pytest.raises(SupplierProtocolError) as info:
        client.list_cities()
    assert info.value.reason == "json_too_deep" and info.value.error_code == "JSON_TOO_DEEP"
    assert "nests deeper than 1024 levels" in str(info.value)
    assert len(script.requests) == 1 and clock.sleeps == []


def test_a_page_with_one_undecodable_name_keeps_its_other_records() -> None:
    raw = json.dumps(page(hotel("H1"), hotel("H2"), hotel("H3"))).encode()
    raw = raw.replace(b'"Hotel H2"', b'"Hotel \xff H2"')
    client, _ = make_client(Script(httpx.Response(200, content=raw)))
    fetched = client.get_hotels_page("BKK", page=1)
    assert fetched.raw == raw  # the bytes as received, for the payload store and trace
    first, bad, third = fetched.data.hotels
    assert first == hotel("H1") and third == hotel("H3")
    marked = bad[MALFORMED_RECORD_KEY]
    assert isinstance(marked, UndecodableRecord)
    assert (marked.error_code, marked.hotel_id, marked.version) == ("INVALID_UTF8", "H2", 1)
    assert marked.message.startswith("name holds bytes that are not UTF-8 (0xFF)")
    assert client.stats().retries == 0


def test_a_page_with_one_element_that_is_not_json_keeps_its_other_records() -> None:
    raw = (
        b'{"city_code": "BKK", "hotels": ['
        + json.dumps(hotel("H1")).encode()
        + b', {"hotel_id": "H2", "name": "x" "y"}, '
        + json.dumps(hotel("H3")).encode()
        + b"]}"
    )
    client, _ = make_client(Script(httpx.Response(200, content=raw)))
    hotels = client.get_hotels_page("BKK", page=1).data.hotels
    assert [h.get("hotel_id") for h in hotels] == ["H1", None, "H3"]
    marked = hotels[1][MALFORMED_RECORD_KEY]
    assert (marked.error_code, marked.hotel_id) == ("INVALID_JSON", "H2")


def test_a_page_whose_envelope_is_broken_is_still_a_bad_body() -> None:
    raw = json.dumps(page(hotel("H1"))).encode().replace(b'"BKK"', b'"BK\xff"', 1)
    script = Script(httpx.Response(200, content=raw), json_response(200, page(hotel("H1"))))
    client, _ = make_client(script)
    client.get_hotels_page("BKK", page=1)
    assert client.stats().retries_by_reason == {"bad_body": 1}
