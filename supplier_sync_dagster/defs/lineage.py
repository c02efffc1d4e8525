"""OpenLineage run events of every run of the sync's jobs (``core.lineage``).

Run status sensors, not hooks in the assets: a sensor sees every run of the code location
from Dagster's own record of it (a job of any kind, a UI backfill of the city partitions, a
run that failed before or outside its step: a resource that did not start, a run worker
that died and was marked failed by run monitoring), and emitting from the daemon never
holds up a run. ``lineage_on_run_start`` sends START, ``lineage_on_run_success``
COMPLETE, ``lineage_on_run_failure`` FAIL (with the failure's message) and
``lineage_on_run_canceled`` ABORT.

Runs that no daemon watches (``supplier-sync sync``, ``demo``, ``replay``: ``dg.materialize``
in the command's process) send the same events through :func:`emit_finished_run` once the
run has ended, each with the time Dagster recorded for it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from supplier_sync_dagster.core.accounts import Account
from supplier_sync_dagster.core.lineage.emit import (
    DEFAULT_FILE_MAX_BYTES,
    DEFAULT_TIMEOUT_SECONDS,
    LINEAGE_FILE,
    LineageConfig,
    LineageEmitter,
)
from supplier_sync_dagster.core.lineage.events import (
    BatchQuality,
    EventType,
    Places,
    RunFacts,
    batch_quality,
    run_event,
)
from supplier_sync_dagster.core.outbox.projections import DEFAULT_EXCHANGE
from supplier_sync_dagster.core.settings import Settings, load_settings
from supplier_sync_dagster.defs.accounts import ACCOUNT_TAG, account_scopes
from supplier_sync_dagster.defs.city_keys import STAGE_ASSETS
from supplier_sync_dagster.defs.incremental_sync import CHANGE_FEED
from supplier_sync_dagster.defs.resources import (
    SupplierResource,
    SyncDatabaseResource,
    env_var,
    setting_field,
)
from supplier_sync_dagster.defs.triggers import SOURCE_TAG, TRIGGER_TAG, trigger_of

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "supplier_sync"
# The assets whose runs belong to a batch whose gates the events report.
GATED_ASSETS = frozenset({"raw_hotel_snapshots", "hotel_change_feed"})
CITY_ASSETS = frozenset(key.path[-1] for keys in STAGE_ASSETS.values() for key in keys)
# The jobs that run the city sync and the change feed (an account's: prefixed).
FULL_SYNC_JOB = "full_sync_job"
INCREMENTAL_JOB = "incremental_sync"
STATUS_EVENTS: dict[dg.DagsterRunStatus, EventType] = {
    dg.DagsterRunStatus.SUCCESS: "COMPLETE",
    dg.DagsterRunStatus.FAILURE: "FAIL",
    dg.DagsterRunStatus.CANCELED: "ABORT",
}


_URL = "OpenLineage HTTP endpoint's base URL (events to <url>/api/v1/lineage)"
_KEY = "API key sent as a bearer token (never logged)"
_FILE = f"a JSON-lines file, {LINEAGE_FILE},"


class LineageResource(dg.ConfigurableResource):
    """Where the runs' OpenLineage events go: an HTTP endpoint, else a file in the state folder."""

    url: str | None = setting_field("lineage_url", _URL, unset=f"{_FILE} in the state folder.")
    api_key: str | None = setting_field("lineage_api_key", _KEY, unset="none.")
    namespace: str = Field(default=DEFAULT_NAMESPACE, description="The jobs' namespace.")
    timeout_seconds: float = Field(
        default=DEFAULT_TIMEOUT_SECONDS,
        description="Connect and read timeout of one request; a lost event is logged, no retry.",
    )
    file_max_bytes: int = Field(
        default=DEFAULT_FILE_MAX_BYTES,
        description="Size cap of the lineage file; past it, it moves to events.jsonl.1.",
    )

    def emitter(self, state_dir: Path) -> LineageEmitter:
        """An emitter to the endpoint, or to the file under ``state_dir``."""
        return LineageEmitter(
            LineageConfig(
                url=self.url,
                api_key=self.api_key,
                timeout_seconds=self.timeout_seconds,
                file=state_dir / LINEAGE_FILE,
                file_max_bytes=self.file_max_bytes,
            )
        )


def lineage_resource(settings: Settings) -> LineageResource:
    """The resource of the settings: the URL and key as ``dg.EnvVar``, numbers as values."""
    fields: dict[str, Any] = {
        "namespace": settings.lineage_namespace,
        "timeout_seconds": settings.lineage_timeout_seconds,
        "file_max_bytes": settings.lineage_file_max_bytes,
    }
    return LineageResource(
        url=env_var(settings, "lineage_url"),
        api_key=env_var(settings, "lineage_api_key"),
        **{name: value for name, value in fields.items() if value is not None},
    )


def places(settings: Settings, tags: Mapping[str, str], *, db_url: str | None = None) -> Places:
    """Where a run's datasets live: the settings' stores and the run's account's supplier."""
    account = _account(tags.get(ACCOUNT_TAG))
    state = settings.state_dir
    return Places(
        db_url=db_url or settings.sync_db_url(),
        payload_url=settings.payload_url or f"file://{state / 'payloads'}",
        supplier_url=account.base_url if account else settings.supplier_url,
        # The supplier resource's own default, when no suppliers file names the account's.
        supplier_id=account.supplier_id
        if account
        else SupplierResource.model_fields["supplier_id"].default,
        search_url=settings.search_url,
        search_file=state / "search.sqlite3",
        amqp_url=settings.amqp_url,
        notifications_file=state / "notifications.jsonl",
        exchange=DEFAULT_EXCHANGE,
    )


def _account(code: str | None) -> Account | None:
    if code is None:
        return None
    return next((s.account for s in account_scopes() if s.account and s.account.code == code), None)


def job_name(run_job: str, assets: Collection[dg.AssetKey]) -> str:
    """The run's OpenLineage job: its Dagster job; for an ad hoc asset run (a UI launch or
    backfill, a command's ``dg.materialize``) the account's job that runs the same assets
    (one lineage job per kind of work, however it was started), else its assets."""
    if not run_job.startswith("__"):
        return run_job
    names = sorted({"__".join([*key.path[:-1], _job_of(key.path[-1])]) for key in assets})
    return "+".join(names) or run_job


def _job_of(asset: str) -> str:
    if asset in CITY_ASSETS:
        return FULL_SYNC_JOB
    return INCREMENTAL_JOB if asset == CHANGE_FEED.path[-1] else asset


def run_facts(
    run: dg.DagsterRun, assets: Collection[dg.AssetKey], error: str | None = None
) -> RunFacts:
    """What the events say of a run (its batch is its trigger's)."""
    trigger, _ = trigger_of(run.tags, run.run_id)
    return RunFacts(
        run_id=run.run_id,
        job_name=job_name(run.job_name, assets),
        assets=frozenset(key.path[-1] for key in assets),
        trigger_id=trigger,
        error=error,
        tags={k: v for k, v in run.tags.items() if k in (ACCOUNT_TAG, TRIGGER_TAG, SOURCE_TAG)},
    )


def emit_run_event(
    event_type: EventType,
    facts: RunFacts,
    *,
    lineage: LineageResource,
    sync_db: SyncDatabaseResource,
    event_time: datetime,
    settings: Settings | None = None,
) -> bool:
    """Builds and sends one event of a run; False when it was not delivered (logged).

    Never raises for the sync's sake: a sync database that cannot say the batch's quality
    leaves the quality facets out.
    """
    settings = settings or load_settings()
    quality: BatchQuality | None = None
    if event_type != "START" and facts.trigger_id and facts.assets & GATED_ASSETS:
        try:
            with sync_db.opened() as db:
                quality = batch_quality(db, facts.trigger_id)
        except Exception:
            log.warning(
                "lineage: the batch of %s has no quality facets", facts.run_id, exc_info=True
            )
    event = run_event(
        event_type,
        facts,
        places(settings, facts.tags, db_url=sync_db.db_url),
        namespace=lineage.namespace,
        event_time=event_time,
        quality=quality,
    )
    emitter = lineage.emitter(settings.state_dir)
    try:
        return emitter.emit(event)
    finally:
        emitter.close()


def _time(epoch: float | None) -> datetime:
    return datetime.fromtimestamp(epoch, UTC) if epoch else datetime.now(UTC)


def emit_finished_run(
    instance: dg.DagsterInstance,
    run_id: str,
    *,
    lineage: LineageResource,
    sync_db: SyncDatabaseResource,
    assets: Collection[dg.AssetKey] = (),
    error: str | None = None,
    settings: Settings | None = None,
) -> int:
    """START and the end event (COMPLETE, FAIL or ABORT) of a run that no daemon watched,
    each with the time Dagster recorded; returns the events delivered.

    Args:
        assets: The run's assets when it selected none (``dg.materialize`` runs all it got).
    """
    record = instance.get_run_record_by_id(run_id)
    if record is None:
        return 0
    run = record.dagster_run
    facts = run_facts(run, run.asset_selection or assets, error)
    end = STATUS_EVENTS.get(run.status)
    sent = 0
    for event_type, at in (("START", record.start_time), (end, record.end_time)):
        if event_type is not None:
            sent += emit_run_event(
                event_type,
                facts,
                lineage=lineage,
                sync_db=sync_db,
                event_time=_time(at),
                settings=settings,
            )
    return sent


@dataclass(frozen=True)
class CommandLineage:
    """The lineage of a command's runs (no daemon watches them): the resource, holding its
    values as a command's resources do, and the command's settings."""

    lineage: LineageResource
    settings: Settings

    @classmethod
    def of(cls, settings: Settings) -> CommandLineage:
        """The command's lineage, from the settings it read."""
        return cls(
            LineageResource(
                url=settings.lineage_url,
                api_key=settings.lineage_key(),
                namespace=settings.lineage_namespace or DEFAULT_NAMESPACE,
                timeout_seconds=settings.lineage_timeout_seconds or DEFAULT_TIMEOUT_SECONDS,
                file_max_bytes=settings.lineage_file_max_bytes or DEFAULT_FILE_MAX_BYTES,
            ),
            settings,
        )

    def finished(
        self,
        instance: dg.DagsterInstance,
        run_id: str,
        sync_db: SyncDatabaseResource,
        assets: Collection[dg.AssetKey],
        error: str | None = None,
    ) -> int:
        """Sends the ended run's events (:func:`emit_finished_run`) of its ``assets``."""
        return emit_finished_run(
            instance,
            run_id,
            lineage=self.lineage,
            sync_db=sync_db,
            assets=assets,
            error=error,
            settings=self.settings,
        )

    @contextlib.contextmanager
    def command_run(
        self,
        assets: Collection[dg.AssetKey],
        sync_db: SyncDatabaseResource,
        tags: Mapping[str, str],
    ) -> Iterator[CommandRun]:
        """Work the command does outside any Dagster run (a reconciliation's comparison) on the
        datasets of ``assets``, as a run of its own under the job that runs those assets: START
        when it begins, COMPLETE when it ends, FAIL with the error it raised or was given."""
        started = datetime.now(UTC)
        run = CommandRun(str(uuid.uuid4()))
        try:
            yield run
        except Exception as err:
            run.error = f"{type(err).__name__}: {err}"
            raise
        finally:
            facts = RunFacts(
                run_id=run.run_id,
                job_name=job_name("__command", assets),
                assets=frozenset(key.path[-1] for key in assets),
                error=run.error,
                tags=dict(tags),
            )
            send = functools.partial(
                emit_run_event, facts=facts, lineage=self.lineage, sync_db=sync_db
            )
            send("START", event_time=started, settings=self.settings)
            send("FAIL" if run.error else "COMPLETE", event_time=datetime.now(UTC))


@dataclass
class CommandRun:
    """A command's own run (:meth:`CommandLineage.command_run`): its id, and why it failed."""

    run_id: str
    error: str | None = None


def _context_assets(context: dg.RunStatusSensorContext) -> Collection[dg.AssetKey]:
    """The assets of the sensor's run: its selection, else its job's."""
    run = context.dagster_run
    if run.asset_selection:
        return run.asset_selection
    repo = context.repository_def
    if repo is None or not repo.has_job(run.job_name):
        return ()
    return repo.get_job(run.job_name).asset_layer.selected_asset_keys


def _on_status(
    context: dg.RunStatusSensorContext,
    event_type: EventType,
    lineage: LineageResource,
    sync_db: SyncDatabaseResource,
    error: str | None = None,
) -> None:
    facts = run_facts(context.dagster_run, _context_assets(context), error)
    record = context.instance.get_run_record_by_id(context.dagster_run.run_id)
    at = (
        None
        if record is None
        else (record.start_time if event_type == "START" else record.end_time)
    )
    delivered = emit_run_event(
        event_type, facts, lineage=lineage, sync_db=sync_db, event_time=_time(at)
    )
    context.log.info(f"lineage {event_type} of {facts.job_name}: {'sent' if delivered else 'lost'}")


SENSORS: dict[dg.DagsterRunStatus, tuple[str, EventType]] = {
    dg.DagsterRunStatus.STARTED: ("lineage_on_run_start", "START"),
    dg.DagsterRunStatus.SUCCESS: ("lineage_on_run_success", "COMPLETE"),
    dg.DagsterRunStatus.FAILURE: ("lineage_on_run_failure", "FAIL"),
    dg.DagsterRunStatus.CANCELED: ("lineage_on_run_canceled", "ABORT"),
}


def _status_sensor(status: dg.DagsterRunStatus) -> dg.SensorDefinition:
    name, event_type = SENSORS[status]

    @dg.run_status_sensor(
        run_status=status,
        name=name,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Sends each run's OpenLineage {event_type} event (a lost event is logged).",
    )
    def sensor(
        context: dg.RunStatusSensorContext, lineage: LineageResource, sync_db: SyncDatabaseResource
    ) -> None:
        # A failed run's event is its failure, with Dagster's message of why.
        error = context.dagster_event.message if event_type == "FAIL" else None
        _on_status(context, event_type, lineage, sync_db, error)

    return sensor


@functools.cache
def build_lineage_sensors() -> tuple[dg.SensorDefinition, ...]:
    """One run status sensor per event type: START, COMPLETE, FAIL, ABORT."""
    return tuple(_status_sensor(status) for status in SENSORS)


@dg.definitions
def defs() -> dg.Definitions:
    """The lineage resource, from the settings read now (a bad URL stops the load), and its
    sensors."""
    return dg.Definitions(
        resources={"lineage": lineage_resource(load_settings())},
        sensors=list(build_lineage_sensors()),
    )
