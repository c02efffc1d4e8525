"""Sync health and alerts in Dagster.

- ``sync_health`` (schedule ``sync_health_schedule``, every 10 minutes): the task's figures
  (:mod:`supplier_sync_dagster.core.health.metrics`) as numeric metadata, which the UI plots over
  time; and a ``city_freshness`` evaluation on every city's partition of ``published_hotels``
  (failed when the city was not synced successfully within the task's SLA; the check is
  declared with the city assets, whose runs cannot judge the syncs that did not happen).
- ``alert_sensor`` (every minute) and ``alert_on_run_failure`` (when a run fails): judge the
  alert conditions (:mod:`supplier_sync_dagster.core.health.alerts`), start or clear alerts, and
  send what is due to the alert channel. The reconciliation's remaining differences and the
  failed run's link come from Dagster's own records.
"""

import functools
from typing import Any

import dagster as dg

from supplier_sync_dagster.core.health import alerts
from supplier_sync_dagster.core.health.metrics import SyncHealth, sync_health
from supplier_sync_dagster.core.settings import load_settings
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.dagster_instance.events import one_event_transaction
from supplier_sync_dagster.defs.accounts import (
    DEFAULT_SCOPE,
    AccountScope,
    per_account,
    resources_of,
    with_resource_key,
)
from supplier_sync_dagster.defs.city_keys import FRESHNESS_CHECK, PUBLISHED
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.defs.reconciliation import RECONCILIATION
from supplier_sync_dagster.defs.resources import SupplierResource, SyncDatabaseResource
from supplier_sync_dagster.defs.triggers import BACKFILL_TAG, TRIGGER_TAG, every, housekeeping_job

HEALTH = dg.AssetKey("sync_health")
EVENTS_PER_TRANSACTION = 250


def health_metadata(h: SyncHealth) -> dict[str, Any]:
    """Every figure as numeric metadata (plotted), breakdowns as JSON."""
    stale = sorted(h.city_lag_hours.items(), key=lambda kv: -kv[1])[:20]
    return {
        **h.values(),
        "latest_batch_id": h.latest_batch_id or "",
        "missing_field_rate": dg.MetadataValue.json(h.missing_field_rate),
        "stalest_cities_hours": dg.MetadataValue.json(dict(stale)),
        "batches_24h": dg.MetadataValue.json(h.batches_24h),
    }


def _sla_hours(db: Any, task_code: str) -> float:
    with db.engine.connect() as conn:
        return float(alerts.thresholds(conn, task_code)["freshness_sla_hours"])


def _freshness(
    city: str, lag: float, sla: float, published: dg.AssetKey = PUBLISHED
) -> dg.AssetCheckEvaluation:
    return dg.AssetCheckEvaluation(
        asset_key=published,
        check_name=FRESHNESS_CHECK,
        passed=lag <= sla,
        severity=dg.AssetCheckSeverity.WARN,
        description=f"{city!r} last synced {lag:.1f} h ago (SLA {sla:g} h)",
        metadata={"city": city, "lag_hours": lag, "sla_hours": sla},
        partition=encode_city_key(city),
    )


@functools.cache
def build_sync_health(scope: AccountScope) -> dg.AssetsDefinition:
    """The account's health figures and its cities' freshness."""

    @dg.asset(
        key=scope.key(HEALTH.path[-1]),
        group_name=scope.group,
        required_resource_keys={"sync_db", scope.supplier_key},
        description=(
            "The sync's health: success of batches and cities, bad records, missing fields, "
            "dead letters and their fix rate, reviews, freshness, outbox lag, supplier "
            "requests, 429s and retries, hotels/s. Also judges each city's freshness on "
            "published_hotels."
        ),
    )
    def sync_health_asset(context: dg.AssetExecutionContext) -> Any:
        yield from _health(context, scope, **resources_of(context, scope, "sync_db"))

    return sync_health_asset


def _health(
    context: dg.AssetExecutionContext,
    scope: AccountScope,
    sync_db: SyncDatabaseResource,
    supplier: SupplierResource,
) -> Any:
    """Computes the figures (bounded queries) and each city's freshness."""
    with sync_db.opened() as db:
        health = sync_health(db, task_code=supplier.task_code, supplier_id=supplier.supplier_id)
        sla = _sla_hours(db, supplier.task_code)
    known = set(context.instance.get_dynamic_partitions(scope.partitions_name))
    cities = [(c, lag) for c, lag in health.city_lag_hours.items() if encode_city_key(c) in known]
    published = scope.key(PUBLISHED.path[-1])
    for start in range(0, len(cities), EVENTS_PER_TRANSACTION):
        with one_event_transaction(context.instance):
            for city, lag in cities[start : start + EVENTS_PER_TRANSACTION]:
                yield _freshness(city, lag, sla, published)
    stale = sum(1 for _, lag in cities if lag > sla)
    context.log.info(
        f"task {health.task_code}: {len(cities)} cities, {stale} over the {sla:g} h SLA; "
        f"batch success {health.batch_success_rate_24h:.0%} over 24 h"
    )
    yield dg.MaterializeResult(metadata={**health_metadata(health), "cities_over_sla": stale})


build_sync_health_job = housekeeping_job(
    "sync_health_job", HEALTH, "Compute the sync's health figures and each city's freshness."
)


@functools.cache
def build_sync_health_schedule(scope: AccountScope) -> dg.ScheduleDefinition:
    """The account's health schedule, every 10 minutes."""
    return every(
        build_sync_health_job(scope),
        scope.name("sync_health_schedule"),
        "*/10 * * * *",
        "Every 10 minutes: the health figures, plotted over time, and city freshness.",
    )


def alert_context(
    instance: dg.DagsterInstance,
    db: SyncDatabase,
    task_code: str,
    failed_run_id: str | None = None,
    *,
    reconciliation: dg.AssetKey = RECONCILIATION,
) -> alerts.Context:
    """What Dagster's records add to an alert round: the latest reconciliation's remaining
    differences, and the run behind the task's latest failed batch (its link).

    Args:
        instance: The Dagster instance the runs and materializations are in.
        db: The sync database (the latest failed batch and its trigger).
        task_code: The task judged.
        failed_run_id: A run known to have failed (the run-failure sensor's), linked as is.
        reconciliation: The task's account's reconciliation asset.
    """
    latest = instance.fetch_materializations(reconciliation, limit=1).records
    remaining: int | None = None
    if latest:
        m = latest[0].asset_materialization
        value = m.metadata.get("remaining_differences") if m is not None else None
        if value is not None and isinstance(value.value, (int, float)):
            remaining = int(value.value)
    if failed_run_id is None:
        trigger = alerts.latest_failed_trigger(db, task_code)
        failed_run_id = _failed_run_of(instance, trigger) if trigger else None
    return alerts.Context(reconciliation_remaining=remaining, failed_run_id=failed_run_id)


def _failed_run_of(instance: dg.DagsterInstance, trigger_id: str) -> str | None:
    """The newest failed run of a batch's trigger: the run itself (a launch, a schedule or
    sensor run), a run tagged with the trigger (the CLI, re-pulls, compensation), or a run of
    the backfill the trigger names."""
    failed = [dg.DagsterRunStatus.FAILURE]
    run = instance.get_run_by_id(trigger_id)
    if run is not None and run.status in failed:
        return run.run_id
    for tag in (TRIGGER_TAG, BACKFILL_TAG):
        runs = instance.get_runs(
            filters=dg.RunsFilter(tags={tag: trigger_id}, statuses=failed), limit=1
        )
        if runs:
            return runs[0].run_id
    return None


def run_alerts(
    instance: dg.DagsterInstance,
    sync_db: SyncDatabaseResource,
    supplier: SupplierResource,
    *,
    failed_run_id: str | None = None,
    scope: AccountScope = DEFAULT_SCOPE,
) -> alerts.Round:
    """One alert round for the configured supplier's task (what both sensors do)."""
    settings = load_settings()
    channel = alerts.open_channel(settings.alert_url, settings.state_dir)
    with sync_db.opened() as db:
        return alerts.check(
            db,
            channel,
            task_code=supplier.task_code,
            context=alert_context(
                instance,
                db,
                supplier.task_code,
                failed_run_id,
                reconciliation=scope.key(RECONCILIATION.path[-1]),
            ),
            dagster_url=settings.dagster_url or "http://localhost:3000",
        )


def _said(done: alerts.Round) -> str:
    holding = [f.condition + (f"/{f.subject}" if f.subject else "") for f in done.findings]
    return (
        f"{len(holding)} conditions hold ({', '.join(holding) or 'none'}); "
        f"{len(done.changes.fired)} started, {len(done.changes.resolved)} cleared; "
        f"{done.delivered.sent} sent, {done.delivered.failed} to retry"
    )


@functools.cache
def build_alert_sensors(scope: AccountScope) -> tuple[dg.SensorDefinition, dg.SensorDefinition]:
    """The account's alert sensor (each minute) and its run-failure sensor."""

    @dg.sensor(
        name=scope.name("alert_sensor"),
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            "Each minute: judge the alert conditions, start or clear alerts (one message "
            "each), and send what is due to the alert channel (a failing channel is retried "
            "later)."
        ),
    )
    @functools.partial(with_resource_key, param="supplier", key=scope.supplier_key)
    def alert_sensor(
        context: dg.SensorEvaluationContext,
        sync_db: SyncDatabaseResource,
        supplier: SupplierResource,
    ) -> dg.SkipReason:
        """An alert round; it requests no run."""
        return dg.SkipReason(_said(run_alerts(context.instance, sync_db, supplier, scope=scope)))

    @dg.run_failure_sensor(
        name=scope.name("alert_on_run_failure"),
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="When a run fails: an alert round at once, linking the failed run.",
    )
    @functools.partial(with_resource_key, param="supplier", key=scope.supplier_key)
    def alert_on_run_failure(
        context: dg.RunFailureSensorContext,
        sync_db: SyncDatabaseResource,
        supplier: SupplierResource,
    ) -> None:
        """An alert round with the failed run's link."""
        done = run_alerts(
            context.instance,
            sync_db,
            supplier,
            failed_run_id=context.dagster_run.run_id,
            scope=scope,
        )
        context.log.info(_said(done))

    return alert_sensor, alert_on_run_failure


sync_health_asset = build_sync_health(DEFAULT_SCOPE)
sync_health_job = build_sync_health_job(DEFAULT_SCOPE)
sync_health_schedule = build_sync_health_schedule(DEFAULT_SCOPE)
alert_sensor, alert_on_run_failure = build_alert_sensors(DEFAULT_SCOPE)


def _build(scope: AccountScope) -> dg.Definitions:
    return dg.Definitions(
        assets=[build_sync_health(scope)],
        jobs=[build_sync_health_job(scope)],
        schedules=[build_sync_health_schedule(scope)],
        sensors=list(build_alert_sensors(scope)),
    )


@dg.definitions
def defs() -> dg.Definitions:
    """Every account's health asset, its schedule and its alert sensors."""
    return per_account(_build)
