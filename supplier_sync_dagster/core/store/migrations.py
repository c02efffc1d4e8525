"""Versioned schema migrations: the numbered files of ``sql/``, applied once each, in order.

``sql/NNN_name.sql`` (MySQL/MariaDB) is the DDL of record; ``sql/sqlite/NNN_name.sql`` is the
same version in SQLite's dialect. Each database records the versions it received in
``supplier_sync_schema_history``, one row per version, with the checksum of the statements
that were run (comments and spacing do not count). :func:`migrate` brings a database to the
newest version; :meth:`SyncDatabase.open` calls it, after a single read of the history that
finds an up-to-date database in one query.

- An applied file that was edited since is refused (:class:`MigrationChecksumMismatch`): a
  change to the schema is a new numbered file.
- A database without a history (created before this runner: by ``metadata.create_all``, or by
  a DBA applying ``sql/`` by hand) is *baselined*: its structure shows the version it is at
  (:data:`_MARKERS`), those versions are recorded as ``BASELINE``, the rest are applied.
- One process migrates at a time: MySQL's ``GET_LOCK`` (per database), SQLite's write lock
  (``BEGIN IMMEDIATE``). The others wait, then find the work done.
- SQLite runs all pending files in one transaction: a failure leaves the database as it was.
  MySQL commits every DDL statement on its own, so each file's history row is written
  before its statements (``success = 0``) and marked done after them; a file that stopped
  half-way stays visible, and :class:`MigrationFailed` tells the operator what to do.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import (
    ConfigError,
    MigrationChecksumMismatch,
    MigrationError,
    MigrationFailed,
    MigrationLocked,
)
from supplier_sync_dagster.core.store.engine import (
    SQLITE_BUSY_TIMEOUT_MS,
    WRITE_OPTION,
    Database,
    db_now,
)

log = logging.getLogger(__name__)

SQL_DIR = Path(__file__).resolve().parents[3] / "sql"
SQLITE_SUBDIR = "sqlite"
HISTORY_TABLE = "supplier_sync_schema_history"
# MySQL: the migration lock is GET_LOCK(LOCK_PREFIX + database name).
LOCK_PREFIX = "supplier_sync_migrate:"
# How long a process waits for another one's migration before giving up.
DEFAULT_LOCK_TIMEOUT_SECONDS = 600.0

_FILE_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")

Kind = Literal["SQL", "BASELINE"]

_history_metadata = sa.MetaData()

history = sa.Table(
    HISTORY_TABLE,
    _history_metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("description", sa.String(200), nullable=False),
    sa.Column("script", sa.String(255), nullable=False),
    sa.Column("checksum", sa.String(64), nullable=False),
    # SQL: its statements ran here; BASELINE: the structure was there before the history.
    sa.Column("kind", sa.String(16), nullable=False),
    # False while a MySQL file runs, and after it stopped half-way.
    sa.Column("success", sa.Boolean, nullable=False),
    sa.Column("installed_by", sa.String(128), nullable=False),
    sa.Column(
        "installed_at",
        sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb"),
        nullable=False,
    ),
    sa.Column("execution_ms", sa.Integer, nullable=False, server_default="0"),
    comment="schema versions applied to this database (sql/NNN_*.sql), with their checksums",
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)


@dataclass(frozen=True)
class _Version:
    """A schema version: its number and its name in words."""

    version: int
    description: str

    @property
    def label(self) -> str:
        """``008 outbox event key``."""
        return f"{self.version:03d} {self.description}"


@dataclass(frozen=True)
class Migration(_Version):
    """One numbered migration file of a dialect.

    Attributes:
        version: The file's number.
        description: Its name after the number, in words.
        script: The path relative to ``sql/``'s parent, as recorded (``sql/008_x.sql``).
        statements: The statements it runs, without comments.
        checksum: sha256 of the statements (comments and spacing outside quotes ignored).
    """

    script: str
    statements: tuple[str, ...] = field(repr=False)
    checksum: str


@dataclass(frozen=True)
class HistoryRow:
    """A row of the history table: a version this database received."""

    version: int
    description: str
    script: str
    checksum: str
    kind: str
    success: bool
    installed_by: str
    installed_at: datetime | None
    execution_ms: int


@dataclass(frozen=True)
class Applied(_Version):
    """A migration that :func:`migrate` ran (or, in a dry run, would run)."""

    seconds: float


@dataclass(frozen=True)
class MigrationResult:
    """What :func:`migrate` did.

    Attributes:
        baseline: The version an unversioned database was recorded at (0 for an empty
            one), or None when the database had a history already.
        applied: The migrations run, in order.
        version: The database's version at the end (or after the dry run).
        head: The newest version of the files.
        dry_run: Nothing was written.
    """

    baseline: int | None
    applied: tuple[Applied, ...]
    version: int
    head: int
    dry_run: bool = False


@dataclass(frozen=True)
class MigrationStatus:
    """Where a database stands, read without changing it.

    Attributes:
        migrations: The dialect's migration files, in order.
        history: The recorded versions (empty when there is no history table).
        versioned: The history table exists and has rows.
        baseline: For an unversioned database, the version its structure shows.
        pending: The migrations :func:`migrate` would apply.
        failed: Recorded versions that did not finish (MySQL).
        edited: Recorded versions whose file changed since.
        unknown: Recorded versions that no file has (a newer release migrated it).
    """

    migrations: tuple[Migration, ...]
    history: tuple[HistoryRow, ...]
    versioned: bool
    baseline: int | None
    pending: tuple[Migration, ...]
    failed: tuple[HistoryRow, ...]
    edited: tuple[HistoryRow, ...]
    unknown: tuple[HistoryRow, ...]

    @property
    def head(self) -> int:
        """The newest version of the files."""
        return self.migrations[-1].version if self.migrations else 0

    @property
    def version(self) -> int:
        """The newest version recorded as done (or the baseline of an unversioned database)."""
        if not self.versioned:
            return self.baseline or 0
        return max((r.version for r in self.history if r.success), default=0)

    @property
    def up_to_date(self) -> bool:
        """Every file is applied, none was edited, none failed."""
        return not (self.pending or self.failed or self.edited)


# ---------------------------------------------------------------------------------------
# The files


def split_statements(text: str, *, mysql: bool = True) -> list[str]:
    """Splits SQL text into statements at ``;``, dropping comments.

    Quotes (``'...'``, ``"..."``, backticks) are kept verbatim; outside them, ``--`` comments
    (and ``#`` ones on MySQL) end at the line's end, ``/* ... */`` comments are dropped, and
    runs of whitespace become one space, so that comments and layout do not change a checksum.

    Args:
        text: The SQL.
        mysql: MySQL's rules (a backslash escapes inside quotes, ``#`` starts a comment);
            False for SQLite's.
    """
    statements: list[str] = []
    buf: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "'\"`":
            j = i + 1
            while j < n:
                if mysql and text[j] == "\\" and ch != "`":
                    j += 2
                    continue
                if text[j] == ch:
                    if j + 1 < n and text[j + 1] == ch:  # doubled quote: an escaped one
                        j += 2
                        continue
                    break
                j += 1
            buf.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("--", i) or (mysql and ch == "#"):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
            buf.append(" ")
        elif ch == ";":
            statements.append("".join(buf))
            buf = []
            i += 1
        elif ch.isspace():
            buf.append(" ")
            while i < n and text[i].isspace():
                i += 1
        else:
            buf.append(ch)
            i += 1
    statements.append("".join(buf))
    out = []
    for stmt in statements:
        stmt = re.sub(r" {2,}", " ", stmt).strip()
        if stmt:
            out.append(stmt)
    return out


def migrations_dir(dialect: str, sql_dir: Path | None = None) -> Path:
    """The folder of a dialect's migration files: ``sql/`` or ``sql/sqlite/``."""
    base = sql_dir or SQL_DIR
    return base / SQLITE_SUBDIR if dialect == "sqlite" else base


def _read_dir(folder: Path, base: Path, *, mysql: bool) -> tuple[Migration, ...]:
    if not folder.is_dir():
        raise ConfigError(
            f"the schema migration files are missing: no folder {folder} (supplier-sync runs "
            "from a source checkout, installed with `pip install -e .`)"
        )
    found: list[Migration] = []
    for path in sorted(folder.glob("*.sql")):
        m = _FILE_NAME.match(path.name)
        if m is None:
            raise MigrationError(
                f"{path}: a migration file is named NNN_words.sql (three digits, lower case)"
            )
        statements = tuple(split_statements(path.read_text(encoding="utf-8"), mysql=mysql))
        if not statements:
            raise MigrationError(f"{path}: the migration has no statement")
        found.append(
            Migration(
                version=int(m.group(1)),
                description=m.group(2).replace("_", " "),
                script=path.relative_to(base.parent).as_posix(),
                statements=statements,
                checksum=hashlib.sha256("\n;\n".join(statements).encode("utf-8")).hexdigest(),
            )
        )
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(
            f"{folder}: migration versions must run 001, 002, ... without gaps or repeats; "
            f"found {', '.join(f'{v:03d}' for v in versions)}"
        )
    return tuple(found)


def _signature(sql_dir: Path) -> tuple[tuple[str, int, int], ...]:
    """The files' names, sizes and modification times: what decides to read them again."""
    out = []
    for folder in (sql_dir, sql_dir / SQLITE_SUBDIR):
        if folder.is_dir():
            for path in sorted(folder.glob("*.sql")):
                st = path.stat()
                out.append((str(path), st.st_size, st.st_mtime_ns))
    return tuple(out)


@functools.lru_cache(maxsize=8)
def _load(
    sql_dir: Path, signature: tuple[tuple[str, int, int], ...]
) -> dict[str, tuple[Migration, ...]]:
    # ``signature`` is only part of the cache key: a changed file is read again.
    mysql = _read_dir(sql_dir, sql_dir, mysql=True)
    sqlite = _read_dir(sql_dir / SQLITE_SUBDIR, sql_dir, mysql=False)
    if len(mysql) != len(sqlite):
        missing = sorted(
            {m.script.split("/")[-1][:3] for m in mysql}
            ^ {m.script.split("/")[-1][:3] for m in sqlite}
        )
        raise MigrationError(
            f"sql/ and sql/{SQLITE_SUBDIR}/ must hold the same versions; version(s) "
            f"{', '.join(missing)} are in only one of them (every version needs a MySQL file "
            f"and a SQLite file)"
        )
    return {"mysql": mysql, "sqlite": sqlite}


def load_migrations(dialect: str, sql_dir: Path | None = None) -> tuple[Migration, ...]:
    """The migration files of a dialect, in order (read again only when a file changed).

    Args:
        dialect: ``sqlite``, ``mysql`` or ``mariadb``.
        sql_dir: The ``sql/`` folder (tests); default: the repository's.

    Raises:
        ConfigError: The folder is missing.
        MigrationError: A file is misnamed or empty, versions have gaps, or the MySQL and
            SQLite folders do not hold the same versions.
    """
    folder = (sql_dir or SQL_DIR).resolve()
    both = _load(folder, _signature(folder))
    return both["sqlite" if dialect == "sqlite" else "mysql"]


# ---------------------------------------------------------------------------------------
# Recognising the version of a database that has no history

# What each version left in a database, newest first: a database without history is at the
# newest version whose mark it bears. Every version has one, so that a database made by
# metadata.create_all (which is at the newest version) is never taken for an older one and
# given migrations whose changes it already has; test_migrations checks the newest is known.
# A mark is a table, with one of its index or unique key names, or ``column:NAME``.
_MARKERS: tuple[tuple[int, str, str | None], ...] = (
    (20, "supplier_sync_run_stats", "column:governed_rate"),
    (19, "supplier_sync_hotel_version", None),
    (18, "supplier_sync_audit", "idx_audit_run"),
    (17, "supplier_sync_dead_letter", "uk_dead_letter_open"),
    (16, "supplier_sync_city_walk", None),
    (15, "supplier_sync_alert_threshold", None),
    (14, "supplier_sync_diff_log", "idx_diff_resource"),
    (13, "platform_hotel_resource", "idx_platform_missing"),
    (12, "supplier_sync_watermark", None),
    (11, "supplier_sync_audit", None),
    (10, "supplier_sync_snapshot", "idx_snapshot_derived_from"),
    (9, "supplier_sync_task_audit", None),
    (8, "supplier_sync_outbox", "uk_outbox_event"),
    (7, "platform_hotel_offer", "uk_offer_identity"),
    (6, "supplier_sync_review", None),
    (5, "supplier_sync_city_profile", None),
    (4, "supplier_sync_outbox", None),
    (3, "supplier_sync_snapshot", None),
    (2, "supplier_sync_shard", None),
    (1, "supplier_sync_task", None),
)

_CREATE_TABLE = re.compile(r"^CREATE TABLE (?:IF NOT EXISTS )?`?(\w+)`?", re.IGNORECASE)
_DROP_TABLE = re.compile(r"^DROP TABLE (?:IF EXISTS )?`?(\w+)`?", re.IGNORECASE)


def tables_at(migrations: Sequence[Migration], version: int) -> set[str]:
    """The tables that the migrations up to ``version`` leave (created and not dropped)."""
    tables: set[str] = set()
    for m in migrations:
        if m.version > version:
            break
        for stmt in m.statements:
            if created := _CREATE_TABLE.match(stmt):
                tables.add(created.group(1))
            elif dropped := _DROP_TABLE.match(stmt):
                tables.discard(dropped.group(1))
    return tables


def detect_version(conn: Connection, migrations: Sequence[Migration]) -> int:
    """The version an unversioned database's structure shows (0: none of our tables).

    Raises:
        MigrationError: It has the mark of a version but lacks tables of that version.
    """
    insp = sa.inspect(conn)
    existing = set(insp.get_table_names())
    version = 0
    for candidate, table, key in _MARKERS:
        if table not in existing:
            continue
        if key is None:
            version = candidate
            break
        keys = {ix["name"] for ix in insp.get_indexes(table)} | {
            uc["name"] for uc in insp.get_unique_constraints(table)
        }
        if key.startswith("column:"):
            keys = {f"column:{c['name']}" for c in insp.get_columns(table)}
        if key in keys:
            version = candidate
            break
    missing = sorted(tables_at(migrations, version) - existing)
    if missing:
        raise MigrationError(
            f"the database has no schema history, and its structure matches no version: it "
            f"bears the mark of version {version:03d} but lacks its table(s) "
            f"{', '.join(missing)}. Apply the missing files of sql/ by hand, or start from an "
            "empty database"
        )
    return version


# ---------------------------------------------------------------------------------------
# The history


def _is_missing_table(err: sa.exc.DBAPIError) -> bool:
    orig = err.orig
    code = orig.args[0] if orig is not None and orig.args else None
    return code == 1146 or "no such table" in str(orig).lower()


def _read_history(conn: Connection) -> list[HistoryRow] | None:
    """The history rows, or None when the table does not exist."""
    try:
        rows = conn.execute(sa.select(history).order_by(history.c.version)).all()
    except (sa.exc.ProgrammingError, sa.exc.OperationalError) as err:
        if _is_missing_table(err):
            conn.rollback()
            return None
        raise
    return [HistoryRow(**{**r._mapping, "success": bool(r.success)}) for r in rows]


def _compare(
    rows: Sequence[HistoryRow], migrations: Sequence[Migration]
) -> tuple[list[HistoryRow], list[HistoryRow], list[HistoryRow], list[Migration]]:
    """(edited, failed, unknown, pending) of a history against the files."""
    by_version = {m.version: m for m in migrations}
    recorded = {r.version for r in rows}
    # A failed version's file may be corrected before it runs again (after a repair).
    edited = [
        r
        for r in rows
        if r.success and r.version in by_version and r.checksum != by_version[r.version].checksum
    ]
    failed = [r for r in rows if not r.success]
    unknown = [r for r in rows if r.version not in by_version]
    pending = [m for m in migrations if m.version not in recorded]
    return edited, failed, unknown, pending


def _edited_error(db_url: str, row: HistoryRow, migration: Migration) -> MigrationChecksumMismatch:
    return MigrationChecksumMismatch(
        f"{migration.script} was edited after version {row.version:03d} was applied to "
        f"{db_url} (recorded checksum {row.checksum[:12]}..., the file's statements now "
        f"{migration.checksum[:12]}...). An applied migration never changes: restore the file "
        "(git checkout) and put the change in a new numbered file"
    )


def _failed_error(db_url: str, row: HistoryRow) -> MigrationFailed:
    return MigrationFailed(
        f"migration {row.version:03d} ({row.script}) did not finish on {db_url} (started "
        f"{row.installed_at} by {row.installed_by}); MySQL cannot roll DDL back, so part of it "
        "may be applied. Compare the database with the file and undo what it applied, then run "
        "`supplier-sync db repair` and `supplier-sync db migrate` (or, if you completed it by "
        "hand, `supplier-sync db repair --mark-applied`)"
    )


def _check(
    db_url: str, rows: Sequence[HistoryRow], migrations: Sequence[Migration]
) -> list[Migration]:
    """Raises on an edited or failed version, or on a hole in the history; returns the pending."""
    edited, failed, unknown, pending = _compare(rows, migrations)
    by_version = {m.version: m for m in migrations}
    if edited:
        raise _edited_error(db_url, edited[0], by_version[edited[0].version])
    if failed:
        raise _failed_error(db_url, failed[0])
    newest = max((r.version for r in rows), default=0)
    behind = [m for m in pending if m.version < newest]
    if behind:
        raise MigrationError(
            f"{db_url} has version {newest:03d} but not {behind[0].label} "
            f"({behind[0].script}): migrations run in order, and this one was added below a "
            "version already applied. Renumber it after the newest version"
        )
    if unknown:
        log.warning(
            "sync database %s has schema version(s) %s that this release does not know: a "
            "newer release migrated it",
            db_url,
            ", ".join(f"{r.version:03d}" for r in unknown),
        )
    return pending


def migration_status(db: Database, *, sql_dir: Path | None = None) -> MigrationStatus:
    """Where the database stands: its history against the files. Changes nothing.

    Args:
        db: The sync database.
        sql_dir: The ``sql/`` folder (tests); default: the repository's.
    """
    migrations = load_migrations(db.dialect, sql_dir)
    with db.translate_errors("reading the schema history"), db.engine.connect() as conn:
        rows = _read_history(conn) or []
        baseline = None if rows else detect_version(conn, migrations)
    edited, failed, unknown, pending = _compare(rows, migrations)
    if baseline is not None:
        pending = [m for m in migrations if m.version > baseline]
    return MigrationStatus(
        migrations=tuple(migrations),
        history=tuple(rows),
        versioned=bool(rows),
        baseline=baseline,
        pending=tuple(pending),
        failed=tuple(failed),
        edited=tuple(edited),
        unknown=tuple(unknown),
    )


# ---------------------------------------------------------------------------------------
# Migrating


def _installed_by() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"[:128]


@contextmanager
def _locked(db: Database, timeout: float) -> Iterator[Connection]:
    """A connection that holds the migration lock of this database.

    SQLite: a write transaction (BEGIN IMMEDIATE), committed when the block ends; other
    writers wait. MySQL: ``GET_LOCK`` on the connection, named after the database; DDL
    commits on its own there, statement by statement.
    """
    if db.dialect == "sqlite":
        with db.engine.connect() as conn:
            dbapi = conn.connection.dbapi_connection
            assert dbapi is not None
            cur = dbapi.cursor()
            cur.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
            try:
                conn = conn.execution_options(**{WRITE_OPTION: True})
                try:
                    tx = conn.begin()
                except sa.exc.OperationalError as err:
                    if "locked" in str(err.orig).lower():
                        raise MigrationLocked(
                            f"another process held the write lock of {db.safe_url} for more "
                            f"than {timeout:.0f} s while this one waited to migrate it"
                        ) from None
                    raise
                with tx:
                    yield conn
            finally:
                cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
                cur.close()
        return
    name = sa.func.left(sa.func.concat(LOCK_PREFIX, sa.func.database()), 64)
    with db.engine.connect() as conn:
        got = conn.execute(sa.select(sa.func.get_lock(name, int(timeout)))).scalar()
        conn.commit()
        if got != 1:
            raise MigrationLocked(
                f"another process held the migration lock of {db.safe_url} for more than "
                f"{timeout:.0f} s while this one waited (it may still be migrating: see "
                "SHOW PROCESSLIST)"
            )
        try:
            yield conn
        finally:
            if not conn.invalidated:
                conn.execute(sa.select(sa.func.release_lock(name)))
                conn.commit()


def _commit(conn: Connection, dialect: str) -> None:
    # SQLite migrates in one transaction; on MySQL each step is committed as it happens.
    if dialect != "sqlite":
        conn.commit()


def _row(m: Migration, kind: Kind, success: bool) -> dict[str, object]:
    return {
        "version": m.version,
        "description": m.description[:200],
        "script": m.script,
        "checksum": m.checksum,
        "kind": kind,
        "success": success,
        "installed_by": _installed_by(),
        "installed_at": db_now(0),
        "execution_ms": 0,
    }


def _apply(conn: Connection, db: Database, m: Migration) -> Applied:
    started = time.perf_counter()
    conn.execute(sa.insert(history).values(_row(m, "SQL", success=False)))
    _commit(conn, db.dialect)
    done = 0
    try:
        for stmt in m.statements:
            conn.exec_driver_sql(stmt, execution_options={"no_parameters": True})
            done += 1
    except sa.exc.DBAPIError as err:
        if err.connection_invalidated:
            raise  # the row stays unfinished: the next migrate says what to do
        if db.dialect == "sqlite":
            raise MigrationError(
                f"migration {m.label} ({m.script}) failed at statement {done + 1} of "
                f"{len(m.statements)}: {err.orig}; nothing was changed (SQLite rolls the "
                "whole migration back)"
            ) from err
        conn.rollback()
        if done == 0:
            # Nothing ran: forget the attempt, so a corrected file (or database) can retry.
            conn.execute(sa.delete(history).where(history.c.version == m.version))
            conn.commit()
            raise MigrationError(
                f"migration {m.label} ({m.script}) failed at its first statement, nothing was "
                f"changed: {err.orig}"
            ) from err
        raise MigrationFailed(
            f"migration {m.label} ({m.script}) failed at statement {done + 1} of "
            f"{len(m.statements)} on {db.safe_url}: {err.orig}. Statements 1-{done} are applied "
            "and MySQL cannot roll them back: undo them by hand, then run `supplier-sync db "
            "repair` and `supplier-sync db migrate` (or complete the file by hand and run "
            "`supplier-sync db repair --mark-applied`)"
        ) from err
    seconds = time.perf_counter() - started
    conn.execute(
        sa.update(history)
        .where(history.c.version == m.version)
        .values(success=True, execution_ms=round(seconds * 1000))
    )
    _commit(conn, db.dialect)
    return Applied(m.version, m.description, seconds)


def migrate(
    db: Database,
    *,
    dry_run: bool = False,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_SECONDS,
    sql_dir: Path | None = None,
) -> MigrationResult:
    """Brings the database to the newest version of ``sql/``.

    A database without history is baselined first (see :func:`detect_version`); then every
    pending file runs, in order, under the migration lock.

    Args:
        db: The sync database.
        dry_run: Only report what would be done (takes no lock, writes nothing).
        lock_timeout: Seconds to wait for another process's migration.
        sql_dir: The ``sql/`` folder (tests); default: the repository's.

    Raises:
        MigrationChecksumMismatch: An applied file was edited since.
        MigrationFailed: A file stopped half-way (now or before), on MySQL.
        MigrationLocked: Another process migrated for longer than ``lock_timeout``.
        MigrationError: A file failed (nothing changed), or the structure or history is
            inconsistent.
        DatabaseUnavailable: The database cannot be reached.
    """
    migrations = load_migrations(db.dialect, sql_dir)
    head = migrations[-1].version
    if dry_run:
        status = migration_status(db, sql_dir=sql_dir)
        _check(db.safe_url, status.history, migrations)
        planned = tuple(Applied(m.version, m.description, 0.0) for m in status.pending)
        return MigrationResult(
            baseline=status.baseline, applied=planned, version=head, head=head, dry_run=True
        )
    with db.translate_errors("migrating the schema"), _locked(db, lock_timeout) as conn:
        history.create(conn, checkfirst=True)
        _commit(conn, db.dialect)
        rows = _read_history(conn) or []
        pending = _check(db.safe_url, rows, migrations)
        baseline = None
        if not rows:
            baseline = detect_version(conn, migrations)
            if baseline:
                conn.execute(
                    sa.insert(history).values(
                        [_row(m, "BASELINE", success=True) for m in migrations[:baseline]]
                    )
                )
                _commit(conn, db.dialect)
            pending = list(migrations[baseline:])
        applied = tuple(_apply(conn, db, m) for m in pending)
    return MigrationResult(baseline=baseline, applied=applied, version=head, head=head)


def migrate_on_open(db: Database, *, sql_dir: Path | None = None) -> MigrationResult | None:
    """What :meth:`SyncDatabase.open` runs: one read of the history, and :func:`migrate`
    only when something is pending.

    Returns:
        What was done, or None when the database was up to date.

    Raises:
        MigrationChecksumMismatch: An applied file was edited since.
        MigrationError: See :func:`migrate`.
    """
    migrations = load_migrations(db.dialect, sql_dir)
    with db.translate_errors("reading the schema history"), db.engine.connect() as conn:
        rows = _read_history(conn)
    if rows:
        edited, failed, _unknown, pending = _compare(rows, migrations)
        if edited:
            raise _edited_error(
                db.safe_url, edited[0], {m.version: m for m in migrations}[edited[0].version]
            )
        if not failed and not pending:
            return None
    result = migrate(db, sql_dir=sql_dir)
    if result.baseline is not None or result.applied:
        log.info(
            "sync database %s: %s%s; at version %03d",
            db.safe_url,
            f"baselined at {result.baseline:03d}, " if result.baseline else "",
            "applied " + ", ".join(a.label for a in result.applied)
            if result.applied
            else "nothing to apply",
            result.version,
        )
    return result


def repair(
    db: Database, *, mark_applied: bool = False, sql_dir: Path | None = None
) -> list[HistoryRow]:
    """Clears the record of MySQL migrations that stopped half-way.

    Run it after undoing by hand what such a file applied (then ``migrate`` runs it again),
    or with ``mark_applied`` after completing it by hand.

    Args:
        db: The sync database.
        mark_applied: Record the failed versions as done, with their files' checksums as
            they are now, instead of forgetting them.
        sql_dir: The ``sql/`` folder (tests); default: the repository's.

    Returns:
        The failed rows that were repaired.
    """
    checksums = {m.version: m.checksum for m in load_migrations(db.dialect, sql_dir)}
    with db.translate_errors("reading the schema history"), db.engine.connect() as conn:
        if not any(not r.success for r in _read_history(conn) or []):
            return []
    with (
        db.translate_errors("repairing the schema history"),
        _locked(db, DEFAULT_LOCK_TIMEOUT_SECONDS) as conn,
    ):
        failed = [r for r in (_read_history(conn) or []) if not r.success]
        for row in failed:
            where = history.c.version == row.version
            if mark_applied:
                done = {"success": True, "checksum": checksums.get(row.version, row.checksum)}
                conn.execute(sa.update(history).where(where).values(done))
            else:
                conn.execute(sa.delete(history).where(where))
        _commit(conn, db.dialect)
    return failed
