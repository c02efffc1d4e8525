"""The Dagster events of one city's outcome, for that city's partition only.

- an ``AssetMaterialization`` per stage the run completed for the city, with the city's own
  metadata (a city that published: all five; one stopped by a quality gate: raw snapshots,
  and normalized hotels when it was normalized; one that failed or lost its lease: what it
  completed before). The assets are ``skippable``, so a ranged run marks exactly the
  partitions it reports (``MaterializeResult`` would mark the whole range: Dagster #17836,
  #18123);
- an ``AssetCheckEvaluation`` per gate and city, on the partitioned (blocking) checks of
  ``normalized_hotels``;
- for a city an earlier run of the batch published (ALREADY_DONE), the same materializations
  with ``published_earlier_in_batch``, and its gates' results again on them;
- for a city that failed, an ``AssetObservation`` of its ``raw_hotel_snapshots`` partition
  with its error code and what happened: its partitions stay unmaterialized, and the UI
  shows why.
"""

from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import dagster as dg

from supplier_sync_dagster.core.records.gates import CHECK_NAMES
from supplier_sync_dagster.core.sync.model import CityReport
from supplier_sync_dagster.core.sync.run import CityOutcome
from supplier_sync_dagster.dagster_instance.events import CheckTarget, check_target
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE, AccountScope
from supplier_sync_dagster.defs.city_keys import (
    DIFFS,
    MAPPINGS,
    NORMALIZED,
    PUBLISHED,
    RAW,
    STAGE_ASSETS,
)
from supplier_sync_dagster.defs.partitions import encode_city_key


def city_materializations(
    outcome: CityOutcome,
    batch_id: str,
    selected: AbstractSet[dg.AssetKey],
    *,
    scope: AccountScope = DEFAULT_SCOPE,
) -> Iterator[dg.AssetMaterialization | dg.AssetObservation]:
    """The city's materializations, one per selected asset of each stage the run completed
    for it, each with the city's own metadata; and the observation of a city that failed.

    A city an earlier run of the batch published (ALREADY_DONE) is materialized again for
    every selected asset, its metadata saying so: the run planned its partitions, and a
    planned partition the run does not materialize is failed in the UI once the run fails.

    Args:
        outcome: The city's outcome.
        batch_id: The run's batch.
        selected: The assets the run materializes.
        scope: The account whose assets these are.
    """
    partition = encode_city_key(outcome.city_code)
    metadata = city_metadata(outcome, batch_id)
    for stage in outcome.report.stages_done:
        for plain in STAGE_ASSETS[stage]:
            key = scope.key(plain.path[-1])
            if key in selected:
                yield dg.AssetMaterialization(key, partition=partition, metadata=metadata[plain])
    if outcome.status == "FAILED":
        yield dg.AssetObservation(
            scope.key(RAW.path[-1]), partition=partition, metadata=metadata[RAW]
        )


def city_checks(
    outcome: CityOutcome,
    batch_id: str,
    selected: AbstractSet[dg.AssetKey],
    *,
    target: Callable[[str], CheckTarget | None] = lambda _: None,
    earlier: Callable[[dg.AssetCheckKey, str], dg.AssetCheckEvaluation | None] = (
        lambda _check, _partition: None
    ),
    stored: Callable[[str], CheckTarget | None] = lambda _: None,
    scope: AccountScope = DEFAULT_SCOPE,
) -> Iterator[dg.AssetCheckEvaluation]:
    """The city's gate evaluations, asked once its materializations are stored: one per gate
    that judged it, on the materialization of ``normalized_hotels`` it judged.

    Args:
        outcome: The city's outcome.
        batch_id: The run's batch.
        selected: The assets the run materializes.
        target: Partition -> the latest materialization of ``normalized_hotels`` for it,
            read after this city's materializations are stored. An evaluation that targets
            it is the partition's current check status in the UI; one without a target is
            ignored once the partition has any materialization.
        earlier: (check, partition) -> the check's latest result on the partition, for a
            city an earlier run of the batch published (:func:`earlier_evaluations`).
        stored: Partition -> the materialization of ``normalized_hotels`` for it that this
            process stored last, if known without a read: asked instead of ``target`` once
            these events have materialized it.
        scope: The account whose assets these are.
    """
    partition = encode_city_key(outcome.city_code)
    normalized = "normalize" in outcome.report.stages_done and (
        scope.key(NORMALIZED.path[-1]) in selected
    )
    if normalized:
        # The checks judge the materialization just stored: known, when remembered.
        target = _first(stored, target)
    # The gates run whenever a city is normalized or published, selected or not (a
    # backfill's re-execution of a gated city asks for its downstream assets only, and its
    # overridden gate passes then): every result is reported on the city's partition.
    judged = target(partition) if outcome.checks else None
    for result in outcome.checks:
        yield dg.AssetCheckEvaluation(
            asset_key=scope.key(NORMALIZED.path[-1]),
            check_name=result.check_name,
            passed=result.passed,
            severity=(
                dg.AssetCheckSeverity.WARN
                if result.severity == "WARN"
                else dg.AssetCheckSeverity.ERROR
            ),
            description=result.description,
            metadata={
                "batch_id": batch_id,
                "city": outcome.city_code,
                "overridden": result.overridden,
                "measured": dg.MetadataValue.json(result.metadata),
            },
            blocking=True,
            partition=partition,
            target_materialization_data=judged,
        )
    if outcome.status == "ALREADY_DONE":
        yield from earlier_evaluations(
            outcome.city_code, batch_id, earlier=earlier, target=target, scope=scope
        )


def _first(
    *finders: Callable[[str], CheckTarget | None],
) -> Callable[[str], CheckTarget | None]:
    """The first answer of ``finders`` that is not None, asked in order."""

    def find(partition: str) -> CheckTarget | None:
        for finder in finders:
            found = finder(partition)
            if found is not None:
                return found
        return None

    return find


def earlier_evaluations(
    city: str,
    batch_id: str,
    *,
    earlier: Callable[[dg.AssetCheckKey, str], dg.AssetCheckEvaluation | None],
    target: Callable[[str], CheckTarget | None],
    scope: AccountScope = DEFAULT_SCOPE,
) -> Iterator[dg.AssetCheckEvaluation]:
    """The gates' results an earlier run of the batch reported on the city's partition,
    reported again on the materialization this run made of it: the run planned the
    partition's checks, and a planned check it does not evaluate shows as skipped, or as
    failed to execute once the run fails.

    A gate with no result of this batch on the partition (the run that published the city
    died before it reported it) passed or was overridden, or the city would not have
    published: it is reported passed, saying so; a result of another batch is not repeated.
    """
    partition = encode_city_key(city)
    key = scope.key(NORMALIZED.path[-1])
    judged = target(partition)
    for name in CHECK_NAMES:
        found = earlier(dg.AssetCheckKey(key, name), partition)
        batch = found.metadata.get("batch_id") if found is not None else None
        if found is None or batch is None or batch.value != batch_id:
            yield dg.AssetCheckEvaluation(
                asset_key=key,
                check_name=name,
                passed=True,
                description=(
                    f"published earlier in batch {batch_id}: the gate passed or was "
                    "overridden then (its measures were not reported)"
                ),
                metadata={
                    "batch_id": batch_id,
                    "city": city,
                    "published_earlier_in_batch": batch_id,
                },
                blocking=True,
                partition=partition,
                target_materialization_data=judged,
            )
            continue
        yield dg.AssetCheckEvaluation(
            asset_key=key,
            check_name=name,
            passed=found.passed,
            severity=found.severity,
            description=found.description,
            metadata={**found.metadata, "published_earlier_in_batch": batch_id},
            blocking=found.blocking,
            partition=partition,
            target_materialization_data=judged,
        )


def latest_record(
    instance: dg.DagsterInstance, key: dg.AssetKey, partition: str
) -> dg.EventLogRecord | None:
    """The partition's latest materialization of ``key``, if any."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition]), limit=1
    ).records
    return records[0] if records else None


def latest_target(
    instance: dg.DagsterInstance, key: dg.AssetKey, partition: str
) -> CheckTarget | None:
    """The partition's latest materialization of ``key``, as a check evaluation's target."""
    record = latest_record(instance, key, partition)
    return check_target(record) if record is not None else None


def request_budget_metadata(outcome: CityOutcome) -> dict[str, Any]:
    """What the city's requests cost of the supplier's budget: 429s (and per minute), the
    seconds waited for the rate limiter and, when it adapts, the rate it had learnt."""
    minutes, use = outcome.seconds / 60, outcome.supplier
    return {
        "supplier_requests": use.requests,
        "supplier_429": use.throttled,
        "supplier_429_per_minute": round(use.throttled / minutes, 3) if minutes else 0.0,
        "rate_limiter_wait_seconds": round(use.waited, 3),
        **({"governed_rate": round(use.rate, 2)} if use.rate is not None else {}),
    }


def city_metadata(outcome: CityOutcome, batch_id: str) -> dict[dg.AssetKey, dict[str, Any]]:
    """Each asset's metadata for one city: its own counts, timings and batch."""
    r = outcome.report
    common: dict[str, Any] = {
        "batch_id": batch_id,
        "city": r.city_code,
        "city_status": r.status,
        "seconds": round(outcome.seconds, 3),
    }
    if outcome.helped:
        common["helped_another_run"] = True
    if r.status == "FAILED":
        # The precise code (SUPPLIER_TIMEOUT, WALK_RUNAWAY, INTERNAL_ERROR...) and what happened.
        common["error_code"] = r.error_code or ""
        common["error"] = r.error or ""
    if r.status == "ALREADY_DONE":
        common["published_earlier_in_batch"] = batch_id
        common["reported_from"] = (
            f"the sync database: an earlier run of batch {batch_id} published it; "
            "this run did not sync it again"
        )
    normalized_ok = r.records - r.dead_letters
    walk = walk_metadata(r)
    return {
        RAW: {
            **common,
            "pages": r.pages_fetched,
            "records": r.records,
            "resumed_from_page": r.resumed_from_page if r.resumed_from_page is not None else "",
            "fetch_seconds": round(r.seconds.get("fetch", 0.0), 3),
            "cpu_fetch_seconds": round(r.cpu_seconds.get("fetch", 0.0), 3),
            **walk,
            **request_budget_metadata(outcome),
        },
        NORMALIZED: {
            **common,
            "records": r.records,
            "dead_letters": r.dead_letters,
            "dead_letters_by_code": dg.MetadataValue.json(dict(r.dead_letters_by_code)),
            "bad_record_ratio": round(r.dead_letters / r.records, 4) if r.records else 0.0,
            "moved_hotels": r.moved,
            "gate": r.error if r.status == "GATED" and r.error else "passed",
            "normalize_seconds": round(r.seconds.get("normalize", 0.0), 3),
            "cpu_normalize_seconds": round(r.cpu_seconds.get("normalize", 0.0), 3),
            **(
                {"dead_letters_resolved_by_replay": outcome.resolved_dead_letters}
                if outcome.resolved_dead_letters
                else {}
            ),
        },
        MAPPINGS: {
            **common,
            "hotels": normalized_ok - r.duplicates,
            "duplicates": r.duplicates,
        },
        DIFFS: {
            **common,
            "diffs_by_type": dg.MetadataValue.json(dict(r.diffs_by_type)),
            "diffs_by_action": dg.MetadataValue.json(dict(r.diffs_by_action)),
            "held_for_review": r.held_for_review,
            "review_command": f"supplier-sync review list --batch {batch_id}",
        },
        PUBLISHED: {
            **common,
            "records": r.records,
            "published": r.published,
            "skipped": r.skipped,
            "dead_letters": r.dead_letters,
            "dead_letters_by_code": dg.MetadataValue.json(dict(r.dead_letters_by_code)),
            "bad_record_ratio": round(r.dead_letters / r.records, 4) if r.records else 0.0,
            "diffs_by_type": dg.MetadataValue.json(dict(r.diffs_by_type)),
            "diffs_by_action": dg.MetadataValue.json(dict(r.diffs_by_action)),
            "pages": r.pages_fetched,
            "resumed_from_page": r.resumed_from_page if r.resumed_from_page is not None else "",
            "counts_add_up": r.records == r.published + r.skipped + r.dead_letters,
            "publish_seconds": round(r.seconds.get("publish", 0.0), 3),
            "cpu_publish_seconds": round(r.cpu_seconds.get("publish", 0.0), 3),
            **({"listing_drift": walk["listing_drift"]} if walk else {}),
        },
    }


def walk_metadata(report: CityReport) -> dict[str, Any]:
    """What the city's walk saw, for its metadata (nothing when no listing was walked):
    ``listing_drift`` is ``none``, SHIFTED (seen and verified), UNVERIFIED or UNCHECKED."""
    w = report.walk
    if w is None:
        return {}
    return {
        "listing_drift": w.drift or "none",
        "listing_shifts": w.shifts,
        "walk_fallbacks": w.fallbacks,
        "walk_probes": w.probes,
        "walk_recovered": w.recovered,
        "walk_requests": w.requests,
    }


def published_city(
    scope: AccountScope, city: str, batch_id: str, mode: str, published: int, **more: str
) -> dg.AssetMaterialization:
    """A city's ``published_hotels`` materialization by a run that is not a full sync
    (compensation, a change-feed window): what it published there, on that city's partition.

    Args:
        scope: The account.
        city: The supplier's city code.
        batch_id: The run's batch.
        mode: The batch's sync mode (``REFRESH``, ``INCREMENTAL``).
        published: Hotels the run published in the city.
        **more: Further metadata (the window's watermark).
    """
    return dg.AssetMaterialization(
        scope.key(PUBLISHED.path[-1]),
        partition=encode_city_key(city),
        metadata={
            "batch_id": batch_id,
            "city": city,
            "sync_mode": mode,
            "published": published,
            **more,
        },
    )
