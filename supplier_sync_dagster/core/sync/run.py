"""One run's cities: its batch, the order of its cities, the cities other runs hold, helping
them, and each city's outcome as it finishes.

A run (a Dagster step over a range of city partitions, or any worker) asks :func:`plan_run`
for its batch and the order of its cities, then iterates :func:`run_cities`, which yields one
:class:`CityOutcome` per city **as the city finishes**: whoever runs the cities can report
each one at once (Dagster marks each city's partitions with its own outcome), and a run that
is interrupted has already reported the cities it completed.

What a run does with its cities:

- **own cities**, largest first, ``threads`` in flight; a city whose lease another worker
  holds is deferred and waited for after the others (it helped out, or raced);
- **helping**: when its own cities are done, the run syncs the largest cities of the batch
  that no run has started (``help_other_runs``), and reports them too;
- **replay** (``RunRequest.replay``): the cities' latest stored raw pages are normalized
  and published again in a replay batch, without a supplier request; dead letters that
  now pass are resolved.

A city's outcome says which stages this run completed for it (``report.stages_done``) and
the gate's results, so that a city that failed, was gated or lost its lease is not reported
as done for anything it did not complete.

How a run ends when it cannot go on:

- a city that fails (any exception) is FAILED with ``CODE: what happened`` and files its
  CITY_FAILED ticket, which compensation retries; the other cities go on;
- a supplier that refuses the API key (401/403), on its city list or on any city, stops the
  run's cities not started yet: each is FAILED with that code, without a request;
- a supplier that refuses the key or cannot be reached when the run reads its city list
  fails the run's cities at once (the batch FAILED: the alerts see it);
- a run told to stop (a :class:`~supplier_sync_dagster.core.sync.stop.Stop`: SIGTERM,
  SIGINT, a termination from the Dagster UI) stops each city at its next page boundary and
  releases its lease with its checkpoint (no ticket), its worker processes too, and ends the
  batch's creator's grace: a resume, or the next trigger, takes the cities at once;
- a run whose batch was cancelled (a CANCEL_PREVIOUS trigger, an operator) sees it within
  a second (:func:`cancellation`, polled) and stops the same way, raising
  :class:`~supplier_sync_dagster.core.errors.SyncCancelled`: no city of a cancelled batch is
  waited for, its failed claims are not taken for another run's lease.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import re
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import AbstractContextManager, ExitStack, closing
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

import sqlalchemy as sa

from supplier_sync_dagster.core.errors import (
    AUTH_REJECTED_CODES,
    INTERNAL_ERROR,
    UNREACHABLE_CODES,
    CityNotFound,
    RateLimiterUnavailable,
    SupplierAuthError,
    SupplierError,
    SyncCancelled,
    WorkerStartFailed,
    code_of_description,
    describe_error,
    error_code_of,
)
from supplier_sync_dagster.core.leasing.batches import (
    Batch,
    BatchDecision,
    TaskSpec,
    TriggerSource,
    create_batch,
    end_grace,
    fail_unstarted,
    get_batch,
    start_batch,
)
from supplier_sync_dagster.core.leasing.leases import get_shard
from supplier_sync_dagster.core.leasing.processes import (
    DEFAULT_LEASE_SECONDS,
    holder_is_dead_here,
    make_worker_id,
)
from supplier_sync_dagster.core.records.deadletters import CITY_FAILED, record_city_failure
from supplier_sync_dagster.core.records.gates import GateResult
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import PayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.supplier.client import tally_requests
from supplier_sync_dagster.core.supplier.governor import GovernedLimiter
from supplier_sync_dagster.core.sync.city import help_other_workers, largest_first, sync_city
from supplier_sync_dagster.core.sync.gate import gate_for_pipeline
from supplier_sync_dagster.core.sync.model import CityReport, SyncSettings
from supplier_sync_dagster.core.sync.replay import (
    prepare_replay,
    record_city_list,
    resolve_replayed_dead_letters,
    stored_city_countries,
)
from supplier_sync_dagster.core.sync.runtime import ForkPool, prepare_process, usable_cpus
from supplier_sync_dagster.core.sync.stop import SharedEvent, Stop, reason_of
from supplier_sync_dagster.core.sync.tasks import open_task

log = logging.getLogger(__name__)

HELD_POLL_SECONDS = 2.0
# How often a run reads whether its batch was cancelled.
CANCEL_POLL_SECONDS = 1.0
DONE_STATUSES = ("SUCCESS", "ALREADY_DONE")

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


def resolve_batch(
    db: SyncDatabase,
    *,
    task_code: str,
    supplier_id: int,
    trigger_id: str,
    source: TriggerSource,
    cities: Sequence[str],
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
) -> Batch:
    """The batch of this trigger (created once, or adopted), with a shard per city of the run.

    The run creates its task if it is missing and never changes it: policy, status, cron
    and thresholds are the operator's (``supplier-sync task set``).

    Raises:
        TaskDisabled: The task is DISABLED.
        TriggerSkipped: The task's concurrency policy skipped this trigger.
    """
    decision = decide_trigger(
        db,
        task_code=task_code,
        supplier_id=supplier_id,
        trigger_id=trigger_id,
        source=source,
        lease_seconds=lease_seconds,
    )
    return start_batch(db, decision, list(cities), skipped="sync skipped")


def decide_trigger(
    db: SyncDatabase,
    *,
    task_code: str,
    supplier_id: int,
    trigger_id: str,
    source: TriggerSource,
    adopt: bool = True,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
) -> BatchDecision:
    """What the task's policy decides for a run's trigger (``create_batch``), the task
    created first if it is missing; ``lease_seconds`` is the creator's grace (the shards'
    lease: a frozen creator's batch is adopted as soon as its leases could expire).

    Raises:
        TaskDisabled: The task is DISABLED.
    """
    open_task(
        db, TaskSpec(task_code=task_code, supplier_id=supplier_id), trigger_id=trigger_id, run="run"
    )
    return create_batch(
        db,
        task_code=task_code,
        trigger_id=trigger_id,
        trigger_source=source,
        adopt=adopt,
        lease_seconds=lease_seconds,
    )


@dataclass(frozen=True)
class RunRequest:
    """What a run was asked to do.

    Attributes:
        trigger_id: The batch's idempotency key (a backfill id, a CLI trigger, a run id).
        source: Where the trigger came from.
        cities: The run's cities (supplier codes, verbatim).
        replay: Normalize and publish the cities' stored raw pages again, in a replay batch,
            without calling the supplier.
        threads: Cities in flight at once in the run's process.
        processes: Worker processes to sync the cities in (0: the run's process); None
            decides from the run's size (:func:`auto_processes`).
        help_other_runs: Once its cities are done, sync cities of the batch that no run
            has started.
    """

    trigger_id: str
    source: TriggerSource
    cities: Sequence[str]
    replay: bool = False
    threads: int = 1
    processes: int | None = None
    help_other_runs: bool = True


@dataclass
class RunPlan:
    """A run's batch and its cities in the order to sync them.

    Attributes:
        batch: The batch (a replay batch for a replay).
        cities: The run's cities to sync, largest first where sizes are known.
        countries: City -> country code from the supplier's city list (or the stored one).
        sizes: City -> the supplier's hotel count, where known.
        sources: For a replay: city -> the batch whose raw pages are replayed.
        missing: For a replay: cities with no stored raw pages (nothing to replay).
        notes: Things the run's log should say (e.g. the city list was unavailable).
    """

    batch: Batch
    cities: list[str]
    countries: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class SupplierUse:
    """What a city cost of the supplier's request budget.

    Attributes:
        requests: Supplier requests (retries included); exact when the process synced one
            city at a time.
        throttled: Of those, 429 answers.
        retries: Retries the client made.
        waited: Seconds the requests waited for the rate limiter(s).
        rate: Requests/s the adaptive rate limiter had learnt when the city ended (None:
            a fixed rate).
    """

    requests: int = 0
    throttled: int = 0
    retries: int = 0
    waited: float = 0.0
    rate: float | None = None


@dataclass
class CityOutcome:
    """One city of a run, when it finished (or failed).

    Attributes:
        report: What the city's sync did; ``report.status`` is SUCCESS, GATED, FAILED,
            LEASE_LOST or ALREADY_DONE (an earlier run of the batch published it: the report
            is that run's, as the database recorded it), and ``report.stages_done`` lists
            the stages completed for it.
        helped: The city belongs to another run of the batch that had not started it.
        resolved_dead_letters: For a replayed city: dead letters that now pass.
        seconds: Wall time this run spent on the city.
        supplier: What it cost of the supplier's request budget.
    """

    report: CityReport
    helped: bool = False
    resolved_dead_letters: int = 0
    seconds: float = 0.0
    supplier: SupplierUse = field(default_factory=SupplierUse)

    @property
    def city_code(self) -> str:
        """The supplier's city code."""
        return self.report.city_code

    @property
    def checks(self) -> list[GateResult]:
        """The batch gate's results for the city (empty when no gate ran); a city stopped
        on its first pages by schema drift has that check only."""
        return self.report.checks

    @property
    def status(self) -> str:
        """The city's status (see ``report``)."""
        return self.report.status

    @property
    def done(self) -> bool:
        """The city is published in this batch (by this run or before it)."""
        return self.report.status in DONE_STATUSES


def plan_run(
    db: SyncDatabase,
    store: PayloadStore,
    client: SupplierClient | None,
    request: RunRequest,
    settings: SyncSettings,
) -> RunPlan:
    """The run's batch (created, joined or adopted) and its cities in the order to sync them.

    A sync reads the supplier's city list once (one request): it gives each city's country,
    for the rule that a hotel's country is its city's, and size, to start the largest
    cities first; its bytes are kept with the batch for replays. A replay reads that list
    from the store and never calls the supplier.

    Args:
        db: The sync database.
        store: The payload store.
        client: The supplier client; None for a replay.
        request: What the run was asked to do.
        settings: The task and tuning settings (task code, supplier id).

    Raises:
        TaskDisabled: The task is DISABLED.
        TriggerSkipped: The task's concurrency policy skipped this trigger.
        ConfigError: A replay batch was refused.
        SupplierError: The supplier refused the API key or could not be reached when asked
            for its city list: the run's cities are FAILED with its code (:func:`refuse_run`).
    """
    cities = list(request.cities)
    if request.replay:
        replay = prepare_replay(
            db, task_code=settings.task_code, trigger_id=request.trigger_id, cities=cities
        )
        return RunPlan(
            batch=replay.batch,
            cities=[c for c in cities if c in replay.sources],
            countries=stored_city_countries(db, store, task_code=settings.task_code),
            sources=dict(replay.sources),
            missing=list(replay.missing),
            notes=[
                f"city {c!r} has no stored raw pages: nothing to replay" for c in replay.missing
            ],
        )
    batch = resolve_batch(
        db,
        task_code=settings.task_code,
        supplier_id=settings.supplier_id,
        trigger_id=request.trigger_id,
        source=request.source,
        cities=cities,
        lease_seconds=settings.lease.lease_seconds,
    )
    plan = RunPlan(batch=batch, cities=cities)
    if client is None:
        return plan
    try:
        fetched = client.list_cities()
    except SupplierError as err:
        if error_code_of(err) in AUTH_REJECTED_CODES | UNREACHABLE_CODES:
            # Nothing of this run can work: its cities fail now, each with the cause.
            refuse_run(db, batch, cities, err, settings)
            raise
        plan.notes.append(f"city list unavailable, country rule skipped: {describe_error(err)}")
        return plan
    except Exception as err:  # the country rule is skipped, the sync is not
        plan.notes.append(f"city list unavailable, country rule skipped: {describe_error(err)}")
        return plan
    record_city_list(
        db, store, batch_id=batch.batch_id, supplier_id=settings.supplier_id, raw=fetched.raw
    )
    listed = fetched.data.cities
    plan.countries = {c.city_code: c.country_code for c in listed if c.country_code}
    plan.sizes = {c.city_code: c.hotel_count for c in listed if c.hotel_count is not None}
    plan.cities = largest_first(cities, plan.sizes)
    return plan


def refuse_run(
    db: SyncDatabase,
    batch: Batch,
    cities: Sequence[str] | None,
    err: BaseException | str,
    settings: SyncSettings,
) -> list[str]:
    """Fails a run that could not start, or go on (the supplier refused the API key, or
    could not be reached): its cities not started are FAILED with the cause, each with its
    CITY_FAILED ticket, and the batch records the cause; the alerts see the failed batch.

    Args:
        db: The sync database.
        batch: The run's batch.
        cities: The run's cities; None: every city of the batch not started.
        err: Why (an exception, or its ``CODE: what happened``).
        settings: The task's settings (the tickets name the task).

    Returns:
        The cities failed.
    """
    error = err if isinstance(err, str) else describe_error(err)
    failed = fail_unstarted(db, batch.batch_id, error, shard_keys=cities)
    for city in failed:
        file_city_failure(db, batch.batch_id, settings, city, error)
    log.info("batch %s: %d cities not started: %s", batch.batch_id, len(failed), error)
    return failed


def refuse_trigger(
    db: SyncDatabase,
    *,
    settings: SyncSettings,
    trigger_id: str,
    source: TriggerSource,
    err: BaseException,
) -> Batch | None:
    """Records a trigger whose run could not even read the supplier's city list: the
    supplier refused the API key or could not be reached. The trigger gets its batch, FAILED
    with the cause (:func:`refuse_run`), so that ``status``, the metrics and the alerts see
    it; an abandoned batch is not adopted for it (the next trigger that works adopts it).

    Returns:
        The failed batch; None when the task's policy skipped the trigger (a live batch
        runs, and meets the supplier itself).

    Raises:
        TaskDisabled: The task is DISABLED.
    """
    decision = decide_trigger(
        db,
        task_code=settings.task_code,
        supplier_id=settings.supplier_id,
        trigger_id=trigger_id,
        source=source,
        adopt=False,
    )
    if decision.batch is None:
        return None
    refuse_run(db, decision.batch, None, err, settings)
    with db.engine.connect() as conn:
        return get_batch(conn, decision.batch.batch_id)


def cancellation(db: SyncDatabase, batch_id: str) -> str | None:
    """Why the batch was cancelled (its recorded reason), or None while it is not.

    Args:
        db: The sync database.
        batch_id: The batch.
    """
    with db.engine.connect() as conn:
        batch = get_batch(conn, batch_id)
    if batch.status != "CANCELLED":
        return None
    return batch.error_message or f"batch {batch_id} was cancelled"


def refusal_line(error: str | None, *, key_setting: str, address: str | None) -> str | None:
    """One line for a run that the supplier refused: ``supplier refused the API key (401):
    check VARIABLE``, or ``supplier unreachable: CONNECTION_REFUSED host:port``.

    Args:
        error: A failure's ``CODE: what happened`` (``core.errors.describe_error``).
        key_setting: The variable that holds the API key.
        address: The supplier's ``host:port``, when known.

    Returns:
        The line; None when ``error`` is neither a refused key nor an unreachable supplier.
    """
    code = code_of_description(error)
    if code in AUTH_REJECTED_CODES:
        status = re.search(r"-> (40[13])\b", error or "")
        return (
            f"supplier refused the API key ({status.group(1) if status else '401/403'}): "
            f"check {key_setting}"
        )
    if code in UNREACHABLE_CODES:
        return f"supplier unreachable: {code}" + (f" {address}" if address else "")
    return None


def file_city_failure(
    db: SyncDatabase, batch_id: str, settings: SyncSettings, city: str, error: str
) -> None:
    """The CITY_FAILED ticket of a city that failed in a batch (once per batch and city):
    compensation asks for a re-sync of the city, and the ticket is resolved once a sync of
    the city succeeds. A city that answered 404 gets a CITY_NOT_FOUND ticket instead, for a
    person: a 404 is not retried (the city retires once the supplier's list lacks it)."""
    code = code_of_description(error)
    record_city_failure(
        db,
        batch_id=batch_id,
        task_code=settings.task_code,
        sync_mode=settings.sync_mode,
        supplier_id=settings.supplier_id,
        city_code=city,
        error=error,
        error_code=CityNotFound.error_code if code == CityNotFound.error_code else CITY_FAILED,
    )


@dataclass(frozen=True)
class WorkerIO:
    """What a process needs to sync cities: its own connections.

    Attributes:
        db: The sync database.
        store: The payload store.
        client: The supplier client; None for a replay.
    """

    db: SyncDatabase
    store: PayloadStore
    client: SupplierClient | None


@dataclass(frozen=True)
class WorkerProcesses:
    """Sync a run's cities in worker processes (see :func:`run_cities`).

    Attributes:
        count: Worker processes; each syncs one city at a time.
        open_io: Called once in each worker process: opens that process's own database,
            payload store and supplier client (connections are never shared across a
            fork), kept open until the process ends. The client should share the run's
            rate limiter (an :class:`InProcessTokenBucket` made before the fork is shared).
    """

    count: int
    open_io: Callable[[], AbstractContextManager[WorkerIO]]


# Worker processes start one per CPU plus one, at most this many, for a run with at least
# this many hotels: below it, the start of the processes costs more than a second core
# gives. The one more: a worker waits on the supplier, on fsyncs and on the database's
# write lock, and one worker more than there are cores fills those waits
# (``bench_user_path.py`` compares the counts).
MAX_AUTO_PROCESSES = 4
OVERSUBSCRIBE_PROCESSES = 1
AUTO_PROCESSES_MIN_HOTELS = 5000


def auto_processes(request: RunRequest, plan: RunPlan) -> int:
    """How many worker processes a run uses (0: it syncs its cities itself).

    ``request.processes`` when set; otherwise one per CPU plus ``OVERSUBSCRIBE_PROCESSES``
    (at most ``MAX_AUTO_PROCESSES``, never more than the run's cities) when the supplier's hotel count of the run's cities
    reaches ``AUTO_PROCESSES_MIN_HOTELS``. A replay stays in the run's process.
    """
    if request.replay:
        return 0
    if request.processes is not None:
        return max(0, request.processes)
    hotels = sum(plan.sizes.get(c, 0) for c in plan.cities)
    if hotels < AUTO_PROCESSES_MIN_HOTELS or len(plan.cities) < 2:
        return 0
    wanted = usable_cpus() + OVERSUBSCRIBE_PROCESSES
    return max(0, min(wanted, MAX_AUTO_PROCESSES, len(plan.cities)))


class _CityWorker:
    """Syncs one city at a time of a run's batch, in whichever process it lives in."""

    def __init__(
        self,
        io: WorkerIO,
        plan: RunPlan,
        request: RunRequest,
        settings: SyncSettings,
        worker_id: str,
        stop: Stop,
    ) -> None:
        self.io, self.plan, self.request, self.settings = io, plan, request, settings
        self.worker_id, self.stop = worker_id, stop
        self.gate = gate_for_pipeline()

    def sync(self, city: str, *, wait_if_held: bool, helped: bool = False) -> CityOutcome:
        """Syncs ``city``. A city that raises is FAILED (resumable), its report saying why.

        Raises:
            SyncInterrupted: The run's stop was asked (the city's lease is released).
        """
        self.stop.check()  # a stopped run claims nothing more
        db, batch = self.io.db, self.plan.batch
        client = self.io.client
        started = time.perf_counter()
        report = CityReport(city)
        with tally_requests() as tally:
            try:
                while True:
                    report = CityReport(city)
                    sync_city(
                        db,
                        self.io.store,
                        client,
                        batch=batch,
                        city_code=city,
                        worker_id=self.worker_id,
                        settings=self.settings,
                        gate=self.gate,
                        fetch=not self.request.replay,
                        city_countries=self.plan.countries,
                        report=report,
                        hotel_count=self.plan.sizes.get(city),
                        stop=self.stop,
                    )
                    if report.status != "HELD_BY_OTHER":
                        break
                    # A cancelled shard refuses every claim too: it is not another run's.
                    if reason := cancellation(db, batch.batch_id):
                        self.stop.cancel(reason)
                        self.stop.check()
                    if not wait_if_held:
                        break
                    # Another run of the batch is syncing it (it helped out, or raced): wait
                    # for its lease to end, then take the outcome or resume.
                    self.stop.sleep(HELD_POLL_SECONDS)
            except Exception as err:  # reported as the city's outcome; the others go on
                report.fail(err, report.error if report.status == "FAILED" else None)
                # The summary says it once; its traceback goes with the report, to the run's log.
                log.debug("city %r failed: %s", city, report.error, exc_info=err)
        if report.status == "ALREADY_DONE":
            report = published_report(db, batch.batch_id, city)
        outcome = CityOutcome(report, helped, seconds=time.perf_counter() - started)
        if client is not None:
            outcome.supplier = SupplierUse(
                tally.requests, tally.throttled, tally.retries, tally.waited, governed_rate(client)
            )
        if self.request.replay and report.status == "SUCCESS":
            outcome.resolved_dead_letters = resolve_replayed_dead_letters(
                db,
                source_batch_id=self.plan.sources[city],
                replay_batch_id=batch.batch_id,
                city_code=city,
            )
        return outcome


def governed_rate(client: SupplierClient | None) -> float | None:
    """The requests/s the client's adaptive rate limiter has learnt; None for a fixed one."""
    limiter = client.rate_limiter if client is not None else None
    if not isinstance(limiter, GovernedLimiter):
        return None
    try:
        return limiter.snapshot().rate
    except RateLimiterUnavailable:
        return None


def record_run_stats(
    db: SyncDatabase,
    *,
    batch_id: str,
    task_code: str,
    worker_id: str,
    outcomes: Sequence[CityOutcome],
    rate: float | None = None,
) -> None:
    """One row of what a run's cities asked of the supplier and published (the metrics);
    ``rate``: the requests/s an adaptive rate limiter had learnt (None: a fixed one)."""
    if not outcomes:
        return
    with db.begin() as conn:
        conn.execute(
            sa.insert(schema.run_stats).values(
                batch_id=batch_id,
                task_code=task_code,
                worker_id=worker_id[:64],
                cities=len(outcomes),
                records=sum(o.report.records for o in outcomes),
                published=sum(o.report.published for o in outcomes),
                requests=sum(o.supplier.requests for o in outcomes),
                throttled=sum(o.supplier.throttled for o in outcomes),
                retries=sum(o.supplier.retries for o in outcomes),
                seconds=round(sum(o.seconds for o in outcomes), 3),
                created_at=db.clock.now(),
                limiter_wait_seconds=round(sum(o.supplier.waited for o in outcomes), 3),
                governed_rate=rate,
            )
        )


def run_city_groups(
    db: SyncDatabase,
    store: PayloadStore,
    client: SupplierClient | None,
    plan: RunPlan,
    request: RunRequest,
    settings: SyncSettings,
    *,
    worker_id: str,
    processes: WorkerProcesses | None = None,
    stop: Stop | None = None,
) -> Generator[list[CityOutcome], None, None]:
    """Syncs the plan's cities (then helps other runs of the batch); yields each city's
    outcome as it finishes, with those of the cities that finished while the iteration was
    away: whoever reports each group (a Dagster step writing the cities' events) can store
    it at once.

    A city that raises is yielded as FAILED (its shard is FAILED and resumable, its
    CITY_FAILED ticket filed); the other cities go on, unless the supplier refused the API
    key: the cities not started then fail without a request. A city another worker holds
    is waited for after the others, and yielded once this run has synced it or seen it
    finished.

    With ``processes`` (and a count above 0), the cities are synced in that many worker
    processes forked now, each with its own connections and worker id (its shard leases
    are its own), one city at a time each; this process only hands out cities and yields
    their outcomes, so whoever iterates (a Dagster step writing each city's events) works
    while the workers sync. A sync is CPU-bound (parsing, normalizing, SQL): threads of
    one process share one core. A worker that dies leaves its city FAILED here and its
    lease to expire (a re-run resumes it); the processes end with the iteration.

    An interruption that reaches the iteration (KeyboardInterrupt, a termination from the
    Dagster UI, the iteration closed) sets ``stop``: every city in flight, in this process
    or a worker process, stops at its next page boundary and releases its lease, and the
    batch's creator's grace ends; then the interruption goes on. A batch cancelled meanwhile
    (read each ``CANCEL_POLL_SECONDS``) stops the run the same way, with
    :class:`~supplier_sync_dagster.core.errors.SyncCancelled`.

    Args:
        db: The sync database.
        store: The payload store.
        client: The supplier client; None for a replay.
        plan: From :func:`plan_run`.
        request: What the run was asked to do.
        settings: The task and tuning settings.
        worker_id: This worker's id (one per run).
        processes: Worker processes to sync in, or None to sync in this process
            (``request.threads`` cities at once, on threads of their own: the next city is
            synced while the iteration works on the last one's outcome).
        stop: The run's stop (a new one when None): setting it stops the run.
    """
    stop = stop or Stop()
    batch_id = plan.batch.batch_id
    # However the stop comes (a signal seen by a SignalWatch, an interruption here), whoever
    # triggers next need not wait one lease period for this run's grace.
    stop.on_set(lambda: _end_grace(db, batch_id))
    done: list[CityOutcome] = []
    # A cancelled batch sends no signal: the run reads it.
    end_poll = stop.poll(lambda: cancellation(db, batch_id), CANCEL_POLL_SECONDS)
    try:
        if processes is not None and processes.count > 0:
            with _ProcessPool(db, processes, plan, request, settings, stop) as pool:
                # One city more than there are workers: it waits in the pool's queue, so a
                # worker that finishes a city takes the next at once instead of waiting for
                # this process to receive the outcome and hand one out (this process is busy
                # writing the finished city's events meanwhile, and shares the CPUs).
                guard = _Guard(db, plan, request, settings, pool.sync)
                for group in _run(db, guard, plan, request, processes.count + QUEUED_AHEAD, stop):
                    done.extend(group)
                    yield group
            return
        worker = _CityWorker(WorkerIO(db, store, client), plan, request, settings, worker_id, stop)
        guard = _Guard(db, plan, request, settings, worker.sync)
        for group in _run(db, guard, plan, request, request.threads, stop):
            done.extend(group)
            yield group
    except BaseException as err:
        if isinstance(err, Exception):
            _end_grace(db, batch_id)
        else:
            stop.set(reason_of(err))
        if stop.cancelled and not isinstance(err, (Exception, GeneratorExit, SyncCancelled)):
            # A worker process saw only that its run stopped: the run says why.
            raise stop.error() from err
        raise
    finally:
        end_poll()
        # Also for a run that stops early: what it did ask of the supplier counts.
        try:
            record_run_stats(
                db,
                batch_id=plan.batch.batch_id,
                task_code=settings.task_code,
                worker_id=worker_id,
                outcomes=done,
                rate=governed_rate(client),
            )
        except Exception as err:  # metrics never fail a sync
            log.warning("could not record the run's stats: %s", err)


def one_at_a_time(
    groups_of: Callable[P, Generator[list[T], None, None]],
) -> Callable[P, Generator[T, None, None]]:
    """``groups_of`` (a generator of groups), yielding one item at a time; leaving the
    iteration closes ``groups_of``'s at once."""

    def flat(*args: P.args, **kwargs: P.kwargs) -> Generator[T, None, None]:
        groups = groups_of(*args, **kwargs)
        with closing(groups):
            for group in groups:
                yield from group

    return flat


run_cities = one_at_a_time(run_city_groups)
""":func:`run_city_groups`, one outcome at a time."""


def _end_grace(db: SyncDatabase, batch_id: str) -> None:
    """Ends this process's grace of the batch (a stopped or failed run); never raises."""
    try:
        end_grace(db, batch_id, make_worker_id())
    except Exception as err:  # it expires on its own
        log.warning("could not end the grace of batch %s: %s", batch_id, err)


SyncOne = Callable[..., CityOutcome]
"""Syncs one city: ``(city, *, wait_if_held, helped=False) -> CityOutcome``."""


class _Guard:
    """A run's cities through ``sync``: the CITY_FAILED ticket of each city that failed and,
    once the supplier refused the API key, its cities not started failed without a request
    (a revoked key is not tried on every city)."""

    def __init__(
        self,
        db: SyncDatabase,
        plan: RunPlan,
        request: RunRequest,
        settings: SyncSettings,
        sync: SyncOne,
    ) -> None:
        self.db, self.plan, self.request, self.settings = db, plan, request, settings
        self._sync = sync
        self._lock = threading.Lock()
        # The city whose request the supplier refused the API key first.
        self.refused: str | None = None

    def sync(self, city: str, *, wait_if_held: bool, helped: bool = False) -> CityOutcome:
        """Syncs ``city``, or fails it unstarted once the supplier refused the API key."""
        if self.refused is not None:
            return self._not_started(city, helped)
        outcome = self._sync(city, wait_if_held=wait_if_held, helped=helped)
        report = outcome.report
        if report.status == "FAILED":
            if not self.request.replay:
                self._ticket(city, report.error or "")
            if report.error_code in AUTH_REJECTED_CODES:
                self._refuse(city)
        return outcome

    def _ticket(self, city: str, error: str) -> None:
        file_city_failure(self.db, self.plan.batch.batch_id, self.settings, city, error)

    def _refuse(self, city: str) -> None:
        """The first refusal fails every city of the run not started yet, in one move."""
        with self._lock:
            if self.refused is not None:
                return
            self.refused = city
        error = (
            f"{SupplierAuthError.error_code}: not started: the supplier refused the API key "
            f"on city {city!r}"
        )
        refuse_run(self.db, self.plan.batch, self.plan.cities, error, self.settings)

    def _not_started(self, city: str, helped: bool) -> CityOutcome:
        """A city met once the supplier refused the API key, as the sync database says."""
        batch_id = self.plan.batch.batch_id
        code = SupplierAuthError.error_code
        error = f"{code}: not started: the supplier refused the API key on city {self.refused!r}"
        if fail_unstarted(self.db, batch_id, error, shard_keys=[city]):  # another run's city
            self._ticket(city, error)
        else:
            shard = get_shard(self.db, batch_id, city)
            if shard.status == "SUCCESS":  # finished meanwhile
                return CityOutcome(published_report(self.db, batch_id, city), helped)
            error = shard.error_message or error
        return CityOutcome(CityReport(city, status="FAILED", error=error, error_code=code), helped)


def _run(
    db: SyncDatabase,
    guard: _Guard,
    plan: RunPlan,
    request: RunRequest,
    threads: int,
    stop: Stop,
) -> Iterator[list[CityOutcome]]:
    """The run's cities through ``guard``, ``threads`` at once: own, held, then helping;
    in groups of the outcomes that finished meanwhile."""
    held: list[str] = []
    own = in_flight_groups(
        plan.cities, lambda c: guard.sync(c, wait_if_held=False), threads, stop, background=True
    )
    for group in own:
        held.extend(o.city_code for o in group if o.status == "HELD_BY_OTHER")
        if reported := [o for o in group if o.status != "HELD_BY_OTHER"]:
            yield reported
    yield from in_flight_groups(
        held, lambda c: guard.sync(c, wait_if_held=True), threads, stop, background=True
    )
    if request.help_other_runs and not request.replay and guard.refused is None:
        helped: list[CityOutcome] = []

        def help_one(city: str) -> CityReport:
            outcome = guard.sync(city, wait_if_held=False, helped=True)
            if outcome.status == "FAILED":
                # Left to its owner, which resumes it; help_other_workers goes on.
                raise RuntimeError(outcome.report.error)
            if outcome.status not in ("HELD_BY_OTHER", "ALREADY_DONE"):
                helped.append(outcome)
            return outcome.report

        help_other_workers(
            db,
            plan.batch.batch_id,
            skip=set(request.cities),
            sync_one=help_one,
            threads=threads,
            hotel_counts=plan.sizes,
            stop=stop,
        )
        if helped:
            yield helped


# Cities handed to the worker processes beyond one each (see run_cities).
QUEUED_AHEAD = 1

# The worker of this process, when it is a worker process of a run (set at its start).
_process_worker: _CityWorker | None = None


class _ProcessPool:
    """A run's worker processes: forked, each with its own connections, one city each; they
    stop with the run's stop (a shared event each of them watches).

    A worker that dies (OOM, a signal) breaks Python's pool: every city in flight or queued
    there fails with it. On a server database the pool is replaced (at most
    ``MAX_POOL_RESTARTS`` times a run): the city whose lease the dead worker held fails, and
    every other city goes to the new pool once, waiting for its lease when a worker of the
    old pool still holds it. On SQLite they fail, and the next run resumes them: a process
    forked while another of its threads is inside SQLite inherits SQLite's record of that
    thread's file locks, and its own connections then wait for them for ever. Workers that
    cannot start (their connections) stop the run with :class:`WorkerStartFailed`.
    """

    def __init__(
        self,
        db: SyncDatabase,
        processes: WorkerProcesses,
        plan: RunPlan,
        request: RunRequest,
        settings: SyncSettings,
        stop: Stop,
    ) -> None:
        self.db, self.batch_id, self.stop = db, plan.batch.batch_id, stop
        shared = multiprocessing.get_context("fork").Event()
        stop.on_set(shared.set)
        # Forked with the run's rate limiter; they never touch this process's connections:
        # open_io opens their own. A worker whose run's process was killed stops too: its
        # city's lease then expires and the next run resumes the city from its checkpoint.
        self._start = lambda: ForkPool(
            processes.count,
            _start_worker,
            (processes.open_io, plan, request, settings, shared),
            exit_with_parent=True,
        )
        self._pool = self._start()
        self._broken: list[ForkPool] = []
        self._restarts = 0 if db.engine.dialect.name == "sqlite" else MAX_POOL_RESTARTS
        self._lock = threading.Lock()

    def __enter__(self) -> _ProcessPool:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not isinstance(exc, Exception):
            # The workers' cities stop at their next page: closing waits for them.
            self.stop.set(reason_of(exc))
        for pool in [*self._broken, self._pool]:
            pool.close()

    def sync(self, city: str, *, wait_if_held: bool, helped: bool = False) -> CityOutcome:
        """Syncs ``city`` in a worker process; a worker that died while it held the city's
        lease makes it FAILED.

        Raises:
            WorkerStartFailed: A worker process could not start.
        """
        started = time.perf_counter()
        for attempt in range(2):
            pool = self._pool
            try:
                return pool.submit(_sync_in_worker, city, wait_if_held, helped).result()
            except BrokenProcessPool as err:
                failure: Exception = err
                if (why := pool.start_error()) is not None:
                    error = WorkerStartFailed(f"the run's worker processes could not start: {why}")
                    self.stop.set(str(error))
                    raise error from err
                if attempt or not self._replace(pool, city):
                    break
                # Its lease may still be held by a worker of the broken pool, which goes on.
                wait_if_held = True
            except Exception as err:  # the call or its outcome could not be sent
                failure = err
                break
        report = CityReport(city)
        report.fail(failure, f"{INTERNAL_ERROR}: worker process died: {failure}")
        log.debug("city %r failed: %s", city, report.error)
        return CityOutcome(report, helped, seconds=time.perf_counter() - started)

    def _replace(self, broken: ForkPool, city: str) -> bool:
        """Whether ``city`` goes to a new pool in place of ``broken`` (started once, by the
        city that asks first): not when the city's lease was held by a worker that is gone
        (it killed its worker, or died with it), nor once the run has replaced its pool
        ``MAX_POOL_RESTARTS`` times (never on SQLite)."""
        # One at a time, and the new pool forked here: no thread of this pool is inside a
        # database driver (SQLite's locks) while this process forks.
        with self._lock:
            if not self._restarts or self._died_holding(city):
                return False
            if self._pool is not broken:
                return True
            if len(self._broken) >= self._restarts:
                return False
            log.warning("a worker process of the run died: its pool is replaced")
            # Its workers still running finish their cities; closed at the run's end.
            broken.close(wait=False)
            self._broken.append(broken)
            self._pool = self._start()
            self._pool.start()
            return True

    def _died_holding(self, city: str) -> bool:
        """True when the city's shard is held by a process of this host that is gone."""
        try:
            shard = get_shard(self.db, self.batch_id, city)
        except Exception as err:  # the city fails as it would have without the new pool
            log.warning("could not read city %r after its worker died: %s", city, err)
            return True
        return shard.status == "RUNNING" and holder_is_dead_here(shard.worker_id or "")


# How many times a run replaces its worker pool after a worker died; beyond that, its cities
# fail (the next run resumes them).
MAX_POOL_RESTARTS = 10


def _start_worker(
    open_io: Callable[[], AbstractContextManager[WorkerIO]],
    plan: RunPlan,
    request: RunRequest,
    settings: SyncSettings,
    shared: SharedEvent,
) -> None:
    """A worker process's start: its own connections, worker id and stop (following its
    run's), kept until it ends."""
    global _process_worker
    stack = ExitStack()
    io = stack.enter_context(open_io())
    # Never closed: the process ends with its pool, and its connections with it.
    _open_stacks.append(stack)
    stop = Stop()
    stop.watch(shared)
    worker_id = make_worker_id("supplier-sync")
    _process_worker = _CityWorker(io, plan, request, settings, worker_id, stop)
    prepare_process()


_open_stacks: list[ExitStack] = []


def _sync_in_worker(city: str, wait_if_held: bool, helped: bool) -> CityOutcome:
    if _process_worker is None:  # pragma: no cover - only a worker process calls this
        raise RuntimeError("not a worker process of a run")
    return _process_worker.sync(city, wait_if_held=wait_if_held, helped=helped)


def published_report(db: SyncDatabase, batch_id: str, city: str) -> CityReport:
    """A city that an earlier run of the batch published, as the sync database records it.

    Its status is ALREADY_DONE and every stage is done; counts and pages come from the
    shard, diffs from the diff log (the dead letters' codes are not broken down per city).
    """
    shard = get_shard(db, batch_id, city)
    d = schema.diff_log.c
    where = (d.batch_id == batch_id, d.shard_key == city)
    with db.engine.connect() as conn:
        diffs = conn.execute(
            sa.select(d.diff_type, d.action, sa.func.count())
            .where(*where)
            .group_by(d.diff_type, d.action)
        ).all()
    report = CityReport(
        city,
        status="ALREADY_DONE",
        pages_fetched=shard.pages_done,
        records=shard.total_count,
        published=shard.success_count,
        dead_letters=shard.failed_count,
        skipped=shard.skipped_count,
        stages_done=["fetch", "normalize", "publish"],
    )
    for diff_type, action, n in diffs:
        report.diffs_by_type[diff_type] += int(n)
        report.diffs_by_action[action] += int(n)
    return report


def published_earlier(db: SyncDatabase, batch_id: str, cities: Sequence[str]) -> list[CityOutcome]:
    """The cities of ``cities`` that an earlier run of the batch published, as outcomes.

    A run that continues a batch (a resume with the same trigger, a re-execution, a
    backfill re-run, a run that adopts a dead run's batch) plans every one of its cities'
    partitions: each city the batch published already is reported as such, first, so that
    its partition stays materialized whatever happens to the rest of the run.

    Args:
        db: The sync database.
        batch_id: The run's batch.
        cities: The run's cities.

    Returns:
        One ALREADY_DONE outcome per city whose shard is SUCCESS (:func:`published_report`),
        in the order of ``cities``, each once.
    """
    s = schema.shard.c
    with db.engine.connect() as conn:
        done = set(
            conn.execute(
                sa.select(s.shard_key).where(s.batch_id == batch_id, s.status == "SUCCESS")
            ).scalars()
        )
    return [
        CityOutcome(published_report(db, batch_id, city))
        for city in dict.fromkeys(cities)
        if city in done
    ]


def take_published_earlier(db: SyncDatabase, plan: RunPlan) -> list[CityOutcome]:
    """The plan's cities an earlier run of its batch published (:func:`published_earlier`),
    taken out of ``plan.cities``: the run reports them and syncs only the others."""
    earlier = published_earlier(db, plan.batch.batch_id, plan.cities)
    codes = {o.city_code for o in earlier}
    plan.cities = [c for c in plan.cities if c not in codes]
    return earlier


def in_flight_groups(
    items: Iterable[T],
    fn: Callable[[T], R],
    threads: int,
    stop: Stop | None = None,
    *,
    background: bool = False,
) -> Generator[list[R], None, None]:
    """``fn`` over ``items`` with ``threads`` calls in flight; yields results as they
    finish, each with the others that finished while the iteration was away.

    Items start in order. With one thread, the calls run on the iterating thread, unless
    ``background``: then on a thread of their own, so that the next call starts while the
    iteration works on a result (a Dagster step storing a city's events). ``fn`` should
    not raise (an exception ends the iteration after the calls in flight finish). Leaving the iteration early cancels the calls not started;
    an interruption (KeyboardInterrupt, a Dagster termination, the iteration closed) also
    sets ``stop``, so that the calls in flight end at their next page instead of their end.
    """
    if threads <= 1 and not background:
        for item in items:
            yield [fn(item)]
        return
    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="city")
    # Each call hands its future over as it finishes: waiting on every pending future at
    # once, per result, would cost a run of many cities quadratic time.
    finished: queue.Queue[Future[R]] = queue.Queue()
    try:
        futures = [pool.submit(fn, item) for item in items]
        for future in futures:
            future.add_done_callback(finished.put)
        left = len(futures)
        while left:
            group = [finished.get()]
            while len(group) < left and not finished.empty():
                group.append(finished.get())
            left -= len(group)
            yield [future.result() for future in group]
    except BaseException as err:
        if stop is not None and not isinstance(err, Exception):
            stop.set(reason_of(err))
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


in_flight = one_at_a_time(in_flight_groups)
""":func:`in_flight_groups`, one result at a time."""


def not_done(outcomes: Iterable[CityOutcome]) -> Mapping[str, list[CityOutcome]]:
    """The outcomes of cities that did not publish, by status (FAILED, GATED, LEASE_LOST)."""
    by_status: dict[str, list[CityOutcome]] = {}
    for o in outcomes:
        if not o.done:
            by_status.setdefault(o.status, []).append(o)
    return by_status
