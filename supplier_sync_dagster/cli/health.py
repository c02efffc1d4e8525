"""The ``supplier-sync metrics`` commands (sync health, shown or served to Prometheus);
registered by :mod:`supplier_sync_dagster.cli.main`."""

from __future__ import annotations

import argparse
import json
import signal
import threading
from typing import Any


def cmd_metrics(args: argparse.Namespace) -> int:
    """``metrics show|serve``."""
    from supplier_sync_dagster.cli.accounts import full_task_scopes
    from supplier_sync_dagster.core.health.metrics import sync_health
    from supplier_sync_dagster.core.store.db import SyncDatabase

    tasks = args.task or [task for task, _ in full_task_scopes()]
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
        from supplier_sync_dagster.serve.metrics import serve

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


def cmd_alerts(args: argparse.Namespace) -> int:
    """``alerts list|check|thresholds``."""
    from supplier_sync_dagster.cli.accounts import full_task_scopes
    from supplier_sync_dagster.core.errors import ConfigError
    from supplier_sync_dagster.core.health import alerts
    from supplier_sync_dagster.core.settings import load_settings
    from supplier_sync_dagster.core.store.db import SyncDatabase

    db = SyncDatabase.open(args.db_url)
    try:
        if args.alerts_command == "list":
            with db.engine.connect() as conn:
                rows = alerts.list_alerts(
                    conn, db.clock, days=args.days, include_resolved=not args.open
                )
            for row in rows:
                if args.json:
                    print(json.dumps(row, sort_keys=True, default=str))
                    continue
                sent = ",".join(f"{d['kind']}:{d['status']}" for d in row["deliveries"])
                print(
                    f"{row['id']:>6} {row['status']:<9} {row['condition_name']:<27} "
                    f"{row['task_code']} {row['subject'] or '-'}  since {row['started_at']}"
                    f"{'  until ' + str(row['resolved_at']) if row['resolved_at'] else ''}  "
                    f"[{sent}]  {row['message']}"
                )
            return 0
        judged = full_task_scopes()
        if args.task:
            judged = [(args.task, next((sc for t, sc in judged if t == args.task), None))]
        if args.alerts_command == "thresholds":
            if len(judged) != 1:
                raise ConfigError(
                    "alerts thresholds: name the task with --task (one of "
                    f"{', '.join(t for t, _ in judged)})"
                )
            task = judged[0][0]
            values: dict[str, float] = {}
            for item in args.set or []:
                name, sep, raw = item.partition("=")
                try:
                    values[name.strip()] = float(raw)
                except ValueError:
                    raise ConfigError(f"--set {item!r}: expected NAME=NUMBER") from None
                if not sep:
                    raise ConfigError(f"--set {item!r}: expected NAME=NUMBER")
            if values:
                current = alerts.set_thresholds(
                    db, task, values, actor=args.by or "", reason=args.reason or ""
                )
            else:
                with db.engine.connect() as conn:
                    current = alerts.thresholds(conn, task)
            print(
                json.dumps(current, sort_keys=True)
                if args.json
                else "\n".join(f"{k:<32} {v:g}" for k, v in sorted(current.items()))
            )
            return 0
        from supplier_sync_dagster.dagster_instance.home import dagster_instance
        from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE
        from supplier_sync_dagster.defs.health import RECONCILIATION, alert_context

        settings = load_settings()
        channel = alerts.open_channel(settings.alert_url, settings.state_dir)
        for task, scope in judged:
            # The instance the CLI's runs are in: the failed run's link and the
            # reconciliation's remaining differences, as the alert sensor reads them.
            with dagster_instance() as instance:
                context = alert_context(
                    instance,
                    db,
                    task,
                    reconciliation=(scope or DEFAULT_SCOPE).key(RECONCILIATION.path[-1]),
                )
            done = alerts.check(
                db,
                channel,
                task_code=task,
                context=context,
                dagster_url=settings.dagster_url or "http://localhost:3000",
            )
            holding = [f.condition + (f"/{f.subject}" if f.subject else "") for f in done.findings]
            summary = {
                "task": task,
                "holding": holding,
                "fired": done.changes.fired,
                "resolved": done.changes.resolved,
                "sent": done.delivered.sent,
                "failed_deliveries": done.delivered.failed,
            }
            print(
                json.dumps(summary, sort_keys=True)
                if args.json
                else (
                    f"{task}: {len(done.findings)} conditions hold ({', '.join(holding) or 'none'}); "
                    f"{len(done.changes.fired)} alerts started, {len(done.changes.resolved)} "
                    f"cleared; {done.delivered.sent} messages sent, {done.delivered.failed} to retry"
                )
            )
        return 0
    finally:
        db.dispose()


def add_commands(sub: Any) -> None:
    """Registers ``metrics`` and ``alerts`` on the ``supplier-sync`` subparsers."""
    metrics = sub.add_parser("metrics", help="sync health: show it, or serve it to Prometheus")
    metrics_sub = metrics.add_subparsers(dest="metrics_command", required=True)
    show = metrics_sub.add_parser("show", help="every figure of each task, now")
    show.add_argument(
        "--task", action="append", help="a task (repeat; default every account's full sync)"
    )
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
    serve.add_argument(
        "--task", action="append", help="a task (repeat; default every account's full sync)"
    )
    serve.set_defaults(func=cmd_metrics)

    al = sub.add_parser("alerts", help="alerts: list them, check the conditions now, thresholds")
    al_sub = al.add_subparsers(dest="alerts_command", required=True)
    listing = al_sub.add_parser("list", help="open alerts and those of the last days")
    listing.add_argument("--days", type=float, default=7.0)
    listing.add_argument("--open", action="store_true", help="only the open ones")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_alerts)
    check = al_sub.add_parser(
        "check",
        help="judge the conditions now, start or clear alerts and send what is due "
        "(what the alert sensor does each minute)",
    )
    check.add_argument("--task", default=None, help="the task (default every account's full sync)")
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=cmd_alerts)
    th = al_sub.add_parser("thresholds", help="show or set a task's alert thresholds (audited)")
    th.add_argument("--task", default=None, help="the task (default the full sync)")
    th.add_argument("--set", action="append", metavar="NAME=NUMBER", help="repeat to set several")
    th.add_argument("--by", default=None, help="who (recorded; needed with --set)")
    th.add_argument("--reason", default=None, help="why (recorded; needed with --set)")
    th.add_argument("--json", action="store_true")
    th.set_defaults(func=cmd_alerts)
