"""Benchmark the paths users run: ``supplier-sync sync --full`` and a backfill under the daemon.

The simulator serves its cities over loopback HTTP from its own process (clean profile,
heavy-tailed city sizes: Zipf exponent 1.0 by default, no empty city, no rate limit unless
``--rate``); every page is walked once before timing, so that its world generation is not
measured. The sync database is a throwaway SQLite file or a ``bench_<random>`` MariaDB
database, dropped afterwards; the state folder (``SUPPLIER_SYNC_HOME``, with its Dagster
instance) and the payloads are in a temp folder.

Paths (``--path``):
  sync      ``supplier-sync sync --full --json`` as a subprocess, configured through the
            ``SUPPLIER_SYNC_*`` environment as a user would; the wall time is the command's.
  backfill  ``dagster-webserver`` and ``supplier-sync daemon`` on a fresh instance; a backfill
            of every city is launched through GraphQL (as ``bench_backfill.py`` does); the
            wall time runs from the launch to the last run's last event. The daemon's
            runs are paced through ``SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT`` (``--rate``, else
            unlimited); with ``--rate`` they share one bucket in Redis
            (``SUPPLIER_SYNC_REDIS_URL``, ``--redis-url``), as a deployment's runs must.

Reported: hotels/s against the issue #16 targets (>= 3,000 hotels/s for 50k hotels in 100
cities; >= 2,000 for 100k in 1,000 cities; the first applies below 1,000 cities, the second
from 1,000), the stage breakdown (fetch, normalize, publish summed from each city's
materialization metadata on the instance; the time in cities; the step time outside the
cities, where the run writes each city's Dagster events; and the wall time outside the
step: process start-up, imports, the instance, run start and end), and a correctness check
(the published catalog, supplier hotel id -> supplier version, equals the simulator's ground
truth).

``--count-statements N`` (default 20; 0 skips) also syncs N one-page cities in this process
with ``run_cities``, the code a Dagster run calls per city, and counts the sync
database's statements (``after_cursor_execute``) and commits per city, by stage, against the
issue's aim (<= 20 statements and <= 4 commits for a one-page city).

``--rate R`` limits the simulator to R requests/s and passes ``--rate-limit R`` to the
command (page size 100): the wall time is compared with the budget 1.05 x pages / R + 10 s.

Exit status 1 when a target is missed or the catalog is wrong. Today's figures are in
``docs/benchmarks.md``.

Usage:
    .venv/bin/python bench/bench_user_path.py [--path sync|backfill]
        [--backend sqlite|mariadb] [--hotels 5000] [--cities 50] [--zipf 1.0]
        [--page-size 100] [--rate R] [--processes N] [--count-statements 20] [--no-run]
        [--profile FILE]
        [--mysql-instance] [--mysql-url mysql+pymysql://root@127.0.0.1:3306]

    # the issue's figures:
    .venv/bin/python bench/bench_user_path.py --hotels 50000 --cities 100
    .venv/bin/python bench/bench_user_path.py --hotels 100000 --cities 1000
    .venv/bin/python bench/bench_user_path.py --hotels 24000 --cities 80 --rate 40
    .venv/bin/python bench/bench_user_path.py --path backfill --hotels 50000 --cities 100
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
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    API_KEY,
    MYSQL_URL,
    CityStages,
    World,
    catalog_problems,
    city_stages,
    mariadb_databases,
    mariadb_url,
    prewarm,
    published_catalog,
    run_backfill,
    run_steps,
    union_seconds,
)
from bench_client import ServerProcess
from bench_pipeline import calibrate

from supplier_sync_dagster.simulator import FaultProfile, SimulatorConfig

BIN = Path(sys.executable).parent
# Issue #16: hotels/s below 1,000 cities (50k in 100) and from 1,000 cities (100k in 1,000).
TARGET_FEW_CITIES = 3000.0
TARGET_MANY_CITIES = 2000.0
MANY_CITIES = 1000
TARGET_STATEMENTS = 20
TARGET_COMMITS = 4
UNLIMITED_RATE = 1e6  # the command's --rate-limit when the supplier has none


@dataclass
class Measured:
    """One timed run of a path and what it published."""

    wall: float
    hotels: int
    stages: CityStages
    step: float
    steps: list[tuple[float, float]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _env(tmp: Path, db_url: str, supplier_url: str, args: argparse.Namespace) -> dict[str, str]:
    """A user's environment: only the SUPPLIER_SYNC_* settings this run means."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUPPLIER_SYNC_", "DAGSTER"))}
    env.update(
        SUPPLIER_SYNC_HOME=str(tmp / "home"),
        SUPPLIER_SYNC_DB_URL=db_url,
        SUPPLIER_SYNC_SUPPLIER_URL=supplier_url,
        SUPPLIER_SYNC_SUPPLIER_API_KEY=API_KEY,
        SUPPLIER_SYNC_PAYLOAD_URL=f"file://{tmp / 'payloads'}",
        SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT=str(args.rate or UNLIMITED_RATE),
    )
    if args.processes is not None:
        env["SUPPLIER_SYNC_WORKER_PROCESSES"] = str(args.processes)
    if args.rate and args.path == "backfill":  # several runs at once: one budget
        env["SUPPLIER_SYNC_REDIS_URL"] = args.redis_url
    return env


def run_sync(
    tmp: Path, db_url: str, supplier_url: str, args: argparse.Namespace, world: World
) -> Measured:
    """``supplier-sync sync --full`` as a subprocess, then what its instance recorded."""
    import dagster as dg

    cmd = [
        str(BIN / "supplier-sync"),
        "sync",
        "--full",
        "--json",
        "--page-size",
        str(args.page_size),
        "--rate-limit",
        str(args.rate or UNLIMITED_RATE),
        "--trigger-id",
        f"bench-{uuid.uuid4().hex[:12]}",
    ]
    if args.city_threads:
        cmd += ["--city-threads", str(args.city_threads)]
    if args.profile:
        # Its worker processes too; the wall time then includes the sampler's cost.
        spy = shutil.which("py-spy") or str(BIN / "py-spy")
        cmd = [spy, "record", "--subprocesses", "--format", "raw", "-o", args.profile, "--", *cmd]
    began = time.perf_counter()
    done = subprocess.run(
        cmd, env=_env(tmp, db_url, supplier_url, args), capture_output=True, text=True, cwd=tmp
    )
    wall = time.perf_counter() - began
    if done.returncode != 0 and not done.stdout.strip():
        raise RuntimeError(f"sync --full exited {done.returncode}: {done.stderr[-3000:]}")
    # The JSON summary is the command's last line starting with "{" (py-spy prints too).
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    summary: dict[str, Any] = json.loads(lines[-1] if lines else done.stdout)
    instance = dg.DagsterInstance.from_config(summary["dagster_home"])
    try:
        steps = run_steps(instance, [summary["dagster_run_id"]])
        stages = city_stages(instance)
    finally:
        instance.dispose()
    problems = []
    if done.returncode != 0 or summary["status"] != "SUCCESS":
        problems.append(
            f"exit {done.returncode}, batch {summary['status']}: {done.stderr.strip()[-300:]}"
        )
    if summary["cities_done"] != len(world.cities):
        problems.append(f"{summary['cities_done']} of {len(world.cities)} cities done")
    return Measured(
        wall=wall,
        hotels=int(summary["records"]),
        stages=stages,
        step=steps.busy,
        steps=steps.steps,
        problems=problems,
        notes=[
            f"outside the step: {wall - summary['seconds']:.1f}s in the command around the run "
            f"(interpreter start, imports, instance, city list and partitions, summary) + "
            f"{summary['seconds'] - steps.busy:.1f}s in the run around its step (run start "
            "with its planned events per partition, resources, run end)"
        ],
    )


def run_daemon_backfill(
    tmp: Path, db_url: str, supplier_url: str, args: argparse.Namespace, world: World
) -> Measured:
    """A backfill of every city under ``supplier-sync daemon``, then what its instance recorded."""
    import dagster as dg

    from supplier_sync_dagster.dagster_instance.deployment import (
        ROOT,
        DagsterProcesses,
        migrate_instance,
        profile_env,
    )
    from supplier_sync_dagster.defs.partitions import encode_city_key

    home = tmp / "dagster_home"
    home.mkdir()
    env = _env(tmp, db_url, supplier_url, args)
    with mariadb_databases(["dg"] if args.mysql_instance else [], args.mysql_url) as made:
        if made:
            shutil.copy(ROOT / "deploy" / "mysql" / "dagster.yaml", home / "dagster.yaml")
            env["DAGSTER_MYSQL_URL"] = f"mysql+mysqlconnector://root@127.0.0.1:3306/{made[0]}"
        else:
            shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
        env = profile_env(dagster_home=home, extra=env)
        os.environ.update({k: v for k, v in env.items() if k.startswith("DAGSTER")})
        if made:
            migrate_instance(env)
        keys = [encode_city_key(c) for c in world.cities]
        # Made before the webserver and the daemon start: three processes creating the
        # SQLite instance's tables at once can leave two alembic heads.
        instance = dg.DagsterInstance.get()
        with DagsterProcesses(env, tmp / "logs") as dagster:
            done = run_backfill(dagster, instance, keys, timeout=args.timeout)
            stages = city_stages(instance)
    problems = []
    if done.ok_runs != len(done.run_ids):
        problems.append(f"{done.ok_runs} of {len(done.run_ids)} runs succeeded")
    if not done.shown == done.own == len(keys):
        problems.append(
            f"{done.shown} of {len(keys)} partitions materialized, {done.own} with their own metadata"
        )
    first_step = min(a for a, _ in done.steps.steps) - done.launched
    return Measured(
        wall=done.wall,
        hotels=world.hotels,
        stages=stages,
        step=done.steps.busy,
        steps=done.steps.steps,
        problems=problems,
        notes=[
            f"{len(done.run_ids)} run(s); launch -> first run {done.first_run:.1f}s, "
            f"-> first step {first_step:.1f}s"
        ],
    )


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def report_run(m: Measured, args: argparse.Namespace, world: World) -> bool:
    """Prints a timed run against its target; returns whether it met it and was correct."""
    rate = m.hotels / m.wall if m.wall else 0.0
    line = (
        f"{args.path} ({args.backend}): {m.hotels} hotels in {m.wall:.1f}s = {rate:,.0f} hotels/s"
    )
    if args.rate:
        pages = world.pages(args.page_size)
        budget = 1.05 * pages / args.rate + 10
        met = m.wall <= budget
        line += (
            f"; rate limit R = {args.rate:g}/s, {pages} pages: wall {m.wall:.1f}s vs budget "
            f"1.05 x pages / R + 10 s = {budget:.1f}s [{_verdict(met)}]"
        )
    else:
        many = len(world.cities) >= MANY_CITIES
        target = TARGET_MANY_CITIES if many else TARGET_FEW_CITIES
        met = rate >= target
        size = "100k hotels in 1,000 cities" if many else "50k hotels in 100 cities"
        line += f" [target >= {target:,.0f} ({size}): {_verdict(met)}]"
    print(line)
    s = m.stages.seconds
    in_stages = s["fetch"] + s["normalize"] + s["publish"]
    print(
        f"  stages, summed over {m.stages.cities} cities' metadata (with cities in flight at "
        f"once the sums exceed the wall): fetch {s['fetch']:.1f}s, normalize "
        f"{s['normalize']:.1f}s, publish {s['publish']:.1f}s = {in_stages:.1f}s; in cities "
        f"{s['city']:.1f}s (claim, gates, snapshots, finish: {s['city'] - in_stages:.1f}s)"
    )
    in_flight = union_seconds(m.stages.intervals)
    edges = ""
    if m.steps and m.stages.intervals:
        before = min(a for a, _ in m.stages.intervals) - min(a for a, _ in m.steps)
        after = max(b for _, b in m.steps) - max(b for _, b in m.stages.intervals)
        between = m.step - in_flight - before - after
        edges = (
            f": {before:.1f}s before the first city, {between:.1f}s between cities (each "
            f"city's Dagster events and instance look-ups, progress), {after:.1f}s after the last"
        )
    outside = m.wall - m.step
    print(
        f"  wall {m.wall:.1f}s = step executing {m.step:.1f}s (some city in flight "
        f"{in_flight:.1f}s; none {m.step - in_flight:.1f}s{edges}) + outside any step {outside:.1f}s "
        f"= {outside / m.wall:.0%} of wall (Dagster's share as bench_backfill counts it: "
        + (
            "process start, imports, instance, run start and end)"
            if args.path == "sync"
            else "daemon ticks, run queueing, run worker start-up, code loading)"
        )
    )
    if m.steps and m.stages.intervals:
        first = min(a for a, _ in m.steps)
        print(
            "  largest cities (the critical path: one worker syncs a city): "
            + "; ".join(
                f"{n:,} hotels {b - a:.1f}s (+{a - first:.1f}s to +{b - first:.1f}s of the step)"
                for n, a, b in m.stages.largest()
            )
        )
    for note in m.notes:
        print(f"  {note}")
    print("  catalog: " + ("correct" if not m.problems else "WRONG: " + "; ".join(m.problems)))
    return met and not m.problems


@dataclass
class StatementCounter:
    """Statements and commits on an engine, by the stage that was running."""

    stage: str = "run"
    statements: Counter[str] = field(default_factory=Counter)
    commits: Counter[str] = field(default_factory=Counter)
    begins: int = 0

    @contextlib.contextmanager
    def at(self, stage: str) -> Iterator[None]:
        """Counts what runs inside the block under ``stage``."""
        outer, self.stage = self.stage, stage
        try:
            yield
        finally:
            self.stage = outer

    def wrap(self, owner: Any, name: str, stage: str) -> None:
        """Counts what ``owner.name`` runs under ``stage`` (until the process ends)."""
        fn = getattr(owner, name)

        def counted(*a: Any, **kw: Any) -> Any:
            with self.at(stage):
                return fn(*a, **kw)

        setattr(owner, name, counted)


def count_statements(args: argparse.Namespace, db_url: str) -> bool:
    """Syncs one-page cities with ``run_cities`` in this process and counts per city.

    Returns:
        Whether statements and commits per city are within the issue's aim.
    """
    import httpx
    import sqlalchemy as sa

    from supplier_sync_dagster.core.leasing.leases import LeaseSettings
    from supplier_sync_dagster.core.records.diff import default_risk_policy
    from supplier_sync_dagster.core.settings import (
        DEFAULT_MAX_CLOCK_SKEW_SECONDS,
        DEFAULT_TASK_CODE,
    )
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.store.payloads import open_payload_store
    from supplier_sync_dagster.core.supplier import SupplierClient
    from supplier_sync_dagster.core.sync import city, run, stages
    from supplier_sync_dagster.core.sync.model import build_sync_settings
    from supplier_sync_dagster.simulator import Simulator

    n = args.count_statements
    config = SimulatorConfig(
        seed=args.seed,
        n_cities=n,
        total_hotels=n * (args.page_size // 2),
        api_key=API_KEY,
        zipf_exponent=0.0,
        empty_city_share=0.0,
    )
    counter = StatementCounter()
    counter.wrap(city, "fetch_pages", "fetch")
    counter.wrap(stages.Normalizer, "add", "normalize")
    counter.wrap(stages.Normalizer, "finish", "normalize")
    counter.wrap(city, "publish_city", "publish")
    make_gate = run.gate_for_pipeline

    def counted_gate_for_pipeline(*a: Any, **kw: Any) -> Any:
        gate = make_gate(*a, **kw)

        def counted_gate(*ga: Any, **gkw: Any) -> Any:
            with counter.at("gates"):
                return gate(*ga, **gkw)

        return counted_gate

    run.gate_for_pipeline = counted_gate_for_pipeline
    tmp = Path(tempfile.mkdtemp(prefix="bench_statements_"))
    db = SyncDatabase.open(db_url)
    store = open_payload_store(f"file://{tmp / 'payloads'}")
    sim = Simulator(config)
    cpu: list[float] = []
    try:
        with httpx.Client(base_url="http://simulator.local", transport=sim.transport()) as http:
            client = SupplierClient(http, api_key=API_KEY, supplier_id="1001")
            # The task and supplier of `sync --full` (a missing task is created on first use).
            settings = build_sync_settings(
                task_code=DEFAULT_TASK_CODE,
                supplier_id=1001,
                page_size=args.page_size,
                lease=LeaseSettings(),
                risk_policy=default_risk_policy,
                max_clock_skew_seconds=DEFAULT_MAX_CLOCK_SKEW_SECONDS,
            )
            listed = client.list_cities().data.cities
            cities = [c.city_code for c in listed]
            one_page = sum(1 for c in listed if (c.hotel_count or 0) <= args.page_size)
            request = run.RunRequest(trigger_id="bench-statements", source="MANUAL", cities=cities)
            plan = run.plan_run(db, store, client, request, settings)
            executed: Counter[str] = Counter()

            def on_statement(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
                counter.statements[counter.stage] += 1
                if statement.lstrip().upper().startswith("BEGIN"):
                    counter.begins += 1

            def on_commit(*_: Any) -> None:
                counter.commits[counter.stage] += 1

            sa.event.listen(db.engine, "after_cursor_execute", on_statement)
            sa.event.listen(db.engine, "commit", on_commit)
            started = time.process_time()
            for outcome in run.run_cities(
                db, store, client, plan, request, settings, worker_id="b"
            ):
                executed[outcome.status] += 1
                now = time.process_time()
                cpu.append(now - started)
                started = now
            sa.event.remove(db.engine, "after_cursor_execute", on_statement)
            sa.event.remove(db.engine, "commit", on_commit)
    finally:
        db.dispose()
        shutil.rmtree(tmp, ignore_errors=True)
    per = len(cities)
    statements = sum(counter.statements.values()) / per
    commits = sum(counter.commits.values()) / per
    ok = statements <= TARGET_STATEMENTS and commits <= TARGET_COMMITS
    order = ["run", "fetch", "normalize", "gates", "publish"]
    by_stage = ", ".join(
        f"{stage} {counter.statements[stage] / per:.1f}/{counter.commits[stage] / per:.1f}"
        for stage in order
        if counter.statements[stage] or counter.commits[stage]
    )
    cpu_ms = sorted(cpu)[len(cpu) // 2] * 1000 if cpu else float("nan")
    print(
        f"per one-page city ({args.backend}, run_cities in process, {per} cities, "
        f"{one_page} of one page, statuses {dict(executed)}): {statements:.1f} statements "
        f"[aim <= {TARGET_STATEMENTS}: {_verdict(statements <= TARGET_STATEMENTS)}], "
        f"{commits:.1f} commits [aim <= {TARGET_COMMITS}: {_verdict(commits <= TARGET_COMMITS)}], "
        f"median CPU {cpu_ms:.0f} ms"
    )
    if counter.begins:
        print(f"  of the statements, {counter.begins / per:.1f} are SQLite's explicit BEGIN")
    print(f"  statements/commits by stage ('run': claim, snapshots, finish...): {by_stage}")
    return ok and executed == Counter({"SUCCESS": per})


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=["sync", "backfill"], default="sync")
    parser.add_argument("--backend", choices=["sqlite", "mariadb"], default="sqlite")
    parser.add_argument("--hotels", type=int, default=5000, help="hotels in the world")
    parser.add_argument("--cities", type=int, default=50, help="cities in the world")
    parser.add_argument("--zipf", type=float, default=1.0, help="skew of city sizes")
    parser.add_argument("--page-size", type=int, default=100)
    parser.add_argument("--rate", type=float, default=None, help="supplier limit, requests/s")
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="--path sync: record the command and its worker processes with py-spy (pip "
        "install py-spy) into FILE (folded stacks)",
    )
    parser.add_argument(
        "--processes", type=int, default=None, help="worker processes per run (default: auto)"
    )
    parser.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/0", help="backfill --rate: shared bucket"
    )
    parser.add_argument(
        "--count-statements", type=int, default=20, help="one-page cities to count (0: skip)"
    )
    parser.add_argument(
        "--city-threads", type=int, default=0, help="sync: pass --city-threads (0: its default)"
    )
    parser.add_argument("--no-run", action="store_true", help="only count statements")
    parser.add_argument("--mysql-instance", action="store_true", help="backfill: MySQL instance")
    parser.add_argument("--mysql-url", default=MYSQL_URL, help="server URL, no database")
    parser.add_argument("--timeout", type=float, default=3600, help="backfill timeout, s")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)

    ok = True
    if args.count_statements:
        tmp = Path(tempfile.mkdtemp(prefix="bench_count_"))
        try:
            with _sync_db(args, tmp) as db_url:
                ok = count_statements(args, db_url) and ok
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.no_run:
        return 0 if ok else 1
    config = SimulatorConfig(
        seed=args.seed,
        n_cities=args.cities,
        total_hotels=args.hotels,
        api_key=API_KEY,
        zipf_exponent=args.zipf,
        empty_city_share=0.0,
        rate_limit_rps=args.rate,
        faults=FaultProfile.named("clean"),
        # Every hotel the pre-warm renders stays cached: the run measures the sync.
        hotel_cache_size=max(50_000, args.hotels),
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench_user_path_"))
    try:
        with ServerProcess(config, truth=True) as server, _sync_db(args, tmp) as db_url:
            valid, bad = server.truth
            world, warm = prewarm(server.url, args.page_size, rate=args.rate)
            sizes = sorted(world.sizes.values(), reverse=True)
            print(
                f"{args.path} of {world.hotels} hotels in {len(world.cities)} cities (largest "
                f"{', '.join(map(str, sizes[:3]))}; median {sizes[len(sizes) // 2]}), page size "
                f"{args.page_size}, {args.backend} sync db, clean profile, "
                + (f"supplier limited to {args.rate:g}/s" if args.rate else "no rate limit")
                + f"; pre-warm {warm:.1f}s; machine speed {calibrate():.2f}s for 10M Python "
                "additions (smaller is faster: compare runs relative to it)",
                flush=True,
            )
            if args.rate:
                time.sleep(1.5)  # the simulator's bucket refills after the pre-warm
            measure = run_sync if args.path == "sync" else run_daemon_backfill
            m = measure(tmp, db_url, server.url, args, world)
            m.problems += catalog_problems(published_catalog(db_url), valid)
            if bad:
                m.problems.append(f"{len(bad)} bad records on the clean profile")
        ok = report_run(m, args, world) and ok
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


@contextlib.contextmanager
def _sync_db(args: argparse.Namespace, tmp: Path) -> Iterator[str]:
    """A throwaway sync database URL: a SQLite file in ``tmp``, or a MariaDB database."""
    if args.backend == "sqlite":
        yield f"sqlite:///{tmp / 'sync.sqlite3'}"
        return
    with mariadb_databases(["sync"], args.mysql_url) as made:
        yield mariadb_url(made[0], args.mysql_url)


if __name__ == "__main__":
    sys.exit(main())
