"""Circuit breaker transitions, retry helpers, and token bucket arithmetic on a fake clock."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
import uuid

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from supplier_sync_dagster.core.errors import CircuitOpen, ConfigError, RateLimiterUnavailable
from supplier_sync_dagster.core.supplier import (
    BreakerState,
    CircuitBreaker,
    InProcessTokenBucket,
    RedisTokenBucket,
    RetryPolicy,
    bucket_key,
    make_city_rate_limiters,
    make_rate_limiter,
    parse_retry_after,
)
from supplier_sync_dagster_tests.core.supplier.fakes import API_KEY, FakeClock

# --- breaker ---------------------------------------------------------------------------------


def fail(breaker: CircuitBreaker, times: int) -> None:
    for _ in range(times):
        breaker.record_failure(breaker.before_request())


def test_breaker_full_cycle() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown=10, monotonic=clock.monotonic)
    fail(breaker, 2)
    breaker.record_success(breaker.before_request())  # resets the consecutive count
    fail(breaker, 2)
    assert breaker.state is BreakerState.CLOSED
    fail(breaker, 1)
    assert breaker.state is BreakerState.OPEN

    with pytest.raises(CircuitOpen) as info:
        breaker.before_request()
    assert info.value.retry_in == pytest.approx(10)

    clock.advance(10)
    probe = breaker.before_request()
    assert breaker.state is BreakerState.HALF_OPEN
    with pytest.raises(CircuitOpen, match="probe"):
        breaker.before_request()  # one probe at a time
    breaker.record_failure(probe)
    assert breaker.state is BreakerState.OPEN  # failed probe reopens

    clock.advance(9.9)
    with pytest.raises(CircuitOpen):
        breaker.before_request()
    clock.advance(0.1)
    breaker.record_success(breaker.before_request())
    assert breaker.state is BreakerState.CLOSED

    stats = breaker.stats()
    assert stats.transitions == {
        "closed->open": 1,
        "open->half_open": 2,
        "half_open->open": 1,
        "half_open->closed": 1,
    }
    assert stats.rejected == 3


def test_breaker_opens_on_failure_ratio() -> None:
    breaker = CircuitBreaker(
        failure_threshold=100, failure_ratio=0.5, ratio_window=10, ratio_min_calls=10
    )
    for i in range(10):
        token = breaker.before_request()
        if i % 2:
            breaker.record_failure(token)
        else:
            breaker.record_success(token)
    assert breaker.state is BreakerState.OPEN


def test_released_or_abandoned_probe_does_not_block_forever() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown=5, monotonic=clock.monotonic)
    fail(breaker, 1)
    clock.advance(5)
    breaker.release(breaker.before_request())  # no verdict: the next caller may probe
    probe = breaker.before_request()
    assert probe > 0
    clock.advance(5)  # the probe's owner vanished
    breaker.record_success(breaker.before_request())
    assert breaker.state is BreakerState.CLOSED


def test_an_open_breaker_says_why_it_opened_and_carries_the_code() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(
        name="supplier-1001", failure_threshold=3, cooldown=30, monotonic=clock.monotonic
    )
    breaker.record_failure(breaker.before_request(), code="SUPPLIER_TIMEOUT", message="slow")
    for _ in range(2):
        breaker.record_failure(
            breaker.before_request(),
            code="CONNECTION_REFUSED",
            message="127.0.0.1:9: connection refused",
        )
    with pytest.raises(CircuitOpen) as info:
        breaker.before_request()
    assert str(info.value) == (
        "circuit breaker for supplier-1001 is open since 3 failures in a row, last: "
        "CONNECTION_REFUSED 127.0.0.1:9: connection refused; next probe in 30.0s"
    )
    assert info.value.error_code == info.value.cause_code == "CONNECTION_REFUSED"

    clock.advance(30)
    probe = breaker.before_request()
    with pytest.raises(CircuitOpen, match="half-open .open since 3 failures") as busy:
        breaker.before_request()
    assert busy.value.cause_code == "CONNECTION_REFUSED"
    breaker.record_failure(probe, code="DNS_FAILURE", message="x.invalid:443: no such host")
    with pytest.raises(CircuitOpen, match="its probe request failed, last: DNS_FAILURE x.invalid"):
        breaker.before_request()


def test_a_breaker_opened_by_the_ratio_says_so() -> None:
    breaker = CircuitBreaker(
        failure_threshold=100, failure_ratio=0.5, ratio_window=4, ratio_min_calls=4
    )
    for i in range(4):
        token = breaker.before_request()
        if i % 2:
            breaker.record_failure(token, code="SUPPLIER_UNAVAILABLE", message="GET /v1/x: 503")
        else:
            breaker.record_success(token)
    with pytest.raises(CircuitOpen, match="open since 2 of the last 4 requests failed, last: "):
        breaker.before_request()


def test_a_breaker_told_no_cause_keeps_its_old_code() -> None:
    breaker = CircuitBreaker(failure_threshold=1)
    fail(breaker, 1)
    with pytest.raises(CircuitOpen, match="open since 1 failure in a row; next probe") as info:
        breaker.before_request()
    assert info.value.error_code == "CIRCUIT_OPEN" and info.value.cause_code is None


def test_breaker_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ConfigError):
        CircuitBreaker(failure_ratio=1.5)


# --- retry helpers -----------------------------------------------------------------------------


def test_parse_retry_after_both_forms() -> None:
    now = 1_800_000_000.0
    assert parse_retry_after("7", now=now) == 7.0
    assert parse_retry_after(" 0 ", now=now) == 0.0
    assert parse_retry_after("1.5", now=now) == 1.5
    assert parse_retry_after("Fri, 15 Jan 2027 08:00:10 GMT", now=1_800_000_000.0) == 10.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=now) == 0.0  # past
    for junk in (None, "", "soon", "-3", "nan", "Wed, 99 Foo"):
        assert parse_retry_after(junk, now=now) is None


def test_full_jitter_backoff_stays_under_its_ceiling() -> None:
    policy = RetryPolicy(base_delay=0.5, max_delay=4)
    rng = random.Random(3)
    for n, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (10, 4.0), (500, 4.0)]:
        draws = [policy.backoff(n, rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in draws)
        assert max(draws) > ceiling * 0.8  # jitter spans the range


# --- in-process bucket -------------------------------------------------------------------------


def test_bucket_arithmetic_on_a_fake_clock() -> None:
    clock = FakeClock()
    bucket = InProcessTokenBucket(4.0, 2, monotonic=clock.monotonic, sleep=clock.sleep)
    assert bucket.acquire() == 0.0  # starts full: burst of 2
    assert bucket.acquire() == 0.0
    assert bucket.try_acquire() == pytest.approx(0.25)  # one token per 1/rate
    assert bucket.acquire() == pytest.approx(0.25)
    clock.advance(0.125)
    assert bucket.try_acquire() == pytest.approx(0.125)
    clock.advance(10)  # refills, but never beyond the burst
    assert bucket.acquire() == 0 and bucket.acquire() == 0
    assert bucket.try_acquire() > 0


def test_bucket_paces_n_requests_to_n_over_rate() -> None:
    clock = FakeClock()
    bucket = InProcessTokenBucket(20.0, 1, monotonic=clock.monotonic, sleep=clock.sleep)
    start = clock.now
    for _ in range(101):
        bucket.acquire()
    assert clock.now - start == pytest.approx(100 / 20.0)


def test_a_waiter_woken_late_loses_no_token() -> None:
    """A busy machine wakes sleepers late: the bucket's rate is still the supplier's."""
    clock = FakeClock()
    late = 0.3 / 20.0  # every sleep overshoots by 30 % of a token's interval

    def sleep_late(seconds: float) -> None:
        clock.sleep(seconds + late)

    bucket = InProcessTokenBucket(20.0, 1, monotonic=clock.monotonic, sleep=sleep_late)
    start = clock.now
    for _ in range(101):
        bucket.acquire()
    # Each late wake-up shortens the next wait: only the last one's lateness adds up.
    assert clock.now - start == pytest.approx(100 / 20.0 + late)


def test_waiters_reserve_their_tokens_in_turn_and_a_try_waits_behind_them() -> None:
    clock = FakeClock()
    slept: list[float] = []
    bucket = InProcessTokenBucket(10.0, 1, monotonic=clock.monotonic, sleep=slept.append)
    # Four callers at the same instant (their sleeps do not move the clock): each gets the
    # next token, due one interval after the one before.
    assert [bucket.acquire() for _ in range(4)] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert slept == pytest.approx([0.1, 0.2, 0.3])
    assert bucket.try_acquire() == pytest.approx(0.4)  # asked, not taken
    clock.advance(0.3)
    assert bucket.try_acquire() == pytest.approx(0.1)
    clock.advance(0.1)
    assert bucket.try_acquire() == 0.0


def test_bucket_is_thread_safe() -> None:
    bucket = InProcessTokenBucket(1000.0, 1)
    taken: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(50):
            bucket.acquire()
            with lock:
                taken.append(time.monotonic())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(taken) == 200
    assert time.monotonic() - t0 >= 199 / 1000.0 * 0.95


def test_bucket_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError):
        InProcessTokenBucket(0, 1)
    with pytest.raises(ConfigError):
        InProcessTokenBucket(1, 0.5)


# --- Redis bucket --------------------------------------------------------------------------------


def redis_client(url: str):
    return redis.Redis.from_url(url)


def test_bucket_key_hides_the_api_key() -> None:
    key = bucket_key("p", "acme", API_KEY)
    assert API_KEY not in key and key.startswith("p:acme:")
    assert bucket_key("p", "acme", API_KEY) == key
    assert bucket_key("p", "acme", API_KEY + "x") != key
    city = bucket_key("p", "acme", API_KEY, scope="../x'|")
    assert "../x" not in city and city.startswith(key + ":city:")


@pytest.mark.redis
def test_redis_bucket_arithmetic(redis_url: str) -> None:
    r = redis_client(redis_url)
    key = f"test:{uuid.uuid4().hex}"
    slept: list[float] = []
    bucket = RedisTokenBucket(r, key, rate=10.0, burst=3, sleep=slept.append)
    try:
        assert [bucket.try_acquire() for _ in range(3)] == [0.0, 0.0, 0.0]
        wait = bucket.try_acquire()
        assert 0.05 < wait <= 0.1  # one token takes 1/rate; a little already refilled
        assert r.pttl(key) > 0  # expires when idle
        assert set(r.hkeys(key)) == {b"tokens", b"s", b"us"}
        time.sleep(0.35)
        assert [bucket.try_acquire() for _ in range(3)] == [0.0, 0.0, 0.0]
    finally:
        r.delete(key)
        r.close()


@pytest.mark.redis
def test_redis_waiters_reserve_their_tokens_and_the_debt_outlives_the_idle_expiry(
    redis_url: str,
) -> None:
    r = redis_client(redis_url)
    key = f"test:{uuid.uuid4().hex}"
    slept: list[float] = []
    bucket = RedisTokenBucket(r, key, rate=10.0, burst=1, sleep=slept.append)
    other = RedisTokenBucket(r, key, rate=10.0, burst=1)
    try:
        waits = [bucket.acquire() for _ in range(6)]  # the sleeps do not happen
        assert waits[0] == 0.0
        # Each waiter's token is due one interval after the one before (less what refilled
        # while asking).
        assert all(0.05 < b - a <= 0.1 for a, b in zip(waits, waits[1:], strict=False))
        assert slept == waits[1:]
        # Another process waits behind the reserved tokens; asking takes nothing.
        assert 0.5 < other.try_acquire() <= 0.6
        assert 0.5 < other.try_acquire() <= 0.6
        # The bucket lives until its debt is paid and it is full again, past the idle expiry.
        assert r.pttl(key) > bucket._ttl_ms + 400
    finally:
        r.delete(key)
        r.close()


@pytest.mark.redis
def test_redis_bucket_shared_by_threads_keeps_the_rate(redis_url: str) -> None:
    key = f"test:{uuid.uuid4().hex}"
    rate = 50.0
    stamps: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        bucket = RedisTokenBucket(redis_client(redis_url), key, rate=rate, burst=1)
        for _ in range(15):
            bucket.acquire()
            with lock:
                stamps.append(time.monotonic())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    redis_client(redis_url).delete(key)
    stamps.sort()
    span = stamps[-1] - stamps[0]
    assert len(stamps) == 60
    assert (len(stamps) - 1) / span <= rate * 1.05
    assert (len(stamps) - 1) / span >= rate * 0.8


@pytest.mark.redis
def test_make_rate_limiter_uses_redis_when_given_a_url(redis_url: str) -> None:
    limiter = make_rate_limiter(
        redis_url=redis_url,
        supplier_id=f"s{uuid.uuid4().hex[:6]}",
        api_key=API_KEY,
        rate=5,
        burst=2,
    )
    assert isinstance(limiter, RedisTokenBucket)
    assert API_KEY not in repr(limiter)
    assert limiter.acquire() == 0.0
    cities = make_city_rate_limiters(
        redis_url=redis_url, supplier_id="s", api_key=API_KEY, rate=5, burst=1
    )
    assert cities.for_city("BKK") is cities.for_city("BKK")
    assert isinstance(cities.for_city("../x"), RedisTokenBucket)
    assert isinstance(
        make_rate_limiter(redis_url=None, supplier_id="s", api_key=API_KEY, rate=5),
        InProcessTokenBucket,
    )


def test_an_in_process_limiter_does_not_import_redis() -> None:
    """redis-py costs ~65 ms to import: only a Redis URL loads it, so a command on the
    embedded default (an in-process bucket) does not pay for it."""
    script = (
        "import sys\n"
        "from supplier_sync_dagster.core.supplier import make_city_rate_limiters, make_rate_limiter\n"
        "make_rate_limiter(redis_url=None, supplier_id='s', api_key='k', rate=5).acquire()\n"
        "make_city_rate_limiters(redis_url=None, supplier_id='s', api_key='k', rate=5)\n"
        "print('loaded:', sorted(m for m in sys.modules if m.split('.')[0] == 'redis'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded: []" in done.stdout, done.stdout


def test_unreachable_redis_is_a_clear_error() -> None:
    r = redis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )
    bucket = RedisTokenBucket(r, "k", rate=5)
    with pytest.raises(RateLimiterUnavailable):
        bucket.acquire()
