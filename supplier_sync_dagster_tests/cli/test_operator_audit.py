"""Every operator action that changes state is audited alike: it needs ``--by`` and
``--reason``, refuses blank ones in one line before it does anything, and writes one row per
change to the audit trail (``supplier-sync audit``). As an operator types it, through
``main([...])``, on SQLite and MariaDB."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import TaskSpec
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.tasks import ensure_task
from supplier_sync_dagster_tests.cli.test_main import (
    assert_one_line_error,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    query,
    run,
)

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


def _trail(capsys: pytest.CaptureFixture[str], db_url: str, *filters: str) -> list[dict[str, Any]]:
    out = run(capsys, "--db-url", db_url, "audit", "--json", *filters)
    assert out.code == 0, out
    return [json.loads(line) for line in out.lines]


def _thresholds(capsys: pytest.CaptureFixture[str], db_url: str) -> dict[str, Any]:
    shown = run(capsys, "--db-url", db_url, "gate", "thresholds")
    assert shown.code == 0, shown
    result: dict[str, Any] = json.loads(shown.out)
    return result


# --- gate thresholds: who and why, audited as task set --------------------------------------


def test_gate_thresholds_need_who_and_why_and_are_audited_as_task_set_audits(
    task_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _thresholds(capsys, task_db)
    assert before["max_bad_ratio"] == 0.2
    gate = ("--db-url", task_db, "gate", "thresholds", "--max-bad-ratio", "0.35")

    # No reason, or a blank one: refused in one line, nothing changed, nothing recorded.
    for who_why in (("--by", "dana"), ("--by", "dana", "--reason", "  "), ("--reason", "r")):
        refused = run(capsys, *gate, *who_why)
        assert "--by WHO and --reason WHY" in assert_one_line_error(refused, code=2)
    assert _thresholds(capsys, task_db) == before
    assert _trail(capsys, task_db) == []

    changed = run(capsys, *gate, "--by", "dana", "--reason", "supplier sends more bad rows")
    assert changed.code == 0, changed
    assert json.loads(changed.out) == {**before, "max_bad_ratio": 0.35}
    assert changed.err == "gate.max_bad_ratio: 0.2 -> 0.35 (audited)\n"
    assert _thresholds(capsys, task_db)["max_bad_ratio"] == 0.35
    g = schema.gate_threshold.c
    assert query(task_db, sa.select(g.task_code, g.updated_by)) == [(TASK, "dana")]

    # The same value again changes nothing and records nothing.
    again = run(capsys, *gate, "--by", "dana", "--reason", "again")
    assert again.code == 0 and again.err == "no change: the task already has these thresholds\n"

    # task set of another threshold: the same kind of row, so the two read alike.
    task_set = run(
        capsys,
        *("--db-url", task_db, "task", "set", "--min-previous-records", "50"),
        *("--by", "erin", "--reason", "small cities"),
    )
    assert task_set.code == 0, task_set
    entries = _trail(capsys, task_db, "--target-type", "task")
    assert [
        (e["action"], e["target_id"], e["actor"], e["reason"], e["before"], e["after"])
        for e in reversed(entries)
    ] == [
        (
            "task.set",
            TASK,
            "dana",
            "supplier sends more bad rows",
            {"gate.max_bad_ratio": "0.2"},
            {"gate.max_bad_ratio": "0.35"},
        ),
        (
            "task.set",
            TASK,
            "erin",
            "small cities",
            {"gate.min_previous_records": "10"},
            {"gate.min_previous_records": "50"},
        ),
    ]
    # And the task's own change log says who and why too.
    shown = run(capsys, "--db-url", task_db, "task", "show", "--json")
    log = json.loads(shown.out)["audit"]
    assert (log[1]["field_name"], log[1]["changed_by"], log[1]["reason"]) == (
        "gate.max_bad_ratio",
        "dana",
        "supplier sends more bad rows",
    )


def test_gate_thresholds_of_an_unknown_task_or_out_of_range_record_nothing(
    task_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    who_why = ("--by", "dana", "--reason", "r")
    unknown = run(
        capsys,
        *("--db-url", task_db, "gate", "thresholds", "--task", "nope", "--max-bad-ratio", "0.3"),
        *who_why,
    )
    assert "unknown task 'nope'" in assert_one_line_error(unknown, code=2)
    out_of_range = run(
        capsys, "--db-url", task_db, "gate", "thresholds", "--max-bad-ratio", "1.5", *who_why
    )
    assert "max_bad_ratio" in assert_one_line_error(out_of_range, code=2)
    assert _trail(capsys, task_db) == []
    # Showing needs no one.
    assert run(capsys, "--db-url", task_db, "gate", "thresholds", "--by", "x").code == 0


# --- every command that changes state: who and why before any work -------------------------

_ACTIONS = {
    "review approve": ("review", "approve", "--all"),
    "review reject": ("review", "reject", "r_1"),
    "gate override": (
        *("gate", "override", "--batch", "b_1", "--city", "BKK"),
        *("--check", "schema_drift"),
    ),
    "task set": ("task", "set", "--status", "DISABLED"),
    "gate thresholds": ("gate", "thresholds", "--max-bad-ratio", "0.3"),
    "dead-letters retry": ("dead-letters", "retry", "1"),
    "dead-letters ignore": ("dead-letters", "ignore", "1"),
    "outbox retry": ("outbox", "retry", "1"),
    "outbox cancel": ("outbox", "cancel", "1"),
    "alerts thresholds": ("alerts", "thresholds", "--set", "lag_minutes=5"),
    "accounts apply": ("accounts", "apply"),
}


@pytest.mark.parametrize("action", sorted(_ACTIONS))
def test_an_operator_action_with_a_blank_who_or_why_is_refused_before_it_does_anything(
    action: str, task_db: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = _ACTIONS[action]
    if action == "accounts apply":
        argv = (*argv, "--db-url", task_db)
    for who, why in (("", "why"), ("ops", " "), ("x" * 65, "why")):
        refused = run(capsys, "--db-url", task_db, *argv, "--by", who, "--reason", why)
        line = assert_one_line_error(refused, code=2)
        assert "--by" in line or "who" in line or "reason" in line, line
    assert _trail(capsys, task_db) == []
    t = schema.task.c
    assert query(task_db, sa.select(t.task_code, t.status)) == [(TASK, "ENABLED")]


@pytest.mark.parametrize("action", sorted(_ACTIONS))
def test_an_operator_action_without_by_or_reason_does_not_parse(
    action: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _ACTIONS[action]
    for missing in (("--by", "ops"), ("--reason", "why")):
        if action in ("gate thresholds", "alerts thresholds"):
            # Both also show the thresholds: the pair is needed only to set one.
            continue
        with pytest.raises(SystemExit) as exit_:
            run(capsys, *argv, *missing)
        assert exit_.value.code == 2
        assert "required" in capsys.readouterr().err


# --- accounts apply: the tasks it creates are audited ---------------------------------------


def test_accounts_apply_records_each_task_it_creates_and_each_setting_with_who_and_why(
    db_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    path = tmp_path / "suppliers.yaml"
    path.write_text(
        "suppliers:\n"
        "  acme:\n"
        "    supplier_id: 1001\n"
        "    accounts:\n"
        "      eu: {thresholds: {quiet_windows: 3}}\n"
    )
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIERS_FILE", str(path))
    blank = run(capsys, "accounts", "apply", "--db-url", db_url, "--by", " ", "--reason", "r")
    assert "--by WHO and --reason WHY" in assert_one_line_error(blank, code=2)
    assert query(db_url, sa.select(schema.task.c.task_code)) == []

    applied = run(
        capsys, "accounts", "apply", "--db-url", db_url, "--by", "olga", "--reason", "onboarding"
    )
    assert applied.code == 0, applied
    tasks = sorted(code for (code,) in query(db_url, sa.select(schema.task.c.task_code)))
    assert len(tasks) == 3
    entries = _trail(capsys, db_url, "--target-type", "task")
    created = {e["target_id"]: e for e in entries if e["action"] == "task.create"}
    assert sorted(created) == tasks
    assert {(e["actor"], e["reason"], e["before"]) for e in created.values()} == {
        ("olga", "onboarding (accounts apply)", None)
    }
    assert all(e["after"]["task_code"] == code for code, e in created.items())
    changed = [e for e in entries if e["action"] == "task.set"]
    assert changed and {(e["actor"], e["reason"]) for e in changed} == {("olga", "onboarding")}
    assert any(e["after"] == {"gate.quiet_windows": "3"} for e in changed), changed

    # Applied again: nothing changes, nothing is recorded.
    again = run(
        capsys, "accounts", "apply", "--db-url", db_url, "--by", "olga", "--reason", "again"
    )
    assert again.code == 0 and "0 settings changed" in again.out
    assert len(_trail(capsys, db_url, "--target-type", "task")) == len(entries)


def test_a_task_created_by_its_first_run_is_no_operator_action(
    task_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _trail(capsys, task_db) == []
    a = schema.task_audit.c
    assert query(task_db, sa.select(a.field_name, a.changed_by)) == [("task", "run night-1")]
