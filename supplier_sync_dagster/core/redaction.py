"""Secrets kept out of every log line, stored error and command output: :func:`redact`.

One function masks a text, wherever it goes:

- the values registered with :func:`register_secret` or :func:`register_url` (the supplier API
  keys, the passwords and query values of the configured URLs and their userinfo as the Basic
  credentials an HTTP client sends, the alert webhook's path), wherever they appear, as ``***``;
- the userinfo of any URL (``https://user:pw@host`` -> ``https://***@host``);
- the values of a URL's credential-like query parameters (a name holding ``token``, ``key``,
  ``secret``, ``sig``, ``pass``, ``pwd``, ``auth``, ``credential`` or ``session``:
  ``?token=abc&page=2`` -> ``?token=***&page=2``); other parameters stay readable (``page``,
  ``cursor``), a configured URL's own query values being registered secrets whatever their
  names;
- the path of a known chat webhook (Slack, Discord, Teams): the URL *is* the credential, so it
  shows as ``https://hooks.slack.com/***``;
- ``Bearer <token>``, ``Authorization: ...`` and ``X-Api-Key: ...``/``api_key=...``/
  ``password=...``-looking pairs (the value masked).

:func:`install_log_redaction` makes every log record of the process pass through it (its
message, and its traceback text when it has one), whichever logger made it and whichever
handler writes it (the command line's, Dagster's, a test's capture). A logger's filter would
not do: Python applies it only to records logged on that logger, not to those its children
propagate, and a handler added later would miss a handler's filter.

Plain Python, no dependency: every entry point (the command line, the Dagster resources)
installs it, and the core's stores call :func:`redact` on the error text they keep.
"""

from __future__ import annotations

import base64
import logging
import re
import threading
import traceback
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

#: What a secret becomes.
MASK = "***"
#: A registered value shorter than this is not masked as free text (it would mask ordinary
#: words); the structural rules (userinfo, credential parameters) still hide it in URLs.
MIN_SECRET_LENGTH = 6

# A URL ends before a space or a quote, and does not take the punctuation that ends a phrase.
_URL = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^\s'\"<>`\\]*[^\s'\"<>`\\.,:;)\]])")
_SECRET_PARAM = re.compile(
    r"([?&;])([^=&#\s]*(?:token|key|secret|sig|pass|pwd|auth|credential|session)[^=&#\s]*)="
    r"([^&#;\s]*)",
    re.IGNORECASE,
)
_PAIR = re.compile(
    r"\b((?:x-)?api[-_]?key|apikey|access[-_]?token|auth[-_]?token|client[-_]?secret|secret"
    r"|password|passwd|authorization)"
    r"([\"']?\s*[:=]\s*[\"']?)"
    r"((?:basic|bearer|token)\s+)?(?!<|(?:basic|bearer|token)\s)([^\s\"',;&)}\]]+)",
    re.IGNORECASE,
)
# Not a challenge's parameters (``Bearer realm="..."``) nor a placeholder (``Bearer <key>``).
_BEARER = re.compile(r"\b(bearer\s+)(?!realm=)([A-Za-z0-9._~+/=-]{6,})", re.IGNORECASE)
# Hosts whose URL path is the credential itself (incoming webhooks).
_WEBHOOK_HOSTS = re.compile(
    r"^(?:hooks\.slack\.com|(?:[a-z0-9-]+\.)?discord(?:app)?\.com|[a-z0-9-]+\.webhook\.office\.com"
    r"|outlook\.office(?:365)?\.com)(?::\d+)?$",
    re.IGNORECASE,
)

_lock = threading.Lock()
_secrets: set[str] = set()
_secret_pattern: re.Pattern[str] | None = None


def register_secret(value: str | None) -> None:
    """Masks ``value`` (and its percent-encoded form) wherever :func:`redact` meets it, from now
    on, in this process.

    Args:
        value: A secret (an API key, a password, a webhook's path); None, empty or shorter
            than :data:`MIN_SECRET_LENGTH` registers nothing.
    """
    global _secret_pattern
    if not value or len(value) < MIN_SECRET_LENGTH:
        return
    forms = {value, quote(value, safe="")} - _secrets
    if not forms:
        return
    with _lock:
        _secrets.update(forms)
        # Longest first: a secret that contains another is masked whole.
        alternatives = sorted(_secrets, key=len, reverse=True)
        _secret_pattern = re.compile("|".join(re.escape(s) for s in alternatives))


def register_url(url: str | None, *, whole_path: bool = False) -> None:
    """Registers the secrets a configured URL carries: its password (and its userinfo as Basic
    credentials) and its query values.

    Args:
        url: A URL from the settings or the suppliers file; None registers nothing.
        whole_path: The path is a credential too (a webhook URL): register it.
    """
    if not url:
        return
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        register_secret(url)  # not parseable: its whole text is all we can hide
        return
    register_secret(parts.password)
    if parts.username or parts.password:
        # httpx sends the userinfo as 'Authorization: Basic <base64>', which a server may echo
        # in free text, where no structural rule finds it.
        userinfo = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
        register_secret(base64.b64encode(userinfo.encode()).decode())
    for _, value in parse_qsl(parts.query, keep_blank_values=False):
        register_secret(value)
    if whole_path:
        register_secret(parts.path.lstrip("/"))


def redact(text: str) -> str:
    """``text`` with every secret it shows masked (see the module docstring).

    Args:
        text: Any text bound for a log, a store or the terminal.
    """
    if not text:
        return text
    pattern = _secret_pattern
    if pattern is not None:
        text = pattern.sub(MASK, text)
    if "://" in text:
        text = _URL.sub(_mask_url, text)
    text = _PAIR.sub(_mask_pair, text)
    return _BEARER.sub(lambda m: m.group(1) + MASK, text)


def redact_url(url: str) -> str:
    """A configured URL as shown to an operator: :func:`redact`, and every query value masked
    (a base URL's query is there to authenticate).

    Args:
        url: The URL.
    """
    shown = redact(url)
    head, sep, query = shown.partition("?")
    if not sep:
        return shown
    query, hash_, fragment = query.partition("#")
    masked = "&".join(
        f"{name}={MASK}" if eq else name
        for name, eq, _ in (item.partition("=") for item in query.split("&"))
    )
    return f"{head}?{masked}{hash_}{fragment and MASK}"


def bounded(text: str, limit: int = 1024) -> str:
    """:func:`redact`, then cut to ``limit`` characters: what a stored error column keeps (cut
    after, so that no half secret escapes the mask).

    Args:
        text: The error text.
        limit: The column's length.
    """
    return redact(text)[:limit]


def _mask_url(match: re.Match[str]) -> str:
    scheme, rest = match.group(1), match.group(2)
    cut = len(rest)
    for stop in "/?#":
        at = rest.find(stop)
        if at != -1:
            cut = min(cut, at)
    authority, tail = rest[:cut], rest[cut:]
    if "@" in authority:
        authority = f"{MASK}@{authority.rsplit('@', 1)[1]}"
    if _WEBHOOK_HOSTS.match(authority.rsplit("@", 1)[-1]) and tail.strip("/"):
        return f"{scheme}{authority}/{MASK}"
    if "=" in tail:
        tail = _SECRET_PARAM.sub(lambda m: f"{m.group(1)}{m.group(2)}={MASK}", tail)
    return f"{scheme}{authority}{tail}"


def _mask_pair(match: re.Match[str]) -> str:
    if match.group(4) == MASK:
        return match.group(0)
    return f"{match.group(1)}{match.group(2)}{match.group(3) or ''}{MASK}"


class _RedactingFactory:
    """A log record factory that masks each record's message and traceback as it is made."""

    def __init__(self, inner: Callable[..., logging.LogRecord]) -> None:
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.inner(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format: logging reports it when a handler formats it
            return record
        shown = redact(message)
        if shown != message:
            record.msg, record.args = shown, None
        if record.exc_info and record.exc_info[1] is not None:
            text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            record.exc_text = redact(text)  # formatters use it instead of the raw traceback
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return record


def install_log_redaction() -> None:
    """Makes every log record of this process pass through :func:`redact` (once; calling it
    again changes nothing)."""
    with _lock:
        current = logging.getLogRecordFactory()
        if not isinstance(current, _RedactingFactory):
            logging.setLogRecordFactory(_RedactingFactory(current))


def log_redaction_installed() -> bool:
    """Whether :func:`install_log_redaction` ran in this process."""
    return isinstance(logging.getLogRecordFactory(), _RedactingFactory)
