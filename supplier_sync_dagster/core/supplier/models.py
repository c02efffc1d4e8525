"""Typed models of the Supplier Hotel API v1 (``shared/supplier-api.md``).

Two kinds of model live here:

* Envelope models (:class:`HotelsPage`, :class:`ChangesPage`, :class:`CityList`...) that the
  client validates every response against. Hotel records inside pages and change feeds are
  kept as raw dicts: real feeds contain bad records, and judging them is the normalization
  stage's job. One bad hotel never fails its page.
* :class:`Hotel` and its parts: the shape of a good hotel record as the contract describes
  it, with the platform's limits from :mod:`~supplier_sync_dagster.core.records.rules`. Nothing in a
  sync applies it: the client keeps records raw, and normalization walks them itself.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from typing import Annotated, Any, Generic, Literal, TypeVar

import orjson
from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
)

from supplier_sync_dagster.core.records.rules import (
    LAT_MAX,
    LAT_MIN,
    LIMITS,
    LNG_MAX,
    LNG_MIN,
    MAX_VERSION,
    MESSAGE_MAX,
    NO_CURRENCY,
    STARS,
    show,
)
from supplier_sync_dagster.core.records.undecodable import UndecodableRecord

#: Key under which a non-object entry of a ``hotels``/``changes`` array is wrapped, so that the
#: page still validates and normalization can dead-letter the entry instead of losing it.
MALFORMED_RECORD_KEY = "_malformed_record"

# 19 digits in a row: an integer that may not fit 64 bits (or a long fraction).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19

DETAILS_KEY = "details"
"""The list of a compensation page: one detail response (``GET /v1/hotels/{id}``) per hotel."""

#: Levels of nesting orjson decodes; deeper JSON is :class:`JsonTooDeep`.
MAX_JSON_DEPTH = 1024
#: The arrays of records a page may hold, each element one record.
RECORD_ARRAYS = ("hotels", "changes", DETAILS_KEY)
_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"[ \t\n\r]*")
# A JSON string (its escapes included), or a bracket or comma outside strings.
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},]', re.DOTALL)
_BAD_BYTE = re.compile("[\udc80-\udcff]")
_HOTEL_ID_KEY = re.compile(r'"hotel_id"\s*:')
_UNSURE = object()
_HOTEL_ID_VALUE = re.compile(r'"hotel_id"\s*:\s*"([^"\\]{1,64})"')


class JsonTooDeep(ValueError):
    """A JSON text nested deeper than the decoder allows (see :func:`decode_json`)."""


def decode_json(raw: bytes) -> Any:
    """``json.loads(raw.decode("utf-8"))``, exactly, at orjson's speed where that is exact.

    orjson parses a page several times faster than the standard library, but reads an
    integer beyond 64 bits as a float; bodies with such digit runs, and every body orjson
    refuses (NaN, ``1e400``, bad UTF-8, a lone surrogate...), are decoded by the standard
    library, which decides what is accepted and with which error.

    Nesting is bounded: orjson refuses more than :data:`MAX_JSON_DEPTH` levels, and the
    standard library's recursion ends at the interpreter's recursion limit (a little below
    that); either way the body is :class:`JsonTooDeep`, never a ``RecursionError``.

    Raises:
        UnicodeDecodeError: The bytes are not UTF-8.
        JsonTooDeep: They nest too deep.
        ValueError: They are not JSON.
    """
    # A run of 19 digits, found by mapping every digit to "0" and searching for 19 of them:
    # much cheaper than a regular expression over a page.
    if raw.translate(_DIGITS_AS_ZERO).find(_LONG_RUN) < 0:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    text = raw.decode("utf-8")
    try:
        return json.loads(text)
    except RecursionError:
        raise JsonTooDeep(
            f"the JSON nests deeper than {MAX_JSON_DEPTH} levels (or than this interpreter's "
            "recursion limit)"
        ) from None


def decode_page(raw: bytes) -> Any:
    """:func:`decode_json`, keeping a page whose record array is broken in one element only.

    When the body is not valid UTF-8 or not valid JSON, but only inside elements of its
    ``hotels``, ``changes`` or ``details`` array (the envelope around them and the array's
    own commas and brackets intact), each such element becomes an
    :class:`~supplier_sync_dagster.core.records.undecodable.UndecodableRecord`
    (``INVALID_UTF8``, ``INVALID_JSON``) in its place and every other element is decoded
    as :func:`decode_json` would. Anything else fails as :func:`decode_json` fails.

    Raises:
        UnicodeDecodeError: The bytes are not UTF-8 outside the records.
        JsonTooDeep: They nest too deep.
        ValueError: They are not JSON outside the records.
    """
    try:
        return decode_json(raw)
    except JsonTooDeep:
        raise
    except ValueError:
        salvaged = _salvage(raw)
        if salvaged is None:
            raise
        return salvaged


def _skip(text: str, pos: int) -> int:
    match = _WHITESPACE.match(text, pos)
    return match.end() if match else pos


def _salvage(raw: bytes) -> dict[str, Any] | None:
    """The page with its undecodable records marked, or None when its structure is broken."""
    # Bytes that are not UTF-8 become lone surrogates U+DC80-U+DCFF: the structure can be
    # read around them, and a record's text holds one only where the supplier's bytes did.
    text = raw.decode("utf-8", "surrogateescape")
    pos = _skip(text, 0)
    if not text.startswith("{", pos):
        return None
    body: dict[str, Any] = {}
    marked = False
    pos = _skip(text, pos + 1)
    try:
        while True:
            key, pos = _DECODER.raw_decode(text, pos)
            pos = _skip(text, pos)
            if not isinstance(key, str) or _BAD_BYTE.search(key) or text[pos : pos + 1] != ":":
                return None
            pos = _skip(text, pos + 1)
            if key in RECORD_ARRAYS and text.startswith("[", pos):
                found = _records(text, pos)
                if found is None:
                    return None
                value, pos = found
                marked = marked or any(type(r) is UndecodableRecord for r in value)
            else:
                start = pos
                value, pos = _DECODER.raw_decode(text, pos)
                if _BAD_BYTE.search(text, start, pos):
                    return None
            body[key] = value
            pos = _skip(text, pos)
            if text.startswith(",", pos):
                pos = _skip(text, pos + 1)
                continue
            if text.startswith("}", pos) and _skip(text, pos + 1) == len(text):
                return body if marked else None
            return None
    except (ValueError, RecursionError):
        return None


def _records(text: str, pos: int) -> tuple[list[Any], int] | None:
    """The array opening at ``text[pos]``, each element decoded or marked; None if unreadable."""
    records: list[Any] = []
    open_brackets: list[str] = []
    start = pos + 1
    for token in _TOKENS.finditer(text, pos):
        char = text[token.start()]
        if char == '"':
            continue
        if char in "[{":
            open_brackets.append("]" if char == "[" else "}")
        elif char in "]}":
            if not open_brackets or open_brackets.pop() != char:
                return None  # brackets that do not pair: the bounds cannot be trusted
            if not open_brackets:
                if records or text[start : token.start()].strip(" \t\n\r"):
                    records.append(_record(text[start : token.start()]))
                if any(r is _UNSURE for r in records):
                    return None
                return records, token.end()
        elif len(open_brackets) == 1:  # a comma between two elements
            records.append(_record(text[start : token.start()]))
            start = token.end()
    return None


def _record(chunk: str) -> Any:
    """One element's text decoded, an UndecodableRecord, or _UNSURE when its bounds are unsure."""
    chunk = chunk.strip(" \t\n\r")
    bad = _BAD_BYTE.search(chunk)
    value: Any = None
    why = "an empty element"
    if chunk:
        try:
            value, end = _DECODER.raw_decode(chunk)
            why = "" if end == len(chunk) else f"text after the value at character {end}"
        except ValueError as err:
            value, why = None, str(err)
        except RecursionError:
            value, why = None, "nested too deep"
    if bad is None and not why:
        return value
    if len(_HOTEL_ID_KEY.findall(chunk)) > 1:
        return _UNSURE  # two records read as one: the element's bounds cannot be trusted
    hotel_id, version = _readable(value, chunk)
    if bad is not None:
        return UndecodableRecord(
            "INVALID_UTF8", _invalid_utf8(value, chunk, bad.start()), hotel_id, version
        )
    shown = show(chunk.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
    return UndecodableRecord(
        "INVALID_JSON", f"the record is not JSON ({why}): {shown}"[:MESSAGE_MAX], hotel_id, version
    )


def _readable(value: Any, chunk: str) -> tuple[str | None, int | None]:
    """The record's hotel id and version, where they can still be read."""
    if isinstance(value, dict):
        hotel_id, version = value.get("hotel_id"), value.get("version")
    else:
        found = _HOTEL_ID_VALUE.search(chunk)
        hotel_id, version = (found.group(1) if found else None), None
    if not (isinstance(hotel_id, str) and hotel_id.isprintable() and 0 < len(hotel_id) <= 64):
        hotel_id = None
    return hotel_id, version if type(version) is int else None


def _invalid_utf8(value: Any, chunk: str, at: int) -> str:
    """Names the field whose string holds the bytes that are not UTF-8, and shows it."""
    where, text = f"character {at} of the record", chunk[max(0, at - 40) : at + 40]
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str) and _BAD_BYTE.search(item):
            where, text = path or "the record", item
            break
        if isinstance(item, dict):
            stack.extend((f"{path}.{k}".lstrip("."), v) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    bad = " ".join(f"0x{ord(c) - 0xDC00:02X}" for c in _BAD_BYTE.findall(text)[:8])
    shown = show(text.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
    return f"{where} holds bytes that are not UTF-8 ({bad}): {shown}"[:MESSAGE_MAX]


CityCode = Annotated[str, Field(min_length=1, max_length=LIMITS["city_code"])]


def _wrap_records(value: Any) -> Any:
    """Keep every entry of a record array: objects as they are, anything else wrapped."""
    if not isinstance(value, list):
        return value
    return [item if isinstance(item, dict) else {MALFORMED_RECORD_KEY: item} for item in value]


RawRecords = Annotated[list[dict[str, Any]], BeforeValidator(_wrap_records)]


class _Envelope(BaseModel):
    """Base of response envelopes: unknown top-level fields are kept, never an error."""

    model_config = ConfigDict(extra="allow", frozen=True)


class City(_Envelope):
    """One city the supplier serves (``GET /v1/cities``)."""

    city_code: CityCode
    name: str | None = None
    country_code: str | None = None
    hotel_count: int | None = None
    updated_at: AwareDatetime | None = None


class CityList(_Envelope):
    """The body of ``GET /v1/cities``."""

    cities: list[City]
    total: int | None = None


class HotelsPage(_Envelope):
    """One page of a city's hotels (``GET /v1/cities/{city_code}/hotels``).

    ``hotels`` holds the records exactly as decoded from JSON (non-object entries wrapped under
    :data:`MALFORMED_RECORD_KEY`); validate them with :class:`Hotel` during normalization.
    ``page`` may be absent when the page was requested by cursor.
    """

    city_code: str | None = None
    page: int | None = None
    page_size: int | None = None
    total: int | None = None
    total_pages: int | None = None
    next_cursor: str | None = None
    hotels: RawRecords

    @property
    def last_hotel_id(self) -> str | None:
        """The ``hotel_id`` of the last record that has a string id, or None."""
        for record in reversed(self.hotels):
            hotel_id = record.get("hotel_id")
            if isinstance(hotel_id, str):
                return hotel_id
        return None

    @property
    def first_hotel_id(self) -> str | None:
        """The ``hotel_id`` of the first record that has a string id, or None."""
        for record in self.hotels:
            hotel_id = record.get("hotel_id")
            if isinstance(hotel_id, str):
                return hotel_id
        return None


class ChangeWatermark(_Envelope):
    """Where to continue a change feed: ``since`` and ``after_id``."""

    since: AwareDatetime
    after_id: str | None = None


class ChangesPage(_Envelope):
    """The body of ``GET /v1/hotels/changes``; ``next`` is None when caught up."""

    changes: RawRecords
    next: ChangeWatermark | None = None


class CitySummary(_Envelope):
    """What the supplier holds for a city (``GET /v1/cities/{city_code}/summary``)."""

    city_code: str
    hotel_count: int
    active_count: int | None = None
    inactive_count: int | None = None
    max_updated_at: AwareDatetime | None = None


def _decimal_from_string(value: Any) -> Any:
    """Money travels as a decimal string; a JSON float would already have lost precision."""
    if isinstance(value, float):
        raise ValueError("money amount must be a decimal string, not a float")
    return value


class Money(BaseModel):
    """A decimal amount (sent as a string) and its ISO 4217 currency code."""

    model_config = ConfigDict(frozen=True)

    amount: Annotated[Decimal, BeforeValidator(_decimal_from_string), Field(ge=0)]
    currency: Annotated[str, Field(pattern=r"^[A-Z]{3}$")]

    @field_validator("currency")
    @classmethod
    def _real_currency(cls, value: str) -> str:
        # X-codes for "no currency" and testing are valid ISO 4217 but never a real price;
        # other codes the platform cannot price in are normalization's call, not the client's.
        if value in NO_CURRENCY:
            raise ValueError(f"currency {value} is not a real currency")
        return value


class OfferRequest(BaseModel):
    """The body of ``POST /v1/offers/confirm``."""

    model_config = ConfigDict(frozen=True)

    hotel_id: Annotated[str, Field(min_length=1)]
    room_code: Annotated[str, Field(min_length=1)]
    rate_plan_code: Annotated[str, Field(min_length=1)]
    check_in: date
    check_out: date
    guests: Annotated[int, Field(ge=1)]


class OfferConfirmation(_Envelope):
    """A real-time quote from ``POST /v1/offers/confirm``; never cache it."""

    available: bool
    price: Money | None = None
    quoted_at: AwareDatetime
    valid_for_seconds: int


# --- the shape of a hotel record ----------------------------------------------------------


class HotelStatus(enum.StrEnum):
    """Lifecycle of a hotel at the supplier."""

    ACTIVE = "ACTIVE"
    INACTIVE = "INACTIVE"


_Code = Annotated[str, Field(min_length=1, max_length=LIMITS["code"])]


class Geo(BaseModel):
    """WGS 84 coordinates."""

    model_config = ConfigDict(frozen=True)

    lat: Annotated[float, Field(ge=LAT_MIN, le=LAT_MAX)]
    lng: Annotated[float, Field(ge=LNG_MIN, le=LNG_MAX)]


class Address(BaseModel):
    """A postal address; suppliers add fields freely."""

    model_config = ConfigDict(extra="allow", frozen=True)

    line1: Annotated[str, Field(max_length=LIMITS["address_line1"])] | None = None
    postal_code: Annotated[str, Field(max_length=LIMITS["postal_code"])] | None = None


class Image(BaseModel):
    """One hotel image."""

    model_config = ConfigDict(frozen=True)

    url: Annotated[str, Field(max_length=LIMITS["url"])]
    caption: Annotated[str, Field(max_length=LIMITS["caption"])] | None = None


class RatePlan(BaseModel):
    """A bookable rate of a room."""

    model_config = ConfigDict(frozen=True)

    code: _Code
    board: Annotated[str, Field(max_length=LIMITS["code"])] | None = None
    refundable: bool | None = None
    available: bool | None = None
    price: Money | None = None


class Room(BaseModel):
    """A room type and its rate plans."""

    model_config = ConfigDict(frozen=True)

    room_code: _Code
    name: Annotated[str, Field(max_length=LIMITS["name"])] | None = None
    bed_type: Annotated[str, Field(max_length=LIMITS["code"])] | None = None
    max_occupancy: Annotated[int, Field(ge=1, le=LIMITS["max_occupancy"])] | None = None
    rate_plans: Annotated[list[RatePlan], Field(max_length=LIMITS["rate_plans"])] = Field(
        default_factory=list
    )


class Hotel(BaseModel):
    """A hotel record in the contract's shape: types, required fields, and the platform's limits.

    For callers that want one record typed. Nothing in a sync applies it: the client keeps the
    records of a page raw (:class:`HotelsPage`), and normalization
    (:mod:`~supplier_sync_dagster.core.records.normalize`) walks them itself, to report the first
    problem precisely. Its lengths and ranges are :mod:`~supplier_sync_dagster.core.records.rules`,
    so a record it accepts is never one normalization rejects for a length or a range; the
    rules it leaves to normalization are the value checks (code lists, phone, control
    characters, HTML).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    hotel_id: Annotated[str, Field(min_length=1, max_length=LIMITS["hotel_id"])]
    name: Annotated[str, Field(min_length=1, max_length=LIMITS["name"])]
    name_local: Annotated[str, Field(max_length=LIMITS["name"])] | None = None
    city_code: CityCode
    country_code: Annotated[str, Field(pattern=r"^[A-Z]{2}$")]
    address: Address | None = None
    geo: Geo
    star_rating: Annotated[float, Field(ge=0, le=float(STARS[-1]))] | None = None
    phone: Annotated[str, Field(max_length=LIMITS["phone"])] | None = None
    email: Annotated[str, Field(max_length=LIMITS["email"])] | None = None
    facilities: Annotated[
        list[Annotated[str, Field(max_length=LIMITS["facility"])]],
        Field(max_length=LIMITS["facilities"]),
    ] = Field(default_factory=list)
    images: Annotated[list[Image], Field(max_length=LIMITS["images"])] = Field(default_factory=list)
    rooms: Annotated[list[Room], Field(max_length=LIMITS["rooms"])] = Field(default_factory=list)
    status: HotelStatus
    updated_at: AwareDatetime
    version: Annotated[int, Field(ge=0, le=MAX_VERSION)]


# --- what the client hands back ------------------------------------------------------------

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class RateLimitInfo:
    """The supplier's ``X-RateLimit-*`` headers of one response (None when absent)."""

    limit: int | None
    remaining: int | None
    reset_seconds: float | None


@dataclass(frozen=True, slots=True)
class Fetched(Generic[M]):
    """A validated response body and the bytes it was parsed from.

    Attributes:
        data: The validated model (or raw dict, for single hotel records).
        raw: The response body after HTTP content decoding (gzip removed): the exact JSON
            text the supplier sent. This is what gets hashed and stored for replay.
        status: The HTTP status (200, or whatever 2xx the supplier used).
        rate_limit: The rate-limit headers of the response.
    """

    data: M
    raw: bytes
    status: int
    rate_limit: RateLimitInfo


class PagePosition(BaseModel):
    """Where a city walk stands: the checkpoint to store once a page is committed.

    Attributes:
        page: Next page number to fetch by number (1-based).
        cursor: Next cursor to fetch with, when the supplier offered one.
        last_hotel_id: ``hotel_id`` of the last record already processed, if any.
        done: True once the walk has seen the city's last page.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    page: Annotated[int, Field(ge=1)] = 1
    cursor: str | None = None
    last_hotel_id: str | None = None
    done: bool = False


@dataclass(frozen=True, slots=True)
class CityPage:
    """One page of a :class:`~supplier_sync_dagster.core.supplier.walk.CityWalk`.

    Attributes:
        city_code: The city being walked.
        page: The validated page (records as raw dicts).
        raw: The decoded response body (see :attr:`Fetched.raw`).
        page_number: The walk's own number for this page (1-based), also when fetched by cursor.
        fetched_by: Whether the request used a cursor or a page number.
        position: The checkpoint to store after this page's data is committed.
    """

    city_code: str
    page: HotelsPage
    raw: bytes
    page_number: int
    fetched_by: Literal["cursor", "page"]
    position: PagePosition


def page_records(body: Any) -> list[Any]:
    """The records of a stored RAW page, in order.

    A city listing's page holds ``hotels``, a change feed's ``changes`` (the contract); a
    compensation page's ``details`` are the supplier's detail responses, each the record
    or the record wrapped as ``{"hotel": {...}}``.
    """
    if not isinstance(body, dict):
        return []
    if DETAILS_KEY in body:
        return [
            r["hotel"] if isinstance(r, dict) and set(r) == {"hotel"} else r
            for r in body[DETAILS_KEY] or ()
        ]
    return list(body.get("hotels", body.get("changes")) or [])
