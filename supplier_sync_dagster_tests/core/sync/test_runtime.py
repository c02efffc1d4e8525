"""The one fork pool: its initializer runs first in each process; a watched process ends with
its parent."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest

from supplier_sync_dagster.core.sync.runtime import (
    PARENT_POLL_SECONDS,
    ForkPool,
    in_spare_thread,
    spare_threads,
)
from supplier_sync_dagster_tests.helpers import process_state

_started: list[int] = []


def _start(value: int) -> None:
    _started.append(value)


def _state() -> tuple[list[int], int]:
    return list(_started), os.getpid()


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that nobody reaped has ended)."""
    return process_state(pid) not in (None, "Z")


def test_each_process_runs_the_initializer_before_its_calls():
    with ForkPool(2, _start, (7,)) as pool:
        seen = [pool.submit(_state).result() for _ in range(6)]
    assert all(state == [7] for state, _ in seen)  # once per process, before any call
    assert {pid for _, pid in seen}.isdisjoint({os.getpid()})
    assert _started == []  # this process's memory is its own


def _refuse(value: int) -> None:
    raise ConnectionRefusedError(f"no database on port {value}")


@pytest.mark.parametrize("watched", [False, True])
def test_a_process_that_cannot_start_breaks_the_pool_and_the_pool_says_why(watched: bool):
    with ForkPool(2, _refuse, (3306,), exit_with_parent=watched) as pool:
        with pytest.raises(BrokenProcessPool):
            pool.submit(_state).result()
        assert pool.start_error() == "ConnectionRefusedError: no database on port 3306"
        assert pool.start_error() == "ConnectionRefusedError: no database on port 3306"


def test_a_pool_whose_processes_started_has_no_start_error():
    with ForkPool(2, _start, (7,)) as pool:
        pool.submit(_state).result()
        assert pool.start_error() is None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_watched_process_exits_once_its_parent_is_killed():
    read, write = os.pipe()
    parent = os.fork()
    if parent == 0:  # the pool's parent: dies at once, as if killed, once its worker runs
        try:
            os.close(read)
            pool = ForkPool(1, _start, (1,), exit_with_parent=True)
            os.write(write, str(pool.submit(_state).result()[1]).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(parent, 0)
    # Not read to its end: the worker holds the pipe's other end as long as it runs.
    worker = int(os.read(read, 32))
    os.close(read)
    deadline = time.monotonic() + 10 * PARENT_POLL_SECONDS
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphaned = _running(worker)
    if orphaned:
        os.kill(worker, signal.SIGKILL)
    assert not orphaned


WAIT = 10.0


def _call_in_spare_thread() -> int:
    """Runs a call with :func:`in_spare_thread`; the id of the thread it ran on."""
    ran: list[int] = []
    done = threading.Event()

    def call() -> None:
        ran.append(threading.get_ident())
        done.set()

    in_spare_thread(call, "spare-test")
    assert done.wait(WAIT)
    return ran[0]


def _until_spare(n: int) -> None:
    """Waits until ``n`` spare threads are idle (a call's thread is, once it returned)."""
    pause, deadline = threading.Event(), time.monotonic() + WAIT
    while spare_threads() < n:
        assert time.monotonic() < deadline, "a finished call's thread never became spare"
        pause.wait(0.01)


def test_a_spare_thread_runs_the_next_call_and_a_blocked_call_keeps_its_own():
    first = _call_in_spare_thread()
    _until_spare(1)  # the thread is spare once its call has returned
    assert _call_in_spare_thread() == first
    assert first != threading.get_ident()

    # A call that never returns (a request abandoned mid-way) keeps its thread: the next
    # call runs on another one.
    blocked, release = threading.Event(), threading.Event()

    def hang() -> None:
        blocked.set()
        release.wait(WAIT)

    _until_spare(1)
    in_spare_thread(hang, "spare-hang")
    assert blocked.wait(WAIT)
    try:
        assert _call_in_spare_thread() != first
    finally:
        release.set()


def test_a_forked_process_starts_with_no_spare_thread():
    _call_in_spare_thread()
    _until_spare(1)
    with ForkPool(1, _start, (1,)) as pool:
        assert pool.submit(spare_threads).result() == 0
        # ...and its own calls still run there.
        assert pool.submit(_call_in_spare_thread).result() > 0
