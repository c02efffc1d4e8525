"""Resource mapping: supplier hotel -> platform resource id.

Ids are allocated exactly once by a unique key: one bulk insert-or-ignore, then one read of
the ids. Never check-then-insert: two concurrent runs that both see "no mapping" would
allocate two ids for one supplier hotel (the duplicate-allocation bug of the post-mortem
in ``seeds/cas-dedupe-postmortem.md``).

Offers (room x rate plan) need no table of their own: ``platform_hotel_offer`` allocates
an offer's id under the unique key (platform resource id, room, rate plan) when publishing
upserts it (``publish._replace_offers``), so the resource id mapped here is the offer's
whole mapping.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import DbClock, insert_ignore

# Ids per IN (...) list: far below every driver's parameter limit, and below MariaDB's
# in_predicate_conversion_threshold (1000). From 1000 values on, MariaDB turns the list
# into a semi-join that may scan the whole table, an index hint notwithstanding.
CHUNK = 500

T = TypeVar("T")


def chunks(items: Sequence[T], size: int = CHUNK) -> Iterator[Sequence[T]]:
    """Consecutive slices of at most ``size`` items."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


@dataclass(frozen=True)
class HotelMappings:
    """Resource ids of a set of supplier hotels, which of them this call created, and the
    resource ids that had a published hotel row when they were read."""

    resource_ids: dict[str, int]
    created: frozenset[str]
    published: frozenset[int] = frozenset()


def ensure_hotel_mappings(
    conn: Connection,
    clock: DbClock,
    *,
    supplier_id: int,
    batch_id: str,
    hotel_ids: Iterable[str],
    at: datetime | None = None,
    published: bool = True,
) -> HotelMappings:
    """Returns the platform resource id of each supplier hotel, creating missing ones.

    ``created`` holds the hotels whose mapping was created by this batch (now or by an
    earlier attempt of the same batch), so a retried run still emits HotelMappingCreated.
    ``at``: the transaction's database time (``clock.read``), written as the creation time
    instead of the clock's SQL expression evaluated on every row. ``published``: whether to
    read which hotels have a published row (``HotelMappings.published``; left empty
    otherwise): on InnoDB that reads each hotel's row from the table itself.
    """
    ids = sorted(set(hotel_ids))
    insert_ignore(
        conn,
        schema.hotel_mapping,
        [(h,) for h in ids],
        columns=("supplier_hotel_id",),
        supplier_id=supplier_id,
        created_batch_id=batch_id,
        created_at=clock.now() if at is None else at,
    )
    return _read_mappings(
        conn, supplier_id=supplier_id, batch_id=batch_id, ids=ids, with_published=published
    )


def _read_mappings(
    conn: Connection,
    *,
    supplier_id: int,
    batch_id: str,
    ids: Sequence[str],
    with_published: bool,
) -> HotelMappings:
    c = schema.hotel_mapping.c
    resource_ids: dict[str, int] = {}
    created: set[str] = set()
    published: set[int] = set()
    h = schema.platform_hotel.c
    # Whether each hotel is published, in the same statement: a diff of new hotels then
    # reads nothing more.
    is_published: Any = (
        sa.select(h.resource_id).where(h.resource_id == c.id).exists()
        if with_published
        else sa.false()
    )
    for part in chunks(ids):
        for hotel_id, rid, made_by, pub in conn.execute(
            sa.select(c.supplier_hotel_id, c.id, c.created_batch_id, is_published).where(
                c.supplier_id == supplier_id, c.supplier_hotel_id.in_(part)
            )
        ).all():
            resource_ids[hotel_id] = int(rid)
            if made_by == batch_id:
                created.add(hotel_id)
            if pub:
                published.add(int(rid))
    return HotelMappings(resource_ids, frozenset(created), frozenset(published))
