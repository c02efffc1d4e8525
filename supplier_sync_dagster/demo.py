"""The lease demo (``supplier-sync lease-demo``): the lease/checkpoint engine on real processes.

The main demo is ``supplier-sync demo`` (:mod:`supplier_sync_dagster.sync_runner`). This one
shows the leases alone:

1. a task and an idempotent batch with one shard per city, in the sync database
   (the embedded SQLite file unless ``SUPPLIER_SYNC_DB_URL`` says otherwise);
2. two worker processes claim cities by lease and walk their pages; each page's raw
   snapshot row and the checkpoint past it commit in one fenced transaction;
3. worker A is killed (``os._exit``, like ``kill -9``) halfway through a city, in the middle
   of a page's transaction; its heartbeat stops;
4. worker B finishes the other cities, waits for A's lease to expire by the database
   clock, reclaims the city and resumes from A's last checkpoint;
5. the report shows every shard, the derived batch, and checks that each page was
   stored exactly once and that the counts add up.

The pages are synthetic (deterministic per city and page), not a supplier's: what is shown
is the leases and checkpoints, not the pipeline.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core import schema as t
from supplier_sync_dagster.core.batches import (
    Batch,
    TaskSpec,
    create_batch,
    get_batch,
    upsert_task,
)
from supplier_sync_dagster.core.db import DbClock, SyncDatabase, insert_ignore
from supplier_sync_dagster.core.leases import (
    Checkpoint,
    LeaseSettings,
    PageCounts,
    ShardInfo,
    claim_next_shard,
    list_shards,
    make_worker_id,
)
from supplier_sync_dagster.core.worker import FetchedPage, PageHandler, PageSource, run_shard

DEMO_TASK = "demo_hotel_full_resource"
DEMO_SUPPLIER_ID = 1001
DEMO_CITIES = ("BKK", "SIN", "JKT", "../../etc", "x'; DROP TABLE t;--", "東京")
PAGE_SIZE = 50
CRASH_EXIT_CODE = 137


def pages_for(city: str, index: int) -> int:
    """How many pages the synthetic supplier has for a city (deterministic, 4-11)."""
    return 4 + int(hashlib.sha256(city.encode()).hexdigest(), 16) % 8 + index % 2


def synthetic_pages(city: str, total_pages: int, delay: float) -> PageSource:
    """A page source over deterministic synthetic hotels, starting at any checkpoint."""

    def source(start: Checkpoint) -> Iterator[FetchedPage]:
        for number in range(start.page, total_pages + 1):
            time.sleep(delay)  # stands in for the supplier's latency
            hotels = [
                {"hotel_id": f"H{number:04d}{i:03d}", "city_code": city, "version": 1}
                for i in range(PAGE_SIZE)
            ]
            payload = json.dumps(
                {"city_code": city, "page": number, "total_pages": total_pages, "hotels": hotels},
                ensure_ascii=False,
                sort_keys=True,
            ).encode()
            nxt = Checkpoint(
                city,
                page=number + 1,
                cursor=None,
                last_supplier_hotel_id=str(hotels[-1]["hotel_id"]) if hotels else None,
            )
            yield FetchedPage(number, nxt, total_pages, payload, hotels)

    return source


def store_page(clock: DbClock, batch_id: str, crash_at: tuple[str, int] | None) -> PageHandler:
    """A page handler: one RAW snapshot row per page, keyed by hash so a redo is a no-op."""

    def handle(conn: Connection, page: FetchedPage) -> PageCounts:
        city = page.next_checkpoint.city_code
        key = hashlib.sha256(f"{batch_id}\0{city}\0{page.number}".encode()).hexdigest()
        insert_ignore(
            conn,
            t.snapshot,
            [
                {
                    "snapshot_id": f"rs_{key[:60]}",
                    "batch_id": batch_id,
                    "supplier_id": DEMO_SUPPLIER_ID,
                    "category_code": "HOTEL",
                    "snapshot_type": "RAW",
                    "snapshot_version": 1,
                    "payload_ref": f"sha256:{hashlib.sha256(page.payload).hexdigest()}",
                    "payload_hash": hashlib.sha256(page.payload).hexdigest(),
                }
            ],
            created_at=clock.now(),
        )
        if crash_at == (city, page.number):
            os._exit(CRASH_EXIT_CODE)  # killed mid-transaction: this page never commits
        # Synthetic outcome mix, so the counts have something to add up.
        failed = sum(1 for i in range(len(page.records)) if (i + page.number) % 17 == 0)
        skipped = sum(1 for i in range(len(page.records)) if (i + page.number) % 23 == 0)
        return PageCounts(len(page.records) - failed - skipped, failed, skipped)

    return handle


def _worker_main(
    url: str,
    batch_id: str,
    name: str,
    settings: LeaseSettings,
    cities: dict[str, int],
    crash_at: tuple[str, int] | None,
    delay: float,
    events: mp.Queue[tuple[str, str, str]],
) -> None:
    db = SyncDatabase.open(url, create_schema=False)
    worker_id = make_worker_id(f"demo-{name}")
    events.put((name, "started", worker_id))
    idle_since: float | None = None
    while True:
        lease = claim_next_shard(db, batch_id, worker_id=worker_id, settings=settings)
        if lease is None:
            with db.engine.connect() as conn:
                if get_batch(conn, batch_id).is_terminal:
                    break
                running = conn.execute(
                    sa.select(sa.func.count())
                    .select_from(t.shard)
                    .where(
                        t.shard.c.batch_id == batch_id, t.shard.c.status.in_(("PENDING", "RUNNING"))
                    )
                ).scalar_one()
            if not running:
                break
            if idle_since is None:
                idle_since = time.monotonic()
                events.put((name, "waiting", "no city claimable: waiting for a lease to expire"))
            time.sleep(settings.heartbeat_seconds)
            continue
        idle_since = None
        cp = lease.checkpoint
        events.put(
            (
                name,
                "claimed",
                f"{lease.shard_key!r} " + (f"resuming at page {cp.page}" if cp else "from page 1"),
            )
        )
        outcome = run_shard(
            lease,
            synthetic_pages(lease.shard_key, cities[lease.shard_key], delay),
            store_page(db.clock, batch_id, crash_at),
            on_page=lambda page, counts: events.put(
                (name, "page", f"{page.next_checkpoint.city_code!r} page {page.number}")
            ),
        )
        events.put(
            (
                name,
                "finished",
                f"{outcome.shard_key!r} {outcome.status} after {outcome.pages} pages",
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
    snapshot_rows: int
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


def run_demo(
    *,
    db_url: str | None = None,
    cities: tuple[str, ...] = DEMO_CITIES,
    lease_seconds: float = 6.0,
    page_delay: float = 0.12,
    crash: bool = True,
    trigger_id: str | None = None,
    echo: bool = True,
) -> DemoReport:
    """Runs the demonstration and returns its report (see the module docstring)."""
    started = time.monotonic()
    db = SyncDatabase.open(db_url)
    url = db.engine.url.render_as_string(hide_password=False)
    settings = LeaseSettings(lease_seconds=lease_seconds, heartbeat_seconds=lease_seconds / 6)
    upsert_task(
        db,
        TaskSpec(
            task_code=DEMO_TASK, supplier_id=DEMO_SUPPLIER_ID, concurrency_policy="ALLOW_PARALLEL"
        ),
    )
    plan = {city: pages_for(city, i) for i, city in enumerate(cities)}
    decision = create_batch(
        db,
        task_code=DEMO_TASK,
        trigger_id=trigger_id or f"demo-{uuid.uuid4().hex[:12]}",
        trigger_source="MANUAL",
        shard_keys=list(cities),
    )
    if decision.batch is None:
        raise RuntimeError(f"the demo batch was not created: {decision.reason}")
    batch_id = decision.batch.batch_id
    crash_at = (cities[0], plan[cities[0]] // 2 + 1) if crash else None

    log_lines: list[str] = []

    def say(line: str) -> None:
        log_lines.append(line)
        if echo:
            print(line, flush=True)

    say(f"sync database: {db.safe_url}")
    say(f"batch {batch_id} ({decision.outcome}): {len(cities)} cities, {sum(plan.values())} pages")
    if crash_at:
        say(f"worker A will be killed in the middle of {crash_at[0]!r} page {crash_at[1]}")

    ctx = mp.get_context("spawn")
    events: mp.Queue[tuple[str, str, str]] = ctx.Queue()
    killed_reported: set[str] = set()
    workers = {
        "A": ctx.Process(
            target=_worker_main,
            args=(url, batch_id, "A", settings, plan, crash_at, page_delay, events),
        ),
        "B": ctx.Process(
            target=_worker_main,
            args=(url, batch_id, "B", settings, plan, None, page_delay, events),
        ),
    }
    workers["A"].start()
    time.sleep(0.3)  # let A claim first, so the crash lands on the city it holds
    workers["B"].start()
    reclaimed: list[str] = []
    while any(p.is_alive() for p in workers.values()) or not events.empty():
        try:
            name, kind, text = events.get(timeout=0.2)
        except Exception:
            for name, proc in workers.items():
                if proc.exitcode == CRASH_EXIT_CODE and name not in killed_reported:
                    killed_reported.add(name)
                    say(
                        f"[{name}] KILLED (exit {proc.exitcode}): its lease will expire in {lease_seconds:g} s"
                    )
            continue
        if kind == "page":
            continue
        if kind == "claimed" and "resuming" in text:
            reclaimed.append(text)
        say(f"[{name}] {kind} {text}".rstrip())
    for proc in workers.values():
        proc.join()
    with db.engine.connect() as conn:
        batch = get_batch(conn, batch_id)
        rows = conn.execute(
            sa.select(sa.func.count())
            .select_from(t.snapshot)
            .where(t.snapshot.c.batch_id == batch_id)
        ).scalar_one()
    report = DemoReport(
        db_url=db.safe_url,
        batch=batch,
        shards=list_shards(db, batch_id),
        expected_pages=plan,
        snapshot_rows=int(rows),
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
