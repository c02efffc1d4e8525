"""What the command groups share, parsers and handlers alike: argument types, how a command
names its handler, JSON output, error lines and the sync database's lifetime.

Light on purpose: every command's parser imports this module, so it imports nothing a
command's handler alone needs (Dagster, pandas, a server).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Protocol, TypeVar

from supplier_sync_dagster.core.errors import ConfigError, InvalidTimestamp
from supplier_sync_dagster.core.inputs.operator_input import MAX_ID
from supplier_sync_dagster.core.inputs.text import json_printable
from supplier_sync_dagster.core.inputs.timestamps import parse_as_of
from supplier_sync_dagster.core.settings import env_name
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.engine import (
    check_db_url,
    missing_sqlite_file,
    resolve_db_url,
)

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
    read_only: bool = False,
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
        read_only: The command only reads the sync database: it refuses a SQLite file that
            does not exist instead of creating it (:func:`refuse_missing_db`).
    """
    parser.set_defaults(handler=handler, preload=preload, root_log=root_log, read_only=read_only)
    # ``--db-url`` after the command too (``status --db-url URL``), as before it; unset, it
    # leaves the one given before the command (or none) as it is.
    with contextlib.suppress(argparse.ArgumentError):  # the command has its own --db-url
        parser.add_argument("--db-url", default=argparse.SUPPRESS, help="the sync database URL")


MAX_COUNT = 10**9
"""The largest count or limit an option takes unless it has a bound of its own: far past
any real catalog, and within every integer column and SQL ``LIMIT``."""
MAX_WORKERS = 64
"""The most threads or processes an option starts: each holds database connections."""
MAX_DURATION_SECONDS = 100 * 365 * 86_400
"""The longest duration an option takes (a century): now minus or plus it is still a date."""
_SHOWN = 40  # characters of a refused value an error line shows


def _range(low: float | None, high: float | None, *, low_open: bool = False) -> str:
    def num(x: float) -> str:  # 3153600000, not 3.1536e+09
        if isinstance(x, int) or (x.is_integer() and abs(x) < 1e15):
            return str(int(x))
        return f"{x:g}"

    if high is None:
        return f"more than {num(low or 0)}" if low_open else f"at least {num(low or 0)}"
    if low is None:
        return f"at most {num(high)}"
    span = f"{num(low)} and at most {num(high)}"
    return f"more than {span}" if low_open else f"within {num(low)}..{num(high)}"


N = TypeVar("N", int, float)


def int_within(low: int | None, high: int | None = None) -> Callable[[str], int]:
    """An argument type: a whole number from ``low`` to ``high`` (None: no bound), both
    included; the error names the range.

    Example:
        >>> parser.add_argument("--page-size", type=int_within(1, 500))  # doctest: +SKIP
    """
    return _within(int, "a whole number", low, high)


def float_within(
    low: float | None, high: float | None = None, *, low_open: bool = False
) -> Callable[[str], float]:
    """An argument type: a finite number from ``low`` to ``high`` (None: no bound), both
    included unless ``low_open`` (then it must exceed ``low``: a rate, a duration).

    Example:
        >>> parser.add_argument("--overlap-seconds", type=float_within(0, 604800))  # doctest: +SKIP
    """
    return _within(float, "a number", low, high, low_open=low_open)


def _within(
    kind: Callable[[str], N],
    what: str,
    low: float | None,
    high: float | None,
    *,
    low_open: bool = False,
) -> Callable[[str], N]:
    def parse(text: str) -> N:
        shown = text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
        try:
            value = kind(text)
        except ValueError:  # not a number, or more digits than int() reads
            raise argparse.ArgumentTypeError(f"must be {what}, not {shown!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be {_range(low, high, low_open=low_open)}, not {shown.strip()}"
            )
        return value

    parse.__name__ = kind.__name__ if isinstance(kind, type) else "number"
    return parse


def duration(unit_seconds: int = 1, *, zero: bool = False) -> Callable[[str], float]:
    """An argument type: a duration in units of ``unit_seconds`` (3600: hours), more than 0
    (or 0 too when ``zero``) and at most :data:`MAX_DURATION_SECONDS`."""
    return float_within(0, MAX_DURATION_SECONDS / unit_seconds, low_open=not zero)


rate = float_within(0, None, low_open=True)
"""An argument type: requests per second, more than none."""
row_id = int_within(1, MAX_ID)
"""An argument type: the id of a row (a dead letter, an outbox event, a supplier)."""
positive_int = int_within(1, MAX_COUNT)
"""An argument type: a count or limit of at least 1."""
non_negative_int = int_within(0, MAX_COUNT)
"""An argument type: a count of at least 0 (``--processes 0``: none)."""
workers = int_within(1, MAX_WORKERS)
"""An argument type: threads or processes to start (at least 1)."""


def as_of(text: str) -> datetime:
    """An argument type: a time, ISO 8601 with a zone (as naive UTC, the database's form)."""
    try:
        return parse_as_of(text)
    except InvalidTimestamp as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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
        act.add_argument("ids", type=row_id, nargs="+", help=ids_help)
        add_who_and_why(act)
        handled_by(act, handler)


def first(*values: T | None) -> T | None:
    """The first value that is not None (an option, then a setting, then a default)."""
    return next((v for v in values if v is not None), None)


def dumps(value: Any, *, indent: int | None = None) -> str:
    """``value`` as JSON for an operator: keys sorted, text as it is but for characters a
    terminal obeys (``core.inputs.text``: escaped, the same JSON value), the rest as ``str``."""
    text = json.dumps(value, default=str, ensure_ascii=False, sort_keys=True, indent=indent)
    return json_printable(text)


def warn(message: str) -> None:
    """One ``supplier-sync: ...`` line on stderr: why a command did not complete."""
    print(f"supplier-sync: {message}", file=sys.stderr)


def check_db_option(args: argparse.Namespace) -> None:
    """Checks the sync database a command was given before it starts: a ``--db-url`` of a
    supported backend (its error names the option, not the setting), and, for a command that
    only reads (:func:`handled_by`'s ``read_only``), a SQLite file that is there (it would
    create the file and its folder).

    Raises:
        ConfigError: ``--db-url`` is malformed or unsupported, or the command reads a SQLite
            database whose file does not exist.
    """
    option = getattr(args, "db_url", None)
    if option:
        check_db_url(option, source="--db-url")
    if not getattr(args, "read_only", False):
        return
    missing = missing_sqlite_file(resolve_db_url(option))
    if missing is not None:
        raise ConfigError(
            f"no sync database at {missing}: {args.command} only reads one (check --db-url or "
            f"{env_name('db_url')}; a sync or `supplier-sync db migrate` creates it)"
        )


@contextmanager
def open_db(url: str | None, *, create_schema: bool = True) -> Iterator[SyncDatabase]:
    """The sync database at ``url`` (``--db-url``, else the settings), disposed of after."""
    db = SyncDatabase.open(url, create_schema=create_schema)
    try:
        yield db
    finally:
        db.dispose()
