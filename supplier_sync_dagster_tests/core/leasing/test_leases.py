"""Shard leases: one writer per shard, fencing, reclaim, checkpoints, heartbeats, stalls; the
shard state machine's table of moves; the lease lifecycle of a shard's work (resume, failure,
lost lease and interruption, each with what it leaves behind)."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import subprocess
import sys
import threading
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import Any, get_args

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import (
    ConfigError,
    InvalidCheckpoint,
    InvalidTransition,
    LeaseLost,
    LeaseNotAcquired,
    UnknownShard,
)
from supplier_sync_dagster.core.leasing import batches
from supplier_sync_dagster.core.leasing.batches import Batch, cancel_batch, get_batch
from supplier_sync_dagster.core.leasing.leases import (
    Checkpoint,
    HeartbeatRunner,
    LeaseSettings,
    PageCounts,
    ShardWork,
    claim_next_shard,
    claim_shard,
    find_stalls,
    get_shard,
    holder_is_dead_here,
    list_shards,
    make_worker_id,
    reopen_shard,
)
from supplier_sync_dagster.core.leasing.shards import (
    SHARD_MOVES,
    ShardStatus,
    move_shards,
    sources_of,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import DbClock, SyncDatabase, insert_ignore
from supplier_sync_dagster_tests.core.conftest import MakeBatch, run_concurrently
from supplier_sync_dagster_tests.core.sync.page_loop import FetchedPage, run_shard
from supplier_sync_dagster_tests.helpers import HOSTILE_CITY_CODES

FAST = LeaseSettings(lease_seconds=30, heartbeat_seconds=0.05)
RACES = 50


def _shard_row(db: SyncDatabase, batch_id: str, key: str) -> dict[str, Any]:
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.select(schema.shard).where(
                schema.shard.c.batch_id == batch_id, schema.shard.c.shard_key == key
            )
        ).one()
    return dict(row._mapping)


# ---------------------------------------------------------------- claim races


def test_threads_race_for_one_shard_exactly_one_wins(db: SyncDatabase, make_batch: MakeBatch):
    n_threads = 8
    for race in range(RACES):
        batch = make_batch(["RACE"])
        won, errors = run_concurrently(
            n_threads,
            lambda i, b=batch.batch_id: (
                claim_shard(  # type: ignore[misc]
                    db, b, "RACE", worker_id=f"thread-{i}", settings=FAST
                ).worker_id
            ),
        )
        assert len(won) == 1, (race, won, errors)
        assert len(errors) == n_threads - 1
        assert all(isinstance(e, LeaseNotAcquired) for e in errors), errors
        row = _shard_row(db, batch.batch_id, "RACE")
        assert row["worker_id"] == won[0]
        assert row["claim_count"] == 1


def _race_worker(
    url: str, idx: int, jobs: Any, results: Any, barrier: Any
) -> None:  # runs in a child process
    db = SyncDatabase.open(url, create_schema=False)
    while True:
        batch_id = jobs.get()
        if batch_id is None:
            break
        barrier.wait()
        try:
            claim_shard(db, batch_id, "RACE", worker_id=f"proc-{idx}", settings=FAST)
            results.put((batch_id, idx, "won"))
        except LeaseNotAcquired:
            results.put((batch_id, idx, "lost"))
        except Exception as err:
            results.put((batch_id, idx, f"error: {err!r}"))
    db.dispose()


def test_processes_race_for_one_shard_exactly_one_wins(
    db: SyncDatabase, make_batch: MakeBatch
) -> None:
    n_procs = 4
    ctx = mp.get_context("spawn")
    jobs = ctx.Queue()
    results = ctx.Queue()
    barrier = ctx.Barrier(n_procs)
    url = db.engine.url.render_as_string(hide_password=False)
    procs = [
        ctx.Process(target=_race_worker, args=(url, i, jobs, results, barrier))
        for i in range(n_procs)
    ]
    for p in procs:
        p.start()
    try:
        for _ in range(RACES):
            batch = make_batch(["RACE"])
            for _ in range(n_procs):
                jobs.put(batch.batch_id)
            outcomes = [results.get(timeout=60) for _ in range(n_procs)]
            assert all(o[0] == batch.batch_id for o in outcomes)
            verdicts = sorted(o[2] for o in outcomes)
            assert verdicts == ["lost"] * (n_procs - 1) + ["won"], outcomes
            winner = next(o[1] for o in outcomes if o[2] == "won")
            assert _shard_row(db, batch.batch_id, "RACE")["worker_id"] == f"proc-{winner}"
    finally:
        for _ in procs:
            jobs.put(None)
        for p in procs:
            p.join(timeout=30)
    assert all(p.exitcode == 0 for p in procs)


@contextmanager
def _batch_locked(db: SyncDatabase, batch_id: str) -> Iterator[None]:
    """Holds the batch's row lock, as a finish, a cancel or a batch's first claim does."""
    with db.begin() as conn:
        batches.lock_batch(conn, batch_id)
        yield


def _claim_in_thread(db: SyncDatabase, batch_id: str, key: str) -> tuple[threading.Thread, list]:
    done: list[Any] = []

    def claim() -> None:
        try:
            done.append(claim_shard(db, batch_id, key, worker_id="w2", settings=FAST))
        except Exception as err:
            done.append(err)

    thread = threading.Thread(target=claim, daemon=True)
    thread.start()
    return thread, done


@pytest.mark.parametrize("db_url", ["mariadb"], indirect=True)
def test_a_claim_in_a_started_batch_does_not_queue_for_the_batch_lock_its_first_claim_does(
    db: SyncDatabase, make_batch: MakeBatch
) -> None:
    """Every finish locks the batch; the claims of a started batch's cities need not wait for
    them, while the claim that starts the batch still does (it changes the batch)."""
    batch = make_batch(["A", "B", "C"])
    with _batch_locked(db, batch.batch_id):
        thread, done = _claim_in_thread(db, batch.batch_id, "A")
        thread.join(timeout=1.0)
        assert thread.is_alive() and not done, "the first claim must wait for the batch lock"
    thread.join(timeout=30)
    assert [lease.shard_key for lease in done] == ["A"]
    with db.engine.connect() as conn:
        started = get_batch(conn, batch.batch_id)
    assert started.status == "RUNNING" and started.started_at is not None

    with _batch_locked(db, batch.batch_id):
        thread, done = _claim_in_thread(db, batch.batch_id, "B")
        thread.join(timeout=10)
        assert not thread.is_alive(), "a started batch's claim waited for the batch lock"
        (lease,) = done
        assert (lease.shard_key, lease.batch_shards, lease.claim_count) == ("B", 3, 1)
        assert _shard_row(db, batch.batch_id, "B")["worker_id"] == "w2"
        # A shard it cannot claim is refused with the reason, after the batch's lock.
        thread, done = _claim_in_thread(db, batch.batch_id, "B")
        thread.join(timeout=1.0)
        assert thread.is_alive()
    thread.join(timeout=30)
    (refused,) = done
    assert isinstance(refused, LeaseNotAcquired) and "held by w2" in str(refused)


def _cancel_among_claims(db: SyncDatabase, batch_id: str) -> tuple[int, list[str]]:
    """Four workers claim and finish the batch's shards while a fifth cancels it once they
    have finished a few; how many they finished, and the shards whose finish found the lease
    lost."""
    time_to_cancel = threading.Event()
    lost: list[str] = []

    def work(i: int) -> int:
        if i == 4:
            time_to_cancel.wait(timeout=30)
            cancel_batch(db, batch_id, "operator cancelled")
            return 0
        done = 0
        while (lease := claim_next_shard(db, batch_id, worker_id=f"w{i}")) is not None:
            if done == 3:
                time_to_cancel.set()
            try:
                _finish_in(lease)
                done += 1
            except LeaseLost:
                lost.append(lease.shard_key)
        return done

    results, errors = run_concurrently(5, work)
    assert not errors, errors
    return sum(results), lost


def test_claims_finishes_and_a_cancel_at_once_leave_no_shard_running_and_no_deadlock(
    db: SyncDatabase, make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claims that lock only their shard, among finishes and a cancel that lock the batch
    and then shards: no transaction is a deadlock's victim, and the cancel ends every shard
    that had not finished, including those claimed while it ran."""
    monkeypatch.setattr(batches, "EXACT_TOTALS_SHARDS", 2)
    for _ in range(5):
        keys = [f"C{i:03d}" for i in range(60)]
        batch = make_batch(keys)
        claim_shard(db, batch.batch_id, keys[0], worker_id="starter", settings=FAST).release()
        finished, lost = _cancel_among_claims(db, batch.batch_id)
        with db.engine.connect() as conn:
            final = get_batch(conn, batch.batch_id)
            statuses = dict(
                conn.execute(
                    sa.select(schema.shard.c.shard_key, schema.shard.c.status).where(
                        schema.shard.c.batch_id == batch.batch_id
                    )
                ).all()
            )
        assert final.status == "CANCELLED"
        assert set(statuses.values()) <= {"SUCCESS", "CANCELLED"}, statuses
        assert sum(1 for v in statuses.values() if v == "SUCCESS") == finished
        assert all(statuses[key] == "CANCELLED" for key in lost)


# ---------------------------------------------------------------- fencing


def test_reclaimed_lease_cannot_write_checkpoint_counts_heartbeat_or_finish(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK"])
    old = claim_shard(db, batch.batch_id, "BKK", worker_id="old", settings=FAST)
    old.advance(
        Checkpoint("BKK", page=2, cursor="c2", last_supplier_hotel_id="H100"),
        PageCounts(success=98, failed=1, skipped=1),
        total_pages=5,
    )

    db.clock.advance(FAST.lease_seconds + 1)  # old's lease expires: no sleeping
    new = claim_shard(db, batch.batch_id, "BKK", worker_id="new", settings=FAST)
    before = _shard_row(db, batch.batch_id, "BKK")

    with pytest.raises(LeaseLost):
        old.advance(Checkpoint("BKK", page=3), PageCounts(success=100))
    for attempt in (
        lambda: old.heartbeat("FETCHING", "page 3"),
        lambda: old.advance(Checkpoint("BKK", page=3), PageCounts(success=1)),
        lambda: old.finish("SUCCESS"),
        lambda: old.release(),
    ):
        with pytest.raises(LeaseLost):
            attempt()
    assert old.lost
    assert _shard_row(db, batch.batch_id, "BKK") == before  # nothing written by the old worker

    new.advance(Checkpoint("BKK", page=3), PageCounts(success=100), total_pages=5)
    assert new.finish("SUCCESS").status == "SUCCESS"


def test_advance_writes_the_checkpoint_counts_progress_and_lease_by_the_database_clock(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK", "SIN"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=FAST)
    other = claim_shard(db, batch.batch_id, "SIN", worker_id="w1", settings=FAST)
    lease.advance(Checkpoint("BKK", page=2), PageCounts(success=7, failed=2), total_pages=5)
    db.clock.advance(100)  # the move's times come from the shifted database clock
    with db.begin() as conn:
        lease.advance(
            Checkpoint("BKK", page=3, cursor="c3"),
            PageCounts(success=1, skipped=4),
            fetched=30,
            message="page three",
            conn=conn,
        )
        with db.engine.connect() as reader:
            now = db.clock.read(reader)
    row = _shard_row(db, batch.batch_id, "BKK")
    assert Checkpoint.from_json(row["checkpoint"]) == Checkpoint("BKK", page=3, cursor="c3")
    counts = ("total_count", "success_count", "failed_count", "skipped_count")
    assert [row[k] for k in counts] == [14, 8, 2, 4]
    assert (row["pages_done"], row["fetched_count"], row["total_pages"]) == (2, 30, 5)
    assert (row["status"], row["worker_id"]) == ("RUNNING", "w1")
    assert (row["last_heartbeat_stage"], row["last_heartbeat_message"]) == (
        "CHECKPOINTING",
        "page three",
    )
    assert row["heartbeat_at"] == row["last_checkpoint_at"] == row["updated_at"]
    assert abs((row["heartbeat_at"] - now).total_seconds()) < 60
    assert (row["lease_until"] - row["heartbeat_at"]).total_seconds() == FAST.lease_seconds
    # Only this shard moved.
    assert _shard_row(db, batch.batch_id, "SIN")["pages_done"] == 0
    assert other.checkpoint is None


def _store_page_row(conn: Connection, db: SyncDatabase, batch_id: str, snapshot_id: str) -> None:
    """A page's RAW snapshot row, written in the caller's transaction."""
    conn.execute(
        sa.insert(schema.snapshot).values(
            snapshot_id=snapshot_id,
            batch_id=batch_id,
            supplier_id=1001,
            category_code="HOTEL",
            snapshot_type="RAW",
            snapshot_version=1,
            payload_hash="0" * 64,
            created_at=db.clock.now(),
        )
    )


@pytest.mark.parametrize("status", ["SUCCESS", "FAILED"])
def test_finish_in_ends_the_shard_with_its_counts_and_a_stale_holder_writes_nothing(
    db: SyncDatabase, make_batch: MakeBatch, status: str
):
    batch = make_batch(["BKK", "SIN"])
    stale = claim_shard(db, batch.batch_id, "SIN", worker_id="old", settings=FAST)
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=FAST)
    db.clock.advance(FAST.lease_seconds + 1)  # both leases expire; SIN is taken over
    claim_shard(db, batch.batch_id, "SIN", worker_id="new", settings=FAST)
    counts = PageCounts(success=5, failed=2, skipped=3)
    with db.begin() as conn:
        lease.finish_in(conn, status, "why" if status == "FAILED" else None, counts=counts)  # type: ignore[arg-type]
    row = _shard_row(db, batch.batch_id, "BKK")
    assert (row["status"], row["lease_until"], row["last_heartbeat_stage"]) == (
        status,
        None,
        "FINISHED",
    )
    assert row["last_heartbeat_message"] == f"finished {status}"
    assert row["error_message"] == ("why" if status == "FAILED" else None)
    got = [row[k] for k in ("total_count", "success_count", "failed_count", "skipped_count")]
    assert got == [10, 5, 2, 3]
    assert row["finished_at"] == row["updated_at"] and row["finished_at"] is not None
    assert get_batch_shards_done(db, batch.batch_id) == 1

    before = _shard_row(db, batch.batch_id, "SIN")
    with pytest.raises(LeaseLost), db.begin() as conn:
        _store_page_row(conn, db, batch.batch_id, "last-page")
        stale.finish_in(conn, status, counts=counts)  # type: ignore[arg-type]
    assert stale.lost
    assert _shard_row(db, batch.batch_id, "SIN") == before
    with db.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(schema.snapshot)).scalar() == 0


def get_batch_shards_done(db: SyncDatabase, batch_id: str) -> int:
    """The batch's finished shards as the finish derived them."""
    with db.engine.connect() as conn:
        return get_batch(conn, batch_id).shards_done


def test_lost_lease_rolls_back_page_data_written_in_the_same_transaction(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK"])
    old = claim_shard(db, batch.batch_id, "BKK", worker_id="old", settings=FAST)
    db.clock.advance(FAST.lease_seconds + 1)
    claim_shard(db, batch.batch_id, "BKK", worker_id="new", settings=FAST)

    with pytest.raises(LeaseLost), db.begin() as conn:
        _store_page_row(conn, db, batch.batch_id, "page-2")
        old.advance(Checkpoint("BKK", page=2), PageCounts(success=1), conn=conn)
    with db.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(schema.snapshot)).scalar() == 0


def test_heartbeat_runner_renews_then_detects_loss_and_signals_stop(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=FAST)
    lost = threading.Event()
    with HeartbeatRunner(lease, on_lost=lambda err: lost.set()) as runner:
        runner.report("FETCHING", "city=BKK page=1")
        deadline = threading.Event()
        while runner.beats < 2 and not deadline.wait(0.02):
            pass
        row = _shard_row(db, batch.batch_id, "BKK")
        assert row["last_heartbeat_stage"] == "FETCHING"
        assert row["last_heartbeat_message"] == "city=BKK page=1"

        # Another worker, whose clock is past the lease (the runner's own clock is not
        # shifted: were it shared, a beat landing now would renew the lease past the claim).
        other = SyncDatabase(engine=db.engine, clock=DbClock(FAST.lease_seconds + 1))
        claim_shard(other, batch.batch_id, "BKK", worker_id="w2", settings=FAST)
        assert lost.wait(5), "the heartbeat runner did not detect the lost lease"
        assert runner.lost
        with pytest.raises(LeaseLost):
            runner.check()
    assert _shard_row(db, batch.batch_id, "BKK")["worker_id"] == "w2"


def _until(done: Any, what: str) -> None:
    """Waits (at most 10 s) until ``done()``."""
    pause, deadline = threading.Event(), 100
    while not done():
        deadline -= 1
        assert deadline, f"waited in vain: {what}"
        pause.wait(0.1)


def test_one_heartbeat_thread_renews_every_lease_and_a_stopped_runner_no_more(
    db: SyncDatabase, make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch
):
    batch = make_batch(["BKK", "SIN"])
    bkk = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=FAST)
    sin = claim_shard(db, batch.batch_id, "SIN", worker_id="w1", settings=FAST)
    renewed_by: set[int] = set()
    for lease in (bkk, sin):

        def renew(*a: Any, real: Any = lease.heartbeat, **k: Any) -> None:
            renewed_by.add(threading.get_ident())
            real(*a, **k)

        monkeypatch.setattr(lease, "heartbeat", renew)
    with HeartbeatRunner(bkk) as first, HeartbeatRunner(sin) as second:
        _until(lambda: first.beats >= 2 and second.beats >= 2, "both leases renewed")
        # The city is done: once stop() returns, its lease is renewed no more.
        first.stop()
        beats, renewed_at = first.beats, _shard_row(db, batch.batch_id, "BKK")["heartbeat_at"]
        seen = second.beats
        _until(lambda: second.beats >= seen + 3, "the other lease still renewed")
        assert first.beats == beats and not first.running and second.running
        assert _shard_row(db, batch.batch_id, "BKK")["heartbeat_at"] == renewed_at
    assert len(renewed_by) == 1 and threading.get_ident() not in renewed_by


def test_a_lease_lost_among_others_still_fences_its_city(db: SyncDatabase, make_batch: MakeBatch):
    batch = make_batch(["BKK", "SIN"])
    bkk = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=FAST)
    sin = claim_shard(db, batch.batch_id, "SIN", worker_id="w1", settings=FAST)
    lost = threading.Event()
    with (
        HeartbeatRunner(bkk, on_lost=lambda err: lost.set()) as first,
        HeartbeatRunner(sin) as second,
    ):
        _until(lambda: first.beats >= 1, "the lease renewed")
        # Another worker whose clock is past the lease takes the city over.
        other = SyncDatabase(engine=db.engine, clock=DbClock(FAST.lease_seconds + 1))
        claim_shard(other, batch.batch_id, "BKK", worker_id="w2", settings=FAST)
        assert lost.wait(5), "the shared heartbeat did not detect the lost lease"
        with pytest.raises(LeaseLost):
            first.check()
        # The stale worker's page writes fail, and roll back with their transaction.
        with pytest.raises(LeaseLost), db.begin() as conn:
            bkk.advance(Checkpoint("BKK", page=2), PageCounts(success=1), conn=conn)
        seen = second.beats
        _until(lambda: second.beats >= seen + 2, "the other lease still renewed")
        assert not first.running and not sin.lost
    row = _shard_row(db, batch.batch_id, "BKK")
    assert row["worker_id"] == "w2" and row["checkpoint"] is None


_forked: list[HeartbeatRunner] = []


def test_a_forked_process_renews_none_of_its_parents_leases(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=FAST)
    with HeartbeatRunner(lease) as runner:
        _until(lambda: runner.beats >= 1, "the lease renewed")
        _forked[:] = [runner]
        try:
            with mp.get_context("fork").Pool(1) as pool:
                assert pool.apply(_beats_in_child) == 0
        finally:
            _forked.clear()


class _OwnLease:
    """A lease of the forked process's own, renewed by nothing but its runner."""

    settings = FAST
    shard_key = "OWN"
    lost = False

    def heartbeat(self, *_: object) -> None:
        pass


def _beats_in_child() -> int:
    # The parent's runner as the fork copied it: the heartbeat thread this process starts
    # for a lease of its own renews that one only.
    runner = _forked[0]
    before = runner.beats
    with HeartbeatRunner(_OwnLease(), refresh_batch_every=0) as own:  # type: ignore[arg-type]
        _until(lambda: own.beats >= 5, "the forked process's own lease renewed")
    return runner.beats - before


def test_heartbeat_runner_gives_up_when_renewals_fail_until_the_lease_could_expire(
    db: SyncDatabase, make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch
):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=FAST)
    calls = {"n": 0}

    def unreachable(*_a: object, **_k: object) -> None:
        calls["n"] += 1
        raise sa.exc.OperationalError("UPDATE supplier_sync_shard", {}, Exception("gone away"))

    monkeypatch.setattr(lease, "heartbeat", unreachable)
    ticks = iter(range(0, 10_000, 5))  # each reading of the local timer: 5 s later
    lost = threading.Event()
    with HeartbeatRunner(
        lease, on_lost=lambda err: lost.set(), monotonic=lambda: float(next(ticks))
    ):
        assert lost.wait(5), "the runner kept going without a renewed lease"
    # 30 s lease, renewal every 0.05 s: it gives up once failures span >= 29.95 s of timer.
    assert 5 <= calls["n"] <= 8
    assert lease.lost
    with pytest.raises(LeaseLost, match="heartbeat failed"):
        lease.ensure_held()


def test_heartbeat_extends_lease_by_database_clock(db: SyncDatabase, make_batch: MakeBatch):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=FAST)
    first = _shard_row(db, batch.batch_id, "BKK")["lease_until"]
    db.clock.advance(20)  # still inside the 30 s lease
    lease.heartbeat()
    second = _shard_row(db, batch.batch_id, "BKK")["lease_until"]
    assert 19 <= (second - first).total_seconds() <= 25
    db.clock.advance(20)  # 40 s after the claim, but 20 s after the renewal: still live
    with pytest.raises(LeaseNotAcquired, match="live lease"):
        claim_shard(db, batch.batch_id, "BKK", worker_id="thief", settings=FAST)


def test_cancelled_batch_workers_lose_their_lease(db: SyncDatabase, make_batch: MakeBatch):
    batch = make_batch(["BKK", "SIN"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=FAST)
    cancel_batch(db, batch.batch_id, "operator cancelled")
    with pytest.raises(LeaseLost):
        lease.heartbeat()
    with pytest.raises(LeaseNotAcquired, match="CANCELLED"):
        claim_shard(db, batch.batch_id, "SIN", worker_id="w2", settings=FAST)
    with db.engine.connect() as conn:
        assert get_batch(conn, batch.batch_id).status == "CANCELLED"


# ---------------------------------------------------------------- reclaim and resume


def test_reclaim_resumes_from_stored_checkpoint_live_lease_never_reclaimed(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK"])
    first = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=FAST)
    assert first.checkpoint is None and not first.resumed
    cp = Checkpoint("BKK", page=7, cursor="opaque==", last_supplier_hotel_id="H0600")
    first.advance(cp, PageCounts(success=100), total_pages=12)

    db.clock.advance(FAST.lease_seconds - 5)  # 5 s before expiry: still live
    with pytest.raises(LeaseNotAcquired):
        claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=FAST)
    assert claim_next_shard(db, batch.batch_id, worker_id="w2", settings=FAST) is None

    db.clock.advance(6)  # now expired
    stalls = find_stalls(db)
    assert [(s.kind, s.shard_key) for s in stalls] == [("LEASE_EXPIRED", "BKK")]
    second = claim_next_shard(db, batch.batch_id, worker_id="w2", settings=FAST)
    assert second is not None
    assert second.checkpoint == cp
    assert second.resumed and second.claim_count == 2
    row = _shard_row(db, batch.batch_id, "BKK")
    assert (row["worker_id"], row["lease_token"]) == ("w2", second.lease_token)
    assert row["success_count"] == 100 and row["pages_done"] == 1


def test_release_returns_shard_to_pending_with_its_checkpoint(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=FAST)
    lease.advance(Checkpoint("BKK", page=4), PageCounts(success=3))
    lease.release("run terminated")
    info = get_shard(db, batch.batch_id, "BKK")
    assert info.status == "PENDING" and info.checkpoint == Checkpoint("BKK", page=4)
    again = claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=FAST)
    assert again.checkpoint == Checkpoint("BKK", page=4)


# ---------------------------------------------------------------- counts and batch derivation


def test_counts_add_up_and_batch_status_derives_from_shards(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["A", "B", "C"])
    pages = {
        "A": [PageCounts(100, 0, 0), PageCounts(97, 2, 1), PageCounts(40, 0, 3)],
        "B": [PageCounts(0, 100, 0)],
        "C": [PageCounts(10, 5, 85), PageCounts(0, 0, 0)],
    }
    leases = {
        k: claim_shard(db, batch.batch_id, k, worker_id=f"w-{k}", settings=FAST) for k in pages
    }
    with db.engine.connect() as conn:
        assert get_batch(conn, batch.batch_id).status == "RUNNING"
    for key, counts in pages.items():
        for i, c in enumerate(counts, start=2):
            leases[key].advance(Checkpoint(key, page=i), c, total_pages=len(counts))

    after_a = leases["A"].finish("SUCCESS")
    assert after_a.status == "RUNNING" and after_a.shards_done == 1
    assert leases["B"].finish("FAILED", "supplier returned 500 for every page").status == "RUNNING"
    final = leases["C"].finish("SUCCESS")
    assert final.status == "PARTIAL_FAILED"
    assert final.finished_at is not None and final.progress_percent == 100

    for info in list_shards(db, batch.batch_id):
        assert info.total_count == info.success_count + info.failed_count + info.skipped_count
        assert info.total_count == sum(c.total for c in pages[info.shard_key])
    everything = [c for cs in pages.values() for c in cs]
    assert final.success_count == sum(c.success for c in everything)
    assert final.failed_count == sum(c.failed for c in everything)
    assert final.skipped_count == sum(c.skipped for c in everything)
    assert final.total_count == final.success_count + final.failed_count + final.skipped_count


@pytest.mark.parametrize(
    ("finishes", "expected"),
    [
        (["SUCCESS", "SUCCESS"], "SUCCESS"),
        (["FAILED", "FAILED"], "FAILED"),
        (["SUCCESS", "FAILED"], "PARTIAL_FAILED"),
    ],
)
def test_batch_terminal_status(
    db: SyncDatabase, make_batch: MakeBatch, finishes: list[str], expected: str
):
    batch = make_batch(["X", "Y"])
    result = None
    for key, status in zip(("X", "Y"), finishes, strict=True):
        lease = claim_shard(db, batch.batch_id, key, worker_id="w", settings=FAST)
        result = lease.finish(status)  # type: ignore[arg-type]
    assert result is not None and result.status == expected


def test_progress_and_current_city_follow_checkpoints(db: SyncDatabase, make_batch: MakeBatch):
    batch = make_batch(["A", "B"])
    a = claim_shard(db, batch.batch_id, "A", worker_id="w", settings=FAST)
    a.advance(Checkpoint("A", page=2), PageCounts(success=10), total_pages=4)
    b = a.refresh_batch()
    assert b.current_city_code == "A" and b.current_page == 2
    assert float(b.progress_percent) == pytest.approx(12.5)  # (1/4) of one of two shards


def test_a_worker_that_lost_its_lease_does_not_refresh_the_batch(
    db: SyncDatabase, make_batch: MakeBatch
):
    """The zombie writer's heartbeat thread, woken between a beat and its batch refresh."""
    batch = make_batch(["A"])
    stale = claim_shard(db, batch.batch_id, "A", worker_id="w1", settings=FAST)
    later = SyncDatabase(engine=db.engine, clock=DbClock(FAST.lease_seconds + 1))
    claim_shard(later, batch.batch_id, "A", worker_id="w2", settings=FAST)
    with db.engine.connect() as conn:
        before = conn.execute(sa.select(schema.batch)).all()
    with pytest.raises(LeaseLost):
        stale.refresh_batch()
    assert stale.lost
    with db.engine.connect() as conn:
        assert conn.execute(sa.select(schema.batch)).all() == before


# ---------------------------------------------------------------- stalls


def test_stall_query_finds_fresh_heartbeat_with_frozen_checkpoint(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["SLOW", "FINE"])
    slow = claim_shard(db, batch.batch_id, "SLOW", worker_id="w1", settings=FAST)
    fine = claim_shard(db, batch.batch_id, "FINE", worker_id="w2", settings=FAST)
    slow.advance(Checkpoint("SLOW", page=2), PageCounts(success=1))
    for _ in range(5):  # 100 s: heartbeats keep both alive, only FINE checkpoints
        db.clock.advance(20)
        slow.heartbeat("FETCHING", "waiting on supplier")
        fine.advance(Checkpoint("FINE", page=2), PageCounts(success=1))
    stalls = find_stalls(db, checkpoint_stall_seconds=60, heartbeat_fresh_seconds=30)
    assert [(s.kind, s.shard_key) for s in stalls] == [("CHECKPOINT_STALLED", "SLOW")]
    assert stalls[0].seconds_since_checkpoint >= 99
    assert stalls[0].message == "waiting on supplier"
    with pytest.raises(ConfigError):
        find_stalls(db, checkpoint_stall_seconds=0)


def test_a_walk_waiting_for_the_supplier_longer_than_a_page_may_take_is_a_stall(
    db: SyncDatabase, make_batch: MakeBatch
):
    """A request that trickles keeps the heartbeat fresh while the checkpoint stands still:
    past what the client's bounds let one page take, that is a stall, long before the
    general threshold; a city publishing for as long is not (it moves no checkpoint)."""
    batch = make_batch(["TRICKLE", "PUBLISH"])
    leases = {
        city: claim_shard(db, batch.batch_id, city, worker_id=f"w-{city}", settings=FAST)
        for city in ("TRICKLE", "PUBLISH")
    }
    for city, lease in leases.items():
        lease.advance(Checkpoint(city, page=2), PageCounts(success=1))
    for _ in range(6):  # 120 s of fresh heartbeats, no checkpoint
        db.clock.advance(20)
        leases["TRICKLE"].heartbeat("FETCHING", "city=TRICKLE waiting for the supplier's page")
        leases["PUBLISH"].heartbeat("PUBLISHING", "city=PUBLISH chunk of 1000")
    quick = find_stalls(
        db, checkpoint_stall_seconds=600, heartbeat_fresh_seconds=30, fetch_stall_seconds=90
    )
    assert [(s.kind, s.shard_key) for s in quick] == [("CHECKPOINT_STALLED", "TRICKLE")]
    # Without the fetch threshold, only the general one applies: nothing yet.
    assert find_stalls(db, checkpoint_stall_seconds=600, heartbeat_fresh_seconds=30) == []
    with pytest.raises(ConfigError):
        find_stalls(db, fetch_stall_seconds=0)


# ---------------------------------------------------------------- bad input


def test_hostile_city_codes_stored_and_read_back_verbatim(db: SyncDatabase, make_batch: MakeBatch):
    batch = make_batch(HOSTILE_CITY_CODES)
    assert {s.shard_key for s in list_shards(db, batch.batch_id)} == set(HOSTILE_CITY_CODES)
    for code in HOSTILE_CITY_CODES:
        lease = claim_shard(db, batch.batch_id, code, worker_id="w", settings=FAST)
        cp = Checkpoint(code, page=3, cursor=code, last_supplier_hotel_id=code)
        lease.advance(cp, PageCounts(success=1))
        assert get_shard(db, batch.batch_id, code).checkpoint == cp
        lease.finish("SUCCESS")
    with db.engine.connect() as conn:
        assert get_batch(conn, batch.batch_id).status == "SUCCESS"
        # The hostile SQL did nothing: every table is still there.
        assert set(sa.inspect(conn).get_table_names()) >= set(schema.metadata.tables)


@pytest.mark.parametrize(
    "stored",
    [
        '{"city_code": "BKK", "page": "two"}',
        "not json",
        "[1, 2]",
        '{"page": 3}',
        '{"city_code": "BKK", "page": 0}',
        '{"city_code": "BKK", "page": 2, "evil": 1}',
    ],
)
def test_malformed_stored_checkpoint_is_a_clear_error(
    db: SyncDatabase, make_batch: MakeBatch, stored: str
):
    batch = make_batch(["BKK"])
    with db.begin() as conn:
        conn.execute(
            sa.update(schema.shard)
            .where(schema.shard.c.batch_id == batch.batch_id)
            .values(checkpoint=stored)
        )
    with pytest.raises(InvalidCheckpoint, match="BKK"):
        claim_shard(db, batch.batch_id, "BKK", worker_id="w", settings=FAST)
    assert _shard_row(db, batch.batch_id, "BKK")["status"] == "PENDING"  # nothing half-written


def test_checkpoint_validation_writes_nothing(db: SyncDatabase, make_batch: MakeBatch):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w", settings=FAST)
    before = _shard_row(db, batch.batch_id, "BKK")
    with pytest.raises(InvalidCheckpoint, match="another city|SIN"):
        lease.advance(Checkpoint("SIN", page=2), PageCounts(success=1))
    with pytest.raises(InvalidCheckpoint, match="limit"):
        lease.advance(Checkpoint("BKK", page=2, cursor="c" * 2000), PageCounts(success=1))
    with pytest.raises(InvalidCheckpoint):
        Checkpoint("BKK", page=0)
    with pytest.raises(ValueError, match="non-negative"):
        PageCounts(success=-1)
    assert _shard_row(db, batch.batch_id, "BKK") == before


@pytest.mark.parametrize(("lease", "beat"), [(1, 0.1), (4000, 20), (180, 90), (180, 0)])
def test_out_of_range_lease_settings_are_rejected(lease: float, beat: float):
    with pytest.raises(ConfigError, match="lease|heartbeat"):
        LeaseSettings(lease_seconds=lease, heartbeat_seconds=beat)


def test_unknown_shard_and_worker_id(db: SyncDatabase, make_batch: MakeBatch):
    batch = make_batch(["BKK"])
    with pytest.raises(UnknownShard, match="NOPE"):
        claim_shard(db, batch.batch_id, "NOPE", worker_id="w", settings=FAST)
    with pytest.raises(ConfigError, match="worker_id"):
        claim_shard(db, batch.batch_id, "BKK", worker_id="w" * 65, settings=FAST)


def test_worker_id_is_service_host_pid_start(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("POD_NAME", "hotel-sync-worker-pod-a1b2c3" + "x" * 80)
    wid = make_worker_id("hotel-sync")
    assert len(wid) <= 64
    assert wid.startswith("hotel-sync-hotel-sync-worker-pod-a1b2c3")
    assert f"-{os.getpid()}-" in wid and wid.endswith("Z")


def test_live_lease_of_a_dead_local_process_is_taken_at_once(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK"])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_worker = make_worker_id("other").rsplit("-", 2)[0] + f"-{child.pid}-20260101T000000Z"
        claim_shard(db, batch.batch_id, "BKK", worker_id=dead_worker, settings=FAST)
        # Alive: its lease is respected.
        with pytest.raises(LeaseNotAcquired, match="live lease"):
            claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=FAST)
    finally:
        child.kill()
        child.wait()
    assert holder_is_dead_here(dead_worker)
    taken = claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=FAST)
    assert taken.claim_count == 2 and _shard_row(db, batch.batch_id, "BKK")["worker_id"] == "w2"
    # Another host's worker, or an id that is not ours, is never presumed dead.
    assert not holder_is_dead_here("supplier-sync-some-other-host-1-20260101T000000Z")
    assert not holder_is_dead_here("not-a-worker-id")
    with pytest.raises(LeaseNotAcquired):
        claim_shard(
            db, batch.batch_id, "BKK", worker_id="w3", settings=FAST, reclaim_dead_local=False
        )


# ---------------------------------------------------------------- the table of shard moves


def _set_status(db: SyncDatabase, shard_id: int, status: str) -> None:
    with db.begin() as conn:  # test setup: straight to a state, bypassing the state machine
        conn.execute(
            sa.update(schema.shard).where(schema.shard.c.id == shard_id).values(status=status)
        )


def test_the_table_of_moves_is_what_the_database_enforces(db: SyncDatabase, make_batch: MakeBatch):
    states: tuple[ShardStatus, ...] = get_args(ShardStatus)
    assert set(SHARD_MOVES) == set(states)
    batch = make_batch(["BKK"])
    shard_id = get_shard(db, batch.batch_id, "BKK").shard_id
    for source, target in itertools.product(states, states):
        _set_status(db, shard_id, source)
        allowed = target in SHARD_MOVES[source]
        assert (source in sources_of(target)) == allowed
        with db.begin() as conn:
            if allowed:
                move_shards(
                    conn, target, [schema.shard.c.id == shard_id], on_miss=lambda: AssertionError()
                )
            else:
                with pytest.raises(InvalidTransition, match="refused"):
                    move_shards(
                        conn,
                        target,
                        [schema.shard.c.id == shard_id],
                        on_miss=lambda: InvalidTransition("refused"),
                    )
                # A bulk move (no on_miss) reports the 0 rows instead of raising.
                assert move_shards(conn, target, [schema.shard.c.id == shard_id]) == 0
        expected = target if allowed else source
        assert get_shard(db, batch.batch_id, "BKK").status == expected, (source, target)


def test_a_move_the_table_does_not_have_is_refused_before_any_write(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK"])
    shard_id = get_shard(db, batch.batch_id, "BKK").shard_id
    _set_status(db, shard_id, "SUCCESS")
    with db.begin() as conn, pytest.raises(InvalidTransition, match="SUCCESS"):
        move_shards(conn, "PENDING", [schema.shard.c.id == shard_id], sources=["SUCCESS"])
    assert get_shard(db, batch.batch_id, "BKK").status == "SUCCESS"


def test_a_fenced_move_needs_the_holder_and_its_token(db: SyncDatabase, make_batch: MakeBatch):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=FAST)
    where = [schema.shard.c.id == lease.shard_id]
    with db.begin() as conn:
        assert move_shards(conn, "PENDING", where, holder=("w1", "another token")) == 0
        assert move_shards(conn, "PENDING", where, holder=("w2", lease.lease_token)) == 0
    assert get_shard(db, batch.batch_id, "BKK").status == "RUNNING"
    with db.begin() as conn:
        assert move_shards(conn, "PENDING", where, holder=("w1", lease.lease_token)) == 1
    assert get_shard(db, batch.batch_id, "BKK").status == "PENDING"


# ---------------------------------------------------------------- the shard's work and its end

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
            schema.snapshot,
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
                .select_from(schema.snapshot)
                .where(schema.snapshot.c.batch_id == batch_id)
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


def test_shard_work_suppresses_only_a_lost_lease_and_always_stops_the_heartbeat(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK", "SIN"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=SETTINGS)
    work = ShardWork(lease)
    with work as heartbeat:
        cancel_batch(db, batch.batch_id, "operator cancelled")
        lease.heartbeat()  # LeaseLost: suppressed, kept
    assert isinstance(work.lost, LeaseLost) and work.error is None
    assert not heartbeat.running

    # Any exception once the lease is lost is the loss's doing: suppressed too.
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=SETTINGS)
    work = ShardWork(lease)
    with work:
        lease.mark_lost("taken over")
        raise ValueError("a write that the loss made moot")
    assert isinstance(work.lost, ValueError)
    assert get_shard(db, batch.batch_id, "BKK").status == "RUNNING"  # nothing written


def test_shard_work_fails_the_shard_and_raises_the_original_error(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=SETTINGS)
    work = ShardWork(lease)
    with pytest.raises(RuntimeError, match="boom"), work:
        raise RuntimeError("boom")
    # The precise code first (a bug's is INTERNAL_ERROR), then what happened.
    assert work.error == "INTERNAL_ERROR: RuntimeError: boom" and work.lost is None
    info = get_shard(db, batch.batch_id, "BKK")
    assert info.status == "FAILED" and info.error_message == "INTERNAL_ERROR: RuntimeError: boom"

    # Failing after another worker took the shard (the zombie writer): its outcome stands,
    # the stale worker's failure is a lost lease, not the city's.
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=SETTINGS)
    other = SyncDatabase(engine=db.engine, clock=DbClock(SETTINGS.lease_seconds + 1))
    work = ShardWork(lease)
    with work:
        claim_shard(other, batch.batch_id, "BKK", worker_id="w2", settings=SETTINGS)
        raise RuntimeError("late")
    assert isinstance(work.lost, LeaseLost) and work.error is None
    info = get_shard(db, batch.batch_id, "BKK")
    assert info.status == "RUNNING" and info.worker_id == "w2" and info.error_message is None


def test_shard_work_releases_on_generator_close_and_keeps_the_interrupt_if_release_fails(
    db: SyncDatabase, make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch
):
    batch = make_batch(["BKK", "SIN"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=SETTINGS)

    def pages() -> Generator[int, None, None]:
        with ShardWork(lease):
            yield 1
            yield 2

    walk = pages()
    next(walk)
    walk.close()  # GeneratorExit inside the block
    assert get_shard(db, batch.batch_id, "BKK").status == "PENDING"

    lease = claim_shard(db, batch.batch_id, "SIN", worker_id="w1", settings=SETTINGS)

    def unreachable(reason: str) -> None:
        raise ConnectionError("database unreachable")

    monkeypatch.setattr(lease, "release", unreachable)
    with pytest.raises(KeyboardInterrupt), ShardWork(lease):
        raise KeyboardInterrupt
    assert get_shard(db, batch.batch_id, "SIN").status == "RUNNING"  # it expires instead


def _finish_in(lease: Any, status: str = "SUCCESS", success: int = 10) -> Batch:
    """The city's last transaction's finish (as ``core.sync`` ends a shard); the batch read
    back after it."""
    with lease.db.begin() as conn:
        lease.finish_in(conn, status, counts=PageCounts(success=success))
    with lease.db.engine.connect() as conn:
        return get_batch(conn, lease.batch_id)


def test_a_large_batch_s_finish_counts_itself_while_its_totals_are_recent(
    db: SyncDatabase, make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Summing every shard at every finish costs a batch of many cities quadratic time: a
    finish counts itself instead, until the totals are RETOTAL_SECONDS old or it may be
    the batch's last; the status is always right."""
    monkeypatch.setattr(batches, "EXACT_TOTALS_SHARDS", 2)
    batch = make_batch(["A", "B", "C", "D", "E"])
    leases = {k: claim_shard(db, batch.batch_id, k, worker_id="w", settings=FAST) for k in "ABCDE"}
    assert {lease.batch_shards for lease in leases.values()} == {5}

    after = _finish_in(leases["A"])
    assert (after.status, after.shards_done, after.success_count) == ("RUNNING", 1, 0)
    after = _finish_in(leases["B"], "FAILED", success=0)
    assert (after.shards_done, after.success_count) == (2, 0)  # counted; totals lag
    db.clock.advance(batches.RETOTAL_SECONDS + 1)
    after = _finish_in(leases["C"])  # the totals are old: summed again
    assert (after.shards_done, after.success_count, after.failed_count) == (3, 20, 0)
    after = _finish_in(leases["D"], "FAILED", success=0)
    assert (after.status, after.shards_done, after.success_count) == ("RUNNING", 4, 20)
    # A reopened shard derives the batch, so the count stays exact.
    after = reopen_shard(db, batch.batch_id, "D", "retry")
    assert (after.status, after.shards_done) == ("RUNNING", 3)
    after = _finish_in(leases["E"])
    assert (after.status, after.shards_done, after.success_count) == ("RUNNING", 4, 20)
    again = claim_shard(db, batch.batch_id, "D", worker_id="w2", settings=FAST)
    final = _finish_in(again)  # the last: summed, and the batch ends
    assert (final.status, final.shards_done, final.success_count) == ("PARTIAL_FAILED", 5, 40)
    assert final.finished_at is not None and final.progress_percent == 100


def test_the_last_of_many_finishing_at_once_ends_a_large_batch(
    db: SyncDatabase, make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batches, "EXACT_TOTALS_SHARDS", 2)
    keys = [f"C{i:02d}" for i in range(24)]
    batch = make_batch(keys)

    def work(i: int) -> int:
        done = 0
        while (lease := claim_next_shard(db, batch.batch_id, worker_id=f"w{i}")) is not None:
            _finish_in(lease)
            done += 1
        return done

    results, errors = run_concurrently(4, work)
    assert not errors and sum(results) == len(keys)
    with db.engine.connect() as conn:
        final = get_batch(conn, batch.batch_id)
    assert (final.status, final.shards_done, final.success_count) == ("SUCCESS", 24, 240)
