"""Operator actions as Dagster jobs: each one a form in the launchpad (a typed ``dg.Config``).

The same actions as the CLI (``dead-letters retry|ignore|fix``, ``review approve|reject``,
``gate override``, ``task set``, ``outbox retry|cancel``), through the same core functions:
each needs who (``by``) and why (``reason``), writes one audit row per target, and its run's
output metadata shows what changed. A refused action (a closed dead letter, a fix that still
fails its checks, an unknown review, a ``by`` or ``reason`` with a control character) fails
the run with the reason, before anything changes. Beside the declared ``by``, each audit row
records the identity the run can prove: its process's OS user, host and pid, the run's id,
and the user Dagster names as its launcher (the ``user`` tag, which Dagster+ sets;
open-source Dagster has no login and sets none).
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, Protocol

import dagster as dg
from pydantic import Field

from supplier_sync_dagster.core.errors import ConfigError, NotFound, SupplierSyncError
from supplier_sync_dagster.core.inputs.operator_input import check_row_ids, load_operator_json
from supplier_sync_dagster.core.leasing.leases import make_worker_id
from supplier_sync_dagster.core.outbox.machine import operate
from supplier_sync_dagster.core.records import deadletters
from supplier_sync_dagster.core.records.gates import GateCheck, override_gate_check
from supplier_sync_dagster.core.records.review import Decision, approve_reviews, reject_reviews
from supplier_sync_dagster.core.repair.compensation import fix_dead_letter
from supplier_sync_dagster.core.store.audit import Identity, process_identity, require_who_and_why
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.tasks import change_task
from supplier_sync_dagster.dagster_instance.run_launcher import HOUSEKEEPING_TAGS
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SyncDatabaseResource,
)

GROUP = "operator_actions"
_WHO = "Who does this (recorded in the audit trail)."
_WHY = "Why (recorded in the audit trail)."
# The run tag Dagster+ sets to the launching user (dagster._core.storage.tags.USER_TAG).
DAGSTER_USER_TAG = "user"


class DeadLetterActionConfig(dg.Config):
    """Dead letters to retry or ignore."""

    ids: list[int] = Field(description="Dead letter ids (`supplier-sync dead-letters list`).")
    by: str = Field(description=_WHO)
    reason: str = Field(description=_WHY)


class DeadLetterFixConfig(dg.Config):
    """A corrected record for one dead letter."""

    id: int = Field(description="The dead letter's id.")
    patch: str = Field(
        description="A JSON merge patch of the supplier's record, e.g. "
        '{"phone": "+66 2 123 4567"}; content only: hotel_id, supplier_hotel_id, supplier_id, '
        "version and updated_at are refused (at most 32 levels deep, 1 MiB)."
    )
    by: str = Field(description=_WHO)
    reason: str = Field(description=_WHY)


class ReviewDecisionConfig(dg.Config):
    """Reviews to approve or reject: named ones, or every PENDING one of a batch."""

    review_ids: list[str] = Field(
        default_factory=list, description="Review ids (`supplier-sync review list`)."
    )
    batch_id: str = Field(
        default="", description="Every PENDING review of this batch (when no ids are given)."
    )
    by: str = Field(description=_WHO)
    reason: str = Field(description=_WHY)


class GateOverrideConfig(dg.Config):
    """A failed batch gate check of one city that may pass."""

    batch_id: str = Field(description="The batch.")
    city: str = Field(description="The supplier's city code, verbatim.")
    check_name: str = Field(description="The check (bad_record_ratio, record_count, ...).")
    by: str = Field(description=_WHO)
    reason: str = Field(description=_WHY)


class TaskSettingsConfig(dg.Config):
    """New settings of a sync task; empty fields stay as they are."""

    task_code: str = Field(description="The task.")
    policy: str = Field(
        default="", description="SKIP_IF_RUNNING, CANCEL_PREVIOUS or ALLOW_PARALLEL."
    )
    status: str = Field(default="", description="ENABLED or DISABLED.")
    cron: str = Field(default="", description='A cron expression, or "none" to clear it.')
    thresholds_json: str = Field(
        default="", description='Gate thresholds as JSON, e.g. {"max_bad_ratio": 0.1}.'
    )
    by: str = Field(description=_WHO)
    reason: str = Field(description=_WHY)


class OutboxActionConfig(dg.Config):
    """Outbox events to retry or cancel."""

    ids: list[int] = Field(description="Event ids (`supplier-sync outbox list`).")
    by: str = Field(description=_WHO)
    reason: str = Field(description=_WHY)


def _refused(err: Exception) -> dg.Failure:
    return dg.Failure(description=f"{type(err).__name__}: {err}", allow_retries=False)


class _Declared(Protocol):
    """A form's who and why."""

    by: str
    reason: str


def run_identity(context: dg.OpExecutionContext) -> Identity:
    """This process's identity as the op's run, with the user Dagster names as its launcher."""
    return process_identity().in_run(context.run_id, context.run.tags.get(DAGSTER_USER_TAG))


def _proven(context: dg.OpExecutionContext, config: _Declared) -> Identity:
    """The run's identity, once the form's who and why pass the CLI's rules for ``--by`` and
    ``--reason``; else the run fails before anything changes."""
    try:
        require_who_and_why(config.by, config.reason)
    except ConfigError as err:
        raise _refused(err) from None
    return run_identity(context)


@contextmanager
def _acting(
    context: dg.OpExecutionContext, config: _Declared, sync_db: SyncDatabaseResource
) -> Iterator[tuple[SyncDatabase, Identity]]:
    """The sync database and the run's identity for an operator's action (:func:`_proven`);
    a refusal of the action fails the run with its reason."""
    identity = _proven(context, config)
    with sync_db.opened() as db:
        try:
            yield db, identity
        except SupplierSyncError as err:
            raise _refused(err) from None


def _row_ids(ids: list[int], name: str = "ids") -> list[int]:
    """A form's row ids, each within a signed BIGINT; any other fails the run in one line."""
    try:
        return check_row_ids(ids, what=name)
    except ConfigError as err:
        raise _refused(err) from None


def _json_field(text: str, name: str) -> Any:
    """A form's JSON field parsed, bounded in size and depth; text that is no JSON, or too
    large or deep, fails the run with one line naming the field."""
    try:
        return load_operator_json(text, what=name)
    except ConfigError as err:
        raise _refused(err) from None


def _dead_letter_action(
    context: dg.OpExecutionContext,
    config: DeadLetterActionConfig,
    sync_db: SyncDatabaseResource,
    action: str,
) -> dg.Output[int]:
    _row_ids(config.ids)
    with _acting(context, config, sync_db) as (db, identity):
        with db.engine.connect() as conn:
            before = deadletters.snapshot(conn, config.ids)
        with db.begin() as conn:
            moved = deadletters.operator_action(
                conn,
                db.clock,
                config.ids,
                "retry" if action == "retry" else "ignore",
                actor=config.by,
                reason=config.reason,
                identity=identity,
            )
        with db.engine.connect() as conn:
            after = deadletters.snapshot(conn, config.ids)
    context.log.info(f"dead letters {config.ids}: {action} by {config.by} ({moved} moved)")
    return dg.Output(
        moved,
        metadata={
            "moved": moved,
            "changes": dg.MetadataValue.json(
                {str(i): {"before": before[i], "after": after[i]} for i in sorted(before)}
            ),
        },
    )


@dg.op(description="Re-queue MANUAL_FIX/FAILED dead letters, due now, with one more attempt.")
def retry_dead_letters(
    context: dg.OpExecutionContext, config: DeadLetterActionConfig, sync_db: SyncDatabaseResource
) -> dg.Output[int]:
    """An operator's dead-letter retry."""
    return _dead_letter_action(context, config, sync_db, "retry")


@dg.op(description="Close open dead letters for good.")
def ignore_dead_letters(
    context: dg.OpExecutionContext, config: DeadLetterActionConfig, sync_db: SyncDatabaseResource
) -> dg.Output[int]:
    """An operator's dead-letter ignore."""
    return _dead_letter_action(context, config, sync_db, "ignore")


@dg.op(
    description="Patch a dead letter's record and run it through every check; publishes or fails."
)
def fix_dead_letter_op(
    context: dg.OpExecutionContext,
    config: DeadLetterFixConfig,
    sync_db: SyncDatabaseResource,
    payloads: PayloadStoreResource,
    governance: GovernanceResource,
) -> dg.Output[str]:
    """An operator's fix: accepted, the run succeeds; refused, it fails with the new code."""
    _row_ids([config.id], "id")
    identity = _proven(context, config)
    patch = _json_field(config.patch, "patch")
    with sync_db.opened() as db:
        try:
            outcome = fix_dead_letter(
                db,
                payloads.open(),
                dead_letter=config.id,
                patch=patch,
                actor=config.by,
                reason=config.reason,
                lease=sync_db.lease_settings(),
                risk_policy=governance.risk_rules(),
                max_clock_skew_seconds=sync_db.max_clock_skew_seconds,
                worker_id=make_worker_id("supplier-sync"),
                identity=identity,
            )
        except NotFound as err:
            raise dg.Failure(description=str(err), allow_retries=False) from None
        except SupplierSyncError as err:
            raise _refused(err) from None
    metadata: dict[str, Any] = {
        "dead_letter": config.id,
        "batch_id": outcome.batch_id,
        "accepted": outcome.accepted,
        "patch": dg.MetadataValue.json(patch),
    }
    if not outcome.accepted:
        raise dg.Failure(
            description=(
                f"the fixed record still fails {outcome.error_code}: {outcome.error_message}; "
                f"dead letter {config.id} is unchanged"
            ),
            metadata={**metadata, "error_code": outcome.error_code or ""},
            allow_retries=False,
        )
    context.log.info(f"dead letter {config.id} fixed in batch {outcome.batch_id}")
    return dg.Output(outcome.batch_id, metadata={**metadata, "action": outcome.action or ""})


def _review(
    context: dg.OpExecutionContext,
    config: ReviewDecisionConfig,
    sync_db: SyncDatabaseResource,
    decide: Callable[..., Decision],
) -> dg.Output[int]:
    with _acting(context, config, sync_db) as (db, identity):
        if not config.review_ids and not config.batch_id:
            raise dg.Failure(description="name review_ids or a batch_id", allow_retries=False)
        decision = decide(
            db,
            review_ids=config.review_ids or None,
            who=config.by,
            reason=config.reason,
            batch_id=config.batch_id or None,
            identity=identity,
        )
    values = {k: v for k, v in vars(decision).items() if isinstance(v, int)}
    return dg.Output(decision.approved + decision.rejected, metadata=values)  # one is 0


@dg.op(description="Approve reviews: their hotels publish through the version guard.")
def approve_reviews_op(
    context: dg.OpExecutionContext, config: ReviewDecisionConfig, sync_db: SyncDatabaseResource
) -> dg.Output[int]:
    """An operator's review approval."""
    return _review(context, config, sync_db, approve_reviews)


@dg.op(description="Reject reviews: their hotels stay as published.")
def reject_reviews_op(
    context: dg.OpExecutionContext, config: ReviewDecisionConfig, sync_db: SyncDatabaseResource
) -> dg.Output[int]:
    """An operator's review rejection."""
    return _review(context, config, sync_db, reject_reviews)


@dg.op(description="Let a failed gate check of one city pass; re-running the city publishes it.")
def override_gate_op(
    context: dg.OpExecutionContext, config: GateOverrideConfig, sync_db: SyncDatabaseResource
) -> dg.Output[str]:
    """An operator's gate override."""
    with _acting(context, config, sync_db) as (db, identity):
        override = override_gate_check(
            db,
            GateCheck(config.batch_id, config.city, config.check_name),
            who=config.by,
            reason=config.reason,
            identity=identity,
        )
    return dg.Output(
        config.check_name,
        metadata={k: str(v) for k, v in vars(override).items()},
    )


@dg.op(description="Change a sync task's settings (one audit row per field that changed).")
def change_task_op(
    context: dg.OpExecutionContext, config: TaskSettingsConfig, sync_db: SyncDatabaseResource
) -> dg.Output[int]:
    """An operator's task settings change."""
    thresholds = (
        _json_field(config.thresholds_json, "thresholds_json") if config.thresholds_json else None
    )
    with _acting(context, config, sync_db) as (db, identity):
        changes = change_task(
            db,
            config.task_code,
            changed_by=config.by,
            reason=config.reason,
            policy=config.policy or None,  # type: ignore[arg-type]
            status=config.status or None,  # type: ignore[arg-type]
            cron=config.cron or None,
            thresholds=thresholds,
            identity=identity,
        )
    return dg.Output(
        len(changes),
        metadata={
            "changed": len(changes),
            "changes": dg.MetadataValue.json(
                [{"field": c.field_name, "old": c.old_value, "new": c.new_value} for c in changes]
            ),
        },
    )


def _outbox_op(action: Literal["retry", "cancel"], description: str) -> dg.OpDefinition:
    """The op of an operator's outbox retry or cancel."""

    @dg.op(name=f"{action}_outbox_events", description=description)
    def outbox_action(
        context: dg.OpExecutionContext, config: OutboxActionConfig, sync_db: SyncDatabaseResource
    ) -> dg.Output[int]:
        _row_ids(config.ids)
        with _acting(context, config, sync_db) as (db, identity):
            moved = operate(
                db, action, config.ids, actor=config.by, reason=config.reason, identity=identity
            )
        return dg.Output(moved, metadata={"moved": moved, "ids": dg.MetadataValue.json(config.ids)})

    return outbox_action


retry_outbox_events = _outbox_op(
    "retry", "FAILED or CANCELLED outbox events run again from the stage they stopped at."
)
cancel_outbox_events = _outbox_op("cancel", "READY or FAILED outbox events stop (until retried).")


def _job(name: str, op: dg.OpDefinition, description: str) -> dg.JobDefinition:
    @dg.job(
        name=name,
        description=description,
        tags={"supplier_sync/kind": "operator_action", **HOUSEKEEPING_TAGS},
    )
    def action() -> None:
        op()

    return action


dead_letter_retry_job = _job(
    "dead_letter_retry", retry_dead_letters, "Retry dead letters (audited)."
)
dead_letter_ignore_job = _job(
    "dead_letter_ignore", ignore_dead_letters, "Ignore dead letters (audited)."
)
dead_letter_fix_job = _job(
    "dead_letter_fix", fix_dead_letter_op, "Fix a dead letter's record with a patch (audited)."
)
review_approve_job = _job("review_approve", approve_reviews_op, "Approve reviews (audited).")
review_reject_job = _job("review_reject", reject_reviews_op, "Reject reviews (audited).")
gate_override_job = _job(
    "gate_override", override_gate_op, "Override a failed gate check (audited)."
)
task_settings_job = _job("task_settings", change_task_op, "Change a task's settings (audited).")
outbox_retry_job = _job("outbox_retry", retry_outbox_events, "Retry outbox events (audited).")
outbox_cancel_job = _job("outbox_cancel", cancel_outbox_events, "Cancel outbox events (audited).")
