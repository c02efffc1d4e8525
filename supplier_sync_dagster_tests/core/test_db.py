"""Opening the sync database: settings, clear errors, the embedded default, the clock."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.db import SyncDatabase, make_engine, resolve_db_url
from supplier_sync_dagster.core.errors import ConfigError, DatabaseUnavailable


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
    from datetime import UTC, datetime
    from decimal import Decimal

    import supplier_sync_dagster.core.db as db_module
    from supplier_sync_dagster.core import schema
    from supplier_sync_dagster.core.db import execute_many

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
