"""The process a sync runs in: its garbage collector, its CPUs, and the one fork pool.

:func:`prepare_process` tunes the cyclic collector once per process and
:func:`collect_garbage` bounds the memory that tuning would let grow; :func:`usable_cpus` is
what the process may run on. :class:`ForkPool` is every forked worker process of a sync: a
run's city workers, a shard's normalizing judges and its publishers. :func:`in_spare_thread`
runs a call in a daemon thread that an earlier call left idle.
"""

from __future__ import annotations

import contextvars
import gc
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing.queues import SimpleQueue as ProcessQueue
from typing import Any, ParamSpec, TypeVar

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

# Young-generation GC threshold set by prepare_process (CPython's default is 700).
GC_GEN0_THRESHOLD = 50_000

_prepared = False
_prepare_lock = threading.Lock()


def prepare_process() -> None:
    """Tunes the cyclic garbage collector for a long sync in this process; idempotent.

    A sync keeps many long-lived objects (modules, compiled statements, a chunk of
    documents) while allocating millions of short-lived ones, and CPython's collector keeps
    re-scanning the long-lived heap: that nearly doubles the cost of normalization. So, once
    per process: collect the young generations' garbage, ``gc.freeze()`` everything that
    survives (it is never scanned again; frozen objects are still freed by reference
    counting) and raise the young-generation threshold so collections run less often.
    The oldest generation is not collected first: it holds what survived every earlier
    collection (the imports' modules and classes), and a full collection of a start-up heap
    costs a command more time than the little it frees, which stays frozen.
    Reference counting still frees every acyclic object at once; only cyclic garbage waits
    a little longer. ``sync_city`` calls this itself; entry points may call it earlier,
    after their imports, to freeze more of the start-up heap.
    """
    global _prepared
    with _prepare_lock:
        if _prepared:
            return
        _prepared = True
        gc.collect(1)
        gc.freeze()
        gen0, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD), gen1, gen2)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


GC_INTERVAL_SECONDS = 2.0
_last_collect = 0.0


def collect_garbage() -> None:
    """A full collection at most every ``GC_INTERVAL_SECONDS``; call it once per page or chunk.

    With the young generation's threshold raised (:func:`prepare_process`), cyclic garbage
    (HTTP responses, parsed pages) that survives into the oldest generation would wait for
    a rare full collection, and a large city's peak memory would grow with its size. After
    ``gc.freeze()`` a full collection only scans what the sync itself holds, so doing it on
    a clock bounds memory by what two seconds of work leave behind (a shorter interval costs
    more CPU for the same peak: ``bench_scale.py memory``).
    """
    global _last_collect
    now = time.monotonic()
    if now - _last_collect >= GC_INTERVAL_SECONDS:
        gc.collect()
        _last_collect = time.monotonic()


PARENT_POLL_SECONDS = 1.0


class ForkPool:
    """Forked worker processes that run calls submitted from this process.

    Fork, not spawn: the processes start at once with this process's modules (a spawned
    process would import the project again) and read their input from the fork's memory
    instead of having it pickled. They must never use this process's connections: the
    initializer opens or disposes of them. Closing the pool waits for the calls running,
    cancels the others and ends the processes.

    The processes ignore SIGINT and SIGTERM: a Ctrl-C reaches the whole process group, and
    the handlers they would inherit (Dagster's) would break a call half-way. This process
    decides when they stop (a run's city workers follow its stop).

    A process whose initializer raises ends, and the pool breaks (every call then raises
    ``BrokenProcessPool``, which does not say why): :meth:`start_error` says why.

    Args:
        workers: How many processes.
        initializer: Called once in each process at its start, with ``initargs``.
        initargs: The initializer's arguments.
        exit_with_parent: Each process exits once this process is gone (killed): a city
            worker then leaves its lease to expire, and the next run resumes its city.
    """

    def __init__(
        self,
        workers: int,
        initializer: Callable[..., None],
        initargs: tuple[Any, ...],
        *,
        exit_with_parent: bool = False,
    ) -> None:
        context = multiprocessing.get_context("fork")
        self._start_errors: ProcessQueue[str] = context.SimpleQueue()
        self._start_error: str | None = None
        self._start_error_lock = threading.Lock()
        start: Callable[..., None] = _start_quiet
        args: tuple[Any, ...] = (self._start_errors, initializer, initargs)
        if exit_with_parent:
            start, args = _start_watched, (os.getpid(), start, args)
        self._pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=context,
            initializer=start,
            initargs=args,
        )

    def __enter__(self) -> ForkPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Runs ``fn(*args, **kwargs)`` in one of the processes."""
        return self._pool.submit(fn, *args, **kwargs)

    def start(self) -> None:
        """Forks the processes now rather than at the first call (Python forks them all
        then, from whichever thread submits it)."""
        self._pool.submit(int)

    def start_error(self) -> str | None:
        """Why a process could not start (``Type: message`` of what its initializer
        raised, the first one), or None while every process started."""
        with self._start_error_lock:  # one reader: a second would wait for a second error
            if self._start_error is None and not self._start_errors.empty():
                self._start_error = self._start_errors.get()
            return self._start_error

    def close(self, *, wait: bool = True) -> None:
        """Cancels the queued calls and ends the processes, once the running calls are
        done: waits for that unless ``wait`` is False."""
        self._pool.shutdown(wait=wait, cancel_futures=True)


def _start_quiet(
    errors: ProcessQueue[str],
    initializer: Callable[..., None],
    initargs: tuple[Any, ...],
) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    try:
        initializer(*initargs)
    except BaseException as err:
        errors.put(f"{type(err).__name__}: {err}")
        raise


def _start_watched(
    parent_pid: int, initializer: Callable[..., None], initargs: tuple[Any, ...]
) -> None:
    threading.Thread(
        target=_exit_with_parent, args=(parent_pid,), daemon=True, name="parent-watch"
    ).start()
    initializer(*initargs)


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_SECONDS)
        if os.getppid() != parent_pid:
            os._exit(1)


# Idle daemon threads kept for the next call, at most (more end when their call does).
SPARE_THREADS_KEPT = 8


class _SpareThreads:
    """Daemon threads that run one call after another: a city's walk reuses the thread that
    an earlier city's walk left, instead of starting one. A call that never returns (a
    request abandoned mid-way) keeps its thread; the next call gets another. A forked
    process starts with none (its parent's threads do not run in it)."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[tuple[Callable[[], None], str]]] = []

    def run(self, fn: Callable[[], None], name: str) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()
        inbox.put((fn, name))

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def _serve(self, inbox: queue.SimpleQueue[tuple[Callable[[], None], str]]) -> None:
        while True:
            fn, name = inbox.get()
            threading.current_thread().name = name
            try:
                fn()
            except BaseException as err:  # a call hands its outcome over itself
                log.warning("call in thread %r raised: %r", name, err)
            with self._lock:
                if len(self._idle) >= SPARE_THREADS_KEPT:
                    return
                self._idle.append(inbox)


_spare_threads = _SpareThreads()


def in_spare_thread(fn: Callable[[], None], name: str) -> None:
    """Runs ``fn()`` in a daemon thread named ``name``, an idle one if this process has one.

    Daemon: a call blocked on the network never keeps the process from exiting. ``fn``
    hands its outcome over itself (what it raises is only logged). It runs in the caller's
    context (a city's request tally counts its read-ahead's requests).
    """
    context = contextvars.copy_context()
    _spare_threads.run(lambda: context.run(fn), name)


def spare_threads() -> int:
    """The idle spare threads of this process: the next calls of :func:`in_spare_thread`
    run on them."""
    return _spare_threads.idle
