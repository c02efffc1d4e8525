"""Trace: from a published hotel (or one of its fields) back to the supplier's bytes.

:func:`trace_hotel` answers "where did this price come from?" for one supplier hotel: the
published row (and, for a hotel the sync unpublished, when, by which batch and why); every diff that changed it, in order (field, old -> new, risk, action, batch,
the review decision when it was held); the normalized document it was published from; each
raw page a version came from (payload ref, city, page, fetched at, and its sha256
**re-computed** from the stored bytes and compared with the recorded one) with the supplier's
own record extracted from those bytes; and its dead letters with their audit history.

Every lookup is by index (``idx_diff_resource``, ``idx_snapshot_payload_hash``,
``idx_dead_letter_hotel``, the hotel's unique key): the cost depends on the hotel's history,
not on the size of the catalog.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import ConfigError, NotFound, PayloadError
from supplier_sync_dagster.core.records.diff import (
    CONTENT_FIELDS,
    PLAN_CONTENT_FIELDS,
    ROOM_CONTENT_FIELDS,
)
from supplier_sync_dagster.core.records.history import (
    HotelKey,
    check_not_future,
    list_versions,
    published_offers,
    version_as_of,
)
from supplier_sync_dagster.core.records.tombstones import TOMBSTONE_FINGERPRINT, UNPUBLISHED_EVENT
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import list_audit
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import PayloadStore
from supplier_sync_dagster.core.store.schema import NORMALIZED, RAW
from supplier_sync_dagster.core.supplier.models import decode_page, page_records


def trace_hotel(
    db: SyncDatabase,
    store: PayloadStore,
    *,
    supplier_id: int,
    supplier_hotel_id: str,
    field: str | None = None,
) -> dict[str, Any]:
    """Everything the sync knows about one hotel, from the published row to the raw bytes.

    Args:
        db: The sync database.
        store: The payload store holding the raw and normalized pages.
        supplier_id: The supplier.
        supplier_hotel_id: The supplier's hotel id.
        field: Only diffs that changed this field (``price_amount`` matches every rate
            plan's price; ``name`` the name ...); None: every diff.

    Returns:
        A JSON-ready mapping: ``published``, ``unpublished`` (when, by which batch and why
        a tombstoned hotel was taken down; None for a hotel that is not), ``offers``,
        ``diffs``, ``normalized``, ``raw`` (one entry per page, ``verified`` true when the
        bytes hash as recorded) and ``dead_letters``.

    Raises:
        NotFound: The sync never saw this hotel (no published row, diff or dead letter).
        ConfigError: ``field`` is not a field a diff records.
    """
    check_trace_field(field)
    with db.engine.connect() as conn:
        published = _published(conn, supplier_id, supplier_hotel_id)
        offers = _offers(conn, published["resource_id"]) if published else []
        unpublished = _unpublished(conn, published) if published else None
        diffs = _diffs(conn, supplier_id, supplier_hotel_id, field)
        letters = _dead_letters(conn, supplier_id, supplier_hotel_id)
        if published is None and not diffs and not letters:
            raise NotFound(f"supplier {supplier_id} hotel {supplier_hotel_id!r} was never synced")
        hashes = list(
            dict.fromkeys(
                h
                for h in [
                    *(d["raw_payload_hash"] for d in diffs),
                    published["raw_payload_hash"] if published else None,
                    *(dl["raw_payload_hash"] for dl in letters),
                ]
                if h and h != "-"
            )
        )
        pages = _raw_pages(conn, hashes)
        normalized_page = (
            _normalized_page(conn, supplier_id, published["raw_payload_hash"])
            if published
            else None
        )
    raw = [
        _read_raw(store, pages[h], supplier_hotel_id) if h in pages else _lost(h) for h in hashes
    ]
    normalized = (
        _read_normalized(store, normalized_page, supplier_hotel_id) if normalized_page else None
    )
    return {
        "supplier_id": supplier_id,
        "supplier_hotel_id": supplier_hotel_id,
        "field": field,
        "published": published,
        "unpublished": unpublished,
        "offers": offers,
        "diffs": diffs,
        "normalized": normalized,
        "raw": raw,
        "dead_letters": letters,
    }


def trace_hotel_as_of(
    db: SyncDatabase,
    store: PayloadStore,
    *,
    supplier_id: int,
    supplier_hotel_id: str,
    at: datetime,
) -> dict[str, Any]:
    """The hotel exactly as published at ``at``, and why: its publish version then, the
    document and offers it published, the diff that produced it, the batch, the raw page
    behind it (its bytes re-hashed) and the version that followed.

    Args:
        db: The sync database.
        store: The payload store holding the raw pages.
        supplier_id: The supplier.
        supplier_hotel_id: The supplier's hotel id.
        at: The time, naive UTC (:func:`~supplier_sync_dagster.core.inputs.timestamps.parse_as_of`).

    Raises:
        InvalidTimestamp: ``at`` is after the database clock's now.
        NotPublishedThen: The hotel had no published version then.
        HistoryNotKept: ``at`` is before the history kept for the hotel.
    """
    hotel = HotelKey(supplier_id=supplier_id, supplier_hotel_id=supplier_hotel_id)
    with db.engine.connect() as conn:
        check_not_future(at, db.clock.read(conn))
        found = version_as_of(conn, hotel, at)
        version = found.version
        pv = int(version["publish_version"])
        following = [v for v in list_versions(conn, hotel) if int(v["publish_version"]) > pv]
        diff = next(
            (
                d
                for d in reversed(_diffs(conn, supplier_id, supplier_hotel_id, None))
                if d["batch_id"] == version["batch_id"]
                and int(d["new_snapshot_version"]) == int(version["supplier_version"])
            ),
            None,
        )
        b = schema.batch.c
        batch = conn.execute(
            sa.select(
                b.batch_id, b.task_code, b.trigger_source, b.trigger_id, b.sync_mode, b.status
            ).where(b.batch_id == version["batch_id"])
        ).first()
        raw_hash = version["raw_payload_hash"]
        pages = _raw_pages(conn, [raw_hash]) if raw_hash else {}
    raw = None
    if raw_hash:
        raw = (
            _read_raw(store, pages[raw_hash], supplier_hotel_id)
            if raw_hash in pages
            else _lost(raw_hash)
        )
    nxt = following[0] if following else None
    return {
        "supplier_id": supplier_id,
        "supplier_hotel_id": supplier_hotel_id,
        "as_of": f"{at.isoformat()}Z",
        "version": {k: _plain(v) for k, v in version.items()},
        "hotel": found.document,
        "offers": published_offers(found.document),
        "diff": diff,
        "batch": None if batch is None else _row(batch),
        "raw": raw,
        "current_until": None
        if nxt is None
        else {
            "publish_version": nxt["publish_version"],
            "published_at": _plain(nxt["published_at"]),
        },
    }


def hotel_history(db: SyncDatabase, *, supplier_id: int, supplier_hotel_id: str) -> dict[str, Any]:
    """Every published version of the hotel the history keeps, oldest first, with its time.

    Raises:
        NotFound: The history keeps no version of it.
    """
    hotel = HotelKey(supplier_id=supplier_id, supplier_hotel_id=supplier_hotel_id)
    with db.engine.connect() as conn:
        versions = list_versions(conn, hotel)
    if not versions:
        raise NotFound(f"{hotel.describe()}: the publish history keeps no version of it")
    return {
        "supplier_id": supplier_id,
        "supplier_hotel_id": supplier_hotel_id,
        "versions": [{k: _plain(v) for k, v in row.items()} for row in versions],
    }


def _row(row: Any) -> dict[str, Any]:
    return {k: _plain(v) for k, v in row._mapping.items()}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool, list, dict)):
        return value
    return str(value)


def _published(conn: Connection, supplier_id: int, hotel: str) -> dict[str, Any] | None:
    h = schema.platform_hotel.c
    row = conn.execute(
        sa.select(
            h.resource_id,
            h.supplier_version,
            h.publish_version,
            h.published_at,
            h.last_batch_id,
            h.status,
            h.name,
            h.city_code,
            h.country_code,
            h.supplier_updated_at,
            h.fingerprint,
            h.raw_payload_ref,
            h.raw_payload_hash,
            h.missing_count,
            h.missing_since,
        ).where(h.supplier_id == supplier_id, h.supplier_hotel_id == hotel)
    ).first()
    return None if row is None else _row(row)


# Why a tombstone was made (the ``reason`` of its HotelUnpublished event), for people.
_UNPUBLISHED_BECAUSE = {
    "missing": "the supplier stopped listing it",
    "not_found": "the supplier answered 404 (not found) for it",
}


def _unpublished(conn: Connection, published: Mapping[str, Any]) -> dict[str, Any] | None:
    """When, by which batch and why the hotel was unpublished (tombstoned); None if it is not.

    The tombstone's publish version is the hotel's current one, and its HotelUnpublished
    event (found through the outbox's unique key) says why.
    """
    if published["fingerprint"] != TOMBSTONE_FINGERPRINT:
        return None
    o = schema.outbox.c
    payload = conn.execute(
        sa.select(o.payload).where(
            o.aggregate_type == "HOTEL",
            o.aggregate_id == published["resource_id"],
            o.aggregate_version == published["publish_version"],
            o.event_type == UNPUBLISHED_EVENT,
        )
    ).scalar()
    reason = None
    if payload is not None:
        try:
            reason = json.loads(payload).get("reason")
        except (ValueError, AttributeError):
            reason = None
    return {
        "at": published["published_at"],
        "batch_id": published["last_batch_id"],
        "reason": reason,
        "because": _UNPUBLISHED_BECAUSE.get(str(reason), reason or "unknown"),
        "missing_since": published["missing_since"],
        "missing_count": published["missing_count"],
    }


def _offers(conn: Connection, resource_id: int) -> list[dict[str, Any]]:
    o = schema.platform_offer.c
    return [
        _row(r)
        for r in conn.execute(
            sa.select(
                o.offer_id,
                o.room_code,
                o.rate_plan_code,
                o.price_amount,
                o.currency,
                o.available,
                o.active,
                o.supplier_version,
                o.publish_version,
                o.updated_at,
            )
            .where(o.resource_id == resource_id)
            .order_by(o.room_code, o.rate_plan_code)
        )
    ]


# A published column and the diff field its changes are recorded under.
_DIFF_FIELD = {"price_amount": "price", "currency": "price", "star_rating": "star_rating"}
# Every field a diff records a change of (a room's and a rate plan's by their last part),
# and the published columns above: what ``trace --field`` may name.
TRACE_FIELDS = tuple(
    sorted(
        {"status", "version", "rooms", "price", "available"}
        | set(CONTENT_FIELDS)
        | set(ROOM_CONTENT_FIELDS)
        | set(PLAN_CONTENT_FIELDS)
        | set(_DIFF_FIELD)
    )
)


def check_trace_field(field: str | None) -> None:
    """Stops a trace of a field no diff records (it would list no diff, as if none changed).

    Raises:
        ConfigError: ``field`` is not one of :data:`TRACE_FIELDS`.
    """
    if field is not None and field not in TRACE_FIELDS:
        raise ConfigError(
            f"--field {field!r} is not a field a diff records; one of: {', '.join(TRACE_FIELDS)}"
        )


def _matches(name: str, field: str) -> bool:
    """Whether a diff's field path (``rooms[DLX].rate_plans[BAR].price``) is ``field``
    (a published column such as ``price_amount`` matches the diff field it is part of)."""
    field = _DIFF_FIELD.get(field, field)
    return name == field or name.endswith("." + field) or name.startswith(field + "[")


def _diffs(
    conn: Connection, supplier_id: int, hotel: str, field: str | None
) -> list[dict[str, Any]]:
    f, b, r = schema.diff_log.c, schema.batch.c, schema.review.c
    rows = conn.execute(
        sa.select(
            f.id,
            f.batch_id,
            f.shard_key,
            f.diff_type,
            f.changed_fields,
            f.risk_level,
            f.action,
            f.old_publish_version,
            f.new_snapshot_version,
            f.raw_payload_hash,
            f.created_at,
            b.trigger_source,
            b.trigger_id,
            b.sync_mode,
        )
        .join(schema.batch, b.batch_id == f.batch_id)
        .where(f.supplier_id == supplier_id, f.supplier_resource_code == hotel)
        .order_by(f.id)
    ).all()
    reviews = {
        (x.batch_id, int(x.supplier_version)): x
        for x in conn.execute(
            sa.select(
                r.batch_id,
                r.supplier_version,
                r.status,
                r.decided_by,
                r.decision_reason,
                r.decided_at,
            ).where(r.supplier_id == supplier_id, r.supplier_hotel_id == hotel)
        )
    }
    out = []
    for row in rows:
        changes = row.changed_fields
        if isinstance(changes, str):
            changes = json.loads(changes)
        changes = list(changes or [])
        if field is not None:
            changes = [c for c in changes if _matches(str(c.get("field", "")), field)]
            if not changes:
                continue
        entry = _row(row)
        entry.pop("id")
        entry["changed_fields"] = changes
        review = reviews.get((row.batch_id, int(row.new_snapshot_version)))
        entry["review"] = None if review is None else _row(review)
        out.append(entry)
    return out


def _dead_letters(conn: Connection, supplier_id: int, hotel: str) -> list[dict[str, Any]]:
    d = schema.dead_letter.c
    rows = conn.execute(
        sa.select(
            d.id,
            d.dead_letter_id,
            d.batch_id,
            d.city_code,
            d.error_stage,
            d.error_code,
            d.error_message,
            d.status,
            d.retry_count,
            d.max_retry_count,
            d.owner_team,
            d.fix_note,
            d.raw_payload_ref,
            d.raw_payload_hash,
            d.record_position,
            d.created_at,
            d.resolved_at,
        )
        .where(d.supplier_id == supplier_id, d.supplier_resource_code == hotel)
        .order_by(d.id)
    ).all()
    return [
        {
            **_row(r),
            "audit": [
                {k: _plain(v) for k, v in asdict(e).items()}
                for e in list_audit(
                    conn, target_type="dead_letter", target_id=r.dead_letter_id, limit=100
                )
            ],
        }
        for r in rows
    ]


def _raw_pages(conn: Connection, hashes: list[str]) -> dict[str, Any]:
    if not hashes:
        return {}
    s, b = schema.snapshot.c, schema.batch.c
    rows = conn.execute(
        sa.select(
            s.payload_hash,
            s.payload_ref,
            s.batch_id,
            s.shard_key,
            s.page_number,
            s.record_count,
            s.derived_from,
            s.created_at,
            b.trigger_source,
            b.sync_mode,
        )
        .join(schema.batch, b.batch_id == s.batch_id)
        .where(s.payload_hash.in_(hashes), s.snapshot_type == RAW)
        .order_by(s.id)
    ).all()
    first: dict[str, Any] = {}
    for row in rows:
        first.setdefault(row.payload_hash, row)  # the fetch that stored the bytes first
    return first


def _normalized_page(conn: Connection, supplier_id: int, raw_hash: str | None) -> Any:
    """The latest NORMALIZED page made from the raw page ``raw_hash``."""
    if not raw_hash:
        return None
    s = schema.snapshot.c
    return conn.execute(
        sa.select(s.payload_ref, s.payload_hash, s.batch_id, s.created_at)
        .where(
            # Pages name no hotel: the leading columns of idx_snapshot_derived_from.
            s.supplier_id == supplier_id,
            s.supplier_resource_code.is_(None),
            s.derived_from == raw_hash,
            s.snapshot_type == NORMALIZED,
        )
        .order_by(s.id.desc())
        .limit(1)
    ).first()


def _read_raw(store: PayloadStore, page: Any, hotel: str) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "payload_ref": page.payload_ref,
        "payload_hash": page.payload_hash,
        "batch_id": page.batch_id,
        "sync_mode": page.sync_mode,
        "trigger_source": page.trigger_source,
        "city": page.shard_key,
        "page": page.page_number,
        "records_on_page": page.record_count,
        "derived_from": page.derived_from,
        "fetched_at": _plain(page.created_at),
    }
    try:
        body = store.get(page.payload_ref)
    except PayloadError as err:
        return {**entry, "verified": False, "error": f"{type(err).__name__}: {err}"}
    actual = hashlib.sha256(body).hexdigest()
    entry["sha256"] = actual
    entry["verified"] = actual == page.payload_hash
    if not entry["verified"]:
        entry["error"] = "the stored bytes do not hash as recorded: they were changed"
        return entry
    entry["record"] = _find(page_records(decode_page(body)), hotel)
    return entry


def _lost(raw_hash: str) -> dict[str, Any]:
    return {
        "payload_hash": raw_hash,
        "verified": False,
        "error": "no RAW snapshot records these bytes (deleted by retention?)",
    }


def _read_normalized(store: PayloadStore, page: Any, hotel: str) -> dict[str, Any]:
    entry = {"payload_ref": page.payload_ref, "batch_id": page.batch_id}
    try:
        body = store.get(page.payload_ref)
    except PayloadError as err:
        return {**entry, "error": f"{type(err).__name__}: {err}"}
    for line in body.splitlines():
        doc = json.loads(line)
        if isinstance(doc, Mapping) and doc.get("supplier_hotel_id") == hotel:
            return {**entry, "document": doc}
    return {**entry, "document": None}


def _find(records: list[Any], hotel: str) -> Any:
    for record in records:
        if isinstance(record, dict) and record.get("hotel_id") == hotel:
            return record
    return None
