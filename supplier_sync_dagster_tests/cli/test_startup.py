"""What a command loads at start: the parser loads no handler module, a command loads only
its own (:func:`supplier_sync_dagster.cli.main.load_handler`, the one deferred import of the
command line), and what that saves a light command, measured."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supplier_sync_dagster.cli import main as cli
from supplier_sync_dagster.core.store.db import SyncDatabase

# What a command that only reads the sync database must not pay for.
HEAVY = ("dagster", "pandas", "pandera", "uvicorn", "prometheus_client")
# What deferring the handler imports must save ``status`` at least: seconds, and a share of
# the whole (with every handler imported it would take more than twice as long).
MIN_SAVING_SECONDS = 0.5
MIN_SAVING_SHARE = 0.5


def _leaf_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    found = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found = True
            for sub in action.choices.values():
                yield from _leaf_parsers(sub)
    if not found:
        yield parser


def handler_names() -> list[str]:
    """Every handler that the commands name, once each."""
    return sorted({str(p.get_default("handler")) for p in _leaf_parsers(cli.build_parser())})


def test_every_command_names_a_handler_that_exists() -> None:
    leaves = list(_leaf_parsers(cli.build_parser()))
    assert len(leaves) > 40
    assert all(p.get_default("handler") for p in leaves), [
        p.prog for p in leaves if not p.get_default("handler")
    ]
    for name in handler_names():
        assert callable(cli.load_handler(name)), name


def _python(script: str, *args: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# Runs each command of argv (a JSON list of argument lists) with main() in this process and
# prints, after each, the heavy packages and handler modules loaded so far.
_LOADED_AFTER_EACH = """
import contextlib, io, json, sys
from supplier_sync_dagster.cli import main as cli
heavy, handlers = json.loads(sys.argv[2]), json.loads(sys.argv[3])
def loaded():
    return {
        "heavy": sorted(m for m in heavy if m in sys.modules),
        "handlers": sorted(h for h in handlers if h in sys.modules),
    }
print(json.dumps({"parser": (cli.build_parser(), loaded())[1]}))
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as exited:
            code = exited.code
    print(json.dumps({" ".join(argv): {**loaded(), "code": code}}))
"""


def test_help_and_light_commands_load_no_dagster_nor_pandas(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'sync.sqlite3'}"
    light = [
        ["--help"],
        # A command that only reads refuses a missing SQLite file: the database first.
        ["--db-url", db_url, "db", "migrate"],
        ["--db-url", db_url, "status"],
        ["--db-url", db_url, "stalls"],
        ["--db-url", db_url, "db", "status"],
        ["--db-url", db_url, "export", "published"],
        ["--db-url", db_url, "review", "list"],
        ["--db-url", db_url, "gate", "thresholds"],
        ["--db-url", db_url, "dead-letters", "list"],
        ["--db-url", db_url, "trace", "H1"],
        ["--db-url", db_url, "audit"],
        ["--db-url", db_url, "outbox", "status"],
    ]
    modules = sorted({name.partition(":")[0] for name in handler_names()})
    out = _python(
        _LOADED_AFTER_EACH,
        json.dumps(light),
        json.dumps(HEAVY),
        json.dumps(modules),
        cwd=tmp_path,
    )
    seen: dict[str, dict[str, Any]] = {}
    for line in out.splitlines():
        seen.update(json.loads(line))
    assert seen.pop("parser") == {"heavy": [], "handlers": []}
    assert len(seen) == len(light)
    for command, after in seen.items():
        assert after["heavy"] == [], (command, after)
        assert after["code"] in (0, 1, 2), (command, after)
    assert seen["--help"]["handlers"] == []
    ran = seen[" ".join(light[-1])]["handlers"]
    assert (
        "supplier_sync_dagster.cli.sync" not in ran and "supplier_sync_dagster.cli.batches" in ran
    )


def test_a_dagster_command_loads_its_handler_module_and_dagster_with_it(tmp_path: Path) -> None:
    out = _python(
        "import sys\n"
        "from supplier_sync_dagster.cli import main as cli\n"
        "args = cli.build_parser().parse_args(['sync', '--full'])\n"
        "assert 'dagster' not in sys.modules\n"
        "cli.load_handler(args.handler)\n"
        "print(args.handler, args.preload, 'dagster' in sys.modules)\n",
        cwd=tmp_path,
    )
    assert out.split() == ["supplier_sync_dagster.cli.sync:cmd_sync", "True", "True"]


# ``status`` as the console script runs it, after importing the handler modules named on
# the command line: what it would cost if the parser imported every handler.
_STATUS = """
import importlib, sys, time
started = time.perf_counter()
for module in sys.argv[2:]:
    importlib.import_module(module)
from supplier_sync_dagster.cli import main as cli
assert cli.main(["--db-url", sys.argv[1], "status"]) == 0
print(f"{time.perf_counter() - started:.4f}")
"""


def test_deferring_the_handler_imports_saves_a_light_command_its_start_up(
    tmp_path: Path,
) -> None:
    db_url = f"sqlite:///{tmp_path / 'sync.sqlite3'}"
    modules = sorted({name.partition(":")[0] for name in handler_names()})
    SyncDatabase.open(db_url).dispose()  # status only reads: the database must be there
    _python(_STATUS, db_url, cwd=tmp_path)  # warm file caches
    lazy, eager = [], []
    for _ in range(3):  # interleaved, best of three: another process's load hits both
        lazy.append(float(_python(_STATUS, db_url, cwd=tmp_path).split()[-1]))
        eager.append(float(_python(_STATUS, db_url, *modules, cwd=tmp_path).split()[-1]))
    saving = min(eager) - min(lazy)
    figure = (
        f"status: {min(lazy):.2f} s with its own handler only, {min(eager):.2f} s with every "
        f"handler module imported ({len(modules)}): deferring saves {saving:.2f} s"
    )
    print(figure)
    assert saving >= MIN_SAVING_SECONDS, figure
    assert saving >= MIN_SAVING_SHARE * min(eager), figure


@pytest.mark.parametrize("argv", [["--help"], ["status"], ["sync", "--full"]])
def test_python_dash_m_runs_the_same_command_line(tmp_path: Path, argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "supplier_sync_dagster.cli", "--db-url", "nope://x", *argv],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    if argv == ["--help"]:
        assert done.returncode == 0 and done.stdout.startswith("usage: supplier-sync ")
    else:
        # A bad database URL: the command's one error line, whichever command it is.
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("supplier-sync: error: "), done.stderr
