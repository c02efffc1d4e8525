"""The numbered DDL in sql/ (and sql/sqlite/) and the package's SQLAlchemy metadata are the same
schema."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.engine import make_engine
from supplier_sync_dagster.core.store.migrations import HISTORY_TABLE, load_migrations
from supplier_sync_dagster.core.store.schema import metadata

SQL_DIR = Path(__file__).resolve().parents[3] / "sql"


def _statements(path: Path) -> list[str]:
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if not ln.startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def _describe(engine: sa.Engine) -> dict[str, dict[str, object]]:
    insp = sa.inspect(engine)
    out: dict[str, dict[str, object]] = {}
    for table in sorted(insp.get_table_names()):
        out[table] = {
            "columns": {
                c["name"]: (c["nullable"], str(c["type"]), str(c.get("default")))
                for c in insp.get_columns(table)
            },
            "unique": {
                # MariaDB reflects UNIQUE KEYs both as unique constraints and unique indexes.
                (u["name"], tuple(u["column_names"]))
                for u in insp.get_unique_constraints(table)
            },
            "indexes": {
                (ix["name"], tuple(ix["column_names"]))
                for ix in insp.get_indexes(table)
                if not ix.get("unique")
            },
        }
    return out


def test_sql_files_are_numbered_and_complete():
    files = sorted(SQL_DIR.glob("*.sql"))
    assert [f.name[:4] for f in files] == [f"{i:03d}_" for i in range(1, len(files) + 1)]
    tables: set[str] = set()
    for f in files:
        for stmt in _statements(f):
            if stmt.upper().startswith("CREATE TABLE"):
                tables.add(stmt.split("(")[0].split()[-1])
            elif stmt.upper().startswith("DROP TABLE"):
                tables.discard(stmt.split()[-1])
    assert tables == set(metadata.tables)


@pytest.fixture
def metadata_db_url(db_url: str, tmp_path: Path) -> Iterator[str]:
    """A second empty database beside ``db_url``, of the same backend."""
    if db_url.startswith("sqlite"):
        yield f"sqlite:///{tmp_path / 'from_metadata.sqlite3'}"
        return
    server, rest = db_url.rsplit("/", 1)
    name = "meta_" + rest.split("?")[0]
    admin = sa.create_engine(server)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    try:
        yield f"{server}/{name}?charset=utf8mb4"
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
        admin.dispose()


def test_migrations_at_head_match_metadata(db_url: str, metadata_db_url: str):
    """sql/ (MariaDB) and sql/sqlite/ (SQLite), applied in order, build what schema.py says."""
    migrated = SyncDatabase.open(db_url)  # applies every migration to the empty database
    from_metadata = make_engine(metadata_db_url)
    with from_metadata.begin() as conn:
        metadata.create_all(conn)
    try:
        actual = _describe(migrated.engine)
        expected = _describe(from_metadata)
        assert set(actual) == set(metadata.tables) | {HISTORY_TABLE}
        for table in metadata.tables:
            assert actual[table] == expected[table], table
        if migrated.dialect != "sqlite":
            # Codes compare byte for byte: BKK and bkk, e and é are different cities.
            with migrated.engine.connect() as conn:
                collations: dict[str, str] = dict(
                    conn.execute(
                        sa.text(
                            "SELECT column_name, collation_name FROM information_schema.columns "
                            "WHERE table_schema = DATABASE() AND table_name = 'supplier_sync_shard'"
                        )
                    ).all()
                )
            assert collations["shard_key"] == "utf8mb4_bin"
    finally:
        migrated.dispose()
        from_metadata.dispose()


def test_sql_and_sqlite_folders_hold_the_same_versions():
    mysql = [Path(m.script).name for m in load_migrations("mysql")]
    sqlite = [Path(m.script).name for m in load_migrations("sqlite")]
    assert mysql == sqlite
    assert sorted(p.name for p in (SQL_DIR / "sqlite").glob("*.sql")) == sqlite
    assert sorted(p.name for p in SQL_DIR.glob("*.sql")) == mysql


def test_tables_are_innodb_utf8mb4(fresh_mysql_db: str):
    db = SyncDatabase.open(fresh_mysql_db)
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT table_name, engine, table_collation FROM information_schema.tables "
                "WHERE table_schema = DATABASE()"
            )
        ).all()
    db.dispose()
    assert {r[0] for r in rows} == set(metadata.tables) | {HISTORY_TABLE}
    assert all(r[1] == "InnoDB" and r[2].startswith("utf8mb4") for r in rows), rows
