"""Alert conditions the simulator cannot provoke cheaply, judged from rows as the sync writes
them (an emptied city, an open circuit breaker, reconciliation differences), and the episode
rules: once while it holds, resolved once, a new episode when it comes back (SQLite and
MariaDB). The end-to-end proof over HTTP is ``integration/test_alerts.py``."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

from supplier_sync_dagster.core.health import alerts
from supplier_sync_dagster.core.health.metrics import sync_health
from supplier_sync_dagster.core.leasing.batches import fail_unstarted
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.core.conftest import MakeBatch


def _finish(db: SyncDatabase, batch_id: str, batch_status: str, **shard: object) -> None:
    b, sh = schema.batch.c, schema.shard.c
    with db.begin() as conn:
        conn.execute(
            sa.update(schema.shard)
            .where(sh.batch_id == batch_id)
            .values(finished_at=db.clock.now(), updated_at=db.clock.now(), **shard)
        )
        conn.execute(
            sa.update(schema.batch)
            .where(b.batch_id == batch_id)
            .values(status=batch_status, started_at=db.clock.now(-60), finished_at=db.clock.now())
        )


def _profile(db: SyncDatabase, batch_id: str, task: str, city: str, records: int) -> None:
    with db.begin() as conn:
        conn.execute(
            sa.insert(schema.city_profile).values(
                batch_id=batch_id,
                task_code=task,
                shard_key=city,
                record_count=records,
                bad_count=0,
                created_at=db.clock.now(),
                updated_at=db.clock.now(),
            )
        )


def test_an_emptied_city_and_an_open_breaker_fire_once_and_clear(
    db: SyncDatabase, make_batch: MakeBatch, tmp_path: Path
):
    channel = alerts.FileChannel(tmp_path / "alerts.jsonl")
    first = make_batch(["BKK", "CNX"])
    task = first.task_code
    _profile(db, first.batch_id, task, "BKK", 40)
    _profile(db, first.batch_id, task, "CNX", 12)
    _finish(db, first.batch_id, "SUCCESS", status="SUCCESS")
    assert alerts.check(db, channel, task_code=task).findings == []

    second = make_batch(["BKK", "CNX"], task_code=task)
    _profile(db, second.batch_id, task, "BKK", 41)
    _profile(db, second.batch_id, task, "CNX", 0)  # the supplier's listing came back empty
    _finish(db, second.batch_id, "SUCCESS", status="SUCCESS")
    done = alerts.check(db, channel, task_code=task)
    assert [(f.condition, f.subject) for f in done.findings] == [("city_emptied", "CNX")]
    assert "had 12 hotels" in done.findings[0].message
    assert len(done.changes.fired) == 1 and done.delivered.sent == 1
    again = alerts.check(db, channel, task_code=task)
    assert again.changes.fired == [] and again.delivered.sent == 0  # it holds: once

    # The next night the breaker refuses the supplier's calls: every city fails with it.
    third = make_batch(["BKK", "CNX"], task_code=task)
    alerts.set_thresholds(db, task, {"breaker_open_minutes": 0}, actor="ops", reason="test")
    _finish(
        db,
        third.batch_id,
        "FAILED",
        status="FAILED",
        error_message="CircuitOpen: circuit breaker for supplier-1001 is open",
    )
    done = alerts.check(db, channel, task_code=task)
    assert [f.condition for f in done.findings] == ["breaker_open"]
    assert len(done.changes.fired) == 1 and len(done.changes.resolved) == 1  # CNX's cleared
    fourth = make_batch(["BKK", "CNX"], task_code=task)
    _profile(db, fourth.batch_id, task, "BKK", 41)
    _profile(db, fourth.batch_id, task, "CNX", 13)
    _finish(db, fourth.batch_id, "SUCCESS", status="SUCCESS")
    cleared = alerts.check(db, channel, task_code=task)
    assert cleared.findings == []
    with db.engine.connect() as conn:
        rows = alerts.list_alerts(conn, db.clock)
    assert {(r["condition_name"], r["status"]) for r in rows} >= {
        ("city_emptied", "RESOLVED"),
        ("breaker_open", "RESOLVED"),
    }
    lines = (tmp_path / "alerts.jsonl").read_text().splitlines()
    kinds = [line.split('"kind": "')[1].split('"')[0] for line in lines]
    assert kinds.count("FIRING") == kinds.count("RESOLVED") == len(rows)


def test_reconciliation_differences_come_from_the_context_and_an_episode_can_return(
    db: SyncDatabase, make_batch: MakeBatch, tmp_path: Path
):
    channel = alerts.FileChannel(tmp_path / "alerts.jsonl")
    task = make_batch(["BKK"]).task_code
    ctx = alerts.Context(reconciliation_remaining=2)
    health = sync_health(db, task_code=task)
    found = alerts.evaluate(db, health, context=ctx)
    # Its one city never synced: stale too. Judge the reconciliation alone here.
    assert {f.condition for f in found} == {"reconciliation_diff", "freshness_sla"}
    found = [f for f in found if f.condition == "reconciliation_diff"]
    first = alerts.record(db, task, found)
    assert len(first.fired) == 1
    assert alerts.record(db, task, []).resolved == first.fired
    back = alerts.record(db, task, found)  # it comes back: a new episode, a new message
    assert len(back.fired) == 1 and back.fired != first.fired
    assert alerts.deliver(db, channel).sent == 3


def test_a_refused_key_and_an_unreachable_supplier_alert_at_once_and_clear(
    db: SyncDatabase, make_batch: MakeBatch, tmp_path: Path
):
    channel = alerts.FileChannel(tmp_path / "alerts.jsonl")
    first = make_batch(["BKK", "CNX"])
    task = first.task_code

    def conditions() -> list[str]:
        done = alerts.check(db, channel, task_code=task)
        return sorted(f.condition for f in done.findings if f.condition.startswith("supplier_"))

    # A run that could not start: its batch failed before it had cities.
    fail_unstarted(db, first.batch_id, "SUPPLIER_AUTH_REJECTED: GET /v1/cities -> 401")
    done = alerts.check(db, channel, task_code=task)
    refused = [f for f in done.findings if f.condition == "supplier_auth_rejected"]
    assert len(refused) == 1 and "before it read the city list" not in refused[0].message
    assert "2 cities not synced" in refused[0].message and "-> 401" in refused[0].message

    # Later the key works; one city fails for another reason: no supplier alert.
    second = make_batch(["BKK", "CNX"], task_code=task)
    _finish(db, second.batch_id, "PARTIAL_FAILED", status="SUCCESS")
    with db.begin() as conn:
        conn.execute(
            sa.update(schema.shard)
            .where(schema.shard.c.batch_id == second.batch_id, schema.shard.c.shard_key == "CNX")
            .values(status="FAILED", error_message="INTERNAL_ERROR: RecursionError: too deep")
        )
    assert conditions() == []

    # Down: every city of the next batch could not connect.
    third = make_batch(["BKK", "CNX"], task_code=task)
    _finish(
        db,
        third.batch_id,
        "FAILED",
        status="FAILED",
        error_message="CONNECTION_REFUSED: circuit breaker for supplier-1001 is open since 5 "
        "failures in a row, last: CONNECTION_REFUSED GET /v1/cities/BKK/hotels",
    )
    assert conditions() == ["supplier_unreachable"]
    # A single city that could not connect while others synced is not "unreachable".
    fourth = make_batch(["BKK", "CNX"], task_code=task)
    _finish(db, fourth.batch_id, "PARTIAL_FAILED", status="SUCCESS")
    with db.begin() as conn:
        conn.execute(
            sa.update(schema.shard)
            .where(schema.shard.c.batch_id == fourth.batch_id, schema.shard.c.shard_key == "CNX")
            .values(status="FAILED", error_message="CONNECTION_REFUSED: GET ...: refused")
        )
    assert conditions() == []
    with db.engine.connect() as conn:
        rows = alerts.list_alerts(conn, db.clock)
    assert {(r["condition_name"], r["status"]) for r in rows} >= {
        ("supplier_auth_rejected", "RESOLVED"),
        ("supplier_unreachable", "RESOLVED"),
    }
