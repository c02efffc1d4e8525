"""Benchmark the outbox's dispatchers (issue #17): events/s through every stage, alone and
while a sync runs, on MariaDB + PostgreSQL + Redis + RabbitMQ (or the embedded defaults).

Modes (``--mode``):
  alone     ``--hotels N`` hotels are published straight through the publish code (three
            events each: HotelResourceUpdated runs SEARCH_INDEX -> CACHE -> NOTIFY, the
            other two NOTIFY), then ``supplier-sync dispatch`` runs as a process until the
            outbox is drained. Reports events/s (each event through all its stages) from the
            command's start, and from the first event done to the last; a queue bound to
            the exchange counts what subscribers received (every event at least once).
  with-sync ``supplier-sync dispatch`` runs as a process while ``supplier-sync sync --full``
            syncs ``--hotels`` hotels from the simulator over HTTP; reports the events/s
            through every stage during the sync, how long after the sync's last publish the
            outbox was drained, and the lag (publish -> search index, publish -> end of
            chain) p50/p95/max.

``--threads``/``--processes`` are passed to ``dispatch``; without them it runs its defaults
(on MariaDB two processes per core, one dispatcher each).

Usage:
    .venv/bin/python bench/bench_dispatch.py --mode alone --hotels 50000
    .venv/bin/python bench/bench_dispatch.py --mode with-sync --hotels 100000 --cities 100
    .venv/bin/python bench/bench_dispatch.py --mode alone --embedded   # SQLite, FTS5, files
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import API_KEY, mariadb_databases, mariadb_url, prewarm
from bench_client import ServerProcess
from bench_pipeline import calibrate

from supplier_sync_dagster.core.outbox.machine import outbox_status
from supplier_sync_dagster.core.outbox.projections import (
    DEFAULT_EXCHANGE,
    ProjectionSettings,
)
from supplier_sync_dagster.core.records.diff import Candidate, compute_diffs, record_diffs
from supplier_sync_dagster.core.records.mapping import ensure_hotel_mappings
from supplier_sync_dagster.core.records.publish import publish_hotels
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.simulator import FaultProfile, SimulatorConfig
from supplier_sync_dagster_tests.helpers import BoundQueue

BIN = Path(sys.executable).parent
PG_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_URL = "redis://127.0.0.1:6379/13"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
TARGET_EVENTS_PER_S = 5000.0
TARGET_DRAIN_S = 30.0
TARGET_LAG_P95_S = 2.0


def _doc(i: int) -> dict[str, Any]:
    return {
        "supplier_hotel_id": f"B{i:08d}",
        "name": f"Bench Hotel {i}",
        "name_local": None,
        "city_code": f"C{i % 100:03d}",
        "country_code": "JP",
        "address_line1": f"{i} Bench Road",
        "postal_code": "100-0001",
        "lat": 35.0 + (i % 1000) / 1000,
        "lng": 139.0 + (i % 1000) / 1000,
        "star_rating": "4.0",
        "phone_e164": "+81312345678",
        "email": None,
        "facilities": ["wifi"],
        "images": [],
        "rooms": [
            {
                "room_code": "STD",
                "name": "Standard",
                "bed_type": "DOUBLE",
                "max_occupancy": 2,
                "rate_plans": [
                    {
                        "code": "BAR",
                        "board": "RO",
                        "refundable": True,
                        "available": True,
                        "price": f"{100 + i % 50}.00",
                        "currency": "JPY",
                    }
                ],
            }
        ],
        "status": "ACTIVE",
        "updated_at": "2026-12-01T10:00:00Z",
        "version": 1,
    }


def publish_synthetic(db: SyncDatabase, hotels: int, chunk: int = 2000) -> float:
    """Publishes ``hotels`` new hotels through the publish code; returns the seconds taken."""
    began = time.perf_counter()
    batch = f"bench-{uuid.uuid4().hex[:8]}"
    for start in range(0, hotels, chunk):
        docs = [_doc(i) for i in range(start, min(hotels, start + chunk))]
        cands = [
            Candidate(
                d,
                hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest(),
                raw_payload_ref="file:///bench/raw.json.gz",
                raw_payload_hash="0" * 64,
            )
            for d in docs
        ]
        with db.begin() as conn:
            maps = ensure_hotel_mappings(
                conn,
                db.clock,
                supplier_id=1001,
                batch_id=batch,
                hotel_ids=[c.supplier_hotel_id for c in cands],
            )
            diffs = compute_diffs(conn, cands, maps.resource_ids, published=maps.versions)
            record_diffs(
                conn, db.clock, batch_id=batch, shard_key="BENCH", supplier_id=1001, diffs=diffs
            )
            by_id = {c.supplier_hotel_id: c for c in cands}
            publish_hotels(
                conn,
                db.clock,
                supplier_id=1001,
                batch_id=batch,
                items=[(d, by_id[d.supplier_hotel_id]) for d in diffs],
            )
    return time.perf_counter() - began


def _waiting(db: SyncDatabase) -> bool:
    """Whether any event is READY or PROCESSING: one probe of the claim index, so that
    watching the drain ten times a second does not cost the database what
    :func:`outbox_status`'s counts of every status would."""
    o = schema.outbox.c
    with db.engine.connect() as conn:
        return (
            conn.execute(
                sa.select(o.id).where(o.status.in_(["READY", "PROCESSING"])).limit(1)
            ).first()
            is not None
        )


def _succeeded(db: SyncDatabase) -> int:
    """Events through every stage so far (one count, taken once when the sync ends)."""
    o = schema.outbox.c
    with db.engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count()).select_from(schema.outbox).where(o.status == "SUCCEEDED")
            ).scalar_one()
        )


def _outbox_seconds(db: SyncDatabase, start: Any, end: Any) -> float:
    """Seconds between two aggregates over the outbox, on the database's clock."""
    with db.engine.connect() as conn:
        first, last = conn.execute(sa.select(start, end)).one()
    return float((last - first).total_seconds())


def _last_finish_after_last_publish(db: SyncDatabase) -> float:
    """Seconds from the start of the last publish transaction (its events' ``created_at``)
    to the last event's end of chain: the drain as issue #17 states it, on the database's
    clock, whatever the sync command does after its last publish."""
    o = schema.outbox.c
    return _outbox_seconds(db, sa.func.max(o.created_at), sa.func.max(o.finished_at))


def _first_and_last_done(db: SyncDatabase) -> float:
    """Seconds from the first stage any event passed to the last event's end of chain
    (database clock): the drain without the command's start-up."""
    o = schema.outbox.c
    return _outbox_seconds(db, sa.func.min(o.projected_at), sa.func.max(o.finished_at))


def _fresh_pg() -> tuple[str, str]:
    name = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    return name, f"{PG_URL.rsplit('/', 1)[0]}/{name}"


def _drop_pg(name: str) -> None:
    with psycopg.connect(PG_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def _env(tmp: Path, db_url: str, settings: ProjectionSettings) -> dict[str, str]:
    """The commands' environment: this run's sync database and read models, nothing of the
    caller's own configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUPPLIER_SYNC_", "DAGSTER"))}
    env.update(SUPPLIER_SYNC_HOME=str(tmp / "home"), SUPPLIER_SYNC_DB_URL=db_url)
    if settings.search_url:
        env["SUPPLIER_SYNC_SEARCH_URL"] = settings.search_url
    if settings.cache_url:
        env["SUPPLIER_SYNC_REDIS_URL"] = settings.cache_url
    if settings.amqp_url:
        env["SUPPLIER_SYNC_AMQP_URL"] = settings.amqp_url
    return env


def run_alone(args: argparse.Namespace, db_url: str, settings: ProjectionSettings) -> bool:
    tmp = Path(tempfile.mkdtemp(prefix="bench_dispatch_"))
    db = SyncDatabase.open(db_url)
    try:
        seconds = publish_synthetic(db, args.hotels)
        events = outbox_status(db).total("READY")
        flags = _dispatch_flags(args)
        print(
            f"published {args.hotels} hotels ({events} events) in {seconds:.1f}s; draining with "
            f"supplier-sync dispatch {' '.join(flags)}",
            flush=True,
        )
        with BoundQueue(AMQP_URL, DEFAULT_EXCHANGE) if settings.amqp_url else _Nothing() as q:
            began = time.perf_counter()
            dispatcher = subprocess.Popen(
                [str(BIN / "supplier-sync"), "dispatch", *flags],
                env=_env(tmp, db_url, settings),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                while _waiting(db):
                    if dispatcher.poll() is not None:
                        raise RuntimeError(f"dispatch exited: {dispatcher.communicate()[1]}")
                    if time.perf_counter() - began > 600:
                        raise RuntimeError(f"not drained: {outbox_status(db)}")
                    time.sleep(0.05)
                wall = time.perf_counter() - began
            finally:
                dispatcher.terminate()
                dispatcher.wait(60)
            received = len(q.drain()) if settings.amqp_url else None
        status = outbox_status(db)
        working = _first_and_last_done(db)
    finally:
        db.dispose()
        shutil.rmtree(tmp, ignore_errors=True)
    rate = events / wall
    ok = rate >= TARGET_EVENTS_PER_S and status.total("SUCCEEDED") == events
    print(
        f"drained {events} events in {wall:.1f}s from the command's start = {rate:,.0f} "
        f"events/s through every stage ({args.hotels / wall:,.0f} hotels/s; "
        f"{events / working:,.0f} events/s from the first event done to the last) "
        f"[target >= {TARGET_EVENTS_PER_S:,.0f} events/s: {_verdict(ok)}]"
    )
    print(
        f"  outbox: {status.total('SUCCEEDED')} SUCCEEDED, {status.total('READY')} READY, "
        f"{status.total('FAILED')} FAILED"
        + ("" if received is None else f"; the bound queue received {received} messages")
    )
    return ok


class _Nothing:
    def __enter__(self) -> _Nothing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def drain(self) -> list[object]:
        return []


def _dispatch_flags(args: argparse.Namespace) -> list[str]:
    """``dispatch``'s flags: the batch size, and the parallelism as given (none given: the
    command's own defaults, on MariaDB two processes per core of one dispatcher each)."""
    flags = ["--batch-size", str(args.batch_size)]
    if args.threads is not None:
        flags += ["--threads", str(args.threads)]
    if args.processes is not None:
        flags += ["--processes", str(args.processes)]
    return flags


def run_with_sync(args: argparse.Namespace, db_url: str, settings: ProjectionSettings) -> bool:
    tmp = Path(tempfile.mkdtemp(prefix="bench_dispatch_"))
    env = _env(tmp, db_url, settings)
    config = SimulatorConfig(
        seed=7,
        n_cities=args.cities,
        total_hotels=args.hotels,
        api_key=API_KEY,
        empty_city_share=0.0,
        faults=FaultProfile.named("clean"),
        hotel_cache_size=max(50_000, args.hotels),
    )
    try:
        with ServerProcess(config, truth=False) as server:
            prewarm(server.url, 100)
            env.update(
                SUPPLIER_SYNC_SUPPLIER_URL=server.url,
                SUPPLIER_SYNC_SUPPLIER_API_KEY=API_KEY,
                SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT="1000000",
            )
            dispatcher = subprocess.Popen(
                [str(BIN / "supplier-sync"), "dispatch", *_dispatch_flags(args)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                began = time.perf_counter()
                done = subprocess.run(
                    [str(BIN / "supplier-sync"), "sync", "--full", "--json"],
                    env=env,
                    capture_output=True,
                    text=True,
                    cwd=tmp,
                )
                synced = time.perf_counter() - began
                if done.returncode != 0:
                    raise RuntimeError(f"sync failed: {done.stderr[-2000:]}")
                db = SyncDatabase.open(db_url)
                try:
                    during = _succeeded(db)
                    while _waiting(db):
                        if time.perf_counter() - began > synced + 600:
                            raise RuntimeError(f"not drained: {outbox_status(db)}")
                        time.sleep(0.1)
                    drained = time.perf_counter() - began - synced
                    status = outbox_status(db, window=10 * args.hotels)
                    after_publish = _last_finish_after_last_publish(db)
                finally:
                    db.dispose()
            finally:
                dispatcher.terminate()
                dispatcher.wait(60)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lag = status.projection_lag
    end = status.end_to_end_lag
    rate = during / synced
    kept_up = rate >= TARGET_EVENTS_PER_S
    ok = kept_up and after_publish <= TARGET_DRAIN_S and (lag.p95 or 0) <= TARGET_LAG_P95_S
    flags = " ".join(_dispatch_flags(args))
    print(
        f"sync --full of {args.hotels} hotels in {args.cities} cities: {synced:.1f}s, with "
        f"supplier-sync dispatch ({flags}) running; {during} events through every stage "
        f"during it = {rate:,.0f} events/s (the sync wrote "
        f"{status.total('SUCCEEDED') / synced:,.0f} events/s) "
        f"[target >= {TARGET_EVENTS_PER_S:,.0f} events/s: {_verdict(kept_up)}]"
    )
    print(
        f"  outbox drained {drained:.1f}s after the sync command ended; the last event finished "
        f"{after_publish:.1f}s after the last publish began (database clock) "
        f"[target <= {TARGET_DRAIN_S:.0f}s: {_verdict(after_publish <= TARGET_DRAIN_S)}]"
    )
    print(
        f"  lag publish -> search index: p50 {lag.p50:.2f}s p95 {lag.p95:.2f}s max "
        f"{lag.max:.2f}s over {lag.count} events [p95 target <= {TARGET_LAG_P95_S:.0f}s: "
        f"{_verdict((lag.p95 or 0) <= TARGET_LAG_P95_S)}]"
    )
    print(
        f"  lag publish -> end of chain: p50 {end.p50:.2f}s p95 {end.p95:.2f}s max "
        f"{end.max:.2f}s over {end.count} events; {status.total('SUCCEEDED')} SUCCEEDED, "
        f"{status.total('FAILED')} FAILED"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["alone", "with-sync"], default="alone")
    parser.add_argument("--hotels", type=int, default=50_000)
    parser.add_argument("--cities", type=int, default=100)
    parser.add_argument(
        "--threads", type=int, default=None, help="dispatch --threads (default: the command's)"
    )
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="dispatch --processes (default: the command's: two per core on MariaDB)",
    )
    parser.add_argument("--embedded", action="store_true", help="SQLite, FTS5, in-process, file")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_dispatch_state_"))
    pg_name = None
    try:
        if args.embedded:
            settings = ProjectionSettings(state_dir=tmp)
            db_url = f"sqlite:///{tmp / 'sync.sqlite3'}"
            run = run_alone if args.mode == "alone" else run_with_sync
            return 0 if run(args, db_url, settings) else 1
        pg_name, pg_url = _fresh_pg()
        settings = ProjectionSettings(
            state_dir=tmp,
            search_url=pg_url,
            cache_url=REDIS_URL,
            amqp_url=AMQP_URL,
            exchange=DEFAULT_EXCHANGE,
        )
        print(
            "MariaDB sync database, PostgreSQL search index, Redis cache, RabbitMQ subscribers; "
            f"machine speed {calibrate():.2f}s for 10M Python additions",
            flush=True,
        )
        with mariadb_databases(["sync"]) as made:
            run = run_alone if args.mode == "alone" else run_with_sync
            return 0 if run(args, mariadb_url(made[0]), settings) else 1
    finally:
        if pg_name:
            _drop_pg(pg_name)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
