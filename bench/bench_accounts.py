"""Many suppliers, many accounts (issue 21): definitions load time and accounts in parallel.

``load``: a suppliers file with N accounts (default 50, two per supplier); ``supplier-sync
accounts check --json`` in a fresh process loads the Dagster definitions from it as a code
location does (every account's assets, jobs, schedules and sensors, resolved). Reports the
definitions' load time (target <= 5 s for 50 accounts) and the command's wall time.

``budget``: four accounts (two suppliers, two accounts each) of the simulator fleet over
loopback HTTP, each limited to R requests/s (the fleet allows each key 20 % more, so a
429 means a client overran its budget). ``dagster-webserver`` and ``supplier-sync daemon``
on a fresh embedded instance; each account's full-sync job is launched through GraphQL
as one run over all its cities, and the daemon runs them in parallel (one per account).
Wall time is from the first launch to the last run's end, against the slowest account's
requests / R (target <= 1.05). The catalog is checked against each supplier's ground truth.

Usage:
    .venv/bin/python bench/bench_accounts.py load [--accounts 50]
    .venv/bin/python bench/bench_accounts.py budget [--rate 4] [--hotels 20000]
        [--cities 40] [--page-size 25] [--city-threads 1] [--sync-db sqlite|mariadb]
        [--mysql-url URL] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MYSQL_URL, mariadb_databases, mariadb_url

BIN = Path(sys.executable).parent
TARGET_LOAD_S = 5.0
TARGET_WALL_RATIO = 1.05
ACCOUNTS = [("acme", "eu"), ("acme", "us"), ("globex", "main"), ("globex", "asia")]
SUPPLIER_IDS = {"acme": 1001, "globex": 2002}


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def bench_load(n_accounts: int) -> int:
    """Times ``accounts check`` over a file of ``n_accounts`` accounts."""
    with tempfile.TemporaryDirectory(prefix="bench_accounts_") as tmp:
        path = Path(tmp) / "suppliers.yaml"
        lines = ["suppliers:"]
        for i in range((n_accounts + 1) // 2):
            lines += [f"  supplier{i:02d}:", f"    supplier_id: {1000 + i}", "    accounts:"]
            for name in ("eu", "us")[: min(2, n_accounts - 2 * i)]:
                lines.append(f"      {name}: {{api_key_env: KEY_{i}_{name.upper()}}}")
        path.write_text("\n".join(lines) + "\n")
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("SUPPLIER_SYNC_", "DAGSTER"))
        }
        env.update(
            SUPPLIER_SYNC_SUPPLIERS_FILE=str(path), SUPPLIER_SYNC_HOME=str(Path(tmp) / "home")
        )
        walls, loads = [], []
        for _ in range(3):
            began = time.perf_counter()
            done = subprocess.run(
                [str(BIN / "supplier-sync"), "accounts", "check", "--json"],
                env=env,
                capture_output=True,
                text=True,
                cwd=tmp,
            )
            walls.append(time.perf_counter() - began)
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                return 1
            result = json.loads(done.stdout.strip().splitlines()[-1])
            loads.append(float(result["load_seconds"]))
        best = min(loads)
        print(
            f"{len(result['accounts'])} accounts: {result['jobs']} jobs, {result['schedules']} "
            f"schedules, {result['sensors']} sensors, {result['assets']} assets"
        )
        print(
            f"definitions load: {', '.join(f'{s:.2f}' for s in loads)} s (best {best:.2f} s; "
            f"target <= {TARGET_LOAD_S:g} s: {_verdict(best <= TARGET_LOAD_S)}); command wall "
            f"{', '.join(f'{s:.2f}' for s in walls)} s (imports included)"
        )
        return 0 if best <= TARGET_LOAD_S else 1


def bench_budget(args: argparse.Namespace) -> int:
    """Four rate-limited accounts through the daemon; wall time against their budgets."""
    import dagster as dg

    from supplier_sync_dagster.core.store import schema
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.dagster_instance.deployment import (
        ROOT,
        DagsterProcesses,
        profile_env,
    )
    from supplier_sync_dagster.defs.partitions import encode_city_key
    from supplier_sync_dagster.defs.triggers import TRIGGER_TAG
    from supplier_sync_dagster.simulator import AccountSpec, SimulatorFleet, SupplierSpec
    from supplier_sync_dagster.simulator.server import running_fleet_server

    rate = float(args.rate)
    fleet = SimulatorFleet.from_spec(
        {
            supplier: SupplierSpec(
                seed=seed,
                n_cities=args.cities,
                total_hotels=args.hotels,
                accounts={
                    a: AccountSpec(api_key=f"key-{s}-{a}", rate_limit_rps=rate * 1.2)
                    for s, a in ACCOUNTS
                    if s == supplier
                },
                settings={"empty_city_share": 0.0},
            )
            for supplier, seed in (("acme", 81), ("globex", 82))
        }
    )
    with contextlib.ExitStack() as stack:
        tmp = Path(
            stack.enter_context(
                tempfile.TemporaryDirectory(prefix="bench_accounts_", ignore_cleanup_errors=True)
            )
        )
        if args.sync_db == "mariadb":
            (name,) = stack.enter_context(mariadb_databases(["sync"], args.mysql_url))
            db_url = mariadb_url(name, args.mysql_url)
        else:
            db_url = f"sqlite:///{tmp / 'sync.sqlite3'}"
        url = stack.enter_context(running_fleet_server(fleet))
        lines = ["suppliers:"]
        for supplier, sid in SUPPLIER_IDS.items():
            lines += [
                f"  {supplier}:",
                f"    supplier_id: {sid}",
                f"    base_url: {url}/{supplier}",
                "    accounts:",
            ]
            for s, a in ACCOUNTS:
                if s == supplier:
                    lines.append(
                        f"      {a}: {{api_key_env: {s.upper()}_{a.upper()}_KEY, rate_limit_rps: "
                        f"{rate}, page_size: {args.page_size}, worker_processes: 0, "
                        f"city_threads: {args.city_threads}}}"
                    )
        (tmp / "suppliers.yaml").write_text("\n".join(lines) + "\n")
        home = tmp / "dagster_home"
        home.mkdir()
        shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
        env = profile_env(
            dagster_home=home,
            extra={
                "SUPPLIER_SYNC_SUPPLIERS_FILE": str(tmp / "suppliers.yaml"),
                "SUPPLIER_SYNC_DB_URL": db_url,
                "SUPPLIER_SYNC_PAYLOAD_URL": f"file://{tmp / 'payloads'}",
                "SUPPLIER_SYNC_HOME": str(tmp / "home"),
                **{f"{s.upper()}_{a.upper()}_KEY": f"key-{s}-{a}" for s, a in ACCOUNTS},
            },
        )
        if args.redis_url:
            env["SUPPLIER_SYNC_REDIS_URL"] = args.redis_url
        os.environ["DAGSTER_HOME"] = str(home)
        # Created here first: the webserver and the daemon must not race to create its storage.
        instance = dg.DagsterInstance.get()
        with DagsterProcesses(env, tmp / "logs") as dagster:
            for s, a in ACCOUNTS:
                keys = sorted(encode_city_key(c) for c in fleet.simulator(s, a).city_codes())
                instance.add_dynamic_partitions(f"{s}__{a}__city", keys)
            fleet.reset_stats()
            began = time.time()
            run_ids = []
            for s, a in ACCOUNTS:
                ordered = instance.get_dynamic_partitions(f"{s}__{a}__city")
                run_ids.append(
                    dagster.launch_job(
                        f"{s}__{a}__full_sync_job",
                        tags={
                            "dagster/asset_partition_range_start": ordered[0],
                            "dagster/asset_partition_range_end": ordered[-1],
                            TRIGGER_TAG: f"bench-{s}.{a}",
                        },
                    )
                )
            while True:
                records = instance.get_run_records(filters=dg.RunsFilter(run_ids=run_ids))
                if len(records) == len(run_ids) and all(r.dagster_run.is_finished for r in records):
                    break
                dagster.check()
                time.sleep(0.5)
            ends = [r.end_time or time.time() for r in records]
            starts = [r.start_time or began for r in records]
            wall = max(ends) - began
            statuses = {r.dagster_run.status.value for r in records}
        stats = fleet.stats()
        requests = {f"{s}.{a}": int(stats[s][a]["requests_total"]) for s, a in ACCOUNTS}
        limited = {f"{s}.{a}": int(stats[s][a]["rate_limited"]) for s, a in ACCOUNTS}
        slowest = max(requests.values())
        budget = slowest / rate
        ratio = wall / budget
        db = SyncDatabase.open(db_url)
        try:
            h = schema.platform_hotel.c
            with db.engine.connect() as conn:
                rows = conn.execute(
                    sa.select(h.supplier_id, h.supplier_hotel_id, h.supplier_version)
                ).all()
        finally:
            db.dispose()
        problems = []
        for supplier, account in (("acme", "eu"), ("globex", "main")):
            sid = SUPPLIER_IDS[supplier]
            found = {r.supplier_hotel_id: r.supplier_version for r in rows if r.supplier_id == sid}
            if found != dict(fleet.ground_truth(supplier, account).valid):
                problems.append(f"{supplier}: catalog differs from its ground truth")
        print(
            f"4 accounts x R={rate:g} requests/s, {args.hotels} hotels in {args.cities} cities per "
            f"supplier, page size {args.page_size}, city_threads {args.city_threads}, "
            f"{args.sync_db} sync db; runs {sorted(statuses)}"
        )
        print(f"requests per account: {requests}; 429s from the supplier's buckets: {limited}")
        print(
            f"wall {wall:.1f} s (launch to last run end; runs started {min(starts) - began:.1f}-"
            f"{max(starts) - began:.1f} s after launch) vs the slowest account's {slowest} requests "
            f"/ R = {budget:.1f} s: {ratio:.3f} (target <= {TARGET_WALL_RATIO}: "
            f"{_verdict(ratio <= TARGET_WALL_RATIO)})"
        )
        print(f"catalog vs ground truth: {'; '.join(problems) or 'equal for both suppliers'}")
        ok = ratio <= TARGET_WALL_RATIO and not problems and statuses == {"SUCCESS"}
        ok = ok and not any(limited.values())
        return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    load = sub.add_parser("load")
    load.add_argument("--accounts", type=int, default=50)
    budget = sub.add_parser("budget")
    budget.add_argument("--rate", type=float, default=4.0)
    budget.add_argument("--hotels", type=int, default=20_000)
    budget.add_argument("--cities", type=int, default=40)
    budget.add_argument("--page-size", type=int, default=25)
    budget.add_argument(
        "--city-threads", type=int, default=1, help="the accounts' city_threads (suppliers.yaml)"
    )
    budget.add_argument("--sync-db", choices=["sqlite", "mariadb"], default="sqlite")
    budget.add_argument("--mysql-url", default=MYSQL_URL)
    budget.add_argument("--redis-url", default=None, help="share buckets through Redis")
    args = parser.parse_args(argv)
    if args.mode == "load":
        return bench_load(args.accounts)
    return bench_budget(args)


if __name__ == "__main__":
    sys.exit(main())
