"""Cost of one checkpoint advance (one fenced UPDATE in its own transaction).

Usage:
    .venv/bin/python bench/bench_checkpoint.py [--n 2000] [--mysql-url mysql+pymysql://root@127.0.0.1:3306]

Measures, on the embedded SQLite default and on MariaDB/MySQL, the wall time of
``ShardLease.advance`` (counts + checkpoint + progress + heartbeat, fenced by worker and
lease token) over N consecutive pages of one shard, and also a heartbeat, then prints the
median, p95 and mean. A throwaway SQLite file and a throwaway MySQL database are used.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import TaskSpec, create_batch, upsert_task
from supplier_sync_dagster.core.leasing.leases import (
    Checkpoint,
    LeaseSettings,
    PageCounts,
    claim_shard,
)
from supplier_sync_dagster.core.store.db import SyncDatabase


def _timings(n: int, op: Callable[[int], None]) -> list[float]:
    out = []
    for i in range(n):
        start = time.perf_counter()
        op(i)
        out.append(time.perf_counter() - start)
    return out


def _summary(name: str, samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[int(len(ms) * 0.95) - 1]
    return (
        f"{name:<36} n={len(ms):>5}  median={statistics.median(ms):7.3f} ms  "
        f"p95={p95:7.3f} ms  mean={statistics.fmean(ms):7.3f} ms"
    )


def bench(url: str, label: str, n: int) -> list[str]:
    db = SyncDatabase.open(url)
    upsert_task(db, TaskSpec(task_code="bench", supplier_id=1))
    batch = create_batch(
        db,
        task_code="bench",
        trigger_id=f"bench-{uuid.uuid4().hex[:8]}",
        trigger_source="MANUAL",
        shard_keys=["BKK"],
    ).batch
    assert batch is not None
    lease = claim_shard(
        db, batch.batch_id, "BKK", worker_id="bench", settings=LeaseSettings(180, 20)
    )
    for i in range(20):  # warm the pool and the statement cache
        lease.advance(Checkpoint("BKK", page=i + 2), PageCounts(success=1))

    def advance(i: int) -> None:
        lease.advance(
            Checkpoint(
                "BKK", page=i + 100, cursor=f"cursor-{i}", last_supplier_hotel_id=f"H{i:07d}"
            ),
            PageCounts(success=97, failed=2, skipped=1),
            total_pages=n + 200,
        )

    lines = [
        _summary(f"{label}: checkpoint advance", _timings(n, advance)),
        _summary(
            f"{label}: heartbeat", _timings(n, lambda i: lease.heartbeat("FETCHING", f"p{i}"))
        ),
    ]
    db.dispose()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=2000, help="advances per backend (>= 1000)")
    parser.add_argument("--mysql-url", default="mysql+pymysql://root@127.0.0.1:3306")
    parser.add_argument("--skip-mysql", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        for line in bench(f"sqlite:///{Path(tmp) / 'bench.sqlite3'}", "SQLite (WAL, file)", args.n):
            print(line, flush=True)
    if not args.skip_mysql:
        name = f"sst_bench_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(args.mysql_url)
        with admin.begin() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        try:
            for line in bench(
                f"{args.mysql_url.rstrip('/')}/{name}", "MariaDB (InnoDB, loopback)", args.n
            ):
                print(line, flush=True)
        finally:
            with admin.begin() as conn:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")


if __name__ == "__main__":
    main()
