"""Benchmark incremental sync and reconciliation on the paths users run (issue #18).

The simulator serves its world over loopback HTTP from its own process (clean profile, no
rate limit; pages walked once before timing). Against one throwaway sync database (SQLite or
a ``bench_<random>`` MariaDB database) and one state folder, as a user would in a row:

1. ``supplier-sync sync --full --json``: the full sync's wall time;
2. the supplier moves one day on (``POST /_sim/advance_day``: ~8% of its hotels change),
   and its change feed is walked once untimed (the simulator renders each changed hotel on
   first use, as the full sync's pages were walked before it was timed);
3. ``supplier-sync sync --incremental --json``: the day's window; its wall time against the
   full sync's (target <= 15 %), and the catalog against the simulator's ground truth;
4. ``supplier-sync sync --incremental`` again with nothing new: the step time of its Dagster
   run (target <= 3 s);
5. ``supplier-sync reconcile --no-repull --json``: supplier requests (target <= one per city)
   and wall time (target <= 30 s for 1,000 cities), every city equal.

Usage:
    .venv/bin/python bench/bench_incremental.py [--hotels 100000] [--cities 1000]
        [--backend sqlite|mariadb]
"""

from __future__ import annotations

import argparse
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

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    API_KEY,
    MYSQL_URL,
    catalog_problems,
    mariadb_databases,
    mariadb_url,
    prewarm,
    prewarm_changes,
    published_catalog,
    run_steps,
)
from bench_client import ServerProcess
from bench_pipeline import calibrate

from supplier_sync_dagster.simulator import FaultProfile, Simulator, SimulatorConfig

BIN = Path(sys.executable).parent
TARGET_SHARE = 0.15
TARGET_QUIET_STEP_S = 3.0
TARGET_RECONCILE_S = 30.0


def _env(tmp: Path, db_url: str, url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUPPLIER_SYNC_", "DAGSTER"))}
    env.update(
        SUPPLIER_SYNC_HOME=str(tmp / "home"),
        SUPPLIER_SYNC_DB_URL=db_url,
        SUPPLIER_SYNC_SUPPLIER_URL=url,
        SUPPLIER_SYNC_SUPPLIER_API_KEY=API_KEY,
        SUPPLIER_SYNC_PAYLOAD_URL=f"file://{tmp / 'payloads'}",
        SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT="1000000",
    )
    return env


def _command(
    env: dict[str, str], cwd: Path, *argv: str, profile: str | None = None
) -> tuple[float, dict[str, Any], str]:
    """``supplier-sync ARGV`` as a subprocess: (wall seconds, its JSON, its stdout).

    With ``profile`` (a file name), the command runs under ``py-spy record`` (its
    subprocesses too) and the folded stacks go to that file.
    """
    command = [str(BIN / "supplier-sync"), *argv]
    if profile:
        spy = shutil.which("py-spy") or str(BIN / "py-spy")
        command = [
            spy,
            "record",
            "--subprocesses",
            "--format",
            "raw",
            "-o",
            profile,
            "--",
            *command,
        ]
    began = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=cwd)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(
            f"supplier-sync {' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}"
        )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    return wall, (json.loads(lines[-1]) if lines else {}), done.stdout


def _step_seconds(dagster_home: str, run_id: str) -> float:
    import dagster as dg

    instance = dg.DagsterInstance.from_config(dagster_home)
    try:
        return run_steps(instance, [run_id]).busy
    finally:
        instance.dispose()


def _buffer_pool_note(db_url: str) -> str:
    """The MariaDB server's buffer pool against the sync database's size after the full sync.

    A window updates hotels all over the catalog: with a pool smaller than the database,
    InnoDB reads most of their pages from disk and flushes others to make room.
    """
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            pool = conn.execute(sa.text("SELECT @@innodb_buffer_pool_size")).scalar_one()
            size = conn.execute(
                sa.text(
                    "SELECT SUM(data_length + index_length) FROM information_schema.tables"
                    " WHERE table_schema = DATABASE()"
                )
            ).scalar_one()
    finally:
        engine.dispose()
    fits = "holds" if int(pool) >= int(size) else "does NOT hold"
    return (
        f"MariaDB innodb_buffer_pool_size {int(pool) / 2**20:.0f} MB {fits} the sync database "
        f"({int(size) / 2**20:.0f} MB after the full sync; the README's Configuration section)"
    )


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sqlite", "mariadb"], default="sqlite")
    parser.add_argument("--hotels", type=int, default=100_000)
    parser.add_argument("--cities", type=int, default=1000)
    parser.add_argument("--page-size", type=int, default=100)
    parser.add_argument("--mysql-url", default=MYSQL_URL)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="record the day's incremental command with py-spy (pip install py-spy) into FILE "
        "(folded stacks); its wall time then includes the sampler's cost",
    )
    args = parser.parse_args(argv)
    config = SimulatorConfig(
        seed=args.seed,
        n_cities=args.cities,
        total_hotels=args.hotels,
        api_key=API_KEY,
        empty_city_share=0.0,
        faults=FaultProfile.named("clean"),
        hotel_cache_size=max(50_000, 2 * args.hotels),
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench_incremental_"))
    ok = True
    try:
        with ServerProcess(config) as server, _sync_db(args, tmp) as db_url:
            world, warm = prewarm(server.url, args.page_size)
            print(
                f"{world.hotels} hotels in {len(world.cities)} cities, {args.backend} sync db, "
                f"clean profile, no rate limit; pre-warm {warm:.1f}s; machine speed "
                f"{calibrate():.2f}s for 10M Python additions",
                flush=True,
            )
            env = _env(tmp, db_url, server.url)
            full_s, full, _ = _command(
                env, tmp, "sync", "--full", "--json", "--trigger-id", f"b-{uuid.uuid4().hex[:8]}"
            )
            print(f"full sync: {full_s:.1f}s wall, {full['records']} records, {full['status']}")
            if args.backend == "mariadb":
                print(_buffer_pool_note(db_url), flush=True)
            httpx.post(f"{server.url}/_sim/advance_day", timeout=60).raise_for_status()
            # The simulator renders the day's changed hotels before the window is timed, as
            # it rendered every hotel before the full sync was (the supplier's own cost).
            warm_changes = prewarm_changes(server.url, config.epoch)
            # What the day changed: the same world, computed here.
            local = Simulator(config)
            local.advance_day()
            truth = local.ground_truth()
            inc_s, inc, _ = _command(
                env, tmp, "sync", "--incremental", "--json", profile=args.profile
            )
            window = inc["window"]
            share = inc_s / full_s
            inc_step = _step_seconds(
                os.path.join(tmp, "home", "dagster_home"), inc["dagster_run_id"]
            )
            print(
                f"incremental (one day; change feed pre-warmed in {warm_changes:.1f}s): "
                f"{inc_s:.1f}s wall ({share:.1%} of the full sync; target "
                f"<= {TARGET_SHARE:.0%}: {_verdict(share <= TARGET_SHARE)}), step {inc_step:.1f}s, "
                f"{window['changes']} changes in {window['pages']} pages, {window['published']} "
                f"published, {window['cities_touched']} cities; stages fetch "
                f"{window['fetch_seconds']:.1f}s, normalize {window['normalize_seconds']:.1f}s, "
                f"publish {window['publish_seconds']:.1f}s"
            )
            ok = ok and share <= TARGET_SHARE
            pub = published_catalog(db_url)
            removed = set(pub) - set(truth.versions)
            wrong = catalog_problems(
                {h: v for h, v in pub.items() if h not in removed}, dict(truth.valid)
            )
            print(
                "catalog vs the ground truth of day 1: "
                + ("equal" if not wrong else "; ".join(wrong))
                + f" ({len(removed)} removed hotels still published: the feed does not say; "
                "tombstones come from complete listings and reconciliation)"
            )
            ok = ok and not wrong
            quiet_s, quiet, _ = _command(env, tmp, "sync", "--incremental", "--json")
            quiet_step = _step_seconds(
                os.path.join(tmp, "home", "dagster_home"), quiet["dagster_run_id"]
            )
            print(
                f"incremental (nothing new): {quiet_s:.1f}s wall, step {quiet_step:.2f}s (target "
                f"<= {TARGET_QUIET_STEP_S:g}s: {_verdict(quiet_step <= TARGET_QUIET_STEP_S)}), "
                f"{quiet['window']['changes']} changes re-read from the overlap, "
                f"{quiet['window']['published']} published"
            )
            ok = ok and quiet_step <= TARGET_QUIET_STEP_S
            before = httpx.get(f"{server.url}/_sim/stats", timeout=30).json()["requests_total"]
            began = time.perf_counter()
            done = subprocess.run(
                [str(BIN / "supplier-sync"), "reconcile", "--no-repull", "--json"],
                env=env,
                capture_output=True,
                text=True,
                cwd=tmp,
            )
            rec_s = time.perf_counter() - began
            rows = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
            differing = [r for r in rows if r["differs"]]
            after = httpx.get(f"{server.url}/_sim/stats", timeout=30).json()["requests_total"]
            requests = after - before
            cheap = requests <= len(world.cities)
            print(
                f"reconcile {len(rows)} cities: {rec_s:.1f}s wall (target <= "
                f"{TARGET_RECONCILE_S:g}s: {_verdict(rec_s <= TARGET_RECONCILE_S)}), {requests} "
                f"supplier requests (a summary per city; the city list is the stored one; target <= one per "
                f"city: {_verdict(cheap)}), {len(differing)} cities beyond the tolerance (removed "
                "hotels: the feed does not report them; a re-pull unpublishes them)"
            )
            ok = ok and rec_s <= TARGET_RECONCILE_S and cheap and len(rows) == len(world.cities)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


class _sync_db:
    """A throwaway sync database URL (a SQLite file, or a MariaDB database)."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self._made: Any = None

    def __enter__(self) -> str:
        if self.args.backend == "sqlite":
            return f"sqlite:///{self.tmp / 'sync.sqlite3'}"
        self._made = mariadb_databases(["sync"], self.args.mysql_url)
        names = self._made.__enter__()
        return mariadb_url(names[0], self.args.mysql_url)

    def __exit__(self, *exc: object) -> None:
        if self._made is not None:
            self._made.__exit__(*exc)


if __name__ == "__main__":
    sys.exit(main())
