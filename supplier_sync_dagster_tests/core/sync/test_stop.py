"""A run's stop: asked once, it wakes whoever waits for a request at once, never waits for the
request, and a worker process's stop follows its run's."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import Future

import pytest

from supplier_sync_dagster.core.errors import SyncInterrupted
from supplier_sync_dagster.core.sync.stop import (
    SignalWatch,
    Stop,
    StopAware,
    in_daemon_thread,
    reason_of,
    stop_on_signals,
)

# Far longer than any assertion waits: a stop that waited for it would fail the test.
HANGS = 60.0


def _after(seconds: float, fn: object) -> threading.Thread:
    thread = threading.Timer(seconds, fn)  # type: ignore[arg-type]
    thread.daemon = True
    thread.start()
    return thread


def test_a_result_is_returned_unless_the_stop_comes_first():
    stop = Stop()
    assert stop.result(in_daemon_thread(lambda: 7)) == 7
    assert stop.call(lambda x: x * 2, 21) == 42
    with pytest.raises(ValueError, match="boom"):  # the call's own error is the caller's
        stop.call(_raise, ValueError("boom"))

    release = threading.Event()
    hanging = in_daemon_thread(release.wait, HANGS)  # a request that trickles for a minute
    _after(0.2, lambda: stop.set("SIGTERM"))
    began = time.monotonic()
    with pytest.raises(SyncInterrupted, match="SIGTERM"):
        stop.result(hanging)
    assert time.monotonic() - began < 5.0
    assert not hanging.done()  # abandoned, not waited for
    release.set()


def test_once_set_it_stays_set_keeps_its_first_reason_and_refuses_new_calls():
    stop = Stop()
    seen: list[str] = []
    unregister = stop.on_set(lambda: seen.append("a"))
    stop.on_set(lambda: seen.append("b"))
    unregister()
    stop.set("SIGINT")
    stop.set("SIGTERM")
    assert stop.is_set and stop.reason == "SIGINT" and seen == ["b"]
    stop.on_set(lambda: seen.append("late"))  # registered after the stop: runs at once
    assert seen == ["b", "late"]
    with pytest.raises(SyncInterrupted):
        stop.check()
    with pytest.raises(SyncInterrupted):  # nothing more is asked of the supplier
        stop.call(_raise, AssertionError("a stopped run must not call"))
    with pytest.raises(SyncInterrupted):
        stop.sleep(HANGS)
    done: Future[int] = Future()
    done.set_result(3)
    assert stop.result(done) == 3  # a page that arrived is not thrown away


def test_a_workers_stop_follows_its_runs_shared_event():
    shared = multiprocessing.get_context("fork").Event()
    stop = Stop()
    stop.watch(shared)
    _after(0.2, shared.set)
    with pytest.raises(SyncInterrupted, match="the run's process stopped"):
        stop.sleep(HANGS)


def test_stop_aware_progress_stops_the_work_then_asks_the_lease():
    class Lease:
        checks = 0
        reports: list[tuple[str, str]] = []

        def check(self) -> None:
            Lease.checks += 1

        def report(self, stage: str, message: str = "") -> None:
            Lease.reports.append((stage, message))

    stop = Stop()
    progress = StopAware(Lease(), stop)
    progress.check()
    progress.report("FETCHING", "page 2")
    assert Lease.checks == 1 and Lease.reports == [("FETCHING", "page 2")]
    stop.set("terminated from the Dagster UI")
    with pytest.raises(SyncInterrupted, match="Dagster UI"):
        progress.check()
    assert Lease.checks == 1


def test_reasons_name_the_interruption():
    assert reason_of(SyncInterrupted("SIGTERM")) == "SIGTERM"
    assert reason_of(KeyboardInterrupt()) == "interrupted (KeyboardInterrupt)"
    assert "stopped iterating" in reason_of(GeneratorExit())


def _raise(err: BaseException) -> None:
    raise err


def test_a_signal_sets_the_stop_at_once_whatever_handler_runs_and_watches_nest():
    """Dagster's handler raises its interruption in the main thread wherever it is; the
    watch sees the signal itself, from its own thread, and an outer watch sees it too."""
    handled: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: handled.append(number))
    outer: list[int] = []
    stop = Stop()
    try:
        with SignalWatch(outer.append), stop_on_signals(stop):
            os.kill(os.getpid(), signal.SIGTERM)
            with pytest.raises(SyncInterrupted, match="SIGTERM"):
                stop.sleep(HANGS)
        assert handled == [signal.SIGTERM]  # the handler in place still ran
        assert outer == [signal.SIGTERM]
        # Once left, a watch sees nothing more (the outer one is gone too).
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert outer == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
