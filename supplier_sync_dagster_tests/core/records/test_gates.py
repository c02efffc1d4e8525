"""Batch-level quality gates on SQLite and MariaDB: profiles, baselines, checks, overrides."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import (
    ConfigError,
    CountsDoNotAddUp,
    InvalidGateOverride,
    ProfileMissing,
    UnknownShard,
    UnknownTask,
)
from supplier_sync_dagster.core.leasing.batches import Batch
from supplier_sync_dagster.core.leasing.leases import claim_shard
from supplier_sync_dagster.core.records import gates as gates_module
from supplier_sync_dagster.core.records.gates import (
    CHECK_NAMES,
    GATED_PREFIX,
    FieldCounts,
    GateOverride,
    GateResult,
    GateThresholds,
    WindowVolume,
    check_change_volume,
    check_first_pages,
    evaluate_gates,
    failure_reason,
    gated_checks,
    get_city_profile,
    get_gate_thresholds,
    list_overrides,
    override_gate,
    previous_profile,
    profile_records,
    record_city_profile,
    set_gate_thresholds,
    weighted_median,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.sync.city import sync_city
from supplier_sync_dagster.core.sync.gate import gate_for_pipeline
from supplier_sync_dagster.core.sync.model import CityReport, SyncSettings
from supplier_sync_dagster.simulator import FaultProfile, running_server
from supplier_sync_dagster_tests.core.conftest import MakeBatch
from supplier_sync_dagster_tests.helpers import HOSTILE_CITY_CODES, make_simulator, supplier_client

CITY = "BKK"


def hotel(i: int, *, coords: str = "geo", **extra: Any) -> dict[str, Any]:
    """A raw supplier record with the required fields; ``coords`` names the geo field."""
    return {
        "hotel_id": f"H{i:06d}",
        "name": f"Hotel {i}",
        "city_code": CITY,
        "country_code": "TH",
        coords: {"lat": 13.7, "lng": 100.5},
        "status": "ACTIVE",
        "updated_at": "2026-11-20T10:00:00Z",
        "version": 1,
        **extra,
    }


class Cities:
    """Batches of one task, each with its cities' profiles, and shards finished at will."""

    def __init__(self, db: SyncDatabase, make_batch: MakeBatch, task_code: str | None = None):
        self.db = db
        self.make_batch = make_batch
        self.task_code = task_code or f"task_{uuid.uuid4().hex[:12]}"

    def batch(
        self,
        records: list[Any] | int,
        *,
        bad: int = 0,
        status: str | None = "SUCCESS",
        city: str = CITY,
        task_code: str | None = None,
    ) -> Batch:
        """A batch whose city has these raw records (or this many plain ones), profiled, and
        whose shard finished with ``status`` (None: left PENDING until the next batch)."""
        task_code = task_code or self.task_code
        # One batch after the other, as a schedule runs them: a new batch supersedes
        # (cancels) an unfinished one.
        batch = self.make_batch((city,), task_code=task_code, policy="CANCEL_PREVIOUS")
        if isinstance(records, int):
            records = [hotel(i) for i in range(records)]
        with self.db.begin() as conn:
            record_city_profile(
                conn,
                self.db.clock,
                batch_id=batch.batch_id,
                task_code=task_code,
                shard_key=city,
                record_count=len(records),
                bad_count=bad,
                field_counts=profile_records(records),
            )
        if status is not None:
            lease = claim_shard(self.db, batch.batch_id, city, worker_id="w-test")
            lease.finish(status)  # type: ignore[arg-type]
        return batch

    def evaluate(
        self, batch: Batch, thresholds: GateThresholds | None = None, city: str = CITY
    ) -> dict[str, GateResult]:
        with self.db.engine.connect() as conn:
            results = evaluate_gates(
                conn,
                batch_id=batch.batch_id,
                task_code=batch.task_code,
                shard_key=city,
                thresholds=thresholds or GateThresholds(),
            )
        assert [r.check_name for r in results] == list(CHECK_NAMES)
        return {r.check_name: r for r in results}


@pytest.fixture
def cities(db: SyncDatabase, make_batch: MakeBatch) -> Cities:
    return Cities(db, make_batch)


# profile_records


def test_profile_records_counts_records_per_top_level_field():
    records = [hotel(1), hotel(2, phone="+66"), hotel(3, coords="location"), "junk", None]
    fc = profile_records(records)
    assert fc.records == 3
    assert fc.fields["geo"] == 2
    assert fc.fields["location"] == 1
    assert fc.fields["phone"] == 1
    assert fc.fields["hotel_id"] == 3
    assert fc.ratio("geo") == pytest.approx(2 / 3)
    assert fc.ratio("nope") == 0.0
    # Pages combine; a generator works as well as a list.
    total = profile_records(r for r in records).merge(profile_records([hotel(4)]))
    assert total.records == 4 and total.fields["geo"] == 3
    assert FieldCounts.from_json(total.to_json()) == total


def test_field_counts_storage_is_capped_for_random_keys():
    fc = profile_records([{f"k{i}": 1, "id": 1} for i in range(1500)] + [{"x" * 1000: 1}])
    stored = fc.to_json()
    assert len(stored["fields"]) == 1000
    assert stored["fields"]["id"] == 1500  # the most frequent fields are the ones kept
    assert stored["omitted_fields"] == 502
    assert all(len(name) <= 200 for name in stored["fields"])


# profiles and baselines


def test_profile_upsert_is_idempotent(db: SyncDatabase, cities: Cities):
    batch = cities.batch(10, bad=1, status=None)
    for _ in range(2):  # a re-run of normalization rewrites the same row
        with db.begin() as conn:
            record_city_profile(
                conn,
                db.clock,
                batch_id=batch.batch_id,
                task_code=batch.task_code,
                shard_key=CITY,
                record_count=12,
                bad_count=3,
                field_counts=profile_records([hotel(1), hotel(2, coords="location")]),
            )
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(sa.func.count()).where(schema.city_profile.c.batch_id == batch.batch_id)
        ).scalar_one()
        profile = get_city_profile(conn, batch_id=batch.batch_id, shard_key=CITY)
    assert rows == 1
    assert profile is not None
    assert (profile.record_count, profile.bad_count) == (12, 3)
    assert profile.field_counts is not None
    assert profile.field_counts.records == 2
    assert profile.field_counts.fields["location"] == 1


def test_profile_without_fields_and_invalid_counts(db: SyncDatabase, cities: Cities):
    batch = cities.batch(5, status=None)
    with db.begin() as conn:
        record_city_profile(
            conn,
            db.clock,
            batch_id=batch.batch_id,
            task_code=batch.task_code,
            shard_key=CITY,
            record_count=5,
            bad_count=0,
            field_counts=None,
        )
    with db.engine.connect() as conn:
        profile = get_city_profile(conn, batch_id=batch.batch_id, shard_key=CITY)
        assert profile is not None and profile.field_counts is None
        assert get_city_profile(conn, batch_id=batch.batch_id, shard_key="SIN") is None
    with pytest.raises(CountsDoNotAddUp), db.begin() as conn:
        record_city_profile(
            conn,
            db.clock,
            batch_id=batch.batch_id,
            task_code=batch.task_code,
            shard_key=CITY,
            record_count=5,
            bad_count=6,
            field_counts=None,
        )


def test_previous_profile_is_the_latest_earlier_success_of_the_same_task(
    db: SyncDatabase, cities: Cities
):
    first = cities.batch(100)
    second = cities.batch(90)
    cities.batch(80, status="FAILED")  # failed or gated: never a baseline
    unfinished = cities.batch(70, status=None)  # cancelled by the next one: never a baseline
    cities.batch(60, task_code=f"other_{uuid.uuid4().hex[:8]}")  # another task
    cities.batch(50, city="SIN")  # another city
    current = cities.batch(40, status=None)
    later = cities.batch(30)  # later than the batch being judged
    with db.engine.connect() as conn:
        statuses = dict(
            conn.execute(
                sa.select(schema.shard.c.batch_id, schema.shard.c.status).where(
                    schema.shard.c.batch_id.in_([unfinished.batch_id, current.batch_id])
                )
            ).all()
        )
        assert statuses == {unfinished.batch_id: "CANCELLED", current.batch_id: "CANCELLED"}
        prev = previous_profile(
            conn, task_code=cities.task_code, shard_key=CITY, before_batch_id=current.batch_id
        )
        assert prev is not None
        assert (prev.batch_id, prev.record_count) == (second.batch_id, 90)
        prev = previous_profile(
            conn, task_code=cities.task_code, shard_key=CITY, before_batch_id=second.batch_id
        )
        assert prev is not None and prev.batch_id == first.batch_id
        assert (
            previous_profile(
                conn, task_code=cities.task_code, shard_key=CITY, before_batch_id=first.batch_id
            )
            is None
        )
        prev = previous_profile(
            conn, task_code=cities.task_code, shard_key=CITY, before_batch_id=later.batch_id
        )
        assert prev is not None and prev.batch_id == second.batch_id


def test_city_codes_are_compared_byte_for_byte(db: SyncDatabase, make_batch: MakeBatch):
    cities = Cities(db, make_batch)
    for code in HOSTILE_CITY_CODES:
        cities.batch(10, city=code)
    current = cities.batch(0, city="bkk", status=None)
    results = cities.evaluate(current, city="bkk")
    # Only the earlier "bkk" batch is a baseline, not "BKK".
    assert results["record_count"].metadata["previous_records"] == 10
    assert not results["record_count"].passed
    with db.engine.connect() as conn:
        prev = previous_profile(
            conn, task_code=cities.task_code, shard_key="BKK", before_batch_id=current.batch_id
        )
    assert prev is not None and prev.shard_key == "BKK"


# the checks


def test_bad_record_ratio_over_and_under_threshold(cities: Cities):
    under = cities.evaluate(cities.batch(100, bad=20, status=None))["bad_record_ratio"]
    assert under.passed and not under.overridden
    assert under.metadata == {"records": 100, "bad": 20, "ratio": 0.2, "max_bad_ratio": 0.2}
    over = cities.evaluate(cities.batch(100, bad=21, status=None))["bad_record_ratio"]
    assert not over.passed
    assert over.severity == "ERROR"
    assert over.metadata["ratio"] == 0.21
    assert "21 of 100" in over.description and "20.0%" in over.description
    strict = cities.evaluate(
        cities.batch(100, bad=6, status=None), GateThresholds(max_bad_ratio=0.05)
    )["bad_record_ratio"]
    assert not strict.passed and strict.metadata["max_bad_ratio"] == 0.05


def test_first_batch_passes_count_and_drift_without_baseline(cities: Cities):
    results = cities.evaluate(cities.batch(3, status=None))
    assert all(r.passed for r in results.values())
    for name in ("record_count", "schema_drift"):
        assert results[name].metadata["baseline"] == "none"
        assert "previous_batch_id" not in results[name].metadata
        assert "no baseline" in results[name].description


def test_count_drop_beyond_threshold_fails(cities: Cities):
    first = cities.batch(200)
    ok = cities.evaluate(cities.batch(100, status=None))["record_count"]
    assert ok.passed  # exactly a 50% drop is within the limit
    assert ok.metadata["drop"] == 0.5
    res = cities.evaluate(cities.batch(99, status=None))["record_count"]
    assert not res.passed
    assert res.metadata == {
        "current_records": 99,
        "previous_batch_id": first.batch_id,
        "previous_records": 200,
        "drop": 0.505,
        "max_count_drop": 0.5,
        "min_previous_records": 10,
        "rule": "drop",
    }
    assert first.batch_id in res.description
    tolerant_batch = cities.batch(99, status=None)
    tolerant = cities.evaluate(tolerant_batch, GateThresholds(max_count_drop=0.6))["record_count"]
    assert tolerant.passed
    growth = cities.evaluate(cities.batch(500, status=None))["record_count"]
    assert growth.passed and growth.metadata["drop"] == -1.5


def test_zero_records_after_some_fails_even_below_the_drop_minimum(cities: Cities):
    cities.batch(3)  # below min_previous_records: the drop rule does not apply...
    small_drop = cities.evaluate(cities.batch(1, status=None))["record_count"]
    assert small_drop.passed and small_drop.metadata["rule"] == "baseline_too_small"
    # ...but "success with 0 rows" is a failure whatever the thresholds and ratios say.
    zero = cities.evaluate(
        cities.batch(0, status=None), GateThresholds(max_count_drop=1.0, max_bad_ratio=1.0)
    )
    assert zero["bad_record_ratio"].passed
    assert not zero["record_count"].passed
    assert zero["record_count"].metadata["rule"] == "zero_after_nonzero"
    assert zero["record_count"].metadata["previous_records"] == 3
    assert zero["schema_drift"].passed  # nothing to compare; record_count covers it


def test_zero_after_zero_passes(cities: Cities):
    cities.batch(0)
    assert cities.evaluate(cities.batch(0, status=None))["record_count"].passed


def test_schema_drift_geo_renamed_to_location(cities: Cities):
    before = cities.batch([hotel(i) for i in range(50)])
    now = cities.batch([hotel(i, coords="location") for i in range(50)], bad=0, status=None)
    drift = cities.evaluate(now)["schema_drift"]
    assert not drift.passed
    assert drift.metadata["fields_disappeared"] == ["geo"]
    assert drift.metadata["fields_appeared"] == ["location"]
    assert drift.metadata["field_ratios"] == {
        "geo": {"previous": 1.0, "current": 0.0},
        "location": {"previous": 0.0, "current": 1.0},
    }
    assert drift.metadata["previous_batch_id"] == before.batch_id
    assert "geo" in drift.description and "location" in drift.description


def test_rare_optional_field_does_not_trip_drift(cities: Cities):
    cities.batch([hotel(i, phone="+66", email="a@b") for i in range(100)])
    now = [hotel(i, phone="+66") for i in range(100)]  # email present in half: not "present"
    for i in range(3):
        now[i]["promo"] = "SUMMER"  # a rare optional field appears in 3% of records
    for i in range(50):
        now[i]["email"] = "a@b"
    drift = cities.evaluate(cities.batch(now, status=None))["schema_drift"]
    assert drift.passed, drift.description
    assert drift.metadata["fields_appeared"] == []
    assert drift.metadata["fields_disappeared"] == []


def test_drift_thresholds_are_configurable(cities: Cities):
    cities.batch([hotel(i, email="a@b") if i < 60 else hotel(i) for i in range(100)])
    now = cities.batch(100, status=None)
    assert cities.evaluate(now)["schema_drift"].passed  # 60% was not "present"
    drift = cities.evaluate(now, GateThresholds(drift_present_ratio=0.5))["schema_drift"]
    assert not drift.passed and drift.metadata["fields_disappeared"] == ["email"]


def test_drift_is_not_measured_without_field_profile(db: SyncDatabase, cities: Cities):
    cities.batch(10)
    now = cities.batch(10, status=None)
    with db.begin() as conn:
        record_city_profile(
            conn,
            db.clock,
            batch_id=now.batch_id,
            task_code=now.task_code,
            shard_key=CITY,
            record_count=10,
            bad_count=0,
            field_counts=None,
        )
    drift = cities.evaluate(now)["schema_drift"]
    assert drift.passed and drift.metadata["baseline"] == "not measurable"


def test_evaluate_without_profile_is_an_error(db: SyncDatabase, make_batch: MakeBatch):
    batch = make_batch((CITY,))
    with pytest.raises(ProfileMissing), db.engine.connect() as conn:
        evaluate_gates(
            conn,
            batch_id=batch.batch_id,
            task_code=batch.task_code,
            shard_key=CITY,
            thresholds=GateThresholds(),
        )


# overrides


def test_override_makes_the_check_pass_and_is_recorded(db: SyncDatabase, cities: Cities):
    cities.batch(100)
    now = cities.batch([hotel(i, coords="location") for i in range(100)], status=None)
    assert not cities.evaluate(now)["schema_drift"].passed
    with db.begin() as conn:
        ov = override_gate(
            conn,
            db.clock,
            batch_id=now.batch_id,
            shard_key=CITY,
            check_name="schema_drift",
            who="alice",
            reason="supplier renamed geo to location; mapping fixed in v2.3",
        )
        db_now = db.clock.read(conn)
    assert (ov.overridden_by, ov.check_name) == ("alice", "schema_drift")
    assert abs((db_now - ov.created_at).total_seconds()) < 60
    # Idempotent: the first decision stays.
    with db.begin() as conn:
        again = override_gate(
            conn,
            db.clock,
            batch_id=now.batch_id,
            shard_key=CITY,
            check_name="schema_drift",
            who="bob",
            reason="again",
        )
        listed = list_overrides(conn, batch_id=now.batch_id)
    assert again == ov
    assert listed == [ov]
    results = cities.evaluate(now)
    drift = results["schema_drift"]
    assert drift.passed and drift.overridden and drift.override == ov
    assert drift.metadata["overridden_by"] == "alice"
    assert drift.metadata["override_reason"].startswith("supplier renamed")
    assert drift.metadata["overridden_at"] == ov.created_at.isoformat()
    assert drift.metadata["fields_disappeared"] == ["geo"]  # the measurement stays visible
    assert "overridden by alice" in drift.description
    # Other checks are not affected; an override of a passing check is not "overridden".
    assert results["record_count"].passed and not results["record_count"].overridden
    with db.begin() as conn:
        override_gate(
            conn,
            db.clock,
            batch_id=now.batch_id,
            shard_key=CITY,
            check_name="record_count",
            who="alice",
            reason="pre-approved",
        )
    count = cities.evaluate(now)["record_count"]
    assert count.passed and not count.overridden and count.override is not None


@pytest.mark.parametrize(
    ("check", "who", "reason"),
    [
        ("bad_records", "alice", "why"),
        ("", "alice", "why"),
        ("schema_drift", "", "why"),
        ("schema_drift", "  ", "why"),
        ("schema_drift", "alice", ""),
        ("schema_drift", "a" * 65, "why"),
        ("schema_drift", "alice", "w" * 1025),
    ],
)
def test_invalid_override_is_refused(
    db: SyncDatabase, make_batch: MakeBatch, check: str, who: str, reason: str
):
    batch = make_batch((CITY,))
    with pytest.raises(InvalidGateOverride), db.begin() as conn:
        override_gate(
            conn,
            db.clock,
            batch_id=batch.batch_id,
            shard_key=CITY,
            check_name=check,
            who=who,
            reason=reason,
        )
    with db.engine.connect() as conn:
        assert list_overrides(conn, batch_id=batch.batch_id) == []


def test_override_of_unknown_shard_is_refused(db: SyncDatabase, make_batch: MakeBatch):
    batch = make_batch((CITY,))
    with pytest.raises(UnknownShard), db.begin() as conn:
        override_gate(
            conn,
            db.clock,
            batch_id=batch.batch_id,
            shard_key="bkk",
            check_name="record_count",
            who="alice",
            reason="typo in the city",
        )


# thresholds


def test_thresholds_per_task_stored_and_read_back(db: SyncDatabase, make_batch: MakeBatch):
    a, b = make_batch((CITY,)).task_code, make_batch((CITY,)).task_code
    with db.engine.connect() as conn:
        assert get_gate_thresholds(conn, a) == GateThresholds()
    custom = GateThresholds(max_bad_ratio=0.05, max_count_drop=0.3, min_previous_records=100)
    with db.begin() as conn:
        set_gate_thresholds(conn, db.clock, task_code=a, thresholds=GateThresholds())
        set_gate_thresholds(conn, db.clock, task_code=a, thresholds=custom, updated_by="ops")
    with db.engine.connect() as conn:
        assert get_gate_thresholds(conn, a) == custom
        assert get_gate_thresholds(conn, b) == GateThresholds()
        rows = conn.execute(
            sa.select(schema.gate_threshold.c.updated_by).where(
                schema.gate_threshold.c.task_code == a
            )
        ).all()
    assert [r.updated_by for r in rows] == ["ops"]
    with pytest.raises(UnknownTask), db.begin() as conn:
        set_gate_thresholds(conn, db.clock, task_code="no_such_task", thresholds=custom)


def test_partial_and_malformed_stored_thresholds(db: SyncDatabase, make_batch: MakeBatch):
    task = make_batch((CITY,)).task_code
    with db.begin() as conn:
        set_gate_thresholds(conn, db.clock, task_code=task, thresholds=GateThresholds())
        conn.execute(
            sa.update(schema.gate_threshold)
            .where(schema.gate_threshold.c.task_code == task)
            .values(thresholds={"max_bad_ratio": 0.1})
        )
    with db.engine.connect() as conn:
        assert get_gate_thresholds(conn, task) == GateThresholds(max_bad_ratio=0.1)
    with db.begin() as conn:
        conn.execute(
            sa.update(schema.gate_threshold)
            .where(schema.gate_threshold.c.task_code == task)
            .values(thresholds={"max_bad_ratoi": 0.1})
        )
    with pytest.raises(ConfigError, match="max_bad_ratoi"), db.engine.connect() as conn:
        get_gate_thresholds(conn, task)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_bad_ratio": 1.5},
        {"max_bad_ratio": -0.1},
        {"max_bad_ratio": float("nan")},
        {"max_count_drop": "0.5"},
        {"max_count_drop": True},
        {"min_previous_records": -1},
        {"min_previous_records": 2.5},
        {"drift_present_ratio": 0.1, "drift_absent_ratio": 0.1},
    ],
)
def test_invalid_thresholds_are_refused(kwargs: dict[str, Any]):
    with pytest.raises(ConfigError):
        GateThresholds(**kwargs)


def test_thresholds_round_trip_through_dict():
    th = GateThresholds(max_bad_ratio=0, drift_present_ratio=1)
    assert th.max_bad_ratio == 0.0 and isinstance(th.max_bad_ratio, float)
    assert GateThresholds.from_dict(th.to_dict()) == th
    assert GateThresholds.from_dict({}) == GateThresholds()


# the pipeline's gate hook


def test_pipeline_gate_names_failed_checks_and_respects_overrides(db: SyncDatabase, cities: Cities):
    seen: list[tuple[str, str, list[GateResult]]] = []
    gate = gate_for_pipeline(on_results=lambda b, c, r: seen.append((b, c, r)))
    cities.batch(100)
    now = cities.batch([hotel(i, coords="location") for i in range(40)], bad=30, status=None)
    report = CityReport(CITY, records=40, dead_letters=30)
    reason = failure_reason(gate(db, now.batch_id, CITY, report))
    assert reason is not None
    assert "bad_record_ratio" in reason and "record_count" in reason
    assert "schema_drift" in reason and "geo" in reason and "location" in reason
    assert [r.check_name for r in seen[0][2] if not r.passed] == list(CHECK_NAMES)
    with db.begin() as conn:
        for check in CHECK_NAMES:
            override_gate(
                conn,
                db.clock,
                batch_id=now.batch_id,
                shard_key=CITY,
                check_name=check,
                who="alice",
                reason="checked with the supplier",
            )
    assert failure_reason(gate(db, now.batch_id, CITY, report)) is None
    assert all(r.overridden for r in seen[1][2])
    # Metadata is plain JSON (what Dagster check metadata and alerts carry).
    for _, _, results in seen:
        for r in results:
            assert json.loads(json.dumps(r.metadata)) == r.metadata


def test_gate_message_is_built_and_read_in_one_place():
    results = [
        GateResult("bad_record_ratio", False, "ERROR", "30% bad: over 10%", {}),
        GateResult("record_count", True, "ERROR", "40 records", {}),
        GateResult("schema_drift", False, "ERROR", "geo: gone | odd", {}),
    ]
    reason = failure_reason(results)
    assert reason == "bad_record_ratio: 30% bad: over 10% | schema_drift: geo: gone | odd"
    assert gated_checks(GATED_PREFIX + (failure_reason(results[:1]) or "")) == [
        ("bad_record_ratio", "30% bad: over 10%")
    ]
    assert gated_checks("SupplierError: boom") is None and gated_checks(None) is None
    assert failure_reason(results[1:2]) is None
    report = CityReport(CITY, checks=results)
    assert report.gate_failures == ["bad_record_ratio", "schema_drift"]


def test_pipeline_gate_uses_task_thresholds(db: SyncDatabase, cities: Cities):
    now = cities.batch(100, bad=10, status=None)
    report = CityReport(CITY, records=100, dead_letters=10)
    assert failure_reason(gate_for_pipeline()(db, now.batch_id, CITY, report)) is None
    with db.begin() as conn:
        set_gate_thresholds(
            conn,
            db.clock,
            task_code=cities.task_code,
            thresholds=GateThresholds(max_bad_ratio=0.05),
        )
    reason = failure_reason(gate_for_pipeline()(db, now.batch_id, CITY, report))
    assert reason is not None and reason.startswith("bad_record_ratio:")
    fixed = gate_for_pipeline(lambda task: GateThresholds(max_bad_ratio=0.5))
    assert failure_reason(fixed(db, now.batch_id, CITY, report)) is None


def test_pipeline_gate_without_profile_judges_the_report(
    db: SyncDatabase, cities: Cities, make_batch: MakeBatch
):
    cities.batch(100)
    now = make_batch((CITY,), task_code=cities.task_code, policy="CANCEL_PREVIOUS")
    seen: list[list[GateResult]] = []
    gate = gate_for_pipeline(on_results=lambda b, c, r: seen.append(r))
    reason = failure_reason(
        gate(db, now.batch_id, CITY, CityReport(CITY, records=0, dead_letters=0))
    )
    assert reason is not None and reason.startswith("record_count: 0 records")
    drift = {r.check_name: r for r in seen[0]}["schema_drift"]
    assert drift.passed and drift.metadata["baseline"] == "not measurable"
    assert (
        failure_reason(gate(db, now.batch_id, CITY, CityReport(CITY, records=90, dead_letters=1)))
        is None
    )


def test_gated_city_publishes_nothing_until_overridden_then_publishes(
    db: SyncDatabase, make_batch: MakeBatch, tmp_path: Path
):
    sim = make_simulator(
        FaultProfile.clean().with_(bad_record_rate=0.5), seed=11, n_cities=1, total_hotels=120
    )
    store = LocalPayloadStore(tmp_path / "payloads")
    with running_server(sim) as url, httpx.Client(base_url=url) as http:
        client = supplier_client(http)
        (city,) = [c.city_code for c in client.list_cities().data.cities]
        batch = make_batch((city,))
        settings = SyncSettings(task_code=batch.task_code, supplier_id=1001, page_size=50)

        def sync() -> CityReport:
            return sync_city(
                db,
                store,
                client,
                batch=batch,
                city_code=city,
                worker_id="w1",
                settings=settings,
                gate=gate_for_pipeline(),
            )

        gated = sync()
        assert gated.status == "GATED"
        assert gated.error is not None and gated.error.startswith("bad_record_ratio:")
        with db.engine.connect() as conn:
            published = sa.select(sa.func.count()).select_from(schema.platform_hotel)
            assert conn.execute(published).scalar() == 0
            shard = conn.execute(
                sa.select(schema.shard.c.status, schema.shard.c.error_message).where(
                    schema.shard.c.batch_id == batch.batch_id
                )
            ).one()
        assert shard.status == "FAILED" and "bad_record_ratio" in shard.error_message

        with db.begin() as conn:
            override_gate(
                conn,
                db.clock,
                batch_id=batch.batch_id,
                shard_key=city,
                check_name="bad_record_ratio",
                who="alice",
                reason="simulated feed: half the records are broken on purpose",
            )
        done = sync()
    assert done.status == "SUCCESS", done.error
    truth = sim.ground_truth()
    assert done.published == len(truth.valid) > 0


# --- change_volume: rates against a time-weighted median (issue 40, item 7) -----------------

HOUR = 3600.0
DAY = 24 * HOUR


def test_weighted_median_weighs_each_value_by_its_weight():
    assert weighted_median([(1.0, 1.0), (2.0, 1.0), (3.0, 1.0)]) == 2.0
    assert weighted_median([(1.0, 1.0), (3.0, 1.0)]) == 2.0  # an exact half: the mean
    # Two light values do not outvote a heavy one, whatever their number.
    assert weighted_median([(0.0, 0.1), (0.0, 0.1), (10.0, 24.0)]) == 10.0
    assert weighted_median([(5.0, 0.0), (7.0, 2.0)]) == 7.0  # a zero weight counts for nothing
    with pytest.raises(ValueError):
        weighted_median([(5.0, 0.0)])


def test_change_volume_judges_a_windows_rate_not_its_count():
    t = GateThresholds()  # 5x, 100 changes
    quiet = WindowVolume(0, 300.0)  # a poll that re-read its 5-minute overlap only
    history = [quiet, quiet, WindowVolume(248, DAY)]
    normal = check_change_volume(WindowVolume(256, DAY), history, t)
    assert normal.passed, normal.description
    assert normal.metadata["trailing_median_rate"] == round(248 / 24, 3)
    assert "256 changes in 24.00 h of feed (10.7/h)" in normal.description
    assert "time-weighted median of 10.3/h over 3 windows" in normal.description
    # The same day after a one-hour window of 10 changes: a rate of 10.7/h, within 5x.
    assert check_change_volume(WindowVolume(256, DAY), [WindowVolume(10, HOUR)] * 3, t).passed
    # A spike: five times the day's changes in one day, or a day's changes in an hour.
    assert not check_change_volume(WindowVolume(5 * 256, DAY), history, t).passed
    held = check_change_volume(WindowVolume(256, HOUR), history, t)
    assert not held.passed and "beyond 5x" in held.description
    # Changes that share one second (a bulk re-date) are a spike, not a division by zero.
    assert not check_change_volume(WindowVolume(150, 0.0), history, t).passed


def test_change_volume_needs_a_baseline_of_enough_windows_and_feed_time():
    t = GateThresholds()
    spike = WindowVolume(10_000, HOUR)
    two = check_change_volume(spike, [WindowVolume(10, DAY)] * 2, t)
    assert two.passed and "no baseline yet" in two.description
    # Three short quiet polls are no baseline for a day: nothing to compare with.
    polls = check_change_volume(WindowVolume(256, DAY), [WindowVolume(0, 300.0)] * 3, t)
    assert polls.passed and "no baseline yet" in polls.description
    assert polls.metadata["baseline_hours"] == 0.25
    # Under min_volume_records the rule does not apply, whatever the rate.
    small = check_change_volume(WindowVolume(99, 1.0), [WindowVolume(10, DAY)] * 3, t)
    assert small.passed and "under 100 changes" in small.description
    # A silent feed's baseline is one change an hour, not zero.
    silent = [WindowVolume(0, DAY)] * 3
    assert check_change_volume(WindowVolume(110, DAY), silent, t).passed  # 4.6/h <= 5/h
    assert not check_change_volume(WindowVolume(130, DAY), silent, t).passed  # 5.4/h


def test_one_spike_in_the_history_does_not_raise_the_baseline():
    t = GateThresholds()
    history = [WindowVolume(5_000, HOUR)] + [WindowVolume(240, DAY)] * 4
    assert not check_change_volume(WindowVolume(1_000, 2 * HOUR), history, t).passed


def test_first_pages_drift_stops_a_renamed_field_and_reads_overrides_only_when_claimed_with_one(
    db: SyncDatabase, cities: Cities, monkeypatch: pytest.MonkeyPatch
):
    cities.batch(100)
    now = cities.batch(0, status=None)
    renamed = [FieldCounts().add([hotel(i, coords="location") for i in range(50)])] * 2

    city: dict[str, Any] = {"batch_id": now.batch_id, "shard_key": CITY}

    def first_pages(overrides: bool | None) -> GateResult | None:
        return check_first_pages(
            db, **city, task_code=cities.task_code, pages=renamed, overrides=overrides
        )

    for overrides in (None, False, True):
        drift = first_pages(overrides)
        assert drift is not None and not drift.passed and "first 2 pages" in drift.description
        assert drift.metadata["stopped"] == "first pages"
        assert drift.metadata["fields_disappeared"] == ["geo"]
    with db.begin() as conn:
        override_gate(conn, db.clock, **city, check_name="schema_drift", who="al", reason="why")
    assert first_pages(None) is None and first_pages(True) is None
    # A claim that saw no override of the city: none is read (the claim read the table).
    read: list[str] = []
    real = gates_module.list_overrides

    def list_overrides_read(*a: Any, **k: Any) -> list[GateOverride]:
        read.append("read")
        return real(*a, **k)

    monkeypatch.setattr(gates_module, "list_overrides", list_overrides_read)
    assert first_pages(False) is not None and read == []
    assert first_pages(None) is None and read == ["read"]


def test_first_pages_without_baseline_pass(db: SyncDatabase, cities: Cities):
    now = cities.batch(0, status=None)  # the task's first batch of the city
    drift = check_first_pages(
        db,
        batch_id=now.batch_id,
        task_code=cities.task_code,
        shard_key=CITY,
        pages=[FieldCounts().add([hotel(i, coords="location") for i in range(50)])],
    )
    assert drift is None
