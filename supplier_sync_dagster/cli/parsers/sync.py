"""The arguments of the syncs: ``demo``, ``sync``, ``lease-demo``, ``replay`` and
``reconcile`` (handlers: :mod:`supplier_sync_dagster.cli.sync`,
:mod:`supplier_sync_dagster.cli.lease_demo`)."""

from __future__ import annotations

from supplier_sync_dagster.cli.common import (
    ACCOUNT_HELP,
    MAX_WORKERS,
    Subcommands,
    add_json_flag,
    duration,
    float_within,
    handled_by,
    int_within,
    non_negative_int,
    positive_int,
    rate,
    workers,
)
from supplier_sync_dagster.core.leasing.leases import MAX_LEASE_SECONDS, MIN_LEASE_SECONDS
from supplier_sync_dagster.core.settings import (
    DEFAULT_TASK_CODE,
    MAX_CHANGES_LIMIT,
    MAX_OVERLAP_SECONDS,
    MAX_PAGE_SIZE,
    MIN_CHANGES_LIMIT,
    MIN_PAGE_SIZE,
)

# Cities in flight in the CLI's run. It is the only run, so a second city can use the time
# one city waits on the database server. A backfill's runs keep the default of 1.
CLI_CITY_THREADS = 2
_THREADS = "cities in flight at once in the run"
_PROCESSES = (
    "worker processes that sync the cities (0: the run's own process; default: one per CPU "
    "plus one, at most 4, when the cities hold at least 5,000 hotels)"
)
_SYNC = "supplier_sync_dagster.cli.sync"
_PROCS = int_within(0, MAX_WORKERS)


def add_demo(sub: Subcommands) -> None:
    """Registers ``demo``."""
    demo = sub.add_parser(
        "demo",
        help="the main job on the embedded defaults: a full sync through Dagster of the "
        "simulated supplier (flaky), then of a second supplier through its own account, with "
        "progress and summaries; run again for the next day",
    )
    demo.add_argument("--cities", type=positive_int, default=50)
    demo.add_argument("--hotels", type=non_negative_int, default=20_000)
    demo.add_argument(
        "--profile", default="flaky", help="simulator fault profile: clean, flaky or hostile"
    )
    demo.add_argument("--rate-limit", type=rate, default=1000.0, help="requests/s")
    demo.add_argument("--city-threads", type=workers, default=CLI_CITY_THREADS, help=_THREADS)
    demo.add_argument("--processes", type=_PROCS, default=None, help=_PROCESSES)
    demo.add_argument(
        "--second-hotels",
        type=non_negative_int,
        default=2_000,
        help="hotels of the second simulated supplier, synced through its own account (0: none)",
    )
    demo.add_argument("--second-cities", type=positive_int, default=10)
    handled_by(demo, f"{_SYNC}:cmd_demo", preload=True)


def add_sync(sub: Subcommands) -> None:
    """Registers ``sync`` (``--full`` or ``--incremental``)."""
    sync = sub.add_parser("sync", help="a sync against the configured supplier (SUPPLIER_SYNC_*)")
    mode = sync.add_mutually_exclusive_group(required=True)
    mode.add_argument("--full", action="store_true", help="every city (full sync)")
    mode.add_argument(
        "--incremental",
        action="store_true",
        help="one window of the change feed, from the watermark until caught up",
    )
    sync.add_argument(
        "--overlap-seconds",
        type=float_within(0, MAX_OVERLAP_SECONDS),
        default=None,
        help="incremental: how far before the watermark the window starts, 0-"
        f"{MAX_OVERLAP_SECONDS:g} (default 300)",
    )
    sync.add_argument(
        "--max-pages",
        type=positive_int,
        default=None,
        help="incremental: pages per window at most (default 2000)",
    )
    sync.add_argument(
        "--changes-limit",
        type=int_within(MIN_CHANGES_LIMIT, MAX_CHANGES_LIMIT),
        default=None,
        help=f"incremental: changes per feed request, {MIN_CHANGES_LIMIT}-{MAX_CHANGES_LIMIT} "
        "(default 500)",
    )
    sync.add_argument(
        "--task",
        default=None,
        help="incremental: the incremental task (default hotel_supplier_incremental)",
    )
    add_json_flag(sync, help="print the summary as JSON")
    sync.add_argument("--account", default=None, help=ACCOUNT_HELP)
    sync.add_argument("--trigger-id", default=None, help="idempotency key: a retry continues it")
    sync.add_argument(
        "--page-size",
        type=int_within(MIN_PAGE_SIZE, MAX_PAGE_SIZE),
        default=None,
        help=f"hotels per page, {MIN_PAGE_SIZE}-{MAX_PAGE_SIZE} (default 100)",
    )
    sync.add_argument(
        "--rate-limit",
        type=rate,
        default=None,
        help="requests/s allowed (default: SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT, else 50)",
    )
    sync.add_argument("--city-threads", type=workers, default=CLI_CITY_THREADS, help=_THREADS)
    sync.add_argument("--processes", type=_PROCS, default=None, help=_PROCESSES)
    sync.add_argument(
        "--retire-dropped-cities",
        action="store_true",
        help="retire every city the supplier no longer lists, even more than the guard allows "
        "at once (a CITY_DROP_HELD ticket says when it held some)",
    )
    handled_by(sync, f"{_SYNC}:cmd_sync", preload=True)


def add_lease_demo(sub: Subcommands) -> None:
    """Registers ``lease-demo``."""
    run = sub.add_parser(
        "lease-demo",
        help="the lease/checkpoint demonstration: two worker processes, one killed mid-city, "
        "the other reclaims its city and resumes from the checkpoint",
    )
    run.add_argument(
        "--lease-seconds",
        type=float_within(MIN_LEASE_SECONDS, MAX_LEASE_SECONDS),
        default=6.0,
        help=f"lease duration ({MIN_LEASE_SECONDS:g}-{MAX_LEASE_SECONDS:g})",
    )
    run.add_argument("--no-crash", action="store_true", help="do not kill worker A")
    run.add_argument("--trigger-id", default=None, help="idempotency key of this launch")
    handled_by(run, "supplier_sync_dagster.cli.lease_demo:cmd_lease_demo")


def add_replay(sub: Subcommands) -> None:
    """Registers ``replay``."""
    replay = sub.add_parser(
        "replay",
        help="normalize, check, diff and publish cities again from their stored raw pages "
        "(no supplier request), e.g. after a rule was fixed",
    )
    replay.add_argument("--city", action="append", required=True, help="a city code (repeatable)")
    replay.add_argument("--dry-run", action="store_true", help="report the diffs, publish nothing")
    add_json_flag(replay, help="the summary as JSON (with --dry-run: one JSON line per city)")
    replay.add_argument("--trigger-id", default=None, help="idempotency key of this replay")
    replay.add_argument(
        "--task",
        default=None,
        help=f"the task whose pages are replayed (default {DEFAULT_TASK_CODE}, or the "
        "account's full-sync task)",
    )
    replay.add_argument(
        "--account",
        default=None,
        metavar="SUPPLIER.ACCOUNT",
        help="an account of the suppliers file: its full-sync task and its assets",
    )
    handled_by(replay, f"{_SYNC}:cmd_replay", preload=True)


def add_reconcile(sub: Subcommands) -> None:
    """Registers ``reconcile``."""
    recon = sub.add_parser(
        "reconcile",
        help="each city's supplier summary against the catalog; re-pull the cities that differ",
    )
    recon.add_argument("--city", action="append", default=None, help="a city code (repeatable)")
    recon.add_argument(
        "--absolute", type=non_negative_int, default=2, help="hotels apart that are fine"
    )
    recon.add_argument(
        "--relative", type=float_within(0, 1), default=0.02, help="...or this share (0-1)"
    )
    recon.add_argument(
        "--max-lag-hours",
        type=duration(3600, zero=True),
        default=6.0,
        help="newest change may trail this long",
    )
    recon.add_argument(
        "--no-repull", action="store_true", help="report only; do not re-pull what differs"
    )
    add_json_flag(recon, help="JSON lines: one per city, a summary")
    recon.add_argument("--account", default=None, help=ACCOUNT_HELP)
    handled_by(recon, f"{_SYNC}:cmd_reconcile", preload=True)
