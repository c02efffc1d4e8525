"""The claim storm on MariaDB, with and without the Redis claim locks.

Usage:
    .venv/bin/python bench/bench_claims.py [--shards 10000] [--hosts 4] [--threads 2]
        [--rounds 2] [--mysql-url mysql+pymysql://root@127.0.0.1:3306]
        [--redis-url redis://127.0.0.1:6379/14] [--markdown]

Each round makes a batch of ``--shards`` shards and starts ``--hosts`` worker processes,
each with its own ``HOSTNAME`` and ``--threads`` threads that call ``claim_next_shard``
until none is left (no work between claims: the start of a large backfill, when every
worker asks for a shard at once). The rounds alternate: without the locks, then with
them, so the machine's other load falls on both alike. Per round it prints claims per
second, the CPU-seconds of the ``mariadbd`` and ``redis-server`` processes (utime + stime
from ``/proc`` before and after) and of the workers, the statements the workers sent,
the claims that reached the database and lost, and InnoDB's row lock waits and deadlocks
(server-wide counters); then the ratios of the medians. ``--markdown`` prints the table
for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MYSQL_URL, mariadb_databases
from bench_pipeline import calibrate

from supplier_sync_dagster.core.errors import ClaimLockHeld, LeaseNotAcquired
from supplier_sync_dagster.core.leasing import leases
from supplier_sync_dagster.core.leasing.batches import (
    TaskSpec,
    add_shards,
    cancel_batch,
    create_batch,
    upsert_task,
)
from supplier_sync_dagster.core.leasing.claim_locks import ClaimLockConfig
from supplier_sync_dagster.core.leasing.leases import (
    LeaseSettings,
    claim_next_shard,
    make_worker_id,
)
from supplier_sync_dagster.core.store.db import SyncDatabase

REDIS_URL = "redis://127.0.0.1:6379/14"
TASK = "bench_claims"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu(name: str) -> float:
    """CPU-seconds (utime + stime) of every process called ``name``."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != name:
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def innodb_status(url: str) -> dict[str, int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SHOW GLOBAL STATUS WHERE Variable_name IN "
                    "('Innodb_row_lock_waits', 'Innodb_deadlocks', 'Innodb_row_lock_time')"
                )
            ).all()
    finally:
        engine.dispose()
    return {str(name): int(value) for name, value in rows}


# ---------------------------------------------------------------- a worker host


def worker(db_url: str, batch_id: str, threads: int, redis_url: str | None, prefix: str) -> None:
    """One host: ``threads`` claimers until the batch has no claimable shard; prints JSON."""
    config = ClaimLockConfig(redis_url, key_prefix=prefix) if redis_url else None
    settings = LeaseSettings(lease_seconds=1800, heartbeat_seconds=20, claim_locks=config)
    db = SyncDatabase.open(db_url, create_schema=False)
    sent = [0]
    sa.event.listen(db.engine, "before_cursor_execute", lambda *a: _add(sent))
    lost_in_db, skipped = [0], [0]
    claim_shard = leases.claim_shard

    def counted(*args: Any, **kwargs: Any) -> leases.ShardLease:
        try:
            return claim_shard(*args, **kwargs)
        except ClaimLockHeld:
            _add(skipped)
            raise
        except LeaseNotAcquired:
            _add(lost_in_db)
            raise

    leases.claim_shard = counted
    claimed = [0]

    def run() -> None:
        wid = make_worker_id("bench") + f"-t{threading.get_ident() % 1000}"
        wid = wid[-64:]
        while claim_next_shard(db, batch_id, worker_id=wid, settings=settings) is not None:
            _add(claimed)

    with db.engine.connect() as conn:  # connected and imported: ready
        conn.execute(sa.text("SELECT 1"))
    print("ready", flush=True)
    sys.stdin.readline()  # the start signal: every host starts together
    start = time.perf_counter()
    pool = [threading.Thread(target=run) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - start
    cpu = os.times()
    print(
        json.dumps(
            {
                "host": os.environ.get("HOSTNAME"),
                "claimed": claimed[0],
                "statements": sent[0],
                "lost_in_db": lost_in_db[0],
                "skipped_by_lock": skipped[0],
                "seconds": seconds,
                "cpu": cpu.user + cpu.system,
            }
        ),
        flush=True,
    )
    db.dispose()


_counter_lock = threading.Lock()


def _add(counter: list[int]) -> None:
    with _counter_lock:
        counter[0] += 1


# ---------------------------------------------------------------- one round


def one_round(
    db_url: str, shards: int, hosts: int, threads: int, redis_url: str | None
) -> dict[str, Any]:
    db = SyncDatabase.open(db_url)
    batch = create_batch(
        db,
        task_code=TASK,
        trigger_id=f"round-{uuid.uuid4().hex[:8]}",
        trigger_source="MANUAL",
    ).batch
    assert batch is not None
    keys = [f"C{i:05d}" for i in range(shards)]
    for i in range(0, shards, 1000):  # as a backfill's runs bring their cities
        add_shards(db, batch.batch_id, keys[i : i + 1000])
    db.dispose()
    prefix = f"bench-claims:{uuid.uuid4().hex[:8]}:"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                db_url,
                batch.batch_id,
                str(threads),
                redis_url or "",
                prefix,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "HOSTNAME": f"bench-host-{i}"},
        )
        for i in range(hosts)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    status0 = innodb_status(db_url)
    mariadb0, redis0 = process_cpu("mariadbd"), process_cpu("redis-server")
    start = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [json.loads(p.communicate()[0]) for p in procs]
    wall = time.perf_counter() - start
    mariadb1, redis1 = process_cpu("mariadbd"), process_cpu("redis-server")
    status1 = innodb_status(db_url)
    db = SyncDatabase.open(db_url, create_schema=False)
    cancel_batch(db, batch.batch_id, "bench round over")
    db.dispose()
    if redis_url:
        _clear(redis_url, prefix)
    claimed = sum(o["claimed"] for o in outs)
    if claimed != shards:
        raise SystemExit(f"{claimed} claims of {shards} shards: every shard must be claimed once")
    return {
        "locks": bool(redis_url),
        "claims": claimed,
        "wall": wall,
        "claims_per_s": claimed / wall,
        "mariadb_cpu": mariadb1 - mariadb0,
        "redis_cpu": redis1 - redis0,
        "worker_cpu": sum(o["cpu"] for o in outs),
        "statements": sum(o["statements"] for o in outs),
        "lost_in_db": sum(o["lost_in_db"] for o in outs),
        "skipped_by_lock": sum(o["skipped_by_lock"] for o in outs),
        "lock_waits": status1["Innodb_row_lock_waits"] - status0["Innodb_row_lock_waits"],
        "lock_wait_ms": status1["Innodb_row_lock_time"] - status0["Innodb_row_lock_time"],
        "deadlocks": status1.get("Innodb_deadlocks", 0) - status0.get("Innodb_deadlocks", 0),
        "per_host": {o["host"]: o["claimed"] for o in outs},
    }


def _clear(redis_url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    for i in range(0, len(keys), 1000):
        client.delete(*keys[i : i + 1000])
    client.close()


def line(r: dict[str, Any]) -> str:
    return (
        f"{'locks' if r['locks'] else 'no locks':<9} claims/s={r['claims_per_s']:7.1f}  "
        f"mariadbd CPU={r['mariadb_cpu']:6.2f} s  redis CPU={r['redis_cpu']:5.2f} s  "
        f"workers CPU={r['worker_cpu']:6.2f} s  statements={r['statements']:>7}  "
        f"lost in db={r['lost_in_db']:>6}  skipped by lock={r['skipped_by_lock']:>6}  "
        f"row lock waits={r['lock_waits']} ({r['lock_wait_ms']} ms)  deadlocks={r['deadlocks']}  "
        f"per host={sorted(r['per_host'].values())}"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        db_url, batch_id, threads, redis_url, prefix = sys.argv[2:7]
        worker(db_url, batch_id, int(threads), redis_url or None, prefix)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="claimers per host")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each mode")
    parser.add_argument("--mysql-url", default=MYSQL_URL)
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    print(
        f"{args.shards} shards, {args.hosts} hosts x {args.threads} claimers, "
        f"{args.rounds} rounds of each mode (alternating); machine speed "
        f"{calibrate():.2f}s for 10M Python additions",
        flush=True,
    )
    results: list[dict[str, Any]] = []
    with mariadb_databases(["claims"], args.mysql_url) as (name,):
        db_url = f"{args.mysql_url}/{name}"
        db = SyncDatabase.open(db_url)
        upsert_task(db, TaskSpec(task_code=TASK, supplier_id=1))
        db.dispose()
        for _ in range(args.rounds):
            for mode in (None, args.redis_url):
                r = one_round(db_url, args.shards, args.hosts, args.threads, mode)
                results.append(r)
                print(line(r), flush=True)
    summary = summarize(results)
    print(
        "ratios of the medians, locks / no locks: "
        + "  ".join(f"{k}={v:.2f}" for k, v in summary.items())
    )
    if args.markdown:
        print(markdown(args, results, summary))


def summarize(results: list[dict[str, Any]]) -> dict[str, float]:
    def med(locks: bool, key: str) -> float:
        return statistics.median(r[key] for r in results if r["locks"] == locks)

    out = {}
    for key in ("claims_per_s", "mariadb_cpu", "statements", "worker_cpu"):
        base = med(False, key)
        out[key] = med(True, key) / base if base else float("nan")
    return out


def markdown(
    args: argparse.Namespace, results: list[dict[str, Any]], summary: dict[str, float]
) -> str:
    rows = [
        "| mode | claims/s | mariadbd CPU-s | redis CPU-s | workers CPU-s | statements | "
        "claims lost in the database | skipped by a lock | row lock waits | deadlocks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {'locks' if r['locks'] else 'no locks'} | {r['claims_per_s']:.0f} | "
            f"{r['mariadb_cpu']:.2f} | {r['redis_cpu']:.2f} | {r['worker_cpu']:.2f} | "
            f"{r['statements']} | {r['lost_in_db']} | {r['skipped_by_lock']} | "
            f"{r['lock_waits']} | {r['deadlocks']} |"
        )
    rows.append("")
    rows.append(
        "Ratios of the medians, locks / no locks: "
        + ", ".join(f"{k} {v:.2f}" for k, v in summary.items())
        + f" (`{' '.join(['bench/bench_claims.py', *sys.argv[1:]])}`)"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
