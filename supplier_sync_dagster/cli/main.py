"""The ``supplier-sync`` command line."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import io
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from supplier_sync_dagster.cli.common import check_db_option
from supplier_sync_dagster.cli.parsers import (
    accounts,
    batches,
    db,
    governance,
    health,
    operators,
    outbox,
    servers,
    sync,
)
from supplier_sync_dagster.core.errors import SupplierSyncError
from supplier_sync_dagster.core.redaction import install_log_redaction, redact
from supplier_sync_dagster.core.settings import env_name

Handler = Callable[[argparse.Namespace], int]

# Every command, in the order ``--help`` lists them; each group's parser module says how
# its commands parse and which handler runs each.
_COMMANDS = (
    sync.add_demo,
    sync.add_sync,
    batches.add_export,
    sync.add_lease_demo,
    batches.add_status_and_stalls,
    servers.add_simulate_and_daemon,
    governance.add_review,
    governance.add_gate,
    governance.add_task,
    sync.add_replay,
    sync.add_reconcile,
    outbox.add_commands,
    operators.add_commands,
    health.add_commands,
    accounts.add_commands,
    db.add_commands,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``supplier-sync``."""
    parser = argparse.ArgumentParser(prog="supplier-sync", description=__doc__)
    parser.add_argument(
        "--db-url",
        default=None,
        help=f"sync database URL (default: ${env_name('db_url')}, else a SQLite file in "
        f"${env_name('home')} or ./.supplier_sync)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at INFO level, with the Dagster run's log and the traceback of an error",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def load_handler(name: str) -> Handler:
    """The handler a command names (``"module:function"``), its module imported now.

    This is the command line's one deferred import: parsing the arguments loads no
    handler module, so a command pays only for the modules its own handler imports
    (``supplier_sync_dagster_tests/cli/test_startup.py`` measures what that saves).
    """
    module, _, function = name.partition(":")
    handler: Handler = getattr(importlib.import_module(module), function)
    return handler


def _stdout_to_devnull() -> None:
    """Points stdout at /dev/null, so that the interpreter's last flush finds no closed pipe
    (the Python docs' recipe for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass  # stdout is no file (in-process callers): nothing is flushed at exit


def _one_line(err: BaseException) -> str:
    text = " ".join(redact(str(err)).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``supplier-sync`` console script.

    Returns:
        0 on success; 1 when the work did not complete (a sync failed, was gated or
        skipped) or on an unexpected error; 2 on an error the program names (bad input or
        configuration, an unknown batch or task, an unreachable database or supplier);
        130 when interrupted (a sync stopped by SIGINT or SIGTERM: 128 + its number, 130 or
        143); 141 (128 + SIGPIPE) when stdout was closed (``| head``).
    """
    args = build_parser().parse_args(argv)
    # Every log line of the process (ours, httpx's, Dagster's) masks secrets from here on.
    install_log_redaction()
    if args.root_log:
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.WARNING,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    if not args.verbose:
        # Retries are expected (and counted); the summary reports them, not the terminal.
        logging.getLogger("supplier_sync_dagster.core.supplier").setLevel(logging.ERROR)
    try:
        check_db_option(args)
        status = int(load_handler(args.handler)(args))
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        # The reader of stdout (`| head -1`) has what it wanted: stop quietly, as a Unix
        # tool killed by SIGPIPE does.
        _stdout_to_devnull()
        return 128 + signal.SIGPIPE
    except SupplierSyncError as err:
        print(f"supplier-sync: error: {' '.join(redact(str(err)).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("supplier-sync: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if args.verbose:
            print(redact(traceback.format_exc()), end="", file=sys.stderr)
        hint = "" if args.verbose else " (run with -v for the traceback)"
        print(f"supplier-sync: error: {_one_line(err)}{hint}", file=sys.stderr)
        return 1


# The young-generation threshold of the console script's process, from its start: the
# one a sync sets anyway (``core.sync.runtime.GC_GEN0_THRESHOLD``, an import to avoid here).
START_GC_THRESHOLD = 50_000


def run() -> NoReturn:
    """The ``supplier-sync`` console script: :func:`main` with the process's arguments, then
    a quick exit (:func:`exit_quickly`).

    A command that runs Dagster imports Dagster, SQLAlchemy, pandas and pandera: millions of
    objects, all kept. While they load, CPython's cyclic collector would re-scan them again
    and again, even with a raised threshold, and they are garbage only at exit. So the
    parser is built and the handler module of a command that asks for it (``preload``) is
    imported with the collector off, then frozen (never scanned again; reference counting
    still frees them), and the collector runs from then on with the young-generation
    threshold a sync sets anyway.
    """
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, START_GC_THRESHOLD), gen1, gen2)
    gc.disable()
    # Ctrl-C while the command loads is noted, not raised: a KeyboardInterrupt raised in a
    # finalizer or under an imported library's bare except would be lost, and the sync start.
    interrupted: list[int] = []
    default = signal.signal(signal.SIGINT, lambda number, _frame: interrupted.append(number))
    try:
        preload = _preload_name(sys.argv[1:])
        if preload is not None:
            importlib.import_module(preload)
            gc.freeze()
    finally:
        signal.signal(signal.SIGINT, default)
        gc.enable()
    if interrupted:
        # Nothing has started, nothing to resume.
        print("supplier-sync: interrupted before the command started", file=sys.stderr)
        exit_quickly(128 + signal.SIGINT)
    try:
        status = main()
    except KeyboardInterrupt:
        # Ctrl-C while the arguments are read, before main() handles it itself.
        print("supplier-sync: interrupted before the command started", file=sys.stderr)
        status = 128 + signal.SIGINT
    exit_quickly(status)


def _preload_name(argv: Sequence[str]) -> str | None:
    """The handler module that the command of ``argv`` asks :func:`run` to import first
    (None when the arguments do not parse: :func:`main` then says why)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit:  # --help, a usage error: main() prints it
        return None
    return str(args.handler).partition(":")[0] if args.preload else None


def exit_quickly(code: int) -> NoReturn:
    """Ends the process with ``code`` without Python's module teardown.

    Interpreter finalization frees every object of every loaded module one by one: with
    Dagster, SQLAlchemy, pandas and pandera loaded that takes a noticeable part of each
    command, for memory the operating system takes back at once. What finalization does
    that matters still happens, in its order: other threads are waited for (and executors
    told to stop), exit handlers run (logging's, multiprocessing's, Dagster's), the
    standard streams are flushed.
    """
    shutdown = getattr(threading, "_shutdown", None)  # what finalization calls first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # A closed pipe or stream: nothing is left to say there.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
