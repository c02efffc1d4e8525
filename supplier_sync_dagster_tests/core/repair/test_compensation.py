"""Compensation of retryable dead letters against a detail endpoint served by a
MockTransport (SQLite and MariaDB): each way a claimed row can end, the backoff, the
supplier's bytes kept, and a killed run resumed. The simulator over real HTTP is in
``integration/test_dead_letters_heal.py``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import (
    TaskSpec,
    cancel_batch,
    create_batch,
    upsert_task,
)
from supplier_sync_dagster.core.leasing.leases import LeaseSettings
from supplier_sync_dagster.core.records.deadletters import (
    BACKOFF_SECONDS,
    OPEN_STATUSES,
    DeadLetter,
    operator_action,
    record_city_failure,
    record_dead_letters,
    summarize,
)
from supplier_sync_dagster.core.repair.compensation import (
    COMPENSATION_SHARD,
    CompensationSettings,
    compensate,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.supplier import RetryPolicy, SupplierClient
from supplier_sync_dagster.core.supplier.models import page_records
from supplier_sync_dagster.core.sync.model import SyncSettings
from supplier_sync_dagster_tests.core.repair.test_incremental import hotel

SETTINGS = SyncSettings(
    task_code="full_task",
    supplier_id=1001,
    lease=LeaseSettings(lease_seconds=30, heartbeat_seconds=5),
)
COMP = CompensationSettings(task_code="comp_task", full_task_code="full_task", page_hotels=3)


class Details:
    """``GET /v1/hotels/{id}``: known records, hotels that fail (503), a kill switch."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self.failing: set[str] = set()
        self.requests: list[str] = []
        self.kill_after: int | None = None
        self.wrap = False

    def handle(self, request: httpx.Request) -> httpx.Response:
        hotel_id = request.url.path.rsplit("/", 1)[-1]
        if self.kill_after is not None and len(self.requests) >= self.kill_after:
            raise KeyboardInterrupt("killed mid-compensation")
        self.requests.append(hotel_id)
        if hotel_id in self.failing:
            return httpx.Response(503, json={"error": {"code": "UNAVAILABLE"}})
        if hotel_id not in self.records:
            return httpx.Response(404, json={"error": {"code": "HOTEL_NOT_FOUND"}})
        record = self.records[hotel_id]
        return httpx.Response(200, json={"hotel": record} if self.wrap else record)


@pytest.fixture
def details() -> Details:
    return Details()


@pytest.fixture
def client(details: Details) -> Iterator[SupplierClient]:
    with httpx.Client(
        base_url="http://supplier", transport=httpx.MockTransport(details.handle)
    ) as http:
        yield SupplierClient(
            http,
            api_key="k",
            supplier_id="fake",
            retry=RetryPolicy(max_attempts=2, base_delay=0.0, max_delay=0.0),
            sleep=lambda _: None,
        )


@pytest.fixture
def store(tmp_path: Path) -> LocalPayloadStore:
    return LocalPayloadStore(tmp_path / "payloads")


@pytest.fixture
def source_batch(db: SyncDatabase) -> str:
    """A batch of the full task whose dead letters compensation takes."""
    upsert_task(db, TaskSpec(task_code="full_task", supplier_id=1001))
    decision = create_batch(
        db, task_code="full_task", trigger_id="source", trigger_source="MANUAL", shard_keys=["BKK"]
    )
    assert decision.batch is not None
    return decision.batch.batch_id


def _fail(db: SyncDatabase, batch_id: str, hotels: list[str], code: str = "SUPPLIER_UNAVAILABLE"):
    with db.begin() as conn:
        record_dead_letters(
            conn,
            db.clock,
            batch_id=batch_id,
            task_code="full_task",
            sync_mode="FULL",
            supplier_id=1001,
            letters=[
                DeadLetter(
                    h,
                    "ADAPTER",
                    "RETRYABLE",
                    code,
                    f"503 on {h}",
                    None,
                    None,
                    record_position="confirm_missing",
                    city_code="BKK",
                )
                for h in hotels
            ],
        )


def _letters(db: SyncDatabase) -> dict[tuple[str, str], Any]:
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        return {
            (r.supplier_resource_code, r.batch_id): r
            for r in conn.execute(sa.select(schema.dead_letter).order_by(d.id))
        }


def _by_hotel(db: SyncDatabase, batch_id: str) -> dict[str, Any]:
    return {h: r for (h, b), r in _letters(db).items() if b == batch_id}


def _published(db: SyncDatabase) -> dict[str, tuple[int, str]]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return {
            r.supplier_hotel_id: (r.supplier_version, r.status)
            for r in conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version, h.status))
        }


def _run(db, store, client, trigger: str, comp: CompensationSettings = COMP):
    return compensate(
        db,
        store,
        client,
        settings=SETTINGS,
        compensation=comp,
        trigger_id=trigger,
        source="MANUAL",
        worker_id=f"worker-{trigger}",
    )


def _due(db: SyncDatabase) -> None:
    """Moves the database clock past the longest first wait (backoff plus jitter)."""
    db.clock.advance(BACKOFF_SECONDS[0] * 1.3)


def test_nothing_due_makes_no_batch(db, store, client, details, source_batch):
    _fail(db, source_batch, ["H000001"])
    details.records["H000001"] = hotel(1, at=0)
    out = _run(db, store, client, "early")  # due only after the first backoff
    assert out.batch is None and out.claimed == 0 and details.requests == []
    assert _by_hotel(db, source_batch)["H000001"].status == "PENDING"


def test_due_rows_are_refetched_published_and_resolved_with_the_suppliers_bytes(
    db, store, client, details, source_batch
):
    hotels = [f"H{n:06d}" for n in range(1, 8)]
    for n, h in enumerate(hotels, start=1):
        details.records[h] = hotel(n, at=n)
    details.wrap = True  # a supplier that wraps its detail: {"hotel": {...}}
    _fail(db, source_batch, hotels)
    _due(db)
    out = _run(db, store, client, "c1")
    assert out.batch is not None and out.batch.status == "SUCCESS", out
    assert (out.claimed, out.resolved, out.rescheduled, out.gone) == (7, 7, 0, 0)
    assert sorted(details.requests) == hotels  # one detail request per hotel
    assert set(_published(db)) == set(hotels)
    for r in _by_hotel(db, source_batch).values():
        assert r.status == "RESOLVED" and r.retry_count == 1 and r.resolved_at is not None
        assert r.retry_batch_id == out.batch.batch_id
        assert "published" in r.fix_note and "AUTO_PUBLISH" in r.fix_note
    # The pages are the supplier's responses, byte for byte, and replay reads them back.
    s = schema.snapshot.c
    with db.engine.connect() as conn:
        pages = conn.execute(
            sa.select(s.payload_ref, s.payload_hash, s.record_count).where(
                s.batch_id == out.batch.batch_id,
                s.shard_key == COMPENSATION_SHARD,
                s.snapshot_type == "RAW",
            )
        ).all()
    assert [p.record_count for p in pages] == [3, 3, 1]
    for p in pages:
        body = store.get(p.payload_ref)
        assert hashlib.sha256(body).hexdigest() == p.payload_hash
        records = page_records(json.loads(body))
        assert all(r == details.records[r["hotel_id"]] for r in records)


def test_a_failed_refetch_backs_off_and_goes_to_manual_fix_past_its_retries(
    db, store, client, details, source_batch
):
    details.records["H000001"] = hotel(1, at=0)
    details.failing.add("H000001")
    _fail(db, source_batch, ["H000001"])
    waits = []
    for attempt in range(1, len(BACKOFF_SECONDS) + 1):
        db.clock.advance(BACKOFF_SECONDS[min(attempt - 1, len(BACKOFF_SECONDS) - 1)] * 1.3)
        out = _run(db, store, client, f"try{attempt}")
        row = _by_hotel(db, source_batch)["H000001"]
        assert row.retry_count == attempt, (attempt, row)
        if attempt < len(BACKOFF_SECONDS):
            assert row.status == "FAILED" and out.rescheduled == 1
            assert row.error_message.startswith("SUPPLIER_UNAVAILABLE")
            with db.engine.connect() as conn:
                now = db.clock.read(conn)
            waits.append((row.next_retry_at - now).total_seconds())
        else:
            assert row.status == "MANUAL_FIX" and out.exhausted == 1
            assert row.next_retry_at is None
    # The waits grow as the schedule says (within the jitter).
    for wait, base in zip(waits, BACKOFF_SECONDS[1:], strict=False):
        assert base * 0.79 <= wait <= base * 1.21, waits
    assert _published(db) == {}


def test_a_refetch_that_heals_after_a_failure_resolves(db, store, client, details, source_batch):
    details.records["H000001"] = hotel(1, at=0)
    details.failing.add("H000001")
    _fail(db, source_batch, ["H000001"])
    _due(db)
    assert _run(db, store, client, "t1").rescheduled == 1
    details.failing.clear()
    db.clock.advance(BACKOFF_SECONDS[1] * 1.3)
    out = _run(db, store, client, "t2")
    assert out.resolved == 1
    row = _by_hotel(db, source_batch)["H000001"]
    assert (row.status, row.retry_count) == ("RESOLVED", 2)
    assert "H000001" in _published(db)


def test_a_hotel_the_supplier_no_longer_has_is_resolved_and_unpublished(
    db, store, client, details, source_batch
):
    details.records["H000001"] = hotel(1, at=0)
    _fail(db, source_batch, ["H000001"])
    _due(db)
    _run(db, store, client, "publish-first")
    assert _published(db)["H000001"][1] == "ACTIVE"
    del details.records["H000001"]
    _fail(db, "later-batch", ["H000001"])  # its city stops listing it, and the check fails
    _due(db)
    out = _run(db, store, client, "gone")
    assert out.gone == 1
    row = _by_hotel(db, "later-batch")["H000001"]
    assert row.status == "RESOLVED" and "404" in row.fix_note


def test_a_publish_of_the_hotel_resolves_its_other_tickets_without_a_request(
    db, store, client, details, source_batch
):
    details.records["H000001"] = hotel(1, at=0)
    _fail(db, "b-first", ["H000001"])
    _fail(db, "b-second", ["H000001"])  # the same problem again: the same ticket
    _fail(db, "b-second", ["H000001"], code="SUPPLIER_RATE_LIMITED")  # another problem
    d = schema.dead_letter.c
    with db.begin() as conn:  # the rate-limited ticket waits while the other one publishes
        conn.execute(
            sa.update(schema.dead_letter)
            .where(d.error_code == "SUPPLIER_RATE_LIMITED")
            .values(next_retry_at=db.clock.now(86_400))
        )
    with db.engine.connect() as conn:
        rows = conn.execute(sa.select(schema.dead_letter).order_by(d.id)).all()
    assert [(r.batch_id, r.error_code, r.seen_count) for r in rows] == [
        ("b-first", "SUPPLIER_UNAVAILABLE", 2),
        ("b-second", "SUPPLIER_RATE_LIMITED", 1),
    ]
    _due(db)
    first = _run(db, store, client, "c1")
    assert (first.claimed, first.resolved) == (1, 1)
    assert set(_published(db)) == {"H000001"}
    with db.engine.connect() as conn:
        limited = conn.execute(
            sa.select(schema.dead_letter).where(d.error_code == "SUPPLIER_RATE_LIMITED")
        ).one()
    assert limited.status == "RESOLVED" and "published" in limited.fix_note
    assert limited.retry_count == 0  # no attempt was needed
    details.requests.clear()
    with db.begin() as conn:
        conn.execute(sa.update(schema.dead_letter).values(next_retry_at=db.clock.now()))
    out = _run(db, store, client, "c2")
    assert out.batch is None and details.requests == []  # nothing is open any more


def test_a_record_that_now_fails_validation_is_superseded_by_a_manual_fix_letter(
    db, store, client, details, source_batch
):
    details.records["H000001"] = hotel(1, at=0, phone="call us")
    _fail(db, source_batch, ["H000001"])
    _due(db)
    out = _run(db, store, client, "c1")
    assert out.refused_again == 1 and out.resolved == 0
    old = _by_hotel(db, source_batch)["H000001"]
    new = _by_hotel(db, out.batch.batch_id)["H000001"]
    # The request works now, but the record has another problem: not a fix.
    assert old.status == "MERGED" and f"#{new.id}" in old.fix_note
    assert new.status == "MANUAL_FIX" and new.owner_team == "supplier-data"
    assert new.error_code in old.fix_note
    assert _published(db) == {}  # nothing is published that failed a check


def test_a_retried_record_that_is_still_bad_keeps_its_one_ticket_open(
    db, store, client, details, source_batch
):
    details.records["H000001"] = hotel(1, at=0, phone="call us")
    _fail(db, source_batch, ["H000001"])
    _due(db)
    new = _by_hotel(db, _run(db, store, client, "c1").batch.batch_id)["H000001"]
    # An operator asks for a retry; the supplier still serves the same bad record.
    with db.begin() as conn:
        operator_action(conn, db.clock, [new.id], "retry", actor="ops", reason="supplier fixed it?")
    again = _run(db, store, client, "c2")
    assert (again.claimed, again.resolved, again.refused_again) == (1, 0, 1)
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        open_rows = conn.execute(
            sa.select(schema.dead_letter).where(
                d.supplier_resource_code == "H000001", d.status.in_(OPEN_STATUSES)
            )
        ).all()
        summary = summarize(conn, db.clock)
    assert [r.id for r in open_rows] == [new.id]  # no second ticket
    ticket = open_rows[0]
    assert ticket.status == "MANUAL_FIX" and ticket.retry_count == 1  # the attempt counted
    assert ticket.seen_count == 2 and ticket.last_batch_id == again.batch.batch_id
    # Nothing was fixed: a merged ticket and a retry still refused are not resolutions.
    assert summary.resolved_24h == 0 and summary.fix_rate_24h == 0.0
    assert _published(db) == {}


def test_a_killed_run_is_resumed_by_the_next_and_publishes_nothing_twice(
    db, store, client, details, source_batch
):
    hotels = [f"H{n:06d}" for n in range(1, 8)]
    for n, h in enumerate(hotels, start=1):
        details.records[h] = hotel(n, at=n)
    _fail(db, source_batch, hotels)
    _due(db)
    details.kill_after = 4  # the second page dies
    with pytest.raises(KeyboardInterrupt):
        _run(db, store, client, "killed")
    assert {r.status for r in _by_hotel(db, source_batch).values()} == {"RETRYING"}
    details.kill_after = None
    db.clock.advance(SETTINGS.lease.lease_seconds * 3)  # the dead worker's lease expires
    asked_before = len(details.requests)
    out = _run(db, store, client, "next")
    assert out.batch is not None and out.batch.status == "SUCCESS"
    assert out.claimed == 7 and out.resolved == 7
    assert len(details.requests) - asked_before == 4  # from the checkpoint: page 2 on
    assert {r.status for r in _by_hotel(db, source_batch).values()} == {"RESOLVED"}
    o = schema.outbox.c
    with db.engine.connect() as conn:
        events = conn.execute(sa.select(sa.func.count()).select_from(schema.outbox)).scalar()
        per_hotel = conn.execute(
            sa.select(o.aggregate_id, sa.func.count()).group_by(o.aggregate_id)
        ).all()
    assert events and all(n == events / len(per_hotel) for _, n in per_hotel)


def test_rows_of_a_batch_that_ended_without_them_are_released(
    db, store, client, details, source_batch
):
    details.records["H000001"] = hotel(1, at=0)
    _fail(db, source_batch, ["H000001"])
    _due(db)
    details.kill_after = 0
    with pytest.raises(KeyboardInterrupt):
        _run(db, store, client, "killed")
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        batch_id = conn.execute(sa.select(d.retry_batch_id)).scalar_one()
    cancel_batch(db, batch_id, "an operator cancelled it")
    details.kill_after = None
    out = _run(db, store, client, "after-cancel")
    assert out.released == 1 and out.resolved == 1
    assert _by_hotel(db, source_batch)["H000001"].status == "RESOLVED"


def test_a_failed_city_is_handed_back_for_a_resync_and_resolved_once_it_synced(
    db, store, client, details, source_batch
):
    record_city_failure(
        db,
        batch_id=source_batch,
        task_code="full_task",
        sync_mode="FULL",
        supplier_id=1001,
        city_code="BKK",
        error="SupplierUnavailable: 503 beyond retries",
    )
    record_city_failure(  # the same failure recorded again: one ticket
        db,
        batch_id=source_batch,
        task_code="full_task",
        sync_mode="FULL",
        supplier_id=1001,
        city_code="BKK",
        error="SupplierUnavailable: 503 beyond retries",
    )
    (ticket,) = _letters(db).values()
    assert (ticket.status, ticket.error_code, ticket.city_code) == ("PENDING", "CITY_FAILED", "BKK")
    _due(db)
    out = _run(db, store, client, "c1")
    assert out.resync_cities == ["BKK"] and out.batch is None and details.requests == []
    row = _by_hotel(db, source_batch)["-"]
    assert (row.status, row.retry_count) == ("FAILED", 1)
    assert row.error_message.startswith("the city's sync stopped")  # kept
    assert _run(db, store, client, "c2").resync_cities == []  # not due again yet
    # A later sync of the task finishes the city.
    cancel_batch(db, source_batch, "the night's batch ended with the city failed")
    later = create_batch(
        db, task_code="full_task", trigger_id="next-night", trigger_source="CRON",
        shard_keys=["BKK"],
    )  # fmt: skip
    assert later.batch is not None
    sh = schema.shard.c
    with db.begin() as conn:
        conn.execute(
            sa.update(schema.shard)
            .where(sh.batch_id == later.batch.batch_id)
            .values(status="SUCCESS", finished_at=db.clock.now(1))
        )
    db.clock.advance(2)
    out = _run(db, store, client, "c3")
    assert out.cities_synced == 1
    row = _by_hotel(db, source_batch)["-"]
    assert row.status == "RESOLVED" and later.batch.batch_id in row.fix_note


def test_an_account_heals_only_its_own_dead_letters(db, store, client, details):
    """Two accounts of one supplier: each compensation claims its account's rows only."""
    batches = {}
    for account in ("eu", "us"):
        upsert_task(db, TaskSpec(task_code=f"acme.{account}.full", supplier_id=1001))
        decision = create_batch(
            db,
            task_code=f"acme.{account}.full",
            trigger_id=f"source-{account}",
            trigger_source="MANUAL",
            shard_keys=["BKK"],
        )
        assert decision.batch is not None
        batches[account] = decision.batch.batch_id
    hotels = {"eu": ["H000001", "H000002", "H000003"], "us": ["H000004", "H000005"]}
    for n, h in enumerate(hotels["eu"] + hotels["us"], start=1):
        details.records[h] = hotel(n, at=n)
    with db.begin() as conn:
        for account, ids in hotels.items():
            record_dead_letters(
                conn,
                db.clock,
                batch_id=batches[account],
                task_code=f"acme.{account}.full",
                sync_mode="FULL",
                supplier_id=1001,
                letters=[
                    DeadLetter(h, "ADAPTER", "RETRYABLE", "SUPPLIER_UNAVAILABLE", "503", None, None)
                    for h in ids
                ],
            )
    _due(db)
    eu = CompensationSettings(
        task_code="acme.eu.compensation",
        full_task_code="acme.eu.full",
        owned_tasks=("acme.eu.full", "acme.eu.incremental", "acme.eu.compensation"),
    )
    out = _run(db, store, client, "c-eu", eu)
    assert out.batch is not None and out.batch.status == "SUCCESS"
    assert (out.claimed, out.resolved) == (3, 3)
    assert sorted(details.requests) == hotels["eu"]
    for h, r in _by_hotel(db, batches["eu"]).items():
        assert r.status == "RESOLVED" and r.retry_batch_id == out.batch.batch_id, h
    for h, r in _by_hotel(db, batches["us"]).items():
        assert r.status == "PENDING" and r.retry_batch_id is None, h
    # Without an owner (one account per supplier) a compensation takes the supplier's rows.
    out = _run(db, store, client, "c-all")
    assert out.claimed == 2 and sorted(details.requests) == sorted(hotels["eu"] + hotels["us"])
