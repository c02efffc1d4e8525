"""Benchmark a full sync end to end: hotels/s of ``core.sync.city.sync_city`` over every city.

The simulator runs in its own process behind uvicorn on loopback HTTP (clean profile, no
rate limit), so its CPU is not counted in the sync; every city is walked once before timing
so that the simulator's world generation is not measured either. Each database backend is
synced in a fresh child process (so peak RSS and the GC state are its own) with a throwaway
database (a temp SQLite file; a ``bench_<random>`` MariaDB database, dropped afterwards) and
payloads in a temp local folder.

Reported per backend: hotels/s over the whole run (wall time of all ``sync_city`` calls), the
per-stage seconds summed from ``CityReport.seconds`` (fetch, normalize, publish), peak RSS of
the sync process, and a correctness check: the published hotels (id -> supplier version) must
equal the simulator's ground truth exactly, and the dead letters must be exactly its bad
records (none on the clean profile).

Usage:
    .venv/bin/python bench/bench_pipeline.py [--hotels 100000] [--cities 50]
        [--backends sqlite,mariadb] [--mysql-url mysql+pymysql://root@127.0.0.1:3306]
        [--page-size 500] [--chunk-hotels N] [--workers 1] [--days 1] [--profile-out DIR]

Exit status 0 when every backend's result is correct and meets its target
(SQLite >= 4,500 hotels/s, MariaDB >= 3,500 hotels/s), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import resource
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_client import ServerProcess

from supplier_sync_dagster.simulator import FaultProfile, SimulatorConfig

API_KEY = "bench-key"
TARGETS = {"sqlite": 4500.0, "mariadb": 3500.0}
DEFAULT_MYSQL_URL = "mysql+pymysql://root@127.0.0.1:3306"


def _client(url: str) -> Any:
    from supplier_sync_dagster.core.supplier import SupplierClient

    http = httpx.Client(base_url=url)
    return http, SupplierClient(http, api_key=API_KEY, supplier_id="bench")


def prewarm(url: str, page_size: int) -> tuple[list[str], int, float]:
    """Walks every city once (the simulator builds hotels on first use)."""
    began = time.perf_counter()
    http, client = _client(url)
    with http:
        cities = [c.city_code for c in client.list_cities().data.cities]
        hotels = 0
        for city in cities:
            for page in client.iter_city(city, page_size=page_size):
                hotels += len(page.page.hotels)
    return cities, hotels, time.perf_counter() - began


def _db_url(backend: str, mysql_url: str, tmp: Path) -> tuple[str, str | None]:
    if backend == "sqlite":
        return f"sqlite:///{tmp / 'sync.sqlite3'}", None
    import sqlalchemy as sa

    name = f"bench_{uuid.uuid4().hex[:12]}"
    server = sa.create_engine(mysql_url)
    with server.begin() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    server.dispose()
    return f"{mysql_url.rstrip('/')}/{name}?charset=utf8mb4", name


def _drop(mysql_url: str, name: str) -> None:
    import sqlalchemy as sa

    server = sa.create_engine(mysql_url)
    with server.begin() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
    server.dispose()


def run_backend(
    backend: str,
    cities: list[str],
    days: list[tuple[str, tuple[dict[str, int], dict[str, str]]]],
    opts: dict[str, Any],
) -> list[dict[str, Any]]:
    """Child process: one full sync of every city per day on one backend, timed and checked.

    ``days`` holds (simulator URL, ground truth) per day; each day is its own batch on the
    same database, so day 1 measures a day-to-day sync (mostly unchanged hotels).
    """
    from supplier_sync_dagster.core.leasing.batches import TaskSpec, upsert_task
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.store.payloads import open_payload_store
    from supplier_sync_dagster.core.sync.runtime import prepare_process

    tmp = Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    db_url, mysql_db = _db_url(backend, opts["mysql_url"], tmp)
    try:
        db = SyncDatabase.open(db_url)
        store = open_payload_store(f"file://{tmp / 'payloads'}")
        upsert_task(
            db, TaskSpec(task_code="bench", supplier_id=1001, concurrency_policy="ALLOW_PARALLEL")
        )
        prepare_process()
        results = []
        for day, (url, truth) in enumerate(days):
            res = _sync_day(db, store, db_url, tmp, cities, day, truth, {**opts, "sim_url": url})
            results.append({"backend": backend, "day": day, **res})
        db.dispose()
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if mysql_db is not None:
            _drop(opts["mysql_url"], mysql_db)


def _sync_day(
    db: Any,
    store: Any,
    db_url: str,
    tmp: Path,
    cities: list[str],
    day: int,
    truth: tuple[dict[str, int], dict[str, str]],
    opts: dict[str, Any],
) -> dict[str, Any]:
    """One batch over every city, timed, then checked against the day's ground truth."""
    import sqlalchemy as sa

    from supplier_sync_dagster.core.leasing.batches import create_batch
    from supplier_sync_dagster.core.store import schema
    from supplier_sync_dagster.core.sync.city import sync_city

    batch = create_batch(
        db,
        task_code="bench",
        trigger_id=f"bench-day{day}",
        trigger_source="MANUAL",
        shard_keys=cities,
    ).batch
    assert batch is not None, "the bench task allows a batch per day"
    settings = _settings(opts)
    profiler = None
    if opts["profile_out"]:
        import cProfile

        profiler = cProfile.Profile()
    totals: Counter[str] = Counter()
    stages: dict[str, float] = defaultdict(float)
    statuses: Counter[str] = Counter()
    workers = opts["workers"]
    peak_rss_mb = 0.0

    def add(summary: dict[str, Any]) -> None:
        statuses[summary["status"]] += 1
        totals.update(summary["totals"])
        for stage, seconds in summary["seconds"].items():
            stages[stage] += seconds

    wall0, cpu0 = time.perf_counter(), time.process_time()
    if workers > 1:
        # Scale-out as in production: several workers claim cities (shard leases) at once.
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(
            workers, initializer=_worker_init, initargs=(db_url, str(tmp), opts, batch)
        ) as pool:
            for summary in pool.imap_unordered(_worker_city, cities, chunksize=1):
                add(summary)
                peak_rss_mb = max(peak_rss_mb, summary["peak_rss_mb"])
        wall, cpu = time.perf_counter() - wall0, float("nan")
    else:
        http, client = _client(opts["sim_url"])
        with http:
            if profiler is not None:
                profiler.enable()
            for city in cities:
                add(
                    _summarize(
                        sync_city(
                            db,
                            store,
                            client,
                            batch=batch,
                            city_code=city,
                            worker_id="bench",
                            settings=settings,
                            **_governance(client),
                        )
                    )
                )
            if profiler is not None:
                profiler.disable()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    peak_rss_mb = max(peak_rss_mb, _peak_rss_mb())
    if profiler is not None:
        out = Path(opts["profile_out"]) / f"pipeline_{db.engine.dialect.name}_day{day}.prof"
        out.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(out)
    with db.engine.connect() as conn:
        h, d = schema.platform_hotel.c, schema.dead_letter.c
        published = dict(conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version)).all())
        dead = dict(
            conn.execute(
                sa.select(d.supplier_resource_code, d.error_code).where(
                    d.batch_id == batch.batch_id
                )
            ).all()
        )
    valid, bad = truth
    problems = []
    # Day 0 publishes exactly the valid hotels. Later days also keep hotels the supplier
    # removed (published as they were) and hold large price moves for review, so each of
    # the day's valid hotels is published at its version or waits in review.
    wrong = {k for k, v in valid.items() if published.get(k) != v}
    if day == 0 and set(published) != set(valid):
        problems.append(
            f"published {len(published)} hotels != ground truth {len(valid)} valid "
            f"(missing {len(set(valid) - set(published))}, "
            f"extra {len(set(published) - set(valid))})"
        )
    if len(wrong) != totals["held_for_review"]:
        problems.append(
            f"{len(wrong)} valid hotels not published at their version, "
            f"{totals['held_for_review']} held for review"
        )
    if set(dead) != set(bad):
        problems.append(f"{len(dead)} dead letters != {len(bad)} bad records")
    if totals["records"] != totals["published"] + totals["dead_letters"] + totals["skipped"]:
        problems.append(f"counts do not add up: {dict(totals)}")
    if statuses != Counter({"SUCCESS": len(cities)}):
        problems.append(f"city statuses {dict(statuses)}")
    return {
        "hotels": totals["records"],
        "wall": wall,
        "cpu": cpu,
        "rate": totals["records"] / wall if wall else 0.0,
        "stages": dict(stages),
        "totals": dict(totals),
        "peak_rss_mb": peak_rss_mb,
        "problems": problems,
    }


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _settings(opts: dict[str, Any]) -> Any:
    from supplier_sync_dagster.core.leasing.leases import LeaseSettings
    from supplier_sync_dagster.core.records.diff import default_risk_policy
    from supplier_sync_dagster.core.settings import DEFAULT_MAX_CLOCK_SKEW_SECONDS
    from supplier_sync_dagster.core.sync.model import SyncTuning, build_sync_settings

    kw: SyncTuning = {}
    if opts["chunk_hotels"]:
        kw["chunk_hotels"] = opts["chunk_hotels"]
    return build_sync_settings(
        task_code="bench",
        supplier_id=1001,
        page_size=opts["page_size"],
        lease=LeaseSettings(),
        risk_policy=default_risk_policy,
        max_clock_skew_seconds=DEFAULT_MAX_CLOCK_SKEW_SECONDS,
        **kw,
    )


def _summarize(report: Any) -> dict[str, Any]:
    return {
        "status": report.status,
        "totals": {
            k: getattr(report, k)
            for k in (
                "records",
                "published",
                "dead_letters",
                "skipped",
                "duplicates",
                "held_for_review",
            )
        },
        "seconds": dict(report.seconds),
        "peak_rss_mb": _peak_rss_mb(),
    }


_WORKER: dict[str, Any] = {}
_GOVERNANCE: dict[int, dict[str, Any]] = {}


def _governance(client: Any) -> dict[str, Any]:
    """What a production sync runs with: the quality gates and the city -> country rule."""
    found = _GOVERNANCE.get(id(client))
    if found is None:
        from supplier_sync_dagster.core.sync.gate import gate_for_pipeline

        cities = client.list_cities().data.cities
        found = {
            "gate": gate_for_pipeline(),
            "city_countries": {c.city_code: c.country_code for c in cities if c.country_code},
        }
        _GOVERNANCE[id(client)] = found
    return found


def _worker_init(db_url: str, tmp: str, opts: dict[str, Any], batch: Any) -> None:
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.store.payloads import open_payload_store
    from supplier_sync_dagster.core.sync.runtime import prepare_process

    http, client = _client(opts["sim_url"])
    _WORKER.update(
        db=SyncDatabase.open(db_url, create_schema=False),
        store=open_payload_store(f"file://{tmp}/payloads"),
        http=http,
        client=client,
        batch=batch,
        settings=_settings(opts),
        worker_id=f"bench-{uuid.uuid4().hex[:8]}",
    )
    prepare_process()


def _worker_city(city: str) -> dict[str, Any]:
    from supplier_sync_dagster.core.sync.city import sync_city

    w = _WORKER
    report = sync_city(
        w["db"],
        w["store"],
        w["client"],
        batch=w["batch"],
        city_code=city,
        worker_id=w["worker_id"],
        settings=w["settings"],
        **_governance(w["client"]),
    )
    return _summarize(report)


def _child(send: multiprocessing.connection.Connection, args: tuple[Any, ...]) -> None:
    try:
        send.send(("ok", run_backend(*args)))
    except BaseException as err:
        import traceback

        send.send(("error", f"{err!r}\n{traceback.format_exc()}"))
        raise


def _run_in_child(*args: Any) -> list[dict[str, Any]]:
    """Runs ``run_backend`` in a fresh (non-daemonic: it may start workers) process."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, args))
    proc.start()
    status, result = recv.recv()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"benchmark child failed: {result}")
    assert isinstance(result, list)
    return result


def calibrate() -> float:
    """Seconds for a fixed pure-Python loop (best of 3): how fast this machine is right now.

    A machine's CPU speed varies from day to day (shared or throttled cores); printing this
    beside a run's figures makes runs of different days comparable.
    """
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        total = 0
        for i in range(10_000_000):
            total += i
        best = min(best, time.perf_counter() - began)
    return best


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one line per backend; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hotels", type=int, default=100_000, help="hotels in the world")
    parser.add_argument("--cities", type=int, default=50, help="cities in the world")
    parser.add_argument("--backends", default="sqlite,mariadb", help="sqlite,mariadb")
    parser.add_argument("--mysql-url", default=DEFAULT_MYSQL_URL, help="server URL, no db")
    parser.add_argument("--page-size", type=int, default=500)
    parser.add_argument("--chunk-hotels", type=int, default=0, help="0: SyncSettings default")
    parser.add_argument("--profile-out", default="", help="write cProfile stats to this folder")
    parser.add_argument(
        "--workers", type=int, default=1, help="sync processes claiming cities concurrently"
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--days",
        type=int,
        default=1,
        help="days to sync (2: also a day-to-day sync of the simulator one day later)",
    )
    args = parser.parse_args(argv)

    config = SimulatorConfig(
        seed=args.seed,
        n_cities=args.cities,
        total_hotels=args.hotels,
        api_key=API_KEY,
        rate_limit_rps=None,
        faults=FaultProfile.named("clean"),
        # Every hotel rendered by the pre-warm walk stays cached: the timed walk measures the
        # sync, not the simulator re-rendering hotels that a smaller LRU evicted.
        hotel_cache_size=max(50_000, args.hotels),
    )
    print(
        f"full sync of {args.hotels} hotels in {args.cities} cities, clean profile, no rate "
        f"limit, page size {args.page_size}, simulator in its own process over loopback HTTP",
        flush=True,
    )
    print(
        f"machine speed: {calibrate():.2f}s for 10M Python additions (smaller is faster; "
        "compare runs relative to it)",
        flush=True,
    )
    ok = True
    with contextlib.ExitStack() as stack:
        days = []
        for day in range(args.days):
            server = stack.enter_context(
                ServerProcess(dataclasses.replace(config, day=day), truth=True)
            )
            valid, bad = server.truth
            cities, listed, warm = prewarm(server.url, args.page_size)
            print(
                f"day {day} ground truth: {len(valid)} valid, {len(bad)} bad; pre-warm walked "
                f"{listed} hotels in {len(cities)} cities in {warm:.1f}s",
                flush=True,
            )
            days.append((server.url, server.truth))
        opts = {
            "mysql_url": args.mysql_url,
            "page_size": args.page_size,
            "chunk_hotels": args.chunk_hotels,
            "profile_out": args.profile_out,
            "workers": args.workers,
        }
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            for res in _run_in_child(backend, cities, days, opts):
                stages = " ".join(f"{k}={v:.1f}s" for k, v in sorted(res["stages"].items()))
                # The targets are for the full sync of day 0.
                target = TARGETS.get(backend, 0.0) if res["day"] == 0 else 0.0
                met = res["rate"] >= target and not res["problems"]
                ok = ok and met
                tot = res["totals"]
                print(
                    f"{backend:8} day {res['day']} {res['hotels']:>7} hotels in "
                    f"{res['wall']:6.1f}s (cpu {res['cpu']:.1f}s, {args.workers} worker(s)) = "
                    f"{res['rate']:7.0f} hotels/s "
                    + (f"[target {target:.0f}: {'MET' if met else 'NOT MET'}] " if target else "")
                    + f"| {stages} | peak RSS {res['peak_rss_mb']:.0f} MB | "
                    f"published {tot.get('published', 0)} dead {tot.get('dead_letters', 0)} "
                    f"skipped {tot.get('skipped', 0)} review {tot.get('held_for_review', 0)} | "
                    + (
                        "correct" if not res["problems"] else "WRONG: " + "; ".join(res["problems"])
                    ),
                    flush=True,
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
