"""The sync database and its clock, and the writes every module shares.

:class:`SyncDatabase` is the database as the sync uses it: an engine
(:mod:`~supplier_sync_dagster.core.store.engine`) whose schema :meth:`SyncDatabase.open`
brings to the newest version (:mod:`~supplier_sync_dagster.core.store.migrations`), and the
clock that every lease decision uses.

Time has one seam: :class:`DbClock`. Lease expiry and "now" are SQL expressions evaluated by
the database (invariant 2: workers on different machines drift, the database does not
disagree with itself); tests shift the clock by an offset instead of sleeping.

The shared writes: guarded updates (:func:`guarded_update`), bulk inserts
(:func:`insert_ignore`, :func:`execute_many`) and deadlock retries (:func:`retry_deadlocks`).
"""

from __future__ import annotations

import copy
import functools
import random
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.dialects.mysql import insert as mysql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.compiler import SQLCompiler

from supplier_sync_dagster.core.store.engine import (
    Database,
    db_now,
    make_engine,
    resolve_db_url,
)
from supplier_sync_dagster.core.store.migrations import migrate_on_open


@functools.lru_cache(maxsize=256)
def _db_now(offset_us: int) -> db_now:
    # SQL elements are immutable: one per offset serves every statement. Building one costs
    # more than running a small statement, and a city's writes name the time dozens of times.
    return db_now(offset_us)


@dataclass
class DbClock:
    """The one place where sync time comes from: the database clock plus a shiftable offset.

    Production code never reads a worker's wall clock for leases. Tests call :meth:`advance`
    to make leases expire without sleeping.
    """

    offset_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # The latest reading of recent_utc: (offset then, monotonic timer then, the time read).
    _recent: tuple[float, float, datetime] | None = field(default=None, repr=False, compare=False)

    def now(self, plus_seconds: float = 0.0) -> db_now:
        """SQL expression: database now + offset + ``plus_seconds``."""
        return _db_now(round((self.offset_seconds + plus_seconds) * 1_000_000))

    def advance(self, seconds: float) -> None:
        """Shifts this clock forward (tests only: makes time pass without sleeping)."""
        with self._lock:
            self.offset_seconds += seconds

    def read(self, conn: Connection) -> datetime:
        """Reads the current time as the database sees it (with this clock's offset)."""
        value = conn.execute(sa.select(self.now())).scalar_one()
        assert isinstance(value, datetime)
        return value

    def read_utc(self, conn: Connection, plus_seconds: float = 0.0) -> datetime:
        """The database's time plus ``plus_seconds``, aware (UTC), to compare with a
        supplier's times (the database gives naive UTC)."""
        value = conn.execute(sa.select(self.now(plus_seconds))).scalar_one()
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

    def recent_utc(self, engine: Engine, max_age_seconds: float) -> datetime:
        """:meth:`read_utc`, or this process's reading of it taken less than
        ``max_age_seconds`` ago, moved on by the time this process's monotonic timer says has
        passed since: the time is the database's, only its last few seconds are counted
        here (a wall clock's skew or jumps play no part).
        """
        recent, now = self._recent, time.monotonic()
        if recent is not None and recent[0] == self.offset_seconds:
            since = now - recent[1]
            if 0 <= since < max_age_seconds:
                return recent[2] + timedelta(seconds=since)
        offset = self.offset_seconds
        with engine.connect() as conn:
            value = self.read_utc(conn)
        self._recent = (offset, now, value)
        return value


@dataclass
class SyncDatabase(Database):
    """The sync database: an engine and the clock that every lease decision uses."""

    clock: DbClock = field(default_factory=DbClock)

    @classmethod
    def open(cls, url: str | None = None, *, create_schema: bool = True) -> SyncDatabase:
        """Opens the sync database and, by default, brings its schema to the newest version.

        Args:
            url: SQLAlchemy URL; None resolves ``$SUPPLIER_SYNC_DB_URL`` or the SQLite default.
            create_schema: Apply the pending migrations of ``sql/`` (an empty database gets
                all of them; see :mod:`supplier_sync_dagster.core.store.migrations`). On an
                up-to-date database this costs one read of the schema history.

        Raises:
            ConfigError: The URL is malformed or unsupported.
            DatabaseUnavailable: The database cannot be reached or opened.
            MigrationError: The schema cannot be brought to the newest version (an applied
                migration file was edited, a MySQL migration stopped half-way, ...).
        """
        engine = make_engine(resolve_db_url(url))
        db = cls(engine=engine)
        try:
            db.ping()
            if create_schema:
                migrate_on_open(db)
        except BaseException:
            engine.dispose()
            raise
        return db


# InnoDB's answers that roll a transaction back and invite it to run again: a deadlock
# (1213) and a lock wait timeout (1205; MariaDB rolls back the statement, a retry of the whole
# transaction is the safe reading).
_RETRYABLE_MYSQL_ERRORS = frozenset({1205, 1213})
DEADLOCK_ATTEMPTS = 5

_R = TypeVar("_R")


def is_deadlock(err: BaseException) -> bool:
    """Whether ``err`` is InnoDB's deadlock or lock wait timeout (the transaction is gone)."""
    if not isinstance(err, sa.exc.DBAPIError):
        return False
    orig = err.orig
    code = getattr(orig, "errno", None)
    if code is None and orig is not None and orig.args and isinstance(orig.args[0], int):
        code = orig.args[0]
    return code in _RETRYABLE_MYSQL_ERRORS


def retry_deadlocks(
    work: Callable[[], _R],
    *,
    attempts: int = DEADLOCK_ATTEMPTS,
    sleep: Callable[[float], None] = time.sleep,
) -> _R:
    """Runs ``work`` (which opens and commits its own transactions) again when InnoDB chose
    its transaction as a deadlock's victim.

    Two cities publishing at once may lock the same index ranges in opposite orders (a
    hotel's publish clears its miss count while another city's finish counts misses); InnoDB
    then rolls one transaction back whole, and the documented answer is to run it again.
    ``work`` must be safe to repeat after a rollback: every write of this project is
    idempotent or version-guarded. SQLite never raises these (its writers queue).

    Args:
        work: The transaction(s) to run.
        attempts: How many times at most.
        sleep: The pause between attempts (a short, growing, jittered one by default).
    """
    for attempt in range(1, attempts + 1):
        try:
            return work()
        except sa.exc.DBAPIError as err:
            if attempt == attempts or not is_deadlock(err):
                raise
            sleep(0.01 * attempt * (1 + random.random()))
    raise AssertionError("unreachable")


_MYSQL_DIALECTS = ("mysql", "mariadb")

_S = TypeVar("_S", sa.Select[Any], sa.Update)


def use_index(stmt: _S, table: sa.Table, index: str) -> _S:
    """The statement with MySQL/MariaDB told to read ``table`` through ``index``.

    For lookups by a long ``IN (...)`` list on a non-unique index prefix. Past 200 values
    (``eq_range_index_dive_limit``) MariaDB estimates the rows from the index statistics,
    and while a table grows fast those lag it, so it may choose a full scan per chunk.
    SQLite ignores the hint.

    Args:
        stmt: A SELECT reading ``table`` or an UPDATE of it.
        table: The table.
        index: The index name.
    """
    hint = f"FORCE INDEX ({index})"
    for name in _MYSQL_DIALECTS:
        if isinstance(stmt, sa.Update):
            stmt = stmt.with_hint(hint, dialect_name=name)
        else:
            stmt = stmt.with_hint(table, hint, dialect_name=name)
    return stmt


def guarded_update(
    conn: Connection, stmt: sa.Update, on_miss: Callable[[], Exception], *, expected: int = 1
) -> None:
    """Runs a conditional UPDATE and raises ``on_miss()`` unless exactly ``expected`` rows matched.

    Every state transition goes through here: the WHERE clause carries the state (and, for
    leased rows, the owner) that the move requires, so a stale writer changes nothing.
    MySQL dialects count matched rows (CLIENT_FOUND_ROWS), not only changed ones.
    """
    if conn.execute(stmt).rowcount != expected:
        raise on_miss()


def insert_ignore(
    conn: Connection,
    table: sa.Table,
    rows: Sequence[Mapping[str, Any]] | Sequence[Sequence[Any]],
    *,
    columns: Sequence[str] | None = None,
    **fixed: Any,
) -> None:
    """Inserts rows in one statement, skipping those whose unique key already exists.

    Only duplicate keys are ignored (``ON DUPLICATE KEY UPDATE id=id`` / ``ON CONFLICT DO
    NOTHING``), unlike MySQL's ``INSERT IGNORE``, which also truncates over-long values.

    Args:
        conn: Connection in the caller's transaction.
        table: Target table.
        rows: Plain column values, one mapping per row; every row has the same keys.
        columns: When given, each row is a tuple of these columns' values instead.
        **fixed: Column values shared by every row; may be SQL expressions (``clock.now()``).
    """
    if not rows:
        return

    def build() -> sa.ClauseElement:
        if conn.dialect.name == "sqlite":
            return sqlite_insert(table).on_conflict_do_nothing()
        return mysql_insert(table).on_duplicate_key_update(id=table.c.id)

    execute_many(conn, ("insert_ignore", table.name), build, rows, fixed=fixed, columns=columns)


@dataclass(frozen=True)
class _Plan:
    sql: str
    # A row's values in SQL order, bind-processed: (row, fixed values) -> tuple.
    values: Callable[[Any, Mapping[str, Any]], tuple[Any, ...]]
    fixed_processors: dict[str, Callable[[Any], Any]]  # applied once per call, not per row
    # PyMySQL only: the statement as (head, one row's "(%s, ...)", tail), and a row's
    # bind-processed values as SQL literals: (row, fixed literals, literal) -> "(...)".
    literal_parts: tuple[str, str, str] | None = None
    literal_row: Callable[[Any, Mapping[str, Any], Callable[[Any], str]], str] | None = None


# Longest multi-row statement sent to MySQL, in characters: at most 4 MB of UTF-8, far below
# the servers' max_allowed_packet (16 MB on MariaDB, 64 MB on MySQL 8).
MYSQL_MAX_STATEMENT_CHARS = 1_000_000


_plans: dict[tuple[Any, ...], _Plan] = {}
_plans_lock = threading.Lock()


def execute_many(
    conn: Connection,
    key: tuple[Any, ...],
    build: Callable[[], sa.ClauseElement],
    rows: Sequence[Mapping[str, Any]] | Sequence[Sequence[Any]],
    *,
    fixed: Mapping[str, Any] | None = None,
    columns: Sequence[str] | None = None,
) -> int:
    """Runs one INSERT/upsert for many rows through the driver's ``executemany``.

    The statement is compiled once per (dialect, ``key``, column set) and the rows go to the
    driver as plain tuples, after the same bind processing that SQLAlchemy applies (dates
    and decimals on SQLite, for instance). That skips SQLAlchemy's per-row parameter
    handling, which costs more than the database itself on bulk writes, while the SQL text
    and the stored values are exactly what ``conn.execute(build(), rows)`` would produce.

    Args:
        conn: Connection in the caller's transaction.
        key: Names the statement that ``build`` returns; equal keys must build equal SQL.
        build: Builds the statement (called once per key and column set).
        rows: Column values, one mapping per row; every row has the keys of the first.
        columns: When given, each row is a tuple of these columns' values instead of a
            mapping (no dict to build per row).
        fixed: Values shared by every row. A SQL expression (``clock.now()``) is written
            into the statement, so the database evaluates it, as it would in a plain
            ``INSERT ... VALUES``: on SQLite in the compiled SQL, through PyMySQL as SQL text
            in the multi-row statement; with a driver that takes only bound rows it is
            evaluated once first (:func:`bind_values`).

    Returns:
        On SQLite, the rows inserted or updated (its change count: an upsert whose guard
        left a row alone does not count it); -1 on other databases.

    Raises:
        ValueError: The statement has a bound parameter that neither the rows nor ``fixed``
            provide (write constants as literal SQL instead).
    """
    if not rows:
        return 0
    fixed = fixed or {}
    dialect = conn.dialect
    # SQL expressions among the fixed values, as SQL text: evaluating them in a SELECT of
    # their own would cost a statement per insert.
    inline = {k: _sql_text(conn, v) for k, v in fixed.items() if isinstance(v, sa.ClauseElement)}
    in_sql = bool(inline) and dialect.name == "sqlite"
    if in_sql:
        fixed = {k: v for k, v in fixed.items() if k not in inline}
    plan_key = (
        dialect.name,
        dialect.driver,
        key,
        tuple(rows[0]) if columns is None else (None, *columns),
        tuple(fixed),
        tuple(inline.items()) if in_sql else (),
    )
    plan = _plans.get(plan_key)
    if plan is None:
        stmt = build()
        if in_sql:
            assert isinstance(stmt, sa.Insert)
            stmt = stmt.values({k: sa.literal_column(text) for k, text in inline.items()})
        plan = _compile_plan(
            conn,
            stmt,
            list(rows[0] if columns is None else columns),
            list(fixed),
            positional=columns is not None,
        )
        with _plans_lock:
            _plans[plan_key] = plan
    literal = None
    if plan.literal_row is not None and plan.literal_parts is not None:
        literal = _pymysql_literal(conn)
    if inline and not in_sql and literal is None:
        fixed = bind_values(conn, fixed)
        inline = {}
    if plan.fixed_processors:
        procs = plan.fixed_processors
        fixed = {
            k: v if v is None or k not in procs or k in inline else procs[k](v)
            for k, v in fixed.items()
        }
    if literal is not None and plan.literal_row is not None and plan.literal_parts is not None:
        _execute_literal_rows(
            conn, plan.literal_parts, plan.literal_row, literal, rows, fixed, inline
        )
        return -1
    values = plan.values
    params = [values(row, fixed) for row in rows]
    result = conn.exec_driver_sql(plan.sql, params)
    return int(result.rowcount) if dialect.name == "sqlite" else -1


def _pymysql_literal(conn: Connection) -> Callable[[Any], str] | None:
    """A value as the SQL literal PyMySQL would send; None when the server's
    NO_BACKSLASH_ESCAPES mode asks for another string escaping (the driver then escapes).

    The common types are inlined. A string gets the escapes that matter inside a quoted
    UTF-8 literal (backslash, quote, NUL, Ctrl-Z), each replaced only if present: the
    driver's ``str.translate`` walks a Python table per character, which is slow on long
    JSON texts. The server stores the same text.
    """
    from pymysql.constants import SERVER_STATUS

    dbapi = conn.connection.dbapi_connection
    if dbapi is None or dbapi.server_status & SERVER_STATUS.SERVER_STATUS_NO_BACKSLASH_ESCAPES:
        return None
    escape = dbapi.escape

    def literal(value: Any) -> str:
        kind = type(value)
        if kind is str:
            if "\\" in value:
                value = value.replace("\\", "\\\\")
            if "'" in value:
                value = value.replace("'", "\\'")
            if "\0" in value:
                value = value.replace("\0", "\\0")
            if "\x1a" in value:
                value = value.replace("\x1a", "\\Z")
            return "'" + value + "'"
        if value is None:
            return "NULL"
        if kind is int:
            return str(value)
        if kind is bool:
            return "1" if value else "0"
        if kind is Decimal and value.is_finite():
            return format(value, "f")
        return cast(str, escape(value))

    return literal


def _execute_literal_rows(
    conn: Connection,
    parts: tuple[str, str, str],
    literal_row: Callable[[Any, Mapping[str, Any], Callable[[Any], str]], str],
    literal: Callable[[Any], str],
    rows: Sequence[Any],
    fixed: Mapping[str, Any],
    inline: Mapping[str, str],
) -> None:
    """What PyMySQL's ``executemany`` does for an INSERT (multi-row statements of at most
    about 1 MB), with the rows turned into SQL text by one generated function each instead
    of a driver call per value, whose escaping would dominate a MariaDB publish's CPU.
    ``inline`` holds fixed values that are SQL expressions, as SQL text."""
    head, _, tail = parts
    fixed_sql = {k: inline[k] if k in inline else literal(v) for k, v in fixed.items()}
    batch: list[str] = []
    size = len(head) + len(tail)
    for row in rows:
        text = literal_row(row, fixed_sql, literal)
        if batch and size + len(text) + 1 > MYSQL_MAX_STATEMENT_CHARS:
            _execute_text(conn, head + ",".join(batch) + tail)
            batch, size = [], len(head) + len(tail)
        batch.append(text)
        size += len(text) + 1
    _execute_text(conn, head + ",".join(batch) + tail)


def _execute_text(conn: Connection, sql: str) -> None:
    # no_parameters: the driver gets the text as it is (no %-formatting of the literals).
    conn.exec_driver_sql(sql, execution_options={"no_parameters": True})


_sql_texts: dict[tuple[str, str, int], str] = {}


def _sql_text(conn: Connection, expr: sa.ClauseElement) -> str:
    """A SQL expression as SQL text of the connection's dialect, its bound values inlined."""
    dialect = conn.dialect
    key = None
    if isinstance(expr, db_now):
        offset = next(iter(expr.clauses))
        assert isinstance(offset, sa.BindParameter)
        key = (dialect.name, dialect.driver, int(offset.value or 0))
        text = _sql_texts.get(key)
        if text is not None:
            return text
    text = str(expr.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
    if key is not None:
        with _plans_lock:
            if len(_sql_texts) > 10_000:  # tests shift the clock by many offsets
                _sql_texts.clear()
            _sql_texts[key] = text
    return text


def _compile_plan(
    conn: Connection,
    stmt: sa.ClauseElement,
    row_keys: list[str],
    fixed_keys: list[str],
    *,
    positional: bool = False,
) -> _Plan:
    keys = row_keys + fixed_keys
    dialect = conn.dialect
    if not dialect.positional and dialect.paramstyle == "pyformat":
        # PyMySQL and mysqlclient take "format" (%s) as well as "pyformat" (%(name)s):
        # compile positionally so rows can be sent as tuples. A copy keeps what the dialect
        # learned from the server (MariaDB or MySQL, which upsert syntax).
        dialect = copy.copy(dialect)
        dialect.paramstyle, dialect.positional = "format", True
    compiled = stmt.compile(dialect=dialect, column_keys=keys)
    assert isinstance(compiled, SQLCompiler)
    names = compiled.positiontup
    if not names:
        raise ValueError(f"{dialect.name}: execute_many needs a positional paramstyle")
    missing = [name for name in names if name not in keys]
    if missing:
        raise ValueError(f"statement parameters {missing} are not columns of the rows")
    processors: dict[int, Callable[[Any], Any]] = {}
    fixed_processors: dict[str, Callable[[Any], Any]] = {}
    mysql = dialect.name in ("mysql", "mariadb")
    for i, name in enumerate(names):
        bind_type = compiled.binds[name].type
        proc = bind_type.dialect_impl(dialect).bind_processor(dialect)
        if proc is None and mysql and isinstance(bind_type, sa.DateTime):
            proc = _mysql_datetime
        if proc is None:
            continue
        if name in row_keys:
            processors[i] = proc
        else:
            fixed_processors[name] = proc
    sql = compiled.string
    booleans = {
        i for i, name in enumerate(names) if isinstance(compiled.binds[name].type, sa.Boolean)
    }
    access = _accessors(row_keys, positional)
    literal_parts = literal_row = None
    if dialect.driver == "pymysql":
        from pymysql.cursors import RE_INSERT_VALUES

        m = RE_INSERT_VALUES.match(sql)
        if m is not None:
            # As PyMySQL splits it; "%%" in the SQL around the values is a literal "%".
            literal_parts = (m.group(1) % (), m.group(2).rstrip(), (m.group(3) or "") % ())
            literal_row = _literal_function(literal_parts[1], names, access, processors, booleans)
    return _Plan(
        sql,
        _values_function(names, access, processors, booleans),
        fixed_processors,
        literal_parts,
        literal_row,
    )


def _mysql_datetime(value: Any) -> Any:
    """A datetime as the text MySQL reads back as the same DATETIME value.

    Both MySQL drivers format datetimes in Python, value by value, which is slow in bulk
    inserts; ``isoformat`` is C, and a string is escaped in C. The
    time zone is dropped as the drivers drop it (values are UTC already).
    """
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.replace(tzinfo=None)
        return value.isoformat(" ")
    return value


def _accessors(row_keys: Sequence[str], positional: bool) -> dict[str, str]:
    """The Python expression that reads each row value from ``r``: by key from a mapping,
    or by position from a tuple (``positional``)."""
    if positional:
        return {name: f"r[{i}]" for i, name in enumerate(row_keys)}
    return {name: f"r[{name!r}]" for name in row_keys}


def _parts(
    names: Sequence[str], access: Mapping[str, str], row_value: Callable[[int, str, str], str]
) -> list[str]:
    """Each parameter's expression in a generated function, in SQL order: a fixed value is
    read from ``f``; a row value is ``row_value(position, its variable, how to read it)``."""
    return [
        row_value(i, f"v{i}", access[name]) if name in access else f"f[{name!r}]"
        for i, name in enumerate(names)
    ]


def _values_function(
    names: Sequence[str],
    access: Mapping[str, str],
    processors: Mapping[int, Callable[[Any], Any]],
    booleans: Collection[int] = (),
) -> Callable[[Any, Mapping[str, Any]], tuple[Any, ...]]:
    """One generated function that turns a row into its parameter tuple.

    Generic code (merge the row with the fixed values, pick the values, then loop over bind
    processors) costs more per row than SQLite's own insert; a function generated per
    statement does it in one expression (``r``: the row, read through ``access``; ``f``:
    the fixed values, already processed once per call). A ``bool`` of a Boolean column
    takes the value its processor gives it, computed once here. Column names come from our
    own schema, and are written as ``repr`` literals anyway.

    Args:
        names: The statement's parameters, in SQL order.
        access: How a row holds each of its values (:func:`_accessors`); other
            parameters are fixed values.
        processors: Bind processors by parameter position.
        booleans: Positions of the parameters of Boolean columns.
    """
    env: dict[str, Any] = {}

    def value(i: int, v: str, get: str) -> str:
        if i not in processors:
            return get
        proc = processors[i]
        env[f"p{i}"] = proc
        if i in booleans:
            env[f"t{i}"], env[f"n{i}"] = proc(True), proc(False)
            slow = f"(None if {v} is None else p{i}({v}))"
            return f"(t{i} if ({v} := {get}) is True else n{i} if {v} is False else {slow})"
        return f"(None if ({v} := {get}) is None else p{i}({v}))"

    fn = eval(f"lambda r, f: ({', '.join(_parts(names, access, value))},)", env)
    return cast(Callable[[Any, Mapping[str, Any]], tuple[Any, ...]], fn)


def _literal_function(
    template: str,
    names: Sequence[str],
    access: Mapping[str, str],
    processors: Mapping[int, Callable[[Any], Any]],
    booleans: Collection[int] = (),
) -> Callable[[Any, Mapping[str, Any], Callable[[Any], str]], str]:
    """One generated function that turns a row into its ``(...)`` of SQL literals.

    ``template`` is the statement's ``(%s, %s, ...)``; a value goes through its bind
    processor, then through ``L`` (the driver's escaping); fixed values arrive as literals
    already (escaped once per call). The common values skip both calls, with the text
    ``L`` would give them: ``None``, an ``int``, a ``str`` without a character to escape,
    a finite ``Decimal`` without a processor, and a ``bool`` of a Boolean column (whose
    processor keeps it as it is).

    Args:
        template: The statement's ``(%s, ...)``.
        names: The statement's parameters, in SQL order.
        access: How a row holds each of its values (:func:`_accessors`); other
            parameters are fixed values.
        processors: Bind processors by parameter position.
        booleans: Positions of the parameters of Boolean columns.
    """
    env: dict[str, Any] = {"D": Decimal, "T": template}

    def literal(i: int, v: str, get: str) -> str:
        if i in processors:
            env[f"p{i}"] = processors[i]
            slow = f"L(p{i}({v}))"
        else:
            slow = f"L({v})"
        if i in booleans:
            return (
                f"('1' if ({v} := {get}) is True else '0' if {v} is False"
                f" else 'NULL' if {v} is None else {slow})"
            )
        if i in processors:
            return f"('NULL' if ({v} := {get}) is None else {slow})"
        return (
            f"('NULL' if ({v} := {get}) is None"
            f' else "\'" + {v} + "\'" if {v}.__class__ is str'
            f" and '\\\\' not in {v} and \"'\" not in {v} and '\\0' not in {v}"
            f" and '\\x1a' not in {v} else str({v}) if {v}.__class__ is int"
            f" else format({v}, 'f') if {v}.__class__ is D and {v}.is_finite()"
            f" else {slow})"
        )

    fn = eval(f"lambda r, f, L: T % ({', '.join(_parts(names, access, literal))},)", env)
    return cast(Callable[[Any, Mapping[str, Any], Callable[[Any], str]], str], fn)


def bind_values(conn: Connection, values: Mapping[str, Any]) -> dict[str, Any]:
    """Evaluates SQL expressions among ``values`` (``clock.now()``) in one SELECT.

    Multi-row statements then carry only bound parameters, which is what lets drivers send
    them as one multi-row INSERT (PyMySQL batches an executemany only then) instead of a
    round trip per row.
    """
    exprs = {k: v for k, v in values.items() if isinstance(v, sa.ClauseElement)}
    if not exprs:
        return dict(values)
    row = conn.execute(sa.select(*(v.label(k) for k, v in exprs.items()))).one()  # type: ignore[attr-defined]
    return {**values, **row._mapping}
