"""The full-sync job and its nightly schedule: one range run over every known city."""

import dagster as dg

from supplier_sync_dagster.defs.city_sync import SOURCE_TAG, TRIGGER_TAG, city_sync
from supplier_sync_dagster.defs.partitions import CITY_PARTITIONS, city_partitions

full_sync_job = dg.define_asset_job(
    "full_sync_job",
    selection=dg.AssetSelection.assets(city_sync),
    partitions_def=city_partitions,
    description="Every stage of the city sync for the selected cities (a partition or a range).",
)


@dg.schedule(
    job=full_sync_job,
    cron_schedule="0 2 * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Nightly full sync of every city, as one range run; its fire time is the trigger id.",
)
def nightly_full_sync(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
    """Requests one run over all city partitions; the scheduled time makes it idempotent."""
    keys = context.instance.get_dynamic_partitions(CITY_PARTITIONS)
    if not keys:
        return dg.SkipReason("no city partitions yet: the city discovery sensor adds them")
    fired = (
        context.scheduled_execution_time.isoformat() if context.scheduled_execution_time else "now"
    )
    trigger = f"nightly:{fired}"[:64]
    return dg.RunRequest(
        run_key=trigger,
        tags={
            "dagster/asset_partition_range_start": keys[0],
            "dagster/asset_partition_range_end": keys[-1],
            TRIGGER_TAG: trigger,
            SOURCE_TAG: "CRON",
        },
    )
