"""Dead letters through Dagster: the compensation asset and its schedule, the summary asset,
and the operator-action jobs run with their launchpad config (SQLite and MariaDB)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import (
    TaskSpec,
    cancel_batch,
    create_batch,
    upsert_task,
)
from supplier_sync_dagster.core.records.deadletters import (
    DeadLetter,
    record_city_failure,
    record_dead_letters,
)
from supplier_sync_dagster.core.settings import DEFAULT_TASK_CODE
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import list_audit
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.defs.city_sync import city_sync
from supplier_sync_dagster.defs.dead_letters import (
    dead_letter_city_resync_sensor,
    dead_letter_compensation,
    dead_letter_compensation_schedule,
    dead_letter_summary,
)
from supplier_sync_dagster.defs.operator_actions import (
    dead_letter_fix_job,
    dead_letter_ignore_job,
    dead_letter_retry_job,
    gate_override_job,
    outbox_retry_job,
    review_approve_job,
    task_settings_job,
)
from supplier_sync_dagster.defs.partitions import decode_city_key, encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SimulatedSupplierResource,
    SyncDatabaseResource,
)
from supplier_sync_dagster.defs.triggers import TRIGGER_TAG
from supplier_sync_dagster_tests.defs.test_reconciliation import repository


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def _supplier(**extra: Any) -> SimulatedSupplierResource:
    settings: dict[str, Any] = {
        "sim_cities": 3,
        "sim_hotels": 200,
        "sim_profile": "clean",
        "rate_limit_rps": 10_000,
        **extra,
    }
    return SimulatedSupplierResource(**settings)


def _resources(db_url: str, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "sync_db": SyncDatabaseResource(db_url=db_url),
        "payloads": PayloadStoreResource(url=f"file://{tmp_path}/payloads"),
        "supplier": _supplier(**extra),
        "governance": GovernanceResource(),
    }


def _metadata(result: dg.ExecuteInJobResult) -> dict[str, Any]:
    """The metadata of the run's unpartitioned materialization (compensation also reports
    each city it published in, on that city's partition of published_hotels)."""
    (m,) = [
        e.step_materialization_data.materialization
        for e in result.get_asset_materialization_events()
        if e.step_materialization_data.materialization.partition is None
    ]
    return {k: v.value for k, v in m.metadata.items()}


def _cities_reported(result: dg.ExecuteInJobResult) -> dict[str, int]:
    return {
        str(m.metadata["city"].value): int(m.metadata["published"].value)
        for m in (
            e.step_materialization_data.materialization
            for e in result.get_asset_materialization_events()
        )
        if m.partition is not None and m.asset_key == dg.AssetKey("published_hotels")
    }


def _hotels(n: int) -> list[str]:
    with _supplier().client() as client:
        city = client.list_cities().data.cities[0].city_code
        page = client.get_hotels_page(city, page_size=n)
    return [str(h["hotel_id"]) for h in page.data.hotels[:n]]


def _retryable(db: SyncDatabase, hotels: list[str], *, due: bool = True) -> None:
    with db.begin() as conn:
        record_dead_letters(
            conn,
            db.clock,
            batch_id="b-outage",
            task_code=DEFAULT_TASK_CODE,
            sync_mode="FULL",
            supplier_id=1001,
            letters=[
                DeadLetter(h, "ADAPTER", "RETRYABLE", "SUPPLIER_UNAVAILABLE", "503", None, None)
                for h in hotels
            ],
        )
        if due:
            conn.execute(sa.update(schema.dead_letter).values(next_retry_at=db.clock.now(-1)))


def test_the_schedule_asks_for_compensation_only_when_a_row_is_due_and_the_asset_heals_it(
    db_url: str, tmp_path: Path, instance: dg.DagsterInstance
):
    db = SyncDatabase.open(db_url)
    sync_db = SyncDatabaseResource(db_url=db_url)
    when = datetime(2026, 12, 2, 3, 5, tzinfo=UTC)

    def tick() -> Any:
        # Entered: a context left open stays the current instance after this test.
        with dg.build_schedule_context(
            instance=instance, scheduled_execution_time=when, resources={"sync_db": sync_db}
        ) as ctx:
            return dead_letter_compensation_schedule(ctx)

    try:
        assert isinstance(tick(), dg.SkipReason)
        hotels = _hotels(5)
        _retryable(db, hotels)
        request = tick()
        assert isinstance(request, dg.RunRequest)
        assert request.tags[TRIGGER_TAG] == "compensate:2026-12-02T03:05:00+00:00"

        result = dg.materialize(
            [dead_letter_compensation],
            instance=instance,
            resources=_resources(db_url, tmp_path),
            tags=request.tags,
        )
        assert result.success
        meta = _metadata(result)
        assert (meta["claimed"], meta["resolved"], meta["batch_status"]) == (5, 5, "SUCCESS")
        assert meta["supplier_requests"] == 5
        # The city it published in, on that city's partition (as a full sync reports it).
        assert sum(_cities_reported(result).values()) == 5
        h = schema.platform_hotel.c
        with db.engine.connect() as conn:
            published = set(conn.execute(sa.select(h.supplier_hotel_id)).scalars())
        assert published == set(hotels)
        assert isinstance(tick(), dg.SkipReason)
    finally:
        db.dispose()


def test_the_summary_asset_counts_and_plots_the_fix_rate(
    db_url: str, tmp_path: Path, instance: dg.DagsterInstance
):
    db = SyncDatabase.open(db_url)
    try:
        _retryable(db, _hotels(4))
        first = dg.materialize(
            [dead_letter_summary], instance=instance, resources=_resources(db_url, tmp_path)
        )
        meta = _metadata(first)
        assert (meta["open"], meta["status_pending"], meta["open_retryable"]) == (4, 4, 4)
        assert meta["created_24h"] == 4 and meta["fix_rate_24h"] == 0.0
        assert meta["oldest_open_hours"] >= 0
        assert dg.materialize(
            [dead_letter_compensation], instance=instance, resources=_resources(db_url, tmp_path)
        ).success
        meta = _metadata(
            dg.materialize(
                [dead_letter_summary], instance=instance, resources=_resources(db_url, tmp_path)
            )
        )
        assert (meta["open"], meta["status_resolved"], meta["fix_rate_24h"]) == (0, 4, 1.0)
        assert meta["fix_rate_7d"] == 1.0
        # Each materialization is a point the UI plots.
        records = instance.fetch_materializations(dg.AssetKey("dead_letter_summary"), limit=10)
        assert len(records.records) == 2
    finally:
        db.dispose()


def _step_failure(result: dg.ExecuteInJobResult) -> str:
    failures = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert len(failures) == 1, failures
    data = failures[0].step_failure_data
    assert data.user_failure_data is not None, data
    return str(data.user_failure_data.description)


def _output_metadata(result: dg.ExecuteInJobResult) -> dict[str, Any]:
    outputs = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_OUTPUT]
    assert len(outputs) == 1
    return {k: v.value for k, v in outputs[0].step_output_data.metadata.items()}


def test_operator_actions_run_from_the_launchpad_and_are_audited(
    db_url: str, tmp_path: Path, instance: dg.DagsterInstance
):
    resources = _resources(db_url, tmp_path)
    with _supplier(sim_profile="flaky").client() as client:
        keys = [encode_city_key(c.city_code) for c in client.list_cities().data.cities]
    instance.add_dynamic_partitions("supplier_city", keys)
    flaky = {**resources, "supplier": _supplier(sim_profile="flaky")}
    for key in keys:
        dg.materialize([city_sync], instance=instance, resources=flaky, partition_key=key)
    db = SyncDatabase.open(db_url)
    d = schema.dead_letter.c
    try:
        with db.engine.connect() as conn:
            letters = conn.execute(
                sa.select(d.id, d.error_code, d.supplier_resource_code).where(
                    d.status == "MANUAL_FIX"
                )
            ).all()
        assert len(letters) >= 2, "the flaky simulator served no bad record"

        def run(job: dg.JobDefinition, op: str, config: dict[str, Any]) -> dg.ExecuteInJobResult:
            return job.execute_in_process(
                run_config={"ops": {op: {"config": config}}},
                instance=instance,
                resources=resources,
                raise_on_error=False,
            )

        who = {"by": "ops-dana", "reason": "ticket OPS-42"}
        ignored = run(
            dead_letter_ignore_job, "ignore_dead_letters", {"ids": [letters[0].id], **who}
        )
        assert ignored.success
        meta = _output_metadata(ignored)
        change = meta["changes"][str(letters[0].id)]
        assert (meta["moved"], change["before"]["status"], change["after"]["status"]) == (
            1,
            "MANUAL_FIX",
            "IGNORED",
        )
        again = run(dead_letter_retry_job, "retry_dead_letters", {"ids": [letters[0].id], **who})
        assert not again.success and "DeadLetterStateError" in _step_failure(again)

        bad = run(
            dead_letter_fix_job,
            "fix_dead_letter_op",
            {"id": letters[1].id, "patch": json.dumps({"star_rating": 11}), **who},
        )
        assert not bad.success
        assert "still fails" in _step_failure(bad) and "unchanged" in _step_failure(bad)
        refused_review = run(
            review_approve_job, "approve_reviews_op", {"review_ids": ["rv-nope"], **who}
        )
        assert not refused_review.success
        task = run(
            task_settings_job,
            "change_task_op",
            {"task_code": DEFAULT_TASK_CODE, "policy": "CANCEL_PREVIOUS", **who},
        )
        assert task.success, _step_failure(task)
        assert _output_metadata(task)["changes"] == [
            {"field": "concurrency_policy", "old": "SKIP_IF_RUNNING", "new": "CANCEL_PREVIOUS"}
        ]
        gate = run(
            gate_override_job,
            "override_gate_op",
            {"batch_id": "b-nope", "city": "BKK", "check_name": "no_such_check", **who},
        )
        assert not gate.success and "no_such_check" in _step_failure(gate)
        no_event = run(outbox_retry_job, "retry_outbox_events", {"ids": [10**9], **who})
        assert not no_event.success
        with db.engine.connect() as conn:
            actions = [(e.action, e.actor, e.reason) for e in list_audit(conn, limit=20)]
        assert ("dead_letter.ignore", "ops-dana", "ticket OPS-42") in actions
        assert ("dead_letter.fix", "ops-dana", "ticket OPS-42") in actions
        assert any(a.startswith("task.") for a, _, _ in actions)
    finally:
        db.dispose()


def test_a_failed_city_is_resynced_by_the_sensor_and_its_ticket_resolved(
    db_url: str, tmp_path: Path, instance: dg.DagsterInstance
):
    with _supplier().client() as client:
        city = client.list_cities().data.cities[0].city_code
    db = SyncDatabase.open(db_url)
    try:
        upsert_task(db, TaskSpec(task_code=DEFAULT_TASK_CODE, supplier_id=1001))
        decision = create_batch(
            db, task_code=DEFAULT_TASK_CODE, trigger_id="night", trigger_source="CRON",
            shard_keys=[city],
        )  # fmt: skip
        assert decision.batch is not None
        record_city_failure(
            db,
            batch_id=decision.batch.batch_id,
            task_code=DEFAULT_TASK_CODE,
            sync_mode="FULL",
            supplier_id=1001,
            city_code=city,
            error="SupplierUnavailable: 503 beyond retries",
        )
        cancel_batch(db, decision.batch.batch_id, "the night's batch ended with the city failed")
        with db.begin() as conn:
            conn.execute(sa.update(schema.dead_letter).values(next_retry_at=db.clock.now(-1)))
        resources = _resources(db_url, tmp_path)
        first = dg.materialize([dead_letter_compensation], instance=instance, resources=resources)
        assert first.success and _metadata(first)["resync_cities"] == [city]
        # The city has its partition: it failed in a run of it.
        instance.add_dynamic_partitions("supplier_city", [encode_city_key(city)])
        with (
            dg.partition_loading_context(dynamic_partitions_store=instance),
            dg.build_sensor_context(instance=instance, repository_def=repository()) as ctx,
        ):
            tick = dead_letter_city_resync_sensor.evaluate_tick(ctx)
        (request,) = tick.run_requests or []
        assert request.partition_key is not None
        assert decode_city_key(request.partition_key) == city
        resync = dg.materialize(
            [city_sync],
            instance=instance,
            resources=resources,
            partition_key=request.partition_key,
            tags=request.tags,
        )
        assert resync.success
        second = dg.materialize([dead_letter_compensation], instance=instance, resources=resources)
        meta = _metadata(second)
        assert meta["cities_synced"] == 1 and meta["resync_cities"] == []
        d = schema.dead_letter.c
        with db.engine.connect() as conn:
            status = conn.execute(sa.select(d.status)).scalar_one()
        assert status == "RESOLVED"
    finally:
        db.dispose()
