"""Row-level quality: a chunk of one city's normalized hotels -> valid, failed, moved, duplicate.

Normalization (:mod:`~supplier_sync_dagster.core.records.normalize`) already rejects records, one at a
time, for parse/shape problems (layer 1), missing required fields (layer 2) and values out of
their domain (layer 3). This module runs over a whole chunk of normalized documents (the
canonical primitive dicts of :func:`~supplier_sync_dagster.core.records.normalize.to_primitive`, as
the pipeline reads them back from NORMALIZED snapshots) and adds:

- layer 3 again, as a second, vectorised net: coordinate ranges, star rating, status, ISO
  3166 country, ISO 4217 currency, non-negative prices, E.164 phone, string lengths and
  control characters. A normalized hotel passes it; a document damaged or built elsewhere
  does not.
- layer 4, cross-field rules: the hotel's country is its city's country
  (``COUNTRY_CITY_MISMATCH``), the rate plans of a room share one currency
  (``MIXED_ROOM_CURRENCY``), a hotel listed twice in the chunk collapses to its highest
  version (a *duplicate*, not an error), and a hotel whose ``city_code`` is another city has
  *moved* (not an error either: the caller routes it to that city instead of publishing it
  under this one).

How: the documents are flattened column-wise into three pandas DataFrames (one row per
hotel; one per string value, with its field and limit; one per rate plan), each validated
once per call by a pandera ``DataFrameModel`` with ``lazy=True``. Every check is named after
the error code it raises, and :data:`RULES` maps ``(frame, check)`` to the field it reports;
``SchemaErrors.failure_cases`` (check, row index) is mapped back to the input position.
Each check is a function over numpy arrays, and the same functions first run over the
chunk's columns before any frame exists (a rule of one value only over a column's distinct
values): when no row fails, which is the usual chunk, neither the frames nor pandera's pass
are needed, and the result is the one pandera would give; a frame where a row fails is built
and validated by pandera, which names every failure case (the other frames, whose rules all
passed, are neither built nor validated). A sync's own chunk, straight from normalization
(``normalized=True``), is not even flattened when what normalization leaves open passes (layer
4, a facility lengthened by lower-casing, the E.164 shape): normalization enforced the same
rows of rules on every value, so the full pass could find nothing else.

Every input position ends in exactly one of ``valid``, ``failures``, ``moved`` and
``duplicates`` of :class:`QualityResult`. A record fails with exactly one
:class:`QualityFailure`, chosen deterministically when it breaks several rules: the first
code in the order of :data:`QUALITY_CODES` (shape, then strings, then layer 3 in document
order, then layer 4), and for one code the first field in document order. Moved hotels are
validated like the others (a broken record is a failure wherever it belongs), and their
country is checked against their own city.

Error types: every code is NON_RETRYABLE (fetching the same supplier data again gives the
same failure) except ``COUNTRY_CITY_MISMATCH``, which is MAPPING_REQUIRED: the record may be
right and the city list wrong (or the other way round), and an operator has to map the
city or the hotel before a replay can publish it.

Cost (``bench/bench_quality.py`` measures it): reading the documents into columns and the
string rules dominate a clean chunk; each distinct phone number not seen before costs a
libphonenumber parse (``parse_phones=False`` skips it). A chunk with a failing row also pays
for the frames and pandera's passes, whose fixed cost per ``validate`` call is why this runs
once per chunk of many hotels, not per page.

Every limit, code list and value check here comes from
:mod:`~supplier_sync_dagster.core.records.rules`, as normalization's do.
"""

from __future__ import annotations

import contextvars
import functools
import operator
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import pandas as pd
import pandera.pandas as pa
from pandera.config import ValidationDepth, config_context
from pandera.typing import Series

from supplier_sync_dagster.core.records.deadletters import DeadLetter, ErrorType
from supplier_sync_dagster.core.records.diff import highest_versions
from supplier_sync_dagster.core.records.normalize import ERROR_CODES
from supplier_sync_dagster.core.records.rules import (
    CODE_CONTROL_RE,
    COUNTRY_CODES,
    E164_SHAPE,
    LAT_MAX,
    LAT_MIN,
    LIMITS,
    LNG_MAX,
    LNG_MIN,
    MESSAGE_MAX,
    MONEY_CODES,
    STATUSES,
    STRING_FIELDS,
    phone_e164,
    show,
)

__all__ = [
    "ERROR_TYPES",
    "QUALITY_CODES",
    "RULES",
    "Duplicate",
    "MovedHotel",
    "QualityFailure",
    "QualityResult",
    "check_quality",
]

_NEW_CODES: Final[dict[str, str]] = {
    "MALFORMED_DOCUMENT": (
        "a normalized document lacks a field or holds a value of the wrong type "
        "(normalization never emits one: a bug or a damaged snapshot)"
    ),
    "COUNTRY_CITY_MISMATCH": "country_code is not the country of the hotel's city (per /v1/cities)",
    "MIXED_ROOM_CURRENCY": "a rate plan's currency differs from the first rate plan of its room",
}

QUALITY_CODES: Final[dict[str, str]] = {
    code: _NEW_CODES.get(code) or ERROR_CODES[code]
    for code in (
        # Precedence order: a record failing several rules reports the first code here.
        "MALFORMED_DOCUMENT",
        "CONTROL_CHARACTERS",
        "OVERSIZED_STRING",
        "LAT_OUT_OF_RANGE",
        "LNG_OUT_OF_RANGE",
        "STAR_RATING_OUT_OF_RANGE",
        "UNKNOWN_STATUS",
        "INVALID_COUNTRY",
        "INVALID_PHONE",
        "VALUE_OUT_OF_RANGE",
        "UNKNOWN_CURRENCY",
        "INVALID_AMOUNT",
        "NEGATIVE_PRICE",
        "COUNTRY_CITY_MISMATCH",
        "MIXED_ROOM_CURRENCY",
    )
}
"""Every code a :class:`QualityFailure` can carry, with its meaning, in precedence order.

Names shared with :data:`normalize.ERROR_CODES` mean the same thing there."""

ERROR_TYPES: Final[dict[str, ErrorType]] = {
    code: ("MAPPING_REQUIRED" if code == "COUNTRY_CITY_MISMATCH" else "NON_RETRYABLE")
    for code in QUALITY_CODES
}
"""The dead-letter error type of each code."""

_RANK: Final = {code: rank for rank, code in enumerate(QUALITY_CODES)}

# -- what a failure says ---------------------------------------------------------------------

_MESSAGES: Final[dict[str, str]] = {
    "CONTROL_CHARACTERS": "{field} holds control characters: {value}",
    "OVERSIZED_STRING": "{field} is {length} characters long, over the limit of {limit}: {value}",
    "LAT_OUT_OF_RANGE": "{field} is not within [-90, 90]: {value}",
    "LNG_OUT_OF_RANGE": "{field} is not within [-180, 180]: {value}",
    "STAR_RATING_OUT_OF_RANGE": "{field} is not within [0, 5] in half steps: {value}",
    "UNKNOWN_STATUS": "{field} is not ACTIVE or INACTIVE: {value}",
    "INVALID_COUNTRY": "{field} is not an ISO 3166-1 alpha-2 code: {value}",
    "INVALID_PHONE": "{field} is not a valid E.164 phone number: {value}",
    "VALUE_OUT_OF_RANGE": "{field} is negative: {value}",
    "UNKNOWN_CURRENCY": "{field} is not an ISO 4217 code of money: {value}",
    "INVALID_AMOUNT": "{field} is not a decimal number: {value}",
    "NEGATIVE_PRICE": "{field} is negative: {value}",
    "COUNTRY_CITY_MISMATCH": "{field} {value} is not the country of city {city} ({expected})",
    "MIXED_ROOM_CURRENCY": (
        "{field} {value} differs from the currency of the room's first rate plan ({expected})"
    ),
}


@dataclass(frozen=True, slots=True)
class Rule:
    """Where a named check reports.

    Attributes:
        frame: ``hotels``, ``strings`` or ``plans``: the DataFrame the check runs on.
        column: the column holding the offending value (for ``hotels``, also the field).
    """

    frame: str
    column: str


RULES: Final[dict[str, Rule]] = {
    "CONTROL_CHARACTERS": Rule("strings", "value"),
    "OVERSIZED_STRING": Rule("strings", "value"),
    "LAT_OUT_OF_RANGE": Rule("hotels", "lat"),
    "LNG_OUT_OF_RANGE": Rule("hotels", "lng"),
    "STAR_RATING_OUT_OF_RANGE": Rule("hotels", "star_rating"),
    "UNKNOWN_STATUS": Rule("hotels", "status"),
    "INVALID_COUNTRY": Rule("hotels", "country_code"),
    "INVALID_PHONE": Rule("hotels", "phone_e164"),
    "VALUE_OUT_OF_RANGE": Rule("hotels", "version"),
    "COUNTRY_CITY_MISMATCH": Rule("hotels", "country_code"),
    "UNKNOWN_CURRENCY": Rule("plans", "currency"),
    "INVALID_AMOUNT": Rule("plans", "price"),
    "NEGATIVE_PRICE": Rule("plans", "price"),
    "MIXED_ROOM_CURRENCY": Rule("plans", "currency"),
}
"""Check name (== error code) -> the frame and column it reports on."""


# -- results ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QualityFailure:
    """One record that must not be published: exactly one problem, chosen by precedence.

    Attributes:
        index: position of the record in the input.
        supplier_hotel_id: the document's ``supplier_hotel_id`` when it is a string.
        version: the document's ``version`` when it is an integer.
        error_code: one of :data:`QUALITY_CODES`.
        field: dotted path in the normalized document (``rooms[0].rate_plans[1].currency``).
        message: what is wrong, with the offending value through ``repr`` truncated to 200
            characters; at most 1024 characters.
        error_type: the dead-letter error type (:data:`ERROR_TYPES`).
    """

    index: int
    supplier_hotel_id: str | None
    version: int | None
    error_code: str
    field: str | None
    message: str
    error_type: ErrorType

    def dead_letter(
        self,
        raw_payload_ref: str | None,
        raw_payload_hash: str | None,
        *,
        record_position: str | None = None,
    ) -> DeadLetter:
        """This failure as a dead letter of stage VALIDATION.

        Args:
            raw_payload_ref: the raw page the record came from.
            raw_payload_hash: sha256 of that page.
            record_position: the record's place on its page (part of the dead letter's key).

        Returns:
            The dead letter to record.
        """
        return DeadLetter(
            self.supplier_hotel_id,
            "VALIDATION",
            self.error_type,
            self.error_code,
            self.message,
            raw_payload_ref,
            raw_payload_hash,
            record_position=record_position,
        )


@dataclass(frozen=True, slots=True)
class MovedHotel:
    """A valid hotel whose ``city_code`` is another city: route it there, do not publish here."""

    index: int
    supplier_hotel_id: str
    city_code: str


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A hotel listed again in the chunk with a lower (or equal, later) version."""

    index: int
    supplier_hotel_id: str
    version: int
    kept_index: int


@dataclass(frozen=True)
class QualityResult:
    """The outcome of :func:`check_quality`; every input position is in exactly one list.

    Attributes:
        total: number of input documents.
        valid: positions of hotels to publish under the city being synced, in input order.
        failures: failed records, in input order (dead letters).
        moved: valid hotels of another city, in input order (route them).
        duplicates: collapsed lower versions, in input order (skipped).
        seconds: time spent in ``flatten`` (documents -> columns), ``validate`` (the rules
            over the columns; with a failing row, also the frames and pandera) and ``report``
            (failure cases -> failures).
    """

    total: int
    valid: tuple[int, ...]
    failures: tuple[QualityFailure, ...]
    moved: tuple[MovedHotel, ...]
    duplicates: tuple[Duplicate, ...]
    seconds: Mapping[str, float] = field(default_factory=dict)


# -- the frames ------------------------------------------------------------------------------

# String fields checked for length and control characters: (path template, limit), one per
# row of rules.STRING_FIELDS (top-level ones first, one value per hotel; then nested ones).
_STRING_FIELDS: Final[tuple[tuple[str, int], ...]] = tuple(
    (f.field, f.limit) for f in STRING_FIELDS
)
_FID: Final = {f.source: fid for fid, f in enumerate(STRING_FIELDS)}
_N_TOP: Final = sum("[" not in f.source for f in STRING_FIELDS)
_F_FACILITY = _FID["facilities[]"]
_F_URL = _FID["images[].url"]
_F_CAPTION = _FID["images[].caption"]
_F_ROOM = _FID["rooms[].room_code"]
_F_ROOM_NAME = _FID["rooms[].name"]
_F_BED = _FID["rooms[].bed_type"]
_F_PLAN = _FID["rooms[].rate_plans[].code"]
_F_BOARD = _FID["rooms[].rate_plans[].board"]
_LIMITS: Final = np.array([limit for _, limit in _STRING_FIELDS], dtype=np.int64)

_COUNTRIES: Final = frozenset(COUNTRY_CODES)
_CURRENCIES: Final = frozenset(MONEY_CODES)
_STATUSES: Final = frozenset(STATUSES)
_E164_RE: Final = re.compile(E164_SHAPE)


@functools.lru_cache(maxsize=65536)
def _phone_ok(value: str) -> bool:
    """``value`` is a valid number written in E.164 (libphonenumber, the normalizer's rule)."""
    return phone_e164(value, "ZZ") == value


# -- the rules, over arrays ------------------------------------------------------------------
#
# Each check below is one of these functions, over the values of its frame's columns as
# numpy arrays: one ``bool`` per row, True when the row passes. check_quality first applies
# the same functions to the chunk's columns before any frame is built (most of them only to
# a column's distinct values: every rule is a function of one row's values); only a frame
# where one of them finds a failing row is built and validated by pandera, which then names
# the failure cases. A clean chunk, the usual case, costs no frame and no pandera pass.


def _lat_ok(lat: np.ndarray) -> np.ndarray:
    return (lat >= float(LAT_MIN)) & (lat <= float(LAT_MAX))


def _lng_ok(lng: np.ndarray) -> np.ndarray:
    return (lng >= float(LNG_MIN)) & (lng <= float(LNG_MAX))


def _stars_of(star_rating: Any) -> np.ndarray:
    """``star_rating`` (strings or null) as numbers; NaN when absent or not a number."""
    return np.asarray(pd.to_numeric(star_rating, errors="coerce"), dtype=np.float64)


def _stars_ok(star_rating: np.ndarray, stars: np.ndarray) -> np.ndarray:
    # ``stars`` is ``star_rating`` as a number (_stars_of); NaN and infinities fail quietly.
    with np.errstate(invalid="ignore"):
        in_steps = (stars >= 0.0) & (stars <= 5.0) & ((stars * 2.0) % 1.0 == 0.0)
    return np.asarray(pd.isna(star_rating) | in_steps, dtype=bool)


def _member(values: np.ndarray, allowed: frozenset[str]) -> np.ndarray:
    return np.fromiter((v in allowed for v in values), dtype=bool, count=len(values))


def _phones_ok(values: np.ndarray) -> np.ndarray:
    """Null, or E.164 in shape and (with phone parsing on) valid to libphonenumber."""
    parse = _PARSE_PHONES.get()
    ok = np.empty(len(values), dtype=bool)
    for i, value in enumerate(values):
        if type(value) is str:
            # Full parsing is costly: once per distinct number, cached.
            ok[i] = _E164_RE.fullmatch(value) is not None and (not parse or _phone_ok(value))
        else:
            ok[i] = bool(pd.isna(value))
    return ok


def _version_ok(version: np.ndarray) -> np.ndarray:
    return version >= 0


def _same_country(country: np.ndarray, expected: np.ndarray) -> np.ndarray:
    # ``expected`` is the country of the hotel's city, null when the city is not listed.
    return np.asarray(pd.isna(expected) | (country == expected), dtype=bool)


def _printable(values: Sequence[str] | np.ndarray) -> np.ndarray:
    # isprintable() is False for every control character (and for a few harmless characters
    # such as NBSP): one C pass over all values joined clears the usual chunk at once, and
    # the regex over the joined values clears it too when only harmless ones are there (a
    # character class matches the joined values where it matches one of them); otherwise
    # it decides value by value for the non-printable values only.
    joined = "".join(values)
    if joined.isprintable() or CODE_CONTROL_RE.search(joined) is None:
        return np.ones(len(values), dtype=bool)
    ok = np.fromiter(map(str.isprintable, values), dtype=bool, count=len(values))
    for i in np.flatnonzero(~ok):
        # Normalized text keeps no tab/CR/LF either: the identifiers' rule holds for all.
        ok[i] = CODE_CONTROL_RE.search(values[int(i)]) is None
    return ok


def _short(values: Sequence[str] | np.ndarray, limits: np.ndarray | int) -> np.ndarray:
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    return np.asarray(lengths <= limits, dtype=bool)


def _amounts_of(prices: Any) -> np.ndarray:
    """Prices (strings) as numbers; NaN when one is not a number."""
    return np.asarray(pd.to_numeric(prices, errors="coerce"), dtype=np.float64)


def _amount_ok(amount: np.ndarray) -> np.ndarray:
    return ~np.isnan(amount)


def _not_negative(amount: np.ndarray) -> np.ndarray:
    return np.isnan(amount) | (amount >= 0.0)


def _room_currency_ok(hotel: np.ndarray, room: np.ndarray, currency: np.ndarray) -> np.ndarray:
    # Rows are grouped by (hotel, room) in document order: compare each plan's currency
    # with the first plan of its group, found by a running maximum of group starts.
    n = len(currency)
    if n == 0:
        return np.ones(0, dtype=bool)
    start = np.ones(n, dtype=bool)
    start[1:] = (hotel[1:] != hotel[:-1]) | (room[1:] != room[:-1])
    first = np.maximum.accumulate(np.where(start, np.arange(n), 0))
    return np.asarray(currency == currency[first], dtype=bool)


def _on(s: pd.Series, ok: np.ndarray) -> pd.Series:
    return pd.Series(ok, index=s.index)


# Every column is declared nullable, which only skips pandera's own not-null scan (a full
# pass per column): _collect already turned a missing or null required value into
# MALFORMED_DOCUMENT, and every check below handles NaN itself (``ignore_na=False`` also saves
# pandera's per-check dropna). Strings stay ``object``: converting to pandas' string dtype
# costs a pass over every value and buys nothing here.
def _column() -> Any:
    # A new Field per column: pandera binds each Field to its attribute.
    return pa.Field(nullable=True)


class _Frame(pa.DataFrameModel):
    """Base of the three frames: columns exactly as declared, never coerced."""

    class Config:
        coerce = False
        strict = True


def _objects(s: pd.Series | pd.DataFrame) -> np.ndarray:
    return np.asarray(s.to_numpy(dtype=object))


class _Hotels(_Frame):
    """One row per hotel; the index is the document's position in the input."""

    city_code: Series[object] = _column()
    country_code: Series[object] = _column()
    city_country: Series[object] = _column()
    lat: Series[float] = _column()
    lng: Series[float] = _column()
    star_rating: Series[object] = _column()
    stars: Series[float] = _column()
    status: Series[object] = _column()
    phone_e164: Series[object] = _column()
    version: Series[int] = _column()

    @pa.check("lat", name="LAT_OUT_OF_RANGE", ignore_na=False)
    def _lat(cls, s: Series[float]) -> Series[bool]:
        return _on(s, _lat_ok(s.to_numpy()))

    @pa.check("lng", name="LNG_OUT_OF_RANGE", ignore_na=False)
    def _lng(cls, s: Series[float]) -> Series[bool]:
        return _on(s, _lng_ok(s.to_numpy()))

    @pa.dataframe_check(name="STAR_RATING_OUT_OF_RANGE", ignore_na=False)
    def _stars(cls, df: pd.DataFrame) -> Series[bool]:
        return _on(df, _stars_ok(_objects(df["star_rating"]), df["stars"].to_numpy()))

    @pa.check("status", name="UNKNOWN_STATUS", ignore_na=False)
    def _status(cls, s: Series[Any]) -> Series[bool]:
        return _on(s, _member(_objects(s), _STATUSES))

    @pa.check("country_code", name="INVALID_COUNTRY", ignore_na=False)
    def _country(cls, s: Series[Any]) -> Series[bool]:
        return _on(s, _member(_objects(s), _COUNTRIES))

    @pa.check("phone_e164", name="INVALID_PHONE", ignore_na=False)
    def _phone(cls, s: Series[Any]) -> Series[bool]:
        return _on(s, _phones_ok(_objects(s)))

    @pa.check("version", name="VALUE_OUT_OF_RANGE", ignore_na=False)
    def _version(cls, s: Series[int]) -> Series[bool]:
        return _on(s, _version_ok(s.to_numpy()))

    @pa.dataframe_check(name="COUNTRY_CITY_MISMATCH", ignore_na=False)
    def _city_country(cls, df: pd.DataFrame) -> Series[bool]:
        return _on(df, _same_country(_objects(df["country_code"]), _objects(df["city_country"])))


class _Strings(_Frame):
    """One row per string value: its hotel's position, field id (into _STRING_FIELDS), k, j."""

    hotel: Series[int] = _column()
    fid: Series[int] = _column()
    k: Series[int] = _column()
    j: Series[int] = _column()
    value: Series[object] = _column()

    @pa.check("value", name="CONTROL_CHARACTERS", ignore_na=False)
    def _control(cls, s: Series[Any]) -> Series[bool]:
        return _on(s, _printable(_objects(s)))

    @pa.dataframe_check(name="OVERSIZED_STRING", ignore_na=False)
    def _length(cls, df: pd.DataFrame) -> Series[bool]:
        return _on(df, _short(_objects(df["value"]), _LIMITS[df["fid"].to_numpy()]))


class _Plans(_Frame):
    """One row per rate plan, in document order: hotel position, room k, plan j."""

    hotel: Series[int] = _column()
    k: Series[int] = _column()
    j: Series[int] = _column()
    currency: Series[object] = _column()
    price: Series[object] = _column()
    amount: Series[float] = _column()

    @pa.check("currency", name="UNKNOWN_CURRENCY", ignore_na=False)
    def _currency(cls, s: Series[Any]) -> Series[bool]:
        return _on(s, _member(_objects(s), _CURRENCIES))

    @pa.check("amount", name="INVALID_AMOUNT", ignore_na=False)
    def _amount(cls, s: Series[float]) -> Series[bool]:
        # ``amount`` is ``price`` as a number, NaN when it is not one (_amounts_of).
        return _on(s, _amount_ok(s.to_numpy()))

    @pa.check("amount", name="NEGATIVE_PRICE", ignore_na=False)
    def _negative(cls, s: Series[float]) -> Series[bool]:
        return _on(s, _not_negative(s.to_numpy()))

    @pa.dataframe_check(name="MIXED_ROOM_CURRENCY", ignore_na=False)
    def _mixed(cls, df: pd.DataFrame) -> Series[bool]:
        hotel, room = df["hotel"].to_numpy(), df["k"].to_numpy()
        return _on(df, _room_currency_ok(hotel, room, _objects(df["currency"])))


# Full phone parsing on or off for the current call (see check_quality's ``parse_phones``);
# a context variable because pandera calls the check without arguments of ours.
_PARSE_PHONES: Final = contextvars.ContextVar("quality_parse_phones", default=True)

_SCHEMAS: Final = {
    "hotels": _Hotels.to_schema(),
    "strings": _Strings.to_schema(),
    "plans": _Plans.to_schema(),
}


class _Malformed(Exception):
    """Internal: documents that cannot be put into the frames, by position."""

    def __init__(self, problems: dict[int, tuple[str, str]]) -> None:
        super().__init__(f"{len(problems)} malformed documents")
        self.problems = problems


_TOP_KEYS: Final = (
    *(name for name, _ in _STRING_FIELDS[:_N_TOP]),
    "country_code",
    "lat",
    "lng",
    "star_rating",
    "status",
    "version",
)
# Expected pandas.infer_dtype results per top-level key, and a per-value test for the slow
# path that names the offending documents.
_STR = frozenset({"string"})
_OPT_STR = frozenset({"string", "empty"})
_NUMBER = frozenset({"floating", "integer", "mixed-integer-float"})
_INTEGER = frozenset({"integer"})
_REQUIRED_STR: Final = frozenset(
    {f.field for f in STRING_FIELDS[:_N_TOP] if f.required} | {"country_code", "status"}
)


def _is_str(value: object) -> bool:
    return type(value) is str


def _is_opt_str(value: object) -> bool:
    return value is None or type(value) is str


def _is_number(value: object) -> bool:
    return (type(value) is float or type(value) is int) and value == value


def _is_version(value: object) -> bool:
    return type(value) is int and -(2**63) <= value < 2**63


def _expect(key: str) -> tuple[frozenset[str], bool, Any]:
    """(accepted infer_dtype results, skipna, per-value test) for a top-level key."""
    if key in ("lat", "lng"):
        return _NUMBER, False, _is_number
    if key == "version":
        return _INTEGER, False, _is_version
    if key in _REQUIRED_STR:
        return _STR, False, _is_str
    return _OPT_STR, True, _is_opt_str


_EXPECT: Final = {key: _expect(key) for key in _TOP_KEYS}
_REQUIRED_FIDS: Final = frozenset(fid for fid, f in enumerate(STRING_FIELDS) if f.required)
"""String fields whose values must be strings (the others may be null)."""


def _groups(owners: np.ndarray, counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each owner repeated ``counts`` times, and the item's position within its owner."""
    sizes = np.asarray(counts, dtype=np.int64)
    total = int(sizes.sum())
    starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(owners, sizes), np.arange(total, dtype=np.int64) - starts


@dataclass
class _Columns:
    """The documents' values column by column, before any frame is built.

    Attributes:
        top: each top-level key of _TOP_KEYS -> one value per hotel.
        hotel_of: each hotel's position in the input.
        blocks: (field id, values, hotel, k, j) per string field of _STRING_FIELDS, in
            document order; the top-level ones share ``top``'s value lists.
        plan_hotel, plan_k, plan_j: each rate plan's hotel position, room k and plan j.
        currencies, prices: each rate plan's currency and price.
    """

    top: dict[str, Sequence[Any]]
    hotel_of: np.ndarray
    blocks: list[tuple[int, Sequence[Any], np.ndarray, np.ndarray, np.ndarray]]
    plan_hotel: np.ndarray
    plan_k: np.ndarray
    plan_j: np.ndarray
    currencies: list[Any]
    prices: list[Any]


_TOP_VALUES: Final = operator.itemgetter(*_TOP_KEYS)


def _collect(docs: Sequence[Mapping[str, Any]], positions: Sequence[int]) -> _Columns:
    """The documents at ``positions`` column by column; raises _Malformed naming bad ones.

    Per-hotel Python work is a handful of list extends (no per-string tuples): the row
    coordinates (hotel, room k, plan j) are derived afterwards from the list lengths with
    numpy, not built value by value. Every value's type is checked here
    (:func:`_wrong_types`), so the rules and the frames only ever see the types they expect.
    """
    problems: dict[int, tuple[str, str]] = {}
    tops: list[tuple[Any, ...]] = []
    hpos: list[int] = []
    facilities: list[Any] = []
    n_facilities: list[int] = []
    urls: list[Any] = []
    captions: list[Any] = []
    n_images: list[int] = []
    room_codes: list[Any] = []
    room_names: list[Any] = []
    beds: list[Any] = []
    n_rooms: list[int] = []
    plan_codes: list[Any] = []
    boards: list[Any] = []
    currencies: list[Any] = []
    prices: list[Any] = []
    n_plans: list[int] = []
    for pos in positions:
        d = docs[pos]
        try:
            top = _TOP_VALUES(d)
            fac = d["facilities"]
            images = d["images"]
            rooms = d["rooms"]
            img_urls = [i["url"] for i in images]
            img_captions = [i["caption"] for i in images]
            r_codes = [r["room_code"] for r in rooms]
            r_names = [r["name"] for r in rooms]
            r_beds = [r["bed_type"] for r in rooms]
            per_room = [r["rate_plans"] for r in rooms]
            plans = [p for rp in per_room for p in rp]
            p_codes = [p["code"] for p in plans]
            p_boards = [p["board"] for p in plans]
            p_currencies = [p["currency"] for p in plans]
            p_prices = [p["price"] for p in plans]
            r_plans = [len(rp) for rp in per_room]
        except KeyError as err:
            problems[pos] = (str(err.args[0])[:64], "is missing")
            continue
        except (TypeError, AttributeError, IndexError) as err:
            problems[pos] = ("", f"has an unexpected shape ({type(err).__name__})")
            continue
        if type(fac) is not list:
            problems[pos] = ("facilities", f"has the wrong type: {show(fac)}")
            continue
        tops.append(top)
        hpos.append(pos)
        facilities += fac
        n_facilities.append(len(fac))
        urls += img_urls
        captions += img_captions
        n_images.append(len(img_urls))
        room_codes += r_codes
        room_names += r_names
        beds += r_beds
        n_rooms.append(len(r_codes))
        plan_codes += p_codes
        boards += p_boards
        currencies += p_currencies
        prices += p_prices
        n_plans += r_plans

    columns: dict[str, Sequence[Any]] = dict(
        zip(_TOP_KEYS, zip(*tops, strict=True) if tops else [()] * len(_TOP_KEYS), strict=True)
    )
    hotel_of = np.array(hpos, dtype=np.int64)
    img_hotel, img_k = _groups(hotel_of, n_images)
    room_hotel, room_k = _groups(hotel_of, n_rooms)
    plan_hotel, plan_j = _groups(room_hotel, n_plans)
    plan_k = np.repeat(room_k, np.asarray(n_plans, dtype=np.int64))
    fac_hotel, fac_k = _groups(hotel_of, n_facilities)
    none = np.full(len(hpos), -1, dtype=np.int64)
    # (field id, values, hotel, k, j) per string field, in document order.
    blocks: list[tuple[int, Sequence[Any], np.ndarray, np.ndarray, np.ndarray]] = [
        (fid, columns[name], hotel_of, none, none)
        for fid, (name, _) in enumerate(_STRING_FIELDS[:_N_TOP])
    ]
    img_none = np.full(len(urls), -1, dtype=np.int64)
    room_none = np.full(len(room_codes), -1, dtype=np.int64)
    blocks += [
        (_F_FACILITY, facilities, fac_hotel, fac_k, np.full(len(facilities), -1, np.int64)),
        (_F_URL, urls, img_hotel, img_k, img_none),
        (_F_CAPTION, captions, img_hotel, img_k, img_none),
        (_F_ROOM, room_codes, room_hotel, room_k, room_none),
        (_F_ROOM_NAME, room_names, room_hotel, room_k, room_none),
        (_F_BED, beds, room_hotel, room_k, room_none),
        (_F_PLAN, plan_codes, plan_hotel, plan_k, plan_j),
        (_F_BOARD, boards, plan_hotel, plan_k, plan_j),
    ]

    cols = _Columns(columns, hotel_of, blocks, plan_hotel, plan_k, plan_j, currencies, prices)
    _wrong_types(cols, hpos, problems)
    if problems:
        raise _Malformed(problems)
    return cols


def _wrong_types(cols: _Columns, hpos: Sequence[int], problems: dict[int, tuple[str, str]]) -> None:
    """Adds to ``problems`` each document (by position) with a value of the wrong type.

    A column whose values all have the expected type is cleared by one pandas pass; only a
    column that fails it is read value by value, to name the first offending document.
    """
    for key, (accepted, skipna, test) in _EXPECT.items():
        values = cols.top[key]
        if values and pd.api.types.infer_dtype(values, skipna=skipna) not in accepted:
            for pos, value in zip(hpos, values, strict=True):
                if not test(value) and pos not in problems:
                    problems[pos] = (key, f"has the wrong type: {show(value)}")
    for fid, values, hotel, k, j in cols.blocks[_N_TOP:]:
        required = fid in _REQUIRED_FIDS
        if values and pd.api.types.infer_dtype(values, skipna=not required) not in (
            _STR if required else _OPT_STR
        ):
            test = _is_str if required else _is_opt_str
            for i, value in enumerate(values):
                pos = int(hotel[i])
                if not test(value) and pos not in problems:
                    path = _field(fid, int(k[i]), int(j[i]))
                    problems[pos] = (path, f"has the wrong type: {show(value)}")
    plan_hotel, plan_k, plan_j = cols.plan_hotel, cols.plan_k, cols.plan_j
    for values, what in ((cols.currencies, "currency"), (cols.prices, "price")):
        if values and pd.api.types.infer_dtype(values, skipna=False) != "string":
            for i, value in enumerate(values):
                pos = int(plan_hotel[i])
                if type(value) is not str and pos not in problems:
                    path = f"rooms[{plan_k[i]}].rate_plans[{plan_j[i]}].{what}"
                    problems[pos] = (path, f"has the wrong type: {show(value)}")


# Prices as normalization writes them (``str`` of a Decimal): digits with an optional
# fraction, one per line. Each such price is a number and not negative, whatever parses it;
# the lines are the prices only when no price holds a line break itself.
_PLAIN_PRICES: Final = re.compile(
    r"[0-9]{1,15}(?:\.[0-9]{1,15})?(?:\n[0-9]{1,15}(?:\.[0-9]{1,15})?)*"
)


def _distinct(values: Sequence[Any]) -> np.ndarray:
    return np.array(list(dict.fromkeys(values)), dtype=object)


def _hotels_pass(cols: _Columns, city_countries: Mapping[str, str]) -> bool:
    top = cols.top
    stars = _distinct(top["star_rating"])
    if not (
        _lat_ok(np.asarray(top["lat"], dtype=np.float64)).all()
        and _lng_ok(np.asarray(top["lng"], dtype=np.float64)).all()
        and _stars_ok(stars, _stars_of(stars)).all()
        and _member(_distinct(top["status"]), _STATUSES).all()
        and _member(_distinct(top["country_code"]), _COUNTRIES).all()
        and _phones_ok(_distinct(top["phone_e164"])).all()
        and _version_ok(np.asarray(top["version"], dtype=np.int64)).all()
    ):
        return False
    pairs = list(dict.fromkeys(zip(top["city_code"], top["country_code"], strict=True)))
    country = np.array([c for _, c in pairs], dtype=object)
    expected = np.array([city_countries.get(city) for city, _ in pairs], dtype=object)
    return bool(_same_country(country, expected).all())


def _strings_pass(cols: _Columns, city_countries: Mapping[str, str]) -> bool:
    for fid, values, _, _, _ in cols.blocks:
        # The frame keeps only the values present (optional fields may be null).
        present = values if fid in _REQUIRED_FIDS else [v for v in values if type(v) is str]
        limit = int(_LIMITS[fid])
        if not (_printable(present).all() and _short(present, limit).all()):
            return False
    return True


def _plans_pass(cols: _Columns, city_countries: Mapping[str, str]) -> bool:
    if not _member(_distinct(cols.currencies), _CURRENCIES).all():
        return False
    prices = cols.prices
    lines = "\n".join(prices)
    if prices and (lines.count("\n") != len(prices) - 1 or _PLAIN_PRICES.fullmatch(lines) is None):
        amount = _amounts_of(np.array(prices, dtype=object))
        if not (_amount_ok(amount).all() and _not_negative(amount).all()):
            return False
    currencies = np.array(cols.currencies, dtype=object)
    return bool(_room_currency_ok(cols.plan_hotel, cols.plan_k, currencies).all())


_PASSES: Final = {"hotels": _hotels_pass, "strings": _strings_pass, "plans": _plans_pass}
"""Frame -> True when none of its rows would fail one of its checks: the checks' own rules
over the columns (a rule of a single value only over the column's distinct values)."""


def _failing(cols: _Columns, city_countries: Mapping[str, str]) -> list[str]:
    """The frames with a row that fails a check: only these are built and validated."""
    return [name for name, passes in _PASSES.items() if not passes(cols, city_countries)]


class _Frames:
    """The columns as the three frames pandera validates, each built when first asked for."""

    def __init__(self, cols: _Columns, city_countries: Mapping[str, str]) -> None:
        self.cols, self.city_countries = cols, city_countries

    @functools.cached_property
    def hotels(self) -> pd.DataFrame:
        columns, hotel_of = self.cols.top, self.cols.hotel_of
        city_countries = self.city_countries
        index = pd.Index(hotel_of)
        city = columns["city_code"]
        star = pd.Series(columns["star_rating"], index=index, dtype=object)
        return pd.DataFrame(
            {
                "city_code": pd.Series(city, index=index, dtype=object),
                "country_code": pd.Series(columns["country_code"], index=index, dtype=object),
                "city_country": pd.Series(
                    [city_countries.get(c) for c in city], index=index, dtype=object
                ),
                "lat": pd.Series(np.array(columns["lat"], dtype=np.float64), index=index),
                "lng": pd.Series(np.array(columns["lng"], dtype=np.float64), index=index),
                "star_rating": star,
                "stars": pd.Series(_stars_of(star), index=index),
                "status": pd.Series(columns["status"], index=index, dtype=object),
                "phone_e164": pd.Series(columns["phone_e164"], index=index, dtype=object),
                "version": pd.Series(np.array(columns["version"], dtype=np.int64), index=index),
            }
        )

    @functools.cached_property
    def strings(self) -> pd.DataFrame:
        blocks = self.cols.blocks
        # Field by field: for one hotel and one field, a smaller row is an earlier item.
        all_values: list[Any] = []
        for _, values, _, _, _ in blocks:
            all_values += values
        value_arr = np.array(all_values, dtype=object)
        fid_arr = np.concatenate([np.full(len(b[1]), b[0], dtype=np.int64) for b in blocks])
        hotel_arr, k_arr, j_arr = (
            np.concatenate([b[i] for b in blocks]) if blocks else np.zeros(0, np.int64)
            for i in (2, 3, 4)
        )
        present = pd.notna(value_arr)
        if not present.all():
            value_arr, fid_arr, hotel_arr, k_arr, j_arr = (
                a[present] for a in (value_arr, fid_arr, hotel_arr, k_arr, j_arr)
            )
        return pd.DataFrame(
            {
                "hotel": hotel_arr,
                "fid": fid_arr,
                "k": k_arr,
                "j": j_arr,
                "value": pd.Series(value_arr, dtype=object),
            }
        )

    @functools.cached_property
    def plans(self) -> pd.DataFrame:
        cols = self.cols
        plan_hotel, plan_k, plan_j = cols.plan_hotel, cols.plan_k, cols.plan_j
        currencies, prices = cols.currencies, cols.prices
        price = pd.Series(prices, dtype=object)
        return pd.DataFrame(
            {
                "hotel": plan_hotel,
                "k": plan_k,
                "j": plan_j,
                "currency": pd.Series(currencies, dtype=object),
                "price": price,
                "amount": pd.Series(_amounts_of(price)),
            }
        )


def _field(fid: int, k: int, j: int) -> str:
    return _STRING_FIELDS[fid][0].format(k=k, j=j)


def _failure_rows(schema: pa.DataFrameSchema, frame: pd.DataFrame) -> list[tuple[str, Any]]:
    """(check name, row index) of every failed check row, once each."""
    try:
        schema.validate(frame, lazy=True)
    except pa.errors.SchemaErrors as err:
        cases = err.failure_cases
        unknown = cases[~cases["check"].isin(list(RULES)) | cases["index"].isna()]
        if len(unknown):
            # A dtype or column problem means the frames were built wrong: a bug here, not
            # bad data, and it cannot be traced to one record.
            raise RuntimeError(f"quality frame rejected as a whole:\n{unknown.head(20)}") from err
        return list(dict.fromkeys(zip(cases["check"], cases["index"], strict=True)))
    return []


def _readable(doc: Mapping[str, Any]) -> tuple[str | None, int | None]:
    # A dict, the usual document, is a Mapping: the exact type test spares the ABC check.
    if type(doc) is dict or isinstance(doc, Mapping):
        hotel_id, version = doc.get("supplier_hotel_id"), doc.get("version")
    else:
        hotel_id = version = None
    return (
        hotel_id[: LIMITS["hotel_id"]] if type(hotel_id) is str else None,
        version if type(version) is int else None,
    )


def _failure(
    pos: int, doc: Mapping[str, Any], code: str, field_path: str | None, message: str
) -> QualityFailure:
    hotel_id, version = _readable(doc)
    return QualityFailure(
        pos,
        hotel_id,
        version,
        code,
        field_path,
        message[:MESSAGE_MAX],
        ERROR_TYPES[code],
    )


def _describe(frames: _Frames, code: str, row: Any) -> tuple[int, str, str]:
    """(hotel position, field, message) of one failed check row."""
    rule = RULES[code]
    template = _MESSAGES[code]
    if rule.frame == "hotels":
        h = frames.hotels
        value = h.at[row, rule.column]
        if code == "COUNTRY_CITY_MISMATCH":
            message = template.format(
                field=rule.column,
                value=show(value),
                city=show(h.at[row, "city_code"]),
                expected=show(h.at[row, "city_country"]),
            )
        else:
            message = template.format(field=rule.column, value=show(_plain(value)))
        return int(row), rule.column, message
    if rule.frame == "strings":
        s = frames.strings
        fid, k, j = (int(s.at[row, c]) for c in ("fid", "k", "j"))
        value = s.at[row, "value"]
        path = _field(fid, k, j)
        message = template.format(
            field=path, value=show(value), length=len(value), limit=_STRING_FIELDS[fid][1]
        )
        return int(s.at[row, "hotel"]), path, message
    p = frames.plans
    k, j = int(p.at[row, "k"]), int(p.at[row, "j"])
    path = f"rooms[{k}].rate_plans[{j}].{rule.column}"
    value = p.at[row, rule.column]
    expected = ""
    if code == "MIXED_ROOM_CURRENCY":
        same_room = p[(p["hotel"] == p.at[row, "hotel"]) & (p["k"] == k)]
        expected = show(same_room["currency"].iloc[0])
    message = template.format(field=path, value=show(value), expected=expected)
    return int(p.at[row, "hotel"]), path, message


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value it came from (for messages); NaN as None."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    return value


def _highest(
    docs: Sequence[Mapping[str, Any]], failures: dict[int, QualityFailure]
) -> tuple[list[int], list[Duplicate]]:
    """The positions of each hotel's highest version, and the lower ones as duplicates.

    A document without a readable id and version is a MALFORMED_DOCUMENT, added to
    ``failures``.
    """
    keys: list[tuple[str, int]] = []
    key_pos: list[int] = []
    for pos, doc in enumerate(docs):
        hotel_id, version = _readable(doc)
        if hotel_id is None or version is None:
            failures[pos] = _failure(
                pos,
                doc,
                "MALFORMED_DOCUMENT",
                "supplier_hotel_id" if hotel_id is None else "version",
                "supplier_hotel_id or version is missing or has the wrong type",
            )
            continue
        keys.append((hotel_id, version))
        key_pos.append(pos)
    kept = [key_pos[i] for i in highest_versions(keys)]
    kept_by_id = {docs[pos]["supplier_hotel_id"]: pos for pos in kept}
    kept_set = set(kept)
    duplicates = [
        Duplicate(pos, hotel_id, version, kept_by_id[hotel_id])
        for (hotel_id, version), pos in zip(keys, key_pos, strict=True)
        if pos not in kept_set
    ]
    return kept, duplicates


def check_quality(
    docs: Sequence[Mapping[str, Any]],
    *,
    city_code: str | None,
    city_countries: Mapping[str, str],
    parse_phones: bool = True,
    normalized: bool = False,
) -> QualityResult:
    """Row-level quality of a chunk of one city's normalized hotels (layers 3 and 4).

    Call it once per chunk (thousands of hotels), not per page: validation has a fixed cost
    per call. Never raises for bad data; every input position ends in exactly one of the
    result's ``valid``, ``failures``, ``moved`` and ``duplicates``.

    Args:
        docs: normalized hotels in canonical primitive form (``to_primitive`` or the decoded
            canonical JSON), e.g. ``[c.doc for c in chunk]``.
        city_code: the city being synced; None for hotels that come from no city listing
            (a change feed): each belongs to its own ``city_code`` and none has moved.
        city_countries: city code -> ISO 3166-1 alpha-2 country, from the supplier's city
            list; a city missing here skips the country rule for its hotels.
        parse_phones: also parse every phone number with libphonenumber (cached per number;
            a libphonenumber parse for each number not seen before). False keeps only the vectorised E.164
            shape check (``+``, a real calling code, 7-15 digits), for callers whose
            documents come straight from normalization, which parsed each number already.
        normalized: every document comes straight from ``normalize_documents`` in this
            process, which already enforced the rules of layer 3 (the same rows of
            :mod:`~supplier_sync_dagster.core.records.rules`). Only what it does not
            guarantee is checked first (layer 4, a facility that lower-casing made longer
            than its limit, the E.164 shape): a chunk that passes is valid as the full pass
            would find it, without flattening it; any other chunk takes the full pass, so
            the result is always the full pass's.

    Returns:
        Valid positions, failures (one per failed record), moved hotels and duplicates.
    """
    began = time.perf_counter()
    failures: dict[int, QualityFailure] = {}

    # The usual chunk lists no hotel twice: no duplicates to collapse first.
    distinct = normalized and _distinct_ids(docs)
    if distinct and _normalized_pass(docs, range(len(docs)), city_countries):
        return _all_pass(docs, range(len(docs)), [], city_code, began)
    # Duplicates first: only the highest version of a hotel is validated and reported.
    kept, duplicates = _highest(docs, failures)
    positions = sorted(kept)
    if (
        normalized
        and not distinct
        and not failures
        and _normalized_pass(docs, positions, city_countries)
    ):
        return _all_pass(docs, positions, duplicates, city_code, began)
    while True:
        try:
            cols = _collect(docs, positions)
            break
        except _Malformed as err:
            for pos, (path, what) in err.problems.items():
                failures[pos] = _failure(
                    pos, docs[pos], "MALFORMED_DOCUMENT", path or None, f"{path} {what}".strip()
                )
            positions = [p for p in positions if p not in err.problems]
    flattened = time.perf_counter()

    rows: list[tuple[str, str, Any]] = []
    frames = _Frames(cols, city_countries)
    token = _PARSE_PHONES.set(parse_phones)
    try:
        failing = _failing(cols, city_countries)
        # Pandera's global settings could turn data checks off: this layer must always run.
        with config_context(
            validation_enabled=True, validation_depth=ValidationDepth.SCHEMA_AND_DATA
        ):
            for name in failing:
                frame = getattr(frames, name)
                rows.extend(
                    (name, check, row) for check, row in _failure_rows(_SCHEMAS[name], frame)
                )
    finally:
        _PARSE_PHONES.reset(token)
    validated = time.perf_counter()

    best: dict[int, tuple[tuple[int, int], str, str, str]] = {}
    for _, code, row in rows:
        pos, path, message = _describe(frames, code, row)
        order = (_RANK[code], int(row))
        if pos not in best or order < best[pos][0]:
            best[pos] = (order, code, path, message)
    for pos, (_, code, path, message) in best.items():
        failures[pos] = _failure(pos, docs[pos], code, path, message)

    valid, moved = _route(docs, positions, failures, city_code)
    done = time.perf_counter()
    return QualityResult(
        total=len(docs),
        valid=valid,
        failures=tuple(failures[p] for p in sorted(failures)),
        moved=moved,
        duplicates=tuple(sorted(duplicates, key=lambda d: d.index)),
        seconds={
            "flatten": flattened - began,
            "validate": validated - flattened,
            "report": done - validated,
        },
    )


def _route(
    docs: Sequence[Mapping[str, Any]],
    positions: Sequence[int],
    failures: Mapping[int, QualityFailure],
    city_code: str | None,
) -> tuple[tuple[int, ...], tuple[MovedHotel, ...]]:
    """The positions that did not fail: (valid under ``city_code``, moved to another city)."""
    valid: list[int] = []
    moved: list[MovedHotel] = []
    for pos in positions:
        if pos in failures:
            continue
        doc = docs[pos]
        if city_code is None or doc["city_code"] == city_code:
            valid.append(pos)
        else:
            moved.append(MovedHotel(pos, doc["supplier_hotel_id"], doc["city_code"]))
    return tuple(valid), tuple(moved)


def _all_pass(
    docs: Sequence[Mapping[str, Any]],
    positions: Sequence[int],
    duplicates: list[Duplicate],
    city_code: str | None,
    began: float,
) -> QualityResult:
    """The result when no document at ``positions`` fails (the others are ``duplicates``)."""
    screened = time.perf_counter()
    valid, moved = _route(docs, positions, {}, city_code)
    return QualityResult(
        total=len(docs),
        valid=valid,
        failures=(),
        moved=moved,
        duplicates=tuple(sorted(duplicates, key=lambda d: d.index)),
        seconds={
            "flatten": 0.0,
            "validate": screened - began,
            "report": time.perf_counter() - screened,
        },
    )


_FACILITY_MAX: Final = int(_LIMITS[_F_FACILITY])
_HOTEL_ID_MAX: Final = LIMITS["hotel_id"]


def _distinct_ids(docs: Sequence[Mapping[str, Any]]) -> bool:
    """No two documents share a ``supplier_hotel_id`` (then none is a duplicate); False
    also when one has none: :func:`_highest` decides then."""
    try:
        ids = {doc["supplier_hotel_id"] for doc in docs}
    except (KeyError, TypeError):
        return False
    return len(ids) == len(docs)


def _normalized_pass(
    docs: Sequence[Mapping[str, Any]], positions: Sequence[int], city_countries: Mapping[str, str]
) -> bool:
    """True when documents straight from normalization break no rule of the full pass.

    Normalization enforces every rule of layer 3 on the values as sent; what it does not
    guarantee of the document it writes is checked here: lower-casing can lengthen a
    facility (``"İ"`` is two characters in lower case), the phone's E.164 shape is cheap to
    confirm, and layer 4 (country of the city, one currency per room) is not its concern.
    A document of an unexpected shape, or whose id and version :func:`_highest` would not
    read as they are, also says False: the full pass names its problem.
    """
    pairs: set[tuple[Any, Any]] = set()
    phones: set[Any] = set()
    try:
        for pos in positions:
            doc = docs[pos]
            hotel_id = doc["supplier_hotel_id"]
            # What _highest reads as the hotel's id and version, unchanged (no MALFORMED).
            if not (
                type(hotel_id) is str
                and len(hotel_id) <= _HOTEL_ID_MAX
                and type(doc["version"]) is int
            ):
                return False
            pairs.add((doc["city_code"], doc["country_code"]))
            phones.add(doc["phone_e164"])
            facilities = doc["facilities"]
            if facilities and max(map(len, facilities)) > _FACILITY_MAX:
                return False
            for room in doc["rooms"]:
                plans = room["rate_plans"]
                if len(plans) > 1:
                    first = plans[0]["currency"]
                    for plan in plans:
                        if plan["currency"] != first:
                            return False
    except (KeyError, TypeError, AttributeError, IndexError):
        return False
    phones.discard(None)
    if not all(type(p) is str and _E164_RE.fullmatch(p) is not None for p in phones):
        return False
    return all(
        type(city) is str and city_countries.get(city, country) == country
        for city, country in pairs
    )
