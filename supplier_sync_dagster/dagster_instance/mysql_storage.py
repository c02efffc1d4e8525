"""The production profile's Dagster storage: dagster-mysql's tables, cheaper connections.

Checked in dagster-mysql 0.29's source: ``MySQLEventLogStorage`` and ``MySQLRunStorage``
create their engine with ``NullPool`` (outside the webserver, which calls
``optimize_for_webserver``), so every statement opens a new connection to the server (TCP,
authentication, session settings) and closes it; an asset event takes two or three of them,
each its own transaction. A ``sync --full`` pays that for every event of every city.

:class:`PooledMySQLStorage` is ``DagsterMySQLStorage`` with :class:`PooledMySQLEventLogStorage`
and :class:`PooledMySQLRunStorage`: the same tables, statements and transactions, on one
small pool of connections per storage (as the webserver's). Inside
:meth:`PooledMySQLEventLogStorage.batched`, a thread's events are inserted together in one
statement, as dagster-postgres stores a batch, and so are the run's planned events that Dagster
hands over together (:meth:`PooledMySQLEventLogStorage.store_event_batch`); the event log adds the index
:data:`.storage.CHECK_HISTORY_INDEX` to the checks' table and runs its transactions READ
COMMITTED (see :class:`PooledMySQLEventLogStorage`).
``deploy/mysql/dagster.yaml`` names it; an instance whose ``dagster.yaml`` says ``storage: mysql``
reads and writes the same database with Dagster's classes.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import sqlalchemy as sa
from dagster._core.errors import DagsterInvariantViolationError
from dagster._core.events import ASSET_CHECK_EVENTS, ASSET_EVENTS
from dagster._core.events.log import EventLogEntry
from dagster._core.storage.config import MySqlStorageConfig
from dagster._core.storage.event_log.schema import SqlEventLogStorageTable
from dagster._serdes import ConfigurableClassData
from dagster_mysql import DagsterMySQLStorage, MySQLEventLogStorage, MySQLRunStorage
from dagster_mysql.schedule_storage import MySQLScheduleStorage
from dagster_mysql.utils import (
    mysql_isolation_level,
    mysql_url_from_config,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import Pool

from supplier_sync_dagster.core.store.db import retry_deadlocks
from supplier_sync_dagster.core.store.engine import ping_when_idle
from supplier_sync_dagster.dagster_instance.storage import (
    StoredMaterializations,
    ensure_check_history_index,
)

log = logging.getLogger(__name__)

# One idle connection per storage, as Dagster's webserver keeps; overflow for threads that
# store at once (the step's thread, the cancel poll, Dagster's own).
_POOL_SIZE = 1
_MAX_OVERFLOW = 8
# Below MySQL's default wait_timeout (8 hours) and any proxy's idle limit.
_POOL_RECYCLE_SECONDS = 3600


def pooled_mysql_engine(mysql_url: str, *, isolation_level: str | None = None) -> Engine:
    """An engine as dagster-mysql's, with a pool of connections that survives a fork.

    A forked child (the run's worker processes) leaves the parent's connections alone: they
    are the parent's sockets, and mysql-connector shuts a socket down (for every process that
    shares it) when the connection is finalized, so the child keeps them referenced. A connection idle for a while is pinged
    before use, and replaced when the server closed it meanwhile (``ping_when_idle``).

    Args:
        mysql_url: The database's SQLAlchemy URL.
        isolation_level: The transactions' isolation level; dagster-mysql's by default.
    """
    engine = ping_when_idle(
        sa.create_engine(
            mysql_url,
            isolation_level=isolation_level or mysql_isolation_level(),
            pool_size=_POOL_SIZE,
            max_overflow=_MAX_OVERFLOW,
            pool_recycle=_POOL_RECYCLE_SECONDS,
        )
    )
    ref = weakref.ref(engine)

    def _in_child() -> None:
        alive = ref()
        if alive is not None:
            # Kept, never finalized: mysql-connector shuts a socket down when it is finalized,
            # and this socket is the parent's (a forked child's garbage collection would
            # break the parent's connection).
            _parents_pools.append(alive.pool)
            alive.dispose(close=False)

    os.register_at_fork(after_in_child=_in_child)
    return engine


# In a forked child, the parent's connection pools, with the connections they hold.
_parents_pools: list[Pool] = []


class _PooledEngine:
    """What the pooled run and event storages share: the engine swapped for a pooled one
    after dagster-mysql's ``__init__`` (which made its own and the tables), configuration
    read as dagster-mysql reads it, the pool closed on ``dispose``."""

    mysql_url: str
    _engine: Engine
    # None: dagster-mysql's level.
    isolation_level: str | None = None

    def __init__(self, mysql_url: str, inst_data: ConfigurableClassData | None = None) -> None:
        super().__init__(mysql_url, inst_data)  # type: ignore[call-arg]
        self._use_pool()

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: MySqlStorageConfig
    ) -> Any:
        """The storage a ``dagster.yaml`` block configures (``mysql_url`` or ``mysql_db``)."""
        return cls(mysql_url_from_config(config_value), inst_data)

    def _use_pool(self) -> None:
        self._engine.dispose()
        self._engine = pooled_mysql_engine(self.mysql_url, isolation_level=self.isolation_level)

    def dispose(self) -> None:
        """The storage's own ``dispose``, then the pooled connections closed."""
        super().dispose()  # type: ignore[misc]
        self._engine.dispose()


class PooledMySQLEventLogStorage(_PooledEngine, MySQLEventLogStorage):  # type: ignore[misc]
    """dagster-mysql's event log on a pooled engine: the same statements and transactions
    (one or more per event), and a thread's events in a :meth:`batched` block inserted in
    one statement.

    Not one transaction per city, as on SQLite: MySQL allocates an event's id when it is
    inserted, not when it commits, so while a transaction is open another run can commit
    later ids, and a reader that remembers the highest id it has seen (the backfill daemon,
    the asset daemon, a run's log watcher) would then skip its events for ever. One
    ``INSERT ... RETURNING`` of several rows (MariaDB 10.5 and later) commits as soon as a
    single row's insert would: the window is one statement's, as for Dagster's own events.

    It remembers the materializations it stored (:class:`.storage.StoredMaterializations`),
    so that a city's check evaluations name the materialization they judged without reading
    it back.

    Its transactions are READ COMMITTED, not dagster-mysql's REPEATABLE READ. With the
    checks' index, InnoDB finds the row a check's result updates (by asset, check, run and
    partition) through that index, and under REPEATABLE READ it also locks the gaps beside it,
    where other runs insert their planned checks for neighbouring partitions: two runs storing
    their cities' events at once then deadlock. READ COMMITTED locks only the rows a statement
    changes, as PostgreSQL's default level, under which Dagster runs the same statements. A
    block's transaction that InnoDB still picks as a deadlock's victim is run again.

    Args:
        mysql_url: The database's SQLAlchemy URL.
        inst_data: Dagster's record of the configuration this storage came from.
    """

    isolation_level = "READ COMMITTED"
    #: The events of one :meth:`store_event_batch` at most: one statement of a few MB at
    #: most (about a kilobyte an event), under MySQL's smallest default packet limit.
    planned_event_batch = 2_000

    def __init__(self, mysql_url: str, inst_data: ConfigurableClassData | None = None) -> None:
        self.stored_materializations = _FlushedFirst(self)
        self._buffers: dict[int, list[EventLogEntry]] = {}
        self._returning: bool | None = None
        self._tables_found: set[str] = set()
        self._held: dict[int, Connection] = {}
        super().__init__(mysql_url, inst_data)
        ensure_check_history_index(self._engine)
        ref = weakref.ref(self)

        def _in_child() -> None:
            # A child forked inside a block keeps none of the parent's events.
            alive = ref()
            if alive is not None:
                alive.forget_blocks()

        os.register_at_fork(after_in_child=_in_child)

    def forget_blocks(self) -> None:
        """Drops every thread's kept events, unstored (a forked child's copy of them)."""
        self._buffers.clear()

    def _store_asset_event(self, conn: Connection, event: EventLogEntry, event_id: int) -> None:
        super()._store_asset_event(conn, event, event_id)
        self.stored_materializations.record(event, event_id)

    def has_table(self, table_name: str) -> bool:
        """dagster-mysql's answer, a table found kept: Dagster asks at every check evaluation,
        and dagster-mysql lists the database's tables each time. A migration adds tables and
        none removes them."""
        if table_name in self._tables_found:
            return True
        found = bool(super().has_table(table_name))
        if found:
            self._tables_found.add(table_name)
        return found

    def store_event(self, event: EventLogEntry) -> None:
        """Stores ``event``, or keeps it for the insert that ends this thread's block."""
        buffer = self._buffers.get(threading.get_ident())
        if buffer is None:
            super().store_event(event)
        else:
            buffer.append(event)

    @contextmanager
    def batched(self) -> Iterator[None]:
        """Within the block, this thread's events are inserted together, at its end.

        They are stored earlier when the thread asks which materialization it stored last
        and one of them is a materialization (a city's checks name the one they judged).
        Until then the thread's reads do not see them. On a server without ``INSERT ... RETURNING`` each event is stored as it would be
        outside the block. A block inside a block of the same thread joins the outer one.
        Events kept when the block raises are stored all the same: they happened.
        """
        thread = threading.get_ident()
        if thread in self._buffers:
            yield
            return
        self._buffers[thread] = []
        try:
            yield
        finally:
            try:
                self.flush()
            finally:
                self._buffers.pop(thread, None)

    def flush(self, *, unless_no_materialization: bool = False) -> None:
        """Stores the events this thread's block has kept so far.

        Args:
            unless_no_materialization: Keep them if none of them is a materialization (a
                lookup of the one stored last needs no id from them).
        """
        buffer = self._buffers.get(threading.get_ident())
        if not buffer:
            return
        if unless_no_materialization and not any(
            event.dagster_event is not None and event.dagster_event.is_step_materialization
            for event in buffer
        ):
            return
        events = list(buffer)
        buffer.clear()
        if len(events) == 1 or not self._supports_returning():
            for event in events:
                super().store_event(event)
            return
        self._store_together(events)

    def _supports_returning(self) -> bool:
        if self._returning is None:
            with self._engine.connect() as conn:
                self._returning = bool(conn.dialect.insert_returning)
        return self._returning

    def store_event_batch(self, events: Sequence[EventLogEntry]) -> None:
        """Stores ``events`` as a block's: their rows inserted by one statement, what they
        change of the asset and check tables written in one transaction.

        Dagster hands over a run's planned events together when the instance batches them
        (:class:`.storage.EmbeddedDagsterInstance`, up to :attr:`planned_event_batch`): five
        per city of a backfill's run, which one by one cost the daemon several round trips
        each while it creates the run.

        Dagster stores every event of a batch again, one by one, when this raises: it raises
        only while none is stored. Once their rows are inserted, a failure to write the asset
        and check rows is logged instead (the planned rows are bookkeeping: a check's result
        inserts its row when the planned one is missing), so that no event is stored twice.
        """
        if len(events) < 2 or not self._supports_returning():
            super().store_event_batch(events)
            return
        stored = self._insert_together(events)
        try:
            self._store_stored_rows(stored)
        except Exception as err:
            log.warning(
                "the asset and check rows of %d stored events were not written: %s",
                len(stored),
                err,
            )

    def _store_together(self, events: Sequence[EventLogEntry]) -> None:
        """``store_event`` of each event, with their rows inserted by one statement and what
        they change of the asset and check tables written in one transaction."""
        self._store_stored_rows(self._insert_together(events))

    def _insert_together(self, events: Sequence[EventLogEntry]) -> list[tuple[EventLogEntry, int]]:
        """Inserts the events' rows by one statement; returns each event with its id."""
        statement = self.prepare_insert_event_batch(events).returning(SqlEventLogStorageTable.c.id)
        with self.run_connection(None) as conn:
            ids = [int(row[0]) for row in conn.execute(statement).fetchall()]
        if len(ids) != len(events):
            raise DagsterInvariantViolationError(
                f"{len(events)} events inserted, {len(ids)} ids returned."
            )
        return list(zip(events, ids, strict=True))

    def _store_stored_rows(self, stored: Sequence[tuple[EventLogEntry, int]]) -> None:
        """What inserted events change of the asset and check tables, in one transaction.

        As dagster-postgres's ``store_event_batch``, an asset's row is written from the last
        of its events of each kind (each kind writes the same columns every time).
        """
        assets = [
            (event, event_id)
            for event, event_id in stored
            if event.is_dagster_event
            and event.dagster_event_type in ASSET_EVENTS
            and event.get_dagster_event().asset_key
        ]
        last: dict[tuple[str, object], int] = {}
        for position, (event, _) in enumerate(assets):
            dagster_event = event.get_dagster_event()
            last[(str(dagster_event.asset_key), dagster_event.event_type)] = position
        written = set(last.values())
        retry_deadlocks(lambda: self._store_block_rows(assets, written, stored))

    def _store_block_rows(
        self,
        assets: Sequence[tuple[EventLogEntry, int]],
        written: set[int],
        stored: Sequence[tuple[EventLogEntry, int]],
    ) -> None:
        """One transaction: the assets' rows and tags and the checks' rows of stored events
        (``written``: the positions in ``assets`` whose asset row is written)."""
        thread = threading.get_ident()
        with self._connect() as conn:
            # Dagster's check updates take this connection (index_connection).
            self._held[thread] = conn
            try:
                if assets:
                    self._store_asset_event_tags(
                        conn, [event for event, _ in assets], [event_id for _, event_id in assets]
                    )
                for position, (event, event_id) in enumerate(assets):
                    if position in written:
                        self._store_asset_event(conn, event, event_id)
                    else:
                        self.stored_materializations.record(event, event_id)
                for event, event_id in stored:
                    if event.is_dagster_event and event.dagster_event_type in ASSET_CHECK_EVENTS:
                        self.store_asset_check_event(event, event_id)
            finally:
                del self._held[thread]

    def index_connection(self) -> AbstractContextManager[Connection]:
        """dagster-mysql's connection, or the one this thread holds while it stores a block."""
        held = self._held.get(threading.get_ident())
        return nullcontext(held) if held is not None else super().index_connection()

    def wipe(self) -> None:
        """dagster-mysql's wipe; nothing stored is remembered any more."""
        super().wipe()
        self.stored_materializations.forget()
        self._tables_found.clear()


class _FlushedFirst(StoredMaterializations):
    """The materializations the event log stored; a lookup first stores its thread's kept
    events when a materialization is among them (so a lookup inside a
    :meth:`PooledMySQLEventLogStorage.batched` block finds it)."""

    def __init__(self, storage: PooledMySQLEventLogStorage) -> None:
        super().__init__()
        self._storage = weakref.ref(storage)

    def lookup(self, key: str, partition: str) -> tuple[str, int, float] | None:
        """:meth:`StoredMaterializations.lookup`, after the thread's kept materializations
        are stored."""
        storage = self._storage()
        if storage is not None:
            storage.flush(unless_no_materialization=True)
        return super().lookup(key, partition)


class PooledMySQLRunStorage(_PooledEngine, MySQLRunStorage):  # type: ignore[misc]
    """dagster-mysql's run storage on a pooled engine (a run's tags, its status polls).

    Args:
        mysql_url: The database's SQLAlchemy URL.
        inst_data: Dagster's record of the configuration this storage came from.
    """


class PooledMySQLStorage(DagsterMySQLStorage):
    """``storage: mysql`` with the pooled run and event storages, named as ``storage: custom``
    with the same configuration (``mysql_url``, or ``mysql_db``'s fields).

    Args:
        mysql_url: The database's SQLAlchemy URL.
        inst_data: Dagster's record of the configuration this storage came from.
    """

    def __init__(self, mysql_url: str, inst_data: ConfigurableClassData | None = None) -> None:
        # DagsterMySQLStorage.__init__ would open dagster-mysql's own storages first.
        self.mysql_url = mysql_url
        self._inst_data = inst_data
        self._run_storage = PooledMySQLRunStorage(mysql_url)
        self._event_log_storage = PooledMySQLEventLogStorage(mysql_url)
        self._schedule_storage = MySQLScheduleStorage(mysql_url)
        super(DagsterMySQLStorage, self).__init__()

    @classmethod
    def from_config_value(  # type: ignore[override]
        cls, inst_data: ConfigurableClassData | None, config_value: MySqlStorageConfig
    ) -> PooledMySQLStorage:
        """The storage a ``dagster.yaml`` block configures."""
        return cls(mysql_url_from_config(config_value), inst_data)

    def _own(self, cls: type) -> ConfigurableClassData | None:
        data = self.inst_data
        return (
            ConfigurableClassData(cls.__module__, cls.__name__, data.config_yaml) if data else None
        )

    @property
    def event_storage_data(self) -> ConfigurableClassData | None:
        """The event log's class and configuration (for processes that rebuild it)."""
        return self._own(PooledMySQLEventLogStorage)

    @property
    def run_storage_data(self) -> ConfigurableClassData | None:
        """The run storage's class and configuration."""
        return self._own(PooledMySQLRunStorage)
