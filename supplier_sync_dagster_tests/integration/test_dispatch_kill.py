"""kill -9 a dispatcher in the middle of a batch, on MariaDB, PostgreSQL, Redis and RabbitMQ:
after the stuck pass, every hotel has exactly one search document at its latest version and
a queue bound to the exchange received every event at least once."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

from supplier_sync_dagster.core.outbox.machine import (
    DEFAULT_LEASE_SECONDS,
    outbox_status,
    release_stuck,
)
from supplier_sync_dagster.core.outbox.projections import PostgresSearchIndex
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.core.records.test_catalog import hotel, sync
from supplier_sync_dagster_tests.helpers import BoundQueue, cli_process


def _dispatch(db_url: str, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    proc: subprocess.Popen[str] = cli_process(
        "--db-url", db_url, "dispatch", "--batch-size", "25", "--processes", "1", *extra, env=env
    )
    return proc


def test_a_killed_dispatcher_loses_nothing(
    fresh_mysql_db: str, fresh_postgres_db: str, redis_url: str, amqp_url: str, tmp_path: Path
):
    db = SyncDatabase.open(fresh_mysql_db)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPPLIER_SYNC_")}
    env.update(
        SUPPLIER_SYNC_HOME=str(tmp_path / "home"),
        SUPPLIER_SYNC_SEARCH_URL=fresh_postgres_db,
        SUPPLIER_SYNC_REDIS_URL=redis_url,
        SUPPLIER_SYNC_AMQP_URL=amqp_url,
    )
    # The CLI publishes to the default exchange, which other tests use too: this test's
    # messages are told apart by their batch ids.
    batches = (f"kill-{uuid.uuid4().hex[:8]}", f"kill-{uuid.uuid4().hex[:8]}")
    hotels = 400
    sync(db, batches[0], [hotel(f"K{i}") for i in range(hotels)])
    sync(db, batches[1], [hotel(f"K{i}", 2, facilities=["wifi"]) for i in range(0, hotels, 4)])
    events = outbox_status(db).total("READY")
    with BoundQueue(amqp_url, "supplier_sync.events") as queue:
        victim = _dispatch(fresh_mysql_db, env, "--threads", "1")
        deadline = time.monotonic() + 60
        while outbox_status(db).total("SUCCEEDED") < events // 4:
            assert victim.poll() is None, victim.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        half = outbox_status(db)
        assert half.total("SUCCEEDED") < events  # killed mid-way
        # Whatever it held stays PROCESSING until its lease expires; the stuck pass (with
        # this process's clock moved past the lease) frees it.
        db.clock.advance(DEFAULT_LEASE_SECONDS + 1)
        freed = release_stuck(db)
        assert sum(freed.values()) == half.total("PROCESSING")
        finisher = _dispatch(fresh_mysql_db, env, "--once")
        out, err = finisher.communicate(timeout=120)
        assert finisher.returncode == 0, err
        received = [m for m in queue.drain() if m.headers.get("batch_id") in batches]
    status = outbox_status(db)
    assert status.total("SUCCEEDED") == events, status
    # Every event reached the queue at least once (a killed batch may deliver twice).
    with db.engine.connect() as conn:
        ids = {r[0] for r in conn.exec_driver_sql("SELECT event_id FROM supplier_sync_outbox")}
    assert {m.message_id for m in received} == ids
    # Exactly one document per hotel, each at its latest publish version.
    index = PostgresSearchIndex(fresh_postgres_db)
    try:
        versions = index.versions()
    finally:
        index.close()
    with db.engine.connect() as conn:
        catalog: dict[int, int] = dict(
            conn.exec_driver_sql(
                "SELECT resource_id, publish_version FROM platform_hotel_resource"
            ).all()
        )
    assert versions == {int(k): int(v) for k, v in catalog.items()}
    assert sorted(set(versions.values())) == [1, 2]
    db.dispose()
