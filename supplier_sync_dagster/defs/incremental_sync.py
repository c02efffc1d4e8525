"""The incremental sync in Dagster: one window of the supplier's change feed per run.

``hotel_change_feed`` runs :func:`~supplier_sync_dagster.core.repair.incremental.run_incremental`:
one window from the task's watermark (minus the overlap) until the feed is caught up. Its
materialization carries the window (watermark before and after, records, what became of
them, timings); every city the window published hotels in gets a ``published_hotels``
materialization **for that city's partition**, as a full sync reports it, so the UI shows
which cities the run touched. Two non-blocking checks say what an operator should look at:
``change_volume`` (the window was far above its usual volume: its diffs wait for review)
and ``quiet_windows`` (the feed has been silent for too many windows in a row).

The ``incremental_sync`` job runs it; ``incremental_sync_schedule`` every 5 minutes, unless
a run of the job is still queued or running (one window per task at a time; the task's
SKIP_IF_RUNNING policy refuses a second one in the database as well, and runs carry the
task's tag, which ``dagster.yaml`` limits to one run per value).
"""

import functools
from collections.abc import Iterator
from typing import Any

import dagster as dg
from pydantic import Field

from supplier_sync_dagster.core.repair.incremental import (
    DEFAULT_CHANGES_LIMIT,
    DEFAULT_INCREMENTAL_TASK,
    DEFAULT_MAX_PAGES,
    DEFAULT_OVERLAP_SECONDS,
    IncrementalSettings,
    WindowReport,
    has_baseline,
    run_incremental,
)
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.dagster_instance.events import one_event_transaction
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE, AccountScope, per_account
from supplier_sync_dagster.defs.city_events import published_city
from supplier_sync_dagster.defs.resources import SyncResources
from supplier_sync_dagster.defs.triggers import (
    TASK_TAG,
    account_job,
    one_at_a_time,
    run_sync_work,
)

CHANGE_FEED = dg.AssetKey("hotel_change_feed")
VOLUME_CHECK = "change_volume"
QUIET_CHECK = "quiet_windows"
EVENTS_PER_TRANSACTION = 250
STAGES = ("fetch", "normalize", "publish")


class IncrementalConfig(dg.Config):
    """How a run reads the change feed (the launchpad's form)."""

    task_code: str | None = Field(
        default=None,
        description=(
            "The incremental task: its batches, watermark and thresholds. Unset: the "
            f"account's ({DEFAULT_INCREMENTAL_TASK} without a suppliers file)."
        ),
    )
    overlap_seconds: float = Field(
        default=DEFAULT_OVERLAP_SECONDS,
        description="How far before the watermark the window starts (changes visible late).",
    )
    changes_per_request: int = Field(
        default=DEFAULT_CHANGES_LIMIT, description="Changes per feed request (1-1000)."
    )
    max_pages: int = Field(
        default=DEFAULT_MAX_PAGES,
        description="Pages per window at most; a longer backlog continues in the next run.",
    )


@functools.cache
def build_hotel_change_feed(scope: AccountScope) -> dg.AssetsDefinition:
    """The account's change-feed asset and its two checks."""
    key = scope.key(CHANGE_FEED.path[-1])

    @dg.asset(
        key=key,
        group_name=scope.group,
        pool=scope.pool,
        required_resource_keys=SyncResources.keys(scope),
        check_specs=[
            dg.AssetCheckSpec(
                VOLUME_CHECK,
                asset=key,
                description=(
                    "The window's change rate (changes per hour of feed it covered) stays "
                    "within the task's max_volume_factor of the time-weighted median rate of "
                    "its latest windows; beyond it every diff is held for review."
                ),
            ),
            dg.AssetCheckSpec(
                QUIET_CHECK,
                asset=key,
                description=(
                    "The feed has not been silent for the task's quiet_windows windows in a "
                    "row (a supplier that stops reporting changes is more often broken than "
                    "idle)."
                ),
            ),
        ],
        description=(
            "One window of the supplier's change feed, from the task's watermark minus the "
            "overlap until caught up, through the same stages as a full sync; the watermark "
            "moves with the window's last publish. Each city it published in is reported on "
            "published_hotels."
        ),
    )
    def hotel_change_feed(
        context: dg.AssetExecutionContext, config: IncrementalConfig
    ) -> Iterator[dg.AssetMaterialization | dg.MaterializeResult]:
        yield from _run_window(context, config, scope, SyncResources.of(context, scope))

    return hotel_change_feed


def _run_window(
    context: dg.AssetExecutionContext,
    config: IncrementalConfig,
    scope: AccountScope,
    resources: SyncResources,
) -> Iterator[dg.AssetMaterialization | dg.MaterializeResult]:
    """Runs one window and reports it, and each city it published in."""
    incremental = IncrementalSettings(
        task_code=config.task_code or scope.incremental_task_code,
        full_task_code=resources.supplier.task_code,
        overlap_seconds=config.overlap_seconds,
        limit=config.changes_per_request,
        max_pages=config.max_pages,
    )
    window, requests = run_sync_work(
        context,
        resources,
        functools.partial(run_incremental, incremental=incremental),
        "incremental sync not run",
    )
    r = window.report
    context.log.info(
        f"window {window.batch.batch_id}: {r.status}, {r.records} changes in {r.pages_fetched} "
        f"pages, {r.published} published, {r.dead_letters} dead letters, {r.skipped} skipped, "
        f"{len(window.cities)} cities, {requests} requests; watermark "
        f"{_text(window.watermark_before)} -> {_text(window.watermark_after)}"
    )
    if r.status not in ("SUCCESS", "ALREADY_DONE"):
        raise dg.Failure(
            description=(
                f"window {window.batch.batch_id} did not publish ({r.status}): {r.error or ''}. "
                "The watermark did not move; the next run resumes or re-reads the window"
            ),
            metadata={"batch_id": window.batch.batch_id, "status": r.status},
            allow_retries=False,
        )
    scope.add_cities(context.instance, window.cities)
    touched = list(window.cities.items())
    watermark = _text(window.watermark_after)
    for start in range(0, len(touched), EVENTS_PER_TRANSACTION):
        # A day's window touches most cities: their events share a few commits.
        with one_event_transaction(context.instance):
            for city, published in touched[start : start + EVENTS_PER_TRANSACTION]:
                # Logged, not yielded: a yielded event passes Dagster's per-yield error and
                # interrupt boundaries, which these many small events need not pay.
                context.log_event(
                    published_city(
                        scope,
                        city,
                        window.batch.batch_id,
                        "INCREMENTAL",
                        published,
                        watermark=watermark,
                    )
                )
    yield dg.MaterializeResult(
        metadata=window_metadata(window, requests),
        check_results=[
            dg.AssetCheckResult(
                check_name=VOLUME_CHECK,
                passed=window.volume is None or window.volume.passed,
                severity=dg.AssetCheckSeverity.WARN,
                description=window.volume.description if window.volume else "not judged",
                metadata=dict(window.volume.metadata) if window.volume else {},
            ),
            dg.AssetCheckResult(
                check_name=QUIET_CHECK,
                passed=not window.quiet_alert,
                severity=dg.AssetCheckSeverity.WARN,
                description=f"{window.quiet_for} windows in a row without a change",
                metadata={"quiet_for": window.quiet_for},
            ),
        ],
    )


def window_metadata(window: WindowReport, requests: int) -> dict[str, Any]:
    """A window's numbers, as numeric metadata the UI plots over time."""
    r = window.report
    start = window.started_from
    return {
        "batch_id": window.batch.batch_id,
        "status": r.status,
        "window_start": start.start.isoformat() if start else "",
        "resumed_from_page": r.resumed_from_page if r.resumed_from_page is not None else "",
        "watermark_before": _text(window.watermark_before),
        "watermark_after": _text(window.watermark_after),
        "pages": r.pages_fetched,
        "changes": r.records,
        "published": r.published,
        "dead_letters": r.dead_letters,
        "skipped": r.skipped,
        "held_for_review": r.held_for_review,
        "held_window": window.held,
        "cities_touched": len(window.cities),
        "quiet_for": window.quiet_for,
        "supplier_requests": requests,
        "seconds": round(sum(r.seconds.values()), 3),
        **{f"{stage}_seconds": round(r.seconds.get(stage, 0.0), 3) for stage in STAGES},
        "diffs_by_type": dg.MetadataValue.json(dict(r.diffs_by_type)),
        "dead_letters_by_code": dg.MetadataValue.json(dict(r.dead_letters_by_code)),
    }


def _text(mark: object) -> str:
    text = getattr(mark, "text", None)
    return text() if callable(text) else ""


build_incremental_sync_job = account_job(
    "incremental_sync",
    CHANGE_FEED,
    "One window of the supplier's change feed, from the watermark until caught up.",
    task=lambda scope: scope.incremental_task_code,
)


@functools.cache
def build_incremental_sync_schedule(scope: AccountScope) -> dg.ScheduleDefinition:
    """The account's window schedule (its ``schedules.incremental``; every 5 minutes): a
    window unless one is queued or running, or there is nothing to be incremental to yet (no
    full sync); its tick time is its trigger."""
    cron = scope.cron("incremental", "*/5 * * * *")

    def no_baseline(db: SyncDatabase) -> str | None:
        task = IncrementalSettings(
            task_code=scope.incremental_task_code, full_task_code=scope.full_task_code
        )
        if has_baseline(db, task):
            return None
        return "no watermark and no successful full sync yet: nothing to start from"

    return one_at_a_time(
        build_incremental_sync_job(scope),
        scope.name("incremental_sync_schedule"),
        cron or "*/5 * * * *",
        (
            f"On {cron}: one incremental window, unless the previous one is still queued or "
            "running (one window per task at a time)."
        ),
        not_yet=no_baseline,
        busy="of the previous window is still active",
        trigger="incremental",
        source="CRON",
        tags={TASK_TAG: scope.incremental_task_code, **scope.tags},
    )


hotel_change_feed = build_hotel_change_feed(DEFAULT_SCOPE)
incremental_sync_job = build_incremental_sync_job(DEFAULT_SCOPE)
incremental_sync_schedule = build_incremental_sync_schedule(DEFAULT_SCOPE)


def _build(scope: AccountScope) -> dg.Definitions:
    return dg.Definitions(
        assets=[build_hotel_change_feed(scope)],
        jobs=[build_incremental_sync_job(scope)],
        schedules=[build_incremental_sync_schedule(scope)]
        if scope.on_schedule("incremental")
        else [],
    )


@dg.definitions
def defs() -> dg.Definitions:
    """Every account's change feed, its job and its schedule."""
    return per_account(_build)
