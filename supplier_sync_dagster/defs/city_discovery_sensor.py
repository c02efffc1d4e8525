"""City discovery: the supplier's /v1/cities becomes the set of city partitions (per account).

A city it lists that is not a partition is added (a city that came back included); a city
partition it no longer lists retires (``city_retirement``): its partition is removed from
the active set and its hotels count a miss against the latest full batch. A mass drop is
held for a person, and an empty list changes nothing.
"""

import functools

import dagster as dg

from supplier_sync_dagster.core.errors import EmptyCityList
from supplier_sync_dagster.core.sync.retire import RetirePlan, held_line
from supplier_sync_dagster.defs.accounts import (
    DEFAULT_SCOPE,
    AccountScope,
    per_account,
    with_resource_key,
)
from supplier_sync_dagster.defs.city_retirement import (
    plan_for,
    retire_against_latest_full,
    retiring_keys,
)
from supplier_sync_dagster.defs.resources import SupplierResource, SyncDatabaseResource


@functools.cache
def build_city_discovery_sensor(scope: AccountScope) -> dg.SensorDefinition:
    """The account's discovery sensor: its supplier's cities become its city partitions."""

    @dg.sensor(
        name=scope.name("city_discovery_sensor"),
        minimum_interval_seconds=3600,
        default_status=dg.DefaultSensorStatus.STOPPED,
        description="Adds a partition per new city of the supplier; retires those it drops.",
    )
    @functools.partial(with_resource_key, param="supplier", key=scope.supplier_key)
    def city_discovery_sensor(
        context: dg.SensorEvaluationContext,
        supplier: SupplierResource,
        sync_db: SyncDatabaseResource,
    ) -> dg.SensorResult:
        """One call to the supplier's city list; new cities become partitions (keys encoded
        safely), cities no longer listed retire."""
        with supplier.client() as client:
            codes = [c.city_code for c in client.list_cities().data.cities]
        new = scope.new_city_keys(context.instance, codes)
        try:
            with sync_db.opened() as db:
                plan = plan_for(
                    context.instance, db, scope, supplier_id=supplier.supplier_id, listed=codes
                )
                retire_against_latest_full(
                    db, plan, supplier_id=supplier.supplier_id, task_code=supplier.task_code
                )
        except EmptyCityList as err:
            context.log.error(f"{err.error_code}: {err}")
            return dg.SensorResult(skip_reason=dg.SkipReason(f"{err.error_code}: {err}"))
        gone = retiring_keys(context.instance, scope, plan)
        context.log.info(_summary(codes, new, gone, plan))
        requests: list[dg.AddDynamicPartitionsRequest | dg.DeleteDynamicPartitionsRequest] = (
            [scope.partitions.build_add_request(new)] if new else []
        )
        if gone:
            requests.append(scope.partitions.build_delete_request(gone))
        quiet = not requests and not plan.held
        return dg.SensorResult(
            dynamic_partitions_requests=requests,
            skip_reason=dg.SkipReason(f"all {len(codes)} cities are partitions") if quiet else None,
        )

    return city_discovery_sensor


def _summary(codes: list[str], new: list[str], gone: list[str], plan: RetirePlan) -> str:
    line = f"supplier serves {len(codes)} cities, {len(new)} new, {len(gone)} retired"
    return f"{line}; {held_line(plan.held)}" if plan.held else line


city_discovery_sensor = build_city_discovery_sensor(DEFAULT_SCOPE)


@dg.definitions
def defs() -> dg.Definitions:
    """Every account's city discovery sensor."""
    return per_account(lambda scope: dg.Definitions(sensors=[build_city_discovery_sensor(scope)]))
