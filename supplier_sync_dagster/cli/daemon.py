"""What ``daemon`` does: ``dagster-daemon run`` with the project's backfill interval
(:func:`supplier_sync_dagster.dagster_instance.daemon.run_daemon`). Its arguments:
:mod:`supplier_sync_dagster.cli.parsers.servers`."""

from __future__ import annotations

import argparse

from supplier_sync_dagster.dagster_instance.daemon import run_daemon


def cmd_daemon(args: argparse.Namespace) -> int:
    """``daemon``: runs the Dagster daemon on ``--workspace`` until stopped."""
    return run_daemon(["-w", args.workspace], backfill_interval_seconds=args.backfill_interval)
