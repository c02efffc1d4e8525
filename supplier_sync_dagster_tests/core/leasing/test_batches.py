"""Tasks and batches: trigger idempotency, concurrency policies, disabled and unknown tasks."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import (
    ConfigError,
    InvalidTransition,
    LeaseLost,
    TaskDisabled,
    UnknownBatch,
    UnknownTask,
)
from supplier_sync_dagster.core.leasing.batches import (
    TaskSpec,
    add_shards,
    batch_for_trigger,
    batch_liveness,
    cancel_batch,
    create_batch,
    end_grace,
    fail_unstarted,
    get_batch,
    get_task,
    list_batches,
    set_task_status,
    upsert_task,
)
from supplier_sync_dagster.core.leasing.leases import (
    Checkpoint,
    LeaseSettings,
    PageCounts,
    claim_shard,
    get_shard,
    list_shards,
)
from supplier_sync_dagster.core.leasing.processes import make_worker_id
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.core.conftest import run_concurrently
from supplier_sync_dagster_tests.helpers import HOSTILE_CITY_CODES

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
    assert _count(db, schema.batch) == 1 and _count(db, schema.shard) == 2
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
    assert _count(db, schema.batch) == 10


def test_skip_if_running_records_the_skip_and_is_idempotent(db: SyncDatabase):
    code = _task(db, policy="SKIP_IF_RUNNING")
    running = create_batch(db, task_code=code, trigger_id="t1", trigger_source="CRON")
    assert running.batch is not None
    skipped = create_batch(db, task_code=code, trigger_id="t2", trigger_source="CRON")
    assert skipped.outcome == "SKIPPED" and skipped.batch is None
    assert skipped.blocking_batch_id == running.batch.batch_id
    assert "SKIP_IF_RUNNING" in skipped.reason
    with db.engine.connect() as conn:
        log = conn.execute(
            sa.select(schema.trigger_log).where(schema.trigger_log.c.trigger_id == "t2")
        ).one()
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
    assert _count(db, schema.batch) == 2


def test_concurrent_distinct_triggers_under_skip_if_running_create_one_batch(db: SyncDatabase):
    code = _task(db, policy="SKIP_IF_RUNNING")
    n = 8
    decisions, errors = run_concurrently(
        n,
        lambda i: create_batch(db, task_code=code, trigger_id=f"op-{i}", trigger_source="MANUAL"),
    )
    assert not errors, errors
    assert sorted(d.outcome for d in decisions) == ["CREATED"] + ["SKIPPED"] * (n - 1)
    assert _count(db, schema.batch) == 1


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
    assert _count(db, schema.batch) == 0 and _count(db, schema.trigger_log) == 0
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
    assert _count(db, schema.batch) == 0


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
    for i, code in enumerate(HOSTILE_CITY_CODES):
        upsert_task(db, TaskSpec(task_code=code, supplier_id=1001 + i))
        decision = create_batch(
            db,
            task_code=code,
            trigger_id=code,
            trigger_source="MANUAL",
            shard_keys=list(HOSTILE_CITY_CODES),
        )
        assert decision.batch is not None
        assert decision.batch.task_code == code and decision.batch.trigger_id == code
        assert decision.batch.city_scope == HOSTILE_CITY_CODES
        again = create_batch(db, task_code=code, trigger_id=code, trigger_source="MANUAL")
        assert again.batch is not None and again.batch.batch_id == decision.batch.batch_id
    assert _count(db, schema.task) == len(HOSTILE_CITY_CODES)
    assert _count(db, schema.batch) == len(HOSTILE_CITY_CODES)


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


# A worker on another host: never presumed dead, so only its lease's expiry frees what it holds.
REMOTE = "supplier-sync-some-other-host-77-20260101T000000Z"


class LocalProcess:
    """A real process of this host, whose worker id leases can name; kill() makes it dead."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        self.worker_id = (
            make_worker_id("run").rsplit("-", 2)[0] + f"-{self.proc.pid}-20260101T000000Z"
        )

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def local_process() -> Iterator[LocalProcess]:
    proc = LocalProcess()
    yield proc
    proc.kill()


def _log_row(db: SyncDatabase, code: str, trigger: str) -> sa.Row[tuple[object, ...]]:
    with db.engine.connect() as conn:
        return conn.execute(
            sa.select(schema.trigger_log).where(
                schema.trigger_log.c.task_code == code, schema.trigger_log.c.trigger_id == trigger
            )
        ).one()


def test_a_batch_whose_leases_expired_is_adopted_and_resumes_from_its_checkpoints(
    db: SyncDatabase,
):
    code = _task(db)
    first = create_batch(
        db,
        task_code=code,
        trigger_id="night-1",
        trigger_source="CRON",
        shard_keys=["BKK", "SIN"],
        worker_id=REMOTE,
        lease_seconds=30,
    )
    assert first.batch is not None
    batch_id = first.batch.batch_id
    lease = claim_shard(db, batch_id, "BKK", worker_id=REMOTE, settings=FAST)
    lease.advance(Checkpoint("BKK", page=3), PageCounts(success=2))
    # The worker is somewhere else and its lease runs: the batch runs, night-2 is skipped.
    skipped = create_batch(db, task_code=code, trigger_id="night-2", trigger_source="CRON")
    assert skipped.outcome == "SKIPPED" and skipped.blocking_batch_id == batch_id
    assert "leased to " + REMOTE in skipped.reason
    # Its lease and the creator's grace run out (no heartbeat): the batch is abandoned.
    db.clock.advance(FAST.lease_seconds + 1)
    with db.engine.connect() as conn:
        state = batch_liveness(conn, db.clock, batch_id)
    assert not state.live and "abandoned" in state.reason
    adopted = create_batch(
        db, task_code=code, trigger_id="night-3", trigger_source="CRON", shard_keys=["JKT"]
    )
    assert adopted.outcome == "ADOPTED" and adopted.batch is not None
    assert adopted.batch.batch_id == batch_id and adopted.batch.trigger_id == "night-1"
    assert adopted.batch.city_scope == ("BKK", "SIN", "JKT")
    log = _log_row(db, code, "night-3")
    assert (log.outcome, log.batch_id) == ("ADOPTED", batch_id)
    assert "abandoned" in str(log.reason) and "night-1" in str(log.reason)
    # The same trigger asked again gets the same batch; the earlier skip stays a skip.
    again = create_batch(db, task_code=code, trigger_id="night-3", trigger_source="CRON")
    assert again.outcome == "EXISTING" and again.batch is not None
    assert again.batch.batch_id == batch_id
    assert create_batch(
        db, task_code=code, trigger_id="night-2", trigger_source="CRON"
    ).outcome == ("SKIPPED")
    with db.engine.connect() as conn:
        found = batch_for_trigger(conn, code, "night-3")
        assert found is not None and found.batch_id == batch_id
        assert batch_for_trigger(conn, code, "night-2") is None
    # The adopter (this process, alive) holds the grace now: a fourth trigger waits.
    fourth = create_batch(db, task_code=code, trigger_id="night-4", trigger_source="CRON")
    assert fourth.outcome == "SKIPPED" and "within its grace" in fourth.reason
    # Its workers continue each city where it stood: BKK from page 3, the others from 1.
    resumed = claim_shard(db, batch_id, "BKK", worker_id="w-adopter", settings=FAST)
    assert resumed.checkpoint == Checkpoint("BKK", page=3) and resumed.claim_count == 2
    assert get_shard(db, batch_id, "BKK").success_count == 2
    for key in ("SIN", "JKT"):
        assert (
            claim_shard(db, batch_id, key, worker_id="w-adopter", settings=FAST).checkpoint is None
        )
    assert _count(db, schema.batch) == 1


def test_a_run_killed_in_its_first_seconds_is_adopted_at_once(
    db: SyncDatabase, local_process: LocalProcess
):
    code = _task(db)
    first = create_batch(
        db,
        task_code=code,
        trigger_id="night-1",
        trigger_source="CRON",
        worker_id=local_process.worker_id,
    )
    assert first.batch is not None
    # Its creator lives and is within its grace (no shard claimed yet): a run starting up.
    waiting = create_batch(db, task_code=code, trigger_id="night-2", trigger_source="CRON")
    assert waiting.outcome == "SKIPPED" and local_process.worker_id in waiting.reason
    local_process.kill()
    # Killed before any city: no need to wait for the grace, its creator is provably dead.
    adopted = create_batch(db, task_code=code, trigger_id="night-3", trigger_source="CRON")
    assert adopted.outcome == "ADOPTED" and adopted.batch is not None
    assert adopted.batch.batch_id == first.batch.batch_id
    assert "creator " + local_process.worker_id + " is dead" in adopted.reason


def test_live_leases_of_a_dead_local_process_do_not_keep_a_batch_running(
    db: SyncDatabase, local_process: LocalProcess
):
    code = _task(db)
    first = create_batch(
        db,
        task_code=code,
        trigger_id="t1",
        trigger_source="MANUAL",
        shard_keys=["BKK", "SIN"],
        worker_id=local_process.worker_id,
    )
    assert first.batch is not None
    batch_id = first.batch.batch_id
    for key in ("BKK", "SIN"):
        claim_shard(db, batch_id, key, worker_id=local_process.worker_id, settings=FAST)
    assert create_batch(db, task_code=code, trigger_id="t2", trigger_source="MANUAL").outcome == (
        "SKIPPED"
    )
    local_process.kill()
    # Both leases and the grace still run by the clock, but their holder is dead here.
    adopted = create_batch(db, task_code=code, trigger_id="t3", trigger_source="MANUAL")
    assert adopted.outcome == "ADOPTED" and adopted.batch is not None
    assert adopted.batch.batch_id == batch_id
    assert "2 unexpired shard lease(s) of dead processes" in adopted.reason
    # The adopter's worker takes the cities over at once (the dead-holder shortcut).
    taken = claim_shard(db, batch_id, "BKK", worker_id=make_worker_id(), settings=FAST)
    assert taken.claim_count == 2


def test_concurrent_triggers_on_an_abandoned_batch_adopt_it_once(db: SyncDatabase):
    code = _task(db)
    first = create_batch(
        db,
        task_code=code,
        trigger_id="t0",
        trigger_source="CRON",
        worker_id=REMOTE,
        lease_seconds=30,
    )
    assert first.batch is not None
    db.clock.advance(31)
    n = 8
    decisions, errors = run_concurrently(
        n,
        lambda i: create_batch(db, task_code=code, trigger_id=f"op-{i}", trigger_source="MANUAL"),
    )
    assert not errors, errors
    assert sorted(d.outcome for d in decisions) == ["ADOPTED"] + ["SKIPPED"] * (n - 1)
    assert {d.blocking_batch_id for d in decisions if d.outcome == "SKIPPED"} == {
        first.batch.batch_id
    }
    assert _count(db, schema.batch) == 1


def test_other_policies_keep_their_meaning_with_abandoned_batches(db: SyncDatabase):
    cancel = _task(db, policy="CANCEL_PREVIOUS")
    old = create_batch(
        db,
        task_code=cancel,
        trigger_id="a",
        trigger_source="CRON",
        worker_id=REMOTE,
        lease_seconds=30,
    )
    assert old.batch is not None
    parallel = _task(db, policy="ALLOW_PARALLEL", data_scope="STOCK_PRICE")
    stale = create_batch(
        db,
        task_code=parallel,
        trigger_id="p1",
        trigger_source="CRON",
        shard_keys=["BKK"],
        worker_id=REMOTE,
        lease_seconds=30,
    )
    assert stale.batch is not None
    # While they live, an overlapping parallel trigger is skipped.
    assert (
        create_batch(
            db, task_code=parallel, trigger_id="p2", trigger_source="CRON", shard_keys=["BKK"]
        ).outcome
        == "SKIPPED"
    )
    db.clock.advance(31)
    # CANCEL_PREVIOUS cancels the abandoned batch and creates its own, as before.
    new = create_batch(db, task_code=cancel, trigger_id="b", trigger_source="CRON")
    assert new.outcome == "CREATED" and new.cancelled_batch_ids == (old.batch.batch_id,)
    # ALLOW_PARALLEL: an abandoned batch no longer blocks an overlapping one; not adopted.
    fresh = create_batch(
        db, task_code=parallel, trigger_id="p3", trigger_source="CRON", shard_keys=["BKK"]
    )
    assert fresh.outcome == "CREATED" and fresh.batch is not None
    assert fresh.batch.batch_id != stale.batch.batch_id


def test_a_batch_from_before_the_grace_existed_is_abandoned_without_leases(db: SyncDatabase):
    code = _task(db)
    first = create_batch(db, task_code=code, trigger_id="t1", trigger_source="CRON")
    assert first.batch is not None
    with db.begin() as conn:  # as stored before this version: no creator, no grace
        conn.execute(
            sa.update(schema.batch)
            .where(schema.batch.c.batch_id == first.batch.batch_id)
            .values(worker_id=None, lease_until=None)
        )
    adopted = create_batch(db, task_code=code, trigger_id="t2", trigger_source="CRON")
    assert adopted.outcome == "ADOPTED" and "no grace" in adopted.reason


def test_a_replay_batch_never_adopts_and_is_not_blocked_by_an_abandoned_batch(db: SyncDatabase):
    code = _task(db)
    sync = create_batch(
        db,
        task_code=code,
        trigger_id="night-1",
        trigger_source="CRON",
        worker_id=REMOTE,
        lease_seconds=30,
    )
    assert sync.batch is not None
    db.clock.advance(31)
    replay = create_batch(
        db, task_code=code, trigger_id="replay:r1", trigger_source="COMPENSATION", adopt=False
    )
    assert replay.outcome == "CREATED" and replay.batch is not None
    assert replay.batch.batch_id != sync.batch.batch_id


def test_a_run_that_could_not_start_fails_its_cities_not_started_and_its_batch(
    db: SyncDatabase,
):
    """The supplier refused the key before any city started: the run's PENDING cities are
    FAILED with the cause (no claim), a city another worker holds or finished stays as it
    is, and the batch is FAILED with the cause; the next trigger is not blocked."""
    code = _task(db)
    decision = create_batch(
        db, task_code=code, trigger_id="night-1", trigger_source="CRON", shard_keys=["A", "B", "C"]
    )
    assert decision.batch is not None
    batch_id = decision.batch.batch_id
    held = claim_shard(db, batch_id, "C", worker_id="w-other", settings=FAST)
    error = "SUPPLIER_AUTH_REJECTED: GET /v1/cities -> 401"
    assert fail_unstarted(db, batch_id, error, shard_keys=["A", "C"]) == ["A"]
    assert fail_unstarted(db, batch_id, error, shard_keys=["A"]) == []  # once
    shards = {s.shard_key: s for s in list_shards(db, batch_id)}
    assert shards["A"].status == "FAILED" and shards["A"].error_message == error
    assert shards["A"].claim_count == 0
    assert (shards["B"].status, shards["C"].status) == ("PENDING", "RUNNING")
    held.finish("SUCCESS")
    assert fail_unstarted(db, batch_id, error) == ["B"]  # every city not started
    with db.engine.connect() as conn:
        batch = get_batch(conn, batch_id)
    assert (batch.status, batch.error_message) == ("PARTIAL_FAILED", error)

    # A batch whose city list could not be read has no shard: it fails itself.
    empty = create_batch(db, task_code=code, trigger_id="night-2", trigger_source="CRON")
    assert empty.batch is not None
    assert fail_unstarted(db, empty.batch.batch_id, error) == []
    with db.engine.connect() as conn:
        failed = get_batch(conn, empty.batch.batch_id)
    assert failed.status == "FAILED" and failed.finished_at is not None
    assert failed.error_message == error
    after = create_batch(db, task_code=code, trigger_id="night-3", trigger_source="CRON")
    assert after.outcome == "CREATED"

    # Resumed with a key that works (the same trigger): the batch runs again, its old
    # error gone.
    add_shards(db, empty.batch.batch_id, ["A"])
    with db.engine.connect() as conn:
        resumed = get_batch(conn, empty.batch.batch_id)
    assert resumed.status == "PENDING" and resumed.error_message is None


def test_a_stopped_runs_grace_ends_so_the_next_trigger_adopts_its_batch_at_once(
    db: SyncDatabase,
):
    code = _task(db)
    me = make_worker_id()
    first = create_batch(
        db, task_code=code, trigger_id="night-1", trigger_source="CRON", shard_keys=["A"]
    )
    assert first.batch is not None
    # This process is alive and its grace runs: another trigger is skipped.
    skipped = create_batch(db, task_code=code, trigger_id="night-2", trigger_source="CRON")
    assert skipped.outcome == "SKIPPED"
    assert not end_grace(db, first.batch.batch_id, "someone-else-1-x")  # only the creator's
    assert end_grace(db, first.batch.batch_id, me)
    assert not end_grace(db, first.batch.batch_id, me)  # once
    adopted = create_batch(db, task_code=code, trigger_id="night-3", trigger_source="CRON")
    assert adopted.outcome == "ADOPTED" and adopted.batch is not None
    assert adopted.batch.batch_id == first.batch.batch_id
