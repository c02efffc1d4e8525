"""The ``supplier-sync accounts`` commands and the ``--account`` option of the sync commands;
registered by :mod:`supplier_sync_dagster.cli.main`.

``accounts list`` shows the suppliers file's accounts (or the one default account),
``accounts check`` loads the Dagster definitions from it as a code location would, and
``accounts apply`` writes each account's tasks (and the file's gate thresholds) into the
sync database, audited.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

ACCOUNT_HELP = (
    "the account (supplier.account) of $SUPPLIER_SYNC_SUPPLIERS_FILE; unset: the one account "
    "of the SUPPLIER_SYNC_SUPPLIER_* settings"
)


def account_scope(args: argparse.Namespace, settings: Any) -> Any:
    """The :class:`AccountScope` that ``--account`` names (the default one without it).

    Raises:
        ConfigError: ``--account`` without a suppliers file, or an unknown account.
    """
    from supplier_sync_dagster.core.accounts import find_account, load_accounts
    from supplier_sync_dagster.core.errors import ConfigError
    from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE, AccountScope

    code = getattr(args, "account", None)
    if code is None:
        return DEFAULT_SCOPE
    if settings.suppliers_file is None:
        raise ConfigError(
            f"--account {code}: no suppliers file (set SUPPLIER_SYNC_SUPPLIERS_FILE to a "
            "suppliers.yaml)"
        )
    return AccountScope(find_account(load_accounts(settings.suppliers_file), code))


def full_task_scopes() -> list[tuple[str, Any]]:
    """(full-sync task, account scope) of every account: the commands that judge tasks
    (metrics, alerts) mean these unless told ``--task``."""
    from supplier_sync_dagster.defs.accounts import account_scopes

    return [(scope.full_task_code, scope) for scope in account_scopes()]


def account_supplier_now(settings: Any, scope: Any, **overrides: Any) -> Any:
    """The account's supplier resource for a command run now: its API key read from the
    variable the file names (a run in Dagster reads it through ``dg.EnvVar`` instead).

    Raises:
        ConfigError: The file names a key variable that is not set.
    """
    from supplier_sync_dagster.core.errors import ConfigError
    from supplier_sync_dagster.defs.resources import account_supplier

    account = scope.account
    # Values, not dg.EnvVar: this resource is used outside a Dagster run too.
    fields = {
        k: v for k, v in {"redis_url": settings.redis_url, **overrides}.items() if v is not None
    }
    if account.api_key_env:
        key = os.environ.get(account.api_key_env)
        if not key:
            raise ConfigError(
                f"{account.api_key_env} is not set: it holds the API key of account {account.code}"
            )
        fields["api_key"] = key
    return account_supplier(settings, scope, **fields)


def _rows(settings: Any) -> list[dict[str, Any]]:
    from supplier_sync_dagster.core.accounts import load_accounts

    if settings.suppliers_file is None:
        return [
            {
                "account": "default",
                "supplier_id": 1001,
                "base_url": settings.supplier_url or "simulator",
                "api_key": "SUPPLIER_SYNC_SUPPLIER_API_KEY"
                + (" (set)" if settings.supplier_api_key else " (unset)"),
                "rate_limit_rps": settings.supplier_rate_limit or 50.0,
                "tasks": ["hotel_supplier_full_resource", "hotel_supplier_incremental"],
            }
        ]
    return [
        {
            "account": a.code,
            "supplier_id": a.supplier_id,
            "base_url": a.base_url or f"simulator (seed {a.simulator.seed}, {a.simulator_profile})",
            "api_key": (
                f"{a.api_key_env} ({'set' if os.environ.get(a.api_key_env) else 'unset'})"
                if a.api_key_env
                else "none"
            ),
            "rate_limit_rps": a.rate_limit_rps,
            "page_size": a.page_size,
            "schedules": a.schedules.model_dump(),
            "thresholds": dict(a.thresholds),
            "tasks": list(a.task_codes),
        }
        for a in load_accounts(settings.suppliers_file)
    ]


def cmd_accounts(args: argparse.Namespace) -> int:
    """``accounts list|check|apply``."""
    from supplier_sync_dagster.core.settings import load_settings

    settings = load_settings()
    if args.accounts_command == "list":
        rows = _rows(settings)
        for row in rows:
            if args.json:
                print(json.dumps(row, sort_keys=True))
            else:
                print(
                    f"{row['account']:<28} supplier {row['supplier_id']:<6} "
                    f"{row['rate_limit_rps']:g} req/s  key {row['api_key']}  {row['base_url']}"
                )
        return 0
    if args.accounts_command == "check":
        return _check(settings, as_json=args.json)
    return _apply(settings, args)


def _check(settings: Any, *, as_json: bool) -> int:
    import dagster as dg

    from supplier_sync_dagster.definitions import defs

    started = time.perf_counter()
    with dg.instance_for_test():
        # An ephemeral instance: loading the definitions must not need the deployment's.
        repo = defs().get_repository_def()
        jobs = sorted(j.name for j in repo.get_all_jobs() if not j.name.startswith("__"))
    seconds = time.perf_counter() - started
    accounts = [r["account"] for r in _rows(settings)]
    result = {
        "accounts": accounts,
        "jobs": len(jobs),
        "schedules": len(repo.schedule_defs),
        "sensors": len(repo.sensor_defs),
        "assets": len(repo.asset_graph.get_all_asset_keys()),
        "load_seconds": round(seconds, 3),
    }
    if as_json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(
            f"{len(accounts)} accounts: {len(jobs)} jobs, {result['schedules']} schedules, "
            f"{result['sensors']} sensors, {result['assets']} assets; loaded in {seconds:.2f} s"
        )
    return 0


def _apply(settings: Any, args: argparse.Namespace) -> int:
    from supplier_sync_dagster.core.accounts import load_accounts
    from supplier_sync_dagster.core.errors import ConfigError
    from supplier_sync_dagster.core.leasing.batches import TaskSpec
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.sync.tasks import change_task, ensure_task

    if settings.suppliers_file is None:
        raise ConfigError("accounts apply: no suppliers file (set SUPPLIER_SYNC_SUPPLIERS_FILE)")
    accounts = load_accounts(settings.suppliers_file)
    db = SyncDatabase.open(args.db_url or settings.db_url)
    changed = 0
    try:
        for account in accounts:
            specs = (
                (account.full_task_code, "FULL", account.schedules.full),
                (account.incremental_task_code, "INCREMENTAL", account.schedules.incremental),
                (account.compensation_task_code, "REFRESH", None),
            )
            for task_code, mode, cron in specs:
                ensure_task(
                    db,
                    TaskSpec(task_code=task_code, supplier_id=account.supplier_id, sync_mode=mode),  # type: ignore[arg-type]
                    created_by=args.by,
                    reason=f"{args.reason} (accounts apply)",
                )
                entries = change_task(
                    db,
                    task_code,
                    changed_by=args.by,
                    reason=args.reason,
                    cron=cron or "none",
                    thresholds=dict(account.thresholds) or None,
                )
                changed += len(entries)
                for e in entries:
                    print(f"{task_code}: {e.field_name} {e.old_value} -> {e.new_value}")
    finally:
        db.dispose()
    print(f"{len(accounts)} accounts, {3 * len(accounts)} tasks: {changed} settings changed")
    return 0


def add_account_commands(sub: Any) -> None:
    """Registers ``supplier-sync accounts``."""
    accounts = sub.add_parser(
        "accounts",
        help="the suppliers and accounts of $SUPPLIER_SYNC_SUPPLIERS_FILE: list, check, apply",
    )
    commands = accounts.add_subparsers(dest="accounts_command", required=True)
    listing = commands.add_parser("list", help="each account: supplier, key variable, limits")
    listing.add_argument("--json", action="store_true", help="one JSON object per account")
    check = commands.add_parser(
        "check", help="load the Dagster definitions from the file, as a code location does"
    )
    check.add_argument("--json", action="store_true")
    apply = commands.add_parser(
        "apply",
        help="create each account's tasks and set the file's schedules and gate thresholds "
        "on them (audited)",
    )
    apply.add_argument("--db-url", default=None, help="the sync database (default: the settings)")
    apply.add_argument("--by", required=True, help="who applies it (recorded)")
    apply.add_argument("--reason", required=True, help="why (recorded)")
    accounts.set_defaults(func=cmd_accounts)
