"""How fast normalization turns simulator records into the platform's model.

Times ``normalize_documents``, what a sync runs (the fast path, with the reference
normalizer for every record it does not take), and the canonical JSON and fingerprint the
sync computes per hotel.

Run: ``.venv/bin/python bench/bench_normalize.py [--hotels 20000] [--cities 20] [--rounds 5]``.
Pages are fetched once from the in-process simulator and kept as raw JSON bytes, as the
pipeline keeps raw snapshots (not timed). The main figure is the pipeline's shape: per page,
decode (not timed), normalize (timed), drop. A second figure keeps all decoded records in memory
and normalizes them in one call: the cyclic GC then walks millions of live containers several
times, which can cost more than normalization itself (the "gc" column is GC time during the
whole round, decoding included). Figures with the start-up heap frozen (``gc.freeze()``, as a
long-running worker should do) and with the GC disabled (pure CPU cost) are printed too.
Prints hotels/s and µs/hotel; nothing is written to disk.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

from supplier_sync_dagster.core.records import normalize as n
from supplier_sync_dagster.core.records import rules
from supplier_sync_dagster.simulator import (
    FaultProfile,
    Simulator,
    SimulatorConfig,
    encode_city_code,
)


def fetch_pages_by_city(sim: Simulator, page_size: int = 500) -> dict[str, list[bytes]]:
    """City code -> the raw body of each of its pages, walked with page numbers."""
    client = sim.client()
    pages: dict[str, list[bytes]] = {}
    for city in client.get("/v1/cities").json()["cities"]:
        bodies = pages.setdefault(city["city_code"], [])
        page = 1
        while True:
            r = client.get(
                f"/v1/cities/{encode_city_code(city['city_code'])}/hotels",
                params={"page": page, "page_size": page_size},
            )
            r.raise_for_status()
            if not r.json()["hotels"]:
                break
            bodies.append(r.content)
            page += 1
    return pages


def fetch_pages(sim: Simulator, page_size: int = 500) -> list[bytes]:
    """The raw body of every page of every city, walked with page numbers."""
    return [body for bodies in fetch_pages_by_city(sim, page_size).values() for body in bodies]


class _GcTimer:
    """Sums the time spent in cyclic garbage collections."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def _report(label: str, count: int, seconds: float, gc_seconds: float | None = None) -> None:
    line = f"{label:<44} {count / seconds:>9,.0f} hotels/s {seconds / count * 1e6:>7.1f} µs/hotel"
    if gc_seconds is not None:
        line += f"  (gc {gc_seconds / count * 1e6:.1f} µs/hotel)"
    print(line)


def _paged(pages: Sequence[bytes], gc_timer: _GcTimer) -> tuple[int, float, float]:
    """Decode, normalize and drop page by page; returns (hotels, normalize s, gc s)."""
    count, spent = 0, 0.0
    gc_before = gc_timer.seconds
    for body in pages:
        records = json.loads(body)["hotels"]
        start = time.perf_counter()
        result = n.normalize_documents(records)
        spent += time.perf_counter() - start
        count += len(result.docs) + len(result.rejections)
        del result, records
    return count, spent, gc_timer.seconds - gc_before


def _best_paged(
    pages: Sequence[bytes], rounds: int, gc_timer: _GcTimer
) -> tuple[int, float, float]:
    return min((_paged(pages, gc_timer) for _ in range(rounds)), key=lambda r: r[1])


def main() -> None:
    """Fetch the pages once, then time normalization over them."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hotels", type=int, default=20_000)
    parser.add_argument("--cities", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    gc_timer = _GcTimer()

    sim = Simulator(SimulatorConfig(n_cities=args.cities, total_hotels=args.hotels))
    pages = fetch_pages(sim)
    del sim  # its world and caches would only slow the GC down
    records = [r for body in pages for r in json.loads(body)["hotels"]]
    rooms = sum(len(r["rooms"]) for r in records)
    plans = sum(len(room["rate_plans"]) for r in records for room in r["rooms"])
    print(
        f"{len(records)} records in {len(pages)} pages: {rooms / len(records):.2f} rooms and "
        f"{plans / len(records):.2f} rate plans per hotel"
    )
    big = [r for r in records if len(r["rooms"]) >= 3]
    big_plans = sum(len(room["rate_plans"]) for r in big for room in r["rooms"]) / len(big)
    big_pages = [json.dumps({"hotels": big[i : i + 500]}).encode() for i in range(0, len(big), 500)]
    del records

    del big
    rules.phone_e164.cache_clear()
    rules._offset.cache_clear()
    _report("per page, cold caches (first round)", *_paged(pages, gc_timer))
    _report("per page, warm (best round)", *_best_paged(pages, args.rounds, gc_timer))
    # A long-running worker freezes its start-up heap (modules, caches) so that the cyclic
    # GC stops re-walking it; here that heap also holds the simulator's geonames catalogue.
    gc.freeze()
    _report("per page, warm, start-up heap frozen", *_best_paged(pages, args.rounds, gc_timer))
    _report(
        f"  same, 3+ rooms ({big_plans:.1f} plans/hotel)",
        *_best_paged(big_pages, args.rounds, gc_timer),
    )
    gc.disable()
    _report("per page, GC disabled (CPU cost alone)", *_best_paged(pages, args.rounds, gc_timer))
    gc.enable()
    gc.unfreeze()

    bad_sim = Simulator(
        SimulatorConfig(
            n_cities=args.cities,
            total_hotels=min(args.hotels, 5_000),
            faults=FaultProfile.clean().with_(bad_record_rate=0.2),
        )
    )
    bad_pages = fetch_pages(bad_sim)
    del bad_sim
    gc.freeze()
    _report("per page, 20% bad records, frozen", *_best_paged(bad_pages, args.rounds, gc_timer))
    gc.unfreeze()

    records = [r for body in pages for r in json.loads(body)["hotels"]]
    gc_before = gc_timer.seconds
    start = time.perf_counter()
    docs = n.normalize_documents(records).docs
    _report(
        "one call, all records live (GC-heavy)",
        len(records),
        time.perf_counter() - start,
        gc_timer.seconds - gc_before,
    )
    start = time.perf_counter()
    for doc in docs:
        hashlib.sha256(n.canonical_dumps(doc)).hexdigest()
    _report("canonical JSON + fingerprint", len(docs), time.perf_counter() - start)


if __name__ == "__main__":
    main()
