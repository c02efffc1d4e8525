"""The read API: hotels from the search projection and the cache, offers confirmed live.

``supplier-sync serve-api`` serves :func:`create_app` (Starlette, under uvicorn):

- ``GET /hotels?q=&city=&country=&stars=&max_price=&limit=``: the search read model.
- ``GET /hotels/{id}``: a hotel with its offers, cache-aside: the cache first (Redis, or
  in-process), else the catalog, cached with a TTL; the outbox's CACHE stage invalidates the
  key when the hotel is published again. ``X-Cache: HIT|MISS`` says which.
- ``POST /offers/confirm``: the supplier's real-time price and availability
  (``POST /v1/offers/confirm``), never cached, with a tight timeout, one retry and the
  client's circuit breaker. It says whether the quote differs from the catalog (per night,
  beyond half a percent, or in availability or currency); a difference enqueues the hotel
  for a refresh: a ``HotelRefreshRequested`` outbox event of its published version, which
  subscribers receive (one per version, however many quotes differ).
- ``GET /health`` and ``GET /openapi.json`` (the OpenAPI description, every limit in it):
  the only routes open without a key.

Every other route needs one of the deployment's API keys (``SUPPLIER_SYNC_API_KEYS``), sent as
``Authorization: Bearer <key>`` or ``X-Api-Key: <key>`` and compared in constant time with
each key (:class:`ApiKeyAuth`). A confirmation takes ``application/json`` only (a browser's
form post cannot trigger it), of at most :data:`MAX_BODY_BYTES` bytes, counted as the body is
read, nested at most :data:`MAX_JSON_DEPTH` levels. Hotels show the platform's fields only
(:data:`PUBLIC_HOTEL_FIELDS`): nothing of the supplier's.

Errors are JSON ``{"error": {"code": ..., "message": ...}}`` with a fitting status; nothing
unexpected leaks a stack trace (500 ``INTERNAL``), a path or a driver's message, and a
supplier's error text stays in the server's log: the caller gets the API's own code.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from supplier_sync_dagster.core.errors import (
    CircuitOpen,
    ConfigError,
    HistoryNotKept,
    InvalidTimestamp,
    NotPublishedThen,
    ProjectionUnavailable,
    RateShareExhausted,
    SupplierError,
    SupplierNotFound,
    SupplierTimeout,
)
from supplier_sync_dagster.core.inputs.operator_input import json_depth
from supplier_sync_dagster.core.inputs.timestamps import parse_as_of
from supplier_sync_dagster.core.outbox.machine import first_stage
from supplier_sync_dagster.core.outbox.projections import (
    HOTEL_KEY,
    HotelCache,
    SearchHit,
    SearchIndex,
    SearchQuery,
    load_search_docs,
)
from supplier_sync_dagster.core.records.history import HotelKey, published_offers, version_as_of
from supplier_sync_dagster.core.records.publish import event_id, write_events
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.supplier import RetryPolicy, SupplierClient

log = logging.getLogger(__name__)

DEFAULT_TTL_SECONDS = 300.0
PRICE_TOLERANCE = Decimal("0.005")  # half a percent, per night
REFRESH_EVENT = "HotelRefreshRequested"
# A customer is waiting: one retry, short waits.
CONFIRM_RETRY = RetryPolicy(
    max_attempts=2, base_delay=0.1, max_delay=0.5, max_total_wait=1.0, max_retry_after=1.0
)
# The confirmations' own share of a supplier account's request rate, unless set
# (``SUPPLIER_SYNC_CONFIRM_RATE_LIMIT``), and the longest one waits for its token: a flood is
# answered 429 at once instead of queueing worker threads.
CONFIRM_SHARE = 0.1
CONFIRM_MAX_WAIT_SECONDS = 0.5

# The routes open without a key: a load balancer's probe, and the API's description.
PUBLIC_PATHS = frozenset({"/health", "/openapi.json"})
# A confirmation's body is a handful of fields: bytes and nesting far past that are refused.
MAX_BODY_BYTES = 16 * 1024
MAX_JSON_DEPTH = 8
# Every id is a signed 64-bit column.
MAX_ID = 2**63 - 1
MAX_STAY_NIGHTS = 30
MAX_DAYS_AHEAD = 730
MAX_GUESTS = 10
MAX_PRICE = Decimal(10**9)
MAX_CODE_LENGTH = 64
# What a hotel shows the world: the platform's fields, never the supplier's (its id, its
# hotel id), whatever the catalog's document grows: a search hit's fields (what a list shows)
# and the detail's own.
PUBLIC_HOTEL_FIELDS: tuple[str, ...] = (
    *(f.name for f in fields(SearchHit)),
    "address",
    "postal_code",
    "lat",
    "lng",
    "published_at",
)
# A cached document written before the public fields were enforced (a rolling upgrade).
_PRIVATE_MARK = b'"supplier_id":'
_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_ID = re.compile(r"[0-9]{1,19}")
# A JSON string (escapes included), or a bracket outside strings.


class ApiError(HTTPException):
    """An error answered as ``{"error": {"code", "message"}}``."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.code = code


def _error(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message}}, status_code=status, headers=headers
    )


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not re.fullmatch(r"[+-]?[0-9]{1,19}", raw):
        raise ApiError(400, "INVALID_PARAMETER", f"{name} must be an integer {low}..{high}")
    value = int(raw)
    if not low <= value <= high:
        raise ApiError(400, "INVALID_PARAMETER", f"{name} must be {low}..{high}")
    return value


def _number(request: Request, name: str, high: Decimal) -> Decimal | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = Decimal(raw) if len(raw) <= 32 else Decimal("NaN")
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite() or not 0 <= value <= high:
        raise ApiError(400, "INVALID_PARAMETER", f"{name} must be a number 0..{high}")
    return value


def _unprintable(ch: str) -> bool:
    """A control character, a surrogate, a Unicode noncharacter, or U+FFFD (what a
    percent-encoded byte that is not UTF-8 became): never in a search."""
    o = ord(ch)
    return (
        o == 0xFFFD
        or o < 0x20
        or 0x7F <= o < 0xA0
        or 0xD800 <= o < 0xE000
        or 0xFDD0 <= o <= 0xFDEF
        or (o & 0xFFFE == 0xFFFE)
    )


def _text(request: Request, name: str, limit: int) -> str | None:
    raw = request.query_params.get(name)
    if raw is not None and len(raw) > limit:
        raise ApiError(400, "INVALID_PARAMETER", f"{name} is longer than {limit} characters")
    if raw is not None and any(_unprintable(ch) for ch in raw):
        raise ApiError(
            400,
            "INVALID_PARAMETER",
            f"{name} holds a control character, a surrogate, a Unicode noncharacter or a "
            "byte that is not UTF-8",
        )
    return raw or None


def _money(value: Decimal | None) -> str | None:
    return None if value is None else str(value)


def _public(fields: dict[str, Any]) -> dict[str, Any]:
    return {name: fields[name] for name in PUBLIC_HOTEL_FIELDS if name in fields}


def create_app(
    *,
    db: SyncDatabase,
    search: SearchIndex,
    cache: HotelCache,
    api_keys: Sequence[str] | None,
    supplier: Callable[[int], SupplierClient | None] | None = None,
    ttl_seconds: float = DEFAULT_TTL_SECONDS,
) -> Starlette:
    """The read API over these stores.

    Args:
        db: The sync database (the catalog, and the outbox for refresh requests).
        search: The search read model.
        cache: The hotel cache (shared with the outbox's CACHE stage).
        api_keys: The keys a request may carry (every route but :data:`PUBLIC_PATHS` needs
            one); None, said on purpose, serves without authentication (``--no-auth``).
        supplier: Supplier id -> the client that confirms that supplier's offers (None, or
            None for that supplier: 503).
        ttl_seconds: How long a hotel stays cached.

    Raises:
        ConfigError: ``api_keys`` is empty (None is the way to serve without keys).
    """
    if api_keys is not None and not api_keys:
        raise ConfigError("no API key to authenticate the read API's requests with")
    api = ReadApi(db=db, search=search, cache=cache, supplier=supplier, ttl_seconds=ttl_seconds)
    spec = OPENAPI if api_keys is not None else {**OPENAPI, "security": []}
    return Starlette(
        routes=[
            Route("/health", _health, methods=["GET"]),
            Route("/hotels", api.hotels, methods=["GET"]),
            Route("/hotels/{resource_id}", api.hotel, methods=["GET"]),
            Route("/offers/confirm", api.confirm, methods=["POST"]),
            Route("/openapi.json", lambda _: JSONResponse(spec), methods=["GET"]),
        ],
        middleware=[] if api_keys is None else [Middleware(ApiKeyAuth, keys=api_keys)],
        exception_handlers={HTTPException: _on_api_error, Exception: _on_error},
    )


class ApiKeyAuth:
    """Lets a request through when it carries one of the keys, as ``Authorization: Bearer
    <key>`` or ``X-Api-Key: <key>``; else answers 401 with ``WWW-Authenticate`` (the routes
    of :data:`PUBLIC_PATHS` need none).

    The SHA-256 of what the request sent is compared with every key's, each with
    :func:`hmac.compare_digest`: the time taken says nothing of a key, its length or which
    key came close.
    """

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        """Wrap ``app`` (Starlette does when the first request comes: :func:`create_app`
        checks that there are keys beforehand)."""
        self.app = app
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point."""
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given = _credentials(scope["headers"])
        if any([self._known(k) for k in given]):
            await self.app(scope, receive, send)
            return
        log.info(
            "read API: refused %s %r: %s",
            scope["method"],
            scope["path"][:200],
            "an unknown API key" if given else "no API key",
        )
        challenge = 'Bearer realm="supplier-sync"' + (', error="invalid_token"' if given else "")
        response = _error(
            401,
            "UNAUTHORIZED",
            "this API key is not valid"
            if given
            else "an API key is required: Authorization: Bearer <key>, or X-Api-Key: <key>",
            {"WWW-Authenticate": challenge, "Cache-Control": "no-store"},
        )
        await response(scope, receive, send)

    def _known(self, given: bytes) -> bool:
        digest = hashlib.sha256(given).digest()
        found = False
        for known in self._digests:  # every key, whichever matched: constant time
            found |= hmac.compare_digest(digest, known)
        return found


def _credentials(headers: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
    """The keys a request carries: its first Bearer token and its first X-Api-Key."""
    bearer = key = None
    for name, value in headers:
        if name == b"authorization" and bearer is None:
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                bearer = token.strip()
        elif name == b"x-api-key" and key is None and value.strip():
            key = value.strip()
    return [k for k in (bearer, key) if k is not None]


async def _health(_: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"}, headers={"Cache-Control": "no-store"})


@dataclass(frozen=True)
class ReadApi:
    """The read API's routes over its stores (see :func:`create_app` for each field)."""

    db: SyncDatabase
    search: SearchIndex
    cache: HotelCache
    supplier: Callable[[int], SupplierClient | None] | None
    ttl_seconds: float

    def hotels(self, request: Request) -> JSONResponse:
        """``GET /hotels``: the search read model."""
        stars = _number(request, "stars", Decimal(5))
        query = SearchQuery(
            text=_text(request, "q", 256) or "",
            city_code=_text(request, "city", MAX_CODE_LENGTH),
            country_code=_text(request, "country", 2),
            min_stars=None if stars is None else float(stars),
            max_price=_number(request, "max_price", MAX_PRICE),
            limit=_int(request, "limit", 20, 1, 100),
        )
        if not (query.text or query.city_code or query.country_code):
            raise ApiError(400, "INVALID_PARAMETER", "give q, city or country")
        hits = self.search.search(query)
        return JSONResponse(
            {
                "count": len(hits),
                "hotels": [
                    _public({**vars(h), "lowest_price": _money(h.lowest_price)}) for h in hits
                ],
            }
        )

    async def hotel(self, request: Request) -> Response:
        """``GET /hotels/{id}``: the cache first, else the catalog, cached."""
        # A hit is answered on the event loop (one cache read, no worker thread: the hot
        # path of a read API); a miss reads the catalog in a worker thread.
        raw = str(request.path_params["resource_id"])
        resource_id = int(raw) if _ID.fullmatch(raw) else 0
        if not 1 <= resource_id <= MAX_ID:
            raise ApiError(400, "INVALID_PARAMETER", f"a hotel id is an integer 1..{MAX_ID}")
        if "as_of" in request.query_params:
            at = _as_of(request)
            then = await run_in_threadpool(_hotel_as_of_json, self.db, resource_id, at)
            return Response(
                then, media_type="application/json", headers={"Cache-Control": "no-store"}
            )
        key = HOTEL_KEY.format(resource_id=resource_id)
        try:
            cached = self.cache.get(key)
        except ProjectionUnavailable as err:  # the cache is an optimisation, not a source
            log.warning("hotel cache unavailable, reading the catalog: %s", err)
            cached = None
        if cached is not None and _PRIVATE_MARK not in cached:
            return Response(cached, media_type="application/json", headers={"X-Cache": "HIT"})
        body = await run_in_threadpool(_hotel_json, self.db, resource_id)
        if body is None:
            raise ApiError(404, "HOTEL_NOT_FOUND", f"no hotel {resource_id}")
        try:
            self.cache.set(key, body, self.ttl_seconds)
        except ProjectionUnavailable as err:
            log.warning("hotel cache unavailable, not cached: %s", err)
        return Response(body, media_type="application/json", headers={"X-Cache": "MISS"})

    async def confirm(self, request: Request) -> JSONResponse:
        """``POST /offers/confirm``: the supplier's live quote against the catalog."""
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise ApiError(415, "UNSUPPORTED_MEDIA_TYPE", "the body must be application/json")
        body = _json_body(await _read_body(request, MAX_BODY_BYTES))
        return await run_in_threadpool(self.confirm_body, body)

    def confirm_body(self, body: Any) -> JSONResponse:
        """The answer to a confirmation request's body (in a worker thread: it waits for the
        supplier)."""
        req = _confirm_request(body)
        if self.supplier is None:
            raise ApiError(503, "SUPPLIER_UNAVAILABLE", "no supplier is configured")
        _check_dates(self.db, req["check_in"])
        offer = _catalog_offer(self.db, req["hotel_id"], req["room_code"], req["rate_plan_code"])
        if offer is None:
            raise ApiError(404, "OFFER_NOT_FOUND", "no such hotel, room and rate plan")
        client = self.supplier(int(offer["supplier_id"]))
        if client is None:
            log.warning("read API: no account of supplier %s confirms offers", offer["supplier_id"])
            raise ApiError(
                503, "SUPPLIER_UNAVAILABLE", "offers of this hotel cannot be confirmed now"
            )
        try:
            quote = client.confirm_offer(
                hotel_id=offer["supplier_hotel_id"],
                room_code=req["room_code"],
                rate_plan_code=req["rate_plan_code"],
                check_in=req["check_in"],
                check_out=req["check_out"],
                guests=req["guests"],
                retry=CONFIRM_RETRY,
            ).data
        except SupplierError as err:
            raise _supplier_failure(err, req["hotel_id"]) from None
        nights = (req["check_out"] - req["check_in"]).days
        live = quote.price
        per_night = None if live is None else (Decimal(live.amount) / nights)
        catalog_price = Decimal(offer["price_amount"])
        differs = (
            quote.available != bool(offer["available"] and offer["active"])
            or live is None
            or live.currency != offer["currency"]
            or (
                per_night is not None
                and abs(per_night - catalog_price) > catalog_price * PRICE_TOLERANCE
            )
        )
        enqueued = _enqueue_refresh(self.db, offer) if differs else False
        return JSONResponse(
            {
                "hotel_id": req["hotel_id"],
                "available": quote.available,
                "price": None
                if live is None
                else {"amount": str(live.amount), "currency": live.currency},
                "quoted_at": quote.quoted_at.isoformat(),
                "valid_for_seconds": quote.valid_for_seconds,
                "catalog": {
                    "price_per_night": str(catalog_price),
                    "currency": offer["currency"],
                    "available": bool(offer["available"] and offer["active"]),
                    "publish_version": int(offer["publish_version"]),
                },
                "differs_from_catalog": differs,
                "refresh_enqueued": enqueued,
            },
            headers={"Cache-Control": "no-store"},
        )


# A supplier's failure as the API answers it: (class, status, code, message), the first class
# that matches. Its own text (which may hold the supplier's words) goes to the log only.
_SUPPLIER_FAILURES: tuple[tuple[type[SupplierError], int, str, str], ...] = (
    (
        RateShareExhausted,
        429,
        "RATE_LIMITED",
        "too many confirmations just now; retry after Retry-After seconds",
    ),
    (
        SupplierNotFound,
        404,
        "OFFER_UNAVAILABLE",
        "the supplier does not offer this room and rate plan now",
    ),
    (
        CircuitOpen,
        503,
        "CONFIRMATION_UNAVAILABLE",
        "confirmations are paused after repeated supplier failures; retry later",
    ),
    (SupplierTimeout, 504, "CONFIRMATION_TIMEOUT", "the supplier did not answer in time"),
    (SupplierError, 502, "CONFIRMATION_FAILED", "the supplier could not confirm this offer"),
)


def _supplier_failure(err: SupplierError, hotel_id: int) -> ApiError:
    status, code, message = next(
        (s, c, m) for kind, s, c, m in _SUPPLIER_FAILURES if isinstance(err, kind)
    )
    log.warning(
        "read API: confirming an offer of hotel %d failed: %s: %s", hotel_id, err.error_code, err
    )
    # Our own waits only: a supplier's Retry-After is its business with us.
    wait = (
        err.retry_after
        if isinstance(err, RateShareExhausted)
        else err.retry_in
        if isinstance(err, CircuitOpen)
        else None
    )
    headers = {"Retry-After": str(max(1, math.ceil(wait)))} if wait else None
    return ApiError(status, code, message, headers)


async def _on_api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = (
        exc.code
        if isinstance(exc, ApiError)
        else ("NOT_FOUND" if exc.status_code == 404 else "HTTP_ERROR")
    )
    return _error(exc.status_code, code, str(exc.detail), exc.headers)


async def _on_error(_: Request, exc: Exception) -> Response:
    if isinstance(exc, ProjectionUnavailable):
        # Its message names files, hosts and the driver's words: for the log only.
        log.warning("read API: a read model is unavailable: %s", exc)
        return _error(503, "READ_MODEL_UNAVAILABLE", "the search index is unavailable; retry later")
    log.exception("unexpected error in the read API")
    return _error(500, "INTERNAL", "an unexpected error; it has been logged")


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes: by its Content-Length before
    anything is read, else as soon as the chunks read pass it (never buffered whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and not declared.strip().isdigit():
        raise ApiError(400, "INVALID_BODY", "Content-Length is not a number")
    # The connection closes after the answer: the rest of the body is never read.
    too_large = ApiError(
        413,
        "BODY_TOO_LARGE",
        f"the body is larger than {limit} bytes",
        {"Connection": "close"},
    )
    if declared is not None and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def _json_body(raw: bytes) -> Any:
    """The body's JSON value, its nesting checked before it is decoded."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "INVALID_BODY", "the body must be JSON") from None
    if json_depth(text, stop_past=MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ApiError(400, "INVALID_BODY", f"the JSON nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except ValueError:
        raise ApiError(400, "INVALID_BODY", "the body must be JSON") from None


def _positive_int(body: dict[str, Any], name: str, high: int, what: str) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
        raise ApiError(400, "INVALID_PARAMETER", f"{name} must be {what}, 1..{high}")
    return value


def _confirm_request(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "INVALID_BODY", "the body must be a JSON object")
    out: dict[str, Any] = {"hotel_id": _positive_int(body, "hotel_id", MAX_ID, "a hotel id")}
    for name in ("room_code", "rate_plan_code"):
        value = body.get(name)
        if not isinstance(value, str) or not 0 < len(value) <= MAX_CODE_LENGTH:
            raise ApiError(400, "INVALID_PARAMETER", f"{name} must be a code")
        out[name] = value
    for name in ("check_in", "check_out"):
        value = body.get(name)
        try:
            if not isinstance(value, str) or not _DATE.fullmatch(value):
                raise ValueError(value)
            out[name] = date.fromisoformat(value)
        except ValueError:
            raise ApiError(400, "INVALID_PARAMETER", f"{name} must be a date YYYY-MM-DD") from None
    if not 1 <= (out["check_out"] - out["check_in"]).days <= MAX_STAY_NIGHTS:
        raise ApiError(
            400,
            "INVALID_PARAMETER",
            f"check_out must be 1 to {MAX_STAY_NIGHTS} nights after check_in",
        )
    body.setdefault("guests", 1)
    out["guests"] = _positive_int(body, "guests", MAX_GUESTS, "a number of guests")
    return out


def _check_dates(db: SyncDatabase, check_in: date) -> None:
    """Refuses a check-in in the past or too far ahead, by the database's clock.

    The earliest is yesterday in UTC: west of Greenwich it is still that day for up to
    twelve hours after UTC midnight.
    """
    with db.engine.connect() as conn:
        today = db.clock.read_utc(conn).date()
    earliest, latest = today - timedelta(days=1), today + timedelta(days=MAX_DAYS_AHEAD)
    if check_in < earliest:
        raise ApiError(
            400, "INVALID_PARAMETER", f"check_in is in the past (the earliest is {earliest})"
        )
    if check_in > latest:
        raise ApiError(
            400, "INVALID_PARAMETER", f"check_in is more than {MAX_DAYS_AHEAD} days ahead"
        )


def _hotel_json(db: SyncDatabase, resource_id: int) -> bytes | None:
    o = schema.platform_offer.c
    with db.engine.connect() as conn:
        doc = load_search_docs(conn, [resource_id]).get(resource_id)
        if doc is None:
            return None
        offers = conn.execute(
            sa.select(
                o.room_code,
                o.rate_plan_code,
                o.room_name,
                o.board,
                o.refundable,
                o.available,
                o.price_amount,
                o.currency,
            )
            .where(o.resource_id == resource_id, o.active.is_(True))
            .order_by(o.room_code, o.rate_plan_code)
        ).all()
    out = _public(doc.to_json())
    out["offers"] = [
        {
            "room_code": r.room_code,
            "rate_plan_code": r.rate_plan_code,
            "room_name": r.room_name,
            "board": r.board,
            "refundable": r.refundable,
            "available": bool(r.available),
            "price": str(Decimal(r.price_amount).quantize(Decimal("0.01"))),
            "currency": r.currency,
        }
        for r in offers
    ]
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()


def _as_of(request: Request) -> datetime:
    """The ``as_of`` parameter: ISO 8601 with a zone, as naive UTC (400 otherwise)."""
    raw = request.query_params.get("as_of", "")
    try:
        return parse_as_of(raw)
    except InvalidTimestamp:
        # The caller's text is not echoed: it may be anything.
        raise ApiError(
            400,
            "INVALID_PARAMETER",
            "as_of must be an ISO 8601 time with a zone, e.g. 2026-05-01T14:00:00Z",
        ) from None


def _hotel_as_of_json(db: SyncDatabase, resource_id: int, at: datetime) -> bytes:
    """The hotel as published at ``at``: its public fields and the offers sold then."""
    with db.engine.connect() as conn:
        now = db.clock.read(conn)
        if at > now:
            raise ApiError(400, "INVALID_PARAMETER", "as_of is in the future")
        try:
            found = version_as_of(conn, HotelKey(resource_id=resource_id), at)
        except NotPublishedThen:
            raise ApiError(404, "HOTEL_NOT_FOUND", f"no hotel {resource_id} then") from None
        except HistoryNotKept as err:
            raise ApiError(410, "HISTORY_NOT_KEPT", str(err)) from None
    doc, version = found.document, found.version
    offers = published_offers(doc)
    sold = [(Decimal(o["price"]), o["currency"]) for o in offers if o["available"]]
    lowest = min(sold) if sold else None
    star = doc.get("star_rating")
    out = _public(
        {
            "resource_id": resource_id,
            "publish_version": int(version["publish_version"]),
            "name": doc.get("name"),
            "name_local": doc.get("name_local"),
            "city_code": doc.get("city_code"),
            "country_code": doc.get("country_code"),
            "star_rating": None if star is None else float(star),
            "status": str(version["status"]),
            "lowest_price": None if lowest is None else str(lowest[0].quantize(Decimal("0.01"))),
            "currency": None if lowest is None else lowest[1],
            "address": doc.get("address_line1"),
            "postal_code": doc.get("postal_code"),
            "lat": doc.get("lat"),
            "lng": doc.get("lng"),
            "published_at": version["published_at"].isoformat(),
        }
    )
    out["as_of"] = at.isoformat() + "Z"
    out["offers"] = [
        {
            "room_code": o["room_code"],
            "rate_plan_code": o["rate_plan_code"],
            "room_name": o["room_name"],
            "board": o["board"],
            "refundable": o["refundable"],
            "available": o["available"],
            "price": str(Decimal(o["price"]).quantize(Decimal("0.01"))),
            "currency": o["currency"],
        }
        for o in offers
    ]
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()


def _catalog_offer(
    db: SyncDatabase, resource_id: int, room_code: str, rate_plan_code: str
) -> dict[str, Any] | None:
    h, o = schema.platform_hotel.c, schema.platform_offer.c
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.select(
                h.supplier_id,
                h.supplier_hotel_id,
                h.publish_version,
                o.price_amount,
                o.currency,
                o.available,
                o.active,
            )
            .select_from(
                schema.platform_hotel.join(schema.platform_offer, o.resource_id == h.resource_id)
            )
            .where(
                h.resource_id == resource_id,
                o.room_code == room_code,
                o.rate_plan_code == rate_plan_code,
            )
        ).first()
    if row is None:
        return None
    return {**row._mapping, "resource_id": resource_id}


def _enqueue_refresh(db: SyncDatabase, offer: dict[str, Any]) -> bool:
    """One ``HotelRefreshRequested`` per published version of the hotel (a second quote that
    differs for the same version adds nothing). Returns whether this call enqueued it."""
    rid, version = int(offer["resource_id"]), int(offer["publish_version"])
    payload = json.dumps(
        {
            "event_type": REFRESH_EVENT,
            "resource_id": rid,
            "publish_version": version,
            "supplier_id": int(offer["supplier_id"]),
            "supplier_hotel_id": offer["supplier_hotel_id"],
            "reason": "a live quote differs from the catalog",
        },
        sort_keys=True,
    )
    o = schema.outbox.c
    with db.begin() as conn:
        before = conn.execute(
            sa.select(sa.func.count())
            .select_from(schema.outbox)
            .where(
                o.aggregate_type == "HOTEL",
                o.aggregate_id == rid,
                o.aggregate_version == version,
                o.event_type == REFRESH_EVENT,
            )
        ).scalar_one()
        if before:
            return False
        write_events(
            conn,
            [
                (
                    event_id(REFRESH_EVENT, rid, version),
                    REFRESH_EVENT,
                    "HOTEL",
                    rid,
                    version,
                    payload,
                    first_stage(REFRESH_EVENT),
                )
            ],
            batch_id="offer-confirm",
            at=db.clock.now(),
        )
    return True


_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
            "required": ["code", "message"],
        }
    },
}


def _responses(*codes: tuple[int, str]) -> dict[str, Any]:
    """OpenAPI responses of these error statuses, each an ``Error`` body."""
    out: dict[str, Any] = {}
    for code, what in codes:
        out[str(code)] = {
            "description": what,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
    if "401" in out:
        out["401"]["headers"] = {
            "WWW-Authenticate": {
                "description": 'Bearer realm="supplier-sync" (error="invalid_token": a wrong key)',
                "schema": {"type": "string"},
            }
        }
    return out


_COMMON_ERRORS = (
    (400, "bad parameters (INVALID_PARAMETER)"),
    (401, "no API key, or not a valid one (UNAUTHORIZED)"),
    (500, "unexpected error (INTERNAL: logged, no details)"),
)
_ID_SCHEMA = {"type": "integer", "minimum": 1, "maximum": MAX_ID}
_CODE_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_CODE_LENGTH}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "supplier-sync read API",
        "version": "1",
        "description": "Hotels from the search projection and the cache; offers confirmed "
        "with the supplier in real time. Every route but /health and /openapi.json needs "
        "one of the deployment's API keys (SUPPLIER_SYNC_API_KEYS), sent as "
        "'Authorization: Bearer <key>' or 'X-Api-Key: <key>'; without a valid one: 401. "
        f"POST bodies: application/json only (415), at most {MAX_BODY_BYTES} bytes (413, "
        f"by Content-Length or while reading), nested at most {MAX_JSON_DEPTH} levels (400). "
        f"Ids are integers 1..{MAX_ID}. Offer confirmations have their own share of the "
        "supplier's request rate (SUPPLIER_SYNC_CONFIRM_RATE_LIMIT; unset: "
        f"{CONFIRM_SHARE:.0%} of the account's), past which they are answered 429 with "
        'Retry-After. Errors are {"error": {"code", "message"}}; a supplier\'s own '
        "error text is never forwarded.",
    },
    "security": [{"bearer": []}, {"apiKey": []}],
    "paths": {
        "/health": {
            "get": {
                "summary": "Liveness (no key needed)",
                "security": [],
                "responses": {"200": {"description": '{"status": "ok"}'}},
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This description (no key needed)",
                "security": [],
                "responses": {"200": {"description": "the OpenAPI description"}},
            }
        },
        "/hotels": {
            "get": {
                "summary": "Search hotels",
                "parameters": [
                    {"name": n, "in": "query", "schema": s, "description": d}
                    for n, s, d in (
                        (
                            "q",
                            {"type": "string", "maxLength": 256},
                            "words; all must match (a control character, surrogate, Unicode "
                            "noncharacter or invalid UTF-8: 400)",
                        ),
                        (
                            "city",
                            {"type": "string", "maxLength": MAX_CODE_LENGTH},
                            "city code",
                        ),
                        ("country", {"type": "string", "maxLength": 2}, "ISO country code"),
                        (
                            "stars",
                            {"type": "number", "minimum": 0, "maximum": 5},
                            "at least this many stars",
                        ),
                        (
                            "max_price",
                            {"type": "number", "minimum": 0, "maximum": int(MAX_PRICE)},
                            "lowest price at most",
                        ),
                        (
                            "limit",
                            {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
                            "results",
                        ),
                    )
                ],
                "responses": {
                    "200": {"description": "hotels, best first (the platform's fields only)"},
                    **_responses(
                        *_COMMON_ERRORS,
                        (503, "the search index is unavailable (READ_MODEL_UNAVAILABLE)"),
                    ),
                },
            }
        },
        "/hotels/{resource_id}": {
            "get": {
                "summary": "A hotel with its offers (cached; X-Cache: HIT or MISS), the "
                "platform's fields only",
                "parameters": [
                    {"name": "resource_id", "in": "path", "required": True, "schema": _ID_SCHEMA},
                    {
                        "name": "as_of",
                        "in": "query",
                        "schema": {"type": "string", "format": "date-time"},
                        "description": "the hotel and its offers exactly as published at this "
                        "time (ISO 8601 with a zone; not cached; a time in the future: 400)",
                    },
                ],
                "responses": {
                    "200": {"description": "the hotel"},
                    **_responses(
                        *_COMMON_ERRORS,
                        (404, "no such hotel (then, with as_of) (HOTEL_NOT_FOUND)"),
                        (
                            410,
                            "as_of is before the publish history kept for the hotel "
                            "(HISTORY_NOT_KEPT)",
                        ),
                    ),
                },
            }
        },
        "/offers/confirm": {
            "post": {
                "summary": "Confirm an offer's price and availability with the supplier now",
                "requestBody": {
                    "required": True,
                    "description": f"application/json only; at most {MAX_BODY_BYTES} bytes; "
                    f"nested at most {MAX_JSON_DEPTH} levels",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": [
                                    "hotel_id",
                                    "room_code",
                                    "rate_plan_code",
                                    "check_in",
                                    "check_out",
                                ],
                                "properties": {
                                    "hotel_id": _ID_SCHEMA,
                                    "room_code": _CODE_SCHEMA,
                                    "rate_plan_code": _CODE_SCHEMA,
                                    "check_in": {
                                        "type": "string",
                                        "format": "date",
                                        "description": "not before yesterday (UTC) by the "
                                        "database's clock, at most "
                                        f"{MAX_DAYS_AHEAD} days ahead",
                                    },
                                    "check_out": {
                                        "type": "string",
                                        "format": "date",
                                        "description": f"1 to {MAX_STAY_NIGHTS} nights after "
                                        "check_in",
                                    },
                                    "guests": {
                                        "type": "integer",
                                        "minimum": 1,
                                        "maximum": MAX_GUESTS,
                                        "default": 1,
                                    },
                                },
                            }
                        }
                    },
                },
                "x-max-body-bytes": MAX_BODY_BYTES,
                "x-max-json-depth": MAX_JSON_DEPTH,
                "responses": {
                    "200": {"description": "the live quote, compared with the catalog"},
                    **_responses(
                        (400, "bad body or parameters (INVALID_BODY, INVALID_PARAMETER)"),
                        *_COMMON_ERRORS[1:],
                        (
                            404,
                            "no such offer in the catalog (OFFER_NOT_FOUND) or at the "
                            "supplier (OFFER_UNAVAILABLE)",
                        ),
                        (413, f"body larger than {MAX_BODY_BYTES} bytes (BODY_TOO_LARGE)"),
                        (415, "Content-Type is not application/json (UNSUPPORTED_MEDIA_TYPE)"),
                        (
                            429,
                            "the confirmations' share of the supplier's rate is used up "
                            "(RATE_LIMITED; Retry-After)",
                        ),
                        (502, "the supplier could not confirm (CONFIRMATION_FAILED)"),
                        (
                            503,
                            "no supplier account confirms this hotel's offers "
                            "(SUPPLIER_UNAVAILABLE), or the supplier's circuit is open "
                            "(CONFIRMATION_UNAVAILABLE; Retry-After)",
                        ),
                        (504, "the supplier did not answer in time (CONFIRMATION_TIMEOUT)"),
                    ),
                },
            }
        },
    },
    "components": {
        "schemas": {"Error": _ERROR},
        "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer", "description": "an API key"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "X-Api-Key"},
        },
    },
}
