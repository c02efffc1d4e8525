"""The shard loop: resume, failure, lost lease and interruption, each with what it leaves behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core import schema as t
from supplier_sync_dagster.core.db import DbClock, SyncDatabase, insert_ignore
from supplier_sync_dagster.core.errors import InvalidTransition
from supplier_sync_dagster.core.leases import (
    Checkpoint,
    LeaseSettings,
    PageCounts,
    claim_shard,
    get_shard,
    reopen_shard,
)
from supplier_sync_dagster.core.worker import FetchedPage, run_shard
from supplier_sync_dagster_tests.core.conftest import MakeBatch

SETTINGS = LeaseSettings(lease_seconds=30, heartbeat_seconds=0.5)
PAGES = 6


def source_for(city: str, seen: list[int]):
    def source(start: Checkpoint) -> Iterator[FetchedPage]:
        for n in range(start.page, PAGES + 1):
            seen.append(n)
            yield FetchedPage(n, Checkpoint(city, page=n + 1), PAGES, f"{city}:{n}".encode(), [n])

    return source


def handler(db: SyncDatabase, batch_id: str, fail_on: int | None = None):
    def handle(conn: Connection, page: FetchedPage) -> PageCounts:
        insert_ignore(
            conn,
            t.snapshot,
            [
                {
                    "snapshot_id": f"{batch_id[:40]}-{page.number}",
                    "batch_id": batch_id,
                    "supplier_id": 1,
                    "category_code": "HOTEL",
                    "snapshot_type": "RAW",
                    "snapshot_version": 1,
                    "payload_hash": "0" * 64,
                }
            ],
            created_at=db.clock.now(),
        )
        if page.number == fail_on:
            raise RuntimeError(f"supplier exploded on page {page.number}")
        return PageCounts(success=10, failed=1, skipped=2)

    return handle


def stored_pages(db: SyncDatabase, batch_id: str) -> int:
    with db.engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count())
                .select_from(t.snapshot)
                .where(t.snapshot.c.batch_id == batch_id)
            ).scalar_one()
        )


def test_failure_marks_shard_failed_and_reopen_resumes_from_checkpoint(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK"])
    seen: list[int] = []
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=SETTINGS)
    with pytest.raises(RuntimeError, match="page 4"):
        run_shard(lease, source_for("BKK", seen), handler(db, batch.batch_id, fail_on=4))
    info = get_shard(db, batch.batch_id, "BKK")
    assert info.status == "FAILED" and "page 4" in (info.error_message or "")
    assert info.checkpoint == Checkpoint("BKK", page=4) and info.pages_done == 3
    assert stored_pages(db, batch.batch_id) == 3  # page 4's data rolled back with it

    after = reopen_shard(db, batch.batch_id, "BKK", "supplier fixed")
    assert after.status == "RUNNING" and after.finished_at is None
    with pytest.raises(InvalidTransition):
        reopen_shard(db, batch.batch_id, "BKK", "again")
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=SETTINGS)
    outcome = run_shard(lease, source_for("BKK", seen), handler(db, batch.batch_id))
    assert outcome.status == "SUCCESS" and outcome.resumed_from == Checkpoint("BKK", page=4)
    assert seen == [1, 2, 3, 4, 4, 5, 6]
    assert outcome.batch is not None and outcome.batch.status == "SUCCESS"
    assert stored_pages(db, batch.batch_id) == PAGES
    info = get_shard(db, batch.batch_id, "BKK")
    assert (
        info.total_count
        == PAGES * 13
        == info.success_count + info.failed_count + info.skipped_count
    )


def test_lost_lease_stops_the_loop_and_writes_nothing_more(db: SyncDatabase, make_batch: MakeBatch):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=SETTINGS)
    # The other worker's own clock is past the lease; w1's heartbeat thread keeps its own.
    other = SyncDatabase(engine=db.engine, clock=DbClock(SETTINGS.lease_seconds + 1))

    def source(start: Checkpoint) -> Iterator[FetchedPage]:
        for n in range(start.page, PAGES + 1):
            if n == 3:  # meanwhile the lease expired and another worker took over
                claim_shard(other, batch.batch_id, "BKK", worker_id="w2", settings=SETTINGS)
            yield FetchedPage(n, Checkpoint("BKK", page=n + 1), PAGES, b"", [])

    outcome = run_shard(lease, source, handler(db, batch.batch_id))
    assert outcome.status == "LEASE_LOST" and outcome.pages == 2
    assert stored_pages(db, batch.batch_id) == 2
    info = get_shard(db, batch.batch_id, "BKK")
    assert info.worker_id == "w2" and info.status == "RUNNING" and info.pages_done == 2


def test_interrupt_releases_the_lease_for_an_immediate_resume(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=SETTINGS)

    def source(start: Checkpoint) -> Iterator[FetchedPage]:
        for n in range(start.page, PAGES + 1):
            if n == 3:
                raise KeyboardInterrupt  # the run was terminated
            yield FetchedPage(n, Checkpoint("BKK", page=n + 1), PAGES, b"", [])

    with pytest.raises(KeyboardInterrupt):
        run_shard(lease, source, handler(db, batch.batch_id))
    info = get_shard(db, batch.batch_id, "BKK")
    assert info.status == "PENDING" and info.checkpoint == Checkpoint("BKK", page=3)
    again = claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=SETTINGS)
    assert again.checkpoint == Checkpoint("BKK", page=3)
