"""What ``accounts check`` does: the Dagster definitions loaded from the suppliers file, as
a code location loads them. A module of its own: it imports Dagster and the definitions,
which ``accounts list`` and ``accounts apply`` do without."""

from __future__ import annotations

import argparse
import time

import dagster as dg

from supplier_sync_dagster.cli.accounts import account_rows, print_result
from supplier_sync_dagster.core.settings import load_settings
from supplier_sync_dagster.definitions import defs


def cmd_check(args: argparse.Namespace) -> int:
    """``accounts check``: the accounts, and the jobs, schedules, sensors and assets that
    their definitions hold."""
    settings = load_settings()
    # The file read as `accounts list` reads it first: a bad field is the one line that
    # names it, not the traceback of the definitions that fail to load from it.
    accounts = [r["account"] for r in account_rows(settings)]
    started = time.perf_counter()
    with dg.instance_for_test():
        # An ephemeral instance: loading the definitions must not need the deployment's.
        repo = defs().get_repository_def()
        jobs = sorted(j.name for j in repo.get_all_jobs() if not j.name.startswith("__"))
    seconds = time.perf_counter() - started
    result = {
        "accounts": accounts,
        "jobs": len(jobs),
        "schedules": len(repo.schedule_defs),
        "sensors": len(repo.sensor_defs),
        "assets": len(repo.asset_graph.get_all_asset_keys()),
        "load_seconds": round(seconds, 3),
    }
    text = (
        f"{len(accounts)} accounts: {len(jobs)} jobs, {result['schedules']} schedules, "
        f"{result['sensors']} sensors, {result['assets']} assets; loaded in {seconds:.2f} s"
    )
    print_result(result, text, as_json=args.json)
    return 0
