"""The outbox's read models in Dagster: their resource, the search projection as an asset
downstream of the catalog, a job that drains the outbox (and frees stuck events), and its
schedule.

``hotel_search_projection`` depends on ``published_hotels``, so lineage shows catalog ->
search. Materializing it runs one dispatcher until the outbox has nothing due (bounded by
``max_seconds``), after the stuck-message pass, and records what moved per stage, failures,
the backlog left and the lag, as numeric metadata the UI plots over time. The schedule runs
it every minute; ``supplier-sync dispatch`` runs dispatchers outside Dagster, and both can
run at once (each event is handled by one dispatcher at a time).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
from pydantic import Field

from supplier_sync_dagster.core.outbox.dispatch import DEFAULT_BATCH_SIZE, Dispatcher
from supplier_sync_dagster.core.outbox.machine import (
    STAGES,
    make_owner,
    outbox_status,
    release_stuck,
)
from supplier_sync_dagster.core.outbox.projections import (
    Projections,
    ProjectionSettings,
    open_projections,
    reconcile_projection,
)
from supplier_sync_dagster.core.settings import load_settings, load_storage_settings
from supplier_sync_dagster.defs.accounts import CATALOG, account_scopes
from supplier_sync_dagster.defs.city_keys import GROUP, PUBLISHED
from supplier_sync_dagster.defs.resources import SyncDatabaseResource, env_var, setting_field
from supplier_sync_dagster.defs.triggers import scheduled_asset_job


class ProjectionsResource(dg.ConfigurableResource):
    """Where the outbox's stages write: the search index, the hotel cache, subscribers."""

    search_url: str | None = setting_field(
        "search_url",
        "The hotel search read model, postgresql://user@host:5432/db",
        unset="a SQLite FTS5 file in the state folder.",
    )
    cache_url: str | None = setting_field(
        "redis_url", "Redis for the hotel cache", unset="in-process."
    )
    amqp_url: str | None = setting_field(
        "amqp_url",
        "RabbitMQ for subscribers, amqp://user:pw@host:5672/vhost",
        unset="a JSON-lines file in the state folder.",
    )
    exchange: str = Field(
        default="supplier_sync.events", description="The subscribers' topic exchange."
    )
    batch_size: int = Field(default=DEFAULT_BATCH_SIZE, description="Events per claim.")

    def settings(self) -> ProjectionSettings:
        """The targets, with the embedded defaults in the state folder."""
        return ProjectionSettings(
            state_dir=load_storage_settings().state_dir,
            search_url=self.search_url,
            cache_url=self.cache_url,
            amqp_url=self.amqp_url,
            exchange=self.exchange,
        )

    @contextmanager
    def opened(self) -> Iterator[Projections]:
        """The targets for the block, closed at the end."""
        targets = open_projections(self.settings())
        try:
            yield targets
        finally:
            targets.close()


class DrainConfig(dg.Config):
    """How long one materialization may drain."""

    max_seconds: float = Field(default=50.0, description="Stop draining after this long.")


@dg.asset(
    key="hotel_search_projection",
    deps=[PUBLISHED],
    group_name=GROUP,
    description=(
        "The hotel search read model (and the cache and subscribers behind it), projected from "
        "the catalog by the outbox's stages. Each materialization drains the outbox once."
    ),
)
def hotel_search_projection(
    context: dg.AssetExecutionContext,
    config: DrainConfig,
    sync_db: SyncDatabaseResource,
    projections: ProjectionsResource,
) -> dg.MaterializeResult:
    """Frees stuck events, then dispatches until nothing is due; reports what moved."""
    with sync_db.opened() as db, projections.opened() as targets:
        released = release_stuck(db)
        for stage, n in released.items():
            context.log.warning(f"{n} stuck {stage} events returned to READY")
        dispatcher = Dispatcher(
            db, targets, owner=make_owner("dagster"), batch_size=projections.batch_size
        )
        report = dispatcher.drain(max_seconds=config.max_seconds)
        status = outbox_status(db)
    metadata: dict[str, dg.RawMetadataValue] = {
        "stuck_released": sum(released.values()),
        "ready_left": status.total("READY"),
        "failed_total": status.total("FAILED"),
        "drain_seconds": round(report.seconds, 3),
    }
    for stage in STAGES:
        counts = report.stages[stage]
        metadata[f"{stage.lower()}_done"] = counts.advanced
        metadata[f"{stage.lower()}_retrying"] = counts.retrying
        metadata[f"{stage.lower()}_failed"] = counts.failed
        if counts.last_error:
            context.log.warning(f"{stage}: {counts.last_error}")
    for name, lag in (
        ("projection_lag", status.projection_lag),
        ("end_to_end_lag", status.end_to_end_lag),
    ):
        if lag.count:
            metadata[f"{name}_p50_s"] = lag.p50
            metadata[f"{name}_p95_s"] = lag.p95
            metadata[f"{name}_max_s"] = lag.max
    if status.oldest_ready_seconds is not None:
        metadata["oldest_ready_s"] = round(status.oldest_ready_seconds, 3)
    return dg.MaterializeResult(metadata=metadata)


outbox_dispatch_job, outbox_dispatch_schedule = scheduled_asset_job(
    hotel_search_projection,
    "outbox_dispatch_job",
    "Drain the outbox once: stuck events back to READY, then every due stage.",
    schedule="outbox_dispatch_schedule",
    cron="* * * * *",
    when="Every minute: the stuck-message pass and a drain of the outbox (search index, cache, "
    "subscribers), so the read models follow the catalog with the daemon alone.",
)


@dg.asset(
    key="hotel_search_reconciliation",
    deps=[hotel_search_projection],
    group_name=GROUP,
    description=(
        "The search index checked against the catalog, city by city (count and a checksum "
        "over (resource id, publish version)); what differs is re-projected from the catalog."
    ),
)
def hotel_search_reconciliation(
    context: dg.AssetExecutionContext,
    sync_db: SyncDatabaseResource,
    projections: ProjectionsResource,
) -> dg.MaterializeResult:
    """Compares and repairs; the differing cities are a table in the metadata."""
    with sync_db.opened() as db, projections.opened() as targets:
        report = reconcile_projection(db, targets)
    for d in report.differences:
        context.log.warning(
            f"city {d.city_code!r}: {d.missing} missing, {d.stale} stale, {d.extra} extra"
        )
    rows = [
        dg.TableRecord(
            {
                "city": d.city_code,
                "catalog": d.catalog_count,
                "search_index": d.projected_count,
                "missing": d.missing,
                "stale": d.stale,
                "extra": d.extra,
            }
        )
        for d in report.differences[:500]
    ]
    schema = dg.TableSchema(
        columns=[
            dg.TableColumn("city", "string"),
            dg.TableColumn("catalog", "int"),
            dg.TableColumn("search_index", "int"),
            dg.TableColumn("missing", "int"),
            dg.TableColumn("stale", "int"),
            dg.TableColumn("extra", "int"),
        ]
    )
    return dg.MaterializeResult(
        metadata={
            "cities": report.cities,
            "hotels": report.hotels,
            "cities_differing": len(report.differences),
            "hotels_repaired": report.repaired,
            "differences": dg.MetadataValue.table(rows, schema=schema),
        }
    )


projection_reconciliation_job, projection_reconciliation_schedule = scheduled_asset_job(
    hotel_search_reconciliation,
    "projection_reconciliation_job",
    "Check the search index against the catalog and repair what differs.",
    schedule="projection_reconciliation_schedule",
    cron="30 3 * * *",
    when="Daily: the search index against the catalog, repaired where it differs.",
)


@dg.definitions
def defs() -> dg.Definitions:
    """The projection of the one catalog; with several accounts, downstream of every
    account's published hotels through the shared ``platform_hotel_catalog``."""
    scopes = account_scopes()
    projection = hotel_search_projection
    extra: list[dg.AssetSpec] = []
    if any(not scope.is_default for scope in scopes):
        extra = [
            dg.AssetSpec(
                CATALOG,
                deps=[scope.key(PUBLISHED.path[-1]) for scope in scopes],
                group_name=GROUP,
                description=(
                    "The platform's hotel catalog (platform_hotel and its offers in the sync "
                    "database): the one sink every account publishes to, in its supplier's "
                    "mapping namespace. Cross-supplier matching would read it here."
                ),
            )
        ]
        projection = hotel_search_projection.map_asset_specs(
            lambda spec: spec.replace_attributes(deps=[CATALOG])
        )
    settings = load_settings()
    return dg.Definitions(
        assets=[*extra, projection, hotel_search_reconciliation],
        jobs=[outbox_dispatch_job, projection_reconciliation_job],
        schedules=[outbox_dispatch_schedule, projection_reconciliation_schedule],
        # Bound here, not in resources.py: only the outbox's assets use the read models,
        # and the commands that import resources.py need not import them.
        resources={
            "projections": ProjectionsResource(
                search_url=env_var(settings, "search_url"),
                cache_url=env_var(settings, "redis_url"),
                amqp_url=env_var(settings, "amqp_url"),
            )
        },
    )
