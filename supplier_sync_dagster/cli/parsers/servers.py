"""The arguments of ``simulate`` and ``daemon``, the commands that serve until stopped
(handlers: :mod:`supplier_sync_dagster.cli.simulate`, :mod:`supplier_sync_dagster.cli.daemon`)."""

from __future__ import annotations

import argparse

from supplier_sync_dagster.cli.common import (
    Subcommands,
    duration,
    handled_by,
    int_within,
    non_negative_int,
    positive_int,
    rate,
)
from supplier_sync_dagster.core.inputs.operator_input import MAX_ID

# How often the backfill daemon looks for new backfills (Dagster's own tick is 30 s, and a
# launched backfill's first run waits for it).
BACKFILL_DAEMON_INTERVAL_SECONDS = 2
# The simulator's clock is a datetime: a century of simulated days stays far from its end.
MAX_SIMULATED_DAY = 36_500
_DATA_PROFILE_HELP = (
    "what the hotels look like: standard, or rich (large hotels, long descriptions, much "
    "non-ASCII text)"
)


def add_simulate_and_daemon(sub: Subcommands) -> None:
    """Registers ``simulate`` and ``daemon``."""
    sim = sub.add_parser("simulate", help="serve the supplier simulator over HTTP (uvicorn)")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int_within(0, 65535), default=8080)
    sim.add_argument("--seed", type=int_within(0, MAX_ID), default=42)
    sim.add_argument("--cities", type=positive_int, default=50)
    sim.add_argument("--hotels", type=non_negative_int, default=20_000)
    sim.add_argument("--day", type=int_within(0, MAX_SIMULATED_DAY), default=0)
    sim.add_argument("--api-key", default="sim-key", help="the key clients must send")
    sim.add_argument("--rate-limit", type=rate, default=None, help="requests/s per API key")
    sim.add_argument("--profile", default="clean", help="fault profile: clean, flaky or hostile")
    sim.add_argument("--hostile-city-codes", action="store_true")
    sim.add_argument("--data-profile", default="standard", help=_DATA_PROFILE_HELP)
    for option, what in (
        ("--rooms-per-hotel", "rooms per hotel"),
        ("--description-chars", "characters of each hotel's description (0,0: none)"),
    ):
        sim.add_argument(
            option, type=_count_range, metavar="LOW,HIGH", help=f"{what}, not the data profile's"
        )
    sim.add_argument(
        "--non-ascii-share",
        type=float,
        help="share of hotels written in other scripts (0 to 1), not the data profile's",
    )
    sim.add_argument(
        "--mode",
        action="append",
        default=[],
        metavar="NAME",
        help="a named misbehaviour, always on (repeatable), e.g. slow_body, runaway_cursor, "
        "drift; an unknown name lists them all",
    )
    sim.add_argument(
        "--mode-cities",
        default="",
        metavar="A,B",
        help="the city codes the modes touch (comma-separated); unset: every city",
    )
    handled_by(sim, "supplier_sync_dagster.cli.simulate:cmd_simulate")

    daemon = sub.add_parser(
        "daemon",
        help="dagster-daemon run, with the backfill daemon looking for new backfills every "
        "--backfill-interval seconds instead of Dagster's fixed 30",
    )
    daemon.add_argument(
        "--backfill-interval",
        type=duration(),
        default=BACKFILL_DAEMON_INTERVAL_SECONDS,
        help="seconds between backfill daemon ticks",
    )
    daemon.add_argument(
        "-w",
        "--workspace",
        default="workspace.yaml",
        help="the workspace file, as for dagster-daemon run",
    )
    # The daemon's loggers have their own handlers.
    handled_by(daemon, "supplier_sync_dagster.cli.daemon:cmd_daemon", root_log=False)


def _count_range(text: str) -> tuple[int, int]:
    """``LOW,HIGH``: two whole numbers, low first (the simulator checks their bounds)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"must be LOW,HIGH (two whole numbers), not {text[:40]!r}")
    low, high = (int(p) for p in parts)
    if low > high:
        raise argparse.ArgumentTypeError(f"LOW must not exceed HIGH, not {text[:40]!r}")
    return low, high
