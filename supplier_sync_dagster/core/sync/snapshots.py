"""A shard's stored pages: the snapshot rows that point at their bytes in the payload store.

The fetch stores each page's exact bytes as a RAW snapshot, normalization each page's kept
documents as a NORMALIZED snapshot derived from it; a replay points a new batch's RAW rows
at stored bytes. A snapshot's id derives from its batch, city, kind and bytes, so writing a
row twice (a retried page, a resumed walk) keeps one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.leasing.leases import ShardLease
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase, insert_ignore
from supplier_sync_dagster.core.store.payloads import StoredPayload

RAW = schema.RAW
NORMALIZED = schema.NORMALIZED
# gzip level of stored RAW and NORMALIZED pages: much cheaper than the store's default of 6
# for somewhat larger objects. Any level reads
# back the same bytes and hashes, so replay and traceability do not depend on it.
PAGE_COMPRESSLEVEL = 1


def snapshot_id(batch_id: str, city_code: str, kind: str, payload_hash: str) -> str:
    """Deterministic snapshot id: one row per (batch, city, kind, page bytes)."""
    key = f"{batch_id}\0{city_code}\0{kind}\0{payload_hash}"
    return ("rs_" if kind == RAW else "ns_") + hashlib.sha256(key.encode()).hexdigest()[:61]


def snapshot_row(
    lease: ShardLease,
    *,
    kind: str,
    key_hash: str,
    stored: StoredPayload,
    page_number: int | None,
    record_count: int,
    source_hash: str | None = None,
) -> dict[str, Any]:
    """The row of a page of the lease's shard just stored (for :func:`record_snapshots`).

    Args:
        lease: The shard's lease.
        kind: RAW or NORMALIZED.
        key_hash: The hash its id derives from (a NORMALIZED page's: its raw page's).
        stored: Where its bytes are.
        page_number: Its number in the walk.
        record_count: Its records (a NORMALIZED page: its kept documents).
        source_hash: For a NORMALIZED page: the raw page it came from.
    """
    return {
        "snapshot_id": snapshot_id(lease.batch_id, lease.shard_key, kind, key_hash),
        "payload_ref": stored.ref,
        "payload_hash": stored.sha256,
        "page_number": page_number,
        "record_count": record_count,
        # For a NORMALIZED page: the raw page it came from (the trace to the supplier).
        "derived_from": source_hash,
    }


def record_snapshots(
    conn: Connection,
    lease: ShardLease,
    supplier_id: int,
    kind: str,
    rows: Sequence[dict[str, Any]],
) -> None:
    """Snapshot rows for stored pages (idempotent: their ids derive from their content)."""
    insert_ignore(
        conn,
        schema.snapshot,
        rows,
        batch_id=lease.batch_id,
        supplier_id=supplier_id,
        category_code="HOTEL",
        shard_key=lease.shard_key,
        snapshot_type=kind,
        snapshot_version=1,
        created_at=lease.db.clock.now(),
    )


class StoredPage(NamedTuple):
    """A stored page: the fields of its snapshot row that normalization needs."""

    payload_ref: str
    payload_hash: str
    page_number: int | None
    record_count: int | None


def stored_pages(db: SyncDatabase, batch_id: str, city: str, kind: str) -> list[StoredPage]:
    """The city's stored pages of ``kind`` in ``batch_id``, in the order they were stored."""
    s = schema.snapshot.c
    with db.engine.connect() as conn:
        return [
            StoredPage(*row)
            for row in conn.execute(
                sa.select(s.payload_ref, s.payload_hash, s.page_number, s.record_count)
                .where(s.batch_id == batch_id, s.shard_key == city, s.snapshot_type == kind)
                .order_by(s.id)
            )
        ]
