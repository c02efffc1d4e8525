"""The Dagster resources a command builds: the sync database and payload store of its options
and settings, the supplier of the settings or of an account of the suppliers file.

The handlers that run Dagster share these; a handler that only reads the sync database
does not import this module (it imports Dagster).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from supplier_sync_dagster.cli.common import first
from supplier_sync_dagster.core.accounts import find_account, load_accounts
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.settings import Settings, StorageSettings
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE, AccountScope, account_scopes
from supplier_sync_dagster.defs.resources import (
    PayloadStoreResource,
    SupplierResource,
    SyncDatabaseResource,
    account_supplier,
    client_limits,
    governor_fields,
    lease_fields,
    supplier_resource,
    walk_fields,
)


def storage_resources(
    args: argparse.Namespace, settings: StorageSettings
) -> tuple[SyncDatabaseResource, PayloadStoreResource]:
    """The database and payload store resources: ``--db-url``, else the settings."""
    return (
        SyncDatabaseResource(
            db_url=args.db_url or settings.db_url,
            max_clock_skew_seconds=settings.max_clock_skew_seconds,
            **lease_fields(settings),
        ),
        PayloadStoreResource(url=settings.payload_url),
    )


def configured_supplier(
    settings: Settings,
    *,
    rate_limit: float | None = None,
    scope: AccountScope | None = None,
    **fields: Any,
) -> SupplierResource:
    """The configured supplier's resource: the settings, then these fields; the rate limit
    is the option, else the setting, else the resource's default (unset fields: defaults).
    With the ``scope`` of an account of the suppliers file: that account's, then these.

    Raises:
        ConfigError: A suppliers file is set but no account was named.
    """
    extra = {k: v for k, v in fields.items() if v is not None}
    if scope is not None and scope.account is not None:
        return account_supplier_now(settings, scope, rate_limit_rps=rate_limit, **extra)
    if settings.suppliers_file is not None:
        # Never the SUPPLIER_SYNC_SUPPLIER_* supplier by mistake in a deployment of accounts.
        raise ConfigError(
            f"the suppliers file {settings.suppliers_file} describes the accounts: name one "
            "with --account supplier.account (supplier-sync accounts list shows them)"
        )
    rate = first(rate_limit, settings.supplier_rate_limit)
    if rate is not None:
        extra["rate_limit_rps"] = rate
    extra = {**client_limits(settings), **extra}
    return supplier_resource(
        base_url=settings.supplier_url,
        api_key=settings.api_key(),
        redis_url=settings.redis_url,
        **{**walk_fields(settings), **governor_fields(settings, rate), **extra},
    )


def account_scope(args: argparse.Namespace, settings: Settings) -> AccountScope:
    """The :class:`AccountScope` that ``--account`` names (the default one without it).

    Raises:
        ConfigError: ``--account`` without a suppliers file, or an unknown account.
    """
    code = getattr(args, "account", None)
    if code is None:
        return DEFAULT_SCOPE
    if settings.suppliers_file is None:
        raise ConfigError(
            f"--account {code}: no suppliers file (set SUPPLIER_SYNC_SUPPLIERS_FILE to a "
            "suppliers.yaml)"
        )
    return AccountScope(find_account(load_accounts(settings.suppliers_file), code))


def full_task_scopes() -> list[tuple[str, AccountScope]]:
    """(full-sync task, account scope) of every account: the commands that judge tasks
    (metrics, alerts) mean these unless told ``--task``."""
    return [(scope.full_task_code, scope) for scope in account_scopes()]


def account_supplier_now(settings: Settings, scope: AccountScope, **overrides: Any) -> Any:
    """The account's supplier resource for a command run now: its API key read from the
    variable the file names (a run in Dagster reads it through ``dg.EnvVar`` instead).

    Raises:
        ConfigError: The file names a key variable that is not set.
    """
    account = scope.account
    assert account is not None  # an account's scope
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
