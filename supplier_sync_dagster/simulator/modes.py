"""Named misbehaviours: a supplier that trickles, loops, floods, lies or shifts under the walk.

Each mode (``FaultProfile.modes``, switched at run time with ``POST /_sim/modes``) is always on,
unlike the per-request fault rates, and touches the listings of ``mode_cities`` (every city
when empty; then the change feed too):

==================  ==========================================================================
``slow_body``       the headers come at once, the body trickles (1 byte/s by default)
``runaway_cursor``  every page carries a new cursor, never null, that serves the same page again
``cursor_cycle``    cursors come back: the last page's cursor leads to the first page (A→B→A)
``endless_pages``   page numbers never run empty (past the end: the last page again), no
                    ``total``/``total_pages``, no cursor
``inflating_body``  a small gzip body that inflates to ``inflated_body_bytes`` (a bomb)
``huge_body``       a page of ``huge_body_bytes``, sent uncompressed
``deep_json``       a page whose ``hotels`` is an array nested 100,000 deep
``bad_bytes``       the city's first hotel has an invalid UTF-8 byte in its name
``truncated_body``  the connection closes half-way through the body
``refused``         the server accepts no connection (a server-level mode: see ``server``)
``unauthorized``    every contract request answers 401: the key was revoked
``future_timestamp`` the city's first hotel says ``updated_at`` 2099-01-01, in its listing, its
                    detail and the change feed (where it sorts last)
``drift``           cursors always expire, and each page asked by number from page 2 on first
                    removes the city's first hotel and adds one at its end (``drift_shifts``
                    times): page numbers shift under the walk while the counts stay equal
``dropped_city``    the supplier stops serving the city: ``/v1/cities`` lacks it, and its
                    listing, summary and hotels answer 404 (``CITY_NOT_FOUND``,
                    ``HOTEL_NOT_FOUND``); the change feed leaves its hotels out
``withdrawn_hotel`` the supplier withdraws the city's first hotel for a while: its listing
                    lacks it (the counts too) and its detail answers 404; switched off, the
                    hotel is back as it would be
``undisclosed_limit`` the rate limit is kept but never told: no ``X-RateLimit-*`` headers,
                    and its 429s carry no ``Retry-After``
``limit_swing``     the rate limit halves ``limit_swing_seconds`` after the first limited
                    request, and doubles back as long again later (the supplier's day)
``shared_limit``    another account on the same API key, unseen, spends half the limit
==================  ==========================================================================

The ground truth (``Simulator.ground_truth``) follows the modes: a ``bad_bytes`` hotel is bad
(``INVALID_UTF8``), a ``future_timestamp`` one bad (``FUTURE_TIMESTAMP``), a drifted city lists
what it lists after its shifts, a dropped city is not there at all, nor a withdrawn hotel.
"""

from __future__ import annotations

import datetime as dt
import functools
import threading
import zlib
from dataclasses import dataclass, field

from supplier_sync_dagster.simulator.config import check_modes
from supplier_sync_dagster.simulator.data import CityState, Hotel

FUTURE_UPDATED_AT = "2099-01-01T00:00:00Z"
FUTURE_SECONDS = int(dt.datetime(2099, 1, 1, tzinfo=dt.UTC).timestamp())
DEEP_JSON_DEPTH = 100_000
INVALID_UTF8 = "INVALID_UTF8"
FUTURE_TIMESTAMP = "FUTURE_TIMESTAMP"
# Modes that change how bytes travel, and so also apply to the change feed.
BODY_MODES = ("slow_body", "inflating_body", "huge_body", "deep_json", "truncated_body")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ActiveModes:
    """The modes on now and the cities they touch (empty: every city).

    Attributes:
        names: the modes that are on.
        cities: the city codes whose listings they touch; empty for all.
    """

    names: frozenset[str] = frozenset()
    cities: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls, names: tuple[str, ...] | list[str], cities: tuple[str, ...] | list[str]
    ) -> ActiveModes:
        """Checked modes.

        Raises:
            ValueError: an unknown mode name.
        """
        check_modes(list(names))
        return cls(frozenset(names), frozenset(cities))

    def on(self, name: str, city: str | None = None) -> bool:
        """Whether ``name`` is on for ``city`` (None: the change feed and other endpoints)."""
        if name not in self.names:
            return False
        if city is None:
            return not self.cities
        return not self.cities or city in self.cities


@functools.lru_cache(maxsize=2)
def inflating_gzip(inflated: int) -> bytes:
    """A gzip body that inflates to ``inflated`` bytes of valid JSON (spaces inside an object),
    compressed a megabyte at a time so that the simulator never holds the inflated bytes."""
    head, tail = b'{"hotels":[],"padding":"', b'"}'
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    parts = [packer.compress(head)]
    left = max(0, inflated - len(head) - len(tail))
    block = b" " * _CHUNK
    while left > 0:
        n = min(left, _CHUNK)
        parts.append(packer.compress(block if n == _CHUNK else block[:n]))
        left -= n
    parts.append(packer.compress(tail))
    parts.append(packer.flush())
    return b"".join(parts)


@functools.lru_cache(maxsize=2)
def huge_page(city_head: bytes, size: int) -> bytes:
    """A page of ``size`` bytes: ``city_head`` (a JSON object's bytes) with an empty
    ``hotels`` and a padding string that fills it up."""
    head = city_head[:-1] + b',"hotels":[],"padding":"'
    return head + b"x" * max(0, size - len(head) - 2) + b'"}'


def deep_page(city_head: bytes, depth: int) -> bytes:
    """``city_head`` whose ``hotels`` is an array nested ``depth`` deep."""
    return city_head[:-1] + b',"hotels":' + b"[" * depth + b"]" * depth + b"}"


def with_bad_byte(record: bytes) -> bytes:
    """A rendered hotel whose name carries a byte that is not UTF-8 (0xFF)."""
    return record.replace(b'"name":"', b'"name":"\xff', 1)


def future_dated(record: bytes) -> bytes:
    """A rendered hotel whose ``updated_at`` is :data:`FUTURE_UPDATED_AT`."""
    start = record.find(b'"updated_at":"')
    if start < 0:
        return record
    start += len(b'"updated_at":"')
    end = record.find(b'"', start)
    return record[:start] + FUTURE_UPDATED_AT.encode() + record[end:]


@dataclass
class Drift:
    """What ``drift`` did to one city: hotels removed from its start, hotels added at its end.

    Attributes:
        removed: numbers of the hotels removed.
        added: the hotels added, by number.
        shifts: shifts made so far.
    """

    removed: set[int] = field(default_factory=set)
    added: dict[int, Hotel] = field(default_factory=dict)
    shifts: int = 0

    def apply(self, state: CityState) -> CityState:
        """The city's listing with the shifts made so far."""
        if not self.removed and not self.added:
            return state
        ids = tuple(n for n in state.ids if n not in self.removed) + tuple(sorted(self.added))
        hotels = {n: h for n, h in state.hotels.items() if n not in self.removed}
        hotels.update(self.added)
        return CityState(state.day, ids, hotels, state.pending, state.retired | self.removed)


class DriftLedger:
    """Every drifted city's :class:`Drift`, shifted one page request at a time."""

    def __init__(self, max_shifts: int, stride: int, span: int) -> None:
        """Args:
        max_shifts: shifts per city at most.
        stride: the gap between a new hotel's number and the last one's.
        span: hotel numbers a city may use (from ``index * span``).
        """
        self._max, self._stride, self._span = max_shifts, stride, span
        self._lock = threading.Lock()
        self._cities: dict[int, Drift] = {}

    def shift(self, city_index: int, state: CityState, at: int) -> None:
        """Remove the city's first listed hotel and add a new one at its end, unless it has
        shifted ``max_shifts`` times or lists nothing."""
        with self._lock:
            drift = self._cities.setdefault(city_index, Drift())
            now = drift.apply(state)
            if drift.shifts >= self._max or not now.ids:
                return
            new = now.ids[-1] + self._stride
            if new >= (city_index + 1) * self._span:
                return
            drift.removed.add(now.ids[0])
            drift.added.pop(now.ids[0], None)
            drift.added[new] = Hotel(new, 1, at, 0, 0, True, -1)
            drift.shifts += 1

    def get(self, city_index: int) -> Drift | None:
        """The city's drift, if it has shifted."""
        return self._cities.get(city_index)

    def all(self) -> dict[int, Drift]:
        """Every drifted city's drift, by city index."""
        with self._lock:
            return dict(self._cities)
