"""The simulator's core: one object that answers contract requests, faults included.

``Simulator.dispatch`` takes the parts of an HTTP request (a ``SimRequest``: method, raw
path, raw query, headers, body) and returns a ``SimResponse``. :func:`handle_httpx` adapts
anything that dispatches so (a ``Dispatcher``) to ``httpx`` (``httpx.MockTransport(sim.handle)``
is the in-process transport) and ``app.SimulatorApp`` to ASGI (uvicorn), so both behave the
same. City codes in paths: see ``paths``.

Order of checks for a contract request: route, API key (401), rate limit (429), injected
transient fault (decided by a seeded RNG, so a retry can succeed), then the endpoint itself
(400 / 404 / 410 or 200), truncation, gzip. Non-contract admin paths under ``/_sim/`` need no
key and are never faulted: ``GET /_sim/stats``, ``POST /_sim/advance?seconds=N`` (the clock
moves ``N`` seconds on) and ``POST /_sim/advance_day`` (to the start of the next day).

The simulated clock is an integer number of seconds since the configured ``epoch``; a
request is answered from the world at the instant the clock shows when it arrives.
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import datetime as dt
import email.utils
import gzip
import hashlib
import hmac
import itertools
import json
import math
import random
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qsl

import httpx

from supplier_sync_dagster.simulator import data, locales, modes, paths
from supplier_sync_dagster.simulator.config import DAY_SECONDS, SimulatorConfig
from supplier_sync_dagster.simulator.data import City, GroundTruth, World
from supplier_sync_dagster.simulator.modes import ActiveModes, DriftLedger
from supplier_sync_dagster.simulator.ratelimit import Decision, RateLimiter
from supplier_sync_dagster.simulator.stats import SimStats

MAX_PAGE_SIZE = 500
DEFAULT_PAGE_SIZE = 100
MAX_CHANGES_LIMIT = 1000
DEFAULT_CHANGES_LIMIT = 100
MAX_NIGHTS = 30
OFFER_VALID_SECONDS = 300
_GZIP_MIN_BYTES = 256
MAX_ADVANCE_SECONDS = 366 * DAY_SECONDS

HTML_502 = (
    b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n"
    b"</body>\r\n</html>\r\n"
)
HTML_504 = (
    b"<html>\r\n<head><title>504 Gateway Time-out</title></head>\r\n<body>\r\n"
    b"<center><h1>504 Gateway Time-out</h1></center>\r\n<hr><center>nginx</center>\r\n"
    b"</body>\r\n</html>\r\n"
)

# Fault kinds, as counted in stats["faults"].
FAULT_429 = "429"
FAULT_500 = "500"
FAULT_502 = "502_html"
FAULT_503 = "503"
FAULT_504 = "504"
FAULT_ENVELOPE = "error_envelope_200"
FAULT_TRUNCATED = "truncated"
FAULT_SLOW = "slow"
FAULT_CURSOR_EXPIRED = "cursor_expired"
FAULT_CURSOR_TTL = "cursor_expired_ttl"
FAULT_DUPLICATE = "duplicate_across_pages"


@dataclass
class SimResponse:
    """A response before it is handed to a transport.

    Attributes:
        status: HTTP status.
        headers: header pairs (names lower-case).
        body: the body bytes as sent (compressed when ``content-encoding`` says so).
        delay: seconds to wait before answering (the slow fault).
        compress: whether the body may be gzipped for a client that accepts it.
        trickle: bytes per second at which the body is sent (None: at once).
        cut_at: the connection closes after this many body bytes (the declared length stays).
        truncate: cut the body (after compression) half-way: sets ``cut_at``.
    """

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    delay: float = 0.0
    compress: bool = True
    trickle: float | None = None
    cut_at: int | None = None
    truncate: bool = False

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), if any."""
        name = name.lower()
        return next((v for k, v in self.headers if k == name), None)


@dataclass(frozen=True)
class SimRequest:
    """A request as the simulator reads it: its raw parts.

    Attributes:
        method: HTTP method.
        raw_path: the path exactly as on the wire (still percent-encoded), no query.
        query: the raw query string.
        headers: request headers with lower-case names.
        body: the request body.
    """

    method: str
    raw_path: bytes
    query: bytes
    headers: Mapping[str, str]
    body: bytes

    @classmethod
    def from_httpx(cls, request: httpx.Request) -> SimRequest:
        """The parts of an ``httpx`` request."""
        raw_path, _, query = request.url.raw_path.partition(b"?")
        headers = {k.lower(): v for k, v in request.headers.items()}
        return cls(request.method, raw_path, query, headers, request.read())


class Dispatcher(Protocol):
    """Anything that answers a request from its raw parts: a ``Simulator``, a fleet of them."""

    def dispatch(self, request: SimRequest) -> SimResponse:
        """Answer one request."""
        ...


def handle_httpx(target: Dispatcher, request: httpx.Request) -> httpx.Response:
    """Answer an ``httpx`` request in-process with ``target`` (sleeping for the slow fault).

    Args:
        target: what answers (``httpx.MockTransport(lambda r: handle_httpx(target, r))``).
        request: the request.

    Returns:
        The response, exactly as the ASGI app would send it.
    """
    if getattr(target, "refuses_connections", False):
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
    resp = target.dispatch(SimRequest.from_httpx(request))
    if resp.delay:
        time.sleep(resp.delay)
    # A stream, not content: the client reads it as it reads a socket (``iter_raw``).
    headers = [*resp.headers, ("content-length", str(len(resp.body)))]
    return httpx.Response(resp.status, headers=headers, stream=_BodyStream(resp, request))


class _BodyStream(httpx.SyncByteStream):
    """A body as the ASGI app sends it over a socket: at once, slowly or cut short."""

    def __init__(self, resp: SimResponse, request: httpx.Request) -> None:
        self._resp, self._request = resp, request

    def __iter__(self) -> Iterator[bytes]:
        body, cut = self._resp.body, self._resp.cut_at
        sent = body if cut is None else body[:cut]
        for chunk, pause in body_chunks(sent, self._resp.trickle):
            if pause:
                time.sleep(pause)
            yield chunk
        if cut is not None:
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body",
                request=self._request,
            )


def body_chunks(body: bytes, trickle: float | None) -> Iterator[tuple[bytes, float]]:
    """The body in the pieces a transport sends, each with the pause before it.

    Args:
        body: the bytes to send.
        trickle: bytes per second (None: one piece, no pause).
    """
    if trickle is None:
        yield body, 0.0
        return
    step = max(1, int(trickle / 10))
    for i in range(0, len(body), step):
        yield body[i : i + step], step / trickle


class _HttpError(Exception):
    """Ends a request with a JSON error envelope."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def error_body(code: str, message: str) -> bytes:
    """The contract's error envelope."""
    return json.dumps({"error": {"code": code, "message": message}}).encode()


def _json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _parse_int(params: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        raise _HttpError(400, "INVALID_PARAMETER", f"{name} must be an integer") from None
    if not lo <= value <= hi:
        raise _HttpError(400, "INVALID_PARAMETER", f"{name} must be within {lo}..{hi}")
    return value


def _parse_time(raw: str) -> float:
    try:
        # A '+' of an unencoded offset arrives as a space in a query string.
        parsed = dt.datetime.fromisoformat(raw.strip().replace(" ", "+"))
    except ValueError:
        raise _HttpError(400, "INVALID_PARAMETER", "since must be an RFC 3339 time") from None
    if parsed.tzinfo is None:
        raise _HttpError(400, "INVALID_PARAMETER", "since must carry a time zone (Z)")
    return parsed.timestamp()


def _accepts_gzip(value: str | None) -> bool:
    for part in (value or "").split(","):
        token, _, params = part.strip().partition(";")
        if token.strip().lower() in ("gzip", "*"):
            q = params.strip().lower()
            return not (q.startswith("q=") and float(q[2:] or 0) == 0.0)
    return False


class Simulator:
    """A simulated hotel supplier speaking ``shared/supplier-api.md``. Thread-safe.

    Example:
        >>> sim = Simulator(SimulatorConfig(n_cities=5, total_hotels=200))
        >>> with httpx.Client(transport=sim.transport(), base_url="http://sim") as c:
        ...     c.get("/v1/cities", headers={"X-Api-Key": "sim-key"}).status_code
        200
    """

    def __init__(self, config: SimulatorConfig | None = None) -> None:
        """Build the world's cities (hotels are generated lazily).

        Args:
            config: the configuration; ``SimulatorConfig()`` when omitted.
        """
        self.config = config or SimulatorConfig()
        self.world = World(self.config)
        self._clock = self.config.day * DAY_SECONDS + self.config.start_offset_seconds
        self._clock_lock = threading.Lock()
        self._stats = SimStats()
        self._limiter = RateLimiter(self.config.rate_limit_rps, self.config.rate_limit_burst)
        self._swing_lock = threading.Lock()
        self._swing_start: float | None = None
        self._other_since: float | None = None
        self._other_owed = 0.0
        self._rng = random.Random(data.stable_hash(self.config.seed, "faults"))
        self._rng_lock = threading.Lock()
        self._cursor_key = hashlib.sha256(f"{self.config.seed}:cursor".encode()).digest()
        self._cities_body: tuple[int, bytes] | None = None
        faults = self.config.faults
        self._modes = ActiveModes.of(faults.modes, faults.mode_cities)
        self._drift = DriftLedger(faults.mode_scale.drift_shifts, 1, data.HOTELS_PER_CITY_SPAN)
        self._cycle_cursors: dict[tuple[str, int], str] = {}
        self._nonce = itertools.count()

    # -- time and truth -------------------------------------------------------------------

    @property
    def clock(self) -> int:
        """The simulated time: integer seconds since ``config.epoch``."""
        return self._clock

    @property
    def day(self) -> int:
        """The current simulated day (``clock // 86400``)."""
        return self._clock // DAY_SECONDS

    def _instant(self) -> int:
        """The current instant as Unix seconds (what the world is asked at)."""
        return self.config.epoch_seconds + self._clock

    def advance(self, seconds: int) -> dt.datetime:
        """Move the clock forward; the changes of the time passed become visible.

        Args:
            seconds: how many seconds to move (>= 0).

        Returns:
            The new current instant (``now()``).

        Raises:
            ValueError: ``seconds`` is negative.
        """
        return self._at(self._advance(seconds))

    def _advance(self, seconds: int) -> int:
        if seconds < 0:
            raise ValueError("advance needs seconds >= 0")
        with self._clock_lock:
            self._clock += seconds
            return self._clock

    def advance_day(self, days: int = 1) -> int:
        """Move the clock to the start of day ``day + days``.

        Args:
            days: how many days to move (>= 1).

        Returns:
            The new current day.

        Raises:
            ValueError: ``days`` is less than 1.
        """
        if days < 1:
            raise ValueError("advance_day needs days >= 1")
        with self._clock_lock:
            self._clock = (self._clock // DAY_SECONDS + days) * DAY_SECONDS
            return self._clock // DAY_SECONDS

    def now(self) -> dt.datetime:
        """The current simulated instant (``epoch + clock`` seconds)."""
        return self._at(self._clock)

    def _at(self, clock: int) -> dt.datetime:
        return self.config.epoch + dt.timedelta(seconds=clock)

    def ground_truth(self, day: int | None = None) -> GroundTruth:
        """What a perfect sync ends with; see ``GroundTruth``. The named modes count: a
        hotel they break is bad, a drifted city lists what it lists now.

        Args:
            day: describe the start of this day; ``None``: the current instant.
        """
        if day is None:
            at = self._instant()
            truth = self.world.ground_truth_at(at)
        else:
            at = self.world.day_start(day)
            truth = self.world.ground_truth(day)
        return self._with_modes(truth, at)

    # -- named modes ------------------------------------------------------------------------

    @property
    def modes(self) -> ActiveModes:
        """The named modes on now (``simulator.modes``)."""
        return self._modes

    def set_modes(self, names: list[str], cities: list[str] | None = None) -> None:
        """Switch the named modes (an empty list: none); see ``simulator.modes``.

        Raises:
            ValueError: an unknown mode name.
        """
        self._modes = ActiveModes.of(names, cities or [])
        self._cities_body = None  # the city list follows ``dropped_city``

    @property
    def refuses_connections(self) -> bool:
        """Whether the ``refused`` mode is on: servers then accept no connection."""
        return "refused" in self._modes.names

    def _victims(self, at: int) -> dict[int, str]:
        """Hotel number -> what breaks it: the first listed hotel of each city the
        ``bad_bytes`` or ``future_timestamp`` mode touches."""
        kinds = [
            (name, code)
            for name, code in (
                ("bad_bytes", modes.INVALID_UTF8),
                ("future_timestamp", modes.FUTURE_TIMESTAMP),
            )
            if name in self._modes.names
        ]
        found: dict[int, str] = {}
        if not kinds:
            return found
        for city in self.world.cities:
            ids = self.world.state_at(city, at).ids
            for name, code in kinds:
                if ids and self._modes.on(name, city.code):
                    found.setdefault(ids[0], code)
        return found

    def _with_modes(self, truth: GroundTruth, at: int) -> GroundTruth:
        return self._without_dropped(self._shifted(truth, at))

    def _without_dropped(self, truth: GroundTruth) -> GroundTruth:
        """The truth without the hotels of ``dropped_city`` cities (the supplier serves none)
        and the ``withdrawn_hotel`` ones."""
        names = self._modes.names
        dropped = (
            {c for c in truth.listed_by_city if self._modes.on("dropped_city", c)}
            if "dropped_city" in names
            else set()
        )
        withdrawn = (
            {
                ids[0]
                for c, ids in truth.listed_by_city.items()
                if ids and c not in dropped and self._modes.on("withdrawn_hotel", c)
            }
            if "withdrawn_hotel" in names
            else set()
        )
        if not dropped and not withdrawn:
            return truth
        gone = {h for c in dropped for h in truth.listed_by_city[c]} | withdrawn
        gone |= {h for c in dropped for h in truth.valid_by_city.get(c, {})}

        def keep(ids: Mapping[str, Any]) -> dict[str, Any]:
            return {h: v for h, v in ids.items() if h not in gone}

        return dataclasses.replace(
            truth,
            valid=keep(truth.valid),
            bad=keep(truth.bad),
            moved=keep(truth.moved),
            versions=keep(truth.versions),
            valid_by_city={
                c: keep(ids) for c, ids in truth.valid_by_city.items() if c not in dropped
            },
            listed_by_city={
                c: tuple(h for h in ids if h not in gone)
                for c, ids in truth.listed_by_city.items()
                if c not in dropped
            },
            inactive=truth.inactive - gone,
            price_shocks=truth.price_shocks - gone,
        )

    def _shifted(self, truth: GroundTruth, at: int) -> GroundTruth:
        """The truth with the ``drift`` shifts and the hotels the modes break."""
        drifts = self._drift.all()
        victims = self._victims(at)
        if not drifts and not victims:
            return truth
        valid, bad, versions = dict(truth.valid), dict(truth.bad), dict(truth.versions)
        by_city = {code: dict(ids) for code, ids in truth.valid_by_city.items()}
        listed = dict(truth.listed_by_city)
        day = self.world.day_of(at)
        for index, drift in drifts.items():
            city = self.world.cities[index]
            gone = {data.hotel_id(n) for n in drift.removed}
            listed[city.code] = tuple(h for h in listed[city.code] if h not in gone) + tuple(
                data.hotel_id(n) for n in sorted(drift.added)
            )
            for hid in gone:
                valid.pop(hid, None)
                bad.pop(hid, None)
                versions.pop(hid, None)
                for ids in by_city.values():
                    ids.pop(hid, None)
            for num, h in drift.added.items():
                hid = data.hotel_id(num)
                versions[hid] = h.version
                reason = self.world.bad_reason(h, day)
                if reason is None:
                    valid[hid] = by_city[city.code][hid] = h.version
                else:
                    bad[hid] = reason
        for num, code in victims.items():
            hid = data.hotel_id(num)
            if valid.pop(hid, None) is not None:
                for ids in by_city.values():
                    ids.pop(hid, None)
                bad[hid] = code
        gone_all = {data.hotel_id(n) for d in drifts.values() for n in d.removed}
        return dataclasses.replace(
            truth,
            valid=valid,
            bad=bad,
            versions=versions,
            valid_by_city=by_city,
            listed_by_city=listed,
            inactive=truth.inactive - gone_all,
        )

    @property
    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters (requests, statuses, faults, bytes, hotels) and the time."""
        snap = self._stats.snapshot()
        clock = self._clock
        snap["day"] = clock // DAY_SECONDS
        snap["now"] = data.rfc3339(self.config.epoch_seconds + clock)
        return snap

    def reset_stats(self) -> None:
        """Set every counter back to zero."""
        self._stats.reset()

    def city_codes(self) -> list[str]:
        """Every city code the supplier serves."""
        return [c.code for c in self.world.cities]

    # -- transports -----------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        """Answer an ``httpx`` request in-process (sleeping for the slow fault)."""
        return handle_httpx(self, request)

    def transport(self) -> httpx.MockTransport:
        """An ``httpx`` transport that calls this simulator in-process."""
        return httpx.MockTransport(self.handle)

    def client(self, **kwargs: Any) -> httpx.Client:
        """An ``httpx.Client`` on the in-process transport, with the API key set."""
        headers = {"X-Api-Key": self.config.api_key, **kwargs.pop("headers", {})}
        return httpx.Client(
            transport=self.transport(), base_url="http://simulator", headers=headers, **kwargs
        )

    # -- dispatch -------------------------------------------------------------------------

    def dispatch(self, request: SimRequest) -> SimResponse:
        """Answer one request."""
        method, query, headers = request.method, request.query, request.headers
        segments = paths.split_raw_path(request.raw_path)
        if segments[:1] == [b"_sim"]:
            return self._admin(method, segments[1:], query)
        endpoint, args = self._route(segments)
        self._stats.request(endpoint)
        key = headers.get("x-api-key", "")
        valid_key = hmac.compare_digest(key.encode(), self.config.api_key.encode())
        if not valid_key or "unauthorized" in self._modes.names:
            self._stats.unauthorized()
            why = "the API key was revoked" if valid_key else "missing or wrong X-Api-Key"
            return self._finish(
                SimResponse(401, body=error_body("UNAUTHORIZED", why)),
                self._limiter.peek(""),
                headers,
            )
        decision = self._limit(key)
        if not decision.allowed:
            self._stats.rate_limited()
            resp = SimResponse(429, body=error_body("RATE_LIMITED", "rate limit exceeded"))
            if "undisclosed_limit" not in self._modes.names:
                resp.headers.append(("retry-after", str(decision.retry_after)))
            return self._finish(resp, decision, headers)
        if endpoint == "not_found":
            resp = SimResponse(404, body=error_body("NOT_FOUND", "no such endpoint"))
            return self._finish(resp, decision, headers)

        fault, u_param = self._draw_fault()
        if (
            fault is None
            and endpoint == "hotel"
            and self._chance(self.config.faults.detail_outage_rate)
        ):
            fault = FAULT_503  # the detail service is down while listings work
        if fault is not None and fault not in (FAULT_TRUNCATED, FAULT_SLOW):
            self._stats.fault(fault)
            return self._finish(self._fault_response(fault, u_param), decision, headers)
        try:
            resp = self._endpoint(endpoint, method, args, query, request.body)
        except _HttpError as err:
            resp = SimResponse(err.status, body=error_body(err.code, err.message))
        if fault == FAULT_SLOW:
            self._stats.fault(fault)
            resp.delay = self.config.faults.slow_seconds
        elif fault == FAULT_TRUNCATED and resp.status == 200 and len(resp.body) > 1:
            self._stats.fault(fault)
            resp.body = resp.body[: max(1, int(len(resp.body) * (0.1 + 0.8 * u_param)))]
        return self._finish(resp, decision, headers)

    def _route(self, segs: list[bytes]) -> tuple[str, list[bytes]]:
        n = len(segs)
        if n < 2 or segs[0] != b"v1":
            return "not_found", []
        if n == 2 and segs[1] == b"cities":
            return "cities", []
        if n == 4 and segs[1] == b"cities" and segs[3] == b"hotels":
            return "city_hotels", [segs[2]]
        if n == 4 and segs[1] == b"cities" and segs[3] == b"summary":
            return "city_summary", [segs[2]]
        if n == 3 and segs[1] == b"hotels" and segs[2] == b"changes":
            return "changes", []
        if n == 3 and segs[1] == b"hotels":
            return "hotel", [segs[2]]
        if n == 3 and segs[1] == b"offers" and segs[2] == b"confirm":
            return "offers_confirm", []
        return "not_found", []

    def _draw_fault(self) -> tuple[str | None, float]:
        f = self.config.faults
        with self._rng_lock:
            u = self._rng.random()
            u_param = self._rng.random()
        for kind, rate in (
            (FAULT_429, f.rate_429),
            (FAULT_500, f.rate_500),
            (FAULT_502, f.rate_502_html),
            (FAULT_503, f.rate_503),
            (FAULT_504, f.rate_504),
            (FAULT_ENVELOPE, f.rate_error_envelope_200),
            (FAULT_TRUNCATED, f.rate_truncated),
            (FAULT_SLOW, f.rate_slow),
        ):
            if u < rate:
                return kind, u_param
            u -= rate
        return None, u_param

    def _chance(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        with self._rng_lock:
            return self._rng.random() < rate

    def _fault_response(self, fault: str, u: float) -> SimResponse:
        f = self.config.faults
        if fault == FAULT_429:
            resp = SimResponse(429, body=error_body("RATE_LIMITED", "too many requests"))
            if u < f.retry_after_http_date_share:
                when = math.ceil(time.time()) + f.retry_after_seconds
                resp.headers.append(("retry-after", email.utils.formatdate(when, usegmt=True)))
            else:
                resp.headers.append(("retry-after", str(f.retry_after_seconds)))
            return resp
        if fault == FAULT_500:
            return SimResponse(500, body=error_body("INTERNAL_ERROR", "internal server error"))
        if fault == FAULT_502:
            return SimResponse(502, [("content-type", "text/html")], HTML_502)
        if fault == FAULT_503:
            resp = SimResponse(503, body=error_body("SERVICE_UNAVAILABLE", "try again later"))
            if u < 0.5:
                resp.headers.append(("retry-after", str(f.retry_after_seconds)))
            return resp
        if fault == FAULT_504:
            return SimResponse(504, [("content-type", "text/html")], HTML_504)
        code = "INTERNAL_ERROR" if u < 0.5 else "SERVICE_UNAVAILABLE"
        return SimResponse(200, body=error_body(code, "upstream failure"))

    def _limit(self, key: str) -> Decision:
        """Count a request of ``key`` against its limit, as the modes on now shape it."""
        names = self._modes.names
        if "limit_swing" in names:
            now = time.monotonic()
            with self._swing_lock:
                if self._swing_start is None:
                    self._swing_start = now
                phase = (
                    now - self._swing_start
                ) / self.config.faults.mode_scale.limit_swing_seconds
            self._limiter.scale(0.5 if 1 <= phase < 2 else 1.0)
        if "shared_limit" in names:
            self._other_account(key)
        return self._limiter.acquire(key)

    def _other_account(self, key: str) -> None:
        """Spend what another account on ``key`` sent since the last request: half the limit."""
        rate = self.config.rate_limit_rps
        if rate is None:
            return
        now = time.monotonic()
        with self._swing_lock:
            start = self._other_since if self._other_since is not None else now
            owed = self._other_owed + (now - start) * rate / 2
            self._other_since = now
            self._other_owed = owed - math.floor(owed)
        for _ in range(math.floor(owed)):
            self._limiter.acquire(key)

    def _finish(
        self, resp: SimResponse, decision: Decision, req_headers: Mapping[str, str]
    ) -> SimResponse:
        if resp.header("content-type") is None:
            resp.headers.append(("content-type", "application/json"))
        if (
            resp.compress
            and resp.header("content-encoding") is None
            and len(resp.body) >= _GZIP_MIN_BYTES
            and _accepts_gzip(req_headers.get("accept-encoding"))
        ):
            resp.body = gzip.compress(resp.body, compresslevel=1, mtime=0)
            resp.headers.append(("content-encoding", "gzip"))
        if resp.truncate:
            resp.cut_at = max(1, len(resp.body) // 2)
        resp.headers.append(("vary", "Accept-Encoding"))
        if "undisclosed_limit" not in self._modes.names:
            resp.headers.append(("x-ratelimit-limit", str(decision.limit)))
            resp.headers.append(("x-ratelimit-remaining", str(decision.remaining)))
            resp.headers.append(("x-ratelimit-reset", str(decision.reset_seconds)))
        self._stats.response(resp.status, len(resp.body))
        return resp

    # -- endpoints ------------------------------------------------------------------------

    def _endpoint(
        self, endpoint: str, method: str, args: list[bytes], query: bytes, body: bytes
    ) -> SimResponse:
        wanted = "POST" if endpoint == "offers_confirm" else "GET"
        if method != wanted:
            raise _HttpError(405, "METHOD_NOT_ALLOWED", f"use {wanted}")
        params = dict(parse_qsl(query.decode("latin-1"), keep_blank_values=True))
        # parse_qsl decodes escapes as latin-1 above; redo it as UTF-8 where it matters.
        params = {
            k.encode("latin-1").decode("utf-8", "replace"): v.encode("latin-1").decode(
                "utf-8", "replace"
            )
            for k, v in params.items()
        }
        at = self._instant()
        if endpoint == "cities":
            return SimResponse(200, body=self._cities(at))
        if endpoint == "city_hotels":
            city = self._city(args[0])
            faults = self.config.faults
            if city.code in faults.unlisted_hotels_city_codes:
                raise _HttpError(404, "CITY_NOT_FOUND", "unknown city")
            if city.code in faults.failing_city_codes:
                raise _HttpError(503, "UNAVAILABLE", "the city's shard of the supplier is down")
            if city.code in faults.emptied_city_codes:
                return SimResponse(
                    200,
                    body=_json(
                        {
                            "city_code": city.code,
                            "page": 1,
                            "page_size": _parse_int(
                                params, "page_size", DEFAULT_PAGE_SIZE, 1, MAX_PAGE_SIZE
                            ),
                            "total": 0,
                            "total_pages": 0,
                            "next_cursor": None,
                            "hotels": [],
                        }
                    ),
                )
            return self._listing(city, params, at)
        if endpoint == "city_summary":
            return self._summary(self._city(args[0]), at)
        if endpoint == "hotel":
            return self._hotel(args[0], at)
        if endpoint == "changes":
            return self._changes(params, at)
        return self._confirm(body, at)

    def _city(self, raw: bytes) -> City:
        try:
            code = paths.decode_segment(raw)
        except paths.PathError as err:
            raise _HttpError(400, "INVALID_CITY_CODE", str(err)) from None
        city = self.world.city_by_code(code)
        if city is None or self._modes.on("dropped_city", city.code):
            raise _HttpError(404, "CITY_NOT_FOUND", "unknown city")
        return city

    def _dropped(self, num: int) -> bool:
        """Whether hotel ``num``'s city is dropped (``dropped_city``)."""
        if "dropped_city" not in self._modes.names:
            return False
        index = num // data.HOTELS_PER_CITY_SPAN
        cities = self.world.cities
        return index < len(cities) and self._modes.on("dropped_city", cities[index].code)

    def _withdrawn(self, num: int, at: int) -> bool:
        """Whether hotel ``num`` is its city's first, withdrawn (``withdrawn_hotel``)."""
        if "withdrawn_hotel" not in self._modes.names:
            return False
        index = num // data.HOTELS_PER_CITY_SPAN
        cities = self.world.cities
        if index >= len(cities) or not self._modes.on("withdrawn_hotel", cities[index].code):
            return False
        ids = self.world.state_at(cities[index], at).ids
        return bool(ids) and ids[0] == num

    def _cities(self, at: int) -> bytes:
        cached = self._cities_body
        if cached is not None and cached[0] == at:
            return cached[1]
        updated = data.rfc3339(self.world.day_start(self.world.day_of(at)))
        cities = [
            {
                "city_code": c.code,
                "name": c.name,
                "country_code": c.country_code,
                "hotel_count": self.world.listed_count_at(c, at),
                "updated_at": updated,
            }
            for c in self.world.cities
            if not self._modes.on("dropped_city", c.code)
        ]
        body = _json({"cities": cities, "total": len(cities)})
        self._cities_body = (at, body)
        return body

    def _listing(self, city: City, params: Mapping[str, str], at: int) -> SimResponse:
        """A city's page, with the named modes that touch the city."""
        if self._modes.on("drift", city.code):
            if "cursor" in params:
                self._stats.fault("drift")
                raise _HttpError(410, "CURSOR_EXPIRED", "cursor expired: resume with page numbers")
            if _parse_int(params, "page", 1, 1, 10**9) >= 2:
                self._drift.shift(city.index, self.world.state_at(city, at), at)
        head, resp = self._city_hotels(city, params, at)
        return self._body_modes(resp, head, city.code)

    def _body_modes(self, resp: SimResponse, head: bytes, city: str | None) -> SimResponse:
        """``resp`` as the modes that change bodies send it (``head``: the page's fields)."""
        on, faults = self._modes.on, self.config.faults.mode_scale
        if on("huge_body", city):
            resp = SimResponse(
                200, body=modes.huge_page(head, faults.huge_body_bytes), compress=False
            )
        elif on("deep_json", city):
            resp = SimResponse(200, body=modes.deep_page(head, modes.DEEP_JSON_DEPTH))
        elif on("inflating_body", city):
            bomb = modes.inflating_gzip(faults.inflated_body_bytes)
            resp = SimResponse(200, [("content-encoding", "gzip")], bomb, compress=False)
        if on("slow_body", city):
            resp.trickle = faults.slow_body_bytes_per_second
        if on("truncated_body", city):
            resp.truncate = True
        return resp

    def _city_state(self, city: City, at: int) -> data.CityState:
        state = self.world.state_at(city, at)
        drift = self._drift.get(city.index)
        state = state if drift is None else drift.apply(state)
        if state.ids and self._modes.on("withdrawn_hotel", city.code):
            state = dataclasses.replace(state, ids=state.ids[1:])
        return state

    def _city_hotels(
        self, city: City, params: Mapping[str, str], at: int
    ) -> tuple[bytes, SimResponse]:
        page_size = _parse_int(params, "page_size", DEFAULT_PAGE_SIZE, 1, MAX_PAGE_SIZE)
        cursor = params.get("cursor")
        if cursor is not None and "page" in params:
            raise _HttpError(400, "INVALID_PARAMETER", "give page or cursor, not both")
        state = self._city_state(city, at)
        total = len(state.ids)
        if cursor is not None:
            after = self._read_cursor(cursor, city)
            start = state.position_after(after)
            page = start // page_size + 1
        else:
            page = _parse_int(params, "page", 1, 1, 10**9)
            start = (page - 1) * page_size
        endless = self._modes.on("endless_pages", city.code)
        if endless and start >= total:
            start = max(0, total - page_size)  # past the end: the last page again
        end = start + page_size
        first = start
        if 0 < start < total and self._chance(self.config.faults.duplicate_across_pages_rate):
            self._stats.fault(FAULT_DUPLICATE)
            first = start - 1
        nums = state.ids[first:end]
        fields: dict[str, Any] = {
            "city_code": city.code,
            "page": page,
            "page_size": page_size,
            "total": total,
            "total_pages": math.ceil(total / page_size),
            "next_cursor": self._next_cursor(city, state, start, end),
        }
        if endless:
            fields.update(total=None, total_pages=None, next_cursor=None)
        head = _json(fields)
        body = self._with_hotels(head, b"hotels", city, state, nums, at)
        return head, SimResponse(200, body=body)

    def _next_cursor(self, city: City, state: data.CityState, start: int, end: int) -> str | None:
        """The page's ``next_cursor``: the position after it, or what a looping mode gives."""
        ids, on = state.ids, self._modes.on
        if on("runaway_cursor", city.code):
            # A new token for the same page, for ever.
            return self._make_cursor(city, ids[start - 1] if start > 0 else -1, next(self._nonce))
        if on("cursor_cycle", city.code):
            after = ids[end - 1] if end < len(ids) else -1
            with self._rng_lock:
                token = self._cycle_cursors.get((city.code, after))
                if token is None:
                    token = self._cycle_cursors[(city.code, after)] = self._make_cursor(city, after)
            return token
        return self._make_cursor(city, ids[end - 1]) if end < len(ids) else None

    def _with_hotels(
        self,
        head: bytes,
        name: bytes,
        city: City | None,
        state: data.CityState | None,
        nums: list[int] | tuple[int, ...],
        at: int,
    ) -> bytes:
        world = self.world
        day = world.day_of(at)
        if city is not None and state is not None:
            found = [(city, state.hotels[num]) for num in nums]
        else:
            # Every hotel of the index exists: it is built from the same states.
            found = world.hotels_at(list(nums), at)
        parts = []
        bad = 0
        victims = self._victims(at)
        for listed, h in found:
            parts.append(self._render(listed, h, day, victims))
            bad += world.bad_reason(h, day) is not None
        self._stats.hotels(len(parts), bad)
        return head[:-1] + b',"' + name + b'":[' + b",".join(parts) + b"]}"

    def _render(self, listed: City, h: data.Hotel, day: int, victims: Mapping[int, str]) -> bytes:
        """The hotel's record as served, broken the way a mode breaks it."""
        body = self.world.render(listed, h, day)
        kind = victims.get(h.num)
        if kind == modes.INVALID_UTF8:
            return modes.with_bad_byte(body)
        if kind == modes.FUTURE_TIMESTAMP:
            return modes.future_dated(body)
        return body

    def _make_cursor(self, city: City, after: int, nonce: int | None = None) -> str:
        fields: dict[str, Any] = {"c": city.code, "a": after, "t": round(time.time(), 3)}
        if nonce is not None:
            fields["n"] = nonce
        payload = _json(fields)
        sig = hmac.new(self._cursor_key, payload, hashlib.sha256).digest()[:12]
        return base64.urlsafe_b64encode(payload + sig).decode().rstrip("=")

    def _read_cursor(self, cursor: str, city: City) -> int:
        try:
            raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
            payload, sig = raw[:-12], raw[-12:]
            expected = hmac.new(self._cursor_key, payload, hashlib.sha256).digest()[:12]
            if not hmac.compare_digest(sig, expected):
                raise ValueError("bad signature")
            obj = json.loads(payload)
            code, after, issued = obj["c"], int(obj["a"]), float(obj["t"])
        except (ValueError, KeyError, TypeError):
            raise _HttpError(400, "INVALID_CURSOR", "cursor is malformed") from None
        if code != city.code:
            raise _HttpError(400, "INVALID_CURSOR", "cursor belongs to another city")
        ttl = self.config.faults.cursor_ttl_seconds
        if ttl is not None and time.time() - issued > ttl:
            self._stats.fault(FAULT_CURSOR_TTL)
            raise _HttpError(410, "CURSOR_EXPIRED", "cursor expired: resume with page numbers")
        if self._chance(self.config.faults.rate_cursor_expired):
            self._stats.fault(FAULT_CURSOR_EXPIRED)
            raise _HttpError(410, "CURSOR_EXPIRED", "cursor expired: resume with page numbers")
        return after

    def _summary(self, city: City, at: int) -> SimResponse:
        s = self.world.summary_at(city, at)
        drift = self._drift.get(city.index)
        if drift is not None:
            was = self.world.state_at(city, at).hotels
            active_gone = sum(was[n].active for n in drift.removed if n in was)
            gone = sum(n in was for n in drift.removed)
            s = data.CitySummary(
                s.hotel_count - gone + len(drift.added),
                s.active_count - active_gone + len(drift.added),
                s.inactive_count - (gone - active_gone),
                max([h.updated_at for h in drift.added.values()] + [s.max_updated_at or 0]),
            )
        future = any(self._modes.on("future_timestamp", city.code) for _ in (0,)) and bool(
            self._city_state(city, at).ids
        )
        newest = modes.FUTURE_SECONDS if future else s.max_updated_at
        body = {
            "city_code": city.code,
            "hotel_count": s.hotel_count,
            "active_count": s.active_count,
            "inactive_count": s.inactive_count,
            "max_updated_at": None if newest is None else data.rfc3339(newest),
        }
        return SimResponse(200, body=_json(body))

    def _hotel(self, raw: bytes, at: int) -> SimResponse:
        try:
            num = data.parse_hotel_id(paths.decode_segment(raw))
        except paths.PathError:
            num = None
        found = None if num is None else self._find_hotel(num, at)
        if found is None:
            raise _HttpError(404, "HOTEL_NOT_FOUND", "unknown hotel")
        listed, h = found
        day = self.world.day_of(at)
        self._stats.hotels(1, self.world.bad_reason(h, day) is not None)
        return SimResponse(200, body=self._render(listed, h, day, self._victims(at)))

    def _find_hotel(self, num: int, at: int) -> tuple[City, data.Hotel] | None:
        if self._dropped(num) or self._withdrawn(num, at):
            return None
        drift = self._drift.get(num // data.HOTELS_PER_CITY_SPAN)
        if drift is not None and num in drift.removed:
            return None
        if drift is not None and num in drift.added:
            return self.world.cities[num // data.HOTELS_PER_CITY_SPAN], drift.added[num]
        return self.world.find_hotel_at(num, at)

    def _changes(self, params: Mapping[str, str], at: int) -> SimResponse:
        raw_since = params.get("since")
        if not raw_since:
            raise _HttpError(400, "INVALID_PARAMETER", "since is required")
        since = _parse_time(raw_since)
        limit = _parse_int(params, "limit", DEFAULT_CHANGES_LIMIT, 1, MAX_CHANGES_LIMIT)
        after_id = params.get("after_id") or None
        after_num = -1
        if after_id is not None:
            parsed = data.parse_hotel_id(after_id)
            if parsed is None:
                raise _HttpError(400, "INVALID_PARAMETER", "after_id is not a hotel id")
            after_num = parsed
        keys = self.world.change_index(at)
        since_s = math.ceil(since)
        if since_s != since:
            after_num = -1  # nothing has this exact fractional time: start after it
        start = _bisect_key(keys, since_s * data.CHANGE_KEY_SPAN + after_num)
        chosen = [k % data.CHANGE_KEY_SPAN for k in keys[start : start + limit]]
        nxt: dict[str, str] | None = None
        if start + limit < len(keys) and chosen:
            last_key = keys[start + len(chosen) - 1]
            nxt = {
                "since": data.rfc3339(last_key // data.CHANGE_KEY_SPAN),
                "after_id": data.hotel_id(chosen[-1]),
            }
        chosen = [n for n in chosen if not (self._dropped(n) or self._withdrawn(n, at))]
        if "future_timestamp" in self._modes.names:
            # A record dated 2099 sorts after every real change, whenever it changed.
            future = {n for n, kind in self._victims(at).items() if kind == modes.FUTURE_TIMESTAMP}
            chosen = [n for n in chosen if n not in future]
            from_key = since_s * data.CHANGE_KEY_SPAN + after_num
            if nxt is None:
                late = sorted(
                    n for n in future if modes.FUTURE_SECONDS * data.CHANGE_KEY_SPAN + n > from_key
                )
                chosen += late[: max(0, limit - len(chosen))]
        head = _json({"next": nxt})
        resp = SimResponse(200, body=self._with_hotels(head, b"changes", None, None, chosen, at))
        return self._body_modes(resp, head, None)

    def _confirm(self, body: bytes, at: int) -> SimResponse:
        try:
            req = json.loads(body)
            if not isinstance(req, dict):
                raise ValueError("not an object")
        except ValueError:
            raise _HttpError(400, "INVALID_BODY", "body must be a JSON object") from None
        for name in ("hotel_id", "room_code", "rate_plan_code", "check_in", "check_out"):
            if not isinstance(req.get(name), str):
                raise _HttpError(400, "INVALID_PARAMETER", f"{name} must be a string")
        guests = req.get("guests")
        if not isinstance(guests, int) or isinstance(guests, bool) or not 1 <= guests <= 10:
            raise _HttpError(400, "INVALID_PARAMETER", "guests must be an integer 1..10")
        try:
            check_in = dt.date.fromisoformat(req["check_in"])
            check_out = dt.date.fromisoformat(req["check_out"])
        except ValueError:
            raise _HttpError(400, "INVALID_PARAMETER", "dates must be YYYY-MM-DD") from None
        nights = (check_out - check_in).days
        if not 1 <= nights <= MAX_NIGHTS:
            raise _HttpError(400, "INVALID_PARAMETER", f"stay must be 1..{MAX_NIGHTS} nights")
        num = data.parse_hotel_id(req["hotel_id"])
        found = None if num is None else self.world.find_hotel_at(num, at)
        if found is None:
            raise _HttpError(404, "HOTEL_NOT_FOUND", "unknown hotel")
        listed, h = found
        record = self.world.valid_record(listed, h)
        room = next((r for r in record["rooms"] if r["room_code"] == req["room_code"]), None)
        if room is None:
            raise _HttpError(404, "ROOM_NOT_FOUND", "unknown room_code for this hotel")
        plan = next((p for p in room["rate_plans"] if p["code"] == req["rate_plan_code"]), None)
        if plan is None:
            raise _HttpError(404, "RATE_PLAN_NOT_FOUND", "unknown rate_plan_code for this room")
        currency = plan["price"]["currency"]
        with self._rng_lock:
            # Real-time prices drift from the cached list price now and then.
            u = self._rng.random()
            drift = 1.0 if u < 0.75 else self._rng.uniform(0.97, 1.05)
        decimals = locales.minor_units(currency)
        amount = round(float(plan["price"]["amount"]) * nights * drift, decimals)
        available = bool(plan["available"]) and h.active and guests <= room["max_occupancy"]
        quoted = dt.datetime.now(dt.UTC).replace(microsecond=0)
        resp = {
            "available": available,
            "price": {"amount": f"{amount:.{decimals}f}", "currency": currency},
            "quoted_at": quoted.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "valid_for_seconds": OFFER_VALID_SECONDS,
        }
        return SimResponse(200, [("cache-control", "no-store")], _json(resp))

    # -- admin ----------------------------------------------------------------------------

    def _admin(self, method: str, segs: list[bytes], query: bytes) -> SimResponse:
        json_type = [("content-type", "application/json")]
        if segs == [b"stats"] and method == "GET":
            body = _json(self.stats)
        elif segs == [b"modes"] and method == "GET":
            body = _json({"modes": sorted(self._modes.names), "cities": sorted(self._modes.cities)})
        elif segs == [b"modes"] and method == "POST":
            params = dict(parse_qsl(query.decode("utf-8", "replace"), keep_blank_values=True))
            names = [n for n in params.get("names", "").split(",") if n]
            cities = [c for c in params.get("cities", "").split(",") if c]
            try:
                self.set_modes(names, cities)
            except ValueError as err:
                return SimResponse(400, json_type, error_body("INVALID_PARAMETER", str(err)))
            body = _json({"modes": sorted(names), "cities": sorted(cities)})
        elif segs == [b"advance_day"] and method == "POST":
            body = _json({"day": self.advance_day()})
        elif segs == [b"advance"] and method == "POST":
            params = dict(parse_qsl(query.decode("latin-1"), keep_blank_values=True))
            try:
                if "seconds" not in params:
                    raise _HttpError(400, "INVALID_PARAMETER", "seconds is required")
                seconds = _parse_int(params, "seconds", 0, 0, MAX_ADVANCE_SECONDS)
            except _HttpError as err:
                return SimResponse(err.status, json_type, error_body(err.code, err.message))
            clock = self._advance(seconds)
            body = _json(
                {
                    "day": clock // DAY_SECONDS,
                    "now": data.rfc3339(self.config.epoch_seconds + clock),
                }
            )
        else:
            return SimResponse(404, json_type, error_body("NOT_FOUND", "no such path"))
        return SimResponse(200, json_type, body)


def _bisect_key(keys: list[int], key: int) -> int:
    """Index of the first key greater than ``key``."""
    return bisect.bisect_right(keys, key)
