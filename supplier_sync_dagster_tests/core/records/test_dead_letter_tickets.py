"""One open ticket per problem (supplier, subject, code): recording is an upsert, closing frees
the slot, a newer version of the record with another problem supersedes, a publish resolves, a
tombstone closes without counting a fix; on SQLite and MariaDB."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from supplier_sync_dagster.core.records import deadletters
from supplier_sync_dagster.core.records.deadletters import (
    DeadLetter,
    hotel_subject,
    record_dead_letters,
    resolve_subjects,
    subject_key,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase


def _bad(hotel: str, code: str = "INVALID_PHONE", *, version: int | None = 1, n: int = 0):
    return DeadLetter(
        hotel,
        "VALIDATION",
        "NON_RETRYABLE",
        code,
        f"{code} #{n}",
        f"raw/{n}",
        f"{n:064d}",
        record_position=f"record#{n}",
        city_code="BKK",
        record_version=version,
    )


def _record(db: SyncDatabase, batch_id: str, *letters: DeadLetter) -> None:
    with db.begin() as conn:
        record_dead_letters(
            conn,
            db.clock,
            batch_id=batch_id,
            task_code="t",
            sync_mode="FULL",
            supplier_id=1001,
            letters=list(letters),
        )


def _tickets(db: SyncDatabase) -> list[Any]:
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        return list(conn.execute(sa.select(schema.dead_letter).order_by(d.id)).all())


def test_a_problem_seen_by_three_syncs_is_one_ticket_with_its_latest_sight(
    db: SyncDatabase,
) -> None:
    for n, batch in enumerate(("b1", "b2", "b3")):
        _record(db, batch, _bad("H1", n=n), _bad("H2", n=10 + n))
    _record(db, "b3", _bad("H1", n=2))  # the same batch again (a resume): not another sight
    rows = _tickets(db)
    assert [(r.supplier_resource_code, r.seen_count) for r in rows] == [("H1", 3), ("H2", 3)]
    h1 = rows[0]
    assert (h1.batch_id, h1.last_batch_id, h1.raw_payload_ref) == ("b1", "b3", "raw/2")
    assert h1.error_message == "INVALID_PHONE #2" and h1.open_slot == 1
    assert h1.last_seen_at >= h1.created_at
    assert h1.status == "MANUAL_FIX"


def test_a_closed_ticket_frees_the_slot_and_another_problem_has_its_own(
    db: SyncDatabase,
) -> None:
    _record(db, "b1", _bad("H1"), _bad("H1", "HTML_IN_NAME", n=1))
    first, other = _tickets(db)
    assert first.id != other.id  # two problems of one hotel, two tickets
    with db.begin() as conn:
        deadletters.move(conn, db.clock, [first.id], "ignore", fix_note="closed for good")
    _record(db, "b2", _bad("H1"))
    rows = {r.id: r for r in _tickets(db)}
    assert (rows[first.id].status, rows[first.id].open_slot) == ("IGNORED", None)
    reopened = max(rows)
    assert reopened not in (first.id, other.id)
    assert (rows[reopened].status, rows[reopened].seen_count) == ("MANUAL_FIX", 1)


def test_a_newer_version_with_another_problem_supersedes_the_older_ticket(
    db: SyncDatabase,
) -> None:
    _record(db, "b1", _bad("H1", version=1))
    _record(db, "b2", _bad("H1", "HTML_IN_NAME", version=2, n=1))
    old, new = _tickets(db)
    assert old.status == "MERGED" and "version 2" in old.fix_note
    assert new.status == "MANUAL_FIX" and new.open_slot == 1
    # The same version failing another way (two checks of one record) supersedes nothing.
    _record(db, "b3", _bad("H1", "UNKNOWN_STATUS", version=2, n=2))
    assert [r.status for r in _tickets(db)] == ["MERGED", "MANUAL_FIX", "MANUAL_FIX"]
    with db.engine.connect() as conn:
        assert deadletters.summarize(conn, db.clock).resolved_24h == 0  # no fix happened


def test_a_publish_resolves_every_open_ticket_of_the_hotel_whatever_its_class(
    db: SyncDatabase,
) -> None:
    unavailable = DeadLetter(
        "H1", "ADAPTER", "RETRYABLE", "SUPPLIER_UNAVAILABLE", "503", None, None
    )
    _record(db, "b1", _bad("H1"), unavailable, _bad("H2", n=1))
    with db.begin() as conn:
        done = resolve_subjects(
            conn,
            db.clock,
            supplier_id=1001,
            subjects=[hotel_subject("H1")],
            batch_id="b2",
            note="published by b2",
        )
    assert done == 2
    assert [(r.supplier_resource_code, r.status) for r in _tickets(db)] == [
        ("H1", "RESOLVED"),
        ("H1", "RESOLVED"),
        ("H2", "MANUAL_FIX"),
    ]
    # A batch that saw the problem itself (a newer version, still bad) does not resolve it
    # by publishing another record.
    _record(db, "b3", _bad("H1", version=2))
    with db.begin() as conn:
        kept = resolve_subjects(
            conn, db.clock, supplier_id=1001, subjects=["hotel:H1"], batch_id="b3", note="x"
        )
    assert kept == 0
    with db.engine.connect() as conn:
        summary = deadletters.summarize(conn, db.clock)
    assert (summary.created_24h, summary.resolved_24h) == (4, 2)


def test_a_gone_hotel_closes_its_ticket_without_counting_a_fix(db: SyncDatabase) -> None:
    _record(db, "b1", _bad("H1"))
    _record(db, "b2", _bad("H1"))
    with db.begin() as conn:
        closed = resolve_subjects(
            conn,
            db.clock,
            supplier_id=1001,
            subjects=[hotel_subject("H1")],
            batch_id="b3",
            note="the hotel is gone",
            gone=True,
        )
    assert closed == 1
    (ticket,) = _tickets(db)
    assert (ticket.status, ticket.seen_count, ticket.open_slot) == ("IGNORED", 2, None)
    with db.engine.connect() as conn:
        assert deadletters.summarize(conn, db.clock).resolved_24h == 0  # nothing was fixed


def test_subjects() -> None:
    assert subject_key(_bad("H1")) == "hotel:H1"
    city = DeadLetter(None, "ADAPTER", "RETRYABLE", "CITY_FAILED", "x", None, None, city_code="BKK")
    assert subject_key(city) == "city:BKK"
    unreadable = _bad("-", n=3)
    assert subject_key(unreadable) == f"record:{3:064d}#record#3"


def test_the_bad_version_an_operator_fixed_seen_again_counts_on_its_resolved_ticket(
    db: SyncDatabase,
) -> None:
    """The supplier keeps serving the version a fix published: the same problem, fixed, not a
    new ticket; a newer version that is still bad is a new problem."""
    _record(db, "b1", _bad("H1", version=7))
    with db.begin() as conn:
        resolve_subjects(
            conn,
            db.clock,
            supplier_id=1001,
            subjects=[hotel_subject("H1")],
            batch_id="fix",
            note="an operator's fix published",
        )
    _record(db, "b2", _bad("H1", version=7))
    (ticket,) = _tickets(db)
    assert (ticket.status, ticket.seen_count, ticket.last_batch_id) == ("RESOLVED", 2, "b2")
    # An unreadable version is never taken for the fixed one: a new ticket, which the
    # newer bad version then updates (one open ticket per problem).
    _record(db, "b3", _bad("H1", version=None))
    _record(db, "b4", _bad("H1", version=8))
    assert [(t.status, t.record_version, t.seen_count) for t in _tickets(db)] == [
        ("RESOLVED", 7, 2),
        ("MANUAL_FIX", 8, 2),
    ]
