"""Publishing: version-guarded upserts of hotels and offers, with their outbox events.

Everything happens in the caller's transaction (invariant 7: publish and its events are one
transaction). The hotel upsert is guarded in SQL: a row is written only when the incoming
supplier version is newer, or equal with a different fingerprint (a fixed normalization
rule replayed). A ``publish_token`` stamped on every written row tells which hotels this
call actually changed, so offers and events follow only those: two concurrent publishes of
the same version write once and emit once, and an older version never overwrites a newer.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.mysql import insert as mysql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.outbox.machine import PUBLISHED, first_stage
from supplier_sync_dagster.core.records.deadletters import hotel_subject, resolve_subjects
from supplier_sync_dagster.core.records.diff import CONTENT_FIELDS, Candidate, HotelDiff
from supplier_sync_dagster.core.records.history import (
    VersionRecord,
    candidate_document,
    record_versions,
)
from supplier_sync_dagster.core.records.mapping import chunks
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import (
    DbClock,
    execute_many,
    insert_ignore,
    use_index,
)
from supplier_sync_dagster.core.store.engine import json_text

# PyMySQL batches an executemany into one multi-row INSERT only if the ON DUPLICATE KEY
# tail has no bound parameters: constants there are written as literal SQL.
_ONE: Any = sa.literal_column("1")
_ZERO: Any = sa.literal_column("0")

# HotelResourceUpdated drives the search index, the cache and subscribers (its chain of
# stages: core/outbox/machine.py); HotelSearchIndexRefreshRequired, once an event of its own, is
# its SEARCH_INDEX stage.
HOTEL_EVENTS = ("HotelResourceUpdated",)
CONTENT_DIFFS = ("NEW", "CONTENT_CHANGED", "STATUS_CHANGED")

# The published hotel's columns: its content fields (as the diff compares them; the
# document's phone_e164 is the column phone), then what the publish itself records.
_HOTEL_COLUMNS = (
    *("phone" if name == "phone_e164" else name for name in CONTENT_FIELDS),
    "status",
    "supplier_updated_at",
    "raw_payload_ref",
    "raw_payload_hash",
    "last_batch_id",
    "publish_token",
    "published_at",
)
# A hotel row as :func:`prepare_publish` builds it (the upsert adds the token and the time).
_HOTEL_ROW = (
    "resource_id",
    "supplier_id",
    "supplier_hotel_id",
    "supplier_version",
    "publish_version",
    "fingerprint",
    *_HOTEL_COLUMNS[: _HOTEL_COLUMNS.index("publish_token")],
)
# An offer row as :func:`_offer_rows` builds it: what the document gives (as
# :func:`_offer_parts` reads it), then the hotel and its versions, which are added to each
# part in one tuple concatenation.
_OFFER_IDENTITY = ("resource_id", "room_code", "rate_plan_code")
_OFFER_ROW = (
    "room_code",
    "rate_plan_code",
    "room_name",
    "bed_type",
    "max_occupancy",
    "board",
    "refundable",
    "available",
    "price_amount",
    "currency",
    "resource_id",
    "supplier_version",
    "publish_version",
)
# An outbox row as :func:`_hotel_events` builds it (the batch and the time are added);
# whoever else writes an event (the read API) writes these columns too.
EVENT_COLUMNS = (
    "event_id",
    "event_type",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "payload",
    "next_stage",
)


@dataclass(frozen=True)
class Published:
    """A hotel this call published."""

    supplier_hotel_id: str
    resource_id: int
    publish_version: int
    supplier_version: int


@dataclass(frozen=True)
class PublishResult:
    """What a publish call wrote and what it left alone."""

    published: list[Published]
    not_newer: list[str]  # a newer (or identical) version was already published
    events: int


@dataclass(frozen=True)
class CandidateRows:
    """A candidate's rows as far as they do not depend on its diff (no resource id, no
    versions): built before the publish transaction, finished inside it in a few tuple
    operations, so that a SQLite write lock (or MySQL row locks) is held for the SQL, not for
    building rows.

    Attributes:
        hotel: The hotel row (the columns ``_HOTEL_ROW``) without its first, the resource id.
        offers: Each offer row without its trailing (resource id, supplier version,
            publish version).
    """

    hotel: tuple[Any, ...]
    offers: list[tuple[Any, ...]]


def candidate_rows(
    candidates: Sequence[Candidate], *, supplier_id: int, batch_id: str
) -> dict[str, CandidateRows]:
    """The diff-independent rows of each candidate, by supplier hotel id (pure, no database).

    Args:
        candidates: Distinct hotels (``diff.collapse_duplicates``).
        supplier_id: The supplier.
        batch_id: The batch publishing.
    """
    return {
        c.supplier_hotel_id: CandidateRows(_hotel_tail(c, supplier_id, batch_id), _offer_parts(c))
        for c in candidates
    }


@dataclass(frozen=True)
class PublishPlan:
    """Everything a publish writes, built before its upsert.

    Offers and events are built for the versions the diffs expect: publish version one
    above the published one (1 for a new hotel) and the candidate's supplier version.
    :func:`publish_hotels` rebuilds the few whose written versions differ (a concurrent
    publish of the same hotel in between). Rows are tuples of the columns ``_HOTEL_ROW``,
    ``_OFFER_ROW`` and ``EVENT_COLUMNS``.
    """

    todo: list[tuple[HotelDiff, Candidate]]
    hotel_rows: list[tuple[Any, ...]]
    offer_rows: dict[int, list[tuple[Any, ...]]]  # by resource id
    events: dict[int, list[tuple[Any, ...]]]  # by resource id
    expected: dict[int, tuple[int, int]]  # resource id -> (publish version, supplier version)
    rows: Mapping[str, CandidateRows]  # the candidates' rows it was built from
    # resource id -> the history's (document hash, compressed document): made before the
    # transaction, so that a SQLite write lock is not held while it compresses.
    documents: dict[int, tuple[str, bytes]] = field(default_factory=dict)


def prepare_publish(
    *,
    supplier_id: int,
    batch_id: str,
    items: Sequence[tuple[HotelDiff, Candidate]],
    rows: Mapping[str, CandidateRows] | None = None,
) -> PublishPlan:
    """Builds the rows of a publish of ``items``' AUTO_PUBLISH diffs (pure, no database).

    Args:
        supplier_id: The supplier.
        batch_id: The batch publishing.
        items: (diff, candidate) pairs; only ``action == "AUTO_PUBLISH"`` ones are kept.
        rows: The candidates' rows from :func:`candidate_rows` (same supplier and batch),
            built beforehand; built here when None.
    """
    todo = [(d, c) for d, c in items if d.action == "AUTO_PUBLISH"]
    if rows is None:
        rows = candidate_rows([c for _, c in todo], supplier_id=supplier_id, batch_id=batch_id)
    plan = PublishPlan(todo=todo, hotel_rows=[], offer_rows={}, events={}, expected={}, rows=rows)
    for d, c in todo:
        rid = d.platform_resource_id
        own = rows[c.supplier_hotel_id]
        versions = plan.expected[rid] = ((d.old_publish_version or 0) + 1, c.version)
        plan.documents[rid] = candidate_document(c)
        plan.hotel_rows.append((rid, *own.hotel))
        plan.offer_rows[rid] = _offer_rows(rid, own, versions)
        plan.events[rid] = _hotel_events(batch_id, d, c, versions)
    return plan


def publish_hotels(
    conn: Connection,
    clock: DbClock,
    *,
    supplier_id: int,
    batch_id: str,
    items: Sequence[tuple[HotelDiff, Candidate]],
    plan: PublishPlan | None = None,
    diffs_current: bool = False,
    at: datetime | None = None,
) -> PublishResult:
    """Publishes AUTO_PUBLISH diffs with their offers and outbox events, in ``conn``'s transaction.

    Args:
        conn: A connection inside the transaction that must also commit the events.
        clock: The database clock.
        supplier_id: The supplier.
        batch_id: The batch publishing.
        items: (diff, candidate) pairs; only ``action == "AUTO_PUBLISH"`` ones are written.
        plan: The rows, built beforehand by :func:`prepare_publish` from the same arguments
            (keeps a SQLite write lock short); built here when None.
        diffs_current: The diffs were read in ``conn``'s transaction, and it holds the
            database's write lock since (SQLite): when the upsert wrote every row, it wrote
            each at the versions the diffs expect, so they are not read back.
        at: The transaction's database time (``clock.read``), written as the publish and
            offer times instead of the clock's SQL expression evaluated on every row.
    """
    if plan is None:
        plan = prepare_publish(supplier_id=supplier_id, batch_id=batch_id, items=items)
    todo = plan.todo
    if not todo:
        return PublishResult([], [], 0)
    token = uuid.uuid4().hex
    now = clock.now() if at is None else at
    count = execute_many(
        conn,
        ("publish_hotels",),
        lambda: _hotel_upsert(conn),
        plan.hotel_rows,
        fixed={"publish_token": token, "published_at": now},
        columns=_HOTEL_ROW,
    )
    rids = [d.platform_resource_id for d, _ in todo]
    written: dict[int, tuple[int, int]] = {}
    if diffs_current and conn.dialect.name == "sqlite" and count == len(rids):
        # Nothing was written between the diffs' read and the upsert (one writer at a
        # time), so each row now holds the versions its diff expects: one above the
        # publish version read (1 when none was) and the candidate's supplier version.
        written = dict(plan.expected)
    read_back = _written_query()
    for part in chunks(rids) if not written else ():
        for rid, pv, sv in conn.execute(read_back, {"ids": part, "token": token}):
            written[rid] = (pv, sv)
    done = [(d, c) for d, c in todo if d.platform_resource_id in written]
    offers: list[tuple[Any, ...]] = []
    events: list[tuple[Any, ...]] = []
    # The hotels that may keep an active offer their new version lacks. Not one this call
    # inserted (publish version 1): offers are only written with their hotel row, which
    # stays locked by this call until commit. Nor one whose diff saw every active offer
    # in the new version, when the version written is the one the diff expected: nothing
    # changed its offers in between (whatever does, a publish or a tombstone, writes a
    # new publish version).
    stale: list[int] = []
    for d, c in done:
        rid = d.platform_resource_id
        if written[rid] == plan.expected[rid]:
            offers += plan.offer_rows[rid]
            events += plan.events[rid]
            if d.drops_offers and written[rid][0] > 1:
                stale.append(rid)
        else:  # another publish of this hotel committed in between: other versions
            offers += _offer_rows(rid, plan.rows[c.supplier_hotel_id], written[rid])
            events += _hotel_events(batch_id, d, c, written[rid])
            stale.append(rid)
    _replace_offers(conn, now, stale, offers)
    write_events(conn, events, batch_id=batch_id, at=now)
    record_versions(
        conn,
        [_version(supplier_id, batch_id, d, c, written, plan.documents) for d, c in done],
        at=now,
    )
    published = [
        Published(d.supplier_hotel_id, d.platform_resource_id, *written[d.platform_resource_id])
        for d, _ in done
    ]
    not_newer = [d.supplier_hotel_id for d, _ in todo if d.platform_resource_id not in written]
    # A published hotel's record passed every stage: its open dead letters, of every class,
    # are fixed (what the fix rate counts).
    resolve_subjects(
        conn,
        clock,
        supplier_id=supplier_id,
        subjects=[hotel_subject(p.supplier_hotel_id) for p in published],
        batch_id=batch_id,
        note=f"the hotel published (a newer version of the record) by batch {batch_id}",
    )
    return PublishResult(published, not_newer, len(events))


def _version(
    supplier_id: int,
    batch_id: str,
    diff: HotelDiff,
    cand: Candidate,
    written: Mapping[int, tuple[int, int]],
    documents: Mapping[int, tuple[str, bytes]],
) -> VersionRecord:
    """The history row of a version this call wrote: the candidate's document as published."""
    versions = written[diff.platform_resource_id]
    return VersionRecord(
        resource_id=diff.platform_resource_id,
        supplier_id=supplier_id,
        supplier_hotel_id=cand.supplier_hotel_id,
        publish_version=versions[0],
        supplier_version=versions[1],
        status=str(cand.doc["status"]),
        change_type=diff.diff_type,
        change_reason=None,
        batch_id=batch_id,
        raw_payload_hash=cand.raw_payload_hash,
        document=cand.doc,
        stored=documents.get(diff.platform_resource_id),
    )


@functools.cache
def _written_query() -> sa.Select[Any]:
    """The versions of the hotels a publish wrote (its token), built once."""
    h = schema.platform_hotel.c
    return sa.select(h.resource_id, h.publish_version, h.supplier_version).where(
        h.resource_id.in_(sa.bindparam("ids", expanding=True)),
        h.publish_token == sa.bindparam("token"),
    )


def _hotel_tail(cand: Candidate, supplier_id: int, batch_id: str) -> tuple[Any, ...]:
    """The hotel's platform row (the columns ``_HOTEL_ROW``) after its resource id."""
    doc = cand.doc
    get = doc.get
    star = get("star_rating")
    return (
        supplier_id,
        cand.supplier_hotel_id,
        cand.version,
        1,
        cand.fingerprint,
        doc["name"],
        get("name_local"),
        doc["city_code"],
        doc["country_code"],
        get("address_line1"),
        get("postal_code"),
        float(doc["lat"]),
        float(doc["lng"]),
        None if star is None else Decimal(str(star)),
        get("phone_e164"),
        get("email"),
        json_text(get("facilities") or []),
        json_text(get("images") or []),
        doc["status"],
        _utc(doc["updated_at"]),
        cand.raw_payload_ref,
        cand.raw_payload_hash,
        batch_id,
    )


def _newer(incoming: Any, cur: Any) -> Any:
    """The upsert's guard: the incoming version is newer, or the same version with another
    fingerprint (a fixed normalization rule replayed)."""
    return sa.or_(
        incoming.supplier_version > cur.supplier_version,
        sa.and_(
            incoming.supplier_version == cur.supplier_version,
            incoming.fingerprint != cur.fingerprint,
        ),
    )


def _written(incoming: Any, cur: Any) -> list[tuple[str, Any]]:
    """What a newer version writes over the hotel row, column by column.

    MySQL applies ON DUPLICATE KEY assignments left to right, each seeing the ones before
    it: every column that the guard reads (fingerprint, supplier_version) comes last, so the
    guard sees the old row in every earlier assignment.
    """
    return [
        *((name, incoming[name]) for name in _HOTEL_COLUMNS),
        # Published again: present at the supplier (core/records/tombstones.py).
        ("missing_count", _ZERO),
        ("missing_since", sa.null()),
        ("publish_version", cur.publish_version + _ONE),
        ("fingerprint", incoming.fingerprint),
        ("supplier_version", incoming.supplier_version),
    ]


def _hotel_upsert(conn: Connection) -> Any:
    """The version-guarded upsert of platform hotels, in the connection's dialect."""
    cur = schema.platform_hotel.c
    if conn.dialect.name == "sqlite":
        ins = sqlite_insert(schema.platform_hotel)
        return ins.on_conflict_do_update(
            index_elements=[cur.resource_id],
            set_=dict(_written(ins.excluded, cur)),
            where=_newer(ins.excluded, cur),
        )
    ins_m = mysql_insert(schema.platform_hotel)
    newer = _newer(ins_m.inserted, cur)
    return ins_m.on_duplicate_key_update(
        [
            (name, sa.func.IF(newer, value, cur[name]))
            for name, value in _written(ins_m.inserted, cur)
        ]
    )


def _offer_parts(cand: Candidate) -> list[tuple[Any, ...]]:
    """The hotel's offers as platform rows (the columns ``_OFFER_ROW``) without the hotel
    (its resource id) and the versions.

    The document is in canonical primitive form (``normalize.to_primitive``): every key is
    present, codes are strings and prices are decimal strings.
    """
    out = []
    for room in cand.doc["rooms"]:
        code, name, bed, occupancy = (
            room["room_code"],
            room["name"],
            room["bed_type"],
            room["max_occupancy"],
        )
        out += [
            (
                code,
                plan["code"],
                name,
                bed,
                occupancy,
                plan["board"],
                plan["refundable"],
                plan["available"],
                Decimal(plan["price"]),
                plan["currency"],
            )
            for plan in room["rate_plans"]
        ]
    return out


def _offer_rows(rid: int, rows: CandidateRows, versions: tuple[int, int]) -> list[tuple[Any, ...]]:
    """The hotel's offer rows (the columns ``_OFFER_ROW``) for its (publish, supplier)
    versions."""
    tail = (rid, versions[1], versions[0])
    return [part + tail for part in rows.offers]


def offer_deactivation(resource_ids: Sequence[int], at: Any) -> sa.Update:
    """UPDATE deactivating every offer of these hotels, through the offer identity index."""
    o = schema.platform_offer.c
    stmt = sa.update(schema.platform_offer).where(o.resource_id.in_(resource_ids))
    return use_index(
        stmt.values(active=False, updated_at=at), schema.platform_offer, schema.OFFER_IDENTITY
    )


def stale_offer_deactivation(resource_ids: Sequence[int], at: Any) -> sa.Update:
    """UPDATE deactivating the active offers of these hotels that their current publish
    version did not write (the hotel rows hold that version; its offers carry it)."""
    o = schema.platform_offer.c
    h = schema.platform_hotel.c
    current = sa.select(h.publish_version).where(h.resource_id == o.resource_id).scalar_subquery()
    stmt = sa.update(schema.platform_offer).where(
        o.resource_id.in_(resource_ids), o.active.is_(True), o.publish_version < current
    )
    return use_index(
        stmt.values(active=False, updated_at=at), schema.platform_offer, schema.OFFER_IDENTITY
    )


def _replace_offers(
    conn: Connection, now: Any, rids: Sequence[int], rows: Sequence[tuple[Any, ...]]
) -> None:
    """The published hotels' offers become exactly ``rows``.

    An offer is upserted under its identity (hotel, room, rate plan): the table allocates
    its id the first time and keeps it, also while the supplier stops and resumes offering
    it. Only hotels this call wrote get here, and their rows stay locked until commit, so no
    concurrent publish of another version can interleave with these offer writes.

    Args:
        conn: The publish's connection.
        now: The time written (the database time, or the clock's SQL expression for it).
        rids: The hotels that may have an active offer their new version lacks (after
            the upsert, their offers that it did not write are deactivated).
        rows: Every offer of the hotels this call wrote, as the columns ``_OFFER_ROW``.
    """
    if rows:
        _upsert_offers(conn, now, rows)
    # After the upsert, so that each offer the version keeps is written once, not
    # deactivated and then written again (under SQLite's one write lock, every row counts).
    for part in chunks(rids):
        conn.execute(stale_offer_deactivation(part, now))


def _upsert_offers(conn: Connection, now: Any, rows: Sequence[tuple[Any, ...]]) -> None:
    o = schema.platform_offer.c
    identity = _OFFER_IDENTITY
    columns = [*(name for name in _OFFER_ROW if name not in identity), "active", "updated_at"]

    def build() -> Any:
        if conn.dialect.name == "sqlite":
            ins = sqlite_insert(schema.platform_offer)
            return ins.on_conflict_do_update(
                index_elements=[o[name] for name in identity],
                set_={name: ins.excluded[name] for name in columns},
            )
        ins_m = mysql_insert(schema.platform_offer)
        return ins_m.on_duplicate_key_update({name: ins_m.inserted[name] for name in columns})

    execute_many(
        conn,
        ("publish_offers",),
        build,
        rows,
        fixed={"active": True, "updated_at": now},
        columns=_OFFER_ROW,
    )


def _event_kinds(*types: str) -> tuple[tuple[str, str, str], ...]:
    """Per event type: the type, its first stage, and its payload's head (the type comes
    first, then the body that every event of the hotel's version shares)."""
    return tuple((t, first_stage(t), f'{{"event_type":"{t}",') for t in types)


# The events of a published version by diff type (HOTEL_EVENTS, then the content and the
# new-mapping events that a diff type adds), worked out once.
_EVENTS_OF_DIFF = {
    diff_type: _event_kinds(
        *HOTEL_EVENTS,
        *(("HotelContentChanged",) if diff_type in CONTENT_DIFFS else ()),
        *(("HotelMappingCreated",) if diff_type == "NEW" else ()),
    )
    for diff_type in ("NEW", "CONTENT_CHANGED", "STATUS_CHANGED", "PRICE_CHANGED", "STOCK_CHANGED")
}


def _hotel_events(
    batch_id: str, diff: HotelDiff, cand: Candidate, versions: tuple[int, int]
) -> list[tuple[Any, ...]]:
    """The outbox events of one published version of a hotel (the columns ``EVENT_COLUMNS``)."""
    rid = diff.platform_resource_id
    pv, sv = versions
    diff_type = diff.diff_type
    kinds = _EVENTS_OF_DIFF.get(diff_type) or _event_kinds(*HOTEL_EVENTS)
    # One encoding per hotel: its events differ only by their type, which comes first.
    tail = json_text(
        {
            "resource_id": rid,
            "publish_version": pv,
            "supplier_hotel_id": cand.supplier_hotel_id,
            "supplier_version": sv,
            "diff_type": diff_type,
            "changed_fields": [c["field"] for c in diff.changed_fields[:50]],
            "batch_id": batch_id,
        }
    )[1:]
    return [
        (event_id(event_type, rid, pv), event_type, "HOTEL", rid, pv, head + tail, stage)
        for event_type, stage, head in kinds
    ]


def write_events(
    conn: Connection, events: Sequence[tuple[Any, ...]], *, batch_id: str, at: Any
) -> None:
    """Writes outbox events (rows of the columns ``EVENT_COLUMNS``), READY at their first
    stage, in the caller's transaction; an event already written (its ``event_id``) is kept.

    Every writer of the outbox goes through here: publishing, tombstones, the read API.
    """
    insert_ignore(
        conn,
        schema.outbox,
        events,
        columns=EVENT_COLUMNS,
        batch_id=batch_id,
        created_at=at,
        status="READY",
        current_stage=PUBLISHED,
    )


def event_id(event_type: str, resource_id: int, publish_version: int) -> str:
    """Deterministic event id: one event of a type per published version of a resource."""
    return hashlib.sha256(f"{event_type}\0{resource_id}\0{publish_version}".encode()).hexdigest()


def _utc(value: Any) -> datetime:
    if type(value) is str and value[-1:] == "Z":
        # A canonical document's time (RFC 3339 in UTC): naive UTC as it stands.
        return datetime.fromisoformat(value[:-1])
    if isinstance(value, datetime):
        dt = value
    else:
        dt = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    if dt.tzinfo is not None:
        dt = dt.astimezone(UTC).replace(tzinfo=None)
    return dt
