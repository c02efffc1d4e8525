"""What ``db migrate``, ``db init``, ``db status`` and ``db repair`` do: the sync database's
versioned migrations (:mod:`supplier_sync_dagster.core.store.migrations`), shown and run.
Their arguments: :mod:`supplier_sync_dagster.cli.parsers.db`."""

from __future__ import annotations

import argparse

from supplier_sync_dagster.cli.common import open_db
from supplier_sync_dagster.core.store.migrations import migrate, migration_status, repair


def cmd_db_migrate(args: argparse.Namespace) -> int:
    """``db migrate`` (and ``db init``): the pending versions applied, each printed."""
    dry_run = getattr(args, "dry_run", False)
    with open_db(args.db_url, create_schema=False) as db:
        result = migrate(db, dry_run=dry_run)
    if result.baseline:
        print(
            f"{'would record' if dry_run else 'recorded'} {db.safe_url} at version "
            f"{result.baseline:03d} (baseline: it had no schema history and the structure of "
            f"version {result.baseline:03d})"
        )
    elif result.baseline == 0:
        print(f"{db.safe_url} has none of the sync tables: every version applies")
    for applied in result.applied:
        print(
            f"would apply {applied.label}"
            if dry_run
            else f"applied {applied.label} ({applied.seconds * 1000:.0f} ms)"
        )
    if dry_run:
        print(f"dry run: nothing changed; {db.safe_url} would be at version {result.head:03d}")
    elif not result.applied:
        print(f"{db.safe_url} is at version {result.version:03d}: nothing to apply")
    else:
        print(f"{db.safe_url} is at version {result.version:03d}")
    if args.db_command == "init" and not dry_run:
        print(f"schema ready in {db.safe_url}")
    return 0


def cmd_db_status(args: argparse.Namespace) -> int:
    """``db status``: each version's state; 0 when the schema is up to date, else 1."""
    with open_db(args.db_url, create_schema=False) as db:
        status = migration_status(db)
    rows = {r.version: r for r in status.history}
    edited = {r.version for r in status.edited}
    for m in status.migrations:
        row = rows.get(m.version)
        if row is None:
            state = "pending"
            if status.baseline and m.version <= status.baseline:
                state = "present, not recorded (baseline)"
            print(f"{m.version:03d}  {m.description:<28} {state}")
            continue
        when = f"{row.installed_at:%Y-%m-%d %H:%M:%S} UTC" if row.installed_at else "?"
        if not row.success:
            state = f"NOT FINISHED (started {when} by {row.installed_by}): see `db repair`"
        elif m.version in edited:
            state = f"EDITED since it was applied ({m.script})"
        elif row.kind == "BASELINE":
            state = f"baseline, recorded {when}"
        else:
            state = f"applied {when} ({row.execution_ms} ms)"
        print(f"{m.version:03d}  {m.description:<28} {state}")
    for row in status.unknown:
        print(f"{row.version:03d}  {row.description:<28} applied by a newer release")
    if not status.versioned:
        print(
            f"{db.safe_url} has no schema history: "
            + (
                f"its structure is that of version {status.baseline:03d}; "
                if status.baseline
                else "it is empty; "
            )
            + "`supplier-sync db migrate` records it and applies the rest"
        )
    verdict = "up to date" if status.up_to_date else "NOT up to date"
    print(f"{db.safe_url}: version {status.version:03d} of {status.head:03d}, {verdict}")
    return 0 if status.up_to_date else 1


def cmd_db_repair(args: argparse.Namespace) -> int:
    """``db repair``: an unfinished migration forgotten (or ``--mark-applied``: recorded)."""
    with open_db(args.db_url, create_schema=False) as db:
        repaired = repair(db, mark_applied=args.mark_applied)
    if not repaired:
        print(f"{db.safe_url}: no unfinished migration to repair")
    for row in repaired:
        done = (
            "recorded as applied" if args.mark_applied else "forgotten: `db migrate` runs it again"
        )
        print(f"{row.version:03d} {row.description}: {done}")
    return 0
