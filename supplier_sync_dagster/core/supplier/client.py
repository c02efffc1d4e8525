"""The resilient client of the Supplier Hotel API v1 (``shared/supplier-api.md``).

Every call goes: circuit breaker -> rate limiter(s) -> one HTTP request with explicit
timeouts -> classification -> (retry with Retry-After or full-jitter backoff | result | error).

Only what the contract promises is relied on, so the client works with any supplier that
honours it, not just the project's simulator.

Path segments built from untrusted codes (city codes, hotel ids) are percent-encoded with
``urllib.parse.quote(code, safe="")``, so ``/``, ``?``, ``#``, ``%``, quotes and non-ASCII text
cannot change the URL's structure. A segment made only of dots (``.``, ``..``) is a
dot-segment that URL normalization (httpx, proxies, servers) would remove, so its dots are
sent as ``%2E``; dots inside longer codes (``a..b``) are not special and are sent as they are.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import pydantic

from supplier_sync_dagster.core.errors import (
    CircuitOpen,
    CityNotFound,
    CursorExpired,
    DecompressionBomb,
    RateLimiterUnavailable,
    ResponseTooLarge,
    RetryBudgetExhausted,
    SupplierAuthError,
    SupplierBadRequest,
    SupplierError,
    SupplierNotFound,
    SupplierProtocolError,
    SupplierRateLimited,
    SupplierTimeout,
    SupplierUnavailable,
    SupplierUnreachable,
    TruncatedBody,
)
from supplier_sync_dagster.core.redaction import MASK, redact, register_secret, register_url
from supplier_sync_dagster.core.settings import (
    MAX_CHANGES_LIMIT,
    MAX_PAGE_SIZE,
    MIN_CHANGES_LIMIT,
    MIN_PAGE_SIZE,
    env_name,
)
from supplier_sync_dagster.core.supplier.breaker import BreakerState, CircuitBreaker
from supplier_sync_dagster.core.supplier.governor import GovernedLimiter
from supplier_sync_dagster.core.supplier.models import (
    ChangesPage,
    CityList,
    CitySummary,
    Fetched,
    HotelsPage,
    JsonTooDeep,
    OfferConfirmation,
    OfferRequest,
    RateLimitInfo,
    decode_page,
)
from supplier_sync_dagster.core.supplier.ratelimit import CityRateLimiters, RateLimiter
from supplier_sync_dagster.core.supplier.retry import RetryPolicy, parse_retry_after
from supplier_sync_dagster.core.supplier.transport import deadline_scope

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)

#: Error codes of a ``{"error": {"code": ...}}`` body, mapped to the status they stand for.
ERROR_CODE_STATUS: Mapping[str, int] = {
    "BAD_REQUEST": 400,
    "INVALID_PARAMETER": 400,
    "INVALID_REQUEST": 400,
    "UNAUTHORIZED": 401,
    "INVALID_API_KEY": 401,
    "FORBIDDEN": 403,
    "NOT_FOUND": 404,
    "CURSOR_EXPIRED": 410,
    "RATE_LIMITED": 429,
    "TOO_MANY_REQUESTS": 429,
}

#: Seconds one attempt may take, connect to last body byte: well under a shard's lease.
DEFAULT_REQUEST_DEADLINE = 60.0
#: Body bytes on the wire one response may have: a few times the largest body the contract
#: allows (a page of 500 hotels with rich records, a change feed of 1,000).
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
#: Body bytes one response may inflate to after gzip decoding.
DEFAULT_MAX_DECODED_BYTES = 16 * 2**20

_MAX_MESSAGE = 300
_REDACTED = MASK
_CONNECTION_REASONS = frozenset({"connection_refused", "dns", "tls", "connection"})


def encode_segment(value: str) -> str:
    """Percent-encode one URL path segment from untrusted text.

    Args:
        value: A city code, hotel id or other supplier-provided string.

    Returns:
        The segment, safe to put between two ``/``: every reserved character is escaped,
        and a segment of dots only is sent as ``%2E`` so no layer treats it as ``.``/``..``.
    """
    encoded = quote(value, safe="")
    if encoded and set(encoded) == {"."}:
        return "%2E" * len(encoded)
    return encoded


def _format_time(value: datetime | str) -> str:
    if isinstance(value, str):
        return value
    if value.tzinfo is None:
        raise ValueError("since must be timezone-aware (UTC)")
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _int_header(headers: httpx.Headers, name: str) -> int | None:
    try:
        return int(headers[name])
    except (KeyError, ValueError):
        return None


def _float_header(headers: httpx.Headers, name: str) -> float | None:
    try:
        return float(headers[name])
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class ClientStats:
    """A snapshot of a client's counters (they feed metrics). Never holds the API key.

    Attributes:
        requests: HTTP requests sent (each retry counts).
        responses_by_status: Responses received, by HTTP status.
        retries_by_reason: Retries, by reason (``"rate_limited"``, ``"status_503"``,
            ``"timeout"``, ``"connection"``, ``"bad_body"``, ``"error_envelope"``...).
        rate_limited: 429 answers, plus ``RATE_LIMITED`` error bodies.
        rate_limiter_wait: Seconds spent waiting for the rate limiter(s).
        backoff_wait: Seconds spent sleeping between attempts (backoff and Retry-After).
        bytes_received: Body bytes received on the wire (before gzip decoding).
        bytes_decoded: Body bytes after decoding.
        cursor_expired: 410 CURSOR_EXPIRED answers.
        breaker_state: The circuit breaker's state.
        breaker_transitions: Breaker moves, by ``"from->to"``.
        breaker_rejections: Calls refused at once because the breaker was open.
        last_rate_limit: The supplier's rate-limit headers on the latest response.
    """

    requests: int
    responses_by_status: dict[int, int]
    retries_by_reason: dict[str, int]
    rate_limited: int
    rate_limiter_wait: float
    backoff_wait: float
    bytes_received: int
    bytes_decoded: int
    cursor_expired: int
    breaker_state: BreakerState
    breaker_transitions: dict[str, int]
    breaker_rejections: int
    last_rate_limit: RateLimitInfo | None

    @property
    def total_wait(self) -> float:
        """Seconds spent waiting for the rate limiter and between retries together."""
        return self.rate_limiter_wait + self.backoff_wait

    @property
    def retries(self) -> int:
        """All retries together."""
        return sum(self.retries_by_reason.values())


@dataclass
class RequestTally:
    """The requests sent inside one :func:`tally_requests` block, by its thread and by the
    threads it hands its context to (a city's read-ahead), whoever else shares the client.

    Attributes:
        requests: Requests sent (retries included).
        throttled: Of those, 429 answers.
        retries: Retries made.
        waited: Seconds waited for the rate limiter(s).
    """

    requests: int = 0
    throttled: int = 0
    retries: int = 0
    waited: float = 0.0


_TALLY: ContextVar[RequestTally | None] = ContextVar("supplier_request_tally", default=None)


@contextmanager
def tally_requests() -> Iterator[RequestTally]:
    """Counts the requests sent in the block (one city's, while other cities share the
    client: the client's totals would count theirs too)."""
    tally = RequestTally()
    token = _TALLY.set(tally)
    try:
        yield tally
    finally:
        _TALLY.reset(token)


@dataclass
class _Counters:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    responses_by_status: dict[int, int] = field(default_factory=dict)
    retries_by_reason: dict[str, int] = field(default_factory=dict)
    rate_limited: int = 0
    rate_limiter_wait: float = 0.0
    backoff_wait: float = 0.0
    bytes_received: int = 0
    bytes_decoded: int = 0
    cursor_expired: int = 0
    last_rate_limit: RateLimitInfo | None = None


@dataclass(frozen=True, slots=True)
class _Ok:
    body: dict[str, Any]
    raw: bytes
    status: int
    rate_limit: RateLimitInfo
    parsed: pydantic.BaseModel | None = None


@dataclass(frozen=True, slots=True)
class _Request:
    """One call of the API, as every attempt of it sends it."""

    method: str
    path: str
    params: Mapping[str, str | int] | None = None
    json_body: Any = None
    # A city endpoint: paced by the city's bucket too.
    city: str | None = None
    # Sent with a cursor: a 410 means the cursor expired.
    with_cursor: bool = False


@dataclass(frozen=True, slots=True)
class _Transient:
    """A failure worth retrying."""

    reason: str
    # What the call raises once the retry policy gives up.
    error: type[RetryBudgetExhausted]
    message: str
    status: int | None = None
    code: str | None = None
    retry_after: float | None = None
    # Whether it counts against the breaker: the supplier did not answer (connection, 5xx,
    # silence). A 429, or an answer whose body went wrong after prompt headers, does not.
    supplier_fault: bool = True


@dataclass(slots=True)
class _Progress:
    """How far one attempt got, for its messages."""

    started: float
    headers_at: float | None = None
    status: int | None = None
    length: int | None = None
    received: int = 0
    decoded: int = 0


class _ApiKey:
    """Holds the key; its repr and str never show it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return _REDACTED

    __str__ = __repr__


class SupplierClient:
    """Calls one supplier's API with timeouts, rate limiting, retries and a circuit breaker.

    Thread-safe: threads may share one client (and so its breaker, limiter and counters).
    """

    def __init__(
        self,
        http: httpx.Client,
        *,
        api_key: str,
        supplier_id: str = "supplier",
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        write_timeout: float = 10.0,
        pool_timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        breaker: CircuitBreaker | None = None,
        detail_breaker: CircuitBreaker | None = None,
        rate_limiter: RateLimiter | None = None,
        city_rate_limiters: CityRateLimiters | None = None,
        request_deadline: float = DEFAULT_REQUEST_DEADLINE,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        """Create a client.

        Args:
            http: The HTTP client, with ``base_url`` set to the supplier's API root. The
                caller owns it (and closes it).
            api_key: The supplier API key, sent as ``X-Api-Key``; never logged or shown.
            supplier_id: The supplier's id, used in messages and as the breaker's name.
            connect_timeout: Seconds to establish a connection.
            read_timeout: Seconds to wait for each chunk of the response.
            write_timeout: Seconds to send each chunk of the request.
            pool_timeout: Seconds to wait for a free connection from the pool.
            request_deadline: Seconds one attempt may take in all, connect to last body
                byte; past it the attempt is a timeout (retried as the policy says). Each
                operation's timeout is at most this. With a ``BoundedTransport`` every socket
                wait ends by it; with another transport it is checked between body chunks.
            max_body_bytes: Body bytes on the wire a response may have; past it (or past a
                larger Content-Length) :class:`ResponseTooLarge`, never retried.
            max_decoded_bytes: Body bytes a response may inflate to; past it
                :class:`DecompressionBomb`, never retried.
            retry: Retry policy; defaults to :class:`RetryPolicy()`.
            breaker: Circuit breaker; pass one instance to every client of the same supplier
                in a process. Defaults to a new breaker.
            detail_breaker: The breaker of single-hotel requests (``GET /v1/hotels/{id}``):
                a detail service that is down must not stop the listings, nor the other way
                round. Defaults to a new breaker.
            rate_limiter: Paces every request (see ``make_rate_limiter``); None sends unpaced.
            city_rate_limiters: Optional second throttle per city (city endpoints only).
            sleep: Sleep function, injectable for tests.
            monotonic: Clock for the breaker and elapsed times, injectable for tests.
            wall_clock: Unix time, to read ``Retry-After`` given as an HTTP-date.
            rng: Randomness for backoff jitter.
        """
        if not api_key:
            raise ValueError("api_key must not be empty")
        if http.base_url.query:
            raise ValueError(
                "the HTTP client's base URL has a query, which httpx mangles with each path: "
                "build it with supplier_http_client()"
            )
        # Every log line, stored error and output of this process masks them from now on.
        register_secret(api_key)
        register_url(str(http.base_url))
        for param in http.params.values():
            register_secret(param)
        for name, value in (
            ("request_deadline", request_deadline),
            ("max_body_bytes", max_body_bytes),
            ("max_decoded_bytes", max_decoded_bytes),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self._http = http
        self._key = _ApiKey(api_key)
        self.supplier_id = supplier_id
        self._deadline = float(request_deadline)
        self._max_body = max_body_bytes
        self._max_decoded = max_decoded_bytes
        self._timeout = httpx.Timeout(
            connect=min(connect_timeout, self._deadline),
            read=min(read_timeout, self._deadline),
            write=min(write_timeout, self._deadline),
            pool=min(pool_timeout, self._deadline),
        )
        url = http.base_url
        port = url.port or {"https": 443, "http": 80}.get(url.scheme)
        host = f"[{url.host}]" if ":" in url.host else url.host
        # Where connections go, for messages: never userinfo, a path or a query.
        self._origin = f"{host}:{port}" if port else host
        self.retry_policy = retry or RetryPolicy()
        self.breaker = breaker or CircuitBreaker(name=supplier_id, monotonic=monotonic)
        self.detail_breaker = detail_breaker or CircuitBreaker(
            name=f"{supplier_id}/hotels", monotonic=monotonic
        )
        self._limiter = rate_limiter
        self._city_limiters = city_rate_limiters
        self._sleep = sleep
        self._clock = monotonic
        self._wall_clock = wall_clock
        self._rng = rng or random.Random()
        self._c = _Counters()

    def __repr__(self) -> str:
        url = self._http.base_url
        # Only scheme, host, port and path: userinfo or a query could carry credentials.
        where = f"{url.scheme}://{url.host}" + (f":{url.port}" if url.port else "") + url.path
        return (
            f"SupplierClient(supplier_id={self.supplier_id!r}, base_url={where!r}, "
            f"api_key={_REDACTED}, breaker={self.breaker.state.value})"
        )

    # --- endpoints -------------------------------------------------------------------------

    def list_cities(self) -> Fetched[CityList]:
        """``GET /v1/cities``: every city the supplier serves.

        Returns:
            The validated city list and its raw body.

        Raises:
            SupplierError: See the module docstring of ``core.errors``.
        """
        return self._typed(_Request("GET", "/v1/cities"), CityList)

    def get_hotels_page(
        self,
        city_code: str,
        *,
        page: int | None = None,
        cursor: str | None = None,
        page_size: int | None = None,
    ) -> Fetched[HotelsPage]:
        """``GET /v1/cities/{city_code}/hotels``: one page, by page number or by cursor.

        Args:
            city_code: The supplier's city code (any 1-64 characters; encoded safely).
            page: 1-based page number; the default when no cursor is given is page 1.
            cursor: Opaque cursor from a previous page's ``next_cursor``.
            page_size: Hotels per page, 1-500 (the supplier's default when None).

        Returns:
            The page (records as raw dicts) and the decoded body bytes.

        Raises:
            CursorExpired: The cursor is too old; continue by page number.
            SupplierError: See the module docstring of ``core.errors``.
        """
        _check_city(city_code)
        if page is not None and cursor is not None:
            raise ValueError("pass page or cursor, not both")
        if page is not None and page < 1:
            raise ValueError(f"page must be >= 1, got {page}")
        if page_size is not None and not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(
                f"page_size must be within {MIN_PAGE_SIZE}..{MAX_PAGE_SIZE}, got {page_size}"
            )
        params: dict[str, str | int] = {}
        if cursor is not None:
            params["cursor"] = cursor
        else:
            params["page"] = page or 1
        if page_size is not None:
            params["page_size"] = page_size
        path = f"/v1/cities/{encode_segment(city_code)}/hotels"
        request = _Request(
            "GET", path, params=params, city=city_code, with_cursor=cursor is not None
        )
        return self._typed(request, HotelsPage)

    def get_hotel(self, hotel_id: str) -> Fetched[dict[str, Any]]:
        """``GET /v1/hotels/{hotel_id}``: one hotel, full detail.

        The record is returned as a raw dict, like page records: validate it with
        ``models.Hotel`` during normalization.

        Args:
            hotel_id: The supplier's hotel id (encoded safely).

        Returns:
            The hotel record and the decoded body bytes.

        Raises:
            SupplierNotFound: The supplier does not know this hotel.
            SupplierError: See the module docstring of ``core.errors``.
        """
        if not hotel_id:
            raise ValueError("hotel_id must not be empty")
        path = f"/v1/hotels/{encode_segment(hotel_id)}"
        ok = self._call(_Request("GET", path), breaker=self.detail_breaker)
        body = ok.body
        # Some suppliers wrap the record: {"hotel": {...}}.
        if set(body) == {"hotel"} and isinstance(body["hotel"], dict):
            body = body["hotel"]
        return Fetched(data=body, raw=ok.raw, status=ok.status, rate_limit=ok.rate_limit)

    def get_changes(
        self, *, since: datetime | str, after_id: str | None = None, limit: int = 500
    ) -> Fetched[ChangesPage]:
        """``GET /v1/hotels/changes``: hotels changed since a watermark.

        Late data is real: callers should ask from a watermark a few minutes back.

        Args:
            since: Watermark time (aware datetime, or an RFC 3339 string as received).
            after_id: Watermark hotel id, from the previous ``next``.
            limit: Changes per call, 1-1000.

        Returns:
            The changes (records as raw dicts), the next watermark, and the raw body.

        Raises:
            SupplierError: See the module docstring of ``core.errors``.
        """
        if not MIN_CHANGES_LIMIT <= limit <= MAX_CHANGES_LIMIT:
            raise ValueError(
                f"limit must be within {MIN_CHANGES_LIMIT}..{MAX_CHANGES_LIMIT}, got {limit}"
            )
        params: dict[str, str | int] = {"since": _format_time(since), "limit": limit}
        if after_id is not None:
            params["after_id"] = after_id
        return self._typed(_Request("GET", "/v1/hotels/changes", params=params), ChangesPage)

    def get_city_summary(self, city_code: str) -> Fetched[CitySummary]:
        """``GET /v1/cities/{city_code}/summary``: counts for reconciliation.

        Args:
            city_code: The supplier's city code (encoded safely).

        Returns:
            The summary and its raw body.

        Raises:
            CityNotFound: Unknown city (a 404).
            SupplierError: See the module docstring of ``core.errors``.
        """
        _check_city(city_code)
        path = f"/v1/cities/{encode_segment(city_code)}/summary"
        return self._typed(_Request("GET", path, city=city_code), CitySummary)

    def confirm_offer(
        self,
        *,
        hotel_id: str,
        room_code: str,
        rate_plan_code: str,
        check_in: date,
        check_out: date,
        guests: int,
        retry: RetryPolicy | None = None,
    ) -> Fetched[OfferConfirmation]:
        """``POST /v1/offers/confirm``: real-time price and availability. Never cache it.

        Confirming is a quote without side effects, so it is retried like a read; pass a
        shorter ``retry`` policy when a customer is waiting.

        Args:
            hotel_id: Supplier hotel id.
            room_code: Room code.
            rate_plan_code: Rate plan code.
            check_in: Arrival date.
            check_out: Departure date (after ``check_in``).
            guests: Number of guests (>= 1).
            retry: Retry policy for this call; defaults to the client's.

        Returns:
            The quote and its raw body.

        Raises:
            SupplierError: See the module docstring of ``core.errors``.
        """
        if check_out <= check_in:
            raise ValueError("check_out must be after check_in")
        request = OfferRequest(
            hotel_id=hotel_id,
            room_code=room_code,
            rate_plan_code=rate_plan_code,
            check_in=check_in,
            check_out=check_out,
            guests=guests,
        )
        body = request.model_dump(mode="json")
        return self._typed(
            _Request("POST", "/v1/offers/confirm", json_body=body), OfferConfirmation, retry=retry
        )

    # --- stats ------------------------------------------------------------------------------

    @property
    def rate_limiter(self) -> RateLimiter | None:
        """The bucket that paces this client's requests (another client may share it)."""
        return self._limiter

    def stats(self) -> ClientStats:
        """Return a snapshot of the client's counters."""
        breaker = self.breaker.stats()
        with self._c.lock:
            return ClientStats(
                requests=self._c.requests,
                responses_by_status=dict(self._c.responses_by_status),
                retries_by_reason=dict(self._c.retries_by_reason),
                rate_limited=self._c.rate_limited,
                rate_limiter_wait=self._c.rate_limiter_wait,
                backoff_wait=self._c.backoff_wait,
                bytes_received=self._c.bytes_received,
                bytes_decoded=self._c.bytes_decoded,
                cursor_expired=self._c.cursor_expired,
                breaker_state=breaker.state,
                breaker_transitions=breaker.transitions,
                breaker_rejections=breaker.rejected,
                last_rate_limit=self._c.last_rate_limit,
            )

    # --- the request loop -----------------------------------------------------------------

    def _typed(
        self, request: _Request, model: type[ModelT], *, retry: RetryPolicy | None = None
    ) -> Fetched[ModelT]:
        ok = self._call(request, retry=retry, model=model)
        # _call validated the body already (a malformed body is retried like a broken one).
        data = ok.parsed
        assert isinstance(data, model)
        return Fetched(data=data, raw=ok.raw, status=ok.status, rate_limit=ok.rate_limit)

    def _call(
        self,
        request: _Request,
        *,
        retry: RetryPolicy | None = None,
        model: type[pydantic.BaseModel] | None = None,
        breaker: CircuitBreaker | None = None,
    ) -> _Ok:
        policy = retry or self.retry_policy
        breaker = breaker or self.breaker
        attempts = 0
        slept = 0.0
        last: _Transient | None = None
        while True:
            attempts += 1
            try:
                token = breaker.before_request()
            except CircuitOpen:
                if last is None:
                    raise
                # This call's own failures opened the breaker: their cause is the answer.
                raise self._exhausted(
                    request, last, attempts - 1, slept, then="; the circuit breaker opened"
                ) from None
            try:
                self._wait_for_token(request.city)
            except BaseException:
                breaker.release(token)
                raise
            try:
                outcome = self._attempt(request, attempts)
                if isinstance(outcome, _Ok) and model is not None:
                    outcome = self._check_shape(outcome, model)
            except SupplierError:
                breaker.record_success(token)  # the supplier answered coherently
                raise
            except BaseException:
                breaker.release(token)
                raise
            if isinstance(outcome, _Ok):
                breaker.record_success(token)
                return outcome
            last = outcome
            if outcome.supplier_fault:
                breaker.record_failure(
                    token, code=_error_code(outcome), message=self._breaker_note(request, outcome)
                )
            else:
                breaker.record_success(token)

            wait = self._next_wait(outcome, policy, attempts, slept)
            if wait is None:
                raise self._exhausted(request, outcome, attempts, slept)
            with self._c.lock:
                self._c.retries_by_reason[outcome.reason] = (
                    self._c.retries_by_reason.get(outcome.reason, 0) + 1
                )
                self._c.backoff_wait += wait
                if (tally := _TALLY.get()) is not None:
                    tally.retries += 1
            logger.warning(
                "supplier %s: %s %s attempt %d failed (%s: %s); retrying in %.2fs",
                self.supplier_id,
                request.method,
                request.path,
                attempts,
                outcome.reason,
                self._redact(outcome.message),
                wait,
            )
            if wait > 0:
                self._sleep(wait)
            slept += wait

    def _teach(
        self, limiter: GovernedLimiter, status: int, headers: httpx.Headers, age: float
    ) -> None:
        """Tell an adaptive limiter of an answer; the answer stands even if it cannot hear
        (the next request's token then fails as it should)."""
        try:
            if status == 429:
                retry_after = parse_retry_after(headers.get("Retry-After"), now=self._wall_clock())
                limiter.throttled(retry_after, age=age)
            else:
                limiter.answered(_rate_limit_info(headers), age=age)
        except RateLimiterUnavailable as err:
            logger.warning(
                "supplier %s: the rate limiter missed an answer: %s", self.supplier_id, err
            )

    def _wait_for_token(self, city: str | None) -> None:
        waited = 0.0
        if self._limiter is not None:
            waited += self._limiter.acquire()
        if city is not None and self._city_limiters is not None:
            waited += self._city_limiters.for_city(city).acquire()
        if waited:
            with self._c.lock:
                self._c.rate_limiter_wait += waited
                if (tally := _TALLY.get()) is not None:
                    tally.waited += waited

    def _next_wait(
        self, outcome: _Transient, policy: RetryPolicy, attempts: int, slept: float
    ) -> float | None:
        """Seconds to sleep before the next attempt, or None to give up."""
        if attempts >= policy.max_attempts:
            return None
        remaining = policy.max_total_wait - slept
        if outcome.retry_after is not None:
            if outcome.retry_after > policy.max_retry_after or outcome.retry_after > remaining:
                return None
            return outcome.retry_after
        wait = policy.backoff(attempts, self._rng)
        if outcome.error is SupplierRateLimited:
            # Retrying a 429 at once only earns another 429.
            wait = max(wait, min(policy.base_delay, policy.max_delay))
        if policy.max_total_wait > 0 and remaining <= 0:
            return None
        return max(0.0, min(wait, remaining))

    def _exhausted(
        self, request: _Request, outcome: _Transient, attempts: int, slept: float, then: str = ""
    ) -> SupplierError:
        what = f"{request.method} {request.path}: {outcome.message}"
        if outcome.retry_after is not None:
            what += f" (Retry-After {outcome.retry_after:.1f}s)"
        msg = self._redact(
            f"{what}; gave up after {attempts} attempt(s), {slept:.1f}s waiting{then}"
        )
        return outcome.error(
            msg,
            reason=outcome.reason,
            status=outcome.status,
            code=outcome.code,
            attempts=attempts,
            retry_after=outcome.retry_after,
        )

    def _breaker_note(self, request: _Request, outcome: _Transient) -> str:
        """The failure as the breaker shows it: the host for a connection, else the call."""
        if outcome.reason in _CONNECTION_REASONS:
            return self._redact(outcome.message)
        return self._redact(f"{request.method} {request.path}: {outcome.message}")

    def _attempt(self, request: _Request, attempt: int) -> _Ok | _Transient:
        """Send one request and classify the answer; raises the non-retryable errors."""
        with self._c.lock:
            self._c.requests += 1
            if (tally := _TALLY.get()) is not None:
                tally.requests += 1
        progress = _Progress(started=self._clock())
        try:
            with (
                deadline_scope(self._deadline),
                self._http.stream(
                    request.method,
                    request.path,
                    params=request.params,
                    json=request.json_body,
                    headers={
                        "X-Api-Key": self._key.reveal(),
                        "Accept": "application/json",
                        "Accept-Encoding": "gzip",
                    },
                    timeout=self._timeout,
                ) as response,
            ):
                progress.headers_at = self._clock()
                raw = self._read_body(request, response, progress)
        except httpx.TransportError as err:
            return self._transport_failure(err, progress)
        status = response.status_code
        rate_limit = _rate_limit_info(response.headers)
        with self._c.lock:
            self._c.responses_by_status[status] = self._c.responses_by_status.get(status, 0) + 1
            self._c.last_rate_limit = rate_limit
        if isinstance(self._limiter, GovernedLimiter):
            self._teach(self._limiter, status, response.headers, self._clock() - progress.started)
        if isinstance(raw, _Transient):
            return raw

        try:
            body, parse_error = _parse_json(raw)
        except JsonTooDeep as err:
            raise SupplierProtocolError(
                self._redact(
                    f"{request.method} {request.path}: {status} with {err}; not retried "
                    "(the same request gets the same body)"
                ),
                reason="json_too_deep",
                status=status,
                attempts=attempt,
            ) from None
        code, message = _error_fields(body)
        effective = status
        if 200 <= status < 300:
            if parse_error is not None:
                return _Transient(
                    "bad_body", SupplierProtocolError, f"{status} with {parse_error}", status
                )
            if code is not None or (isinstance(body, dict) and body.get("error")):
                # An error envelope inside a 200 counts as the error it names.
                effective = ERROR_CODE_STATUS.get(code or "", 500)
                if effective == 500:
                    return _Transient(
                        "error_envelope",
                        SupplierUnavailable,
                        f"{status} with error body {code or '?'}: {message}",
                        status,
                        code,
                    )
            else:
                assert isinstance(body, dict)
                return _Ok(body=body, raw=raw, status=status, rate_limit=rate_limit)

        return self._classify_error(
            request, status, effective, code, message, response.headers, attempt
        )

    def _read_body(
        self, request: _Request, response: httpx.Response, progress: _Progress
    ) -> bytes | _Transient:
        """The body, decoded, read against the deadline and both byte caps.

        Raises:
            ResponseTooLarge: Past the cap on the wire (or the declared length is).
            DecompressionBomb: Past the cap on decoded bytes.
        """
        status = progress.status = response.status_code
        progress.length = _int_header(response.headers, "Content-Length")
        if progress.length is not None and progress.length > self._max_body:
            raise self._too_large(request, status, progress, declared=True)
        encoding = response.headers.get("Content-Encoding", "").strip().lower()
        chunks: Iterable[bytes]
        if response.is_stream_consumed:
            # An in-memory response (a test's, the in-process simulator's), read and decoded
            # by httpx when it was made.
            chunks, encoding = (response.content,), ""
        else:
            chunks = response.iter_raw()
        if encoding in ("gzip", "x-gzip"):
            inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            inflate = zlib.decompressobj()
        elif encoding in ("", "identity"):
            inflate = None
        else:
            return _Transient(
                "bad_body",
                SupplierProtocolError,
                f"{status} with Content-Encoding {encoding[:40]!r} (only gzip was accepted)",
                status,
            )
        deadline = progress.started + self._deadline
        cap = self._max_decoded if inflate is not None else min(self._max_decoded, self._max_body)
        parts: list[bytes] = []
        try:
            for chunk in chunks:
                progress.received += len(chunk)
                if progress.received > self._max_body:
                    raise self._too_large(request, status, progress)
                if inflate is not None:
                    # At most one byte past the cap is ever inflated.
                    chunk = inflate.decompress(chunk, cap - progress.decoded + 1)
                progress.decoded += len(chunk)
                if progress.decoded > cap:
                    raise self._too_large(request, status, progress, inflated=inflate is not None)
                parts.append(chunk)
                if self._clock() > deadline:
                    return self._late(status, progress)
        except zlib.error as err:
            return _Transient(
                "bad_body",
                SupplierProtocolError,
                f"{status} with a broken gzip body ({err})",
                status,
            )
        finally:
            with self._c.lock:
                self._c.bytes_received += progress.received
                self._c.bytes_decoded += progress.decoded
        if inflate is not None and not inflate.eof:
            return _Transient(
                "bad_body",
                SupplierProtocolError,
                f"{status} with a gzip body that ends early",
                status,
            )
        return b"".join(parts)

    def _too_large(
        self,
        request: _Request,
        status: int,
        progress: _Progress,
        *,
        declared: bool = False,
        inflated: bool = False,
    ) -> ResponseTooLarge:
        where = f"{request.method} {request.path}: body"
        if inflated:
            cap = self._max_decoded
            what = (
                f"{where} inflates past the {cap:,} byte cap on decoded bytes "
                f"({progress.received:,} bytes received)"
            )
            setting = "supplier_max_decoded_bytes"
        elif declared:
            cap = self._max_body
            what = (
                f"{where} of {progress.length:,} bytes (Content-Length) over the {cap:,} byte cap"
            )
            setting = "supplier_max_body_bytes"
        else:
            cap = min(self._max_body, self._max_decoded)
            what = f"{where} over the {cap:,} byte cap ({progress.received:,} bytes received)"
            setting = (
                "supplier_max_body_bytes" if cap == self._max_body else "supplier_max_decoded_bytes"
            )
        cls = DecompressionBomb if inflated else ResponseTooLarge
        return cls(
            self._redact(
                f"{what}; not read further, not retried (raise {env_name(setting)} "
                "if the supplier's pages are really this large)"
            ),
            limit=cap,
            status=status,
        )

    def _late(self, status: int | None, progress: _Progress) -> _Transient:
        """The body was still coming at the deadline (after prompt headers: not the breaker's)."""
        return _Transient(
            "timeout",
            SupplierTimeout,
            f"body not complete within the {self._deadline:g} s request "
            f"deadline ({progress.received:,} bytes"
            + (f" of {progress.length:,}" if progress.length is not None else "")
            + f" received in {self._clock() - progress.started:.1f} s)",
            status,
            supplier_fault=False,
        )

    def _transport_failure(self, err: httpx.TransportError, progress: _Progress) -> _Transient:
        """A request that failed below HTTP: refused, DNS, TLS, timeout, cut short."""
        elapsed = self._clock() - progress.started
        in_body = progress.headers_at is not None
        if in_body and (isinstance(err, httpx.TimeoutException) or elapsed >= self._deadline):
            return self._late(progress.status, progress)
        if isinstance(err, httpx.TimeoutException) or elapsed >= self._deadline:
            phase = (
                "connecting" if isinstance(err, httpx.ConnectTimeout) else "waiting for an answer"
            )
            return _Transient(
                "timeout",
                SupplierTimeout,
                f"{self._origin}: timed out {phase} after {elapsed:.1f} s "
                f"({type(err).__name__}; the request deadline is {self._deadline:g} s)",
            )
        if in_body:
            expected = f" of {progress.length:,}" if progress.length is not None else ""
            return _Transient(
                "truncated",
                TruncatedBody,
                "body cut short: the connection closed after "
                f"{progress.received:,}{expected} bytes",
                progress.status,
                supplier_fault=False,
            )
        if isinstance(err, httpx.ConnectError):
            reason, what = _connect_failure(err)
            return _Transient(reason, SupplierUnreachable, f"{self._origin}: {what}")
        if isinstance(err, httpx.RemoteProtocolError) and "without sending a response" not in str(
            err
        ):
            # A response cut short before the client saw its headers end.
            return _Transient(
                "truncated",
                TruncatedBody,
                f"the response was cut short ({err})",
                supplier_fault=False,
            )
        return _Transient(
            "connection",
            SupplierUnavailable,
            f"{self._origin}: the connection failed before an answer ({type(err).__name__}: {err})",
        )

    def _classify_error(
        self,
        request: _Request,
        status: int,
        effective: int,
        code: str | None,
        message: str,
        headers: httpx.Headers,
        attempt: int,
    ) -> _Transient:
        label = f"{status}" + (f" {code}" if code else "")
        detail = f"{request.method} {request.path} -> {label}" + (f": {message}" if message else "")
        detail = self._redact(detail)
        if effective == 429 or effective == 503:
            retry_after = parse_retry_after(headers.get("Retry-After"), now=self._wall_clock())
            if effective == 429:
                with self._c.lock:
                    self._c.rate_limited += 1
                    if (tally := _TALLY.get()) is not None:
                        tally.throttled += 1
                return _Transient(
                    "rate_limited",
                    SupplierRateLimited,
                    label,
                    status,
                    code,
                    retry_after,
                    supplier_fault=False,
                )
            return _Transient("status_503", SupplierUnavailable, label, status, code, retry_after)
        if effective >= 500 or effective == 408:
            return _Transient(f"status_{effective}", SupplierUnavailable, label, status, code)
        if effective in (401, 403):
            raise SupplierAuthError(
                f"supplier {self.supplier_id} refused the API key: {detail}. "
                "Check the key configured for this supplier; the sync must stop.",
                status=status,
                code=code,
                attempts=attempt,
            )
        if effective == 404:
            # A city's 404 is the supplier dropping the city, not a missing hotel.
            gone = SupplierNotFound if request.city is None else CityNotFound
            raise gone(detail, status=status, code=code, attempts=attempt)
        if effective == 410 and (code == "CURSOR_EXPIRED" or request.with_cursor):
            with self._c.lock:
                self._c.cursor_expired += 1
            raise CursorExpired(detail, status=status, code=code, attempts=attempt)
        if 300 <= effective < 400:
            raise SupplierProtocolError(
                f"{detail} (redirects are not followed)",
                reason="redirect",
                status=status,
                code=code,
                attempts=attempt,
            )
        raise SupplierBadRequest(detail, status=status, code=code, attempts=attempt)

    def _check_shape(self, ok: _Ok, model: type[pydantic.BaseModel]) -> _Ok | _Transient:
        try:
            parsed = model.model_validate(ok.body)
        except pydantic.ValidationError as err:
            details = err.errors()
            where = ".".join(str(part) for part in details[0]["loc"]) if details else ""
            why = details[0]["msg"] if details else ""
            return _Transient(
                "bad_body",
                SupplierProtocolError,
                f"{ok.status} body does not match {model.__name__} "
                f"({err.error_count()} error(s), first at '{where}': {why})",
                ok.status,
            )
        return dataclasses.replace(ok, parsed=parsed)

    def _redact(self, text: str) -> str:
        # A supplier may echo the key back in an error message (registered: see __init__).
        return redact(text.replace(self._key.reveal(), _REDACTED))


def _check_city(city_code: str) -> None:
    if not isinstance(city_code, str) or not 1 <= len(city_code) <= 64:
        raise ValueError("city_code must be a string of 1 to 64 characters")


def _parse_json(raw: bytes) -> tuple[Any, str | None]:
    """Decode a JSON object body; returns (body, None) or (None, what went wrong).

    A page whose records are broken one by one keeps its other records
    (:func:`~supplier_sync_dagster.core.supplier.models.decode_page`).

    Raises:
        JsonTooDeep: The body nests deeper than the decoder's limit.
    """
    if not raw:
        return None, "an empty body"
    try:
        body = decode_page(raw)
    except JsonTooDeep:
        raise
    except UnicodeDecodeError:
        return None, "a body that is not UTF-8"
    except ValueError:
        return None, "a body that is not JSON (truncated or HTML)"
    if not isinstance(body, dict):
        return None, f"a JSON {type(body).__name__} instead of an object"
    return body, None


def _rate_limit_info(headers: httpx.Headers) -> RateLimitInfo:
    """The supplier's ``X-RateLimit-*`` headers of a response."""
    return RateLimitInfo(
        limit=_int_header(headers, "X-RateLimit-Limit"),
        remaining=_int_header(headers, "X-RateLimit-Remaining"),
        reset_seconds=_float_header(headers, "X-RateLimit-Reset"),
    )


def _connect_failure(err: BaseException) -> tuple[str, str]:
    """The reason and what happened, for a connection that could not be made."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ssl.SSLError):
            detail = getattr(cause, "verify_message", None) or cause.reason or cause
            return "tls", f"TLS handshake failed ({detail})"
        if isinstance(cause, socket.gaierror):
            return "dns", f"the host name does not resolve ({cause.strerror or cause})"
        if isinstance(cause, ConnectionRefusedError):
            return "connection_refused", "connection refused"
        cause = cause.__cause__ or cause.__context__
    text = str(err)
    lowered = text.lower()
    if "refused" in lowered:
        return "connection_refused", "connection refused"
    if any(s in lowered for s in ("name or service", "nodename", "name resolution", "getaddrinfo")):
        return "dns", f"the host name does not resolve ({text})"
    if any(s in lowered for s in ("ssl", "tls", "certificate")):
        return "tls", f"TLS handshake failed ({text})"
    return "connection", f"no connection ({type(err).__name__}: {text})"


def _error_code(outcome: _Transient) -> str:
    """The error code the call would raise with, if it gave up on this failure."""
    return outcome.error("", reason=outcome.reason).error_code


def _error_fields(body: Any) -> tuple[str | None, str]:
    """Pull ``(code, message)`` out of an ``{"error": ...}`` body, if it is one."""
    if not isinstance(body, dict):
        return None, ""
    error = body.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        message = error.get("message")
        return (
            str(code)[:64] if code is not None else None,
            str(message)[:_MAX_MESSAGE] if message is not None else "",
        )
    if isinstance(error, str) and error:
        return error[:64], ""
    return None, ""
