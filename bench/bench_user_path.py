"""Benchmark the paths users run: ``supplier-sync sync --full`` and a backfill under the daemon,
side by side with the dlt peers and the fetch-only ceiling in one invocation (issue #42).

The simulator serves its cities over loopback HTTP from its own process (clean profile,
heavy-tailed city sizes: Zipf exponent 1.0 by default, no empty city, no rate limit unless
``--rate``; ``--data-profile`` picks its data set when the simulator has named ones); every
page is walked once before timing, so that its world generation is not measured. Each
project run gets its own throwaway sync database (a SQLite file or a ``bench_<random>``
MariaDB database, dropped afterwards), state folder (``SUPPLIER_SYNC_HOME``), payloads and
Dagster instance.

Paths (``--path``):
  sync      ``supplier-sync sync --full --json`` as a subprocess, configured through the
            ``SUPPLIER_SYNC_*`` environment as a user would; the wall time is the command's.
  backfill  ``dagster-webserver`` and ``supplier-sync daemon`` on a fresh instance; a backfill
            of every city is launched through GraphQL (as ``bench_backfill.py`` does); the
            wall time runs from the launch to the last run's last event. The daemon's
            runs are paced through ``SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT`` (``--rate``, else
            unlimited); with ``--rate`` they share one bucket in Redis
            (``SUPPLIER_SYNC_REDIS_URL``, ``--redis-url``), as a deployment's runs must.

Dagster instances (``--instance``):
  embedded  ``sync``: no ``DAGSTER_HOME``, the command makes its own in the state folder;
            ``backfill``: a ``DAGSTER_HOME`` holding the project's ``dagster.yaml``.
  plain     a ``DAGSTER_HOME`` holding the stock ``dagster.yaml`` ``dagster dev`` leaves
            (telemetry off, Dagster's default SQLite storage): the command must leave it as is.
  mysql     the production profile: a MariaDB sync database and a ``DAGSTER_HOME`` with
            ``deploy/mysql/dagster.yaml`` on a throwaway MariaDB database (implies
            ``--backend mariadb``; ``--mysql-instance`` is an alias).
  mysql-stock  a user's own dagster-mysql instance: a ``DAGSTER_HOME`` whose ``dagster.yaml``
            says only ``storage: mysql`` (and telemetry off), on a throwaway MariaDB database;
            the command must leave it as is (implies ``--backend mariadb``).

Side by side (unless ``--no-peers``, or ``--rate``: the peers and the ceiling are measured
without a rate limit), in this order: the project, dlt plain, dlt ``--tuned``
(``../shared/bench/dlt_peer.py``, ``--dlt-peer``, run as a process with ``--page-size``
``--peer-page-size`` into the same kind of database), the fetch-only ceiling (4 threads,
each with its own client, GET and decode every page of every city, nothing stored), the
project again. Each is timed as a process (its wall time); each peer's ``hotels`` table
must hold every valid hotel. Printed: the ratios of the project (the mean of its two runs,
and each) to the better dlt, to each dlt and to the ceiling, against the issue's targets
(>= 3x the better dlt; >= 0.40 of the ceiling as a stretch).

Reported per project run: hotels/s against the issue #16 targets (>= 3,000 hotels/s for 50k
hotels in 100 cities; >= 2,000 for 100k in 1,000 cities), the stage breakdown (wall seconds
summed from each city's materialization metadata), the CPU (the machine's busy share over
all cores from ``/proc/stat`` against the >= 90 % target; the CPU-seconds of the command's
process tree, from ``getrusage(RUSAGE_CHILDREN)`` once its processes are reaped, with a
``/proc`` sampling of the tree beside it as a check; the simulator's; and per 1,000 hotels by
stage: fetch, normalize+quality, publish from each city's ``cpu_*_seconds``, and Dagster
and the rest = the tree's total minus those three), and a correctness check (the published
catalog, supplier hotel id -> supplier version, equals the simulator's ground truth).

``--count-statements N`` (default 20; 0 skips) also syncs N one-page cities in this process
with ``run_cities``, the code a Dagster run calls per city, and counts the sync
database's statements (``after_cursor_execute``) and commits per city, by stage, against the
issue's aim (<= 20 statements and <= 4 commits for a one-page city).

``--rate R`` limits the simulator to R requests/s and passes ``--rate-limit R`` to the
command: the wall time is compared with the budget 1.05 x pages / R + 5 s. ``--busy suite``
keeps a CPU-heavy test selection running in a loop during each measured project run;
``--busy sync`` a second ``sync --full`` of another simulator into another throwaway state.

Exit status 1 when a target (throughput, 3x dlt, rate budget) is missed or a catalog or a
peer's table is wrong. Today's figures are in ``docs/benchmarks.md``.

Usage:
    .venv/bin/python bench/bench_user_path.py [--path sync|backfill]
        [--instance embedded|plain|mysql] [--backend sqlite|mariadb]
        [--hotels 5000] [--cities 50] [--zipf 1.0] [--page-size 100] [--data-profile NAME]
        [--rate R] [--busy none|suite|sync] [--processes N] [--count-statements 20]
        [--no-run] [--profile FILE] [--no-peers] [--dlt-peer PATH] [--peer-page-size 200]
        [--mysql-url mysql+pymysql://root@127.0.0.1:3306]

    # issue #42: side by side, on each instance a user runs
    .venv/bin/python bench/bench_user_path.py --hotels 50000 --cities 100 --count-statements 0
    .venv/bin/python bench/bench_user_path.py --hotels 50000 --cities 100 --count-statements 0 \
        --instance plain
    .venv/bin/python bench/bench_user_path.py --hotels 50000 --cities 100 --count-statements 0 \
        --instance mysql
    .venv/bin/python bench/bench_user_path.py --hotels 100000 --cities 1000 --count-statements 0
    .venv/bin/python bench/bench_user_path.py --hotels 50000 --cities 100 --count-statements 0 \
        --data-profile rich
    .venv/bin/python bench/bench_user_path.py --path backfill --hotels 50000 --cities 100 \
        --count-statements 0 --instance plain
    # the rate budget, alone and with the machine shared
    .venv/bin/python bench/bench_user_path.py --hotels 24000 --cities 80 --rate 40
    .venv/bin/python bench/bench_user_path.py --hotels 24000 --cities 80 --rate 40 --busy suite
    .venv/bin/python bench/bench_user_path.py --hotels 24000 --cities 80 --rate 40 --busy sync
    .venv/bin/python bench/bench_user_path.py --hotels 100000 --cities 1000 --rate 40
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import queue
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import sqlalchemy as sa

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
REPO = Path(__file__).resolve().parents[1]
# Issue #16: hotels/s below 1,000 cities (50k in 100) and from 1,000 cities (100k in 1,000).
TARGET_FEW_CITIES = 3000.0
TARGET_MANY_CITIES = 2000.0
MANY_CITIES = 1000
TARGET_STATEMENTS = 20
TARGET_COMMITS = 4
UNLIMITED_RATE = 1e6  # the command's --rate-limit when the supplier has none
# Issue #42: times the better dlt; share of the fetch-only ceiling (stretch); machine busy.
TARGET_VS_DLT = 3.0
STRETCH_OF_CEILING = 0.40
TARGET_BUSY = 0.90
RATE_BUDGET_SLACK = 5.0  # seconds: the budget is 1.05 x pages / R + this
CEILING_THREADS = 4
# What `dagster dev` leaves in a DAGSTER_HOME it made, telemetry turned off: Dagster's
# default (SQLite) storage.
STOCK_DAGSTER_YAML = "telemetry:\n  enabled: false\n"
STOCK_MYSQL_DAGSTER_YAML = (
    STOCK_DAGSTER_YAML + "storage:\n  mysql:\n    mysql_url:\n      env: DAGSTER_MYSQL_URL\n"
)
MYSQL_INSTANCES = ("mysql", "mysql-stock")
# The CPU-heavy selection `--busy suite` runs in a loop (SQLite only: no MariaDB load).
BUSY_SUITE = ["supplier_sync_dagster_tests/core/records", "-k", "not mariadb"]


def machine_times() -> tuple[float, float]:
    """(idle, total) time of all cores since boot, in clock ticks (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:9]]
    return ticks[3] + ticks[4], sum(ticks)  # idle + iowait; user .. steal


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of one process so far; 0 when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (and theirs, reaped by them)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _process_table() -> dict[int, tuple[int, float]]:
    """Every process: pid -> (parent pid, its own CPU seconds so far)."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return table


class TreeSampler:
    """Samples the CPU of this process's descendants (but ``excluded`` subtrees) from
    ``/proc`` while they run: each process's last CPU seen, summed (a lower bound that
    does not depend on how its processes are reaped)."""

    def __init__(self, excluded: Mapping[str, int | None], interval: float = 0.5) -> None:
        self.excluded = excluded
        self.interval = interval
        self.seen: dict[int, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    @property
    def seconds(self) -> float:
        """The CPU seconds seen."""
        return sum(self.seen.values())

    def _run(self) -> None:
        me, skip = os.getpid(), {p for p in self.excluded.values() if p}
        while True:
            table = _process_table()
            children: dict[int, list[int]] = {}
            for pid, (parent, _) in table.items():
                children.setdefault(parent, []).append(pid)
            todo = [p for p in children.get(me, []) if p not in skip]
            while todo:
                pid = todo.pop()
                self.seen[pid] = max(self.seen.get(pid, 0.0), table[pid][1])
                todo += [p for p in children.get(pid, []) if p not in skip]
            if self._done.wait(self.interval):
                return


@dataclass
class CpuUse:
    """What a measured project run cost in CPU.

    Attributes:
        busy: The machine's busy share over all cores (``1 - idle / total``): every
            process on the machine counts, not only this run's.
        reaped: CPU seconds of the run's process tree as ``getrusage`` counts its reaped
            children: complete for ``sync --full`` (its workers are reaped by the command),
            not for the daemon's path (processes killed with their parent are reaped by
            init).
        sampled: The same tree's CPU as sampled from ``/proc`` while it ran (each process's
            last figure seen: a lower bound).
        simulator: CPU seconds of the simulator's process.
        window: What the figures span.
    """

    busy: float
    reaped: float
    sampled: float
    simulator: float
    window: str

    @property
    def tree(self) -> float:
        """The tree's CPU seconds: the larger of the two counts."""
        return max(self.reaped, self.sampled)


class CpuWindow:
    """Measures :class:`CpuUse` from its start to :meth:`stop`."""

    def __init__(self, simulator_pid: int | None, excluded: Mapping[str, int | None]) -> None:
        self.simulator_pid = simulator_pid
        self.sampler = TreeSampler({"simulator": simulator_pid, **excluded})
        self.idle, self.total = machine_times()
        self.tree = children_cpu()
        self.simulator = process_cpu(simulator_pid) if simulator_pid else 0.0
        self.sampler.__enter__()

    def stop(self, window: str) -> CpuUse:
        """The CPU used since the start (call once the run's processes are reaped)."""
        self.sampler.__exit__()
        idle, total = machine_times()
        return CpuUse(
            busy=1 - (idle - self.idle) / max(1.0, total - self.total),
            reaped=children_cpu() - self.tree,
            sampled=self.sampler.seconds,
            simulator=(process_cpu(self.simulator_pid) if self.simulator_pid else 0.0)
            - self.simulator,
            window=window,
        )


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
    cpu: CpuUse | None = None

    @property
    def rate(self) -> float:
        """Hotels per second of wall time."""
        return self.hotels / self.wall if self.wall else 0.0


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


@contextlib.contextmanager
def _environ(updates: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with ``updates``, restored on exit."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _instance_url(name: str, mysql_url: str) -> str:
    """The dagster-mysql URL of database ``name`` (its driver: mysql-connector)."""
    url = sa.engine.make_url(mysql_url).set(drivername="mysql+mysqlconnector", database=name)
    return url.render_as_string(hide_password=False)


@contextlib.contextmanager
def dagster_instance_env(args: argparse.Namespace, tmp: Path) -> Iterator[dict[str, str]]:
    """The ``DAGSTER_*`` environment of ``--instance`` in ``tmp``; its MySQL database is
    dropped on exit.

    Yields:
        Nothing for the embedded instance of ``sync`` (the command makes its own), else
        ``DAGSTER_HOME`` (and ``DAGSTER_MYSQL_URL``) of a migrated instance.
    """
    from supplier_sync_dagster.dagster_instance.deployment import (
        ROOT,
        migrate_instance,
        profile_env,
    )

    if args.instance == "embedded" and args.path == "sync":
        yield {}
        return
    home = tmp / "dagster_home"
    home.mkdir()
    mysql = args.instance in MYSQL_INSTANCES
    with mariadb_databases(["dg"] if mysql else [], args.mysql_url) as made:
        env = {"DAGSTER_HOME": str(home)}
        if mysql:
            if args.instance == "mysql":
                shutil.copy(ROOT / "deploy" / "mysql" / "dagster.yaml", home / "dagster.yaml")
            else:
                (home / "dagster.yaml").write_text(STOCK_MYSQL_DAGSTER_YAML)
            env["DAGSTER_MYSQL_URL"] = _instance_url(made[0], args.mysql_url)
            migrate_instance(profile_env(dagster_home=home, extra=env))
        elif args.instance == "plain":
            (home / "dagster.yaml").write_text(STOCK_DAGSTER_YAML)
        else:
            shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
        yield env


def _instance_problems(args: argparse.Namespace, tmp: Path) -> list[str]:
    """A plain instance's ``dagster.yaml`` is the user's: the run must leave it as it was."""
    users = {"plain": STOCK_DAGSTER_YAML, "mysql-stock": STOCK_MYSQL_DAGSTER_YAML}
    if args.instance not in users:
        return []
    config = tmp / "dagster_home" / "dagster.yaml"
    if config.exists() and config.read_text() == users[args.instance]:
        return []
    return [f"the user's {config} was changed or removed"]


@dataclass
class RunSetup:
    """What a project run is given.

    Attributes:
        tmp: Its folder (state, payloads, Dagster home).
        db_url: Its sync database.
        supplier_url: The simulator's URL.
        instance_env: The ``DAGSTER_*`` environment of its instance (none: embedded).
        cpu: Starts the run's :class:`CpuWindow`.
    """

    tmp: Path
    db_url: str
    supplier_url: str
    instance_env: dict[str, str]
    cpu: Callable[[], CpuWindow]


def events_line(instance: Any, run_ids: list[str], cities: int) -> str:
    """The Dagster events the runs stored, per city, by kind (read back from the event log)."""
    kinds: Counter[str] = Counter()
    for run_id in run_ids:
        for entry in instance.all_logs(run_id) if instance is not None else []:
            kind = entry.dagster_event_type
            kinds[kind.value if kind is not None else "log line"] += 1
    per_city = ", ".join(f"{n / cities:.2f} {kind}" for kind, n in kinds.most_common(5))
    return (
        f"Dagster events: {sum(kinds.values()) / cities:.2f} per city ({per_city}; "
        f"{sum(kinds.values())} in {len(run_ids)} run(s))"
    )


FAILURES_DIR = Path(tempfile.gettempdir()) / "bench_user_path_failures"


def keep_failure(
    done: subprocess.CompletedProcess[str], instance: Any = None, run_id: str = "no-run"
) -> Path:
    """Writes what a failed ``sync --full`` left (its command, whole stdout and stderr, and
    every warning, error and failure event of its run with its stack) to a file kept after
    the benchmark deletes the run's folder; returns the file."""
    FAILURES_DIR.mkdir(parents=True, exist_ok=True)
    path = FAILURES_DIR / f"{time.strftime('%Y%m%dT%H%M%S')}-{run_id[:8]}.log"
    parts = [
        f"command: {' '.join(map(str, done.args))}\nexit: {done.returncode}\n",
        f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}\n--- run {run_id}: failures\n",
    ]
    for entry in instance.all_logs(run_id) if instance is not None else []:
        event = entry.dagster_event
        if entry.level < logging.WARNING and not (event is not None and event.is_failure):
            continue
        parts.append(f"{entry.dagster_event_type or 'log'} {entry.step_key or ''}: ")
        parts.append(f"{entry.user_message}\n")
        error = getattr(event.event_specific_data, "error", None) if event else None
        if error is not None:
            parts.append(error.to_string() + "\n")
    path.write_text("".join(parts))
    return path


def run_sync(run: RunSetup, args: argparse.Namespace, world: World) -> Measured:
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
        # Its worker processes too; the wall time then includes the sampler's cost. Without
        # --nonblocking, py-spy pauses the process to sample and counts idle threads as busy.
        spy = shutil.which("py-spy") or str(BIN / "py-spy")
        sampler = [spy, "record", "--subprocesses", "--nonblocking", "--format", "raw"]
        cmd = [*sampler, "-o", args.profile, "--", *cmd]
    env = {**_env(run.tmp, run.db_url, run.supplier_url, args), **run.instance_env}
    window = run.cpu()
    began = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=run.tmp)
    wall = time.perf_counter() - began
    used = window.stop("the command, start to exit")
    if done.returncode != 0 and not done.stdout.strip():
        raise RuntimeError(
            f"sync --full exited {done.returncode}: {done.stderr[-3000:]} "
            f"(the whole output: {keep_failure(done)})"
        )
    # The JSON summary is the command's last line starting with "{" (py-spy prints too).
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    summary: dict[str, Any] = json.loads(lines[-1] if lines else done.stdout)
    failed = done.returncode != 0 or summary["status"] != "SUCCESS"
    with _environ(run.instance_env):
        instance = dg.DagsterInstance.from_config(summary["dagster_home"])
        try:
            steps = run_steps(instance, [summary["dagster_run_id"]])
            stages = city_stages(instance)
            events = events_line(instance, [summary["dagster_run_id"]], len(world.cities))
            kept = keep_failure(done, instance, summary["dagster_run_id"]) if failed else None
        finally:
            instance.dispose()
    problems = _instance_problems(args, run.tmp)
    if failed:
        problems.append(
            f"exit {done.returncode}, batch {summary['status']}: {done.stderr.strip()[-300:]} "
            f"(the whole output and the run's failures: {kept})"
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
        cpu=used,
        notes=[
            f"outside the step: {wall - summary['seconds']:.1f}s in the command around the run "
            f"(interpreter start, imports, instance, city list and partitions, summary) + "
            f"{summary['seconds'] - steps.busy:.1f}s in the run around its step (run start "
            "with its planned events per partition, resources, run end)",
            events,
        ],
    )


def run_daemon_backfill(run: RunSetup, args: argparse.Namespace, world: World) -> Measured:
    """A backfill of every city under ``supplier-sync daemon``, then what its instance recorded."""
    import dagster as dg

    from supplier_sync_dagster.dagster_instance.deployment import DagsterProcesses, profile_env
    from supplier_sync_dagster.defs.partitions import encode_city_key

    env = profile_env(
        dagster_home=Path(run.instance_env["DAGSTER_HOME"]),
        extra={**_env(run.tmp, run.db_url, run.supplier_url, args), **run.instance_env},
    )
    keys = [encode_city_key(c) for c in world.cities]
    with _environ(run.instance_env):
        # Made before the webserver and the daemon start: three processes creating the
        # SQLite instance's tables at once can leave two alembic heads.
        instance = dg.DagsterInstance.from_config(run.instance_env["DAGSTER_HOME"])
        try:
            window = run.cpu()
            with DagsterProcesses(env, run.tmp / "logs") as dagster:
                done = run_backfill(dagster, instance, keys, timeout=args.timeout)
            used = window.stop("webserver and daemon, start to exit, with every run")
            stages = city_stages(instance)
            events = events_line(instance, done.run_ids, len(world.cities))
        finally:
            instance.dispose()
    problems = _instance_problems(args, run.tmp)
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
        cpu=used,
        notes=[
            f"{len(done.run_ids)} run(s); launch -> first run {done.first_run:.1f}s, "
            f"-> first step {first_step:.1f}s",
            events,
        ],
    )


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def rate_budget(args: argparse.Namespace, world: World) -> float:
    """Issue #42's wall-time budget under ``--rate R``: 1.05 x pages / R + 5 s."""
    return 1.05 * world.pages(args.page_size) / args.rate + RATE_BUDGET_SLACK


def report_run(m: Measured, args: argparse.Namespace, world: World, label: str) -> bool:
    """Prints a timed run against its target; returns whether it met it and was correct."""
    line = (
        f"{label}: {args.path} ({args.backend}, {args.instance} instance"
        + (f", machine busy with {args.busy}" if args.busy != "none" else "")
        + f"): {m.hotels} hotels in {m.wall:.1f}s = {m.rate:,.0f} hotels/s"
    )
    if args.rate:
        pages = world.pages(args.page_size)
        budget = rate_budget(args, world)
        met = m.wall <= budget
        line += (
            f"; rate limit R = {args.rate:g}/s, {pages} pages: wall {m.wall:.1f}s vs budget "
            f"1.05 x pages / R + {RATE_BUDGET_SLACK:g} s = {budget:.1f}s [{_verdict(met)}]"
        )
    else:
        many = len(world.cities) >= MANY_CITIES
        target = TARGET_MANY_CITIES if many else TARGET_FEW_CITIES
        met = m.rate >= target
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
    if m.cpu is not None:
        report_cpu(m, m.cpu)
    for note in m.notes:
        print(f"  {note}")
    print("  catalog: " + ("correct" if not m.problems else "WRONG: " + "; ".join(m.problems)))
    return met and not m.problems


def report_cpu(m: Measured, cpu: CpuUse) -> None:
    """Prints the run's CPU: the machine's busy share, the tree's and the simulator's CPU,
    and CPU-seconds per 1,000 hotels by stage."""
    per = 1000 / m.hotels if m.hotels else 0.0
    s = m.stages.seconds
    stages = {
        "fetch": s["cpu_fetch"],
        "normalize+quality": s["cpu_normalize"],
        "publish": s["cpu_publish"],
    }
    rest = cpu.tree - sum(stages.values())
    print(
        f"  CPU ({cpu.window}): machine {cpu.busy:.0%} busy over all {os.cpu_count()} cores "
        f"(every process on it) [target >= {TARGET_BUSY:.0%}: {_verdict(cpu.busy >= TARGET_BUSY)}]"
        f"; process tree {cpu.tree:.1f} CPU-s = {cpu.tree * per:.2f} per 1,000 hotels (the "
        f"larger of: its reaped children's getrusage {cpu.reaped:.1f}s, its processes "
        f"sampled from /proc while they ran {cpu.sampled:.1f}s); simulator "
        f"{cpu.simulator:.1f} CPU-s = {cpu.simulator * per:.2f} per 1,000 hotels"
    )
    print(
        "  CPU-s per 1,000 hotels by stage (threads that did the work, summed over cities): "
        + ", ".join(f"{name} {v * per:.2f}" for name, v in stages.items())
        + f", Dagster and the rest (the tree minus those: start-up, events, gates, polling) "
        f"{rest * per:.2f}"
    )


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


@dataclass
class PeerRun:
    """One timed peer: a dlt load or the fetch-only ceiling."""

    name: str
    wall: float
    hotels: int
    cpu: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Hotels per second of wall time."""
        return self.hotels / self.wall if self.wall else 0.0


def _main_checkout() -> Path:
    """The repository's main checkout (this one, unless this is a ``git worktree``)."""
    dot_git = REPO / ".git"
    if dot_git.is_file():  # a worktree's: "gitdir: <main>/.git/worktrees/<name>"
        return Path(dot_git.read_text().split(":", 1)[1].strip()).parents[2]
    return REPO


def dlt_peer_path(args: argparse.Namespace) -> Path:
    """The dlt peer's script: ``--dlt-peer``, else ``<repo>/../shared/bench/dlt_peer.py``
    (``<repo>`` the main checkout when this is a worktree).

    Raises:
        SystemExit: It is not there.
    """
    path = (
        Path(args.dlt_peer)
        if args.dlt_peer
        else _main_checkout().parent / "shared" / "bench" / "dlt_peer.py"
    )
    if not path.is_file():
        raise SystemExit(
            f"bench_user_path: the dlt peer {path} is missing: pass --dlt-peer PATH "
            "(../shared/bench/dlt_peer.py of the main checkout), or --no-peers"
        )
    return path


def _sqlite_hotels(folder: Path, stem: str) -> int | None:
    """Rows of the ``hotels`` table dlt made beside ``<stem>.db`` (its dataset's own file,
    ``<stem>__<dataset>.db``); None when there is none."""
    for path in sorted(folder.glob(f"{stem}__*.db")):
        if path.stem.endswith("_staging"):
            continue
        with contextlib.closing(sqlite3.connect(path)) as conn:
            named = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'hotels'"
            ).fetchone()
            if named:
                return int(conn.execute("SELECT COUNT(*) FROM hotels").fetchone()[0])
    return None


@contextlib.contextmanager
def _peer_db(
    args: argparse.Namespace, tmp: Path
) -> Iterator[tuple[str, dict[str, str], Callable[[], int | None]]]:
    """A throwaway database for a dlt peer: its URL, the environment that keeps its dataset
    its own, and how to count its ``hotels`` rows. dlt puts a dataset in a database of its
    own on MariaDB (``<name>_<dataset>``, ``..._staging``): dropped on exit too."""
    if args.backend == "sqlite":
        yield f"sqlite:///{tmp / 'peer.db'}", {}, lambda: _sqlite_hotels(tmp, "peer")
        return
    with mariadb_databases(["dlt"], args.mysql_url) as made:
        prefix = made[0] + "\\_%"
        engine = sa.create_engine(args.mysql_url)

        def datasets() -> list[str]:
            with engine.connect() as conn:
                return list(
                    conn.execute(
                        sa.text(
                            "SELECT schema_name FROM information_schema.schemata "
                            "WHERE schema_name LIKE :p"
                        ),
                        {"p": prefix},
                    ).scalars()
                )

        def count() -> int | None:
            for name in datasets():
                if name.endswith("_staging"):
                    continue
                with engine.connect() as conn:
                    tables = sa.inspect(conn).get_table_names(schema=name)
                    if "hotels" in tables:
                        hotels = sa.table("hotels", schema=name)
                        return int(
                            conn.execute(
                                sa.select(sa.func.count()).select_from(hotels)
                            ).scalar_one()
                        )
            return None

        try:
            # The peer names its dataset; dlt's layout setting keeps it inside this run's name.
            yield (
                mariadb_url(made[0], args.mysql_url),
                {"DATASET_NAME_LAYOUT": f"{made[0]}_%s"},
                count,
            )
        finally:
            with engine.begin() as conn:
                for name in datasets():
                    conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
            engine.dispose()


def run_dlt(args: argparse.Namespace, url: str, expected: int, *, tuned: bool) -> PeerRun:
    """``dlt_peer.py`` as a process into a throwaway database; its ``hotels`` rows checked."""
    name = "dlt tuned" if tuned else "dlt plain"
    tmp = Path(tempfile.mkdtemp(prefix="bench_dlt_"))
    try:
        with _peer_db(args, tmp) as (dest, extra, count):
            cmd = [
                sys.executable,
                str(dlt_peer_path(args)),
                "--base",
                url,
                "--key",
                API_KEY,
                "--dest",
                dest,
                "--page-size",
                str(args.peer_page_size),
                *(["--tuned"] if tuned else []),
            ]
            env = {
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("SUPPLIER_SYNC_", "DAGSTER"))
            }
            # Its own pipelines folder: no state of an earlier load (or of another user's).
            env.update(DLT_DATA_DIR=str(tmp / "dlt"), **extra)
            cpu = children_cpu()
            began = time.perf_counter()
            done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True)
            wall = time.perf_counter() - began
            run = PeerRun(name, wall, 0, cpu=children_cpu() - cpu)
            if done.returncode != 0:
                run.problems.append(f"exit {done.returncode}: {done.stderr.strip()[-500:]}")
                return run
            rows = count()
            run.hotels = rows or 0
            if rows != expected:
                run.problems.append(f"its hotels table holds {rows} rows, not {expected}")
            return run
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch_ceiling(url: str, world: World, page_size: int) -> PeerRun:
    """Every page of every city fetched and decoded by :data:`CEILING_THREADS` threads, each
    with its own client; nothing stored."""
    jobs: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
    for city, size in world.sizes.items():
        for page in range(1, max(1, math.ceil(size / page_size)) + 1):
            jobs.put((city, page))
    seen: list[int] = []
    errors: list[str] = []

    def work() -> None:
        hotels = 0
        try:
            with httpx.Client(base_url=url, headers={"X-Api-Key": API_KEY}, timeout=60) as http:
                while True:
                    try:
                        city, page = jobs.get_nowait()
                    except queue.Empty:
                        break
                    answer = http.get(
                        f"/v1/cities/{quote(city, safe='')}/hotels",
                        params={"page": page, "page_size": page_size},
                    )
                    answer.raise_for_status()
                    hotels += len(answer.json()["hotels"])
        except Exception as err:  # reported beside the figure
            errors.append(repr(err))
        seen.append(hotels)

    threads = [threading.Thread(target=work) for _ in range(CEILING_THREADS)]
    cpu = time.process_time()
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    run = PeerRun("fetch-only ceiling", time.perf_counter() - began, sum(seen))
    run.cpu = time.process_time() - cpu
    run.problems += errors[:1]
    if run.hotels != world.hotels:
        run.problems.append(f"decoded {run.hotels} hotels, not {world.hotels}")
    return run


@contextlib.contextmanager
def busy_load(
    args: argparse.Namespace, busy_url: str | None, tmp: Path
) -> Iterator[dict[str, int | None]]:
    """Keeps the machine loaded (``--busy``) until exit, then kills the load's processes.

    Yields:
        The load's process ids (kept out of the run's own CPU).
    """
    if args.busy == "none":
        yield {}
        return
    if args.busy == "suite":
        py = BIN / "python"
        loop = f"{py} -m pytest -q -x -p no:cacheprovider " + " ".join(f"'{a}'" for a in BUSY_SUITE)
        env = dict(os.environ)
    else:
        assert busy_url is not None
        state = tmp / "busy"
        loop = (
            f"rm -rf '{state}'; mkdir -p '{state}'; {BIN / 'supplier-sync'} sync --full --json "
            f"--page-size {args.page_size} --rate-limit {UNLIMITED_RATE:g} "
            f"--trigger-id busy-$RANDOM"
        )
        env = _env(state, f"sqlite:///{state / 'sync.sqlite3'}", busy_url, args)
    script = f"while true; do {loop} >/dev/null 2>&1; done"
    proc = subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, start_new_session=True)
    try:
        time.sleep(1.0)  # under way before the measured run starts
        yield {"busy": proc.pid}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the loop and its children
        proc.wait()


def measure_project(
    args: argparse.Namespace,
    server: ServerProcess,
    world: World,
    truth: tuple[dict[str, int], dict[str, str]],
    busy_server: ServerProcess | None,
) -> Measured:
    """One project run on fresh state, its catalog checked against the ground truth."""
    valid, bad = truth
    tmp = Path(tempfile.mkdtemp(prefix="bench_user_path_"))
    try:
        with _sync_db(args, tmp) as db_url, dagster_instance_env(args, tmp) as instance_env:
            measure = run_sync if args.path == "sync" else run_daemon_backfill
            busy_url = busy_server.url if busy_server else None
            excluded = {"busy simulator": busy_server.pid if busy_server else None}
            with busy_load(args, busy_url, tmp) as load:
                excluded.update(load)
                setup = RunSetup(
                    tmp, db_url, server.url, instance_env, lambda: CpuWindow(server.pid, excluded)
                )
                m = measure(setup, args, world)
            m.problems += catalog_problems(published_catalog(db_url), valid)
            if bad:
                m.problems.append(f"{len(bad)} bad records on the clean profile")
        return m
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report_side_by_side(
    args: argparse.Namespace, runs: list[Measured], peers: list[PeerRun]
) -> bool:
    """Prints the ratios of the project to the peers; returns whether >= 3x dlt held and every
    peer was correct."""
    by_name = {p.name: p for p in peers}
    plain, tuned, ceiling = (by_name[n] for n in ("dlt plain", "dlt tuned", "fetch-only ceiling"))
    better = max(plain, tuned, key=lambda p: p.rate)
    rates = [m.rate for m in runs]
    mean = sum(rates) / len(rates)

    def ratio(peer: PeerRun) -> str:
        if not peer.rate:
            return f"/ {peer.name}: n/a"
        each = ", ".join(f"{r / peer.rate:.2f}" for r in rates)
        return f"/ {peer.name} = {mean / peer.rate:.2f} (runs {each})"

    met = bool(better.rate) and mean / better.rate >= TARGET_VS_DLT
    stretch = bool(ceiling.rate) and mean / ceiling.rate >= STRETCH_OF_CEILING
    print(
        f"side by side ({args.path}, {args.backend}, {args.instance} instance; in order: "
        "project, dlt plain, dlt tuned, ceiling, project again):"
    )
    print(
        "  project: "
        + ", ".join(f"run {i} {r:,.0f}" for i, r in enumerate(rates, 1))
        + f" hotels/s, mean {mean:,.0f}"
    )
    for peer in peers:
        what = (
            f"dlt_peer.py{' --tuned' if peer.name == 'dlt tuned' else ''} --page-size "
            f"{args.peer_page_size}, its hotels table checked"
            if peer is not ceiling
            else f"{CEILING_THREADS} threads GET and decode every page, page size "
            f"{args.page_size}, nothing stored"
        )
        per = f"{peer.cpu * 1000 / peer.hotels:.2f}" if peer.hotels else "n/a"
        print(
            f"  {peer.name} ({what}): {peer.hotels} hotels in {peer.wall:.1f}s = "
            f"{peer.rate:,.0f} hotels/s, {per} CPU-s per 1,000 hotels"
            + (" WRONG: " + "; ".join(peer.problems) if peer.problems else "")
        )
    print(
        f"  ratios: project {ratio(better).replace(better.name, f'better dlt ({better.name})')} "
        f"[target >= {TARGET_VS_DLT:g}x: {_verdict(met)}]; {ratio(plain)}; {ratio(tuned)}; "
        f"{ratio(ceiling)} [stretch >= {STRETCH_OF_CEILING:.2f}: {_verdict(stretch)}]"
    )
    return met and not any(p.problems for p in peers)


def _simulator_config(args: argparse.Namespace, seed: int) -> SimulatorConfig:
    """The measured supplier (``seed``): clean, heavy-tailed, ``--data-profile`` if any."""
    extra: dict[str, Any] = {}
    if args.data_profile:
        extra["data_profile"] = args.data_profile
    return SimulatorConfig(
        seed=seed,
        n_cities=args.cities,
        total_hotels=args.hotels,
        api_key=API_KEY,
        zipf_exponent=args.zipf,
        empty_city_share=0.0,
        rate_limit_rps=args.rate,
        faults=FaultProfile.named("clean"),
        # Every hotel the pre-warm renders stays cached: the run measures the sync.
        hotel_cache_size=max(50_000, args.hotels),
        **extra,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=["sync", "backfill"], default="sync")
    parser.add_argument(
        "--instance",
        choices=["embedded", "plain", "mysql", "mysql-stock"],
        default="embedded",
        help="the Dagster instance (mysql: the production profile, implies --backend mariadb)",
    )
    parser.add_argument("--backend", choices=["sqlite", "mariadb"], default=None)
    parser.add_argument("--hotels", type=int, default=5000, help="hotels in the world")
    parser.add_argument("--cities", type=int, default=50, help="cities in the world")
    parser.add_argument("--zipf", type=float, default=1.0, help="skew of city sizes")
    parser.add_argument("--page-size", type=int, default=100)
    parser.add_argument(
        "--data-profile", default=None, help="the simulator's named data profile (standard, rich)"
    )
    parser.add_argument("--rate", type=float, default=None, help="supplier limit, requests/s")
    parser.add_argument(
        "--busy",
        choices=["none", "suite", "sync"],
        default="none",
        help="load the machine during each project run: a test selection in a loop, or "
        "another sync --full of another simulator",
    )
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
    parser.add_argument(
        "--no-peers", action="store_true", help="no dlt peers, no ceiling, one project run"
    )
    parser.add_argument(
        "--dlt-peer", default=None, help="dlt_peer.py (default: <repo>/../shared/bench/)"
    )
    parser.add_argument("--peer-page-size", type=int, default=200, help="the dlt peers' page size")
    parser.add_argument(
        "--mysql-instance", action="store_true", help="the same as --instance mysql"
    )
    parser.add_argument("--mysql-url", default=MYSQL_URL, help="server URL, no database")
    parser.add_argument("--timeout", type=float, default=3600, help="backfill timeout, s")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    if args.mysql_instance:
        args.instance = "mysql"
    if args.instance in MYSQL_INSTANCES and args.backend == "sqlite":
        parser.error(f"--instance {args.instance}: its sync database is MariaDB")
    args.backend = args.backend or ("mariadb" if args.instance in MYSQL_INSTANCES else "sqlite")
    known = {f.name for f in dataclasses.fields(SimulatorConfig)}
    if args.data_profile and "data_profile" not in known:
        parser.error(
            "--data-profile: this simulator has no named data profiles (no "
            "SimulatorConfig.data_profile yet)"
        )
    peers_too = not args.no_peers and not args.no_run and not args.rate
    if peers_too:
        dlt_peer_path(args)  # missing: say so before anything runs

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
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ServerProcess(_simulator_config(args, args.seed), truth=True))
        busy_server = None
        if args.busy == "sync":  # another supplier, as large, never rate limited
            busy_config = dataclasses.replace(
                _simulator_config(args, args.seed + 1), rate_limit_rps=None
            )
            busy_server = stack.enter_context(ServerProcess(busy_config))
        world, warm = prewarm(server.url, args.page_size, rate=args.rate)
        sizes = sorted(world.sizes.values(), reverse=True)
        print(
            f"{args.path} of {world.hotels} hotels in {len(world.cities)} cities (largest "
            f"{', '.join(map(str, sizes[:3]))}; median {sizes[len(sizes) // 2]}), page size "
            f"{args.page_size}, {args.backend} sync db, {args.instance} Dagster instance, "
            f"clean profile, data profile {args.data_profile or 'default'}, "
            + (f"supplier limited to {args.rate:g}/s" if args.rate else "no rate limit")
            + (f", machine busy with {args.busy}" if args.busy != "none" else "")
            + f"; pre-warm {warm:.1f}s; machine speed {calibrate():.2f}s for 10M Python "
            "additions (smaller is faster: compare runs relative to it)",
            flush=True,
        )
        if args.rate:
            print("  (no peers nor ceiling under --rate: they are measured without a limit)")
            time.sleep(1.5)  # the simulator's bucket refills after the pre-warm
        runs = [measure_project(args, server, world, server.truth, busy_server)]
        ok = report_run(runs[0], args, world, "project, run 1") and ok
        if peers_too:
            peers = []
            for tuned in (False, True):
                peers.append(run_dlt(args, server.url, len(server.truth[0]), tuned=tuned))
                print(f"  {peers[-1].name}: {peers[-1].rate:,.0f} hotels/s", flush=True)
            peers.append(fetch_ceiling(server.url, world, args.page_size))
            print(f"  {peers[-1].name}: {peers[-1].rate:,.0f} hotels/s", flush=True)
            runs.append(measure_project(args, server, world, server.truth, busy_server))
            ok = report_run(runs[1], args, world, "project, run 2") and ok
            ok = report_side_by_side(args, runs, peers) and ok
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
