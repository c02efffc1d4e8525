"""How much the row-level quality layer costs per hotel, per chunk size.

Run: ``.venv/bin/python bench/bench_quality.py [--rounds 5] [--sizes 500,2000,10000]``.
Clean simulator hotels are fetched once, normalized and turned into canonical documents, as
the pipeline holds them (not timed). Each chunk is then checked with
``quality.check_quality`` against the chunk's largest city (the others count as moved, which
costs the same). The garbage collector is tuned by ``runtime.prepare_process`` as in a sync worker. Figures: best of ``--rounds``, with warm caches (phone numbers seen before), and a cold
round (phone cache cleared) where every distinct number is parsed by libphonenumber once;
``parse_phones=False`` keeps only the vectorised E.164 shape check; ``normalized=True`` is
what a sync passes for documents straight from normalization; a last round has one
failing hotel, so that the frames are built and pandera validates them. Prints µs per hotel and
ms per 1,000 hotels, split into flatten (documents -> columns), validate (the rules over the
columns: a clean chunk needs no frame and no pandera pass) and report.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from typing import Any

from supplier_sync_dagster.core.records import quality
from supplier_sync_dagster.core.records.normalize import canonical_json, normalize_records
from supplier_sync_dagster.core.records.rules import phone_e164
from supplier_sync_dagster.core.sync.runtime import prepare_process
from supplier_sync_dagster.simulator import (
    FaultProfile,
    Simulator,
    SimulatorConfig,
    encode_city_code,
)


def clean_docs(total: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Normalized documents of a clean simulated supplier, and its city -> country map."""
    sim = Simulator(SimulatorConfig(n_cities=8, total_hotels=total, faults=FaultProfile.clean()))
    client = sim.client()
    cities = client.get("/v1/cities").json()["cities"]
    records: list[Any] = []
    for city in cities:
        page = 1
        while hotels := client.get(
            f"/v1/cities/{encode_city_code(city['city_code'])}/hotels",
            params={"page": page, "page_size": 500},
        ).json()["hotels"]:
            records.extend(hotels)
            page += 1
    docs = [json.loads(canonical_json(h)) for h in normalize_records(records).hotels]
    return docs, {c["city_code"]: c["country_code"] for c in cities}


def _run(
    chunk: list[dict[str, Any]],
    city: str,
    countries: dict[str, str],
    parse_phones: bool,
    normalized: bool = False,
) -> tuple[float, dict[str, float]]:
    start = time.perf_counter()
    result = quality.check_quality(
        chunk,
        city_code=city,
        city_countries=countries,
        parse_phones=parse_phones,
        normalized=normalized,
    )
    spent = time.perf_counter() - start
    assert len(result.failures) == sum(d["lat"] > 90 for d in chunk), result.failures[:3]
    return spent, dict(result.seconds)


def _line(label: str, n: int, spent: float, parts: dict[str, float]) -> None:
    split = "  ".join(f"{k} {v / n * 1e6:5.1f}" for k, v in parts.items())
    print(
        f"{label:<34} {spent / n * 1e6:7.1f} µs/hotel {spent / n * 1e6:8.1f} ms/1,000  ({split} µs)"
    )


def main() -> None:
    """Build the documents once, then time check_quality per chunk size."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="500,2000,10000")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    docs, countries = clean_docs(max(sizes))
    rooms = sum(len(d["rooms"]) for d in docs) / len(docs)
    plans = sum(len(r["rate_plans"]) for d in docs for r in d["rooms"]) / len(docs)
    phones = len({d["phone_e164"] for d in docs})
    print(
        f"{len(docs)} clean hotels: {rooms:.2f} rooms, {plans:.2f} rate plans per hotel, "
        f"{phones} distinct phone numbers"
    )
    prepare_process()  # what a sync worker does: freeze the heap, rarer young collections
    for size in sizes:
        chunk = docs[:size]
        city = Counter(d["city_code"] for d in chunk).most_common(1)[0][0]
        phone_e164.cache_clear()
        quality._phone_ok.cache_clear()
        _line(f"{size:>6} hotels, cold phone cache", size, *_run(chunk, city, countries, True))
        best = min(
            (_run(chunk, city, countries, True) for _ in range(args.rounds)), key=lambda r: r[0]
        )
        _line(f"{size:>6} hotels, warm (best)", size, *best)
        best = min(
            (_run(chunk, city, countries, False) for _ in range(args.rounds)), key=lambda r: r[0]
        )
        _line(f"{size:>6} hotels, parse_phones=False", size, *best)
        # What a sync passes: documents straight from normalization.
        best = min(
            (_run(chunk, city, countries, False, True) for _ in range(args.rounds)),
            key=lambda r: r[0],
        )
        _line(f"{size:>6} hotels, normalized=True", size, *best)
        # One failing hotel: the frames are built and pandera validates them.
        damaged = [{**chunk[0], "lat": 123.0}, *chunk[1:]]
        best = min(
            (_run(damaged, city, countries, True) for _ in range(args.rounds)), key=lambda r: r[0]
        )
        _line(f"{size:>6} hotels, one fails (pandera)", size, *best)


if __name__ == "__main__":
    main()
