"""The city-partitioned asset graph: raw snapshots → normalized → mappings → diffs → published.

One multi-asset step works every city of its run (a backfill groups cities into runs with
``BackfillPolicy.multi_run``), so that orchestration is a small share of the wall time: a
step per stage and city would cost a process start per step. The run's work is
``core.run`` (batch, order, held cities, helping); as each city finishes, its outcome
becomes Dagster events for that city's partition only (``city_events.py``), and a city that
did not publish fails the step, so that a backfill lists exactly those cities' partitions as
failed and its "re-execute from failure" (or a run's) re-syncs them.

The batch is the run's trigger (``triggers.py``). A re-execution therefore continues its
original batch: cities already published are not synced again, failed cities resume from
their checkpoints, and a gate override recorded for the batch applies. The cities published
earlier in the batch are reported first, on their partitions (``core.sync.run.published_earlier``):
the run planned them, and a planned partition a failed run does not materialize shows failed.

A run terminated from the UI (``DagsterExecutionInterruptedError`` in the step, as SIGTERM or
SIGINT to a ``sync --full``) stops its cities at a page boundary and releases their leases
(``core.sync.stop``); re-executing it resumes them. So does a run marked CANCELING that no
signal reached (the step polls its run's status). A run whose batch was cancelled (a
CANCEL_PREVIOUS trigger) fails its step with who cancelled it, without retries. A supplier
that refuses the API key or cannot be reached fails the step with that cause, and its cities
with it.
"""

import functools
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext

import dagster as dg

from supplier_sync_dagster.core.errors import (
    CityNotFound,
    SupplierError,
    SyncCancelled,
    SyncInterrupted,
    TaskDisabled,
    TriggerSkipped,
    describe_error,
    error_code_of,
)
from supplier_sync_dagster.core.leasing.batches import get_batch, progress_line
from supplier_sync_dagster.core.leasing.leases import make_worker_id
from supplier_sync_dagster.core.records.gates import CHECK_NAMES
from supplier_sync_dagster.core.settings import env_name, load_settings
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync.model import SyncSettings
from supplier_sync_dagster.core.sync.retire import held_line
from supplier_sync_dagster.core.sync.run import (
    CityOutcome,
    RunPlan,
    RunRequest,
    WorkerIO,
    WorkerProcesses,
    auto_processes,
    not_done,
    plan_run,
    refusal_line,
    run_city_groups,
    take_published_earlier,
)
from supplier_sync_dagster.core.sync.stop import Stop, reason_of, stop_on_signals
from supplier_sync_dagster.dagster_instance.events import (
    latest_evaluation,
    one_event_transaction,
    pooled_events,
    stored_target,
)
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE, AccountScope, per_account
from supplier_sync_dagster.defs.city_events import (
    city_checks,
    city_materializations,
    latest_target,
)
from supplier_sync_dagster.defs.city_keys import (
    DIFFS,
    FRESHNESS_CHECK,
    MAPPINGS,
    NORMALIZED,
    PUBLISHED,
    RAW,
)
from supplier_sync_dagster.defs.city_retirement import retire_unlisted
from supplier_sync_dagster.defs.partitions import decode_city_key
from supplier_sync_dagster.defs.resources import SupplierResource, SyncResources
from supplier_sync_dagster.defs.triggers import refused, trigger_of

# The chain in order: each asset depends on the one before it.
_DESCRIPTIONS = {
    RAW: (
        "Each supplier page's exact bytes, gzip in the payload store, with a RAW "
        "supplier_sync_snapshot row (sha256, ref); the shard checkpoint advances per page."
    ),
    NORMALIZED: (
        "Supplier records turned into the platform model (trimmed text, ISO country and "
        "currency, E.164 phone, Decimal money); NORMALIZED snapshots; every record that "
        "cannot be parsed or is out of its domain becomes a dead letter with a precise code."
    ),
    MAPPINGS: (
        "(supplier, hotel) → platform resource id and (hotel, room, rate plan) → offer id, "
        "allocated once by unique keys."
    ),
    DIFFS: (
        "Field-level diffs against the published hotels, with risk and action "
        "(supplier_sync_diff_log)."
    ),
    PUBLISHED: (
        "Platform hotels and offers, version-guarded (an older supplier version never "
        "overwrites a newer), with outbox events in the same transaction."
    ),
}


def _specs(scope: AccountScope) -> list[dg.AssetSpec]:
    # Built in a function: the defs loader collects module-level AssetSpecs as assets.
    keys = [scope.key(plain.path[-1]) for plain in _DESCRIPTIONS]
    return [
        dg.AssetSpec(
            key,
            deps=keys[i - 1 : i],
            group_name=scope.group,
            skippable=True,
            description=description,
        )
        for i, (key, description) in enumerate(zip(keys, _DESCRIPTIONS.values(), strict=True))
    ]


_CHECK_DESCRIPTIONS = {
    "bad_record_ratio": (
        "Blocking gate: the share of a city's records that became dead letters stays under "
        "the task's threshold; a city over it publishes nothing until an operator overrides."
    ),
    "record_count": (
        "Blocking gate: a city's record count does not drop beyond the task's threshold "
        "against its previous successful batch, and never falls to zero from some."
    ),
    "schema_drift": (
        "Blocking gate: no top-level field of the supplier's records appears or disappears "
        "against the previous successful batch (e.g. geo renamed to location)."
    ),
}


def _check_specs(scope: AccountScope) -> list[dg.AssetCheckSpec]:
    with warnings.catch_warnings():
        # Partitioned checks are a preview in Dagster 1.13; they are what shows a gate's
        # result on the city it judged.
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return [
            *(
                dg.AssetCheckSpec(
                    name,
                    asset=scope.key(NORMALIZED.path[-1]),
                    blocking=True,
                    description=_CHECK_DESCRIPTIONS[name],
                    partitions_def=scope.partitions,
                )
                for name in CHECK_NAMES
            ),
            # Judged for every city by the sync_health asset (defs/health.py), not here: a
            # city's freshness is about the syncs that did not happen.
            dg.AssetCheckSpec(
                FRESHNESS_CHECK,
                asset=scope.key(PUBLISHED.path[-1]),
                description="The city was synced successfully within the task's freshness "
                "SLA (alert threshold freshness_sla_hours); reported by sync_health.",
                partitions_def=scope.partitions,
            ),
        ]


def _root_of(context: dg.AssetExecutionContext) -> tuple[Mapping[str, str], str] | None:
    run = context.run
    if not run.root_run_id or run.root_run_id == run.run_id:
        return None
    root = context.instance.get_run_by_id(run.root_run_id)
    return (dict(root.tags), root.run_id) if root is not None else None


# A backfill's cities per run. A run spreads its cities over one worker process per core,
# so more runs at once would only share the same cores; the cap keeps one run's plan bounded.
BACKFILL_CITIES_PER_RUN = 1000


@functools.cache
def build_city_sync(
    scope: AccountScope, cities_per_run: int = BACKFILL_CITIES_PER_RUN
) -> dg.AssetsDefinition:
    """The account's city sync: one multi-asset over its five stages and its city partitions
    (a backfill of them runs ``cities_per_run`` cities per run)."""

    @dg.multi_asset(
        specs=_specs(scope),
        check_specs=_check_specs(scope),
        partitions_def=scope.partitions,
        backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=cities_per_run),
        pool=scope.pool,
        name=scope.name("city_sync"),
        can_subset=True,
        required_resource_keys=SyncResources.keys(scope),
        description=(
            "Syncs the run's cities from the supplier to the platform catalog, stage by stage; "
            "each city's partitions are marked with that city's own outcome. Materializing "
            "normalized_hotels and downstream without raw_hotel_snapshots replays each city's "
            "latest stored raw pages without calling the supplier."
        ),
    )
    def city_sync(
        context: dg.AssetExecutionContext,
    ) -> Iterator[dg.AssetMaterialization | dg.AssetCheckEvaluation | dg.AssetObservation]:
        # A run worker of a user's plain SQLite instance: the step's events on pooled
        # connections, a city's in one transaction, as on the embedded instance.
        with pooled_events(context.instance):
            yield from _sync_cities(context, scope, SyncResources.of(context, scope))

    return city_sync


def _sync_cities(
    context: dg.AssetExecutionContext, scope: AccountScope, resources: SyncResources
) -> Iterator[dg.AssetMaterialization | dg.AssetCheckEvaluation | dg.AssetObservation]:
    """Claims, fetches, normalizes, gates, maps, diffs and publishes each city of the run."""
    started = time.perf_counter()
    supplier = resources.supplier
    request = _run_request(context, scope, supplier)
    settings = resources.settings()
    db = resources.sync_db.open()
    store = resources.payloads.open()
    outcomes: list[CityOutcome] = []
    stop = Stop()
    # A run terminated while no signal reaches its process (its status CANCELING only).
    end_poll = stop.poll(
        functools.partial(_run_terminated, context), CANCEL_POLL_SECONDS, cancels=False
    )
    try:
        # A replay reads stored pages only: it does not even open a supplier client.
        with (
            stop_on_signals(stop),
            nullcontext(None) if request.replay else supplier.client() as client,
        ):
            try:
                plan = plan_run(db, store, client, request, settings)
            except TaskDisabled as err:
                raise refused("sync refused", err) from None
            except TriggerSkipped as err:
                raise refused(None, err) from None
            except SupplierError as err:
                raise _refused_by_supplier(err, request, scope) from err
            earlier = take_published_earlier(db, plan)
            _log_plan(context, plan, request, earlier)
            progress = _Progress()
            # Reported before any city is synced: whatever stops this run later, the
            # partitions of the cities its batch published already stay materialized.
            outcomes.extend(earlier)
            yield from _report(context, scope, earlier, plan, progress, db)
            processes = auto_processes(request, plan)
            if processes:
                context.log.info(f"syncing the cities in {processes} worker processes")
            requests = 0
            for group in run_city_groups(
                db,
                store,
                client,
                plan,
                request,
                settings,
                worker_id=make_worker_id("supplier-sync"),
                processes=WorkerProcesses(processes, _worker_io(resources, client)),
                stop=stop,
            ):
                requests += sum(o.supplier.requests for o in group) if processes else 0
                outcomes.extend(group)
                yield from _report(context, scope, group, plan, progress, db)
            progress.show(context, db, plan.batch.batch_id, final=True)
            if client is not None and any(o.report.error_code == CITY_GONE for o in outcomes):
                _retire_unlisted(context, scope, db, client, settings, plan.batch.batch_id)
            if client is not None:
                # The worker processes' requests come with their cities' outcomes.
                requests += client.stats().requests
                context.log.info(
                    f"supplier: {requests} requests in {time.perf_counter() - started:.1f} s"
                )
    except SyncCancelled as err:
        # The batch is over: nothing to resume, nothing to retry.
        context.log.warning(f"run cancelled ({err.reason}): its cities in flight stopped")
        raise dg.Failure(description=f"run cancelled: {err.reason}", allow_retries=False) from None
    except BaseException as err:
        if stop.is_set and not isinstance(err, Exception):
            context.log.warning(
                f"run stopped ({stop.reason or reason_of(err)}): its cities in flight stopped "
                "at a page boundary and released their leases; re-execute the run to resume"
            )
        if isinstance(err, SyncInterrupted):
            # The cities saw the signal before this thread did: Dagster's own interruption.
            raise dg.DagsterExecutionInterruptedError() from err
        raise
    finally:
        end_poll()
        db.dispose()
    failure = _not_published(outcomes, plan, request)
    if failure is not None:
        raise failure


CITY_GONE = CityNotFound.error_code


def _retire_unlisted(
    context: dg.AssetExecutionContext,
    scope: AccountScope,
    db: SyncDatabase,
    client: SupplierClient,
    settings: SyncSettings,
    batch_id: str,
) -> None:
    """A city of the run answered 404: the cities the supplier no longer lists retire (their
    partitions leave the active set), so a dropped city fails this run only. Never fails
    the run itself: the next one, or the discovery sensor, tries again."""
    try:
        plan = retire_unlisted(
            context.instance,
            db,
            scope,
            client,
            supplier_id=settings.supplier_id,
            task_code=settings.task_code,
            batch_id=batch_id,
        )
    except Exception as err:  # the run's outcome is its cities'; this is housekeeping
        context.log.warning(f"could not retire the cities no longer listed: {err}")
        return
    if plan.retire:
        context.log.info(f"retired (no longer listed by the supplier): {', '.join(plan.retire)}")
    if plan.held:
        context.log.warning(held_line(plan.held))


# How often a step reads whether its Dagster run was terminated.
CANCEL_POLL_SECONDS = 1.0


def _run_terminated(context: dg.AssetExecutionContext) -> str | None:
    """Why the step's run must stop, when it was terminated (CANCELING or CANCELED) but no
    signal reached this process (a run launched elsewhere, or in process); else None."""
    run = context.instance.get_run_by_id(context.run.run_id)
    if run is None or run.status not in (
        dg.DagsterRunStatus.CANCELING,
        dg.DagsterRunStatus.CANCELED,
    ):
        return None
    return f"Dagster run {context.run.run_id} was terminated"


def _run_request(
    context: dg.AssetExecutionContext, scope: AccountScope, supplier: SupplierResource
) -> RunRequest:
    """The run's cities, trigger and way of working: a replay when the run materializes
    ``normalized_hotels`` without ``raw_hotel_snapshots``."""
    selected = context.selected_asset_keys
    trigger_id, source = trigger_of(context.run.tags, context.run.run_id, root=_root_of(context))
    return RunRequest(
        trigger_id=trigger_id,
        source=source,
        cities=[decode_city_key(k) for k in context.partition_keys],
        replay=scope.key(NORMALIZED.path[-1]) in selected
        and scope.key(RAW.path[-1]) not in selected,
        threads=supplier.city_threads,
        processes=supplier.worker_processes,
        help_other_runs=supplier.help_other_runs,
    )


def _log_plan(
    context: dg.AssetExecutionContext,
    plan: RunPlan,
    request: RunRequest,
    earlier: list[CityOutcome],
) -> None:
    for note in plan.notes:
        context.log.warning(note)
    context.log.info(
        f"batch {plan.batch.batch_id} (trigger {request.trigger_id}, {request.source}"
        f"{', replay' if request.replay else ''}): {len(plan.cities)} cities"
        + (
            f" to sync, {len(earlier)} published earlier in the batch (reported, not synced)"
            if earlier
            else ""
        )
    )


def _report(
    context: dg.AssetExecutionContext,
    scope: AccountScope,
    outcomes: list[CityOutcome],
    plan: RunPlan,
    progress: "_Progress",
    db: SyncDatabase,
) -> Iterator[dg.AssetMaterialization | dg.AssetCheckEvaluation | dg.AssetObservation]:
    """Each city's events, on its partition (and an error line when it did not publish);
    the batch's progress."""
    if not outcomes:
        return
    normalized = scope.key(NORMALIZED.path[-1])
    for start in range(0, len(outcomes), CITIES_PER_EVENT_TRANSACTION):
        group = outcomes[start : start + CITIES_PER_EVENT_TRANSACTION]
        # Dagster stores each event as it is yielded, on this thread: the cities'
        # materializations, check evaluations and error lines are one transaction (on
        # MySQL, the materializations one insert and the checks another).
        with one_event_transaction(context.instance):
            for outcome in group:
                if not outcome.done:
                    _log_failed_city(context, outcome)
                yield from city_materializations(
                    outcome, plan.batch.batch_id, context.selected_asset_keys, scope=scope
                )
            for outcome in group:
                yield from city_checks(
                    outcome,
                    plan.batch.batch_id,
                    context.selected_asset_keys,
                    scope=scope,
                    target=lambda p: latest_target(context.instance, normalized, p),
                    earlier=lambda check, p: latest_evaluation(context.instance, check, p),
                    stored=lambda p: stored_target(context.instance, normalized, p),
                )
    progress.show(context, db, plan.batch.batch_id)


# Cities whose events share one transaction at most (those that finished while the last
# ones were reported): SQLite's write lock on the event log is held no longer than that.
CITIES_PER_EVENT_TRANSACTION = 32


def _not_published(
    outcomes: list[CityOutcome], plan: RunPlan, request: RunRequest
) -> dg.Failure | None:
    """The step's failure when a city of the run did not publish (None: every one did),
    naming the cities by what stopped them."""
    failed = not_done(outcomes)
    unreplayed = plan.missing
    if not failed and not unreplayed:
        return None
    cities = {
        status: {o.city_code: o.report.error or "" for o in group}
        for status, group in failed.items()
    }
    parts = [f"{len(group)} {status}" for status, group in sorted(failed.items())]
    if "LEASE_LOST" in failed:
        # The zombie writer's case: its cities belong to whoever took them over.
        parts.append(
            "the LEASE_LOST ones were taken over by another worker after this run's leases "
            "expired (it was frozen or cut off from the database for longer than the lease), "
            "and this run wrote nothing more of them"
        )
    if unreplayed:
        parts.append(f"{len(unreplayed)} without stored raw pages to replay")
    errors = cities.get("FAILED", {})
    # What stopped them, first: each failed city's code and what happened, a few of them.
    why = "; ".join(f"{city!r}: {error}" for city, error in list(errors.items())[:3])
    more = f"; {len(errors) - 3} more" if len(errors) > 3 else ""
    return dg.Failure(
        description=(
            f"{len(outcomes) - sum(len(g) for g in failed.values())} of "
            f"{len(request.cities)} cities published; not published: {', '.join(parts)}"
            + (f" ({why}{more})" if why else "")
            + ". Re-executing the run (or the backfill from failure) resumes exactly these "
            "cities in the same batch; gated cities publish once their gate is "
            "overridden (supplier-sync gate override)"
        ),
        metadata={
            "batch_id": plan.batch.batch_id,
            "failed_cities": dg.MetadataValue.json(cities.get("FAILED", {})),
            "gated_cities": dg.MetadataValue.json(cities.get("GATED", {})),
            "lease_lost_cities": dg.MetadataValue.json(cities.get("LEASE_LOST", {})),
            "cities_without_raw_pages": dg.MetadataValue.json(unreplayed),
        },
    )


def _refused_by_supplier(
    err: SupplierError, request: RunRequest, scope: AccountScope
) -> dg.Failure:
    """The step's failure when the supplier refused the API key or could not be reached as
    the run read its city list (its cities are FAILED with that cause): no retry, which
    would meet the same refusal."""
    error = describe_error(err)
    headline = refusal_line(error, key_setting=api_key_setting(scope), address=None)
    return dg.Failure(
        description=(
            f"{headline or 'the supplier failed'}: {len(request.cities)} cities not synced "
            f"({error})"
        ),
        metadata={"error_code": error_code_of(err), "error": error},
        allow_retries=False,
    )


def api_key_setting(scope: AccountScope) -> str:
    """The variable that holds the account's API key (what a refused key's message names)."""
    if scope.account is not None and scope.account.api_key_env:
        return scope.account.api_key_env
    return env_name("supplier_api_key")


city_sync = build_city_sync(DEFAULT_SCOPE)


@dg.definitions
def defs() -> dg.Definitions:
    """Every account's city sync (``SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN`` read now)."""
    per_run = load_settings().backfill_cities_per_run or BACKFILL_CITIES_PER_RUN
    return per_account(lambda scope: dg.Definitions(assets=[build_city_sync(scope, per_run)]))


def _worker_io(
    resources: SyncResources, client: SupplierClient | None
) -> Callable[[], AbstractContextManager[WorkerIO]]:
    """What a worker process of the run opens: its own connections, the run's rate limit."""
    limiter = client.rate_limiter if client is not None else None

    @contextmanager
    def open_io() -> Iterator[WorkerIO]:
        db = resources.sync_db.open()
        try:
            with resources.supplier.client(rate_limiter=limiter) as own:
                yield WorkerIO(db, resources.payloads.open(), own)
        finally:
            db.dispose()

    return open_io


def _log_failed_city(context: dg.AssetExecutionContext, outcome: CityOutcome) -> None:
    """What stopped a city, in the run's log. A city that published gets no line: its
    materializations carry the same counts, and a line each would be one more event per
    city to store."""
    r = outcome.report
    context.log.error(
        f"city {r.city_code!r}: {r.status}, {r.records} records, "
        f"{r.published} published, {r.dead_letters} dead letters"
        + (" (helping another run)" if outcome.helped else "")
        + (
            f", {outcome.resolved_dead_letters} dead letters resolved by replay"
            if outcome.resolved_dead_letters
            else ""
        )
        + (f" ({r.error})" if r.error else "")
        # Where it failed, for whoever reads the run's log (the UI; the CLI's -v).
        + (f"\n{r.trace}" if r.status == "FAILED" and r.trace else "")
    )


PROGRESS_TAG = "supplier_sync/progress"
PROGRESS_INTERVAL_SECONDS = 2.0


class _Progress:
    """The batch's progress as a run tag, visible while the run works.

    Updated at most every ``PROGRESS_INTERVAL_SECONDS`` and once when the run's cities are
    done: each update reads the batch and writes a run tag, which a run of many
    small cities would otherwise pay after every city.
    """

    def __init__(self) -> None:
        self._last = float("-inf")

    def show(
        self,
        context: dg.AssetExecutionContext,
        db: SyncDatabase,
        batch_id: str,
        *,
        final: bool = False,
    ) -> None:
        now = time.monotonic()
        if not final and now - self._last < PROGRESS_INTERVAL_SECONDS:
            return
        self._last = now
        try:
            with db.engine.connect() as conn:
                line = progress_line(get_batch(conn, batch_id), db.clock.read(conn))
            context.instance.add_run_tags(context.run.run_id, {PROGRESS_TAG: line})
        except Exception as err:  # progress is for people; it never stops a sync
            context.log.debug(f"progress tag not updated: {err}")
