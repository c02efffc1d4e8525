"""Tombstones: published hotels that the supplier stopped listing are unpublished, never deleted.

A full sync of a city that **completes** (every page fetched, normalized and published; never
a failed, gated or partial city) knows every hotel id the supplier lists there. In the
transaction that finishes the city, :func:`record_presence` compares them with the catalog:

- a published hotel of the city that the listing lacks counts one **miss**
  (``missing_count``; ``missing_since`` is the first); after ``missing_syncs`` complete
  syncs in a row without it (default 2) it is **unpublished**: status INACTIVE, a new
  publish version, its offers inactive, and a ``HotelResourceUpdated`` (search, cache,
  subscribers) and a ``HotelUnpublished`` outbox event;
- a hotel with misses that a listing has again (any city: a hotel listed under another
  city than its own is present) has its count cleared;
- a tombstoned hotel that comes back is restored by the ordinary publish: its fingerprint
  is the tombstone's (:data:`TOMBSTONE_FINGERPRINT`), so the listing's record differs and
  publishes a new version (ACTIVE again); every publish clears the count.

A hotel that a single-hotel fetch answers with 404 is gone for certain:
:func:`unpublish_missing` takes it at once (the caller makes the request: the sync's
``confirm_missing`` step, dead-letter compensation, ``trace``).

Few hotels vanish per sync; a city that loses more than ``max_share`` of its hotels at
once is not unpublished wholesale (the ``record_count`` gate stops such a city anyway): the
misses are counted and reported (``held``), and nothing is unpublished.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.outbox.machine import first_stage
from supplier_sync_dagster.core.records.deadletters import hotel_subject, resolve_subjects
from supplier_sync_dagster.core.records.history import (
    UNPUBLISHED,
    VersionRecord,
    record_versions,
    tombstone_documents,
)
from supplier_sync_dagster.core.records.mapping import chunks
from supplier_sync_dagster.core.records.publish import event_id, offer_deactivation, write_events
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import DbClock

log = logging.getLogger(__name__)

DEFAULT_MISSING_SYNCS = 2
DEFAULT_MAX_SHARE = 0.2
# Up to this many hotels of a city may be unpublished at once whatever its size.
SMALL_CITY_TOMBSTONES = 5
TOMBSTONE_FINGERPRINT = "tombstone".ljust(64, "-")
"""The fingerprint of an unpublished hotel: no document hashes to it, so the supplier's
record of a hotel that comes back always differs and publishes."""
UNPUBLISHED_EVENT = "HotelUnpublished"


@dataclass
class Presence:
    """What a complete city listing did to the catalog's presence marks.

    Attributes:
        missing: Hotel ids that got a miss (not unpublished yet).
        unpublished: Hotel ids unpublished now.
        cleared: Hotel ids whose misses were cleared (listed again).
        held: Hotel ids that would be unpublished but were not: too many at once.
    """

    missing: list[str] = field(default_factory=list)
    unpublished: list[str] = field(default_factory=list)
    cleared: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)


def record_presence(
    conn: Connection,
    clock: DbClock,
    *,
    supplier_id: int,
    city_code: str,
    listed: Collection[str],
    batch_id: str,
    at: datetime | Any,
    missing_syncs: int = DEFAULT_MISSING_SYNCS,
    max_share: float = DEFAULT_MAX_SHARE,
) -> Presence:
    """Counts the misses of one completely listed city, in the caller's transaction.

    One read (the city's hotels and the supplier's hotels with misses, by index) and, only
    when something changed, one UPDATE per kind of change.

    Args:
        conn: The transaction that finishes the city.
        clock: The database clock.
        supplier_id: The supplier.
        city_code: The city whose listing is complete.
        listed: Every hotel id its listing served (valid or not).
        batch_id: The batch (an unpublished hotel's ``last_batch_id``).
        at: The transaction's database time (a value or the clock's SQL expression).
        missing_syncs: Complete syncs without a hotel before it is unpublished.
        max_share: Most of a city's hotels unpublished at once (beyond: held, counted).
    """
    h = schema.platform_hotel.c
    rows = conn.execute(
        _presence_of_city(), {"presence_supplier": supplier_id, "presence_city": city_code}
    ).all()
    presence = Presence()
    clear: list[int] = []
    miss: list[Any] = []
    city_hotels = 0
    for row in rows:
        hid = str(row.supplier_hotel_id)
        tombstoned = row.missing_count >= missing_syncs
        city_hotels += row.city_code == city_code
        if hid in listed:
            if row.missing_count and not tombstoned:
                clear.append(row.resource_id)
                presence.cleared.append(hid)
        elif row.city_code == city_code and not tombstoned:
            miss.append(row)
    if clear:
        for part in chunks(clear):
            conn.execute(
                sa.update(schema.platform_hotel)
                .where(h.resource_id.in_(part))
                .values(missing_count=0, missing_since=None)
            )
    if not miss:
        return presence
    due = [r for r in miss if r.missing_count + 1 >= missing_syncs]
    allowed = max(SMALL_CITY_TOMBSTONES, int(max_share * city_hotels))
    if len(due) > allowed:
        log.warning(
            "city %r: %d hotels missing for %d complete syncs, more than the %d allowed at "
            "once; they stay published (counted) until a person looks",
            city_code,
            len(due),
            missing_syncs,
            allowed,
        )
        presence.held = [str(r.supplier_hotel_id) for r in due]
        due = []
    due_ids = {r.resource_id for r in due}
    counting = [r for r in miss if r.resource_id not in due_ids]
    for part in chunks([r.resource_id for r in miss]):
        conn.execute(
            sa.update(schema.platform_hotel)
            .where(h.resource_id.in_(part))
            .values(
                missing_count=h.missing_count + 1,
                missing_since=sa.func.coalesce(h.missing_since, at),
            )
        )
    presence.missing = [str(r.supplier_hotel_id) for r in counting]
    if due:
        _unpublish(
            conn, clock, due, supplier_id=supplier_id, batch_id=batch_id, at=at, reason="missing"
        )
        presence.unpublished = [str(r.supplier_hotel_id) for r in due]
    return presence


@functools.cache
def _presence_of_city() -> sa.CompoundSelect:
    """:func:`record_presence`'s read (``:presence_supplier``, ``:presence_city``): built once,
    as every complete city runs it."""
    h = schema.platform_hotel.c
    names = ("resource_id", "supplier_hotel_id", "city_code", "missing_count")
    columns = [h[name] for name in (*names, "publish_version", "supplier_version")]
    supplier = h.supplier_id == sa.bindparam("presence_supplier", type_=h.supplier_id.type)
    # A UNION, not an OR: each part reads its own index (the city's hotels; the few with misses).
    return sa.union(
        sa.select(*columns).where(
            supplier, h.city_code == sa.bindparam("presence_city", type_=h.city_code.type)
        ),
        sa.select(*columns).where(supplier, h.missing_count > 0),
    )


def unpublish_missing(
    conn: Connection,
    clock: DbClock,
    *,
    supplier_id: int,
    supplier_hotel_ids: Sequence[str],
    batch_id: str,
    at: datetime | Any,
    missing_syncs: int = DEFAULT_MISSING_SYNCS,
) -> list[str]:
    """Unpublishes hotels that the supplier answered 404 for (gone for certain); returns
    the ids unpublished (those already unpublished or unknown are left alone)."""
    h = schema.platform_hotel.c
    rows: list[Any] = []
    for part in chunks(list(supplier_hotel_ids)):
        rows += conn.execute(
            sa.select(
                h.resource_id,
                h.supplier_hotel_id,
                h.missing_count,
                h.publish_version,
                h.supplier_version,
            ).where(
                h.supplier_id == supplier_id,
                h.supplier_hotel_id.in_(part),
                h.fingerprint != TOMBSTONE_FINGERPRINT,
            )
        ).all()
    if not rows:
        return []
    for part in chunks([r.resource_id for r in rows]):
        conn.execute(
            sa.update(schema.platform_hotel)
            .where(h.resource_id.in_(part))
            .values(
                missing_count=sa.func.max(h.missing_count, missing_syncs)
                if conn.dialect.name == "sqlite"
                else sa.func.greatest(h.missing_count, missing_syncs),
                missing_since=sa.func.coalesce(h.missing_since, at),
            )
        )
    _unpublish(
        conn, clock, rows, supplier_id=supplier_id, batch_id=batch_id, at=at, reason="not_found"
    )
    return [str(r.supplier_hotel_id) for r in rows]


def _unpublish(
    conn: Connection,
    clock: DbClock,
    rows: Sequence[Any],
    *,
    supplier_id: int,
    batch_id: str,
    at: datetime | Any,
    reason: str,
) -> None:
    """Makes the hotels INACTIVE with a new publish version, offers off, and their events;
    their open dead letters are resolved (the hotel is gone).

    Each UPDATE is guarded by the publish version read: a publish of the hotel in between
    (it came back) wins, and its tombstone is dropped.
    """
    h = schema.platform_hotel.c
    # Read before the UPDATEs: the document each hotel has now, which its tombstone follows.
    documents = tombstone_documents(
        conn, {int(r.resource_id): int(r.publish_version) for r in rows}
    )
    done: list[Any] = []
    for r in rows:
        moved = conn.execute(
            sa.update(schema.platform_hotel)
            .where(h.resource_id == r.resource_id, h.publish_version == r.publish_version)
            .values(
                status="INACTIVE",
                fingerprint=TOMBSTONE_FINGERPRINT,
                publish_version=h.publish_version + 1,
                last_batch_id=batch_id,
                published_at=at,
            )
        ).rowcount
        if moved:
            done.append(r)
    if not done:
        return
    rids = [r.resource_id for r in done]
    for part in chunks(rids):
        conn.execute(offer_deactivation(part, at))
    events = []
    for r in done:
        pv = int(r.publish_version) + 1
        body = json.dumps(
            {
                "resource_id": int(r.resource_id),
                "publish_version": pv,
                "supplier_hotel_id": str(r.supplier_hotel_id),
                "supplier_version": int(r.supplier_version),
                "diff_type": "UNPUBLISHED",
                "reason": reason,
                "batch_id": batch_id,
            },
            separators=(",", ":"),
        )[1:]
        for event_type in ("HotelResourceUpdated", UNPUBLISHED_EVENT):
            events.append(
                (
                    event_id(event_type, int(r.resource_id), pv),
                    event_type,
                    "HOTEL",
                    int(r.resource_id),
                    pv,
                    f'{{"event_type":"{event_type}",{body}',
                    first_stage(event_type),
                )
            )
    write_events(conn, events, batch_id=batch_id, at=at)
    record_versions(
        conn,
        [
            VersionRecord(
                resource_id=int(r.resource_id),
                supplier_id=supplier_id,
                supplier_hotel_id=str(r.supplier_hotel_id),
                publish_version=int(r.publish_version) + 1,
                supplier_version=int(r.supplier_version),
                status="INACTIVE",
                change_type=UNPUBLISHED,
                change_reason=reason,
                batch_id=batch_id,
                raw_payload_hash=None,
                document=documents[int(r.resource_id)],
            )
            for r in done
        ],
        at=at,
    )
    resolve_subjects(
        conn,
        clock,
        supplier_id=supplier_id,
        subjects=[hotel_subject(str(r.supplier_hotel_id)) for r in done],
        batch_id=batch_id,
        note=f"the hotel is gone ({reason}): unpublished by batch {batch_id}",
        gone=True,
    )
    log.info("unpublished %d hotels (%s)", len(done), reason)


__all__ = [
    "DEFAULT_MISSING_SYNCS",
    "TOMBSTONE_FINGERPRINT",
    "UNPUBLISHED_EVENT",
    "Presence",
    "record_presence",
    "unpublish_missing",
]
