"""The arguments of the operator commands: ``dead-letters``, ``trace``, ``history``,
``prune-history`` and ``audit`` (handlers: :mod:`supplier_sync_dagster.cli.operators`,
:mod:`supplier_sync_dagster.cli.repair`)."""

from __future__ import annotations

import argparse

from supplier_sync_dagster.cli.common import (
    ACCOUNT_HELP,
    Subcommands,
    add_audited_actions,
    add_json_flag,
    add_who_and_why,
    as_of,
    duration,
    handled_by,
    int_within,
    positive_int,
    row_id,
)
from supplier_sync_dagster.core.settings import MAX_HISTORY_RETENTION_DAYS

_OPERATORS = "supplier_sync_dagster.cli.operators"
_REPAIR = "supplier_sync_dagster.cli.repair"
_PRUNE_HELP = (
    "drop the publish versions superseded before the retention horizon (the one current at "
    "it stays)"
)
_RETENTION = "SUPPLIER_SYNC_HISTORY_RETENTION_DAYS, else 400"
_STATUSES = ("PENDING", "RETRYING", "RESOLVED", "FAILED", "MANUAL_FIX", "IGNORED", "MERGED")


def add_commands(sub: Subcommands) -> None:
    """Registers ``dead-letters``, ``trace``, ``history``, ``prune-history`` and ``audit``."""
    dl = sub.add_parser(
        "dead-letters",
        help="records that could not be published: list, show, retry, ignore, fix, compensate",
    )
    _add_dead_letter_commands(dl.add_subparsers(dest="dl_command", required=True))

    trace = sub.add_parser(
        "trace", help="where a published hotel's fields came from, down to the supplier's bytes"
    )
    _add_hotel(trace)
    trace.add_argument("--field", default=None, help="only diffs of this field (price_amount ...)")
    trace.add_argument(
        "--as-of",
        type=as_of,
        metavar="TIME",
        help="the hotel and its offers exactly as published at this time (ISO 8601 with a "
        "zone: 2026-05-01T14:00:00Z), with the version, diff, batch and raw bytes behind it",
    )
    add_json_flag(trace)
    handled_by(trace, f"{_OPERATORS}:cmd_trace", read_only=True)

    history = sub.add_parser("history", help="every published version of a hotel, with its time")
    _add_hotel(history)
    add_json_flag(history)
    handled_by(history, f"{_OPERATORS}:cmd_history", read_only=True)

    prune = sub.add_parser("prune-history", help=_PRUNE_HELP)
    days = int_within(1, MAX_HISTORY_RETENTION_DAYS)
    prune.add_argument("--retention-days", type=days, help=f"days kept (default: ${_RETENTION})")
    add_json_flag(prune)
    handled_by(prune, f"{_OPERATORS}:cmd_prune_history")

    audit = sub.add_parser(
        "audit", help="every operator action: who, when, what, why, before and after"
    )
    audit.add_argument(
        "--target-type", default=None, help="dead_letter, review, gate_check, task, outbox_event"
    )
    audit.add_argument("--target", default=None, help="the target's id")
    audit.add_argument("--actor", default=None)
    audit.add_argument("--action", default=None, help="dead_letter.fix, review.approve ...")
    audit.add_argument("--limit", type=positive_int, default=50)
    add_json_flag(audit)
    handled_by(audit, f"{_OPERATORS}:cmd_audit", read_only=True)


def _add_hotel(parser: argparse.ArgumentParser) -> None:
    """The hotel a command is about: its supplier's id, and the supplier when ambiguous."""
    parser.add_argument("hotel", help="the supplier's hotel id")
    parser.add_argument(
        "--supplier-id", type=row_id, default=None, help="needed when two suppliers share the id"
    )


def _add_dead_letter_commands(dl_sub: Subcommands) -> None:
    listing = dl_sub.add_parser("list", help="dead letters, newest first")
    listing.add_argument("--status", choices=_STATUSES, default=None)
    listing.add_argument("--code", default=None, help="an error code (UNKNOWN_CURRENCY ...)")
    listing.add_argument(
        "--class", dest="error_class", choices=("RETRYABLE", "NEEDS_PERSON"), default=None
    )
    listing.add_argument("--city", default=None, help="the supplier's city code of the record")
    listing.add_argument("--batch", default=None)
    listing.add_argument("--hotel", default=None, help="the supplier's hotel id")
    listing.add_argument("--older-than-hours", type=duration(3600, zero=True), default=None)
    listing.add_argument("--limit", type=positive_int, default=100)
    add_json_flag(listing)
    handled_by(listing, f"{_OPERATORS}:cmd_dead_letters", read_only=True)
    show = dl_sub.add_parser("show", help="one dead letter with its audit history")
    show.add_argument("id", type=row_id, help="the dead letter's id (the list's first column)")
    add_json_flag(show, help="one line instead of indented")
    handled_by(show, f"{_OPERATORS}:cmd_dead_letters", read_only=True)
    add_audited_actions(
        dl_sub,
        {
            "retry": "re-queue MANUAL_FIX/FAILED rows, due now, with one more attempt",
            "ignore": "close open rows for good",
        },
        f"{_OPERATORS}:cmd_dead_letters",
        ids_help="dead letter ids (the list's first column)",
    )
    _add_repair_commands(dl_sub)


def _add_repair_commands(dl_sub: Subcommands) -> None:
    fix = dl_sub.add_parser(
        "fix",
        help="patch the supplier's record (JSON merge patch) and run it through every check "
        "(recorded in the audit trail); exit 1 when it still fails",
    )
    fix.add_argument("id", type=row_id, help="the dead letter's id")
    fix.add_argument(
        "--patch", required=True, help='a JSON merge patch of the record: \'{"phone": "+66 2 1"}\''
    )
    add_who_and_why(fix)
    add_json_flag(fix)
    handled_by(fix, f"{_REPAIR}:cmd_fix")
    comp = dl_sub.add_parser(
        "compensate",
        help="re-fetch the hotels of due retryable dead letters and run them through every "
        "stage (what the dead_letter_compensation schedule does)",
    )
    comp.add_argument("--limit", type=positive_int, default=10_000, help="due rows taken at most")
    comp.add_argument("--account", default=None, help=ACCOUNT_HELP)
    comp.add_argument("--trigger-id", default=None, help="idempotency key (default: new)")
    add_json_flag(comp)
    handled_by(comp, f"{_REPAIR}:cmd_compensate")
