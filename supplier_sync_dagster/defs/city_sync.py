"""The city-partitioned asset graph: raw snapshots → normalized → mappings → diffs → published.

One multi-asset step works every city of its run (a backfill groups cities into runs with
``BackfillPolicy.multi_run``), so that orchestration is a small share of the wall time: a
step per stage and city would cost a process start per step. The run's work is
``core.run`` (batch, order, held cities, helping); this module turns each city's outcome,
as the city finishes, into Dagster events **for that city's partition only**:

- an ``AssetMaterialization`` per stage the run completed for the city, with the city's own
  metadata (a city that published: all five; one stopped by a quality gate: raw snapshots,
  and normalized hotels when it was normalized; one that failed or lost its lease: what it
  completed before). The assets are ``skippable``, so a ranged run marks exactly the
  partitions it reports (Dagster #17836 and #18123 concern ``MaterializeResult``, which
  marks the whole range);
- an ``AssetCheckEvaluation`` per gate and city, on the partitioned (blocking) checks of
  ``normalized_hotels``;
- a step failure when a city did not publish, so that a backfill lists exactly those
  cities' partitions as failed and its "re-execute from failure" (or a run's) re-syncs them.

The batch is the run's trigger: an explicit ``supplier_sync/trigger_id`` tag (CLI), else the
backfill id (a re-executed backfill's root backfill id), else a re-executed run's original
run's trigger, else the run id. A re-execution therefore continues its original batch: cities
already published are not synced again, failed cities resume from their checkpoints, and a
gate override recorded for the batch applies.
"""

import functools
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import dagster as dg
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    # Not exported by Dagster 1.13; what its own AssetCheckResult builds for a partition.
    AssetCheckEvaluationTargetMaterializationData as TargetMaterialization,
)

from supplier_sync_dagster.core.errors import TaskDisabled, TriggerSkipped
from supplier_sync_dagster.core.leasing.batches import TriggerSource, get_batch, progress_line
from supplier_sync_dagster.core.leasing.leases import make_worker_id
from supplier_sync_dagster.core.records.gates import CHECK_NAMES
from supplier_sync_dagster.core.settings import load_settings
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync.model import Stage
from supplier_sync_dagster.core.sync.run import (
    CityOutcome,
    RunRequest,
    WorkerIO,
    WorkerProcesses,
    auto_processes,
    not_done,
    plan_run,
    run_cities,
)
from supplier_sync_dagster.dagster_instance.storage import one_event_transaction
from supplier_sync_dagster.defs.accounts import (
    DEFAULT_SCOPE,
    AccountScope,
    per_account,
    resources_of,
)
from supplier_sync_dagster.defs.partitions import decode_city_key, encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SupplierResource,
    SyncDatabaseResource,
    sync_settings,
)

TRIGGER_TAG = "supplier_sync/trigger_id"
SOURCE_TAG = "supplier_sync/trigger_source"
ROOT_BACKFILL_TAG = "dagster/root_backfill_id"
BACKFILL_TAG = "dagster/backfill"

GROUP = DEFAULT_SCOPE.group
RAW = dg.AssetKey("raw_hotel_snapshots")
NORMALIZED = dg.AssetKey("normalized_hotels")
MAPPINGS = dg.AssetKey("hotel_mappings")
DIFFS = dg.AssetKey("hotel_diffs")
PUBLISHED = dg.AssetKey("published_hotels")
FRESHNESS_CHECK = "city_freshness"

STAGE_ASSETS: dict[Stage, tuple[dg.AssetKey, ...]] = {
    "fetch": (RAW,),
    "normalize": (NORMALIZED,),
    "publish": (MAPPINGS, DIFFS, PUBLISHED),
}
_SOURCES: tuple[TriggerSource, ...] = ("CRON", "MANUAL", "COMPENSATION", "SENSOR", "BACKFILL")


def _specs(scope: AccountScope) -> list[dg.AssetSpec]:
    # Built in a function: the defs loader collects module-level AssetSpecs as assets.
    raw, normalized, mappings, diffs, published = (
        scope.key(k.path[-1]) for k in (RAW, NORMALIZED, MAPPINGS, DIFFS, PUBLISHED)
    )
    return [
        dg.AssetSpec(
            raw,
            group_name=scope.group,
            skippable=True,
            description=(
                "Each supplier page's exact bytes, gzip in the payload store, with a RAW "
                "supplier_sync_snapshot row (sha256, ref); the shard checkpoint advances per page."
            ),
        ),
        dg.AssetSpec(
            normalized,
            deps=[raw],
            group_name=scope.group,
            skippable=True,
            description=(
                "Supplier records turned into the platform model (trimmed text, ISO country and "
                "currency, E.164 phone, Decimal money); NORMALIZED snapshots; every record that "
                "cannot be parsed or is out of its domain becomes a dead letter with a precise code."
            ),
        ),
        dg.AssetSpec(
            mappings,
            deps=[normalized],
            group_name=scope.group,
            skippable=True,
            description=(
                "(supplier, hotel) → platform resource id and (hotel, room, rate plan) → offer id, "
                "allocated once by unique keys."
            ),
        ),
        dg.AssetSpec(
            diffs,
            deps=[mappings],
            group_name=scope.group,
            skippable=True,
            description="Field-level diffs against the published hotels, with risk and action (supplier_sync_diff_log).",
        ),
        dg.AssetSpec(
            published,
            deps=[diffs],
            group_name=scope.group,
            skippable=True,
            description=(
                "Platform hotels and offers, version-guarded (an older supplier version never "
                "overwrites a newer), with outbox events in the same transaction."
            ),
        ),
    ]


_CHECK_DESCRIPTIONS = {
    "bad_record_ratio": (
        "Blocking gate: the share of a city's records that became dead letters stays under "
        "the task's threshold; a city over it publishes nothing until an operator overrides."
    ),
    "record_count": (
        "Blocking gate: a city's record count does not drop beyond the task's threshold "
        "against its previous successful batch, and never falls to zero from some."
    ),
    "schema_drift": (
        "Blocking gate: no top-level field of the supplier's records appears or disappears "
        "against the previous successful batch (e.g. geo renamed to location)."
    ),
}


def _check_specs(scope: AccountScope) -> list[dg.AssetCheckSpec]:
    with warnings.catch_warnings():
        # Partitioned checks are a preview in Dagster 1.13; they are what shows a gate's
        # result on the city it judged.
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return [
            *(
                dg.AssetCheckSpec(
                    name,
                    asset=scope.key(NORMALIZED.path[-1]),
                    blocking=True,
                    description=_CHECK_DESCRIPTIONS[name],
                    partitions_def=scope.partitions,
                )
                for name in CHECK_NAMES
            ),
            # Judged for every city by the sync_health asset (defs/health.py), not here: a
            # city's freshness is about the syncs that did not happen.
            dg.AssetCheckSpec(
                FRESHNESS_CHECK,
                asset=scope.key(PUBLISHED.path[-1]),
                description="The city was synced successfully within the task's freshness "
                "SLA (alert threshold freshness_sla_hours); reported by sync_health.",
                partitions_def=scope.partitions,
            ),
        ]


def trigger_of(
    tags: Mapping[str, str],
    run_id: str,
    *,
    root: tuple[Mapping[str, str], str] | None = None,
) -> tuple[str, TriggerSource]:
    """The batch trigger of a run: (trigger id, trigger source).

    Args:
        tags: The run's tags.
        run_id: The run's id.
        root: For a re-execution, the original (root) run's tags and id: a re-execution
            continues the batch of its original, whose backfill tags Dagster drops when the
            backfill has ended.
    """
    if tags.get(TRIGGER_TAG):
        source = tags.get(SOURCE_TAG, "MANUAL")
        return tags[TRIGGER_TAG], next((s for s in _SOURCES if s == source), "MANUAL")
    backfill = tags.get(ROOT_BACKFILL_TAG) or tags.get(BACKFILL_TAG)
    if backfill:
        return backfill, "BACKFILL"
    if root is not None:
        return trigger_of(root[0], root[1])
    if tags.get("dagster/schedule_name"):
        return run_id, "CRON"
    if tags.get("dagster/sensor_name"):
        return run_id, "SENSOR"
    return run_id, "MANUAL"


def _root_of(context: dg.AssetExecutionContext) -> tuple[Mapping[str, str], str] | None:
    run = context.run
    if not run.root_run_id or run.root_run_id == run.run_id:
        return None
    root = context.instance.get_run_by_id(run.root_run_id)
    return (dict(root.tags), root.run_id) if root is not None else None


# A backfill's cities per run. A run spreads its cities over one worker process per core,
# so more runs at once would only share the same cores (a 1,000-city backfill in runs of
# 50 did 1,420 hotels/s, in one run ~3,000); the cap keeps one run's plan bounded.
BACKFILL_CITIES_PER_RUN = 1000


@functools.cache
def build_city_sync(
    scope: AccountScope, cities_per_run: int = BACKFILL_CITIES_PER_RUN
) -> dg.AssetsDefinition:
    """The account's city sync: one multi-asset over its five stages and its city partitions
    (a backfill of them runs ``cities_per_run`` cities per run)."""

    @dg.multi_asset(
        specs=_specs(scope),
        check_specs=_check_specs(scope),
        partitions_def=scope.partitions,
        backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=cities_per_run),
        pool=scope.pool,
        name=scope.name("city_sync"),
        can_subset=True,
        required_resource_keys={"sync_db", "payloads", "governance", scope.supplier_key},
        description=(
            "Syncs the run's cities from the supplier to the platform catalog, stage by stage; "
            "each city's partitions are marked with that city's own outcome. Materializing "
            "normalized_hotels and downstream without raw_hotel_snapshots replays each city's "
            "latest stored raw pages without calling the supplier."
        ),
    )
    def city_sync(
        context: dg.AssetExecutionContext,
    ) -> Iterator[dg.AssetMaterialization | dg.AssetCheckEvaluation]:
        yield from _sync_cities(
            context,
            scope,
            **resources_of(context, scope, "sync_db", "payloads", "governance"),
        )

    return city_sync


def _sync_cities(
    context: dg.AssetExecutionContext,
    scope: AccountScope,
    *,
    sync_db: SyncDatabaseResource,
    payloads: PayloadStoreResource,
    supplier: SupplierResource,
    governance: GovernanceResource,
) -> Iterator[dg.AssetMaterialization | dg.AssetCheckEvaluation]:
    """Claims, fetches, normalizes, gates, maps, diffs and publishes each city of the run."""
    started = time.perf_counter()
    selected = context.selected_asset_keys
    trigger_id, source = trigger_of(context.run.tags, context.run.run_id, root=_root_of(context))
    request = RunRequest(
        trigger_id=trigger_id,
        source=source,
        cities=[decode_city_key(k) for k in context.partition_keys],
        replay=scope.key(NORMALIZED.path[-1]) in selected
        and scope.key(RAW.path[-1]) not in selected,
        threads=supplier.city_threads,
        processes=supplier.worker_processes,
        help_other_runs=supplier.help_other_runs,
    )
    settings = sync_settings(supplier, sync_db, governance)
    db = sync_db.open()
    store = payloads.open()
    outcomes: list[CityOutcome] = []
    try:
        # A replay reads stored pages only: it does not even open a supplier client.
        with nullcontext(None) if request.replay else supplier.client() as client:
            try:
                plan = plan_run(db, store, client, request, settings)
            except (TaskDisabled, TriggerSkipped) as err:
                word = "refused" if isinstance(err, TaskDisabled) else "skipped"
                blocking = getattr(err, "blocking_batch_id", None) or ""
                raise dg.Failure(
                    description=str(err) if word == "skipped" else f"sync {word}: {err}",
                    metadata={"blocking_batch_id": blocking},
                    allow_retries=False,
                ) from None
            for note in plan.notes:
                context.log.warning(note)
            context.log.info(
                f"batch {plan.batch.batch_id} (trigger {trigger_id}, {source}"
                f"{', replay' if request.replay else ''}): {len(plan.cities)} cities"
            )
            progress = _Progress()
            worker_id = make_worker_id("supplier-sync")
            processes = auto_processes(request, plan)
            if processes:
                context.log.info(f"syncing the cities in {processes} worker processes")
            requests = 0
            for outcome in run_cities(
                db,
                store,
                client,
                plan,
                request,
                settings,
                worker_id=worker_id,
                processes=WorkerProcesses(
                    processes, _worker_io(sync_db, payloads, supplier, client)
                ),
            ):
                requests += outcome.requests if processes else 0
                outcomes.append(outcome)
                # Dagster stores each event as it is yielded, on this thread: the city's
                # log line, materializations and check evaluations are one transaction.
                with one_event_transaction(context.instance):
                    _log_city(context, outcome)
                    yield from city_events(
                        outcome,
                        plan.batch.batch_id,
                        selected,
                        scope=scope,
                        target=lambda partition: _latest(
                            context.instance, scope.key(NORMALIZED.path[-1]), partition
                        ),
                        reported=lambda key, partition: _reported(
                            context.instance, key, partition, plan.batch.batch_id
                        ),
                    )
                    progress.show(context, db, plan.batch.batch_id)
            progress.show(context, db, plan.batch.batch_id, final=True)
            if client is not None:
                # The worker processes' requests come with their cities' outcomes.
                requests += client.stats().requests
                context.log.info(
                    f"supplier: {requests} requests in {time.perf_counter() - started:.1f} s"
                )
    finally:
        db.dispose()
    failed = not_done(outcomes)
    unreplayed = plan.missing
    if failed or unreplayed:
        cities = {
            status: {o.city_code: o.report.error or "" for o in group}
            for status, group in failed.items()
        }
        parts = [f"{len(group)} {status}" for status, group in sorted(failed.items())]
        if unreplayed:
            parts.append(f"{len(unreplayed)} without stored raw pages to replay")
        raise dg.Failure(
            description=(
                f"{len(outcomes) - sum(len(g) for g in failed.values())} of "
                f"{len(request.cities)} cities published; not published: {', '.join(parts)}. "
                "Re-executing the run (or the backfill from failure) resumes exactly these "
                "cities in the same batch; gated cities publish once their gate is "
                "overridden (supplier-sync gate override)"
            ),
            metadata={
                "batch_id": plan.batch.batch_id,
                "failed_cities": dg.MetadataValue.json(cities.get("FAILED", {})),
                "gated_cities": dg.MetadataValue.json(cities.get("GATED", {})),
                "lease_lost_cities": dg.MetadataValue.json(cities.get("LEASE_LOST", {})),
                "cities_without_raw_pages": dg.MetadataValue.json(unreplayed),
            },
        )


city_sync = build_city_sync(DEFAULT_SCOPE)


@dg.definitions
def defs() -> dg.Definitions:
    """Every account's city sync (``SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN`` read now)."""
    per_run = load_settings().backfill_cities_per_run or BACKFILL_CITIES_PER_RUN
    return per_account(lambda scope: dg.Definitions(assets=[build_city_sync(scope, per_run)]))


def _worker_io(
    sync_db: SyncDatabaseResource,
    payloads: PayloadStoreResource,
    supplier: SupplierResource,
    client: SupplierClient | None,
) -> Callable[[], AbstractContextManager[WorkerIO]]:
    """What a worker process of the run opens: its own connections, the run's rate limit."""
    limiter = client.rate_limiter if client is not None else None

    @contextmanager
    def open_io() -> Iterator[WorkerIO]:
        db = sync_db.open()
        try:
            with supplier.client(rate_limiter=limiter) as own:
                yield WorkerIO(db, payloads.open(), own)
        finally:
            db.dispose()

    return open_io


def _log_city(context: dg.AssetExecutionContext, outcome: CityOutcome) -> None:
    r = outcome.report
    log = context.log.info if outcome.done else context.log.error
    log(
        f"city {r.city_code!r}: {r.status}, {r.records} records, "
        f"{r.published} published, {r.dead_letters} dead letters"
        + (" (helping another run)" if outcome.helped else "")
        + (
            f", {outcome.resolved_dead_letters} dead letters resolved by replay"
            if outcome.resolved_dead_letters
            else ""
        )
        + (f" ({r.error})" if r.error else "")
    )


def city_events(
    outcome: CityOutcome,
    batch_id: str,
    selected: AbstractSet[dg.AssetKey],
    *,
    target: Callable[[str], TargetMaterialization | None] = lambda _: None,
    reported: Callable[[dg.AssetKey, str], bool] = lambda _key, _partition: False,
    scope: AccountScope = DEFAULT_SCOPE,
) -> Iterator[dg.AssetMaterialization | dg.AssetCheckEvaluation]:
    """The Dagster events of one city's outcome, for its partition only.

    One materialization per selected asset of each stage the run completed for the city,
    each with the city's own metadata, and one evaluation per gate that judged it.

    Args:
        outcome: The city's outcome.
        batch_id: The run's batch.
        selected: The assets the run materializes.
        target: Partition -> the latest materialization of ``normalized_hotels`` for it,
            read after this city's materializations are stored. An evaluation that targets
            it is the partition's current check status in the UI; one without a target is
            ignored once the partition has any materialization.
        reported: (asset, partition) -> the partition's latest materialization is of this
            batch already. A city an earlier run of the batch published (ALREADY_DONE) is
            reported only for the assets that are not: a backfill may have asked that run
            for some of its assets and this one for the others.
    """
    partition = encode_city_key(outcome.city_code)
    metadata = city_metadata(outcome, batch_id)
    earlier = outcome.status == "ALREADY_DONE"
    for stage in outcome.report.stages_done:
        for plain in STAGE_ASSETS[stage]:
            key = scope.key(plain.path[-1])
            if key in selected and not (earlier and reported(key, partition)):
                yield dg.AssetMaterialization(key, partition=partition, metadata=metadata[plain])
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


def _latest_record(
    instance: dg.DagsterInstance, key: dg.AssetKey, partition: str
) -> dg.EventLogRecord | None:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition]), limit=1
    ).records
    return records[0] if records else None


def _latest(
    instance: dg.DagsterInstance, key: dg.AssetKey, partition: str
) -> TargetMaterialization | None:
    record = _latest_record(instance, key, partition)
    if record is None:
        return None
    return TargetMaterialization(
        run_id=record.event_log_entry.run_id,
        storage_id=record.storage_id,
        timestamp=record.timestamp,
    )


def _reported(
    instance: dg.DagsterInstance, key: dg.AssetKey, partition: str, batch_id: str
) -> bool:
    record = _latest_record(instance, key, partition)
    mat = record.asset_materialization if record is not None else None
    found = mat.metadata.get("batch_id") if mat is not None else None
    return found is not None and found.value == batch_id


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
    if r.status == "ALREADY_DONE":
        common["reported_from"] = "the sync database: an earlier run of the batch published it"
    normalized_ok = r.records - r.dead_letters
    return {
        RAW: {
            **common,
            "pages": r.pages_fetched,
            "records": r.records,
            "resumed_from_page": r.resumed_from_page if r.resumed_from_page is not None else "",
            "fetch_seconds": round(r.seconds.get("fetch", 0.0), 3),
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
        },
    }


PROGRESS_TAG = "supplier_sync/progress"
PROGRESS_INTERVAL_SECONDS = 2.0


class _Progress:
    """The batch's progress as a run tag, visible while the run works.

    Updated at most every ``PROGRESS_INTERVAL_SECONDS`` and once when the run's cities are
    done: each update reads the batch and writes a run tag, which a run of many
    small cities would otherwise pay after every city.
    """

    def __init__(self) -> None:
        self._last = float("-inf")

    def show(
        self,
        context: dg.AssetExecutionContext,
        db: SyncDatabase,
        batch_id: str,
        *,
        final: bool = False,
    ) -> None:
        now = time.monotonic()
        if not final and now - self._last < PROGRESS_INTERVAL_SECONDS:
            return
        self._last = now
        try:
            with db.engine.connect() as conn:
                line = progress_line(get_batch(conn, batch_id), db.clock.read(conn))
            context.instance.add_run_tags(context.run.run_id, {PROGRESS_TAG: line})
        except Exception as err:  # progress is for people; it never stops a sync
            context.log.debug(f"progress tag not updated: {err}")
