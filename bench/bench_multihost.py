"""A daemon backfill of 10,000 small cities on 4 worker hosts of the celery profile, with and
without the Redis claim locks.

Each round deploys the multi-host profile of ``deploy/celery/`` as the multi-host tests do
(``supplier_sync_dagster_tests/multihost/deploy.py``): fresh MariaDB databases (the
dagster-mysql instance and the sync database), payloads in a moto S3 bucket, the rate bucket
and Celery results in Redis, runs through RabbitMQ, the simulator over real HTTP, a control
host (webserver + ``supplier-sync daemon``) and ``--hosts`` Celery worker hosts, each its own
process tree with its own host name, state folder and ``DAGSTER_HOME``. The backfill of every
city is launched through GraphQL; the daemon splits it into runs of ``--cities-per-run``
cities (``SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN``) that go to whichever host takes them.
Rounds alternate without and with the claim locks (``SUPPLIER_SYNC_CLAIM_LOCKS``), so the
machine's other load falls on both alike.

Per round it prints:

- the wall time (launch to the backfill's end as the instance records it), cities, hotels,
  the catalog checked equal to the simulator's ground truth, every shard SUCCESS claimed once;
- cities per host (from each shard's worker id);
- claims per second: shard claims over the span from the first claim to the last, and the
  CPU-seconds of ``mariadbd``, ``redis-server`` and RabbitMQ's ``beam.smp`` (utime + stime
  from ``/proc``, launch to end: server-wide, so other work on the machine counts too);
- the orchestration share of the wall time: 1 - (host-seconds inside a city sync) /
  (wall x hosts), a host being inside a city sync while some shard it claimed is between
  its claim (``started_at``) and its finish (``finished_at``) in the sync database; and the
  looser share of the wall time during which no host was inside any city sync;
- per run (medians, and the sum over runs): the daemon's submit -> the run's start on a
  host -> its first claim, and its last city's finish -> the run's end.

Usage:
    .venv/bin/python bench/bench_multihost.py [--cities 10000] [--hosts 4]
        [--cities-per-run 250] [--hotels 20000] [--rounds 1] [--locks both|off|on]
        [--runs-per-host 1]
        [--worker-processes N]
        [--per-run] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import MYSQL_URL, catalog_problems, union_seconds
from bench_claims import process_cpu

from supplier_sync_dagster.core.settings import DEFAULT_TASK_CODE
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster_tests.cli.test_main import query
from supplier_sync_dagster_tests.helpers import moto_bucket, mysql_database_pair
from supplier_sync_dagster_tests.multihost.deploy import (
    Services,
    catalog,
    deployment,
    host_of,
)
from supplier_sync_dagster_tests.multihost.hosts import WorkerHost

REDIS_URL = "redis://127.0.0.1:6379/12"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
SERVERS = {"mariadb": "mariadbd", "redis": "redis-server", "rabbitmq": "beam.smp"}
TARGET_SHARE = 0.10


@contextmanager
def scoped_environ() -> Iterator[Callable[[str, str], None]]:
    """A ``setenv`` for this process whose changes are undone on exit."""
    saved = dict(os.environ)

    def setenv(name: str, value: str) -> None:
        os.environ[name] = value

    try:
        yield setenv
    finally:
        os.environ.clear()
        os.environ.update(saved)


def epoch(value: datetime | None) -> float | None:
    """A sync database time (the database clock, UTC, naive) as epoch seconds."""
    return value.replace(tzinfo=UTC).timestamp() if value is not None else None


@dataclass(frozen=True)
class Shard:
    """What the sync database says of one city's shard."""

    key: str
    host: str
    pid: str
    status: str
    claims: int
    claimed: float
    finished: float


def shards_of(db_url: str, hosts: list[str]) -> list[Shard]:
    """The full sync's shards (the housekeeping schedules' batches, an incremental sync
    retried until a full sync has finished, are not the backfill's)."""
    s, b = schema.shard.c, schema.batch.c
    rows = query(
        db_url,
        sa.select(s.shard_key, s.worker_id, s.status, s.claim_count, s.started_at, s.finished_at)
        .join_from(schema.shard, schema.batch, b.batch_id == s.batch_id)
        .where(b.task_code == DEFAULT_TASK_CODE),
    )
    return [
        Shard(
            r.shard_key,
            host_of(r.worker_id, hosts),
            (r.worker_id or "--").rsplit("-", 2)[-2],
            r.status,
            r.claim_count,
            epoch(r.started_at) or float("nan"),
            epoch(r.finished_at) or float("nan"),
        )
        for r in rows
    ]


@dataclass(frozen=True)
class RunTimes:
    """One run of the backfill: when the daemon submitted it, it started and it ended on the
    host that ran it, and that host's first claim, last finish and seconds with no city in
    flight in between (a worker host executes one run at a time)."""

    host: str
    submitted: float
    started: float
    ended: float
    first_claim: float
    last_finish: float
    between_cities: float


def run_hosts(workers: Sequence[WorkerHost]) -> dict[str, tuple[str, str]]:
    """Run id -> the worker host whose log has the run's events, and the run's pid."""
    found: dict[str, tuple[str, str]] = {}
    for worker in workers:
        for line in worker.log.read_text(errors="replace").splitlines():
            if " - RUN_START - " in line:
                fields = line.split(" - ")
                found[fields[4]] = (worker.name, fields[5])
    return found


def run_times(
    records: Sequence[Any], shards: list[Shard], hosts: dict[str, tuple[str, str]]
) -> list[RunTimes]:
    """Each run's times, from its record and the shards its process claimed (the cities it
    synced in its own process), else those its host claimed while it ran."""
    out = []
    for record in records:
        started, ended = record.start_time, record.end_time
        host, pid = hosts.get(record.dagster_run.run_id, ("", ""))
        mine = [x for x in shards if x.host == host and x.pid == pid]
        mine = mine or [x for x in shards if x.host == host and started <= x.claimed <= ended]
        if not mine:
            continue
        first, last = min(x.claimed for x in mine), max(x.finished for x in mine)
        out.append(
            RunTimes(
                host=str(host),
                submitted=record.create_timestamp.timestamp(),
                started=started,
                ended=ended,
                first_claim=first,
                last_finish=last,
                between_cities=last
                - first
                - union_seconds([(x.claimed, x.finished) for x in mine]),
            )
        )
    return out


def keep_logs(root: Path) -> Path:
    """Copies every log of a deployment (control host, worker hosts) out of its folder,
    which is removed with the round; returns where."""
    kept = Path(tempfile.mkdtemp(prefix="bench_multihost_logs_"))
    for log in root.rglob("*.log"):
        target = kept / log.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)
    return kept


def one_round(args: argparse.Namespace, locks: bool) -> dict[str, Any]:
    """Deploys, runs one backfill of every city and measures it (see the module's docstring)."""
    import dagster as dg

    names = [f"host-{i}" for i in range(args.hosts)]
    settings = {
        "SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN": str(args.cities_per_run),
        "SUPPLIER_SYNC_CLAIM_LOCKS": "true" if locks else "false",
        "SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT": str(args.rate_limit),
    }
    if args.worker_processes is not None:
        settings["SUPPLIER_SYNC_WORKER_PROCESSES"] = str(args.worker_processes)
    simulator = {
        "seed": 43,
        "n_cities": args.cities,
        "total_hotels": args.hotels,
        "empty_city_share": 0.0,
        "zipf_exponent": args.zipf,
    }
    with (
        tempfile.TemporaryDirectory(prefix="bench_multihost_") as tmp,
        scoped_environ() as setenv,
        mysql_database_pair(args.mysql_url) as databases,
        moto_bucket() as s3,
    ):
        services = Services(databases, s3, args.redis_url, args.amqp_url, Path(tmp), setenv)
        with deployment(
            services,
            settings=settings,
            hosts=names,
            runs_per_host=args.runs_per_host,
            **simulator,
        ) as deployed:
            truth = dict(deployed.sim.ground_truth().valid)  # builds every city first
            cpu0 = {name: process_cpu(comm) for name, comm in SERVERS.items()}
            launched = time.time()
            backfill_id = deployed.dagster.launch_backfill(deployed.keys, title="bench multihost")
            status, runs = deployed.dagster.wait_for_backfill(
                deployed.instance, backfill_id, timeout=args.timeout, poll=1
            )
            kept = keep_logs(Path(tmp)) if status != "COMPLETED_SUCCESS" else None
            cpu = {n: process_cpu(c) - cpu0[n] for n, c in SERVERS.items()}
            backfill = deployed.instance.get_backfill(backfill_id)
            assert backfill is not None
            end = backfill.backfill_end_timestamp or time.time()
            records = deployed.instance.get_run_records(
                filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id})
            )
            db_url = deployed.env["SUPPLIER_SYNC_DB_URL"]
            shards = shards_of(db_url, names)
            published = catalog(db_url)
            refetched = sum(deployed.counter.refetched().values())
            hosts = run_hosts(deployed.workers)
    wall = end - launched
    problems = catalog_problems(published, truth)
    if status not in ("COMPLETED", "COMPLETED_SUCCESS"):
        problems.append(f"backfill {status} (the deployment's logs: {kept})")
    failed = [r.run_id for r in runs if r.status != dg.DagsterRunStatus.SUCCESS]
    if failed:
        problems.append(f"{len(failed)} runs not SUCCESS")
    odd = Counter((x.status, x.claims) for x in shards if (x.status, x.claims) != ("SUCCESS", 1))
    if odd or len(shards) != args.cities:
        problems.append(f"{len(shards)} shards; not SUCCESS claimed once: {dict(odd)}")
    busy: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for x in shards:
        busy[x.host].append((x.claimed, x.finished))
    host_busy = sum(union_seconds(v) for v in busy.values())
    any_busy = union_seconds([i for v in busy.values() for i in v])
    claimed = sorted(x.claimed for x in shards)
    claim_span = claimed[-1] - claimed[0] if len(claimed) > 1 else float("nan")
    timed = run_times(records, shards, hosts)
    return {
        "locks": locks,
        "ok": not problems,
        "problems": problems,
        "wall": wall,
        "cities": len(shards),
        "hotels": len(published),
        "runs": len(runs),
        "per_host": dict(sorted(Counter(x.host for x in shards).items())),
        "claims": sum(x.claims for x in shards),
        "claim_span": claim_span,
        "claims_per_s": sum(x.claims for x in shards) / claim_span,
        "cpu": cpu,
        "share": 1 - host_busy / (wall * args.hosts),
        "share_any": 1 - any_busy / wall,
        "first_claim": claimed[0] - launched,
        "tail": end - max(x.finished for x in shards),
        "refetched": refetched,
        "phases": phases(timed),
        "run_lines": [run_line(t, launched) for t in sorted(timed, key=lambda t: t.started)],
    }


PHASES = {
    "submit->start": lambda t: t.started - t.submitted,
    "start->first claim": lambda t: t.first_claim - t.started,
    "first claim->last finish": lambda t: t.last_finish - t.first_claim,
    "(of which no city in flight)": lambda t: t.between_cities,
    "last finish->end": lambda t: t.ended - t.last_finish,
}


def phases(timed: list[RunTimes]) -> dict[str, tuple[float, float]]:
    """Per phase of a run: (median over runs, sum over runs) in seconds."""
    if not timed:
        return {}
    return {
        name: (statistics.median(f(t) for t in timed), sum(f(t) for t in timed))
        for name, f in PHASES.items()
    }


def run_line(t: RunTimes, launched: float) -> str:
    return f"    {t.host:<8} submitted +{t.submitted - launched:7.1f}s  " + "  ".join(
        f"{name} {f(t):6.2f}s" for name, f in PHASES.items()
    )


SHARE_DEFINITION = (
    "orchestration share = 1 - (host-seconds during which the host had a city between its "
    "claim and its finish in the sync db) / (wall x hosts); wall = launch -> backfill end"
)


def report(r: dict[str, Any], per_run: bool) -> str:
    cpu = r["cpu"]
    lines = [
        f"{'locks' if r['locks'] else 'no locks':<9} wall {r['wall']:7.1f}s  "
        f"{r['cities']} cities, {r['hotels']} hotels, {r['runs']} runs  "
        f"{'catalog = ground truth, every shard SUCCESS claimed once' if r['ok'] else r['problems']}",
        f"  cities per host: {r['per_host']}",
        f"  claims/s {r['claims_per_s']:6.1f} ({r['claims']} claims in {r['claim_span']:.1f}s)  "
        f"CPU-s: mariadbd {cpu['mariadb']:.1f}  redis-server {cpu['redis']:.1f}  "
        f"beam.smp {cpu['rabbitmq']:.1f}  (mariadbd per city {cpu['mariadb'] / r['cities'] * 1e3:.1f} ms)",
        f"  orchestration share {r['share']:.1%} [target <= {TARGET_SHARE:.0%}]; "
        f"no host in a city sync {r['share_any']:.1%} of wall; launch -> first claim "
        f"{r['first_claim']:.1f}s, last finish -> backfill end {r['tail']:.1f}s; "
        f"pages fetched twice {r['refetched']}",
        "  per run, median (sum over runs): "
        + "  ".join(f"{k} {m:.2f}s ({s:.0f}s)" for k, (m, s) in r["phases"].items()),
    ]
    if per_run:
        lines.extend(r["run_lines"])
    return "\n".join(lines)


def markdown(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    rows = [
        "| claim locks | wall s | cities per host | claims/s | mariadbd CPU-s | redis CPU-s | "
        "orchestration share | submit->start (median) | start->first claim | "
        "last finish->run end |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r["phases"]
        rows.append(
            f"| {'on' if r['locks'] else 'off'} | {r['wall']:.0f} | "
            f"{'/'.join(str(v) for v in r['per_host'].values())} | {r['claims_per_s']:.0f} | "
            f"{r['cpu']['mariadb']:.1f} | {r['cpu']['redis']:.1f} | {r['share']:.1%} | "
            f"{p['submit->start'][0]:.1f} s | {p['start->first claim'][0]:.1f} s | "
            f"{p['last finish->end'][0]:.1f} s |"
        )
    rows.append("")
    rows.append(
        f"{SHARE_DEFINITION}. `{' '.join(['bench/bench_multihost.py', *sys.argv[1:]])}`, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--cities", type=int, default=10_000)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--cities-per-run", type=int, default=250)
    parser.add_argument("--hotels", type=int, default=20_000, help="over every city")
    parser.add_argument("--zipf", type=float, default=0.3, help="skew of hotels per city")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of each mode")
    parser.add_argument(
        "--locks", choices=("both", "off", "on"), default="both", help="which modes to run"
    )
    parser.add_argument("--runs-per-host", type=int, default=1, help="celery worker -c")
    parser.add_argument("--worker-processes", type=int, help="SUPPLIER_SYNC_WORKER_PROCESSES")
    parser.add_argument("--rate-limit", type=float, default=100_000, help="requests/s")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--mysql-url", default=MYSQL_URL)
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--amqp-url", default=AMQP_URL)
    parser.add_argument("--per-run", action="store_true", help="a line per run")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    print(
        f"{args.cities} cities, {args.hotels} hotels, {args.hosts} hosts, "
        f"{args.cities_per_run} cities per run; {args.rounds} rounds of each mode "
        f"(alternating); load average {os.getloadavg()[0]:.1f}\n{SHARE_DEFINITION}",
        flush=True,
    )
    results = []
    for _ in range(args.rounds):
        for locks in {"both": (False, True), "off": (False,), "on": (True,)}[args.locks]:
            r = one_round(args, locks)
            results.append(r)
            print(report(r, args.per_run), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.markdown:
        print(markdown(args, results))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
