"""Resilient client of the Supplier Hotel API v1 (``shared/supplier-api.md``).

Build one client per supplier API key::

    limiter = make_rate_limiter(redis_url=settings.redis_url, supplier_id="acme",
                                api_key=key, rate=20, burst=1)
    # Every socket wait ends by the request's deadline; a base URL's query is kept apart.
    with supplier_http_client("https://api.acme.example/?token=t") as http:
        client = SupplierClient(http, api_key=key, supplier_id="acme", rate_limiter=limiter)
        walk = CityWalk(client, "BKK", page_size=100, start=checkpoint, hotel_count=size)
        for item in walk:
            commit(item.page, item.raw)          # then store item.position as the checkpoint
"""

from __future__ import annotations

from supplier_sync_dagster.core.supplier.breaker import BreakerState, BreakerStats, CircuitBreaker
from supplier_sync_dagster.core.supplier.client import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_DECODED_BYTES,
    DEFAULT_REQUEST_DEADLINE,
    ERROR_CODE_STATUS,
    ClientStats,
    SupplierClient,
    encode_segment,
)
from supplier_sync_dagster.core.supplier.models import (
    MALFORMED_RECORD_KEY,
    ChangesPage,
    ChangeWatermark,
    City,
    CityList,
    CityPage,
    CitySummary,
    Fetched,
    Hotel,
    HotelsPage,
    HotelStatus,
    Money,
    OfferConfirmation,
    OfferRequest,
    PagePosition,
    RateLimitInfo,
)
from supplier_sync_dagster.core.supplier.ratelimit import (
    BucketOptions,
    CityRateLimiters,
    InProcessTokenBucket,
    RateLimiter,
    RedisTokenBucket,
    ShareLimiter,
    TokenBucket,
    bucket_key,
    make_city_rate_limiters,
    make_rate_limiter,
    make_share_limiter,
)
from supplier_sync_dagster.core.supplier.retry import NO_RETRY, RetryPolicy, parse_retry_after
from supplier_sync_dagster.core.supplier.transport import (
    BoundedTransport,
    deadline_scope,
    supplier_http_client,
)
from supplier_sync_dagster.core.supplier.walk import CityWalk, WalkLimits, WalkStats

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_DECODED_BYTES",
    "DEFAULT_REQUEST_DEADLINE",
    "ERROR_CODE_STATUS",
    "MALFORMED_RECORD_KEY",
    "NO_RETRY",
    "BoundedTransport",
    "BreakerState",
    "BreakerStats",
    "BucketOptions",
    "ChangeWatermark",
    "ChangesPage",
    "CircuitBreaker",
    "City",
    "CityWalk",
    "CityList",
    "CityPage",
    "CityRateLimiters",
    "CitySummary",
    "ClientStats",
    "Fetched",
    "Hotel",
    "HotelStatus",
    "HotelsPage",
    "InProcessTokenBucket",
    "Money",
    "OfferConfirmation",
    "OfferRequest",
    "PagePosition",
    "RateLimitInfo",
    "RateLimiter",
    "RedisTokenBucket",
    "RetryPolicy",
    "ShareLimiter",
    "SupplierClient",
    "TokenBucket",
    "WalkLimits",
    "WalkStats",
    "bucket_key",
    "deadline_scope",
    "encode_segment",
    "make_city_rate_limiters",
    "make_rate_limiter",
    "make_share_limiter",
    "parse_retry_after",
    "supplier_http_client",
]
