"""The city-partitioned asset graph: raw snapshots → normalized → mappings → diffs → published.

One multi-asset step works every city of its run (a backfill groups cities into runs with
``BackfillPolicy.multi_run``), so that orchestration is a small share of the wall time: a
step per stage and city would cost a process start per step. Each city runs its stages
under its own shard lease (``core.pipeline.sync_city``); the five assets are materialized
together with metadata for each stage, and lineage shows the chain.

The batch is the run's trigger: the backfill id for backfill runs (all runs of one backfill
share one batch), else an explicit ``supplier_sync/trigger_id`` tag (CLI), else the run id.
"""

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import dagster as dg

from supplier_sync_dagster.core.batches import (
    Batch,
    TaskSpec,
    TriggerSource,
    add_shards,
    create_batch,
    get_batch,
    progress_line,
)
from supplier_sync_dagster.core.db import SyncDatabase
from supplier_sync_dagster.core.errors import TaskDisabled
from supplier_sync_dagster.core.gates import CHECK_NAMES, GateResult, gate_for_pipeline
from supplier_sync_dagster.core.leases import make_worker_id
from supplier_sync_dagster.core.payloads import PayloadStore
from supplier_sync_dagster.core.pipeline import (
    CityReport,
    SyncSettings,
    help_other_workers,
    largest_first,
    sync_cities,
    sync_city,
)
from supplier_sync_dagster.core.replay import (
    prepare_replay,
    record_city_list,
    resolve_replayed_dead_letters,
    stored_city_countries,
)
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.tasks import ensure_task, require_enabled
from supplier_sync_dagster.defs.partitions import city_partitions, decode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SupplierResource,
    SyncDatabaseResource,
)

TRIGGER_TAG = "supplier_sync/trigger_id"
SOURCE_TAG = "supplier_sync/trigger_source"
GROUP = "supplier_sync"

RAW = dg.AssetKey("raw_hotel_snapshots")
NORMALIZED = dg.AssetKey("normalized_hotels")
MAPPINGS = dg.AssetKey("hotel_mappings")
DIFFS = dg.AssetKey("hotel_diffs")
PUBLISHED = dg.AssetKey("published_hotels")


def _specs() -> list[dg.AssetSpec]:
    # Built in a function: the defs loader collects module-level AssetSpecs as assets.
    return [
        dg.AssetSpec(
            RAW,
            group_name=GROUP,
            description=(
                "Each supplier page's exact bytes, gzip in the payload store, with a RAW "
                "supplier_sync_snapshot row (sha256, ref); the shard checkpoint advances per page."
            ),
        ),
        dg.AssetSpec(
            NORMALIZED,
            deps=[RAW],
            group_name=GROUP,
            description=(
                "Supplier records turned into the platform model (trimmed text, ISO country and "
                "currency, E.164 phone, Decimal money); NORMALIZED snapshots; every record that "
                "cannot be parsed or is out of its domain becomes a dead letter with a precise code."
            ),
        ),
        dg.AssetSpec(
            MAPPINGS,
            deps=[NORMALIZED],
            group_name=GROUP,
            description=(
                "(supplier, hotel) → platform resource id and (hotel, room, rate plan) → offer id, "
                "allocated once by unique keys."
            ),
        ),
        dg.AssetSpec(
            DIFFS,
            deps=[MAPPINGS],
            group_name=GROUP,
            description="Field-level diffs against the published hotels, with risk and action (supplier_sync_diff_log).",
        ),
        dg.AssetSpec(
            PUBLISHED,
            deps=[DIFFS],
            group_name=GROUP,
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


def _check_specs() -> list[dg.AssetCheckSpec]:
    return [
        dg.AssetCheckSpec(
            name, asset=NORMALIZED, blocking=True, description=_CHECK_DESCRIPTIONS[name]
        )
        for name in CHECK_NAMES
    ]


def trigger_of(tags: dict[str, str], run_id: str) -> tuple[str, TriggerSource]:
    """The batch trigger of a run: (trigger id, trigger source)."""
    backfill = tags.get("dagster/backfill")
    if tags.get(TRIGGER_TAG):
        source = tags.get(SOURCE_TAG, "MANUAL")
        return tags[TRIGGER_TAG], source if source in (
            "CRON",
            "MANUAL",
            "COMPENSATION",
            "SENSOR",
            "BACKFILL",
        ) else "MANUAL"  # type: ignore[return-value]
    if backfill:
        return backfill, "BACKFILL"
    if tags.get("dagster/schedule_name"):
        return run_id, "CRON"
    if tags.get("dagster/sensor_name"):
        return run_id, "SENSOR"
    return run_id, "MANUAL"


def resolve_batch(
    db: SyncDatabase,
    supplier: SupplierResource,
    trigger_id: str,
    source: TriggerSource,
    cities: list[str],
) -> Batch:
    """The batch of this trigger (created once, or adopted), with a shard per city of the run.

    The run creates its task if it is missing and never changes it: policy, status, cron
    and thresholds are the operator's (``supplier-sync task set``).

    Raises:
        dg.Failure: The task is DISABLED, or its concurrency policy skipped this trigger.
    """
    ensure_task(
        db,
        TaskSpec(task_code=supplier.task_code, supplier_id=supplier.supplier_id),
        created_by=f"run {trigger_id}"[:64],
        reason="created by its first run, with the default settings",
    )
    try:
        with db.engine.connect() as conn:
            require_enabled(conn, supplier.task_code)
        decision = create_batch(
            db, task_code=supplier.task_code, trigger_id=trigger_id, trigger_source=source
        )
    except TaskDisabled as err:
        raise dg.Failure(description=f"sync refused: {err}", allow_retries=False) from None
    if decision.batch is None:
        raise dg.Failure(
            description=f"sync skipped: {decision.reason}",
            metadata={"blocking_batch_id": decision.blocking_batch_id or ""},
            allow_retries=False,
        )
    add_shards(db, decision.batch.batch_id, cities)
    with db.engine.connect() as conn:
        return get_batch(conn, decision.batch.batch_id)


def _summary(reports: list[CityReport], batch: Batch, seconds: float) -> dict[str, Any]:
    total: Counter[str] = Counter()
    for r in reports:
        total.update(
            {
                "pages": r.pages_fetched,
                "records": r.records,
                "published": r.published,
                "dead_letters": r.dead_letters,
                "skipped": r.skipped,
                "duplicates": r.duplicates,
            }
        )
    return {"batch_id": batch.batch_id, "seconds": seconds, **total}


@dg.multi_asset(
    specs=_specs(),
    check_specs=_check_specs(),
    partitions_def=city_partitions,
    backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=50),
    pool="supplier_api",
    name="city_sync",
    can_subset=True,
    description=(
        "Syncs the run's cities from the supplier to the platform catalog, stage by stage. "
        "Materializing normalized_hotels and downstream without raw_hotel_snapshots replays "
        "each city's latest stored raw pages without calling the supplier."
    ),
)
def city_sync(
    context: dg.AssetExecutionContext,
    sync_db: SyncDatabaseResource,
    payloads: PayloadStoreResource,
    supplier: SupplierResource,
    governance: GovernanceResource,
) -> Iterator[dg.MaterializeResult | dg.AssetCheckResult]:
    """Claims, fetches, normalizes, gates, maps, diffs and publishes each city of the run."""
    started = time.perf_counter()
    cities = [decode_city_key(k) for k in context.partition_keys]
    replay = RAW not in context.selected_asset_keys
    db = sync_db.open()
    store = payloads.open()
    trigger_id, source = trigger_of(dict(context.run.tags), context.run.run_id)
    sources: dict[str, str] = {}
    if replay:
        plan = prepare_replay(
            db, task_code=supplier.task_code, trigger_id=trigger_id, cities=cities
        )
        batch, sources = plan.batch, plan.sources
        for city in plan.missing:
            context.log.warning(f"city {city!r} has no stored raw pages: nothing to replay")
        cities = [c for c in cities if c in sources]
    else:
        batch = resolve_batch(db, supplier, trigger_id, source, cities)
    context.log.info(
        f"batch {batch.batch_id} (trigger {trigger_id}, {source}"
        f"{', replay' if replay else ''}): {len(cities)} cities"
    )
    settings = SyncSettings(
        task_code=supplier.task_code,
        supplier_id=supplier.supplier_id,
        page_size=supplier.page_size,
        lease=sync_db.lease_settings(),
        risk_policy=governance.risk_rules(),
    )
    worker_id = make_worker_id("supplier-sync")
    reports: list[CityReport] = []
    failures: dict[str, str] = {}
    checks: dict[str, list[GateResult]] = {}

    def on_results(batch_id: str, city: str, results: list[GateResult]) -> None:
        checks[city] = results

    gate = gate_for_pipeline(on_results=on_results)
    progress = _Progress()
    requests = retries = 0
    try:
        # A replay reads stored pages only: it does not even open a supplier client.
        sizes: dict[str, int] = {}
        with nullcontext(None) if replay else supplier.client() as client:
            if client is None:
                countries = stored_city_countries(db, store, task_code=supplier.task_code)
            else:
                countries, sizes = _city_list(client, context, db, store, batch.batch_id, supplier)
                cities = largest_first(cities, sizes)

            def run_city(city: str, *, wait: bool) -> CityReport:
                while True:
                    report = sync_city(
                        db,
                        store,
                        client,
                        batch=batch,
                        city_code=city,
                        worker_id=worker_id,
                        settings=settings,
                        gate=gate,
                        fetch=not replay,
                        city_countries=countries,
                    )
                    if report.status != "HELD_BY_OTHER" or not wait:
                        return report
                    # Another run of the batch is syncing this city (it helped out, or
                    # raced): wait for its lease to end, then take the outcome or resume.
                    time.sleep(HELD_POLL_SECONDS)

            held: list[str] = []

            def one_city(city: str, *, wait: bool = False) -> CityReport:
                report = run_city(city, wait=wait)
                if report.status == "HELD_BY_OTHER":
                    # Another run is syncing it (it helped out, or raced): go on with the
                    # other cities and wait for this one's outcome at the end.
                    held.append(city)
                    return report
                progress.show(context, db, batch.batch_id)
                if replay and report.status == "SUCCESS":
                    resolved = resolve_replayed_dead_letters(
                        db,
                        source_batch_id=sources[city],
                        replay_batch_id=batch.batch_id,
                        city_code=city,
                    )
                    context.log.info(f"city {city!r}: {resolved} dead letters resolved by replay")
                log = context.log.error if report.status == "GATED" else context.log.info
                log(
                    f"city {city!r}: {report.status}, {report.records} records, "
                    f"{report.published} published, {report.dead_letters} dead letters"
                    + (f" ({report.error})" if report.error else "")
                )
                return report

            def failed(city: str, err: Exception) -> None:
                # The city's shard is FAILED and resumable: a re-run continues it.
                failures[city] = f"{type(err).__name__}: {err}"
                context.log.error(f"city {city!r} failed: {failures[city]}")

            first = sync_cities(
                cities, sync_one=one_city, threads=supplier.city_threads, on_error=failed
            )
            reports.extend(r for r in first if r.status != "HELD_BY_OTHER")
            if held:
                reports.extend(
                    sync_cities(
                        list(held),
                        sync_one=lambda city: one_city(city, wait=True),
                        threads=supplier.city_threads,
                        on_error=failed,
                    )
                )
            if supplier.help_other_runs and not replay:
                helped = help_other_workers(
                    db,
                    batch.batch_id,
                    skip=set(cities),
                    sync_one=lambda city: run_city(city, wait=False),
                    threads=supplier.city_threads,
                    hotel_counts=sizes,
                )
                if helped:
                    context.log.info(
                        f"helped other runs of the batch with {len(helped)} cities: "
                        + ", ".join(repr(r.city_code) for r in helped[:20])
                    )
            progress.show(context, db, batch.batch_id, final=True)
            if client is not None:
                stats = client.stats()
                requests, retries = stats.requests, stats.retries
        with db.engine.connect() as conn:
            batch = get_batch(conn, batch.batch_id)
    finally:
        db.dispose()
    seconds = time.perf_counter() - started
    selected = context.selected_asset_keys
    for result in _results(reports, batch, seconds, requests, retries):
        if result.asset_key in selected:
            yield result
    selected_checks = context.selected_asset_check_keys
    for report in reports:
        if report.status == "GATED" and report.city_code not in checks:
            # Stopped by the drift check on its first pages, before a full evaluation.
            checks[report.city_code] = [
                GateResult(name, False, "ERROR", report.error or "", {"stopped": "first pages"})
                for name in CHECK_NAMES
                if name in report.gate_failures
            ]
    for check in _check_results(checks):
        if (
            check.asset_key is None
            or dg.AssetCheckKey(check.asset_key, check.check_name or "") in selected_checks
        ):
            yield check
    gated = [r.city_code for r in reports if r.status == "GATED"]
    if failures or gated:
        raise dg.Failure(
            description=(
                f"{len(failures)} of {len(cities)} cities failed and {len(gated)} were stopped "
                "by a quality gate; a re-run resumes failed cities, and gated cities publish "
                "once their gate is overridden (supplier-sync gate override)"
            ),
            metadata={
                "failed_cities": dg.MetadataValue.json(failures),
                "gated_cities": dg.MetadataValue.json(gated),
            },
        )


HELD_POLL_SECONDS = 2.0
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


def _city_list(
    client: SupplierClient,
    context: dg.AssetExecutionContext,
    db: SyncDatabase,
    store: PayloadStore,
    batch_id: str,
    supplier: SupplierResource,
) -> tuple[dict[str, str], dict[str, int]]:
    """City -> country and city -> hotel count from the supplier's list (one request).

    The list's bytes are kept with the batch, for replays (which never call the supplier).
    """
    try:
        fetched = client.list_cities()
    except Exception as err:  # the rule is skipped, the sync is not
        context.log.warning(f"city list unavailable, country rule skipped: {err}")
        return {}, {}
    record_city_list(
        db, store, batch_id=batch_id, supplier_id=supplier.supplier_id, raw=fetched.raw
    )
    cities = fetched.data.cities
    return (
        {c.city_code: c.country_code for c in cities if c.country_code},
        {c.city_code: c.hotel_count for c in cities if c.hotel_count is not None},
    )


def _check_results(checks: dict[str, list[GateResult]]) -> Iterator[dg.AssetCheckResult]:
    """One result per gate over the run's cities: passed when every city passed (or was overridden)."""
    for name in CHECK_NAMES:
        per_city = {
            city: r for city, results in checks.items() for r in results if r.check_name == name
        }
        failed = {c: r.metadata for c, r in per_city.items() if not r.passed}
        overridden = {c: r.metadata for c, r in per_city.items() if r.passed and r.overridden}
        yield dg.AssetCheckResult(
            asset_key=NORMALIZED,
            check_name=name,
            passed=not failed,
            severity=dg.AssetCheckSeverity.ERROR,
            description=(
                f"{len(failed)} of {len(per_city)} cities failed"
                if failed
                else f"{len(per_city)} cities passed"
            ),
            metadata={
                "cities_checked": len(per_city),
                "failed_cities": dg.MetadataValue.json(failed),
                "overridden_cities": dg.MetadataValue.json(overridden),
                "measured": dg.MetadataValue.json(
                    {c: r.metadata for c, r in list(per_city.items())[:20]}
                ),
            },
        )


def _results(
    reports: list[CityReport], batch: Batch, seconds: float, requests: int, retries: int
) -> Iterator[dg.MaterializeResult]:
    s = _summary(reports, batch, seconds)
    by_code: Counter[str] = Counter()
    by_type: Counter[str] = Counter()
    by_action: Counter[str] = Counter()
    timing: dict[str, float] = {"fetch": 0.0, "normalize": 0.0, "publish": 0.0}
    for r in reports:
        by_code.update(r.dead_letters_by_code)
        by_type.update(r.diffs_by_type)
        by_action.update(r.diffs_by_action)
        for stage, secs in r.seconds.items():
            timing[stage] = timing.get(stage, 0.0) + secs
    statuses = Counter(r.status for r in reports)
    common: dict[str, Any] = {
        "batch_id": batch.batch_id,
        "cities": len(reports),
        "city_status": dg.MetadataValue.json(dict(statuses)),
    }
    yield dg.MaterializeResult(
        asset_key=RAW,
        metadata={
            **common,
            "pages": s["pages"],
            "records": s["records"],
            "supplier_requests": requests,
            "supplier_retries": retries,
            "fetch_seconds": round(timing["fetch"], 3),
            "resumed_cities": sum(1 for r in reports if r.resumed_from_page is not None),
        },
    )
    yield dg.MaterializeResult(
        asset_key=NORMALIZED,
        metadata={
            **common,
            "records": s["records"],
            "dead_letters": s["dead_letters"],
            "dead_letters_by_code": dg.MetadataValue.json(dict(by_code)),
            "moved_hotels": sum(r.moved for r in reports),
            "gated_cities": dg.MetadataValue.json(
                {r.city_code: r.error for r in reports if r.status == "GATED"}
            ),
            "bad_record_ratio": round(s["dead_letters"] / s["records"], 4) if s["records"] else 0.0,
            "normalize_seconds": round(timing["normalize"], 3),
        },
    )
    yield dg.MaterializeResult(
        asset_key=MAPPINGS,
        metadata={
            **common,
            "hotels": s["records"] - s["dead_letters"] - s["duplicates"],
            "duplicates": s["duplicates"],
        },
    )
    yield dg.MaterializeResult(
        asset_key=DIFFS,
        metadata={
            **common,
            "diffs_by_type": dg.MetadataValue.json(dict(by_type)),
            "diffs_by_action": dg.MetadataValue.json(dict(by_action)),
            "held_for_review": sum(r.held_for_review for r in reports),
            "review_command": "supplier-sync review list --batch " + batch.batch_id,
        },
    )
    yield dg.MaterializeResult(
        asset_key=PUBLISHED,
        metadata={
            **common,
            "published": s["published"],
            "skipped": s["skipped"],
            "dead_letters": s["dead_letters"],
            "records": s["records"],
            "counts_add_up": s["records"] == s["published"] + s["skipped"] + s["dead_letters"],
            "publish_seconds": round(timing["publish"], 3),
            "hotels_per_second": round(s["records"] / seconds, 1) if seconds else 0.0,
            "batch_status": batch.status,
        },
    )
