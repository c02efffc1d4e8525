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
- ``GET /openapi.json``: the OpenAPI description.

Errors are JSON ``{"error": {"code": ..., "message": ...}}`` with a fitting status; nothing
unexpected leaks a stack trace (500 ``INTERNAL``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from decimal import Decimal, InvalidOperation
from typing import Any

import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from supplier_sync_dagster.core.errors import (
    CircuitOpen,
    ProjectionUnavailable,
    SupplierError,
    SupplierNotFound,
)
from supplier_sync_dagster.core.outbox.machine import first_stage
from supplier_sync_dagster.core.outbox.projections import (
    HOTEL_KEY,
    HotelCache,
    SearchIndex,
    SearchQuery,
    load_search_docs,
)
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


class ApiError(HTTPException):
    """An error answered as ``{"error": {"code", "message"}}``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(status_code=status, detail=message)
        self.code = code


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, "INVALID_PARAMETER", f"{name} must be an integer") from None
    if not low <= value <= high:
        raise ApiError(400, "INVALID_PARAMETER", f"{name} must be {low}..{high}")
    return value


def _number(request: Request, name: str) -> Decimal | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = Decimal(raw)
    except InvalidOperation:
        raise ApiError(400, "INVALID_PARAMETER", f"{name} must be a number") from None
    if not value.is_finite() or value < 0:
        raise ApiError(400, "INVALID_PARAMETER", f"{name} must be a non-negative number")
    return value


def _text(request: Request, name: str, limit: int = 128) -> str | None:
    raw = request.query_params.get(name)
    if raw is not None and len(raw) > limit:
        raise ApiError(400, "INVALID_PARAMETER", f"{name} is longer than {limit} characters")
    return raw or None


def _money(value: Decimal | None) -> str | None:
    return None if value is None else str(value)


def create_app(
    *,
    db: SyncDatabase,
    search: SearchIndex,
    cache: HotelCache,
    supplier: Callable[[int], SupplierClient | None] | None = None,
    ttl_seconds: float = DEFAULT_TTL_SECONDS,
) -> Starlette:
    """The read API over these stores.

    Args:
        db: The sync database (the catalog, and the outbox for refresh requests).
        search: The search read model.
        cache: The hotel cache (shared with the outbox's CACHE stage).
        supplier: Supplier id -> the client that confirms that supplier's offers (None, or
            None for that supplier: 503).
        ttl_seconds: How long a hotel stays cached.
    """
    api = ReadApi(db=db, search=search, cache=cache, supplier=supplier, ttl_seconds=ttl_seconds)
    return Starlette(
        routes=[
            Route("/hotels", api.hotels, methods=["GET"]),
            Route("/hotels/{resource_id:int}", api.hotel, methods=["GET"]),
            Route("/offers/confirm", api.confirm, methods=["POST"]),
            Route("/openapi.json", _openapi, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _on_api_error, Exception: _on_error},
    )


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
        stars = _number(request, "stars")
        query = SearchQuery(
            text=_text(request, "q", 256) or "",
            city_code=_text(request, "city"),
            country_code=_text(request, "country", 2),
            min_stars=None if stars is None else float(stars),
            max_price=_number(request, "max_price"),
            limit=_int(request, "limit", 20, 1, 100),
        )
        if not (query.text or query.city_code or query.country_code):
            raise ApiError(400, "INVALID_PARAMETER", "give q, city or country")
        hits = self.search.search(query)
        return JSONResponse(
            {
                "count": len(hits),
                "hotels": [{**vars(h), "lowest_price": _money(h.lowest_price)} for h in hits],
            }
        )

    async def hotel(self, request: Request) -> Response:
        """``GET /hotels/{id}``: the cache first, else the catalog, cached."""
        # A hit is answered on the event loop (one cache read, no worker thread: the hot
        # path of a read API); a miss reads the catalog in a worker thread.
        resource_id = int(request.path_params["resource_id"])
        key = HOTEL_KEY.format(resource_id=resource_id)
        try:
            cached = self.cache.get(key)
        except ProjectionUnavailable as err:  # the cache is an optimisation, not a source
            log.warning("hotel cache unavailable, reading the catalog: %s", err)
            cached = None
        if cached is not None:
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
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "INVALID_BODY", "the body must be JSON") from None
        return await run_in_threadpool(self.confirm_body, body)

    def confirm_body(self, body: Any) -> JSONResponse:
        """The answer to a confirmation request's body (in a worker thread: it waits for the
        supplier)."""
        req = _confirm_request(body)
        if self.supplier is None:
            raise ApiError(503, "SUPPLIER_UNAVAILABLE", "no supplier is configured")
        offer = _catalog_offer(self.db, req["hotel_id"], req["room_code"], req["rate_plan_code"])
        if offer is None:
            raise ApiError(404, "OFFER_NOT_FOUND", "no such hotel, room and rate plan")
        client = self.supplier(int(offer["supplier_id"]))
        if client is None:
            raise ApiError(
                503,
                "SUPPLIER_UNAVAILABLE",
                f"no account of supplier {offer['supplier_id']} is configured to confirm offers",
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
        except SupplierNotFound as err:
            raise ApiError(404, "SUPPLIER_NOT_FOUND", str(err)) from None
        except CircuitOpen as err:
            raise ApiError(503, "CIRCUIT_OPEN", str(err)) from None
        except SupplierError as err:
            raise ApiError(502, "SUPPLIER_UNAVAILABLE", str(err)) from None
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


def _openapi(_: Request) -> JSONResponse:
    return JSONResponse(OPENAPI)


async def _on_api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = (
        exc.code
        if isinstance(exc, ApiError)
        else ("NOT_FOUND" if exc.status_code == 404 else "HTTP_ERROR")
    )
    return _error(exc.status_code, code, str(exc.detail))


async def _on_error(_: Request, exc: Exception) -> Response:
    if isinstance(exc, ProjectionUnavailable):
        return _error(503, "READ_MODEL_UNAVAILABLE", str(exc))
    log.exception("unexpected error in the read API")
    return _error(500, "INTERNAL", "an unexpected error; it has been logged")


def _confirm_request(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "INVALID_BODY", "the body must be a JSON object")
    out: dict[str, Any] = {}
    hotel_id = body.get("hotel_id")
    if not isinstance(hotel_id, int) or isinstance(hotel_id, bool) or hotel_id < 1:
        raise ApiError(400, "INVALID_PARAMETER", "hotel_id must be the platform's hotel id")
    out["hotel_id"] = hotel_id
    for name in ("room_code", "rate_plan_code"):
        value = body.get(name)
        if not isinstance(value, str) or not 0 < len(value) <= 64:
            raise ApiError(400, "INVALID_PARAMETER", f"{name} must be a code")
        out[name] = value
    try:
        out["check_in"] = date.fromisoformat(str(body.get("check_in")))
        out["check_out"] = date.fromisoformat(str(body.get("check_out")))
    except ValueError:
        raise ApiError(400, "INVALID_PARAMETER", "check_in/check_out must be YYYY-MM-DD") from None
    if not 1 <= (out["check_out"] - out["check_in"]).days <= 30:
        raise ApiError(400, "INVALID_PARAMETER", "the stay must be 1 to 30 nights")
    guests = body.get("guests", 1)
    if not isinstance(guests, int) or isinstance(guests, bool) or not 1 <= guests <= 10:
        raise ApiError(400, "INVALID_PARAMETER", "guests must be 1..10")
    out["guests"] = guests
    return out


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
    out = doc.to_json()
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
_ERRORS = {
    str(code): {
        "description": what,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    for code, what in (
        (400, "bad parameters or body"),
        (404, "not found"),
        (500, "unexpected error (logged; no details)"),
        (502, "the supplier failed"),
        (503, "the supplier's circuit is open, or a read model is unavailable"),
    )
}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "supplier-sync read API",
        "version": "1",
        "description": "Hotels from the search projection and the cache; offers confirmed "
        "with the supplier in real time.",
    },
    "paths": {
        "/hotels": {
            "get": {
                "summary": "Search hotels",
                "parameters": [
                    {"name": n, "in": "query", "schema": s, "description": d}
                    for n, s, d in (
                        ("q", {"type": "string", "maxLength": 256}, "words; all must match"),
                        ("city", {"type": "string"}, "supplier city code"),
                        ("country", {"type": "string", "maxLength": 2}, "ISO country code"),
                        ("stars", {"type": "number", "minimum": 0}, "at least this many stars"),
                        ("max_price", {"type": "number", "minimum": 0}, "lowest price at most"),
                        ("limit", {"type": "integer", "minimum": 1, "maximum": 100}, "results"),
                    )
                ],
                "responses": {"200": {"description": "hotels, best first"}, **_ERRORS},
            }
        },
        "/hotels/{resource_id}": {
            "get": {
                "summary": "A hotel with its offers (cached; X-Cache: HIT or MISS)",
                "parameters": [
                    {
                        "name": "resource_id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "integer"},
                    }
                ],
                "responses": {"200": {"description": "the hotel"}, **_ERRORS},
            }
        },
        "/offers/confirm": {
            "post": {
                "summary": "Confirm an offer's price and availability with the supplier now",
                "requestBody": {
                    "required": True,
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
                                    "hotel_id": {"type": "integer"},
                                    "room_code": {"type": "string"},
                                    "rate_plan_code": {"type": "string"},
                                    "check_in": {"type": "string", "format": "date"},
                                    "check_out": {"type": "string", "format": "date"},
                                    "guests": {"type": "integer", "minimum": 1, "maximum": 10},
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": {"description": "the live quote, compared with the catalog"},
                    **_ERRORS,
                },
            }
        },
    },
    "components": {"schemas": {"Error": _ERROR}},
}
