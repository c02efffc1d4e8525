"""The arguments of ``db`` (handlers: :mod:`supplier_sync_dagster.cli.db`)."""

from __future__ import annotations

from supplier_sync_dagster.cli.common import Subcommands, handled_by

_DB = "supplier_sync_dagster.cli.db"


def add_commands(sub: Subcommands) -> None:
    """Registers ``db migrate``, ``db init``, ``db status`` and ``db repair``."""
    db = sub.add_parser(
        "db",
        help="sync database schema: versioned migrations of sql/ (migrate, status, repair)",
        description="The schema is the numbered files of sql/ (sql/sqlite/ on SQLite), each "
        "applied once and recorded with its checksum in supplier_sync_schema_history. Every "
        "command that opens the database applies the pending ones first; these commands "
        "show and do it explicitly.",
    )
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_migrate = db_sub.add_parser(
        "migrate",
        help="bring the schema to the newest version: record an unversioned database's "
        "version from its structure, then apply the pending files in order, printing each",
    )
    db_migrate.add_argument(
        "--dry-run", action="store_true", help="print what would be applied, change nothing"
    )
    handled_by(db_migrate, f"{_DB}:cmd_db_migrate")
    db_init = db_sub.add_parser("init", help="create the schema, or upgrade it (same as migrate)")
    handled_by(db_init, f"{_DB}:cmd_db_migrate")
    db_status = db_sub.add_parser(
        "status",
        help="each version: applied, baseline, pending, edited or unfinished; "
        "exit 1 unless up to date",
    )
    handled_by(db_status, f"{_DB}:cmd_db_status", read_only=True)
    db_repair = db_sub.add_parser(
        "repair",
        help="after a MySQL migration stopped half-way and you undid its statements by hand: "
        "forget the attempt so that migrate runs it again",
    )
    db_repair.add_argument(
        "--mark-applied",
        action="store_true",
        help="you completed its statements by hand instead: record it as applied",
    )
    handled_by(db_repair, f"{_DB}:cmd_db_repair")
