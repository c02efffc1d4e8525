"""Dead letters in Dagster: compensation on a schedule, and their numbers over time.

``dead_letter_compensation`` runs :func:`~supplier_sync_dagster.core.repair.compensation.compensate`:
the supplier's due retryable dead letters are re-fetched one hotel each and go through the
sync's stages; its materialization says how each claimed row ended, and each city it
published hotels in gets a ``published_hotels`` materialization on that city's partition.
The ``dead_letter_compensation_schedule`` runs it every 5 minutes when something is due (one
run at a time: the task's SKIP_IF_RUNNING policy, and the task tag ``dagster.yaml`` limits).
Cities whose CITY_FAILED ticket is due are listed in its metadata (``resync_cities``); the
``dead_letter_city_resync_sensor`` requests a full-sync run of exactly those partitions.

``dead_letter_summary`` counts dead letters by code, class and status, the age of the oldest
open one and the **fix rate** (resolved ÷ created over 24 h and 7 d) as numeric metadata, so
that the UI plots them; ``dead_letter_summary_schedule`` materializes it every 15 minutes.
"""

import functools
from collections.abc import Iterator
from typing import Any

import dagster as dg
from pydantic import Field

from supplier_sync_dagster.core.records import deadletters
from supplier_sync_dagster.core.repair.compensation import (
    DEFAULT_COMPENSATION_TASK,
    DEFAULT_FETCH_THREADS,
    DEFAULT_LIMIT,
    DEFAULT_PAGE_HOTELS,
    CompensationReport,
    CompensationSettings,
    compensate,
)
from supplier_sync_dagster.core.repair.incremental import published_cities
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.dagster_instance.events import one_event_transaction
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE, AccountScope, per_account
from supplier_sync_dagster.defs.city_events import published_city
from supplier_sync_dagster.defs.city_keys import GROUP
from supplier_sync_dagster.defs.full_sync_schedule import build_city_resync_sensor
from supplier_sync_dagster.defs.resources import SyncDatabaseResource, SyncResources
from supplier_sync_dagster.defs.triggers import (
    account_job,
    one_at_a_time,
    run_sync_work,
    scheduled_asset_job,
)

COMPENSATION = dg.AssetKey("dead_letter_compensation")
SUMMARY = dg.AssetKey("dead_letter_summary")


class CompensationConfig(dg.Config):
    """How a compensation run takes its dead letters (the launchpad's form)."""

    task_code: str | None = Field(
        default=None,
        description=(
            "The compensation task: its batches and its one-run-at-a-time policy. Unset: the "
            f"account's ({DEFAULT_COMPENSATION_TASK} without a suppliers file)."
        ),
    )
    limit: int = Field(default=DEFAULT_LIMIT, description="Due dead letters taken per run.")
    page_hotels: int = Field(
        default=DEFAULT_PAGE_HOTELS, description="Hotels re-fetched per stored page."
    )
    fetch_threads: int = Field(
        default=DEFAULT_FETCH_THREADS, description="Detail requests in flight at once."
    )


RESYNC = "resync_cities"


def compensation_metadata(out: CompensationReport, requests: int) -> dict[str, Any]:
    """A compensation run's numbers, as numeric metadata the UI plots over time."""
    values = out.to_json()
    seconds = values.pop("seconds", {})
    errors = values.pop("errors")
    resync = values.pop(RESYNC)
    return {
        **{k: ("" if v is None else v) for k, v in values.items()},
        "supplier_requests": requests,
        "seconds": round(sum(seconds.values()), 3),
        "errors_by_code": dg.MetadataValue.json(errors),
        RESYNC: dg.MetadataValue.json(resync),
    }


@functools.cache
def build_compensation(scope: AccountScope) -> dg.AssetsDefinition:
    """The account's compensation asset: its supplier's due dead letters, re-fetched."""

    @dg.asset(
        key=scope.key(COMPENSATION.path[-1]),
        group_name=scope.group,
        pool=scope.pool,
        required_resource_keys=SyncResources.keys(scope),
        description=(
            "Due retryable dead letters healed without an operator: each hotel is re-fetched "
            "once and goes through the sync's stages; a failed request backs off (1 min ... "
            "12 h) and goes to MANUAL_FIX past its retries."
        ),
    )
    def dead_letter_compensation(
        context: dg.AssetExecutionContext, config: CompensationConfig
    ) -> Iterator[dg.AssetMaterialization | dg.MaterializeResult]:
        yield from _compensate(context, config, scope, SyncResources.of(context, scope))

    return dead_letter_compensation


def _compensate(
    context: dg.AssetExecutionContext,
    config: CompensationConfig,
    scope: AccountScope,
    resources: SyncResources,
) -> Iterator[dg.AssetMaterialization | dg.MaterializeResult]:
    """Runs one compensation and reports how each claimed dead letter ended, and each city
    it published in."""
    compensation = CompensationSettings(
        task_code=config.task_code or scope.compensation_task_code,
        # An account heals its own dead letters, never another account's.
        owned_tasks=() if scope.account is None else scope.account.task_codes,
        full_task_code=resources.supplier.task_code,
        limit=config.limit,
        page_hotels=config.page_hotels,
        fetch_threads=config.fetch_threads,
    )
    out, requests = run_sync_work(
        context,
        resources,
        functools.partial(compensate, compensation=compensation),
        "compensation not run",
    )
    context.log.info(
        f"compensation: {out.claimed} claimed, {out.resolved} resolved "
        f"({out.refused_again} refused again), {out.newer} newer, {out.gone} gone, "
        f"{out.rescheduled} rescheduled, {out.exhausted} to MANUAL_FIX, {requests} requests"
    )
    if out.report is not None and out.report.status not in ("SUCCESS", "ALREADY_DONE"):
        raise dg.Failure(
            description=(
                f"compensation batch {out.batch.batch_id if out.batch else ''} did not finish "
                f"({out.report.status}): {out.report.error or ''}; the next run resumes it"
            ),
            allow_retries=False,
        )
    if out.batch is not None:
        # Each city it published hotels in is reported on that city's partition, as a full
        # sync reports it: the UI shows what compensation changed, city by city.
        with resources.sync_db.opened() as db, db.engine.connect() as conn:
            cities = published_cities(conn, out.batch.batch_id)
        scope.add_cities(context.instance, cities)
        with one_event_transaction(context.instance):
            for city, published in cities.items():
                yield published_city(scope, city, out.batch.batch_id, "REFRESH", published)
    yield dg.MaterializeResult(metadata=compensation_metadata(out, requests))


build_compensation_job = account_job(
    "compensate_dead_letters",
    COMPENSATION,
    "Re-fetch and re-publish the hotels of due retryable dead letters.",
    task=lambda scope: scope.compensation_task_code,
)


@functools.cache
def build_compensation_schedule(scope: AccountScope) -> dg.ScheduleDefinition:
    """The account's compensation schedule (its ``schedules.compensation``; every 5 minutes),
    when one of its rows is due (or a claimed one waits) and no compensation runs; its tick
    time is its trigger."""
    cron = scope.cron("compensation", "*/5 * * * *")
    supplier_id = None if scope.account is None else scope.account.supplier_id
    owned = () if scope.account is None else scope.account.task_codes

    def nothing_due(db: SyncDatabase) -> str | None:
        with db.engine.connect() as conn:
            due = deadletters.due_for_retry(
                conn, db.clock, limit=1, supplier_id=supplier_id, task_codes=owned
            )
            claimed = deadletters.list_dead_letters(
                conn, db.clock, deadletters.DeadLetterFilter(status="RETRYING"), limit=1
            )
        return None if due or claimed else "no retryable dead letter is due"

    return one_at_a_time(
        build_compensation_job(scope),
        scope.name("dead_letter_compensation_schedule"),
        cron or "*/5 * * * *",
        f"On {cron}, when a retryable dead letter is due and no run is active.",
        not_yet=nothing_due,
        busy="of the previous compensation is active",
        trigger="compensate",
        source="COMPENSATION",
        tags=scope.tags,
    )


@functools.cache
def build_dead_letter_resync_sensor(scope: AccountScope) -> dg.SensorDefinition:
    """The account's re-sync sensor: its full sync of the cities its compensation lists."""
    return build_city_resync_sensor(
        scope,
        name="dead_letter_city_resync_sensor",
        watched=scope.key(COMPENSATION.path[-1]),
        metadata_key=RESYNC,
        source="COMPENSATION",
        trigger_prefix="resync",
        description=(
            "After each compensation: one full-sync run per city whose CITY_FAILED ticket is "
            "due, all of one trigger (one batch); the next compensation resolves the tickets "
            "of the cities that synced."
        ),
    )


dead_letter_compensation = build_compensation(DEFAULT_SCOPE)
dead_letter_compensation_job = build_compensation_job(DEFAULT_SCOPE)
dead_letter_compensation_schedule = build_compensation_schedule(DEFAULT_SCOPE)
dead_letter_city_resync_sensor = build_dead_letter_resync_sensor(DEFAULT_SCOPE)


def summary_metadata(summary: deadletters.Summary) -> dict[str, Any]:
    """The summary as metadata: every figure numeric (plotted), the breakdowns as JSON."""
    statuses = ("PENDING", "RETRYING", "FAILED", "MANUAL_FIX", "RESOLVED", "IGNORED", "MERGED")
    return {
        "open": summary.open,
        **{f"status_{s.lower()}": summary.by_status.get(s, 0) for s in statuses},
        "open_retryable": summary.by_class.get("RETRYABLE", 0),
        "open_needs_person": summary.by_class.get("NEEDS_PERSON", 0),
        "oldest_open_hours": summary.oldest_open_hours,
        "created_24h": summary.created_24h,
        "resolved_24h": summary.resolved_24h,
        "fix_rate_24h": summary.fix_rate_24h,
        "created_7d": summary.created_7d,
        "resolved_7d": summary.resolved_7d,
        "fix_rate_7d": summary.fix_rate_7d,
        "open_by_code": dg.MetadataValue.json(summary.by_code),
        "by_status": dg.MetadataValue.json(summary.by_status),
    }


@dg.asset(
    key=SUMMARY,
    group_name=GROUP,
    description=(
        "Dead letters by code, class and status, the age of the oldest open one, and the fix "
        "rate (resolved ÷ created) over 24 h and 7 d, as numbers the UI plots over time."
    ),
)
def dead_letter_summary(
    context: dg.AssetExecutionContext, sync_db: SyncDatabaseResource
) -> dg.MaterializeResult:
    """Counts the dead letters (a few grouped queries)."""
    with sync_db.opened() as db, db.engine.connect() as conn:
        summary = deadletters.summarize(conn, db.clock)
    context.log.info(
        f"dead letters: {summary.open} open (oldest {summary.oldest_open_hours} h), fix rate "
        f"{summary.fix_rate_24h:.1%} over 24 h, {summary.fix_rate_7d:.1%} over 7 d"
    )
    return dg.MaterializeResult(metadata=summary_metadata(summary))


dead_letter_summary_job, dead_letter_summary_schedule = scheduled_asset_job(
    SUMMARY,
    "summarize_dead_letters",
    "Count the dead letters and their fix rate.",
    schedule="dead_letter_summary_schedule",
    cron="*/15 * * * *",
    when="Every 15 minutes: the dead-letter counts and fix rate, plotted over time.",
)


def _build(scope: AccountScope) -> dg.Definitions:
    return dg.Definitions(
        assets=[build_compensation(scope)],
        jobs=[build_compensation_job(scope)],
        schedules=[build_compensation_schedule(scope)] if scope.on_schedule("compensation") else [],
        sensors=[build_dead_letter_resync_sensor(scope)],
    )


@dg.definitions
def defs() -> dg.Definitions:
    """Every account's compensation, and the one dead-letter summary of the deployment."""
    return dg.Definitions.merge(
        per_account(_build),
        dg.Definitions(
            assets=[dead_letter_summary],
            jobs=[dead_letter_summary_job],
            schedules=[dead_letter_summary_schedule],
        ),
    )
