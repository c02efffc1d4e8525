"""Dead letters: every record that could not be published, as a ticket with a state.

A dead letter names the stage that refused the record, a precise error code, the message
(with the offending value, truncated) and the raw payload it came from (ref and hash), so
that one record can be replayed later. Writing is idempotent: the seed's dedup key
``(batch, supplier, hotel, record position, stage, raw hash)`` and a dead_letter_id derived
from it mean a re-run adds no second row for the same failure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core import schema
from supplier_sync_dagster.core.db import DbClock, insert_ignore

ErrorStage = Literal["ADAPTER", "VALIDATION", "MAPPING", "PUBLISH", "INDEX"]
ErrorType = Literal["RETRYABLE", "NON_RETRYABLE", "MAPPING_REQUIRED", "RISK_BLOCKED"]
# The dedup key cannot rely on NULLs (a UNIQUE key lets NULLs repeat): unreadable ids and
# positions are stored as this marker.
UNKNOWN = "-"


@dataclass(frozen=True)
class DeadLetter:
    """One failed record."""

    supplier_hotel_id: str | None
    error_stage: ErrorStage
    error_type: ErrorType
    error_code: str
    error_message: str
    raw_payload_ref: str | None
    raw_payload_hash: str | None
    # The record's place on its raw page ('record#N'), part of the dedup key.
    record_position: str | None = None
    normalized_payload_ref: str | None = None


def dead_letter_id(batch_id: str, supplier_id: int, letter: DeadLetter) -> str:
    """The deterministic id of a dead letter: a hash of its dedup key."""
    key = "\0".join(
        (
            batch_id,
            str(supplier_id),
            letter.supplier_hotel_id or UNKNOWN,
            letter.record_position or UNKNOWN,
            letter.error_stage,
            letter.raw_payload_hash or UNKNOWN,
        )
    )
    return "dl_" + hashlib.sha256(key.encode()).hexdigest()[:61]


def record_dead_letters(
    conn: Connection,
    clock: DbClock,
    *,
    batch_id: str,
    task_code: str,
    sync_mode: str,
    supplier_id: int,
    letters: Sequence[DeadLetter],
    category_code: str = "HOTEL",
) -> None:
    """Writes dead letters in one statement; rows already recorded are left as they are."""
    rows = [
        {
            "dead_letter_id": dead_letter_id(batch_id, supplier_id, d),
            "supplier_resource_code": (d.supplier_hotel_id or UNKNOWN)[:128],
            "record_position": (d.record_position or UNKNOWN)[:128],
            "error_stage": d.error_stage,
            "error_type": d.error_type,
            "error_code": d.error_code[:128],
            "error_message": d.error_message[:1024],
            "raw_payload_ref": d.raw_payload_ref,
            "raw_payload_hash": d.raw_payload_hash or UNKNOWN,
            "normalized_payload_ref": d.normalized_payload_ref,
            "next_retry_at": None,
        }
        for d in letters
    ]
    insert_ignore(
        conn,
        schema.dead_letter,
        rows,
        batch_id=batch_id,
        task_code=task_code,
        sync_mode=sync_mode,
        category_code=category_code,
        supplier_id=supplier_id,
        status="PENDING",
        created_at=clock.now(),
        updated_at=clock.now(),
    )


def count_dead_letters(conn: Connection, batch_id: str) -> dict[str, int]:
    """Dead letters of a batch by error code."""
    rows = conn.execute(
        sa.select(schema.dead_letter.c.error_code, sa.func.count())
        .where(schema.dead_letter.c.batch_id == batch_id)
        .group_by(schema.dead_letter.c.error_code)
    )
    return {code: int(n) for code, n in rows}
