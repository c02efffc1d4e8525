"""Publish history: every published version of a hotel, and the document it published.

Each publish version (a publish, an unpublish) gets one ``supplier_sync_hotel_version`` row
in the transaction that writes it: when (the database clock), by which batch, from which raw
page, what kind of change, and the sha256 of the document published. The document (the
canonical normalized hotel with its rooms and rate plans, as the diff and the publish read it)
is stored zlib-compressed in ``supplier_sync_published_document``, once per content.

:func:`version_as_of` answers "what did we publish for this hotel at that time?": the
version with the highest publish version published at or before it. Versions only grow, so
that is the one current then; a time before the hotel's first version is
:class:`NotPublishedThen`, before the history kept (pruned, or published before the history
was recorded) :class:`HistoryNotKept`. :func:`prune_history` keeps the version current at the
retention horizon and every later one, so every answer inside the window stays exact.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.mysql import insert as mysql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import (
    HistoryNotKept,
    InvalidTimestamp,
    NotPublishedThen,
)
from supplier_sync_dagster.core.records.diff import Candidate, load_published
from supplier_sync_dagster.core.records.mapping import chunks
from supplier_sync_dagster.core.records.normalize import canonical_dumps, loads_canonical
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase, execute_many, insert_ignore

UNPUBLISHED = "UNPUBLISHED"
# The fastest level: a hotel's JSON repeats its keys room after room, so it already shrinks
# to about a third, and every first publish pays for it.
_ZLIB_LEVEL = 1
# Rows a pruning transaction deletes at most (short locks on a busy catalog).
PRUNE_CHUNK = 5000
_VERSION_COLUMNS = (
    "resource_id",
    "supplier_id",
    "supplier_hotel_id",
    "publish_version",
    "supplier_version",
    "status",
    "change_type",
    "change_reason",
    "batch_id",
    "raw_payload_hash",
    "document_hash",
)


@dataclass(frozen=True)
class VersionRecord:
    """One published version of a hotel, as its publish writes it (the columns
    ``_VERSION_COLUMNS`` but the hash, then the document)."""

    resource_id: int
    supplier_id: int
    supplier_hotel_id: str
    publish_version: int
    supplier_version: int
    status: str
    change_type: str
    change_reason: str | None
    batch_id: str
    raw_payload_hash: str | None
    document: Mapping[str, Any]
    stored: tuple[str, bytes] | None = None  # the document's (hash, bytes), when made before


def document_bytes(document: Mapping[str, Any]) -> tuple[str, bytes]:
    """The document's content address (sha256 of its canonical JSON) and stored bytes."""
    canonical = canonical_dumps(document)
    return hashlib.sha256(canonical).hexdigest(), zlib.compress(canonical, _ZLIB_LEVEL)


def candidate_document(cand: Candidate) -> tuple[str, bytes]:
    """:func:`document_bytes` of a candidate's document: its fingerprint is the sha256 of the
    canonical JSON it came with, which is compressed as it stands."""
    if cand.canonical is None:
        return document_bytes(cand.doc)
    return cand.fingerprint, zlib.compress(cand.canonical, _ZLIB_LEVEL)


def decode_document(stored: bytes) -> dict[str, Any]:
    """A stored document (:func:`document_bytes`), decoded."""
    doc: dict[str, Any] = loads_canonical(zlib.decompress(stored))
    return doc


def record_versions(conn: Connection, records: Sequence[VersionRecord], *, at: Any) -> None:
    """Writes the versions and their documents in the caller's (the publish's) transaction.

    A document already stored is not written again; its ``last_used_at`` moves to ``at``, so
    that a pruning that found it unused cannot delete it under this version (its DELETE
    re-checks the time on the row this transaction holds).

    Args:
        conn: The publish's connection.
        records: The versions written.
        at: The publish time (a value, or the clock's SQL expression).
    """
    if not records:
        return
    documents: dict[str, bytes] = {}
    rows = []
    for r in records:
        digest, body = r.stored or document_bytes(r.document)
        documents.setdefault(digest, body)
        rows.append(
            (
                r.resource_id,
                r.supplier_id,
                r.supplier_hotel_id,
                r.publish_version,
                r.supplier_version,
                r.status,
                r.change_type,
                r.change_reason,
                r.batch_id,
                r.raw_payload_hash,
                digest,
            )
        )
    execute_many(
        conn,
        ("history_documents",),
        lambda: _document_upsert(conn),
        sorted(documents.items()),  # one order for every writer: no deadlock between them
        fixed={"created_at": at, "last_used_at": at},
        columns=("document_hash", "document"),
    )
    insert_ignore(conn, schema.hotel_version, rows, columns=_VERSION_COLUMNS, published_at=at)


def _document_upsert(conn: Connection) -> Any:
    table = schema.published_document
    if conn.dialect.name == "sqlite":
        ins = sqlite_insert(table)
        return ins.on_conflict_do_update(
            index_elements=[table.c.document_hash],
            set_={"last_used_at": ins.excluded.last_used_at},
        )
    ins_m = mysql_insert(table)
    return ins_m.on_duplicate_key_update(last_used_at=ins_m.inserted.last_used_at)


def tombstone_documents(conn: Connection, versions: Mapping[int, int]) -> dict[int, dict[str, Any]]:
    """The documents of hotels about to be unpublished: each one's current document with
    status INACTIVE and no rooms (the hotel stays, nothing of it is sold).

    Args:
        conn: The unpublishing transaction.
        versions: Resource id -> its publish version now (the one the tombstone follows).
    """
    v, d = schema.hotel_version.c, schema.published_document.c
    found: dict[int, dict[str, Any]] = {}
    pairs = sorted(versions.items())
    for part in chunks(pairs):
        for rid, stored in conn.execute(
            sa.select(v.resource_id, d.document)
            .join(schema.published_document, d.document_hash == v.document_hash)
            .where(sa.tuple_(v.resource_id, v.publish_version).in_(part))
        ):
            found[int(rid)] = decode_document(stored)
    missing = [rid for rid in versions if rid not in found]
    if missing:
        # Published before the history was recorded: the catalog's rows are that version.
        for rid, ((supplier_version, _, _), doc) in load_published(conn, missing).items():
            found[rid] = {**doc, "version": supplier_version}
    return {rid: {**doc, "status": "INACTIVE", "rooms": []} for rid, doc in found.items()}


def check_not_future(at: datetime, now: datetime) -> None:
    """Refuses a time after the database clock's now: nothing is known of it yet.

    Raises:
        InvalidTimestamp: ``at`` is after ``now`` (both naive UTC).
    """
    if at > now:
        raise InvalidTimestamp(
            f"{at.isoformat()}Z is in the future (the database clock says {now.isoformat()}Z)"
        )


def published_offers(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The offers (room x rate plan) a published document sold, by room and rate plan code."""
    offers = [
        {
            "room_code": room["room_code"],
            "rate_plan_code": plan["code"],
            "room_name": room.get("name"),
            "bed_type": room.get("bed_type"),
            "max_occupancy": room.get("max_occupancy"),
            "board": plan.get("board"),
            "refundable": plan.get("refundable"),
            "available": bool(plan.get("available")),
            "price": plan["price"],
            "currency": plan["currency"],
        }
        for room in document.get("rooms") or ()
        for plan in room.get("rate_plans") or ()
    ]
    return sorted(offers, key=lambda o: (o["room_code"], o["rate_plan_code"]))


@dataclass(frozen=True)
class HotelKey:
    """Which hotel: its resource id, or its supplier and supplier hotel id."""

    resource_id: int | None = None
    supplier_id: int | None = None
    supplier_hotel_id: str | None = None

    def where(self) -> list[Any]:
        """The conditions on ``supplier_sync_hotel_version`` that select it."""
        v = schema.hotel_version.c
        if self.resource_id is not None:
            return [v.resource_id == self.resource_id]
        return [v.supplier_id == self.supplier_id, v.supplier_hotel_id == self.supplier_hotel_id]

    def describe(self) -> str:
        """The hotel, for a message."""
        if self.resource_id is not None:
            return f"hotel {self.resource_id}"
        return f"supplier {self.supplier_id} hotel {self.supplier_hotel_id!r}"


def _version_columns() -> tuple[Any, ...]:
    v = schema.hotel_version.c
    return (
        v.resource_id,
        v.supplier_id,
        v.supplier_hotel_id,
        v.publish_version,
        v.supplier_version,
        v.status,
        v.change_type,
        v.change_reason,
        v.batch_id,
        v.raw_payload_hash,
        v.document_hash,
        v.published_at,
    )


def list_versions(conn: Connection, hotel: HotelKey) -> list[dict[str, Any]]:
    """Every version of the hotel the history keeps, oldest first (by index)."""
    v = schema.hotel_version.c
    rows = conn.execute(
        sa.select(*_version_columns()).where(*hotel.where()).order_by(v.publish_version)
    )
    return [dict(r._mapping) for r in rows]


@dataclass(frozen=True)
class VersionAt:
    """The version of a hotel current at a time, with its document."""

    version: dict[str, Any]
    document: dict[str, Any]


def version_as_of(conn: Connection, hotel: HotelKey, at: datetime) -> VersionAt:
    """The hotel's published version current at ``at`` (naive UTC, database clock), exactly.

    Raises:
        NotPublishedThen: The hotel's first version was published after ``at`` (or never).
        HistoryNotKept: ``at`` is before the oldest version the history keeps, and that one
            is not the hotel's first (pruned, or published before the history was recorded).
    """
    v, d = schema.hotel_version.c, schema.published_document.c
    base = sa.select(*_version_columns(), d.document).join(
        schema.published_document, d.document_hash == v.document_hash
    )
    row = conn.execute(
        base.where(*hotel.where(), v.published_at <= at).order_by(v.publish_version.desc()).limit(1)
    ).first()
    if row is not None:
        version = dict(row._mapping)
        return VersionAt(version, decode_document(version.pop("document")))
    first = conn.execute(
        sa.select(v.publish_version, v.published_at)
        .where(*hotel.where())
        .order_by(v.publish_version)
        .limit(1)
    ).first()
    stamp = f"{at.isoformat()}Z"
    if first is None:
        if _in_catalog(conn, hotel):
            raise HistoryNotKept(
                f"{hotel.describe()}: no publish history was recorded for it yet (its "
                "current version was published before the history began)"
            )
        raise NotPublishedThen(f"{hotel.describe()} was never published")
    if int(first.publish_version) > 1:
        raise HistoryNotKept(
            f"{hotel.describe()}: {stamp} is before its history kept, which starts at "
            f"{first.published_at.isoformat()}Z (publish version {first.publish_version})"
        )
    raise NotPublishedThen(
        f"{hotel.describe()} was not published yet at {stamp} (first published at "
        f"{first.published_at.isoformat()}Z)"
    )


def _in_catalog(conn: Connection, hotel: HotelKey) -> bool:
    h = schema.platform_hotel.c
    where = (
        [h.resource_id == hotel.resource_id]
        if hotel.resource_id is not None
        else [h.supplier_id == hotel.supplier_id, h.supplier_hotel_id == hotel.supplier_hotel_id]
    )
    return conn.execute(sa.select(h.resource_id).where(*where)).first() is not None


@dataclass(frozen=True)
class PruneReport:
    """What a pruning removed, and its horizon (naive UTC)."""

    horizon: datetime
    versions: int
    documents: int


def prune_history(
    db: SyncDatabase, *, retention_days: int, chunk: int = PRUNE_CHUNK
) -> PruneReport:
    """Drops the versions superseded before the horizon (now minus ``retention_days`` by the
    database clock) and the documents no version uses any more, in short transactions.

    The version current at the horizon stays (and every later one), so every time from the
    horizon on is answered exactly.
    """
    v, d = schema.hotel_version.c, schema.published_document.c
    with db.engine.connect() as conn:
        horizon = db.clock.read(conn) - timedelta(days=retention_days)
    later = schema.hotel_version.alias("later")
    superseded = (
        sa.select(v.id)
        .where(
            v.published_at <= horizon,
            sa.exists().where(
                later.c.resource_id == v.resource_id,
                later.c.publish_version > v.publish_version,
                later.c.published_at <= horizon,
            ),
        )
        .limit(chunk)
    )
    unused = (
        sa.select(d.id)
        .where(
            d.last_used_at <= horizon,
            ~sa.exists().where(v.document_hash == d.document_hash),
        )
        .limit(chunk)
    )
    versions = _delete_all(db, superseded, schema.hotel_version, [])
    documents = _delete_all(db, unused, schema.published_document, [d.last_used_at <= horizon])
    return PruneReport(horizon, versions, documents)


def _delete_all(
    db: SyncDatabase, select_ids: sa.Select[Any], table: sa.Table, recheck: list[Any]
) -> int:
    total = 0
    while True:
        with db.begin() as conn:
            ids = list(conn.execute(select_ids).scalars())
            if not ids:
                return total
            deleted = conn.execute(sa.delete(table).where(table.c.id.in_(ids), *recheck)).rowcount
        if not deleted:  # each chosen row was used again meanwhile: the next pruning decides
            return total
        total += deleted


__all__ = [
    "UNPUBLISHED",
    "HotelKey",
    "PruneReport",
    "VersionAt",
    "VersionRecord",
    "candidate_document",
    "check_not_future",
    "decode_document",
    "document_bytes",
    "list_versions",
    "prune_history",
    "published_offers",
    "record_versions",
    "tombstone_documents",
    "version_as_of",
]
