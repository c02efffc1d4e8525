"""Tasks and batches: trigger idempotency, concurrency policies, disabled and unknown tasks."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core import schema as t
from supplier_sync_dagster.core.batches import (
    TaskSpec,
    add_shards,
    cancel_batch,
    create_batch,
    get_batch,
    get_task,
    list_batches,
    set_task_status,
    upsert_task,
)
from supplier_sync_dagster.core.db import SyncDatabase
from supplier_sync_dagster.core.errors import (
    ConfigError,
    InvalidTransition,
    LeaseLost,
    TaskDisabled,
    UnknownBatch,
    UnknownTask,
)
from supplier_sync_dagster.core.leases import LeaseSettings, claim_shard, list_shards
from supplier_sync_dagster_tests.core.conftest import HOSTILE_CODES, run_concurrently

FAST = LeaseSettings(lease_seconds=30, heartbeat_seconds=1)


def _task(db: SyncDatabase, policy: str = "SKIP_IF_RUNNING", **kw: object) -> str:
    code = f"task_{uuid.uuid4().hex[:10]}"
    upsert_task(db, TaskSpec(task_code=code, supplier_id=1001, concurrency_policy=policy, **kw))  # type: ignore[arg-type]
    return code


def _count(db: SyncDatabase, table: sa.Table) -> int:
    with db.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def test_same_trigger_returns_the_same_batch(db: SyncDatabase):
    code = _task(db)
    first = create_batch(
        db, task_code=code, trigger_id="req-1", trigger_source="MANUAL", shard_keys=["BKK", "SIN"]
    )
    again = create_batch(
        db, task_code=code, trigger_id="req-1", trigger_source="MANUAL", shard_keys=["BKK", "SIN"]
    )
    assert first.outcome == "CREATED" and again.outcome == "EXISTING"
    assert first.batch is not None and again.batch is not None
    assert first.batch.batch_id == again.batch.batch_id
    assert first.batch.status == "PENDING" and first.batch.shard_count == 2
    assert _count(db, t.batch) == 1 and _count(db, t.shard) == 2
    with db.engine.connect() as conn:
        assert get_task(conn, code).task_code == code


def test_concurrent_callers_with_one_trigger_get_one_batch(db: SyncDatabase):
    code = _task(db, policy="ALLOW_PARALLEL")
    n = 8
    for round_ in range(10):
        trigger = f"fire-{round_}"
        decisions, errors = run_concurrently(
            n,
            lambda _i, trig=trigger: create_batch(  # type: ignore[misc]
                db, task_code=code, trigger_id=trig, trigger_source="CRON", shard_keys=[trig]
            ),
        )
        assert not errors, errors
        ids = {d.batch.batch_id for d in decisions if d.batch is not None}
        assert len(ids) == 1, decisions
        assert sorted(d.outcome for d in decisions) == ["CREATED"] + ["EXISTING"] * (n - 1)
    assert _count(db, t.batch) == 10


def test_skip_if_running_records_the_skip_and_is_idempotent(db: SyncDatabase):
    code = _task(db, policy="SKIP_IF_RUNNING")
    running = create_batch(db, task_code=code, trigger_id="t1", trigger_source="CRON")
    assert running.batch is not None
    skipped = create_batch(db, task_code=code, trigger_id="t2", trigger_source="CRON")
    assert skipped.outcome == "SKIPPED" and skipped.batch is None
    assert skipped.blocking_batch_id == running.batch.batch_id
    assert "SKIP_IF_RUNNING" in skipped.reason
    with db.engine.connect() as conn:
        log = conn.execute(sa.select(t.trigger_log).where(t.trigger_log.c.trigger_id == "t2")).one()
    assert log.outcome == "SKIPPED" and log.blocking_batch_id == running.batch.batch_id
    # The same skipped trigger gets the same answer, even after the blocker finished.
    cancel_batch(db, running.batch.batch_id, "done for the test")
    assert (
        create_batch(db, task_code=code, trigger_id="t2", trigger_source="CRON").outcome
        == "SKIPPED"
    )
    assert (
        create_batch(db, task_code=code, trigger_id="t3", trigger_source="CRON").outcome
        == "CREATED"
    )
    assert _count(db, t.batch) == 2


def test_concurrent_distinct_triggers_under_skip_if_running_create_one_batch(db: SyncDatabase):
    code = _task(db, policy="SKIP_IF_RUNNING")
    n = 8
    decisions, errors = run_concurrently(
        n,
        lambda i: create_batch(db, task_code=code, trigger_id=f"op-{i}", trigger_source="MANUAL"),
    )
    assert not errors, errors
    assert sorted(d.outcome for d in decisions) == ["CREATED"] + ["SKIPPED"] * (n - 1)
    assert _count(db, t.batch) == 1


def test_cancel_previous_cancels_old_batch_and_its_workers_lose_the_lease(db: SyncDatabase):
    code = _task(db, policy="CANCEL_PREVIOUS")
    old = create_batch(
        db, task_code=code, trigger_id="t1", trigger_source="CRON", shard_keys=["BKK"]
    )
    assert old.batch is not None
    lease = claim_shard(db, old.batch.batch_id, "BKK", worker_id="w-old", settings=FAST)
    new = create_batch(
        db, task_code=code, trigger_id="t2", trigger_source="CRON", shard_keys=["BKK"]
    )
    assert new.outcome == "CREATED" and new.cancelled_batch_ids == (old.batch.batch_id,)
    with db.engine.connect() as conn:
        assert get_batch(conn, old.batch.batch_id).status == "CANCELLED"
        assert get_task(conn, code).task_code == code
    assert [s.status for s in list_shards(db, old.batch.batch_id)] == ["CANCELLED"]
    with pytest.raises(LeaseLost):
        lease.heartbeat()
    assert new.batch is not None
    claim_shard(db, new.batch.batch_id, "BKK", worker_id="w-new", settings=FAST).finish("SUCCESS")


def test_allow_parallel_only_when_scopes_do_not_overlap(db: SyncDatabase):
    code = _task(db, policy="ALLOW_PARALLEL")
    a = create_batch(
        db, task_code=code, trigger_id="a", trigger_source="MANUAL", shard_keys=["BKK", "SIN"]
    )
    b = create_batch(
        db, task_code=code, trigger_id="b", trigger_source="MANUAL", shard_keys=["JKT"]
    )
    c = create_batch(
        db, task_code=code, trigger_id="c", trigger_source="MANUAL", shard_keys=["SIN", "HKG"]
    )
    d = create_batch(db, task_code=code, trigger_id="d", trigger_source="MANUAL")  # every city
    assert (a.outcome, b.outcome) == ("CREATED", "CREATED")
    assert (
        c.outcome == "SKIPPED" and a.batch is not None and c.blocking_batch_id == a.batch.batch_id
    )
    assert d.outcome == "SKIPPED"
    # Another task of a different data scope does not overlap with RESOURCE batches.
    other = _task(db, policy="ALLOW_PARALLEL", data_scope="STOCK_PRICE")
    assert (
        create_batch(db, task_code=other, trigger_id="e", trigger_source="MANUAL").outcome
        == "CREATED"
    )
    # Another task of the same scope does.
    same = _task(db, policy="ALLOW_PARALLEL")
    f = create_batch(
        db, task_code=same, trigger_id="f", trigger_source="MANUAL", shard_keys=["BKK"]
    )
    assert f.outcome == "SKIPPED"


def test_disabled_and_unknown_tasks_are_refused_without_writing(db: SyncDatabase):
    code = _task(db)
    set_task_status(db, code, "DISABLED")
    with pytest.raises(TaskDisabled, match=code):
        create_batch(db, task_code=code, trigger_id="t", trigger_source="MANUAL")
    with pytest.raises(UnknownTask, match="no_such_task"):
        create_batch(db, task_code="no_such_task", trigger_id="t", trigger_source="MANUAL")
    with pytest.raises(UnknownTask):
        set_task_status(db, "no_such_task", "ENABLED")
    assert _count(db, t.batch) == 0 and _count(db, t.trigger_log) == 0
    set_task_status(db, code, "ENABLED")
    assert (
        create_batch(db, task_code=code, trigger_id="t", trigger_source="MANUAL").outcome
        == "CREATED"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"trigger_id": "", "trigger_source": "MANUAL"},
        {"trigger_id": "x" * 65, "trigger_source": "MANUAL"},
        {"trigger_id": "ok", "trigger_source": "NONSENSE"},
        {"trigger_id": "ok", "trigger_source": "MANUAL", "shard_keys": "BKK"},
        {"trigger_id": "ok", "trigger_source": "MANUAL", "shard_keys": ["x" * 129]},
    ],
)
def test_malformed_trigger_is_a_clear_error(db: SyncDatabase, kwargs: dict[str, object]):
    code = _task(db)
    with pytest.raises(ConfigError):
        create_batch(db, task_code=code, **kwargs)  # type: ignore[arg-type]
    assert _count(db, t.batch) == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"supplier_id": 0},
        {"sync_mode": "SOMETIMES"},
        {"concurrency_policy": "YOLO"},
        {"schedule_type": "CRON"},
        {"task_code": ""},
    ],
)
def test_malformed_task_spec(bad: dict[str, object]):
    spec = {"task_code": "t", "supplier_id": 1} | bad
    with pytest.raises(ConfigError):
        TaskSpec(**spec)  # type: ignore[arg-type]


def test_hostile_codes_as_task_trigger_and_shards_round_trip(db: SyncDatabase):
    for i, code in enumerate(HOSTILE_CODES):
        upsert_task(db, TaskSpec(task_code=code, supplier_id=1001 + i))
        decision = create_batch(
            db,
            task_code=code,
            trigger_id=code,
            trigger_source="MANUAL",
            shard_keys=list(HOSTILE_CODES),
        )
        assert decision.batch is not None
        assert decision.batch.task_code == code and decision.batch.trigger_id == code
        assert decision.batch.city_scope == HOSTILE_CODES
        again = create_batch(db, task_code=code, trigger_id=code, trigger_source="MANUAL")
        assert again.batch is not None and again.batch.batch_id == decision.batch.batch_id
    assert _count(db, t.task) == len(HOSTILE_CODES)
    assert _count(db, t.batch) == len(HOSTILE_CODES)


def test_add_shards_is_idempotent_reopens_finished_and_refused_on_cancelled(db: SyncDatabase):
    code = _task(db)
    batch = create_batch(db, task_code=code, trigger_id="t", trigger_source="BACKFILL").batch
    assert batch is not None and batch.city_scope is None
    assert add_shards(db, batch.batch_id, ["BKK", "SIN"]) == 2
    assert add_shards(db, batch.batch_id, ["SIN", "JKT"]) == 3
    for key in ("BKK", "SIN", "JKT"):
        claim_shard(db, batch.batch_id, key, worker_id="w", settings=FAST).finish("SUCCESS")
    with db.engine.connect() as conn:
        assert get_batch(conn, batch.batch_id).status == "SUCCESS"
    assert add_shards(db, batch.batch_id, ["HKG"]) == 4  # the backfill's next run arrives
    with db.engine.connect() as conn:
        again = get_batch(conn, batch.batch_id)
    assert again.status == "RUNNING" and again.finished_at is None
    cancel_batch(db, batch.batch_id, "test")
    with pytest.raises(InvalidTransition, match="CANCELLED"):
        add_shards(db, batch.batch_id, ["HKG"])
    with pytest.raises(InvalidTransition):
        cancel_batch(db, batch.batch_id, "again")
    with pytest.raises(UnknownBatch):
        add_shards(db, "b_missing", ["HKG"])


def test_batch_versions_increase_per_task_and_list_newest_first(db: SyncDatabase):
    code = _task(db, policy="CANCEL_PREVIOUS")
    ids = []
    for i in range(3):
        d = create_batch(db, task_code=code, trigger_id=f"t{i}", trigger_source="CRON")
        assert d.batch is not None
        ids.append((d.batch.batch_id, d.batch.sync_batch_version))
    assert [v for _, v in ids] == [1, 2, 3]
    assert [b.batch_id for b in list_batches(db, task_code=code)] == [i for i, _ in reversed(ids)]
