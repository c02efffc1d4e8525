"""Token buckets that pace requests before they are sent.

* :class:`InProcessTokenBucket` paces the threads of one process and of the worker
  processes forked from it after it was made (its state is in shared memory): a run that
  syncs its cities in worker processes keeps one budget without Redis.
* :class:`RedisTokenBucket` paces every process that shares one Redis key: the supplier's
  limit is per API key, and several workers share a key. The refill and the take happen in
  one Lua script on Redis' own clock (``TIME``), so worker clocks never matter.

A caller that waits (``acquire``) reserves its token at once, the bucket going into debt, and
sleeps until the token is due: waiters are served in turn, and one woken late (a busy
machine) still gets its token, so the supplier's rate is not lost to late wake-ups.

The bucket key holds the supplier id and a SHA-256 of the API key: the key itself never
reaches Redis.

Both pace at a fixed rate. Their adaptive kinds, which learn the supplier's limit from its
429s and ``X-RateLimit-*`` headers, are in :mod:`~supplier_sync_dagster.core.supplier.governor`;
:func:`make_rate_limiter` builds one when given a ``governor``.

A caller that must never starve the syncs (the read API's offer confirmations) paces on a
share of its own (:func:`make_share_limiter`): a second bucket of the same supplier key, under
another Redis key, that refuses at once (:class:`RateShareExhausted`) instead of queueing.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, Protocol, TypedDict, Unpack, runtime_checkable

from supplier_sync_dagster.core.errors import (
    ConfigError,
    RateShareExhausted,
)
from supplier_sync_dagster.core.supplier.governor import (
    GovernorConfig,
    InProcessGovernedBucket,
    RedisGovernedBucket,
    run_wait_script,
    state_file_name,
)

if TYPE_CHECKING:
    import redis


@runtime_checkable
class RateLimiter(Protocol):
    """Something that blocks until one request may be sent."""

    def acquire(self) -> float:
        """Block until a token is available and take it.

        Returns:
            Seconds spent waiting.
        """
        ...


@runtime_checkable
class TokenBucket(RateLimiter, Protocol):
    """A rate limiter that can also be asked without blocking."""

    def try_acquire(self) -> float:
        """Take a token if one is available, without blocking.

        Returns:
            0.0 if a token was taken, otherwise the seconds until one will be available.
        """
        ...


_EPSILON = 1e-9


def _check_rate(rate: float, burst: float) -> None:
    if not (rate > 0 and math.isfinite(rate)):
        raise ConfigError(f"rate must be a finite number > 0, got {rate}")
    if not (burst >= 1 and math.isfinite(burst)):
        raise ConfigError(f"burst must be a finite number >= 1, got {burst}")


class InProcessTokenBucket:
    """A token bucket: ``rate`` tokens per second, holding at most ``burst``.

    Safe for threads and for processes forked after it was made: its two numbers live in
    shared memory under a process-shared lock (the monotonic clock is system-wide on
    Linux, so every process reads the same time).
    """

    def __init__(
        self,
        rate: float,
        burst: float = 1.0,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Create a full bucket.

        Args:
            rate: Tokens added per second (the sustained request rate).
            burst: Capacity: requests that may go out back to back after a quiet spell.
            monotonic: Clock, injectable for tests.
            sleep: Sleep function, injectable for tests.
        """
        _check_rate(rate, burst)
        self.rate = float(rate)
        self.burst = float(burst)
        self._clock = monotonic
        self._sleep = sleep
        # Forked worker processes see the same memory and lock ("fork" context: the
        # default one may be another start method, whose children would not share them).
        ctx = multiprocessing.get_context("fork")
        self._lock = ctx.Lock()
        self._state = ctx.RawArray("d", [self.burst, monotonic()])  # tokens, stamp

    def __repr__(self) -> str:
        return f"InProcessTokenBucket(rate={self.rate}, burst={self.burst})"

    def _refilled(self) -> float:
        """The tokens now, the refill since the last call counted (under the lock)."""
        now = self._clock()
        tokens, stamp = self._state[0], self._state[1]
        if now > stamp:
            tokens = min(self.burst, tokens + (now - stamp) * self.rate)
            self._state[1] = now
        return tokens

    def try_acquire(self) -> float:
        """Take a token if one is available, without blocking.

        Returns:
            0.0 if a token was taken, otherwise the seconds until one will be available.
        """
        with self._lock:
            tokens = self._refilled()
            # Float rounding can leave 0.99999...; waiting that out would never end.
            if tokens >= 1.0 - _EPSILON:
                self._state[0] = max(0.0, tokens - 1.0)
                return 0.0
            self._state[0] = tokens
            return (1.0 - tokens) / self.rate

    def acquire(self) -> float:
        """Take a token, waiting until it is due.

        The token is reserved at once, the bucket going into debt for it, and the caller
        sleeps until it is due: a waiter woken late (a busy machine) still gets its token,
        so none of the rate is lost to late wake-ups, and waiters are served in turn.

        Returns:
            Seconds spent waiting.
        """
        with self._lock:
            tokens = self._refilled() - 1.0
            self._state[0] = tokens
        # Float rounding can leave -0.00001; that token is due now.
        wait = -tokens / self.rate if tokens < -_EPSILON else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait


_LUA_TAKE = """
-- KEYS[1]: bucket key. ARGV: rate (tokens/s), burst (capacity), ttl_ms, reserve (0/1).
-- Returns "0" when a token was taken, otherwise the seconds until one is available; with
-- reserve=1 the token is taken even so (the bucket goes into debt) and the seconds until it
-- is due are returned.
local t = redis.call('TIME')
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'tokens', 's', 'us')
local tokens = tonumber(b[1])
local s = tonumber(b[2])
local us = tonumber(b[3])
if tokens == nil or s == nil or us == nil then
  tokens = burst
else
  -- Seconds and microseconds kept apart: one double cannot hold both exactly.
  local elapsed = (tonumber(t[1]) - s) + (tonumber(t[2]) - us) / 1000000
  if elapsed > 0 then
    tokens = math.min(burst, tokens + elapsed * rate)
  end
end
local wait = 0
if tokens >= 1 - 1e-9 then
  tokens = math.max(0, tokens - 1)
elseif ARGV[4] == '1' then
  tokens = tokens - 1
  wait = -tokens / rate
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 's', t[1], 'us', t[2])
-- A bucket in debt lives until it is full again: expiring earlier would forget the debt.
local ttl = math.max(tonumber(ARGV[3]), math.ceil((burst - tokens) / rate * 1000) + 1000)
redis.call('PEXPIRE', KEYS[1], ttl)
return string.format('%.17g', wait)
"""


def bucket_key(prefix: str, supplier_id: str, api_key: str, *, scope: str | None = None) -> str:
    """Build the Redis key of a supplier's bucket without revealing the API key.

    Args:
        prefix: Namespace of the keys (e.g. ``"supplier-sync:ratelimit"``).
        supplier_id: The supplier's id.
        api_key: The supplier API key; only a SHA-256 digest of it enters the key.
        scope: Optional sub-bucket (a city code); hashed too, as it is untrusted text.

    Returns:
        ``{prefix}:{supplier_id}:{sha256(api_key)[:32]}`` plus ``:city:{sha256(scope)[:32]}``.
    """
    digest = hashlib.sha256(b"supplier-sync-ratelimit\0" + api_key.encode()).hexdigest()[:32]
    key = f"{prefix}:{supplier_id}:{digest}"
    if scope is not None:
        key += ":city:" + hashlib.sha256(scope.encode()).hexdigest()[:32]
    return key


class RedisTokenBucket:
    """A token bucket in Redis, shared by every process that uses the same key."""

    def __init__(
        self,
        redis_client: redis.Redis,
        key: str,
        rate: float,
        burst: float = 1.0,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Create a handle on a shared bucket (the bucket starts full when first used).

        Args:
            redis_client: A redis-py client.
            key: The bucket's key; build it with :func:`bucket_key`.
            rate: Tokens added per second, for all processes together.
            burst: Capacity of the bucket.
            sleep: Sleep function, injectable for tests.
        """
        _check_rate(rate, burst)
        self.key = key
        self.rate = float(rate)
        self.burst = float(burst)
        self._redis = redis_client
        self._sleep = sleep
        self._script = redis_client.register_script(_LUA_TAKE)
        # Long enough for an idle bucket to refill completely, then it can go.
        self._ttl_ms = int(math.ceil(self.burst / self.rate * 1000)) + 1000

    def __repr__(self) -> str:
        return f"RedisTokenBucket(key={self.key!r}, rate={self.rate}, burst={self.burst})"

    def try_acquire(self) -> float:
        """Take a token if one is available, without blocking.

        Returns:
            0.0 if a token was taken, otherwise the seconds until one will be available.

        Raises:
            RateLimiterUnavailable: Redis could not be reached or refused the script.
        """
        return self._take(reserve=False)

    def _take(self, *, reserve: bool) -> float:
        args = [self.rate, self.burst, self._ttl_ms, int(reserve)]
        return run_wait_script(self._script, self.key, args)

    def acquire(self) -> float:
        """Take a token of the shared bucket, waiting until it is due.

        The token is reserved at once (the shared bucket goes into debt for it, so every
        process sharing the key waits behind it) and the caller sleeps until it is due: a
        waiter woken late still gets its token, and none of the rate is lost to late
        wake-ups.

        Returns:
            Seconds spent waiting.

        Raises:
            RateLimiterUnavailable: Redis could not be reached or refused the script.
        """
        wait = self._take(reserve=True)
        if wait > 0:
            self._sleep(wait)
        return wait


class CityRateLimiters:
    """Lazily created per-city buckets, for suppliers that also throttle per city."""

    def __init__(self, factory: Callable[[str], RateLimiter]) -> None:
        """Create the registry.

        Args:
            factory: Builds the bucket of one city code.
        """
        self._factory = factory
        self._lock = threading.Lock()
        self._buckets: dict[str, RateLimiter] = {}

    def for_city(self, city_code: str) -> RateLimiter:
        """Return the bucket of ``city_code``, creating it on first use."""
        with self._lock:
            bucket = self._buckets.get(city_code)
            if bucket is None:
                bucket = self._buckets[city_code] = self._factory(city_code)
            return bucket


def _redis_from_url(redis_url: str) -> redis.Redis:
    import redis

    return redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)


DEFAULT_KEY_PREFIX = "supplier-sync:ratelimit"


class BucketOptions(TypedDict):
    """Which supplier API key the buckets pace, and how fast: the arguments of
    :func:`make_rate_limiter` and :func:`make_city_rate_limiters`.

    Attributes:
        redis_url: Redis URL (the ``redis_url`` setting); None for in-process buckets,
            which only pace the threads of this process.
        supplier_id: The supplier's id.
        api_key: The supplier API key (hashed into the Redis keys).
        rate: Requests per second allowed for a bucket, all workers together.
        burst: Capacity of a bucket (default 1).
        key_prefix: Namespace of the Redis keys (default :data:`DEFAULT_KEY_PREFIX`).
        governor: How an adaptive bucket moves (its ``start_rate`` replaces ``rate``);
            None or absent: a fixed rate.
        state_dir: Where an in-process adaptive bucket keeps its learnt rate between runs
            (None or absent: nowhere).
        shared: Buckets of this process with the same supplier id and key are one
            (accounts configured on one budget); absent: False.
    """

    redis_url: str | None
    supplier_id: str
    api_key: str
    rate: float
    burst: NotRequired[float]
    key_prefix: NotRequired[str]
    governor: NotRequired[GovernorConfig | None]
    state_dir: NotRequired[Path | None]
    shared: NotRequired[bool]


def make_rate_limiter(**options: Unpack[BucketOptions]) -> RateLimiter:
    """Build the request limiter of one supplier API key (see :class:`BucketOptions`).

    Returns:
        A :class:`RedisTokenBucket` when ``redis_url`` is given, else an
        :class:`InProcessTokenBucket`; their adaptive kinds (``governor``),
        :class:`~.governor.RedisGovernedBucket` and :class:`~.governor.InProcessGovernedBucket`.
    """
    return _bucket_maker(options)(None)


def make_city_rate_limiters(**options: Unpack[BucketOptions]) -> CityRateLimiters:
    """Build per-city buckets, a second throttle on top of the per-key one (see
    :class:`BucketOptions`: ``rate`` and ``burst`` are each city's).

    Returns:
        A :class:`CityRateLimiters` registry.
    """
    return CityRateLimiters(_bucket_maker(options))


def make_share_limiter(
    share: str, *, max_wait: float, **options: Unpack[BucketOptions]
) -> ShareLimiter:
    """Build a share of its own beside a supplier key's bucket (see :class:`ShareLimiter`).

    Args:
        share: The share's name (``"confirm"``); its Redis key is the key's bucket key under
            the prefix ``{key_prefix}:share:{share}``, so it never spends the syncs' tokens.
        max_wait: The longest a request waits for a token before it is refused.
        **options: See :class:`BucketOptions`; ``rate`` and ``burst`` are the share's own.
    """
    prefix = options.get("key_prefix", DEFAULT_KEY_PREFIX)
    bucket = _bucket_maker({**options, "key_prefix": f"{prefix}:share:{share}", "governor": None})(
        None
    )
    return ShareLimiter(bucket, name=share, max_wait=max_wait)


class ShareLimiter:
    """A caller's own bucket beside the syncs' (a share of the supplier's request budget):
    a flood of its requests empties this bucket only, and a request that would wait longer
    than ``max_wait`` for a token is refused at once rather than queued."""

    def __init__(
        self,
        bucket: TokenBucket,
        *,
        name: str,
        max_wait: float,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Wrap a bucket.

        Args:
            bucket: The share's own bucket.
            name: The share's name, for the refusal's message.
            max_wait: Seconds a request may wait for a token in all (0: none).
            sleep: Sleep function, injectable for tests.
        """
        self.bucket = bucket
        self.name = name
        self.max_wait = max_wait
        self._sleep = sleep

    def __repr__(self) -> str:
        return f"ShareLimiter({self.name!r}, {self.bucket!r}, max_wait={self.max_wait})"

    def acquire(self) -> float:
        """Take a token of the share, waiting at most ``max_wait`` in all.

        Returns:
            Seconds spent waiting.

        Raises:
            RateShareExhausted: No token within ``max_wait``; nothing is taken.
            RateLimiterUnavailable: Redis could not be reached.
        """
        waited = 0.0
        while True:
            wait = self.bucket.try_acquire()
            if wait <= 0:
                return waited
            if waited + wait > self.max_wait:
                raise RateShareExhausted(
                    f"the {self.name} share of the supplier's request budget is used up; "
                    f"a token is due in {wait:.2f}s",
                    retry_after=wait,
                )
            self._sleep(wait)
            waited += wait


_SHARED_BUCKETS: dict[str, TokenBucket] = {}
_SHARED_LOCK = threading.Lock()


def _bucket_maker(options: BucketOptions) -> Callable[[str | None], TokenBucket]:
    """Builds a bucket of ``options`` per scope (None: the whole key; else a city code)."""
    rate, burst = options["rate"], options.get("burst", 1.0)
    redis_url = options["redis_url"]
    governor = options.get("governor")
    prefix = options.get("key_prefix", DEFAULT_KEY_PREFIX)
    supplier_id, api_key = options["supplier_id"], options["api_key"]
    if redis_url is None:
        state_dir = options.get("state_dir")

        def local(scope: str | None) -> TokenBucket:
            if governor is None or scope is not None:
                return InProcessTokenBucket(rate, burst)
            key = bucket_key(prefix, supplier_id, api_key)
            state = state_dir / state_file_name(key) if state_dir is not None else None
            return InProcessGovernedBucket(governor, state_file=state)

        if not options.get("shared", False):
            return local

        def shared(scope: str | None) -> TokenBucket:
            key = bucket_key(prefix, supplier_id, api_key, scope=scope)
            with _SHARED_LOCK:
                found = _SHARED_BUCKETS.get(key)
                if found is None:
                    found = _SHARED_BUCKETS[key] = local(scope)
                return found

        return shared
    client = _redis_from_url(redis_url)

    def bucket(scope: str | None) -> TokenBucket:
        key = bucket_key(prefix, supplier_id, api_key, scope=scope)
        if governor is not None and scope is None:
            return RedisGovernedBucket(client, key + ":governor", governor)
        return RedisTokenBucket(client, key, rate, burst)

    return bucket
