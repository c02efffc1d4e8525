"""The ``supplier-sync dead-letters`` commands: list with filters, ``retry`` and ``ignore``
(audited); registered by :mod:`supplier_sync_dagster.cli`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from supplier_sync_dagster.core.errors import NotFound

_STATUSES = ("PENDING", "RETRYING", "RESOLVED", "FAILED", "MANUAL_FIX", "IGNORED")


def cmd_dead_letters(args: argparse.Namespace) -> int:
    """``dead-letters list|retry|ignore``."""
    from supplier_sync_dagster.core import deadletters
    from supplier_sync_dagster.core.db import SyncDatabase

    db = SyncDatabase.open(args.db_url)
    try:
        if args.dl_command == "list":
            where = deadletters.DeadLetterFilter(
                status=args.status,
                error_code=args.code,
                error_class=args.error_class,
                batch_id=args.batch,
                supplier_hotel_id=args.hotel,
                older_than_hours=args.older_than_hours,
            )
            with db.engine.connect() as conn:
                rows = deadletters.list_dead_letters(conn, db.clock, where, limit=args.limit)
            for row in rows:
                print(_line(row, as_json=args.json))
            return 0
        if args.dl_command == "show":
            from supplier_sync_dagster.core.audit import list_audit

            with db.engine.connect() as conn:
                found = deadletters.list_dead_letters(
                    conn, db.clock, deadletters.DeadLetterFilter(id=args.id), limit=1
                )
                if not found:
                    raise NotFound(f"no dead letter has id {args.id}")
                row = found[0]
                history = list_audit(
                    conn, target_type="dead_letter", target_id=row["dead_letter_id"], limit=100
                )
            print(
                json.dumps(
                    {**row, "audit": [vars(e) for e in history]},
                    default=str,
                    ensure_ascii=False,
                    indent=None if args.json else 2,
                    sort_keys=True,
                )
            )
            return 0
        with db.begin() as conn:
            moved = deadletters.operator_action(
                conn, db.clock, args.ids, args.dl_command, actor=args.by, reason=args.reason
            )
        print(f"{args.dl_command}: {moved} dead letters (recorded in the audit trail)")
        return 0
    finally:
        db.dispose()


def _line(row: dict[str, Any], *, as_json: bool) -> str:
    if as_json:
        return json.dumps(row, default=str, ensure_ascii=False, sort_keys=True)
    due = f" due {row['next_retry_at']}" if row["next_retry_at"] else ""
    return (
        f"{row['id']:>8} {row['status']:<10} {row['error_class']:<12} {row['error_code']:<24} "
        f"{row['supplier_resource_code']:<14} tries {row['retry_count']}/{row['max_retry_count']}"
        f"{due}  {row['owner_team'] or '-'}  {row['batch_id']}  {row['error_message'][:120]}"
    )


def add_commands(sub: Any) -> None:
    """Registers ``dead-letters`` on the ``supplier-sync`` subparsers."""
    dl = sub.add_parser(
        "dead-letters", help="records that could not be published: list, retry, ignore"
    )
    dl_sub = dl.add_subparsers(dest="dl_command", required=True)
    listing = dl_sub.add_parser("list", help="dead letters, newest first")
    listing.add_argument("--status", choices=_STATUSES, default=None)
    listing.add_argument("--code", default=None, help="an error code (UNKNOWN_CURRENCY ...)")
    listing.add_argument(
        "--class", dest="error_class", choices=("RETRYABLE", "NEEDS_PERSON"), default=None
    )
    listing.add_argument("--batch", default=None)
    listing.add_argument("--hotel", default=None, help="the supplier's hotel id")
    listing.add_argument("--older-than-hours", type=float, default=None)
    listing.add_argument("--limit", type=int, default=100)
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_dead_letters)
    show = dl_sub.add_parser("show", help="one dead letter with its audit history")
    show.add_argument("id", type=int, help="the dead letter's id (the list's first column)")
    show.add_argument("--json", action="store_true", help="one line instead of indented")
    show.set_defaults(func=cmd_dead_letters)
    for name, what in (
        ("retry", "re-queue MANUAL_FIX/FAILED rows, due now, with one more attempt"),
        ("ignore", "close open rows for good"),
    ):
        act = dl_sub.add_parser(name, help=what + " (recorded in the audit trail)")
        act.add_argument(
            "ids", nargs="+", type=int, help="dead letter ids (the list's first column)"
        )
        act.add_argument("--by", required=True, help="who (recorded)")
        act.add_argument("--reason", required=True, help="why (recorded)")
        act.set_defaults(func=cmd_dead_letters)
