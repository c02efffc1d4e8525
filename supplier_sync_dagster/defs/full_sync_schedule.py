"""The full-sync job and its nightly schedule (per account): one range run over every known city."""

import functools
from typing import Any

import dagster as dg

from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE, AccountScope, per_account
from supplier_sync_dagster.defs.city_sync import SOURCE_TAG, TRIGGER_TAG, build_city_sync


@functools.cache
def build_full_sync_job(scope: AccountScope) -> Any:
    """The account's full-sync job: every stage of its city sync for the selected cities."""
    return dg.define_asset_job(
        scope.name("full_sync_job"),
        selection=dg.AssetSelection.assets(build_city_sync(scope)),
        tags=scope.tags,
        description="Every stage of the city sync for the selected cities (a partition or a range).",
    )


@functools.cache
def build_nightly_full_sync(scope: AccountScope) -> dg.ScheduleDefinition:
    """The account's scheduled full sync (its ``schedules.full`` cron; 02:00 UTC by default)."""
    cron = "0 2 * * *" if scope.account is None else scope.account.schedules.full

    @dg.schedule(
        name=scope.name("nightly_full_sync"),
        job=build_full_sync_job(scope),
        cron_schedule=cron or "0 2 * * *",
        execution_timezone="UTC",
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description="Nightly full sync of every city, as one range run; its fire time is the trigger id.",
    )
    def nightly_full_sync(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        """Requests one run over all city partitions; the scheduled time makes it idempotent."""
        keys = context.instance.get_dynamic_partitions(scope.partitions_name)
        if not keys:
            return dg.SkipReason("no city partitions yet: the city discovery sensor adds them")
        fired = (
            context.scheduled_execution_time.isoformat()
            if context.scheduled_execution_time
            else "now"
        )
        trigger = f"nightly:{fired}"[:64]
        return dg.RunRequest(
            run_key=trigger,
            tags={
                "dagster/asset_partition_range_start": keys[0],
                "dagster/asset_partition_range_end": keys[-1],
                TRIGGER_TAG: trigger,
                SOURCE_TAG: "CRON",
                **scope.tags,
            },
        )

    return nightly_full_sync


full_sync_job = build_full_sync_job(DEFAULT_SCOPE)
nightly_full_sync = build_nightly_full_sync(DEFAULT_SCOPE)


def _build(scope: AccountScope) -> dg.Definitions:
    on_schedule = scope.account is None or scope.account.schedules.full is not None
    return dg.Definitions(
        jobs=[build_full_sync_job(scope)],
        schedules=[build_nightly_full_sync(scope)] if on_schedule else [],
    )


@dg.definitions
def defs() -> dg.Definitions:
    """Every account's full-sync job and schedule."""
    return per_account(_build)
