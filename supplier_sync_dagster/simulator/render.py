"""Fast rendering of valid hotel records straight to JSON bytes.

A benchmark pulls a million hotels through the simulator, so a record must be cheap to
render: every random choice of a hotel comes from one BLAKE2b digest of
``(seed, hotel, content epoch)`` (and one of ``(seed, hotel, price epoch)`` for prices), and
the JSON is assembled from fragments that were escaped once per city. Bad records are derived
from these bytes by the slower dict path in ``data.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from supplier_sync_dagster.simulator import locales, richtext
from supplier_sync_dagster.simulator.config import DataProfile

FACILITIES = (
    "wifi", "pool", "parking", "gym", "spa", "restaurant", "bar", "airport_shuttle",
    "room_service", "business_center", "laundry", "pet_friendly", "ev_charging", "kids_club",
)  # fmt: skip
CAPTIONS = ("Lobby", "Facade", "Room", "Pool", "Restaurant", "Bathroom", "View", "Terrace")
# (code, name, bed type, max occupancy, price factor)
# A data profile's hotels choose among the first ``room_kinds`` of these rooms and the first
# ``rate_plan_kinds`` of these plans (the standard profile: the first 7 and 4).
ROOM_TYPES = (
    ("SGL", "Single Room", "SINGLE", 1, 0.8),
    ("STD", "Standard Double", "DOUBLE", 2, 1.0),
    ("TWN", "Twin Room", "TWIN", 2, 1.0),
    ("SUP", "Superior Queen", "QUEEN", 2, 1.2),
    ("DLX", "Deluxe King", "KING", 2, 1.4),
    ("FAM", "Family Room", "DOUBLE", 4, 1.6),
    ("STE", "Junior Suite", "KING", 3, 2.2),
    ("TRP", "Triple Room", "TWIN", 3, 1.3),
    ("QUA", "Quadruple Room", "DOUBLE", 4, 1.5),
    ("STU", "Studio", "QUEEN", 2, 1.25),
    ("APT", "Two-Bedroom Apartment", "DOUBLE", 5, 2.0),
    ("DSV", "Deluxe Sea View", "KING", 2, 1.7),
    ("EXE", "Executive Suite", "KING", 2, 2.6),
    ("PRS", "Presidential Suite", "KING", 4, 5.0),
)
# (code, board, refundable, price factor, per-mille chance that a room offers it)
RATE_PLANS = (
    ("BAR", "RO", True, 1.0, 1000),
    ("NRF", "RO", False, 0.88, 600),
    ("BB", "BB", True, 1.12, 500),
    ("HB", "HB", True, 1.35, 150),
    ("FB", "FB", True, 1.55, 300),
    ("AI", "AI", True, 1.9, 250),
    ("ADV", "RO", False, 0.8, 450),
    ("MEM", "BB", True, 1.02, 400),
    ("LOS7", "RO", True, 0.85, 350),
    ("PKG", "HB", False, 1.25, 200),
)
_STAR_TABLE = tuple(
    star
    for star, weight in ((2.0, 5), (2.5, 4), (3.0, 20), (3.5, 15), (4.0, 25), (4.5, 10), (5.0, 8))
    for _ in range(weight)
)
_FACILITY_JSON = tuple(json.dumps(f) for f in FACILITIES)
_CAPTION_JSON = tuple(json.dumps(c) for c in CAPTIONS)
_ROOM_CODE = tuple(f'{{"room_code":{json.dumps(code)},"name":' for code, *_ in ROOM_TYPES)
_ROOM_TAIL = tuple(
    f',"bed_type":{json.dumps(bed)},"max_occupancy":{occ},"rate_plans":['
    for _, _, bed, occ, _ in ROOM_TYPES
)
_ROOM_HEAD = tuple(
    f"{code}{json.dumps(room[1])}{tail}"
    for code, tail, room in zip(_ROOM_CODE, _ROOM_TAIL, ROOM_TYPES, strict=True)
)
_PLAN_HEAD = tuple(
    f'{{"code":{json.dumps(code)},"board":{json.dumps(board)},'
    f'"refundable":{"true" if refundable else "false"},"available":'
    for code, board, refundable, _, _ in RATE_PLANS
)


def _digest(*parts: object) -> int:
    data = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=64).digest(), "little")


class _Bits:
    """Draws uniform integers from a big random integer, digit by mixed-radix digit.

    Given ``more`` (the parts of further digests), it draws more random bits whenever few are
    left, for hotels whose many choices would use up one digest.
    """

    __slots__ = ("more", "v")

    def __init__(self, v: int, more: tuple[object, ...] | None = None) -> None:
        self.v = v
        self.more = more

    def take(self, n: int) -> int:
        if self.more is not None and self.v < n << 64:
            self.v = (self.v << 512) | _digest(*self.more, self.v.bit_length(), n)
        self.v, r = divmod(self.v, n)
        return r

    def unit(self) -> float:
        """Uniform in ``[0, 1)`` with 16 bits of resolution."""
        return self.take(65536) / 65536.0


@dataclass(frozen=True)
class CityKit:
    """Everything about a city that hotel records repeat, escaped for JSON once.

    Attributes:
        names: (name JSON, name_local JSON, email slug) per name combination.
        streets: street names.
        number_first: whether the house number precedes the street.
        postal_digits: digits of the postal code, 0 when the country has none we can make.
        phones: phone numbers as JSON strings.
        city_fields: ``"city_code":...,"country_code":...`` fragment.
        currency_json: the currency code as a JSON string.
        usd_rate: units of the currency per US dollar.
        decimals: minor units of the currency.
        level: nightly price of a 2-star room in US dollars.
        lat: latitude of the city centre.
        lng: longitude of the city centre.
        spread: standard deviation of hotel latitude around the centre (degrees).
        lng_spread: the same for longitude (wider away from the equator).
    """

    names: tuple[tuple[str, str, str], ...]
    streets: tuple[str, ...]
    number_first: bool
    postal_digits: int
    phones: tuple[str, ...]
    city_fields: str
    currency_json: str
    usd_rate: float
    decimals: int
    level: float
    lat: float
    lng: float
    spread: float
    lng_spread: float


def city_kit(
    *,
    seed: int,
    code: str,
    name: str,
    country_code: str,
    lat: float,
    lng: float,
    population: int,
    currency: str,
    language: locales.Language,
    postal_regex: str,
) -> CityKit:
    """Precompute the fragments of a city's hotel records."""
    names = []
    latin = language.latin_format
    for fmt_latin, fmt_local in zip(latin, language.local_format, strict=True):
        for word in language.words:
            for kind in language.kinds:
                n = fmt_latin.format(word=word[0], kind=kind[0], city=name)
                local = fmt_local.format(word=word[1], kind=kind[1], city=name)
                slug = _slug(word[0])
                names.append(
                    (json.dumps(n, ensure_ascii=False), json.dumps(local, ensure_ascii=False), slug)
                )
    spread = 0.015 + 0.035 * min(1.0, population / 5e6)
    return CityKit(
        names=tuple(names),
        streets=language.streets,
        number_first=language.number_first,
        postal_digits=locales.postal_digits(postal_regex),
        phones=tuple(json.dumps(p) for p in locales.phone_pool(seed, country_code)),
        city_fields=f'"city_code":{json.dumps(code, ensure_ascii=False)},'
        f'"country_code":{json.dumps(country_code)}',
        currency_json=json.dumps(currency),
        usd_rate=locales.USD_RATES.get(currency, 1.0),
        decimals=locales.minor_units(currency),
        level=45.0 * (0.7 + 0.6 * min(1.0, population / 3e6)),
        lat=lat,
        lng=lng,
        spread=spread,
        lng_spread=spread / max(0.2, math.cos(math.radians(lat))),
    )


def _slug(text: str) -> str:
    folded = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    return "-".join("".join(c if c.isalnum() else " " for c in folded).split()) or "hotel"


STANDARD = DataProfile.standard()
"""The data profile records are drawn by unless told otherwise."""

PRICE_SHOCK = 2.5  # a shocked price epoch multiplies every price of the hotel by this


def price_shocked(seed: int, num: int, price_epoch: int, rate: float) -> bool:
    """Whether the hotel's prices at ``price_epoch`` are shocked (a sudden large move)."""
    if not rate or not price_epoch:
        return False
    return _Bits(_digest(seed, "shock", num, price_epoch)).unit() < rate


def render_valid(
    kit: CityKit,
    *,
    seed: int,
    hotel_id: str,
    num: int,
    content_epoch: int,
    price_epoch: int,
    active: bool,
    updated_at: str,
    version: int,
    price_shock_rate: float = 0.0,
    profile: DataProfile = STANDARD,
) -> bytes:
    """The hotel's valid record as compact JSON (UTF-8), keys in the contract's order.

    The standard data profile draws exactly as it always has (the same seed, the same bytes);
    other profiles draw their extra choices from digests of their own.
    """
    deep = not profile.is_standard
    # What a hotel is (name, position, stars, rooms) never changes; a content change edits
    # what a hotel's content team edits (address, phone, facilities, images), as real feeds do.
    b = _Bits(_digest(seed, "content", num, 0), (seed, "content+", num) if deep else None)
    take = b.take
    name_json, local_json, slug = kit.names[take(len(kit.names))]
    lat = kit.lat + (b.unit() + b.unit() + b.unit() - 1.5) * 2.0 * kit.spread
    lat = max(-89.9, min(89.9, lat))
    lng = (kit.lng + (b.unit() + b.unit() + b.unit() - 1.5) * 2.0 * kit.lng_spread + 180.0) % 360.0
    lng -= 180.0
    star = _STAR_TABLE[take(len(_STAR_TABLE))]
    # A hotel written in other scripts keeps them through its content changes.
    foreign = (
        profile.non_ascii_share > 0
        and _Bits(_digest(seed, "script", num, 0)).unit() < profile.non_ascii_share
    )
    text = _NO_BITS
    if foreign:
        text = _Bits(_digest(seed, "text", num, content_epoch), (seed, "text+", num, content_epoch))
        name = richtext.name(_Bits(_digest(seed, "name", num, 0)).take)
        name_json = json.dumps(name, ensure_ascii=False)
    e = _Bits(_digest(seed, "edit", num, content_epoch), (seed, "edit+", num) if deep else None)
    edit = e.take
    number = 1 + edit(250)
    street = kit.streets[edit(len(kit.streets))]
    if foreign:
        street = richtext.street(text.take)
    line1 = f"{number} {street}" if kit.number_first else f"{street} {number}"
    digits = kit.postal_digits
    postal = f'"{edit(10**digits):0{digits}d}"' if digits else "null"
    phone = kit.phones[edit(len(kit.phones))]
    low, high = profile.facilities_per_hotel
    facilities = _pick(edit, len(FACILITIES), low + edit(high - low + 1))
    low, high = profile.images_per_hotel
    n_images = low + edit(high - low + 1)
    captions = [_CAPTION_JSON[edit(len(CAPTIONS))] for _ in range(n_images)]
    if foreign:
        captions = [
            c if text.take(3) else _pick_json(richtext.CAPTIONS_JSON, text) for c in captions
        ]
    images = ",".join(
        f'{{"url":"https://img.example/h/{hotel_id}/{i}.jpg","caption":{caption}}}'
        for i, caption in enumerate(captions, 1)
    )
    p = _Bits(_digest(seed, "price", num, price_epoch), (seed, "price+", num) if deep else None)
    drift = (0.85 + 0.35 * p.unit()) if price_epoch else 1.0
    if price_shocked(seed, num, price_epoch, price_shock_rate):
        drift *= PRICE_SHOCK
    level = kit.level * 1.45 ** (star - 2.0) * drift * kit.usd_rate
    decimals = kit.decimals
    currency = kit.currency_json
    rooms = []
    low, high = profile.rooms_per_hotel
    plan_kinds = RATE_PLANS[: profile.rate_plan_kinds]
    for t in _pick(take, profile.room_kinds, low + take(high - low + 1)):
        base = level * ROOM_TYPES[t][4] * (0.85 + 0.35 * b.unit())
        plans = []
        for i, plan in enumerate(plan_kinds):
            if plan[4] < 1000 and take(1000) >= plan[4]:
                continue
            amount = round(base * plan[3], decimals)
            available = "true" if p.take(10) else "false"
            plans.append(
                f'{_PLAN_HEAD[i]}{available},"price":'
                f'{{"amount":"{amount:.{decimals}f}","currency":{currency}}}}}'
            )
        head = _ROOM_HEAD[t]
        if foreign and not text.take(3):
            head = _ROOM_CODE[t] + _pick_json(richtext.ROOM_NAMES_JSON, text) + _ROOM_TAIL[t]
        rooms.append(head + ",".join(plans) + "]}")
    facility_json = ",".join(_FACILITY_JSON[f] for f in facilities)
    status = "ACTIVE" if active else "INACTIVE"
    description = ""
    low, high = profile.description_chars
    if high:
        d = _Bits(_digest(seed, "description", num, content_epoch), (seed, "description+", num))
        said = richtext.description(d.take, low + d.take(high - low + 1))
        description = f',"description":{json.dumps(said, ensure_ascii=False)}'
    return (
        f'{{"hotel_id":"{hotel_id}","name":{name_json},"name_local":{local_json},'
        f'{kit.city_fields},"address":{{"line1":{json.dumps(line1, ensure_ascii=False)},'
        f'"postal_code":{postal}}},"geo":{{"lat":{lat:.6f},"lng":{lng:.6f}}},'
        f'"star_rating":{star},"phone":{phone},"email":"stay@{slug}-{num % 100_000}.example"'
        f'{description},"facilities":[{facility_json}],"images":[{images}],'
        f'"rooms":[{",".join(rooms)}],"status":"{status}","updated_at":"{updated_at}",'
        f'"version":{version}}}'
    ).encode()


_NO_BITS = _Bits(0)


def _pick_json(values: tuple[str, ...], bits: _Bits) -> str:
    return values[bits.take(len(values))]


def _pick(take: Callable[[int], int], n: int, k: int) -> list[int]:
    """``k`` distinct indices out of ``range(n)``, ascending (a partial Fisher-Yates)."""
    pool = list(range(n))
    k = min(k, n)
    for i in range(k):
        j = i + take(n - i)
        pool[i], pool[j] = pool[j], pool[i]
    return sorted(pool[:k])
