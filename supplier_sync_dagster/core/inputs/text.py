"""Operator text: what an operator may type into a recorded field, and how stored text is shown.

A terminal obeys some characters instead of showing them: a newline starts what looks like
another record, an ANSI escape (``ESC [ 2 J``) clears the screen or recolours it, a bidi
override reverses what follows, a zero-width character makes two names look alike. Such
characters (Unicode categories Cc: C0, DEL and C1 controls; Cf: format characters, bidi
overrides and isolates among them; Zl and Zp: line and paragraph separators; Cs: lone
surrogates) are refused in what an operator records (:func:`unsafe_characters`), and escaped
wherever stored text is printed (:func:`printable`, :func:`json_printable`), so that rows
written before the refusal cannot forge a line either.
"""

from __future__ import annotations

import unicodedata

_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def _unsafe(ch: str) -> bool:
    return unicodedata.category(ch) in _UNSAFE_CATEGORIES


def unsafe_characters(text: str) -> list[str]:
    """The characters of ``text`` that a terminal would obey rather than show, in order."""
    if text.isprintable():  # the common case; printable text has none of them
        return []
    return [ch for ch in text if _unsafe(ch)]


def escaped(ch: str) -> str:
    """One character as Python writes it in a literal: ``\\x1b``, ``\\u202e``, ``\\U000e0001``."""
    n = ord(ch)
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def printable(text: str) -> str:
    """``text`` with every character a terminal would obey written as its escape (``\\n``
    as ``\\x0a``, ESC as ``\\x1b``); other text, non-ASCII letters included, as it is."""
    if text.isprintable():
        return text
    return "".join(escaped(ch) if _unsafe(ch) else ch for ch in text)


def json_printable(json_text: str) -> str:
    """JSON text with the same characters written as JSON escapes (``\\u001b``): the same
    value to a JSON reader, nothing a terminal obeys. JSON's own syntax is ASCII, so such a
    character can only be inside a string, where an escape means the same."""
    if json_text.isprintable():
        return json_text
    return "".join(_json_escaped(ch) if _unsafe(ch) else ch for ch in json_text)


def _json_escaped(ch: str) -> str:
    n = ord(ch)
    if n < 0x10000:
        return f"\\u{n:04x}"
    n -= 0x10000  # JSON writes a character beyond the BMP as its UTF-16 surrogate pair
    return f"\\u{0xD800 + (n >> 10):04x}\\u{0xDC00 + (n & 0x3FF):04x}"
