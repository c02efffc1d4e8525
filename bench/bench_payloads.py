"""Throughput of the payload store for typical raw supplier pages.

Usage:
    .venv/bin/python bench/bench_payloads.py [--pages 60] [--levels 1,6,9] [--no-s3]

Pages are real simulator answers (``GET /v1/cities/{code}/hotels?page=N&page_size=M``,
100 and 500 hotels, about 150 KB and 750 KB of JSON), all distinct. For each page size it
prints:

- gzip alone: CPU time per page (``time.process_time``) and compression ratio per level;
- ``put`` of every page into a fresh store: pages/s and MB/s (uncompressed) on a local
  folder (with and without fsync) and on moto's S3 server on loopback (``put`` one by one
  and ``put_many`` with its thread pool), then ``get`` of every page back.

moto is an in-process Python server, so its figures bound the client side (hash, gzip,
signing, HTTP) and are no estimate of a real S3 round trip.
"""

from __future__ import annotations

import argparse
import gzip
import logging
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from supplier_sync_dagster.core.store.payloads import (
    LocalPayloadStore,
    PayloadStore,
    S3PayloadStore,
)
from supplier_sync_dagster.simulator import Simulator, SimulatorConfig, encode_city_code

MB = 1024 * 1024


def fetch_pages(page_size: int, n_pages: int) -> list[bytes]:
    """Distinct raw pages of ``page_size`` hotels, biggest cities first."""
    sim = Simulator(SimulatorConfig(n_cities=20, total_hotels=max(30_000, page_size * n_pages)))
    pages: list[bytes] = []
    with sim.client() as client:
        cities = client.get("/v1/cities").json()["cities"]
        cities.sort(key=lambda c: -c["hotel_count"])
        for city in cities:
            path = f"/v1/cities/{encode_city_code(city['city_code'])}/hotels"
            for page in range(1, city["hotel_count"] // page_size + 1):  # full pages only
                response = client.get(path, params={"page": page, "page_size": page_size})
                response.raise_for_status()
                pages.append(response.content)
                if len(pages) == n_pages:
                    return pages
    return pages


def gzip_row(pages: Sequence[bytes], level: int) -> str:
    cpu: list[float] = []
    stored = 0
    for page in pages:
        start = time.process_time()
        blob = gzip.compress(page, compresslevel=level, mtime=0)
        cpu.append(time.process_time() - start)
        stored += len(blob)
    raw = sum(len(p) for p in pages)
    return (
        f"  gzip level {level}: {statistics.fmean(cpu) * 1000:6.2f} ms CPU/page "
        f"(median {statistics.median(cpu) * 1000:6.2f}), ratio {raw / stored:5.1f}x, "
        f"{raw / sum(cpu) / MB if sum(cpu) else float('inf'):6.1f} MB/s/core"
    )


def timed_row(label: str, pages: Sequence[bytes], run: Callable[[], object]) -> str:
    start = time.perf_counter()
    cpu0 = time.process_time()
    run()
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    raw = sum(len(p) for p in pages)
    return (
        f"  {label:<36} {len(pages) / wall:8.1f} pages/s {raw / wall / MB:8.1f} MB/s   "
        f"{wall / len(pages) * 1000:7.2f} ms/page wall  {cpu / len(pages) * 1000:7.2f} ms/page CPU"
    )


def store_rows(name: str, pages: Sequence[bytes], make: Callable[[], PayloadStore]) -> list[str]:
    rows = []
    store = make()
    refs: list[str] = []
    rows.append(
        timed_row(
            f"{name} put", pages, lambda: refs.extend(store.put(p, kind="raw").ref for p in pages)
        )
    )
    rows.append(
        timed_row(
            f"{name} put (again, exists)", pages, lambda: [store.put(p, kind="raw") for p in pages]
        )
    )
    rows.append(timed_row(f"{name} get", pages, lambda: [store.get(r) for r in refs]))
    if isinstance(store, S3PayloadStore):
        fresh = make()
        rows.append(
            timed_row(
                f"{name} put_many (8 threads)", pages, lambda: fresh.put_many(pages, kind="raw")
            )
        )
    return rows


@contextmanager
def moto_s3() -> Iterator[tuple[Any, Callable[[], str]]]:
    import boto3  # type: ignore[import-untyped]
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    client = boto3.client(
        "s3",
        endpoint_url=f"http://{host}:{port}",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )

    def new_bucket() -> str:
        name = f"bench-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=name)
        return name

    try:
        yield client, new_bucket
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=60, help="pages per page size")
    parser.add_argument("--levels", default="1,6,9", help="gzip levels to time")
    parser.add_argument("--no-s3", action="store_true", help="skip the moto S3 runs")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    with tempfile.TemporaryDirectory() as tmp, moto_s3() as (client, new_bucket):
        root = Path(tmp)
        for page_size in (100, 500):
            pages = fetch_pages(page_size, args.pages)
            mean_kb = statistics.fmean(len(p) for p in pages) / 1024
            print(f"\n{len(pages)} pages of {page_size} hotels, {mean_kb:.0f} KB each on average")
            for level in levels:
                print(gzip_row(pages, level))
            rows = store_rows(
                "local (fsync)",
                pages,
                lambda: LocalPayloadStore(root / uuid.uuid4().hex),
            )
            rows += store_rows(
                "local (no fsync)",
                pages,
                lambda: LocalPayloadStore(root / uuid.uuid4().hex, fsync=False),
            )
            if not args.no_s3:
                rows += store_rows(
                    "moto S3",
                    pages,
                    lambda: S3PayloadStore(client, bucket=new_bucket(), prefix="bench"),
                )
            print("\n".join(rows))


if __name__ == "__main__":
    main()
