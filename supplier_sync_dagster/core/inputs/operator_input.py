"""What a person types (a CLI option, a launchpad form's field), bounded before anything
uses it: ids within a signed BIGINT (:data:`MAX_ID`), and JSON (``dead-letters fix --patch``,
a form's JSON field) of bounded size and depth (:func:`load_operator_json`).

A JSON text's size and how deep its arrays and objects nest are measured first, over the text
itself and without recursion: a patch nested 20,000 levels deep is a one-line
:class:`~supplier_sync_dagster.core.errors.ConfigError`, never a ``RecursionError`` of the
parser or of the code that walks the value afterwards (a merge patch, a canonical dump).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, Final, NoReturn

from supplier_sync_dagster.core.errors import ConfigError

MAX_ID: Final = 2**63 - 1
"""The largest id of a row an operator names: every id column is a signed BIGINT."""
MAX_INPUT_JSON_DEPTH: Final = 32
"""The deepest nesting of arrays and objects an operator's JSON may have (a hotel record
nests 6 levels: hotel, rooms, room, rate plans, plan, price)."""
MAX_INPUT_JSON_BYTES: Final = 1 << 20
"""The largest operator's JSON, in UTF-8 bytes (a whole hotel record is a few kB)."""

# A JSON string (escapes included, so a quoted bracket is skipped), or a bracket.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)


def json_depth(text: str, *, stop_past: int | None = None) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (0: a scalar), counted over the
    text without parsing it; brackets inside strings do not count.

    Args:
        text: The JSON text (malformed text is measured as far as its brackets go).
        stop_past: Stop counting once the depth exceeds this (what is returned then
            only says "deeper").
    """
    depth = deepest = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_past is not None and deepest > stop_past:
                    break
        elif token in ("]", "}"):
            depth -= 1
    return deepest


def check_row_ids(ids: Iterable[int], *, what: str = "ids") -> list[int]:
    """Row ids an operator named (a launchpad form's ``ids``), each within 1..:data:`MAX_ID`.

    Raises:
        ConfigError: One is outside the range (past a signed BIGINT no driver binds it).
    """
    out = list(ids)
    bad = [i for i in out if isinstance(i, bool) or not 1 <= i <= MAX_ID]
    if bad:
        raise ConfigError(f"{what} must be within 1..{MAX_ID}, not {', '.join(map(str, bad[:3]))}")
    return out


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def load_operator_json(
    text: str,
    *,
    what: str,
    max_depth: int = MAX_INPUT_JSON_DEPTH,
    max_bytes: int = MAX_INPUT_JSON_BYTES,
) -> Any:
    """Parses an operator's JSON ``text`` once its size and depth are known to be bounded.

    Args:
        text: The JSON text.
        what: What it is, for the error (``--patch``, ``thresholds_json``).
        max_depth: The deepest nesting allowed.
        max_bytes: The most UTF-8 bytes allowed.

    Returns:
        The value (``NaN`` and ``Infinity`` are refused: they are not JSON).

    Raises:
        ConfigError: Too large, nested too deep, or not JSON; one line that names ``what``.
    """
    if len(text) > max_bytes or len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise ConfigError(f"{what} is larger than {max_bytes} bytes")
    if json_depth(text, stop_past=max_depth) > max_depth:
        raise ConfigError(f"{what} nests deeper than {max_depth} levels of arrays and objects")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as err:  # a JSONDecodeError, a bad constant, an integer of 4300+ digits
        raise ConfigError(f"{what} is not JSON: {err}") from None
