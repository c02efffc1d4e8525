"""Benchmark the sync health figures and the Prometheus scrape (issue #20).

Builds, in a throwaway ``bench_sync_<random>`` MariaDB database (or a SQLite file), what a
large deployment's sync database holds: ``--hotels`` published hotels with one finished outbox
event each (plus a few thousand READY ones), ``--dead-letters`` dead letters over the last
week in every state, a week of nightly full-sync batches of ``--cities`` cities (shards, city
profiles with field counts, run stats), and pending reviews. Then:

1. ``sync_health`` for the task, ``--repeat`` times: the median and worst wall time
   (target <= 2 s on MariaDB), and the number of statements it ran;
2. ``metrics serve`` in this process on a free port: ``--scrapes`` scrapes of ``/metrics``
   from the cached figures, median and worst (target <= 200 ms), parsed with
   prometheus_client's parser.

Usage:
    .venv/bin/python bench/bench_metrics.py [--hotels 1000000] [--dead-letters 100000]
        [--cities 1000] [--backend mariadb|sqlite]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MYSQL_URL, mariadb_databases, mariadb_url

from supplier_sync_dagster.core.health.metrics import sync_health
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.serve.metrics import serve

TASK = "hotel_supplier_full_resource"
TARGET_HEALTH_S = 2.0
TARGET_SCRAPE_S = 0.2
CHUNK = 10_000


def _insert(conn: sa.Connection, table: sa.Table, rows: list[dict[str, Any]]) -> None:
    for start in range(0, len(rows), CHUNK):
        conn.execute(sa.insert(table), rows[start : start + CHUNK])


def build(db: SyncDatabase, args: argparse.Namespace) -> None:
    """The data (see the module docstring); inserted in chunks, by plain INSERTs."""
    rng = random.Random(7)
    now = datetime.now(UTC).replace(tzinfo=None)
    cities = [f"C{i:04d}" for i in range(args.cities)]
    began = time.perf_counter()
    with db.begin() as conn:
        conn.execute(
            sa.insert(schema.task).values(
                task_code=TASK,
                supplier_id=1001,
                category_code="HOTEL",
                sync_mode="FULL",
                data_scope="RESOURCE",
                schedule_type="CRON",
                cron_expr="0 2 * * *",
                status="ENABLED",
                concurrency_policy="SKIP_IF_RUNNING",
                created_at=now,
                updated_at=now,
            )
        )
        per_city = max(1, args.hotels // len(cities))
        for day in range(7, 0, -1):
            batch_id = f"b_bench_{day}"
            started = now - timedelta(days=day - 1, hours=3)
            conn.execute(
                sa.insert(schema.batch).values(
                    batch_id=batch_id,
                    task_code=TASK,
                    trigger_source="CRON",
                    trigger_id=f"night-{day}",
                    supplier_id=1001,
                    category_code="HOTEL",
                    sync_mode="FULL",
                    data_scope="RESOURCE",
                    status="SUCCESS" if day != 3 else "PARTIAL_FAILED",
                    sync_batch_version=8 - day,
                    shard_count=len(cities),
                    shards_done=len(cities),
                    success_count=args.hotels,
                    total_count=args.hotels,
                    created_at=started,
                    updated_at=started + timedelta(minutes=40),
                    started_at=started,
                    finished_at=started + timedelta(minutes=40),
                )
            )
            _insert(
                conn,
                schema.shard,
                [
                    {
                        "batch_id": batch_id,
                        "shard_type": "CITY",
                        "shard_key": c,
                        "status": "SUCCESS" if (day != 3 or i % 50) else "FAILED",
                        "created_at": started,
                        "updated_at": started + timedelta(minutes=30),
                        "finished_at": started + timedelta(minutes=rng.randint(1, 40)),
                    }
                    for i, c in enumerate(cities)
                ],
            )
            fields = {
                "hotel_id": per_city,
                "name": per_city,
                "phone": per_city - 2,
                "geo": per_city,
            }
            _insert(
                conn,
                schema.city_profile,
                [
                    {
                        "batch_id": batch_id,
                        "task_code": TASK,
                        "shard_key": c,
                        "record_count": per_city,
                        "bad_count": rng.randint(0, 3),
                        "field_counts": {"records": per_city, "fields": fields},
                        "created_at": started,
                        "updated_at": started,
                    }
                    for c in cities
                ],
            )
            conn.execute(
                sa.insert(schema.run_stats).values(
                    batch_id=batch_id,
                    task_code=TASK,
                    worker_id="bench",
                    cities=len(cities),
                    records=args.hotels,
                    published=args.hotels,
                    requests=args.hotels // 100 + len(cities),
                    throttled=rng.randint(0, 50),
                    retries=rng.randint(0, 200),
                    seconds=2400.0,
                    created_at=started + timedelta(minutes=40),
                )
            )
    print(f"batches, shards, profiles: {time.perf_counter() - began:.0f}s", flush=True)
    began = time.perf_counter()
    statuses = ["RESOLVED"] * 6 + ["MANUAL_FIX"] * 2 + ["PENDING", "FAILED", "IGNORED"]
    codes = ["INVALID_PHONE", "UNKNOWN_CURRENCY", "SUPPLIER_UNAVAILABLE", "MISSING_REQUIRED_FIELD"]
    with db.begin() as conn:
        rows = []
        for i in range(args.dead_letters):
            created = now - timedelta(seconds=rng.randint(0, 7 * 86_400))
            status = statuses[i % len(statuses)]
            rows.append(
                {
                    "dead_letter_id": f"dl_bench_{i}",
                    "batch_id": f"b_bench_{1 + i % 7}",
                    "task_code": TASK,
                    "sync_mode": "FULL",
                    "category_code": "HOTEL",
                    "supplier_id": 1001,
                    "supplier_resource_code": f"H{i:09d}",
                    "record_position": f"record#{i % 100}",
                    "error_stage": "VALIDATION",
                    "error_type": "NON_RETRYABLE",
                    "error_code": codes[i % len(codes)],
                    "error_message": "bench",
                    "raw_payload_hash": "-",
                    "status": status,
                    "retry_count": 0,
                    "max_retry_count": 5,
                    "created_at": created,
                    "updated_at": created,
                    "resolved_at": created + timedelta(hours=2) if status == "RESOLVED" else None,
                    "city_code": cities[i % len(cities)],
                }
            )
        _insert(conn, schema.dead_letter, rows)
    print(f"{args.dead_letters} dead letters: {time.perf_counter() - began:.0f}s", flush=True)
    began = time.perf_counter()
    for start in range(0, args.hotels, 100_000):
        with db.begin() as conn:
            _insert(
                conn,
                schema.platform_hotel,
                [
                    {
                        "resource_id": i + 1,
                        "supplier_id": 1001,
                        "supplier_hotel_id": f"H{i:09d}",
                        "supplier_version": 1,
                        "publish_version": 1,
                        "fingerprint": "f" * 64,
                        "name": f"Hotel {i}",
                        "city_code": cities[i % len(cities)],
                        "country_code": "TH",
                        "lat": 13.7,
                        "lng": 100.5,
                        "status": "ACTIVE",
                        "supplier_updated_at": now,
                        "last_batch_id": "b_bench_1",
                        "publish_token": "t",
                        "published_at": now,
                    }
                    for i in range(start, min(args.hotels, start + 100_000))
                ],
            )
            _insert(
                conn,
                schema.outbox,
                [
                    {
                        "event_id": f"ev_{i}",
                        "event_type": "HotelResourceUpdated",
                        "aggregate_type": "HOTEL",
                        "aggregate_id": i + 1,
                        "aggregate_version": 1,
                        "batch_id": "b_bench_1",
                        "payload": "{}",
                        "status": "SUCCEEDED" if i < args.hotels - 2000 else "READY",
                        "current_stage": "NOTIFY" if i < args.hotels - 2000 else "PUBLISHED",
                        "next_stage": "END" if i < args.hotels - 2000 else "SEARCH_INDEX",
                        "created_at": now - timedelta(seconds=10),
                        "projected_at": now - timedelta(seconds=rng.uniform(0, 9)),
                        "finished_at": now,
                        "next_attempt_at": now,
                    }
                    for i in range(start, min(args.hotels, start + 100_000))
                ],
            )
        print(f"  {min(args.hotels, start + 100_000)} hotels and events", flush=True)
    print(f"hotels and outbox: {time.perf_counter() - began:.0f}s", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["mariadb", "sqlite"], default="mariadb")
    parser.add_argument("--hotels", type=int, default=1_000_000)
    parser.add_argument("--dead-letters", type=int, default=100_000)
    parser.add_argument("--cities", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--mysql-url", default=MYSQL_URL)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.backend == "sqlite":
            return _run(f"sqlite:///{tmp}/sync.sqlite3", args)
        with mariadb_databases(["sync"], args.mysql_url) as names:
            return _run(mariadb_url(names[0], args.mysql_url), args)


def _run(url: str, args: argparse.Namespace) -> int:
    db = SyncDatabase.open(url)
    try:
        build(db, args)
        statements = 0

        def count(*_: Any) -> None:
            nonlocal statements
            statements += 1

        sa.event.listen(db.engine, "before_cursor_execute", count)
        walls = []
        for _ in range(args.repeat):
            began = time.perf_counter()
            health = sync_health(db, task_code=TASK)
            walls.append(time.perf_counter() - began)
        sa.event.remove(db.engine, "before_cursor_execute", count)
        walls.sort()
        ok = walls[-1] <= TARGET_HEALTH_S
        print(
            f"sync_health on {args.hotels:,} hotels, {args.dead_letters:,} dead letters, "
            f"{args.cities} cities x 7 nights ({args.backend}): median "
            f"{statistics.median(walls):.3f}s, worst {walls[-1]:.3f}s (target <= "
            f"{TARGET_HEALTH_S:g}s: {'MET' if ok else 'MISSED'}); "
            f"{statements // args.repeat} statements each"
        )
        print("  " + json.dumps({k: round(v, 4) for k, v in health.values().items()}))
        port = _free_port()
        stop = threading.Event()
        server = threading.Thread(
            target=serve,
            args=(db, [TASK]),
            kwargs={"port": port, "host": "127.0.0.1", "interval": 3600, "stop": stop},
            daemon=True,
        )
        server.start()
        scrapes = []
        body = ""
        with httpx.Client(timeout=10) as http:
            deadline = time.monotonic() + 60
            while True:
                try:
                    http.get(f"http://127.0.0.1:{port}/metrics")
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            for _ in range(args.scrapes):
                began = time.perf_counter()
                body = http.get(f"http://127.0.0.1:{port}/metrics").text
                scrapes.append(time.perf_counter() - began)
        stop.set()
        server.join(timeout=10)
        families = list(text_string_to_metric_families(body))
        samples = sum(len(f.samples) for f in families)
        scrapes.sort()
        fast = scrapes[-1] <= TARGET_SCRAPE_S
        print(
            f"scrape of /metrics from the cached figures: median "
            f"{statistics.median(scrapes) * 1000:.1f} ms, worst {scrapes[-1] * 1000:.1f} ms "
            f"(target <= {TARGET_SCRAPE_S * 1000:g} ms: {'MET' if fast else 'MISSED'}); "
            f"{len(families)} families, {samples} samples, {len(body):,} bytes"
        )
        return 0 if ok and fast else 1
    finally:
        db.dispose()


if __name__ == "__main__":
    sys.exit(main())
