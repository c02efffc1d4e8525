"""The publish history's retention in Dagster: a daily job that prunes what the as-of answers
no longer need (:func:`~supplier_sync_dagster.core.records.history.prune_history`).

``publish_history_retention`` (downstream of ``published_hotels``) drops the versions
superseded before the horizon (``SUPPLIER_SYNC_HISTORY_RETENTION_DAYS`` before the database
clock's now) and the documents no version uses; the version current at the horizon stays,
so every answer inside the window is unchanged. ``supplier-sync prune-history`` does the same
from the command line.
"""

import dagster as dg
from pydantic import Field

from supplier_sync_dagster.core.records.history import prune_history
from supplier_sync_dagster.core.settings import load_history_settings
from supplier_sync_dagster.defs.accounts import CATALOG, account_scopes
from supplier_sync_dagster.defs.city_keys import GROUP, PUBLISHED
from supplier_sync_dagster.defs.resources import SyncDatabaseResource
from supplier_sync_dagster.defs.triggers import scheduled_asset_job


class RetentionConfig(dg.Config):
    """The window kept (the launchpad's form)."""

    retention_days: int | None = Field(
        default=None,
        ge=1,
        le=3650,
        description="Days of history kept; unset: SUPPLIER_SYNC_HISTORY_RETENTION_DAYS.",
    )


@dg.asset(
    key="publish_history_retention",
    deps=[PUBLISHED],
    group_name=GROUP,
    description=(
        "The publish history pruned to its retention window: versions superseded before the "
        "horizon and the documents no version uses are dropped, the version current at the "
        "horizon stays."
    ),
)
def publish_history_retention(
    context: dg.AssetExecutionContext, config: RetentionConfig, sync_db: SyncDatabaseResource
) -> dg.MaterializeResult:
    """Prunes in short transactions and reports what went."""
    days = config.retention_days or load_history_settings().history_retention_days
    with sync_db.opened() as db:
        report = prune_history(db, retention_days=days)
    context.log.info(
        f"pruned {report.versions} versions and {report.documents} documents published "
        f"before {report.horizon.isoformat()}Z"
    )
    return dg.MaterializeResult(
        metadata={
            "retention_days": days,
            "horizon": f"{report.horizon.isoformat()}Z",
            "versions_pruned": report.versions,
            "documents_pruned": report.documents,
        }
    )


history_retention_job, history_retention_schedule = scheduled_asset_job(
    publish_history_retention,
    "history_retention_job",
    "Prune the publish history to its retention window.",
    schedule="history_retention_schedule",
    cron="45 3 * * *",
    when="Daily: the publish history pruned to its retention window (as-of answers inside it "
    "stay exact).",
)


@dg.definitions
def defs() -> dg.Definitions:
    """The retention job; with several accounts, downstream of the one shared catalog (as the
    search projection is), since no account is the unnamed default then."""
    asset = publish_history_retention
    if any(not scope.is_default for scope in account_scopes()):
        asset = asset.map_asset_specs(lambda spec: spec.replace_attributes(deps=[CATALOG]))
    return dg.Definitions(
        assets=[asset], jobs=[history_retention_job], schedules=[history_retention_schedule]
    )
