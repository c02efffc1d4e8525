"""Opening the sync database: settings, clear errors, the embedded default, the clock."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa

import supplier_sync_dagster.core.store.db as db_module
from supplier_sync_dagster.core.errors import ConfigError, DatabaseUnavailable
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import (
    SyncDatabase,
    execute_many,
    is_deadlock,
    retry_deadlocks,
)
from supplier_sync_dagster.core.store.engine import make_engine, resolve_db_url


def test_default_is_a_sqlite_file_in_the_state_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("SUPPLIER_SYNC_DB_URL", raising=False)
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "state"))
    url = resolve_db_url()
    assert url == f"sqlite:///{tmp_path / 'state' / 'sync.sqlite3'}"
    db = SyncDatabase.open()
    assert (tmp_path / "state" / "sync.sqlite3").exists()
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
        # Checkpoints every 40 MB of WAL, not every 4 MB (see SQLITE_WAL_AUTOCHECKPOINT_PAGES).
        assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 10_000
    db.dispose()


def test_env_setting_selects_the_database(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("SUPPLIER_SYNC_DB_URL", f"sqlite:///{tmp_path}/other.db")
    assert resolve_db_url() == f"sqlite:///{tmp_path}/other.db"
    assert resolve_db_url("sqlite:///explicit.db") == "sqlite:///explicit.db"


@pytest.mark.parametrize("url", ["not a url", "postgresql://u@h/db", "oracle://x"])
def test_malformed_or_unsupported_url_is_a_config_error(url: str):
    with pytest.raises(ConfigError, match="SUPPLIER_SYNC_DB_URL"):
        SyncDatabase.open(url)


def test_unreachable_database_is_a_clear_error_without_the_password():
    # Port 1 on loopback: nothing listens there, the connection is refused at once.
    with pytest.raises(DatabaseUnavailable) as info:
        SyncDatabase.open("mysql+pymysql://root:s3cret@127.0.0.1:1/sync")
    message = str(info.value)
    assert "127.0.0.1:1" in message and "unavailable" in message
    assert "s3cret" not in message


def test_unknown_mysql_database_is_a_clear_error(mysql_server_url: str):
    with pytest.raises(DatabaseUnavailable, match="no_such_db_here"):
        SyncDatabase.open(f"{mysql_server_url}/no_such_db_here")


def test_unopenable_sqlite_path(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises((DatabaseUnavailable, ConfigError, OSError)):
        SyncDatabase.open(f"sqlite:///{blocker}/sub/sync.sqlite3")


def test_a_new_sqlite_file_opens_in_wal_mode_while_another_process_writes_it(tmp_path: Path):
    """Switching to WAL fails at once on a write lock (no busy handler): opening waits."""
    path = tmp_path / "sync.sqlite3"
    writer = sqlite3.connect(path, isolation_level=None)  # another process, rollback journal
    writer.execute("CREATE TABLE t (x INT)")
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO t VALUES (1)")
    engine = make_engine(f"sqlite:///{path}")
    modes: list[str] = []
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            with engine.connect() as conn:
                modes.append(conn.exec_driver_sql("PRAGMA journal_mode").scalar_one())
        except BaseException as err:
            errors.append(err)

    opener = threading.Thread(target=open_it)
    try:
        opener.start()
        opener.join(timeout=0.5)
        assert not errors, errors
        assert opener.is_alive()  # waiting for the write lock, not failed
        writer.execute("COMMIT")
        opener.join()
        assert not errors, errors
        assert modes == ["wal"]
    finally:
        writer.close()
        opener.join()
        engine.dispose()


def _count_rows(db: SyncDatabase) -> int:
    with db.engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT count(*) FROM t").scalar_one())


def _hold_write(db: SyncDatabase, entered: threading.Event, release: threading.Event) -> None:
    with db.begin() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES (1)")
        entered.set()
        release.wait(10)


def test_sqlite_writers_queue_on_the_writer_lock_and_go_in_when_it_is_released(tmp_path: Path):
    """A write transaction waits for the holder of ``<db>-writer`` and starts the moment the
    holder commits (no busy-handler sleeps); commit, rollback and a failed BEGIN release it."""
    db = SyncDatabase.open(f"sqlite:///{tmp_path / 'sync.sqlite3'}", create_schema=False)
    with db.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INT)")
    assert (tmp_path / "sync.sqlite3-writer").exists()
    entered, release, second_in = threading.Event(), threading.Event(), threading.Event()
    waited: list[float] = []

    def second() -> None:
        began = time.monotonic()
        with db.begin() as conn:
            waited.append(time.monotonic() - began)
            second_in.set()
            conn.exec_driver_sql("INSERT INTO t VALUES (2)")

    holder = threading.Thread(target=_hold_write, args=(db, entered, release))
    holder.start()
    assert entered.wait(5)
    other = threading.Thread(target=second)
    other.start()
    assert not second_in.wait(0.3)  # queued behind the holder
    release.set()
    holder.join(5)
    other.join(5)
    assert second_in.is_set() and waited[0] >= 0.3
    assert _count_rows(db) == 2

    # A rolled-back transaction releases the lock too.
    with pytest.raises(RuntimeError), db.begin() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES (3)")
        raise RuntimeError("boom")
    started = time.monotonic()
    with db.begin() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES (4)")
    assert time.monotonic() - started < 1
    assert _count_rows(db) == 3
    db.dispose()


def test_a_writer_that_ignores_the_writer_lock_still_gets_the_busy_timeout(tmp_path: Path):
    """Another program (here a plain sqlite3 connection) that holds SQLite's write lock
    without the lock file makes our writer wait in SQLite's busy handler, not fail."""
    path = tmp_path / "sync.sqlite3"
    db = SyncDatabase.open(f"sqlite:///{path}", create_schema=False)
    with db.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INT)")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO t VALUES (1)")
    done = threading.Event()

    def write() -> None:
        with db.begin() as conn:
            conn.exec_driver_sql("INSERT INTO t VALUES (2)")
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    assert not done.wait(0.3)
    other.execute("COMMIT")
    writer.join(10)
    other.close()
    assert done.is_set()
    assert _count_rows(db) == 2
    db.dispose()


def test_sqlite_writer_lock_is_shared_by_processes(tmp_path: Path):
    """Another process's write transaction queues behind this process's holder."""
    path = tmp_path / "sync.sqlite3"
    db = SyncDatabase.open(f"sqlite:///{path}", create_schema=False)
    with db.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INT)")
    entered, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_write, args=(db, entered, release))
    holder.start()
    assert entered.wait(5)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from supplier_sync_dagster.core.store.db import SyncDatabase\n"
            "db = SyncDatabase.open(sys.argv[1], create_schema=False)\n"
            "with db.begin() as conn: conn.exec_driver_sql('INSERT INTO t VALUES (2)')\n",
            f"sqlite:///{path}",
        ]
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(3)  # waiting for the lock file
        release.set()
        holder.join(5)
        assert child.wait(10) == 0
    finally:
        release.set()
        child.kill()
    assert _count_rows(db) == 2
    db.dispose()


def test_clock_is_the_database_clock_and_shifts_without_sleeping(db_url: str):
    db = SyncDatabase.open(db_url)
    with db.engine.connect() as conn:
        before = db.clock.read(conn)
        db.clock.advance(3600)
        after = db.clock.read(conn)
        shifted = conn.execute(sa.select(db.clock.now(-3600))).scalar_one()
    db.dispose()
    assert 3600 <= (after - before).total_seconds() < 3605
    assert abs((shifted - before).total_seconds()) < 5


def test_execute_many_stores_exactly_what_sqlalchemy_stores(
    db: SyncDatabase, monkeypatch: pytest.MonkeyPatch
):
    """The generated bind step (dates as text on MySQL included) matches SQLAlchemy's own."""
    # Small statements: the rows of one call are split over several of them on MySQL.
    monkeypatch.setattr(db_module, "MYSQL_MAX_STATEMENT_CHARS", 1000)
    inserts: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("INSERT"):
            inserts.append(statement)

    sa.event.listen(db.engine, "before_cursor_execute", count)

    def row(offer_id: int, i: int) -> dict[str, object]:
        return {
            "offer_id": offer_id,
            "resource_id": offer_id // 100,  # (resource, room, rate plan) is unique
            "room_code": f"R{i}é",
            "rate_plan_code": "BAR",
            "room_name": None
            if i % 2
            else "Deluxe 'quoted' \"\\ 100% %s\n\r\x1a\x00 room \U0001f600",
            "bed_type": "KING",
            "max_occupancy": i,
            "board": None,
            "refundable": bool(i % 2),
            "available": True,
            "price_amount": Decimal("1234.5678") + i,
            "currency": "THB",
            "supplier_version": 2**40 + i,
            "publish_version": i,
            "updated_at": datetime(2026, 11, 30, 5, 6, 7, 890123 if i % 2 else 0),
        }

    fixed = {"active": True}
    with db.begin() as conn:
        ours = [row(100 + i, i) for i in range(12)]
        execute_many(
            conn, ("test_offers",), lambda: sa.insert(schema.platform_offer), ours, fixed=fixed
        )
        if db.dialect != "sqlite":  # sent as SQL text, in statements of at most 1000 characters
            assert len(inserts) > 1 and max(len(s) for s in inserts) <= 1000
        theirs = [{**row(200 + i, i), **fixed} for i in range(12)]
        conn.execute(sa.insert(schema.platform_offer), theirs)
        aware = [{**row(300, 1), "updated_at": datetime(2026, 11, 30, 5, 6, 7, 1, tzinfo=UTC)}]
        execute_many(
            conn, ("test_offers",), lambda: sa.insert(schema.platform_offer), aware, fixed=fixed
        )
    with db.engine.connect() as conn:
        got = {
            r.offer_id: {
                k: v for k, v in r._mapping.items() if k not in ("offer_id", "resource_id")
            }
            for r in conn.execute(sa.select(schema.platform_offer))
        }
    for i in range(12):
        assert got[100 + i] == got[200 + i]
    assert got[100]["room_name"] == "Deluxe 'quoted' \"\\ 100% %s\n\r\x1a\x00 room \U0001f600"
    assert got[300]["updated_at"] == datetime(2026, 11, 30, 5, 6, 7, 1)
    sa.event.remove(db.engine, "before_cursor_execute", count)


def _deadlock_on_mariadb(url: str) -> sa.exc.DBAPIError:
    """Two transactions lock two rows in opposite orders: InnoDB picks one as the victim."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (id INT PRIMARY KEY, v INT)"))
            conn.execute(sa.text("INSERT INTO t VALUES (1, 0), (2, 0)"))
        first_locked, second_locked = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def tx(mine: int, theirs: int, locked: threading.Event, other: threading.Event) -> None:
            try:
                with engine.begin() as conn:
                    conn.execute(sa.text("UPDATE t SET v = v + 1 WHERE id = :i"), {"i": mine})
                    locked.set()
                    other.wait(10)
                    conn.execute(sa.text("UPDATE t SET v = v + 1 WHERE id = :i"), {"i": theirs})
            except BaseException as err:  # the victim's
                errors.append(err)

        threads = [
            threading.Thread(target=tx, args=(1, 2, first_locked, second_locked)),
            threading.Thread(target=tx, args=(2, 1, second_locked, first_locked)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        (err,) = errors
        assert isinstance(err, sa.exc.DBAPIError)
        return err
    finally:
        engine.dispose()


def test_a_real_innodb_deadlock_is_recognised_and_its_work_runs_again(fresh_mysql_db: str):
    err = _deadlock_on_mariadb(fresh_mysql_db)
    assert is_deadlock(err)
    assert not is_deadlock(ValueError("no")) and not is_deadlock(
        sa.exc.OperationalError("SELECT 1", {}, Exception(1045, "Access denied"))
    )
    calls: list[int] = []
    pauses: list[float] = []

    def work() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise err
        return "done"

    assert retry_deadlocks(work, sleep=pauses.append) == "done"
    assert len(calls) == 3 and len(pauses) == 2 and all(0 < p < 1 for p in pauses)

    # Past its attempts the deadlock is raised; any other error at once.
    def always(error: BaseException) -> Callable[[], None]:
        def work() -> None:
            calls.append(1)
            raise error

        return work

    calls.clear()
    with pytest.raises(sa.exc.DBAPIError):
        retry_deadlocks(always(err), attempts=2, sleep=pauses.append)
    assert len(calls) == 2
    calls.clear()
    denied = sa.exc.OperationalError("SELECT 1", {}, Exception(1045, "Access denied"))
    with pytest.raises(sa.exc.OperationalError):
        retry_deadlocks(always(denied), sleep=pauses.append)
    assert len(calls) == 1


def test_a_process_on_sqlite_does_not_import_pymysql(tmp_path: Path):
    """PyMySQL costs ~45 ms to import: the bulk-insert code that needs it (its escaping, its
    INSERT splitting) imports it where it runs, which is only on a PyMySQL connection, so a
    command on the embedded SQLite default never loads it."""
    script = (
        "import sys\n"
        "from supplier_sync_dagster.core.leasing.batches import TaskSpec, upsert_task\n"
        "from supplier_sync_dagster.core.store.db import SyncDatabase\n"
        "db = SyncDatabase.open(sys.argv[1])\n"
        "upsert_task(db, TaskSpec(task_code='t', supplier_id=1))\n"
        "print('loaded:', sorted(m for m in sys.modules if m.split('.')[0] == 'pymysql'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, f"sqlite:///{tmp_path / 'sync.sqlite3'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded: []" in done.stdout, done.stdout


def test_a_recent_database_time_is_reused_until_too_old_or_the_clock_moves(db: SyncDatabase):
    reads: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        if "db_now" in statement:
            reads.append(statement)

    sa.event.listen(db.engine, "after_cursor_execute", count)
    try:
        first = db.clock.recent_utc(db.engine, 3600)
        assert first.tzinfo is UTC
        # The reading, moved on by the time elapsed since: never behind the one before.
        again = db.clock.recent_utc(db.engine, 3600)
        assert first <= again and len(reads) == 1
        assert db.clock.recent_utc(db.engine, 3600) >= again and len(reads) == 1
        # Another clock (a shifted one: a test's, or a worker whose clock moved) reads anew.
        db.clock.advance(120)
        later = db.clock.recent_utc(db.engine, 3600)
        assert len(reads) == 2 and (later - first).total_seconds() >= 120
        # No reuse allowed: always the database's time now.
        db.clock.recent_utc(db.engine, 0)
        assert len(reads) == 3
    finally:
        sa.event.remove(db.engine, "after_cursor_execute", count)
