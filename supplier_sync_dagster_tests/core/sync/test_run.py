"""A run's cities in worker processes: every city once, a shared rate limit, a killed worker,
workers that cannot start."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import (
    DatabaseUnavailable,
    SupplierAuthError,
    SupplierError,
    WorkerStartFailed,
)
from supplier_sync_dagster.core.leasing.batches import (
    TaskSpec,
    create_batch,
    get_batch,
    upsert_task,
)
from supplier_sync_dagster.core.leasing.leases import LeaseSettings, ShardInfo, list_shards
from supplier_sync_dagster.core.records.deadletters import CITY_FAILED
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.supplier import InProcessTokenBucket, SupplierClient
from supplier_sync_dagster.core.sync import city as city_module
from supplier_sync_dagster.core.sync import run as run_module
from supplier_sync_dagster.core.sync.model import SyncSettings
from supplier_sync_dagster.core.sync.run import (
    CityOutcome,
    RunRequest,
    WorkerIO,
    WorkerProcesses,
    auto_processes,
    in_flight,
    in_flight_groups,
    plan_run,
    published_earlier,
    refuse_trigger,
    run_cities,
    run_city_groups,
    take_published_earlier,
)
from supplier_sync_dagster.core.sync.stop import Stop
from supplier_sync_dagster.simulator import running_server
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, make_simulator, serve_simulator

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
    db: SyncDatabase,
    store: LocalPayloadStore,
    url: str,
    trigger: str,
    processes: WorkerProcesses | None,
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


def test_each_city_counts_its_own_requests_while_others_share_the_client(
    db: SyncDatabase, tmp_path: Path
):
    """Three cities in flight on one client (and each walk's read-ahead thread): a city's
    figures are its own requests, not the client's totals that moved meanwhile."""
    store = LocalPayloadStore(tmp_path / "payloads")
    with (
        serve_simulator(seed=12, n_cities=6, total_hotels=1200) as (_, url),
        _client(url) as client,
    ):
        cities = [c.city_code for c in client.list_cities().data.cities]
        request = RunRequest(trigger_id="threads", source="MANUAL", cities=cities, threads=3)
        plan = plan_run(db, store, client, request, SETTINGS)
        before = client.stats().requests
        outcomes = list(run_cities(db, store, client, plan, request, SETTINGS, worker_id="parent"))
        sent = client.stats().requests - before
    assert {o.status for o in outcomes} == {"SUCCESS"}
    assert max(o.report.pages_fetched for o in outcomes) > 1
    for o in outcomes:
        assert o.supplier.requests == o.report.pages_fetched, o.city_code
    assert sum(o.supplier.requests for o in outcomes) == sent


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
    assert sum(o.supplier.requests for o in outcomes) == sum(
        o.report.pages_fetched for o in outcomes
    )
    holders = {s.worker_id for s in list_shards(db, _only_batch(db))}
    # The leases were the workers' own (their pids), never the run's.
    assert holders and all(h and h != "parent" and f"-{os.getpid()}-" not in h for h in holders)


def _only_batch(db: SyncDatabase) -> str:
    b = schema.batch.c
    with db.engine.connect() as conn:
        return str(conn.execute(sa.select(b.batch_id)).scalar_one())


def test_a_killed_worker_fails_its_city_the_others_go_on_and_the_rerun_resumes_it(
    db: SyncDatabase, db_url: str, tmp_path: Path
):
    """On a server database the cities beside the dead worker's go on in a new pool; on
    SQLite (no fork once the run's threads use the database) they fail with it."""
    store = LocalPayloadStore(tmp_path / "payloads")
    with serve_simulator(seed=12, n_cities=6, total_hotels=600) as (sim, url):
        victim = _first_city(url)
        first = _sync(db, store, url, "killed", _processes(db_url, store, url, die_on=victim))
        by_city = {o.city_code: o for o in first}
        assert by_city[victim].status == "FAILED"
        assert "worker process died" in (by_city[victim].report.error or "")
        assert len(first) == len(by_city) == 6  # each city reported once
        # The cities beside it went on in a new pool (or were finished by the old one's
        # workers, which went on).
        others = {c: (o.status, o.report.error) for c, o in by_city.items() if c != victim}
        if db.engine.dialect.name == "sqlite":
            assert all(
                status != "FAILED" or "worker process died" in (error or "")
                for status, error in others.values()
            ), others
        else:
            assert {status for status, _ in others.values()} <= {"SUCCESS", "ALREADY_DONE"}, others
        # The same trigger again: the dead worker's lease is reclaimed, nothing twice.
        second = _sync(db, store, url, "killed", _processes(db_url, store, url))
    assert {o.status for o in second} <= {"SUCCESS", "ALREADY_DONE"}
    if db.engine.dialect.name != "sqlite":
        assert [o.city_code for o in second if o.status == "SUCCESS"] == [victim]
    assert _published(db) == sim.ground_truth().valid
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        assert set(conn.execute(sa.select(h.publish_version).distinct()).scalars()) == {1}


def _first_city(url: str) -> str:
    with _client(url) as client:
        return client.list_cities().data.cities[0].city_code


def test_past_its_pool_restarts_a_run_fails_the_cities_its_dead_worker_took_down(
    db: SyncDatabase, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The pool is replaced a bounded number of times: past it, the cities the broken pool
    held fail with the reason (the next run resumes them), each reported once, instead of
    the run forking for ever."""
    monkeypatch.setattr(run_module, "MAX_POOL_RESTARTS", 0)
    store = LocalPayloadStore(tmp_path / "payloads")
    with serve_simulator(seed=12, n_cities=6, total_hotels=600) as (_sim, url):
        victim = _first_city(url)
        first = _sync(db, store, url, "no-restart", _processes(db_url, store, url, die_on=victim))
    by_city = {o.city_code: o for o in first}
    assert len(first) == len(by_city) == 6
    failed = {c for c, o in by_city.items() if o.status == "FAILED"}
    assert victim in failed
    assert all("worker process died" in (by_city[c].report.error or "") for c in failed)


def test_workers_that_cannot_start_stop_the_run_with_why_and_fail_no_city(
    db: SyncDatabase, db_url: str, tmp_path: Path
):
    store = LocalPayloadStore(tmp_path / "payloads")

    @contextmanager
    def refused() -> Iterator[WorkerIO]:
        # What a worker meets when its own connection is refused (a wrong URL, a full server).
        raise DatabaseUnavailable("the sync database refused the connection: too many connections")
        yield  # pragma: no cover

    with serve_simulator(seed=13, n_cities=5, total_hotels=400) as (sim, url):
        with pytest.raises(WorkerStartFailed) as raised:
            _sync(db, store, url, "no-start", WorkerProcesses(2, refused))
        assert str(raised.value) == (
            "the run's worker processes could not start: DatabaseUnavailable: "
            "the sync database refused the connection: too many connections"
        )
        batch_id = _only_batch(db)
        assert {s.status for s in list_shards(db, batch_id)} == {"PENDING"}
        with db.engine.connect() as conn:
            dead_letters = sa.select(sa.func.count()).select_from(schema.dead_letter)
            assert conn.execute(dead_letters).scalar_one() == 0
        # The same trigger with workers that start: the batch goes on, every city once.
        again = _sync(db, store, url, "no-start", _processes(db_url, store, url))
    assert {o.status for o in again} == {"SUCCESS"}
    assert _published(db) == sim.ground_truth().valid


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


# --- how a run ends when it cannot go on -----------------------------------------------------


def _shards(db: SyncDatabase) -> dict[str, ShardInfo]:
    return {s.shard_key: s for s in list_shards(db, _only_batch(db))}


def _tickets(db: SyncDatabase) -> dict[str, str]:
    """City -> the message of its CITY_FAILED ticket."""
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(d.city_code, d.error_message).where(d.error_code == CITY_FAILED)
        ).all()
    return {str(r.city_code): str(r.error_message) for r in rows}


@contextmanager
def _interrupt_main_thread_when(ready: Callable[[], bool]) -> Iterator[list[float]]:
    """Raises KeyboardInterrupt in this (the main) thread once ``ready()`` holds, through a
    signal as SIGINT, SIGTERM or a Dagster termination does: in whatever the thread waits
    in. Yields the list that gets the moment it was sent."""
    sent: list[float] = []
    stop = threading.Event()

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def watch() -> None:
        while not stop.wait(0.05):
            if ready():
                sent.append(time.monotonic())
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
                return

    previous = signal.signal(signal.SIGUSR1, interrupt)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield sent
    finally:
        stop.set()
        watcher.join(5)
        signal.signal(signal.SIGUSR1, previous)


def _wait(what: str, ready: Callable[[], bool], timeout: float = 60.0) -> float:
    """Waits until ``ready()``; the moment it held."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.05)
    return time.monotonic()


@pytest.mark.parametrize(
    ("processes", "threads"), [(0, 1), (0, 2), (2, 2)], ids=["one thread", "threads", "processes"]
)
@pytest.mark.parametrize("how", ["in its wait", "while its caller is elsewhere"])
def test_an_interrupted_run_stops_at_once_releases_its_leases_and_resumes(
    db: SyncDatabase, db_url: str, tmp_path: Path, processes: int, threads: int, how: str
):
    """A city whose page trickles a byte a second holds the run. Interrupted (SIGINT,
    SIGTERM, a Dagster termination) while the run's thread waits for it, or while that
    thread is elsewhere (writing a city's events: the signal's watch then sets the run's
    stop), it stops in seconds, not when the request ends: no city is left RUNNING, none
    FAILED or ticketed, and the batch is adopted at once by the next trigger, or resumed
    by its own."""
    store = LocalPayloadStore(tmp_path / "payloads")
    with serve_simulator(seed=13, n_cities=4, total_hotels=400, empty_city_share=0.0) as (
        sim,
        url,
    ):
        request = RunRequest(
            trigger_id="night-1", source="MANUAL", cities=sim.city_codes(), threads=threads
        )
        outcomes: list[CityOutcome] = []
        stop = Stop()
        with _client(url) as client:
            plan = plan_run(db, store, client, request, SETTINGS)
            # The run's last city trickles, so that with one city in flight the others
            # finish before it.
            slow = plan.cities[-1]
            sim.set_modes(["slow_body"], [slow])
            others = set(sim.city_codes()) - {slow}

            def only_the_slow_city_left() -> bool:
                shards = _shards(db)
                return shards[slow].status == "RUNNING" and all(
                    shards[c].status == "SUCCESS" for c in others
                )

            pool = _processes(db_url, store, url) if processes else None
            cities = run_cities(
                db,
                store,
                client,
                plan,
                request,
                SETTINGS,
                worker_id="parent",
                processes=pool,
                stop=stop,
            )
            if how == "in its wait":
                # Once this thread has every other city's outcome: it then waits for the
                # trickling one.
                with (
                    _interrupt_main_thread_when(
                        lambda: len(outcomes) == len(others) and only_the_slow_city_left()
                    ) as sent,
                    pytest.raises(KeyboardInterrupt),
                ):
                    for outcome in cities:
                        outcomes.append(outcome)
                stopped_in = time.monotonic() - sent[0]
            else:
                outcomes += [next(cities) for _ in others]
                _wait("the other cities synced", only_the_slow_city_left)
                sent_at = time.monotonic()
                stop.set("SIGTERM")  # what the run's SignalWatch does; the caller never returns
                released = _wait(
                    "the lease released", lambda: _shards(db)[slow].status != "RUNNING"
                )
                stopped_in = released - sent_at
        assert stopped_in < 10.0, stopped_in  # the trickle would take hours
        assert {o.city_code for o in outcomes} == others
        shards = _shards(db)
        assert shards[slow].status == "PENDING" and shards[slow].claim_count == 1
        assert not [s for s in shards.values() if s.status == "RUNNING"]
        assert _tickets(db) == {}  # an interruption is not a failure
        # The run's grace ended with it: a new trigger adopts the batch now, not in minutes.
        adopted = create_batch(
            db, task_code=SETTINGS.task_code, trigger_id="night-2", trigger_source="CRON"
        )
        assert adopted.outcome == "ADOPTED" and adopted.batch is not None
        assert adopted.batch.batch_id == plan.batch.batch_id

        sim.set_modes([])
        again = _sync(db, store, url, "night-1", _processes(db_url, store, url))
    assert {o.city_code: o.status for o in again if o.status == "SUCCESS"} == {slow: "SUCCESS"}
    assert _published(db) == sim.ground_truth().valid


def test_a_city_that_fails_with_any_exception_files_its_ticket_with_its_code(
    db: SyncDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    store = LocalPayloadStore(tmp_path / "payloads")
    with serve_simulator(seed=14, n_cities=3, total_hotels=300, empty_city_share=0.0) as (
        sim,
        url,
    ):
        victim = sim.city_codes()[1]
        publish = city_module.publish_city

        def deep(*args: Any, **kwargs: Any) -> bool:
            report = args[4]
            if report.city_code == victim:  # what a 100k-deep JSON array did to the decoder
                raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
            return publish(*args, **kwargs)

        monkeypatch.setattr(city_module, "publish_city", deep)
        outcomes = {o.city_code: o for o in _sync(db, store, url, "night-1", None)}
    failed = outcomes[victim].report
    assert (failed.status, failed.error_code) == ("FAILED", "INTERNAL_ERROR")
    assert failed.error == (
        "INTERNAL_ERROR: RecursionError: maximum recursion depth exceeded while decoding a "
        "JSON array"
    )
    assert _shards(db)[victim].error_message == failed.error
    assert {c: o.status for c, o in outcomes.items() if c != victim} == {
        c: "SUCCESS" for c in sim.city_codes() if c != victim
    }
    tickets = _tickets(db)
    assert list(tickets) == [victim] and failed.error in tickets[victim]


def test_a_refused_key_stops_the_cities_not_started_without_a_request(
    db: SyncDatabase, tmp_path: Path
):
    """The key is revoked under the run (its first city answers 401): the cities it had not
    started fail at once with the same code, each with its ticket, and are not asked."""
    store = LocalPayloadStore(tmp_path / "payloads")
    with (
        serve_simulator(seed=15, n_cities=5, total_hotels=500, empty_city_share=0.0) as (
            sim,
            url,
        ),
        _client(url) as client,
    ):
        request = RunRequest(
            trigger_id="night-1", source="MANUAL", cities=sim.city_codes(), threads=1
        )
        plan = plan_run(db, store, client, request, SETTINGS)
        first = plan.cities[0]
        sim.set_modes(["unauthorized"], [first])
        before = client.stats().requests
        outcomes = list(run_cities(db, store, client, plan, request, SETTINGS, worker_id="parent"))
        asked = client.stats().requests - before
    assert asked == 1  # the first city's first page: a 401 is not retried, nor tried again
    assert {o.status for o in outcomes} == {"FAILED"}
    assert {o.report.error_code for o in outcomes} == {"SUPPLIER_AUTH_REJECTED"}
    shards = _shards(db)
    assert shards[first].claim_count == 1 and "401" in (shards[first].error_message or "")
    for city in plan.cities[1:]:
        assert shards[city].claim_count == 0
        assert shards[city].error_message == (
            f"SUPPLIER_AUTH_REJECTED: not started: the supplier refused the API key on city "
            f"{first!r}"
        )
    assert set(_tickets(db)) == set(plan.cities)
    with db.engine.connect() as conn:
        assert get_batch(conn, plan.batch.batch_id).status == "FAILED"


@pytest.mark.parametrize("mode", ["unauthorized", "refused"])
def test_a_supplier_that_refuses_the_city_list_fails_the_run_before_any_city(
    db: SyncDatabase, tmp_path: Path, mode: str
):
    store = LocalPayloadStore(tmp_path / "payloads")
    sim = make_simulator(seed=16, n_cities=3, total_hotels=300)
    cities = sim.city_codes()
    sim.set_modes([mode])
    with running_server(sim) as url, _client(url) as client:
        request = RunRequest(trigger_id="night-1", source="MANUAL", cities=cities)
        with pytest.raises(SupplierError) as refused:
            plan_run(db, store, client, request, SETTINGS)
    code = refused.value.error_code
    assert code == ("SUPPLIER_AUTH_REJECTED" if mode == "unauthorized" else "CONNECTION_REFUSED")
    shards = _shards(db)
    assert {s.status for s in shards.values()} == {"FAILED"}
    assert {s.claim_count for s in shards.values()} == {0}
    assert all((s.error_message or "").startswith(f"{code}: ") for s in shards.values())
    assert set(_tickets(db)) == set(cities)
    with db.engine.connect() as conn:
        batch = get_batch(conn, _only_batch(db))
    assert batch.status == "FAILED" and (batch.error_message or "").startswith(f"{code}: ")


def test_a_trigger_refused_before_its_city_list_gets_a_failed_batch_and_blocks_nobody(
    db: SyncDatabase,
):
    # An abandoned batch of an earlier night: a refused trigger leaves it to be adopted.
    upsert_task(db, TaskSpec(task_code=SETTINGS.task_code, supplier_id=SETTINGS.supplier_id))
    abandoned = create_batch(
        db,
        task_code=SETTINGS.task_code,
        trigger_id="night-0",
        trigger_source="CRON",
        shard_keys=["A"],
        worker_id="supplier-sync-other-host-7-20260101T000000Z",
        lease_seconds=0.001,
    )
    assert abandoned.batch is not None
    time.sleep(0.01)
    err = SupplierAuthError("supplier 1001 refused the API key: GET /v1/cities -> 401")
    batch = refuse_trigger(db, settings=SETTINGS, trigger_id="night-1", source="CRON", err=err)
    assert batch is not None and batch.batch_id != abandoned.batch.batch_id
    assert (batch.status, batch.shard_count) == ("FAILED", 0)
    assert batch.error_message == f"SUPPLIER_AUTH_REJECTED: {err}"
    assert _tickets(db) == {}  # no city was known: nothing to re-sync
    after = create_batch(
        db, task_code=SETTINGS.task_code, trigger_id="night-2", trigger_source="CRON"
    )
    assert after.outcome == "ADOPTED" and after.batch is not None
    assert after.batch.batch_id == abandoned.batch.batch_id


def test_the_cities_published_earlier_in_the_batch_are_taken_out_of_a_resumed_plan(
    db: SyncDatabase, tmp_path: Path
):
    store = LocalPayloadStore(tmp_path / "payloads")
    with serve_simulator(seed=14, n_cities=4, total_hotels=400) as (sim, url):
        codes = sim.city_codes()
        broken = codes[1]
        sim.set_modes(["deep_json"], [broken])
        first = {o.city_code: o for o in _sync(db, store, url, "night-1", None)}
        assert first[broken].status == "FAILED"
        with _client(url) as client:
            # The run's cities in a different order, one of them twice, one unknown.
            cities = [codes[3], broken, codes[0], codes[2], codes[0], "NOPE"]
            request = RunRequest(trigger_id="night-1", source="MANUAL", cities=cities)
            plan = plan_run(db, store, client, request, SETTINGS)
            plan_order = list(dict.fromkeys(plan.cities))
            earlier = take_published_earlier(db, plan)
    # Each once, in the plan's order (largest first).
    assert sorted(o.city_code for o in earlier) == sorted([codes[0], codes[2], codes[3]])
    order = [c for c in plan_order if c in {o.city_code for o in earlier}]
    assert [o.city_code for o in earlier] == order
    assert {o.status for o in earlier} == {"ALREADY_DONE"}
    # What the earlier run published, as the database recorded it.
    for o in earlier:
        assert o.report.published == first[o.city_code].report.published > 0
        assert o.report.stages_done == ["fetch", "normalize", "publish"]
    # Left to sync: the city that failed, and the one the batch has not seen.
    assert sorted(plan.cities) == sorted([broken, "NOPE"])
    assert published_earlier(db, plan.batch.batch_id, []) == []


def test_in_flight_yields_every_result_once_as_it_finishes_and_stops_when_left() -> None:
    started: list[int] = []
    release = threading.Event()
    two_started = threading.Event()

    def work(item: int) -> int:
        started.append(item)
        if item == 2:
            two_started.set()
        if item in (0, 2):
            release.wait(10)  # held until released
        return item * 10

    seen = []
    for result in in_flight(range(40), work, threads=4):
        seen.append(result)
        if len(seen) == 38:
            release.set()
    assert sorted(seen) == [i * 10 for i in range(40)] and set(seen[-2:]) == {0, 20}
    # A call that raises ends the iteration with its error.
    with pytest.raises(ZeroDivisionError):
        list(in_flight(range(10), lambda i: 1 // (i - 5), threads=3))
    # Left early: the calls in flight are asked to stop, the others never start.
    started.clear()
    release.clear()
    two_started.clear()
    stop = Stop()
    early = in_flight(range(100), work, threads=2, stop=stop)
    assert next(early) == 10
    # The thread item 1 freed takes item 2, which is held: both threads are busy.
    assert two_started.wait(10)
    threading.Timer(0.2, release.set).start()
    early.close()
    assert sorted(started) == [0, 1, 2] and stop.is_set


def _pool_idle(prefix: str) -> bool:
    """Every pool thread named ``prefix``* waits for work: none is running a work item (the
    call, its future's result and callbacks)."""
    frames = sys._current_frames()
    for thread in threading.enumerate():
        frame: FrameType | None = frames.get(thread.ident or -1)
        while thread.name.startswith(prefix) and frame is not None:
            code = frame.f_code
            if code.co_name == "run" and code.co_filename.endswith("futures/thread.py"):
                return False
            frame = frame.f_back
    return True


def test_results_that_finish_while_the_iteration_is_away_come_together() -> None:
    go = threading.Event()
    finished: list[int] = []

    def work(item: int) -> int:
        if item:
            go.wait(10)
        finished.append(item)
        return item

    groups = in_flight_groups(range(6), work, threads=3)
    assert next(groups) == [0]
    go.set()
    deadline = time.monotonic() + 30
    # Each call's future is handed over just after it returns: wait until every pool thread
    # is back at its work queue (a loaded machine may take seconds to get there).
    while (len(finished) < 6 or not _pool_idle("city")) and time.monotonic() < deadline:
        time.sleep(0.01)
    rest = list(groups)
    assert rest == [sorted(rest[0], key=finished.index)] and sorted(rest[0]) == [1, 2, 3, 4, 5]


def test_one_call_at_a_time_in_the_background_goes_on_while_the_iteration_is_away() -> None:
    """With one thread, the calls run on the iterating thread (the next starts once the
    iteration asks for it), or, in the background, on a thread of their own: there the next
    call runs while the iteration works on a result, and still one call at a time."""
    running: list[int] = []
    most = [0]
    lock = threading.Lock()

    def work(item: int) -> int:
        with lock:
            running.append(item)
            most[0] = max(most[0], len(running))
        time.sleep(0.01)
        with lock:
            running.remove(item)
        return item

    inline = in_flight_groups(range(3), work, threads=1)
    assert next(inline) == [0]
    time.sleep(0.2)
    assert next(inline) == [1]  # item 1 started only now: nothing else came with it
    inline.close()

    began: list[int] = []

    def logged(item: int) -> int:
        began.append(item)
        return work(item)

    behind = in_flight_groups(range(5), logged, threads=1, background=True)
    assert next(behind) == [0]
    # This thread is away (storing a city's events): the other calls go on meanwhile.
    _wait("every call done", lambda: len(began) == 5 and not running, timeout=10)
    rest = [r for g in behind for r in g]
    assert rest == [1, 2, 3, 4] and began == [0, 1, 2, 3, 4] and most == [1]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_run_syncs_its_next_city_while_its_caller_reports_the_last(
    db: SyncDatabase, tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Dagster step stores each city's events as it receives the city's outcome: the run's
    next cities are synced meanwhile, with ``threads`` cities in flight at most."""
    store = LocalPayloadStore(tmp_path / "payloads")
    in_flight_now: list[str] = []
    most = [0]
    lock = threading.Lock()
    sync_city = run_module.sync_city

    def counted(*args: Any, **kwargs: Any) -> Any:
        with lock:
            in_flight_now.append(kwargs["city_code"])
            most[0] = max(most[0], len(in_flight_now))
        try:
            return sync_city(*args, **kwargs)
        finally:
            with lock:
                in_flight_now.remove(kwargs["city_code"])

    monkeypatch.setattr(run_module, "sync_city", counted)
    with (
        serve_simulator(seed=15, n_cities=4, total_hotels=200, empty_city_share=0.0) as (sim, url),
        _client(url) as client,
    ):
        cities = sim.city_codes()
        request = RunRequest(trigger_id="behind", source="MANUAL", cities=cities, threads=threads)
        plan = plan_run(db, store, client, request, SETTINGS)
        groups = run_city_groups(db, store, client, plan, request, SETTINGS, worker_id="parent")
        first = next(groups)
        # The caller is away with the first outcome: the other cities publish meanwhile.
        _wait(
            "the other cities synced while the caller was away",
            lambda: sum(s.status == "SUCCESS" for s in _shards(db).values()) == len(cities),
            timeout=30,
        )
        outcomes = first + [o for g in groups for o in g]
    assert sorted(o.city_code for o in outcomes) == sorted(cities)
    assert {o.status for o in outcomes} == {"SUCCESS"}
    assert _published(db) == sim.ground_truth().valid
    assert most[0] <= threads


def test_a_run_s_outcomes_come_in_groups_every_city_once(db: SyncDatabase, tmp_path: Path) -> None:
    store = LocalPayloadStore(tmp_path / "payloads")
    with (
        serve_simulator(seed=14, n_cities=8, total_hotels=400) as (sim, url),
        _client(url) as client,
    ):
        cities = [c.city_code for c in client.list_cities().data.cities]
        request = RunRequest(trigger_id="groups", source="MANUAL", cities=cities, threads=3)
        plan = plan_run(db, store, client, request, SETTINGS)
        groups = list(
            run_city_groups(db, store, client, plan, request, SETTINGS, worker_id="parent")
        )
    assert all(groups)
    assert sorted(o.city_code for g in groups for o in g) == sorted(
        sim.ground_truth().listed_by_city
    )
    assert {o.status for g in groups for o in g} == {"SUCCESS"}
    assert _published(db) == sim.ground_truth().valid
