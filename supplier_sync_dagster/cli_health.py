"""The ``supplier-sync metrics`` commands (sync health, shown or served to Prometheus);
registered by :mod:`supplier_sync_dagster.cli`."""

from __future__ import annotations

import argparse
import json
import signal
import threading
from typing import Any


def cmd_metrics(args: argparse.Namespace) -> int:
    """``metrics show|serve``."""
    from supplier_sync_dagster.core.db import SyncDatabase
    from supplier_sync_dagster.core.metrics import sync_health
    from supplier_sync_dagster.core.settings import DEFAULT_TASK_CODE

    tasks = args.task or [DEFAULT_TASK_CODE]
    db = SyncDatabase.open(args.db_url)
    try:
        if args.metrics_command == "show":
            for task in tasks:
                health = sync_health(db, task_code=task)
                if args.json:
                    print(json.dumps(health.to_json(), sort_keys=True, default=str))
                    continue
                print(f"task {task} at {health.at:%Y-%m-%d %H:%M:%S} UTC")
                for key, value in health.values().items():
                    print(f"  {key:<36} {value:g}")
            return 0
        from supplier_sync_dagster.metrics_server import serve

        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(
            f"metrics on http://{args.host}:{args.port}/metrics for {', '.join(tasks)}, "
            f"refreshed every {args.interval:g} s",
            flush=True,
        )
        serve(db, tasks, port=args.port, host=args.host, interval=args.interval, stop=stop)
        return 0
    finally:
        db.dispose()


def add_commands(sub: Any) -> None:
    """Registers ``metrics`` on the ``supplier-sync`` subparsers."""
    metrics = sub.add_parser("metrics", help="sync health: show it, or serve it to Prometheus")
    metrics_sub = metrics.add_subparsers(dest="metrics_command", required=True)
    show = metrics_sub.add_parser("show", help="every figure of each task, now")
    show.add_argument("--task", action="append", help="a task (repeat; default the full sync)")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_metrics)
    serve = metrics_sub.add_parser(
        "serve",
        help="/metrics in Prometheus' text format, from figures refreshed in the background",
    )
    serve.add_argument("--port", type=int, default=9464)
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument(
        "--interval", type=float, default=30.0, help="seconds between refreshes of the figures"
    )
    serve.add_argument("--task", action="append", help="a task (repeat; default the full sync)")
    serve.set_defaults(func=cmd_metrics)
