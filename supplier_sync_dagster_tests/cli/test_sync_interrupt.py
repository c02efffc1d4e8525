"""A signal that reaches ``sync`` outside its Dagster run, where the work it interrupted
(a database driver, a connection pool) then fails with an error of its own: the command
says it was interrupted, in one line, with 128 + the signal's number, not that error."""

from __future__ import annotations

import os
import signal
import sqlite3
from typing import Any

import pytest

from supplier_sync_dagster.cli import sync_runner
from supplier_sync_dagster.core.errors import SyncInterrupted
from supplier_sync_dagster_tests.cli.test_main import (  # noqa: F401 (cli_home: autouse)
    assert_one_line_error,
    cli_home,
    run,
)


def _interrupted_then_broken(**kwargs: Any) -> Any:
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # SignalLog's handler raises here
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a call for the handler to run in
    except SyncInterrupted:
        # What SQLAlchemy's pool does with a connection a signal interrupted mid-call.
        raise sqlite3.ProgrammingError("Cannot operate on a closed database.") from None
    raise AssertionError("the signal never arrived")


@pytest.mark.parametrize("mode", ["--full", "--incremental"])
def test_an_error_after_a_signal_is_reported_as_the_interruption(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, mode: str
):
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", "k")
    monkeypatch.setattr(sync_runner, "run_full_sync", _interrupted_then_broken)
    monkeypatch.setattr(sync_runner, "run_incremental_sync", _interrupted_then_broken)
    out = run(capsys, "sync", mode)
    line = assert_one_line_error(out, code=128 + signal.SIGTERM)
    assert "interrupted (SIGTERM) outside its run" in line, line
    assert "ProgrammingError" not in out.err


def test_an_error_without_a_signal_is_still_the_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    def broken(**kwargs: Any) -> Any:
        raise sqlite3.ProgrammingError("Cannot operate on a closed database.")

    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", "k")
    monkeypatch.setattr(sync_runner, "run_full_sync", broken)
    out = run(capsys, "sync", "--full")
    line = assert_one_line_error(out, code=1)
    assert "ProgrammingError: Cannot operate on a closed database." in line, line
