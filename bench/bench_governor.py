"""Benchmark the adaptive rate governor against the simulator over HTTP, in each of its
rate-limit fault modes.

The simulator runs in its own process at ``--limit`` requests/s; callers fetch as fast as one
adaptive budget lets them, starting from half the limit left to them. For each mode it prints
the rate the governor ended at and the limit it learnt over the true limit left to them, the
share of requests answered 429 and the requests/s the supplier accepted over that limit.

Modes:
  undisclosed_limit  no X-RateLimit-* headers, 429s without Retry-After (1 process, 4 threads)
  headers            the limit told in X-RateLimit-* headers (1 process, 4 threads)
  limit_swing        the limit halves after 5 s and doubles back after 10 s (1 process)
  shared_limit       another account on the key, unseen, spends half the limit (1 process):
                     the limit left to us is half
  two_accounts       two accounts on one key, two processes each, one budget in Redis

Usage:
    .venv/bin/python bench/bench_governor.py [--limit 80] [--seconds 30] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from supplier_sync_dagster_tests.core.supplier.governor_load import (
    run_accounts,
    run_load,
    simulator,
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
    modes: list[tuple[str, tuple[str, ...], float]] = [
        ("undisclosed_limit", ("undisclosed_limit",), 1.0),
        ("headers", (), 1.0),
        ("limit_swing", ("undisclosed_limit", "limit_swing"), 1.0),
        ("shared_limit", ("undisclosed_limit", "shared_limit"), 0.5),
        ("two_accounts", ("undisclosed_limit",), 1.0),
    ]
    for name, sim_modes, left in modes:
        with simulator(limit, *sim_modes) as url:
            if name == "two_accounts":
                load = run_accounts(
                    url, accounts=2, seconds=seconds, start_rate=start, redis_url=args.redis_url
                )
            else:
                load = run_load(url, seconds=seconds, start_rate=start * left, threads=4)
        true = limit * left
        accepted = (load.requests - load.throttled) / seconds
        print(
            f"{name:18} {load.rate / true:10.2f} {load.ceiling / true:12.2f} "
            f"{load.share_429:9.2%} {accepted / true:14.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
