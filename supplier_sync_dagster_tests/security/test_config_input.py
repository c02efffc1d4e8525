"""Issue 41, operator input that cannot lock the catalog: ``suppliers.yaml`` and cron expressions.

The probes, played: duplicate YAML keys (top level and nested), anchors and aliases (a 9^9
alias bomb on ``load_accounts`` and on the code location's definitions load, each in a child
process bounded in time and address space), bad cron expressions on ``task set --cron`` (on
SQLite and MariaDB) and in ``suppliers.yaml``; good ones still accepted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.accounts import load_accounts
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.inputs.cron import check_cron
from supplier_sync_dagster.core.leasing.batches import TaskSpec
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.tasks import ensure_task
from supplier_sync_dagster.definitions import defs
from supplier_sync_dagster_tests.cli.test_main import (  # noqa: F401  (cli_home: an autouse fixture)
    assert_one_line_error,
    cli_home,
    run,
)

TASK = "hotel_supplier_full_resource"
SUPPLIERS = """\
suppliers:
  acme:
    supplier_id: 1001
    simulator: {seed: 11, cities: 2, hotels: 20, profile: clean}
    accounts:
      eu:
        rate_limit_rps: 20
        schedules: {full: "FULL_CRON"}
"""
# The child's address space: the definitions load needs about 0.3 GB; the 9^9 bomb, expanded,
# 2.6 GB and more.
CHILD_AS_BYTES = 1536 * 1024 * 1024
CHILD_SECONDS = 10.0
# Loads a good file the way ``argv[1]`` says (the imports and Dagster's first load, which a
# loaded machine makes slow, are not what is timed), then the file ``argv[3]``, and formats its
# error as Dagster serializes a failed code location load: a TracebackException that is not
# compact renders every context, suppressed or not. Before issue 41 the chain held pydantic's
# ValidationError, whose message renders its input: the bomb, expanded (9^8: 11 s, 0.9 GB).
CHILD = textwrap.dedent(
    """
    import json, os, resource, sys, time, traceback
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
    if sys.argv[1] == "load_accounts":
        from pathlib import Path
        from supplier_sync_dagster.core.accounts import load_accounts
        def load():
            load_accounts(Path(os.environ["SUPPLIER_SYNC_SUPPLIERS_FILE"]))
    else:
        import dagster as dg
        from supplier_sync_dagster.definitions import defs
        def load():
            with dg.instance_for_test():
                defs()
    load()
    os.environ["SUPPLIER_SYNC_SUPPLIERS_FILE"] = sys.argv[3]
    start = time.monotonic()
    try:
        load()
        found = {"error": None}
    except Exception as err:
        tbe = traceback.TracebackException(type(err), err, err.__traceback__)
        chain = "".join(tbe.format())
        cause = err
        while cause is not None and type(cause).__name__ != "ConfigError":
            cause = cause.__cause__ or cause.__context__
        found = {"error": type(err).__name__, "config_error": cause and str(cause)}
        found["traceback_chars"] = len(chain)
    found["seconds"] = time.monotonic() - start
    found["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(found))
    """
)


def alias_bomb(levels: int) -> str:
    """A valid suppliers file below a list of 9^``levels`` aliased leaves."""
    lines = ["a1: &a1 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 9)}]" for n in range(2, levels + 1)]
    return "\n".join(lines) + "\n" + SUPPLIERS.replace("FULL_CRON", "0 2 * * *")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "suppliers.yaml"
    path.write_text(text)
    return path


def refused(path: Path, *expected: str) -> str:
    """``load_accounts(path)`` refuses the file in one line naming it and ``expected``."""
    with pytest.raises(ConfigError) as caught:
        load_accounts(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    for text in expected:
        assert text in message, message
    return message


@pytest.fixture
def suppliers_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$SUPPLIER_SYNC_SUPPLIERS_FILE`` set to a (not yet written) file under the test's folder."""
    path = tmp_path / "suppliers.yaml"
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIERS_FILE", str(path))
    return path


def test_a_duplicate_top_level_key_is_refused_naming_it_and_its_line(tmp_path: Path):
    text = SUPPLIERS.replace("FULL_CRON", "0 2 * * *") + "suppliers: {}\n"
    refused(write(tmp_path, text), "line 9: duplicate key 'suppliers'", "first at line 1")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        # The same account twice: the second would silently replace the first.
        ("      eu: {}\n", "line 9: duplicate key 'eu' in suppliers.acme.accounts"),
        # The same field twice, in block style and in a flow mapping.
        (
            "        rate_limit_rps: 500\n",
            "line 9: duplicate key 'rate_limit_rps' in suppliers.acme.accounts.eu",
        ),
        ("        thresholds: {max_bad_ratio: 0.1, max_bad_ratio: 1}\n", "'max_bad_ratio' in"),
    ],
)
def test_a_duplicate_nested_key_is_refused_naming_it_and_its_line(
    tmp_path: Path, extra: str, expected: str
):
    refused(write(tmp_path, SUPPLIERS.replace("FULL_CRON", "0 2 * * *") + extra), expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # One plain anchor, never used: refused all the same (the file has no use for one).
        (
            "suppliers:\n  acme: &acme\n    supplier_id: 1001\n    accounts:\n      eu: {}\n",
            "line 2: YAML anchor &acme refused",
        ),
        # A merge of an anchored mapping: the anchor is met first.
        (
            "base: &base {rate_limit_rps: 5}\nsuppliers:\n  acme:\n    supplier_id: 1001\n"
            "    accounts:\n      eu: {<<: *base}\n",
            "line 1: YAML anchor &base refused",
        ),
        # An alias of nothing: refused as an alias, before any composer looks it up.
        ("suppliers: *nowhere\n", "line 1: YAML alias *nowhere refused"),
        ("a: " + "[" * 40 + "]" * 40 + "\n", "line 1: nested deeper than 32 levels"),
        ("suppliers: \x00\n", "not YAML"),
    ],
)
def test_anchors_aliases_and_deep_nesting_are_refused(tmp_path: Path, text: str, expected: str):
    refused(write(tmp_path, text), expected)


def test_an_oversized_or_binary_file_is_refused_before_parsing(tmp_path: Path):
    path = write(tmp_path, "# " + "x" * (1 << 20) + "\n")
    refused(path, "larger than 1048576 bytes")
    path.write_bytes(b"suppliers: \xff\xfe\n")
    refused(path, "not UTF-8 text (byte 11)")


def _bounded_child(mode: str, path: Path, tmp_path: Path) -> dict[str, Any]:
    good = tmp_path / "good.yaml"
    good.write_text(SUPPLIERS.replace("FULL_CRON", "0 2 * * *"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPPLIER_SYNC_")}
    env.update(SUPPLIER_SYNC_SUPPLIERS_FILE=str(good), SUPPLIER_SYNC_HOME=str(tmp_path / "home"))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(CHILD_AS_BYTES), str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,  # imports and the warm-up included; the bomb's load is bounded below
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return found


@pytest.mark.parametrize("mode", ["load_accounts", "definitions"])
def test_an_alias_bomb_is_refused_at_once_on_every_path(mode: str, tmp_path: Path):
    # 9^9 leaves once expanded: the definitions load took over 40 s and 2.6 GB, then was killed.
    path = write(tmp_path, alias_bomb(9))
    found = _bounded_child(mode, path, tmp_path)
    assert found["error"] == (
        "ConfigError" if mode == "load_accounts" else "ComponentTreeException"
    )
    assert found["config_error"] == (
        f"{path}: line 1: YAML anchor &a1 refused: write each value out (no anchors or aliases)"
    )
    assert found["seconds"] < CHILD_SECONDS, found
    assert found["peak_rss_mb"] < 1024, found


WHO = ["--by", "alice", "--reason", "probe 41"]


@pytest.mark.parametrize(
    "argv",
    [
        ["accounts", "list"],
        ["accounts", "check"],
        ["accounts", "apply", "--db-url", "sqlite://", *WHO],
    ],
)
def test_the_commands_refuse_a_bomb_in_one_line(
    suppliers_env: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
):
    suppliers_env.write_text(alias_bomb(9))
    line = assert_one_line_error(run(capsys, *argv), code=2)
    assert f"{suppliers_env}: line 1: YAML anchor &a1 refused" in line, line


@pytest.mark.parametrize(
    ("cron", "problem"),
    [
        ("61 * * * *", "minute 61 is outside 0-59"),
        ("0 24 * * *", "hour 24 is outside 0-23"),
        ("0 2 * * * *", "has 6 fields"),
        ("0 2 30 2 *", "none of its months has that day of month"),
        ("*/0 * * * *", "minute step '*/0' is outside 1-60"),
        ("5-3 * * * *", "minute range '5-3' runs backwards"),
        ("0 2 L * *", "day of month 'L' is not a number"),
        ("0 2 * * 1#2", "day of week '1#2' is not"),
        ("@reboot", "has 1 fields"),
    ],
)
def test_a_bad_cron_in_the_suppliers_file_names_the_account_and_field(
    tmp_path: Path, cron: str, problem: str
):
    path = write(tmp_path, SUPPLIERS.replace("FULL_CRON", cron))
    refused(path, f"suppliers.acme.accounts.eu.schedules.full: cron {cron!r}", problem)


def test_a_bad_cron_stops_the_definitions_load_with_our_error_not_dagsters(suppliers_env: Path):
    suppliers_env.write_text(SUPPLIERS.replace("FULL_CRON", "61 * * * *"))
    with dg.instance_for_test(), pytest.raises(Exception) as caught:
        defs()
    err: BaseException | None = caught.value
    while err is not None and not isinstance(err, ConfigError):
        err = err.__cause__ or err.__context__
    assert err is not None, caught.value  # before: Dagster's "invalid cron schedule" in the tree
    assert str(err) == (
        f"{suppliers_env}: suppliers.acme.accounts.eu.schedules.full: "
        "cron '61 * * * *': minute 61 is outside 0-59"
    )


def test_accounts_check_refuses_a_bad_cron_in_one_line(
    suppliers_env: Path, capsys: pytest.CaptureFixture[str]
):
    suppliers_env.write_text(SUPPLIERS.replace("FULL_CRON", "0 2 31 4 *"))
    line = assert_one_line_error(run(capsys, "accounts", "check"), code=2)
    assert "schedules.full: cron '0 2 31 4 *': none of its months has that day of month" in line


GOOD_CRONS = [
    "0 2 * * *",
    "*/5 * * * *",
    "15 1 * * mon-fri",
    "0 0 1,15 jan-jun *",
    "0-59/10 8-18 * * 1-5",
    "0 0 29 2 *",
    "0 0 * * 7",
    "@daily",
    "@hourly",
]


@pytest.mark.parametrize("cron", GOOD_CRONS)
def test_a_good_cron_is_accepted_in_the_file_and_by_dagster(tmp_path: Path, cron: str):
    (account,) = load_accounts(write(tmp_path, SUPPLIERS.replace("FULL_CRON", cron)))
    assert account.schedules.full == cron
    # Whatever the checker accepts, a Dagster schedule accepts too (the load cannot fail on it).
    dg.ScheduleDefinition(name="probe", cron_schedule=cron, target=dg.AssetSelection.all())


def test_the_definitions_load_takes_a_good_file(suppliers_env: Path):
    suppliers_env.write_text(SUPPLIERS.replace("FULL_CRON", "15 1 * * mon-fri"))
    with dg.instance_for_test():
        repo = defs().get_repository_def()
    schedules = {s.name: s.cron_schedule for s in repo.schedule_defs}
    assert schedules["acme__eu__nightly_full_sync"] == "15 1 * * mon-fri"


@pytest.fixture
def task_db(db_url: str) -> str:
    """A sync database whose task exists, as its first run creates it."""
    db = SyncDatabase.open(db_url)
    ensure_task(db, TaskSpec(task_code=TASK, supplier_id=1001), created_by="run 1", reason="first")
    db.dispose()
    return db_url


def _stored(url: str) -> tuple[Any, ...]:
    db = SyncDatabase.open(url)
    t = schema.task.c
    with db.engine.connect() as conn:
        task = conn.execute(
            sa.select(t.schedule_type, t.cron_expr).where(t.task_code == TASK)
        ).one()
        audits = conn.execute(sa.select(sa.func.count()).select_from(schema.task_audit)).scalar()
    db.dispose()
    return (*task, audits)


@pytest.mark.parametrize(
    ("cron", "problem"),
    [
        ("61 * * * *", "--cron '61 * * * *': minute 61 is outside 0-59"),
        ("0 2 * 13 *", "--cron '0 2 * 13 *': month 13 is outside 1-12"),
        ("0 2 30 2 *", "none of its months has that day of month"),
        ("0 2 * * 8", "day of week 8 is outside 0-7"),
        ("every night", "--cron 'every night' has 2 fields"),
        ("0 " * 40, "is longer than 64 characters"),
    ],
)
def test_task_set_refuses_a_bad_cron_in_one_line(
    task_db: str, capsys: pytest.CaptureFixture[str], cron: str, problem: str
):
    before = _stored(task_db)
    outcome = run(capsys, "--db-url", task_db, "task", "set", "--cron", cron, *WHO)
    assert problem in assert_one_line_error(outcome, code=2)
    assert _stored(task_db) == before == ("MANUAL", None, 1)


@pytest.mark.parametrize(
    ("cron", "stored"), [("30  2 * * 1-5", "30 2 * * 1-5"), ("@Daily", "@daily")]
)
def test_task_set_takes_a_good_cron(
    task_db: str, capsys: pytest.CaptureFixture[str], cron: str, stored: str
):
    assert run(capsys, "--db-url", task_db, "task", "set", "--cron", cron, *WHO).code == 0
    assert _stored(task_db) == ("CRON", stored, 3)  # the creation, then schedule_type and cron


def test_check_cron_is_the_one_checker():
    # The launchpad's task settings job and `accounts apply` reach it through change_task;
    # the file's schedules through load_accounts. Here: its normal form.
    assert check_cron("  0   2 * * *  ") == "0 2 * * *"
    with pytest.raises(ConfigError, match=r"^--cron '61 \* \* \* \*': minute 61"):
        check_cron("61 * * * *", what="--cron")
