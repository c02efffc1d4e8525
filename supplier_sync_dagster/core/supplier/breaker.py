"""A thread-safe circuit breaker, one per supplier.

closed --(N consecutive failures, or failure ratio over a window)--> open
open --(cool-down elapsed; one probe request let through)--> half-open
half-open --(probe succeeds)--> closed;  half-open --(probe fails)--> open

A caller reports each failure with its error code and a one-line message; the breaker keeps
the last one, and a refusal (:class:`CircuitOpen`) says why the breaker opened and carries
that code.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from supplier_sync_dagster.core.errors import CircuitOpen, ConfigError


class BreakerState(enum.StrEnum):
    """State of a :class:`CircuitBreaker`."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerStats:
    """A snapshot of a breaker's state and counters.

    Attributes:
        state: The current state.
        consecutive_failures: Failures since the last success.
        transitions: How often each ``"from->to"`` move happened.
        rejected: Requests refused while open (or while a probe was in flight).
    """

    state: BreakerState
    consecutive_failures: int
    transitions: dict[str, int]
    rejected: int


class CircuitBreaker:
    """Stops calling a supplier whose errors persist, and probes it again after a cool-down.

    Call :meth:`before_request` before sending, then exactly one of :meth:`record_success`,
    :meth:`record_failure` or :meth:`release` with the token it returned.
    """

    def __init__(
        self,
        *,
        name: str = "supplier",
        failure_threshold: int = 5,
        failure_ratio: float | None = None,
        ratio_window: int = 20,
        ratio_min_calls: int = 10,
        cooldown: float = 30.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create a closed breaker.

        Args:
            name: Label used in messages (a supplier id, never a secret).
            failure_threshold: Consecutive failures that open the breaker.
            failure_ratio: If set, also open when at least this share of the last
                ``ratio_window`` outcomes failed (with at least ``ratio_min_calls`` outcomes).
            ratio_window: Outcomes remembered for the ratio rule.
            ratio_min_calls: Outcomes needed before the ratio rule applies.
            cooldown: Seconds the breaker stays open before letting one probe through.
            monotonic: Clock, injectable for tests.
        """
        if failure_threshold < 1:
            raise ConfigError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if failure_ratio is not None and not 0 < failure_ratio <= 1:
            raise ConfigError(f"failure_ratio must be in (0, 1], got {failure_ratio}")
        if cooldown < 0:
            raise ConfigError(f"cooldown must be >= 0, got {cooldown}")
        self.name = name
        self._threshold = failure_threshold
        self._ratio = failure_ratio
        self._ratio_min = max(1, ratio_min_calls)
        self._window: deque[bool] = deque(maxlen=max(1, ratio_window))
        self._cooldown = cooldown
        self._clock = monotonic
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probe_started: float | None = None
        self._probe_seq = 0
        self._transitions: dict[str, int] = {}
        self._rejected = 0
        # Why the breaker last opened, and the last failure reported: (code, message).
        self._opened_because = ""
        self._last_failure: tuple[str, str] | None = None

    def __repr__(self) -> str:
        return f"CircuitBreaker(name={self.name!r}, state={self.state.value})"

    @property
    def state(self) -> BreakerState:
        """The current state (an open breaker whose cool-down passed still reads ``open``)."""
        with self._lock:
            return self._state

    def stats(self) -> BreakerStats:
        """Return a snapshot of state and counters."""
        with self._lock:
            return BreakerStats(
                state=self._state,
                consecutive_failures=self._consecutive,
                transitions=dict(self._transitions),
                rejected=self._rejected,
            )

    def before_request(self) -> int:
        """Ask to send one request.

        Returns:
            A token to pass to ``record_*``/``release``: 0 for a normal request, a positive
            number for the half-open probe.

        Raises:
            CircuitOpen: The breaker is open, or half-open with its probe still in flight.
        """
        with self._lock:
            now = self._clock()
            if self._state is BreakerState.CLOSED:
                return 0
            if self._state is BreakerState.OPEN:
                remaining = self._opened_at + self._cooldown - now
                if remaining > 0:
                    self._rejected += 1
                    raise CircuitOpen(
                        f"circuit breaker for {self.name} is open since {self._why()}; "
                        f"next probe in {remaining:.1f}s",
                        retry_in=remaining,
                        cause_code=self._cause_code(),
                    )
                self._move(BreakerState.HALF_OPEN)
                return self._start_probe(now)
            # Half-open: one probe at a time. A probe whose owner vanished without reporting
            # would block the breaker forever, so it is replaced after one cool-down.
            assert self._probe_started is not None
            probe_age = now - self._probe_started
            if probe_age < max(self._cooldown, 1.0):
                self._rejected += 1
                raise CircuitOpen(
                    f"circuit breaker for {self.name} is half-open (open since {self._why()}); "
                    "a probe request is in flight",
                    retry_in=max(self._cooldown, 1.0) - probe_age,
                    cause_code=self._cause_code(),
                )
            return self._start_probe(now)

    def record_success(self, token: int) -> None:
        """Report that the request answered coherently (2xx, 4xx, 429)."""
        with self._lock:
            self._consecutive = 0
            self._window.append(True)
            if self._state is BreakerState.HALF_OPEN and token == self._probe_seq:
                self._probe_started = None
                self._window.clear()
                self._move(BreakerState.CLOSED)

    def record_failure(self, token: int, *, code: str = "", message: str = "") -> None:
        """Report a server-side failure (5xx, timeout, connection error, broken body).

        Args:
            token: What :meth:`before_request` returned.
            code: The failure's error code (``CONNECTION_REFUSED``...), for the message and
                the :class:`CircuitOpen` of the calls refused while open.
            message: One line saying what failed (never a secret: it is shown).
        """
        with self._lock:
            self._consecutive += 1
            self._window.append(False)
            if code or message:
                self._last_failure = (code, message)
            if self._state is BreakerState.HALF_OPEN:
                if token == self._probe_seq:
                    self._probe_started = None
                    self._open("its probe request failed")
            elif self._state is BreakerState.CLOSED and self._should_open():
                if self._consecutive >= self._threshold:
                    n = self._consecutive
                    self._open(f"{n} failure{'s' if n > 1 else ''} in a row")
                else:
                    failed = sum(1 for ok in self._window if not ok)
                    self._open(f"{failed} of the last {len(self._window)} requests failed")

    def release(self, token: int) -> None:
        """Give back a request slot without an outcome (nothing was sent, or no verdict)."""
        with self._lock:
            if self._state is BreakerState.HALF_OPEN and token == self._probe_seq:
                # Let the next caller probe at once.
                self._probe_started = self._clock() - max(self._cooldown, 1.0)

    def _should_open(self) -> bool:
        if self._consecutive >= self._threshold:
            return True
        if self._ratio is None or len(self._window) < self._ratio_min:
            return False
        failures = sum(1 for ok in self._window if not ok)
        return failures / len(self._window) >= self._ratio

    def _open(self, why: str) -> None:
        self._opened_at = self._clock()
        self._opened_because = why
        self._move(BreakerState.OPEN)

    def _why(self) -> str:
        """Why the breaker opened, with the last failure (the lock is held)."""
        if self._last_failure is None:
            return self._opened_because
        code, message = self._last_failure
        return f"{self._opened_because}, last: {' '.join(p for p in (code, message) if p)}"

    def _cause_code(self) -> str | None:
        return self._last_failure[0] or None if self._last_failure is not None else None

    def _start_probe(self, now: float) -> int:
        self._probe_seq += 1
        self._probe_started = now
        return self._probe_seq

    def _move(self, new: BreakerState) -> None:
        key = f"{self._state.value}->{new.value}"
        self._transitions[key] = self._transitions.get(key, 0) + 1
        self._state = new
