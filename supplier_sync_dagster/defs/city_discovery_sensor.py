"""City discovery: the supplier's /v1/cities becomes the set of city partitions (per account)."""

import functools

import dagster as dg

from supplier_sync_dagster.defs.accounts import (
    DEFAULT_SCOPE,
    AccountScope,
    per_account,
    with_resource_key,
)
from supplier_sync_dagster.defs.resources import SupplierResource


@functools.cache
def build_city_discovery_sensor(scope: AccountScope) -> dg.SensorDefinition:
    """The account's discovery sensor: its supplier's cities become its city partitions."""

    @dg.sensor(
        name=scope.name("city_discovery_sensor"),
        minimum_interval_seconds=3600,
        default_status=dg.DefaultSensorStatus.STOPPED,
        description="Adds a partition for every city the supplier serves that is not one yet.",
    )
    @functools.partial(with_resource_key, param="supplier", key=scope.supplier_key)
    def city_discovery_sensor(
        context: dg.SensorEvaluationContext, supplier: SupplierResource
    ) -> dg.SensorResult:
        """One call to the supplier's city list; new cities become partitions (keys encoded safely)."""
        with supplier.client() as client:
            codes = [c.city_code for c in client.list_cities().data.cities]
        new = scope.new_city_keys(context.instance, codes)
        context.log.info(f"supplier serves {len(codes)} cities, {len(new)} new")
        return dg.SensorResult(
            dynamic_partitions_requests=[scope.partitions.build_add_request(new)] if new else [],
            skip_reason=None if new else dg.SkipReason(f"all {len(codes)} cities are partitions"),
        )

    return city_discovery_sensor


city_discovery_sensor = build_city_discovery_sensor(DEFAULT_SCOPE)


@dg.definitions
def defs() -> dg.Definitions:
    """Every account's city discovery sensor."""
    return per_account(lambda scope: dg.Definitions(sensors=[build_city_discovery_sensor(scope)]))
