"""The arguments of the outbox's commands and its read models: ``dispatch``, ``outbox``,
``search`` and ``serve-api`` (handlers: :mod:`supplier_sync_dagster.cli.outbox`,
:mod:`supplier_sync_dagster.cli.serve_api`)."""

from __future__ import annotations

import argparse
from decimal import Decimal, InvalidOperation

from supplier_sync_dagster.cli.common import (
    Subcommands,
    add_audited_actions,
    add_json_flag,
    float_within,
    handled_by,
    int_within,
    positive_int,
)

# The most dispatcher processes ``dispatch`` starts unless told (``dispatch_parallelism``).
MAX_AUTO_PROCESSES = 8
_OUTBOX = "supplier_sync_dagster.cli.outbox"
_STATUSES = ("READY", "PROCESSING", "SUCCEEDED", "FAILED", "CANCELLED")
_STAGES = ("SEARCH_INDEX", "CACHE", "NOTIFY", "END")
_SECONDS = float_within(0, None, low_open=True)


def _price(text: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a price: {text!r}") from None
    if not value.is_finite() or value < 0:
        raise argparse.ArgumentTypeError(f"not a price: {text!r}")
    return value


def add_commands(sub: Subcommands) -> None:
    """Registers ``dispatch``, ``outbox``, ``search`` and ``serve-api``."""
    dispatch = sub.add_parser(
        "dispatch",
        help="drive the outbox: search index, cache and subscribers (until SIGTERM, or --once)",
    )
    dispatch.add_argument("--once", action="store_true", help="drain what is due, then exit")
    dispatch.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="dispatchers per process (default: 2 in one process, else 1)",
    )
    dispatch.add_argument(
        "--processes",
        type=positive_int,
        default=None,
        help="processes of --threads dispatchers each (default: two per CPU core, at most "
        f"{MAX_AUTO_PROCESSES}, on MySQL/MariaDB; one on SQLite)",
    )
    dispatch.add_argument("--batch-size", type=positive_int, default=500, help="events per claim")
    dispatch.add_argument("--max-seconds", type=_SECONDS, default=None, help="--once: stop after")
    add_json_flag(dispatch)
    handled_by(dispatch, f"{_OUTBOX}:cmd_dispatch", preload=True)

    _add_outbox_commands(sub)

    search = sub.add_parser("search", help="search the hotel search read model")
    search.add_argument("text", nargs="?", default="", help="words (all must match)")
    search.add_argument("--city", default=None, help="supplier city code")
    search.add_argument("--country", default=None, help="ISO country code")
    search.add_argument(
        "--stars", type=float_within(0, 5), default=None, help="at least this many stars"
    )
    search.add_argument("--max-price", type=_price, default=None, help="lowest price at most")
    search.add_argument("--all-statuses", action="store_true", help="INACTIVE hotels too")
    search.add_argument("--limit", type=positive_int, default=20)
    add_json_flag(search)
    handled_by(search, f"{_OUTBOX}:cmd_search")

    api = sub.add_parser(
        "serve-api",
        help="the read API: /hotels, /hotels/{id}, POST /offers/confirm (SUPPLIER_SYNC_API_KEYS)",
    )
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument(
        "--no-auth",
        action="store_true",
        help="serve without API keys (a local demo): a loopback --host only, and "
        "SUPPLIER_SYNC_API_KEYS unset",
    )
    api.add_argument("--port", type=int_within(0, 65535), default=8000)
    api.add_argument(
        "--ttl", type=float_within(0), default=300.0, help="seconds a hotel stays cached"
    )
    api.add_argument(
        "--confirm-timeout", type=_SECONDS, default=3.0, help="seconds for the supplier's answer"
    )
    handled_by(api, "supplier_sync_dagster.cli.serve_api:cmd_serve_api", preload=True)


def _add_outbox_commands(sub: Subcommands) -> None:
    outbox = sub.add_parser("outbox", help="the outbox's events: status, list, retry, cancel")
    outbox_sub = outbox.add_subparsers(dest="outbox_command", required=True)
    status = outbox_sub.add_parser("status", help="counts by status and stage, stuck, lag")
    add_json_flag(status)
    handled_by(status, f"{_OUTBOX}:cmd_outbox", read_only=True)
    listing = outbox_sub.add_parser("list", help="events, newest first")
    listing.add_argument("--status", choices=_STATUSES, default=None)
    listing.add_argument("--stage", choices=_STAGES, default=None, help="the next stage")
    listing.add_argument("--limit", type=positive_int, default=50)
    add_json_flag(listing)
    handled_by(listing, f"{_OUTBOX}:cmd_outbox", read_only=True)
    add_audited_actions(
        outbox_sub,
        {
            "retry": "FAILED or CANCELLED events run again from the stage they stopped at",
            "cancel": "READY or FAILED events stop (until retried)",
        },
        f"{_OUTBOX}:cmd_outbox",
        ids_help="outbox event ids (outbox list)",
    )

    reconcile = outbox_sub.add_parser(
        "reconcile",
        help="compare the search index with the catalog per city (count, checksum of "
        "(resource, publish version)) and re-project what differs",
    )
    reconcile.add_argument("--no-repair", action="store_true", help="only report (exit 1)")
    add_json_flag(reconcile)
    handled_by(reconcile, f"{_OUTBOX}:cmd_outbox")
