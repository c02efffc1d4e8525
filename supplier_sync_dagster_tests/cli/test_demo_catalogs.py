"""A demo never touches an operator's catalog (issue 40, item 1): ``lease-demo`` runs in its
own database whatever ``SUPPLIER_SYNC_DB_URL`` says, and a demo told to write into a catalog
it did not fill (``--db-url``, or ``demo`` on the configured one) refuses in one line, before
it writes anything; on SQLite and MariaDB."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.cli.demo_catalogs import (
    RECORD_NAME,
    catalog_key,
    claim_demo_catalog,
    holds_catalog,
)
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster_tests.cli.test_main import (  # noqa: F401  (cli_home: an autouse fixture)
    assert_one_line_error,
    cli_home,
    run,
    simulator,
    supplier,
    sync,
)


def rows(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, sorted: the catalog's content, read without migrating it."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            meta = sa.MetaData()
            meta.reflect(conn)
            return {
                name: sorted(tuple(map(repr, r)) for r in conn.execute(sa.select(table)))
                for name, table in meta.tables.items()
            }
    finally:
        engine.dispose()


def file_bytes(url: str) -> str | None:
    """The sha256 of a SQLite catalog's file (None for a server's)."""
    if not url.startswith("sqlite:///"):
        return None
    return hashlib.sha256(Path(url.removeprefix("sqlite:///")).read_bytes()).hexdigest()


@pytest.fixture
def real_catalog(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> str:
    """An operator's catalog: published hotels of supplier 1001 (the demo's id too), synced
    from the configured supplier by `sync --full`."""
    with supplier(simulator(seed=5, n_cities=3, total_hotels=240), monkeypatch):
        done = sync(capsys, db_url, "--trigger-id", "real-night-1")
    assert done.code == 0, done
    h = schema.platform_hotel.c
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).where(h.supplier_id == 1001)).scalar()
    engine.dispose()
    return db_url


def test_lease_demo_runs_in_its_own_database_and_leaves_the_configured_catalog_as_it_was(
    real_catalog: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
):
    monkeypatch.setenv("SUPPLIER_SYNC_DB_URL", real_catalog)
    before, before_bytes = rows(real_catalog), file_bytes(real_catalog)

    demo = run(capsys, "lease-demo", "--lease-seconds", "5")
    assert demo.code == 0, demo.out + demo.err
    assert demo.lines[-1] == "ALL CHECKS PASSED"
    own = tmp_path / "home" / "lease-demo" / "sync.sqlite3"
    assert f"sync database: sqlite:///{own}" in demo.out
    assert file_bytes(real_catalog) == before_bytes  # byte for byte (SQLite)
    assert rows(real_catalog) == before  # row for row
    # The demo's batch is in its own database, with its pages in its own payload folder.
    demo_rows = rows(f"sqlite:///{own}")
    assert [r for r in demo_rows[schema.batch.name] if "'SUCCESS'" in r]
    assert any((tmp_path / "home" / "lease-demo" / "payloads").rglob("*"))


@pytest.mark.parametrize(
    "argv",
    [
        ["lease-demo"],  # --db-url below names the catalog explicitly
        ["demo", "--cities", "2", "--hotels", "50", "--second-hotels", "0"],
    ],
    ids=["lease-demo", "demo"],
)
def test_a_demo_told_to_write_into_a_real_catalog_refuses_in_one_line(
    argv: list[str],
    real_catalog: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
):
    before, before_bytes = rows(real_catalog), file_bytes(real_catalog)
    explicit = run(capsys, "--db-url", real_catalog, *argv)
    line = assert_one_line_error(explicit, code=2)
    assert f"{argv[0]} writes simulated hotels and will not touch " in line
    assert "it holds a catalog no demo filled" in line and explicit.out == ""
    # `demo` on the configured catalog: the same.
    monkeypatch.setenv("SUPPLIER_SYNC_DB_URL", real_catalog)
    if argv[0] == "demo":
        configured = run(capsys, *argv)
        assert "will not touch" in assert_one_line_error(configured, code=2)
    assert file_bytes(real_catalog) == before_bytes
    assert rows(real_catalog) == before
    assert not (tmp_path / "home" / RECORD_NAME).exists()
    assert not (tmp_path / "home" / "lease-demo").exists()


def test_a_demo_claims_an_empty_catalog_and_comes_back_to_it(
    db_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    # An empty database (not even its schema): the demo's, from now on.
    assert not holds_catalog(db_url)
    claim_demo_catalog(db_url, command="demo")
    record = json.loads((tmp_path / "home" / RECORD_NAME).read_text())
    assert record == {"catalogs": [catalog_key(db_url)]}
    demo = run(
        capsys,
        *("--db-url", db_url, "demo", "--cities", "2", "--hotels", "60"),
        "--second-hotels",
        "0",
    )
    assert demo.code == 0, demo.out + demo.err
    assert holds_catalog(db_url)
    # Filled by a demo: a demo may come back to it.
    claim_demo_catalog(db_url, command="demo")
    # Not a password or a driver: the same database is the same catalog.
    assert catalog_key(db_url) == catalog_key(db_url.replace("mysql+pymysql", "mariadb+pymysql"))


def test_a_missing_sqlite_catalog_is_not_created_by_the_check(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'absent' / 'x.db'}"
    assert not holds_catalog(url)
    assert not (tmp_path / "absent").exists()


def test_a_damaged_record_is_one_line(tmp_path: Path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / RECORD_NAME).write_text("{not json")
    with pytest.raises(ConfigError, match="is not a record of demo catalogs"):
        claim_demo_catalog(f"sqlite:///{tmp_path / 'x.db'}", command="demo")
