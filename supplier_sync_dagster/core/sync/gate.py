"""The batch gate as a city's sync calls it, after normalization and before publishing.

The checks themselves, their thresholds, profiles and overrides are
``core.records.gates``; this is the hook that ``sync_city(gate=...)`` takes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from supplier_sync_dagster.core.records.gates import (
    CityProfile,
    GateOverride,
    GateResult,
    GateThresholds,
    batch_baselines,
    failure_reason,
    get_city_profile,
    get_gate_thresholds,
    judge_profile,
    list_overrides,
)
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.model import CityReport

log = logging.getLogger(__name__)

PipelineGate = Callable[[SyncDatabase, str, str, CityReport], list[GateResult]]
"""Called after normalization with (db, batch_id, city_code, report); any result that did
not pass stops the city before anything is published."""


def gate_for_pipeline(
    thresholds_for_task: Callable[[str], GateThresholds] | None = None,
    *,
    on_results: Callable[[str, str, list[GateResult]], None] | None = None,
) -> PipelineGate:
    """A gate for ``sync_city(gate=...)`` that runs the checks of ``core.records.gates``.

    It judges the profile that normalization recorded for the city (``report.profile``,
    as recorded, or else read back). Without one (the normalize stage does not record
    profiles) it judges the report's counts and cannot measure schema drift; it says so in
    the log and in the check's metadata. The batch's task and baselines are read once per
    batch in a process (``batch_baselines``), the task's stored thresholds once per
    gate (one gate per run); the city's overrides are read unless ``report.gate_overrides``
    says it had none when it was claimed.

    Args:
        thresholds_for_task: Task code -> thresholds; None reads the task's stored ones.
        on_results: Called with (batch_id, city_code, results) after every evaluation.

    Returns:
        ``gate(db, batch_id, city_code, report)``: one result per check (a failed check
        that was overridden counts as passed).
    """
    stored: dict[str, GateThresholds] = {}

    def gate(
        db: SyncDatabase, batch_id: str, city_code: str, report: CityReport
    ) -> list[GateResult]:
        baselines = batch_baselines(db, batch_id)
        task_code = baselines.task_code
        if thresholds_for_task is not None:
            thresholds = thresholds_for_task(task_code)
        elif task_code in stored:
            thresholds = stored[task_code]
        else:
            with db.engine.connect() as conn:
                thresholds = stored[task_code] = get_gate_thresholds(conn, task_code)
        current = report.profile
        overrides: list[GateOverride] = []
        if current is None or report.gate_overrides is not False:
            with db.engine.connect() as conn:
                if current is None:
                    current = get_city_profile(conn, batch_id=batch_id, shard_key=city_code)
                if report.gate_overrides is not False:
                    overrides = list_overrides(conn, batch_id=batch_id, shard_key=city_code)
        if current is None:
            log.warning(
                "no city profile for %r in batch %s: gating on the report's counts only",
                city_code,
                batch_id,
            )
            current = CityProfile(
                batch_id, task_code, city_code, report.records, report.dead_letters, None
            )
        results = judge_profile(current, baselines.previous.get(city_code), thresholds, overrides)
        if on_results is not None:
            on_results(batch_id, city_code, results)
        reason = failure_reason(results)
        if reason is not None:
            log.warning("quality gate stopped city %r of batch %s: %s", city_code, batch_id, reason)
        return results

    return gate
