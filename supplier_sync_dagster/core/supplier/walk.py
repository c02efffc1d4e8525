"""A city's walk: every page of a city's listing, through a :class:`SupplierClient`.

The client makes one request; the walk pages through a city with it: by cursor when the
supplier offers one, else by page number, from a checkpoint (:class:`PagePosition`) when
resuming, and back to page numbers when a cursor expires (410 CURSOR_EXPIRED).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Literal

from supplier_sync_dagster.core.errors import CursorExpired, SupplierProtocolError
from supplier_sync_dagster.core.supplier.client import SupplierClient
from supplier_sync_dagster.core.supplier.models import (
    CityPage,
    Fetched,
    HotelsPage,
    PagePosition,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_CURSOR_EXPIRIES = 3


def iter_city(
    client: SupplierClient,
    city_code: str,
    *,
    page_size: int = 100,
    start: PagePosition | None = None,
    max_cursor_expiries: int = DEFAULT_MAX_CURSOR_EXPIRIES,
) -> Iterator[CityPage]:
    """Walk all pages of a city, by cursor when offered, else by page number.

    The walk starts by page number (or from ``start``), follows ``next_cursor`` whenever
    the supplier offers one, and ends on an empty page, a null cursor on a cursor page,
    or a page number reaching ``total_pages``. On 410 CURSOR_EXPIRED it falls back to
    page numbers from the last completed page (after ``max_cursor_expiries`` expiries it
    stops asking for cursors).

    Resuming by page number (after a cursor expiry, or from a checkpoint without a
    cursor) first makes sure nothing was skipped when the supplier's data shifted: it
    steps back from the checkpoint's page until a page starts at or before the last hotel
    already processed (normally one page back). Those overlapping pages are yielded again;
    processing is idempotent, so hotels seen twice are harmless while a hotel skipped
    would be lost. This assumes ``hotel_id`` order is code-point order.

    Args:
        client: The supplier's client (one request at a time).
        city_code: The supplier's city code.
        page_size: Hotels per page (1-500).
        start: Checkpoint to resume from (``CityPage.position`` of the last committed
            page); None starts at page 1.
        max_cursor_expiries: Cursor expiries after which the walk stops asking for cursors
            and continues by page number only.

    Yields:
        Each page with its raw bytes and the position to checkpoint once it is committed.

    Raises:
        SupplierError: A call failed beyond retries (the checkpoint stays valid).
    """
    pos = start or PagePosition()
    if pos.done:
        return
    number = pos.page
    cursor = pos.cursor
    last_id = pos.last_hotel_id
    expiries = 0
    verify_overlap = cursor is None and last_id is not None and number > 1
    queued: list[tuple[int, Fetched[HotelsPage]]] = []
    while True:
        used_cursor: str | None = None
        if queued:
            number, fetched = queued.pop(0)
            fetched_by: Literal["cursor", "page"] = "page"
        elif cursor is not None and expiries < max_cursor_expiries:
            try:
                fetched = client.get_hotels_page(city_code, cursor=cursor, page_size=page_size)
            except CursorExpired:
                expiries += 1
                logger.info(
                    "supplier %s city walk: cursor expired before page %d; "
                    "continuing by page number",
                    client.supplier_id,
                    number,
                )
                cursor = None
                verify_overlap = last_id is not None and number > 1
                continue
            used_cursor = cursor
            fetched_by = "cursor"
        elif verify_overlap:
            verify_overlap = False
            assert last_id is not None
            queued = _pages_from_overlap(client, city_code, number, last_id, page_size)
            continue
        else:
            fetched = client.get_hotels_page(city_code, page=number, page_size=page_size)
            fetched_by = "page"

        page = fetched.data
        next_cursor: str | None = None
        if not page.hotels:
            done = True
        elif page.next_cursor is not None and expiries < max_cursor_expiries:
            if page.next_cursor == used_cursor:
                raise SupplierProtocolError(
                    f"supplier {client.supplier_id} returned the same cursor it was given "
                    f"(page {number}): the walk would never end",
                    reason="cursor_loop",
                    status=fetched.status,
                )
            next_cursor = page.next_cursor
            done = False
        elif fetched_by == "cursor" and page.next_cursor is None:
            done = True  # a null cursor on a cursor page marks the last page
        else:
            done = page.total_pages is not None and number >= page.total_pages
        page_last = page.last_hotel_id
        if page_last is not None and (last_id is None or page_last > last_id):
            # An overlap page ends before the checkpoint; never move the mark back.
            last_id = page_last
        position = PagePosition(
            page=number + 1, cursor=next_cursor, last_hotel_id=last_id, done=done
        )
        yield CityPage(
            city_code=city_code,
            page=page,
            raw=fetched.raw,
            page_number=number,
            fetched_by=fetched_by,
            position=position,
        )
        if done and not queued:
            return
        number += 1
        cursor = next_cursor


def _pages_from_overlap(
    client: SupplierClient, city_code: str, number: int, last_id: str, page_size: int
) -> list[tuple[int, Fetched[HotelsPage]]]:
    """Fetch pages ``number``, ``number-1``... until one starts at or before ``last_id``."""
    found: dict[int, Fetched[HotelsPage]] = {}
    k = number
    while True:
        fetched = client.get_hotels_page(city_code, page=k, page_size=page_size)
        found[k] = fetched
        first = fetched.data.first_hotel_id
        if k == 1 or (first is not None and first <= last_id):
            break
        k -= 1
    if k < number:
        logger.info(
            "supplier %s city walk: resuming by page number at page %d (%d page(s) of overlap)",
            client.supplier_id,
            k,
            number - k,
        )
    return [(n, found[n]) for n in sorted(found)]
