"""A thread-safe token bucket per API key, as a supplier enforces its rate limit."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    """The outcome of one request against the bucket.

    Attributes:
        allowed: whether the request may proceed.
        limit: bucket capacity (``X-RateLimit-Limit``).
        remaining: whole tokens left (``X-RateLimit-Remaining``).
        reset_seconds: seconds until the bucket is full again (``X-RateLimit-Reset``).
        retry_after: seconds to wait before a refused request can succeed (at least 1).
    """

    allowed: bool
    limit: int
    remaining: int
    reset_seconds: int
    retry_after: int


class TokenBucket:
    """``rate`` tokens per second up to ``burst``; one token per request."""

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Start full.

        Args:
            rate: refill rate, tokens per second (> 0).
            burst: capacity (>= 1).
            clock: monotonic seconds (injectable for tests).
        """
        if rate <= 0 or burst < 1:
            raise ValueError("TokenBucket needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._stamp = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def set_rate(self, rate: float, burst: float) -> None:
        """Change the refill rate and capacity from now on (tokens above it are dropped)."""
        with self._lock:
            self._refill()
            self.rate, self.burst = rate, burst
            self._tokens = min(self._tokens, burst)

    def acquire(self) -> Decision:
        """Take a token if there is one."""
        with self._lock:
            self._refill()
            allowed = self._tokens >= 1.0
            if allowed:
                self._tokens -= 1.0
            return self._decision(allowed)

    def peek(self) -> Decision:
        """The bucket's state without taking a token."""
        with self._lock:
            self._refill()
            return self._decision(True)

    def _decision(self, allowed: bool) -> Decision:
        missing = max(0.0, 1.0 - self._tokens)
        return Decision(
            allowed=allowed,
            limit=int(self.burst),
            remaining=int(self._tokens),
            reset_seconds=math.ceil((self.burst - self._tokens) / self.rate),
            retry_after=max(1, math.ceil(missing / self.rate)),
        )


class RateLimiter:
    """One token bucket per API key, shared by every caller of the simulator."""

    def __init__(self, rate: float | None, burst: float | None) -> None:
        """Create the limiter; buckets are made per key on first use.

        Args:
            rate: requests per second per key; ``None`` disables limiting.
            burst: bucket size; ``None`` means one second worth of ``rate`` (at least 1).
        """
        self.rate = rate
        self.burst = burst if burst is not None else max(1.0, rate or 1.0)
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()
        self._factor = 1.0

    def scale(self, factor: float) -> None:
        """Set every bucket's rate and capacity to ``factor`` times the configured ones."""
        if self.rate is None:
            return
        with self._lock:
            self._factor = factor
            for bucket in self._buckets.values():
                bucket.set_rate(self.rate * factor, max(1.0, self.burst * factor))

    def _bucket(self, key: str) -> TokenBucket | None:
        if self.rate is None:
            return None
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                factor = self._factor
                bucket = self._buckets[key] = TokenBucket(
                    self.rate * factor, max(1.0, self.burst * factor)
                )
            return bucket

    def acquire(self, key: str) -> Decision:
        """Count one request of ``key``."""
        bucket = self._bucket(key)
        return _UNLIMITED if bucket is None else bucket.acquire()

    def peek(self, key: str) -> Decision:
        """The state of ``key``'s bucket without counting a request."""
        bucket = self._bucket(key)
        return _UNLIMITED if bucket is None else bucket.peek()


_UNLIMITED = Decision(
    allowed=True, limit=1_000_000, remaining=1_000_000, reset_seconds=0, retry_after=0
)
