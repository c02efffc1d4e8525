"""The sync database's engine: its URL, the supported backends, and the connection rules.

One setting selects the database: ``SUPPLIER_SYNC_DB_URL`` (a SQLAlchemy URL; see
:mod:`~supplier_sync_dagster.core.settings`). Unset, the embedded default is a SQLite file in
the local state folder (``SUPPLIER_SYNC_HOME``, default ``./.supplier_sync``), created on first
use. MySQL 8 and MariaDB are reached through
``mysql+pymysql://user:password@host:port/db``.

:class:`Database` is an engine with those rules (SQLite's queued writers and WAL, MySQL's
READ COMMITTED) and :class:`db_now` the database's own time as SQL: what the schema
migrations need, below :class:`~supplier_sync_dagster.core.store.db.SyncDatabase`, which adds
the clock and opens the database with its schema migrated.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from supplier_sync_dagster.core.errors import ConfigError, DatabaseUnavailable
from supplier_sync_dagster.core.redaction import register_secret
from supplier_sync_dagster.core.settings import env_name, load_storage_settings

_SUPPORTED_BACKENDS = ("sqlite", "mysql", "mariadb")
SQLITE_BUSY_TIMEOUT_MS = 30_000
# SQLite copies the WAL into the database (a checkpoint, two fsyncs, under the one write
# lock) at the first commit past this many pages. A publish spread over the catalog touches
# index pages all over it: with SQLite's default (1,000 pages) it checkpoints at nearly
# every commit and copies the same pages again each time; ten times as many pages copy a
# page once for many commits.
SQLITE_WAL_AUTOCHECKPOINT_PAGES = 10_000
WRITE_OPTION = "supplier_sync_write"


def state_dir() -> Path:
    """The local folder for embedded state (SQLite file, payloads): ``$SUPPLIER_SYNC_HOME``."""
    return load_storage_settings().state_dir


def resolve_db_url(url: str | None = None) -> str:
    """Returns the sync database URL: ``url``, else ``$SUPPLIER_SYNC_DB_URL``, else SQLite.

    Args:
        url: An explicit SQLAlchemy URL; empty or None falls through to the environment.
    """
    if url:
        return url
    return load_storage_settings().sync_db_url()


def check_db_url(url: str, *, source: str | None = None) -> URL:
    """The parsed sync database URL, once it names a supported backend.

    Args:
        url: A SQLAlchemy URL.
        source: What gave it, named in the error (``--db-url``; empty: no name); None:
            the setting, ``SUPPLIER_SYNC_DB_URL``.

    Raises:
        ConfigError: The URL is malformed or names an unsupported backend.
    """
    said = f"{env_name('db_url') if source is None else source} ".lstrip()
    try:
        parsed = sa.engine.make_url(url)
    except sa.exc.ArgumentError as err:
        raise ConfigError(
            f"{said}is not a valid SQLAlchemy URL ({err}); "
            "expected e.g. sqlite:///path/sync.sqlite3 or mysql+pymysql://user@host:3306/db"
        ) from None
    if parsed.get_backend_name() not in _SUPPORTED_BACKENDS:
        raise ConfigError(
            f"{said}uses backend {parsed.get_backend_name()!r}; "
            f"supported: {', '.join(_SUPPORTED_BACKENDS)}"
        )
    return parsed


def missing_sqlite_file(url: str) -> Path | None:
    """The file of a SQLite ``url`` that does not exist (None: it exists, is in memory, or
    the URL is not SQLite's): a command that only reads must not create it."""
    parsed = check_db_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    path = Path(parsed.database)
    return None if path.exists() else path


def make_engine(url: str) -> Engine:
    """Creates an engine configured for the sync's concurrency rules.

    SQLite: WAL and a busy timeout. Write transactions (:meth:`SyncDatabase.begin`) start
    with ``BEGIN IMMEDIATE``, so a read-then-write transaction holds the write lock from its
    start (SQLite's ``SELECT ... FOR UPDATE``) and waits for it instead of failing; plain
    connections (reads) start a deferred ``BEGIN`` and, under WAL, never block a writer. MySQL/MariaDB: READ COMMITTED, so a statement that follows a
    row lock sees the latest committed rows, and affected-row counts that count matched rows.

    Args:
        url: A SQLAlchemy URL of a supported backend.

    Raises:
        ConfigError: The URL is malformed or names an unsupported backend.
    """
    parsed = check_db_url(url)
    register_secret(parsed.password)  # masked in every log line and stored error from now on
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        connect_args: dict[str, Any] = {
            "check_same_thread": False,
            "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000,
        }
        if parsed.database and parsed.database != ":memory:":
            connect_args["factory"] = _WriterLockedConnection
        engine = sa.create_engine(
            parsed,
            connect_args=connect_args,
            json_serializer=json_text,
            json_deserializer=orjson.loads,
        )
        _configure_sqlite(engine)
        return engine
    return ping_when_idle(
        sa.create_engine(
            parsed,
            isolation_level="READ COMMITTED",
            pool_recycle=3600,
            connect_args={"connect_timeout": 5},
            json_serializer=json_text,
            json_deserializer=orjson.loads,
        )
    )


# A pooled connection checked in less than this ago is handed out without a ping.
IDLE_PING_SECONDS = 1.0
_LAST_USED = "supplier_sync_last_used"


def ping_when_idle(engine: Engine, idle_seconds: float = IDLE_PING_SECONDS) -> Engine:
    """Pings a pooled connection at checkout only when it sat idle longer than
    ``idle_seconds``, or since another connection's ping failed; returns ``engine``.

    ``pool_pre_ping`` pings at every checkout: a round trip per transaction, a few per city
    synced or event stored. What a ping guards against (a server restarted, a connection
    closed for idleness, a host frozen past ``idle_transaction_timeout``) leaves the
    connection idle first; one that dies within the second after its last use fails its
    statement, and SQLAlchemy then replaces every older connection of the pool, as after a
    failed ping. A connection whose ping fails is replaced (``DisconnectionError``).
    """
    failed_at = [float("-inf")]

    def used(_dbapi_connection: Any, record: Any, *_: Any) -> None:
        record.info[_LAST_USED] = time.monotonic()

    def checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        last = record.info.get(_LAST_USED, float("-inf"))
        if time.monotonic() - last <= idle_seconds and last > failed_at[0]:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as err:
            failed_at[0] = time.monotonic()
            raise sa.exc.DisconnectionError(f"ping failed: {err}") from err
        record.info[_LAST_USED] = time.monotonic()

    sa.event.listen(engine, "connect", used)
    sa.event.listen(engine, "checkin", used)
    sa.event.listen(engine, "checkout", checkout)
    return engine


def json_text(value: Any) -> str:
    """Compact JSON text of a value in primitive form: the JSON columns' encoder.

    orjson, not ``json``: a publish writes a diff log entry per hotel, and the standard
    library's encoder is far slower.
    """
    return orjson.dumps(value).decode()


def _configure_sqlite(engine: Engine) -> None:
    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # The driver must not open transactions on its own: we emit BEGIN IMMEDIATE below.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        _enable_wal(cur)
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA wal_autocheckpoint={SQLITE_WAL_AUTOCHECKPOINT_PAGES}")
        cur.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if not conn.get_execution_options().get(WRITE_OPTION, False):
            conn.exec_driver_sql("BEGIN")
            return
        dbapi_conn = conn.connection.dbapi_connection
        if isinstance(dbapi_conn, _WriterLockedConnection):
            dbapi_conn.take_writer_lock()
        try:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        except BaseException:
            if isinstance(dbapi_conn, _WriterLockedConnection):
                dbapi_conn.release_writer_lock()
            raise


# Writer locks this thread holds (lock file paths): a second write transaction of the same
# thread on another connection would wait for itself; it falls back to SQLite's busy timeout.
_held_writer_locks = threading.local()


class _WriterLockedConnection(sqlite3.Connection):
    """A SQLite connection whose write transactions queue on a lock file first.

    SQLite lets one writer in at a time, and a ``BEGIN IMMEDIATE`` that finds the write lock
    taken waits in SQLite's busy handler, which *sleeps* in growing steps (up to 100 ms) and
    polls: with several processes writing (a run's worker processes), they spend much of
    their time in those sleeps, most of it after the lock was already free. An exclusive
    ``flock`` on ``<database>-writer`` taken before ``BEGIN IMMEDIATE`` and released after
    ``COMMIT``/``ROLLBACK`` queues the writers in the kernel instead, which hands the lock on
    the moment it is released. The busy timeout still guards against writers that do not
    take the lock (another program, or a second write of the same thread).
    """

    def __init__(self, database: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(database, *args, **kwargs)
        self._lock_path = f"{database}-writer"
        self._lock_fd: int | None = None
        # The holding thread's set of held locks (None: not held); released from any thread.
        self._held_in: set[str] | None = None

    def take_writer_lock(self) -> None:
        """Waits for the database's writer lock (unless this thread already holds it)."""
        held: set[str] = _held_writer_locks.__dict__.setdefault("paths", set())
        if self._held_in is not None or self._lock_path in held:
            return
        if self._lock_fd is None:
            self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        held.add(self._lock_path)
        self._held_in = held

    def release_writer_lock(self) -> None:
        """Releases the writer lock, if this connection holds it."""
        held, self._held_in = self._held_in, None
        if held is None:
            return
        held.discard(self._lock_path)
        assert self._lock_fd is not None
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def commit(self) -> None:
        try:
            super().commit()
        finally:
            self.release_writer_lock()

    def rollback(self) -> None:
        try:
            super().rollback()
        finally:
            self.release_writer_lock()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.release_writer_lock()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None


def _enable_wal(cur: sqlite3.Cursor) -> None:
    # A file not yet in WAL mode is switched under its write lock, taken from a read lock.
    # SQLite fails that upgrade at once ("database is locked") while another connection
    # holds the write lock, without calling the busy handler (it could deadlock), so
    # processes opening a new database together would fail: retry for the busy timeout.
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err).lower() or time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


class db_now(FunctionElement[datetime]):
    """The database's current UTC time plus an offset in microseconds, as a SQL expression."""

    type = sa.DateTime()
    name = "db_now"
    inherit_cache = True

    def __init__(self, offset_us: int | sa.BindParameter[int]) -> None:
        # A parameter: the offset of a statement built once, given each time it runs.
        if isinstance(offset_us, sa.BindParameter):
            super().__init__(offset_us)
        else:
            super().__init__(sa.literal(int(offset_us), sa.BigInteger()))


@compiles(db_now, "sqlite")
def _db_now_sqlite(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    bind = next(iter(element.clauses))
    if kw.get("literal_binds") and isinstance(bind, sa.BindParameter) and bind.value == 0:
        # Written into bulk inserts' SQL, evaluated per row: without the zero offset's
        # printf and modifier it costs half as much, for the same text.
        return "(strftime('%Y-%m-%d %H:%M:%f', 'now') || '000')"
    offset = compiler.process(bind, **kw)
    # SQLAlchemy stores SQLite datetimes as 'YYYY-MM-DD HH:MM:SS.ffffff': pad %f's millis.
    return (
        "(strftime('%Y-%m-%d %H:%M:%f', 'now', "
        f"printf('%+.6f seconds', ({offset}) / 1000000.0)) || '000')"
    )


@compiles(db_now, "mysql")
@compiles(db_now, "mariadb")
def _db_now_mysql(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    offset = compiler.process(next(iter(element.clauses)), **kw)
    return f"TIMESTAMPADD(MICROSECOND, {offset}, UTC_TIMESTAMP(6))"


@dataclass
class Database:
    """An engine of the sync database, with the error translation every use of it shares."""

    engine: Engine

    @property
    def dialect(self) -> str:
        """``sqlite`` or ``mysql``/``mariadb``."""
        return self.engine.dialect.name

    @property
    def safe_url(self) -> str:
        """The URL with its password masked, for messages."""
        return self.engine.url.render_as_string(hide_password=True)

    def ping(self) -> None:
        """Checks that the database answers.

        Raises:
            DatabaseUnavailable: It does not, with the reason and the (masked) URL.
        """
        with self.translate_errors("connecting"), self.engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))

    @contextmanager
    def translate_errors(self, doing: str) -> Iterator[None]:
        """Turns driver connection errors into :class:`DatabaseUnavailable`."""
        try:
            yield
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as err:
            if err.connection_invalidated or _is_connect_error(err):
                raise DatabaseUnavailable(
                    f"sync database {self.safe_url} is unavailable while {doing}: {err.orig}"
                ) from err
            raise

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A write transaction (``with db.begin() as conn:``): committed on success.

        On SQLite it takes the write lock at its start; read-only work should use
        ``db.engine.connect()`` instead, which does not block writers.
        """
        with self.engine.connect() as conn:
            conn = conn.execution_options(**{WRITE_OPTION: True})
            with conn.begin():
                yield conn

    def dispose(self) -> None:
        """Closes pooled connections (call in tests and before forking)."""
        self.engine.dispose()


def _is_connect_error(err: sa.exc.DBAPIError) -> bool:
    text = str(err.orig).lower()
    return any(
        marker in text
        for marker in (
            "can't connect",
            "unable to open database",
            "access denied",
            "unknown database",
            "lost connection",
            "gone away",
            "connection refused",
            "timed out",
        )
    )
