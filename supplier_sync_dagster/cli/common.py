"""What the command groups share, parsers and handlers alike: argument types, how a command
names its handler, JSON output, error lines and the sync database's lifetime.

Light on purpose: every command's parser imports this module, so it imports nothing a
command's handler alone needs (Dagster, pandas, a server).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from supplier_sync_dagster.core.store.db import SyncDatabase

ACCOUNT_HELP = (
    "the account (supplier.account) of $SUPPLIER_SYNC_SUPPLIERS_FILE; unset: the one account "
    "of the SUPPLIER_SYNC_SUPPLIER_* settings"
)

T = TypeVar("T")


class Subcommands(Protocol):
    """The ``supplier-sync`` subparsers (what ``add_subparsers`` returns), as a command
    group's parser module sees them."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        """A new command ``name``; ``kwargs`` as for :class:`argparse.ArgumentParser`."""
        ...


def handled_by(
    parser: argparse.ArgumentParser,
    handler: str,
    *,
    preload: bool = False,
    root_log: bool = True,
) -> None:
    """Names the function that runs ``parser``'s command, as ``"module:function"``.

    :func:`supplier_sync_dagster.cli.main.main` imports that module only when the command
    runs, so that parsing (and ``--help``) loads no handler.

    Args:
        parser: The command's parser.
        handler: ``"module:function"``; the function takes the parsed arguments and returns
            the exit status.
        preload: The console script imports the module before the command starts, with the
            cyclic collector off (:func:`supplier_sync_dagster.cli.main.run`): for the
            handlers that import Dagster.
        root_log: Whether the command logs through a handler on the root logger; False for
            a command whose loggers have their own handlers (each line would show twice).
    """
    parser.set_defaults(handler=handler, preload=preload, root_log=root_log)


def positive_int(text: str, least: int = 1) -> int:
    """An argument type: a whole number of at least ``least``.

    Raises:
        argparse.ArgumentTypeError: Not a whole number, or less than ``least``.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argument type: a whole number of at least 0 (``--processes 0``: none)."""
    return positive_int(text, least=0)


def add_json_flag(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """The ``--json`` option of a command that prints JSON instead of text when given."""
    parser.add_argument("--json", action="store_true", help=help)


def add_who_and_why(parser: argparse.ArgumentParser, who: str = "who (recorded)") -> None:
    """The ``--by`` and ``--reason`` options of an action that the audit trail records."""
    parser.add_argument("--by", required=True, help=who)
    parser.add_argument("--reason", required=True, help="why (recorded)")


def add_audited_actions(
    group: Subcommands, actions: dict[str, str], handler: str, *, ids_help: str
) -> None:
    """Commands that act on rows named by id, each recorded in the audit trail with who and
    why (``dead-letters retry|ignore``, ``outbox retry|cancel``).

    Args:
        group: The command group's subparsers.
        actions: Each command's name and what it does (its help).
        handler: The handler of every one of them (:func:`handled_by`).
        ids_help: The help of their ``ids`` argument.
    """
    for name, what in actions.items():
        act = group.add_parser(name, help=what + " (recorded in the audit trail)")
        act.add_argument("ids", type=int, nargs="+", help=ids_help)
        add_who_and_why(act)
        handled_by(act, handler)


def first(*values: T | None) -> T | None:
    """The first value that is not None (an option, then a setting, then a default)."""
    return next((v for v in values if v is not None), None)


def dumps(value: Any, *, indent: int | None = None) -> str:
    """``value`` as JSON for an operator: keys sorted, text as it is, the rest as ``str``."""
    return json.dumps(value, default=str, ensure_ascii=False, sort_keys=True, indent=indent)


def warn(message: str) -> None:
    """One ``supplier-sync: ...`` line on stderr: why a command did not complete."""
    print(f"supplier-sync: {message}", file=sys.stderr)


@contextmanager
def open_db(url: str | None, *, create_schema: bool = True) -> Iterator[SyncDatabase]:
    """The sync database at ``url`` (``--db-url``, else the settings), disposed of after."""
    db = SyncDatabase.open(url, create_schema=create_schema)
    try:
        yield db
    finally:
        db.dispose()
