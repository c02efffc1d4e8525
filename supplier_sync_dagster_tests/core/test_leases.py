"""Shard leases: one writer per shard, fencing, reclaim, checkpoints, heartbeats, stalls."""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core import schema as t
from supplier_sync_dagster.core.batches import cancel_batch, get_batch
from supplier_sync_dagster.core.db import DbClock, SyncDatabase
from supplier_sync_dagster.core.errors import (
    ConfigError,
    InvalidCheckpoint,
    LeaseLost,
    LeaseNotAcquired,
    UnknownShard,
)
from supplier_sync_dagster.core.leases import (
    Checkpoint,
    HeartbeatRunner,
    LeaseSettings,
    PageCounts,
    claim_next_shard,
    claim_shard,
    find_stalls,
    get_shard,
    holder_is_dead_here,
    list_shards,
    make_worker_id,
)
from supplier_sync_dagster_tests.core.conftest import MakeBatch, run_concurrently
from supplier_sync_dagster_tests.helpers import HOSTILE_CITY_CODES

FAST = LeaseSettings(lease_seconds=30, heartbeat_seconds=0.05)
RACES = 50


def _shard_row(db: SyncDatabase, batch_id: str, key: str) -> dict[str, Any]:
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.select(t.shard).where(t.shard.c.batch_id == batch_id, t.shard.c.shard_key == key)
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


def test_lost_lease_rolls_back_page_data_written_in_the_same_transaction(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(["BKK"])
    old = claim_shard(db, batch.batch_id, "BKK", worker_id="old", settings=FAST)
    db.clock.advance(FAST.lease_seconds + 1)
    claim_shard(db, batch.batch_id, "BKK", worker_id="new", settings=FAST)

    with pytest.raises(LeaseLost), db.begin() as conn:
        conn.execute(
            sa.insert(t.snapshot).values(
                snapshot_id="page-2",
                batch_id=batch.batch_id,
                supplier_id=1001,
                category_code="HOTEL",
                snapshot_type="RAW",
                snapshot_version=1,
                payload_hash="0" * 64,
                created_at=db.clock.now(),
            )
        )
        old.advance(Checkpoint("BKK", page=2), PageCounts(success=1), conn=conn)
    with db.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(t.snapshot)).scalar() == 0


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
        assert set(sa.inspect(conn).get_table_names()) >= set(t.metadata.tables)


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
            sa.update(t.shard).where(t.shard.c.batch_id == batch.batch_id).values(checkpoint=stored)
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
    import os

    assert f"-{os.getpid()}-" in wid and wid.endswith("Z")


def test_live_lease_of_a_dead_local_process_is_taken_at_once(
    db: SyncDatabase, make_batch: MakeBatch
):
    import subprocess
    import sys

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
