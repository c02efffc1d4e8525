"""The numbered DDL in sql/ and the package's SQLAlchemy metadata are the same schema."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

from supplier_sync_dagster.core.db import SyncDatabase
from supplier_sync_dagster.core.schema import metadata

SQL_DIR = Path(__file__).resolve().parents[2] / "sql"


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


def test_sql_ddl_matches_metadata_on_mariadb(mysql_server_url: str, fresh_mysql_db: str):
    from_sql = sa.create_engine(fresh_mysql_db)
    with from_sql.begin() as conn:
        for path in sorted(SQL_DIR.glob("*.sql")):
            for stmt in _statements(path):
                conn.exec_driver_sql(stmt)

    other = (
        fresh_mysql_db.rsplit("/", 1)[0]
        + "/"
        + "meta_"
        + fresh_mysql_db.rsplit("/", 1)[1].split("?")[0]
    )
    admin = sa.create_engine(mysql_server_url)
    name = other.rsplit("/", 1)[1]
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    try:
        db = SyncDatabase.open(other)
        expected = _describe(db.engine)
        db.dispose()
        actual = _describe(from_sql)
        assert set(actual) == set(metadata.tables)
        for table in metadata.tables:
            assert actual[table] == expected[table], table
        # Codes compare byte for byte: BKK and bkk, e and é are different cities.
        with from_sql.connect() as conn:
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
        from_sql.dispose()
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
        admin.dispose()


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
    assert {r[0] for r in rows} == set(metadata.tables)
    assert all(r[1] == "InnoDB" and r[2].startswith("utf8mb4") for r in rows), rows
