"""What ``accounts list`` and ``accounts apply`` do: the suppliers file's accounts (or the
one default account) shown, and each account's tasks (and the file's gate thresholds)
written into the sync database, audited. ``accounts check``:
:mod:`supplier_sync_dagster.cli.accounts_check`. Their arguments:
:mod:`supplier_sync_dagster.cli.parsers.accounts`.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from supplier_sync_dagster.cli.common import open_db
from supplier_sync_dagster.core.accounts import load_accounts
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.leasing.batches import TaskSpec
from supplier_sync_dagster.core.redaction import redact_url
from supplier_sync_dagster.core.settings import Settings, load_settings
from supplier_sync_dagster.core.store.audit import require_who_and_why
from supplier_sync_dagster.core.sync.tasks import change_task, ensure_task


def account_rows(settings: Settings) -> list[dict[str, Any]]:
    """One row per account of the suppliers file (the default account without one)."""
    if settings.suppliers_file is None:
        return [
            {
                "account": "default",
                "supplier_id": 1001,
                "base_url": redact_url(settings.supplier_url or "simulator"),
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
            "base_url": redact_url(a.base_url)
            if a.base_url
            else f"simulator (seed {a.simulator.seed}, {a.simulator_profile})",
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


def print_result(result: dict[str, Any], text: str, *, as_json: bool) -> None:
    """One line of an ``accounts`` command's output: ``result`` as JSON (keys sorted), else
    ``text``."""
    print(json.dumps(result, sort_keys=True) if as_json else text)


def cmd_list(args: argparse.Namespace) -> int:
    """``accounts list``: each account's supplier, key variable and limits."""
    for row in account_rows(load_settings()):
        text = (
            f"{row['account']:<28} supplier {row['supplier_id']:<6} "
            f"{row['rate_limit_rps']:g} req/s  key {row['api_key']}  {row['base_url']}"
        )
        print_result(row, text, as_json=args.json)
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    """``accounts apply``: each account's tasks created, the file's schedules and gate
    thresholds set on them (audited).

    Raises:
        ConfigError: No suppliers file is set, or no ``--by`` or ``--reason``.
    """
    who, why = require_who_and_why(args.by, args.reason)
    settings = load_settings()
    if settings.suppliers_file is None:
        raise ConfigError("accounts apply: no suppliers file (set SUPPLIER_SYNC_SUPPLIERS_FILE)")
    accounts = load_accounts(settings.suppliers_file)
    changed = 0
    with open_db(args.db_url or settings.db_url) as db:
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
                    created_by=who,
                    reason=f"{why} (accounts apply)"[:1024],
                    by_operator=True,
                )
                entries = change_task(
                    db,
                    task_code,
                    changed_by=who,
                    reason=why,
                    cron=cron or "none",
                    thresholds=dict(account.thresholds) or None,
                )
                changed += len(entries)
                for e in entries:
                    print(f"{task_code}: {e.field_name} {e.old_value} -> {e.new_value}")
    print(f"{len(accounts)} accounts, {3 * len(accounts)} tasks: {changed} settings changed")
    return 0
