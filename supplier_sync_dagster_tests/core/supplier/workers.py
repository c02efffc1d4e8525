"""Worker process body for the shared rate-limit test (importable, so ``spawn`` can run it)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import redis

from supplier_sync_dagster.core.supplier import (
    InProcessTokenBucket,
    RateLimiter,
    RedisTokenBucket,
    RetryPolicy,
    SupplierClient,
)


def hammer(
    base_url: str,
    api_key: str,
    rate: float,
    redis_url: str | None,
    bucket_key: str,
    start_at: float,
    duration: float,
) -> dict[str, Any]:
    """Call the supplier as fast as the limiter allows from ``start_at`` for ``duration`` s.

    Returns:
        ``{"sent": [unix times of each request], "stats": {...}}``.
    """
    limiter: RateLimiter
    if redis_url is not None:
        limiter = RedisTokenBucket(redis.Redis.from_url(redis_url), bucket_key, rate=rate, burst=1)
    else:
        limiter = InProcessTokenBucket(rate, 1)
    sent: list[float] = []

    class Stamping:
        def acquire(self) -> float:
            waited = limiter.acquire()
            sent.append(time.time())
            return waited

    with httpx.Client(base_url=base_url) as http:
        client = SupplierClient(
            http,
            api_key=api_key,
            supplier_id="sim",
            rate_limiter=Stamping(),
            read_timeout=5.0,
            retry=RetryPolicy(max_attempts=1000, base_delay=0.05, max_total_wait=1e6),
        )
        time.sleep(max(0.0, start_at - time.time()))
        end = start_at + duration
        while time.time() < end:
            client.list_cities()
        stats = client.stats()
    return {
        "sent": [t for t in sent if t <= end],
        "responses_429": stats.responses_by_status.get(429, 0),
        "requests": stats.requests,
    }
