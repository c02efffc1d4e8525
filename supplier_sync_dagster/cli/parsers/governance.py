"""The arguments of ``review``, ``gate`` and ``task`` (handlers:
:mod:`supplier_sync_dagster.cli.governance`)."""

from __future__ import annotations

import argparse
import dataclasses

from supplier_sync_dagster.cli.common import (
    Subcommands,
    add_json_flag,
    add_who_and_why,
    handled_by,
    non_negative_int,
    positive_int,
)
from supplier_sync_dagster.core.records.gates import CHECK_NAMES, GateThresholds
from supplier_sync_dagster.core.settings import DEFAULT_TASK_CODE

_GOVERNANCE = "supplier_sync_dagster.cli.governance"


def add_threshold_options(parser: argparse.ArgumentParser) -> None:
    """One option per gate threshold (``--max-bad-ratio``...), each unset by default; the
    core checks each one's range, a whole number's bounds are checked here first."""
    for f in dataclasses.fields(GateThresholds):
        kind = non_negative_int if isinstance(f.default, int) else float
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None)


def add_review(sub: Subcommands) -> None:
    """Registers ``review list|approve|reject``."""
    review = sub.add_parser("review", help="diffs held for review: list, approve, reject")
    review_sub = review.add_subparsers(dest="review_command", required=True)
    rlist = review_sub.add_parser("list", help="reviews (PENDING by default)")
    rlist.add_argument(
        "--status",
        default="PENDING",
        choices=["PENDING", "APPROVED", "REJECTED", "SUPERSEDED", "ALL"],
    )
    rlist.add_argument("--batch", default=None)
    rlist.add_argument("--limit", type=positive_int, default=100)
    add_json_flag(rlist)
    handled_by(rlist, f"{_GOVERNANCE}:cmd_review", read_only=True)
    for name, what in (
        ("approve", "publish them (version-guarded)"),
        ("reject", "keep what is live"),
    ):
        decide = review_sub.add_parser(name, help=f"{name} reviews: {what}")
        decide.add_argument("ids", nargs="*", help="review ids")
        decide.add_argument("--all", action="store_true", help="every PENDING review (of --batch)")
        decide.add_argument("--batch", default=None)
        add_who_and_why(decide, who="who decides (recorded)")
        handled_by(decide, f"{_GOVERNANCE}:cmd_review")


def add_gate(sub: Subcommands) -> None:
    """Registers ``gate show|override|thresholds``."""
    gate = sub.add_parser("gate", help="batch quality gates: show, override, thresholds")
    gate_sub = gate.add_subparsers(dest="gate_command", required=True)
    show = gate_sub.add_parser("show", help="a city's gate results in a batch")
    show.add_argument("--batch", required=True)
    show.add_argument("--city", required=True, help="the supplier's city code, verbatim")
    handled_by(show, f"{_GOVERNANCE}:cmd_gate", read_only=True)
    override = gate_sub.add_parser("override", help="let a city pass a failed check (recorded)")
    override.add_argument("--batch", required=True)
    override.add_argument("--city", required=True, help="the supplier's city code, verbatim")
    override.add_argument("--check", required=True, choices=CHECK_NAMES)
    add_who_and_why(override, who="who overrides (recorded)")
    handled_by(override, f"{_GOVERNANCE}:cmd_gate")
    thresholds = gate_sub.add_parser(
        "thresholds", help="show or set a task's gate thresholds (audited)"
    )
    thresholds.add_argument("--task", default=DEFAULT_TASK_CODE)
    add_threshold_options(thresholds)
    thresholds.add_argument(
        "--by", default=None, help="who changes them (recorded; needed with a threshold)"
    )
    thresholds.add_argument(
        "--reason", default=None, help="why (recorded; needed with a threshold)"
    )
    handled_by(thresholds, f"{_GOVERNANCE}:cmd_gate")


def add_task(sub: Subcommands) -> None:
    """Registers ``task show|set``."""
    task = sub.add_parser(
        "task",
        help="a sync task's settings: show them, or set them (audited; runs never change them)",
    )
    task_sub = task.add_subparsers(dest="task_command", required=True)
    task_show = task_sub.add_parser("show", help="the settings, gate thresholds and change log")
    task_set = task_sub.add_parser(
        "set", help="change policy, status, cron or gate thresholds (recorded with who and why)"
    )
    for p in (task_show, task_set):
        p.add_argument("--task", default=DEFAULT_TASK_CODE, help="the task code")
        handled_by(p, f"{_GOVERNANCE}:cmd_task", read_only=p is task_show)
    task_show.add_argument(
        "--history", type=non_negative_int, default=10, help="change-log rows to show"
    )
    add_json_flag(task_show)
    task_set.add_argument(
        "--policy", choices=["SKIP_IF_RUNNING", "CANCEL_PREVIOUS", "ALLOW_PARALLEL"], default=None
    )
    task_set.add_argument("--status", choices=["ENABLED", "DISABLED"], default=None)
    task_set.add_argument(
        "--cron", default=None, help="a cron expression ('0 2 * * *', @daily), or none to clear"
    )
    add_threshold_options(task_set)
    add_who_and_why(task_set, who="who changes it (recorded)")
