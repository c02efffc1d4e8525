"""The rules of a supplier hotel record, in one place: limits, code lists and predicates.

Every check on a record's values is stated here once and used by everything that checks a
record: the reference normalizer and its fast path and the models' validators
(:mod:`~supplier_sync_dagster.core.records.normalize`), the row-level quality schemas
(:mod:`~supplier_sync_dagster.core.records.quality`) and the supplier's typed :class:`Hotel` model
(:mod:`~supplier_sync_dagster.core.supplier.models`). Change a rule here and every path
follows; the tests check each limit at its boundary on both normalization paths.

What is here:

- :data:`LIMITS`, the length limits of strings and lists, and :data:`MAX_VERSION`,
  :data:`MAX_AMOUNT_INT`, the coordinate bounds and :data:`STATUSES`;
- :data:`STRING_FIELDS`, every string field of a hotel with its place in a supplier's record
  and in a normalized document, its limit and the rule it follows (identifier or free text,
  name, required or not);
- the code lists: :data:`COUNTRY_CODES` (ISO 3166-1 alpha-2 plus Kosovo) and
  :data:`MONEY_CODES` (ISO 4217 minus what is not money), and the half-step star ratings;
- predicates on one value: :func:`string_problem` (length, control characters, lone
  surrogates, HTML in names), :func:`collapse`, :func:`country`,
  :func:`currency`, :func:`phone_e164`, :func:`star`, :func:`email_ok`, :func:`url_ok`,
  :func:`parse_timestamp`, :func:`might_hold_html`;
- :func:`show`, how an offending value appears in an error message.

Predicates are plain functions on plain values, with no model or frame in sight. The fast path
of normalization inlines only the cheapest shape tests (``type``, a length from here,
``isprintable``), where a call per value would cost more than the test.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Final

import phonenumbers
import pycountry

__all__ = [
    "COUNTRY_CODES",
    "LAT_MAX",
    "LAT_MIN",
    "LIMITS",
    "LNG_MAX",
    "LNG_MIN",
    "MAX_AMOUNT_INT",
    "MAX_VERSION",
    "MESSAGE_MAX",
    "MONEY_CODES",
    "NO_CURRENCY",
    "REQUIRED_FIELDS",
    "STARS",
    "STAR_BY_VALUE",
    "STATUSES",
    "STRING_FIELDS",
    "STRING_FIELDS_BY_SOURCE",
    "StringField",
    "collapse",
    "country",
    "currency",
    "email_ok",
    "formats_only",
    "might_hold_html",
    "parse_timestamp",
    "phone_e164",
    "show",
    "star",
    "string_problem",
    "url_ok",
]

# -- limits ---------------------------------------------------------------------------------

REQUIRED_FIELDS: Final = (
    "hotel_id",
    "name",
    "city_code",
    "country_code",
    "geo",
    "status",
    "updated_at",
    "version",
)
"""Top-level fields the contract requires, in the order they are checked."""

LIMITS: Final[dict[str, int]] = {
    "hotel_id": 128,
    "city_code": 64,
    "code": 64,  # room_code, rate plan code, board, bed_type
    "name": 255,  # name, name_local, room name
    "address_line1": 512,
    "postal_code": 32,
    "phone": 64,
    "email": 254,
    "facility": 64,
    "caption": 512,
    "url": 2048,
    "timestamp": 64,
    "amount": 40,
    "facilities": 256,  # items
    "images": 256,
    "rooms": 256,
    "rate_plans": 64,  # per room
    "max_occupancy": 100,
}
"""Length limits in characters (strings) or items (lists), and the max room occupancy."""

# The same limits by name, for the per-record paths (a name is cheaper than a look-up).
HOTEL_ID_MAX: Final = LIMITS["hotel_id"]
CITY_CODE_MAX: Final = LIMITS["city_code"]
CODE_MAX: Final = LIMITS["code"]
NAME_MAX: Final = LIMITS["name"]
ADDRESS_MAX: Final = LIMITS["address_line1"]
POSTAL_CODE_MAX: Final = LIMITS["postal_code"]
PHONE_MAX: Final = LIMITS["phone"]
EMAIL_MAX: Final = LIMITS["email"]
FACILITY_MAX: Final = LIMITS["facility"]
CAPTION_MAX: Final = LIMITS["caption"]
URL_MAX: Final = LIMITS["url"]
TIMESTAMP_MAX: Final = LIMITS["timestamp"]
AMOUNT_MAX: Final = LIMITS["amount"]
FACILITIES_MAX: Final = LIMITS["facilities"]
IMAGES_MAX: Final = LIMITS["images"]
ROOMS_MAX: Final = LIMITS["rooms"]
RATE_PLANS_MAX: Final = LIMITS["rate_plans"]
OCCUPANCY_MAX: Final = LIMITS["max_occupancy"]


@dataclass(frozen=True, slots=True)
class StringField:
    """A string field of a hotel and the rule it follows, wherever it is checked.

    Attributes:
        source: where a supplier's record holds it, ``[]`` standing for each item of a list
            (``rooms[].rate_plans[].board``).
        field: where a normalized document holds it, ``{k}`` and ``{j}`` standing for the
            position of the item and of its rate plan (``rooms[{k}].rate_plans[{j}].board``).
        limit: its length limit in characters (:data:`LIMITS`).
        verbatim: an identifier or a code, kept as sent: no control character at all (tab
            and newline included), and an empty one is no value. Otherwise free text: tab,
            CR and LF are allowed (:func:`collapse` turns each run of white space into one
            space), and a blank one is no value.
        html: a name, where HTML markup is not allowed.
        required: a record needs a value here, and a document always holds a string here
            (a list's blank item is dropped instead); otherwise "no value" is null.
    """

    source: str
    field: str
    limit: int
    verbatim: bool = False
    html: bool = False
    required: bool = True


STRING_FIELDS: Final = (
    StringField("hotel_id", "supplier_hotel_id", HOTEL_ID_MAX, verbatim=True),
    StringField("name", "name", NAME_MAX, html=True),
    StringField("name_local", "name_local", NAME_MAX, html=True, required=False),
    StringField("city_code", "city_code", CITY_CODE_MAX, verbatim=True),
    StringField("address.line1", "address_line1", ADDRESS_MAX, required=False),
    StringField("address.postal_code", "postal_code", POSTAL_CODE_MAX, required=False),
    StringField("phone", "phone_e164", PHONE_MAX, required=False),
    StringField("email", "email", EMAIL_MAX, required=False),
    StringField("updated_at", "updated_at", TIMESTAMP_MAX, verbatim=True),
    StringField("facilities[]", "facilities[{k}]", FACILITY_MAX),
    StringField("images[].url", "images[{k}].url", URL_MAX, verbatim=True),
    StringField("images[].caption", "images[{k}].caption", CAPTION_MAX, required=False),
    StringField("rooms[].room_code", "rooms[{k}].room_code", CODE_MAX, verbatim=True),
    StringField("rooms[].name", "rooms[{k}].name", NAME_MAX, html=True),
    StringField("rooms[].bed_type", "rooms[{k}].bed_type", CODE_MAX, verbatim=True, required=False),
    StringField(
        "rooms[].rate_plans[].code", "rooms[{k}].rate_plans[{j}].code", CODE_MAX, verbatim=True
    ),
    StringField(
        "rooms[].rate_plans[].board",
        "rooms[{k}].rate_plans[{j}].board",
        CODE_MAX,
        verbatim=True,
        required=False,
    ),
)
"""Every string field of a hotel, top-level ones first, each part in document order.

Normalization (both paths, and the models' validators) and the row-level quality checks
read these rows; quality reports the first failing field in this order. A timestamp and an
image URL have rules of their own beyond these (:func:`parse_timestamp`, :func:`url_ok`)."""

STRING_FIELDS_BY_SOURCE: Final = {f.source: f for f in STRING_FIELDS}
""":data:`STRING_FIELDS` by their ``source``."""


MAX_VERSION: Final = 2**63 - 1  # a signed BIGINT
MAX_AMOUNT_INT: Final = 10**15  # an integer amount must be below this (15 integer digits)
LAT_MIN: Final = -90
LAT_MAX: Final = 90
LNG_MIN: Final = -180
LNG_MAX: Final = 180
STATUSES: Final = ("ACTIVE", "INACTIVE")
SHOW_MAX: Final = 200
"""An offending value is shown in at most this many characters."""
MESSAGE_MAX: Final = 1024
"""A rejection's or failure's message is at most this many characters."""

# -- code lists -----------------------------------------------------------------------------

NO_CURRENCY: Final = frozenset({"XXX", "XTS"})
"""ISO 4217 codes for "no currency" and for testing: never a real price."""
# Codes that pycountry lists but that are not money a hotel can be priced in.
_NOT_MONEY: Final = NO_CURRENCY | frozenset(
    {"XAU", "XAG", "XPD", "XPT", "XBA", "XBB", "XBC", "XBD", "XDR", "XSU", "XUA"}
)
# User-assigned country codes in wide use that pycountry does not list (Kosovo).
_EXTRA_COUNTRIES: Final = frozenset({"XK"})

# Loaded once at import: membership tests are far cheaper than pycountry look-ups.
COUNTRY_CODES: Final = frozenset(c.alpha_2 for c in pycountry.countries) | _EXTRA_COUNTRIES
"""Upper-case ISO 3166-1 alpha-2 codes a hotel's country may have."""
MONEY_CODES: Final = frozenset(c.alpha_3 for c in pycountry.currencies) - _NOT_MONEY
"""Upper-case ISO 4217 codes a price may be in (no metals, funds, test or no-currency codes)."""

STARS: Final = tuple(Decimal(f"{k / 2:.1f}") for k in range(11))
"""Every star rating, 0 to 5 in half steps, in its one spelling."""
STAR_BY_VALUE: Final[dict[float | Decimal, Decimal]] = {k / 2: s for k, s in enumerate(STARS)}
"""A star rating as a JSON number (int or float) -> its :data:`STARS` entry."""

# -- patterns -------------------------------------------------------------------------------

# Free text may carry \t \n \r (collapsed); every other C0/C1 control character is rejected.
_TEXT_CONTROL_RE: Final = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
CODE_CONTROL_RE: Final = re.compile("[\x00-\x1f\x7f-\x9f]")
"""Codes are verbatim identifiers, and collapsed text keeps no tab/CR/LF: no C0/C1 at all."""
_SURROGATE_RE: Final = re.compile("[\ud800-\udfff]")
WS_RE: Final = re.compile("[ \t\n\r]+")
"""A run of the white space that free text collapses into one space."""
# A tag needs a letter right after "<" (as HTML parsers do), so "Hotel <3" is not markup.
_HTML_RE: Final = re.compile(
    r"</?[a-z][a-z0-9-]*(?:[\s/][^>]*)?>|<!--|<\s*script|\bon[a-z]+\s*=|javascript\s*:",
    re.IGNORECASE,
)
UNSIGNED_AMOUNT_RE: Final = re.compile(r"[0-9]{1,15}(?:\.[0-9]{1,6})?")
"""A price amount that is not negative (see :data:`AMOUNT_RE`)."""
AMOUNT_RE: Final = re.compile("-?" + UNSIGNED_AMOUNT_RE.pattern)
"""A price amount as a string: a plain decimal, at most 15 integer and 6 fraction digits."""
_TS_RE: Final = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?"
    r"(?:[Zz]|([+-])([0-9]{2}):([0-9]{2}))"
)
EMAIL_RE: Final = re.compile(r"[^@\s]+@[^@\s.]+(?:\.[^@\s.]+)+")
"""One local part, one @ and a dotted domain, without spaces."""
URL_RE: Final = re.compile(r"https?://[^\s/?#@]+(?:[/?#]\S*)?", re.IGNORECASE)
"""An absolute http(s) URL without spaces (see :func:`url_ok`)."""
E164_SHAPE: Final = (
    r"\+(?=[0-9]{7,15}\Z)(?:"
    + "|".join(str(c) for c in sorted(phonenumbers.COUNTRY_CODE_TO_REGION_CODE, reverse=True))
    + r")[0-9]+"
)
"""A regex for the shape of E.164 (``+``, a calling code that exists, 7-15 digits), for
vectorised checks; :func:`phone_e164` is the full rule."""


# -- predicates -----------------------------------------------------------------------------


def country(raw: str) -> str | None:
    """The upper-case ISO 3166-1 alpha-2 code for ``raw`` (any case), else None."""
    if len(raw) != 2 or not raw.isascii():
        return None
    code = raw.upper()
    return code if code in COUNTRY_CODES else None


def currency(raw: str) -> str | None:
    """The upper-case ISO 4217 code for ``raw`` (any case) if it is money, else None."""
    if len(raw) != 3 or not raw.isascii():
        return None
    code = raw.upper()
    return code if code in MONEY_CODES else None


# phonenumbers compiles its metadata's patterns through re.compile, whose cache is bounded:
# numbers of many countries (a supplier's cities) would evict them, and parses recompile
# them. Its own pattern cache keeps every one.
phonenumbers.enable_pattern_cache()


@functools.lru_cache(maxsize=65536)
def phone_e164(raw: str, region: str) -> str | None:
    """``raw`` parsed with ``region`` as the default region, in E.164, if it is valid.

    ``region`` ``"ZZ"`` (unknown) accepts only numbers written with ``+`` and a calling code.
    """
    try:
        number = phonenumbers.parse(raw, region)
        if not phonenumbers.is_valid_number(number):
            return None
        return phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)
    except Exception:  # libphonenumber rejects junk with exceptions; junk is just "invalid"
        return None


def star(value: float | Decimal) -> Decimal | None:
    """The star rating of a number: 0 to 5 in half steps, else None (NaN included).

    A ``Decimal`` compares and hashes equal to the float of the same value, so ``4.50`` is
    ``4.5`` and ``4.500001`` is no rating, whichever type it comes in.
    """
    return STAR_BY_VALUE.get(value)


@functools.lru_cache(maxsize=64)
def _offset(sign: str, hours: str, minutes: str) -> dt.timezone:
    if hours > "23" or minutes > "59":
        raise ValueError(f"offset out of range: {sign}{hours}:{minutes}")
    delta = dt.timedelta(hours=int(hours), minutes=int(minutes))
    return dt.timezone(-delta if sign == "-" else delta)


def parse_timestamp(raw: str) -> dt.datetime | None:
    """An RFC 3339 timestamp (with a time zone) as an aware UTC datetime, else None."""
    if len(raw) > TIMESTAMP_MAX:
        return None
    m = _TS_RE.fullmatch(raw)
    if m is None:
        return None
    year, month, day, hour, minute, second, frac, sign, oh, om = m.groups()
    try:
        tz = dt.UTC if sign is None or (oh == "00" and om == "00") else _offset(sign, oh, om)
        value = dt.datetime(
            int(year),
            int(month),
            int(day),
            int(hour),
            int(minute),
            int(second),
            int(frac[:6].ljust(6, "0")) if frac else 0,
            tzinfo=tz,
        )
        return value if tz is dt.UTC else value.astimezone(dt.UTC)
    except (ValueError, OverflowError):
        return None


def might_hold_html(value: str) -> bool:
    """Whether ``value`` holds a character that HTML markup needs; False rules markup out.

    The cheap pre-filter of the HTML rule: names rarely hold any of ``<``, ``=``, ``:``.
    """
    return "<" in value or "=" in value or ":" in value


def string_problem(
    value: str, limit: int, *, verbatim: bool = False, html: bool = False
) -> tuple[str, str] | None:
    """Why string ``value`` is unacceptable, as ``(error code, reason)``, or None.

    Args:
        value: the string as sent.
        limit: its length limit (see :data:`LIMITS`).
        verbatim: it is an identifier or a code, kept as sent, so no control character at
            all is allowed; free text (False) may hold tab/CR/LF, which collapsing turns
            into spaces.
        html: it is a name, where HTML markup is not allowed.
    """
    if len(value) > limit:
        return "OVERSIZED_STRING", f"is {len(value)} characters long, over the limit of {limit}"
    if not value.isprintable():
        if (CODE_CONTROL_RE if verbatim else _TEXT_CONTROL_RE).search(value):
            return "CONTROL_CHARACTERS", "holds control characters"
        if _SURROGATE_RE.search(value):
            return "INVALID_UNICODE", "holds lone surrogates"
    if html and might_hold_html(value) and _HTML_RE.search(value):
        return "HTML_IN_NAME", "holds HTML markup"
    return None


def formats_only(value: str) -> bool:
    """Whether every character of ``value`` that is not printable is harmless in free text
    and kept as sent: no control character (tab, CR and LF included: collapsing changes
    them) and no lone surrogate.

    What is left are format characters and non-ASCII spaces (ZERO WIDTH JOINER in emoji,
    ZERO WIDTH NON-JOINER in Persian, bidirectional marks, a no-break space), which
    :func:`string_problem` accepts and :func:`collapse` keeps: the fast path's test of a
    free-text value that ``str.isprintable`` refuses.
    """
    return CODE_CONTROL_RE.search(value) is None and _SURROGATE_RE.search(value) is None


def collapse(value: str) -> str:
    """Strip, and collapse runs of space/tab/CR/LF into one space."""
    if "  " in value or "\t" in value or "\n" in value or "\r" in value:
        value = WS_RE.sub(" ", value)
    if value[:1] == " " or value[-1:] == " ":
        value = value.strip(" ")
    return value


def email_ok(value: str) -> bool:
    """Whether ``value`` (collapsed) is an email address within its limit."""
    return len(value) <= EMAIL_MAX and EMAIL_RE.fullmatch(value) is not None


def url_ok(value: str) -> bool:
    """Whether ``value`` is an absolute http(s) URL within its limit, without spaces."""
    return len(value) <= URL_MAX and value.isprintable() and URL_RE.fullmatch(value) is not None


# -- showing a value in a message -----------------------------------------------------------


def show(value: object) -> str:
    """``value`` for a log line: never longer than 200 characters, never raw control bytes."""
    if isinstance(value, str):
        shown = repr(value[:SHOW_MAX])
        if len(value) > SHOW_MAX or len(shown) > SHOW_MAX:
            tail = f"...<{len(value)} chars>"
            shown = shown[: SHOW_MAX - len(tail)] + tail
        return shown
    if value is None or value is True or value is False:
        return repr(value)
    if isinstance(value, float):
        return float.__repr__(value)
    if isinstance(value, int):
        if value.bit_length() > 256:
            return f"<integer of {value.bit_length()} bits>"
        return int.__repr__(value)
    if isinstance(value, dict):
        return f"<object with {len(value)} keys>"
    if isinstance(value, list):
        return f"<array of {len(value)} items>"
    return f"<{type(value).__name__[:50]}>"
