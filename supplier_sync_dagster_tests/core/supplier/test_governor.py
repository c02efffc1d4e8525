"""The adaptive rate governor: its arithmetic on an injected clock, its convergence against
the simulator's own token bucket on a virtual clock (each of the rate-limit fault modes), and
its two buckets (in-process with a state file, Redis shared by several handles)."""

from __future__ import annotations

import heapq
import math
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from supplier_sync_dagster.core.errors import ConfigError, RateLimiterUnavailable
from supplier_sync_dagster.core.supplier import RateLimitInfo, bucket_key, make_rate_limiter
from supplier_sync_dagster.core.supplier.governor import (
    GovernorConfig,
    GovernorState,
    InProcessGovernedBucket,
    RedisGovernedBucket,
    load_state_file,
)
from supplier_sync_dagster.simulator.ratelimit import TokenBucket
from supplier_sync_dagster_tests.core.supplier.fakes import (
    API_KEY,
    CITIES,
    FakeClock,
    Script,
    error_response,
    json_response,
    make_client,
)

CONFIG = GovernorConfig(start_rate=20.0, max_rate=1000.0)


def fresh(config: GovernorConfig = CONFIG) -> GovernorState:
    return GovernorState.fresh(config, 0.0)


def used(s: GovernorState, now: float) -> GovernorState:
    """``s`` with its rate fully used over the half window before ``now``."""
    s.window_start, s.window_ok, s.prev_ok, s.window_rate = now - 0.5, s.rate / 2, 0.0, s.rate
    return s


def demand(
    s: GovernorState, config: GovernorConfig, share: float, start: float, end: float
) -> None:
    """Answers at ``share`` of the rate from ``start`` to ``end``, a batch every 0.1 s."""
    owed, t = 0.0, start
    while t < end:
        t += 0.1
        owed += share * s.rate * 0.1
        n, owed = int(owed), owed - int(owed)
        s.answered(config, t, n, None)


# --- arithmetic --------------------------------------------------------------------------


def test_slow_start_grows_by_its_share_per_second_until_a_limit_is_known() -> None:
    s = fresh()
    used(s, 4.0).advance(CONFIG, 4.0)
    assert s.rate == pytest.approx(20.0 * math.exp(0.25 * 4))
    used(s, 100.0).advance(CONFIG, 100.0)
    assert s.rate == CONFIG.max_rate


def test_a_429_cuts_to_a_share_of_the_accepted_rate_and_holds_for_retry_after() -> None:
    s = fresh(GovernorConfig(start_rate=100.0))
    for tenth in range(1, 21):  # 40 requests/s accepted over two seconds
        s.count_accepted(tenth / 10, 4)
    s.updated = s.decreased = 2.0  # no growth in between, to see the cut alone
    s.throttled_at(CONFIG, 2.0, 3.0)
    assert s.ceiling == pytest.approx(40.0, rel=0.15)
    assert s.rate == pytest.approx(0.85 * s.ceiling)
    assert s.hold_until == 5.0
    assert s.take(2.0, reserve=False) == pytest.approx(3.0)  # nothing goes out during the hold
    assert s.throttled == 1


def test_retry_after_zero_cuts_without_holding() -> None:
    s = fresh()
    s.throttled_at(CONFIG, 1.0, 0.0)
    assert s.rate == pytest.approx(0.85 * s.ceiling)
    assert s.hold_until == 0.0
    assert s.take(1.0, reserve=False) == 0.0


def test_a_429_to_a_request_sent_before_the_cut_does_not_cut_again() -> None:
    s = fresh()
    s.throttled_at(CONFIG, 1.0, None)
    after_first = s.rate
    s.throttled_at(CONFIG, 1.05, None, age=0.1)  # in flight when the rate was cut
    assert s.rate == after_first
    s.throttled_at(CONFIG, 1.5, None, age=0.1)  # sent after the cut: the new rate is too high
    assert s.rate < after_first
    assert s.throttled == 3


def test_tokens_reserved_before_a_cut_are_not_news() -> None:
    s = fresh()
    for _ in range(10):
        s.take(1.0, reserve=True)  # ten reserved at 20/s: the last one goes out at 1.45
    s.throttled_at(CONFIG, 1.1, None)
    cut = s.rate
    s.throttled_at(CONFIG, 1.45, None)  # one of those reservations
    assert s.rate == cut


def test_headers_low_remaining_cut_once_per_cooldown_and_zero_holds_for_reset() -> None:
    s = fresh()
    low = RateLimitInfo(limit=50, remaining=3, reset_seconds=1.0)
    s.answered(CONFIG, 1.0, 1, low)
    cut = s.rate
    assert s.decreased == 1.0 and cut == pytest.approx(CONFIG.decrease * s.ceiling)
    s.answered(CONFIG, 1.5, 1, low)  # still low: the supplier's bucket has not refilled yet
    assert s.rate == cut
    s.answered(CONFIG, 3.0, 1, RateLimitInfo(limit=50, remaining=0, reset_seconds=2.0))
    assert s.rate < cut
    assert s.hold_until == 5.0


def test_plenty_remaining_or_no_headers_probe_upward() -> None:
    s = fresh()
    s.answered(CONFIG, 1.0, 1, RateLimitInfo(limit=50, remaining=40, reset_seconds=1.0))
    used(s, 2.0).answered(CONFIG, 2.0, 1, None)
    assert s.rate > CONFIG.start_rate


def test_after_a_cut_the_rate_recovers_plateaus_then_probes_past_the_limit() -> None:
    config = GovernorConfig(start_rate=50.0, plateau=2.0)
    s = fresh(config)
    s.updated = 10.0
    s.throttled_at(config, 10.0, None)  # no accepted rate measured: the estimate is the rate
    assert (s.ceiling, s.rate) == (50.0, pytest.approx(42.5))
    used(s, 10.5).advance(config, 10.5)  # cooldown: still cut
    assert s.rate == pytest.approx(42.5)
    used(s, 12.0).advance(config, 12.0)  # a second of recovery at 5/s: up to 0.95 * 50, no further
    assert s.rate == pytest.approx(47.5)
    used(s, 13.9).advance(config, 13.9)  # the plateau
    assert s.rate == pytest.approx(47.5)
    used(s, 20.0).advance(config, 20.0)  # then probing: each second's step a step larger
    assert s.rate > 50.0
    step = config.probe * 50.0
    tau = 20.0 - 14.0
    assert s.rate == pytest.approx(47.5 + step * (tau + tau**2 / 2), rel=0.05)


@pytest.mark.parametrize("ceiling", [0.0, 50.0], ids=["slow_start", "probing"])
def test_a_budget_used_at_30_percent_for_a_minute_does_not_grow(ceiling: float) -> None:
    s = fresh()
    s.ceiling, s.rate = ceiling, ceiling or s.rate
    before = s.rate
    demand(s, CONFIG, 0.3, 0.0, 60.0)
    assert s.rate == before
    demand(s, CONFIG, 1.0, 60.0, 70.0)  # used in full again: it grows again
    assert s.rate > before


def test_the_rate_stays_between_min_and_max() -> None:
    config = GovernorConfig(start_rate=2.0, min_rate=1.0, max_rate=4.0)
    s = fresh(config)
    for n in range(1, 20):
        s.throttled_at(config, float(n), None)
    assert s.rate == 1.0
    used(s, 1000.0).advance(config, 1000.0)
    assert s.rate == 4.0


@pytest.mark.parametrize(
    ("field", "value"),
    [("start_rate", 0.0), ("decrease", 1.0), ("probe", -0.1), ("max_rate", math.inf)],
)
def test_a_bad_configuration_is_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        GovernorConfig(**{"start_rate": 10.0, field: value})


def test_start_outside_min_max_is_refused() -> None:
    with pytest.raises(ConfigError, match="min_rate <= start_rate <= max_rate"):
        GovernorConfig(start_rate=100.0, max_rate=50.0)


# --- convergence on a virtual clock, against the simulator's bucket ---------------------


@dataclass
class Run:
    state: GovernorState
    accepted: int
    throttled: int

    @property
    def share_429(self) -> float:
        return self.throttled / (self.accepted + self.throttled)


def drive(
    limit: float,
    *,
    seconds: float,
    disclosed: bool = True,
    swing: float | None = None,
    workers: int = 8,
    latency: float = 0.02,
    quiet: tuple[float, float] | None = None,
) -> Run:
    """``workers`` callers paced by one governor against the simulator's token bucket (its
    capacity a second's worth), each request answered ``latency`` seconds after it is sent;
    ``swing``: the limit halves then and doubles back twice as late; ``quiet``: within it the
    callers ask for 30 % of the limit."""
    clock = [0.0]
    supplier = TokenBucket(limit, limit, clock=lambda: clock[0])
    state = GovernorState.fresh(CONFIG, 0.0)
    events: list[tuple[float, int, str]] = [(0.0, n, "free") for n in range(workers)]
    answers: dict[int, tuple[bool, RateLimitInfo | None, float | None]] = {}
    reserved = [0.0] * workers
    retakes = [0] * workers
    accepted = throttled = 0
    while events:
        now, n, kind = heapq.heappop(events)
        if now > seconds:
            break
        clock[0] = now
        if swing is not None:
            factor = 0.5 if swing <= now < 2 * swing else 1.0
            if supplier.rate != limit * factor:
                supplier.set_rate(limit * factor, limit * factor)
        if kind == "free" and quiet is not None and quiet[0] <= now < quiet[1]:
            heapq.heappush(events, (now + workers / (0.3 * limit), n, "ready"))
        elif kind in ("free", "ready"):
            reserved[n] = now
            heapq.heappush(events, (now + state.take(now, reserve=True), n, "send"))
        elif kind == "send" and state.cut_at > reserved[n] and retakes[n] < 2:
            retakes[n] += 1  # the rate was cut while it waited: a token at the new pace
            heapq.heappush(events, (now, n, "free"))
        elif kind == "send":
            retakes[n] = 0
            d = supplier.acquire()
            info = RateLimitInfo(d.limit, d.remaining, d.reset_seconds) if disclosed else None
            answers[n] = (d.allowed, info, float(d.retry_after) if disclosed else None)
            heapq.heappush(events, (now + latency, n, "answer"))
        else:
            allowed, info, retry_after = answers.pop(n)
            if allowed:
                accepted += 1
                state.answered(CONFIG, now, 1, info, age=latency)
                heapq.heappush(events, (now, n, "free"))
            else:
                throttled += 1
                state.throttled_at(CONFIG, now, retry_after, age=latency)
                heapq.heappush(events, (now + (retry_after or 0.0), n, "free"))
    return Run(state, accepted, throttled)


@pytest.mark.parametrize("limit", [40.0, 80.0])
@pytest.mark.parametrize("disclosed", [True, False], ids=["headers", "undisclosed_limit"])
def test_it_converges_near_the_limit_with_few_429s(limit: float, disclosed: bool) -> None:
    run = drive(limit, seconds=60.0, disclosed=disclosed)
    assert 0.9 * limit <= run.state.ceiling <= 1.25 * limit
    assert run.state.rate >= 0.9 * limit
    assert run.accepted >= 0.85 * limit * 60
    assert run.share_429 < 0.01


@pytest.mark.parametrize("limit", [40.0, 80.0])
def test_a_limit_that_halves_then_doubles_is_followed(limit: float) -> None:
    halved = drive(limit, seconds=35.0, disclosed=False, swing=20.0)
    # It learnt the halved limit (its estimate a little above: the supplier's burst)...
    assert halved.state.ceiling <= 0.7 * limit and halved.state.rate <= 0.6 * limit
    back = drive(limit, seconds=60.0, disclosed=False, swing=20.0)
    assert back.state.rate >= 0.9 * limit  # and found the doubled one again
    assert back.share_429 < 0.01


@pytest.mark.parametrize("limit", [40.0, 80.0])
def test_demand_that_returns_after_a_quiet_spell_meets_no_burst_of_429s(limit: float) -> None:
    before = drive(limit, seconds=20.0, disclosed=False)
    quiet = drive(limit, seconds=40.0, disclosed=False, quiet=(20.0, 40.0))
    # Unused, the rate held where it was (a little growth while the last full window lasts).
    assert quiet.state.rate <= max(1.05 * before.state.rate, 1.3 * limit)
    assert quiet.state.rate <= 1.3 * limit
    back = drive(limit, seconds=60.0, disclosed=False, quiet=(20.0, 40.0))
    assert back.state.rate >= 0.9 * limit  # in full use again, it probes again
    assert back.share_429 < 0.01


# --- the in-process bucket ---------------------------------------------------------------


def test_the_in_process_bucket_paces_learns_and_survives_a_restart(tmp_path: Path) -> None:
    clock = FakeClock()
    state_file = tmp_path / "governor" / "acme.json"
    kw = {"state_file": state_file, "monotonic": clock.monotonic, "sleep": clock.sleep}
    bucket = InProcessGovernedBucket(CONFIG, **kw)  # type: ignore[arg-type]
    assert bucket.acquire() == 0.0
    assert bucket.acquire() == pytest.approx(1 / 20)  # paced at the start rate
    bucket.throttled(2.0)
    assert bucket.acquire() == pytest.approx(2.0)  # the hold, for everyone
    learnt = bucket.snapshot()
    assert learnt.throttled == 1 and learnt.rate < 20.0 and learnt.waited > 2.0
    saved = load_state_file(state_file)
    assert saved == (pytest.approx(learnt.rate), pytest.approx(learnt.ceiling))

    again = InProcessGovernedBucket(CONFIG, **kw)  # type: ignore[arg-type]
    assert again.snapshot().rate == pytest.approx(learnt.rate)  # not from scratch
    assert again.snapshot().ceiling == pytest.approx(learnt.ceiling)


@pytest.mark.parametrize("body", ["", "{not json", '{"rate": -3, "ceiling": 0}', '{"rate": 1}'])
def test_a_damaged_state_file_starts_from_the_configured_rate(tmp_path: Path, body: str) -> None:
    state_file = tmp_path / "g.json"
    state_file.write_text(body)
    assert InProcessGovernedBucket(CONFIG, state_file=state_file).snapshot().rate == 20.0


def test_accounts_on_one_budget_share_one_in_process_bucket(tmp_path: Path) -> None:
    budget = f"1001/budget/{uuid.uuid4().hex}"
    options = {"redis_url": None, "supplier_id": budget, "api_key": API_KEY, "rate": 20.0}
    first = make_rate_limiter(**options, governor=CONFIG, shared=True)  # type: ignore[arg-type]
    second = make_rate_limiter(**options, governor=CONFIG, shared=True)  # type: ignore[arg-type]
    assert first is second
    own = make_rate_limiter(**options, governor=CONFIG)  # type: ignore[arg-type]
    assert own is not first


# --- the Redis bucket --------------------------------------------------------------------


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def test_redis_handles_of_one_budget_learn_together_and_survive_a_restart(
    client: redis.Redis,
) -> None:
    key = bucket_key("test-governor", uuid.uuid4().hex, API_KEY) + ":governor"
    clock = FakeClock()
    one = RedisGovernedBucket(client, key, CONFIG, sleep=clock.sleep)
    two = RedisGovernedBucket(client, key, CONFIG, sleep=clock.sleep)
    try:
        one.acquire()
        assert two.acquire() > 0  # one budget: the second token waits for the first
        one.throttled(1.0)
        assert two.try_acquire() >= 0.9  # the other handle's callers hold too
        learnt = two.snapshot()
        assert learnt.throttled == 1 and learnt.rate < 20.0
        restarted = RedisGovernedBucket(client, key, CONFIG)
        assert restarted.snapshot().rate == pytest.approx(learnt.rate)
        assert 0 < client.ttl(key) <= 30 * 24 * 3600
    finally:
        client.delete(key)


def test_redis_answers_are_reported_in_batches_with_a_429_at_once(client: redis.Redis) -> None:
    key = bucket_key("test-governor", uuid.uuid4().hex, API_KEY) + ":governor"
    clock = FakeClock()
    bucket = RedisGovernedBucket(client, key, CONFIG, monotonic=clock.monotonic)
    try:
        for _ in range(5):
            bucket.answered(None)
        assert bucket.snapshot().accepted == 0  # not yet reported
        bucket.throttled(None)
        counted = bucket.snapshot()
        assert (counted.accepted, counted.throttled) == (5, 1)
        low = RateLimitInfo(limit=100, remaining=1, reset_seconds=1.0)
        bucket.answered(low)  # nearly spent: reported at once
        assert bucket.snapshot().accepted == 6
    finally:
        client.delete(key)


def test_redis_down_is_a_clear_error_and_nothing_is_sent() -> None:
    dead = redis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )
    bucket = RedisGovernedBucket(dead, "k", CONFIG)
    with pytest.raises(RateLimiterUnavailable):
        bucket.acquire()
    with pytest.raises(RateLimiterUnavailable):
        bucket.throttled(1.0)


# --- the supplier client teaches its limiter ---------------------------------------------


def test_the_client_teaches_its_limiter_429s_with_retry_after_zero_and_headers() -> None:
    clock = FakeClock()
    limiter = InProcessGovernedBucket(CONFIG, monotonic=clock.monotonic, sleep=clock.sleep)
    script = Script(
        error_response(429, "RATE_LIMITED", headers={"Retry-After": "0"}),
        json_response(200, CITIES, {"X-RateLimit-Limit": "30", "X-RateLimit-Remaining": "2"}),
    )
    client, _ = make_client(script, clock=clock, rate_limiter=limiter)
    assert client.list_cities().data.total == 1
    learnt = limiter.snapshot()
    assert (learnt.throttled, learnt.accepted) == (1, 1)
    assert learnt.rate < CONFIG.start_rate  # cut, though Retry-After asked for no wait
    assert sum(clock.sleeps) < 0.2  # no hold: the next token at the new pace only


def test_an_unreachable_limiter_does_not_lose_the_answer() -> None:
    dead = redis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )

    class Taught(RedisGovernedBucket):
        def acquire(self) -> float:  # the token came before Redis went away
            return 0.0

    clock = FakeClock()
    limiter = Taught(dead, "gone", CONFIG, monotonic=clock.monotonic)
    clock.advance(1.0)  # its answers are due to be reported
    supplier, _ = make_client(Script(json_response(200, CITIES)), rate_limiter=limiter)
    assert supplier.list_cities().data.total == 1
