"""What ``status``, ``stalls`` and ``export`` do: the sync database's batches, shards and
published data, read without Dagster. Their arguments:
:mod:`supplier_sync_dagster.cli.parsers.batches`."""

from __future__ import annotations

import argparse
import sys

from supplier_sync_dagster.cli.common import open_db
from supplier_sync_dagster.core.leasing.batches import get_batch, list_batches, rate_and_eta
from supplier_sync_dagster.core.leasing.leases import FETCH_STALL_SECONDS, find_stalls, list_shards
from supplier_sync_dagster.core.repair.export import export_jsonl
from supplier_sync_dagster.core.store.db import SyncDatabase


def cmd_export(args: argparse.Namespace) -> int:
    """``export``: JSON lines of published hotels, dead letters or diffs on stdout."""
    with open_db(args.db_url) as db:
        n = export_jsonl(db, args.what, sys.stdout, batch_id=args.batch)
    print(f"exported {n} {args.what}", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``status``: batches with their progress (and a batch's shards with ``--batch``)."""
    with open_db(args.db_url) as db:
        return _print_status(db, args)


def _print_status(db: SyncDatabase, args: argparse.Namespace) -> int:
    if args.batch:
        with db.engine.connect() as conn:
            batches = [get_batch(conn, args.batch)]
    else:
        batches = list_batches(db, task_code=args.task, limit=args.limit)
    if not batches:
        print("no batches")
        return 0
    with db.engine.connect() as conn:
        now = db.clock.read(conn)
    for b in batches:
        print(
            f"{b.batch_id}  {b.task_code}  {b.status:<14} {b.shards_done}/{b.shard_count} cities  "
            f"{b.progress_percent}%  pages={b.pages_done} hotels={b.fetched_count}  "
            f"total={b.total_count} ok={b.success_count} failed={b.failed_count} "
            f"skipped={b.skipped_count}  {rate_and_eta(b, now)}  "
            f"current={b.current_city_code!r} page={b.current_page}  heartbeat={b.heartbeat_at}"
        )
        if args.batch:
            for s in list_shards(db, b.batch_id):
                print(
                    f"    {s.shard_key!r:<30} {s.status:<9} pages={s.pages_done}/{s.total_pages} "
                    f"total={s.total_count} claims={s.claim_count} worker={s.worker_id} "
                    f"stage={s.last_heartbeat_stage}"
                )
    return 0


def cmd_stalls(args: argparse.Namespace) -> int:
    """``stalls``: running shards that are stuck or whose lease expired."""
    with open_db(args.db_url) as db:
        stalls = find_stalls(
            db,
            checkpoint_stall_seconds=args.checkpoint_stall_seconds,
            fetch_stall_seconds=args.fetch_stall_seconds or FETCH_STALL_SECONDS,
        )
    for s in stalls:
        print(
            f"{s.kind:<19} batch={s.batch_id} city={s.shard_key!r} worker={s.worker_id} "
            f"since_checkpoint={s.seconds_since_checkpoint:.0f}s heartbeat={s.heartbeat_at}"
        )
    if not stalls:
        print("no stalled shards")
    return 0
