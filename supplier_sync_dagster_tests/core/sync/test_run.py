"""A run's cities in worker processes: every city once, a shared rate limit, a killed worker."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.leases import LeaseSettings, list_shards
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.supplier import InProcessTokenBucket, SupplierClient
from supplier_sync_dagster.core.sync.model import SyncSettings
from supplier_sync_dagster.core.sync.run import (
    CityOutcome,
    RunRequest,
    WorkerIO,
    WorkerProcesses,
    auto_processes,
    plan_run,
    run_cities,
)
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, serve_simulator

SETTINGS = SyncSettings(
    task_code="hotel_full",
    supplier_id=1001,
    page_size=50,
    lease=LeaseSettings(lease_seconds=60, heartbeat_seconds=1),
)


class _DieOn(httpx.BaseTransport):
    """Forwards requests; the process dies (as if OOM-killed) on a request for ``city``."""

    def __init__(self, inner: httpx.BaseTransport, city: str) -> None:
        self.inner, self.city = inner, city

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if f"/cities/{self.city}/" in request.url.path and os.getpid() != _PARENT:
            os._exit(9)
        return self.inner.handle_request(request)


_PARENT = os.getpid()


@contextmanager
def _client(url: str, *, die_on: str | None = None) -> Iterator[SupplierClient]:
    transport: httpx.BaseTransport = httpx.HTTPTransport()
    if die_on is not None:
        transport = _DieOn(transport, die_on)
    with httpx.Client(base_url=url, transport=transport) as http:
        yield SupplierClient(http, api_key=SIM_API_KEY, supplier_id="sim")


def _processes(
    db_url: str, store: LocalPayloadStore, url: str, die_on: str | None = None
) -> WorkerProcesses:
    @contextmanager
    def open_io() -> Iterator[WorkerIO]:
        # What a worker process opens: its own database engine and supplier connection.
        db = SyncDatabase.open(db_url)
        try:
            with _client(url, die_on=die_on) as client:
                yield WorkerIO(db, store, client)
        finally:
            db.dispose()

    return WorkerProcesses(2, open_io)


def _sync(
    db: SyncDatabase, store: LocalPayloadStore, url: str, trigger: str, processes: WorkerProcesses
) -> list[CityOutcome]:
    with _client(url) as client:
        cities = [c.city_code for c in client.list_cities().data.cities]
        request = RunRequest(trigger_id=trigger, source="MANUAL", cities=cities)
        plan = plan_run(db, store, client, request, SETTINGS)
        return list(
            run_cities(
                db, store, client, plan, request, SETTINGS, worker_id="parent", processes=processes
            )
        )


def _published(db: SyncDatabase) -> dict[str, int]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return dict(conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version)).all())


def test_worker_processes_sync_every_city_once_under_their_own_leases(
    db: SyncDatabase, db_url: str, tmp_path: Path
):
    store = LocalPayloadStore(tmp_path / "payloads")
    with serve_simulator(seed=11, n_cities=8, total_hotels=900) as (sim, url):
        outcomes = _sync(db, store, url, "procs", _processes(db_url, store, url))
    truth = sim.ground_truth()
    assert sorted(o.city_code for o in outcomes) == sorted(truth.listed_by_city)
    assert {o.status for o in outcomes} == {"SUCCESS"}
    assert _published(db) == truth.valid
    # Each city's requests are counted where it was synced: pages plus nothing else.
    assert sum(o.requests for o in outcomes) == sum(o.report.pages_fetched for o in outcomes)
    holders = {s.worker_id for s in list_shards(db, _only_batch(db))}
    # The leases were the workers' own (their pids), never the run's.
    assert holders and all(h and h != "parent" and f"-{os.getpid()}-" not in h for h in holders)


def _only_batch(db: SyncDatabase) -> str:
    b = schema.batch.c
    with db.engine.connect() as conn:
        return str(conn.execute(sa.select(b.batch_id)).scalar_one())


def test_a_killed_worker_fails_its_cities_and_the_rerun_resumes_them(
    db: SyncDatabase, db_url: str, tmp_path: Path
):
    store = LocalPayloadStore(tmp_path / "payloads")
    with serve_simulator(seed=12, n_cities=6, total_hotels=600) as (sim, url):
        with _client(url) as client:
            victim = client.list_cities().data.cities[0].city_code
        first = _sync(db, store, url, "killed", _processes(db_url, store, url, die_on=victim))
        by_city = {o.city_code: o for o in first}
        assert by_city[victim].status == "FAILED"
        assert "worker process died" in (by_city[victim].report.error or "")
        assert len(first) == len(by_city)  # each city reported once
        # The same trigger again: the dead worker's lease is reclaimed, nothing twice.
        second = _sync(db, store, url, "killed", _processes(db_url, store, url))
    assert {o.status for o in second} <= {"SUCCESS", "ALREADY_DONE"}
    assert _published(db) == sim.ground_truth().valid
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        assert set(conn.execute(sa.select(h.publish_version).distinct()).scalars()) == {1}


def test_a_bucket_paces_the_processes_forked_after_it(tmp_path: Path):
    import multiprocessing
    import time

    bucket = InProcessTokenBucket(40.0, 1)
    ctx = multiprocessing.get_context("fork")
    started = time.monotonic()
    workers = [ctx.Process(target=_take, args=(bucket, 10)) for _ in range(2)]
    for w in workers:
        w.start()
    _take(bucket, 10)
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    # 30 tokens at 40/s from a full bucket of 1: at least 29/40 s, whoever took them.
    assert time.monotonic() - started >= 29 / 40 - 0.02


def _take(bucket: InProcessTokenBucket, n: int) -> None:
    for _ in range(n):
        bucket.acquire()


@pytest.mark.parametrize(
    ("processes", "sizes", "replay", "expected"),
    [
        (None, {"A": 4000, "B": 2000}, False, 2),  # never more than the cities
        (
            None,
            {c: 1000 for c in "ABCDEFGH"},
            False,
            min(len(os.sched_getaffinity(0)) + 1, 4),  # one per CPU plus one, at most 4
        ),
        (None, {"A": 10, "B": 20}, False, 0),
        (3, {"A": 10}, False, 3),
        (None, {"A": 4000, "B": 2000}, True, 0),
        (0, {"A": 4000, "B": 2000}, False, 0),
    ],
)
def test_auto_processes(processes: int | None, sizes: dict[str, int], replay: bool, expected: int):
    from supplier_sync_dagster.core.leasing.batches import Batch
    from supplier_sync_dagster.core.sync.run import RunPlan

    request = RunRequest(
        trigger_id="t", source="MANUAL", cities=list(sizes), processes=processes, replay=replay
    )
    plan = RunPlan(batch=object.__new__(Batch), cities=list(sizes), sizes=sizes)
    assert auto_processes(request, plan) == expected
