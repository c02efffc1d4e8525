"""A 1,000-city backfill under dagster-daemon: how much of its wall time is orchestration.

The simulator serves its cities over HTTP from its own process; ``dagster-webserver`` and
``supplier-sync daemon`` (dagster-daemon with a shorter backfill tick than Dagster's) run on
a fresh instance (the embedded profile's ``dagster.yaml``: SQLite instance; or ``--mysql``
for the MySQL profile); the backfill of every city is launched through GraphQL and the
daemon runs it with the asset's backfill policy (``BackfillPolicy.multi_run``, cities per run
from ``SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN``). Orchestration is the part of the wall time
(launch to last run finished) during which no ``city_sync`` step was executing: run
queueing, run worker start-up, code loading, and the daemon's polling. Target: <= 10 %.

Usage:
    .venv/bin/python bench/bench_backfill.py [--cities 1000] [--hotels 100000]
        [--sync-db sqlite|mariadb] [--mysql]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import API_KEY, MYSQL_URL, mariadb_databases, mariadb_url, run_backfill
from bench_client import ServerProcess

from supplier_sync_dagster.dagster_instance.deployment import (
    ROOT,
    DagsterProcesses,
    migrate_instance,
    profile_env,
)
from supplier_sync_dagster.simulator import SimulatorConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cities", type=int, default=1000)
    parser.add_argument("--hotels", type=int, default=100_000)
    parser.add_argument("--sync-db", choices=["sqlite", "mariadb"], default="mariadb")
    parser.add_argument("--mysql", action="store_true", help="MySQL instance profile")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)

    import dagster as dg
    import httpx

    from supplier_sync_dagster.defs.partitions import encode_city_key

    tmp = Path(tempfile.mkdtemp(prefix="bench_backfill_"))
    home = tmp / "dagster_home"
    home.mkdir()
    extra = {
        "SUPPLIER_SYNC_SUPPLIER_API_KEY": API_KEY,
        "SUPPLIER_SYNC_PAYLOAD_URL": f"file://{tmp / 'payloads'}",
        "SUPPLIER_SYNC_REDIS_URL": "redis://127.0.0.1:6379/13",
    }
    kinds = ["sync", "dg"] if args.sync_db == "mariadb" or args.mysql else []
    config = SimulatorConfig(
        seed=7,
        n_cities=args.cities,
        total_hotels=args.hotels,
        api_key=API_KEY,
        empty_city_share=0.0,
        rate_limit_rps=None,
    )
    with contextlib.ExitStack() as stack:
        made = stack.enter_context(mariadb_databases(kinds, MYSQL_URL))
        if args.sync_db == "sqlite":
            extra["SUPPLIER_SYNC_DB_URL"] = f"sqlite:///{tmp / 'sync.sqlite3'}"
        else:
            extra["SUPPLIER_SYNC_DB_URL"] = mariadb_url(made[0], MYSQL_URL)
        if args.mysql:
            shutil.copy(ROOT / "deploy" / "mysql" / "dagster.yaml", home / "dagster.yaml")
            extra["DAGSTER_MYSQL_URL"] = f"mysql+mysqlconnector://root@127.0.0.1:3306/{made[1]}"
        else:
            shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
        server = stack.enter_context(ServerProcess(config))
        extra["SUPPLIER_SYNC_SUPPLIER_URL"] = server.url
        env = profile_env(dagster_home=home, extra=extra)
        os.environ.update({k: v for k, v in env.items() if k.startswith("DAGSTER")})
        if args.mysql:
            migrate_instance(env)
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
            try:
                done = run_backfill(dagster, dg.DagsterInstance.get(), keys, timeout=args.timeout)
            except TimeoutError as err:
                print("timed out", err, file=sys.stderr)
                return 1
    steps = done.steps
    wall, busy = done.wall, steps.busy
    first_step = min(a for a, _ in steps.steps) - done.launched
    tail = max(steps.ends) - max(b for _, b in steps.steps)
    share = (wall - busy) / wall
    profile = "MySQL" if args.mysql else "embedded (SQLite)"
    print(
        f"backfill of {len(keys)} cities ({args.hotels} hotels), {profile} instance, "
        f"{args.sync_db} sync db: {len(done.run_ids)} runs ({done.ok_runs} succeeded), "
        f"status {done.status}"
    )
    print(
        f"  wall {wall:.1f}s, some city_sync step executing for {busy:.1f}s; "
        f"orchestration {wall - busy:.1f}s = {share:.1%} of wall [target <= 10%]"
    )
    print(
        f"  launch -> first run created {done.first_run:.1f}s (backfill daemon tick), "
        f"-> first step {first_step:.1f}s; gaps between steps "
        f"{wall - busy - first_step - tail:.1f}s; last step -> last run ended {tail:.1f}s"
    )
    print(
        f"  published_hotels partitions materialized in the UI: {done.shown} of {len(keys)}, "
        f"{done.own} with their own city's metadata"
    )
    print(f"  {args.hotels / wall:,.0f} hotels/s end to end")
    ok = done.ok_runs == len(done.run_ids) and done.shown == done.own == len(keys)
    return 0 if share <= 0.10 and ok else 1


if __name__ == "__main__":
    sys.exit(main())
