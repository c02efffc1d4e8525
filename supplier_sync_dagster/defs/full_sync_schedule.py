"""The full-sync job and its nightly schedule (per account): one range run over every known city."""

import functools
from typing import Any

import dagster as dg

from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE, AccountScope, per_account
from supplier_sync_dagster.defs.city_sync import build_city_sync
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.defs.triggers import SOURCE_TAG, TRIGGER_TAG, every, scheduled_run


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
    cron = scope.cron("full", "0 2 * * *")

    def nightly_full_sync(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        """Requests one run over all city partitions; the scheduled time makes it idempotent."""
        keys = context.instance.get_dynamic_partitions(scope.partitions_name)
        if not keys:
            return dg.SkipReason("no city partitions yet: the city discovery sensor adds them")
        return scheduled_run(
            context,
            "nightly",
            "CRON",
            {
                "dagster/asset_partition_range_start": keys[0],
                "dagster/asset_partition_range_end": keys[-1],
                **scope.tags,
            },
        )

    return every(
        build_full_sync_job(scope),
        scope.name("nightly_full_sync"),
        cron or "0 2 * * *",
        "Nightly full sync of every city, as one range run; its fire time is the trigger id.",
        nightly_full_sync,
        status=dg.DefaultScheduleStatus.STOPPED,
    )


def build_city_resync_sensor(
    scope: AccountScope,
    *,
    name: str,
    watched: dg.AssetKey,
    metadata_key: str,
    source: str,
    trigger_prefix: str,
    description: str,
) -> dg.SensorDefinition:
    """A sensor that, after each materialization of ``watched``, requests the account's full
    sync of the cities its ``metadata_key`` lists: one run per city (an exact partition), all
    of one trigger, so one batch."""

    @dg.asset_sensor(
        asset_key=watched,
        job=build_full_sync_job(scope),
        name=scope.name(name),
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=description,
    )
    def city_resync_sensor(
        context: dg.SensorEvaluationContext, asset_event: dg.EventLogEntry
    ) -> dg.SensorResult:
        m = asset_event.asset_materialization
        value = m.metadata.get(metadata_key) if m is not None else None
        data = value.value if value is not None else None
        cities = [str(c) for c in data] if isinstance(data, list) else []
        if not cities:
            return dg.SensorResult(skip_reason=dg.SkipReason("no city to re-sync"))
        trigger = f"{trigger_prefix}:{asset_event.run_id}"[:64]
        keys = [encode_city_key(c) for c in cities]
        new = scope.new_city_keys(context.instance, cities)
        return dg.SensorResult(
            run_requests=[
                dg.RunRequest(
                    run_key=f"{trigger}:{key}",
                    partition_key=key,
                    tags={TRIGGER_TAG: trigger, SOURCE_TAG: source, **scope.tags},
                )
                for key in keys
            ],
            dynamic_partitions_requests=[scope.partitions.build_add_request(new)] if new else [],
        )

    return city_resync_sensor


full_sync_job = build_full_sync_job(DEFAULT_SCOPE)
nightly_full_sync = build_nightly_full_sync(DEFAULT_SCOPE)


def _build(scope: AccountScope) -> dg.Definitions:
    return dg.Definitions(
        jobs=[build_full_sync_job(scope)],
        schedules=[build_nightly_full_sync(scope)] if scope.on_schedule("full") else [],
    )


@dg.definitions
def defs() -> dg.Definitions:
    """Every account's full-sync job and schedule."""
    return per_account(_build)
