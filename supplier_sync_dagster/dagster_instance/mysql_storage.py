"""The production profile's Dagster storage: dagster-mysql's tables, cheaper connections.

Checked in dagster-mysql 0.29's source: ``MySQLEventLogStorage`` and ``MySQLRunStorage``
create their engine with ``NullPool`` (outside the webserver, which calls
``optimize_for_webserver``), so every statement opens a new connection to the server (TCP,
authentication, session settings) and closes it; an asset event takes two or three of them,
each its own transaction. A ``sync --full`` pays that for every event of every city.

:class:`PooledMySQLStorage` is ``DagsterMySQLStorage`` with :class:`PooledMySQLEventLogStorage`
and :class:`PooledMySQLRunStorage`: the same tables, statements and transactions, on one
small pool of connections per storage (as the webserver's).
``deploy/mysql/dagster.yaml`` names it; an instance whose ``dagster.yaml`` says ``storage: mysql``
reads and writes the same database with Dagster's classes.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import sqlalchemy as sa
from dagster._core.events.log import EventLogEntry
from dagster._core.storage.config import MySqlStorageConfig
from dagster._serdes import ConfigurableClassData
from dagster_mysql import DagsterMySQLStorage, MySQLEventLogStorage, MySQLRunStorage
from dagster_mysql.schedule_storage import MySQLScheduleStorage
from dagster_mysql.utils import (
    mysql_isolation_level,
    mysql_url_from_config,
)
from sqlalchemy.engine import Connection, Engine

from supplier_sync_dagster.dagster_instance.storage import StoredMaterializations

# One idle connection per storage, as Dagster's webserver keeps; overflow for threads that
# store at once (the step's thread, the cancel poll, Dagster's own).
_POOL_SIZE = 1
_MAX_OVERFLOW = 8
# Below MySQL's default wait_timeout (8 hours) and any proxy's idle limit.
_POOL_RECYCLE_SECONDS = 3600


def pooled_mysql_engine(mysql_url: str) -> Engine:
    """An engine as dagster-mysql's, with a pool of connections that survives a fork.

    A forked child (the run's worker processes) drops the parent's connections without
    closing them: they are the parent's sockets. ``pool_pre_ping`` replaces a connection the
    server closed meanwhile.
    """
    engine = sa.create_engine(
        mysql_url,
        isolation_level=mysql_isolation_level(),
        pool_size=_POOL_SIZE,
        max_overflow=_MAX_OVERFLOW,
        pool_recycle=_POOL_RECYCLE_SECONDS,
        pool_pre_ping=True,
    )
    ref = weakref.ref(engine)

    def _in_child() -> None:
        alive = ref()
        if alive is not None:
            alive.dispose(close=False)

    os.register_at_fork(after_in_child=_in_child)
    return engine


class _PooledEngine:
    """What the pooled run and event storages share: the engine swapped for a pooled one
    after dagster-mysql's ``__init__`` (which made its own and the tables), configuration
    read as dagster-mysql reads it, the pool closed on ``dispose``."""

    mysql_url: str
    _engine: Engine

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
        self._engine = pooled_mysql_engine(self.mysql_url)

    def dispose(self) -> None:
        """The storage's own ``dispose``, then the pooled connections closed."""
        super().dispose()  # type: ignore[misc]
        self._engine.dispose()


class PooledMySQLEventLogStorage(_PooledEngine, MySQLEventLogStorage):  # type: ignore[misc]
    """dagster-mysql's event log on a pooled engine: the same statements and transactions
    (one or more per event).

    Not one transaction per city, as on SQLite: MySQL allocates an event's id when it is
    inserted, not when it commits, so while a block is open another run can commit later
    ids, and a reader that remembers the highest id it has seen (the backfill daemon, the
    asset daemon, a run's log watcher) would then skip the block's events for ever. SQLite
    has one writer at a time, which commits before the next one inserts.

    It remembers the materializations it stored (:class:`.storage.StoredMaterializations`),
    so that a city's check evaluations name the materialization they judged without reading
    it back.

    Args:
        mysql_url: The database's SQLAlchemy URL.
        inst_data: Dagster's record of the configuration this storage came from.
    """

    def __init__(self, mysql_url: str, inst_data: ConfigurableClassData | None = None) -> None:
        self.stored_materializations = StoredMaterializations()
        super().__init__(mysql_url, inst_data)

    def _store_asset_event(self, conn: Connection, event: EventLogEntry, event_id: int) -> None:
        super()._store_asset_event(conn, event, event_id)
        self.stored_materializations.record(event, event_id)

    def wipe(self) -> None:
        """dagster-mysql's wipe; nothing stored is remembered any more."""
        super().wipe()
        self.stored_materializations.forget()


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
