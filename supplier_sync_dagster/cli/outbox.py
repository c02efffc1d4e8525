"""The ``supplier-sync`` commands of the outbox and its read models: ``dispatch``, ``outbox``,
``search`` and ``audit`` (registered by :mod:`supplier_sync_dagster.cli.main`)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from supplier_sync_dagster.core.errors import ConfigError

_STATUSES = ("READY", "PROCESSING", "SUCCEEDED", "FAILED", "CANCELLED")
_STAGES = ("SEARCH_INDEX", "CACHE", "NOTIFY", "END")


def _projection_settings() -> Any:
    from supplier_sync_dagster.core.outbox.projections import ProjectionSettings
    from supplier_sync_dagster.core.settings import load_settings

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
    from supplier_sync_dagster.core.outbox.dispatch import Dispatcher, DrainReport, serve
    from supplier_sync_dagster.core.outbox.machine import release_stuck
    from supplier_sync_dagster.core.outbox.projections import open_projections
    from supplier_sync_dagster.core.store.db import SyncDatabase

    settings = _projection_settings()
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


MAX_AUTO_PROCESSES = 8


def dispatch_parallelism(
    dialect: str, *, processes: int | None, threads: int | None
) -> tuple[int, int]:
    """How many dispatcher processes, and dispatchers in each, ``dispatch`` runs.

    Unless told: on MySQL/MariaDB two processes per CPU core (at most
    :data:`MAX_AUTO_PROCESSES`) of one dispatcher each. A dispatcher waits on the sync
    database, the search index and the broker for about half of each batch, so two per core
    keep the cores busy; and a sync on the same machine has processes of its own: fewer
    dispatchers get too small a share of the CPU to keep up with it (issue 17's figures in
    the README). On SQLite one process of two threads: every claim and move takes SQLite's
    one write lock, which more processes would only queue on.

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


def _serve_in_child(db_url: str | None, settings: Any, threads: int, batch_size: int) -> None:
    from supplier_sync_dagster.core.outbox.dispatch import serve
    from supplier_sync_dagster.core.outbox.projections import open_projections
    from supplier_sync_dagster.core.store.db import SyncDatabase

    stop = threading.Event()
    _stop_on_signals(stop)
    _stop_when_orphaned(stop)
    db = SyncDatabase.open(db_url)
    try:
        serve(
            db,
            lambda: open_projections(settings),
            threads=threads,
            stop=stop,
            batch_size=batch_size,
        )
    finally:
        db.dispose()


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
    args: argparse.Namespace, settings: Any, *, processes: int, threads: int
) -> int:
    """N forked processes of ``threads`` dispatchers each (the stages are CPU-bound Python:
    threads of one process share one core). SIGTERM/SIGINT reach every process, which
    finishes its batches; the exit status is 0 when all stopped cleanly."""
    import multiprocessing

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
    """``outbox status|list|retry|cancel``."""
    from supplier_sync_dagster.core.outbox.machine import list_events, operate, outbox_status
    from supplier_sync_dagster.core.store.db import SyncDatabase

    db = SyncDatabase.open(args.db_url)
    try:
        if args.outbox_command == "status":
            st = outbox_status(db)
            if args.json:
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
                return 0
            for (status, stage), n in sorted(st.counts.items()):
                print(f"{status:<11} {stage or '-':<13} {n}")
            oldest = st.oldest_ready_seconds
            print(f"oldest READY: {'none' if oldest is None else f'{oldest:.1f} s old'}")
            print(f"stuck (lease expired): {st.stuck}")
            print(f"lag publish -> search index: {_fmt_lag(st.projection_lag)}")
            print(f"lag publish -> end of chain: {_fmt_lag(st.end_to_end_lag)}")
            return 0
        if args.outbox_command == "list":
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
            return 0
        if args.outbox_command == "reconcile":
            return _reconcile(db, repair=not args.no_repair, as_json=args.json)
        moved = operate(db, args.outbox_command, args.ids, actor=args.by, reason=args.reason)
        print(
            json.dumps({"action": f"outbox.{args.outbox_command}", "ids": args.ids, "moved": moved})
        )
        return 0
    finally:
        db.dispose()


def _reconcile(db: Any, *, repair: bool, as_json: bool) -> int:
    from supplier_sync_dagster.core.outbox.projections import open_projections, reconcile_projection

    projections = open_projections(_projection_settings())
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


def _price(text: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a price: {text!r}") from None
    if not value.is_finite() or value < 0:
        raise argparse.ArgumentTypeError(f"not a price: {text!r}")
    return value


def cmd_search(args: argparse.Namespace) -> int:
    """``search "words" [--city ...]``: the hotel search read model."""
    from supplier_sync_dagster.core.outbox.projections import SearchQuery, open_search_index

    if not args.text.strip() and not (args.city or args.country):
        raise ConfigError("give words to search for, or --city / --country")
    index = open_search_index(_projection_settings())
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


def cmd_serve_api(args: argparse.Namespace) -> int:
    """``serve-api``: the read API under uvicorn until interrupted."""
    import contextlib

    import uvicorn

    from supplier_sync_dagster.core.outbox.projections import (
        InProcessHotelCache,
        RedisHotelCache,
        open_search_index,
    )
    from supplier_sync_dagster.core.settings import load_settings
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.defs.resources import supplier_resource
    from supplier_sync_dagster.serve.api import create_app

    settings = load_settings()
    projection = _projection_settings()
    with contextlib.ExitStack() as stack:
        db = SyncDatabase.open(args.db_url)
        stack.callback(db.dispose)
        search = open_search_index(projection)
        stack.callback(search.close)
        cache = RedisHotelCache(settings.redis_url) if settings.redis_url else InProcessHotelCache()
        stack.callback(cache.close)
        timeouts = {
            "read_timeout": args.confirm_timeout,
            "connect_timeout": min(args.confirm_timeout, 2.0),
        }
        if settings.suppliers_file is None:
            client = stack.enter_context(
                supplier_resource(
                    base_url=settings.supplier_url,
                    api_key=settings.api_key(),
                    redis_url=settings.redis_url,
                    **timeouts,
                ).client()
            )
            confirming: Callable[[int], Any] = lambda _supplier_id: client  # noqa: E731
        else:
            clients = {
                sid: stack.enter_context(resource.client())
                for sid, resource in _confirming_accounts(settings, timeouts).items()
            }
            confirming = clients.get
        app = create_app(
            db=db, search=search, cache=cache, supplier=confirming, ttl_seconds=args.ttl
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _confirming_accounts(settings: Any, timeouts: dict[str, float]) -> dict[int, Any]:
    """Supplier id -> the supplier resource that confirms its offers: its first account in
    the suppliers file whose API key is set here (a supplier with none is answered 503)."""
    from supplier_sync_dagster.cli.accounts import account_supplier_now
    from supplier_sync_dagster.core.errors import ConfigError
    from supplier_sync_dagster.defs.accounts import account_scopes

    chosen: dict[int, Any] = {}
    for scope in account_scopes():
        assert scope.account is not None  # a suppliers file names every account
        sid = scope.account.supplier_id
        if sid in chosen:
            continue
        try:
            chosen[sid] = account_supplier_now(settings, scope, **timeouts)
        except ConfigError as err:  # its key is not set in this process: try the next one
            print(f"supplier-sync: serve-api: {err}", file=sys.stderr)
    return chosen


def add_commands(sub: Any) -> None:
    """Registers the commands on the ``supplier-sync`` subparsers."""
    from supplier_sync_dagster.cli.main import _positive_int as _positive  # cli imports this module

    dispatch = sub.add_parser(
        "dispatch",
        help="drive the outbox: search index, cache and subscribers (until SIGTERM, or --once)",
    )
    dispatch.add_argument("--once", action="store_true", help="drain what is due, then exit")
    dispatch.add_argument(
        "--threads",
        type=_positive,
        default=None,
        help="dispatchers per process (default: 2 in one process, else 1)",
    )
    dispatch.add_argument(
        "--processes",
        type=_positive,
        default=None,
        help="processes of --threads dispatchers each (default: two per CPU core, at most "
        f"{MAX_AUTO_PROCESSES}, on MySQL/MariaDB; one on SQLite)",
    )
    dispatch.add_argument("--batch-size", type=int, default=500, help="events per claim")
    dispatch.add_argument("--max-seconds", type=float, default=None, help="--once: stop after")
    dispatch.add_argument("--json", action="store_true")
    dispatch.set_defaults(
        func=cmd_dispatch,
        preload=(
            "supplier_sync_dagster.core.outbox.dispatch",
            "supplier_sync_dagster.core.outbox.projections",
        ),
    )

    outbox = sub.add_parser("outbox", help="the outbox's events: status, list, retry, cancel")
    outbox_sub = outbox.add_subparsers(dest="outbox_command", required=True)
    status = outbox_sub.add_parser("status", help="counts by status and stage, stuck, lag")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_outbox)
    listing = outbox_sub.add_parser("list", help="events, newest first")
    listing.add_argument("--status", choices=_STATUSES, default=None)
    listing.add_argument("--stage", choices=_STAGES, default=None, help="the next stage")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_outbox)
    for name, what in (
        ("retry", "FAILED or CANCELLED events run again from the stage they stopped at"),
        ("cancel", "READY or FAILED events stop (until retried)"),
    ):
        act = outbox_sub.add_parser(name, help=what + " (recorded in the audit trail)")
        act.add_argument("ids", type=int, nargs="+", help="outbox event ids (outbox list)")
        act.add_argument("--by", required=True, help="who (recorded)")
        act.add_argument("--reason", required=True, help="why (recorded)")
        act.set_defaults(func=cmd_outbox)

    reconcile = outbox_sub.add_parser(
        "reconcile",
        help="compare the search index with the catalog per city (count, checksum of "
        "(resource, publish version)) and re-project what differs",
    )
    reconcile.add_argument("--no-repair", action="store_true", help="only report (exit 1)")
    reconcile.add_argument("--json", action="store_true")
    reconcile.set_defaults(func=cmd_outbox)

    search = sub.add_parser("search", help="search the hotel search read model")
    search.add_argument("text", nargs="?", default="", help="words (all must match)")
    search.add_argument("--city", default=None, help="supplier city code")
    search.add_argument("--country", default=None, help="ISO country code")
    search.add_argument("--stars", type=float, default=None, help="at least this many stars")
    search.add_argument("--max-price", type=_price, default=None, help="lowest price at most")
    search.add_argument("--all-statuses", action="store_true", help="INACTIVE hotels too")
    search.add_argument("--limit", type=int, default=20)
    search.add_argument("--json", action="store_true")
    search.set_defaults(func=cmd_search)

    api = sub.add_parser(
        "serve-api",
        help="the read API: /hotels (search), /hotels/{id} (cached), POST /offers/confirm",
    )
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument("--ttl", type=float, default=300.0, help="seconds a hotel stays cached")
    api.add_argument(
        "--confirm-timeout", type=float, default=3.0, help="seconds for the supplier's answer"
    )
    api.set_defaults(func=cmd_serve_api, preload=("uvicorn", "supplier_sync_dagster.serve.api"))
