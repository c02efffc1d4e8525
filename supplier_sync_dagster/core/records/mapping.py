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

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import DbClock, insert_ignore
from supplier_sync_dagster.core.store.engine import db_now

# Ids per IN (...) list: far below every driver's parameter limit, and below MariaDB's
# in_predicate_conversion_threshold (1000). From 1000 values on, MariaDB turns the list
# into a semi-join that may scan the whole table, an index hint notwithstanding.
CHUNK = 500

T = TypeVar("T")


def chunks(items: Sequence[T], size: int = CHUNK) -> Iterator[Sequence[T]]:
    """Consecutive slices of at most ``size`` items."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


PublishedVersion = tuple[int, int, str]
"""What a diff needs first of a published hotel: (supplier version, publish version,
fingerprint). Most hotels are new or unchanged, and these decide those alone."""


@dataclass(frozen=True)
class HotelMappings:
    """Resource ids of a set of supplier hotels, which of them this call created, and the
    resource ids that had a published hotel row when they were read, with its versions."""

    resource_ids: dict[str, int]
    created: frozenset[str]
    published: frozenset[int] = frozenset()
    versions: Mapping[int, PublishedVersion] = field(default_factory=dict)
    # The database's time when they were read (None: not asked for, or no hotel read).
    read_at: datetime | None = None


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
    instead of the clock's SQL expression evaluated on every row; without it, the read also
    gives the database's time (``read_at``: a caller needs no statement of its own to read
    it, for a few hotels). ``published``: whether to
    read which hotels have a published row and its versions (``HotelMappings.published``
    and ``versions``; left empty otherwise): on InnoDB that reads each hotel's row from the
    table itself.
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
        conn,
        clock,
        supplier_id=supplier_id,
        batch_id=batch_id,
        ids=ids,
        with_published=published,
        with_time=at is None,
    )


def _read_mappings(
    conn: Connection,
    clock: DbClock,
    *,
    supplier_id: int,
    batch_id: str,
    ids: Sequence[str],
    with_published: bool,
    with_time: bool,
) -> HotelMappings:
    resource_ids: dict[str, int] = {}
    created: set[str] = set()
    versions: dict[int, PublishedVersion] = {}
    read_at: datetime | None = None
    query = _mappings_query(with_published, with_time)
    params = {"supplier_id": supplier_id, "batch_id": batch_id}
    if with_time:
        params["now_us"] = round(clock.offset_seconds * 1_000_000)
    for part in chunks(ids):
        for hotel_id, rid, made_here, *more in conn.execute(query, {**params, "ids": part}):
            resource_ids[hotel_id] = rid
            if made_here:
                created.add(hotel_id)
            if with_time:
                now = more.pop()
                read_at = read_at or now
            # A published hotel's versions come in the same statement: a diff of new or
            # unchanged hotels then reads nothing more.
            if more and more[0] is not None:
                versions[rid] = (more[0], more[1], more[2])
    return HotelMappings(
        resource_ids, frozenset(created), frozenset(versions), versions, read_at=read_at
    )


@functools.cache
def _mappings_query(with_published: bool, with_time: bool) -> sa.Select[Any]:
    """The read of a part of the mappings (and, when asked, of their published versions and
    the database's time, last), built once: its IN list is one expanding parameter, not a
    bound value per id."""
    c, h = schema.hotel_mapping.c, schema.platform_hotel.c
    # Whether this batch made the mapping, as a number: no batch id sent back per row.
    made_here = (c.created_batch_id == sa.bindparam("batch_id")).label("made_here")
    columns: list[Any] = [c.supplier_hotel_id, c.id, made_here]
    source: Any = schema.hotel_mapping
    if with_published:
        columns += [h.supplier_version, h.publish_version, h.fingerprint]
        source = source.outerjoin(schema.platform_hotel, h.resource_id == c.id)
    if with_time:
        columns.append(db_now(sa.bindparam("now_us", type_=sa.BigInteger())).label("read_at"))
    return (
        sa.select(*columns)
        .select_from(source)
        .where(
            c.supplier_id == sa.bindparam("supplier_id"),
            c.supplier_hotel_id.in_(sa.bindparam("ids", expanding=True)),
        )
    )
