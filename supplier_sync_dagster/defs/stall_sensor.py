"""Stall detection: shards whose heartbeat is fresh but whose checkpoint stopped (sooner
while the walk waits for the supplier: longer than its request deadlines allow), and shards
whose lease expired (their worker died)."""

from __future__ import annotations

import json

import dagster as dg

from supplier_sync_dagster.core.leasing.leases import FETCH_STALL_SECONDS, find_stalls
from supplier_sync_dagster.defs.resources import SyncDatabaseResource

CHECKPOINT_STALL_SECONDS = 600.0


@dg.sensor(
    name="shard_stall_sensor",
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description=(
        "Alerts on RUNNING shards whose heartbeat is fresh but whose checkpoint has not moved "
        f"for {CHECKPOINT_STALL_SECONDS:.0f} s ({FETCH_STALL_SECONDS:.0f} s while waiting for the "
        "supplier's next page), and on shards whose lease expired. A stall is reported once "
        "(the cursor remembers it) until its checkpoint moves again."
    ),
)
def shard_stall_sensor(
    context: dg.SensorEvaluationContext, sync_db: SyncDatabaseResource
) -> dg.SkipReason:
    """Reports new stalls in the sensor log and its skip reason; requests no runs."""
    with sync_db.opened() as db:
        stalls = find_stalls(
            db,
            checkpoint_stall_seconds=CHECKPOINT_STALL_SECONDS,
            fetch_stall_seconds=FETCH_STALL_SECONDS,
        )
    seen = set(json.loads(context.cursor)) if context.cursor else set()
    current = {f"{s.kind}|{s.batch_id}|{s.shard_key}|{s.last_checkpoint_at}" for s in stalls}
    new = [
        s
        for s in stalls
        if f"{s.kind}|{s.batch_id}|{s.shard_key}|{s.last_checkpoint_at}" not in seen
    ]
    for s in new:
        context.log.warning(
            f"{s.kind}: batch {s.batch_id} city {s.shard_key!r} worker {s.worker_id}: no "
            f"checkpoint for {s.seconds_since_checkpoint:.0f} s (heartbeat {s.heartbeat_at}, "
            f"lease until {s.lease_until}, last message {s.message!r})"
        )
    context.update_cursor(json.dumps(sorted(current)))
    if not stalls:
        return dg.SkipReason("no stalled shards")
    kinds = ", ".join(f"{s.kind} {s.shard_key!r}" for s in stalls[:10])
    return dg.SkipReason(f"{len(stalls)} stalled shards ({len(new)} new): {kinds}")
