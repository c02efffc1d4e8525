"""Exports of the sync's results as JSON lines, streamed (bounded memory, any size)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any, Literal, TextIO

import sqlalchemy as sa

from supplier_sync_dagster.core.records.diff import active_offers
from supplier_sync_dagster.core.records.mapping import CHUNK
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase

ExportKind = Literal["published", "dead-letters", "diffs"]


def _plain(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def _rows(db: SyncDatabase, stmt: sa.Select[Any]) -> Iterator[dict[str, Any]]:
    with db.engine.connect() as conn:
        result = conn.execution_options(stream_results=True, yield_per=1000).execute(stmt)
        for row in result:
            yield {k: _plain(v) for k, v in row._mapping.items()}


def _export_published(db: SyncDatabase, out: TextIO, page: int = CHUNK) -> int:
    """Hotels with their active offers, a page at a time by resource id, on one connection
    (a second connection inside a read would wait on SQLite's lock held by the first)."""
    h, o = schema.platform_hotel.c, schema.platform_offer.c
    cols = [c for c in schema.platform_hotel.c if c.name not in ("resource_id", "publish_token")]
    n, last = 0, -1
    with db.engine.connect() as conn:
        while True:
            hotels = [
                {k: _plain(v) for k, v in row._mapping.items()}
                for row in conn.execute(
                    sa.select(h.resource_id.label("platform_resource_id"), *cols)
                    .where(h.resource_id > last)
                    .order_by(h.resource_id)
                    .limit(page)
                )
            ]
            if not hotels:
                return n
            ids = [r["platform_resource_id"] for r in hotels]
            offers: dict[int, list[dict[str, Any]]] = {}
            for row in conn.execute(active_offers(ids).order_by(o.offer_id)):
                m = {k: _plain(v) for k, v in row._mapping.items()}
                offers.setdefault(m.pop("resource_id"), []).append(m)
            for r in hotels:
                r["facilities"] = json.loads(r["facilities"] or "[]")
                r["images"] = json.loads(r["images"] or "[]")
                r["offers"] = offers.get(r["platform_resource_id"], [])
                out.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
            n += len(hotels)
            last = ids[-1]


def export_jsonl(
    db: SyncDatabase, what: ExportKind, out: TextIO, *, batch_id: str | None = None
) -> int:
    """Writes one JSON object per line; returns how many.

    - published: a hotel with ``supplier_id``, ``supplier_hotel_id``, ``supplier_version``,
      ``platform_resource_id``, ``publish_version``, its published fields and its offers.
    - dead-letters: ``supplier_hotel_id``, ``error_stage``, ``error_type``, ``error_code``,
      ``error_message``, ``status``, the record's position and the raw payload ref and hash.
    - diffs: the diff log.
    """
    n = 0
    if what == "published":
        return _export_published(db, out)
    if what == "dead-letters":
        d = schema.dead_letter.c
        stmt = sa.select(
            d.dead_letter_id,
            d.batch_id,
            d.supplier_id,
            d.supplier_resource_code.label("supplier_hotel_id"),
            d.record_position,
            d.error_stage,
            d.error_type,
            d.error_code,
            d.error_message,
            d.status,
            d.retry_count,
            d.raw_payload_ref,
            d.raw_payload_hash,
            d.created_at,
        ).order_by(d.id)
        if batch_id:
            stmt = stmt.where(sa.or_(d.batch_id == batch_id, d.last_batch_id == batch_id))
    else:
        f = schema.diff_log.c
        stmt = sa.select(
            f.diff_id,
            f.batch_id,
            f.shard_key.label("city_code"),
            f.supplier_resource_code.label("supplier_hotel_id"),
            f.platform_resource_id,
            f.old_publish_version,
            f.new_snapshot_version,
            f.diff_type,
            f.changed_fields,
            f.risk_level,
            f.action,
            f.created_at,
        ).order_by(f.id)
        if batch_id:
            stmt = stmt.where(f.batch_id == batch_id)
    for row in _rows(db, stmt):
        out.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
        n += 1
    return n
