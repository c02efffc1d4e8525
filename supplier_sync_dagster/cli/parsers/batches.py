"""The arguments of ``export``, ``status`` and ``stalls`` (handlers:
:mod:`supplier_sync_dagster.cli.batches`)."""

from __future__ import annotations

from supplier_sync_dagster.cli.common import Subcommands, duration, handled_by, positive_int

_BATCHES = "supplier_sync_dagster.cli.batches"


def add_export(sub: Subcommands) -> None:
    """Registers ``export``."""
    export = sub.add_parser("export", help="JSON lines of published hotels, dead letters or diffs")
    export.add_argument("what", choices=["published", "dead-letters", "diffs"])
    export.add_argument("--format", choices=["jsonl"], default="jsonl")
    export.add_argument("--batch", default=None, help="only this batch (dead letters, diffs)")
    handled_by(export, f"{_BATCHES}:cmd_export", read_only=True)


def add_status_and_stalls(sub: Subcommands) -> None:
    """Registers ``status`` and ``stalls``."""
    status = sub.add_parser("status", help="batches with their progress (and shards with --batch)")
    status.add_argument("--batch", default=None, help="show this batch and its shards")
    status.add_argument("--task", default=None, help="only this task's batches")
    status.add_argument("--limit", type=positive_int, default=10)
    handled_by(status, f"{_BATCHES}:cmd_status", read_only=True)

    stalls = sub.add_parser("stalls", help="running shards that are stuck or whose lease expired")
    stalls.add_argument("--checkpoint-stall-seconds", type=duration(), default=600.0)
    stalls.add_argument(
        "--fetch-stall-seconds",
        type=duration(),
        default=None,
        help="a shard waiting for the supplier's next page this long is stalled (default: two "
        "request deadlines of the supplier client, 120)",
    )
    handled_by(stalls, f"{_BATCHES}:cmd_stalls", read_only=True)
