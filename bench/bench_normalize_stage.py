"""CPU of a sync worker's normalize stage, per hotel and per city: normalization and quality.

Run: ``.venv/bin/python bench/bench_normalize_stage.py [--hotels 20000] [--cities 40]
[--rounds 3]``. Pages of 100 clean records are fetched once from the in-process simulator and
kept as raw JSON bytes (not timed). Then, city by city, as ``stages.Normalizer`` does
without its I/O: each page is decoded (not timed) and normalized (``normalize_documents``),
the city's documents are checked by ``quality.check_quality`` in chunks of
``SyncSettings.chunk_hotels``, and each kept document is encoded and fingerprinted
(``canonical_dumps`` + sha256). Phone caches are cleared before each round, as a worker meets
new numbers; the heap is frozen by ``runtime.prepare_process`` as in a worker. Prints the
process CPU time per hotel and per city, best of ``--rounds``. Many small cities (e.g.
``--hotels 3000 --cities 60``: one page each) show the fixed cost per city; few large ones
the cost per hotel.

A second figure runs the stage itself, ``stages.Normalizer`` without a writer (nothing
stored), over the decoded pages of each city: its per-page and per-chunk bookkeeping, the
quality pass as a sync calls it, canonical JSON and the candidates' fingerprints. Its only
database work is the clock read per chunk (a throwaway SQLite file).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_normalize import fetch_pages_by_city

from supplier_sync_dagster.core.records import quality, rules
from supplier_sync_dagster.core.records.normalize import canonical_dumps, normalize_documents
from supplier_sync_dagster.core.records.quality import check_quality
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.sync.model import NO_PROGRESS, CityReport, SyncSettings
from supplier_sync_dagster.core.sync.runtime import prepare_process
from supplier_sync_dagster.core.sync.snapshots import StoredPage
from supplier_sync_dagster.core.sync.stages import Normalizer
from supplier_sync_dagster.simulator import FaultProfile, Simulator, SimulatorConfig


def _round(pages: dict[str, list[bytes]], countries: dict[str, str], chunk: int) -> float:
    """CPU seconds of one pass over every city, JSON decoding left out."""
    rules.phone_e164.cache_clear()
    quality._phone_ok.cache_clear()
    decoding = 0.0
    began = time.process_time()
    for city, bodies in pages.items():
        docs: list[dict[str, Any]] = []
        for body in bodies:
            start = time.process_time()
            records = json.loads(body)["hotels"]
            decoding += time.process_time() - start
            docs += normalize_documents(records).docs
        for i in range(0, len(docs), chunk):
            part = docs[i : i + chunk]
            result = check_quality(part, city_code=city, city_countries=countries)
            assert not result.failures, result.failures[:3]
            for pos in result.valid:
                hashlib.sha256(canonical_dumps(part[pos])).hexdigest()
    return time.process_time() - began - decoding


def _stage_round(
    decoded: dict[str, list[tuple[StoredPage, list[Any]]]],
    countries: dict[str, str],
    db: SyncDatabase,
    store: LocalPayloadStore,
) -> float:
    """CPU seconds of ``stages.Normalizer`` (no writer) over every city's decoded pages."""
    rules.phone_e164.cache_clear()
    quality._phone_ok.cache_clear()
    settings = SyncSettings(task_code="bench", supplier_id=1)
    began = time.process_time()
    for city, pages in decoded.items():
        report = CityReport(city)
        normalizer = Normalizer(
            db,
            "bench-batch",
            city,
            store,
            NO_PROGRESS,
            settings,
            report,
            countries,
            writer=None,
            drift_check=False,
            listing_city=city,
        )
        normalizer.stored_pages_seen = True
        for raw, records in pages:
            normalizer.add(raw, records)
        normalizer.finish()
        assert report.dead_letters == 0, report.dead_letters_by_code
    return time.process_time() - began


def main() -> None:
    """Fetch the pages once, then time the stage over every city, best of the rounds."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hotels", type=int, default=20_000)
    parser.add_argument("--cities", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sim = Simulator(
        SimulatorConfig(n_cities=args.cities, total_hotels=args.hotels, faults=FaultProfile.clean())
    )
    countries = {
        c["city_code"]: c["country_code"] for c in sim.client().get("/v1/cities").json()["cities"]
    }
    pages = fetch_pages_by_city(sim, page_size=100)
    hotels = sum(len(json.loads(b)["hotels"]) for bodies in pages.values() for b in bodies)
    prepare_process()
    best = min(_round(pages, countries, SyncSettings.chunk_hotels) for _ in range(args.rounds))
    print(
        f"{hotels} hotels in {len(pages)} cities (pages of 100): {best:.2f} s CPU = "
        f"{best / hotels * 1e6:.1f} µs/hotel, {best / len(pages) * 1e3:.2f} ms/city "
        f"(best of {args.rounds}; JSON decoding left out)"
    )
    decoded = {
        city: [
            (StoredPage(f"ref-{city}-{n}", f"{city}-{n}", n, None), json.loads(body)["hotels"])
            for n, body in enumerate(bodies, start=1)
        ]
        for city, bodies in pages.items()
    }
    # A worker holds a page or two decoded, not the whole supplier: the full collections
    # the stage makes on a clock should not walk every decoded page.
    gc.freeze()
    with tempfile.TemporaryDirectory() as tmp:
        db = SyncDatabase.open(f"sqlite:///{Path(tmp) / 'bench.sqlite3'}")
        store = LocalPayloadStore(Path(tmp) / "payloads", fsync=False)
        try:
            best = min(_stage_round(decoded, countries, db, store) for _ in range(args.rounds))
        finally:
            db.engine.dispose()
    print(
        f"stages.Normalizer, no writer: {best:.2f} s CPU = {best / hotels * 1e6:.1f} µs/hotel "
        f"= {best / hotels * 1e3:.4f} CPU-s per 1,000 hotels, {best / len(pages) * 1e3:.2f} "
        f"ms/city (best of {args.rounds})"
    )


if __name__ == "__main__":
    main()
