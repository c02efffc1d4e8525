"""Scale benchmarks: the supplier's request budget shared by parallel runs, and memory per city.

``budget``: the simulator (its own process, HTTP) allows R requests/s per API key. W worker
processes play a backfill's runs: each gets a contiguous range of the cities, as
``BackfillPolicy.multi_run`` hands them out, and syncs them with ``core.sync.city.sync_city``
into one batch, all pacing their requests through one Redis token bucket at R. With
``--steal`` a worker that finishes its range goes on with cities that nobody has started
(the shard lease decides who syncs a city), as the Dagster asset does. Reported: achieved
request rate / R (target >= 0.97), the simulator's 429 answers (target ~0), and wall time
/ (pages / R) (target <= 1.05).

``memory``: one city of N hotels synced in a fresh process per size (SQLite, local
payloads); peak RSS must not grow with N (pages stream; chunks are bounded).

Usage:
    .venv/bin/python bench/bench_scale.py budget [--rate 20] [--workers 4] [--cities 40]
        [--hotels 40000] [--page-size 100] [--backend sqlite|mariadb] [--steal]
        [--redis-url redis://127.0.0.1:6379/14]
    .venv/bin/python bench/bench_scale.py memory [--sizes 1000,10000,100000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_client import ServerProcess
from bench_pipeline import _db_url, _drop

from supplier_sync_dagster.simulator import SimulatorConfig

API_KEY = "bench-key"
MYSQL_URL = "mysql+pymysql://root@127.0.0.1:3306"


def _settings(page_size: int) -> Any:
    from supplier_sync_dagster.core.leasing.leases import LeaseSettings
    from supplier_sync_dagster.core.records.diff import default_risk_policy
    from supplier_sync_dagster.core.settings import DEFAULT_MAX_CLOCK_SKEW_SECONDS
    from supplier_sync_dagster.core.sync.model import build_sync_settings

    return build_sync_settings(
        task_code="bench",
        supplier_id=1001,
        page_size=page_size,
        lease=LeaseSettings(lease_seconds=60, heartbeat_seconds=5),
        risk_policy=default_risk_policy,
        max_clock_skew_seconds=DEFAULT_MAX_CLOCK_SKEW_SECONDS,
    )


def _worker(
    url: str,
    db_url: str,
    tmp: str,
    batch: Any,
    mine: list[str],
    opts: dict[str, Any],
    out: Any,
    ready: Any,
    go: Any,
) -> None:
    import redis

    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.store.payloads import open_payload_store
    from supplier_sync_dagster.core.supplier import RetryPolicy, SupplierClient
    from supplier_sync_dagster.core.supplier.ratelimit import RedisTokenBucket
    from supplier_sync_dagster.core.sync.city import help_other_workers, sync_cities, sync_city

    db = SyncDatabase.open(db_url, create_schema=False)
    store = open_payload_store(f"file://{tmp}/payloads")
    limiter = RedisTokenBucket(
        redis.Redis.from_url(opts["redis_url"]), opts["bucket"], opts["rate"], 1
    )
    worker = f"w-{uuid.uuid4().hex[:6]}"
    # Start-up (imports, connections) is the orchestration's share, measured by
    # bench_backfill.py; the budget is measured from the moment every run can fetch.
    ready.put(worker)
    go.wait()
    started = time.perf_counter()
    with httpx.Client(base_url=url) as http:
        client = SupplierClient(
            http,
            api_key=API_KEY,
            supplier_id="bench",
            rate_limiter=limiter,
            retry=RetryPolicy(max_total_wait=600),
        )

        timeline: list[dict[str, Any]] = []

        def sync_one(city: str) -> Any:
            began = time.time()
            report = sync_city(
                db,
                store,
                client,
                batch=batch,
                city_code=city,
                worker_id=worker,
                settings=_settings(opts["page_size"]),
            )
            if report.pages_fetched:
                timeline.append(
                    {
                        "city": city,
                        "pages": report.pages_fetched,
                        "began": began,
                        "ended": time.time(),
                        "after_fetch": sum(v for k, v in report.seconds.items() if k != "fetch"),
                    }
                )
            return report

        # What a Dagster run does: its cities (largest first), then help with the batch's.
        reports = sync_cities(mine, sync_one=sync_one, threads=opts["threads"])
        if opts["steal"]:
            reports += help_other_workers(
                db,
                batch.batch_id,
                skip=set(mine),
                sync_one=sync_one,
                threads=opts["threads"],
                hotel_counts=opts["sizes"],
            )
        pages = sum(r.pages_fetched for r in reports)
        stats = client.stats()
    out.put(
        {
            "pages": pages,
            "requests": stats.requests,
            "seconds": time.perf_counter() - started,
            "finished_at": time.time(),
            "timeline": timeline,
        }
    )
    db.dispose()


def budget(args: argparse.Namespace) -> int:
    from supplier_sync_dagster.core.leasing.batches import TaskSpec, create_batch, upsert_task
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.sync.city import largest_first

    config = SimulatorConfig(
        seed=args.seed,
        n_cities=args.cities,
        total_hotels=args.hotels,
        api_key=API_KEY,
        rate_limit_rps=args.rate,
        empty_city_share=0.0,
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench_scale_"))
    db_url, dbname = _db_url(args.backend, MYSQL_URL, tmp)
    try:
        with ServerProcess(config) as server:
            with httpx.Client(base_url=server.url) as http:
                listing = http.get("/v1/cities", headers={"X-Api-Key": API_KEY}).json()
                cities = [c["city_code"] for c in listing["cities"]]
                sizes = {c["city_code"]: c["hotel_count"] for c in listing["cities"]}
                # The simulator builds each city on first use: keep that out of the window.
                for city in cities:
                    http.get(
                        f"/v1/cities/{city}/summary", headers={"X-Api-Key": API_KEY}
                    ).raise_for_status()
                    time.sleep(1.0 / args.rate)
            db = SyncDatabase.open(db_url)
            upsert_task(
                db,
                TaskSpec(task_code="bench", supplier_id=1001, concurrency_policy="ALLOW_PARALLEL"),
            )
            batch = create_batch(
                db,
                task_code="bench",
                trigger_id="bench",
                trigger_source="BACKFILL",
                shard_keys=cities,
            ).batch
            db.dispose()
            size = -(-len(cities) // args.workers)
            # Each run syncs its range largest city first, as the Dagster asset does.
            ranges = [
                largest_first(cities[i : i + size], sizes) for i in range(0, len(cities), size)
            ]
            opts = {
                "redis_url": args.redis_url,
                "bucket": f"bench-budget:{uuid.uuid4().hex}",
                "rate": args.rate,
                "page_size": args.page_size,
                "steal": args.steal,
                "sizes": sizes,
                "threads": args.threads,
            }
            before = httpx.get(f"{server.url}/_sim/stats").json()
            ctx = multiprocessing.get_context("spawn")
            out, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
            procs = [
                ctx.Process(
                    target=_worker,
                    args=(server.url, db_url, str(tmp), batch, r, opts, out, ready, go),
                )
                for r in ranges
            ]
            for p in procs:
                p.start()
            for _ in procs:
                ready.get(timeout=120)
            started = time.time()
            go.set()
            results = [out.get(timeout=3600) for _ in procs]
            for p in procs:
                p.join()
            wall = max(r["finished_at"] for r in results) - started
            after = httpx.get(f"{server.url}/_sim/stats").json()
    finally:
        if dbname:
            _drop(MYSQL_URL, dbname)
    pages = sum(r["pages"] for r in results)
    requests = after["requests_total"] - before["requests_total"]
    rate_429 = after["responses_429"] - before["responses_429"]
    achieved = requests / wall
    print(
        f"budget: R={args.rate}/s, {len(procs)} runs{' (helping)' if args.steal else ''}, "
        f"{args.threads} cities in flight per run, "
        f"{args.backend}, {len(cities)} cities, {pages} pages of {args.page_size}"
    )
    print(
        f"  wall {wall:.1f}s; requests {requests} (429: {rate_429}); achieved {achieved:.2f}/s "
        f"= {achieved / args.rate:.3f} R [target >= 0.97]; wall / (pages/R) = "
        f"{wall / (pages / args.rate):.3f} [target <= 1.05]"
    )
    for i, r in enumerate(sorted(results, key=lambda r: r["finished_at"])):
        print(f"  run {i}: {r['pages']} pages, finished at +{r['finished_at'] - started:.1f}s")
    # The tail: cities that ended last, with their normalize/publish seconds (no requests).
    cities_done = sorted((c for r in results for c in r["timeline"]), key=lambda c: c["ended"])
    for c in cities_done[-6:]:
        print(
            f"  city {c['city']!r}: {c['pages']} pages, +{c['began'] - started:.1f}s to "
            f"+{c['ended'] - started:.1f}s, {c['after_fetch']:.1f}s of it normalizing/publishing"
        )
    ok = achieved / args.rate >= 0.97 and wall / (pages / args.rate) <= 1.05 and rate_429 <= 2
    return 0 if ok else 1


def _memory_child(url: str, city: str, page_size: int, out: Any) -> None:
    from supplier_sync_dagster.core.leasing.batches import TaskSpec, create_batch, upsert_task
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.store.payloads import open_payload_store
    from supplier_sync_dagster.core.supplier import SupplierClient
    from supplier_sync_dagster.core.sync.city import sync_city
    from supplier_sync_dagster.core.sync.runtime import prepare_process

    tmp = Path(tempfile.mkdtemp(prefix="bench_mem_"))
    db = SyncDatabase.open(f"sqlite:///{tmp / 'sync.sqlite3'}")
    upsert_task(db, TaskSpec(task_code="bench", supplier_id=1001))
    batch = create_batch(
        db, task_code="bench", trigger_id="m", trigger_source="MANUAL", shard_keys=[city]
    ).batch
    assert batch is not None, "a fresh database has no batch to conflict with"
    store = open_payload_store(f"file://{tmp}/payloads")
    prepare_process()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with httpx.Client(base_url=url) as http:
        client = SupplierClient(http, api_key=API_KEY, supplier_id="bench")
        started = time.perf_counter()
        report = sync_city(
            db,
            store,
            client,
            batch=batch,
            city_code=city,
            worker_id="m",
            settings=_settings(page_size),
        )
        seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put({"records": report.records, "base": base, "peak": peak, "s": seconds})


def memory(args: argparse.Namespace) -> int:
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        config = SimulatorConfig(
            seed=3, n_cities=1, total_hotels=size, api_key=API_KEY, empty_city_share=0.0
        )
        # The simulator has its own process: only the sync's memory is measured.
        with ServerProcess(config) as server:
            city = httpx.get(
                f"{server.url}/v1/cities", headers={"X-Api-Key": API_KEY}, timeout=60
            ).json()["cities"][0]["city_code"]
            out = ctx.Queue()
            p = ctx.Process(target=_memory_child, args=(server.url, city, args.page_size, out))
            p.start()
            rows.append({"size": size, **out.get(timeout=3600)})
            p.join()
    print(f"memory: one city per sync process, SQLite, page size {args.page_size}")
    for r in rows:
        print(
            f"  {r['size']:>7} hotels ({r['records']} records) in {r['s']:.1f}s: peak RSS "
            f"{r['peak']:.0f} MB (start {r['base']:.0f} MB, growth {r['peak'] - r['base']:.0f} MB)"
        )
    growth = [r["peak"] - r["base"] for r in rows]
    return 0 if max(growth) <= 2 * min(growth) + 50 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("budget")
    b.add_argument("--rate", type=float, default=20.0)
    b.add_argument("--workers", type=int, default=4)
    b.add_argument("--cities", type=int, default=40)
    b.add_argument("--hotels", type=int, default=40_000)
    b.add_argument("--page-size", type=int, default=100)
    b.add_argument("--backend", choices=["sqlite", "mariadb"], default="sqlite")
    b.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    b.add_argument("--steal", action="store_true", help="runs help with others' cities")
    b.add_argument("--threads", type=int, default=1, help="cities in flight per run")
    b.add_argument("--seed", type=int, default=42)
    b.set_defaults(func=budget)
    m = sub.add_parser("memory")
    m.add_argument("--sizes", default="1000,10000,100000")
    m.add_argument("--page-size", type=int, default=500)
    m.set_defaults(func=memory)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
