"""``supplier-sync db migrate|status|init|repair`` as a user calls them, on SQLite and MariaDB."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from supplier_sync_dagster.cli import main as cli
from supplier_sync_dagster.core.store import migrations
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.migrations import HISTORY_TABLE, migration_status
from supplier_sync_dagster_tests.core.store.test_migrations import (
    HEAD,
    NEXT,
    apply_by_hand,
    row_counts,
)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_db_migrate_brings_a_database_at_007_to_head_and_says_what_it_did(
    db_url: str, capsys: pytest.CaptureFixture[str]
):
    apply_by_hand(db_url, 7)
    after_007 = [m.label for m in migrations.load_migrations("mysql")[7:]]
    assert after_007[0] == "008 outbox event key"

    code, out, _ = _run(capsys, "--db-url", db_url, "db", "migrate", "--dry-run")
    assert code == 0, out
    assert "would record" in out and "at version 007" in out
    assert [ln for ln in out.splitlines() if ln.startswith("would apply ")] == [
        f"would apply {label}" for label in after_007
    ]
    last = out.splitlines()[-1]
    assert last.startswith("dry run: nothing changed; ")
    assert last.endswith(f"would be at version {HEAD:03d}")
    db = SyncDatabase.open(db_url, create_schema=False)
    assert HISTORY_TABLE not in row_counts(db) and not migration_status(db).versioned
    db.dispose()

    code, out, _ = _run(capsys, "--db-url", db_url, "db", "status")
    assert code == 1  # not up to date
    assert "structure is that of version 007" in out
    assert any(
        ln.startswith("008  outbox event key") and "pending" in ln for ln in out.splitlines()
    )

    code, out, _ = _run(capsys, "--db-url", db_url, "db", "migrate")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("recorded ") and "at version 007 (baseline" in lines[0]
    assert [ln.split(" (")[0] for ln in lines[1:-1]] == [f"applied {lb}" for lb in after_007]
    assert lines[-1].endswith(f"is at version {HEAD:03d}")

    code, out, _ = _run(capsys, "--db-url", db_url, "db", "status")
    assert code == 0, out
    states = {int(ln[:3]): ln for ln in out.splitlines() if ln[:3].isdigit()}
    assert sorted(states) == list(range(1, HEAD + 1))
    assert all("baseline, recorded" in states[v] for v in range(1, 8))
    assert all(" applied " in states[v] for v in range(8, HEAD + 1))
    assert states[8].startswith("008  outbox event key")
    assert out.splitlines()[-1].endswith(f"version {HEAD:03d} of {HEAD:03d}, up to date")

    code, out, _ = _run(capsys, "--db-url", db_url, "db", "migrate")
    assert code == 0 and out.strip().endswith("nothing to apply")
    code, out, _ = _run(capsys, "--db-url", db_url, "db", "init")
    assert code == 0 and "schema ready in" in out


def test_db_init_creates_an_empty_database_from_001(
    db_url: str, capsys: pytest.CaptureFixture[str]
):
    code, out, _ = _run(capsys, "--db-url", db_url, "db", "init")
    assert code == 0, out
    assert "has none of the sync tables" in out
    assert [ln.split(" (")[0] for ln in out.splitlines() if ln.startswith("applied ")] == [
        f"applied {m.label}" for m in migrations.load_migrations("mysql")
    ]


@pytest.mark.parametrize(
    "url",
    ["postgresql://u@h/db", "not a url", "mysql+pymysql://root:s3cret@127.0.0.1:1/sync"],
    ids=["unsupported", "malformed", "unreachable"],
)
@pytest.mark.parametrize("command", ["migrate", "status"])
def test_db_commands_with_a_bad_url_say_one_line_and_exit_2(
    url: str, command: str, capsys: pytest.CaptureFixture[str]
):
    code, out, err = _run(capsys, "--db-url", url, "db", command)
    assert code == 2
    assert out == ""
    assert err.startswith("supplier-sync: error: ") and err.count("\n") == 1, err
    assert "s3cret" not in err


def test_an_edited_applied_migration_stops_every_command_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    copy = tmp_path / "sql"
    shutil.copytree(migrations.SQL_DIR, copy)
    monkeypatch.setattr(migrations, "SQL_DIR", copy)
    url = f"sqlite:///{tmp_path / 'sync.sqlite3'}"
    assert _run(capsys, "--db-url", url, "db", "migrate")[0] == 0
    path = copy / "sqlite" / "005_quality_gates.sql"
    path.write_text(path.read_text().replace("VARCHAR(1024)", "VARCHAR(4000)"))
    for argv in (("db", "migrate"), ("db", "migrate", "--dry-run"), ("status",)):
        code, _, err = _run(capsys, "--db-url", url, *argv)
        assert code == 2, argv
        assert err.count("\n") == 1, err
        assert "sql/sqlite/005_quality_gates.sql was edited after version 005 was applied" in err
    code, out, _ = _run(capsys, "--db-url", url, "db", "status")  # shows it, does not fail on it
    assert code == 1 and "005  quality gates" in out and "EDITED" in out


def test_db_repair_after_a_half_applied_mysql_migration(
    fresh_mysql_db: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
):
    copy = tmp_path / "sql"
    shutil.copytree(migrations.SQL_DIR, copy)
    monkeypatch.setattr(migrations, "SQL_DIR", copy)
    assert _run(capsys, "--db-url", fresh_mysql_db, "db", "migrate")[0] == 0
    bad = "CREATE TABLE probe (id INT NOT NULL, PRIMARY KEY (id));\nALTER TABLE nope ADD x INT;\n"
    probe = f"{NEXT:03d}_probe.sql"
    for folder in (copy, copy / "sqlite"):
        (folder / probe).write_text(bad)

    code, _, err = _run(capsys, "--db-url", fresh_mysql_db, "db", "migrate")
    assert code == 2 and err.count("\n") == 1 and "statement 2 of 2" in err
    code, out, _ = _run(capsys, "--db-url", fresh_mysql_db, "db", "status")
    assert code == 1 and "NOT FINISHED" in out
    code, _, err = _run(capsys, "--db-url", fresh_mysql_db, "status")  # any command refuses
    assert code == 2 and "did not finish" in err and "db repair" in err

    # The operator corrects the file and completes it by hand, then records it as applied.
    fixed = bad.replace("ALTER TABLE nope", "ALTER TABLE probe")
    for folder in (copy, copy / "sqlite"):
        (folder / probe).write_text(fixed)
    db = SyncDatabase.open(fresh_mysql_db, create_schema=False)
    with db.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE probe ADD x INT")
    db.dispose()
    code, out, _ = _run(capsys, "--db-url", fresh_mysql_db, "db", "repair", "--mark-applied")
    assert code == 0 and out.strip() == f"{NEXT:03d} probe: recorded as applied"
    code, out, _ = _run(capsys, "--db-url", fresh_mysql_db, "db", "status")
    assert code == 0, out
    assert _run(capsys, "--db-url", fresh_mysql_db, "status")[0] == 0
    code, out, _ = _run(capsys, "--db-url", fresh_mysql_db, "db", "repair")
    assert code == 0 and "no unfinished migration" in out
