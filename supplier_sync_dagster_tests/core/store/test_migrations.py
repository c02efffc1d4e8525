"""Versioned migrations: older databases upgrade in place, with their data, once, in order."""

from __future__ import annotations

import shutil
import threading
from collections import Counter
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import (
    ConfigError,
    MigrationChecksumMismatch,
    MigrationError,
    MigrationFailed,
    MigrationLocked,
)
from supplier_sync_dagster.core.records import publish as publish_module
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.engine import WRITE_OPTION, make_engine
from supplier_sync_dagster.core.store.migrations import (
    HISTORY_TABLE,
    LOCK_PREFIX,
    SQL_DIR,
    history,
    load_migrations,
    migrate,
    migrate_on_open,
    migration_status,
    migrations_dir,
    repair,
    split_statements,
    tables_at,
)
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.simulator import FaultProfile
from supplier_sync_dagster_tests.core.conftest import run_concurrently
from supplier_sync_dagster_tests.core.sync.test_city import full_sync, published
from supplier_sync_dagster_tests.helpers import make_simulator, supplier_client

HEAD = load_migrations("mysql")[-1].version
# The number a test's own migration takes in a copy of sql/: the one after the real files.
NEXT = HEAD + 1


def apply_by_hand(url: str, upto: int) -> None:
    """Applies the files 001..``upto`` of the URL's dialect as a DBA would: no history."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            for m in load_migrations(engine.dialect.name)[:upto]:
                for stmt in m.statements:
                    conn.exec_driver_sql(stmt, execution_options={"no_parameters": True})
                conn.commit()
    finally:
        engine.dispose()


# The columns that 010 renamed: (table, name before 010, name since).
_RENAMED_BY_010 = (
    ("supplier_sync_snapshot", "supplier_product_code", "derived_from"),
    ("supplier_sync_dead_letter", "supplier_product_code", "record_position"),
)


# Columns today's sync writes that 014 added (dead letters' city and retry batch, diffs' raw page).
_ADDED_BY_014 = (
    ("supplier_sync_dead_letter", "city_code"),
    ("supplier_sync_dead_letter", "retry_batch_id"),
    ("supplier_sync_diff_log", "raw_payload_hash"),
)

# The dead letters' ticket columns that 017 added (today's sync reads and writes them).
_ADDED_BY_017 = (
    ("subject_key", "VARCHAR(200)"),
    ("open_slot", "SMALLINT"),
    ("seen_count", "INT NOT NULL DEFAULT 1"),
    ("last_seen_at", "DATETIME"),
    ("last_batch_id", "VARCHAR(64)"),
    ("record_version", "BIGINT"),
)


def _rename_010_columns(db: SyncDatabase, *, forward: bool) -> None:
    """Gives a database older than 010 the column names today's code writes, or takes them back:
    the release of that time wrote the same values under the old name. Its outbox gets the
    stage columns today's publish writes (011), and loses them again with its events left as
    that release left them: PENDING. Its hotels get the tombstone columns (012) that today's
    publish writes, and lose them again; so do its dead letters and diffs (014), and its dead
    letters' ticket columns (017)."""
    with db.begin() as conn:
        hotels = "platform_hotel_resource"
        if forward:
            conn.exec_driver_sql(
                f"ALTER TABLE {hotels} ADD COLUMN missing_count INT NOT NULL DEFAULT 0"
            )
            conn.exec_driver_sql(f"ALTER TABLE {hotels} ADD COLUMN missing_since DATETIME")
        else:
            conn.exec_driver_sql(f"ALTER TABLE {hotels} DROP COLUMN missing_since")
            conn.exec_driver_sql(f"ALTER TABLE {hotels} DROP COLUMN missing_count")
        for column, sql_type in _ADDED_BY_017:
            dead_letter = "supplier_sync_dead_letter"
            if forward:
                conn.exec_driver_sql(f"ALTER TABLE {dead_letter} ADD COLUMN {column} {sql_type}")
            else:
                conn.exec_driver_sql(f"ALTER TABLE {dead_letter} DROP COLUMN {column}")
        for table, column in _ADDED_BY_014:
            if forward:
                conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column} VARCHAR(64)")
            else:
                conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN {column}")
        for table, old, new in _RENAMED_BY_010:
            src, dst = (old, new) if forward else (new, old)
            conn.exec_driver_sql(f"ALTER TABLE {table} RENAME COLUMN {src} TO {dst}")
        outbox = "supplier_sync_outbox"
        if forward:
            conn.exec_driver_sql(f"ALTER TABLE {outbox} RENAME COLUMN stage TO next_stage")
            conn.exec_driver_sql(
                f"ALTER TABLE {outbox} ADD COLUMN current_stage VARCHAR(32) NOT NULL "
                "DEFAULT 'PUBLISHED'"
            )
        else:
            conn.exec_driver_sql(f"ALTER TABLE {outbox} DROP COLUMN current_stage")
            conn.exec_driver_sql(f"ALTER TABLE {outbox} RENAME COLUMN next_stage TO stage")
            conn.exec_driver_sql(
                "UPDATE supplier_sync_outbox SET status = 'PENDING', stage = 'SEARCH_INDEX'"
            )


def row_counts(db: SyncDatabase) -> dict[str, int]:
    """Rows of every table but the history."""
    with db.engine.connect() as conn:
        names = sorted(set(sa.inspect(conn).get_table_names()) - {HISTORY_TABLE})
        return {
            name: conn.execute(sa.select(sa.func.count()).select_from(sa.table(name))).scalar_one()
            for name in names
        }


def kept_tables(counts: dict[str, int], dialect: str, since: int) -> dict[str, int]:
    """The row counts of the tables that existed at version ``since``: those the later
    versions created are left out (a migration may add a table, never lose a row)."""
    migrations = load_migrations(dialect)
    added = tables_at(migrations, HEAD) - tables_at(migrations, since)
    return {name: n for name, n in counts.items() if name not in added}


def history_rows(db: SyncDatabase) -> list[dict[str, Any]]:
    with db.engine.connect() as conn:
        rows = conn.execute(sa.select(history).order_by(history.c.version)).all()
    return [dict(r._mapping) for r in rows]


def unique_keys(db: SyncDatabase, table: str) -> set[str]:
    with db.engine.connect() as conn:
        insp = sa.inspect(conn)
        return {str(ix["name"]) for ix in insp.get_indexes(table) if ix.get("unique")} | {
            str(uc["name"]) for uc in insp.get_unique_constraints(table)
        }


@pytest.fixture
def sql_copy(tmp_path: Path) -> Path:
    """A copy of sql/ (both dialects) that a test may edit."""
    copy = tmp_path / "sql"
    shutil.copytree(SQL_DIR, copy)
    return copy


def test_statements_split_at_semicolons_outside_quotes_and_comments():
    text = """-- a comment; with a semicolon
    CREATE TABLE a (x VARCHAR(8) COMMENT 'it''s; here', y INT) COMMENT='t;';  /* b; */
    # hash comment;
    INSERT INTO a VALUES ("x;y", 1);

    """
    assert split_statements(text) == [
        "CREATE TABLE a (x VARCHAR(8) COMMENT 'it''s; here', y INT) COMMENT='t;'",
        'INSERT INTO a VALUES ("x;y", 1)',
    ]
    # SQLite: a backslash is an ordinary character, and # no comment.
    assert split_statements(r"SELECT 'a\'; SELECT 1 # 2;", mysql=False) == [
        r"SELECT 'a\'",
        "SELECT 1 # 2",
    ]
    assert split_statements(r"SELECT 'a\'; b'; SELECT 2;") == [r"SELECT 'a\'; b'", "SELECT 2"]


def test_an_empty_database_gets_every_version_from_001(db_url: str):
    db = SyncDatabase.open(db_url, create_schema=False)
    try:
        result = migrate(db)
        assert result.baseline == 0
        assert [a.version for a in result.applied] == list(range(1, HEAD + 1))
        rows = history_rows(db)
        assert [(r["version"], r["kind"], r["success"]) for r in rows] == [
            (v, "SQL", True) for v in range(1, HEAD + 1)
        ]
        scripts = [m.script for m in load_migrations(db.dialect)]
        assert [r["script"] for r in rows] == scripts
        assert scripts[0] == (
            "sql/sqlite/001_task_batch.sql" if db.dialect == "sqlite" else "sql/001_task_batch.sql"
        )
    finally:
        db.dispose()


def test_a_database_at_007_with_synced_data_migrates_without_losing_a_row_then_syncs(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """As a DBA built it (sql/001-007, no history), synced by the release of that time."""
    apply_by_hand(db_url, 7)
    sim = make_simulator(
        FaultProfile.clean().with_(bad_record_rate=0.05), seed=5, n_cities=4, total_hotels=300
    )
    store = LocalPayloadStore(tmp_path / "payloads")
    old = SyncDatabase.open(db_url, create_schema=False)  # the 007 release did not migrate
    with sim.client() as http:
        client = supplier_client(http)
        _rename_010_columns(old, forward=True)
        with monkeypatch.context() as patched:
            # That release kept no publish history (sql/019).
            patched.setattr(publish_module, "record_versions", lambda *_, **__: None)
            _, reports = full_sync(old, store, client, "before-upgrade")
        _rename_010_columns(old, forward=False)
        assert all(r.status == "SUCCESS" for r in reports)
        before = row_counts(old)
        with old.engine.connect() as conn:
            outbox_before = conn.execute(
                sa.select(schema.outbox.c.id, schema.outbox.c.event_id).order_by(schema.outbox.c.id)
            ).all()
        assert "uk_event_id" in unique_keys(old, "supplier_sync_outbox")
        # Real data in the tables that matter: published hotels, offers, events, dead letters.
        for table in (
            "platform_hotel_resource",
            "platform_hotel_offer",
            "supplier_sync_outbox",
            "supplier_sync_dead_letter",
            "supplier_sync_snapshot",
            "supplier_sync_diff_log",
        ):
            assert before[table] > 0, table

        result = migrate(old)
        assert result.baseline == 7
        # 008 first, then whatever came after it, in order.
        assert result.applied[0].label == "008 outbox event key"
        assert [a.version for a in result.applied] == list(range(8, HEAD + 1))
        assert kept_tables(row_counts(old), old.dialect, 7) == before
        with old.engine.connect() as conn:
            outbox_after = conn.execute(
                sa.select(schema.outbox.c.id, schema.outbox.c.event_id).order_by(schema.outbox.c.id)
            ).all()
        assert outbox_after == outbox_before
        with old.engine.connect() as conn:
            stages = set(
                conn.execute(
                    sa.select(
                        schema.outbox.c.event_type,
                        schema.outbox.c.status,
                        schema.outbox.c.current_stage,
                        schema.outbox.c.next_stage,
                    ).distinct()
                ).all()
            )
        # 011: the PENDING events are READY for the first stage of their type's chain.
        assert stages == {
            ("HotelResourceUpdated", "READY", "PUBLISHED", "SEARCH_INDEX"),
            ("HotelContentChanged", "READY", "PUBLISHED", "NOTIFY"),
            ("HotelMappingCreated", "READY", "PUBLISHED", "NOTIFY"),
        }
        keys = unique_keys(old, "supplier_sync_outbox")
        assert "uk_outbox_event" in keys and "uk_event_id" not in keys
        assert [(r["version"], r["kind"], r["success"]) for r in history_rows(old)] == [
            *((v, "BASELINE", True) for v in range(1, 8)),
            *((v, "SQL", True) for v in range(8, HEAD + 1)),
        ]
        old.dispose()

        db = SyncDatabase.open(db_url)  # up to date: opens without migrating
        try:
            sim.advance_day()
            batch_id, reports = full_sync(db, store, client, "after-upgrade")
            assert all(r.status == "SUCCESS" for r in reports), [
                (r.city_code, r.status, r.error) for r in reports
            ]
            now = published(db)
            truth = sim.ground_truth()
            assert {h: now.get(h) for h in truth.valid} == truth.valid  # day 1 is published
            with db.engine.connect() as conn:
                republished = conn.execute(
                    sa.select(sa.func.count()).where(schema.platform_hotel.c.publish_version > 1)
                ).scalar_one()
            assert republished > 0  # hotels published before the upgrade changed after it
            with db.engine.connect() as conn:
                recorded = conn.execute(
                    sa.select(sa.func.count()).select_from(schema.hotel_version)
                ).scalar_one()
            # The history starts at the upgrade: one row per version published (or
            # unpublished) since.
            assert recorded == sum(
                r.published + len(r.presence.unpublished if r.presence else ()) for r in reports
            )
            assert recorded > 0
            after = row_counts(db)
            assert after["supplier_sync_outbox"] > before["supplier_sync_outbox"]
            assert after["supplier_sync_batch"] == before["supplier_sync_batch"] + 1
        finally:
            db.dispose()


def _offer(offer_id: int | None, resource_id: int, room: str) -> dict[str, Any]:
    row: dict[str, Any] = {
        "resource_id": resource_id,
        "room_code": room,
        "rate_plan_code": "BAR",
        "room_name": f"room {room}",
        "bed_type": "KING",
        "max_occupancy": 2,
        "board": None,
        "refundable": True,
        "available": True,
        "price_amount": Decimal("123.4500"),
        "currency": "THB",
        "supplier_version": 3,
        "publish_version": 1,
        "active": True,
        "updated_at": datetime(2026, 11, 1, 2, 3, 4),
    }
    if offer_id is not None:
        row["offer_id"] = offer_id
    return row


def test_a_database_at_006_keeps_every_offer_id_through_007_and_later(db_url: str):
    """007 rebuilds the offer table on SQLite and alters it on MySQL: ids and rows survive."""
    apply_by_hand(db_url, 6)
    db = SyncDatabase.open(db_url, create_schema=False)
    try:
        offers = [_offer(100 + 7 * i, 1 + i // 2, f"R{i % 2}") for i in range(6)]
        offer_mapping = sa.table(
            "supplier_sync_offer_mapping",
            *(
                sa.column(c)
                for c in (
                    "supplier_id",
                    "supplier_hotel_id",
                    "room_code",
                    "rate_plan_code",
                    "platform_resource_id",
                    "created_batch_id",
                    "created_at",
                )
            ),
        )
        now = datetime(2026, 11, 1)
        event = {
            "event_type": "HotelResourceUpdated",
            "aggregate_type": "HOTEL",
            "aggregate_version": 1,
            "batch_id": "b1",
            "payload": "{}",
            "created_at": now,
        }
        with db.begin() as conn:
            conn.execute(sa.insert(schema.platform_offer), offers)
            conn.execute(
                sa.insert(offer_mapping),
                [
                    {
                        "supplier_id": 1,
                        "supplier_hotel_id": f"H{o['resource_id']}",
                        "room_code": o["room_code"],
                        "rate_plan_code": "BAR",
                        "platform_resource_id": o["resource_id"],
                        "created_batch_id": "b1",
                        "created_at": now,
                    }
                    for o in offers
                ],
            )
            conn.execute(
                sa.insert(schema.outbox),
                [{**event, "event_id": f"e{i}", "aggregate_id": i} for i in range(1, 4)],
            )
        before = row_counts(db)
        assert before["supplier_sync_offer_mapping"] == 6

        result = migrate(db)
        assert result.baseline == 6
        assert [a.version for a in result.applied] == list(range(7, HEAD + 1))
        after = row_counts(db)
        assert "supplier_sync_offer_mapping" not in after  # dropped by 007, as on MySQL
        del before["supplier_sync_offer_mapping"]
        assert kept_tables(after, db.dialect, 6) == before
        with db.engine.connect() as conn:
            kept = [
                dict(r._mapping)
                for r in conn.execute(sa.select(schema.platform_offer).order_by("offer_id"))
            ]
        assert kept == offers
        assert "uk_offer_identity" in unique_keys(db, "platform_hotel_offer")
        with db.begin() as conn:
            new_id = conn.execute(
                sa.insert(schema.platform_offer), _offer(None, 99, "R0")
            ).inserted_primary_key
            assert new_id is not None and new_id[0] == 136  # after the largest (135)
        with pytest.raises(sa.exc.IntegrityError), db.begin() as conn:
            conn.execute(sa.insert(schema.platform_offer), _offer(None, 1, "R0"))  # same identity
    finally:
        db.dispose()


def test_a_database_at_009_keeps_its_snapshot_and_dead_letter_traces_through_010(db_url: str):
    """010 renames supplier_product_code (derived_from, record_position): values survive."""
    apply_by_hand(db_url, 9)
    db = SyncDatabase.open(db_url, create_schema=False)
    try:
        now = datetime(2026, 11, 1)
        common = {"batch_id": "b1", "supplier_id": 1, "category_code": "HOTEL", "created_at": now}
        snapshots = [
            {**common, "snapshot_id": f"s{i}", "supplier_product_code": code}
            | {"snapshot_type": "NORMALIZED", "snapshot_version": 1, "payload_hash": f"h{i}"}
            for i, code in enumerate(("a" * 64, "replay-of:b0", None))
        ]
        letters = [
            {**common, "dead_letter_id": f"d{i}", "supplier_product_code": code}
            | {"task_code": "t", "sync_mode": "FULL", "error_stage": "VALIDATION"}
            | {"error_type": "NON_RETRYABLE", "error_code": "E", "error_message": "m"}
            | {"supplier_resource_code": "H1", "raw_payload_hash": "r", "updated_at": now}
            for i, code in enumerate(("record#0", "record#7", "-"))
        ]
        old = {
            name: sa.table(name, *(sa.column(c) for c in rows[0]))
            for name, rows in (
                ("supplier_sync_snapshot", snapshots),
                ("supplier_sync_dead_letter", letters),
            )
        }
        with db.begin() as conn:
            conn.execute(sa.insert(old["supplier_sync_snapshot"]), snapshots)
            conn.execute(sa.insert(old["supplier_sync_dead_letter"]), letters)

        result = migrate(db)
        assert result.baseline == 9
        assert [a.version for a in result.applied] == list(range(10, HEAD + 1))
        with db.engine.connect() as conn:
            s, d = schema.snapshot.c, schema.dead_letter.c
            derived = conn.execute(sa.select(s.derived_from).order_by(s.snapshot_id)).scalars()
            positions = conn.execute(
                sa.select(d.record_position).order_by(d.dead_letter_id)
            ).scalars()
            assert list(derived) == ["a" * 64, "replay-of:b0", None]
            assert list(positions) == ["record#0", "record#7", "-"]
        # The dedup key now names the position: the same record again is refused.
        with pytest.raises(sa.exc.IntegrityError), db.begin() as conn:
            row = {k: v for k, v in letters[0].items() if k != "supplier_product_code"}
            conn.execute(
                sa.insert(schema.dead_letter),
                {**row, "dead_letter_id": "d9", "record_position": "record#0"},
            )
    finally:
        db.dispose()


def test_a_database_made_by_create_all_is_recorded_at_head_and_left_as_it_is(db_url: str):
    """The embedded default and tests made databases with metadata.create_all until now."""
    db = SyncDatabase.open(db_url, create_schema=False)
    try:
        with db.begin() as conn:
            schema.metadata.create_all(conn)
        result = migrate_on_open(db)
        assert result is not None
        # The newest version's mark is known (core/migrations._MARKERS): nothing re-applied.
        assert result.baseline == HEAD and result.applied == ()
        assert [(r["version"], r["kind"]) for r in history_rows(db)] == [
            (v, "BASELINE") for v in range(1, HEAD + 1)
        ]
        assert migration_status(db).up_to_date
    finally:
        db.dispose()


@pytest.mark.parametrize("version", range(1, HEAD + 1), ids=lambda v: f"{v:03d}")
def test_a_database_applied_by_hand_is_recorded_at_its_version(db_url: str, version: int):
    """Every version bears a mark (core/migrations._MARKERS) that no earlier one has."""
    apply_by_hand(db_url, version)
    db = SyncDatabase.open(db_url, create_schema=False)
    try:
        assert migration_status(db).baseline == version
        result = migrate(db)
        assert result.baseline == version
        assert [a.version for a in result.applied] == list(range(version + 1, HEAD + 1))
        assert migration_status(db).up_to_date
    finally:
        db.dispose()


def test_an_unversioned_database_that_matches_no_version_is_refused(db_url: str):
    apply_by_hand(db_url, 7)
    db = SyncDatabase.open(db_url, create_schema=False)
    try:
        with db.begin() as conn:
            conn.exec_driver_sql("DROP TABLE supplier_sync_shard")
        with pytest.raises(MigrationError, match="lacks its table.*supplier_sync_shard"):
            migrate(db)
    finally:
        db.dispose()


def test_an_applied_file_that_was_edited_is_refused(db_url: str, sql_copy: Path):
    db = SyncDatabase.open(db_url, create_schema=False)
    try:
        migrate(db, sql_dir=sql_copy)
        path = migrations_dir(db.dialect, sql_copy) / "002_shard.sql"
        # Comments and layout are not the migration: they may change.
        path.write_text("-- reviewed\n" + path.read_text().replace("    ", "  "))
        assert migrate_on_open(db, sql_dir=sql_copy) is None
        path.write_text(path.read_text().replace("VARCHAR(1024)", "VARCHAR(2048)", 1))
        for call in (
            lambda: migrate_on_open(db, sql_dir=sql_copy),
            lambda: migrate(db, sql_dir=sql_copy),
            lambda: migrate(db, sql_dir=sql_copy, dry_run=True),
        ):
            with pytest.raises(MigrationChecksumMismatch, match=r"002_shard\.sql was edited"):
                call()
        assert migration_status(db, sql_dir=sql_copy).edited[0].version == 2
    finally:
        db.dispose()


def test_migrating_again_changes_nothing_and_open_reads_only_the_history(db_url: str):
    db = SyncDatabase.open(db_url)
    try:
        rows = history_rows(db)
        result = migrate(db)
        assert result.baseline is None and result.applied == ()
        assert history_rows(db) == rows
    finally:
        db.dispose()

    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    sa.event.listen(sa.Engine, "before_cursor_execute", record)
    try:
        SyncDatabase.open(db_url).dispose()
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", record)
    queries = [s for s in statements if s.strip().upper() not in ("BEGIN", "SELECT 1")]
    assert len(queries) == 1 and HISTORY_TABLE in queries[0], statements


def test_concurrent_migrations_apply_each_version_once(db_url: str):
    db_dialect = make_engine(db_url).dialect.name
    expected = Counter(s for m in load_migrations(db_dialect) for s in m.statements)
    ran: list[str] = []
    lock = threading.Lock()

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement in expected:
            with lock:
                ran.append(statement)

    def one(_: int) -> int:
        db = SyncDatabase.open(db_url, create_schema=False)
        try:
            return len(migrate(db).applied)
        finally:
            db.dispose()

    sa.event.listen(sa.Engine, "before_cursor_execute", record)
    try:
        results, errors = run_concurrently(4, one)
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", record)
    assert not errors, errors
    assert sorted(results) == [0, 0, 0, HEAD]
    assert Counter(ran) == expected  # every statement of every file, exactly once
    db = SyncDatabase.open(db_url, create_schema=False)
    assert [r["version"] for r in history_rows(db)] == list(range(1, HEAD + 1))
    db.dispose()


def test_a_migration_that_cannot_get_the_lock_gives_up_with_a_clear_error(db_url: str):
    db = SyncDatabase.open(db_url, create_schema=False)
    holder = make_engine(db_url)
    try:
        with holder.connect() as conn:
            if db.dialect == "sqlite":
                conn = conn.execution_options(**{WRITE_OPTION: True})
                conn.begin()  # BEGIN IMMEDIATE: the write lock
            else:
                name = sa.func.concat(LOCK_PREFIX, sa.func.database())
                assert conn.execute(sa.select(sa.func.get_lock(name, 0))).scalar() == 1
            with pytest.raises(MigrationLocked, match="another process held"):
                migrate(db, lock_timeout=0)
            if db.dialect != "sqlite":  # a pooled connection would keep holding it
                conn.execute(sa.select(sa.func.release_lock(name)))
        assert not migration_status(db).versioned  # nothing was written
        assert len(migrate(db).applied) == HEAD  # the lock is free again
    finally:
        holder.dispose()
        db.dispose()


def _add_version(sql_copy: Path, name: str, text: str) -> None:
    for folder in (sql_copy, sql_copy / "sqlite"):
        (folder / name).write_text(text)


PROBE_FAILS_AT_2 = """
CREATE TABLE migration_probe (id INT NOT NULL, PRIMARY KEY (id));
ALTER TABLE no_such_table ADD COLUMN x INT;
"""


def test_a_failed_migration_on_sqlite_changes_nothing(tmp_path: Path, sql_copy: Path):
    db = SyncDatabase.open(f"sqlite:///{tmp_path / 'sync.sqlite3'}", create_schema=False)
    try:
        migrate(db, sql_dir=sql_copy)
        _add_version(sql_copy, f"{NEXT:03d}_probe.sql", PROBE_FAILS_AT_2)
        with pytest.raises(MigrationError, match="statement 2 of 2.*nothing was changed"):
            migrate_on_open(db, sql_dir=sql_copy)
        assert "migration_probe" not in row_counts(db)
        assert [r["version"] for r in history_rows(db)] == list(range(1, HEAD + 1))
    finally:
        db.dispose()


def test_a_half_applied_mysql_migration_is_refused_until_repaired(
    fresh_mysql_db: str, sql_copy: Path
):
    db = SyncDatabase.open(fresh_mysql_db, create_schema=False)
    try:
        migrate(db, sql_dir=sql_copy)
        _add_version(sql_copy, f"{NEXT:03d}_probe.sql", PROBE_FAILS_AT_2)
        with pytest.raises(MigrationFailed, match="statement 2 of 2.*db repair"):
            migrate(db, sql_dir=sql_copy)
        assert "migration_probe" in row_counts(db)  # MySQL committed statement 1
        assert history_rows(db)[-1]["version"] == NEXT and not history_rows(db)[-1]["success"]
        # Every later open says so, and what to do, until an operator repairs it.
        with pytest.raises(
            MigrationFailed, match=rf"{NEXT:03d} \(sql/{NEXT:03d}_probe.sql\) did not finish"
        ):
            migrate_on_open(db, sql_dir=sql_copy)
        assert migration_status(db, sql_dir=sql_copy).failed[0].version == NEXT

        # Undo by hand, correct the file, forget the attempt, migrate.
        with db.begin() as conn:
            conn.exec_driver_sql("DROP TABLE migration_probe")
        _add_version(
            sql_copy,
            f"{NEXT:03d}_probe.sql",
            PROBE_FAILS_AT_2.replace("no_such_table", "migration_probe"),
        )
        assert [r.version for r in repair(db)] == [NEXT]
        assert [a.version for a in migrate(db, sql_dir=sql_copy).applied] == [NEXT]

        # Or complete it by hand and record it as applied.
        _add_version(
            sql_copy,
            f"{NEXT + 1:03d}_probe.sql",
            PROBE_FAILS_AT_2.replace("migration_probe", "probe_two"),
        )
        with pytest.raises(MigrationFailed):
            migrate(db, sql_dir=sql_copy)
        with db.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE probe_two ADD COLUMN x INT")
        assert [r.version for r in repair(db, mark_applied=True)] == [NEXT + 1]
        assert migration_status(db, sql_dir=sql_copy).up_to_date

        # A file that fails at its first statement changed nothing: it can simply be fixed.
        third = f"{NEXT + 2:03d}_probe.sql"
        _add_version(sql_copy, third, "ALTER TABLE no_such_table ADD COLUMN y INT;")
        with pytest.raises(MigrationError, match="first statement, nothing was changed"):
            migrate(db, sql_dir=sql_copy)
        assert history_rows(db)[-1]["version"] == NEXT + 1
        _add_version(sql_copy, third, "ALTER TABLE probe_two ADD COLUMN y INT;")
        assert [a.version for a in migrate(db, sql_dir=sql_copy).applied] == [NEXT + 2]
    finally:
        db.dispose()


def test_files_must_exist_for_both_dialects_and_run_without_gaps(sql_copy: Path):
    _add_version(sql_copy, f"{NEXT:03d}_a.sql", "SELECT 1;")
    (sql_copy / "sqlite" / f"{NEXT:03d}_a.sql").unlink()
    with pytest.raises(MigrationError, match=f"{NEXT:03d} are in only one of them"):
        load_migrations("mysql", sql_copy)
    _add_version(sql_copy, f"{NEXT + 1:03d}_b.sql", "SELECT 1;")
    with pytest.raises(MigrationError, match="without gaps"):
        load_migrations("mysql", sql_copy)


def test_a_missing_migration_folder_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="migration files are missing"):
        load_migrations("sqlite", tmp_path / "nowhere")
