"""``supplier-sync task show|set`` as an operator types it, on SQLite and MariaDB."""

from __future__ import annotations

import json
import os
import pwd
import socket

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.cli import main as cli
from supplier_sync_dagster.core.leasing.batches import TaskSpec
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.tasks import ensure_task

TASK = "hotel_supplier_full_resource"


@pytest.fixture
def task_db(db_url: str) -> str:
    """A sync database whose task exists, created as a first run creates it."""
    db = SyncDatabase.open(db_url)
    ensure_task(
        db,
        TaskSpec(task_code=TASK, supplier_id=1001),
        created_by="run night-1",
        reason="created by its first run, with the default settings",
    )
    db.dispose()
    return db_url


def _show(url: str, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert cli.main(["--db-url", url, "task", "show", "--task", TASK, "--json"]) == 0
    shown: dict[str, object] = json.loads(capsys.readouterr().out)
    return shown


def _audit_rows(url: str) -> list[tuple[str, str | None, str | None, str, str]]:
    db = SyncDatabase.open(url)
    a = schema.task_audit.c
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(a.field_name, a.old_value, a.new_value, a.changed_by, a.reason).order_by(a.id)
        ).all()
    db.dispose()
    return [tuple(r) for r in rows]


def _one_line_error(capsys: pytest.CaptureFixture[str], *expected: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith("supplier-sync: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for text in expected:
        assert text in err, err


def test_task_show_prints_settings_thresholds_and_the_creation(
    task_db: str, capsys: pytest.CaptureFixture[str]
):
    assert cli.main(["--db-url", task_db, "task", "show"]) == 0
    out = capsys.readouterr().out
    assert f"task {TASK}: ENABLED, policy SKIP_IF_RUNNING, schedule MANUAL" in out
    assert '"max_bad_ratio": 0.2' in out
    # Who was declared, then who the process proves it is (the one that created the task).
    proven = f"[{pwd.getpwuid(os.geteuid()).pw_name}@{socket.gethostname()} pid {os.getpid()}]"
    assert f"run night-1 {proven}  task: None -> " in out
    shown = _show(task_db, capsys)
    assert shown["task"] == {
        "task_code": TASK,
        "supplier_id": 1001,
        "category_code": "HOTEL",
        "sync_mode": "FULL",
        "data_scope": "RESOURCE",
        "schedule_type": "MANUAL",
        "cron_expr": None,
        "status": "ENABLED",
        "concurrency_policy": "SKIP_IF_RUNNING",
        "owner_team": None,
    }
    assert [a["field_name"] for a in shown["audit"]] == ["task"]  # type: ignore[attr-defined]


def test_task_set_changes_each_setting_once_and_audits_it(
    task_db: str, capsys: pytest.CaptureFixture[str]
):
    args = [
        "--db-url",
        task_db,
        "task",
        "set",
        "--task",
        TASK,
        "--policy",
        "CANCEL_PREVIOUS",
        "--status",
        "DISABLED",
        "--cron",
        "0 3 * * *",
        "--max-bad-ratio",
        "0.05",
        "--min-previous-records",
        "50",
        "--by",
        "alice",
        "--reason",
        "supplier migrating, INC-42",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "concurrency_policy: SKIP_IF_RUNNING -> CANCEL_PREVIOUS" in out
    assert "status: ENABLED -> DISABLED" in out and "gate.max_bad_ratio: 0.2 -> 0.05" in out
    shown = _show(task_db, capsys)
    task = shown["task"]
    assert isinstance(task, dict)
    assert (task["concurrency_policy"], task["status"]) == ("CANCEL_PREVIOUS", "DISABLED")
    assert (task["schedule_type"], task["cron_expr"]) == ("CRON", "0 3 * * *")
    thresholds = shown["gate_thresholds"]
    assert isinstance(thresholds, dict)
    assert thresholds["max_bad_ratio"] == 0.05 and thresholds["min_previous_records"] == 50
    assert thresholds["max_count_drop"] == 0.5  # not given: kept
    why = ("alice", "supplier migrating, INC-42")
    assert _audit_rows(task_db)[1:] == [
        ("concurrency_policy", "SKIP_IF_RUNNING", "CANCEL_PREVIOUS", *why),
        ("status", "ENABLED", "DISABLED", *why),
        ("cron_expr", None, "0 3 * * *", *why),
        ("schedule_type", "MANUAL", "CRON", *why),
        ("gate.max_bad_ratio", "0.2", "0.05", *why),
        ("gate.min_previous_records", "10", "50", *why),
    ]
    # The same settings again change nothing and record nothing.
    assert cli.main(args) == 0
    assert "no change" in capsys.readouterr().out
    assert cli.main(["--db-url", task_db, "audit", "--target-type", "task", "--json"]) == 0
    trail = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(trail) == 6 and {(e["action"], e["target_id"], e["actor"]) for e in trail} == {
        ("task.set", TASK, "alice")
    }
    assert {"status": "DISABLED"} in [e["after"] for e in trail]
    assert len(_audit_rows(task_db)) == 7
    # Clearing the cron makes the task MANUAL again.
    assert (
        cli.main(
            ["--db-url", task_db, "task", "set", "--cron", "none", "--by", "bob", "--reason", "x"]
        )
        == 0
    )
    assert "schedule_type: CRON -> MANUAL" in capsys.readouterr().out
    task = _show(task_db, capsys)["task"]
    assert isinstance(task, dict)
    assert (task["schedule_type"], task["cron_expr"]) == ("MANUAL", None)


def test_a_disabled_task_refuses_the_cli_sync_in_one_line(
    task_db: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("SUPPLIER_SYNC_SUPPLIER_URL", raising=False)
    assert (
        cli.main(
            [
                *("--db-url", task_db, "task", "set", "--status", "DISABLED"),
                *("--by", "alice", "--reason", "supplier outage INC-7"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert cli.main(["--db-url", task_db, "sync", "--full"]) == 2
    _one_line_error(capsys, "is DISABLED by alice", "supplier outage INC-7", "--status ENABLED")
    db = SyncDatabase.open(task_db)
    with db.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(schema.batch)).scalar_one() == 0
    db.dispose()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["set", "--by", "a", "--reason", "r"], "nothing to change"),
        (["set", "--task", "nope", "--status", "DISABLED", "--by", "a", "--reason", "r"], "nope"),
        (["show", "--task", "nope"], "unknown task 'nope'"),
        (["set", "--cron", "every night", "--by", "a", "--reason", "r"], "--cron"),
        (["set", "--max-bad-ratio", "1.5", "--by", "a", "--reason", "r"], "max_bad_ratio"),
        (["set", "--status", "DISABLED", "--by", " ", "--reason", "r"], "--by"),
    ],
)
def test_task_errors_are_one_line(
    task_db: str, capsys: pytest.CaptureFixture[str], args: list[str], expected: str
):
    assert cli.main(["--db-url", task_db, "task", *args]) == 2
    _one_line_error(capsys, expected)
    assert len(_audit_rows(task_db)) == 1  # only the creation


def test_task_set_requires_who_and_why(task_db: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--db-url", task_db, "task", "set", "--status", "DISABLED"])
    assert exit_.value.code == 2
    assert "--by" in capsys.readouterr().err
