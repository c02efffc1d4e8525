"""A city's events: what its walk saw reaches its raw and published materializations; a city
published earlier in the batch is reported again, its gates too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dagster as dg
import pytest

from supplier_sync_dagster.core.records.gates import CHECK_NAMES, GateResult
from supplier_sync_dagster.core.supplier import WalkStats
from supplier_sync_dagster.core.sync.model import CityReport
from supplier_sync_dagster.core.sync.run import CityOutcome, SupplierUse
from supplier_sync_dagster.dagster_instance.events import CheckTarget
from supplier_sync_dagster.defs.city_events import (
    city_checks,
    city_materializations,
    city_metadata,
)
from supplier_sync_dagster.defs.city_keys import DIFFS, MAPPINGS, NORMALIZED, PUBLISHED, RAW

ALL_KEYS = (RAW, NORMALIZED, MAPPINGS, DIFFS, PUBLISHED)


def city_events(
    outcome: CityOutcome, batch_id: str, selected: set[dg.AssetKey], **reads: Any
) -> list[object]:
    """A city's events as ``city_sync`` reports them: its materializations, then its checks."""
    return [
        *city_materializations(outcome, batch_id, selected),
        *city_checks(outcome, batch_id, selected, **reads),
    ]


def test_what_the_city_cost_of_the_request_budget_reaches_its_metadata() -> None:
    outcome = CityOutcome(
        CityReport("BKK"),
        seconds=30.0,
        supplier=SupplierUse(requests=900, throttled=3, waited=12.345, rate=47.123),
    )
    raw = city_metadata(outcome, "b1")[RAW]
    assert (raw["supplier_requests"], raw["supplier_429"]) == (900, 3)
    assert raw["supplier_429_per_minute"] == 6.0
    assert (raw["rate_limiter_wait_seconds"], raw["governed_rate"]) == (12.345, 47.12)
    fixed = city_metadata(CityOutcome(CityReport("BKK")), "b1")[RAW]
    assert "governed_rate" not in fixed and fixed["supplier_429_per_minute"] == 0.0


def test_the_walk_s_drift_reaches_the_city_metadata() -> None:
    report = CityReport("BKK", walk=WalkStats(requests=12, probes=4, shifts=1, verified=True))
    meta = city_metadata(CityOutcome(report), "b1")
    assert meta[RAW]["listing_drift"] == "SHIFTED" and meta[RAW]["listing_shifts"] == 1
    assert (meta[RAW]["walk_probes"], meta[RAW]["walk_requests"]) == (4, 12)
    assert meta[PUBLISHED]["listing_drift"] == "SHIFTED"


def test_each_stage_s_wall_and_cpu_seconds_reach_its_asset_s_metadata() -> None:
    report = CityReport("BKK")
    report.seconds.update(fetch=2.0, normalize=1.0, publish=0.5)
    report.cpu_seconds.update(fetch=0.25, normalize=0.75, publish=0.125)
    meta = city_metadata(CityOutcome(report), "b1")
    assert (meta[RAW]["fetch_seconds"], meta[RAW]["cpu_fetch_seconds"]) == (2.0, 0.25)
    assert (meta[NORMALIZED]["normalize_seconds"], meta[NORMALIZED]["cpu_normalize_seconds"]) == (
        1.0,
        0.75,
    )
    assert (meta[PUBLISHED]["publish_seconds"], meta[PUBLISHED]["cpu_publish_seconds"]) == (
        0.5,
        0.125,
    )
    assert "cpu_fetch_seconds" not in meta[PUBLISHED]


def test_a_city_that_walked_no_listing_says_nothing_of_drift() -> None:
    meta = city_metadata(CityOutcome(CityReport("BKK")), "b1")
    assert "listing_drift" not in meta[RAW] and "listing_drift" not in meta[PUBLISHED]
    clean = city_metadata(CityOutcome(CityReport("BKK", walk=WalkStats(requests=3))), "b1")
    assert clean[RAW]["listing_drift"] == "none"


def _already_done(city: str) -> CityOutcome:
    return CityOutcome(
        CityReport(
            city,
            status="ALREADY_DONE",
            records=10,
            published=9,
            dead_letters=1,
            stages_done=["fetch", "normalize", "publish"],
        )
    )


def test_a_city_published_earlier_is_materialized_for_every_selected_asset_and_its_gates():
    """Even when its partitions' latest materializations are of the batch already: the run
    planned them, and a planned partition the run does not materialize fails with the run."""
    earlier = dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey("normalized_hotels"),
        check_name="bad_record_ratio",
        passed=True,
        description="1 of 10 records dead-lettered",
        metadata={"batch_id": "b1", "city": "BKK"},
        partition="BKK",
    )
    other_batch = dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey("normalized_hotels"),
        check_name="record_count",
        passed=False,
        metadata={"batch_id": "b0", "city": "BKK"},
        partition="BKK",
    )
    found = {"bad_record_ratio": earlier, "record_count": other_batch}
    target = CheckTarget(run_id="r2", storage_id=42, timestamp=1.0)
    events = list(
        city_events(
            _already_done("BKK"),
            "b1",
            set(ALL_KEYS),
            target=lambda _partition: target,
            earlier=lambda check, _partition: found.get(check.name),
        )
    )
    mats = [e for e in events if isinstance(e, dg.AssetMaterialization)]
    assert {m.asset_key for m in mats} == set(ALL_KEYS)
    assert all(m.metadata["published_earlier_in_batch"].value == "b1" for m in mats)
    assert all(m.metadata["city_status"].value == "ALREADY_DONE" for m in mats)
    checks = {e.check_name: e for e in events if isinstance(e, dg.AssetCheckEvaluation)}
    assert set(checks) == set(CHECK_NAMES)
    assert all(c.passed and c.target_materialization_data == target for c in checks.values())
    # The batch's own result is repeated; another batch's is not: passed, as published.
    assert checks["bad_record_ratio"].description == "1 of 10 records dead-lettered"
    for name in ("record_count", "schema_drift"):
        assert checks[name].metadata["batch_id"].value == "b1"
        assert "published earlier in batch b1" in (checks[name].description or "")


def test_a_city_that_failed_is_not_materialized_nor_judged_again():
    report = CityReport("BKK", status="FAILED", error="SUPPLIER_TIMEOUT: x", stages_done=[])
    events = list(
        city_events(
            CityOutcome(report),
            "b1",
            set(ALL_KEYS),
            earlier=lambda *_: pytest.fail("a failed city is not judged again"),
        )
    )
    assert [type(e) for e in events] == [dg.AssetObservation]


def _published(city: str) -> CityOutcome:
    report = CityReport(
        city,
        status="SUCCESS",
        records=3,
        published=3,
        stages_done=["fetch", "normalize", "publish"],
    )
    report.checks = [
        GateResult(check_name=name, passed=True, severity="ERROR", description="ok", metadata={})
        for name in CHECK_NAMES
    ]
    return CityOutcome(report)


def _targets(events: Sequence[object]) -> set[CheckTarget | None]:
    return {e.target_materialization_data for e in events if isinstance(e, dg.AssetCheckEvaluation)}


def test_a_city_s_gates_judge_the_materialization_its_events_just_stored() -> None:
    stored = CheckTarget(run_id="r1", storage_id=7, timestamp=1.0)
    read = CheckTarget(run_id="r0", storage_id=3, timestamp=0.5)
    asked: list[str] = []

    def reading(partition: str) -> CheckTarget:
        asked.append(partition)
        return read

    events = list(
        city_events(
            _published("BKK"), "b1", set(ALL_KEYS), target=reading, stored=lambda _p: stored
        )
    )
    assert _targets(events) == {stored} and asked == []  # known: no read
    # Not remembered (another instance's storage): read back.
    events = list(
        city_events(_published("BKK"), "b1", set(ALL_KEYS), target=reading, stored=lambda _p: None)
    )
    assert _targets(events) == {read} and asked == ["BKK"]
    # normalized_hotels not materialized by these events (a re-execution of the downstream
    # assets): the checks judge its latest materialization, whatever this process stored.
    events = list(
        city_events(
            _published("BKK"),
            "b1",
            {MAPPINGS, DIFFS, PUBLISHED},
            target=reading,
            stored=lambda _p: pytest.fail("not this run's materialization"),
        )
    )
    assert _targets(events) == {read}
