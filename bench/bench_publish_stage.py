"""CPU of a sync worker's publish stage per hotel: map, diff, publish and the shard's finish.

Run: ``.venv/bin/python bench/bench_publish_stage.py [--hotels 20000] [--cities 40]
[--backend sqlite|mariadb] [--syncs 2] [--profile FILE]``. The in-process simulator (clean
profile, heavy-tailed city sizes) is synced with ``run.run_cities`` in this process, the code
a Dagster run calls per city, into a throwaway database (a temp SQLite file or a
``bench_<random>`` MariaDB database). Each sync is a new batch of the same unchanged world:
the first publishes every hotel as NEW, the later ones find every hotel unchanged. Only
``publish_city`` is timed, in this thread's CPU (``time.thread_time``: the heartbeat thread
and the database server are left out). Prints CPU-seconds per 1,000 hotels of each sync;
``--profile FILE`` writes a cProfile of each sync's publish stage (``FILE.1``, ``FILE.2``...).
"""

from __future__ import annotations

import argparse
import cProfile
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import API_KEY, MYSQL_URL, mariadb_databases, mariadb_url

from supplier_sync_dagster.core.leasing.leases import LeaseSettings
from supplier_sync_dagster.core.records.diff import default_risk_policy
from supplier_sync_dagster.core.settings import DEFAULT_MAX_CLOCK_SKEW_SECONDS, DEFAULT_TASK_CODE
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import open_payload_store
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync import city, run
from supplier_sync_dagster.core.sync.model import build_sync_settings
from supplier_sync_dagster.simulator import FaultProfile, Simulator, SimulatorConfig


class _Timed:
    """``city.publish_city`` wrapped: its CPU and the hotels it published or left alone."""

    def __init__(self, profile: cProfile.Profile | None) -> None:
        self.inner = city.publish_city
        self.cpu = 0.0
        self.records = 0
        self.profile = profile

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        report = args[4]
        began = time.thread_time()
        try:
            with self.profile or nullcontext():
                return self.inner(*args, **kwargs)
        finally:
            self.cpu += time.thread_time() - began
            self.records += report.records


@contextmanager
def _database(backend: str) -> Iterator[str]:
    if backend == "sqlite":
        tmp = Path(tempfile.mkdtemp(prefix="bench_publish_"))
        try:
            yield f"sqlite:///{tmp / 'sync.sqlite3'}"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        with mariadb_databases(["sync"], MYSQL_URL) as (name,):
            yield mariadb_url(name, MYSQL_URL)


def main() -> None:
    """Syncs the world ``--syncs`` times and prints the publish stage's CPU of each."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hotels", type=int, default=20_000)
    parser.add_argument("--cities", type=int, default=40)
    parser.add_argument("--backend", choices=["sqlite", "mariadb"], default="sqlite")
    parser.add_argument("--syncs", type=int, default=2)
    parser.add_argument("--page-size", type=int, default=100)
    parser.add_argument("--profile", help="cProfile output prefix")
    args = parser.parse_args()
    sim = Simulator(
        SimulatorConfig(
            n_cities=args.cities,
            total_hotels=args.hotels,
            api_key=API_KEY,
            faults=FaultProfile.clean(),
        )
    )
    # The task, supplier and defaults of `sync --full`.
    deployment: dict[str, Any] = {
        "lease": LeaseSettings(),
        "risk_policy": default_risk_policy,
        "max_clock_skew_seconds": DEFAULT_MAX_CLOCK_SKEW_SECONDS,
    }
    settings = build_sync_settings(
        task_code=DEFAULT_TASK_CODE, supplier_id=1001, page_size=args.page_size, **deployment
    )
    with (
        _database(args.backend) as url,
        httpx.Client(base_url="http://simulator.local", transport=sim.transport()) as http,
    ):
        tmp = Path(tempfile.mkdtemp(prefix="bench_publish_payloads_"))
        db = SyncDatabase.open(url)
        try:
            store = open_payload_store(f"file://{tmp}")
            client = SupplierClient(http, api_key=API_KEY, supplier_id="1001")
            cities = [c.city_code for c in client.list_cities().data.cities]
            for n in range(args.syncs):
                profile = cProfile.Profile(time.thread_time) if args.profile else None
                timed = _Timed(profile)
                city.publish_city = timed
                try:
                    request = run.RunRequest(
                        trigger_id=f"bench-{n}", source="MANUAL", cities=cities
                    )
                    plan = run.plan_run(db, store, client, request, settings)
                    wall = time.perf_counter()
                    statuses = [
                        o.status
                        for o in run.run_cities(
                            db, store, client, plan, request, settings, worker_id="b"
                        )
                    ]
                    wall = time.perf_counter() - wall
                finally:
                    city.publish_city = timed.inner
                bad = [s for s in statuses if s != "SUCCESS"]
                print(
                    f"sync {n + 1} ({args.backend}, {timed.records} hotels, {len(cities)} cities): "
                    f"publish {timed.cpu / timed.records * 1000:.3f} CPU-s per 1,000 hotels "
                    f"({timed.cpu:.2f} s), whole sync wall {wall:.1f} s"
                    + (f"; NOT SUCCESS: {bad}" if bad else "")
                )
                if profile is not None:
                    profile.dump_stats(f"{args.profile}.{n + 1}")
        finally:
            db.dispose()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
