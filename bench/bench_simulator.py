"""How fast the supplier simulator serves pages, in-process and over real HTTP.

Run: ``.venv/bin/python bench/bench_simulator.py [--hotels 200000] [--cities 200]``.
Prints one line per measurement; nothing is written to disk.
"""

from __future__ import annotations

import argparse
import time

import httpx

from supplier_sync_dagster.simulator import (
    Simulator,
    SimulatorConfig,
    encode_city_code,
    running_server,
)


def _walk(client: httpx.Client, codes: list[str], page_size: int) -> tuple[int, int]:
    hotels = requests = 0
    for code in codes:
        params: dict[str, str | int] = {"page_size": page_size}
        while True:
            r = client.get(f"/v1/cities/{encode_city_code(code)}/hotels", params=params)
            r.raise_for_status()
            body = r.json()
            requests += 1
            hotels += len(body["hotels"])
            if body["next_cursor"] is None:
                break
            params = {"page_size": page_size, "cursor": body["next_cursor"]}
    return hotels, requests


def main() -> None:
    """Measure full cursor traversals: cold (generation) and warm (cached), then over HTTP."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hotels", type=int, default=100_000)
    parser.add_argument("--cities", type=int, default=100)
    parser.add_argument("--page-size", type=int, default=500)
    args = parser.parse_args()
    sim = Simulator(
        SimulatorConfig(
            n_cities=args.cities, total_hotels=args.hotels, hotel_cache_size=args.hotels
        )
    )
    codes = sim.city_codes()
    with sim.client() as client:
        for label in ("in-process cold", "in-process warm"):
            started = time.perf_counter()
            hotels, requests = _walk(client, codes, args.page_size)
            elapsed = time.perf_counter() - started
            print(
                f"{label:18s} {hotels} hotels, {requests} pages in {elapsed:.2f} s: "
                f"{hotels / elapsed:,.0f} hotels/s, {elapsed / requests * 1000:.1f} ms/page"
            )
    with (
        running_server(sim) as url,
        httpx.Client(base_url=url, headers={"X-Api-Key": sim.config.api_key}, timeout=60) as client,
    ):
        started = time.perf_counter()
        hotels, requests = _walk(client, codes, args.page_size)
        elapsed = time.perf_counter() - started
        print(
            f"{'http warm (gzip)':18s} {hotels} hotels, {requests} pages in {elapsed:.2f} s: "
            f"{hotels / elapsed:,.0f} hotels/s, {elapsed / requests * 1000:.1f} ms/page"
        )
    print("stats:", {k: v for k, v in sim.stats.items() if k != "responses_by_status"})


if __name__ == "__main__":
    main()
