"""Normalization: one supplier hotel record (raw JSON) -> the platform's model, or a rejection.

A record is whatever ``json.loads`` produced for one element of a page's ``hotels`` list, so
it can be anything: another type, missing fields, wrong types, hostile strings.
:func:`normalize_record` turns it into a frozen :class:`NormalizedHotel` or into exactly one
:class:`Rejection` that names the problem (stage, error code, dotted field path, a message
with the offending value shown safely). It never raises, and one bad record never affects
another: :func:`normalize_records` maps it over a page and keeps each output's position.

Which problem is reported when a record has several (deterministic):

1. ``INVALID_UTF8`` / ``INVALID_JSON`` when the record's bytes could not be decoded (the page
   decoder left an :class:`~supplier_sync_dagster.core.records.undecodable.UndecodableRecord`
   in its place); ``NOT_AN_OBJECT`` when the record is not a JSON object;
2. required fields, in the contract's order (``hotel_id, name, city_code, country_code,
   geo, status, updated_at, version``): ``MISSING_REQUIRED_FIELD`` (absent or ``null``),
   ``FIELD_RENAMED`` (``geo`` absent but ``location`` present);
3. a walk over the fields in the contract's order: the first ADAPTER problem (wrong type,
   unparseable timestamp or amount, missing nested field) wins at once; otherwise the
   first VALIDATION problem (a value out of its domain) met during the walk;
4. for :func:`normalize_documents` given the database clock's bound, an otherwise valid
   record dated after it: ``FUTURE_TIMESTAMP``.

Text rules: free text (names, address, captions, facilities) is stripped and runs of
space/tab/CR/LF are collapsed to one space; any other C0/C1 control character (ESC, NUL,
DEL, U+0080-U+009F) rejects the record with ``CONTROL_CHARACTERS`` instead of being deleted,
because deleting it could hide an escape-sequence injection and change what was meant.
Lone surrogates (not encodable as UTF-8) are ``INVALID_UNICODE``. Identifiers and codes
(``hotel_id``, ``city_code``, room/rate/board/bed codes) are kept verbatim, and any control
character in them (tab and newline included) is rejected. HTML markup in a name
(``name``, ``name_local``, room names) is ``HTML_IN_NAME``. Length limits (in characters,
checked on the value as sent) are in :data:`rules.LIMITS`; over them is ``OVERSIZED_STRING``.
Every limit, code list and check is stated once in :mod:`~supplier_sync_dagster.core.records.rules`,
each string field's rule as its row of :data:`rules.STRING_FIELDS`; this module applies them
to a record and reports the first problem.

Speed: this runs on the hot path of a sync, so values are checked in plain Python, phone and
ISO code lookups are cached, and models are assembled without re-validation
(:func:`_assemble`). :func:`normalize_documents`, what a sync runs, first tries a fast path
that builds the usual clean record's document directly from the same rows of rules, and
leaves every other record to the reference walk; the tests compare both on every row. The
models still carry full validators, so ``NormalizedHotel(**fields)`` and ``model_validate``
enforce the same rules; the tests check that every normalized hotel survives a full
re-validation unchanged.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Annotated, Any, Final, Literal, TypeVar

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from supplier_sync_dagster.core.records import rules
from supplier_sync_dagster.core.records.rules import (
    AMOUNT_MAX,
    AMOUNT_RE,
    COUNTRY_CODES,
    EMAIL_RE,
    FACILITIES_MAX,
    IMAGES_MAX,
    LAT_MAX,
    LAT_MIN,
    LIMITS,
    LNG_MAX,
    LNG_MIN,
    MAX_AMOUNT_INT,
    MAX_VERSION,
    MESSAGE_MAX,
    MONEY_CODES,
    OCCUPANCY_MAX,
    RATE_PLANS_MAX,
    REQUIRED_FIELDS,
    ROOMS_MAX,
    STAR_BY_VALUE,
    STATUSES,
    STRING_FIELDS_BY_SOURCE,
    UNSIGNED_AMOUNT_RE,
    URL_RE,
    WS_RE,
    StringField,
    collapse,
    email_ok,
    formats_only,
    might_hold_html,
    parse_timestamp,
    phone_e164,
    show,
    string_problem,
    url_ok,
)
from supplier_sync_dagster.core.records.undecodable import UndecodableRecord

__all__ = [
    "ERROR_CODES",
    "ERROR_STAGES",
    "LIMITS",
    "REQUIRED_FIELDS",
    "Image",
    "NormalizeResult",
    "NormalizedHotel",
    "RatePlan",
    "Rejection",
    "Room",
    "Stage",
    "canonical_dumps",
    "canonical_json",
    "canonical_lines",
    "content_fields",
    "content_fingerprint",
    "fingerprint",
    "loads_canonical",
    "normalize_record",
    "normalize_records",
    "price_fields",
    "price_fingerprint",
    "to_primitive",
]

Stage = Literal["ADAPTER", "VALIDATION"]
HotelStatus = Literal["ACTIVE", "INACTIVE"]

ADAPTER: Final = "ADAPTER"
VALIDATION: Final = "VALIDATION"

ERROR_CODES: Final[dict[str, str]] = {
    # ADAPTER: the record cannot be parsed into the model's shape.
    "NOT_AN_OBJECT": "the record is not a JSON object",
    "INVALID_UTF8": "the record's bytes on its page are not UTF-8 (the rest of the page is)",
    "INVALID_JSON": "the record's text on its page is not JSON (the page around it is)",
    "MISSING_REQUIRED_FIELD": "a required field is absent, null or blank",
    "FIELD_RENAMED": "a required field is absent but its known new name is present (geo -> location)",
    "WRONG_TYPE": "a field has the wrong JSON type (e.g. geo not an object, version not an integer, float money)",
    "INVALID_TIMESTAMP": "updated_at is not an RFC 3339 timestamp with a time zone",
    "INVALID_AMOUNT": "a price amount is not a plain decimal string or integer (<= 15 integer, <= 6 fraction digits)",
    "INTERNAL_ERROR": "the normalizer itself failed on this record (a bug); the record is kept for replay",
    # VALIDATION: parsed, but a value is outside its domain.
    "LAT_OUT_OF_RANGE": "geo.lat is not within [-90, 90] (or is NaN/Infinity)",
    "LNG_OUT_OF_RANGE": "geo.lng is not within [-180, 180] (or is NaN/Infinity)",
    "STAR_RATING_OUT_OF_RANGE": "star_rating is not within [0, 5] in half steps",
    "VALUE_OUT_OF_RANGE": "an integer is outside its range (version < 0, max_occupancy not in 1..100)",
    "UNKNOWN_CURRENCY": "a currency is not an ISO 4217 code of money (XXX, XTS, metals and unknown codes)",
    "NEGATIVE_PRICE": "a price amount is below zero",
    "UNKNOWN_STATUS": "status is not exactly ACTIVE or INACTIVE",
    "INVALID_PHONE": "phone is not a valid phone number for the hotel's country",
    "INVALID_COUNTRY": "country_code is not an ISO 3166-1 alpha-2 code",
    "INVALID_EMAIL": "email is not one local part, one @ and a dotted domain, without spaces",
    "INVALID_URL": "an image url is not an absolute http(s) URL without spaces",
    "CONTROL_CHARACTERS": "a string holds C0/C1 control characters (tab/newline allowed in free text only)",
    "INVALID_UNICODE": "a string holds lone surrogates (cannot be encoded as UTF-8)",
    "HTML_IN_NAME": "a name holds HTML markup (tags, <script, on...= handlers, javascript:)",
    "OVERSIZED_STRING": "a string is longer than its limit (see LIMITS)",
    "TOO_MANY_ITEMS": "a list (facilities, images, rooms, rate plans) is longer than its limit",
    "DUPLICATE_CODE": "two rooms of a hotel, or two rate plans of a room, share a code",
    "FUTURE_TIMESTAMP": (
        "updated_at is further ahead of the database clock than the allowed clock skew "
        "(SUPPLIER_SYNC_MAX_CLOCK_SKEW_SECONDS)"
    ),
}
"""Every error code a :class:`Rejection` can carry, with its one-line meaning."""

_ADAPTER_CODES: Final = frozenset(
    {
        "NOT_AN_OBJECT",
        "INVALID_UTF8",
        "INVALID_JSON",
        "MISSING_REQUIRED_FIELD",
        "FIELD_RENAMED",
        "WRONG_TYPE",
        "INVALID_TIMESTAMP",
        "INVALID_AMOUNT",
        "INTERNAL_ERROR",
    }
)
ERROR_STAGES: Final[dict[str, Stage]] = {
    code: ("ADAPTER" if code in _ADAPTER_CODES else "VALIDATION") for code in ERROR_CODES
}
"""The stage each error code belongs to."""

# Known renames of required fields seen in real feeds (schema drift): name -> new names.
_RENAMES: Final[dict[str, tuple[str, ...]]] = {"geo": ("location",)}

# -- the string fields (rules.STRING_FIELDS: one row each, read by every path here) ----------

_STRING = STRING_FIELDS_BY_SOURCE
_HOTEL_ID: Final = _STRING["hotel_id"]
_NAME: Final = _STRING["name"]
_NAME_LOCAL: Final = _STRING["name_local"]
_CITY_CODE: Final = _STRING["city_code"]
_LINE1: Final = _STRING["address.line1"]
_POSTAL_CODE: Final = _STRING["address.postal_code"]
_PHONE: Final = _STRING["phone"]
_EMAIL: Final = _STRING["email"]
_FACILITY: Final = _STRING["facilities[]"]
_URL: Final = _STRING["images[].url"]
_CAPTION: Final = _STRING["images[].caption"]
_ROOM_CODE: Final = _STRING["rooms[].room_code"]
_ROOM_NAME: Final = _STRING["rooms[].name"]
_BED_TYPE: Final = _STRING["rooms[].bed_type"]
_PLAN_CODE: Final = _STRING["rooms[].rate_plans[].code"]
_BOARD: Final = _STRING["rooms[].rate_plans[].board"]

# -- model validators (full validation when a model is built directly) ----------------------


def _string_validator(rule: StringField, *, item: bool = False) -> Callable[[Any], Any]:
    """The model's check of a string field by its rule; ``item``: a list's item (blank: None)."""

    def check(value: str | None) -> str | None:
        if value is None:
            return None
        if rule.verbatim and not value:
            raise ValueError("MISSING_REQUIRED_FIELD: empty")
        problem = string_problem(value, rule.limit, verbatim=rule.verbatim, html=rule.html)
        if problem is not None:
            raise ValueError(f"{problem[0]}: {problem[1]}")
        if rule.verbatim:
            return value
        value = collapse(value)
        if not value:
            if rule.required and not item:
                raise ValueError("MISSING_REQUIRED_FIELD: blank")
            return None
        return value

    return check


def _checked(rule: StringField) -> Any:
    """A model's annotation of a string field by its rule."""
    return AfterValidator(_string_validator(rule))


def _validate_country(value: str) -> str:
    code = rules.country(value)
    if code is None:
        raise ValueError("INVALID_COUNTRY: not an ISO 3166-1 alpha-2 code")
    return code


def _validate_currency(value: str) -> str:
    code = rules.currency(value)
    if code is None:
        raise ValueError("UNKNOWN_CURRENCY: not an ISO 4217 code of money")
    return code


def _validate_star(value: Decimal | None) -> Decimal | None:
    if value is None:
        return None
    star = rules.star(value)
    if star is None:
        raise ValueError("STAR_RATING_OUT_OF_RANGE: not within [0, 5] in half steps")
    return star


def _validate_phone(value: str | None) -> str | None:
    if value is None:
        return None
    if not value.startswith("+") or phone_e164(value, "ZZ") != value:
        raise ValueError("INVALID_PHONE: not a valid E.164 number")
    return value


def _validate_email(value: str | None) -> str | None:
    if value is not None and not email_ok(value):
        raise ValueError("INVALID_EMAIL: not an email address")
    return value


def _validate_url(value: str) -> str:
    if not url_ok(value):
        raise ValueError("INVALID_URL: not an absolute http(s) URL")
    return value


def _validate_utc(value: dt.datetime) -> dt.datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("INVALID_TIMESTAMP: naive datetime")
    return value if value.tzinfo is dt.UTC else value.astimezone(dt.UTC)


_facility_item = _string_validator(_FACILITY, item=True)


def _validate_facilities(value: tuple[str, ...]) -> tuple[str, ...]:
    out = (_facility_item(f) for f in value)
    return tuple(dict.fromkeys(f.lower() for f in out if f))


def _validate_money(value: Decimal) -> Decimal:
    if value.is_signed() and value == 0:
        return value.copy_abs()
    return value


_FROZEN = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
_StrictBool = Annotated[bool, Field(strict=True)]


class Image(BaseModel):
    """A hotel image: an absolute http(s) URL and an optional caption."""

    model_config = _FROZEN

    url: Annotated[str, AfterValidator(_validate_url)]
    caption: Annotated[str | None, _checked(_CAPTION)] = None


class RatePlan(BaseModel):
    """A rate plan of a room: its price (exact ``Decimal``) and availability."""

    model_config = _FROZEN

    code: Annotated[str, _checked(_PLAN_CODE)]
    board: Annotated[str | None, _checked(_BOARD)] = None
    refundable: _StrictBool
    available: _StrictBool
    price: Annotated[Decimal, Field(ge=0), AfterValidator(_validate_money)]
    currency: Annotated[str, AfterValidator(_validate_currency)]


class Room(BaseModel):
    """A room type of a hotel and its rate plans."""

    model_config = _FROZEN

    room_code: Annotated[str, _checked(_ROOM_CODE)]
    name: Annotated[str, _checked(_ROOM_NAME)]
    bed_type: Annotated[str | None, _checked(_BED_TYPE)] = None
    max_occupancy: Annotated[int, Field(strict=True, ge=1, le=OCCUPANCY_MAX)]
    rate_plans: tuple[RatePlan, ...] = ()


class NormalizedHotel(BaseModel):
    """A supplier's hotel in the platform's model (immutable).

    ``city_code`` is the hotel's own ``city_code`` as sent (it can differ from the city whose
    listing served it, when the hotel moved). ``updated_at`` is aware and in UTC.
    """

    model_config = _FROZEN

    supplier_hotel_id: Annotated[str, _checked(_HOTEL_ID)]
    name: Annotated[str, _checked(_NAME)]
    name_local: Annotated[str | None, _checked(_NAME_LOCAL)] = None
    city_code: Annotated[str, _checked(_CITY_CODE)]
    country_code: Annotated[str, AfterValidator(_validate_country)]
    address_line1: Annotated[str | None, _checked(_LINE1)] = None
    postal_code: Annotated[str | None, _checked(_POSTAL_CODE)] = None
    lat: Annotated[float, Field(ge=LAT_MIN, le=LAT_MAX)]
    lng: Annotated[float, Field(ge=LNG_MIN, le=LNG_MAX)]
    star_rating: Annotated[Decimal | None, AfterValidator(_validate_star)] = None
    phone_e164: Annotated[str | None, AfterValidator(_validate_phone)] = None
    email: Annotated[str | None, AfterValidator(_validate_email)] = None
    facilities: Annotated[tuple[str, ...], AfterValidator(_validate_facilities)] = ()
    images: tuple[Image, ...] = ()
    rooms: tuple[Room, ...] = ()
    status: HotelStatus
    updated_at: Annotated[dt.datetime, AfterValidator(_validate_utc)]
    version: Annotated[int, Field(strict=True, ge=0, le=MAX_VERSION)]


_M = TypeVar("_M", bound=BaseModel)
_new = object.__new__
_setattr = object.__setattr__


def _assemble(cls: type[_M], values: dict[str, Any]) -> _M:
    """Build a model from values the normalizer has already checked, without re-validating.

    What ``model_construct`` does, minus its per-field alias and default handling (which costs
    more than full validation): every field is given. The tests re-validate the output.
    """
    m = _new(cls)
    _setattr(m, "__dict__", values)
    _setattr(m, "__pydantic_fields_set__", set(values))
    _setattr(m, "__pydantic_extra__", None)
    _setattr(m, "__pydantic_private__", None)
    return m


# -- rejections -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a record was not normalized: exactly one problem, the first found.

    Attributes:
        supplier_hotel_id: the record's ``hotel_id`` when it is a readable string (1-128
            printable characters), else None.
        stage: ``ADAPTER`` (the record cannot be parsed into the model's shape) or
            ``VALIDATION`` (parsed, but a value is outside its domain).
        error_code: one of :data:`ERROR_CODES`.
        field: dotted path of the offending field in the supplier's record, such as
            ``rooms[0].rate_plans[0].price.currency``; None for ``NOT_AN_OBJECT``.
        message: what is wrong, showing the offending value through ``repr`` truncated to at
            most 200 characters (so control characters and 100 KB strings stay harmless);
            at most 1024 characters.
        version: the record's ``version`` when it is an integer in ``0 .. 2**63-1``.
    """

    supplier_hotel_id: str | None
    stage: Stage
    error_code: str
    field: str | None
    message: str
    version: int | None = None


class _Reject(Exception):
    """Internal: stops the walk over a record with its rejection."""

    def __init__(self, stage: Stage, code: str, path: str | None, message: str) -> None:
        super().__init__(code)
        self.stage: Stage = stage
        self.code = code
        self.path = path
        self.message = message


_JSON_TYPES: Final = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "an integer",
    float: "a float",
    bool: "a boolean",
    type(None): "null",
}


def _kind(value: object) -> str:
    return _JSON_TYPES.get(type(value)) or f"a {type(value).__name__[:50]}"


def _path(path: str | tuple[object, ...]) -> str:
    """A dotted path from a string or from ``(name, index, name, ...)`` parts."""
    if isinstance(path, str):
        return path
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


Path = str | tuple[object, ...]
_Errors = list[tuple[str, Path, str]]


def _wrong_type(path: Path, expected: str, value: object) -> _Reject:
    return _Reject(
        ADAPTER,
        "WRONG_TYPE",
        _path(path),
        f"{_path(path)} must be {expected}, got {_kind(value)}: {show(value)}",
    )


def _missing(path: Path, how: str = "is missing") -> _Reject:
    return _Reject(ADAPTER, "MISSING_REQUIRED_FIELD", _path(path), f"{_path(path)} {how}")


def _readable_id(record: object) -> str | None:
    if type(record) is UndecodableRecord:
        hid: object = record.hotel_id
    elif isinstance(record, dict):
        hid = record.get("hotel_id")
    else:
        return None
    if isinstance(hid, str) and 0 < len(hid) <= _HOTEL_ID.limit and hid.isprintable():
        return hid
    return None


def _readable_version(record: object) -> int | None:
    if type(record) is UndecodableRecord:
        version: object = record.version
    elif isinstance(record, dict):
        version = record.get("version")
    else:
        return None
    if type(version) is int and 0 <= version <= MAX_VERSION:
        return version
    return None


# -- field parsers: ADAPTER problems raise, VALIDATION problems go to ``errs`` ---------------


def _source(rule: StringField, k: int, j: int) -> str:
    """The dotted path of a string field in the record: ``k``, ``j`` fill its ``[]`` in turn."""
    return rule.source.replace("[]", f"[{k}]", 1).replace("[]", f"[{j}]", 1)


def _string(
    rule: StringField, value: object, errs: _Errors, k: int = 0, j: int = 0, *, item: bool = False
) -> str | None:
    """A string field by its rule, as the document holds it (verbatim, or free text collapsed).

    ``k`` and ``j`` are the positions of its list items (:func:`_source`). None when it has no
    value (null, empty or blank) or when a VALIDATION problem was recorded. A required field
    without a value raises; a list's ``item`` without one is to be dropped (null is no item:
    a wrong type).
    """
    if value is None and not item:
        if rule.required:
            raise _missing(_source(rule, k, j))
        return None
    if type(value) is not str and not isinstance(value, str):
        raise _wrong_type(_source(rule, k, j), "a string", value)
    # Only a long or unprintable string can have a problem (names always need the HTML check).
    if len(value) > rule.limit or not value.isprintable() or rule.html:
        problem = string_problem(value, rule.limit, verbatim=rule.verbatim, html=rule.html)
        if problem is not None:
            errs.append((problem[0], _source(rule, k, j), f"{problem[1]}: {show(value)}"))
            return None
    if not rule.verbatim:
        value = collapse(value)
    if value:
        return value
    if rule.required and not item:
        raise _missing(_source(rule, k, j), "is empty" if rule.verbatim else "is blank")
    return None


def _number(value: object, path: Path) -> int | float:
    if type(value) is float or type(value) is int:
        return value
    raise _wrong_type(path, "a number", value)


def _integer(value: object, path: Path) -> int:
    if type(value) is int:
        return value
    raise _wrong_type(path, "an integer", value)


def _present(value: object, path: Path) -> object:
    """``value``; a required field that is absent or null raises."""
    if value is None:
        raise _missing(path)
    return value


def _boolean(value: object, path: Path) -> bool:
    if value is True or value is False:
        return value
    if value is None:
        raise _missing(path)
    raise _wrong_type(path, "a boolean", value)


def _obj(value: object, path: Path) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    raise _wrong_type(path, "an object", value)


def _array(value: object, path: Path, limit_key: str, errs: _Errors) -> list[Any]:
    """A list (null means empty); longer than its limit is recorded and gives []."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _wrong_type(path, "an array", value)
    limit = LIMITS[limit_key]
    if len(value) > limit:
        errs.append(("TOO_MANY_ITEMS", path, f"has {len(value)} items, over the limit of {limit}"))
        return []
    return value


_LAT_RANGE: Final = f"[{LAT_MIN}, {LAT_MAX}]"
_LNG_RANGE: Final = f"[{LNG_MIN}, {LNG_MAX}]"


def _in_range(
    value: int | float, low: int, high: int, code: str, path: Path, why: str, errs: _Errors
) -> None:
    """Records ``code`` when ``value`` is not within ``low..high`` (NaN is not)."""
    if not low <= value <= high:
        errs.append((code, path, f"must be within {why}: {show(value)}"))


def _amount(value: object, path: Path, errs: _Errors) -> Decimal | None:
    kind = type(value)
    if kind is str:
        raw: str = value  # type: ignore[assignment]
        if len(raw) > AMOUNT_MAX or AMOUNT_RE.fullmatch(raw) is None:
            raise _Reject(
                ADAPTER,
                "INVALID_AMOUNT",
                _path(path),
                f"{_path(path)} is not a plain decimal number: {show(raw)}",
            )
        amount = Decimal(raw)
    elif kind is int:
        number: int = value  # type: ignore[assignment]
        if not -MAX_AMOUNT_INT < number < MAX_AMOUNT_INT:
            raise _Reject(
                ADAPTER,
                "INVALID_AMOUNT",
                _path(path),
                f"{_path(path)} is too large: {show(number)}",
            )
        amount = Decimal(number)
    elif kind is float:
        raise _Reject(
            ADAPTER,
            "WRONG_TYPE",
            _path(path),
            f"{_path(path)} must be a decimal string, got a float (money is never a float): "
            f"{show(value)}",
        )
    elif value is None:
        raise _missing(path)
    else:
        raise _wrong_type(path, "a decimal string", value)
    if amount < 0:
        errs.append(("NEGATIVE_PRICE", path, f"is negative: {show(value)}"))
        return None
    if amount == 0 and amount.is_signed():
        amount = amount.copy_abs()
    return amount


def _currency_field(value: object, path: Path, errs: _Errors) -> str | None:
    if value is None:
        raise _missing(path)
    if not isinstance(value, str):
        raise _wrong_type(path, "a string", value)
    code = rules.currency(value) if len(value) == 3 else None
    if code is None:
        errs.append(("UNKNOWN_CURRENCY", path, f"is not an ISO 4217 currency: {show(value)}"))
    return code


def _rate_plan(raw: object, ri: int, pi: int, errs: _Errors) -> RatePlan | None:
    get = _obj(raw, ("rooms", ri, "rate_plans", pi)).get
    code = _string(_PLAN_CODE, get("code"), errs, ri, pi)
    board = _string(_BOARD, get("board"), errs, ri, pi)
    refundable = _boolean(get("refundable"), ("rooms", ri, "rate_plans", pi, "refundable"))
    available = _boolean(get("available"), ("rooms", ri, "rate_plans", pi, "available"))
    price_raw = get("price")
    if price_raw is None:
        raise _missing(("rooms", ri, "rate_plans", pi, "price"))
    price = _obj(price_raw, ("rooms", ri, "rate_plans", pi, "price"))
    amount = _amount(price.get("amount"), ("rooms", ri, "rate_plans", pi, "price", "amount"), errs)
    currency = _currency_field(
        price.get("currency"), ("rooms", ri, "rate_plans", pi, "price", "currency"), errs
    )
    if errs:
        return None
    return _assemble(
        RatePlan,
        {
            "code": code,
            "board": board,
            "refundable": refundable,
            "available": available,
            "price": amount,
            "currency": currency,
        },
    )


def _room(raw: object, ri: int, errs: _Errors) -> Room | None:
    get = _obj(raw, ("rooms", ri)).get
    room_code = _string(_ROOM_CODE, get("room_code"), errs, ri)
    name = _string(_ROOM_NAME, get("name"), errs, ri)
    bed = _string(_BED_TYPE, get("bed_type"), errs, ri)
    occupancy = get("max_occupancy")
    if occupancy is None:
        raise _missing(("rooms", ri, "max_occupancy"))
    occupancy = _integer(occupancy, ("rooms", ri, "max_occupancy"))
    if not 1 <= occupancy <= OCCUPANCY_MAX:
        errs.append(
            (
                "VALUE_OUT_OF_RANGE",
                ("rooms", ri, "max_occupancy"),
                f"must be within 1..{OCCUPANCY_MAX}: {show(occupancy)}",
            )
        )
    plans_raw = _array(get("rate_plans"), ("rooms", ri, "rate_plans"), "rate_plans", errs)
    plans: list[RatePlan] = []
    seen: set[str] = set()
    for pi, plan_raw in enumerate(plans_raw):
        plan = _rate_plan(plan_raw, ri, pi, errs)
        if plan is not None:
            if plan.code in seen:
                errs.append(
                    (
                        "DUPLICATE_CODE",
                        ("rooms", ri, "rate_plans", pi, "code"),
                        f"repeats an earlier rate plan code: {show(plan.code)}",
                    )
                )
            seen.add(plan.code)
            plans.append(plan)
    if errs:
        return None
    return _assemble(
        Room,
        {
            "room_code": room_code,
            "name": name,
            "bed_type": bed,
            "max_occupancy": occupancy,
            "rate_plans": tuple(plans),
        },
    )


def _rooms(value: object, errs: _Errors) -> tuple[Room, ...]:
    rooms: list[Room] = []
    seen: set[str] = set()
    for ri, room_raw in enumerate(_array(value, "rooms", "rooms", errs)):
        room = _room(room_raw, ri, errs)
        if room is not None:
            if room.room_code in seen:
                errs.append(
                    (
                        "DUPLICATE_CODE",
                        ("rooms", ri, "room_code"),
                        f"repeats an earlier room code: {show(room.room_code)}",
                    )
                )
            seen.add(room.room_code)
            rooms.append(room)
    return tuple(rooms)


def _facilities(value: object, errs: _Errors) -> tuple[str, ...]:
    out: dict[str, None] = {}
    for i, item in enumerate(_array(value, "facilities", "facilities", errs)):
        text = _string(_FACILITY, item, errs, i, item=True)
        if text is not None:
            out[text.lower()] = None
    return tuple(out)


def _images(value: object, errs: _Errors) -> tuple[Image, ...]:
    items = _array(value, "images", "images", errs)
    out: list[Image] = []
    for i, item in enumerate(items):
        img = _obj(item, ("images", i))
        url = _present(img.get("url"), ("images", i, "url"))
        if not isinstance(url, str):
            raise _wrong_type(("images", i, "url"), "a string", url)
        if not url_ok(url):
            problem = string_problem(url, _URL.limit, verbatim=True)
            code, why = problem or ("INVALID_URL", "is not an absolute http(s) URL")
            errs.append((code, ("images", i, "url"), f"{why}: {show(url)}"))
            continue
        caption = _string(_CAPTION, img.get("caption"), errs, i)
        out.append(_assemble(Image, {"url": url, "caption": caption}))
    return tuple(out)


def _required(rec: dict[str, Any]) -> None:
    """Raises for the first required field, in the contract's order, that has no value."""
    for required in REQUIRED_FIELDS:
        if rec.get(required) is None:
            if required in rec:
                raise _missing(required, "is null")
            for new in _RENAMES.get(required, ()):
                if new in rec:
                    raise _Reject(
                        ADAPTER,
                        "FIELD_RENAMED",
                        required,
                        f"{required} is missing but {new!r} is present: the field was renamed to {new}",
                    )
            raise _missing(required)


def _country(value: object, errs: _Errors) -> str | None:
    if not isinstance(value, str):
        raise _wrong_type("country_code", "a string", value)
    country = rules.country(value) if len(value) == 2 else None
    if country is None:
        errs.append(
            ("INVALID_COUNTRY", "country_code", f"is not an ISO 3166-1 alpha-2 code: {show(value)}")
        )
    return country


def _address(value: object, errs: _Errors) -> tuple[str | None, str | None]:
    if value is None:
        return None, None
    address = _obj(value, "address")
    line1 = _string(_LINE1, address.get("line1"), errs)
    postal = _string(_POSTAL_CODE, address.get("postal_code"), errs)
    return line1, postal


def _geo(value: object, errs: _Errors) -> tuple[int | float, int | float]:
    geo = _obj(value, "geo")
    lat = _number(_present(geo.get("lat"), "geo.lat"), "geo.lat")
    lng = _number(_present(geo.get("lng"), "geo.lng"), "geo.lng")
    _in_range(lat, LAT_MIN, LAT_MAX, "LAT_OUT_OF_RANGE", "geo.lat", _LAT_RANGE, errs)
    _in_range(lng, LNG_MIN, LNG_MAX, "LNG_OUT_OF_RANGE", "geo.lng", _LNG_RANGE, errs)
    return lat, lng


def _star(value: object, errs: _Errors) -> Decimal | None:
    if value is None:
        return None
    star = rules.star(_number(value, "star_rating"))
    if star is None:
        errs.append(
            (
                "STAR_RATING_OUT_OF_RANGE",
                "star_rating",
                f"must be within [0, 5] in half steps: {show(value)}",
            )
        )
    return star


def _phone(value: object, country: str | None, errs: _Errors) -> str | None:
    text = _string(_PHONE, value, errs)
    if text is None or country is None:
        return None
    phone = phone_e164(text, country)
    if phone is None:
        errs.append(
            ("INVALID_PHONE", "phone", f"is not a valid phone number in {country}: {show(value)}")
        )
    return phone


def _email(value: object, errs: _Errors) -> str | None:
    email = _string(_EMAIL, value, errs)
    if email is not None and EMAIL_RE.fullmatch(email) is None:
        errs.append(("INVALID_EMAIL", "email", f"is not an email address: {show(value)}"))
    return email


def _status(value: object, errs: _Errors) -> str:
    if not isinstance(value, str):
        raise _wrong_type("status", "a string", value)
    if value not in STATUSES:
        errs.append(("UNKNOWN_STATUS", "status", f"must be ACTIVE or INACTIVE: {show(value)}"))
    return value


def _updated_at(value: object) -> dt.datetime:
    if not isinstance(value, str):
        raise _wrong_type("updated_at", "a string", value)
    updated_at = parse_timestamp(value)
    if updated_at is None:
        raise _Reject(
            ADAPTER,
            "INVALID_TIMESTAMP",
            "updated_at",
            f"updated_at is not an RFC 3339 timestamp with a time zone: {show(value)}",
        )
    return updated_at


def _normalize(rec: object) -> NormalizedHotel:
    """The reference normalizer: the record walked in the contract's order (see the module's
    docstring); the first ADAPTER problem raises at once, VALIDATION ones are collected."""
    if not isinstance(rec, dict):
        if type(rec) is UndecodableRecord:
            raise _Reject(ADAPTER, rec.error_code, None, rec.message)
        raise _Reject(ADAPTER, "NOT_AN_OBJECT", None, f"the record is {_kind(rec)}, not an object")
    _required(rec)
    get = rec.get
    errs: _Errors = []
    hotel_id = _string(_HOTEL_ID, rec["hotel_id"], errs)
    name = _string(_NAME, rec["name"], errs)
    name_local = _string(_NAME_LOCAL, get("name_local"), errs)
    city_code = _string(_CITY_CODE, rec["city_code"], errs)
    country = _country(rec["country_code"], errs)
    line1, postal = _address(get("address"), errs)
    lat, lng = _geo(rec["geo"], errs)
    star = _star(get("star_rating"), errs)
    phone = _phone(get("phone"), country, errs)
    email = _email(get("email"), errs)
    facilities = _facilities(get("facilities"), errs)
    images = _images(get("images"), errs)
    rooms = _rooms(get("rooms"), errs)
    status = _status(rec["status"], errs)
    updated_at = _updated_at(rec["updated_at"])
    version = _integer(rec["version"], "version")
    _in_range(version, 0, MAX_VERSION, "VALUE_OUT_OF_RANGE", "version", "0..2**63-1", errs)
    if errs:
        code, path, why = errs[0]
        raise _Reject(VALIDATION, code, _path(path), f"{_path(path)} {why}")
    return _assemble(
        NormalizedHotel,
        {
            "supplier_hotel_id": hotel_id,
            "name": name,
            "name_local": name_local,
            "city_code": city_code,
            "country_code": country,
            "address_line1": line1,
            "postal_code": postal,
            "lat": float(lat) + 0.0,  # + 0.0 turns -0.0 into 0.0: one spelling per value
            "lng": float(lng) + 0.0,
            "star_rating": star,
            "phone_e164": phone,
            "email": email,
            "facilities": facilities,
            "images": images,
            "rooms": rooms,
            "status": status,
            "updated_at": updated_at,
            "version": version,
        },
    )


# -- fast path: the usual clean record, built straight into its document -------------------
#
# Each value's shape is tested inline against its row of rules.STRING_FIELDS, since a call per
# value would cost more than the test; anything unusual is left to _normalize. A printable
# string holds no tab/CR/LF, so collapsing it is stripping and squeezing spaces.


def _fast(rec: dict[str, Any]) -> dict[str, Any] | None:
    """The usual clean record, as ``to_primitive(_normalize(rec))``; None if unusual.

    It accepts only what :func:`_normalize` (the reference) accepts, and returns what
    ``to_primitive(_normalize(rec))`` returns, built directly (no model objects on the way);
    anything else (a problem, or merely an unusual spelling such as a lower-case country, an
    integer amount or a tab in a name) returns None and goes through :func:`_normalize`. The
    tests compare both paths on simulator records, on fuzzed ones and on each shape of every
    string field's row.
    """
    get = rec.get
    hotel_id = get("hotel_id")
    name = get("name")
    city_code = get("city_code")
    country = get("country_code")
    if not (
        type(hotel_id) is str
        and 0 < len(hotel_id) <= _HOTEL_ID.limit
        and hotel_id.isprintable()
        and type(name) is str
        and len(name) <= _NAME.limit
        and (name.isprintable() or formats_only(name))
        and not might_hold_html(name)
        and type(city_code) is str
        and 0 < len(city_code) <= _CITY_CODE.limit
        and city_code.isprintable()
        and type(country) is str
        and country in COUNTRY_CODES
    ):
        return None
    name = name.strip(" ")
    if "  " in name:
        name = WS_RE.sub(" ", name)
    if not name:
        return None
    name_local = get("name_local")
    if name_local is not None:
        if not (
            type(name_local) is str
            and len(name_local) <= _NAME_LOCAL.limit
            and (name_local.isprintable() or formats_only(name_local))
            and not might_hold_html(name_local)
        ):
            return None
        name_local = collapse(name_local) or None

    geo = get("geo")
    if type(geo) is not dict:
        return None
    lat = geo.get("lat")
    lng = geo.get("lng")
    if not (
        (type(lat) is float or type(lat) is int)
        and LAT_MIN <= lat <= LAT_MAX
        and (type(lng) is float or type(lng) is int)
        and LNG_MIN <= lng <= LNG_MAX
    ):
        return None
    star = get("star_rating")
    if star is not None:
        if type(star) is not float and type(star) is not int:
            return None
        star = STAR_BY_VALUE.get(star)
        if star is None:
            return None

    contact = _fast_contact(get("address"), get("phone"), get("email"), country)
    facilities = _fast_facilities(get("facilities"))
    images = _fast_images(get("images"))
    rooms = _fast_rooms(get("rooms"))
    if contact is None or facilities is None or images is None or rooms is None:
        return None
    status = get("status")
    ts = get("updated_at")
    version = get("version")
    if not (
        type(status) is str
        and status in STATUSES
        and type(ts) is str
        and type(version) is int
        and 0 <= version <= MAX_VERSION
    ):
        return None
    updated_at = parse_timestamp(ts)
    if updated_at is None:
        return None
    if not (len(ts) == 20 and ts[19] == "Z" and ts[10] == "T"):
        # A valid timestamp spelled YYYY-MM-DDTHH:MM:SSZ is already its canonical form.
        ts = _timestamp(updated_at)
    line1, postal, phone, email = contact
    return {
        "supplier_hotel_id": hotel_id,
        "name": name,
        "name_local": name_local,
        "city_code": city_code,
        "country_code": country,
        "address_line1": line1,
        "postal_code": postal,
        "lat": float(lat) + 0.0,
        "lng": float(lng) + 0.0,
        "star_rating": None if star is None else str(star),
        "phone_e164": phone,
        "email": email,
        "facilities": facilities,
        "images": images,
        "rooms": rooms,
        "status": status,
        "updated_at": ts,
        "version": version,
    }


_NO_CONTACT: Final = (None, None, None, None)


def _fast_contact(
    address: object, phone: object, email: object, country: str
) -> tuple[str | None, str | None, str | None, str | None] | None:
    """(address line 1, postal code, E.164 phone, email), or None if one is unusual."""
    if address is None and phone is None and email is None:
        return _NO_CONTACT
    line1 = postal = None
    if address is not None:
        if type(address) is not dict:
            return None
        line1 = address.get("line1")
        if line1 is not None:
            if not (
                type(line1) is str
                and len(line1) <= _LINE1.limit
                and (line1.isprintable() or formats_only(line1))
            ):
                return None
            line1 = collapse(line1) or None
        postal = address.get("postal_code")
        if postal is not None:
            if not (
                type(postal) is str and len(postal) <= _POSTAL_CODE.limit and postal.isprintable()
            ):
                return None
            postal = collapse(postal) or None
    if phone is not None:
        if not (type(phone) is str and len(phone) <= _PHONE.limit and phone.isprintable()):
            return None
        text = collapse(phone)
        phone = phone_e164(text, country) if text else None
        if text and phone is None:
            return None
    if email is not None:
        if not (type(email) is str and len(email) <= _EMAIL.limit and email.isprintable()):
            return None
        email = collapse(email) or None
        if email is not None and EMAIL_RE.fullmatch(email) is None:
            return None
    return line1, postal, phone, email


def _fast_facilities(raw: object) -> list[str] | None:
    """The facilities, trimmed, lower-cased and deduplicated; None if one is unusual."""
    if raw is None:
        return []
    if type(raw) is not list or len(raw) > FACILITIES_MAX:
        return None
    facilities: dict[str, None] = {}
    limit = _FACILITY.limit
    for item in raw:
        if not (type(item) is str and len(item) <= limit and item.isprintable()):
            return None
        item = item.strip(" ")
        if "  " in item:
            item = WS_RE.sub(" ", item)
        if item:
            facilities[item.lower()] = None
    return list(facilities)


def _fast_images(raw: object) -> list[dict[str, Any]] | None:
    """The images as documents; None if one is unusual."""
    if raw is None:
        return []
    if type(raw) is not list or len(raw) > IMAGES_MAX:
        return None
    images: list[dict[str, Any]] = []
    for img in raw:
        if type(img) is not dict:
            return None
        url = img.get("url")
        caption = img.get("caption")
        if not (
            type(url) is str
            and len(url) <= _URL.limit
            and url.isprintable()
            and URL_RE.fullmatch(url) is not None
        ):
            return None
        if caption is not None:
            if not (
                type(caption) is str
                and len(caption) <= _CAPTION.limit
                and (caption.isprintable() or formats_only(caption))
            ):
                return None
            caption = caption.strip(" ")
            if "  " in caption:
                caption = WS_RE.sub(" ", caption)
            caption = caption or None
        images.append({"url": url, "caption": caption})
    return images


def _fast_rooms(raw: object) -> list[dict[str, Any]] | None:
    """The rooms as documents, each with its rate plans; None if one is unusual."""
    if raw is None:
        return []
    if type(raw) is not list or len(raw) > ROOMS_MAX:
        return None
    rooms: list[dict[str, Any]] = []
    room_codes: set[str] = set()
    for room in raw:
        if type(room) is not dict:
            return None
        rget = room.get
        room_code = rget("room_code")
        room_name = rget("name")
        bed = rget("bed_type")
        occupancy = rget("max_occupancy")
        if not (
            type(room_code) is str
            and 0 < len(room_code) <= _ROOM_CODE.limit
            and room_code.isprintable()
            and room_code not in room_codes
            and type(room_name) is str
            and len(room_name) <= _ROOM_NAME.limit
            and (room_name.isprintable() or formats_only(room_name))
            and not might_hold_html(room_name)
            and (
                bed is None
                or (type(bed) is str and 0 < len(bed) <= _BED_TYPE.limit and bed.isprintable())
            )
            and type(occupancy) is int
            and 1 <= occupancy <= OCCUPANCY_MAX
        ):
            return None
        room_codes.add(room_code)
        room_name = room_name.strip(" ")
        if "  " in room_name:
            room_name = WS_RE.sub(" ", room_name)
        if not room_name:
            return None
        plans = _fast_plans(rget("rate_plans"))
        if plans is None:
            return None
        rooms.append(
            {
                "room_code": room_code,
                "name": room_name,
                "bed_type": bed,
                "max_occupancy": occupancy,
                "rate_plans": plans,
            }
        )
    return rooms


def _fast_plans(raw: object) -> list[dict[str, Any]] | None:
    """A room's rate plans as documents; None if one is unusual."""
    if raw is None:
        return []
    if type(raw) is not list or len(raw) > RATE_PLANS_MAX:
        return None
    plans: list[dict[str, Any]] = []
    plan_codes: set[str] = set()
    for plan in raw:
        if type(plan) is not dict:
            return None
        pget = plan.get
        code = pget("code")
        board = pget("board")
        refundable = pget("refundable")
        available = pget("available")
        price = pget("price")
        if not (
            type(code) is str
            and 0 < len(code) <= _PLAN_CODE.limit
            and code.isprintable()
            and code not in plan_codes
            and (
                board is None
                or (type(board) is str and 0 < len(board) <= _BOARD.limit and board.isprintable())
            )
            and (refundable is True or refundable is False)
            and (available is True or available is False)
            and type(price) is dict
        ):
            return None
        amount = price.get("amount")
        currency = price.get("currency")
        if not (
            type(amount) is str
            and len(amount) <= AMOUNT_MAX
            and UNSIGNED_AMOUNT_RE.fullmatch(amount) is not None
            and type(currency) is str
            and currency in MONEY_CODES
        ):
            return None
        plan_codes.add(code)
        if amount[0] == "0" and amount[:2] != "0." and amount != "0":
            # "007.50" is "7.50", as the model says. A plain amount without a leading zero
            # (at most 6 fraction digits) is its Decimal's own string.
            amount = str(Decimal(amount))
        plans.append(
            {
                "code": code,
                "board": board,
                "refundable": refundable,
                "available": available,
                "price": amount,
                "currency": currency,
            }
        )
    return plans


# -- public API -----------------------------------------------------------------------------


def normalize_record(record: object) -> NormalizedHotel | Rejection:
    """Normalize one supplier hotel record, or say precisely why it cannot be.

    Never raises: any input (wrong type, hostile strings, huge values) gives a
    :class:`NormalizedHotel` or a :class:`Rejection`.

    Args:
        record: one element of a page's ``hotels`` list, as decoded from JSON.

    Returns:
        The hotel in the platform's model, or the first (most fundamental) problem found.
    """
    try:
        return _normalize(record)
    except _Reject as r:
        return Rejection(
            _readable_id(record),
            r.stage,
            r.code,
            r.path,
            r.message[:MESSAGE_MAX],
            _readable_version(record),
        )
    except Exception as exc:  # a bug must cost one record, never the page
        return Rejection(
            _readable_id(record),
            "ADAPTER",
            "INTERNAL_ERROR",
            None,
            f"normalizer failed: {type(exc).__name__}: {show(str(exc))}"[:MESSAGE_MAX],
            _readable_version(record),
        )


@dataclass
class NormalizeResult:
    """The outcome of normalizing one page of records.

    Attributes:
        hotels: normalized hotels, in input order.
        rejections: rejections, in input order.
        hotel_index: ``hotel_index[i]`` is the position in the input of ``hotels[i]``.
        rejection_index: ``rejection_index[i]`` is the position in the input of
            ``rejections[i]``.
    """

    hotels: list[NormalizedHotel] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    hotel_index: list[int] = field(default_factory=list)
    rejection_index: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Number of input records (``len(hotels) + len(rejections)``)."""
        return len(self.hotels) + len(self.rejections)

    def outcomes(self) -> list[NormalizedHotel | Rejection]:
        """One outcome per input record, in input order."""
        out: list[NormalizedHotel | Rejection | None] = [None] * self.total
        for i, hotel in zip(self.hotel_index, self.hotels, strict=True):
            out[i] = hotel
        for i, rejection in zip(self.rejection_index, self.rejections, strict=True):
            out[i] = rejection
        return [o for o in out if o is not None]


def normalize_records(records: Iterable[object]) -> NormalizeResult:
    """Normalize a page of records; each one independently of the others.

    Args:
        records: the page's ``hotels`` list, as decoded from JSON.

    Returns:
        Hotels and rejections, each with its position in ``records``.
    """
    result = NormalizeResult()
    hotels, hotel_index = result.hotels, result.hotel_index
    rejections, rejection_index = result.rejections, result.rejection_index
    for i, record in enumerate(records):
        out = normalize_record(record)
        if type(out) is Rejection:
            rejections.append(out)
            rejection_index.append(i)
        else:
            hotels.append(out)  # type: ignore[arg-type]
            hotel_index.append(i)
    return result


@dataclass
class NormalizedDocuments:
    """The outcome of normalizing one page of records, hotels in primitive form.

    Attributes:
        docs: normalized hotels as :func:`to_primitive` gives them, in input order.
        rejections: rejections, in input order.
        doc_index: ``doc_index[i]`` is the position in the input of ``docs[i]``.
        rejection_index: ``rejection_index[i]`` is the position in the input of
            ``rejections[i]``.
    """

    docs: list[dict[str, Any]] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    doc_index: list[int] = field(default_factory=list)
    rejection_index: list[int] = field(default_factory=list)


def normalize_documents(
    records: Iterable[object], *, not_after: dt.datetime | None = None
) -> NormalizedDocuments:
    """:func:`normalize_records`, each hotel as ``to_primitive`` of it: what a sync stores.

    The usual clean record takes a fast path that builds the primitive document directly;
    every other record goes through the reference normalizer, so the outcome is the same.
    A record that normalizes but whose ``updated_at`` is after ``not_after`` is rejected
    with ``FUTURE_TIMESTAMP`` (VALIDATION): one supplier clock far ahead would otherwise
    publish a time no later change can pass, and blind an incremental task's watermark.

    Args:
        records: the page's ``hotels`` list, as decoded from JSON.
        not_after: the latest ``updated_at`` a record may carry (aware): the database
            clock plus the allowed skew; None checks nothing.

    Returns:
        Documents and rejections, each with its position in ``records``.
    """
    result = NormalizedDocuments()
    docs, doc_index = result.docs, result.doc_index
    for i, record in enumerate(records):
        doc = None
        if type(record) is dict:
            try:
                doc = _fast(record)
            except Exception:  # a bug in the fast path: the reference path reports it
                doc = None
        if doc is None:
            out = normalize_record(record)
            if type(out) is Rejection:
                result.rejections.append(out)
                result.rejection_index.append(i)
                continue
            doc = to_primitive(out)  # type: ignore[arg-type]
        if not_after is not None and dt.datetime.fromisoformat(doc["updated_at"]) > not_after:
            result.rejections.append(_future(record, doc["updated_at"], not_after))
            result.rejection_index.append(i)
            continue
        docs.append(doc)
        doc_index.append(i)
    return result


def _future(record: object, updated_at: str, not_after: dt.datetime) -> Rejection:
    """The ``FUTURE_TIMESTAMP`` rejection of a record dated after ``not_after``."""
    return Rejection(
        _readable_id(record),
        VALIDATION,
        "FUTURE_TIMESTAMP",
        "updated_at",
        f"updated_at {updated_at} is after {_timestamp(not_after.astimezone(dt.UTC))}, the "
        "database clock plus the allowed clock skew",
        _readable_version(record),
    )


# -- canonical form, fingerprints and the content / price split ------------------------------


def _timestamp(value: dt.datetime) -> str:
    return value.isoformat().replace("+00:00", "Z")


def _rate_plan_primitive(p: RatePlan) -> dict[str, Any]:
    return {
        "code": p.code,
        "board": p.board,
        "refundable": p.refundable,
        "available": p.available,
        "price": str(p.price),
        "currency": p.currency,
    }


def to_primitive(hotel: NormalizedHotel) -> dict[str, Any]:
    """The hotel as JSON-ready primitives: ``Decimal`` as string, time as RFC 3339 UTC.

    Args:
        hotel: a normalized hotel.

    Returns:
        A dict of str/int/float/bool/None/list/dict only.
    """
    return {
        "supplier_hotel_id": hotel.supplier_hotel_id,
        "name": hotel.name,
        "name_local": hotel.name_local,
        "city_code": hotel.city_code,
        "country_code": hotel.country_code,
        "address_line1": hotel.address_line1,
        "postal_code": hotel.postal_code,
        "lat": hotel.lat,
        "lng": hotel.lng,
        "star_rating": None if hotel.star_rating is None else str(hotel.star_rating),
        "phone_e164": hotel.phone_e164,
        "email": hotel.email,
        "facilities": list(hotel.facilities),
        "images": [{"url": i.url, "caption": i.caption} for i in hotel.images],
        "rooms": [
            {
                "room_code": r.room_code,
                "name": r.name,
                "bed_type": r.bed_type,
                "max_occupancy": r.max_occupancy,
                "rate_plans": [_rate_plan_primitive(p) for p in r.rate_plans],
            }
            for r in hotel.rooms
        ],
        "status": hotel.status,
        "updated_at": _timestamp(hotel.updated_at),
        "version": hotel.version,
    }


_SORTED: Final = orjson.OPT_SORT_KEYS


def _dumps(value: object) -> bytes:
    # orjson: the same compact, sorted, UTF-8 form as the standard library's encoder (only
    # float exponents differ: 1e-7, not 1e-07) at a fraction of the cost; this runs for
    # every hotel of every sync. Primitive documents only (to_primitive), so no NaN here.
    return orjson.dumps(value, option=_SORTED)


def loads_canonical(data: bytes) -> Any:
    """Decodes JSON written by :func:`canonical_dumps` (our own output, so orjson is exact).

    Untrusted supplier bytes are decoded by the standard library instead: orjson reads an
    integer beyond 64 bits as a float, which would change what the quality checks see.
    """
    return orjson.loads(data)


def canonical_dumps(doc: Mapping[str, Any]) -> bytes:
    """Canonical JSON of a hotel already in primitive form (:func:`to_primitive`)."""
    return _dumps(doc)


def canonical_lines(docs: Iterable[Mapping[str, Any]]) -> list[bytes]:
    """:func:`canonical_dumps` of each document, in one call for a page of them."""
    dumps = orjson.dumps
    return [dumps(doc, option=_SORTED) for doc in docs]


def canonical_json(hotel: NormalizedHotel) -> bytes:
    """The hotel's canonical JSON: sorted keys, no spaces, UTF-8, ``Decimal`` as string.

    The same hotel always gives the same bytes, whatever the key order of the record it came
    from; used for hashing and for NORMALIZED snapshots.

    Args:
        hotel: a normalized hotel.

    Returns:
        UTF-8 JSON bytes.
    """
    return _dumps(to_primitive(hotel))


def fingerprint(hotel: NormalizedHotel) -> str:
    """SHA-256 (hex) of :func:`canonical_json`."""
    return hashlib.sha256(canonical_json(hotel)).hexdigest()


def content_fields(hotel: NormalizedHotel) -> dict[str, Any]:
    """Everything that is content: the hotel minus prices, availability and bookkeeping.

    Rate plans keep ``code``, ``board`` and ``refundable``; their ``price``, ``currency`` and
    ``available`` are in :func:`price_fields`. ``version`` and ``updated_at`` are left out:
    they change with every change, so they would make every price change look like a
    content change.

    Args:
        hotel: a normalized hotel.

    Returns:
        JSON-ready primitives.
    """
    data = to_primitive(hotel)
    del data["version"], data["updated_at"]
    for room in data["rooms"]:
        for plan in room["rate_plans"]:
            del plan["price"], plan["currency"], plan["available"]
    return data


def price_fields(hotel: NormalizedHotel) -> dict[tuple[str, str], tuple[Decimal, str, bool]]:
    """Price and stock per rate plan: ``(room_code, rate_plan_code) -> (price, currency, available)``.

    Args:
        hotel: a normalized hotel.

    Returns:
        One entry per rate plan (codes are unique within a hotel/room).
    """
    return {
        (room.room_code, plan.code): (plan.price, plan.currency, plan.available)
        for room in hotel.rooms
        for plan in room.rate_plans
    }


def content_fingerprint(hotel: NormalizedHotel) -> str:
    """SHA-256 (hex) of the canonical JSON of :func:`content_fields`."""
    return hashlib.sha256(_dumps(content_fields(hotel))).hexdigest()


def price_fingerprint(hotel: NormalizedHotel) -> str:
    """SHA-256 (hex) of the canonical JSON of :func:`price_fields`, in key order."""
    rows = sorted(
        [room, code, str(price), currency, available]
        for (room, code), (price, currency, available) in price_fields(hotel).items()
    )
    return hashlib.sha256(_dumps(rows)).hexdigest()
