"""What the quality gates' field profile costs per record: ``gates.profile_records``.

Run: ``.venv/bin/python bench/bench_gates.py [--hotels 20000] [--cities 20] [--rounds 7]``.
Pages are fetched once from the in-process simulator and decoded (not timed), as the
normalize stage has them; then every page is profiled and the pages' counts merged, as the
pipeline would do. Also timed: a worst case where no two records share a key order, and the
naive alternative (counting every key) for comparison. Prints µs/record (best round).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

from bench_normalize import fetch_pages

from supplier_sync_dagster.core.records.gates import FieldCounts, profile_records
from supplier_sync_dagster.simulator import Simulator, SimulatorConfig


def _profile_pages(pages: Sequence[list[Any]]) -> FieldCounts:
    total = FieldCounts()
    for records in pages:
        total.merge(profile_records(records))
    return total


def _naive(pages: Sequence[list[Any]]) -> Counter[str]:
    total: Counter[str] = Counter()
    for records in pages:
        total.update(chain.from_iterable(r for r in records if isinstance(r, dict)))
    return total


def _best(
    fn: Callable[[Sequence[list[Any]]], object], pages: Sequence[list[Any]], rounds: int
) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn(pages)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    """Fetch and decode the pages once, then time the profile over them."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hotels", type=int, default=20_000)
    parser.add_argument("--cities", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    sim = Simulator(SimulatorConfig(n_cities=args.cities, total_hotels=args.hotels))
    pages = [json.loads(body)["hotels"] for body in fetch_pages(sim)]
    del sim
    n = sum(len(p) for p in pages)
    profile = _profile_pages(pages)
    print(f"{n} records in {len(pages)} pages, {len(profile.fields)} distinct top-level fields")
    gc.freeze()

    def report(label: str, seconds: float) -> None:
        print(f"{label:<48} {seconds / n * 1e6:6.2f} µs/record")

    report("profile_records per page + merge", _best(_profile_pages, pages, args.rounds))
    report("naive Counter over every key (comparison)", _best(_naive, pages, args.rounds))
    rng = random.Random(7)
    shuffled = [[dict(rng.sample(list(r.items()), len(r))) for r in records] for records in pages]
    report(
        "worst case: every record's key order shuffled",
        _best(_profile_pages, shuffled, args.rounds),
    )


if __name__ == "__main__":
    main()
