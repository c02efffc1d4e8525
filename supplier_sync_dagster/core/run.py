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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TypeVar

import sqlalchemy as sa

from supplier_sync_dagster.core import schema
from supplier_sync_dagster.core.batches import (
    Batch,
    TaskSpec,
    TriggerSource,
    add_shards,
    create_batch,
    get_batch,
)
from supplier_sync_dagster.core.db import SyncDatabase
from supplier_sync_dagster.core.errors import TriggerSkipped
from supplier_sync_dagster.core.gates import GateResult, gate_for_pipeline
from supplier_sync_dagster.core.leases import get_shard
from supplier_sync_dagster.core.payloads import PayloadStore
from supplier_sync_dagster.core.pipeline import (
    CityReport,
    SyncSettings,
    help_other_workers,
    largest_first,
    sync_city,
)
from supplier_sync_dagster.core.replay import (
    prepare_replay,
    record_city_list,
    resolve_replayed_dead_letters,
    stored_city_countries,
)
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.tasks import ensure_task, require_enabled

log = logging.getLogger(__name__)

HELD_POLL_SECONDS = 2.0
DONE_STATUSES = ("SUCCESS", "ALREADY_DONE")

T = TypeVar("T")
R = TypeVar("R")


def resolve_batch(
    db: SyncDatabase,
    *,
    task_code: str,
    supplier_id: int,
    trigger_id: str,
    source: TriggerSource,
    cities: Sequence[str],
) -> Batch:
    """The batch of this trigger (created once, or adopted), with a shard per city of the run.

    The run creates its task if it is missing and never changes it: policy, status, cron
    and thresholds are the operator's (``supplier-sync task set``).

    Raises:
        TaskDisabled: The task is DISABLED.
        TriggerSkipped: The task's concurrency policy skipped this trigger.
    """
    ensure_task(
        db,
        TaskSpec(task_code=task_code, supplier_id=supplier_id),
        created_by=f"run {trigger_id}"[:64],
        reason="created by its first run, with the default settings",
    )
    with db.engine.connect() as conn:
        require_enabled(conn, task_code)
    decision = create_batch(db, task_code=task_code, trigger_id=trigger_id, trigger_source=source)
    if decision.batch is None:
        raise TriggerSkipped(
            f"sync skipped: {decision.reason}", blocking_batch_id=decision.blocking_batch_id
        )
    add_shards(db, decision.batch.batch_id, list(cities))
    with db.engine.connect() as conn:
        return get_batch(conn, decision.batch.batch_id)


@dataclass(frozen=True)
class RunRequest:
    """What a run was asked to do.

    Attributes:
        trigger_id: The batch's idempotency key (a backfill id, a CLI trigger, a run id).
        source: Where the trigger came from.
        cities: The run's cities (supplier codes, verbatim).
        replay: Normalize and publish the cities' stored raw pages again, in a replay batch,
            without calling the supplier.
        threads: Cities in flight at once.
        help_other_runs: Once its cities are done, sync cities of the batch that no run
            has started.
    """

    trigger_id: str
    source: TriggerSource
    cities: Sequence[str]
    replay: bool = False
    threads: int = 1
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
    """

    report: CityReport
    helped: bool = False
    resolved_dead_letters: int = 0
    seconds: float = 0.0

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
    )
    plan = RunPlan(batch=batch, cities=cities)
    if client is None:
        return plan
    try:
        fetched = client.list_cities()
    except Exception as err:  # the country rule is skipped, the sync is not
        plan.notes.append(f"city list unavailable, country rule skipped: {err}")
        return plan
    record_city_list(
        db, store, batch_id=batch.batch_id, supplier_id=settings.supplier_id, raw=fetched.raw
    )
    listed = fetched.data.cities
    plan.countries = {c.city_code: c.country_code for c in listed if c.country_code}
    plan.sizes = {c.city_code: c.hotel_count for c in listed if c.hotel_count is not None}
    plan.cities = largest_first(cities, plan.sizes)
    return plan


def run_cities(
    db: SyncDatabase,
    store: PayloadStore,
    client: SupplierClient | None,
    plan: RunPlan,
    request: RunRequest,
    settings: SyncSettings,
    *,
    worker_id: str,
) -> Iterator[CityOutcome]:
    """Syncs the plan's cities (then helps other runs of the batch); yields each city's
    outcome as it finishes.

    A city that raises is yielded as FAILED (its shard is FAILED and resumable); the other
    cities go on. A city another worker holds is waited for after the others, and yielded
    once this run has synced it or seen it finished.

    Args:
        db: The sync database.
        store: The payload store.
        client: The supplier client; None for a replay.
        plan: From :func:`plan_run`.
        request: What the run was asked to do.
        settings: The task and tuning settings.
        worker_id: This worker's id (one per run).
    """
    gate = gate_for_pipeline()
    batch = plan.batch

    def one(city: str, *, wait_if_held: bool, helped: bool = False) -> CityOutcome:
        started = time.perf_counter()
        report = CityReport(city)
        try:
            while True:
                report = CityReport(city)
                sync_city(
                    db,
                    store,
                    client,
                    batch=batch,
                    city_code=city,
                    worker_id=worker_id,
                    settings=settings,
                    gate=gate,
                    fetch=not request.replay,
                    city_countries=plan.countries,
                    report=report,
                )
                if report.status != "HELD_BY_OTHER" or not wait_if_held:
                    break
                # Another run of the batch is syncing it (it helped out, or raced): wait
                # for its lease to end, then take the outcome or resume.
                time.sleep(HELD_POLL_SECONDS)
        except Exception as err:  # reported as the city's outcome; the others go on
            report.status, report.error = "FAILED", f"{type(err).__name__}: {err}"
            log.warning("city %r failed: %s", city, report.error)
        if report.status == "ALREADY_DONE":
            report = published_report(db, batch.batch_id, city)
        outcome = CityOutcome(report, helped, seconds=time.perf_counter() - started)
        if request.replay and report.status == "SUCCESS":
            outcome.resolved_dead_letters = resolve_replayed_dead_letters(
                db,
                source_batch_id=plan.sources[city],
                replay_batch_id=batch.batch_id,
                city_code=city,
            )
        return outcome

    held: list[str] = []
    for outcome in in_flight(plan.cities, lambda c: one(c, wait_if_held=False), request.threads):
        if outcome.status == "HELD_BY_OTHER":
            held.append(outcome.city_code)
        else:
            yield outcome
    yield from in_flight(held, lambda c: one(c, wait_if_held=True), request.threads)
    if request.help_other_runs and not request.replay:
        helped: list[CityOutcome] = []

        def help_one(city: str) -> CityReport:
            outcome = one(city, wait_if_held=False, helped=True)
            if outcome.status == "FAILED":
                # Left to its owner, which resumes it; help_other_workers goes on.
                raise RuntimeError(outcome.report.error)
            if outcome.status not in ("HELD_BY_OTHER", "ALREADY_DONE"):
                helped.append(outcome)
            return outcome.report

        help_other_workers(
            db,
            batch.batch_id,
            skip=set(request.cities),
            sync_one=help_one,
            threads=request.threads,
            hotel_counts=plan.sizes,
        )
        yield from helped


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


def in_flight(items: Iterable[T], fn: Callable[[T], R], threads: int) -> Iterator[R]:
    """``fn`` over ``items`` with ``threads`` calls in flight; yields results as they finish.

    Items start in order. ``fn`` should not raise (an exception ends the iteration after
    the calls in flight finish). Leaving the iteration early cancels the calls not started.
    """
    if threads <= 1:
        for item in items:
            yield fn(item)
        return
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="city")
    try:
        pending: set[Future[R]] = {pool.submit(fn, item) for item in items}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                yield future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def not_done(outcomes: Iterable[CityOutcome]) -> Mapping[str, list[CityOutcome]]:
    """The outcomes of cities that did not publish, by status (FAILED, GATED, LEASE_LOST)."""
    by_status: dict[str, list[CityOutcome]] = {}
    for o in outcomes:
        if not o.done:
            by_status.setdefault(o.status, []).append(o)
    return by_status
