"""What starts a run and how the run knows its batch: run tags, the trigger of a run, the run
requests, jobs and schedules that the definitions share, and a run's sync work for its trigger.

The batch is the run's trigger: an explicit ``supplier_sync/trigger_id`` tag (CLI, schedules,
sensors), else the backfill id (a re-executed backfill's root backfill id), else a re-executed
run's original run's trigger, else the run id (:func:`trigger_of`).
"""

import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import dagster as dg

from supplier_sync_dagster.core.errors import (
    NoBaseline,
    SupplierSyncError,
    TaskDisabled,
    TriggerSkipped,
)
from supplier_sync_dagster.core.leasing.batches import TriggerSource
from supplier_sync_dagster.core.leasing.leases import make_worker_id
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import PayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync.model import SyncSettings
from supplier_sync_dagster.dagster_instance.run_launcher import HOUSEKEEPING_TAGS
from supplier_sync_dagster.defs.accounts import AccountScope
from supplier_sync_dagster.defs.resources import SyncDatabaseResource, SyncResources

TRIGGER_TAG = "supplier_sync/trigger_id"
SOURCE_TAG = "supplier_sync/trigger_source"
TASK_TAG = "supplier_sync/task"
ROOT_BACKFILL_TAG = "dagster/root_backfill_id"
BACKFILL_TAG = "dagster/backfill"

_SOURCES: tuple[TriggerSource, ...] = ("CRON", "MANUAL", "COMPENSATION", "SENSOR", "BACKFILL")
# How a task refuses a trigger: disabled, its concurrency policy, nothing to start from.
REFUSALS = (NoBaseline, TaskDisabled, TriggerSkipped)
# A run of these has not finished: a schedule that runs one job at a time waits for it.
ACTIVE_STATUSES = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def trigger_of(
    tags: Mapping[str, str],
    run_id: str,
    *,
    root: tuple[Mapping[str, str], str] | None = None,
) -> tuple[str, TriggerSource]:
    """The batch trigger of a run: (trigger id, trigger source).

    Args:
        tags: The run's tags.
        run_id: The run's id.
        root: For a re-execution, the original (root) run's tags and id: a re-execution
            continues the batch of its original, whose backfill tags Dagster drops when the
            backfill has ended.
    """
    if tags.get(TRIGGER_TAG):
        source = tags.get(SOURCE_TAG, "MANUAL")
        return tags[TRIGGER_TAG], next((s for s in _SOURCES if s == source), "MANUAL")
    backfill = tags.get(ROOT_BACKFILL_TAG) or tags.get(BACKFILL_TAG)
    if backfill:
        return backfill, "BACKFILL"
    if root is not None:
        return trigger_of(root[0], root[1])
    if tags.get("dagster/schedule_name"):
        return run_id, "CRON"
    if tags.get("dagster/sensor_name"):
        return run_id, "SENSOR"
    return run_id, "MANUAL"


def refused(what: str | None, err: SupplierSyncError) -> dg.Failure:
    """The run's failure when its task refused the trigger (disabled, its concurrency policy,
    no baseline): no retry, which would be refused again; the batch that blocked it, if any.

    Args:
        what: What did not run, before the reason (None: the reason alone).
        err: The refusal.
    """
    return dg.Failure(
        description=f"{what}: {err}" if what else str(err),
        metadata={"blocking_batch_id": getattr(err, "blocking_batch_id", "") or ""},
        allow_retries=False,
    )


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class SyncWork(Protocol[T_co]):
    """A core entry point that does one run's sync work for a trigger (``compensate``,
    ``run_incremental``), its own settings bound."""

    def __call__(
        self,
        db: SyncDatabase,
        store: PayloadStore,
        client: SupplierClient,
        *,
        settings: SyncSettings,
        trigger_id: str,
        source: TriggerSource,
        worker_id: str,
    ) -> T_co: ...


def run_sync_work(
    context: dg.AssetExecutionContext,
    resources: SyncResources,
    work: SyncWork[T],
    what: str,
) -> tuple[T, int]:
    """Runs ``work`` for the run's trigger, with the run's settings, database, payload store
    and supplier client.

    Args:
        context: The asset's execution (its run's tags and id are the trigger).
        resources: The account's resources.
        work: What to run.
        what: What did not run, should the task refuse the trigger (:func:`refused`).

    Returns:
        What ``work`` returned, and the supplier requests it made.

    Raises:
        dg.Failure: The task refused the trigger (:data:`REFUSALS`); no retry.
    """
    trigger_id, source = trigger_of(context.run.tags, context.run.run_id)
    settings = resources.settings()
    store = resources.payloads.open()
    with resources.sync_db.opened() as db, resources.supplier.client() as client:
        try:
            out = work(
                db,
                store,
                client,
                settings=settings,
                trigger_id=trigger_id,
                source=source,
                worker_id=make_worker_id("supplier-sync"),
            )
        except REFUSALS as err:
            raise refused(what, err) from None
        return out, client.stats().requests


def active_run(instance: dg.DagsterInstance, job_name: str) -> dg.DagsterRun | None:
    """A run of the job that is queued or running, if any."""
    runs = instance.get_runs(
        filters=dg.RunsFilter(job_name=job_name, statuses=ACTIVE_STATUSES), limit=1
    )
    return runs[0] if runs else None


def scheduled_run(
    context: dg.ScheduleEvaluationContext,
    prefix: str,
    source: TriggerSource,
    tags: Mapping[str, str],
) -> dg.RunRequest:
    """A schedule's run request whose trigger is its tick time: a tick evaluated again asks
    for the same run (its run key) and the same batch (its trigger).

    Args:
        context: The schedule's evaluation.
        prefix: What the trigger id starts with (``nightly``, ``incremental``...).
        source: The trigger source recorded on the batch.
        tags: Further run tags (the account's, the task's, a partition range).
    """
    fired = (
        context.scheduled_execution_time.isoformat() if context.scheduled_execution_time else "now"
    )
    trigger = f"{prefix}:{fired}"[:64]
    return dg.RunRequest(run_key=trigger, tags={**tags, TRIGGER_TAG: trigger, SOURCE_TAG: source})


def account_job(
    name: str,
    asset: dg.AssetKey,
    description: str,
    task: Callable[[AccountScope], str] | None = None,
    *,
    housekeeping: bool = False,
) -> Callable[[AccountScope], Any]:
    """The builder of an account's job that materializes its own ``asset``, one job per
    account: named ``name`` in the account's namespace, with the account's run tags.

    Args:
        name: The job's name (the default account's).
        asset: The asset it materializes (the default account's key).
        description: What the job does, for the UI.
        task: The account's task its runs are tagged with (one run per task at a time).
        housekeeping: Its runs are housekeeping (``HOUSEKEEPING_TAGS``), not a sync.
    """

    @functools.cache
    def build(scope: AccountScope) -> Any:
        tags = {} if task is None else {TASK_TAG: task(scope)}
        if housekeeping:
            tags.update(HOUSEKEEPING_TAGS)
        return dg.define_asset_job(
            scope.name(name),
            selection=dg.AssetSelection.assets(scope.key(asset.path[-1])),
            tags={**tags, **scope.tags},
            description=description,
        )

    return build


# An account's housekeeping job (:func:`account_job`): its runs are tagged as such.
housekeeping_job = functools.partial(account_job, housekeeping=True)


def scheduled_asset_job(
    asset: Any, name: str, description: str, *, schedule: str, cron: str, when: str
) -> tuple[Any, dg.ScheduleDefinition]:
    """A housekeeping job (``HOUSEKEEPING_TAGS``) that materializes ``asset``, and its
    schedule (:func:`every`).

    Args:
        asset: The asset (its definition or key).
        name: The job's name.
        description: What the job does, for the UI.
        schedule: The schedule's name.
        cron: When (UTC).
        when: What the schedule does, for the UI.
    """
    job = dg.define_asset_job(
        name,
        selection=dg.AssetSelection.assets(asset),
        description=description,
        tags=HOUSEKEEPING_TAGS,
    )
    return job, every(job, schedule, cron, when)


def every(
    job: Any,
    name: str,
    cron: str,
    description: str,
    evaluate: Callable[..., dg.RunRequest | dg.SkipReason] | None = None,
    *,
    status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.RUNNING,
) -> dg.ScheduleDefinition:
    """A schedule that runs ``job`` on ``cron`` (UTC), by default on as soon as the daemon runs.

    Args:
        job: The job it runs.
        name: The schedule's name.
        cron: When (UTC).
        description: What it does, for the UI.
        evaluate: What each tick requests (a run or a skip), its resources named by its
            parameters; None: a run of ``job``.
        status: Whether it runs before anyone turns it on.
    """
    options: dict[str, Any] = {
        "name": name,
        "job": job,
        "cron_schedule": cron,
        "execution_timezone": "UTC",
        "default_status": status,
        "description": description,
    }
    if evaluate is None:
        return dg.ScheduleDefinition(**options)
    return dg.schedule(**options)(evaluate)


def one_at_a_time(
    job: Any,
    name: str,
    cron: str,
    description: str,
    *,
    not_yet: Callable[[SyncDatabase], str | None],
    busy: str,
    trigger: str,
    source: TriggerSource,
    tags: Mapping[str, str],
) -> dg.ScheduleDefinition:
    """A schedule that runs ``job`` on ``cron`` (UTC), one run at a time: a tick is skipped
    while the sync database says why not yet, or while a run of the job is queued or running;
    else it requests the run of its tick (:func:`scheduled_run`).

    Args:
        job: The job it runs.
        name: The schedule's name.
        cron: When (UTC).
        description: What it does, for the UI.
        not_yet: Why a tick has nothing to run, read from the sync database (None: it has).
        busy: The skip reason's words after the active run's id.
        trigger: What the trigger id starts with.
        source: The trigger source recorded on the batch.
        tags: Further run tags.
    """

    def evaluate(
        context: dg.ScheduleEvaluationContext, sync_db: SyncDatabaseResource
    ) -> dg.RunRequest | dg.SkipReason:
        with sync_db.opened() as db:
            reason = not_yet(db)
        if reason is not None:
            return dg.SkipReason(reason)
        active = active_run(context.instance, job.name)
        if active is not None:
            return dg.SkipReason(f"run {active.run_id} {busy}")
        return scheduled_run(context, trigger, source, tags)

    return every(job, name, cron, description, evaluate)
