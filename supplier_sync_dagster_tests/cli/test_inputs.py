"""Every command checks its input before work starts (issue 40, item 9): a bad option is
refused as the command line is read (argparse's exit 2, its error line naming the option and
the allowed range), a read-only command never creates a missing SQLite database, a bad
``--db-url`` blames the option (one line, exit 2), an unknown ``--task``/``--field`` is named, and a bad
suppliers file is one line; nothing is created and no Dagster run starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from supplier_sync_dagster.cli import main as cli
from supplier_sync_dagster.cli.common import float_within, int_within
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.leasing.batches import TaskSpec
from supplier_sync_dagster.core.repair.trace import TRACE_FIELDS, trace_hotel
from supplier_sync_dagster.core.settings import MAX_PAGE_SIZE
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import open_payload_store
from supplier_sync_dagster.core.sync.tasks import ensure_task
from supplier_sync_dagster_tests.cli.test_main import (
    assert_one_line_error,
    cli_home,  # noqa: F401 (autouse: state under the test's folder)
    run,
)

TASK = "hotel_supplier_full_resource"


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``supplier-sync ARGV`` stopped as its command line is read: exit 2, and the one error
    line argparse prints after the usage. Returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
    return errors[0]


def nothing_created(home: Path) -> None:
    """No state folder, and the Dagster home as the fixture made it: no run, no storage."""
    assert not (home / "home").exists()
    assert sorted(p.name for p in (home / "dagster_home").iterdir()) == ["dagster.yaml"]


@pytest.fixture
def task_db(db_url: str) -> str:
    """A sync database holding the full-sync task, as its first run leaves it."""
    db = SyncDatabase.open(db_url)
    ensure_task(db, TaskSpec(task_code=TASK, supplier_id=1001), created_by="t", reason="test")
    db.dispose()
    return db_url


# --- numbers out of range: refused at parse time -------------------------------------------


@pytest.mark.parametrize("size", ["0", "9999", "-1", "501", "ten"])
def test_sync_full_page_size_outside_the_contract_is_refused_before_any_work(
    size: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    line = refused(capsys, "sync", "--full", "--page-size", size)
    assert "argument --page-size: must be " in line
    if size != "ten":
        assert f"must be within 1..{MAX_PAGE_SIZE}, not {int(size)}" in line
    nothing_created(tmp_path)


def test_the_contracts_page_sizes_are_accepted():
    parser = cli.build_parser()
    assert parser.parse_args(["sync", "--full", "--page-size", "1"]).page_size == 1
    assert parser.parse_args(["sync", "--full", "--page-size", "500"]).page_size == 500


@pytest.mark.parametrize("overlap", ["-5", "nan", "inf", "604801"])
def test_a_negative_or_endless_overlap_starts_no_run(
    overlap: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    line = refused(capsys, "sync", "--incremental", "--overlap-seconds", overlap)
    assert "argument --overlap-seconds: must be within 0..604800, not " in line
    assert "dagster" not in line.lower()  # no class path: the run never started
    nothing_created(tmp_path)


@pytest.mark.parametrize(
    ("argv", "option", "expected"),
    [
        (["sync", "--incremental", "--changes-limit", "1001"], "--changes-limit", "1..1000"),
        (["sync", "--incremental", "--changes-limit", "0"], "--changes-limit", "1..1000"),
        (["sync", "--full", "--rate-limit", "0"], "--rate-limit", "more than 0"),
        (["sync", "--full", "--rate-limit", "-3"], "--rate-limit", "more than 0"),
        (["demo", "--rate-limit", "0"], "--rate-limit", "more than 0"),
        (["demo", "--cities", "0"], "--cities", "within 1.."),
        (["demo", "--hotels", "-1"], "--hotels", "within 0.."),
        (["demo", "--second-hotels", "-1"], "--second-hotels", "within 0.."),
        (["lease-demo", "--lease-seconds", "1"], "--lease-seconds", "within 5..1800"),
        (["reconcile", "--absolute", "-1"], "--absolute", "within 0.."),
        (["reconcile", "--relative", "2"], "--relative", "within 0..1"),
        (["reconcile", "--max-lag-hours", "-1"], "--max-lag-hours", "within 0.."),
        (["status", "--limit", "0"], "--limit", "within 1.."),
        (["stalls", "--checkpoint-stall-seconds", "0"], "--checkpoint-stall-seconds", "more"),
        (["stalls", "--fetch-stall-seconds", "-1"], "--fetch-stall-seconds", "more than 0"),
        (["simulate", "--port", "70000"], "--port", "within 0..65535"),
        (["simulate", "--cities", "0"], "--cities", "within 1.."),
        (["simulate", "--day", "-1"], "--day", "within 0.."),
        (["simulate", "--rate-limit", "0"], "--rate-limit", "more than 0"),
        (["daemon", "--backfill-interval", "0"], "--backfill-interval", "more than 0"),
        (["dispatch", "--batch-size", "0"], "--batch-size", "within 1.."),
        (["dispatch", "--once", "--max-seconds", "-1"], "--max-seconds", "more than 0"),
        (["search", "x", "--stars", "6"], "--stars", "within 0..5"),
        (["search", "x", "--limit", "0"], "--limit", "within 1.."),
        (["serve-api", "--port", "-1"], "--port", "within 0..65535"),
        (["serve-api", "--ttl", "-1"], "--ttl", "within 0.."),
        (["serve-api", "--confirm-timeout", "0"], "--confirm-timeout", "more than 0"),
        (["outbox", "list", "--limit", "0"], "--limit", "within 1.."),
        (["metrics", "serve", "--interval", "0"], "--interval", "more than 0"),
        (["metrics", "serve", "--port", "99999"], "--port", "within 0..65535"),
        (["alerts", "list", "--days", "0"], "--days", "more than 0"),
        (["review", "list", "--limit", "-1"], "--limit", "within 1.."),
        (["task", "show", "--history", "-1"], "--history", "within 0.."),
        (["trace", "H1", "--supplier-id", "0"], "--supplier-id", "within 1.."),
        (["audit", "--limit", "0"], "--limit", "within 1.."),
        (["dead-letters", "list", "--limit", "0"], "--limit", "within 1.."),
        (["dead-letters", "list", "--older-than-hours", "-2"], "--older-than-hours", "within 0.."),
        (["dead-letters", "compensate", "--limit", "0"], "--limit", "within 1.."),
    ],
)
def test_every_numeric_option_names_its_range(
    argv: list[str],
    option: str,
    expected: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
):
    line = refused(capsys, *argv)
    assert f"argument {option}: must be " in line and expected in line, line
    nothing_created(tmp_path)


def test_the_range_types_name_their_range_and_refuse_what_is_not_a_number():
    within = int_within(1, 500)
    assert within("1") == 1 and within("500") == 500
    for bad, why in (("0", "within 1..500, not 0"), ("x", "a whole number, not 'x'")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            within(bad)
    rate = float_within(0, None, low_open=True)
    assert rate("0.5") == 0.5
    for bad in ("0", "-1", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            rate(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="at most 3"):
        float_within(None, 3)("4")


# --- the sync database: a read-only command creates nothing; a bad URL blames its giver ---

_READERS = [
    ["status"],
    ["stalls"],
    ["export", "published"],
    ["metrics", "show"],
    ["alerts", "list"],
    ["trace", "H1"],
    ["audit"],
    ["dead-letters", "list"],
    ["dead-letters", "show", "1"],
    ["review", "list"],
    ["gate", "show", "--batch", "b", "--city", "X"],
    ["task", "show"],
    ["outbox", "status"],
    ["outbox", "list"],
    ["db", "status"],
]


@pytest.mark.parametrize("argv", _READERS, ids=" ".join)
def test_a_read_only_command_refuses_a_missing_sqlite_file_and_creates_nothing(
    argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    absent = tmp_path / "nonexistent" / "dir" / "x.db"
    for where in (
        ["--db-url", f"sqlite:///{absent}", *argv],  # the option before the command
        [*argv, "--db-url", f"sqlite:///{absent}"],  # ... or after it
    ):
        line = assert_one_line_error(run(capsys, *where), code=2)
        assert f"no sync database at {absent}: {argv[0]} only reads one" in line
    assert not (tmp_path / "nonexistent").exists()
    # Nor the default file of the state folder.
    line = assert_one_line_error(run(capsys, *argv), code=2)
    assert f"no sync database at {tmp_path / 'home' / 'sync.sqlite3'}" in line
    nothing_created(tmp_path)


def test_a_read_only_command_reads_an_existing_database(
    task_db: str, capsys: pytest.CaptureFixture[str]
):
    done = run(capsys, "--db-url", task_db, "status")
    assert done.code == 0 and done.out == "no batches\n"
    done = run(capsys, "status", "--db-url", task_db)  # after the command too
    assert done.code == 0 and done.out == "no batches\n"


@pytest.mark.parametrize("url", ["bogus://", "postgresql://x@y/z", "not a url"])
def test_a_bad_db_url_option_blames_the_option(
    url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    for argv in (
        ["--db-url", url, "status"],
        ["status", "--db-url", url],  # after the command too
        ["--db-url", url, "sync", "--full"],
        ["accounts", "apply", "--db-url", url, "--by", "a", "--reason", "b"],
    ):
        line = assert_one_line_error(run(capsys, *argv), code=2)
        assert line.startswith("supplier-sync: error: --db-url ") and "SUPPLIER_SYNC" not in line
    # --help still answers, whatever the URL.
    with pytest.raises(SystemExit) as helped:
        cli.main(["--db-url", url, "--help"])
    assert helped.value.code == 0
    nothing_created(tmp_path)


def test_a_bad_db_url_setting_blames_the_setting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("SUPPLIER_SYNC_DB_URL", "bogus://")
    line = assert_one_line_error(run(capsys, "status"), code=2)
    assert line.startswith("supplier-sync: error: SUPPLIER_SYNC_DB_URL uses backend 'bogus'")
    nothing_created(tmp_path)


# --- names the command cannot know: an unknown task, a field no diff records ------------


def test_metrics_show_of_an_unknown_task_is_an_error_not_healthy_figures(
    task_db: str, capsys: pytest.CaptureFixture[str]
):
    unknown = run(capsys, "--db-url", task_db, "metrics", "show", "--task", "nosuch")
    assert unknown.out == ""
    assert "unknown task 'nosuch'" in assert_one_line_error(unknown, code=2)
    # One unknown among known ones is still an error, before any figure is printed.
    mixed = run(capsys, "--db-url", task_db, "metrics", "show", "--task", TASK, "--task", "nope")
    assert mixed.out == "" and "unknown task 'nope'" in assert_one_line_error(mixed, code=2)
    known = run(capsys, "--db-url", task_db, "metrics", "show", "--task", TASK)
    assert known.code == 0 and known.lines[0].startswith(f"task {TASK} at ")


def test_trace_of_a_field_no_diff_records_lists_the_valid_fields(
    task_db: str, capsys: pytest.CaptureFixture[str]
):
    bogus = run(capsys, "--db-url", task_db, "trace", "H0001", "--field", "bogus")
    line = assert_one_line_error(bogus, code=2)
    assert "--field 'bogus' is not a field a diff records; one of: " in line
    assert all(name in line for name in ("price_amount", "name", "status", "star_rating"))
    # A valid field goes on to the hotel (which this database never saw).
    valid = run(capsys, "--db-url", task_db, "trace", "H0001", "--field", "price_amount")
    assert "hotel 'H0001' was never synced" in assert_one_line_error(valid, code=2)
    # The core refuses it too, for a caller that is not the command line.
    db = SyncDatabase.open(task_db)
    try:
        with pytest.raises(ConfigError, match="one of: "):
            trace_hotel(
                db, open_payload_store(), supplier_id=1001, supplier_hotel_id="H", field="x"
            )
    finally:
        db.dispose()
    assert {"price", "available", "version", "refundable"} <= set(TRACE_FIELDS)


# --- a bad suppliers file: one line naming the field, from list and check alike ------------


def test_accounts_check_on_a_bad_suppliers_file_is_the_one_line_accounts_list_gives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    bad = tmp_path / "suppliers.yaml"
    bad.write_text(
        "suppliers:\n  acme:\n    supplier_id: -3\n    accounts:\n      main: {}\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIERS_FILE", str(bad))
    listed = assert_one_line_error(run(capsys, "accounts", "list"), code=2)
    checked = run(capsys, "accounts", "check")
    assert "ComponentTreeException" not in checked.err
    assert assert_one_line_error(checked, code=2) == listed
    assert "suppliers.acme.supplier_id" in listed
