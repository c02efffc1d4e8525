"""SupplierClient against httpx.MockTransport: every row of the contract's error table."""

from __future__ import annotations

import email.utils
import gzip
import json
import logging
from datetime import UTC, date, datetime
from decimal import Decimal
from urllib.parse import unquote

import httpx
import pytest

from supplier_sync_dagster.core.errors import (
    CircuitOpen,
    ConfigError,
    CursorExpired,
    RetryBudgetExhausted,
    SupplierAuthError,
    SupplierBadRequest,
    SupplierError,
    SupplierNotFound,
    SupplierProtocolError,
    SupplierRateLimited,
    SupplierUnavailable,
)
from supplier_sync_dagster.core.supplier import (
    MALFORMED_RECORD_KEY,
    BreakerState,
    CircuitBreaker,
    CityRateLimiters,
    Hotel,
    InProcessTokenBucket,
    RetryPolicy,
    SupplierClient,
    encode_segment,
    supplier_http_client,
)
from supplier_sync_dagster_tests.core.supplier.fakes import (
    API_KEY,
    CITIES,
    FakeClock,
    Script,
    error_response,
    hotel,
    json_response,
    make_client,
)
from supplier_sync_dagster_tests.helpers import HOSTILE_CITY_CODES

HTML_502 = b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>"


def ok_cities() -> httpx.Response:
    return json_response(200, CITIES)


# --- happy paths ----------------------------------------------------------------------------


def test_list_cities_sends_key_timeouts_and_returns_typed_model() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return json_response(
            200, CITIES, {"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "19"}
        )

    client, _ = make_client(handler, connect_timeout=2.0, read_timeout=7.5)
    fetched = client.list_cities()
    assert fetched.data.cities[0].city_code == "BKK"
    assert fetched.raw == json.dumps(CITIES).encode()
    assert fetched.rate_limit.limit == 20 and fetched.rate_limit.remaining == 19
    (request,) = seen
    assert request.headers["X-Api-Key"] == API_KEY
    assert request.url.raw_path == b"/api/v1/cities"
    assert request.extensions["timeout"] == {
        "connect": 2.0,
        "read": 7.5,
        "write": 10.0,
        "pool": 10.0,
    }


def test_page_keeps_bad_hotels_as_raw_dicts() -> None:
    bad = {"hotel_id": "H2", "geo": {"lat": 200}, "price": {"currency": "XXX"}}
    body = {
        "city_code": "BKK",
        "page": 1,
        "page_size": 3,
        "total": 3,
        "total_pages": 1,
        "next_cursor": None,
        "hotels": [hotel("H1"), bad, "not-an-object"],
        "something_new": {"x": 1},
    }
    client, _ = make_client(Script(json_response(200, body)))
    fetched = client.get_hotels_page("BKK", page=1, page_size=3)
    assert fetched.data.hotels[0] == hotel("H1")
    assert fetched.data.hotels[1] == bad
    assert fetched.data.hotels[2] == {MALFORMED_RECORD_KEY: "not-an-object"}
    assert Hotel.model_validate(fetched.data.hotels[0]).hotel_id == "H1"
    with pytest.raises(ValueError):
        Hotel.model_validate(bad)


def test_gzip_body_is_decoded_and_raw_is_the_json_text() -> None:
    text = json.dumps(CITIES).encode()
    packed = gzip.compress(text)
    client, _ = make_client(
        Script(
            httpx.Response(
                200, stream=httpx.ByteStream(packed), headers={"Content-Encoding": "gzip"}
            )
        )
    )
    fetched = client.list_cities()
    assert fetched.raw == text
    stats = client.stats()
    assert stats.bytes_decoded == len(text)
    assert stats.bytes_received == len(packed)


def test_broken_gzip_is_retried_as_a_bad_body() -> None:
    client, _ = make_client(
        Script(
            httpx.Response(
                200,
                stream=httpx.ByteStream(b"\x1f\x8bnot gzip"),
                headers={"Content-Encoding": "gzip"},
            ),
            ok_cities(),
        )
    )
    assert client.list_cities().data.total == 1
    assert client.stats().retries_by_reason == {"bad_body": 1}


@pytest.mark.parametrize("code", HOSTILE_CITY_CODES)
def test_hostile_city_codes_are_one_encoded_path_segment(code: str) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return json_response(200, {"city_code": code, "hotel_count": 0})

    client, _ = make_client(handler)
    assert client.get_city_summary(code).data.city_code == code
    raw_path = seen[0].url.raw_path.decode("ascii")
    prefix, segment, suffix = raw_path.split("/")[3], raw_path.split("/")[4], raw_path.split("/")[5]
    assert (prefix, suffix) == ("cities", "summary")
    assert raw_path.count("/") == 5  # nothing in the code became a path separator
    assert segment == encode_segment(code)
    assert unquote(segment) == code
    assert "?" not in raw_path and "#" not in raw_path and "'" not in raw_path


def test_dot_segments_are_escaped_but_dots_inside_codes_are_kept() -> None:
    assert encode_segment("..") == "%2E%2E"
    assert encode_segment(".") == "%2E"
    assert encode_segment("a..b") == "a..b"
    assert encode_segment("a/../b") == "a%2F..%2Fb"


def test_get_hotel_changes_summary_and_confirm() -> None:
    quote = {
        "available": True,
        "price": {"amount": "241.00", "currency": "USD"},
        "quoted_at": "2026-11-29T21:00:00Z",
        "valid_for_seconds": 300,
    }
    script = Script(
        json_response(200, hotel("H/1")),
        json_response(
            200,
            {"changes": [hotel("H1")], "next": {"since": "2026-11-20T10:00:00Z", "after_id": "H1"}},
        ),
        json_response(200, {"changes": [], "next": None}),
        json_response(200, quote),
    )
    client, _ = make_client(script)
    assert client.get_hotel("H/1").data["hotel_id"] == "H/1"
    changes = client.get_changes(since=datetime(2026, 11, 20, tzinfo=UTC), limit=10)
    assert changes.data.next is not None and changes.data.next.after_id == "H1"
    assert client.get_changes(since="2026-11-20T10:00:00Z", after_id="H1").data.next is None
    confirmed = client.confirm_offer(
        hotel_id="H1",
        room_code="DLX",
        rate_plan_code="BAR",
        check_in=date(2026, 12, 24),
        check_out=date(2026, 12, 26),
        guests=2,
    )
    assert confirmed.data.price is not None and confirmed.data.price.amount == Decimal("241.00")
    assert script.requests[0].url.raw_path == b"/api/v1/hotels/H%2F1"
    params = script.requests[1].url.params
    assert params["since"] == "2026-11-20T00:00:00Z" and params["limit"] == "10"
    assert script.requests[2].url.params["after_id"] == "H1"
    assert script.requests[3].method == "POST"
    assert json.loads(script.requests[3].content)["check_in"] == "2026-12-24"


# --- the error table: not retried ------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "exc"),
    [
        (400, SupplierBadRequest),
        (401, SupplierAuthError),
        (403, SupplierAuthError),
        (404, SupplierNotFound),
    ],
)
def test_client_errors_are_not_retried(status: int, exc: type[SupplierError]) -> None:
    script = Script(error_response(status, "SOME_CODE", "explained"))
    client, clock = make_client(script)
    with pytest.raises(exc) as info:
        client.list_cities()
    assert len(script.requests) == 1
    assert clock.sleeps == []
    assert info.value.status == status and info.value.code == "SOME_CODE"
    assert client.stats().retries == 0
    assert client.breaker.state is BreakerState.CLOSED


def test_auth_error_says_to_stop() -> None:
    client, _ = make_client(Script(httpx.Response(401, content=b"")))
    with pytest.raises(SupplierAuthError, match="sync must stop"):
        client.list_cities()


def test_410_cursor_expired_raises_cursor_expired() -> None:
    client, _ = make_client(Script(error_response(410, "CURSOR_EXPIRED")))
    with pytest.raises(CursorExpired):
        client.get_hotels_page("BKK", cursor="abc")
    assert client.stats().cursor_expired == 1


# --- the error table: retried ----------------------------------------------------------------


def test_429_with_retry_after_seconds_waits_that_long() -> None:
    script = Script(error_response(429, "RATE_LIMITED", headers={"Retry-After": "3"}), ok_cities())
    client, clock = make_client(script)
    client.list_cities()
    assert clock.sleeps == [3.0]
    stats = client.stats()
    assert stats.rate_limited == 1 and stats.retries_by_reason == {"rate_limited": 1}
    assert stats.backoff_wait == 3.0 and stats.responses_by_status == {429: 1, 200: 1}


def test_429_with_retry_after_http_date_waits_until_then() -> None:
    clock = FakeClock()
    when = email.utils.formatdate(clock.wall() + 5, usegmt=True)
    script = Script(error_response(429, "RATE_LIMITED", headers={"Retry-After": when}), ok_cities())
    client, _ = make_client(script, clock=clock)
    client.list_cities()
    assert len(clock.sleeps) == 1 and 4.0 <= clock.sleeps[0] <= 5.0


def test_429_without_retry_after_backs_off_at_least_base_delay() -> None:
    script = Script(httpx.Response(429), ok_cities())
    client, clock = make_client(script)
    client.list_cities()
    assert clock.sleeps[0] >= 0.5


def test_retry_after_beyond_budget_gives_up_at_once() -> None:
    script = Script(error_response(429, "RATE_LIMITED", headers={"Retry-After": "3600"}))
    client, clock = make_client(script)
    with pytest.raises(SupplierRateLimited) as info:
        client.list_cities()
    assert clock.sleeps == [] and info.value.retry_after == 3600.0
    assert isinstance(info.value, RetryBudgetExhausted)


@pytest.mark.parametrize(
    "failure",
    [
        error_response(500, "INTERNAL"),
        httpx.Response(502, content=HTML_502, headers={"Content-Type": "text/html"}),
        error_response(503, "UNAVAILABLE"),
        httpx.Response(504, content=b"<html>Gateway Timeout</html>"),
    ],
    ids=["500", "502-html", "503-no-retry-after", "504"],
)
def test_5xx_is_retried_with_jittered_backoff(failure: httpx.Response) -> None:
    status = failure.status_code
    script = Script(failure, httpx.Response(status, content=failure.content), ok_cities())
    client, clock = make_client(script)
    assert client.list_cities().data.total == 1
    assert len(script.requests) == 3
    # full jitter: retry n waits within [0, base * 2**(n-1)]
    assert len(clock.sleeps) == 2
    assert 0 <= clock.sleeps[0] <= 0.5 and 0 <= clock.sleeps[1] <= 1.0
    assert client.stats().retries_by_reason == {f"status_{status}": 2}


def test_503_with_retry_after_waits_that_long() -> None:
    script = Script(error_response(503, "UNAVAILABLE", headers={"Retry-After": "2"}), ok_cities())
    client, clock = make_client(script)
    client.list_cities()
    assert clock.sleeps == [2.0]


def test_200_with_error_envelope_is_the_error_it_names() -> None:
    script = Script(
        error_response(200, "RATE_LIMITED", headers={"Retry-After": "1"}),
        error_response(200, "INTERNAL_ERROR", "oops"),
        ok_cities(),
    )
    client, clock = make_client(script)
    client.list_cities()
    assert clock.sleeps[0] == 1.0
    stats = client.stats()
    assert stats.retries_by_reason == {"rate_limited": 1, "error_envelope": 1}
    assert stats.rate_limited == 1

    client, _ = make_client(Script(error_response(200, "CURSOR_EXPIRED")))
    with pytest.raises(CursorExpired):
        client.get_hotels_page("BKK", cursor="c")
    client, _ = make_client(Script(error_response(200, "UNAUTHORIZED")))
    with pytest.raises(SupplierAuthError):
        client.list_cities()


@pytest.mark.parametrize(
    "broken",
    [
        httpx.Response(200, content=b'{"cities": [{"city_code": "BK'),
        httpx.Response(200, content=b"<html>maintenance</html>"),
        httpx.Response(200, content=b""),
        httpx.Response(200, content=b"[1, 2]"),
        httpx.Response(200, content=b'{"unexpected": true}'),
        httpx.RemoteProtocolError("peer closed connection without sending complete message body"),
    ],
    ids=["truncated", "html", "empty", "array", "wrong-shape", "cut-off-stream"],
)
def test_broken_bodies_are_retried_then_protocol_error(broken: httpx.Response | Exception) -> None:
    client, _ = make_client(Script(broken, ok_cities()))
    assert client.list_cities().data.total == 1
    assert client.stats().retries == 1

    client, _ = make_client(Script(*[broken] * 5), retry=RetryPolicy(max_attempts=3))
    with pytest.raises(SupplierProtocolError):
        client.list_cities()


def test_timeout_and_connection_errors_are_retried() -> None:
    script = Script(
        httpx.ReadTimeout("timed out"),
        httpx.ConnectError("connection refused"),
        httpx.ConnectTimeout("timed out"),
        httpx.RemoteProtocolError("Server disconnected without sending a response."),
        ok_cities(),
    )
    client, _ = make_client(script)
    client.list_cities()
    assert client.stats().retries_by_reason == {
        "timeout": 2,
        "connection_refused": 1,
        "connection": 1,
    }


# --- bounds ------------------------------------------------------------------------------------


def test_attempts_are_bounded() -> None:
    script = Script(*[error_response(500, "INTERNAL")] * 10)
    client, _ = make_client(script, retry=RetryPolicy(max_attempts=4, base_delay=0.1))
    with pytest.raises(SupplierUnavailable) as info:
        client.list_cities()
    assert len(script.requests) == 4 and info.value.attempts == 4
    assert "gave up after 4 attempt(s)" in str(info.value)


def test_total_wait_is_bounded() -> None:
    script = Script(*[httpx.Response(503)] * 50)
    policy = RetryPolicy(max_attempts=50, base_delay=2, max_delay=10, max_total_wait=15)
    client, clock = make_client(script, retry=policy)
    with pytest.raises(SupplierUnavailable):
        client.list_cities()
    assert sum(clock.sleeps) <= 15.0 + 1e-9
    assert len(script.requests) < 50


def test_retry_after_counts_against_the_total_wait() -> None:
    script = Script(*[httpx.Response(429, headers={"Retry-After": "4"})] * 10)
    client, clock = make_client(script, retry=RetryPolicy(max_attempts=10, max_total_wait=10))
    with pytest.raises(SupplierRateLimited):
        client.list_cities()
    assert clock.sleeps == [4.0, 4.0]


def test_retry_policy_rejects_nonsense() -> None:
    with pytest.raises(ConfigError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ConfigError):
        RetryPolicy(max_total_wait=-1)


# --- breaker integration ------------------------------------------------------------------------


def test_persistent_5xx_opens_the_breaker_and_then_nothing_is_sent() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(
        name="acme", failure_threshold=3, cooldown=30, monotonic=clock.monotonic
    )
    script = Script(*[httpx.Response(500)] * 3, ok_cities())
    client, _ = make_client(
        script, clock=clock, breaker=breaker, retry=RetryPolicy(max_attempts=10, base_delay=0.01)
    )
    # The call whose own failures opened the breaker says what failed, not "open".
    with pytest.raises(SupplierUnavailable, match="500; gave up after 3 attempt.*breaker opened"):
        client.list_cities()
    assert len(script.requests) == 3
    with pytest.raises(CircuitOpen) as refused:
        client.list_cities()
    assert len(script.requests) == 3  # refused without sending
    assert "open since 3 failures in a row, last: SUPPLIER_UNAVAILABLE GET /v1/cities: 500" in str(
        refused.value
    )
    assert refused.value.error_code == refused.value.cause_code == "SUPPLIER_UNAVAILABLE"
    clock.advance(31)
    assert client.list_cities().data.total == 1  # the probe succeeds
    stats = client.stats()
    assert stats.breaker_state is BreakerState.CLOSED
    assert stats.breaker_transitions == {
        "closed->open": 1,
        "open->half_open": 1,
        "half_open->closed": 1,
    }
    assert stats.breaker_rejections == 2


def test_a_detail_service_that_is_down_opens_its_own_breaker_only() -> None:
    clock = FakeClock()
    detail = CircuitBreaker(
        name="acme/hotels", failure_threshold=3, cooldown=30, monotonic=clock.monotonic
    )
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path.rsplit("/v1", 1)[-1])
        if "/v1/hotels/" in request.url.path:
            return httpx.Response(503)
        return ok_cities()

    client, _ = make_client(
        handler,
        clock=clock,
        detail_breaker=detail,
        retry=RetryPolicy(max_attempts=10, base_delay=0.01),
    )
    with pytest.raises(SupplierUnavailable):
        client.get_hotel("H1")
    with pytest.raises(CircuitOpen):
        client.get_hotel("H2")  # refused without sending
    assert sent.count("/hotels/H1") == 3 and "/hotels/H2" not in sent
    assert client.list_cities().data.total == 1  # listings are not held back
    assert client.stats().breaker_state is BreakerState.CLOSED


def test_rate_limiter_is_asked_before_every_attempt() -> None:
    clock = FakeClock()
    bucket = InProcessTokenBucket(2.0, 1, monotonic=clock.monotonic, sleep=clock.sleep)
    script = Script(httpx.Response(500), ok_cities(), ok_cities())
    client, _ = make_client(
        script, clock=clock, rate_limiter=bucket, retry=RetryPolicy(base_delay=0.0001)
    )
    client.list_cities()
    client.list_cities()
    assert len(script.requests) == 3
    assert client.stats().rate_limiter_wait == pytest.approx(1.0, abs=0.01)


def test_city_throttle_applies_to_city_endpoints_only() -> None:
    clock = FakeClock()
    asked: list[str] = []

    def factory(city: str) -> InProcessTokenBucket:
        asked.append(city)
        return InProcessTokenBucket(1.0, 1, monotonic=clock.monotonic, sleep=clock.sleep)

    body = {"city_code": "BKK", "hotel_count": 1}
    script = Script(ok_cities(), *[json_response(200, body)] * 3)
    client, _ = make_client(script, clock=clock, city_rate_limiters=CityRateLimiters(factory))
    client.list_cities()
    client.get_city_summary("BKK")
    client.get_city_summary("BKK")  # waits one second for BKK's bucket
    client.get_city_summary("../x")
    assert asked == ["BKK", "../x"]
    assert clock.sleeps == [pytest.approx(1.0)]


# --- secrets ------------------------------------------------------------------------------------


def test_api_key_never_leaks(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    echo = f"invalid key {API_KEY}"
    failures: list[SupplierError] = []
    client, _ = make_client(
        Script(
            error_response(500, "INTERNAL", echo),
            error_response(401, "INVALID_API_KEY", echo),
            error_response(400, "BAD", echo),
            *[error_response(503, "DOWN", echo)] * 2,
        ),
        retry=RetryPolicy(max_attempts=2, base_delay=0.001),
    )
    for _ in range(3):
        try:
            client.list_cities()
        except SupplierError as err:
            failures.append(err)
    assert len(failures) == 3
    texts = [repr(client), str(client.stats()), repr(client.breaker), caplog.text]
    texts += [str(err) for err in failures] + [repr(err) for err in failures]
    for text in texts:
        assert API_KEY not in text
    assert "***" in str(failures[0])

    http = supplier_http_client(f"https://user:{API_KEY}@supplier.test/api/?key={API_KEY}")
    assert API_KEY not in repr(SupplierClient(http, api_key=API_KEY))


def test_empty_api_key_is_refused() -> None:
    with pytest.raises(ValueError):
        SupplierClient(httpx.Client(base_url="http://x"), api_key="")


def test_bad_arguments_fail_before_sending() -> None:
    client, _ = make_client(Script())
    with pytest.raises(ValueError):
        client.get_hotels_page("", page=1)
    with pytest.raises(ValueError):
        client.get_hotels_page("x" * 65, page=1)
    with pytest.raises(ValueError):
        client.get_hotels_page("BKK", page=1, cursor="c")
    with pytest.raises(ValueError):
        client.get_hotels_page("BKK", page_size=501)
    with pytest.raises(ValueError):
        client.get_changes(since=datetime(2026, 1, 1))
