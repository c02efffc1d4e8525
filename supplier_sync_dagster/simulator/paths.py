"""How city codes travel in URL paths.

A city code is any string of 1-64 characters, ``/``, ``.``, ``'``, ``|``, ``%`` and non-ASCII
included. In ``/v1/cities/{city_code}/...`` it is **one path segment, percent-encoded as RFC
3986 says, with nothing left unescaped but the unreserved characters**: UTF-8 bytes, then
``urllib.parse.quote(code, safe="")``. A code that is exactly ``.`` or ``..`` must also have
its dots encoded (``%2E``), or it would be a dot-segment that clients and proxies collapse.
``encode_city_code`` does exactly this.

The server reads the raw request path (never a decoded one, in which an encoded ``/`` is
indistinguishable from a separator), splits it on literal ``/`` and percent-decodes each
segment. It accepts both ``%2E`` and literal dots, except a whole segment ``.`` or ``..``
(ambiguous: refused with 400). Malformed escapes and invalid UTF-8 are refused with 400.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote_to_bytes

_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")


class PathError(ValueError):
    """A path segment cannot be decoded unambiguously."""


def encode_city_code(code: str) -> str:
    """The path segment that carries ``code`` (see the module docstring)."""
    segment = quote(code, safe="")
    if segment in (".", ".."):
        segment = segment.replace(".", "%2E")
    return segment


def split_raw_path(raw_path: bytes) -> list[bytes]:
    """The raw segments of a path (``b"/v1/cities"`` -> ``[b"v1", b"cities"]``)."""
    return raw_path.split(b"/")[1:] if raw_path.startswith(b"/") else raw_path.split(b"/")


def decode_segment(raw: bytes) -> str:
    """Percent-decode one raw path segment into text.

    Raises:
        PathError: a malformed ``%`` escape, invalid UTF-8, or a bare dot-segment.
    """
    if raw in (b".", b".."):
        raise PathError("a bare '.' or '..' path segment is ambiguous: encode the dots as %2E")
    if _BAD_ESCAPE.search(raw):
        raise PathError("malformed percent-escape in path")
    try:
        return unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError as err:
        raise PathError("path segment is not valid UTF-8 once percent-decoded") from err
