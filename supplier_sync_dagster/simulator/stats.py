"""Counters of what the simulator served, readable from Python and over HTTP."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class SimStats:
    """Thread-safe counters: requests (total, per endpoint, per status), faults, bytes."""

    def __init__(self) -> None:
        """Start at zero."""
        self._lock = threading.Lock()
        self._zero()

    def _zero(self) -> None:
        self._requests = 0
        self._by_endpoint: Counter[str] = Counter()
        self._by_status: Counter[int] = Counter()
        self._faults: Counter[str] = Counter()
        self._rate_limited = 0
        self._unauthorized = 0
        self._bytes = 0
        self._hotels = 0
        self._bad_records = 0

    def request(self, endpoint: str) -> None:
        """Count a contract request to ``endpoint``."""
        with self._lock:
            self._requests += 1
            self._by_endpoint[endpoint] += 1

    def response(self, status: int, nbytes: int) -> None:
        """Count a response and its body size (as sent, after compression)."""
        with self._lock:
            self._by_status[status] += 1
            self._bytes += nbytes

    def fault(self, kind: str) -> None:
        """Count one injected fault."""
        with self._lock:
            self._faults[kind] += 1

    def rate_limited(self) -> None:
        """Count one request refused by the token bucket."""
        with self._lock:
            self._rate_limited += 1

    def unauthorized(self) -> None:
        """Count one request refused for its API key."""
        with self._lock:
            self._unauthorized += 1

    def hotels(self, served: int, bad: int) -> None:
        """Count hotel records served and how many of them were bad."""
        with self._lock:
            self._hotels += served
            self._bad_records += bad

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of every counter (JSON-serializable)."""
        with self._lock:
            injected_429 = self._faults.get("429", 0)
            return {
                "requests_total": self._requests,
                "requests_by_endpoint": dict(self._by_endpoint),
                "responses_by_status": {str(k): v for k, v in sorted(self._by_status.items())},
                "rate_limited": self._rate_limited,
                "responses_429": self._rate_limited + injected_429,
                "unauthorized": self._unauthorized,
                "faults": dict(self._faults),
                "bytes_sent": self._bytes,
                "hotels_served": self._hotels,
                "bad_records_served": self._bad_records,
            }

    def reset(self) -> None:
        """Set every counter back to zero."""
        with self._lock:
            self._zero()
