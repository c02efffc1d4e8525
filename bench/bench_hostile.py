"""Benchmark a hostile supplier: ``sync --full`` under each fault mode of the simulator.

For each named fault mode (``--modes``, default every one, and a ``clean`` baseline row) the
simulator is served by ``supplier-sync simulate --mode NAME --mode-cities CITY`` in a process
of its own, with the mode on one city of a small world (the largest city, so that the
misbehaviour has pages to act on; ``--cities 20 --hotels 5000`` by default, clean profile
otherwise). Then ``supplier-sync sync --full --json`` runs as a process, as a user runs it:
configured through the ``SUPPLIER_SYNC_*`` environment only (the simulator's URL and key, a
throwaway SQLite file or ``bench_sync_<random>`` MariaDB database, a state folder and a
payload folder in a temp folder; ``--setting FIELD=VALUE`` adds any other setting, such as the
supplier's request deadlines, named as in ``core/settings.py``).

Printed per mode:
  seconds   the wall time from starting the command until it ended (or was killed);
  exit      its exit status (``killed`` when the per-mode ``--timeout`` ran out first);
  peak      the memory of the command's process tree at its largest: every ~50 ms
            (``--sample-ms``) the benchmark reads ``/proc/*/stat`` once to find the tree
            (the command's process, every process below it by parent pid, and every process
            in its session: the command starts a session of its own, so a worker orphaned
            by its parent still counts), then adds each one's ``Pss`` from
            ``/proc/<pid>/smaps_rollup``. PSS divides a page shared by n processes by n:
            forked workers share their parent's pages until they write them, and a sum of
            their RSS would count those pages once per process. The row also prints the
            largest summed RSS (an upper bound) and the largest single process's RSS. The
            simulator's own process is the supplier, not the command, and is not counted;
  others    whether every valid hotel that the other cities list is published with its
            version (the sync database compared with the simulator's ground truth, built
            in this process from the same world and mode);
  its city  how many of the mode's city's valid hotels are published with their version;
  cause     the command's last line on stderr (its one-line failure; empty on success).

Targets: every command ends by itself within ``--timeout`` seconds, its tree's peak memory
(summed PSS) is at most 512 MB, no hotel whose record breaks the contract (the ground
truth's bad ones, a mode's victims among them) is published, and the other cities are
published in full (except for ``refused`` and ``unauthorized``, where the contract stops
the sync, so the row only reports it). Exit status 1 when a target is missed.

Usage:
    .venv/bin/python bench/bench_hostile.py [--modes slow_body,huge_body] [--no-clean]
        [--backend sqlite|mariadb] [--cities 20] [--hotels 5000] [--timeout 300]
        [--processes N] [--setting FIELD=VALUE ...] [--mysql-url URL]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import API_KEY, MYSQL_URL, mariadb_databases, mariadb_url, published_catalog
from bench_pipeline import calibrate

from supplier_sync_dagster.core.settings import Settings, env_name
from supplier_sync_dagster.dagster_instance.deployment import free_port
from supplier_sync_dagster.simulator import FaultProfile, Simulator, SimulatorConfig
from supplier_sync_dagster.simulator.config import MODES

BIN = Path(sys.executable).parent
CLEAN = "clean"
# The contract stops the whole sync on these: the other cities need not be published.
STOPPING_MODES = frozenset({"refused", "unauthorized"})
TARGET_PEAK_RSS_MB = 512.0
UNLIMITED_RATE = 1e6  # the command's --rate-limit: the simulator has no limit
SIMULATOR_START_SECONDS = 120.0
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


# -- the memory of a process tree --------------------------------------------------------------


def _processes() -> dict[int, tuple[int, int, int]]:
    """Every live process now: pid -> (parent pid, session id, resident pages), from one
    read of each ``/proc/<pid>/stat`` (a zombie has ended: it is left out)."""
    found: dict[int, tuple[int, int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                text = f.read()
        except OSError:  # it ended meanwhile
            continue
        # "pid (comm) state ppid pgrp session ... rss ...": comm may hold spaces and ")".
        fields = text[text.rfind(b")") + 2 :].split()
        try:
            if fields[0] != b"Z":
                found[int(entry.name)] = (int(fields[1]), int(fields[3]), int(fields[21]))
        except (IndexError, ValueError):
            continue
    return found


@dataclass(frozen=True)
class TreeSample:
    """The memory of a process tree at one instant, in bytes."""

    pss: int  # proportional set size, summed: shared pages divided among their sharers
    rss: int  # resident set size, summed: shared pages counted in each process
    largest_rss: int  # the largest one process's resident set
    processes: int


def _pss(pid: int) -> int:
    """A process's proportional set size in bytes (0 when it ended meanwhile)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def sample_tree(root: int) -> TreeSample:
    """The memory of ``root``'s process tree now: ``root``, the processes below it by parent
    pid and those in its session."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    tree = {pid for pid, (_, session, _) in procs.items() if session == root}
    below: set[int] = set()
    todo = [root] if root in procs else []
    while todo:
        pid = todo.pop()
        if pid not in below:
            below.add(pid)
            todo.extend(children.get(pid, ()))
    tree |= below
    rss = [procs[pid][2] * PAGE_BYTES for pid in tree]
    return TreeSample(
        pss=sum(_pss(pid) for pid in tree),
        rss=sum(rss),
        largest_rss=max(rss, default=0),
        processes=len(tree),
    )


@dataclass
class Measured:
    """One command, run to its end (or killed) while its tree's memory was sampled."""

    seconds: float
    returncode: int | None  # None: killed at the timeout
    peak: TreeSample = TreeSample(0, 0, 0, 0)  # the sample of the largest PSS
    peak_rss: int = 0  # the largest summed RSS of any sample
    peak_largest_rss: int = 0  # the largest one process's RSS of any sample
    samples: int = 0
    left_behind: int = 0  # processes of its session still alive after it ended (killed)


def run_sampled(
    cmd: Sequence[str],
    *,
    env: dict[str, str],
    cwd: Path,
    out: Path,
    err: Path,
    timeout: float,
    sample_seconds: float,
) -> Measured:
    """Runs ``cmd`` in a session of its own, sampling its tree's RSS until it ends; kills the
    session when ``timeout`` passes first."""
    with out.open("wb") as stdout, err.open("wb") as stderr:
        began = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=stdout, stderr=stderr, start_new_session=True
        )
        m = Measured(seconds=0.0, returncode=None)
        try:
            while proc.poll() is None:
                if time.perf_counter() - began > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
                now = sample_tree(proc.pid)
                m.samples += 1
                if now.pss > m.peak.pss:
                    m.peak = now
                m.peak_rss = max(m.peak_rss, now.rss)
                m.peak_largest_rss = max(m.peak_largest_rss, now.largest_rss)
                time.sleep(sample_seconds)
            else:
                m.returncode = proc.returncode
        finally:
            m.seconds = time.perf_counter() - began
            if proc.poll() is None:  # interrupted: leave nothing running
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    left = _end_session(proc.pid)
    if m.returncode is not None:
        m.left_behind = left
    return m


def _session(session: int) -> list[int]:
    return [pid for pid, (_, sid, _) in _processes().items() if sid == session]


def _end_session(session: int, grace: float = 2.0) -> int:
    """Kills what is still alive in ``session`` after ``grace`` seconds (a command's orphaned
    workers, or a killed one's dying ones); returns how many there were."""
    deadline = time.monotonic() + grace
    while (left := _session(session)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(left)


# -- the simulator and its world ---------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """The simulated supplier's world as its ground truth gives it, with a mode or none."""

    cities: dict[str, int]  # city code -> hotels its listing serves
    listed: dict[str, tuple[str, ...]]
    valid: dict[str, int]
    bad: frozenset[str]  # hotels whose records break the contract (a mode's victims too)

    def mode_city(self) -> str:
        """The city a mode acts on: the largest (ties: the first listed)."""
        return max(self.cities, key=self.cities.__getitem__)

    def expected(self, city: str, *, inside: bool) -> dict[str, int]:
        """The valid hotels that ``city`` lists (``inside``) or that the other cities list:
        hotel id -> version."""
        return {
            h: self.valid[h]
            for c, ids in self.listed.items()
            if (c == city) is inside
            for h in ids
            if h in self.valid
        }


def world_of(args: argparse.Namespace, mode: str = CLEAN, city: str = "") -> World:
    """The world ``supplier-sync simulate`` serves with these options and ``mode`` on
    ``city``, built here (the simulator's ground truth follows its modes; a drifted city's
    shifts happen only while it is walked, so here it has none)."""
    faults = FaultProfile.named(CLEAN)
    if mode != CLEAN:
        faults = faults.with_(modes=(mode,), mode_cities=(city,))
    truth = Simulator(
        SimulatorConfig(
            seed=args.seed,
            n_cities=args.cities,
            total_hotels=args.hotels,
            api_key=API_KEY,
            faults=faults,
        )
    ).ground_truth()
    listed = {c: tuple(ids) for c, ids in truth.listed_by_city.items()}
    return World(
        {c: len(ids) for c, ids in listed.items()},
        listed,
        dict(truth.valid),
        frozenset(truth.bad),
    )


@contextlib.contextmanager
def simulator(args: argparse.Namespace, mode: str, city: str, tmp: Path) -> Iterator[str]:
    """``supplier-sync simulate`` in a process (and session) of its own, with ``mode`` on
    ``city`` (none for the clean row); yields its base URL and stops it on exit."""
    port = free_port()
    cmd = [
        str(BIN / "supplier-sync"),
        "simulate",
        "--port",
        str(port),
        "--seed",
        str(args.seed),
        "--cities",
        str(args.cities),
        "--hotels",
        str(args.hotels),
        "--api-key",
        API_KEY,
        "--profile",
        CLEAN,
    ]
    if mode != CLEAN:
        cmd += ["--mode", mode, "--mode-cities", city]
    log = tmp / f"simulator-{mode}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp
        )
    try:
        _wait_serving(proc, port, log, refusing=mode == "refused")
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_serving(proc: subprocess.Popen[bytes], port: int, log: Path, *, refusing: bool) -> None:
    """Waits until the simulator accepts connections (a refusing one: until it says it
    serves, and a few seconds more).

    Raises:
        RuntimeError: It exited, or did not start in time.
    """
    deadline = time.monotonic() + SIMULATOR_START_SECONDS
    announced: float | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"supplier-sync simulate exited {proc.returncode}: {tail}")
        if announced is None and b"supplier simulator on" in log.read_bytes():
            announced = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if refusing and announced is not None and time.monotonic() - announced > 5:
                return
            time.sleep(0.05)
    raise RuntimeError(f"the simulator did not serve within {SIMULATOR_START_SECONDS:.0f} s")


# -- one mode ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What ``sync --full`` did under one mode."""

    mode: str
    measured: Measured
    cause: str
    batch: str
    expected: int  # valid hotels of the other cities
    missing: int
    other_version: int
    in_city: int  # valid hotels of the mode's city
    in_city_published: int  # of those, published with their version
    bad_published: int  # hotels whose records break the contract, published anyway
    notes: list[str] = field(default_factory=list)

    @property
    def peak_mb(self) -> float:
        """The peak memory (summed PSS) of the command's tree, in MB (2**20 bytes)."""
        return self.measured.peak.pss / 2**20

    @property
    def others_published(self) -> bool:
        """Every valid hotel of the other cities is published with its version."""
        return self.missing == 0 and self.other_version == 0


def user_env(tmp: Path, db_url: str, supplier_url: str, args: argparse.Namespace) -> dict[str, str]:
    """A user's environment: only the ``SUPPLIER_SYNC_*`` settings this run means."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUPPLIER_SYNC_", "DAGSTER"))}
    env.update(
        SUPPLIER_SYNC_HOME=str(tmp / "home"),
        SUPPLIER_SYNC_DB_URL=db_url,
        SUPPLIER_SYNC_SUPPLIER_URL=supplier_url,
        SUPPLIER_SYNC_SUPPLIER_API_KEY=API_KEY,
        SUPPLIER_SYNC_PAYLOAD_URL=f"file://{tmp / 'payloads'}",
        SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT=str(UNLIMITED_RATE),
    )
    if args.processes is not None:
        env["SUPPLIER_SYNC_WORKER_PROCESSES"] = str(args.processes)
    env.update(args.settings)
    return env


def run_mode(args: argparse.Namespace, mode: str, city: str, root: Path) -> Outcome:
    """One row: the simulator with ``mode`` on ``city``, then ``sync --full`` against it,
    measured."""
    world = world_of(args, mode, city)
    tmp = root / mode
    tmp.mkdir()
    with simulator(args, mode, city, tmp) as url, _sync_db(args, tmp) as db_url:
        m = run_sampled(
            [
                str(BIN / "supplier-sync"),
                "sync",
                "--full",
                "--json",
                "--trigger-id",
                f"bench-{mode}-{uuid.uuid4().hex[:8]}",
            ],
            env=user_env(tmp, db_url, url, args),
            cwd=tmp,
            out=tmp / "stdout",
            err=tmp / "stderr",
            timeout=args.timeout,
            sample_seconds=args.sample_ms / 1000,
        )
        published = published_catalog(db_url)
    expected = world.expected(city, inside=False)
    own = world.expected(city, inside=True)
    lines = [ln for ln in (tmp / "stderr").read_text(errors="replace").splitlines() if ln.strip()]
    outcome = Outcome(
        mode=mode,
        measured=m,
        cause=lines[-1].strip() if lines and m.returncode != 0 else "",
        batch=_batch_status(tmp / "stdout"),
        expected=len(expected),
        missing=sum(1 for h in expected if h not in published),
        other_version=sum(1 for h, v in expected.items() if h in published and published[h] != v),
        in_city=len(own),
        in_city_published=sum(1 for h, v in own.items() if published.get(h) == v),
        bad_published=sum(1 for h in published if h in world.bad),
    )
    if m.left_behind:
        outcome.notes.append(f"{m.left_behind} process(es) of its session outlived it (killed)")
    return outcome


def _batch_status(stdout: Path) -> str:
    """The batch status of the command's JSON summary (its last line starting with "{")."""
    lines = [ln for ln in stdout.read_text(errors="replace").splitlines() if ln.startswith("{")]
    if not lines:
        return "-"
    try:
        summary: dict[str, Any] = json.loads(lines[-1])
    except json.JSONDecodeError:
        return "-"
    return str(summary.get("status", "-"))


@contextlib.contextmanager
def _sync_db(args: argparse.Namespace, tmp: Path) -> Iterator[str]:
    """A throwaway sync database URL: a SQLite file in ``tmp``, or a MariaDB database."""
    if args.backend == "sqlite":
        yield f"sqlite:///{tmp / 'sync.sqlite3'}"
        return
    with mariadb_databases(["sync"], args.mysql_url) as made:
        yield mariadb_url(made[0], args.mysql_url)


# -- the report --------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def report(o: Outcome, args: argparse.Namespace) -> bool:
    """Prints one mode's row and its notes; returns whether it met every target."""
    m = o.measured
    ended = m.returncode is not None
    memory_ok = o.peak_mb <= TARGET_PEAK_RSS_MB
    others_count = o.mode not in STOPPING_MODES
    others = (
        f"all {o.expected:,}"
        if o.others_published
        else f"MISSING {o.missing:,} of {o.expected:,}"
        + (f", {o.other_version} other version" if o.other_version else "")
    )
    print(
        f"{o.mode:<17} {m.seconds:7.1f}s  exit {'killed' if not ended else m.returncode!s:<6} "
        f"batch {o.batch:<14} peak PSS {o.peak_mb:5.0f} MB ({m.peak.processes} proc; RSS sum "
        f"{m.peak_rss / 2**20:.0f}, largest process {m.peak_largest_rss / 2**20:.0f}) "
        f"others {others}{'' if others_count else ' (reported only)'}; its city "
        f"{o.in_city_published:,}/{o.in_city:,}  | {o.cause or '-'}",
        flush=True,
    )
    misses = []
    if o.bad_published:
        misses.append(f"{o.bad_published} hotel(s) whose records break the contract published")
    if not ended:
        misses.append(f"did not end by itself within {args.timeout:g}s (killed)")
    if not memory_ok:
        misses.append(f"peak memory (PSS) over {TARGET_PEAK_RSS_MB:.0f} MB")
    if others_count and not o.others_published:
        misses.append("the other cities are not all published")
    for note in [*o.notes, *misses]:
        print(f"  {note}")
    return not misses


def _settings(pairs: Sequence[str]) -> dict[str, str]:
    """``FIELD=VALUE`` pairs as environment variables, each field a setting of ``Settings``.

    Raises:
        SystemExit: A pair is malformed or names no setting.
    """
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip().lower().removeprefix("supplier_sync_")
        if not sep or name not in Settings.model_fields:
            raise SystemExit(
                f"--setting {pair!r}: expected FIELD=VALUE with FIELD one of "
                + ", ".join(Settings.model_fields)
            )
        env[env_name(name)] = value
    return env


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated fault modes (default: all)"
    )
    parser.add_argument("--no-clean", action="store_true", help="skip the clean baseline row")
    parser.add_argument("--backend", choices=["sqlite", "mariadb"], default="sqlite")
    parser.add_argument("--cities", type=int, default=20, help="cities in the world")
    parser.add_argument("--hotels", type=int, default=5000, help="hotels in the world")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a command may run before it is killed"
    )
    parser.add_argument(
        "--sample-ms", type=float, default=50.0, help="milliseconds between RSS samples"
    )
    parser.add_argument(
        "--processes", type=int, default=None, help="SUPPLIER_SYNC_WORKER_PROCESSES (default: auto)"
    )
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="another SUPPLIER_SYNC_* setting for the command (repeatable), e.g. a deadline",
    )
    parser.add_argument("--mysql-url", default=MYSQL_URL, help="server URL, no database")
    args = parser.parse_args(argv)
    args.settings = _settings(args.setting)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    if not args.no_clean:
        modes.insert(0, CLEAN)

    world = world_of(args)
    city = world.mode_city()
    print(
        f"sync --full of {sum(world.cities.values()):,} hotels in {len(world.cities)} cities "
        f"({args.backend} sync db), each mode on city {city!r} ({world.cities[city]} hotels); "
        f"per-mode timeout {args.timeout:g}s; "
        f"settings {args.settings or 'the defaults'}; memory of the command's process tree "
        f"sampled every {args.sample_ms:g} ms; machine speed {calibrate():.2f}s for 10M "
        "Python additions (smaller is faster)",
        flush=True,
    )
    ok = True
    root = Path(tempfile.mkdtemp(prefix="bench_hostile_"))
    try:
        for mode in modes:
            try:
                outcome = run_mode(args, mode, city, root)
            except RuntimeError as err:  # the simulator could not serve this mode
                print(f"{mode:<17} not run: {err}", flush=True)
                ok = False
                continue
            ok = report(outcome, args) and ok
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
