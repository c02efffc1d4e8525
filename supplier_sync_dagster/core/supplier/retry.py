"""Retry policy: bounded attempts, bounded total wait, full-jitter backoff, Retry-After parsing."""

from __future__ import annotations

import email.utils
import math
import random
from dataclasses import dataclass

from supplier_sync_dagster.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a call retries transient failures.

    Attributes:
        max_attempts: Requests sent at most per call, the first one included.
        base_delay: Backoff ceiling of the first retry, in seconds; it doubles per retry.
        max_delay: Largest backoff ceiling, in seconds.
        max_total_wait: Seconds a call may spend sleeping between attempts (backoff and
            Retry-After together). A Retry-After beyond what is left ends the call at once.
        max_retry_after: Longest Retry-After honoured; a longer one ends the call at once so
            the caller can reschedule instead of holding a worker.
    """

    max_attempts: int = 6
    base_delay: float = 0.5
    max_delay: float = 30.0
    max_total_wait: float = 120.0
    max_retry_after: float = 120.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("base_delay", "max_delay", "max_total_wait", "max_retry_after"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"RetryPolicy.{name} must be a finite number >= 0, got {value}")

    def backoff(self, retry_number: int, rng: random.Random) -> float:
        """Full-jitter backoff before retry ``retry_number`` (1 for the first retry).

        Args:
            retry_number: 1-based index of the retry about to happen.
            rng: Source of randomness (injected so tests are deterministic).

        Returns:
            A delay drawn uniformly from ``[0, min(max_delay, base_delay * 2**(n-1))]``.
        """
        ceiling = min(self.max_delay, self.base_delay * (2.0 ** min(retry_number - 1, 60)))
        return rng.uniform(0.0, ceiling)


#: Never retry: a single attempt.
NO_RETRY = RetryPolicy(max_attempts=1, max_total_wait=0.0)


def parse_retry_after(value: str | None, *, now: float) -> float | None:
    """Parse a ``Retry-After`` header given as delay-seconds or as an HTTP-date.

    Args:
        value: The header value, or None when absent.
        now: The current wall-clock time (Unix seconds), to turn a date into a delay.

    Returns:
        Seconds to wait (0 for a date in the past), or None when absent or unparseable.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text.isdigit():
        return float(int(text))
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        # Fractional seconds are not in RFC 9110, but some servers send them.
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)
