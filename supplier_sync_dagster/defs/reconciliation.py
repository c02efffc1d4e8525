"""Catalog reconciliation in Dagster: the supplier's city summaries against the catalog, daily,
and a full sync of exactly the cities that differ.

``hotel_catalog_reconciliation`` (downstream of ``published_hotels``) compares every city
(:func:`~supplier_sync_dagster.core.repair.reconcile.reconcile`) and records the differing cities
as a table, with numbers the UI plots and an alert can use: cities compared, differing,
re-pulled, and the **remaining differences** (cities that still differ although the previous
reconciliation re-pulled them: a re-pull does not fix those, a person must look; they are not
re-pulled again), and apart from them the cities **waiting on tickets** (they differ only by
hotels with open dead-letter tickets: neither re-pulled nor differences; the rule is
:func:`~supplier_sync_dagster.core.repair.reconcile.plan_repull`, the CLI's too).
``reconciliation_repull_sensor`` sees each new materialization and requests
one full-sync run per city to re-pull (one trigger: they share one batch), so the next
reconciliation shows them equal.
"""

import functools

import dagster as dg
from pydantic import Field

from supplier_sync_dagster.core.repair.reconcile import Tolerance, plan_repull, reconcile
from supplier_sync_dagster.defs.accounts import (
    DEFAULT_SCOPE,
    AccountScope,
    per_account,
    resources_of,
)
from supplier_sync_dagster.defs.city_keys import PUBLISHED
from supplier_sync_dagster.defs.full_sync_schedule import build_city_resync_sensor
from supplier_sync_dagster.defs.resources import (
    PayloadStoreResource,
    SupplierResource,
    SyncDatabaseResource,
)
from supplier_sync_dagster.defs.triggers import every, housekeeping_job

RECONCILIATION = dg.AssetKey("hotel_catalog_reconciliation")
REPULL = "repull_cities"


class ReconcileConfig(dg.Config):
    """The tolerance (the launchpad's form)."""

    absolute: int = Field(default=2, description="Hotels apart that never count as different.")
    relative: float = Field(default=0.02, description="...nor this share of the supplier's count.")
    max_lag_hours: float = Field(
        default=6.0, description="The catalog's newest change may trail the supplier's this long."
    )
    repull: bool = Field(default=True, description="Re-pull the cities that differ.")


@functools.cache
def build_reconciliation(scope: AccountScope) -> dg.AssetsDefinition:
    """The account's reconciliation asset (downstream of its published hotels)."""
    key = scope.key(RECONCILIATION.path[-1])

    @dg.asset(
        key=key,
        deps=[scope.key(PUBLISHED.path[-1])],
        group_name=scope.group,
        pool=scope.pool,
        required_resource_keys={"sync_db", "payloads", scope.supplier_key},
        description=(
            "Each city's supplier summary (hotels, active, newest change) against the catalog, "
            "and a new walk of a city whose last walk drifted; the cities beyond the tolerance "
            "are re-pulled by a full sync of exactly those cities."
        ),
    )
    def hotel_catalog_reconciliation(
        context: dg.AssetExecutionContext, config: ReconcileConfig
    ) -> dg.MaterializeResult:
        return _reconcile(
            context,
            config,
            key,
            **resources_of(context, scope, "sync_db", "payloads"),
        )

    return hotel_catalog_reconciliation


def _reconcile(
    context: dg.AssetExecutionContext,
    config: ReconcileConfig,
    key: dg.AssetKey,
    *,
    sync_db: SyncDatabaseResource,
    payloads: PayloadStoreResource,
    supplier: SupplierResource,
) -> dg.MaterializeResult:
    """Compares every city; the differing ones are a table, the ones to re-pull a list."""
    tolerance = Tolerance(
        absolute=config.absolute,
        relative=config.relative,
        max_lag_seconds=config.max_lag_hours * 3600,
    )
    with sync_db.opened() as db, supplier.client() as client:
        # The city list the last full sync stored: a summary per city is the whole cost.
        report = reconcile(
            db,
            client,
            supplier_id=supplier.supplier_id,
            tolerance=tolerance,
            store=payloads.open(),
            task_code=supplier.task_code,
            walk=supplier.walk_limits(),
        )
    plan = plan_repull(
        report, repulled_before=_previous_repull(context.instance, key), repull=config.repull
    )
    for c in report.differing:
        context.log.warning(f"city {c.city_code!r} differs: {'; '.join(c.reasons)}")
    for c in report.waiting:
        context.log.info(
            f"city {c.city_code!r} waits on the open dead letters of {len(c.tickets)} "
            f"hotel(s): {'; '.join(c.explained)}"
        )
    for c in report.failed:
        context.log.warning(f"city {c.city_code!r} not compared: {c.error}")
    columns = [
        ("city", "string"),
        ("supplier_hotels", "int"),
        ("catalog_hotels", "int"),
        ("supplier_active", "int"),
        ("catalog_active", "int"),
        ("supplier_max_updated_at", "string"),
        ("catalog_max_updated_at", "string"),
        ("rewalked", "string"),
        ("missing_hotels", "int"),
        ("reasons", "string"),
    ]
    rows = [
        dg.TableRecord({name: c.row()[name] for name, _ in columns if c.row()[name] is not None})
        for c in report.differing[:500]
    ]
    return dg.MaterializeResult(
        metadata={
            "cities_compared": len(report.cities) - len(report.failed),
            "cities_not_compared": len(report.failed),
            "cities_differing": len(report.differing),
            "cities_repulled": len(plan.repull),
            "remaining_differences": len(plan.remaining),
            "cities_waiting_on_tickets": len(plan.waiting),
            "hotels_waiting_on_tickets": plan.hotels_waiting,
            "cities_walked_again": sum(c.rewalked is not None for c in report.cities),
            "supplier_requests": report.requests,
            "seconds": round(report.seconds, 3),
            "differences": dg.MetadataValue.table(
                rows, schema=dg.TableSchema(columns=[dg.TableColumn(n, t) for n, t in columns])
            ),
            REPULL: dg.MetadataValue.json(plan.repull),
            "remaining_cities": dg.MetadataValue.json(plan.remaining),
            "waiting_cities": dg.MetadataValue.json(plan.waiting),
        }
    )


def _previous_repull(instance: dg.DagsterInstance, key: dg.AssetKey) -> list[str]:
    """The cities the latest earlier reconciliation re-pulled."""
    event = instance.get_latest_materialization_event(key)
    if event is None or event.asset_materialization is None:
        return []
    value = event.asset_materialization.metadata.get(REPULL)
    data = value.value if value is not None else []
    return [str(c) for c in data] if isinstance(data, list) else []


build_reconciliation_job = housekeeping_job(
    "catalog_reconciliation_job",
    RECONCILIATION,
    "Compare every city's supplier summary with the catalog.",
)


@functools.cache
def build_reconciliation_schedule(scope: AccountScope) -> dg.ScheduleDefinition:
    """The account's daily reconciliation (its ``schedules.reconciliation``; 04:00 UTC)."""
    cron = scope.cron("reconciliation", "0 4 * * *")
    return every(
        build_reconciliation_job(scope),
        scope.name("catalog_reconciliation_schedule"),
        cron or "0 4 * * *",
        "Every city's supplier summary against the catalog (a request per city).",
    )


@functools.cache
def build_repull_sensor(scope: AccountScope) -> dg.SensorDefinition:
    """The account's re-pull sensor: its full sync of the cities its reconciliation lists."""
    return build_city_resync_sensor(
        scope,
        name="reconciliation_repull_sensor",
        watched=scope.key(RECONCILIATION.path[-1]),
        metadata_key=REPULL,
        source="SENSOR",
        trigger_prefix="repull",
        description=(
            "After each reconciliation: one full-sync run per city that differs, all of one "
            "trigger (one batch), so the next reconciliation shows them equal."
        ),
    )


hotel_catalog_reconciliation = build_reconciliation(DEFAULT_SCOPE)
reconciliation_job = build_reconciliation_job(DEFAULT_SCOPE)
catalog_reconciliation_schedule = build_reconciliation_schedule(DEFAULT_SCOPE)
reconciliation_repull_sensor = build_repull_sensor(DEFAULT_SCOPE)


def _build(scope: AccountScope) -> dg.Definitions:
    on_schedule = scope.on_schedule("reconciliation")
    return dg.Definitions(
        assets=[build_reconciliation(scope)],
        jobs=[build_reconciliation_job(scope)],
        schedules=[build_reconciliation_schedule(scope)] if on_schedule else [],
        sensors=[build_repull_sensor(scope)],
    )


@dg.definitions
def defs() -> dg.Definitions:
    """Every account's reconciliation, its job, schedule and re-pull sensor."""
    return per_account(_build)
