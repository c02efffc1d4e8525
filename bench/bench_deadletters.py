"""Benchmark dead-letter compensation and trace on the paths users run (issue #19).

The simulator serves its world over loopback HTTP from its own process (clean profile, no
rate limit). Against one throwaway sync database (SQLite or a ``bench_<random>`` MariaDB
database) and one state folder:

**Compensation** (target >= 500 hotels/s): ``--due`` retryable dead letters
(SUPPLIER_UNAVAILABLE, as a detail-service outage leaves them) are written for hotels the
supplier holds, all due; then ``supplier-sync dead-letters compensate --json`` runs as a
subprocess: one detail request per hotel, every stage, a batch of its own. Its wall time
(the command's, start-up included) gives hotels/s; every row must end RESOLVED and the
published catalog equal the supplier's ground truth for those hotels.

**Trace** (target <= 1 s): a catalog of ``--hotels`` hotels with three days of history
(``sync --full``, then the supplier moves a day and ``sync --incremental`` runs, twice);
``supplier-sync trace HOTEL --field price_amount --json`` for hotels that changed each day,
as a subprocess: the command's wall time, start-up included, and each raw page verified.

Usage:
    .venv/bin/python bench/bench_deadletters.py [--due 10000] [--hotels 100000]
        [--cities 1000] [--backend sqlite|mariadb] [--skip-trace] [--skip-compensation]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import API_KEY, MYSQL_URL, prewarm, published_catalog
from bench_client import ServerProcess
from bench_incremental import _sync_db
from bench_pipeline import calibrate

from supplier_sync_dagster.core.records.deadletters import DeadLetter, record_dead_letters
from supplier_sync_dagster.core.settings import DEFAULT_TASK_CODE
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.simulator import FaultProfile, Simulator, SimulatorConfig

BIN = Path(sys.executable).parent
TARGET_HOTELS_PER_S = 500.0
TARGET_TRACE_S = 1.0


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


def _command(env: dict[str, str], cwd: Path, *argv: str) -> tuple[float, Any, str]:
    """``supplier-sync ARGV`` as a subprocess: (wall seconds, its last JSON line, stdout)."""
    began = time.perf_counter()
    done = subprocess.run(
        [str(BIN / "supplier-sync"), *argv], env=env, capture_output=True, text=True, cwd=cwd
    )
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(
            f"supplier-sync {' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}"
        )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    return wall, (json.loads(lines[-1]) if lines else {}), done.stdout


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def _seed_dead_letters(db_url: str, hotels: list[str]) -> None:
    db = SyncDatabase.open(db_url)
    try:
        for start in range(0, len(hotels), 2000):
            with db.begin() as conn:
                record_dead_letters(
                    conn,
                    db.clock,
                    batch_id="bench-outage",
                    task_code=DEFAULT_TASK_CODE,
                    sync_mode="FULL",
                    supplier_id=1001,
                    letters=[
                        DeadLetter(
                            h,
                            "ADAPTER",
                            "RETRYABLE",
                            "SUPPLIER_UNAVAILABLE",
                            "GET /v1/hotels/{id}: 503 (the detail service was down)",
                            None,
                            None,
                            record_position="confirm_missing",
                        )
                        for h in hotels[start : start + 2000]
                    ],
                )
        import sqlalchemy as sa

        from supplier_sync_dagster.core.store import schema

        with db.begin() as conn:  # the outage was a while ago: every row is due
            conn.execute(sa.update(schema.dead_letter).values(next_retry_at=db.clock.now(-60)))
    finally:
        db.dispose()


def _statuses(db_url: str) -> dict[str, int]:
    import sqlalchemy as sa

    from supplier_sync_dagster.core.store import schema

    engine = sa.create_engine(db_url)
    try:
        d = schema.dead_letter.c
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(d.status, sa.func.count())
                .where(d.batch_id == "bench-outage")
                .group_by(d.status)
            ).all()
    finally:
        engine.dispose()
    return {str(s): int(n) for s, n in rows}


def compensation(args: argparse.Namespace) -> bool:
    """10k due dead letters compensated by the CLI; hotels/s and correctness."""
    hotels_total = int(args.due * 1.1)
    config = SimulatorConfig(
        seed=args.seed,
        n_cities=max(10, hotels_total // 500),
        total_hotels=hotels_total,
        api_key=API_KEY,
        empty_city_share=0.0,
        faults=FaultProfile.named("clean"),
        hotel_cache_size=max(50_000, 2 * hotels_total),
    )
    truth = Simulator(config).ground_truth()
    candidates = sorted([*truth.valid, *truth.bad])
    chosen = candidates[: args.due]
    tmp = Path(tempfile.mkdtemp(prefix="bench_deadletters_"))
    try:
        with ServerProcess(config) as server, _sync_db(args, tmp) as db_url:
            prewarm(server.url, 100)  # the simulator renders each hotel once, before timing
            _seed_dead_letters(db_url, chosen)
            env = _env(tmp, db_url, server.url)
            before = httpx.get(f"{server.url}/_sim/stats", timeout=30).json()["requests_total"]
            wall, out, _ = _command(
                env, tmp, "dead-letters", "compensate", "--json", "--limit", str(args.due)
            )
            after = httpx.get(f"{server.url}/_sim/stats", timeout=30).json()["requests_total"]
            rate = out["claimed"] / wall
            seconds = out.get("seconds", {})
            print(
                f"compensate {out['claimed']} due dead letters ({args.backend}): {wall:.1f}s wall "
                f"= {rate:,.0f} hotels/s (target >= {TARGET_HOTELS_PER_S:g}: "
                f"{_verdict(rate >= TARGET_HOTELS_PER_S)}); {after - before} supplier requests; "
                f"{out['resolved']} resolved ({out['refused_again']} refused again), "
                f"{out['published']} published; stages "
                + ", ".join(f"{k} {v:.1f}s" for k, v in sorted(seconds.items()))
            )
            statuses = _statuses(db_url)
            pub = published_catalog(db_url)
            expected = {h: v for h, v in truth.valid.items() if h in set(chosen)}
            right = statuses == {"RESOLVED": len(chosen)} and pub == expected
            print(
                f"dead letters {statuses}; published {len(pub)} = ground truth {len(expected)} "
                f"of the chosen hotels: {'equal' if pub == expected else 'DIFFERENT'}"
            )
            return rate >= TARGET_HOTELS_PER_S and right and after - before == len(chosen)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def trace(args: argparse.Namespace) -> bool:
    """A catalog with three days of history; trace of hotels that changed every day."""
    config = SimulatorConfig(
        seed=args.seed,
        n_cities=args.cities,
        total_hotels=args.hotels,
        api_key=API_KEY,
        empty_city_share=0.0,
        faults=FaultProfile.named("clean"),
        hotel_cache_size=max(50_000, 2 * args.hotels),
    )
    local = Simulator(config)
    versions = [dict(local.ground_truth().valid)]
    tmp = Path(tempfile.mkdtemp(prefix="bench_trace_"))
    try:
        with ServerProcess(config) as server, _sync_db(args, tmp) as db_url:
            prewarm(server.url, 100)
            env = _env(tmp, db_url, server.url)
            began = time.perf_counter()
            _command(
                env, tmp, "sync", "--full", "--json", "--trigger-id", f"b-{uuid.uuid4().hex[:8]}"
            )
            for _ in range(2):
                httpx.post(f"{server.url}/_sim/advance_day", timeout=60).raise_for_status()
                local.advance_day()
                versions.append(dict(local.ground_truth().valid))
                _command(env, tmp, "sync", "--incremental", "--json")
            print(
                f"catalog of {args.hotels} hotels in {args.cities} cities with 3 days of history "
                f"built in {time.perf_counter() - began:.0f}s ({args.backend})"
            )
            changed = [
                h
                for h, v in versions[0].items()
                if versions[1].get(h, v) != v and versions[2].get(h, v) != versions[1].get(h, v)
            ][: args.traces]
            if not changed:
                print("no hotel changed on both days: nothing to trace")
                return False
            walls: list[float] = []
            ok = True
            for hotel in changed:
                wall, t, _ = _command(env, tmp, "trace", hotel, "--json")
                walls.append(wall)
                ok = ok and all(r["verified"] for r in t["raw"]) and len(t["diffs"]) >= 3
            field_wall, t, _ = _command(
                env, tmp, "trace", changed[0], "--field", "price_amount", "--json"
            )
            walls.sort()
            worst = walls[-1]
            print(
                f"trace of {len(changed)} hotels changed on each day: median {walls[len(walls) // 2]:.2f}s, "
                f"worst {worst:.2f}s wall per command, start-up included (target <= "
                f"{TARGET_TRACE_S:g}s: {_verdict(worst <= TARGET_TRACE_S)}); --field price_amount "
                f"{field_wall:.2f}s with {len(t['diffs'])} diffs; every raw page verified: {ok}"
            )
            return ok and worst <= TARGET_TRACE_S
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sqlite", "mariadb"], default="sqlite")
    parser.add_argument("--due", type=int, default=10_000)
    parser.add_argument("--hotels", type=int, default=100_000)
    parser.add_argument("--cities", type=int, default=1000)
    parser.add_argument("--traces", type=int, default=10)
    parser.add_argument("--mysql-url", default=MYSQL_URL)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--skip-compensation", action="store_true")
    parser.add_argument("--skip-trace", action="store_true")
    args = parser.parse_args(argv)
    print(f"machine speed {calibrate():.2f}s for 10M Python additions", flush=True)
    ok = True
    if not args.skip_compensation:
        ok = compensation(args) and ok
    if not args.skip_trace:
        ok = trace(args) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
