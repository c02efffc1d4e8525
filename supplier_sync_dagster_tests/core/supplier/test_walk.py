"""The city walk: cursor walks, 410 fallback to page numbers, resume from checkpoints; walks
that always end (WALK_RUNAWAY) and pagination drift that loses nothing."""

from __future__ import annotations

import base64
import itertools
from collections.abc import Callable

import httpx
import pytest

from supplier_sync_dagster.core.errors import SupplierUnavailable, WalkRunaway
from supplier_sync_dagster.core.supplier import CityPage, PagePosition, RetryPolicy
from supplier_sync_dagster.core.supplier.walk import CityWalk, WalkLimits
from supplier_sync_dagster_tests.core.supplier.fakes import (
    FakeCatalog,
    Script,
    hotel,
    ids,
    json_response,
    make_client,
)

UNCHECKED = WalkLimits(continuity_check=False)


def walked_ids(pages: list[CityPage]) -> list[str]:
    return [h["hotel_id"] for p in pages for h in p.page.hotels]


def kinds(requests: list[httpx.Request]) -> list[str]:
    """``c`` for a cursor request, ``p3`` for page 3, ``p20/1`` for a one-hotel probe."""
    out = []
    for r in requests:
        if "cursor" in r.url.params:
            out.append("c")
        elif r.url.params.get("page_size") == "1":
            out.append(f"p{r.url.params['page']}/1")
        else:
            out.append(f"p{r.url.params['page']}")
    return out


def test_cursor_walk_follows_next_cursor_until_null() -> None:
    catalog = FakeCatalog(ids(25))
    client, _ = make_client(catalog)
    pages = list(CityWalk(client, "BKK", page_size=10))
    assert walked_ids(pages) == ids(25)
    assert kinds(catalog.requests) == ["p1", "c", "c"]
    assert [p.fetched_by for p in pages] == ["page", "cursor", "cursor"]
    assert [p.page_number for p in pages] == [1, 2, 3]
    last = pages[-1].position
    assert last.done and last.cursor is None and last.last_hotel_id == "H000025"
    assert pages[0].position == PagePosition(
        page=2, cursor=pages[0].page.next_cursor, last_hotel_id="H000010"
    )
    assert pages[1].raw.startswith(b"{") and b"H000011" in pages[1].raw


def test_page_number_walk_checks_each_next_page_with_a_one_hotel_probe() -> None:
    catalog = FakeCatalog(ids(30), cursors=False)
    client, _ = make_client(catalog)
    walk = CityWalk(client, "BKK", page_size=10)
    pages = list(walk)
    assert walked_ids(pages) == ids(30)
    # stops at total_pages, no extra page; the hotel before each next page is asked for
    assert kinds(catalog.requests) == ["p1", "p2", "p10/1", "p3", "p20/1"]
    assert pages[-1].position.done
    assert walk.stats.probes == 2 and walk.stats.shifts == 0 and walk.stats.drift is None


def test_page_number_walk_without_the_check_asks_no_probe() -> None:
    catalog = FakeCatalog(ids(30), cursors=False)
    client, _ = make_client(catalog)
    walk = CityWalk(client, "BKK", page_size=10, limits=UNCHECKED)
    assert walked_ids(list(walk)) == ids(30)
    assert kinds(catalog.requests) == ["p1", "p2", "p3"]
    assert walk.stats.unchecked == 2 and walk.stats.drift == "UNCHECKED"


def test_empty_city_is_one_empty_page() -> None:
    catalog = FakeCatalog([], cursors=True)
    client, _ = make_client(catalog)
    pages = list(CityWalk(client, "BKK", page_size=10))
    assert len(pages) == 1 and pages[0].page.hotels == [] and pages[0].position.done


def page_body(n: int, hotels: list[str], **more: object) -> dict[str, object]:
    return {"page": n, "hotels": [{"hotel_id": h} for h in hotels], **more}


def test_empty_page_ends_the_walk_once_the_page_before_still_ends_where_the_walk_is() -> None:
    script = Script(
        json_response(200, page_body(1, ["A"])),
        json_response(200, page_body(2, ["B"])),
        json_response(200, page_body(1, ["A"])),  # the probe before page 2: A, as walked
        json_response(200, page_body(3, [])),
        json_response(200, page_body(2, ["B"])),  # page 2 again: still ends at B
    )
    client, _ = make_client(script)
    pages = list(CityWalk(client, "X", page_size=1))
    assert walked_ids(pages) == ["A", "B"] and len(pages) == 3 and pages[-1].position.done


def test_cursor_expired_falls_back_to_page_numbers_checked_by_a_probe() -> None:
    # cursor requests #2 expire: pages 1 (number), 2 (cursor), then 3 -> 410
    catalog = FakeCatalog(ids(50), expire=[2])
    client, _ = make_client(catalog)
    walk = CityWalk(client, "BKK", page_size=10)
    pages = list(walk)
    # page 3 by number; the hotel before it is still the last one walked: nothing shifted
    assert kinds(catalog.requests) == ["p1", "c", "c", "p3", "p20/1", "c", "c"]
    assert [p.page_number for p in pages] == [1, 2, 3, 4, 5]
    assert walked_ids(pages) == ids(50)
    assert client.stats().cursor_expired == 1
    assert walk.stats.fallbacks == 1 and walk.stats.shifts == 0 and walk.stats.drift is None


def test_cursor_expired_without_the_check_rereads_the_last_completed_page() -> None:
    catalog = FakeCatalog(ids(50), expire=[2])
    client, _ = make_client(catalog)
    pages = list(CityWalk(client, "BKK", page_size=10, limits=UNCHECKED))
    assert kinds(catalog.requests) == ["p1", "c", "c", "p3", "p2", "c", "c"]
    assert [p.page_number for p in pages] == [1, 2, 2, 3, 4, 5]
    assert sorted(set(walked_ids(pages))) == ids(50)
    marks = [p.position.last_hotel_id or "" for p in pages]
    assert marks == sorted(marks)  # the re-read page never moves the checkpoint back


@pytest.mark.parametrize("limits", [WalkLimits(), UNCHECKED], ids=["checked", "unchecked"])
def test_fallback_steps_back_further_when_hotels_were_removed(limits: WalkLimits) -> None:
    removed = False

    def on_request(cat: FakeCatalog, request: httpx.Request) -> None:
        nonlocal removed
        if cat.cursor_requests == 2 and not removed:
            # 15 hotels before the checkpoint vanish: page numbers shift by 1.5 pages
            cat.ids = [i for i in cat.ids if not "H000001" <= i <= "H000015"]
            removed = True

    catalog = FakeCatalog(ids(60), expire=[3], on_request=on_request)
    client, _ = make_client(catalog)
    pages = list(CityWalk(client, "BKK", page_size=10, limits=limits))
    seen = set(walked_ids(pages))
    assert seen >= set(ids(45, start=16))  # nothing that still exists was skipped


def test_repeated_expiry_switches_to_page_numbers_for_good() -> None:
    catalog = FakeCatalog(ids(60), expire=range(1, 100))
    client, _ = make_client(catalog)
    walk = CityWalk(client, "BKK", page_size=10, limits=WalkLimits(max_cursor_expiries=2))
    pages = list(walk)
    assert sorted(set(walked_ids(pages))) == ids(60)
    assert catalog.cursor_requests == 2 and walk.stats.fallbacks == 2
    assert pages[-1].position.done


def test_resume_from_a_cursor_checkpoint() -> None:
    catalog = FakeCatalog(ids(30))
    client, _ = make_client(catalog)
    first = next(iter(CityWalk(client, "BKK", page_size=10)))
    checkpoint = PagePosition.model_validate_json(first.position.model_dump_json())

    catalog.requests.clear()
    pages = list(CityWalk(client, "BKK", page_size=10, start=checkpoint))
    assert walked_ids(pages) == ids(20, start=11)
    assert kinds(catalog.requests) == ["c", "c"]
    assert [p.page_number for p in pages] == [2, 3]


def test_resume_from_a_page_number_checkpoint_checks_the_page_before() -> None:
    catalog = FakeCatalog(ids(30), cursors=False)
    client, _ = make_client(catalog)
    start = PagePosition(page=3, last_hotel_id="H000020")
    walk = CityWalk(client, "BKK", page_size=10, start=start)
    pages = list(walk)
    assert kinds(catalog.requests) == ["p3", "p20/1"]
    assert [p.page_number for p in pages] == [3] and walked_ids(pages) == ids(10, start=21)
    assert walk.stats.fallbacks == 1


def test_resume_from_a_page_number_checkpoint_without_the_check_rereads_the_last_page() -> None:
    catalog = FakeCatalog(ids(30), cursors=False)
    client, _ = make_client(catalog)
    start = PagePosition(page=3, last_hotel_id="H000020")
    pages = list(CityWalk(client, "BKK", page_size=10, start=start, limits=UNCHECKED))
    assert kinds(catalog.requests) == ["p3", "p2"]  # p3 first id > checkpoint, so check p2
    assert [p.page_number for p in pages] == [2, 3]
    assert walked_ids(pages) == ids(20, start=11)


def test_resume_from_page_without_last_id_goes_straight_there() -> None:
    catalog = FakeCatalog(ids(30), cursors=False)
    client, _ = make_client(catalog)
    pages = list(CityWalk(client, "BKK", page_size=10, start=PagePosition(page=3)))
    assert kinds(catalog.requests) == ["p3"] and walked_ids(pages) == ids(10, start=21)


def test_done_checkpoint_yields_nothing() -> None:
    client, _ = make_client(Script())
    assert list(CityWalk(client, "BKK", start=PagePosition(page=9, done=True))) == []


def test_failure_mid_walk_leaves_a_valid_checkpoint() -> None:
    catalog = FakeCatalog(ids(30))
    failing = Script(
        catalog, *[httpx.Response(503)] * 3
    )  # page 1 served, then the supplier is down
    client, _ = make_client(failing, retry=RetryPolicy(max_attempts=3, base_delay=0.01))
    walk = iter(CityWalk(client, "BKK", page_size=10))
    first = next(walk)
    with pytest.raises(SupplierUnavailable):
        next(walk)
    assert first.position.cursor is not None and first.position.last_hotel_id == "H000010"


# --- a walk always ends -------------------------------------------------------------------------


class Looping:
    """A supplier of one city that never lets a walk end, in the way ``answer`` says."""

    def __init__(self, answer: Callable[[httpx.Request, int], dict[str, object]]) -> None:
        self.answer = answer
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        assert len(self.requests) <= 100, "the walk did not stop"
        return json_response(200, self.answer(request, len(self.requests)))


def walk_until_runaway(
    supplier: Looping, **kw: object
) -> tuple[list[CityPage], WalkRunaway, CityWalk]:
    client, _ = make_client(supplier)
    walk = CityWalk(client, "loop", page_size=10, **kw)  # type: ignore[arg-type]
    pages: list[CityPage] = []
    with pytest.raises(WalkRunaway) as caught:
        for page in walk:
            pages.append(page)
    assert caught.value.error_code == "WALK_RUNAWAY"
    assert str(caught.value).startswith("WALK_RUNAWAY: ") and "city 'loop'" in str(caught.value)
    assert walk.stats.requests == len(supplier.requests)
    return pages, caught.value, walk


def test_a_new_cursor_on_every_page_of_one_hotel_is_a_runaway() -> None:
    supplier = Looping(lambda r, n: {"hotels": [hotel("H1")], "total": 1, "next_cursor": f"c{n}"})
    pages, err, _ = walk_until_runaway(supplier, hotel_count=1)
    # page 1 by number, page 2 by cursor (one repeat is let through), page 3 stops it
    assert len(supplier.requests) == 3 and len(pages) == 2
    assert str(err).startswith("WALK_RUNAWAY: 2 cursor pages in a row held only hotels seen")


def test_a_new_cursor_and_new_hotels_on_every_page_stop_at_the_city_s_size() -> None:
    def answer(request: httpx.Request, n: int) -> dict[str, object]:
        return {"hotels": [hotel(f"H{n:03d}{i}") for i in range(10)], "next_cursor": f"c{n}"}

    pages, err, _ = walk_until_runaway(Looping(answer), hotel_count=25)
    # 25 hotels are 3 pages of 10; 2 pages of slack: page 6 is never asked for
    assert len(pages) == 5 and "page 6 is past the 5 allowed" in str(err)
    assert "(its counts say 3 page(s) of 10, plus slack)" in str(err)


def test_a_walk_of_a_city_whose_size_nothing_states_stops_at_max_pages() -> None:
    def answer(request: httpx.Request, n: int) -> dict[str, object]:
        return {"hotels": [hotel(f"H{n:03d}{i}") for i in range(10)], "next_cursor": f"c{n}"}

    supplier = Looping(answer)
    pages, err, _ = walk_until_runaway(supplier, limits=WalkLimits(max_pages=7))
    assert len(pages) == 7 and len(supplier.requests) == 7
    assert "no count states its size" in str(err)


def test_cursors_that_cycle_a_b_a_are_a_runaway() -> None:
    cycle = itertools.cycle(["A", "B"])
    supplier = Looping(lambda r, n: {"hotels": [hotel(f"H{n:03d}")], "next_cursor": next(cycle)})
    pages, err, _ = walk_until_runaway(supplier)
    # page 1 offers A, A offers B, B offers A again: the page that offers it is not yielded
    assert len(supplier.requests) == 3 and len(pages) == 2
    assert str(err).startswith("WALK_RUNAWAY: cursor 'A' came back after 2 page(s); city")


def test_a_cursor_handed_back_as_it_was_given_is_a_runaway() -> None:
    supplier = Looping(lambda r, n: {"hotels": [hotel(f"H{n}")], "next_cursor": "same"})
    pages, err, _ = walk_until_runaway(supplier)
    assert len(supplier.requests) == 2 and len(pages) == 1
    assert "cursor 'same' came back after 1 page(s)" in str(err)


def test_a_long_cursor_is_shortened_in_the_message() -> None:
    long = "x" * 5000
    supplier = Looping(lambda r, n: {"hotels": [hotel(f"H{n}")], "next_cursor": long})
    _, err, _ = walk_until_runaway(supplier)
    assert f"cursor '{'x' * 16}…'" in str(err) and len(str(err)) < 200


def infinite_listing(request: httpx.Request, n: int) -> dict[str, object]:
    """Page numbers that never run empty: hotel i at position i, no total_pages."""
    size = int(request.url.params["page_size"])
    page = int(request.url.params["page"])
    return {"hotels": [hotel(f"H{i:08d}") for i in range((page - 1) * size, page * size)]}


def test_page_numbers_that_never_run_empty_stop_at_the_city_s_size() -> None:
    supplier = Looping(infinite_listing)
    pages, err, walk = walk_until_runaway(supplier, hotel_count=25)
    assert [p.page_number for p in pages] == [1, 2, 3, 4, 5]
    assert "page 6 is past the 5 allowed" in str(err)
    # the pages and the probe before each next page: bounded by the pages allowed
    assert walk.stats.probes == 4 and len(supplier.requests) == 9


def test_page_numbers_that_never_run_empty_stop_at_the_pages_own_total() -> None:
    def answer(request: httpx.Request, n: int) -> dict[str, object]:
        return {**infinite_listing(request, n), "total": 12}

    pages, err, _ = walk_until_runaway(Looping(answer))
    assert len(pages) == 4 and "page 5 is past the 4 allowed" in str(err)


def test_a_one_hotel_city_that_keeps_answering_pages_stops_after_a_few() -> None:
    supplier = Looping(lambda r, n: {"hotels": [hotel("H1")], "total": 1})
    pages, err, _ = walk_until_runaway(supplier, hotel_count=1)
    # 1 page, 2 of slack: three pages (each overlapping what the walk holds), no fourth
    assert len(pages) == 3 and len(supplier.requests) == 3
    assert "page 4 is past the 3 allowed" in str(err)


def test_slack_grows_with_the_city() -> None:
    limits = WalkLimits(page_slack=0.1, max_pages=1000)
    assert limits.page_limit(1) == 3
    assert limits.page_limit(100) == 110
    assert limits.page_limit(5000) == 1000
    assert limits.page_limit(None) == 1000


# --- pagination drift ---------------------------------------------------------------------------


class Drifting(FakeCatalog):
    """A city of 60 hotels, 10 a page, whose cursors expire after the first (the walk goes on
    by page number) and whose first hotel goes and a new one is added at its end while the
    walk is on page numbers: the counts stay equal, every later page shifts by one."""

    def __init__(self, *, shift_before_page: int = 6) -> None:
        super().__init__(ids(60), expire=range(2, 100), on_request=self.shift)
        self.shift_before_page = shift_before_page
        self.shifted = False

    def shift(self, cat: FakeCatalog, request: httpx.Request) -> None:
        page = request.url.params.get("page")
        if not self.shifted and page == str(self.shift_before_page):
            self.ids = [*self.ids[1:], "H000061"]
            self.shifted = True


def test_drift_under_a_page_number_walk_loses_no_hotel() -> None:
    supplier = Drifting()
    client, _ = make_client(supplier)
    walk = CityWalk(client, "BKK", page_size=10)
    pages = list(walk)
    assert supplier.shifted
    listed_throughout = set(ids(59, start=2))
    assert listed_throughout <= set(walked_ids(pages))
    assert "H000061" in walked_ids(pages)
    assert walk.stats.shifts == 1 and walk.stats.verified is True
    assert walk.stats.drift == "SHIFTED" and walk.stats.complete
    # the verification is the listing as it stands: the first hotel went meanwhile
    assert walk.stats.listed == set(supplier.ids) == listed_throughout | {"H000061"}
    # the walk's last page comes after the verification: only it says done
    assert [p.position.done for p in pages].count(True) == 1 and pages[-1].position.done


def test_drift_loses_a_hotel_without_the_continuity_check() -> None:
    supplier = Drifting()
    client, _ = make_client(supplier)
    walk = CityWalk(client, "BKK", page_size=10, limits=UNCHECKED)
    pages = list(walk)
    assert supplier.shifted
    lost = set(ids(59, start=2)) - set(walked_ids(pages))
    assert lost == {"H000051"}  # the hotel at the boundary of pages 5 and 6
    assert walk.stats.drift == "UNCHECKED" and not walk.stats.complete


class StaleProbes(FakeCatalog):
    """A supplier whose one-hotel answers may come from a stale copy of the listing."""

    def __init__(self, stale_probes: set[str]) -> None:
        super().__init__(ids(60), cursors=False, on_request=self.change)
        self.stale_probes = stale_probes
        self.before: list[str] = []

    def change(self, cat: FakeCatalog, request: httpx.Request) -> None:
        page, size = request.url.params["page"], request.url.params["page_size"]
        if size == "10" and page == "4" and "H000001" in self.ids:
            self.before = list(self.ids)
            # Missed: the counts stay equal and the probe after page 4 answers from before.
            self.ids = [*self.ids[1:], "H000061"]
        if size == "10" and page == "6" and "H000002" in self.ids:
            self.ids = self.ids[1:]  # seen: the walk steps back, then verifies the city

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.params.get("page_size") == "1" and request.url.params["page"] in (
            self.stale_probes
        ):
            self.stale_probes.discard(request.url.params["page"])
            current, self.ids = self.ids, self.before
            try:
                return super().__call__(request)
            finally:
                self.ids = current
        return super().__call__(request)


def test_the_verification_pass_finds_a_hotel_a_shift_hid_from_the_checks() -> None:
    supplier = StaleProbes({"30"})
    client, _ = make_client(supplier)
    walk = CityWalk(client, "BKK", page_size=10)
    pages = list(walk)
    assert "H000031" in walked_ids(pages)  # skipped at page 4, found by the verification
    assert set(ids(58, start=3)) <= set(walked_ids(pages))
    assert walk.stats.shifts == 1 and walk.stats.recovered == 1 and walk.stats.verified
    recovered = [p for p in pages if "H000031" in [h["hotel_id"] for h in p.page.hotels]]
    assert [p.position.done for p in recovered] == [False]
    assert pages[-1].position.done


def test_a_verification_that_sees_a_shift_too_leaves_the_walk_unverified() -> None:
    shifts = iter(["6", "3"])  # page 6 of the walk, then page 3 of the verification
    at = next(shifts)

    def on_request(cat: FakeCatalog, request: httpx.Request) -> None:
        nonlocal at
        if request.url.params.get("page_size") == "10" and request.url.params["page"] == at:
            cat.ids = cat.ids[1:]
            at = next(shifts, "")

    catalog = FakeCatalog(ids(60), cursors=False, on_request=on_request)
    client, _ = make_client(catalog)
    walk = CityWalk(client, "BKK", page_size=10)
    pages = list(walk)
    assert set(ids(58, start=3)) <= set(walked_ids(pages))
    assert walk.stats.verified is False and walk.stats.drift == "UNVERIFIED"
    assert not walk.stats.complete


def test_a_listing_that_changed_between_a_page_and_its_probe_is_a_shift() -> None:
    # Before page 4 the first hotel goes (page 4 skips H000031); before the probe a hotel
    # lands in front, so the probe finds H000030 where the walk left it: only the counts
    # the two answers state (59, then 60) show that the listing moved in between.
    def on_request(cat: FakeCatalog, request: httpx.Request) -> None:
        page, size = request.url.params["page"], request.url.params["page_size"]
        if (page, size) == ("4", "10") and "H000001" in cat.ids:
            cat.ids = cat.ids[1:]
        if (page, size) == ("30", "1") and "H0000000" not in cat.ids:
            cat.ids = ["H0000000", *cat.ids]

    catalog = FakeCatalog(ids(60), cursors=False, on_request=on_request)
    client, _ = make_client(catalog)
    walk = CityWalk(client, "BKK", page_size=10)
    assert set(ids(59, start=2)) <= set(walked_ids(list(walk)))
    assert walk.stats.shifts == 1


def test_a_cursor_walk_is_not_checked_it_is_stable() -> None:
    removed = False

    def on_request(cat: FakeCatalog, request: httpx.Request) -> None:
        nonlocal removed
        if cat.cursor_requests == 3 and not removed:
            cat.ids = cat.ids[1:]
            removed = True

    catalog = FakeCatalog(ids(50), on_request=on_request)
    client, _ = make_client(catalog)
    walk = CityWalk(client, "BKK", page_size=10)
    assert walked_ids(list(walk)) == ids(50)
    assert walk.stats.probes == 0 and walk.stats.drift is None


def test_a_page_by_number_may_offer_a_cursor_the_walk_followed_before() -> None:
    # Twenty hotels land before the walk's position: page 3 by number is page 1 again, and
    # its cursor is the one page 2 was fetched with. Not a loop: the walk goes on by number.
    catalog = FakeCatalog(ids(40), expire=[2])
    added = False

    def on_request(cat: FakeCatalog, request: httpx.Request) -> None:
        nonlocal added
        if request.url.params.get("page") == "3" and not added:
            cat.ids = sorted([*cat.ids, *[f"H000000{c}" for c in "abcdefghijklmnopqrst"]])
            added = True

    catalog.on_request = on_request
    client, _ = make_client(catalog)
    pages = list(CityWalk(client, "BKK", page_size=10))
    assert set(ids(40)) <= set(walked_ids(pages))
    followed = base64.urlsafe_b64encode(b"H000010").decode()
    assert pages[0].page.next_cursor == followed and pages[2].page.next_cursor == followed
    assert pages[2].fetched_by == "page" and pages[3].fetched_by == "page"


def test_a_listing_that_never_stops_shifting_ends_the_walk() -> None:
    added = itertools.count(1000)

    def on_request(cat: FakeCatalog, request: httpx.Request) -> None:
        if request.url.params.get("page", "1") != "1":
            cat.ids = [*cat.ids[1:], f"H{next(added):06d}"]

    catalog = FakeCatalog(ids(60), cursors=False, on_request=on_request)
    client, _ = make_client(catalog)
    walk = CityWalk(client, "BKK", page_size=10, hotel_count=60)
    with pytest.raises(WalkRunaway, match="requests, the most 8 page"):
        list(walk)
    # 5 requests for each of 8 pages allowed, 6 for each shift seen (at most 8 of them)
    assert len(catalog.requests) <= 5 * 8 + 6 * 8 and walk.stats.shifts > 0
