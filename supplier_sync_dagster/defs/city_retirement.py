"""The Dagster side of a city's retirement (``core.sync.retire``): its partition leaves the
account's active set, and comes back with the city.

Deleting a dynamic partition keeps its materializations in the event log: the UI still shows
the city's history, and a range run or a schedule no longer asks for it. The city discovery
sensor, ``sync --full`` and the city sync's runs (a scheduled run, a backfill, a run from
the UI, when one of their cities answered 404) all use it: a dropped city fails one run at
most, never every run.
"""

from __future__ import annotations

from collections.abc import Iterable

import dagster as dg

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.leasing.batches import list_batches
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync.retire import (
    Retirement,
    RetirePlan,
    plan_retirement,
    retire_cities,
)
from supplier_sync_dagster.defs.accounts import AccountScope
from supplier_sync_dagster.defs.partitions import decode_city_key, encode_city_key


def partition_cities(instance: dg.DagsterInstance, scope: AccountScope) -> list[str]:
    """The city codes of the account's partitions (a key no encoding makes is left out)."""
    cities = []
    for key in instance.get_dynamic_partitions(scope.partitions_name):
        try:
            cities.append(decode_city_key(key))
        except ConfigError:
            continue
    return cities


def retiring_keys(instance: dg.DagsterInstance, scope: AccountScope, plan: RetirePlan) -> list[str]:
    """The partition keys of the cities that retire (those that are partitions)."""
    known = set(instance.get_dynamic_partitions(scope.partitions_name))
    return [key for key in (encode_city_key(c) for c in plan.retire) if key in known]


def drop_partitions(instance: dg.DagsterInstance, scope: AccountScope, keys: Iterable[str]) -> None:
    """Removes partitions from the account's active set (their history stays)."""
    for key in keys:
        instance.delete_dynamic_partition(scope.partitions_name, key)


def plan_for(
    instance: dg.DagsterInstance,
    db: SyncDatabase,
    scope: AccountScope,
    *,
    supplier_id: int,
    listed: Iterable[str],
    allow_mass_drop: bool = False,
) -> RetirePlan:
    """The retirement plan of the supplier's city list against the account's partitions.

    Raises:
        EmptyCityList: The supplier listed no city.
    """
    return plan_retirement(
        db,
        supplier_id=supplier_id,
        listed=listed,
        partitions=partition_cities(instance, scope),
        allow_mass_drop=allow_mass_drop,
    )


def retire_against_latest_full(
    db: SyncDatabase, plan: RetirePlan, *, supplier_id: int, task_code: str
) -> Retirement | None:
    """Retires the plan's cities against the task's latest full batch (one miss per batch:
    the hourly sensor counts once per nightly batch); None when the task has none yet."""
    batches = [b for b in list_batches(db, task_code=task_code, limit=1) if b.sync_mode == "FULL"]
    if not batches:
        return None
    return retire_cities(
        db, plan, supplier_id=supplier_id, batch_id=batches[0].batch_id, task_code=task_code
    )


def retire_unlisted(
    instance: dg.DagsterInstance,
    db: SyncDatabase,
    scope: AccountScope,
    client: SupplierClient,
    *,
    supplier_id: int,
    task_code: str,
    batch_id: str,
) -> RetirePlan:
    """After a run in which a city answered 404: asks the supplier for its city list once,
    retires the cities it no longer lists against the run's batch and removes their
    partitions, so that the next run does not ask for them.

    Raises:
        EmptyCityList: The supplier listed no city (nothing retires).
        SupplierError: The city list could not be read.
    """
    codes = [c.city_code for c in client.list_cities().data.cities]
    plan = plan_for(instance, db, scope, supplier_id=supplier_id, listed=codes)
    retire_cities(db, plan, supplier_id=supplier_id, batch_id=batch_id, task_code=task_code)
    drop_partitions(instance, scope, retiring_keys(instance, scope, plan))
    return plan
