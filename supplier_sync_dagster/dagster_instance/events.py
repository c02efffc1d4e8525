"""What ``defs/`` may use of Dagster's internals: the whole interface, five names.

- :func:`one_event_transaction`: the events an asset stores in a block share one
  transaction per shard of the pooled SQLite event log (the embedded instance; a plain one
  opened by the command line or swapped in by :func:`pooled_events`), and one insert
  statement on the production profile's pooled MySQL event log (``mysql_storage.py`` says
  why not one transaction there); any other instance stores them as before.
- :func:`pooled_events`: a step's events of a run worker of a user's plain SQLite
  instance stored through the pooled event log on the same files (``storage.py``).
- :func:`check_target`: the materialization an ``AssetCheckEvaluation`` judged, built from
  its record as Dagster's own ``AssetCheckResult`` builds it for a partition (Dagster does
  not export the class).
- :func:`latest_evaluation`: a check's latest result on a partition (its execution history
  filtered by partition has no public API).
- :func:`stored_target`: the materialization of a partition this process stored last, as a
  check evaluation's target, without reading the event log (the pooled storages remember
  it); None where that is not known.

``supplier_sync_dagster_tests/dagster_instance/test_dagster_internals.py`` fails when a
Dagster upgrade breaks what this package uses of Dagster's private modules.
"""

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, runtime_checkable

import dagster as dg
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus

from supplier_sync_dagster.dagster_instance.storage import (
    PooledSqliteEventLogStorage,
    StoredMaterializations,
    pooled_events,
)

__all__ = [
    "CheckTarget",
    "check_target",
    "latest_evaluation",
    "one_event_transaction",
    "pooled_events",
    "stored_target",
]

# What ``dg.AssetCheckEvaluation(target_materialization_data=...)`` takes.
CheckTarget = AssetCheckEvaluationTargetMaterializationData


@runtime_checkable
class _BatchingEventLog(Protocol):
    """An event log that inserts a block's events together (``PooledMySQLEventLogStorage``,
    not imported here: that would import dagster-mysql into every process)."""

    def batched(self) -> AbstractContextManager[None]:
        """The thread's events in the block inserted together."""


def one_event_transaction(instance: dg.DagsterInstance) -> AbstractContextManager[None]:
    """The instance's events stored in the block share one transaction per shard.

    With the pooled SQLite event log, a city's events cost one commit per shard instead of
    one or two per event; with the pooled MySQL event log, one insert statement for the
    events stored between two check targets asked for; any other event log stores them as
    before.
    """
    storage = instance.event_log_storage
    if isinstance(storage, PooledSqliteEventLogStorage):
        return storage.one_transaction()
    if isinstance(storage, _BatchingEventLog):
        return storage.batched()
    return nullcontext()


def check_target(record: dg.EventLogRecord) -> CheckTarget:
    """The target of a check evaluation that judges the materialization of ``record``: the
    partition's check status in the UI follows that materialization."""
    return CheckTarget(
        run_id=record.event_log_entry.run_id,
        storage_id=record.storage_id,
        timestamp=record.timestamp,
    )


def stored_target(
    instance: dg.DagsterInstance, key: dg.AssetKey, partition: str
) -> CheckTarget | None:
    """The materialization of ``key`` for ``partition`` that this process stored last, as a
    check evaluation's target; None when the instance's storage does not remember it (then
    read the partition's latest materialization).

    What a city's checks judge is the materialization its own events just stored; the pooled
    storages know its storage id without a query.
    """
    memory = getattr(instance.event_log_storage, "stored_materializations", None)
    if not isinstance(memory, StoredMaterializations):
        return None
    found = memory.lookup(key.to_string(), partition)
    if found is None:
        return None
    run_id, storage_id, timestamp = found
    return CheckTarget(run_id=run_id, storage_id=storage_id, timestamp=timestamp)


def latest_evaluation(
    instance: dg.DagsterInstance, check: dg.AssetCheckKey, partition: str
) -> dg.AssetCheckEvaluation | None:
    """The latest result (passed or failed) of ``check`` on ``partition``, if any."""
    records = instance.event_log_storage.get_asset_check_execution_history(
        check,
        limit=1,
        status={AssetCheckExecutionRecordStatus.SUCCEEDED, AssetCheckExecutionRecordStatus.FAILED},
        partition_filter=PartitionKeyFilter(key=partition),
    )
    event = records[0].event if records else None
    data = event.dagster_event.event_specific_data if event and event.dagster_event else None
    return data if isinstance(data, dg.AssetCheckEvaluation) else None
