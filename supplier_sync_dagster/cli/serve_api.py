"""What ``serve-api`` does: the read API (search, cached hotels, offer confirmation against
the supplier) under uvicorn until interrupted. A module of its own: it imports the web
server and the supplier resources, which the other outbox commands
(:mod:`supplier_sync_dagster.cli.outbox`) do without. Its arguments:
:mod:`supplier_sync_dagster.cli.parsers.outbox`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn

from supplier_sync_dagster.cli.common import warn
from supplier_sync_dagster.cli.outbox import projection_settings
from supplier_sync_dagster.cli.resources import account_supplier_now
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.outbox.projections import (
    InProcessHotelCache,
    RedisHotelCache,
    open_search_index,
)
from supplier_sync_dagster.core.settings import Settings, load_settings
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.supplier import SupplierClient, make_share_limiter
from supplier_sync_dagster.defs.accounts import account_scopes
from supplier_sync_dagster.defs.resources import SupplierResource, supplier_resource
from supplier_sync_dagster.serve.api import CONFIRM_MAX_WAIT_SECONDS, CONFIRM_SHARE, create_app
from supplier_sync_dagster.serve.metrics import loopback_only


def cmd_serve_api(args: argparse.Namespace) -> int:
    """``serve-api``: the read API under uvicorn until interrupted."""
    settings = load_settings()
    keys = api_keys_to_serve(settings, host=args.host, port=args.port, no_auth=args.no_auth)
    projection = projection_settings()
    with contextlib.ExitStack() as stack:
        db = SyncDatabase.open(args.db_url)
        stack.callback(db.dispose)
        search = open_search_index(projection)
        stack.callback(search.close)
        cache = RedisHotelCache(settings.redis_url) if settings.redis_url else InProcessHotelCache()
        stack.callback(cache.close)
        timeouts = {
            "read_timeout": args.confirm_timeout,
            "connect_timeout": min(args.confirm_timeout, 2.0),
        }
        if settings.suppliers_file is None:
            rate = {"rate_limit_rps": settings.supplier_rate_limit}
            resource = supplier_resource(
                base_url=settings.supplier_url,
                api_key=settings.api_key(),
                redis_url=settings.redis_url,
                **(rate if settings.supplier_rate_limit else {}),
                **timeouts,
            )
            client = confirm_client(stack, resource, settings)
            confirm: Callable[[int], Any] = lambda _supplier_id: client  # noqa: E731
        else:
            clients = {
                sid: confirm_client(stack, resource, settings)
                for sid, resource in _confirming_accounts(settings, timeouts).items()
            }
            confirm = clients.get
        app = create_app(
            db=db, search=search, cache=cache, api_keys=keys, supplier=confirm, ttl_seconds=args.ttl
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def api_keys_to_serve(
    settings: Settings, *, host: str, port: int, no_auth: bool
) -> Sequence[str] | None:
    """The keys the API asks for (``SUPPLIER_SYNC_API_KEYS``), or None with ``--no-auth``.

    Raises:
        ConfigError: No key and no ``--no-auth``; ``--no-auth`` with keys set, or on a host
            that reaches beyond loopback (or is no address).
    """
    keys = settings.read_api_keys()
    if not no_auth:
        if not keys:
            raise ConfigError(
                "no API key: set SUPPLIER_SYNC_API_KEYS (comma-separated keys that clients send "
                "as 'Authorization: Bearer <key>' or 'X-Api-Key: <key>'), or pass --no-auth "
                "to serve loopback only, without authentication"
            )
        return keys
    if keys:
        raise ConfigError("--no-auth, but SUPPLIER_SYNC_API_KEYS is set: drop one of them")
    if not loopback_only(host, port):
        raise ConfigError(
            f"--no-auth serves a loopback --host only (127.0.0.1, ::1, localhost), not {host!r}"
        )
    warn(f"warning: serve-api --no-auth: every route is open to whoever can reach {host}")
    return None


def confirm_client(
    stack: contextlib.ExitStack, resource: SupplierResource, settings: Settings
) -> SupplierClient:
    """The client that confirms offers of ``resource``'s account for the duration of
    ``stack``, paced by the confirmations' own share (``confirm_rate_limit``, else
    :data:`CONFIRM_SHARE` of the account's rate) beside the syncs' bucket, never from it: a
    flood of confirmations spends its share, then is answered 429."""
    rate = settings.confirm_rate_limit or resource.rate_limit_rps * CONFIRM_SHARE
    scope = f"{resource.supplier_id}/{resource.account}" if resource.account else None
    limiter = make_share_limiter(
        "confirm",
        max_wait=CONFIRM_MAX_WAIT_SECONDS,
        redis_url=resource.redis_url,
        supplier_id=scope or str(resource.supplier_id),
        api_key=getattr(resource, "api_key", None) or "",
        rate=rate,
        burst=max(1.0, rate),
    )
    client: SupplierClient = stack.enter_context(resource.client(rate_limiter=limiter))
    return client


def _confirming_accounts(
    settings: Settings, timeouts: dict[str, float]
) -> dict[int, SupplierResource]:
    """Supplier id -> the supplier resource that confirms its offers: its first account in
    the suppliers file whose API key is set here (a supplier with none is answered 503)."""
    chosen: dict[int, SupplierResource] = {}
    for scope in account_scopes():
        assert scope.account is not None  # a suppliers file names every account
        sid = scope.account.supplier_id
        if sid in chosen:
            continue
        try:
            chosen[sid] = account_supplier_now(settings, scope, **timeouts)
        except ConfigError as err:  # its key is not set in this process: try the next one
            print(f"supplier-sync: serve-api: {err}", file=sys.stderr)
    return chosen
