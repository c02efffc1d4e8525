"""Cron expressions, checked wherever one enters: ``suppliers.yaml`` schedules and ``task set
--cron`` (the command line and the launchpad's task settings job).

One strict checker, :func:`check_cron`, with no dependency (``core`` may not import Dagster,
whose ``is_valid_cron_string`` lives there, and ``croniter`` is not installed). It accepts a
subset of what Dagster's schedules accept, so a schedule the suppliers file sets never fails
the code location's load:

- five fields, ``minute hour day-of-month month day-of-week`` (UTC), each a comma list of
  ``*``, ``n`` or ``a-b`` (``a <= b``), either optionally followed by ``/step`` after ``*`` or
  a range; months ``1-12`` or ``jan``-``dec``, weekdays ``0-7`` (0 and 7 Sunday) or
  ``sun``-``sat``, any case;
- or one macro: ``@hourly``, ``@daily``, ``@midnight``, ``@weekly``, ``@monthly``,
  ``@yearly``, ``@annually``.

It refuses a day of month that none of the months given has (``0 0 30 2 *``, whatever the
weekday), and what some cron dialects accept but others read differently (seconds or years
fields, ``L``, ``W``, ``#``, ``?``, ``5/15``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from supplier_sync_dagster.core.errors import ConfigError

# The width of ``supplier_sync_task.cron_expr``.
MAX_CRON_LEN = 64
CRON_MACROS = frozenset(
    {"@hourly", "@daily", "@midnight", "@weekly", "@monthly", "@yearly", "@annually"}
)
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_WEEKDAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# Days in each month, February in a leap year (29 February fires, every fourth year).
_MONTH_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
_ITEM = re.compile(r"^(?:(\*)|([0-9A-Za-z]{1,3})(?:-([0-9A-Za-z]{1,3}))?)(?:/([0-9]{1,2}))?$")


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()
    names_from: int = 0

    def value(self, text: str) -> int:
        if text.isdigit():
            number = int(text)
        elif text.lower() in self.names:
            number = self.names.index(text.lower()) + self.names_from
        else:
            raise ValueError(f"{self.name} {text!r} is not a number")
        if not self.low <= number <= self.high:
            raise ValueError(f"{self.name} {number} is outside {self.low}-{self.high}")
        return number

    def values(self, text: str) -> set[int]:
        """The values one field's text selects."""
        found: set[int] = set()
        for item in text.split(","):
            match = _ITEM.match(item)
            if match is None:
                raise ValueError(f"{self.name} {item!r} is not *, n or a-b, with an optional /step")
            star, first, last, step = match.groups()
            if first is not None and last is None and step is not None:
                raise ValueError(f"{self.name} {item!r}: a /step follows * or a range a-b")
            low = self.low if star else self.value(first)
            high = self.high if star else self.value(last) if last else low
            if low > high:
                raise ValueError(f"{self.name} range {item!r} runs backwards")
            every = int(step) if step else 1
            if not 1 <= every <= self.high - self.low + 1:
                raise ValueError(
                    f"{self.name} step {item!r} is outside 1-{self.high - self.low + 1}"
                )
            found.update(range(low, high + 1, every))
        return found


_FIELDS = (
    _Field("minute", 0, 59),
    _Field("hour", 0, 23),
    _Field("day of month", 1, 31),
    _Field("month", 1, 12, _MONTHS, 1),
    _Field("day of week", 0, 7, _WEEKDAYS, 0),
)


def check_cron(text: str, *, what: str = "cron") -> str:
    """``text`` as a checked cron expression: five fields or a macro (the module says which).

    Args:
        text: The expression as given; runs of blanks between fields count as one space.
        what: Where it was given, to begin the messages with (``--cron``).

    Returns:
        The expression with single spaces between its fields.

    Raises:
        ConfigError: The expression is malformed, out of range or never fires; the message
            quotes it and names the field.
    """
    expr = " ".join(text.split())
    if len(expr) > MAX_CRON_LEN:
        raise ConfigError(f"{what} {_short(text)} is longer than {MAX_CRON_LEN} characters")
    if expr.lower() in CRON_MACROS:
        return expr.lower()
    parts = expr.split(" ")
    if len(parts) != len(_FIELDS):
        raise ConfigError(
            f"{what} {expr!r} has {len(parts)} fields; write five (minute hour day-of-month "
            "month day-of-week, e.g. '0 2 * * *') or a macro such as @daily"
        )
    try:
        selected = [field.values(part) for field, part in zip(_FIELDS, parts, strict=True)]
    except ValueError as err:
        raise ConfigError(f"{what} {expr!r}: {err}") from None
    # Whatever the weekday says, as Dagster's check does (its schedules refuse 30 February).
    days, months = selected[2], selected[3]
    if not any(d <= _MONTH_DAYS[m - 1] for d in days for m in months):
        raise ConfigError(f"{what} {expr!r}: none of its months has that day of month")
    return expr


def _short(text: str) -> str:
    return repr(text[:MAX_CRON_LEN] + ("..." if len(text) > MAX_CRON_LEN else ""))


__all__ = ["CRON_MACROS", "MAX_CRON_LEN", "check_cron"]
