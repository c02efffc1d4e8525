"""A run's stop: asked once (a signal, a termination from the Dagster UI), seen by every city.

A stop never waits for the supplier. The only work that blocks on the network is a
request, and every request of a city's walk runs in a daemon thread of its own
(:meth:`Stop.result`, :meth:`Stop.call`): a city waiting for its next page wakes as soon as
the stop is asked, raises :class:`~supplier_sync_dagster.core.errors.SyncInterrupted` at
that page boundary and releases its lease, while the abandoned request ends on its own
(its deadline, or the HTTP client closed under it) without holding the process: it writes
nothing, since every write of a page is the city's, fenced by its lease. A city that is
normalizing or publishing stops at its next chunk (:class:`StopAware`).

Worker processes of a run watch a shared event (:meth:`Stop.watch`) that the run's process
sets when it stops.

A stop is also a cancellation (:meth:`Stop.cancel`) when the run's batch was cancelled
(CANCEL_PREVIOUS, an operator): the same stop, but what it raises is
:class:`~supplier_sync_dagster.core.errors.SyncCancelled`, so that nothing waits for a city
of a batch that is over and nobody is told to resume it. A run learns of it by polling
(:meth:`Stop.poll`): a cancelled batch sends no signal (nor does a Dagster run terminated
from another process, which polls its run's status the same way).

A signal sets the stop the moment it arrives (:class:`SignalWatch`), not when the thread
that runs the cities next sees an exception: Dagster's handler raises its interruption in
the main thread wherever that thread is, and when it is writing a city's events, outside
the cities' frames, nothing of theirs would see it (nor would the process exit, waiting
for a city thread that waits for its page).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import ParamSpec, Protocol, TypeVar

from supplier_sync_dagster.core.errors import SyncCancelled, SyncInterrupted
from supplier_sync_dagster.core.sync.model import Progress

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


class SharedEvent(Protocol):
    """An event another process sets (``multiprocessing.Event``)."""

    def set(self) -> None:
        """Sets it."""

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until it is set."""


class Stop:
    """A run's stop request: set once, checked at page boundaries, waking whoever waits.

    Thread-safe. A new one is not set; it stays set once set.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.reason = ""
        self.cancelled = False

    def __repr__(self) -> str:
        return f"Stop(set={self.is_set}, cancelled={self.cancelled}, reason={self.reason!r})"

    @property
    def is_set(self) -> bool:
        """True once a stop was asked."""
        return self._event.is_set()

    def set(self, reason: str) -> None:
        """Asks the run to stop (the first reason is kept), wakes everyone waiting and runs
        the callbacks (:meth:`on_set`)."""
        self._set(reason, cancelled=False)

    def cancel(self, reason: str) -> None:
        """Stops the run because its batch (or Dagster run) was cancelled: as :meth:`set`,
        but what the stop raises from now on is :class:`SyncCancelled`. A stop already
        asked stays what it was."""
        self._set(reason, cancelled=True)

    def _set(self, reason: str, *, cancelled: bool) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self.reason, self.cancelled = reason, cancelled
            self._event.set()
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Runs ``callback`` once the stop is asked (at once if it was); returns the function
        that unregisters it."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)

                def unregister() -> None:
                    with self._lock:
                        if callback in self._callbacks:
                            self._callbacks.remove(callback)

                return unregister
        callback()
        return lambda: None

    def error(self) -> SyncInterrupted:
        """What the stop raises: :class:`SyncCancelled` for a cancellation, else
        :class:`SyncInterrupted`, with its reason."""
        return SyncCancelled(self.reason) if self.cancelled else SyncInterrupted(self.reason)

    def check(self) -> None:
        """Raises :class:`SyncInterrupted` (:class:`SyncCancelled`) once a stop was asked
        (no database call)."""
        if self._event.is_set():
            raise self.error()

    def result(self, future: Future[T]) -> T:
        """``future``'s result, unless a stop comes first.

        Raises:
            SyncInterrupted: A stop was asked before the result (the call is abandoned).
        """
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        unregister = self.on_set(done.set)
        try:
            done.wait()
        finally:
            unregister()
        if not future.done():
            raise self.error()
        return future.result()

    def sleep(self, seconds: float) -> None:
        """Waits ``seconds``, or less if a stop comes first.

        Raises:
            SyncInterrupted: A stop was asked.
        """
        if self._event.wait(seconds):
            raise self.error()

    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` in a daemon thread of its own, unless a stop comes first
        (a request: the stop does not wait for it, nor does the process's exit).

        Raises:
            SyncInterrupted: A stop was asked before ``fn`` returned.
        """
        self.check()
        return self.result(in_daemon_thread(fn, *args, **kwargs))

    def watch(self, shared: SharedEvent) -> None:
        """Sets this stop once ``shared`` is set (from a daemon thread): a worker process's
        stop follows its run's."""

        def follow() -> None:
            shared.wait()
            self.set("the run's process stopped")

        threading.Thread(target=follow, name="stop-watch", daemon=True).start()

    def poll(
        self, probe: Callable[[], str | None], every: float = 1.0, *, cancels: bool = True
    ) -> Callable[[], None]:
        """Cancels this stop once ``probe`` says why; returns the function that ends the
        polling.

        A daemon thread calls ``probe`` every ``every`` seconds until the stop is asked or
        the polling ends; the first reason it returns cancels the stop (:meth:`cancel`), or
        only sets it (:meth:`set`) without ``cancels``. A probe that raises is tried again
        at the next poll (a database blip never stops a run).

        Args:
            probe: Why the run must stop (``"cancelled by trigger night-2
                (CANCEL_PREVIOUS)"``), or None while it need not; must not block long.
            every: Seconds between two probes.
            cancels: What ``probe`` sees is a cancellation (the batch is over), not only a
                stop (the run is resumable).
        """
        ended = threading.Event()

        def follow() -> None:
            while not ended.wait(every) and not self.is_set:
                try:
                    reason = probe()
                except Exception as err:  # tried again at the next poll
                    log.debug("cancellation probe failed: %s", err)
                    continue
                if reason:
                    self._set(reason, cancelled=cancels)

        threading.Thread(target=follow, name="stop-poll", daemon=True).start()
        return ended.set


def reason_of(interruption: BaseException) -> str:
    """What a stop says when ``interruption`` (a ``BaseException`` that is not an
    ``Exception``) stopped the run."""
    if isinstance(interruption, SyncInterrupted):
        return interruption.reason
    if isinstance(interruption, GeneratorExit):
        return "the run's caller stopped iterating its cities"
    return f"interrupted ({type(interruption).__name__})"


def in_daemon_thread(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
    """Starts ``fn(*args, **kwargs)`` in a daemon thread; its future.

    Daemon: a call blocked on the network never keeps the process from exiting.
    """
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            value = fn(*args, **kwargs)
        except BaseException as err:  # handed to whoever waits for the future
            future.set_exception(err)
        else:
            future.set_result(value)

    threading.Thread(target=run, name="supplier-call", daemon=True).start()
    return future


class StopAware:
    """A city's :class:`Progress` that also stops the work once its run's stop is asked.

    Args:
        progress: The city's heartbeat.
        stop: The run's stop.
    """

    def __init__(self, progress: Progress, stop: Stop) -> None:
        self.progress = progress
        self.stop = stop

    def check(self) -> None:
        """Raises once the run must stop, or the lease is lost."""
        self.stop.check()
        self.progress.check()

    def report(self, stage: str, message: str = "") -> None:
        """Says what the work is doing now."""
        self.progress.report(stage, message)


INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


class SignalWatch:
    """Calls ``on_signal(number)`` from a thread of its own as soon as SIGINT or SIGTERM
    arrives, whichever Python handler then runs for it (Dagster's during a run: its
    termination from the UI is a SIGINT to the run's process; SIGTERM under Kubernetes).

    CPython writes each signal's number to the process's wakeup file descriptor before any
    Python handler runs; this watch sets its own, reads it, and passes every byte on to the
    one it replaced (so watches nest). Only the main thread can set it; entered elsewhere,
    the watch does nothing. A signal without a Python handler (SIG_DFL, SIG_IGN) is not seen.

    Args:
        on_signal: Called with the signal's number; must not block.
    """

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        self._read = self._write = -1
        self._previous = -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SignalWatch:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._follow, name="signal-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._thread is None:
            return
        signal.set_wakeup_fd(self._previous)
        os.close(self._write)  # the reader sees the end, having read what came before
        self._thread.join(5)
        os.close(self._read)
        self._thread = None

    def _follow(self) -> None:
        while data := os.read(self._read, 64):
            if self._previous >= 0:
                with contextlib.suppress(OSError):  # the outer watch has gone: nothing to tell
                    os.write(self._previous, data)
            for number in data:
                if number in INTERRUPTS:
                    self._on_signal(number)


def stop_on_signals(stop: Stop) -> SignalWatch:
    """A :class:`SignalWatch` that sets ``stop`` (its reason the signal's name)."""
    return SignalWatch(lambda number: stop.set(signal.Signals(number).name))
