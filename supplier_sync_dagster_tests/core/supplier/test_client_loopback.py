"""SupplierClient against a misbehaving server on loopback: what a mock transport cannot show
(a body trickling at a byte a second, a connection cut mid-body, a refused port, TLS spoken
to a plain socket, a 300 MB gzip bomb), each ending in time, in memory, with its own error."""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Iterator

import httpx
import pytest

from supplier_sync_dagster.core.errors import (
    CircuitOpen,
    DecompressionBomb,
    ResponseTooLarge,
    SupplierTimeout,
    SupplierUnreachable,
    TruncatedBody,
)
from supplier_sync_dagster.core.supplier import (
    BoundedTransport,
    BreakerState,
    CircuitBreaker,
    RetryPolicy,
    SupplierClient,
    supplier_http_client,
)
from supplier_sync_dagster_tests.core.supplier.hostile_server import (
    CITIES_BODY,
    body,
    closed_port,
    cut,
    drip_before_timeout,
    endless,
    gzip_bomb,
    gzipped,
    serving,
    slow_headers,
    trickle,
)

KEY = "sk-loopback-SECRET-0123"
ONCE = RetryPolicy(max_attempts=1, max_total_wait=0)


def client(
    url: str,
    *,
    bounded: bool = True,
    retry: RetryPolicy = ONCE,
    breaker: CircuitBreaker | None = None,
    **kwargs: object,
) -> SupplierClient:
    transport = BoundedTransport() if bounded else httpx.HTTPTransport()
    http = supplier_http_client(url, transport=transport)
    return SupplierClient(
        http,
        api_key=KEY,
        supplier_id="acme",
        retry=retry,
        breaker=breaker or CircuitBreaker(name="acme", failure_threshold=50),
        **kwargs,  # type: ignore[arg-type]
    )


def timed(call: object) -> tuple[BaseException | None, float]:
    began = time.monotonic()
    try:
        call()  # type: ignore[operator]
    except BaseException as err:
        return err, time.monotonic() - began
    return None, time.monotonic() - began


@pytest.fixture(params=[True, False], ids=["bounded-transport", "httpx-transport"])
def bounded(request: pytest.FixtureRequest) -> Iterator[bool]:
    yield request.param


# --- time -------------------------------------------------------------------------------------


def test_a_body_trickling_at_one_byte_a_second_ends_at_the_deadline(bounded: bool) -> None:
    with serving({"/cities": trickle(CITIES_BODY, every=1.0)}) as server:
        c = client(server.url, bounded=bounded, request_deadline=1.5)
        err, took = timed(c.list_cities)
    assert isinstance(err, SupplierTimeout), err
    assert 1.5 <= took <= 2.5 + 0.5  # the deadline, plus at most one byte's second
    assert err.error_code == "SUPPLIER_TIMEOUT" and err.reason == "timeout"
    text = str(err)
    assert "GET /v1/cities" in text and "1.5 s request deadline" in text
    assert "bytes of" in text  # how far the body got


def test_retries_of_a_trickling_body_each_end_at_the_deadline() -> None:
    with serving({"/cities": trickle(CITIES_BODY, every=1.0)}) as server:
        c = client(
            server.url,
            request_deadline=1.0,
            retry=RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.01),
        )
        err, took = timed(c.list_cities)
    assert isinstance(err, SupplierTimeout)
    assert "gave up after 2 attempt(s)" in str(err)
    assert took <= 2 * 1.0 + 1.0
    assert c.stats().retries_by_reason == {"timeout": 1}
    # The supplier answered promptly each time: a slow body is not an outage.
    assert c.breaker.state is BreakerState.CLOSED


def test_headers_that_never_end_stop_at_the_deadline() -> None:
    with serving({"/cities": slow_headers(every=0.2)}) as server:
        c = client(server.url, request_deadline=1.0, read_timeout=30.0)
        err, took = timed(c.list_cities)
    assert isinstance(err, SupplierTimeout), err
    assert took <= 1.0 + 0.5
    assert "timed out waiting for an answer" in str(err)


def test_each_read_waits_only_for_the_time_left() -> None:
    # Every byte comes just inside a 2 s read timeout: only the total deadline ends it.
    with serving({"/cities": drip_before_timeout(pause=1.5)}) as server:
        c = client(server.url, request_deadline=2.0, read_timeout=2.0)
        err, took = timed(c.list_cities)
    assert isinstance(err, SupplierTimeout), err
    assert took <= 2.0 + 0.5


# --- bytes ------------------------------------------------------------------------------------


def test_a_300_mb_gzip_bomb_is_refused_in_small_memory() -> None:
    bomb = gzip_bomb()
    assert len(bomb) < 1_000_000
    routes = {"/cities": body(bomb, "Content-Encoding: gzip")}
    with serving(routes) as server:
        c = client(server.url, request_deadline=30.0)
        gc.collect()
        tracemalloc.start()
        try:
            err, _ = timed(c.list_cities)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(server.paths) == 1  # never retried
    assert isinstance(err, DecompressionBomb), err
    assert err.error_code == "DECOMPRESSION_BOMB"
    assert "SUPPLIER_SYNC_SUPPLIER_MAX_DECODED_BYTES" in str(err)
    cap = 16 * 2**20  # the default cap on decoded bytes
    assert peak < 2 * cap + 8 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    stats = c.stats()
    assert stats.bytes_decoded == cap + 1
    assert stats.bytes_received <= len(bomb)
    assert c.breaker.state is BreakerState.CLOSED


def test_a_small_decoded_cap_keeps_the_peak_smaller_still() -> None:
    routes = {"/cities": body(gzip_bomb(), "Content-Encoding: gzip")}
    with serving(routes) as server:
        c = client(server.url, max_decoded_bytes=2**20)
        gc.collect()
        tracemalloc.start()
        try:
            err, _ = timed(c.list_cities)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert isinstance(err, DecompressionBomb)
    assert peak < 4 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_a_50_mb_page_is_refused_by_default_before_it_is_read() -> None:
    declared = 50 * 2**20

    def route(sock: object) -> None:
        import socket as _socket

        assert isinstance(sock, _socket.socket)
        sock.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {declared}\r\n\r\n".encode())
        sock.sendall(b"[" * 65536)

    with serving({"/cities": route}) as server:
        c = client(server.url)
        err, _ = timed(c.list_cities)
    assert type(err) is ResponseTooLarge, err
    assert err.error_code == "BODY_TOO_LARGE" and err.limit == 8 * 2**20
    assert f"{declared:,} bytes (Content-Length)" in str(err)
    assert c.stats().bytes_received == 0


def test_a_50_mb_page_without_a_length_stops_at_the_wire_cap() -> None:
    with serving({"/cities": endless(b" " * 65536, 50 * 2**20)}) as server:
        c = client(server.url, max_body_bytes=2**20)
        err, _ = timed(c.list_cities)
        assert len(server.paths) == 1
    assert type(err) is ResponseTooLarge, err
    assert 2**20 < c.stats().bytes_received <= 2**20 + 65536


# --- what happened ------------------------------------------------------------------------------


def test_a_body_cut_short_is_a_truncated_body() -> None:
    with serving({"/cities": cut(CITIES_BODY, after=20)}) as server:
        c = client(server.url, retry=RetryPolicy(max_attempts=2, base_delay=0.01))
        err, _ = timed(c.list_cities)
    assert isinstance(err, TruncatedBody), err
    assert err.error_code == "TRUNCATED_BODY" and err.reason == "truncated"
    assert f"after 20 of {len(CITIES_BODY)} bytes" in str(err)
    assert c.breaker.state is BreakerState.CLOSED


def test_a_refused_connection_names_host_and_port_and_never_the_secrets() -> None:
    port = closed_port()
    url = f"http://user:{KEY}@127.0.0.1:{port}/api/?key={KEY}"
    c = client(url, retry=RetryPolicy(max_attempts=2, base_delay=0.01))
    err, _ = timed(c.list_cities)
    assert isinstance(err, SupplierUnreachable), err
    assert err.reason == "connection_refused" and err.error_code == "CONNECTION_REFUSED"
    assert f"127.0.0.1:{port}: connection refused" in str(err)
    assert KEY not in str(err) and "user" not in str(err)


def test_an_unknown_host_is_a_dns_failure() -> None:
    c = client("http://supplier.invalid/api/")
    err, _ = timed(c.list_cities)
    assert isinstance(err, SupplierUnreachable), err
    assert (err.reason, err.error_code) == ("dns", "DNS_FAILURE")
    assert "supplier.invalid:80: the host name does not resolve" in str(err)


def test_tls_to_a_server_that_does_not_speak_it_is_a_tls_failure() -> None:
    with serving({}, greeting=b"HTTP/1.1 400 Bad Request\r\n\r\n") as server:
        c = client(server.url.replace("http://", "https://"))
        err, _ = timed(c.list_cities)
    assert isinstance(err, SupplierUnreachable), err
    assert (err.reason, err.error_code) == ("tls", "TLS_FAILURE")
    assert "TLS handshake failed" in str(err)


def test_the_open_breaker_says_why_it_opened() -> None:
    port = closed_port()
    breaker = CircuitBreaker(name="supplier-1001", failure_threshold=3, cooldown=30)
    c = client(
        f"http://127.0.0.1:{port}/",
        breaker=breaker,
        retry=RetryPolicy(max_attempts=5, base_delay=0.001),
    )
    first, _ = timed(c.list_cities)
    assert isinstance(first, SupplierUnreachable)  # its own failures opened it: the cause
    assert "the circuit breaker opened" in str(first)
    later, _ = timed(c.list_cities)
    assert isinstance(later, CircuitOpen), later
    assert (
        f"open since 3 failures in a row, last: CONNECTION_REFUSED 127.0.0.1:{port}: "
        "connection refused" in str(later)
    )
    assert later.error_code == later.cause_code == "CONNECTION_REFUSED"


def test_a_clean_gzip_page_over_a_real_socket() -> None:
    with serving({"/cities": body(gzipped(CITIES_BODY), "Content-Encoding: gzip")}) as server:
        c = client(server.url)
        fetched = c.list_cities()
    assert fetched.raw == CITIES_BODY
    stats = c.stats()
    assert stats.bytes_decoded == len(CITIES_BODY)
    assert stats.bytes_received == len(gzipped(CITIES_BODY))
