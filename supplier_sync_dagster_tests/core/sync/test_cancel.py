"""A run whose batch is cancelled (a CANCEL_PREVIOUS trigger, an operator) stops within
seconds with :class:`SyncCancelled`: the cancelled shards' refused claims are not taken for
another run's lease and waited on, and a city in flight stops at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from supplier_sync_dagster.core.errors import SyncCancelled, SyncInterrupted
from supplier_sync_dagster.core.leasing.batches import cancel_batch, create_batch
from supplier_sync_dagster.core.leasing.leases import LeaseSettings, list_shards
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync.model import SyncSettings
from supplier_sync_dagster.core.sync.run import (
    CityOutcome,
    RunRequest,
    WorkerIO,
    WorkerProcesses,
    cancellation,
    plan_run,
    run_cities,
)
from supplier_sync_dagster.core.sync.stop import Stop
from supplier_sync_dagster.core.sync.tasks import change_task
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, serve_simulator

SETTINGS = SyncSettings(
    task_code="hotel_full",
    supplier_id=1001,
    page_size=50,
    lease=LeaseSettings(lease_seconds=60, heartbeat_seconds=1),
)
# "Within seconds": the cancellation is polled each second; a trickling page takes hours.
STOPS_WITHIN = 8.0


@contextmanager
def _client(url: str) -> Iterator[SupplierClient]:
    with httpx.Client(base_url=url) as http:
        yield SupplierClient(http, api_key=SIM_API_KEY, supplier_id="sim")


def _processes(db_url: str, store: LocalPayloadStore, url: str) -> WorkerProcesses:
    @contextmanager
    def open_io() -> Iterator[WorkerIO]:
        db = SyncDatabase.open(db_url)
        try:
            with _client(url) as client:
                yield WorkerIO(db, store, client)
        finally:
            db.dispose()

    return WorkerProcesses(2, open_io)


def test_a_run_whose_batch_was_cancelled_before_its_cities_stops_instead_of_waiting(
    db: SyncDatabase, tmp_path: Path
):
    """Every claim of a cancelled shard is refused, as a live lease's would be: the run
    used to defer each city as held by another run and wait for it, for ever."""
    store = LocalPayloadStore(tmp_path / "payloads")
    with serve_simulator(seed=5, n_cities=3, total_hotels=150, empty_city_share=0.0) as (sim, url):
        request = RunRequest(trigger_id="night-1", source="MANUAL", cities=sim.city_codes())
        with _client(url) as client:
            plan = plan_run(db, store, client, request, SETTINGS)
            cancel_batch(db, plan.batch.batch_id, "cancelled by operator ann: wrong day")
            outcomes: list[CityOutcome] = []
            started = time.monotonic()
            with pytest.raises(SyncCancelled) as raised:
                outcomes.extend(
                    run_cities(db, store, client, plan, request, SETTINGS, worker_id="parent")
                )
        took = time.monotonic() - started
        assert took < STOPS_WITHIN, took
        assert raised.value.reason == "cancelled by operator ann: wrong day"
        assert outcomes == []
        assert sim.stats["hotels_served"] == 0
        assert {s.status for s in list_shards(db, plan.batch.batch_id)} == {"CANCELLED"}


@pytest.mark.parametrize("processes", [0, 2], ids=["threads", "processes"])
def test_a_run_cancelled_by_a_cancel_previous_trigger_stops_within_seconds(
    db: SyncDatabase, db_url: str, tmp_path: Path, processes: int
):
    """Every page trickles a byte a second; one city at a time (or one a worker process)
    is in flight, the others wait. A CANCEL_PREVIOUS trigger cancels the batch: the run
    raises SyncCancelled with the trigger's reason within seconds, not when the page ends,
    and no city of it is left RUNNING."""
    store = LocalPayloadStore(tmp_path / "payloads")
    with serve_simulator(seed=7, n_cities=4, total_hotels=200, empty_city_share=0.0) as (
        sim,
        url,
    ):
        sim.set_modes(["slow_body"])
        request = RunRequest(trigger_id="night-1", source="MANUAL", cities=sim.city_codes())
        errors: list[BaseException] = []
        ended: list[float] = []
        with _client(url) as client:
            plan = plan_run(db, store, client, request, SETTINGS)
            change_task(
                db,
                SETTINGS.task_code,
                changed_by="ann",
                reason="a new night supersedes the last",
                policy="CANCEL_PREVIOUS",
            )

            def run() -> None:
                try:
                    for _ in run_cities(
                        db,
                        store,
                        client,
                        plan,
                        request,
                        SETTINGS,
                        worker_id="parent",
                        processes=_processes(db_url, store, url) if processes else None,
                        stop=Stop(),
                    ):
                        pass
                except BaseException as err:
                    errors.append(err)
                finally:
                    ended.append(time.monotonic())

            runner = threading.Thread(target=run, daemon=True)
            runner.start()
            deadline = time.monotonic() + 60
            while not any(s.status == "RUNNING" for s in list_shards(db, plan.batch.batch_id)):
                assert time.monotonic() < deadline and runner.is_alive(), errors
                time.sleep(0.05)
            time.sleep(0.5)  # the city's first page is trickling
            decision = create_batch(
                db, task_code=SETTINGS.task_code, trigger_id="night-2", trigger_source="MANUAL"
            )
            sent = time.monotonic()
            assert decision.cancelled_batch_ids == (plan.batch.batch_id,)
            runner.join(30)
        assert not runner.is_alive()
        assert ended[0] - sent < STOPS_WITHIN, ended[0] - sent
        assert len(errors) == 1 and isinstance(errors[0], SyncCancelled), errors
        assert errors[0].reason == "cancelled by trigger night-2 (CANCEL_PREVIOUS)"
        assert cancellation(db, plan.batch.batch_id) == errors[0].reason
        assert {s.status for s in list_shards(db, plan.batch.batch_id)} == {"CANCELLED"}


def test_a_cancelled_stop_raises_sync_cancelled_and_stays_what_it_was_first():
    stop = Stop()
    stop.cancel("cancelled by trigger t2 (CANCEL_PREVIOUS)")
    stop.set("SIGTERM")  # too late: the first stop stands
    with pytest.raises(SyncCancelled, match="t2"):
        stop.check()
    with pytest.raises(SyncCancelled):
        stop.sleep(5)

    signalled = Stop()
    signalled.set("SIGTERM")
    signalled.cancel("cancelled by trigger t2 (CANCEL_PREVIOUS)")
    with pytest.raises(SyncInterrupted) as raised:
        signalled.check()
    assert type(raised.value) is SyncInterrupted and raised.value.reason == "SIGTERM"


def test_a_poll_cancels_once_its_probe_says_why_and_survives_a_failing_probe():
    answers: list[str | None | Exception] = [None, RuntimeError("database blip"), "gone"]

    def probe() -> str | None:
        answer = answers.pop(0) if answers else "never asked again"
        if isinstance(answer, Exception):
            raise answer
        return answer

    stop = Stop()
    end = stop.poll(probe, every=0.01)
    try:
        with pytest.raises(SyncCancelled, match="^gone$"):
            stop.sleep(5)
    finally:
        end()
    assert stop.cancelled and answers == []

    idle = Stop()
    end = idle.poll(lambda: "too late", every=0.2)
    end()  # the polling ended before its first probe
    time.sleep(0.4)
    assert not idle.is_set
