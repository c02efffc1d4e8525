"""The arguments of ``accounts`` (handlers: :mod:`supplier_sync_dagster.cli.accounts`,
:mod:`supplier_sync_dagster.cli.accounts_check`)."""

from __future__ import annotations

from supplier_sync_dagster.cli.common import (
    Subcommands,
    add_json_flag,
    add_who_and_why,
    handled_by,
)


def add_commands(sub: Subcommands) -> None:
    """Registers ``accounts list|check|apply``."""
    accounts = sub.add_parser(
        "accounts",
        help="the suppliers and accounts of $SUPPLIER_SYNC_SUPPLIERS_FILE: list, check, apply",
    )
    commands = accounts.add_subparsers(dest="accounts_command", required=True)
    listing = commands.add_parser("list", help="each account: supplier, key variable, limits")
    add_json_flag(listing, help="one JSON object per account")
    handled_by(listing, "supplier_sync_dagster.cli.accounts:cmd_list")
    check = commands.add_parser(
        "check", help="load the Dagster definitions from the file, as a code location does"
    )
    add_json_flag(check)
    handled_by(check, "supplier_sync_dagster.cli.accounts_check:cmd_check")
    apply = commands.add_parser(
        "apply",
        help="create each account's tasks and set the file's schedules and gate thresholds "
        "on them (audited)",
    )
    apply.add_argument("--db-url", default=None, help="the sync database (default: the settings)")
    add_who_and_why(apply, who="who applies it (recorded)")
    handled_by(apply, "supplier_sync_dagster.cli.accounts:cmd_apply")
