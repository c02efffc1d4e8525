"""Load for the rate governor's proofs (and ``bench/bench_governor.py``): the simulator over
HTTP in a process of its own, limited and in the named rate-limit modes, and callers that
fetch from it as fast as their adaptive budget lets them, in threads of one process or in
several processes sharing Redis."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from supplier_sync_dagster.core.supplier import (
    RetryPolicy,
    SupplierClient,
    make_rate_limiter,
    supplier_http_client,
)
from supplier_sync_dagster.core.supplier.governor import GovernedLimiter, GovernorConfig
from supplier_sync_dagster_tests.helpers import cli_process, free_port, wait_for_http

SIM_KEY = "governor-proof-key"


@contextmanager
def simulator(limit: float, *modes: str, cities: int = 4, hotels: int = 200) -> Iterator[str]:
    """The simulator (seed 42) at ``limit`` requests/s with ``modes`` on, as a process; yields
    its URL."""
    port = free_port()
    argv = ["simulate", "--port", str(port), "--seed", "42"]
    argv += ["--cities", str(cities), "--hotels", str(hotels)]
    argv += ["--api-key", SIM_KEY, "--rate-limit", str(limit)]
    for mode in modes:
        argv += ["--mode", mode]
    proc = cli_process(*argv, env=dict(os.environ))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/_sim/stats", proc, timeout=180.0)
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@dataclass(frozen=True)
class Load:
    """What the callers of one budget sent and what their governor learnt.

    Attributes:
        requests: Requests sent (retries included).
        throttled: Of those, answered 429.
        rate: The governor's rate at the end.
        ceiling: Its estimate of the limit at the end.
    """

    requests: int
    throttled: int
    rate: float
    ceiling: float

    @property
    def share_429(self) -> float:
        """429 answers over requests."""
        return self.throttled / self.requests if self.requests else 0.0


def governor(start_rate: float) -> GovernorConfig:
    """The governor the proofs use: the resource's, started at ``start_rate``."""
    return GovernorConfig(start_rate=start_rate, min_rate=0.5, max_rate=10 * start_rate)


def budget_limiter(budget: str, redis_url: str | None, start_rate: float) -> GovernedLimiter:
    """The adaptive limiter of ``budget`` (in Redis when ``redis_url``, else in process)."""
    limiter = make_rate_limiter(
        redis_url=redis_url,
        supplier_id=budget,
        api_key=SIM_KEY,
        rate=start_rate,
        governor=governor(start_rate),
    )
    assert isinstance(limiter, GovernedLimiter)
    return limiter


def _fetch(
    url: str, budget: str, redis_url: str | None, start_rate: float, threads: int, seconds: float
) -> tuple[int, int, GovernedLimiter]:
    limiter = budget_limiter(budget, redis_url, start_rate)
    with supplier_http_client(url) as http:
        client = SupplierClient(
            http,
            api_key=SIM_KEY,
            supplier_id="sim",
            rate_limiter=limiter,
            retry=RetryPolicy(max_attempts=20, max_total_wait=60.0),
        )
        deadline = time.monotonic() + seconds

        def work() -> None:
            while time.monotonic() < deadline:
                client.list_cities()

        workers = [threading.Thread(target=work) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        stats = client.stats()
    return stats.requests, stats.rate_limited, limiter


def _process(
    url: str,
    budget: str,
    redis_url: str,
    start_rate: float,
    threads: int,
    seconds: float,
    out: multiprocessing.connection.Connection,
) -> None:
    requests, throttled, _ = _fetch(url, budget, redis_url, start_rate, threads, seconds)
    out.send((requests, throttled))
    out.close()


def run_load(
    url: str,
    *,
    seconds: float,
    start_rate: float,
    threads: int = 4,
    processes: int = 0,
    redis_url: str | None = None,
    budget: str | None = None,
) -> Load:
    """Fetch for ``seconds`` through one adaptive budget.

    Args:
        url: The simulator.
        seconds: How long the callers fetch.
        start_rate: The configured rate the budget starts from.
        threads: Callers per process.
        processes: Processes sharing the budget through Redis; 0: threads of this process,
            on an in-process budget.
        redis_url: Redis, for ``processes``.
        budget: The budget's name (several loads on one name share it); None: a fresh one.
    """
    budget = budget or f"proof/{uuid.uuid4().hex}"
    if not processes:
        requests, throttled, limiter = _fetch(url, budget, None, start_rate, threads, seconds)
        learnt = limiter.snapshot()
        return Load(requests, throttled, learnt.rate, learnt.ceiling)
    assert redis_url is not None
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for _ in range(processes):
        receive, send = ctx.Pipe(duplex=False)
        args = (url, budget, redis_url, start_rate, threads, seconds, send)
        proc = ctx.Process(target=_process, args=args)
        proc.start()
        pipes.append(receive)
        procs.append(proc)
    counts = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join(timeout=30)
    snap = budget_limiter(budget, redis_url, start_rate).snapshot()
    return Load(sum(c[0] for c in counts), sum(c[1] for c in counts), snap.rate, snap.ceiling)


def run_accounts(
    url: str, *, accounts: int, seconds: float, start_rate: float, redis_url: str
) -> Load:
    """``accounts`` accounts (two processes each, two threads in each) fetch at once through
    one budget in Redis, as accounts configured on one supplier key do; their loads summed."""
    budget = f"budget/{uuid.uuid4().hex}"
    loads: list[Load] = []

    def account() -> None:
        loads.append(
            run_load(
                url,
                seconds=seconds,
                start_rate=start_rate,
                threads=2,
                processes=2,
                redis_url=redis_url,
                budget=budget,
            )
        )

    threads = [threading.Thread(target=account) for _ in range(accounts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == accounts
    return Load(
        requests=sum(x.requests for x in loads),
        throttled=sum(x.throttled for x in loads),
        rate=loads[-1].rate,
        ceiling=loads[-1].ceiling,
    )
