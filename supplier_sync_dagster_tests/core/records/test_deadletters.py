"""The dead-letter lifecycle: the rules table, the initial state, every guarded move and the
retry schedule, on SQLite and MariaDB."""

from __future__ import annotations

import random

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import DeadLetterStateError
from supplier_sync_dagster.core.records import deadletters
from supplier_sync_dagster.core.records.deadletters import (
    BACKOFF_SECONDS,
    JITTER,
    RULES,
    TRANSITIONS,
    DeadLetter,
    Rule,
    backoff_seconds,
    due_for_retry,
    fail_attempt,
    move,
    record_dead_letters,
    rule_for,
)
from supplier_sync_dagster.core.records.normalize import ERROR_CODES
from supplier_sync_dagster.core.records.quality import QUALITY_CODES
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.core.conftest import MakeBatch


def test_every_code_that_the_pipeline_writes_has_its_own_rule() -> None:
    missing = (set(ERROR_CODES) | set(QUALITY_CODES)) - set(RULES)
    assert not missing, f"codes without a rule: {sorted(missing)}"
    assert all(RULES[c].error_class == "NEEDS_PERSON" for c in QUALITY_CODES)
    assert RULES["COUNTRY_CITY_MISMATCH"].owner_team == "product-sync"
    # A supplier clock far ahead: the supplier corrects it (or a person fixes the record).
    assert RULES["FUTURE_TIMESTAMP"] == Rule("NEEDS_PERSON", "supplier-data")
    assert RULES["SUPPLIER_UNAVAILABLE"].error_class == "RETRYABLE"
    assert RULES["SUPPLIER_UNAVAILABLE"].max_retries == len(BACKOFF_SECONDS)
    assert rule_for("NEVER_SEEN").error_class == "NEEDS_PERSON"


def test_backoff_grows_with_bounded_jitter() -> None:
    rng = random.Random(7)
    for attempts, base in [
        (0, 60),
        (1, 300),
        (2, 1800),
        (3, 7200),
        (4, 43200),
        (5, 43200),
        (9, 43200),
    ]:
        waits = [backoff_seconds(attempts, rng=rng) for _ in range(200)]
        assert base * (1 - JITTER) <= min(waits) and max(waits) <= base * (1 + JITTER)
        assert max(waits) - min(waits) > base * JITTER / 2  # jitter spreads them


def _letter(hotel: str, code: str) -> DeadLetter:
    return DeadLetter(hotel, "ADAPTER", "NON_RETRYABLE", code, f"{code} on {hotel}", "ref", "h")


def _rows(db: SyncDatabase, batch_id: str) -> dict[str, sa.Row[tuple[object, ...]]]:
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        return {
            r.supplier_resource_code: r
            for r in conn.execute(sa.select(schema.dead_letter).where(d.batch_id == batch_id))
        }


@pytest.fixture
def letters(db: SyncDatabase, make_batch: MakeBatch) -> tuple[str, dict[str, int]]:
    batch = make_batch(["BKK"])
    with db.begin() as conn:
        record_dead_letters(
            conn,
            db.clock,
            batch_id=batch.batch_id,
            task_code=batch.task_code,
            sync_mode="FULL",
            supplier_id=1001,
            letters=[
                _letter("H1", "SUPPLIER_UNAVAILABLE"),
                _letter("H2", "SUPPLIER_UNAVAILABLE"),
                _letter("H3", "UNKNOWN_CURRENCY"),
                _letter("H4", "COUNTRY_CITY_MISMATCH"),
            ],
        )
    return batch.batch_id, {h: int(r.id) for h, r in _rows(db, batch.batch_id).items()}


def test_created_in_the_state_its_rule_says(
    db: SyncDatabase, letters: tuple[str, dict[str, int]]
) -> None:
    batch_id, _ = letters
    rows = _rows(db, batch_id)
    with db.engine.connect() as conn:
        now = db.clock.read(conn)
    h1 = rows["H1"]
    assert (h1.status, h1.owner_team, h1.max_retry_count, h1.retry_count) == (
        "PENDING",
        "sync-platform",
        5,
        0,
    )
    assert h1.next_retry_at is not None
    wait = (h1.next_retry_at - now).total_seconds()
    assert 60 * (1 - JITTER) - 5 <= wait <= 60 * (1 + JITTER)
    assert (rows["H3"].status, rows["H3"].owner_team, rows["H3"].next_retry_at) == (
        "MANUAL_FIX",
        "supplier-data",
        None,
    )
    assert (rows["H4"].status, rows["H4"].owner_team) == ("MANUAL_FIX", "product-sync")


def test_compensation_cycle_backs_off_then_exhausts_to_manual_fix(
    db: SyncDatabase, letters: tuple[str, dict[str, int]]
) -> None:
    batch_id, ids = letters
    with db.begin() as conn:
        assert due_for_retry(conn, db.clock) == []  # not due before the first backoff
    db.clock.advance(80)
    with db.begin() as conn:
        assert sorted(due_for_retry(conn, db.clock)) == sorted([ids["H1"], ids["H2"]])
    rng = random.Random(1)
    for attempt in range(1, 6):
        with db.begin() as conn:
            due = due_for_retry(conn, db.clock)
            assert ids["H1"] in due
            move(conn, db.clock, [ids["H1"]], "start_retry")
            assert ids["H1"] not in due_for_retry(conn, db.clock)  # RETRYING is not due
            rescheduled, exhausted = fail_attempt(
                conn, db.clock, [ids["H1"]], error_message=f"503 on attempt {attempt}", rng=rng
            )
        row = _rows(db, batch_id)["H1"]
        assert row.retry_count == attempt
        assert row.error_message == f"503 on attempt {attempt}"
        if attempt < 5:
            assert (rescheduled, exhausted, row.status) == (1, 0, "FAILED")
            with db.engine.connect() as conn:
                wait = (row.next_retry_at - db.clock.read(conn)).total_seconds()
            base = BACKOFF_SECONDS[attempt]  # after n attempts: the (n+1)th wait
            assert base * (1 - JITTER) - 5 <= wait <= base * (1 + JITTER)
            db.clock.advance(wait + 1)
        else:
            assert (rescheduled, exhausted, row.status, row.next_retry_at) == (
                0,
                1,
                "MANUAL_FIX",
                None,
            )
    # H2 succeeds on its first attempt.
    with db.begin() as conn:
        move(conn, db.clock, [ids["H2"]], "start_retry")
        move(conn, db.clock, [ids["H2"]], "resolve", fix_note="published on retry")
    h2 = _rows(db, batch_id)["H2"]
    assert (h2.status, h2.retry_count, h2.fix_note) == ("RESOLVED", 1, "published on retry")
    assert h2.resolved_at is not None and h2.last_retry_at is not None


def test_every_move_is_guarded(db: SyncDatabase, letters: tuple[str, dict[str, int]]) -> None:
    batch_id, ids = letters
    with db.begin() as conn:
        move(conn, db.clock, [ids["H3"]], "ignore", fix_note="supplier retired this hotel")
    for transition, (sources, _) in TRANSITIONS.items():
        if "IGNORED" not in sources:
            with pytest.raises(DeadLetterStateError, match=transition), db.begin() as conn:
                move(conn, db.clock, [ids["H3"]], transition)
    # A move of several rows is all or nothing: one wrong row rolls the others back.
    with pytest.raises(DeadLetterStateError), db.begin() as conn:
        move(conn, db.clock, [ids["H1"], ids["H4"]], "start_retry")
    assert _rows(db, batch_id)["H1"].status == "PENDING"
    with pytest.raises(DeadLetterStateError, match="do not exist"), db.begin() as conn:
        move(conn, db.clock, [10**12], "resolve")
    # An operator re-queues a MANUAL_FIX row; it becomes due when they say.
    with db.begin() as conn:
        move(conn, db.clock, [ids["H4"]], "requeue", next_retry_at=db.clock.now())
        assert ids["H4"] not in due_for_retry(conn, db.clock)  # budget 0: needs a raise
        conn.execute(
            sa.update(schema.dead_letter)
            .where(schema.dead_letter.c.id == ids["H4"])
            .values(max_retry_count=1)
        )
        assert ids["H4"] in due_for_retry(conn, db.clock)
    assert _rows(db, batch_id)["H3"].status == "IGNORED"


def test_recording_again_keeps_the_lifecycle(
    db: SyncDatabase, letters: tuple[str, dict[str, int]]
) -> None:
    batch_id, ids = letters
    with db.begin() as conn:
        move(conn, db.clock, [ids["H1"]], "start_retry")
        d = schema.dead_letter.c
        row = conn.execute(sa.select(schema.dead_letter).where(d.id == ids["H1"])).one()
        record_dead_letters(
            conn,
            db.clock,
            batch_id=batch_id,
            task_code=row.task_code,
            sync_mode="FULL",
            supplier_id=1001,
            letters=[_letter("H1", "SUPPLIER_UNAVAILABLE")],
        )
    assert _rows(db, batch_id)["H1"].status == "RETRYING"
    assert deadletters.OPEN_STATUSES == ("PENDING", "RETRYING", "FAILED", "MANUAL_FIX")
