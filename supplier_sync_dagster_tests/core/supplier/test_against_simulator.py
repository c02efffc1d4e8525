"""The client against the project's simulator over real HTTP (uvicorn on loopback)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis

from supplier_sync_dagster.core.errors import SupplierAuthError
from supplier_sync_dagster.core.supplier import (
    CircuitBreaker,
    CityWalk,
    RetryPolicy,
    SupplierClient,
)
from supplier_sync_dagster.simulator import (
    HOSTILE_CITY_CODES,
    FaultProfile,
    Simulator,
    running_server,
)
from supplier_sync_dagster_tests.core.supplier.workers import hammer
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, make_simulator, serve_simulator


def sim_client(http: httpx.Client) -> SupplierClient:
    return SupplierClient(
        http,
        api_key=SIM_API_KEY,
        supplier_id="sim",
        connect_timeout=2.0,
        read_timeout=0.75,  # the simulator's slow fault sleeps 2 s: it must time out
        retry=RetryPolicy(max_attempts=8, base_delay=0.02, max_delay=0.5, max_retry_after=5),
        breaker=CircuitBreaker(name="sim", failure_threshold=20),
    )


@pytest.fixture
def flaky_server() -> Iterator[tuple[Simulator, str]]:
    faults = FaultProfile.flaky().with_(rate_cursor_expired=0.15)
    with serve_simulator(faults, seed=7, n_cities=12, total_hotels=2500) as served:
        yield served


def walk_everything(client: SupplierClient, page_size: int) -> dict[str, set[str]]:
    listed: dict[str, set[str]] = {}
    for city in client.list_cities().data.cities:
        ids = listed.setdefault(city.city_code, set())
        for item in CityWalk(client, city.city_code, page_size=page_size):
            ids.update(h["hotel_id"] for h in item.page.hotels)
    return listed


def test_flaky_walk_returns_exactly_the_ground_truth(flaky_server: tuple[Simulator, str]) -> None:
    sim, url = flaky_server
    truth = sim.ground_truth()
    with httpx.Client(base_url=url) as http:
        client = sim_client(http)
        listed = walk_everything(client, page_size=40)
        stats = client.stats()

    assert set(listed) == set(truth.listed_by_city)
    for code, expected in truth.listed_by_city.items():
        assert listed[code] == set(expected), f"city {code!r}"
    every = set().union(*listed.values())
    assert every == set(truth.valid) | set(truth.bad) == set(truth.versions)
    # The faults really happened and were absorbed.
    faults = sim.stats["faults"]
    assert sum(faults.values()) > 0
    assert stats.retries > 0 and stats.cursor_expired > 0


def test_hostile_city_codes_round_trip(flaky_server: tuple[Simulator, str]) -> None:
    sim, url = flaky_server
    truth = sim.ground_truth()
    with httpx.Client(base_url=url) as http:
        client = sim_client(http)
        served = {c.city_code for c in client.list_cities().data.cities}
        for code in HOSTILE_CITY_CODES:
            assert code in served
            assert client.get_city_summary(code).data.city_code == code
            pages = list(CityWalk(client, code, page_size=2))
            assert all(p.page.city_code == code for p in pages)
            ids = {h["hotel_id"] for p in pages for h in p.page.hotels}
            assert ids == set(truth.listed_by_city[code])


def test_wrong_key_stops_at_once() -> None:
    sim = make_simulator(n_cities=2, total_hotels=10)
    with running_server(sim) as url, httpx.Client(base_url=url) as http:
        client = SupplierClient(http, api_key="wrong-key-123", supplier_id="sim")
        with pytest.raises(SupplierAuthError) as info:
            client.list_cities()
        assert "wrong-key-123" not in str(info.value)
        assert client.stats().requests == 1


# --- the shared budget: four processes, one Redis bucket ------------------------------------

RATE = 20.0


def run_workers(url: str, redis_url: str | None, duration: float) -> tuple[float, int, int]:
    """Run 4 worker processes; returns (combined send rate, 429s seen, requests)."""
    key = f"test:shared:{uuid.uuid4().hex}"
    start_at = time.time() + 4.0  # all workers start together, after spawning
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=4, mp_context=ctx) as pool:
        futures = [
            pool.submit(hammer, url, SIM_API_KEY, RATE, redis_url, key, start_at, duration)
            for _ in range(4)
        ]
        results = [f.result(timeout=duration + 60) for f in futures]
    if redis_url is not None:
        redis.Redis.from_url(redis_url).delete(key)
    sent = sorted(t for r in results for t in r["sent"])
    rate = len(sent) / duration
    return rate, sum(r["responses_429"] for r in results), sum(r["requests"] for r in results)


@pytest.mark.redis
@pytest.mark.parametrize(
    ("shared", "duration"), [(True, 20.0), (False, 6.0)], ids=["shared-redis", "unshared"]
)
def test_four_processes_share_one_budget(redis_url: str, shared: bool, duration: float) -> None:
    sim = make_simulator(n_cities=3, total_hotels=30, rate_limit_rps=RATE)
    with running_server(sim) as url:
        rate, seen_429, requests = run_workers(url, redis_url if shared else None, duration)
        server_429 = sim.stats["responses_429"]
    within_budget = rate <= 1.05 * RATE and server_429 <= max(1, 0.005 * requests)
    if shared:
        assert rate <= 1.05 * RATE, f"combined {rate:.2f} req/s for a limit of {RATE}"
        assert rate >= 0.9 * RATE, f"combined {rate:.2f} req/s: the budget is underused"
        assert within_budget, f"{server_429} x 429 out of {requests} requests"
    else:
        # Four private buckets at the full rate each: the supplier refuses the excess (the
        # workers then honour Retry-After, which is why the share of 429s stays moderate).
        assert not within_budget
        assert seen_429 >= 5 and server_429 >= 5
