"""017: one open dead letter per problem. A database at 016 with duplicate open tickets (every
sync opened one) keeps one per problem, the newest, counting the others; a "resolution" that
was a re-fetch refused again with the same code stops counting as a fix. SQLite and MariaDB."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.records.deadletters import summarize
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.migrations import migrate
from supplier_sync_dagster_tests.core.store.test_migrations import apply_by_hand

T0 = datetime(2026, 11, 1)


def _letter(n: int, hotel: str, code: str, status: str, **extra: Any) -> dict[str, Any]:
    return {
        "dead_letter_id": f"d{n}",
        "batch_id": f"b{n}",
        "task_code": "t",
        "sync_mode": "FULL",
        "category_code": "HOTEL",
        "supplier_id": 1,
        "supplier_resource_code": hotel,
        "record_position": f"record#{n}",
        "error_stage": "VALIDATION",
        "error_type": "NON_RETRYABLE",
        "error_code": code,
        "error_message": f"m{n}",
        "raw_payload_hash": f"h{n}",
        "status": status,
        "created_at": T0 + timedelta(hours=n),
        "updated_at": T0 + timedelta(hours=n),
        "city_code": "BKK",
        "fix_note": None,
        **extra,
    }


def test_017_merges_duplicate_open_tickets_and_false_resolutions(db_url: str) -> None:
    apply_by_hand(db_url, 16)
    db = SyncDatabase.open(db_url, create_schema=False)
    try:
        rows = [
            _letter(1, "H1", "INVALID_PHONE", "RESOLVED"),  # an old, real fix
            _letter(2, "H1", "INVALID_PHONE", "MANUAL_FIX"),
            _letter(3, "H1", "INVALID_PHONE", "MANUAL_FIX"),
            _letter(4, "H1", "INVALID_PHONE", "MANUAL_FIX"),
            _letter(5, "H1", "HTML_IN_NAME", "MANUAL_FIX"),  # another problem of H1
            _letter(6, "H2", "INVALID_PHONE", "MANUAL_FIX"),
            _letter(7, "-", "CITY_FAILED", "FAILED", record_position="city:BKK"),
            _letter(8, "-", "CITY_FAILED", "PENDING", record_position="city:BKK"),
            _letter(9, "-", "CITY_FAILED", "PENDING", record_position="city:DAV", city_code="DAV"),
            _letter(
                10,
                "H3",
                "INVALID_PHONE",
                "RESOLVED",
                fix_note="re-fetched in batch c1: now fails with INVALID_PHONE (dead letter #11)",
            ),
            _letter(
                12,
                "H4",
                "SUPPLIER_UNAVAILABLE",
                "RESOLVED",
                fix_note="re-fetched in batch c1: now fails with INVALID_PHONE (dead letter #13)",
            ),
        ]
        old = sa.table("supplier_sync_dead_letter", *(sa.column(c) for c in rows[0]))
        with db.begin() as conn:
            conn.execute(sa.insert(old), rows)
        assert 17 in [a.version for a in migrate(db).applied]
        d = schema.dead_letter.c
        with db.engine.connect() as conn:
            got = {
                r.dead_letter_id: r
                for r in conn.execute(sa.select(schema.dead_letter).order_by(d.id))
            }
        ids = {k: int(r.id) for k, r in got.items()}

        def state(key: str) -> tuple[Any, ...]:
            r = got[key]
            return (r.status, r.open_slot, r.seen_count, r.subject_key)

        assert state("d1") == ("RESOLVED", None, 1, "hotel:H1")
        assert state("d2") == ("MERGED", None, 1, "hotel:H1")
        assert state("d3") == ("MERGED", None, 1, "hotel:H1")
        assert state("d4") == ("MANUAL_FIX", 1, 3, "hotel:H1")  # the newest keeps the count
        assert got["d2"].fix_note == f"merged into dead letter #{ids['d4']}"
        assert state("d5") == ("MANUAL_FIX", 1, 1, "hotel:H1")
        assert state("d6") == ("MANUAL_FIX", 1, 1, "hotel:H2")
        assert state("d7") == ("MERGED", None, 1, "city:BKK")
        assert state("d8") == ("PENDING", 1, 2, "city:BKK")
        assert state("d9") == ("PENDING", 1, 1, "city:DAV")
        # Refused again with the same code: not a fix. With another code, the old problem
        # (the failed request) did go away.
        assert got["d10"].status == "MERGED"
        assert got["d12"].status == "RESOLVED"
        assert got["d4"].last_batch_id == "b4" and got["d4"].last_seen_at is not None

        # One open ticket per problem, from now on enforced by the database.
        dup = {k: v for k, v in got["d4"]._mapping.items() if k in {c.name for c in old.columns}}
        with pytest.raises(sa.exc.IntegrityError), db.begin() as conn:
            conn.execute(
                sa.insert(schema.dead_letter),
                {**dup, "dead_letter_id": "d99", "batch_id": "b99", "subject_key": "hotel:H1"}
                | {"open_slot": 1},
            )
        with db.engine.connect() as conn:
            summary = summarize(conn, db.clock)
        assert summary.by_status["MERGED"] == 4
        assert summary.open == 5
    finally:
        db.dispose()
