"""The Redis claim accelerator: a claim takes the shard's Redis lock before its database
claim; a lease works only while it holds both; every failure order of the rules, Redis
down at the claim and mid-work, and a ``sync --full`` with the locks on."""

from __future__ import annotations

import json
import pickle
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import (
    ClaimLockHeld,
    ClaimLockLost,
    ConfigError,
    LeaseLost,
    LeaseNotAcquired,
)
from supplier_sync_dagster.core.leasing.batches import cancel_batch
from supplier_sync_dagster.core.leasing.claim_locks import (
    ClaimLockConfig,
    claim_locks_for,
    claim_locks_from_env,
)
from supplier_sync_dagster.core.leasing.leases import (
    Checkpoint,
    LeaseSettings,
    PageCounts,
    ShardLease,
    ShardWork,
    claim_next_shard,
    claim_shard,
    get_shard,
    make_worker_id,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.cli.test_main import published, query, simulator, supplier, sync
from supplier_sync_dagster_tests.core.conftest import MakeBatch

OTHER = "supplier-sync-other-host-1-20260101T000000Z:another-token"


@pytest.fixture(autouse=True)
def no_env_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim locks each test asks for, not the environment's."""
    monkeypatch.delenv("SUPPLIER_SYNC_CLAIM_LOCKS", raising=False)


@pytest.fixture
def locks(redis_url: str) -> ClaimLockConfig:
    """Claim locks in the test Redis, under a prefix of this test's own."""
    return ClaimLockConfig(redis_url, key_prefix=f"test-claim:{uuid.uuid4().hex}:")


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def settings(config: ClaimLockConfig | None) -> LeaseSettings:
    return LeaseSettings(lease_seconds=30, heartbeat_seconds=0.05, claim_locks=config)


def key(config: ClaimLockConfig, lease_or_batch: ShardLease | str, shard: str = "") -> str:
    if isinstance(lease_or_batch, ShardLease):
        return claim_locks_for(config).key(lease_or_batch.batch_id, lease_or_batch.shard_key)
    return claim_locks_for(config).key(lease_or_batch, shard)


def value(lease: ShardLease) -> str:
    return f"{lease.worker_id}:{lease.lease_token}"


def shard_row(db: SyncDatabase, batch_id: str, shard_key: str) -> Any:
    with db.engine.connect() as conn:
        c = schema.shard.c
        return conn.execute(
            sa.select(schema.shard).where(c.batch_id == batch_id, c.shard_key == shard_key)
        ).one()


def statements(db: SyncDatabase) -> list[str]:
    """Every statement the database is sent from now on."""
    sent: list[str] = []
    sa.event.listen(db.engine, "before_cursor_execute", lambda *a: sent.append(a[2]))
    return sent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A Redis of the test's own, stopped and started again on the same port."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.tmp = tmp
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no"],
            cwd=self.tmp,
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def own_redis(tmp_path: Path, redis_url: str) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    try:
        server.start()
    except FileNotFoundError:
        pytest.skip("redis-server is not installed")
    yield server
    server.stop()


# ---------------------------------------------------------------- the claim


def test_a_claim_takes_the_lock_as_worker_and_token_and_its_end_deletes_it(
    db: SyncDatabase, make_batch: MakeBatch, locks: ClaimLockConfig, r: redis.Redis
):
    batch = make_batch(["BKK", "SIN"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=settings(locks))
    k = key(locks, lease)
    assert r.get(k) == value(lease) == f"w1:{lease.lease_token}"
    assert 0 < r.pttl(k) <= 30_000
    r.pexpire(k, 5_000)
    lease.heartbeat()
    assert r.pttl(k) > 5_000  # renewed with the lease
    lease.advance(Checkpoint("BKK", page=2), PageCounts(success=3))
    lease.finish("SUCCESS")
    assert r.get(k) is None
    other = claim_shard(db, batch.batch_id, "SIN", worker_id="w1", settings=settings(locks))
    other.release("interrupted")
    assert r.get(key(locks, other)) is None


def test_a_shard_whose_lock_another_holds_is_skipped_without_a_database_claim(
    db: SyncDatabase, make_batch: MakeBatch, locks: ClaimLockConfig, r: redis.Redis
):
    batch = make_batch(["BKK", "SIN"])
    r.set(key(locks, batch.batch_id, "BKK"), OTHER, px=30_000)
    sent = statements(db)
    with pytest.raises(ClaimLockHeld, match="supplier-sync-other-host"):
        claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=settings(locks))
    assert sent == []
    assert shard_row(db, batch.batch_id, "BKK").status == "PENDING"
    # claim_next_shard passes over it to the next candidate.
    lease = claim_next_shard(db, batch.batch_id, worker_id="w1", settings=settings(locks))
    assert lease is not None and lease.shard_key == "SIN"
    assert r.get(key(locks, batch.batch_id, "BKK")) == OTHER
    # Without the locks the database alone decides: the shard is claimable.
    assert claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=settings(None))


def test_a_database_claim_that_fails_deletes_its_own_lock(
    db: SyncDatabase, make_batch: MakeBatch, locks: ClaimLockConfig, r: redis.Redis
):
    batch = make_batch(["BKK"])
    # The holder took its lease while it could not reach Redis: no lock, a live lease.
    claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=settings(None))
    with pytest.raises(LeaseNotAcquired, match="live lease") as refused:
        claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=settings(locks))
    assert not isinstance(refused.value, ClaimLockHeld)
    assert r.get(key(locks, batch.batch_id, "BKK")) is None


def test_threads_racing_with_locks_claim_each_shard_once(
    db: SyncDatabase, make_batch: MakeBatch, locks: ClaimLockConfig
):
    keys = [f"C{i:02d}" for i in range(12)]
    batch = make_batch(keys)
    from supplier_sync_dagster_tests.core.conftest import run_concurrently

    def drain(i: int) -> list[str]:
        got = []
        while (
            lease := claim_next_shard(
                db, batch.batch_id, worker_id=f"t{i}", settings=settings(locks)
            )
        ) is not None:
            got.append(lease.shard_key)
            lease.finish("SUCCESS")
        return got

    results, errors = run_concurrently(4, drain)
    assert errors == []
    claimed = [k for got in results for k in got]
    assert sorted(claimed) == keys
    with db.engine.connect() as conn:
        counts = (
            conn.execute(
                sa.select(schema.shard.c.claim_count).where(
                    schema.shard.c.batch_id == batch.batch_id
                )
            )
            .scalars()
            .all()
        )
    assert set(counts) == {1}


# ---------------------------------------------------------------- the rules while working


def test_a_renewal_that_finds_the_lock_gone_stops_the_work_and_gives_the_lease_back(
    db: SyncDatabase, make_batch: MakeBatch, locks: ClaimLockConfig, r: redis.Redis
):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=settings(locks))
    lease.advance(Checkpoint("BKK", page=3), PageCounts(success=2))
    k = key(locks, lease)
    # The lock expires while the database lease is still valid (the worker was paused).
    r.pexpire(k, 1)
    while r.exists(k):
        time.sleep(0.01)
    assert shard_row(db, batch.batch_id, "BKK").lease_until is not None
    with pytest.raises(ClaimLockLost, match="no longer holds its Redis claim lock"):
        lease.heartbeat()
    row = shard_row(db, batch.batch_id, "BKK")
    assert row.status == "PENDING" and row.lease_until is None
    assert json.loads(row.checkpoint)["page"] == 3
    assert lease.lost
    with pytest.raises(LeaseLost):
        lease.advance(Checkpoint("BKK", page=4), PageCounts(success=1))
    # Another worker resumes it at once, from the checkpoint.
    again = claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=settings(locks))
    assert again.checkpoint == Checkpoint("BKK", page=3) and again.claim_count == 2


def test_a_renewal_that_finds_another_holder_stops_and_leaves_its_lock_alone(
    db: SyncDatabase, make_batch: MakeBatch, locks: ClaimLockConfig, r: redis.Redis
):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=settings(locks))
    k = key(locks, lease)
    r.set(k, OTHER, px=30_000)  # the lock expired and another worker took it
    assert lease.claim_lock is not None
    assert lease.claim_lock.renew() == "LOST"
    lease.claim_lock.release()
    assert r.get(k) == OTHER  # a stale holder neither deletes...
    with pytest.raises(ClaimLockLost):
        lease.heartbeat()
    assert r.get(k) == OTHER  # ...nor extends another's lock
    assert 0 < r.pttl(k) <= 30_000
    assert shard_row(db, batch.batch_id, "BKK").status == "PENDING"


def test_the_heartbeat_thread_stops_the_work_when_the_lock_is_lost(
    db: SyncDatabase, make_batch: MakeBatch, locks: ClaimLockConfig, r: redis.Redis
):
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=settings(locks))
    work = ShardWork(lease)
    with work as heartbeat:
        r.delete(key(locks, lease))
        deadline = time.monotonic() + 60
        while not heartbeat.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        heartbeat.check()  # the work's own check between pages
        pytest.fail("the work went on without its claim lock")
    assert isinstance(work.lost, ClaimLockLost) and work.error is None
    assert shard_row(db, batch.batch_id, "BKK").status == "PENDING"


def test_a_lease_update_that_fails_stops_the_work_while_the_lock_holds(
    db: SyncDatabase, make_batch: MakeBatch, locks: ClaimLockConfig, r: redis.Redis
):
    batch = make_batch(["BKK", "SIN"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=settings(locks))
    k = key(locks, lease)
    with db.begin() as conn:  # another worker took the shard in the database
        conn.execute(
            sa.update(schema.shard)
            .where(schema.shard.c.id == lease.shard_id)
            .values(worker_id="w2", lease_token="t2")
        )
    assert r.get(k) == value(lease)
    with pytest.raises(LeaseLost) as lost:
        lease.heartbeat()
    assert not isinstance(lost.value, ClaimLockLost)
    assert lease.lost and r.get(k) is None  # its own lock goes with it
    assert shard_row(db, batch.batch_id, "BKK").worker_id == "w2"
    # A cancelled batch: the same, for the other shard.
    other = claim_shard(db, batch.batch_id, "SIN", worker_id="w1", settings=settings(locks))
    cancel_batch(db, batch.batch_id, "stop")
    assert r.get(key(locks, other)) == value(other)
    with pytest.raises(LeaseLost):
        other.heartbeat()
    assert r.get(key(locks, other)) is None


def test_the_lock_of_a_dead_local_holder_is_replaced_with_its_lease(
    db: SyncDatabase, make_batch: MakeBatch, locks: ClaimLockConfig, r: redis.Redis
):
    batch = make_batch(["BKK"])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = make_worker_id("other").rsplit("-", 2)[0] + f"-{child.pid}-20260101T000000Z"
        held = claim_shard(db, batch.batch_id, "BKK", worker_id=dead, settings=settings(locks))
        with pytest.raises(ClaimLockHeld):
            claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=settings(locks))
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ClaimLockHeld):  # only this host's own dead processes
        claim_shard(
            db,
            batch.batch_id,
            "BKK",
            worker_id="w2",
            settings=settings(locks),
            reclaim_dead_local=False,
        )
    taken = claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=settings(locks))
    assert r.get(key(locks, taken)) == value(taken) != value(held)
    assert taken.claim_count == 2


# ---------------------------------------------------------------- Redis down


def test_without_redis_the_database_alone_decides(
    db: SyncDatabase, make_batch: MakeBatch, redis_url: str
):
    down = ClaimLockConfig(f"redis://127.0.0.1:{free_port()}/0", retry_seconds=60)
    batch = make_batch(["BKK"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=settings(down))
    assert lease.claim_lock is not None and not lease.claim_lock.held
    with pytest.raises(LeaseNotAcquired, match="live lease") as refused:
        claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=settings(down))
    assert not isinstance(refused.value, ClaimLockHeld)
    lease.heartbeat()  # the lease is renewed; the lock is not there to renew
    lease.advance(Checkpoint("BKK", page=2), PageCounts(success=1))
    lease.finish("SUCCESS")
    assert get_shard(db, batch.batch_id, "BKK").status == "SUCCESS"


def test_redis_down_mid_work_then_back_the_lock_is_taken_again(
    db: SyncDatabase, make_batch: MakeBatch, own_redis: RedisServer
):
    config = ClaimLockConfig(own_redis.url, retry_seconds=0.1)
    batch = make_batch(["BKK", "SIN"])
    lease = claim_shard(db, batch.batch_id, "BKK", worker_id="w1", settings=settings(config))
    k = key(config, lease)
    own_redis.stop()
    before = shard_row(db, batch.batch_id, "BKK").heartbeat_at
    lease.heartbeat()  # Redis down: the database lease alone decides, the work goes on
    lease.advance(Checkpoint("BKK", page=2), PageCounts(success=1))
    assert shard_row(db, batch.batch_id, "BKK").heartbeat_at >= before
    assert lease.claim_lock is not None and not lease.claim_lock.held
    own_redis.start()  # back, empty
    time.sleep(0.2)  # past the retry interval
    lease.heartbeat()
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    assert client.get(k) == value(lease) and lease.claim_lock.held
    with pytest.raises(ClaimLockHeld):  # the accelerator works again
        claim_shard(db, batch.batch_id, "BKK", worker_id="w2", settings=settings(config))
    # Down again, and back with the lock held by another: the work stops.
    other = claim_shard(db, batch.batch_id, "SIN", worker_id="w1", settings=settings(config))
    own_redis.stop()
    other.heartbeat()
    own_redis.start()
    time.sleep(0.2)
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    client.set(key(config, other), OTHER, px=30_000)
    with pytest.raises(ClaimLockLost):
        other.heartbeat()
    assert shard_row(db, batch.batch_id, "SIN").status == "PENDING"
    assert client.get(key(config, other)) == OTHER
    client.close()


# ---------------------------------------------------------------- settings


def test_the_setting_turns_the_locks_on_and_needs_redis(
    monkeypatch: pytest.MonkeyPatch, redis_url: str
):
    monkeypatch.delenv("SUPPLIER_SYNC_REDIS_URL", raising=False)
    assert claim_locks_from_env() is None and LeaseSettings().claim_locks is None
    monkeypatch.setenv("SUPPLIER_SYNC_CLAIM_LOCKS", "1")
    with pytest.raises(ConfigError, match="SUPPLIER_SYNC_CLAIM_LOCKS needs SUPPLIER_SYNC_REDIS"):
        claim_locks_from_env()
    monkeypatch.setenv("SUPPLIER_SYNC_REDIS_URL", redis_url)
    lease_settings = LeaseSettings()
    assert lease_settings.claim_locks == ClaimLockConfig(redis_url)
    # Lease settings travel to worker processes.
    assert pickle.loads(pickle.dumps(lease_settings)) == lease_settings
    assert "6379" not in repr(lease_settings)
    monkeypatch.setenv("SUPPLIER_SYNC_CLAIM_LOCKS", "perhaps")
    with pytest.raises(ConfigError, match="SUPPLIER_SYNC_CLAIM_LOCKS"):
        LeaseSettings()
    monkeypatch.setenv("SUPPLIER_SYNC_CLAIM_LOCKS", "0")
    assert LeaseSettings().claim_locks is None


# ---------------------------------------------------------------- end to end


def test_sync_full_with_claim_locks_on_mariadb_publishes_the_ground_truth(
    fresh_mysql_db: str,
    own_redis: RedisServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
):
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "home"))
    dagster_home = tmp_path / "dagster_home"
    dagster_home.mkdir()
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    monkeypatch.setenv("SUPPLIER_SYNC_REDIS_URL", own_redis.url)
    monkeypatch.setenv("SUPPLIER_SYNC_CLAIM_LOCKS", "1")
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    client.config_set("notify-keyspace-events", "Kg$x")
    events = client.pubsub()
    events.psubscribe("__keyspace@0__:supplier-sync:claim:*")
    sim = simulator(n_cities=6, total_hotels=600, faults={"bad_record_rate": 0.05})
    truth = sim.ground_truth()
    with supplier(sim, monkeypatch):
        done = sync(capsys, fresh_mysql_db, "--processes", "2", "--json", "--trigger-id", "locks-1")
    assert done.code == 0, done
    summary = json.loads(done.out)
    assert summary["status"] == "SUCCESS" and summary["counts_add_up"], summary
    assert published(fresh_mysql_db) == truth.valid
    shards = query(fresh_mysql_db, sa.select(schema.shard.c.shard_key, schema.shard.c.claim_count))
    assert shards and {n for _, n in shards} == {1}
    # Every city was claimed through its lock, once, and every lock was deleted at its end.
    seen: dict[str, list[str]] = {}
    while (message := events.get_message(timeout=1.0)) is not None:
        if message["type"] == "pmessage":
            lock = message["channel"].removeprefix("__keyspace@0__:supplier-sync:claim:")
            city = lock.split(":", 1)[1]
            seen.setdefault(city, []).append(message["data"])
    assert set(seen) == {key for key, _ in shards}
    for city, happened in seen.items():
        assert happened.count("set") == 1 and happened[-1] == "del", (city, happened)
    assert client.keys("supplier-sync:claim:*") == []
    events.close()
    client.close()
