"""Opening the sync database: settings, clear errors, the embedded default, the clock."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.db import SyncDatabase, resolve_db_url
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
