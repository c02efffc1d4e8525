"""walk.iter_city: cursor walks, 410 fallback to page numbers, resume from checkpoints."""

from __future__ import annotations

import httpx
import pytest

from supplier_sync_dagster.core.errors import SupplierProtocolError, SupplierUnavailable
from supplier_sync_dagster.core.supplier import CityPage, PagePosition, RetryPolicy, iter_city
from supplier_sync_dagster_tests.core.supplier.fakes import (
    FakeCatalog,
    Script,
    ids,
    json_response,
    make_client,
)


def walked_ids(pages: list[CityPage]) -> list[str]:
    return [h["hotel_id"] for p in pages for h in p.page.hotels]


def kinds(catalog: FakeCatalog) -> list[str]:
    out = []
    for r in catalog.requests:
        out.append("c" if "cursor" in r.url.params else f"p{r.url.params['page']}")
    return out


def test_cursor_walk_follows_next_cursor_until_null() -> None:
    catalog = FakeCatalog(ids(25))
    client, _ = make_client(catalog)
    pages = list(iter_city(client, "BKK", page_size=10))
    assert walked_ids(pages) == ids(25)
    assert kinds(catalog) == ["p1", "c", "c"]
    assert [p.fetched_by for p in pages] == ["page", "cursor", "cursor"]
    assert [p.page_number for p in pages] == [1, 2, 3]
    last = pages[-1].position
    assert last.done and last.cursor is None and last.last_hotel_id == "H000025"
    assert pages[0].position == PagePosition(
        page=2, cursor=pages[0].page.next_cursor, last_hotel_id="H000010"
    )
    assert pages[1].raw.startswith(b"{") and b"H000011" in pages[1].raw


def test_page_number_walk_when_no_cursor_is_offered() -> None:
    catalog = FakeCatalog(ids(30), cursors=False)
    client, _ = make_client(catalog)
    pages = list(iter_city(client, "BKK", page_size=10))
    assert walked_ids(pages) == ids(30)
    assert kinds(catalog) == ["p1", "p2", "p3"]  # stops at total_pages, no extra request
    assert pages[-1].position.done


def test_empty_city_is_one_empty_page() -> None:
    catalog = FakeCatalog([], cursors=True)
    client, _ = make_client(catalog)
    pages = list(iter_city(client, "BKK", page_size=10))
    assert len(pages) == 1 and pages[0].page.hotels == [] and pages[0].position.done


def test_empty_page_ends_the_walk_even_without_total_pages() -> None:
    def page(n: int, hotels: list[str]) -> httpx.Response:
        return json_response(200, {"page": n, "hotels": [{"hotel_id": h} for h in hotels]})

    script = Script(page(1, ["A"]), page(2, ["B"]), page(3, []))
    client, _ = make_client(script)
    pages = list(iter_city(client, "X", page_size=1))
    assert walked_ids(pages) == ["A", "B"] and len(pages) == 3


def test_cursor_expired_falls_back_to_page_numbers_from_the_last_completed_page() -> None:
    # cursor requests #2 expire: pages 1 (number), 2 (cursor), then 3 -> 410
    catalog = FakeCatalog(ids(50), expire=[2])
    client, _ = make_client(catalog)
    pages = list(iter_city(client, "BKK", page_size=10))
    # the walk re-reads page 2 (the last completed one) by number to prove nothing shifted
    assert kinds(catalog) == ["p1", "c", "c", "p3", "p2", "c", "c"]
    assert [p.page_number for p in pages] == [1, 2, 2, 3, 4, 5]
    assert sorted(set(walked_ids(pages))) == ids(50)
    assert client.stats().cursor_expired == 1
    marks = [p.position.last_hotel_id or "" for p in pages]
    assert marks == sorted(marks)  # the re-read page never moves the checkpoint back


def test_fallback_steps_back_further_when_hotels_were_removed() -> None:
    removed = False

    def on_request(cat: FakeCatalog, request: httpx.Request) -> None:
        nonlocal removed
        if cat.cursor_requests == 2 and not removed:
            # 15 hotels before the checkpoint vanish: page numbers shift by 1.5 pages
            cat.ids = [i for i in cat.ids if not "H000001" <= i <= "H000015"]
            removed = True

    catalog = FakeCatalog(ids(60), expire=[3], on_request=on_request)
    client, _ = make_client(catalog)
    pages = list(iter_city(client, "BKK", page_size=10))
    seen = set(walked_ids(pages))
    assert seen >= set(ids(45, start=16))  # nothing that still exists was skipped


def test_repeated_expiry_switches_to_page_numbers_for_good() -> None:
    catalog = FakeCatalog(ids(60), expire=range(1, 100))
    client, _ = make_client(catalog)
    pages = list(iter_city(client, "BKK", page_size=10, max_cursor_expiries=2))
    assert sorted(set(walked_ids(pages))) == ids(60)
    assert catalog.cursor_requests == 2
    assert pages[-1].position.done


def test_resume_from_a_cursor_checkpoint() -> None:
    catalog = FakeCatalog(ids(30))
    client, _ = make_client(catalog)
    first = next(iter(iter_city(client, "BKK", page_size=10)))
    checkpoint = PagePosition.model_validate_json(first.position.model_dump_json())

    catalog.requests.clear()
    pages = list(iter_city(client, "BKK", page_size=10, start=checkpoint))
    assert walked_ids(pages) == ids(20, start=11)
    assert kinds(catalog) == ["c", "c"]
    assert [p.page_number for p in pages] == [2, 3]


def test_resume_from_a_page_number_checkpoint_rereads_the_last_page() -> None:
    catalog = FakeCatalog(ids(30), cursors=False)
    client, _ = make_client(catalog)
    start = PagePosition(page=3, last_hotel_id="H000020")
    pages = list(iter_city(client, "BKK", page_size=10, start=start))
    assert kinds(catalog) == ["p3", "p2"]  # p3 first id > checkpoint, so check p2; both reused
    assert [p.page_number for p in pages] == [2, 3]
    assert walked_ids(pages) == ids(20, start=11)


def test_resume_from_page_without_last_id_goes_straight_there() -> None:
    catalog = FakeCatalog(ids(30), cursors=False)
    client, _ = make_client(catalog)
    pages = list(iter_city(client, "BKK", page_size=10, start=PagePosition(page=3)))
    assert kinds(catalog) == ["p3"] and walked_ids(pages) == ids(10, start=21)


def test_done_checkpoint_yields_nothing() -> None:
    client, _ = make_client(Script())
    assert list(iter_city(client, "BKK", start=PagePosition(page=9, done=True))) == []


def test_cursor_loop_is_detected() -> None:
    body = {"hotels": [{"hotel_id": "A"}], "next_cursor": "same"}
    client, _ = make_client(Script(json_response(200, body), json_response(200, body)))
    with pytest.raises(SupplierProtocolError, match="same cursor"):
        list(iter_city(client, "X"))


def test_failure_mid_walk_leaves_a_valid_checkpoint() -> None:
    catalog = FakeCatalog(ids(30))
    failing = Script(
        catalog, *[httpx.Response(503)] * 3
    )  # page 1 served, then the supplier is down
    client, _ = make_client(failing, retry=RetryPolicy(max_attempts=3, base_delay=0.01))
    walk = iter_city(client, "BKK", page_size=10)
    first = next(walk)
    with pytest.raises(SupplierUnavailable):
        next(walk)
    assert first.position.cursor is not None and first.position.last_hotel_id == "H000010"
