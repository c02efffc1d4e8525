"""Short Redis locks taken before a shard's database claim: the seed's claim accelerator.

When many workers claim thousands of shards, most database claims of a popular shard find
it taken: each a transaction under the batch's row lock that changes nothing. A worker
first sets the shard's lock in Redis (``SET key worker_id:lease_token NX PX ttl``) and
claims in the database only when it got it, so shards being taken by others are skipped
without a database round trip. The rules (``supplier-sync-design.md`` §18.3):

- Redis holds only short locks, never facts: the database's lease decides who owns a
  shard, its checkpoint and its counts.
- A worker works a shard only while it holds both; its heartbeat renews both. A Redis
  renewal that finds the lock gone or another's stops the work and gives the database
  lease back; a database renewal that fails stops the work even while the lock holds.
- Renewal and release compare the stored value with the holder's first (Lua), so a stale
  holder never extends or deletes another's lock.
- When Redis cannot be reached the claim goes on without a lock (the database alone
  decides) and Redis is left alone for a few seconds; a lease claimed meanwhile takes its
  lock at the first renewal that reaches Redis again, unless another worker holds it.

:class:`ClaimLockConfig` (plain data, so lease settings travel to worker processes) names
the Redis; :func:`claim_locks_from_env` reads it from ``SUPPLIER_SYNC_CLAIM_LOCKS`` and
``SUPPLIER_SYNC_REDIS_URL``; :func:`take_claim_lock` is what a claim calls.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from supplier_sync_dagster.core.errors import ClaimLockHeld, ClaimLockUnavailable, ConfigError
from supplier_sync_dagster.core.settings import env_name, load_claim_lock_settings

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

KEY_PREFIX = "supplier-sync:claim:"
# How long one Redis call may take, and how long Redis is left alone after one failed:
# a claim never waits on an unreachable Redis for longer than the first.
REDIS_TIMEOUT_SECONDS = 1.0
DEFAULT_RETRY_SECONDS = 5.0

# KEYS[1] the lock, ARGV[1] the holder's value, ARGV[2] the ttl in ms.
# A claim's SET NX, answering the holder when it is taken: one round trip either way.
_TAKE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return redis.call('GET', KEYS[1])
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
# After an outage: the lock is ours again if it is still ours or nobody holds it.
_RETAKE = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] or not held then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# ARGV[1] the dead holder's value, ARGV[2] the new one, ARGV[3] the ttl in ms.
_REPLACE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""

Renewal = Literal["RENEWED", "LOST", "UNAVAILABLE"]


@dataclass(frozen=True)
class ClaimLockConfig:
    """Which Redis holds the claim locks.

    Attributes:
        redis_url: ``redis://``, ``rediss://`` or ``unix://``.
        retry_seconds: How long Redis is left alone after a call failed.
        key_prefix: Prefix of every lock's key.
    """

    redis_url: str
    retry_seconds: float = DEFAULT_RETRY_SECONDS
    key_prefix: str = KEY_PREFIX

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ConfigError("the claim locks need a Redis URL")
        if not 0 < self.retry_seconds <= 600:
            raise ConfigError(
                f"claim lock retry interval {self.retry_seconds!r} s must be within 0..600"
            )

    def __repr__(self) -> str:  # the URL may carry a password
        return f"ClaimLockConfig(key_prefix={self.key_prefix!r})"


def claim_locks_from_env() -> ClaimLockConfig | None:
    """The claim locks the environment asks for (``SUPPLIER_SYNC_CLAIM_LOCKS``), else None.

    Raises:
        ConfigError: A variable is malformed, or the locks are asked for without a Redis URL.
    """
    settings = load_claim_lock_settings()
    if not settings.claim_locks:
        return None
    if settings.redis_url is None:
        raise ConfigError(f"{env_name('claim_locks')} needs {env_name('redis_url')}")
    return ClaimLockConfig(settings.redis_url)


class ClaimLocks:
    """The claim locks of one Redis, shared by a process's leases (thread-safe).

    Every call answers None, instead of raising, when Redis cannot be reached; after a
    failure Redis is not tried again for ``config.retry_seconds``.
    """

    def __init__(
        self,
        config: ClaimLockConfig,
        *,
        client: redis.Redis | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._client = client if client is not None else _redis_from_url(config.redis_url)
        self._monotonic = monotonic
        self._down_until = 0.0
        self._scripts = {
            name: self._client.register_script(text)
            for name, text in (
                ("take", _TAKE),
                ("renew", _RENEW),
                ("release", _RELEASE),
                ("retake", _RETAKE),
                ("replace", _REPLACE),
            )
        }

    def key(self, batch_id: str, shard_key: str) -> str:
        """The lock's key of one shard."""
        return f"{self.config.key_prefix}{batch_id}:{shard_key}"

    def take(self, key: str, value: str, ttl_seconds: float) -> Literal[True] | str | None:
        """``SET key value NX PX ttl``: True when taken, else the value of its holder;
        None when Redis cannot be reached."""

        def take() -> Literal[True] | str:
            done = self._scripts["take"](keys=[key], args=[value, _ms(ttl_seconds)])
            return True if done == 1 else _text(done)

        return self._call(take)

    def script(self, name: str, key: str, *args: str | int) -> bool | None:
        """Runs one of the compare-first scripts (renew, release, retake, replace)."""
        return self._call(lambda: bool(self._scripts[name](keys=[key], args=list(args))))

    def _call(self, call: Callable[[], Any]) -> Any:
        import redis

        if self._monotonic() < self._down_until:
            return None
        try:
            return call()
        except redis.RedisError as err:
            self._down_until = self._monotonic() + self.config.retry_seconds
            log.warning(
                "claim locks: Redis unreachable (%s); the database alone decides claims "
                "for the next %g s",
                ClaimLockUnavailable(f"{type(err).__name__}: {err}"),
                self.config.retry_seconds,
            )
            return None


@dataclass(eq=False)
class ClaimLock:
    """One lease's Redis lock on its shard.

    Attributes:
        locks: The Redis it is in.
        key: The shard's lock key.
        value: ``worker_id:lease_token`` of the lease.
        ttl_seconds: How long the lock lives without renewal (the lease's duration).
        held: False until Redis has confirmed it (it was unreachable at the claim, or since).
    """

    locks: ClaimLocks
    key: str
    value: str
    ttl_seconds: float
    held: bool

    def renew(self) -> Renewal:
        """Extends the lock: RENEWED; LOST when it expired or another worker holds it;
        UNAVAILABLE when Redis cannot be reached (the database alone decides meanwhile).

        After an outage the lock is taken again unless another worker holds it.
        """
        name = "renew" if self.held else "retake"
        done = self.locks.script(name, self.key, self.value, _ms(self.ttl_seconds))
        if done is None:
            self.held = False
            return "UNAVAILABLE"
        if not done:
            return "LOST"
        self.held = True
        return "RENEWED"

    def release(self) -> None:
        """Deletes the lock if it is still this lease's (never another worker's)."""
        self.locks.script("release", self.key, self.value)
        self.held = False


_cache_lock = threading.Lock()
_cache: dict[tuple[int, ClaimLockConfig], ClaimLocks] = {}


def claim_locks_for(config: ClaimLockConfig) -> ClaimLocks:
    """The process's :class:`ClaimLocks` of ``config`` (one Redis connection pool each)."""
    # Keyed by pid too: a forked worker process opens its own connections.
    cache_key = (os.getpid(), config)
    with _cache_lock:
        locks = _cache.get(cache_key)
        if locks is None:
            locks = _cache[cache_key] = ClaimLocks(config)
        return locks


def take_claim_lock(
    config: ClaimLockConfig | None,
    batch_id: str,
    shard_key: str,
    value: str,
    *,
    ttl_seconds: float,
    holder_is_dead: Callable[[str], bool] | None = None,
) -> ClaimLock | None:
    """Takes a shard's claim lock before its database claim; None when there are no locks.

    Args:
        config: The claim locks (None: off).
        batch_id: The shard's batch.
        shard_key: The shard's key.
        value: ``worker_id:lease_token`` of the claim.
        ttl_seconds: The lock's life without renewal.
        holder_is_dead: Whether a holder's worker id names a process that provably no
            longer runs; its lock is then replaced (compare-and-set), as its lease is.

    Returns:
        The lock, not yet confirmed (``held`` False) when Redis cannot be reached.

    Raises:
        ClaimLockHeld: Another worker holds the lock: do not claim in the database.
    """
    if config is None:
        return None
    locks = claim_locks_for(config)
    key = locks.key(batch_id, shard_key)
    holder = locks.take(key, value, ttl_seconds)
    if holder is None or holder is True:
        return ClaimLock(locks, key, value, ttl_seconds, held=holder is True)
    worker = holder.rpartition(":")[0]
    if holder_is_dead is not None and worker and holder_is_dead(worker):
        replaced = locks.script("replace", key, holder, value, _ms(ttl_seconds))
        if replaced is None or replaced:
            return ClaimLock(locks, key, value, ttl_seconds, held=bool(replaced))
    raise ClaimLockHeld(
        f"shard {shard_key!r} of batch {batch_id}: its claim lock is held by "
        f"{worker or holder!r}; not claimed"
    )


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _redis_from_url(redis_url: str) -> redis.Redis:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        redis_url,
        socket_timeout=REDIS_TIMEOUT_SECONDS,
        socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
        retry=Retry(NoBackoff(), 0),
    )


__all__ = [
    "ClaimLock",
    "ClaimLockConfig",
    "ClaimLocks",
    "claim_locks_for",
    "claim_locks_from_env",
    "take_claim_lock",
]
