"""A record whose bytes could not be decoded, kept in its place on its page.

A page whose body is not valid UTF-8, or not valid JSON, only inside one record still has
its other records: the page decoder (``supplier.models.decode_page``) puts an
:class:`UndecodableRecord` where the broken one stood, and normalization turns it into that
record's dead letter (``INVALID_UTF8``, ``INVALID_JSON``), so the page's count and every
record's position stay as the supplier sent them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

UndecodableCode = Literal["INVALID_UTF8", "INVALID_JSON"]


@dataclass(frozen=True, slots=True)
class UndecodableRecord:
    """One element of a page's record array that could not be decoded.

    Attributes:
        error_code: ``INVALID_UTF8`` (bytes that are not UTF-8) or ``INVALID_JSON``.
        message: What is wrong and where, with the offending text shown safely.
        hotel_id: The record's ``hotel_id`` when it could still be read, else None.
        version: The record's ``version`` when it could still be read, else None.
    """

    error_code: UndecodableCode
    message: str
    hotel_id: str | None = None
    version: int | None = None
