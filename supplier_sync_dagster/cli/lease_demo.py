"""The lease demo (``supplier-sync lease-demo``): the real sync, two worker processes, one killed mid-city.

The main demo is ``supplier-sync demo`` (:mod:`supplier_sync_dagster.cli.sync_runner`). This one
shows the leases and checkpoints under the pipeline's own stages:

1. a task and an idempotent batch with one shard per city of a small simulated supplier
   (hostile city codes included), in the demo's own database: a SQLite file and payload
   folder in ``$SUPPLIER_SYNC_HOME/lease-demo/`` (never ``SUPPLIER_SYNC_DB_URL``'s catalog),
   or the database ``--db-url`` names, if it is empty or a demo filled it
   (:mod:`supplier_sync_dagster.cli.demo_catalogs`);
2. two worker processes each run the cities as a sync run does (``run.run_cities``, which
   calls ``sync_city``: fetch, normalize, gate, map, diff, publish, under the
   city's shard lease); each page's raw snapshot row and the checkpoint past it commit in
   one fenced transaction;
3. worker A is killed (``os._exit``, like ``kill -9``) halfway through the largest city,
   in the middle of a page's transaction; its heartbeat stops;
4. worker B finishes the other cities, waits for the city A held, reclaims it (at once
   when A's process is provably dead on this host, else once its lease expires by the
   database clock) and resumes from A's last checkpoint;
5. the report shows every shard, the derived batch, and checks that each page was
   stored exactly once and that the counts add up.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import httpx
import sqlalchemy as sa

from supplier_sync_dagster.cli.demo_catalogs import claim_demo_catalog
from supplier_sync_dagster.core.leasing.batches import (
    Batch,
    TaskSpec,
    create_batch,
    get_batch,
    upsert_task,
)
from supplier_sync_dagster.core.leasing.leases import LeaseSettings, ShardInfo, list_shards
from supplier_sync_dagster.core.leasing.processes import make_worker_id
from supplier_sync_dagster.core.records.diff import default_risk_policy
from supplier_sync_dagster.core.settings import (
    DEFAULT_MAX_CLOCK_SKEW_SECONDS,
    load_storage_settings,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import PayloadStore, open_payload_store
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync.city import largest_first
from supplier_sync_dagster.core.sync.model import SyncSettings, build_sync_settings
from supplier_sync_dagster.core.sync.run import RunPlan, RunRequest, run_cities
from supplier_sync_dagster.core.sync.snapshots import RAW
from supplier_sync_dagster.simulator import FaultProfile, Simulator, SimulatorConfig

DEMO_TASK = "demo_hotel_full_resource"
DEMO_SUPPLIER_ID = 1001
PAGE_SIZE = 50
CRASH_EXIT_CODE = 137
# The demo's own state, in the state folder: its SQLite database and its payloads.
DEMO_FOLDER = "lease-demo"
# A small world: three real cities (the largest has ten pages) and the hostile codes.
DEMO_SUPPLIER = SimulatorConfig(
    seed=7,
    n_cities=3,
    total_hotels=900,
    faults=FaultProfile.clean().with_(hostile_city_codes=True),
)


class _SlowTransport(httpx.BaseTransport):
    """The simulator's transport, with the latency of a remote supplier."""

    def __init__(self, inner: httpx.BaseTransport, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        time.sleep(self.delay)
        return self.inner.handle_request(request)


def _demo_client(delay: float) -> SupplierClient:
    sim = Simulator(DEMO_SUPPLIER)
    http = httpx.Client(
        base_url="http://simulator.local", transport=_SlowTransport(sim.transport(), delay)
    )
    return SupplierClient(http, api_key=DEMO_SUPPLIER.api_key, supplier_id=str(DEMO_SUPPLIER_ID))


def _kill_mid_page(db: SyncDatabase, store: PayloadStore, page: int) -> None:
    """Arms this process to die inside the transaction that stores its ``page``-th page.

    The fetch stage stores a page's bytes, then inserts its RAW snapshot row and advances
    the checkpoint in one transaction: the process exits right after that INSERT, so the
    page never commits.
    """
    raw_pages = 0
    put = store.put

    def counting_put(body: bytes, **kwargs: Any) -> Any:
        nonlocal raw_pages
        stored = put(body, **kwargs)
        raw_pages += kwargs.get("kind") == "raw"
        return stored

    def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if raw_pages == page and statement.lstrip().upper().startswith("INSERT"):
            os._exit(CRASH_EXIT_CODE)  # killed mid-transaction: this page never commits

    setattr(store, "put", counting_put)  # noqa: B010 (an instance's method, replaced)
    sa.event.listen(db.engine, "after_cursor_execute", after)


def _worker_main(
    url: str,
    payload_url: str | None,
    batch_id: str,
    name: str,
    settings: SyncSettings,
    cities: list[str],
    countries: dict[str, str],
    crash_at_page: int | None,
    delay: float,
    events: mp.Queue[tuple[str, str, str]],
) -> None:
    db = SyncDatabase.open(url, create_schema=False)
    store = open_payload_store(payload_url)
    if crash_at_page is not None:
        _kill_mid_page(db, store, crash_at_page)
    client = _demo_client(delay)
    worker_id = make_worker_id(f"demo-{name}")
    events.put((name, "started", worker_id))
    with db.engine.connect() as conn:
        batch = get_batch(conn, batch_id)
    # The run's own loop: its cities in order, a city another worker holds waited for
    # after the others (and resumed once that worker's lease is gone).
    request = RunRequest(
        trigger_id=batch.trigger_id or batch_id,
        source="MANUAL",
        cities=cities,
        help_other_runs=False,
    )
    plan = RunPlan(batch=batch, cities=cities, countries=countries)
    for outcome in run_cities(db, store, client, plan, request, settings, worker_id=worker_id):
        r = outcome.report
        resumed = r.resumed_from_page
        events.put(
            (
                name,
                "finished",
                f"{r.city_code!r} {r.status}: {r.pages_fetched} pages"
                + (f" fetched after resuming at page {resumed}" if resumed else "")
                + f", {r.records} records = {r.published} published + "
                f"{r.dead_letters} dead letters + {r.skipped} skipped"
                + (f" ({r.error})" if r.error else ""),
            )
        )
    db.dispose()
    events.put((name, "exit", ""))


@dataclass(frozen=True)
class DemoReport:
    """What the demonstration did and what it verified."""

    db_url: str
    batch: Batch
    shards: list[ShardInfo]
    expected_pages: dict[str, int]
    snapshot_rows: int  # RAW page snapshots stored
    crashed_worker_exit: int | None
    reclaimed: list[str]
    seconds: float
    log: list[str]

    @property
    def problems(self) -> list[str]:
        """Every invariant the run broke (empty when all held)."""
        out = []
        if self.batch.status != "SUCCESS":
            out.append(f"batch ended {self.batch.status}, expected SUCCESS")
        if self.snapshot_rows != sum(self.expected_pages.values()):
            out.append(
                f"{self.snapshot_rows} page snapshots stored, expected exactly "
                f"{sum(self.expected_pages.values())} (one per page)"
            )
        for s in self.shards:
            if s.pages_done < self.expected_pages[s.shard_key]:
                out.append(f"city {s.shard_key!r}: {s.pages_done} pages done")
            if s.total_count != s.success_count + s.failed_count + s.skipped_count:
                out.append(f"city {s.shard_key!r}: counts do not add up")
        b = self.batch
        if b.total_count != b.success_count + b.failed_count + b.skipped_count:
            out.append("batch counts do not add up")
        if self.crashed_worker_exit is not None and not self.reclaimed:
            out.append("the crashed worker's city was never reclaimed")
        return out


def _demo_plan() -> tuple[list[str], dict[str, int], dict[str, str]]:
    """The demo supplier's cities, largest first, with their pages and their countries."""
    listed = _demo_client(0.0).list_cities().data.cities
    sizes = {c.city_code: c.hotel_count or 0 for c in listed}
    cities = largest_first(list(sizes), sizes)
    pages = {city: max(1, math.ceil(sizes[city] / PAGE_SIZE)) for city in cities}
    return cities, pages, {c.city_code: c.country_code for c in listed if c.country_code}


def _create_demo_batch(
    db: SyncDatabase, cities: list[str], trigger_id: str | None
) -> tuple[str, str]:
    """The demo task and one batch with a shard per city: (its id, how the trigger went)."""
    upsert_task(
        db,
        TaskSpec(
            task_code=DEMO_TASK, supplier_id=DEMO_SUPPLIER_ID, concurrency_policy="ALLOW_PARALLEL"
        ),
    )
    decision = create_batch(
        db,
        task_code=DEMO_TASK,
        trigger_id=trigger_id or f"demo-{uuid.uuid4().hex[:12]}",
        trigger_source="MANUAL",
        shard_keys=cities,
    )
    if decision.batch is None:
        raise RuntimeError(f"the demo batch was not created: {decision.reason}")
    return decision.batch.batch_id, decision.outcome


def _wait_until_running(db: SyncDatabase, batch_id: str, worker: BaseProcess) -> None:
    """Returns once a shard of the batch is RUNNING (or the worker ended, or two minutes
    passed): B starts then, so that the crash lands on the city A holds (a spawned worker
    takes a while to start on a loaded machine)."""
    deadline = time.monotonic() + 120
    while worker.is_alive() and time.monotonic() < deadline:
        if any(s.status == "RUNNING" for s in list_shards(db, batch_id)):
            return
        time.sleep(0.05)


def _follow(
    workers: dict[str, BaseProcess],
    events: mp.Queue[tuple[str, str, str]],
    say: Callable[[str], None],
    lease_seconds: float,
) -> list[str]:
    """Says what the workers report until they have all exited; returns the lines of the
    cities that were resumed after a reclaim."""
    killed_reported: set[str] = set()
    reclaimed: list[str] = []
    while any(p.is_alive() for p in workers.values()) or not events.empty():
        try:
            name, kind, text = events.get(timeout=0.2)
        except Exception:
            for name, proc in workers.items():
                if proc.exitcode == CRASH_EXIT_CODE and name not in killed_reported:
                    killed_reported.add(name)
                    say(
                        f"[{name}] KILLED (exit {proc.exitcode}): its lease ends in "
                        f"{lease_seconds:g} s, or as soon as a worker of this host sees it dead"
                    )
            continue
        if kind == "finished" and "resuming at page" in text:
            reclaimed.append(text)
        say(f"[{name}] {kind} {text}".rstrip())
    for proc in workers.values():
        proc.join()
    return reclaimed


def _raw_snapshots(db: SyncDatabase, batch_id: str) -> int:
    """The RAW page snapshots the batch stored."""
    s = schema.snapshot.c
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(sa.func.count())
            .select_from(schema.snapshot)
            .where(s.batch_id == batch_id, s.snapshot_type == RAW)
        ).scalar_one()
    return int(rows)


def own_storage() -> tuple[str, str]:
    """The demo's own database and payload store: (SQLite URL, file URL) in
    ``$SUPPLIER_SYNC_HOME/lease-demo/``, whatever the configured ones are."""
    folder = load_storage_settings().state_dir / DEMO_FOLDER
    return f"sqlite:///{folder / 'sync.sqlite3'}", (folder / "payloads").as_uri()


def run_demo(
    *,
    db_url: str | None = None,
    payload_url: str | None = None,
    lease_seconds: float = 6.0,
    page_delay: float = 0.12,
    crash: bool = True,
    trigger_id: str | None = None,
    echo: bool = True,
) -> DemoReport:
    """Runs the demonstration and returns its report (see the module docstring).

    Args:
        db_url: The database to run it in; None: the demo's own (:func:`own_storage`),
            never the configured catalog.
        payload_url: The payload store; None: the demo's own (:func:`own_storage`).
        lease_seconds: The shards' lease.
        page_delay: Seconds the simulated supplier takes per page.
        crash: Kill worker A mid-city.
        trigger_id: Idempotency key of the batch.
        echo: Print what happens as it happens.
    """
    started = time.monotonic()
    own_db, own_payloads = own_storage()
    db = SyncDatabase.open(db_url or own_db)
    payload_url = payload_url or own_payloads
    url = db.engine.url.render_as_string(hide_password=False)
    settings = build_sync_settings(
        task_code=DEMO_TASK,
        supplier_id=DEMO_SUPPLIER_ID,
        page_size=PAGE_SIZE,
        lease=LeaseSettings(lease_seconds=lease_seconds, heartbeat_seconds=lease_seconds / 6),
        risk_policy=default_risk_policy,
        max_clock_skew_seconds=DEFAULT_MAX_CLOCK_SKEW_SECONDS,
    )
    cities, plan, countries = _demo_plan()
    batch_id, outcome = _create_demo_batch(db, cities, trigger_id)
    crash_at = (cities[0], plan[cities[0]] // 2 + 1) if crash else None

    log_lines: list[str] = []

    def say(line: str) -> None:
        log_lines.append(line)
        if echo:
            print(line, flush=True)

    say(f"sync database: {db.safe_url}")
    say(f"batch {batch_id} ({outcome}): {len(cities)} cities, {sum(plan.values())} pages")
    if crash_at:
        say(f"worker A will be killed in the middle of {crash_at[0]!r} page {crash_at[1]}")

    ctx = mp.get_context("spawn")
    events: mp.Queue[tuple[str, str, str]] = ctx.Queue()

    def worker(name: str, order: list[str], crash_here: int | None) -> BaseProcess:
        return ctx.Process(
            target=_worker_main,
            args=(
                url,
                payload_url,
                batch_id,
                name,
                settings,
                order,
                countries,
                crash_here,
                page_delay,
                events,
            ),
        )

    # A starts with the largest city, B with the smallest: A holds the city it is killed in.
    workers = {
        "A": worker("A", cities, crash_at[1] if crash_at else None),
        "B": worker("B", cities[::-1], None),
    }
    workers["A"].start()
    _wait_until_running(db, batch_id, workers["A"])
    workers["B"].start()
    reclaimed = _follow(workers, events, say, lease_seconds)
    with db.engine.connect() as conn:
        batch = get_batch(conn, batch_id)
    report = DemoReport(
        db_url=db.safe_url,
        batch=batch,
        shards=list_shards(db, batch_id),
        expected_pages=plan,
        snapshot_rows=_raw_snapshots(db, batch_id),
        crashed_worker_exit=workers["A"].exitcode if crash else None,
        reclaimed=reclaimed,
        seconds=time.monotonic() - started,
        log=log_lines,
    )
    db.dispose()
    return report


def format_report(report: DemoReport) -> str:
    """The report as a table for the terminal."""
    lines = [
        "",
        f"{'city':<24} {'status':<8} {'pages':>5} {'total':>6} {'ok':>6} {'failed':>6} "
        f"{'skipped':>7} {'claims':>6}  worker",
    ]
    for s in report.shards:
        lines.append(
            f"{s.shard_key!r:<24} {s.status:<8} {s.pages_done:>5} {s.total_count:>6} "
            f"{s.success_count:>6} {s.failed_count:>6} {s.skipped_count:>7} {s.claim_count:>6}  "
            f"{s.worker_id}"
        )
    b = report.batch
    lines += [
        "",
        f"batch {b.batch_id}: {b.status}, {b.shards_done}/{b.shard_count} cities, "
        f"progress {b.progress_percent}%",
        f"records: total {b.total_count} = success {b.success_count} + failed {b.failed_count} "
        f"+ skipped {b.skipped_count}",
        f"page snapshots stored: {report.snapshot_rows} "
        f"(pages in the plan: {sum(report.expected_pages.values())})",
        f"took {report.seconds:.1f} s",
    ]
    problems = report.problems
    lines.append("ALL CHECKS PASSED" if not problems else "PROBLEMS:\n  " + "\n  ".join(problems))
    return "\n".join(lines)


def cmd_lease_demo(args: argparse.Namespace) -> int:
    """``lease-demo``: runs the demonstration and prints its report; 1 when a check failed.

    Its database is its own, unless ``--db-url`` names another; that one must be empty or
    filled by a demo before (else one line, exit 2, nothing written).

    Raises:
        ConfigError: ``--db-url`` names a database holding a catalog no demo filled.
    """
    db_url = args.db_url or own_storage()[0]
    claim_demo_catalog(db_url, command="lease-demo")
    report = run_demo(
        db_url=args.db_url,
        lease_seconds=args.lease_seconds,
        crash=not args.no_crash,
        trigger_id=args.trigger_id,
    )
    print(format_report(report))
    return 0 if not report.problems else 1
