"""The embedded Dagster instance's storage: Dagster's SQLite layout, cheaper connections.

Checked in Dagster 1.13.27's source: ``SqliteEventLogStorage._connect`` creates a new
SQLAlchemy engine with ``NullPool`` for every statement, so SQLAlchemy's compiled-statement
cache (kept per engine) is never reused, and the connection closed after each statement is
the process's last one on that file, so SQLite checkpoints the WAL every time; commits run
with ``synchronous=FULL``. A ``sync --full`` pays that for every one of its events, several
per city (planned materializations before its step; materializations, check evaluations and
a log line in it). ``SqliteRunStorage.connect`` follows the same pattern for the run
database.

:class:`PooledSqliteEventLogStorage` and :class:`PooledSqliteRunStorage` keep one engine
per database file (per run shard: a bounded LRU, disposed on eviction) with a small pool
of connections opened with ``PRAGMA synchronous=NORMAL``. The files, their tables and their
places are Dagster's (``history/runs.db``, ``history/runs/<run_id>.db``,
``history/runs/index.db``, ``schedules/schedules.db``): a ``$DAGSTER_HOME`` written by
Dagster's default storage keeps working, and Dagster's default reads one written by these.

:class:`EmbeddedSqliteStorage` is Dagster's ``DagsterSqliteStorage`` with those two, and
:class:`EmbeddedDagsterInstance` makes it the default storage of an instance whose
``dagster.yaml`` names it (``instance_class``) and configures no other storage, under the
instance's own directory as Dagster's default does (a ``storage:`` block could only name a
fixed path or one environment variable).

Both pooled event logs (this one and the MySQL profile's) add one index to Dagster's
``asset_check_executions`` table (:data:`CHECK_HISTORY_INDEX`, by
:func:`ensure_check_history_index`): a check's latest result on one partition is then a
lookup, not a pass over every result of the check. Dagster's own storages read and write
the table as before.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from dagster import Field, IntSource, StringSource
from dagster._core.errors import DagsterInvariantViolationError
from dagster._core.event_api import EventHandlerFn
from dagster._core.events import (
    ASSET_CHECK_EVENTS,
    ASSET_EVENTS,
    EVENT_TYPE_TO_PIPELINE_RUN_STATUS,
    AssetCheckEvaluation,
    AssetCheckEvaluationPlanned,
    DagsterEventType,
)
from dagster._core.events.log import EventLogEntry
from dagster._core.instance import DagsterInstance
from dagster._core.instance.ref import InstanceRef, configurable_storage_data
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus
from dagster._core.storage.event_log.schema import (
    AssetCheckExecutionsTable,
    AssetKeyTable,
    SqlEventLogStorageTable,
)
from dagster._core.storage.event_log.sqlite.sqlite_event_log import (
    INDEX_SHARD_NAME,
    SqliteEventLogStorage,
    SqliteEventLogStorageWatchdog,
)
from dagster._core.storage.runs.sqlite.sqlite_run_storage import SqliteRunStorage
from dagster._core.storage.schedules.sqlite.sqlite_schedule_storage import SqliteScheduleStorage
from dagster._core.storage.sqlite import SQLITE_BUSY_TIMEOUT_SECONDS
from dagster._core.storage.sqlite_storage import (
    DagsterSqliteStorage,
    _event_logs_directory,
    _runs_directory,
    _schedule_directory,
)
from dagster._serdes import ConfigurableClassData, serialize_value
from dagster._time import datetime_from_timestamp
from sqlalchemy.engine import Connection, Engine
from watchdog.events import FileSystemEvent
from watchdog.observers import Observer

# Run shards whose engine stays open besides the index shard's. A run writes its own shard
# and the index; a webserver reads the shards of the runs people look at: a few at a time.
DEFAULT_MAX_CACHED_SHARDS = 8
# Events Dagster hands over in one batch at most: a run's planned events, several per city.
PLANNED_EVENT_BATCH = 20_000

# The events stored by :meth:`PooledSqliteEventLogStorage.store_event` itself; Dagster's
# code stores every other kind. A run writes these for every city: a log line, a
# materialization per asset and a check evaluation per gate, planned materializations.
_FAST_ASSET_EVENTS = frozenset(
    {DagsterEventType.ASSET_MATERIALIZATION, DagsterEventType.ASSET_MATERIALIZATION_PLANNED}
)
_FAST_CHECK_EVENTS = frozenset({DagsterEventType.ASSET_CHECK_EVALUATION})
# Statements built once: executed with parameters, SQLAlchemy compiles each once per engine
# (Dagster builds a new statement with its values inlined as bound literals per event,
# which costs more than the insert itself).
_INSERT_EVENT = SqlEventLogStorageTable.insert()
_INSERT_ASSET_KEY = AssetKeyTable.insert()
_UPDATE_ASSET_KEY = AssetKeyTable.update().where(
    AssetKeyTable.c.asset_key == sa.bindparam("key_asset_key")
)
_INSERT_CHECK = AssetCheckExecutionsTable.insert()
_CHECK_ROW = sa.and_(
    AssetCheckExecutionsTable.c.asset_key == sa.bindparam("key_asset_key"),
    AssetCheckExecutionsTable.c.check_name == sa.bindparam("key_check_name"),
    AssetCheckExecutionsTable.c.run_id == sa.bindparam("key_run_id"),
)
_UPDATE_CHECK = {
    True: AssetCheckExecutionsTable.update().where(
        _CHECK_ROW, AssetCheckExecutionsTable.c.partition == sa.bindparam("key_partition")
    ),
    False: AssetCheckExecutionsTable.update().where(
        _CHECK_ROW, AssetCheckExecutionsTable.c.partition.is_(None)
    ),
}

# A check's latest result on one partition (what a run reports again for a city an earlier
# run of the batch published) is found through this index. Dagster's own put the storage id
# of the judged materialization before the partition, so the database read or sorted every
# result of the check, at each city. Built on a copy of the table, not on Dagster's metadata,
# which creates its tables for every instance in the process.
_CHECK_HISTORY = AssetCheckExecutionsTable.to_metadata(sa.MetaData())
CHECK_HISTORY_INDEX = sa.Index(
    "idx_supplier_sync_check_partition",
    _CHECK_HISTORY.c.asset_key,
    _CHECK_HISTORY.c.check_name,
    _CHECK_HISTORY.c.partition,
    _CHECK_HISTORY.c.id,
    mysql_length={"asset_key": 64, "check_name": 64, "partition": 64},
)

# One idle connection per file. Overflow only for a caller that opens a second connection
# to the same file before closing the first (Dagster's code does not, under ``_db_lock``).
_POOL_SIZE = 1
_MAX_OVERFLOW = 8


def pooled_sqlite_engine(conn_string: str) -> Engine:
    """An engine on one SQLite file with pooled connections and ``synchronous=NORMAL``.

    In WAL mode (Dagster creates its SQLite files so), ``synchronous=NORMAL`` stays durable
    across application crashes: a committed transaction is in the WAL file, which the next
    connection replays. Only an operating system crash or a power loss can lose the last
    transactions before a checkpoint; the database stays consistent. That is acceptable for
    the embedded instance (run history and materialization events, not the sync state,
    which is in the sync database); deployments that need more use the MySQL profile.

    Args:
        conn_string: A ``sqlite:///`` URL.

    Returns:
        The engine; its pool keeps one idle connection.
    """
    engine = sa.create_engine(
        conn_string,
        pool_size=_POOL_SIZE,
        max_overflow=_MAX_OVERFLOW,
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_SECONDS},
    )

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return engine


# Materializations remembered per storage: a run's cities, each looked up right after its
# events are stored; older ones fall back to a read.
REMEMBERED_MATERIALIZATIONS = 4096


def ensure_check_history_index(engine: Engine) -> bool:
    """Adds :data:`CHECK_HISTORY_INDEX` to Dagster's ``asset_check_executions`` table when
    it is missing (once per database; an index only, no column or row changes).

    Several processes may start at once: the one that loses the race to create it finds it.

    Returns:
        Whether the table has the index (False: no such table, a database Dagster has not
        made yet).
    """
    table = CHECK_HISTORY_INDEX.table
    assert table is not None

    def found() -> bool | None:
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            if not inspector.has_table(table.name):
                return None
            names = {index["name"] for index in inspector.get_indexes(table.name)}
            return CHECK_HISTORY_INDEX.name in names

    has_index = found()
    if has_index is not False:
        return bool(has_index)
    try:
        with engine.begin() as conn:
            CHECK_HISTORY_INDEX.create(conn)
    except sa.exc.DBAPIError:
        if not found():
            raise
    return True


class StoredMaterializations:
    """The materializations this process stored last, per (asset, partition): what a check
    evaluation of the partition judges, known without reading the event log back.

    A thread's materializations inside an open transaction (:meth:`pending`) are seen by that
    thread only, and kept only when it commits (:meth:`settle`).
    """

    def __init__(self, limit: int = REMEMBERED_MATERIALIZATIONS) -> None:
        self._limit = max(1, limit)
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, str], tuple[str, int, float]] = OrderedDict()
        self._pending: dict[int, dict[tuple[str, str], tuple[str, int, float]]] = {}

    def record(self, event: EventLogEntry, event_id: int) -> None:
        """Remembers ``event`` (stored with ``event_id``) when it materializes a partition."""
        dagster_event = event.dagster_event
        if dagster_event is None or not dagster_event.is_step_materialization:
            return
        key, partition = dagster_event.asset_key, dagster_event.partition
        if key is None or partition is None:
            return
        entry = (event.run_id, int(event_id), event.timestamp)
        with self._lock:
            pending = self._pending.get(threading.get_ident())
            if pending is not None:
                pending[(key.to_string(), partition)] = entry
            else:
                self._keep({(key.to_string(), partition): entry})

    def lookup(self, key: str, partition: str) -> tuple[str, int, float] | None:
        """(run id, storage id, timestamp) of the partition's materialization stored last
        here (``key`` as ``AssetKey.to_string``), if remembered."""
        with self._lock:
            pending = self._pending.get(threading.get_ident())
            if pending is not None and (key, partition) in pending:
                return pending[(key, partition)]
            return self._kept.get((key, partition))

    @contextmanager
    def pending(self) -> Iterator[None]:
        """The thread's materializations in the block are provisional until :meth:`settle`."""
        with self._lock:
            self._pending[threading.get_ident()] = {}
        try:
            yield
        finally:
            with self._lock:
                self._pending.pop(threading.get_ident(), None)

    def settle(self) -> None:
        """Keeps the thread's provisional materializations (their transaction committed)."""
        with self._lock:
            pending = self._pending.get(threading.get_ident())
            if pending:
                self._keep(pending)
                pending.clear()

    def forget(self) -> None:
        """Forgets everything (the event log was wiped)."""
        with self._lock:
            self._kept.clear()

    def _keep(self, entries: Mapping[tuple[str, str], tuple[str, int, float]]) -> None:
        for name, entry in entries.items():
            self._kept[name] = entry
            self._kept.move_to_end(name)
        while len(self._kept) > self._limit:
            self._kept.popitem(last=False)


class PooledSqliteEventLogStorage(SqliteEventLogStorage):
    """Dagster's run-sharded SQLite event log with one pooled engine per shard.

    Same files and tables as ``SqliteEventLogStorage`` (one database per run plus the
    ``index`` shard that mirrors asset, check and run-status events). Connections come from
    an engine cached per shard: the index shard's for the storage's life, run shards' in a
    least-recently-used cache of ``max_cached_shards`` engines, disposed when evicted, on
    :meth:`dispose` and in a forked child (which must not share its parent's SQLite
    connections). All access holds Dagster's ``_db_lock``, as the base class does, so the
    cache needs no lock of its own.

    Writers keep their connection open, so their commits stay in ``<run_id>.db-wal`` until a
    checkpoint instead of reaching ``<run_id>.db`` at once: the watchers that stream a run's
    events to the webserver fire on changes to either file.

    Args:
        base_dir: The folder of the shards (``$DAGSTER_HOME/history/runs``).
        inst_data: Dagster's record of the configuration this storage came from.
        max_cached_shards: How many run shards keep an open engine.
    """

    #: The events of one :meth:`store_event_batch` at most: a run's planned events.
    planned_event_batch = PLANNED_EVENT_BATCH

    def __init__(
        self,
        base_dir: str,
        inst_data: ConfigurableClassData | None = None,
        max_cached_shards: int = DEFAULT_MAX_CACHED_SHARDS,
    ) -> None:
        # Set before the base class's __init__, which connects to the index shard.
        self._max_cached_shards = max(1, max_cached_shards)
        self._engines: OrderedDict[str, Engine] = OrderedDict()
        self._engines_pid = os.getpid()
        self._asset_key_columns: set[str] = set()
        self._tables: set[str] = set()
        self._batch: dict[str, Connection] | None = None
        self._batch_thread: int | None = None
        # (event, its serialized text) while store_event writes the event's asset row.
        self._serialized: tuple[EventLogEntry, str] | None = None
        self.stored_materializations = StoredMaterializations()
        super().__init__(base_dir, inst_data)

    @classmethod
    def config_type(cls) -> dict[str, Any]:
        """``base_dir`` as Dagster's SQLite event log; ``max_cached_shards`` optional."""
        return {
            "base_dir": StringSource,
            "max_cached_shards": Field(
                IntSource, is_required=False, default_value=DEFAULT_MAX_CACHED_SHARDS
            ),
        }

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]
    ) -> PooledSqliteEventLogStorage:
        """The storage a ``dagster.yaml`` block configures."""
        return cls(inst_data=inst_data, **config_value)

    def _engine(self, shard: str) -> Engine:
        """The shard's cached engine, made (and its database initialised) when missing.

        Called with ``_db_lock`` held.
        """
        if os.getpid() != self._engines_pid:
            # A forked child: drop the parent's pools without closing their connections,
            # which the parent still uses.
            for engine in self._engines.values():
                engine.dispose(close=False)
            self._engines.clear()
            self._engines_pid = os.getpid()
        cached = self._engines.get(shard)
        if cached is not None:
            self._engines.move_to_end(shard)
            return cached
        engine = pooled_sqlite_engine(self.conn_string_for_shard(shard))
        if shard not in self._initialized_dbs:
            self._initdb(engine)
            self._initialized_dbs.add(shard)
        if shard == INDEX_SHARD_NAME:
            ensure_check_history_index(engine)
        self._engines[shard] = engine
        run_shards = [name for name in self._engines if name != INDEX_SHARD_NAME]
        for name in run_shards[: max(0, len(run_shards) - self._max_cached_shards)]:
            self._engines.pop(name).dispose()
        return engine

    @contextmanager
    def _connect(self, shard: str) -> Iterator[Connection]:
        batch = self._batch
        if batch is not None and self._batch_thread == threading.get_ident():
            # Inside one_transaction, which holds _db_lock: one transaction per shard.
            conn = batch.get(shard)
            if conn is None:
                conn = batch[shard] = self._engine(shard).connect()
                conn.begin()
            yield conn
            return
        with self._db_lock:
            engine = self._engine(shard)
            with engine.connect() as conn, conn.begin():
                yield conn

    def store_event(self, event: EventLogEntry) -> None:
        """Stores ``event`` as Dagster's SQLite event log does: the same rows in the same
        tables, the event serialized once.

        Dagster's ``store_event`` serializes a materialization twice (the event row, and
        again for the asset's ``last_materialization``), a check evaluation twice, and builds
        a new statement per row, with its values bound as literals, which costs more than the
        insert itself. Here each event is serialized once (the asset's and the check's
        copies are made from that text) and written through statements built once. Kinds other than log lines, run and step
        events, materializations, planned materializations and run-scoped check evaluations
        go to Dagster's code.
        """
        dagster_event = event.dagster_event
        kind = dagster_event.event_type if dagster_event is not None else None
        asset = kind in _FAST_ASSET_EVENTS
        check = kind in _FAST_CHECK_EVENTS and bool(event.run_id)
        if (
            kind is not None
            and not asset
            and not check
            and (kind in ASSET_EVENTS or kind in ASSET_CHECK_EVENTS)
        ):
            super().store_event(event)
            return
        row = self._event_to_row(event)
        with self.run_connection(event.run_id) as conn:
            conn.execute(_INSERT_EVENT, row)
        if asset:
            with self.index_transaction() as conn:
                event_id = _inserted_id(conn.execute(_INSERT_EVENT, row))
                self._store_asset_event_tags(conn, [event], [event_id])
                self._serialized = (event, row["event"])
                try:
                    self._store_asset_event(conn, event, event_id)
                finally:
                    self._serialized = None
        elif check:
            with self.index_connection() as conn:
                event_id = _inserted_id(conn.execute(_INSERT_EVENT, row))
            self._store_check_evaluation(event, event_id, row["event"])
        elif kind in EVENT_TYPE_TO_PIPELINE_RUN_STATUS:
            with self.index_connection() as conn:
                conn.execute(_INSERT_EVENT, row)

    def _store_check_evaluation(self, event: EventLogEntry, event_id: int, text: str) -> None:
        """Dagster's ``_update_asset_check_evaluation`` for a run's evaluation: the planned
        row of (asset, check, run, partition) gets the result; Dagster's code inserts the row
        when there is none."""
        assert event.dagster_event is not None
        evaluation = event.dagster_event.event_specific_data
        assert isinstance(evaluation, AssetCheckEvaluation)
        if not self.supports_asset_checks:
            super().store_asset_check_event(event, event_id)  # raises Dagster's error
            return
        target = evaluation.target_materialization_data
        params = {
            "key_asset_key": evaluation.asset_key.to_string(),
            "key_check_name": evaluation.check_name,
            "key_run_id": event.run_id,
            "key_partition": evaluation.partition,
            "execution_status": (
                AssetCheckExecutionRecordStatus.SUCCEEDED.value
                if evaluation.passed
                else AssetCheckExecutionRecordStatus.FAILED.value
            ),
            "evaluation_event": text,
            "evaluation_event_timestamp": self._event_insert_timestamp(event),
            "evaluation_event_storage_id": event_id,
            "materialization_event_storage_id": target.storage_id if target else None,
            "partition": evaluation.partition,
        }
        with self.index_connection() as conn:
            updated = conn.execute(_UPDATE_CHECK[evaluation.partition is not None], params)
        if updated.rowcount == 0:
            super().store_asset_check_event(event, event_id)
        elif updated.rowcount > 1:
            raise DagsterInvariantViolationError(
                f"Updated {updated.rowcount} rows for asset check evaluation "
                f"{evaluation.asset_check_key} as a result of duplicate AssetCheckPlanned events."
            )

    def _store_asset_check_evaluation_planned(
        self, event: EventLogEntry, event_id: int | None
    ) -> None:
        """Dagster's rows of a planned check, one per partition of the run; the event is
        serialized once, not once per partition (a ranged run plans each check on every
        partition of the run, and the event carries their list)."""
        assert event.dagster_event is not None
        planned = event.dagster_event.event_specific_data
        assert isinstance(planned, AssetCheckEvaluationPlanned)
        subset = planned.partitions_subset
        keys = subset.get_partition_keys() if subset else [None]
        shared = {
            "asset_key": planned.asset_key.to_string(),
            "check_name": planned.check_name,
            "run_id": event.run_id,
            "execution_status": AssetCheckExecutionRecordStatus.PLANNED.value,
            "evaluation_event": serialize_value(event),
            "evaluation_event_timestamp": self._event_insert_timestamp(event),
            "evaluation_event_storage_id": event_id,
        }
        with self.index_connection() as conn:
            conn.execute(_INSERT_CHECK, [{**shared, "partition": key} for key in keys])

    def _get_asset_entry_values(
        self, event: EventLogEntry, event_id: int, has_asset_key_index_cols: bool
    ) -> dict[str, Any]:
        serialized = self._serialized
        dagster_event = event.dagster_event
        if (
            serialized is None
            or serialized[0] is not event
            or dagster_event is None
            or not dagster_event.is_step_materialization
        ):
            return super()._get_asset_entry_values(event, event_id, has_asset_key_index_cols)
        # serialize_value(EventLogRecord(storage_id=event_id, event_log_entry=event)), which
        # Dagster writes with sorted keys, from the event's text already made for its row.
        values: dict[str, Any] = {
            "last_materialization": (
                '{"__class__": "EventLogRecord", "event_log_entry": '
                f'{serialized[1]}, "storage_id": {int(event_id)}}}'
            ),
            "last_run_id": event.run_id,
        }
        if has_asset_key_index_cols:
            values["last_materialization_timestamp"] = datetime_from_timestamp(event.timestamp)
        return values

    def store_event_batch(self, events: Sequence[EventLogEntry]) -> None:
        """Stores ``events`` in one transaction per shard: all of them or none.

        Dagster batches a run's planned events (five per city and asset of a ``sync
        --full``, written before its step starts; see :class:`EmbeddedDagsterInstance`);
        one by one, each would pay its own transactions on the run shard and the index.
        """
        with self.one_transaction():
            for event in events:
                self.store_event(event)

    @contextmanager
    def one_transaction(self) -> Iterator[None]:
        """Within the block, this thread's events share one transaction per shard.

        What the thread reads in the block sees what it stored; other threads wait for the
        end of the block (they would wait for SQLite's write lock anyway). The block commits
        at its end, or rolls everything back if it raises: all of its events or none. A
        block inside a block of the same thread joins the outer one.
        """
        if self._batch is not None and self._batch_thread == threading.get_ident():
            yield
            return
        with self._db_lock, self.stored_materializations.pending():
            batch: dict[str, Connection] = {}
            self._batch, self._batch_thread = batch, threading.get_ident()
            try:
                yield
                for conn in batch.values():
                    conn.commit()
                self.stored_materializations.settle()
            except BaseException:
                for conn in batch.values():
                    conn.rollback()
                raise
            finally:
                self._batch, self._batch_thread = None, None
                for conn in batch.values():
                    conn.close()

    def _has_asset_key_col_on_connection(self, conn: Connection, column_name: str) -> bool:
        # Dagster inspects the table's columns for every asset event. A migration
        # adds columns and none removes them, so only a column found is remembered.
        if column_name in self._asset_key_columns:
            return True
        if super()._has_asset_key_col_on_connection(conn, column_name):
            self._asset_key_columns.add(column_name)
            return True
        return False

    def has_table(self, table_name: str) -> bool:
        """Whether the index shard has the table (Dagster's answer; a table found is kept).

        Dagster asks for every asset check evaluation (``supports_asset_checks``) and every
        tagged materialization, and each time creates an engine and opens a connection to
        the index shard. A migration adds tables and none removes them, so only a table
        found is remembered.
        """
        if table_name in self._tables:
            return True
        if super().has_table(table_name):
            self._tables.add(table_name)
            return True
        return False

    def _store_asset_event(self, conn: Connection, event: EventLogEntry, event_id: int) -> None:
        # Dagster's upsert of the asset's row inserts first and updates on the unique-key
        # error, which every event of a known asset raises; updating first skips that. Two
        # writers inserting the same new asset at once still meet the error and update.
        dagster_event = event.dagster_event
        asset_key = dagster_event.asset_key if dagster_event else None
        if asset_key is None:
            return
        values = self._get_asset_entry_values(
            event, event_id, self._has_asset_key_index_cols_on_connection(conn)
        )
        if not values:
            return
        key = asset_key.to_string()
        if not conn.execute(_UPDATE_ASSET_KEY, {"key_asset_key": key, **values}).rowcount:
            try:
                conn.execute(_INSERT_ASSET_KEY, {"asset_key": key, **values})
            except sa.exc.IntegrityError:
                conn.execute(_UPDATE_ASSET_KEY, {"key_asset_key": key, **values})
        self.stored_materializations.record(event, event_id)

    def cached_shards(self) -> list[str]:
        """The shards whose engine is open, least recently used first."""
        with self._db_lock:
            return list(self._engines)

    def _dispose_engines(self) -> None:
        with self._db_lock:
            for engine in self._engines.values():
                engine.dispose()
            self._engines.clear()

    def wipe(self) -> None:
        """Dagster's wipe, after closing every connection to the files it deletes."""
        self._dispose_engines()
        self._tables.clear()
        self.stored_materializations.forget()
        super().wipe()

    def upgrade(self) -> None:
        """Dagster's migration, on fresh connections afterwards."""
        super().upgrade()
        self._asset_key_columns.clear()
        self._tables.clear()
        self._dispose_engines()

    def watch(self, run_id: str, cursor: str | None, callback: EventHandlerFn) -> None:
        """Calls ``callback`` with each new event of the run, as Dagster's storage does."""
        observer: Any = self._obs
        if observer is None:
            observer = Observer()
            observer.start()
            self._obs = observer
        watchdog = WalAwareWatchdog(self, run_id, callback, cursor)
        self._watchers[run_id][callback] = (
            watchdog,
            observer.schedule(watchdog, self._base_dir, recursive=True),
        )

    def dispose(self) -> None:
        """Stops the watchers (Dagster's) and closes every cached engine."""
        super().dispose()
        self._dispose_engines()


def _inserted_id(result: sa.CursorResult[Any]) -> int:
    key = result.inserted_primary_key
    if key is None or key[0] is None:
        raise DagsterInvariantViolationError("Cannot store an asset event without its id.")
    return int(key[0])


class WalAwareWatchdog(SqliteEventLogStorageWatchdog):
    """Dagster's run-shard watchdog, also woken by writes to the shard's WAL file."""

    def __init__(
        self,
        event_log_storage: SqliteEventLogStorage,
        run_id: str,
        callback: EventHandlerFn,
        cursor: str | None,
    ) -> None:
        super().__init__(event_log_storage, run_id, callback, cursor)
        self._paths = (self._log_path, self._log_path + "-wal")

    @property
    def patterns(self) -> list[str]:
        """The paths whose events reach :meth:`on_modified`."""
        return list(self._paths)

    def on_modified(self, event: FileSystemEvent) -> None:
        """Reads the run's new events when its database or WAL file changed."""
        if event.src_path in self._paths:
            self._process_log()


class PooledSqliteRunStorage(SqliteRunStorage):
    """Dagster's SQLite run storage (``history/runs.db``) on one pooled engine.

    Dagster's ``connect`` makes an engine per call; this one keeps it, disposed on
    :meth:`dispose` and in a forked child. SQLAlchemy's pool is thread-safe and the pysqlite
    dialect lets a pooled connection move between threads.
    """

    def __init__(self, conn_string: str, inst_data: ConfigurableClassData | None = None) -> None:
        self._engine_lock = threading.Lock()
        self._pooled: Engine | None = None
        self._pooled_pid = os.getpid()
        super().__init__(conn_string, inst_data)

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]
    ) -> PooledSqliteRunStorage:
        """The storage a ``dagster.yaml`` block configures (``base_dir``)."""
        return cls.from_local(inst_data=inst_data, **config_value)

    def _engine(self) -> Engine:
        with self._engine_lock:
            if self._pooled is not None and os.getpid() != self._pooled_pid:
                self._pooled.dispose(close=False)
                self._pooled = None
            if self._pooled is None:
                self._pooled = pooled_sqlite_engine(self._conn_string)
                self._pooled_pid = os.getpid()
            return self._pooled

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """A connection in a transaction, committed on exit."""
        with self._engine().connect() as conn, conn.begin():
            yield conn

    def dispose(self) -> None:
        """Closes the cached engine's connections."""
        super().dispose()
        with self._engine_lock:
            if self._pooled is not None:
                self._pooled.dispose()
                self._pooled = None


class EmbeddedSqliteStorage(DagsterSqliteStorage):
    """Dagster's SQLite storage (``storage: sqlite``) with the pooled run and event storages.

    Args:
        base_dir: The instance's folder (``$DAGSTER_HOME``).
        inst_data: Dagster's record of the configuration this storage came from.
    """

    def __init__(self, base_dir: str, inst_data: ConfigurableClassData | None = None) -> None:
        # DagsterSqliteStorage.__init__ would open Dagster's own storages first.
        self.base_dir = base_dir
        self._run_storage = PooledSqliteRunStorage.from_local(_runs_directory(base_dir))
        self._event_log_storage = PooledSqliteEventLogStorage(_event_logs_directory(base_dir))
        self._schedule_storage = SqliteScheduleStorage.from_local(_schedule_directory(base_dir))
        self._inst_data = inst_data
        super(DagsterSqliteStorage, self).__init__()

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]
    ) -> EmbeddedSqliteStorage:
        """The storage a ``storage: custom`` block configures (``base_dir``)."""
        return cls.from_local(inst_data=inst_data, **config_value)


def _class_data(cls: type, base_dir: str) -> ConfigurableClassData:
    return ConfigurableClassData(
        # JSON is YAML, which Dagster reads the configuration as.
        cls.__module__,
        cls.__name__,
        json.dumps({"base_dir": base_dir}),
    )


class EmbeddedDagsterInstance(DagsterInstance):
    """A Dagster instance whose default storage is :class:`EmbeddedSqliteStorage`.

    Named in ``dagster.yaml`` (``instance_class``), it changes nothing else: a ``storage``
    block (MySQL, say) still wins over the default, and every process that loads the
    instance (the CLI's run, the webserver, the daemon, run workers) gets the same class.
    """

    @classmethod
    def config_schema(cls) -> dict[str, Any]:
        """No settings of its own."""
        return {}

    def _get_event_batch_size(self) -> int:
        # Dagster writes batched events (a run's planned events) one by one unless
        # DAGSTER_EVENT_BATCH_SIZE is set; the pooled event logs store a batch together
        # (SQLite: one transaction per shard, the run's whole set of planned events; MySQL:
        # one insert of at most its ``planned_event_batch``). Dagster's own store them one by one.
        configured = super()._get_event_batch_size()
        if configured:
            return configured
        return int(getattr(self._event_storage, "planned_event_batch", 0))

    @staticmethod
    def config_defaults(base_dir: str) -> Mapping[str, ConfigurableClassData | None]:
        """Dagster's defaults with the pooled SQLite storages under ``base_dir``."""
        return {
            **InstanceRef.config_defaults(base_dir),
            "storage": _class_data(EmbeddedSqliteStorage, base_dir),
            "run_storage": _class_data(PooledSqliteRunStorage, _runs_directory(base_dir)),
            "event_log_storage": _class_data(
                PooledSqliteEventLogStorage, _event_logs_directory(base_dir)
            ),
        }


# Dagster's stock SQLite storage, as ``InstanceRef.from_dir`` names it for a ``dagster.yaml``
# without a ``storage`` block or with ``storage: sqlite``.
STOCK_SQLITE_STORAGE = ("dagster._core.storage.sqlite_storage", "DagsterSqliteStorage")
# dagster-mysql's, as it names ``storage: mysql``; and the production profile's pooled one on
# the same tables (named, not imported: that module builds on this one).
STOCK_MYSQL_STORAGE = ("dagster_mysql", "DagsterMySQLStorage")
POOLED_MYSQL_STORAGE = (
    "supplier_sync_dagster.dagster_instance.mysql_storage",
    "PooledMySQLStorage",
)


def pooled_ref(ref: InstanceRef) -> InstanceRef | None:
    """``ref`` with the pooled storages on the same files or database, when it stores in
    Dagster's stock SQLite storage (a user's plain instance) or dagster-mysql's
    (``storage: mysql``); None for any other storage.

    The ``dagster.yaml`` stays as it is: only this process opens the storage through the
    pooled classes, and every other process (the webserver, the daemon, Dagster's CLI) reads
    and writes it with Dagster's own, which these are compatible with. The files or the
    database gain one index (:data:`CHECK_HISTORY_INDEX`), which Dagster's code neither needs
    nor minds. An instance without a class of its own gets :class:`EmbeddedDagsterInstance`,
    which batches a run's planned events.
    """
    data = ref.storage_data
    if data is None:
        return None
    kind = (data.module_name, data.class_name)
    if kind == STOCK_MYSQL_STORAGE:
        # As ``storage: custom`` names the production profile's storage, same configuration.
        module, name = POOLED_MYSQL_STORAGE
        storage, runs, events, _ = configurable_storage_data(
            {"custom": {"module": module, "class": name, "config": data.config_dict}}, {}
        )
    elif kind == STOCK_SQLITE_STORAGE:
        base_dir = data.config_dict.get("base_dir")
        if not isinstance(base_dir, str):
            return None
        pooled = EmbeddedDagsterInstance.config_defaults(base_dir)
        storage, runs, events = (
            pooled["storage"],
            pooled["run_storage"],
            pooled["event_log_storage"],
        )
    else:
        return None
    return ref._replace(
        storage_data=storage,
        run_storage_data=runs,
        event_storage_data=events,
        custom_instance_class_data=ref.custom_instance_class_data
        or ConfigurableClassData(
            EmbeddedDagsterInstance.__module__, EmbeddedDagsterInstance.__name__, "{}\n"
        ),
    )


def local_instance(home: str) -> DagsterInstance:
    """The instance of the Dagster home ``home`` (``DagsterInstance.get()`` for it), on the
    pooled storages when its ``dagster.yaml`` keeps Dagster's stock SQLite storage
    (:func:`pooled_ref`)."""
    ref = InstanceRef.from_dir(home)
    return DagsterInstance.from_ref(pooled_ref(ref) or ref)


@contextmanager
def pooled_events(instance: DagsterInstance) -> Iterator[None]:
    """Within the block, ``instance`` stores and reads its events through
    :class:`PooledSqliteEventLogStorage` on the same files, when its event log is Dagster's
    stock ``SqliteEventLogStorage``; any other instance is left as it is.

    For a run worker of a user's plain instance, which Dagster builds from the user's
    ``dagster.yaml``: its step's events then cost what they cost on the embedded instance,
    and :func:`.events.one_event_transaction` groups them. Dagster reaches the event log
    through the instance's attribute on every call, so the swap holds for every thread of
    the process until the block ends; the stock storage comes back then.
    """
    stock = instance.event_log_storage
    if type(stock) is not SqliteEventLogStorage:
        yield
        return
    pooled = PooledSqliteEventLogStorage(stock._base_dir)
    pooled.register_instance(instance)
    instance._event_storage = pooled
    try:
        yield
    finally:
        instance._event_storage = stock
        pooled.dispose()
