"""Benchmark the adaptive rate governor against the simulator over HTTP, in each of its
rate-limit fault modes.

The simulator runs in its own process at ``--limit`` requests/s; callers fetch as fast as one
adaptive budget lets them, starting from half the limit. For each mode it prints the rate the
governor ended at and the limit it learnt over the true limit, the share of requests answered
429 and the requests/s the supplier accepted over the true limit.

Modes:
  undisclosed_limit  no X-RateLimit-* headers, 429s without Retry-After (1 process, 4 threads)
  headers            the limit told in X-RateLimit-* headers (1 process, 4 threads)
  limit_swing        the limit halves after 5 s and doubles back after 10 s (1 process)
  shared_limit       two accounts on one key, two processes each, one budget in Redis

Usage:
    .venv/bin/python bench/bench_governor.py [--limit 80] [--seconds 30] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import sys
import threading
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from supplier_sync_dagster_tests.core.supplier.governor_load import Load, run_load, simulator


def _two_accounts(url: str, seconds: float, start: float, redis_url: str) -> Load:
    budget = f"bench/{uuid.uuid4().hex}"
    loads: list[Load] = []

    def account() -> None:
        loads.append(
            run_load(
                url,
                seconds=seconds,
                start_rate=start,
                threads=2,
                processes=2,
                redis_url=redis_url,
                budget=budget,
            )
        )

    accounts = [threading.Thread(target=account) for _ in range(2)]
    for a in accounts:
        a.start()
    for a in accounts:
        a.join()
    return Load(
        sum(x.requests for x in loads),
        sum(x.throttled for x in loads),
        loads[-1].rate,
        loads[-1].ceiling,
    )


def main() -> int:
    """Run every mode and print one line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=float, default=80.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    limit, seconds, start = args.limit, args.seconds, args.limit / 2
    print(f"true limit {limit:g} req/s, {seconds:g} s per mode, starting at {start:g} req/s")
    print(
        f"{'mode':18} {'rate/limit':>10} {'learnt/limit':>12} {'429 share':>9} {'accepted/limit':>14}"
    )
    modes: list[tuple[str, tuple[str, ...]]] = [
        ("undisclosed_limit", ("undisclosed_limit",)),
        ("headers", ()),
        ("limit_swing", ("undisclosed_limit", "limit_swing")),
        ("shared_limit", ("undisclosed_limit", "shared_limit")),
    ]
    for name, sim_modes in modes:
        with simulator(limit, *sim_modes) as url:
            if name == "shared_limit":
                load = _two_accounts(url, seconds, start, args.redis_url)
            else:
                load = run_load(url, seconds=seconds, start_rate=start, threads=4)
        accepted = (load.requests - load.throttled) / seconds
        print(
            f"{name:18} {load.rate / limit:10.2f} {load.ceiling / limit:12.2f} "
            f"{load.share_429:9.2%} {accepted / limit:14.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
