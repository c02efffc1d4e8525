"""A 1,000-city backfill under dagster-daemon: how much of its wall time is orchestration.

The simulator serves its cities over HTTP from its own process; ``dagster-webserver`` and
``supplier-sync daemon`` (dagster-daemon with a 5 s backfill tick) run on a fresh instance (the embedded profile's ``dagster.yaml``: SQLite
instance; or ``--mysql`` for the MySQL profile); the backfill of every city is launched
through GraphQL and the daemon runs it with the asset's backfill policy
(``BackfillPolicy.multi_run``). Orchestration is the part of the wall time (launch to last
run finished) during which no ``city_sync`` step was executing: run queueing, run worker
start-up, code loading, and the daemon's polling. Target: <= 10 %.

Usage:
    .venv/bin/python bench/bench_backfill.py [--cities 1000] [--hotels 100000]
        [--sync-db sqlite|mariadb] [--mysql]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_client import ServerProcess

from supplier_sync_dagster.deployment import (
    FINAL_BACKFILL_STATES,
    ROOT,
    DagsterProcesses,
    migrate_instance,
    profile_env,
)
from supplier_sync_dagster.simulator import SimulatorConfig

API_KEY = "bench-key"
MYSQL_URL = "mysql+pymysql://root@127.0.0.1:3306"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cities", type=int, default=1000)
    parser.add_argument("--hotels", type=int, default=100_000)
    parser.add_argument("--sync-db", choices=["sqlite", "mariadb"], default="mariadb")
    parser.add_argument("--mysql", action="store_true", help="MySQL instance profile")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)

    import dagster as dg

    tmp = Path(tempfile.mkdtemp(prefix="bench_backfill_"))
    home = tmp / "dagster_home"
    home.mkdir()
    made: list[str] = []
    admin = sa.create_engine(MYSQL_URL)
    extra = {
        "SUPPLIER_SYNC_SUPPLIER_API_KEY": API_KEY,
        "SUPPLIER_SYNC_PAYLOAD_URL": f"file://{tmp / 'payloads'}",
        "SUPPLIER_SYNC_REDIS_URL": "redis://127.0.0.1:6379/13",
    }
    if args.sync_db == "sqlite":
        extra["SUPPLIER_SYNC_DB_URL"] = f"sqlite:///{tmp / 'sync.sqlite3'}"
    if args.sync_db == "mariadb" or args.mysql:
        with admin.begin() as conn:
            for kind in ("sync", "dg"):
                name = f"bench_{kind}_{uuid.uuid4().hex[:8]}"
                conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
                made.append(name)
        if args.sync_db == "mariadb":
            extra["SUPPLIER_SYNC_DB_URL"] = f"{MYSQL_URL}/{made[0]}?charset=utf8mb4"
    if args.mysql:
        shutil.copy(ROOT / "deploy" / "mysql" / "dagster.yaml", home / "dagster.yaml")
        extra["DAGSTER_MYSQL_URL"] = f"mysql+mysqlconnector://root@127.0.0.1:3306/{made[1]}"
    else:
        shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    config = SimulatorConfig(
        seed=7,
        n_cities=args.cities,
        total_hotels=args.hotels,
        api_key=API_KEY,
        empty_city_share=0.0,
        rate_limit_rps=None,
    )
    try:
        with ServerProcess(config) as server:
            extra["SUPPLIER_SYNC_SUPPLIER_URL"] = server.url
            env = profile_env(dagster_home=home, extra=extra)
            import os

            os.environ.update({k: v for k, v in env.items() if k.startswith("DAGSTER")})
            if args.mysql:
                migrate_instance(env)
            import httpx

            from supplier_sync_dagster.defs.partitions import encode_city_key

            cities = [
                c["city_code"]
                for c in httpx.get(
                    f"{server.url}/v1/cities", headers={"X-Api-Key": API_KEY}, timeout=60
                ).json()["cities"]
            ]
            keys = [encode_city_key(c) for c in cities]
            # The simulator builds a city on first use: keep that out of the measurement.
            with httpx.Client(base_url=server.url, headers={"X-Api-Key": API_KEY}) as http:
                for city in cities:
                    http.get(f"/v1/cities/{city}/summary").raise_for_status()
            with DagsterProcesses(env, tmp / "logs") as dagster:
                instance = dg.DagsterInstance.get()
                instance.add_dynamic_partitions("supplier_city", keys)
                launched = time.time()
                backfill_id = dagster.launch_backfill(keys, title="bench: every city")
                deadline = time.monotonic() + args.timeout
                while True:
                    status = dagster.backfill_status(backfill_id)
                    runs = instance.get_runs(
                        filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id})
                    )
                    if (
                        status in FINAL_BACKFILL_STATES
                        and runs
                        and all(r.is_finished for r in runs)
                    ):
                        break
                    if time.monotonic() > deadline:
                        print("timed out", status, file=sys.stderr)
                        return 1
                    dagster.check()
                    time.sleep(2)
                steps: list[tuple[float, float]] = []
                ends: list[float] = []
                for run in runs:
                    records = instance.all_logs(run.run_id)
                    start = next(
                        (
                            r.timestamp
                            for r in records
                            if r.dagster_event and r.dagster_event.event_type_value == "STEP_START"
                        ),
                        None,
                    )
                    stop = next(
                        (
                            r.timestamp
                            for r in reversed(records)
                            if r.dagster_event
                            and r.dagster_event.event_type_value in ("STEP_SUCCESS", "STEP_FAILURE")
                        ),
                        None,
                    )
                    if start is not None and stop is not None:
                        steps.append((start, stop))
                    ends.append(max(r.timestamp for r in records))
                wall = max(ends) - launched
                busy = _union(steps)
                run_records = instance.get_run_records(
                    filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id})
                )
                first_run = min(r.create_timestamp.timestamp() for r in run_records) - launched
                first_step = min(a for a, _ in steps) - launched
                tail = max(ends) - max(b for _, b in steps)
                ok_runs = sum(1 for r in runs if r.status == dg.DagsterRunStatus.SUCCESS)
                # The UI's truth: every city is materialized on its own for every asset.
                view = dagster.partitions("published_hotels", keys)
                shown = len(view.statuses["materialized"])
                own = sum(1 for k in keys if view.latest.get(k, {}).get("city") is not None)
        share = (wall - busy) / wall
        profile = "MySQL" if args.mysql else "embedded (SQLite)"
        print(
            f"backfill of {len(keys)} cities ({args.hotels} hotels), {profile} instance, "
            f"{args.sync_db} sync db: {len(runs)} runs ({ok_runs} succeeded), status {status}"
        )
        print(
            f"  wall {wall:.1f}s, some city_sync step executing for {busy:.1f}s; "
            f"orchestration {wall - busy:.1f}s = {share:.1%} of wall [target <= 10%]"
        )
        print(
            f"  launch -> first run created {first_run:.1f}s (backfill daemon tick), "
            f"-> first step {first_step:.1f}s; gaps between steps "
            f"{wall - busy - first_step - tail:.1f}s; last step -> last run ended {tail:.1f}s"
        )
        print(
            f"  published_hotels partitions materialized in the UI: {shown} of {len(keys)}, "
            f"{own} with their own city's metadata"
        )
        print(f"  {args.hotels / wall:,.0f} hotels/s end to end")
        ok = ok_runs == len(runs) and shown == own == len(keys)
        return 0 if share <= 0.10 and ok else 1
    finally:
        with admin.begin() as conn:
            for name in made:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


if __name__ == "__main__":
    sys.exit(main())
