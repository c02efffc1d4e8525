"""A city's walk: every page of a city's listing, through a :class:`SupplierClient`.

The client makes one request; the walk pages through a city with it: by cursor when the
supplier offers one, else by page number, from a checkpoint (:class:`PagePosition`) when
resuming, and by page number again when a cursor expires (410 CURSOR_EXPIRED).

**A walk always ends.** It stops with :class:`~supplier_sync_dagster.core.errors.WalkRunaway`
(``WALK_RUNAWAY``), before the offending page is yielded (so never stored), when:

- a cursor page hands out a cursor the walk has already followed (``A -> B -> A``, at any
  distance);
- two cursor pages in a row bring no hotel id this pass has not seen (one such page is
  let through: the contract lets a hotel appear on two pages);
- the next page would be past what the city's own counts allow: the largest of its
  ``hotel_count`` (``/v1/cities``, when the caller knows it) and the pages' ``total`` and
  ``total_pages``, plus :attr:`WalkLimits.page_slack` of it (at least
  :data:`MIN_SLACK_PAGES`) for a listing that grows while it is walked; never
  more than :attr:`WalkLimits.max_pages`, which is also the limit of a city whose size
  nothing states;
- the walk has made :data:`REQUESTS_PER_PAGE` requests per page allowed (pages, probes, the
  verification pass) and :data:`REQUESTS_PER_SHIFT` per shift it saw (at most one shift per
  page allowed is paid for).

**Pagination drift loses nothing.** Cursors are stable when hotels come and go; page numbers
are not: a hotel removed before the walk's position moves every later hotel one place
back, and the hotel at the next page boundary would be skipped. With the continuity check
(:attr:`WalkLimits.continuity_check`, on by default) every page fetched by number that
continues the walk is checked through the ``hotel_id`` order the contract promises (code
point order): the listing's hotel just before the page must be at or before the last hotel
the walk holds (``last_id``). A page that starts at or before ``last_id`` overlaps and is
fine; otherwise one hotel is asked for (``page_size=1`` at the position just before the
page: a *probe*). If that hotel is past ``last_id`` (or gone), or the probe states another
``total`` than the page (the listing changed between the two answers), it shifted: the walk
steps back page by page until a page starts at or before ``last_id``, yields the pages that
hold hotels it has not reached (a hotel seen twice is harmless, processing is idempotent),
and fetches the page again. An empty page after the first ends the walk only once the page
before it ends at or before ``last_id``.

A walk that saw the listing shift is verified before it ends: a second pass from page 1
(by cursor when offered, checked the same way) yields every page holding a hotel the walk
has not seen; the walk's last page comes after it, so the checkpoint says ``done`` only
once the city is verified, and that pass is the city's listing as it stands after the walk
(:attr:`WalkStats.listed`: a hotel the walk saw that the pass lacks went meanwhile).
:class:`WalkStats` tells what the walk saw (:attr:`WalkStats.drift`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from supplier_sync_dagster.core.errors import ConfigError, CursorExpired, WalkRunaway
from supplier_sync_dagster.core.supplier.client import SupplierClient
from supplier_sync_dagster.core.supplier.models import (
    CityPage,
    Fetched,
    HotelsPage,
    PagePosition,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_CURSOR_EXPIRIES = 3
DEFAULT_MAX_PAGES = 10_000
DEFAULT_PAGE_SLACK = 0.1
# Pages past a city's expected ones that a walk may always go (its slack's floor).
MIN_SLACK_PAGES = 2
# A walk's requests: its pages, a probe per page fetched by number and the verification
# pass stay under this many per page allowed, plus REQUESTS_PER_SHIFT for each shift seen
# (a probe, a page or two stepped back, the page again), counted up to one per page allowed.
REQUESTS_PER_PAGE = 5
REQUESTS_PER_SHIFT = 6
# Cursor pages in a row that may bring no new hotel (the contract: a hotel can appear on
# two pages); one more is a runaway.
REPEATED_PAGES_ALLOWED = 1
# Untrusted text (cursors, city codes) in a message is cut to this many characters.
SHOWN_CHARS = 16

Drift = Literal["SHIFTED", "UNVERIFIED", "UNCHECKED"]
"""What a walk's listing did under it: SHIFTED (seen, and the walk verified), UNVERIFIED
(seen, and the verification pass saw it shift too), UNCHECKED (pages fetched by number
after cursors without the continuity check: a shift would have gone unseen)."""


@dataclass(frozen=True)
class WalkLimits:
    """How far a city's walk may go, and whether it checks its pages for a shifted listing.

    Attributes:
        max_pages: The most pages of a walk: the limit of a city whose size nothing states,
            and a ceiling over any stated size.
        page_slack: Share of the city's expected pages a walk may go past them (hotels
            added while it is walked), at least :data:`MIN_SLACK_PAGES`.
        continuity_check: Check every page fetched by number that continues the walk (see
            the module docstring). Off: only the page where a walk turns to page numbers
            is checked, by stepping back one page (a shift later on can skip a hotel).
        max_cursor_expiries: Cursor expiries after which the walk stops asking for
            cursors and continues by page number only.
    """

    max_pages: int = DEFAULT_MAX_PAGES
    page_slack: float = DEFAULT_PAGE_SLACK
    continuity_check: bool = True
    max_cursor_expiries: int = DEFAULT_MAX_CURSOR_EXPIRIES

    def __post_init__(self) -> None:
        if self.max_pages < 1 or not 0 <= self.page_slack <= 10:
            raise ConfigError(
                f"walk limits need max_pages >= 1 and page_slack in [0, 10]; got {self!r}"
            )

    def page_limit(self, expected_pages: int | None) -> int:
        """The most pages a walk of a city of ``expected_pages`` (None: unknown) may fetch."""
        if expected_pages is None:
            return self.max_pages
        slack = max(MIN_SLACK_PAGES, math.ceil(expected_pages * self.page_slack))
        return min(self.max_pages, expected_pages + slack)


@dataclass
class WalkStats:
    """What one walk of a city saw (its own, not an earlier attempt's).

    Attributes:
        requests: Listing requests made (pages, probes, pages read again, verification).
        probes: Of those, one-hotel requests that checked a page's continuity.
        fallbacks: Times the walk went on by page number after cursors (a 410, or a
            checkpoint without a cursor).
        listed: The hotel ids of a verification pass that saw no shift: the city's listing
            as it stands after the walk (hotels the walk saw that it lacks went meanwhile).
        shifts: Times the listing was seen to have shifted under a page-number walk.
        unchecked: Pages fetched by number that continued the walk without the
            continuity check (the pages read again where it turned to page numbers too).
        verified: None: no verification was needed; True: the verification pass saw no
            shift; False: it saw one too.
        recovered: Hotels the verification pass found that the walk had not seen.
    """

    requests: int = 0
    probes: int = 0
    fallbacks: int = 0
    listed: frozenset[str] | None = field(default=None, repr=False)
    shifts: int = 0
    unchecked: int = 0
    verified: bool | None = None
    recovered: int = 0

    @property
    def drift(self) -> Drift | None:
        """What the listing did under the walk (None: nothing that could lose a hotel)."""
        if self.shifts:
            return "SHIFTED" if self.verified else "UNVERIFIED"
        return "UNCHECKED" if self.unchecked else None

    @property
    def complete(self) -> bool:
        """Whether a walk that ended saw every hotel its city listed throughout: what the
        catalog may count a hotel's absence by (tombstones)."""
        return self.drift in (None, "SHIFTED")


def shown(text: str) -> str:
    """Untrusted text for a message: at most :data:`SHOWN_CHARS` characters, quoted."""
    return repr(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…")


def hotel_ids(page: HotelsPage) -> list[str]:
    """The page's hotel ids that are strings, in order."""
    return [h for r in page.hotels if isinstance(h := r.get("hotel_id"), str)]


@dataclass
class _Pass:
    """One pass over the listing: where it stands and what it has seen."""

    number: int
    cursor: str | None
    last_id: str | None
    # The pages a step back found, to yield before going on (page number, page).
    queued: list[tuple[int, Fetched[HotelsPage]]] = field(default_factory=list)
    followed: dict[str, int] = field(default_factory=dict)  # cursor -> page it fetched
    seen: set[str] = field(default_factory=set)
    repeats: int = 0
    shifts: int = 0
    # Without the continuity check: step back once before the next page by number.
    overlap_first: bool = False


class CityWalk:
    """Every page of one city, once iterated (see the module docstring).

    Example:
        >>> walk = CityWalk(client, "BKK", page_size=100, hotel_count=1234)  # doctest: +SKIP
        >>> for page in walk:  # doctest: +SKIP
        ...     commit(page.page, page.raw)  # then store page.position as the checkpoint
        >>> walk.stats.drift  # doctest: +SKIP
    """

    def __init__(
        self,
        client: SupplierClient,
        city_code: str,
        *,
        page_size: int = 100,
        start: PagePosition | None = None,
        hotel_count: int | None = None,
        limits: WalkLimits | None = None,
    ) -> None:
        """Prepare a walk (nothing is requested before iterating).

        Args:
            client: The supplier's client (one request at a time).
            city_code: The supplier's city code.
            page_size: Hotels per page (1-500).
            start: Checkpoint to resume from (``CityPage.position`` of the last committed
                page); None starts at page 1.
            hotel_count: The city's ``hotel_count`` from ``/v1/cities``, when known.
            limits: How far the walk may go; defaults to :class:`WalkLimits()`.
        """
        self.client = client
        self.city_code = city_code
        self.page_size = page_size
        self.start = start or PagePosition()
        self.hotel_count = hotel_count
        self.limits = limits or WalkLimits()
        self.stats = WalkStats()
        self._seen: set[str] = set()
        self._expiries = 0
        self._total = 0
        self._total_pages = 0
        self._size = page_size

    def __iter__(self) -> Iterator[CityPage]:
        """The pages, each with the position to checkpoint once it is committed.

        Raises:
            WalkRunaway: The walk would not end (nothing past the offending page is yielded).
            SupplierError: A call failed beyond retries (the checkpoint stays valid).
        """
        start = self.start
        if start.done:
            return
        main = _Pass(start.page, start.cursor, start.last_hotel_id, seen=self._seen)
        if start.cursor is None and start.last_hotel_id is not None and start.page > 1:
            self.stats.fallbacks += 1
            main.overlap_first = not self.limits.continuity_check
        held: CityPage | None = None
        for page in self._pass(main):
            if page.position.done and self.stats.shifts:
                held = page  # yielded once the walk is verified: its checkpoint says done
            else:
                yield page
        if held is None:
            return
        yield from self._verify()
        yield held

    # --- one pass ---------------------------------------------------------------------------

    def _pass(self, p: _Pass) -> Iterator[CityPage]:
        """The pages of one pass over the listing, from ``p`` to the listing's end."""
        while True:
            fetched_by: Literal["cursor", "page"] = "page"
            if p.queued:
                p.number, fetched = p.queued.pop(0)
            elif p.cursor is not None and self._expiries < self.limits.max_cursor_expiries:
                got = self._by_cursor(p)
                if got is None:
                    continue
                fetched, fetched_by = got, "cursor"
            elif p.overlap_first:
                p.overlap_first = False
                assert p.last_id is not None
                p.queued = self._pages_from_overlap(p.number, p.last_id)
                continue
            else:
                self._check_page_limit(p.number)
                fetched = self._get(page=p.number)
                if not self._continues(p, fetched):
                    continue
            page = fetched.data
            self._count(page)
            done, next_cursor = self._next(p, fetched, fetched_by)
            # Pages a step back found are yielded, all of them, before the pass may end.
            done = done and not p.queued
            p.seen.update(hotel_ids(page))
            last = page.last_hotel_id
            if last is not None and (p.last_id is None or last > p.last_id):
                # An overlap page ends before the mark: never move it back.
                p.last_id = last
            position = PagePosition(
                page=p.number + 1, cursor=next_cursor, last_hotel_id=p.last_id, done=done
            )
            yield CityPage(
                city_code=self.city_code,
                page=page,
                raw=fetched.raw,
                page_number=p.number,
                fetched_by=fetched_by,
                position=position,
            )
            if done:
                return
            p.number += 1
            p.cursor = next_cursor

    def _by_cursor(self, p: _Pass) -> Fetched[HotelsPage] | None:
        """The pass's next page by its cursor; None when the cursor expired (the pass goes
        on by page number)."""
        assert p.cursor is not None
        self._check_page_limit(p.number)
        try:
            fetched = self._get(cursor=p.cursor)
        except CursorExpired:
            self._expiries += 1
            self.stats.fallbacks += 1
            logger.info(
                "supplier %s city walk: cursor expired before page %d; continuing by page number",
                self.client.supplier_id,
                p.number,
            )
            p.cursor = None
            p.overlap_first = (
                not self.limits.continuity_check and p.last_id is not None and p.number > 1
            )
            return None
        p.followed.setdefault(p.cursor, p.number)
        return fetched

    def _next(
        self, p: _Pass, fetched: Fetched[HotelsPage], fetched_by: Literal["cursor", "page"]
    ) -> tuple[bool, str | None]:
        """Whether the page ends the pass, and the cursor to go on with; raises on a
        runaway before the page is yielded."""
        page = fetched.data
        if fetched_by == "cursor":
            self._check_repeats(p, page)
        if not page.hotels:
            return True, None
        offered = page.next_cursor
        if offered is not None and self._expiries < self.limits.max_cursor_expiries:
            if offered not in p.followed:
                return False, offered
            if fetched_by == "cursor":
                raise self._runaway(
                    f"cursor {shown(offered)} came back after "
                    f"{p.number - p.followed[offered] + 1} page(s)"
                )
            # A page read by number may end where the walk has been already (an overlap):
            # its cursor leads back there; the next page number goes on.
            return False, None
        if fetched_by == "cursor" and offered is None:
            return True, None  # a null cursor on a cursor page marks the last page
        return page.total_pages is not None and p.number >= page.total_pages, None

    def _check_repeats(self, p: _Pass, page: HotelsPage) -> None:
        ids = hotel_ids(page)
        if not ids or any(h not in p.seen for h in ids):
            p.repeats = 0
            return
        p.repeats += 1
        if p.repeats > REPEATED_PAGES_ALLOWED:
            raise self._runaway(
                f"{p.repeats} cursor pages in a row held only hotels seen before "
                f"(to page {p.number})"
            )

    # --- continuity -------------------------------------------------------------------------

    def _continues(self, p: _Pass, fetched: Fetched[HotelsPage]) -> bool:
        """Whether page ``p.number``, just fetched by number, continues the pass; if not,
        the pages a step back found are queued (the page is then fetched again)."""
        if p.number == 1 or p.last_id is None:
            return True
        if not self.limits.continuity_check:
            self.stats.unchecked += 1
            return True
        first = fetched.data.first_hotel_id
        if first is not None and first <= p.last_id:
            return True  # it overlaps what the walk holds
        if fetched.data.hotels:
            probe = self._probe((p.number - 1) * self._size)
            before = probe.first_hotel_id
            if before is not None and before <= p.last_id and _same_total(probe, fetched.data):
                return True
            p.queued = self._step_back(p.number, p.last_id)
        else:
            # An empty page: the end, once the page before ends at or before last_id.
            p.queued = self._step_back(p.number, p.last_id)
            if not p.queued:
                return True
        # The pages found go first; the page is fetched again after them.
        self._shifted(p)
        return False

    def _shifted(self, p: _Pass) -> None:
        p.shifts += 1
        self.stats.shifts += 1
        logger.info(
            "supplier %s city walk: the listing of city %s shifted under page %d; stepping back",
            self.client.supplier_id,
            shown(self.city_code),
            p.number,
        )

    def _probe(self, position: int) -> HotelsPage:
        """The one-hotel page at 1-based ``position`` of the listing."""
        self.stats.probes += 1
        return self._get(page=position, page_size=1).data

    def _step_back(self, number: int, last_id: str) -> list[tuple[int, Fetched[HotelsPage]]]:
        """Pages ``number-1``, ``number-2``... until one starts at or before ``last_id`` (or
        page 1): those holding a hotel past ``last_id``, in page order."""
        found: list[tuple[int, Fetched[HotelsPage]]] = []
        for k in range(number - 1, 0, -1):
            fetched = self._get(page=k)
            if any(h > last_id for h in hotel_ids(fetched.data)):
                found.append((k, fetched))
            first = fetched.data.first_hotel_id
            if first is not None and first <= last_id:
                break
        return found[::-1]

    def _pages_from_overlap(
        self, number: int, last_id: str
    ) -> list[tuple[int, Fetched[HotelsPage]]]:
        """Without the continuity check: pages ``number``, ``number-1``... until one starts
        at or before ``last_id``."""
        found: dict[int, Fetched[HotelsPage]] = {}
        k = number
        while True:
            fetched = self._get(page=k)
            self.stats.unchecked += 1
            found[k] = fetched
            first = fetched.data.first_hotel_id
            if k == 1 or (first is not None and first <= last_id):
                break
            k -= 1
        return [(n, found[n]) for n in sorted(found)]

    # --- verification -----------------------------------------------------------------------

    def _verify(self) -> Iterator[CityPage]:
        """A second pass from page 1; yields its pages that hold a hotel the walk has not
        seen (their positions never say done: the walk's last page comes after them)."""
        check = _Pass(1, None, None)
        logger.info(
            "supplier %s city walk: verifying city %s after %d shift(s)",
            self.client.supplier_id,
            shown(self.city_code),
            self.stats.shifts,
        )
        for page in self._pass(check):
            new = [h for h in hotel_ids(page.page) if h not in self._seen]
            if not new:
                continue
            self._seen.update(new)
            self.stats.recovered += len(new)
            yield dataclasses.replace(
                page, position=page.position.model_copy(update={"done": False})
            )
        self.stats.verified = check.shifts == 0
        if self.stats.verified:
            self.stats.listed = frozenset(check.seen)

    # --- requests and limits ----------------------------------------------------------------

    def _get(
        self, *, page: int | None = None, cursor: str | None = None, page_size: int | None = None
    ) -> Fetched[HotelsPage]:
        limit = self._page_limit()
        budget = REQUESTS_PER_PAGE * limit + REQUESTS_PER_SHIFT * min(self.stats.shifts, limit)
        if self.stats.requests >= budget:
            raise self._runaway(
                f"{self.stats.requests} requests, the most {limit} page(s) and "
                f"{self.stats.shifts} shift(s) allow"
            )
        self.stats.requests += 1
        return self.client.get_hotels_page(
            self.city_code, page=page, cursor=cursor, page_size=page_size or self.page_size
        )

    def _count(self, page: HotelsPage) -> None:
        """Takes the city's size and page size as the page states them."""
        if isinstance(page.page_size, int) and 1 <= page.page_size < self._size:
            self._size = page.page_size
        if isinstance(page.total, int) and page.total > self._total:
            self._total = page.total
        if isinstance(page.total_pages, int) and page.total_pages > self._total_pages:
            self._total_pages = page.total_pages

    def _expected_pages(self) -> int | None:
        counts = [self._total_pages] if self._total_pages else []
        for hotels in (self.hotel_count, self._total or None):
            if hotels is not None and hotels >= 0:
                counts.append(max(1, math.ceil(hotels / self._size)))
        return max(counts) if counts else None

    def _page_limit(self) -> int:
        return self.limits.page_limit(self._expected_pages())

    def _check_page_limit(self, number: int) -> None:
        limit = self._page_limit()
        if number <= limit:
            return
        expected = self._expected_pages()
        why = (
            f"its counts say {expected} page(s) of {self._size}, plus slack"
            if expected is not None
            else "no count states its size"
        )
        raise self._runaway(f"page {number} is past the {limit} allowed ({why})")

    def _runaway(self, what: str) -> WalkRunaway:
        # The rule first: a failed city's line shows the start of its error.
        return WalkRunaway(
            f"WALK_RUNAWAY: {what}; city {shown(self.city_code)} of supplier "
            f"{self.client.supplier_id}, stopped after {self.stats.requests} request(s)"
        )


def _same_total(a: HotelsPage, b: HotelsPage) -> bool:
    """False when both pages state a ``total`` and they differ: the listing changed between
    them, so one cannot vouch for the other."""
    return not (isinstance(a.total, int) and isinstance(b.total, int) and a.total != b.total)
