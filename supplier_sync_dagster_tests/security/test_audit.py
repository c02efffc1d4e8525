"""Issue 41, audit identity and operator text: every operator action records, beside the
``--by`` an operator declares, the identity the acting process can prove (OS user of its
effective uid, host, pid; for a Dagster run its id and the user Dagster names); control
characters in ``--by``/``--reason`` (and a launchpad's ``by``/``reason``) are refused before
anything changes; rows stored before that are printed escaped, so no forged line appears.
On SQLite and MariaDB, through ``main([...])`` and the launchpad jobs."""

from __future__ import annotations

import json
import os
import pwd
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import TaskDisabled
from supplier_sync_dagster.core.inputs.text import json_printable, printable
from supplier_sync_dagster.core.leasing.batches import TaskSpec, get_task
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import process_identity
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.migrations import migrate
from supplier_sync_dagster.core.sync.tasks import ensure_task, require_enabled
from supplier_sync_dagster.defs import operator_actions as actions
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SimulatedSupplierResource,
    SyncDatabaseResource,
)
from supplier_sync_dagster_tests.cli.test_main import (
    TASK,
    Outcome,
    assert_one_line_error,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    query,
    run,
    simulator,
    supplier,
    sync,
)
from supplier_sync_dagster_tests.core.store.test_migrations import HEAD, apply_by_hand

# What this test process can prove about itself: what every row it writes must record.
OWN = {
    "os_user": pwd.getpwuid(os.geteuid()).pw_name,
    "host": socket.gethostname(),
    "pid": os.getpid(),
}
# A --by that would print a second, forged audit line, and a --reason that would clear the
# operator's screen and paint what follows red.
FORGED_BY = "alice\n2026-12-06 03:00:00  root  task.set  why: ok"
ANSI_REASON = "\x1b[2J\x1b[H\x1b[31mall clear"
# Each (by, reason) an operator action must refuse: a newline, ANSI escapes, a tab, DEL, a C1
# CSI, a bidi override, a bidi isolate, a line separator, a zero-width space.
BAD_WHO_AND_WHY = [
    (FORGED_BY, "r"),
    ("ops", ANSI_REASON),
    ("ops\tx", "r"),
    ("ops", "why\x7f"),
    ("ops", "why \x9b2J"),
    ("ops\u202etxt.exe", "r"),
    ("ops", "why \u2066hidden\u2069"),
    ("ops", "one\u2028two"),
    ("al\u200bice", "r"),
]
_RISKY = ("\x1b", "\x9b", "\x7f", "\u202e", "\u2066", "\u2028", "\u200b", "\t")


@pytest.fixture
def task_db(db_url: str) -> str:
    """A sync database whose task exists, created as a first run creates it."""
    db = SyncDatabase.open(db_url)
    try:
        ensure_task(
            db,
            TaskSpec(task_code=TASK, supplier_id=1001),
            created_by="run night-1",
            reason="created by its first run",
        )
    finally:
        db.dispose()
    return db_url


def _trail(capsys: pytest.CaptureFixture[str], db_url: str, *filters: str) -> list[dict[str, Any]]:
    out = run(capsys, "--db-url", db_url, "audit", "--json", "--limit", "1000", *filters)
    assert out.code == 0, out
    return [json.loads(line) for line in out.lines]


def _proven(entry: dict[str, Any]) -> dict[str, Any]:
    identity = entry["identity"]
    assert identity is not None, entry
    return {k: identity[k] for k in OWN}


# --- the CLI: every action that audits records this process's identity ----------------------


def _act(capsys: pytest.CaptureFixture[str], db_url: str, *argv: str) -> Outcome:
    done = run(capsys, "--db-url", db_url, *argv, "--by", "ops-ivy", "--reason", "INC-41")
    assert done.code == 0, done
    return done


def _list(capsys: pytest.CaptureFixture[str], db_url: str, *argv: str) -> list[dict[str, Any]]:
    out = run(capsys, "--db-url", db_url, *argv, "--json")
    assert out.code == 0, out
    return [json.loads(line) for line in out.lines]


def _sync_two_days(capsys: pytest.CaptureFixture[str], db_url: str, mp: pytest.MonkeyPatch) -> str:
    """Day 0 leaves dead letters and outbox events, day 1 price shocks held for review; the
    day-1 batch."""
    sim = simulator(
        daily_price_change_rate=0.3, price_shock_rate=0.4, faults={"bad_record_rate": 0.1}
    )
    with supplier(sim, mp):
        assert sync(capsys, db_url, "--trigger-id", "day-0").code == 0
        sim.advance_day()
        day1 = sync(capsys, db_url, "--trigger-id", "day-1", "--json")
    assert day1.code == 0, day1
    return str(json.loads(day1.out)["batch_id"])


def _act_on_records(capsys: pytest.CaptureFixture[str], db_url: str, batch: str) -> None:
    """Dead letters (ignore, retry, fix), reviews (reject, approve), a gate override and
    outbox events (cancel, retry), each as an operator types it."""
    letters = _list(capsys, db_url, "dead-letters", "list")
    fixes: dict[str, dict[str, Any]] = {
        "INVALID_PHONE": {"phone": "+66 2 123 4567"},
        "STAR_RATING_OUT_OF_RANGE": {"star_rating": 4.0},
        "UNKNOWN_STATUS": {"status": "ACTIVE"},
        "HTML_IN_NAME": {"name": "Riverside Hotel"},
        "CONTROL_CHARACTERS": {"name": "Riverside Hotel"},
    }
    fixable = next(d for d in letters if d["error_code"] in fixes)
    others = [d["id"] for d in letters if d["id"] != fixable["id"]]
    _act(capsys, db_url, "dead-letters", "ignore", str(others[0]))
    _act(capsys, db_url, "dead-letters", "retry", str(others[1]))
    patch = json.dumps(fixes[fixable["error_code"]])
    _act(capsys, db_url, "dead-letters", "fix", str(fixable["id"]), "--patch", patch)
    reviews = _list(capsys, db_url, "review", "list", "--batch", batch)
    _act(capsys, db_url, "review", "reject", reviews[0]["review_id"])
    _act(capsys, db_url, "review", "approve", "--all", "--batch", batch)
    s = schema.shard.c
    city = query(db_url, sa.select(s.shard_key).where(s.batch_id == batch).limit(1))[0][0]
    gate = ("gate", "override", "--batch", batch, "--city", city, "--check", "schema_drift")
    _act(capsys, db_url, *gate)
    o = schema.outbox.c
    event = query(db_url, sa.select(o.id).where(o.status == "READY").limit(1))[0][0]
    _act(capsys, db_url, "outbox", "cancel", str(event))
    _act(capsys, db_url, "outbox", "retry", str(event))


def _act_on_settings(
    capsys: pytest.CaptureFixture[str], db_url: str, mp: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Task settings, gate and alert thresholds, and the tasks of a suppliers file."""
    _act(capsys, db_url, "task", "set", "--policy", "CANCEL_PREVIOUS")
    _act(capsys, db_url, "gate", "thresholds", "--max-bad-ratio", "0.3")
    _act(capsys, db_url, "alerts", "thresholds", "--set", "stuck_outbox_events=5")
    path = tmp_path / "suppliers.yaml"
    path.write_text("suppliers:\n  acme:\n    supplier_id: 1002\n    accounts:\n      eu: {}\n")
    mp.setenv("SUPPLIER_SYNC_SUPPLIERS_FILE", str(path))
    applied = run(
        capsys, "accounts", "apply", "--db-url", db_url, "--by", "ops-ivy", "--reason", "r"
    )
    assert applied.code == 0, applied


def test_each_operator_cli_action_records_this_process_os_user_host_and_pid(
    db_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    batch = _sync_two_days(capsys, db_url, monkeypatch)
    _act_on_records(capsys, db_url, batch)
    _act_on_settings(capsys, db_url, monkeypatch, tmp_path)

    trail = _trail(capsys, db_url)
    assert {e["action"] for e in trail} == {
        "dead_letter.ignore",
        "dead_letter.retry",
        "dead_letter.fix",
        "review.reject",
        "review.approve",
        "gate.override",
        "outbox.cancel",
        "outbox.retry",
        "task.set",
        "alert.threshold",
        "task.create",
    }
    for entry in trail:
        assert entry["actor"] == "ops-ivy", entry
        assert _proven(entry) == OWN, entry
        assert entry["identity"]["dagster_run_id"] is None, entry
    # The text line names both: who was declared, and who the process proves it is.
    text = run(capsys, "--db-url", db_url, "audit", "--action", "task.set")
    assert text.code == 0 and text.lines, text
    proof = f"[{OWN['os_user']}@{OWN['host']} pid {OWN['pid']}]"
    assert all("ops-ivy" in line and proof in line for line in text.lines), text.out
    # The task's change log records it too (the first run's creation included).
    shown = run(capsys, "--db-url", db_url, "task", "show", "--json")
    log = json.loads(shown.out)["audit"]
    assert {(a["field_name"], a["changed_by"]) for a in log} >= {
        ("concurrency_policy", "ops-ivy"),
        ("gate.max_bad_ratio", "ops-ivy"),
    }
    assert all({k: a["identity"][k] for k in OWN} == OWN for a in log), log
    shown_text = run(capsys, "--db-url", db_url, "task", "show")
    assert sum(proof in line for line in shown_text.lines) == len(log), shown_text.out


# --- control characters in --by and --reason are refused ------------------------------------

_CLI_ACTIONS = {
    "review approve": ("review", "approve", "--all"),
    "review reject": ("review", "reject", "r_1"),
    "gate override": (
        "gate",
        "override",
        "--batch",
        "b_1",
        "--city",
        "BKK",
        "--check",
        "schema_drift",
    ),
    "task set": ("task", "set", "--status", "DISABLED"),
    "gate thresholds": ("gate", "thresholds", "--max-bad-ratio", "0.3"),
    "dead-letters retry": ("dead-letters", "retry", "1"),
    "dead-letters ignore": ("dead-letters", "ignore", "1"),
    "dead-letters fix": ("dead-letters", "fix", "1", "--patch", "{}"),
    "outbox retry": ("outbox", "retry", "1"),
    "outbox cancel": ("outbox", "cancel", "1"),
    "alerts thresholds": ("alerts", "thresholds", "--set", "stuck_outbox_events=5"),
    "accounts apply": ("accounts", "apply"),
}


@pytest.mark.parametrize("action", sorted(_CLI_ACTIONS))
def test_a_by_or_reason_with_control_characters_is_refused_in_one_line_before_anything(
    action: str, task_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _CLI_ACTIONS[action]
    if action == "accounts apply":
        argv = (*argv, "--db-url", task_db)
    for who, why in BAD_WHO_AND_WHY:
        refused = run(capsys, "--db-url", task_db, *argv, "--by", who, "--reason", why)
        line = assert_one_line_error(refused, code=2)
        assert "may not hold control characters" in line, (who, why, line)
        assert not any(ch in line for ch in _RISKY), line  # the error names it escaped
    assert _trail(capsys, task_db) == []
    t = schema.task.c
    assert query(task_db, sa.select(t.task_code, t.status)) == [(TASK, "ENABLED")]


# --- rows stored before the refusal print escaped -------------------------------------------


def _store_forged_rows(db_url: str) -> None:
    """Rows as an older release stored them: control characters in who and why, no identity."""
    db = SyncDatabase.open(db_url)
    try:
        with db.begin() as conn:
            at = datetime(2026, 12, 1, 12, 0)
            conn.execute(
                sa.insert(schema.audit).values(
                    action="task.set",
                    target_type="task",
                    target_id=TASK,
                    actor=FORGED_BY[:64],
                    reason=ANSI_REASON + "\u202e\u2028\x9b",
                    before_state=json.dumps({"status": "ENABLED\n\x1b[1m"}),
                    after_state=json.dumps({"status": "DISABLED\u2028"}, ensure_ascii=False),
                    created_at=at,
                )
            )
            conn.execute(
                sa.insert(schema.task_audit).values(
                    task_code=TASK,
                    field_name="status",
                    old_value="ENABLED\nFORGED",
                    new_value="DISABLED",
                    changed_by=FORGED_BY[:64],
                    reason=ANSI_REASON,
                    created_at=at,
                )
            )
    finally:
        db.dispose()


def _assert_no_forged_line(out: Outcome, lines: int) -> None:
    assert out.code == 0, out
    assert len(out.lines) == lines, out.out
    assert not any(ch in out.out for ch in _RISKY), repr(out.out)
    assert not any(line.startswith("2026-12-06") for line in out.lines), out.out


def test_stored_rows_with_control_characters_print_escaped_in_audit_and_task_show(
    task_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _store_forged_rows(task_db)
    text = run(capsys, "--db-url", task_db, "audit")
    _assert_no_forged_line(text, 1)
    assert "alice\\x0a2026-12-06" in text.out and "\\x1b[2J" in text.out
    assert "[identity not recorded]" in text.out
    as_json = run(capsys, "--db-url", task_db, "audit", "--json")
    _assert_no_forged_line(as_json, 1)
    entry = json.loads(as_json.out)  # the same values, escaped only in JSON's own way
    assert (entry["actor"], entry["identity"]) == (FORGED_BY[:64], None)
    assert entry["reason"] == ANSI_REASON + "\u202e\u2028\x9b"
    assert entry["after"] == {"status": "DISABLED\u2028"}

    shown = run(capsys, "--db-url", task_db, "task", "show")
    _assert_no_forged_line(shown, 4)  # the task, its thresholds, its two changes
    assert "ENABLED\\x0aFORGED" in shown.out and "\\x1b[2J" in shown.out
    shown_json = run(capsys, "--db-url", task_db, "task", "show", "--json")
    _assert_no_forged_line(shown_json, 1)
    assert json.loads(shown_json.out)["audit"][0]["changed_by"] == FORGED_BY[:64]


def test_a_disabled_tasks_refusal_quotes_a_stored_reason_escaped(task_db: str) -> None:
    _store_forged_rows(task_db)
    db = SyncDatabase.open(task_db)
    try:
        with db.begin() as conn:
            conn.execute(sa.update(schema.task).values(status="DISABLED"))
        with db.engine.connect() as conn, pytest.raises(TaskDisabled) as refused:
            require_enabled(conn, TASK)
    finally:
        db.dispose()
    message = str(refused.value)
    assert "\\x1b[2J" in message and not any(ch in message for ch in ("\n", *_RISKY)), message


def test_printable_and_json_printable_escape_every_kind_and_keep_the_value() -> None:
    text = "ok é 東京 " + "".join(ch for _, why in BAD_WHO_AND_WHY for ch in why) + "\U000e0001"
    shown = printable(text)
    assert shown.isprintable() and shown.startswith("ok é 東京 ")
    assert "\\U000e0001" in shown and "\\x1b" in shown and "\\u2028" in shown
    encoded = json_printable(json.dumps({"t": text}, ensure_ascii=False))
    assert encoded.isprintable() and json.loads(encoded) == {"t": text}
    assert "東京" in encoded  # other text stays as it is


# --- the launchpad: config.by and config.reason -----------------------------------------------

_JOBS: dict[str, tuple[dg.JobDefinition, str, dict[str, Any]]] = {
    "dead_letter_retry": (actions.dead_letter_retry_job, "retry_dead_letters", {"ids": [1]}),
    "dead_letter_ignore": (actions.dead_letter_ignore_job, "ignore_dead_letters", {"ids": [1]}),
    "dead_letter_fix": (
        actions.dead_letter_fix_job,
        "fix_dead_letter_op",
        {"id": 1, "patch": "{}"},
    ),
    "review_approve": (actions.review_approve_job, "approve_reviews_op", {"batch_id": "b"}),
    "review_reject": (actions.review_reject_job, "reject_reviews_op", {"review_ids": ["r"]}),
    "gate_override": (
        actions.gate_override_job,
        "override_gate_op",
        {"batch_id": "b", "city": "BKK", "check_name": "schema_drift"},
    ),
    "task_settings": (
        actions.task_settings_job,
        "change_task_op",
        {"task_code": TASK, "status": "DISABLED"},
    ),
    "outbox_retry": (actions.outbox_retry_job, "retry_outbox_events", {"ids": [1]}),
    "outbox_cancel": (actions.outbox_cancel_job, "cancel_outbox_events", {"ids": [1]}),
}


def _launch(
    db_url: str,
    tmp_path: Path,
    job: str,
    who: dict[str, str],
    tags: dict[str, str] | None = None,
    **config: Any,
) -> dg.ExecuteInJobResult:
    definition, op, defaults = _JOBS[job]
    return definition.execute_in_process(
        run_config={"ops": {op: {"config": {**defaults, **config, **who}}}},
        resources={
            "sync_db": SyncDatabaseResource(db_url=db_url),
            "payloads": PayloadStoreResource(url=f"file://{tmp_path}/payloads"),
            "supplier": SimulatedSupplierResource(sim_cities=1, sim_hotels=10),
            "governance": GovernanceResource(),
        },
        tags=tags,
        raise_on_error=False,
    )


def _failure(result: dg.ExecuteInJobResult) -> str:
    failures = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert len(failures) == 1, failures
    data = failures[0].step_failure_data
    assert data.user_failure_data is not None, data
    return str(data.user_failure_data.description)


@pytest.mark.parametrize("job", sorted(_JOBS))
def test_a_launchpad_by_or_reason_with_control_characters_fails_the_run_before_anything(
    job: str, task_db: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for who, why in (BAD_WHO_AND_WHY[0], BAD_WHO_AND_WHY[1], BAD_WHO_AND_WHY[5]):
        result = _launch(task_db, tmp_path, job, {"by": who, "reason": why})
        assert not result.success
        description = _failure(result)
        assert "may not hold control characters" in description, description
        assert "\n" not in description and "\x1b" not in description, description
    assert _trail(capsys, task_db) == []
    t = schema.task.c
    assert query(task_db, sa.select(t.task_code, t.status)) == [(TASK, "ENABLED")]


def test_a_launchpad_action_records_the_run_id_and_the_user_dagster_names(
    task_db: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    who = {"by": "ops-jo", "reason": "INC-41"}
    plain = _launch(task_db, tmp_path, "task_settings", who, policy="CANCEL_PREVIOUS", status="")
    assert plain.success
    # Open-source Dagster names no user; Dagster+ sets the run's `user` tag to the launcher.
    tagged = _launch(
        task_db, tmp_path, "task_settings", who, {"user": "jo@example.com"}, status="DISABLED"
    )
    assert tagged.success
    identities = {next(iter(e["after"])): e["identity"] for e in _trail(capsys, task_db)}
    assert identities == {
        "concurrency_policy": {**OWN, "dagster_run_id": plain.run_id, "dagster_user": None},
        "status": {**OWN, "dagster_run_id": tagged.run_id, "dagster_user": "jo@example.com"},
    }
    shown = run(capsys, "--db-url", task_db, "task", "show")
    assert any(
        f"dagster run {tagged.run_id} launched by jo@example.com" in ln for ln in shown.lines
    )
    db = SyncDatabase.open(task_db)
    try:
        with db.engine.connect() as conn:
            assert get_task(conn, TASK).status == "DISABLED"
    finally:
        db.dispose()


def test_a_process_captures_its_identity_once_and_a_run_adds_to_it() -> None:
    me = process_identity()
    assert (me.os_user, me.host, me.pid) == (OWN["os_user"], OWN["host"], OWN["pid"])
    assert process_identity() is me
    in_run = me.in_run("r-1", "")
    assert (in_run.dagster_run_id, in_run.dagster_user, in_run.pid) == ("r-1", None, me.pid)


# --- the migration ---------------------------------------------------------------------------


def test_018_adds_the_identity_columns_and_keeps_older_rows_as_not_recorded(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    apply_by_hand(db_url, 17)
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO supplier_sync_audit (action, target_type, target_id, actor, reason, "
                "before_state, after_state, created_at) VALUES ('outbox.retry', 'outbox_event', "
                "'7', 'old-ops', 'before 018', 'null', 'null', '2026-11-01 10:00:00')"
            )
    finally:
        engine.dispose()
    db = SyncDatabase.open(db_url, create_schema=False)
    try:
        assert [a.version for a in migrate(db).applied] == list(range(18, HEAD + 1))
        with db.engine.connect() as conn:
            insp = sa.inspect(conn)
            for table in ("supplier_sync_audit", "supplier_sync_task_audit"):
                columns = {c["name"] for c in insp.get_columns(table)}
                assert set(OWN) | {"dagster_run_id", "dagster_user"} <= columns, table
            assert "idx_audit_run" in {ix["name"] for ix in insp.get_indexes("supplier_sync_audit")}
    finally:
        db.dispose()
    (old,) = _trail(capsys, db_url)
    assert (old["actor"], old["identity"]) == ("old-ops", None)
    text = run(capsys, "--db-url", db_url, "audit")
    assert "old-ops" in text.out and "[identity not recorded]" in text.out
