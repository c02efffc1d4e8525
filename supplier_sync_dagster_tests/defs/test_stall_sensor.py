"""The stall sensor reports stuck shards once, against a real sync database."""

from __future__ import annotations

import dagster as dg

from supplier_sync_dagster.core.leasing.batches import TaskSpec, create_batch, upsert_task
from supplier_sync_dagster.core.leasing.leases import (
    Checkpoint,
    LeaseSettings,
    PageCounts,
    claim_shard,
)
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.defs import stall_sensor as mod
from supplier_sync_dagster.defs.resources import SyncDatabaseResource


def _message(result: object) -> str:
    assert isinstance(result, dg.SkipReason)
    assert result.skip_message is not None
    return result.skip_message


def test_stall_sensor_reports_new_stalls_once(db_url: str, monkeypatch):
    db = SyncDatabase.open(db_url)
    upsert_task(db, TaskSpec(task_code="t", supplier_id=1))
    batch = create_batch(
        db, task_code="t", trigger_id="r", trigger_source="MANUAL", shard_keys=["SLOW", "DEAD"]
    ).batch
    assert batch is not None
    settings = LeaseSettings(lease_seconds=300, heartbeat_seconds=10)
    slow = claim_shard(db, batch.batch_id, "SLOW", worker_id="w1", settings=settings)
    claim_shard(db, batch.batch_id, "DEAD", worker_id="w2", settings=settings)
    slow.advance(Checkpoint("SLOW", page=2), PageCounts(success=1))
    # The sensor opens the database itself: shift the clock seam it will use, by the
    # stall threshold, with the SLOW worker's heartbeat kept fresh meanwhile.
    original_open = SyncDatabase.open

    def shifted_open(url=None, **kw):
        opened = original_open(url, **kw)
        opened.clock.advance(mod.CHECKPOINT_STALL_SECONDS + 60)
        return opened

    db.clock.advance(mod.CHECKPOINT_STALL_SECONDS + 59)
    slow.heartbeat("FETCHING", "supplier is slow")
    monkeypatch.setattr(SyncDatabase, "open", staticmethod(shifted_open))
    resource = SyncDatabaseResource(db_url=db_url)

    ctx = dg.build_sensor_context(resources={"sync_db": resource})
    message = _message(mod.shard_stall_sensor(ctx))
    assert "2 stalled shards (2 new)" in message
    assert "CHECKPOINT_STALLED 'SLOW'" in message
    assert "LEASE_EXPIRED 'DEAD'" in message

    again = mod.shard_stall_sensor(
        dg.build_sensor_context(resources={"sync_db": resource}, cursor=ctx.cursor)
    )
    assert "(0 new)" in _message(again)
    db.dispose()


def test_stall_sensor_quiet_when_nothing_is_stuck(db_url: str):
    SyncDatabase.open(db_url).dispose()
    ctx = dg.build_sensor_context(resources={"sync_db": SyncDatabaseResource(db_url=db_url)})
    assert _message(mod.shard_stall_sensor(ctx)) == "no stalled shards"
