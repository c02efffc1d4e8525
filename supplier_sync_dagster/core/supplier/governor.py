"""An adaptive rate governor: the request rate of one supplier budget, learnt from its answers.

The arithmetic (:class:`GovernorState` and its methods) is pure, on a clock passed in; the two
buckets that hold it share it:

* :class:`InProcessGovernedBucket` keeps the state in shared memory under a process-shared
  lock (the threads of a process and the worker processes forked from it), and in a small
  JSON state file so that a restarted process starts from what was learnt;
* :class:`RedisGovernedBucket` keeps it in a Redis hash on Redis' own clock, changed with
  ``WATCH``/``MULTI`` (every process of the budget adapts one rate), and paces with a Lua
  script reading that rate. The hash expires after :data:`STATE_TTL_SECONDS` unused, so a
  restart within that time goes on from the learnt rate.

How the rate moves:

* **429**: multiplicative decrease. The estimated limit (``ceiling``) becomes the lesser of
  the rate and the rate the supplier actually accepted over the last window; the rate drops to
  ``decrease`` times it; sending holds until ``Retry-After`` is over (``0``: no hold). A 429
  to a request sent before the last decrease (in flight then) counts but does not decrease
  again; the rate rises again ``cooldown`` seconds after a decrease.
* **Headers**: ``X-RateLimit-Remaining`` at or below ``low_remaining`` of ``X-RateLimit-Limit``
  is the same signal before any 429; ``Remaining: 0`` also holds until ``X-RateLimit-Reset``.
* **No 429**: before any ceiling is known the rate grows by ``slow_start`` of itself per
  second; then it climbs back to ``recover_to`` of the ceiling at ``recover`` of the ceiling per
  second, and probes past it additively, each second's step ``probe`` of the ceiling larger
  than the last (so a limit raised mid-run is found in seconds, not minutes).
* **Unused budget**: the rate grows (slow start, recovery and probe alike) only while it is
  used: the answers accepted over the last window, all processes together, at least ``busy``
  of the lesser of the rate now and the rate when that window began. Otherwise it holds
  (RFC 7661's application-limited rule): a rate nobody sends at says nothing of the limit,
  and demand that returns would meet it with a burst of 429s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from supplier_sync_dagster.core.errors import ConfigError, RateLimiterUnavailable
from supplier_sync_dagster.core.supplier.models import RateLimitInfo

if TYPE_CHECKING:
    import redis

CONSERVATIVE_START_RATE = 10.0
"""Requests/s an adaptive budget starts from when no rate is configured."""
STATE_TTL_SECONDS = 30 * 24 * 3600
"""Seconds an unused budget's state stays in Redis."""


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    """How an adaptive budget moves (see the module docstring).

    Attributes:
        start_rate: Requests/s at first use (the configured rate).
        min_rate: The rate never goes below this (requests/s).
        max_rate: The rate never probes above this (requests/s).
        decrease: Share of the estimated limit kept after a 429.
        cooldown: Seconds after a decrease before the rate rises again.
        slow_start: Growth per second, a share of the rate, before any limit is known.
        recover: Climb per second back towards the limit, a share of it.
        recover_to: Share of the estimated limit the climb goes back to.
        probe: Growth of the step per second past ``recover_to``, a share of the limit.
        plateau: Seconds the rate stays at ``recover_to`` before it probes past it.
        low_remaining: Share of ``X-RateLimit-Limit`` left at which the rate decreases.
        busy: Share of the rate the accepted answers must reach for the rate to grow.
    """

    start_rate: float
    min_rate: float = field(default=0.5)
    max_rate: float = field(default=1000.0)
    decrease: float = field(default=0.85)
    cooldown: float = field(default=1.0)
    slow_start: float = field(default=0.25)
    recover: float = field(default=0.1)
    recover_to: float = field(default=0.95)
    probe: float = field(default=0.02)
    plateau: float = field(default=4.0)
    low_remaining: float = field(default=0.1)
    busy: float = field(default=0.9)

    def __post_init__(self) -> None:
        if not (self.plateau >= 0 and math.isfinite(self.plateau)):
            raise ConfigError(f"governor plateau must be a finite number >= 0, got {self.plateau}")
        for name in ("start_rate", "min_rate", "max_rate", "cooldown"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"governor {name} must be a finite number > 0, got {value}")
        for name in (
            "decrease",
            "slow_start",
            "recover",
            "recover_to",
            "probe",
            "low_remaining",
            "busy",
        ):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ConfigError(f"governor {name} must be within (0, 1), got {value}")
        if not self.min_rate <= self.start_rate <= self.max_rate:
            raise ConfigError(
                f"governor rates must satisfy min_rate <= start_rate <= max_rate, got "
                f"{self.min_rate} <= {self.start_rate} <= {self.max_rate}"
            )


@dataclass(frozen=True, slots=True)
class GovernorSnapshot:
    """What a budget's governor has learnt and counted (all its processes together).

    Attributes:
        rate: Requests/s it paces at now.
        ceiling: Its estimate of the supplier's limit (0: none yet).
        throttled: 429 answers since the state was made.
        accepted: Answers that were not 429 since the state was made.
        waited: Seconds callers spent waiting for its tokens.
    """

    rate: float
    ceiling: float
    throttled: int
    accepted: int
    waited: float


WINDOW_SECONDS = 1.0
"""Length of the window over which the accepted rate is measured."""


@dataclass(slots=True)
class GovernorState:
    """The state of one budget; every time is on the clock of whoever holds it.

    Attributes:
        rate: Requests/s now.
        ceiling: Estimated limit (0: unknown).
        updated: When ``rate`` was last advanced.
        decreased: When the last decrease took effect: then, or when the tokens reserved
            before it were all sent (-inf: never).
        hold_until: No request is sent before this.
        probe_from: When the probe past ``recover_to`` began (0: not probing).
        window_start: Start of the current accepted-rate window.
        window_ok: Accepted answers in the current window.
        prev_ok: Accepted answers in the window before.
        throttled: 429 answers, total.
        accepted: Other answers, total.
        waited: Seconds waited for tokens, total.
        tat: When the next token is due (the GCRA's theoretical arrival time).
        cut_at: When the rate was last cut (-inf: never).
        window_rate: The rate when the current window began.
        prev_rate: The rate when the window before began.
    """

    rate: float
    ceiling: float = 0.0
    updated: float = 0.0
    decreased: float = -math.inf
    hold_until: float = 0.0
    probe_from: float = 0.0
    window_start: float = 0.0
    window_ok: float = 0.0
    prev_ok: float = 0.0
    throttled: float = 0.0
    accepted: float = 0.0
    waited: float = 0.0
    tat: float = 0.0
    cut_at: float = -math.inf
    window_rate: float = 0.0
    prev_rate: float = 0.0

    @classmethod
    def fresh(cls, config: GovernorConfig, now: float) -> GovernorState:
        """The state at first use."""
        rate = config.start_rate
        return cls(
            rate=rate, updated=now, window_start=now, tat=now, window_rate=rate, prev_rate=rate
        )

    def to_list(self) -> list[float]:
        """The fields in order (for shared memory and Redis)."""
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def from_list(cls, values: list[float]) -> GovernorState:
        """The state of :meth:`to_list`'s values."""
        return cls(*values)

    def snapshot(self) -> GovernorSnapshot:
        """What it learnt and counted."""
        return GovernorSnapshot(
            rate=self.rate,
            ceiling=self.ceiling,
            throttled=int(self.throttled),
            accepted=int(self.accepted),
            waited=self.waited,
        )

    def advance(self, config: GovernorConfig, now: float) -> None:
        """Raise the rate for the time without a 429 since the last call."""
        start = max(self.updated, self.decreased + config.cooldown, self.hold_until)
        self.updated = max(self.updated, now)
        if now <= start:
            return
        if not self.in_use(config, now):
            # The probe's clock stops with the growth: it resumes where it was.
            if self.probe_from > 0:
                self.probe_from += now - start
            return
        dt = now - start
        if self.ceiling <= 0:
            self.rate *= math.exp(config.slow_start * dt)
        else:
            target = config.recover_to * self.ceiling
            if self.rate < target:
                climb = config.recover * self.ceiling * dt
                self.rate = min(target, self.rate + climb)
                if self.rate >= target:
                    # At the estimate's safe side a while before probing past it.
                    self.probe_from = now + config.plateau
            else:
                if self.probe_from <= 0:
                    self.probe_from = start + config.plateau
                start = max(start, self.probe_from)
                if now <= start:
                    return
                dt = now - start
                # Each second past the estimate, the step grows by ``probe`` of it.
                tau_end, tau_start = now - self.probe_from, start - self.probe_from
                step = config.probe * self.ceiling
                self.rate += step * (dt + (tau_end**2 - tau_start**2) / 2)
        self.rate = min(config.max_rate, self.rate)

    def count_accepted(self, now: float, n: int) -> None:
        """Count ``n`` answers that were not 429 (for the accepted-rate window)."""
        self._roll(now)
        self.window_ok += n
        self.accepted += n

    def accepted_rate(self, now: float) -> float | None:
        """Requests/s the supplier accepted over the last window and this one, or None when
        too little time was measured."""
        self._roll(now)
        span = now - self.window_start + (WINDOW_SECONDS if self.prev_ok else 0.0)
        return (self.window_ok + self.prev_ok) / span if span >= WINDOW_SECONDS / 2 else None

    def in_use(self, config: GovernorConfig, now: float) -> bool:
        """Whether the accepted answers of the last window used ``busy`` of the rate (of the
        lesser of it now and at the window's start: a rate that grows or was cut within the
        window is not held against its users)."""
        accepted = self.accepted_rate(now)
        paced = min(self.rate, self.prev_rate if self.prev_ok else self.window_rate)
        return accepted is not None and accepted >= config.busy * paced

    def _roll(self, now: float) -> None:
        if now - self.window_start >= WINDOW_SECONDS:
            recent = now - self.window_start < 2 * WINDOW_SECONDS
            self.prev_ok = self.window_ok if recent else 0.0
            self.prev_rate = self.window_rate
            self.window_ok = 0.0
            self.window_start = now
            self.window_rate = self.rate

    def decrease(
        self, config: GovernorConfig, now: float, hold: float | None, *, sent: float
    ) -> None:
        """The supplier said it is over its limit: cut the rate and hold for ``hold`` seconds
        (None or 0: no hold). An answer to a request ``sent`` before the last cut says
        nothing of the rate since: it only holds."""
        self.advance(config, now)
        if hold:
            self.hold_until = max(self.hold_until, now + hold)
        if sent < self.decreased:
            return
        accepted = self.accepted_rate(now)
        estimate = self.rate if accepted is None else min(self.rate, accepted)
        self.ceiling = max(config.min_rate, estimate)
        self.rate = max(config.min_rate, config.decrease * self.ceiling)
        # Tokens reserved before the cut are sent at the old pace: their 429s are not news.
        self.decreased = max(now, self.tat)
        self.cut_at = now
        self.probe_from = 0.0

    def throttled_at(
        self, config: GovernorConfig, now: float, retry_after: float | None, *, age: float = 0.0
    ) -> None:
        """A 429 answer (``retry_after``: its ``Retry-After`` seconds, None when absent) to a
        request sent ``age`` seconds ago."""
        self.throttled += 1
        self.decrease(config, now, retry_after, sent=now - age)

    def answered(
        self,
        config: GovernorConfig,
        now: float,
        n: int,
        info: RateLimitInfo | None,
        *,
        age: float = 0.0,
    ) -> None:
        """``n`` answers that were not 429, the latest with headers ``info``, to a request
        sent ``age`` seconds ago."""
        self.count_accepted(now, n)
        limit = info.limit if info is not None else None
        remaining = info.remaining if info is not None else None
        if (
            limit
            and remaining is not None
            and remaining <= math.floor(config.low_remaining * limit)
        ):
            hold = info.reset_seconds if info is not None and remaining <= 0 else None
            # A level, not an event: answers after a cut still show it until the supplier's
            # bucket refills, so it cuts at most once per cooldown.
            sent = now - age if now >= self.decreased + config.cooldown else -math.inf
            self.decrease(config, now, hold, sent=sent)
            return
        self.advance(config, now)

    def take(self, now: float, *, reserve: bool) -> float:
        """Take a token (GCRA, burst 1): returns 0 when taken now; otherwise the seconds until
        one is due, the token taken all the same when ``reserve`` (the caller sleeps it)."""
        due = max(self.tat, now, self.hold_until)
        wait = max(0.0, due - now)
        if reserve or wait <= 1e-9:
            self.tat = due + 1.0 / self.rate
            self.waited += wait
        return wait


@runtime_checkable
class GovernedLimiter(Protocol):
    """A rate limiter that learns from the supplier's answers."""

    def acquire(self) -> float:
        """Block until a token is due and take it; returns seconds waited."""
        ...

    def answered(self, info: RateLimitInfo | None, *, age: float = 0.0) -> None:
        """An answer that was not 429, with its rate-limit headers, to a request sent
        ``age`` seconds ago."""
        ...

    def throttled(self, retry_after: float | None, *, age: float = 0.0) -> None:
        """A 429 answer, with its ``Retry-After`` seconds (None when absent), to a request
        sent ``age`` seconds ago."""
        ...

    def snapshot(self) -> GovernorSnapshot:
        """What the budget learnt and counted."""
        ...


SAVE_SECONDS = 2.0
"""Seconds between writes of the in-process state file."""


RETAKES = 3
"""Tokens a caller takes at most: one reserved before a cut goes out at the old pace, so
a caller whose token came due after a cut takes another at the new pace."""


class InProcessGovernedBucket:
    """An adaptive budget of one process and the workers forked from it, saved to a file."""

    def __init__(
        self,
        config: GovernorConfig,
        *,
        state_file: Path | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Create the budget, from ``state_file``'s learnt rate when it has one.

        Args:
            config: How the rate moves.
            state_file: Where the learnt rate is kept between runs (None: nowhere).
            monotonic: Clock, injectable for tests.
            sleep: Sleep function, injectable for tests.
        """
        self.config = config
        self.state_file = state_file
        self._clock = monotonic
        self._sleep = sleep
        now = monotonic()
        state = GovernorState.fresh(config, now)
        saved = load_state_file(state_file) if state_file is not None else None
        if saved is not None:
            state.rate = min(config.max_rate, max(config.min_rate, saved[0]))
            state.ceiling = saved[1]
        ctx = multiprocessing.get_context("fork")
        self._lock = ctx.Lock()
        self._state = ctx.RawArray("d", state.to_list())
        self._saved_at = now

    def __repr__(self) -> str:
        return f"InProcessGovernedBucket(start_rate={self.config.start_rate})"

    def _change(
        self, change: Callable[[GovernorState, float], float | None], *, save: bool = False
    ) -> float:
        with self._lock:
            state = GovernorState.from_list(list(self._state))
            now = self._clock()
            result = change(state, now)
            self._state[:] = state.to_list()
        if self.state_file is not None and (save or now - self._saved_at >= SAVE_SECONDS):
            self._saved_at = now
            save_state_file(self.state_file, state)
        return result or 0.0

    def acquire(self) -> float:
        """Take a token, waiting until it is due (again, when the rate was cut meanwhile);
        returns seconds waited."""
        waited = 0.0
        for _ in range(RETAKES):
            reserved = self._clock()
            wait = self._change(lambda s, now: s.take(now, reserve=True))
            if wait > 0:
                self._sleep(wait)
            waited += wait
            with self._lock:
                if GovernorState.from_list(list(self._state)).cut_at <= reserved:
                    break
        return waited

    def try_acquire(self) -> float:
        """Take a token if one is due now; else the seconds until one is."""
        return self._change(lambda s, now: s.take(now, reserve=False))

    def answered(self, info: RateLimitInfo | None, *, age: float = 0.0) -> None:
        """An answer that was not 429."""
        self._change(lambda s, now: s.answered(self.config, now, 1, info, age=age))

    def throttled(self, retry_after: float | None, *, age: float = 0.0) -> None:
        """A 429 answer (saved to the state file at once)."""
        self._change(
            lambda s, now: s.throttled_at(self.config, now, retry_after, age=age), save=True
        )

    def snapshot(self) -> GovernorSnapshot:
        """What it learnt and counted."""
        with self._lock:
            return GovernorState.from_list(list(self._state)).snapshot()


def load_state_file(path: Path) -> tuple[float, float] | None:
    """The (rate, ceiling) a state file keeps, or None when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        rate, ceiling = float(data["rate"]), float(data["ceiling"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (rate > 0 and math.isfinite(rate) and ceiling >= 0 and math.isfinite(ceiling)):
        return None
    return rate, ceiling


def save_state_file(path: Path, state: GovernorState) -> None:
    """Write the learnt rate atomically (a crash leaves the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"rate": state.rate, "ceiling": state.ceiling, "saved": time.time()})
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".governor-")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(body)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def state_file_name(budget: str) -> str:
    """The state file's name of a budget key (hashed: it holds a digest of an API key)."""
    return "governor-" + hashlib.sha256(budget.encode()).hexdigest()[:32] + ".json"


_LUA_TAKE = """
-- KEYS[1]: the budget's state hash. ARGV: start rate, reserve (0/1), ttl seconds.
-- GCRA on Redis' clock: the token is due at max(tat, now, hold_until).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local g = redis.call('HMGET', KEYS[1], 'rate', 'tat', 'hold_until', 'waited')
local rate = tonumber(g[1]) or tonumber(ARGV[1])
local due = math.max(tonumber(g[2]) or now, now, tonumber(g[3]) or 0)
local wait = due - now
if ARGV[2] == '1' or wait <= 1e-9 then
  redis.call('HSET', KEYS[1], 'tat', string.format('%.17g', due + 1 / rate),
    'waited', string.format('%.17g', (tonumber(g[4]) or 0) + wait))
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
end
return string.format('%.17g', wait)
"""

_FIELDS = [f.name for f in dataclasses.fields(GovernorState)]


def run_wait_script(script: Callable[..., object], key: str, args: list[float | int]) -> float:
    """Run a bucket's Lua script on ``key``; its answer is the seconds to wait (>= 0).

    Raises:
        RateLimiterUnavailable: Redis could not be reached or refused the script.
    """
    import redis

    try:
        result = script(keys=[key], args=args)
    except redis.RedisError as err:
        raise RateLimiterUnavailable(
            f"shared rate limiter unavailable ({type(err).__name__}); no request was sent"
        ) from err
    text = result.decode() if isinstance(result, bytes) else str(result)
    return max(0.0, float(text))


FLUSH_SECONDS = 0.1
"""Seconds between a process's reports of its accepted requests (a 429 reports at once)."""


class RedisGovernedBucket:
    """An adaptive budget shared by every process that uses the same Redis key."""

    def __init__(
        self,
        redis_client: redis.Redis,
        key: str,
        config: GovernorConfig,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Create a handle on the budget (its state is made at first use, or found).

        Args:
            redis_client: A redis-py client.
            key: The budget's state hash (see :func:`~.ratelimit.bucket_key`).
            config: How the rate moves.
            monotonic: Local clock, only to space this process's reports.
            sleep: Sleep function, injectable for tests.
        """
        self.key = key
        self.config = config
        self._redis = redis_client
        self._script = redis_client.register_script(_LUA_TAKE)
        self._clock = monotonic
        self._sleep = sleep
        self._lock = threading.Lock()
        self._pending = 0
        self._last_info: RateLimitInfo | None = None
        self._flushed = monotonic()

    def __repr__(self) -> str:
        return f"RedisGovernedBucket(key={self.key!r}, start_rate={self.config.start_rate})"

    def _take(self, *, reserve: bool) -> float:
        args = [self.config.start_rate, int(reserve), STATE_TTL_SECONDS]
        return run_wait_script(self._script, self.key, args)

    def acquire(self) -> float:
        """Take a token of the shared budget, waiting until it is due (again, when the rate
        was cut meanwhile); seconds waited."""
        import redis

        waited = 0.0
        for _ in range(RETAKES):
            wait = self._take(reserve=True)
            if wait > 0:
                self._sleep(wait)
            waited += wait
            try:
                with self._redis.pipeline(transaction=False) as pipe:
                    cut_at, (seconds, micros) = pipe.hget(self.key, "cut_at").time().execute()
            except redis.RedisError as err:
                raise RateLimiterUnavailable(
                    f"shared rate limiter unavailable ({type(err).__name__}); no request was sent"
                ) from err
            if cut_at is None or float(cut_at) <= seconds + micros / 1e6 - wait:
                break
        return waited

    def try_acquire(self) -> float:
        """Take a token if one is due now; else the seconds until one is."""
        return self._take(reserve=False)

    def answered(self, info: RateLimitInfo | None, *, age: float = 0.0) -> None:
        """An answer that was not 429: reported with others every :data:`FLUSH_SECONDS`,
        at once when its headers say the budget is nearly spent."""
        low = (
            info is not None
            and bool(info.limit)
            and info.remaining is not None
            and info.remaining <= math.floor(self.config.low_remaining * (info.limit or 0))
        )
        with self._lock:
            self._pending += 1
            self._last_info = info
            now = self._clock()
            if not low and now - self._flushed < FLUSH_SECONDS:
                return
            n, self._pending, self._flushed = self._pending, 0, now
        self._update(lambda s, t: s.answered(self.config, t, n, info, age=age))

    def throttled(self, retry_after: float | None, *, age: float = 0.0) -> None:
        """A 429 answer, reported at once (with the accepted answers not reported yet)."""
        with self._lock:
            n, self._pending = self._pending, 0

        def change(state: GovernorState, now: float) -> None:
            state.count_accepted(now, n)
            state.throttled_at(self.config, now, retry_after, age=age)

        self._update(change)

    def snapshot(self) -> GovernorSnapshot:
        """What the budget learnt and counted, all its processes together."""
        return self._read()[0].snapshot()

    def _read(self, pipe: redis.client.Pipeline | None = None) -> tuple[GovernorState, float]:
        source = pipe if pipe is not None else self._redis
        values = source.hmget(self.key, _FIELDS)
        seconds, micros = source.time()
        now = seconds + micros / 1_000_000
        state = GovernorState.fresh(self.config, now)
        if values[0] is not None:
            state = GovernorState.from_list(
                [
                    float(v) if v is not None else getattr(state, f)
                    for f, v in zip(_FIELDS, values, strict=True)
                ]
            )
        return state, now

    def _update(self, change: Callable[[GovernorState, float], None]) -> None:
        import redis

        try:
            with self._redis.pipeline() as pipe:
                while True:
                    try:
                        pipe.watch(self.key)
                        state, now = self._read(pipe)
                        change(state, now)
                        pipe.multi()
                        # ``tat`` and ``waited`` belong to the take script: left as they are.
                        fields: dict[str | bytes, str] = {
                            f: repr(v)
                            for f, v in zip(_FIELDS, state.to_list(), strict=True)
                            if f not in ("tat", "waited")
                        }
                        pipe.hset(self.key, mapping=fields)
                        pipe.expire(self.key, STATE_TTL_SECONDS)
                        pipe.execute()
                        return
                    except redis.WatchError:
                        continue
        except redis.RedisError as err:
            raise RateLimiterUnavailable(
                f"shared rate limiter unavailable ({type(err).__name__})"
            ) from err
