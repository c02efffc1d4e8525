"""What ``metrics`` and ``alerts`` do: sync health shown or served to Prometheus, alerts
listed, judged and their thresholds set. Their arguments:
:mod:`supplier_sync_dagster.cli.parsers.health`."""

from __future__ import annotations

import argparse
import json
import signal
import threading

from supplier_sync_dagster.cli.common import open_db, warn
from supplier_sync_dagster.cli.resources import full_task_scopes
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.health import alerts
from supplier_sync_dagster.core.health.metrics import sync_health
from supplier_sync_dagster.core.leasing.batches import get_task
from supplier_sync_dagster.core.settings import load_settings
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.dagster_instance.home import dagster_instance
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE, AccountScope
from supplier_sync_dagster.defs.health import RECONCILIATION, alert_context
from supplier_sync_dagster.serve.metrics import loopback_only, serve


def cmd_metrics(args: argparse.Namespace) -> int:
    """``metrics show|serve``."""
    tasks = args.task or [task for task, _ in full_task_scopes()]
    with open_db(args.db_url) as db:
        if args.task:
            require_tasks(db, args.task)
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
        if not loopback_only(args.host, args.port):
            warn(
                f"warning: /metrics on {args.host}:{args.port} is unauthenticated and reachable "
                "beyond this machine; listen on 127.0.0.1 (the default) behind a proxy that "
                "authenticates (deploy/nginx/supplier-sync.conf)"
            )
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


def cmd_alerts(args: argparse.Namespace) -> int:
    """``alerts list|check|thresholds``."""
    with open_db(args.db_url) as db:
        if args.alerts_command == "list":
            _list_alerts(db, args)
            return 0
        judged: list[tuple[str, AccountScope | None]] = list(full_task_scopes())
        if args.task:
            judged = [(args.task, next((sc for t, sc in judged if t == args.task), None))]
        if args.alerts_command == "thresholds":
            _alert_thresholds(db, args, [task for task, _ in judged])
            return 0
        _check_alerts(db, args, judged)
        return 0


def require_tasks(db: SyncDatabase, tasks: list[str]) -> None:
    """Stops a command told ``--task`` of a task the database does not hold: its figures
    would be those of nothing, and look healthy.

    Raises:
        UnknownTask: A task of ``tasks`` is not in the database.
    """
    with db.engine.connect() as conn:
        for task in dict.fromkeys(tasks):
            get_task(conn, task)


def _list_alerts(db: SyncDatabase, args: argparse.Namespace) -> None:
    with db.engine.connect() as conn:
        rows = alerts.list_alerts(conn, db.clock, days=args.days, include_resolved=not args.open)
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


def _alert_thresholds(db: SyncDatabase, args: argparse.Namespace, tasks: list[str]) -> None:
    if len(tasks) != 1:
        raise ConfigError(
            f"alerts thresholds: name the task with --task (one of {', '.join(tasks)})"
        )
    task = tasks[0]
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


def _check_alerts(
    db: SyncDatabase, args: argparse.Namespace, judged: list[tuple[str, AccountScope | None]]
) -> None:
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
