"""Proof of the adaptive rate governor against the simulator over HTTP (a process of its own)
in the named rate-limit modes: the supplier client, paced by one adaptive budget, learns the
limit it is never told to within a cut of it, with fewer than 1 % of its requests answered
429, in threads of one process and in four processes sharing Redis; and two accounts on one
supplier key share one budget."""

from __future__ import annotations

import pytest

from supplier_sync_dagster_tests.core.supplier.governor_load import (
    Load,
    run_accounts,
    run_load,
    simulator,
)

LIMIT = 50.0
SECONDS = 24.0


def assert_converged(load: Load, limit: float = LIMIT) -> None:
    assert load.ceiling >= 0.9 * limit, load  # the limit it learnt
    assert 0.8 * limit <= load.rate <= 1.5 * limit, load  # paced within a cut of it
    assert load.share_429 < 0.01, load
    assert load.requests >= 0.5 * limit * SECONDS, load  # it did send (retries included)


def test_one_process_learns_an_undisclosed_limit() -> None:
    with simulator(LIMIT, "undisclosed_limit") as url:
        load = run_load(url, seconds=SECONDS, start_rate=LIMIT / 2, threads=4)
    assert_converged(load)


def test_four_processes_sharing_redis_learn_an_undisclosed_limit(redis_url: str) -> None:
    with simulator(LIMIT, "undisclosed_limit") as url:
        load = run_load(
            url, seconds=SECONDS, start_rate=LIMIT / 2, threads=2, processes=4, redis_url=redis_url
        )
    assert_converged(load)


def test_two_accounts_on_one_key_share_one_budget(redis_url: str) -> None:
    """Two accounts' processes pace on the one budget their configuration names, against a
    limit the supplier keeps for the key: together they learn it, not twice it."""
    with simulator(LIMIT, "undisclosed_limit") as url:
        load = run_accounts(
            url, accounts=2, seconds=SECONDS, start_rate=LIMIT / 2, redis_url=redis_url
        )
    assert_converged(load)


@pytest.mark.parametrize("limit", [60.0])
def test_a_disclosed_limit_is_followed_without_429s(limit: float) -> None:
    with simulator(limit) as url:
        load = run_load(url, seconds=10.0, start_rate=limit / 2, threads=4)
    assert load.ceiling >= 0.9 * limit, load
    assert load.share_429 < 0.01, load
