"""The arguments of ``metrics`` and ``alerts`` (handlers:
:mod:`supplier_sync_dagster.cli.health`)."""

from __future__ import annotations

from supplier_sync_dagster.cli.common import (
    Subcommands,
    add_json_flag,
    float_within,
    handled_by,
    int_within,
)

_HEALTH = "supplier_sync_dagster.cli.health"
_TASKS = "a task (repeat; default every account's full sync)"


def add_commands(sub: Subcommands) -> None:
    """Registers ``metrics show|serve`` and ``alerts list|check|thresholds``."""
    metrics = sub.add_parser("metrics", help="sync health: show it, or serve it to Prometheus")
    metrics_sub = metrics.add_subparsers(dest="metrics_command", required=True)
    show = metrics_sub.add_parser("show", help="every figure of each task, now")
    show.add_argument("--task", action="append", help=_TASKS)
    add_json_flag(show)
    handled_by(show, f"{_HEALTH}:cmd_metrics", read_only=True)
    serve = metrics_sub.add_parser(
        "serve",
        help="/metrics in Prometheus' text format, from figures refreshed in the background",
    )
    serve.add_argument("--port", type=int_within(0, 65535), default=9464)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default loopback: /metrics is unauthenticated; "
        "another address is warned about)",
    )
    serve.add_argument(
        "--interval",
        type=float_within(0, None, low_open=True),
        default=30.0,
        help="seconds between refreshes of the figures",
    )
    serve.add_argument("--task", action="append", help=_TASKS)
    handled_by(serve, f"{_HEALTH}:cmd_metrics")

    al = sub.add_parser("alerts", help="alerts: list them, check the conditions now, thresholds")
    al_sub = al.add_subparsers(dest="alerts_command", required=True)
    listing = al_sub.add_parser("list", help="open alerts and those of the last days")
    listing.add_argument("--days", type=float_within(0, None, low_open=True), default=7.0)
    listing.add_argument("--open", action="store_true", help="only the open ones")
    add_json_flag(listing)
    handled_by(listing, f"{_HEALTH}:cmd_alerts", read_only=True)
    check = al_sub.add_parser(
        "check",
        help="judge the conditions now, start or clear alerts and send what is due "
        "(what the alert sensor does each minute)",
    )
    check.add_argument("--task", default=None, help="the task (default every account's full sync)")
    add_json_flag(check)
    handled_by(check, f"{_HEALTH}:cmd_alerts")
    th = al_sub.add_parser("thresholds", help="show or set a task's alert thresholds (audited)")
    th.add_argument("--task", default=None, help="the task (default the full sync)")
    th.add_argument("--set", action="append", metavar="NAME=NUMBER", help="repeat to set several")
    th.add_argument("--by", default=None, help="who (recorded; needed with --set)")
    th.add_argument("--reason", default=None, help="why (recorded; needed with --set)")
    add_json_flag(th)
    handled_by(th, f"{_HEALTH}:cmd_alerts")
