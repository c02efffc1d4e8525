"""What ``dispatch``, ``outbox`` and ``search`` do: the outbox driven through its stages,
its events shown and operated, the hotel search read model queried; ``serve-api``:
:mod:`supplier_sync_dagster.cli.serve_api`. Their arguments:
:mod:`supplier_sync_dagster.cli.parsers.outbox`."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any

from supplier_sync_dagster.cli.common import open_db
from supplier_sync_dagster.cli.parsers.outbox import MAX_AUTO_PROCESSES
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.outbox.dispatch import Dispatcher, DrainReport, serve
from supplier_sync_dagster.core.outbox.machine import (
    list_events,
    operate,
    outbox_status,
    release_stuck,
)
from supplier_sync_dagster.core.outbox.projections import (
    ProjectionSettings,
    SearchQuery,
    open_projections,
    open_search_index,
    reconcile_projection,
)
from supplier_sync_dagster.core.settings import load_settings
from supplier_sync_dagster.core.store.db import SyncDatabase


def projection_settings() -> ProjectionSettings:
    """The read models' settings (search index, cache, subscribers) from the settings."""
    return ProjectionSettings.from_settings(load_settings())


def _report_json(report: Any) -> dict[str, Any]:
    return {
        "stages": {s: vars(c) for s, c in report.stages.items()},
        "stuck_released": report.stuck_released,
        "moved": report.moved,
        "seconds": round(report.seconds, 3),
    }


def _report_line(report: Any) -> str:
    parts = [
        f"{stage} {c.advanced} done"
        + (f", {c.retrying} retry later" if c.retrying else "")
        + (f", {c.failed} FAILED" if c.failed else "")
        for stage, c in report.stages.items()
    ]
    stuck = sum(report.stuck_released.values())
    return "; ".join(parts) + (f"; {stuck} stuck events released" if stuck else "")


def cmd_dispatch(args: argparse.Namespace) -> int:
    """``dispatch``: drain once (``--once``) or serve until SIGTERM/SIGINT."""
    settings = projection_settings()
    db = SyncDatabase.open(args.db_url)
    try:
        if args.once:
            projections = open_projections(settings)
            try:
                released = release_stuck(db)
                report = Dispatcher(db, projections, batch_size=args.batch_size).drain(
                    max_seconds=args.max_seconds
                )
                report.stuck_released = released
            finally:
                projections.close()
            print(json.dumps(_report_json(report)) if args.json else _report_line(report))
            failed = sum(c.failed for c in report.stages.values())
            return 1 if failed else 0
        processes, threads = dispatch_parallelism(
            db.engine.dialect.name, processes=args.processes, threads=args.threads
        )
        if processes > 1:
            db.dispose()  # each process opens its own connections
            return _serve_processes(args, settings, processes=processes, threads=threads)
        stop = threading.Event()
        _stop_on_signals(stop)

        def show(report: DrainReport) -> None:
            print(json.dumps(_report_json(report)) if args.json else _report_line(report))
            sys.stdout.flush()

        total = serve(
            db,
            lambda: open_projections(settings),
            threads=threads,
            stop=stop,
            batch_size=args.batch_size,
            on_report=show,
        )
        print(f"supplier-sync: dispatch stopped: {_report_line(total)}", file=sys.stderr)
        return 0
    finally:
        db.dispose()


def dispatch_parallelism(
    dialect: str, *, processes: int | None, threads: int | None
) -> tuple[int, int]:
    """How many dispatcher processes, and dispatchers in each, ``dispatch`` runs.

    Unless told: on MySQL/MariaDB two processes per CPU core (at most
    :data:`MAX_AUTO_PROCESSES`) of one dispatcher each. A dispatcher spends much of each
    batch waiting on the sync database, the search index and the broker, so two per core
    keep the cores busy; and a sync on the same machine has processes of its own: fewer
    dispatchers get too small a share of the CPU to keep up with it. On SQLite one process
    of two threads: every claim and move takes SQLite's one write lock, which more
    processes would only queue on.

    Returns:
        (processes, threads per process).
    """
    if processes is None:
        auto = min(MAX_AUTO_PROCESSES, 2 * (os.cpu_count() or 1))
        processes = 1 if dialect == "sqlite" else auto
    if threads is None:
        threads = 2 if processes == 1 else 1
    return max(1, processes), max(1, threads)


def _stop_on_signals(stop: threading.Event) -> None:
    def on_signal(signum: int, _frame: object) -> None:
        print(
            f"supplier-sync: dispatch: {signal.Signals(signum).name}, finishing the batches",
            file=sys.stderr,
        )
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def _serve_in_child(
    db_url: str | None, settings: ProjectionSettings, threads: int, batch_size: int
) -> None:
    stop = threading.Event()
    _stop_on_signals(stop)
    _stop_when_orphaned(stop)
    with open_db(db_url) as db:
        serve(
            db,
            lambda: open_projections(settings),
            threads=threads,
            stop=stop,
            batch_size=batch_size,
        )


def _stop_when_orphaned(stop: threading.Event, every: float = 0.5) -> None:
    """A dispatcher process whose parent died (``kill -9`` of ``supplier-sync dispatch``)
    finishes its batch and exits instead of dispatching on unwatched."""
    parent = os.getppid()

    def watch() -> None:
        while not stop.wait(every):
            if os.getppid() != parent:
                print(
                    "supplier-sync: dispatch: the parent process is gone, stopping", file=sys.stderr
                )
                stop.set()

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _serve_processes(
    args: argparse.Namespace, settings: ProjectionSettings, *, processes: int, threads: int
) -> int:
    """N forked processes of ``threads`` dispatchers each (the stages are CPU-bound Python:
    threads of one process share one core). SIGTERM/SIGINT reach every process, which
    finishes its batches; the exit status is 0 when all stopped cleanly."""
    ctx = multiprocessing.get_context("fork")
    children = [
        ctx.Process(
            target=_serve_in_child,
            args=(args.db_url, settings, threads, args.batch_size),
            name=f"dispatch-process-{i}",
        )
        for i in range(processes)
    ]
    for child in children:
        child.start()
    stop = threading.Event()
    _stop_on_signals(stop)
    while not stop.is_set() and all(c.is_alive() for c in children):
        stop.wait(0.5)
    for child in children:
        if child.is_alive() and child.pid is not None:
            os.kill(child.pid, signal.SIGTERM)
    for child in children:
        child.join()
    codes = [c.exitcode for c in children]
    print(
        f"supplier-sync: dispatch stopped: {len(children)} processes, exit codes {codes}",
        file=sys.stderr,
    )
    return 0 if all(code == 0 for code in codes) else 1


def _fmt_lag(lag: Any) -> str:
    if not lag.count:
        return "none measured"
    return f"p50 {lag.p50:.3f}s p95 {lag.p95:.3f}s max {lag.max:.3f}s over {lag.count} events"


def cmd_outbox(args: argparse.Namespace) -> int:
    """``outbox status|list|retry|cancel|reconcile``."""
    with open_db(args.db_url) as db:
        if args.outbox_command == "status":
            _print_outbox_status(db, as_json=args.json)
            return 0
        if args.outbox_command == "list":
            _print_events(db, args)
            return 0
        if args.outbox_command == "reconcile":
            return _reconcile(db, repair=not args.no_repair, as_json=args.json)
        moved = operate(db, args.outbox_command, args.ids, actor=args.by, reason=args.reason)
        print(
            json.dumps({"action": f"outbox.{args.outbox_command}", "ids": args.ids, "moved": moved})
        )
        return 0


def _print_outbox_status(db: SyncDatabase, *, as_json: bool) -> None:
    st = outbox_status(db)
    if as_json:
        print(
            json.dumps(
                {
                    "counts": {f"{s}/{n}": c for (s, n), c in sorted(st.counts.items())},
                    "oldest_ready_seconds": st.oldest_ready_seconds,
                    "stuck": st.stuck,
                    "projection_lag": vars(st.projection_lag),
                    "end_to_end_lag": vars(st.end_to_end_lag),
                },
                sort_keys=True,
            )
        )
        return
    for (status, stage), n in sorted(st.counts.items()):
        print(f"{status:<11} {stage or '-':<13} {n}")
    oldest = st.oldest_ready_seconds
    print(f"oldest READY: {'none' if oldest is None else f'{oldest:.1f} s old'}")
    print(f"stuck (lease expired): {st.stuck}")
    print(f"lag publish -> search index: {_fmt_lag(st.projection_lag)}")
    print(f"lag publish -> end of chain: {_fmt_lag(st.end_to_end_lag)}")


def _print_events(db: SyncDatabase, args: argparse.Namespace) -> None:
    for row in list_events(db, status=args.status, stage=args.stage, limit=args.limit):
        if args.json:
            print(json.dumps(row, default=str, sort_keys=True))
            continue
        error = f"  error: {row['last_error']}" if row["last_error"] else ""
        print(
            f"{row['id']:>8}  {row['status']:<10} {row['current_stage']:>12} -> "
            f"{row['next_stage']:<12} retries={row['retry_count']}  {row['event_type']} "
            f"hotel {row['aggregate_id']} v{row['aggregate_version']}  "
            f"created {row['created_at']}{error}"
        )


def _reconcile(db: SyncDatabase, *, repair: bool, as_json: bool) -> int:
    projections = open_projections(projection_settings())
    try:
        report = reconcile_projection(db, projections, repair=repair)
    finally:
        projections.close()
    if as_json:
        print(
            json.dumps(
                {
                    "cities": report.cities,
                    "hotels": report.hotels,
                    "repaired": report.repaired,
                    "differences": [vars(d) for d in report.differences],
                },
                sort_keys=True,
            )
        )
    else:
        for d in report.differences:
            print(
                f"{d.city_code!r}: catalog {d.catalog_count} (checksum {d.catalog_checksum}), "
                f"search index {d.projected_count} ({d.projected_checksum}): {d.missing} missing, "
                f"{d.stale} stale, {d.extra} not in the catalog"
            )
        print(
            f"{report.cities} cities, {report.hotels} hotels: {len(report.differences)} cities "
            f"differ; {report.repaired} hotels re-projected from the catalog"
        )
    # Differences that remain (not repaired) are a non-zero exit, for scripts and alerts.
    return 0 if repair or not report.differences else 1


def cmd_search(args: argparse.Namespace) -> int:
    """``search "words" [--city ...]``: the hotel search read model."""
    if not args.text.strip() and not (args.city or args.country):
        raise ConfigError("give words to search for, or --city / --country")
    index = open_search_index(projection_settings())
    try:
        hits = index.search(
            SearchQuery(
                text=args.text,
                city_code=args.city,
                country_code=args.country,
                min_stars=args.stars,
                status=None if args.all_statuses else "ACTIVE",
                max_price=args.max_price,
                limit=args.limit,
            )
        )
    finally:
        index.close()
    for h in hits:
        if args.json:
            row = dict(vars(h))
            row["lowest_price"] = None if h.lowest_price is None else str(h.lowest_price)
            print(json.dumps(row, ensure_ascii=False, sort_keys=True))
            continue
        price = "-" if h.lowest_price is None else f"{h.lowest_price} {h.currency}"
        local = f" ({h.name_local})" if h.name_local and h.name_local != h.name else ""
        stars = "-" if h.star_rating is None else f"{h.star_rating:g}*"
        print(
            f"{h.resource_id:>10}  {h.name}{local}  {h.city_code}/{h.country_code}  {stars}  "
            f"from {price}  v{h.publish_version}  {h.status}"
        )
    print(f"{len(hits)} hotels", file=sys.stderr)
    return 0
