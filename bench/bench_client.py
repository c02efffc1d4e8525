"""Benchmark the supplier client against the simulator over loopback HTTP.

The simulator runs in its own process (uvicorn), so the CPU time measured in this process
(``time.process_time``) is the client's own: HTTP, gzip, JSON parsing, validation.

Scenarios:
  1. Throughput: walk every city with no faults and no rate limit, per page size.
  2. Pacing: walk with the supplier limited to R requests/s and the client's token bucket
     at R; report achieved rate / R (target >= 0.97) and any 429s.

Usage:
    .venv/bin/python bench/bench_client.py [--hotels 20000] [--cities 40]
        [--page-sizes 100,500] [--rate 20] [--rate-seconds 15] [--redis-url URL]
        [--pacing-cities 4] [--pacing-hotels 2000] [--skip-pacing]
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import socket
import sys
import time
import uuid
from dataclasses import dataclass

import httpx

from supplier_sync_dagster.core.supplier import (
    CityWalk,
    InProcessTokenBucket,
    RateLimiter,
    RedisTokenBucket,
    RetryPolicy,
    SupplierClient,
)
from supplier_sync_dagster.dagster_instance.deployment import free_port
from supplier_sync_dagster.simulator import Simulator, SimulatorConfig, serve

API_KEY = "bench-key"


def _serve(
    config: SimulatorConfig, port: int, out: multiprocessing.connection.Connection | None
) -> None:
    """Child process: build the world, send its ground truth back if asked, serve over HTTP."""
    sim = Simulator(config)
    if out is not None:
        truth = sim.ground_truth()
        out.send((dict(truth.valid), dict(truth.bad)))
        out.close()
    serve(sim, host="127.0.0.1", port=port, log_level="warning")


class ServerProcess:
    """The simulator in a child process, stopped on exit.

    With ``truth=True`` the child computes its ground truth before serving and ``truth``
    holds it as (valid hotel id -> version, bad hotel id -> expected error code).
    """

    def __init__(self, config: SimulatorConfig, *, truth: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        ctx = multiprocessing.get_context("spawn")
        self._recv: multiprocessing.connection.Connection | None = None
        send: multiprocessing.connection.Connection | None = None
        if truth:
            self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_serve, args=(config, self.port, send), daemon=True)
        self.truth: tuple[dict[str, int], dict[str, str]] = ({}, {})

    def __enter__(self) -> ServerProcess:
        self._proc.start()
        if self._recv is not None:
            self.truth = self._recv.recv()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self._proc.terminate()
        raise RuntimeError("the simulator did not start within 120 s")

    @property
    def pid(self) -> int | None:
        """The simulator's process id (None before it starts)."""
        return self._proc.pid

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        self._proc.join(timeout=10)


@dataclass
class WalkResult:
    """What one measured walk did."""

    pages: int
    hotels: int
    wall: float
    cpu: float
    requests: int
    rate_limited: int
    raw_bytes: int


def walk(client: SupplierClient, cities: list[str], page_size: int, deadline: float) -> WalkResult:
    """Walk cities (cycling through them) until all are done or ``deadline`` passes."""
    before = client.stats()
    pages = hotels = raw_bytes = 0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for code in cities:
        for item in CityWalk(client, code, page_size=page_size):
            pages += 1
            hotels += len(item.page.hotels)
            raw_bytes += len(item.raw)
            if time.monotonic() >= deadline:
                break
        if time.monotonic() >= deadline:
            break
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    after = client.stats()
    return WalkResult(
        pages=pages,
        hotels=hotels,
        wall=wall,
        cpu=cpu,
        requests=after.requests - before.requests,
        rate_limited=after.rate_limited - before.rate_limited,
        raw_bytes=raw_bytes,
    )


def throughput(args: argparse.Namespace) -> list[tuple[int, WalkResult]]:
    """Scenario 1: no faults, no limit."""
    config = SimulatorConfig(
        seed=args.seed, n_cities=args.cities, total_hotels=args.hotels, api_key=API_KEY
    )
    results = []
    with ServerProcess(config) as server, httpx.Client(base_url=server.url) as http:
        client = SupplierClient(http, api_key=API_KEY, supplier_id="bench")
        cities = [c.city_code for c in client.list_cities().data.cities]
        # Warm-up: the simulator builds each city on first use; keep that out of the figures.
        walk(client, cities, max(args.page_sizes), time.monotonic() + 120)
        for size in args.page_sizes:
            results.append((size, walk(client, cities, size, time.monotonic() + 120)))
    return results


def pacing(args: argparse.Namespace) -> tuple[WalkResult, float]:
    """Scenario 2: supplier limited to R req/s; client bucket at R. Returns (result, R)."""
    rate = args.rate
    # A small world: the simulator builds a city on first use, and a page slower than 1/R
    # (a cold city) would measure the simulator, not the client's pacing.
    config = SimulatorConfig(
        seed=args.seed,
        n_cities=args.pacing_cities,
        total_hotels=args.pacing_hotels,
        api_key=API_KEY,
        rate_limit_rps=rate,
    )
    limiter: RateLimiter
    if args.redis_url:
        import redis

        limiter = RedisTokenBucket(
            redis.Redis.from_url(args.redis_url), f"bench:{uuid.uuid4().hex}", rate, 1
        )
    else:
        limiter = InProcessTokenBucket(rate, 1)
    with ServerProcess(config) as server, httpx.Client(base_url=server.url) as http:
        client = SupplierClient(
            http,
            api_key=API_KEY,
            supplier_id="bench",
            rate_limiter=limiter,
            retry=RetryPolicy(max_total_wait=600),
        )
        cities = [c.city_code for c in client.list_cities().data.cities]
        limiter.acquire()  # drain the start-up token so the window is steady state
        deadline = time.monotonic() + args.rate_seconds
        result = walk(client, cities * 100, args.page_sizes[0], deadline)
    return result, rate


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        0 when the pacing target (achieved / R >= 0.97, no 429) is met, 1 otherwise.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hotels", type=int, default=20_000, help="hotels in the world")
    parser.add_argument("--cities", type=int, default=40, help="cities in the world")
    parser.add_argument(
        "--page-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[100, 500],
        help="comma-separated page sizes (default 100,500)",
    )
    parser.add_argument("--rate", type=float, default=20.0, help="R, requests/s for pacing")
    parser.add_argument("--rate-seconds", type=float, default=15.0, help="pacing duration")
    parser.add_argument("--pacing-cities", type=int, default=4, help="cities when pacing")
    parser.add_argument("--pacing-hotels", type=int, default=2000, help="hotels when pacing")
    parser.add_argument("--redis-url", default=None, help="pace with a Redis bucket instead")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--skip-pacing", action="store_true")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    print(f"simulator: {args.hotels} hotels in {args.cities} cities, loopback HTTP, no faults")
    print()
    header = (
        f"{'page size':>9} {'pages':>6} {'hotels':>7} {'wall s':>7} {'pages/s':>8} "
        f"{'hotels/s':>9} {'MB/s':>6} {'client CPU ms/page':>19} {'CPU share':>9}"
    )
    print(header)
    print("-" * len(header))
    for size, r in throughput(args):
        print(
            f"{size:>9} {r.pages:>6} {r.hotels:>7} {r.wall:>7.2f} {r.pages / r.wall:>8.1f} "
            f"{r.hotels / r.wall:>9.0f} {r.raw_bytes / r.wall / 1e6:>6.1f} "
            f"{r.cpu / r.pages * 1000:>19.2f} {r.cpu / r.wall:>9.0%}"
        )
    ok = True
    if not args.skip_pacing:
        r, rate = pacing(args)
        achieved = r.requests / r.wall
        ratio = achieved / rate
        ok = ratio >= 0.97 and r.rate_limited == 0
        limiter = "Redis" if args.redis_url else "in-process"
        print()
        print(
            f"pacing ({limiter} bucket, burst 1): supplier limit R = {rate:g} req/s, "
            f"{r.wall:.1f} s, page size {args.page_sizes[0]}"
        )
        print(
            f"  requests {r.requests}, achieved {achieved:.2f} req/s, "
            f"achieved/R = {ratio:.3f} (target >= 0.97), 429s = {r.rate_limited} "
            f"-> {'OK' if ok else 'MISSED'}"
        )
    print(f"\ntotal benchmark time {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
