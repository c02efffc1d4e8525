"""City discovery: the supplier's /v1/cities becomes the set of city partitions."""

import dagster as dg

from supplier_sync_dagster.defs.partitions import CITY_PARTITIONS, city_partitions, encode_city_key
from supplier_sync_dagster.defs.resources import SupplierResource


@dg.sensor(
    name="city_discovery_sensor",
    minimum_interval_seconds=3600,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="Adds a partition for every city the supplier serves that is not one yet.",
)
def city_discovery_sensor(
    context: dg.SensorEvaluationContext, supplier: SupplierResource
) -> dg.SensorResult:
    """One call to the supplier's city list; new cities become partitions (keys encoded safely)."""
    with supplier.client() as client:
        codes = [c.city_code for c in client.list_cities().data.cities]
    known = set(context.instance.get_dynamic_partitions(CITY_PARTITIONS))
    new = [key for key in (encode_city_key(c) for c in codes) if key not in known]
    context.log.info(f"supplier serves {len(codes)} cities, {len(new)} new")
    return dg.SensorResult(
        dynamic_partitions_requests=[city_partitions.build_add_request(new)] if new else [],
        skip_reason=None if new else dg.SkipReason(f"all {len(codes)} cities are partitions"),
    )
