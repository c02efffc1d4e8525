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
from collections.abc import Callable
from typing import Any

import uvicorn

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
from supplier_sync_dagster.defs.accounts import account_scopes
from supplier_sync_dagster.defs.resources import SupplierResource, supplier_resource
from supplier_sync_dagster.serve.api import create_app


def cmd_serve_api(args: argparse.Namespace) -> int:
    """``serve-api``: the read API under uvicorn until interrupted."""
    settings = load_settings()
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
            client = stack.enter_context(
                supplier_resource(
                    base_url=settings.supplier_url,
                    api_key=settings.api_key(),
                    redis_url=settings.redis_url,
                    **timeouts,
                ).client()
            )
            confirming: Callable[[int], Any] = lambda _supplier_id: client  # noqa: E731
        else:
            clients = {
                sid: stack.enter_context(resource.client())
                for sid, resource in _confirming_accounts(settings, timeouts).items()
            }
            confirming = clients.get
        app = create_app(
            db=db, search=search, cache=cache, supplier=confirming, ttl_seconds=args.ttl
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


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
