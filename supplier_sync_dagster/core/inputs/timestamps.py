"""Times that people and callers hand in: ``trace --as-of``, the read API's ``as_of``."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from supplier_sync_dagster.core.errors import InvalidTimestamp

# ISO 8601 with a zone: a date, a time to the minute at least, then Z or an offset.
_AS_OF = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,6})?)?"
    r"(Z|z|[+-][0-9]{2}:?[0-9]{2})"
)


def parse_as_of(text: str) -> datetime:
    """A time as given by a person or a caller: ISO 8601 with a zone (``2026-05-01T14:00Z``,
    ``2026-05-01 16:00:00+02:00``), as naive UTC (the database clock's form).

    Raises:
        InvalidTimestamp: Not that form, or not a real time.
    """
    raw = text.strip()
    if len(raw) > 40 or not _AS_OF.fullmatch(raw):
        raise InvalidTimestamp(
            f"{raw[:40]!r} is not an ISO 8601 time with a zone, e.g. 2026-05-01T14:00:00Z "
            "or 2026-05-01T16:00:00+02:00"
        )
    try:
        value = datetime.fromisoformat(raw.upper().replace("Z", "+00:00"))
    except ValueError as err:
        raise InvalidTimestamp(f"{raw!r} is not a real time: {err}") from None
    return value.astimezone(UTC).replace(tzinfo=None)
