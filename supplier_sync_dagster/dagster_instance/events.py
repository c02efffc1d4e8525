"""What ``defs/`` may use of Dagster's internals: the whole interface, four names.

- :func:`one_event_transaction`: the events an asset stores in a block share one
  transaction per shard of the pooled SQLite event log (the embedded instance, a plain one
  opened by the command line) and one transaction of the pooled MySQL event log (the
  production profile); any other instance stores them as before.
- :func:`pooled_events`: a step's events of a run worker of a user's plain SQLite
  instance stored through the pooled event log on the same files (``storage.py``).
- :func:`check_target`: the materialization an ``AssetCheckEvaluation`` judged, built from
  its record as Dagster's own ``AssetCheckResult`` builds it for a partition (Dagster does
  not export the class).
- :func:`latest_evaluation`: a check's latest result on a partition (its execution history
  filtered by partition has no public API).

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

from supplier_sync_dagster.dagster_instance.storage import pooled_events

__all__ = [
    "CheckTarget",
    "check_target",
    "latest_evaluation",
    "one_event_transaction",
    "pooled_events",
]

# What ``dg.AssetCheckEvaluation(target_materialization_data=...)`` takes.
CheckTarget = AssetCheckEvaluationTargetMaterializationData


@runtime_checkable
class OneTransaction(Protocol):
    """An event log of this package that stores a block's events in one transaction
    (``storage.PooledSqliteEventLogStorage``, ``mysql_storage.PooledMySQLEventLogStorage``;
    named by the method, so that importing this module does not import dagster-mysql)."""

    def one_transaction(self) -> AbstractContextManager[None]:
        """The block's events in one transaction (per shard)."""
        ...


def one_event_transaction(instance: dg.DagsterInstance) -> AbstractContextManager[None]:
    """The instance's events stored in the block share one transaction per shard.

    With a pooled event log of this package, a city's events cost one commit per shard
    instead of one or two per event; any other event log stores them as before.
    """
    storage = instance.event_log_storage
    if isinstance(storage, OneTransaction):
        return storage.one_transaction()
    return nullcontext()


def check_target(record: dg.EventLogRecord) -> CheckTarget:
    """The target of a check evaluation that judges the materialization of ``record``: the
    partition's check status in the UI follows that materialization."""
    return CheckTarget(
        run_id=record.event_log_entry.run_id,
        storage_id=record.storage_id,
        timestamp=record.timestamp,
    )


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
