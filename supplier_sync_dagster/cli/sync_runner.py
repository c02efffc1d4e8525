"""The main demo and the CLI's sync: a full sync through Dagster, with progress and a summary.

``supplier-sync demo`` (the embedded simulator) and ``supplier-sync sync --full`` (the
configured supplier) run this. It discovers the supplier's cities as dynamic partitions,
then materializes the city-sync assets over the whole range in one run on the local Dagster
instance (``$DAGSTER_HOME``, default ``$SUPPLIER_SYNC_HOME/dagster_home``), so the run, its
metadata and lineage show in the UI. A thread renders the batch's progress from the sync
database while the run works.

A supplier that refuses the API key or cannot be reached before its city list is read gets
the trigger a FAILED batch (``core.sync.run.refuse_trigger``) and no Dagster run. A sync
stopped by SIGTERM or SIGINT (Dagster's handler interrupts the step, which stops the cities
at a page boundary) says which signal it was (:class:`SignalLog`) and how to resume.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO
from urllib.parse import urlsplit

import dagster as dg
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import (
    AUTH_REJECTED_CODES,
    UNREACHABLE_CODES,
    SupplierError,
    SyncInterrupted,
    code_of_description,
    describe_error,
)
from supplier_sync_dagster.core.leasing.batches import Batch, batch_for_trigger, time_left
from supplier_sync_dagster.core.leasing.processes import this_host
from supplier_sync_dagster.core.records.deadletters import count_dead_letters
from supplier_sync_dagster.core.records.gates import GATED_PREFIX, gate_check_names
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.engine import state_dir
from supplier_sync_dagster.core.sync.retire import RetirePlan, held_line, retire_cities
from supplier_sync_dagster.core.sync.run import refusal_line, refuse_trigger
from supplier_sync_dagster.core.sync.stop import INTERRUPTS, SignalWatch
from supplier_sync_dagster.core.sync.tasks import require_enabled
from supplier_sync_dagster.dagster_instance.home import dagster_instance
from supplier_sync_dagster.dagster_instance.run_launcher import WORKER_HOST_TAG
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE, AccountScope
from supplier_sync_dagster.defs.city_keys import DIFFS, MAPPINGS, NORMALIZED, PUBLISHED
from supplier_sync_dagster.defs.city_retirement import drop_partitions, plan_for, retiring_keys
from supplier_sync_dagster.defs.city_sync import api_key_setting, build_city_sync
from supplier_sync_dagster.defs.incremental_sync import (
    CHANGE_FEED,
    IncrementalConfig,
    build_hotel_change_feed,
)
from supplier_sync_dagster.defs.lineage import CommandLineage
from supplier_sync_dagster.defs.partitions import CITY_PARTITIONS, encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SupplierResource,
    SyncDatabaseResource,
    run_settings,
)
from supplier_sync_dagster.defs.triggers import SOURCE_TAG, TASK_TAG, TRIGGER_TAG


@dataclass
class SyncSummary:
    """What a sync did, for the terminal and for ``--json``."""

    batch_id: str
    trigger_id: str
    status: str
    run_success: bool
    # A trigger that made no batch (skipped, or failed before it) keeps these defaults.
    cities: int = 0
    cities_done: int = 0
    records: int = 0
    published: int = 0
    dead_letters: int = 0
    skipped: int = 0
    counts_add_up: bool = True
    dead_letters_by_code: dict[str, int] = field(default_factory=dict)
    diffs_by_type: dict[str, int] = field(default_factory=dict)
    diffs_by_action: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    hotels_per_second: float = 0.0
    dagster_run_id: str = ""
    dagster_home: str = ""
    # city -> the gate's reason (a gated city publishes after an override and a re-run)
    gated_cities: dict[str, str] = field(default_factory=dict)
    # city -> its error (a re-run of the same trigger resumes it)
    failed_cities: dict[str, str] = field(default_factory=dict)
    # why the trigger made no batch (the concurrency policy's reason), if it did not
    skip_reason: str = ""
    # the Dagster run's failure, when the batch does not explain it
    run_error: str = ""
    # the batch's own error: why it could not start (``CODE: what happened``)
    error: str = ""
    # the signal that stopped the sync (SIGTERM, SIGINT), or "interrupted"
    interrupted: str = ""
    # who or what cancelled the batch (a CANCEL_PREVIOUS trigger, an operator), if it was
    cancelled: str = ""
    # the cities whose run was launched (a re-sync of some cities: all unless interrupted)
    attempted_cities: list[str] = field(default_factory=list)
    # what a refused key's or an unreachable supplier's line names
    key_setting: str = ""
    supplier_address: str = ""
    # cities the supplier no longer lists: retired (partition out of the active set, hotels
    # through the tombstone grace), or held by the mass-drop guard for a person
    retired_cities: list[str] = field(default_factory=list)
    held_cities: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        """The summary as one JSON object."""
        return json.dumps(asdict(self), sort_keys=True)

    def exit_status(self) -> int:
        """The command's exit status: 0 done; 1 not complete; 2 the supplier refused the API
        key or could not be reached; 3 its batch was cancelled; 128 + the signal's number
        when a signal stopped it."""
        if self.cancelled:
            return 3
        if self.interrupted:
            return interrupted_status(self.interrupted)
        if self.refusal() is not None:
            return 2
        return 0 if self.problem() is None else 1

    def refusal(self) -> str | None:
        """The one line of a sync that the supplier refused (the API key, or any connection):
        from the batch's own error, or its failed cities'; None when it was not that."""
        if self.status == "SUCCESS":
            return None
        line = refusal_line(self.error, key_setting=self.key_setting, address=self.address)
        if line is not None:
            return line
        codes = [code_of_description(e) for e in self.failed_cities.values()]
        refused = [
            e for e in self.failed_cities.values() if code_of_description(e) in AUTH_REJECTED_CODES
        ]
        if refused:
            return refusal_line(refused[0], key_setting=self.key_setting, address=self.address)
        if self.status == "FAILED" and codes and all(c in UNREACHABLE_CODES for c in codes):
            first = next(iter(self.failed_cities.values()))
            return refusal_line(first, key_setting=self.key_setting, address=self.address)
        return None

    @property
    def address(self) -> str | None:
        """The supplier's ``host:port``, when known."""
        return self.supplier_address or None

    def problem(self) -> str | None:
        """Why the sync did not complete, in one line (None: it did).

        The command line prints it after the summary and exits non-zero.
        """
        resume = f"resume with --trigger-id {shlex.quote(self.trigger_id)}"
        if self.cancelled:
            # A cancelled batch is over: nothing of it resumes.
            why = (
                self.cancelled
                if self.cancelled.startswith("cancelled")
                else (f"cancelled: {self.cancelled}")
            )
            return f"sync {why}; {self.cities_done} of {_cities(self.cities)} done before it"
        if self.interrupted:
            return (
                f"sync interrupted ({self.interrupted}): {self.cities_done} of "
                f"{_cities(self.cities)} done, the others stopped at a page boundary; {resume}"
            )
        if not self.batch_id:
            if self.skip_reason:
                return f"sync skipped: {self.skip_reason}"
            return f"sync failed before it made a batch: {self.run_error or 'no reason recorded'}"
        refusal = self.refusal()
        if refusal is not None:
            if not self.cities:
                return refusal
            return (
                f"{refusal}; {len(self.failed_cities)} of {_cities(self.cities)} not synced; "
                f"{resume}"
            )
        parts = []
        if self.failed_cities:
            parts.append(
                f"sync failed: {_cities(len(self.failed_cities))} of {self.cities} failed "
                f"({_some(self.failed_cities)}); {resume}"
            )
        if self.gated_cities:
            first = next(iter(self.gated_cities))
            parts.append(
                f"{_cities(len(self.gated_cities))} stopped by a quality gate "
                f"({_some(self._gate_checks())}); see supplier-sync gate show --batch "
                f"{self.batch_id} --city {shlex.quote(first)}"
            )
        if self.held_cities:
            parts.append(held_line(self.held_cities))
        if parts:
            return "; ".join(parts)
        if self.status != "SUCCESS":
            why = self.run_error or self.error or resume
            return (
                f"batch {self.batch_id} is {self.status} "
                f"({self.cities_done}/{self.cities} cities): {why}"
            )
        if not self.run_success:
            return f"the Dagster run failed: {self.run_error or 'no reason recorded'}"
        if not self.counts_add_up:
            return f"batch {self.batch_id}: the counts do not add up"
        return None

    def render(self) -> str:
        """The summary as text for a terminal."""
        if not self.batch_id:
            return "\n".join(
                [
                    f"trigger {self.trigger_id}: no batch"
                    + (f" (skipped: {self.skip_reason})" if self.skip_reason else ""),
                    self._ui_line(),
                ]
            )
        lines = [
            f"batch {self.batch_id}: {self.status} ({self.cities_done}/{self.cities} cities)",
            f"records {self.records} = published {self.published} + dead letters "
            f"{self.dead_letters} + skipped {self.skipped}"
            + ("" if self.counts_add_up else "   <-- DOES NOT ADD UP"),
            "dead letters by code: " + _fmt(self.dead_letters_by_code),
            "diffs by type:        " + _fmt(self.diffs_by_type),
            "diffs by action:      " + _fmt(self.diffs_by_action),
            f"elapsed {self.seconds:.1f} s, {self.hotels_per_second:.0f} hotels/s",
        ]
        for what, cities in (("gated", self._gate_checks()), ("failed", self.failed_cities)):
            if cities:
                lines.append(f"{what} cities: ".ljust(22) + _some(cities, limit=10))
        for what, listed in (("retired", self.retired_cities), ("held", self.held_cities)):
            if listed:
                lines.append(f"{what} cities: ".ljust(22) + ", ".join(listed[:10]))
        if self.error:
            lines.append(f"batch error: {self.error}")
        if self.dagster_run_id:  # a trigger refused before its run has none
            lines.append(self._ui_line())
        return "\n".join(lines)

    def _gate_checks(self) -> dict[str, str]:
        """City -> the names of the checks that stopped it."""
        return {c: ", ".join(gate_check_names(r)) for c, r in self.gated_cities.items()}

    def _ui_line(self) -> str:
        return (
            f"open the UI: DAGSTER_HOME={self.dagster_home} .venv/bin/dagster dev -w workspace.yaml "
            f"(run {self.dagster_run_id})"
        )


def interrupted_status(signal_name: str) -> int:
    """128 + the number of the signal named (SIGINT when it names none: ``"interrupted"``)."""
    return 128 + int(getattr(signal.Signals, signal_name, signal.SIGINT))


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"


def _cities(n: int) -> str:
    return f"{n} city" if n == 1 else f"{n} cities"


def _some(reasons: dict[str, str], limit: int = 3, width: int = 240) -> str:
    """``'city': reason, ...`` on one line: city codes quoted (they are supplier data), at
    most ``limit`` of them, each reason cut to ``width`` characters."""
    shown = [
        f"{city!r}: {' '.join(reason.split())[:width]}"
        for city, reason in list(reasons.items())[:limit]
    ]
    more = len(reasons) - len(shown)
    return "; ".join(shown) + (f"; {more} more" if more > 0 else "")


class SignalLog:
    """The signals (SIGINT, SIGTERM) a sync received, whichever handler ran for them.

    While it is entered, a signal outside a Dagster run raises :class:`SyncInterrupted`
    (nothing started that needs stopping); inside one, Dagster's own handler interrupts the
    step, whose cities stop at a page boundary and release their leases. Which signal it
    was is seen by a :class:`~supplier_sync_dagster.core.sync.stop.SignalWatch`. Only the
    main thread can enter it; elsewhere it records nothing.
    """

    def __init__(self) -> None:
        self._seen: list[int] = []
        self._watch = SignalWatch(self._seen.append)
        self._old: dict[int, Any] = {}

    def __enter__(self) -> SignalLog:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._raise) for s in INTERRUPTS}
        self._watch.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._watch.__exit__(None, None, None)
        for number, handler in self._old.items():
            signal.signal(number, handler)

    def received(self) -> str:
        """The name of the first signal received so far (``""``: none)."""
        return signal.Signals(self._seen[0]).name if self._seen else ""

    def _raise(self, number: int, frame: FrameType | None) -> None:
        # Seen at once: the watch's thread may not have read it yet when the caller asks.
        self._seen.append(number)
        raise SyncInterrupted(signal.Signals(number).name)


def new_trigger_id() -> str:
    """A command line's trigger id, when the user gave none."""
    return f"cli-{uuid.uuid4().hex[:16]}"


def run_full_sync(
    *,
    supplier: SupplierResource,
    sync_db: SyncDatabaseResource | None = None,
    payloads: PayloadStoreResource | None = None,
    trigger_id: str | None = None,
    progress: TextIO | None = sys.stderr,
    console_log_level: str = "WARNING",
    cities: Sequence[str] | None = None,
    scope: AccountScope = DEFAULT_SCOPE,
    signals: SignalLog | None = None,
    retire_dropped: bool = False,
    lineage: CommandLineage | None = None,
) -> SyncSummary:
    """Syncs every city of the supplier in one Dagster run and returns the summary.

    With ``cities``, only those (a reconciliation's re-pull): one run per city, all of one
    trigger (one batch). ``scope`` is the account whose assets the run materializes (its
    supplier resource is ``supplier``). A supplier that fails the city list (refuses the
    key, cannot be reached, lists no city) gets the trigger a FAILED batch and no run.

    Without ``cities``, the cities the supplier no longer lists retire
    (``core.sync.retire``): their partitions leave the range before the run, their hotels
    count a miss against the run's batch after it; a mass drop is held unless
    ``retire_dropped``.

    Each run's OpenLineage events go out through ``lineage`` once it has ended.

    Raises:
        TaskDisabled: The task is DISABLED (nothing is launched).
    """
    sync_db = sync_db or SyncDatabaseResource()
    payloads = payloads or PayloadStoreResource()
    check = SyncDatabase.open(sync_db.db_url)
    try:
        with check.engine.connect() as conn:
            # Refused before Dagster starts: one line for the terminal, not a failed run.
            require_enabled(conn, supplier.task_code)
    finally:
        check.dispose()
    # Entering the instance makes it the one Dagster reads definitions state from,
    # whatever another instance of this process left behind.
    with dagster_instance() as instance:
        trigger_id = trigger_id or new_trigger_id()
        started = time.perf_counter()
        plan: RetirePlan | None = None
        if cities is None:
            try:
                with supplier.client() as client:
                    codes = [c.city_code for c in client.list_cities().data.cities]
                plan = _retire_partitions(instance, sync_db, supplier, scope, codes, retire_dropped)
                # Held cities stay active: each answers 404 in the run, a ticket for a person.
                codes += plan.held
            except SupplierError as err:
                return _refused(sync_db, supplier, scope, trigger_id, err, started)
        else:
            codes = list(cities)
        keys = _add_city_partitions(instance, codes, scope.partitions_name)
        # A range covers the keys between its ends in the partition set's order.
        ordered = [
            k for k in instance.get_dynamic_partitions(scope.partitions_name) if k in set(keys)
        ]
        # A subset is not a range: one run per city (each an exact partition).
        ranges = [(k, k) for k in keys] if cities is not None else [(ordered[0], ordered[-1])]
        db = SyncDatabase.open(sync_db.db_url)
        stop = threading.Event()
        reporter = threading.Thread(
            target=_report_progress,
            args=(db, supplier.task_code, trigger_id, len(keys), stop, progress),
            daemon=True,
        )
        reporter.start()
        try:
            attempted, result = _materialize_ranges(
                instance,
                ranges,
                resources=_run_resources(sync_db, payloads, supplier, scope),
                tags={**scope.tags, TRIGGER_TAG: trigger_id, SOURCE_TAG: "MANUAL"},
                scope=scope,
                console_log_level=console_log_level,
                keep_going=cities is not None,
                after=_lineage_after(instance, lineage, sync_db, build_city_sync(scope).keys),
            )
        finally:
            stop.set()
            reporter.join(timeout=5)
        seconds = time.perf_counter() - started
        summary = summarize(db, supplier.task_code, trigger_id, seconds)
        summary.attempted_cities = attempted if cities is not None else list(keys)
        summary.run_success = result.success
        summary.run_error = "" if result.success else run_failure(result)
        summary.dagster_run_id = result.run_id
        summary.dagster_home = os.environ.get("DAGSTER_HOME", "")
        if not result.success and not summary.cancelled:
            summary.interrupted = (signals.received() if signals else "") or (
                "interrupted" if was_interrupted(result) else ""
            )
        _where(summary, supplier, scope)
        if plan is not None and summary.batch_id and not summary.interrupted:
            _retire(db, supplier, plan, summary)
        db.dispose()
        return summary


def _retire_partitions(
    instance: dg.DagsterInstance,
    sync_db: SyncDatabaseResource,
    supplier: SupplierResource,
    scope: AccountScope,
    codes: Sequence[str],
    allow_mass_drop: bool,
) -> RetirePlan:
    """The retirement plan of the supplier's city list; the partitions of the cities that
    retire leave the active set before the run (their history stays).

    Raises:
        EmptyCityList: The supplier listed no city (nothing retires, nothing runs).
    """
    db = SyncDatabase.open(sync_db.db_url)
    try:
        plan = plan_for(
            instance,
            db,
            scope,
            supplier_id=supplier.supplier_id,
            listed=codes,
            allow_mass_drop=allow_mass_drop,
        )
    finally:
        db.dispose()
    drop_partitions(instance, scope, retiring_keys(instance, scope, plan))
    return plan


def _retire(
    db: SyncDatabase, supplier: SupplierResource, plan: RetirePlan, summary: SyncSummary
) -> None:
    """Retires the plan's cities against the sync's batch (their hotels count a miss), and
    files the ticket of a held drop; the summary names them."""
    retire_cities(
        db,
        plan,
        supplier_id=supplier.supplier_id,
        batch_id=summary.batch_id,
        task_code=supplier.task_code,
    )
    summary.retired_cities = list(plan.retire)
    summary.held_cities = list(plan.held)


def _materialize_ranges(
    instance: dg.DagsterInstance,
    ranges: Sequence[tuple[str, str]],
    *,
    resources: dict[str, Any],
    tags: dict[str, str],
    scope: AccountScope,
    console_log_level: str,
    keep_going: bool,
    after: Callable[[dg.ExecuteInProcessResult], None] | None = None,
) -> tuple[list[str], dg.ExecuteInProcessResult]:
    """Runs each range; returns the cities run (a range's start) and the first failed run's
    result (else the last one's). With ``keep_going`` (single cities), a failed city does
    not stop the others: only an interruption does. ``after`` sees each run's result."""
    attempted: list[str] = []
    failed: dg.ExecuteInProcessResult | None = None
    result: dg.ExecuteInProcessResult | None = None
    for start, end in ranges:
        result = dg.materialize(
            [build_city_sync(scope)],
            instance=instance,
            resources=resources,
            tags={
                **tags,
                "dagster/asset_partition_range_start": start,
                "dagster/asset_partition_range_end": end,
                # The run executes in this process: run monitoring can tell when it dies.
                WORKER_HOST_TAG: this_host(),
            },
            raise_on_error=False,
            run_config=_console_config(console_log_level),
        )
        attempted.append(start)
        if after is not None:
            after(result)
        if not result.success:
            failed = failed or result
            if not keep_going or was_interrupted(result):
                break
    assert result is not None
    return attempted, failed or result


def _lineage_after(
    instance: dg.DagsterInstance,
    lineage: CommandLineage | None,
    sync_db: SyncDatabaseResource,
    assets: Collection[dg.AssetKey],
) -> Callable[[dg.ExecuteInProcessResult], None] | None:
    """What sends an ended run's OpenLineage events (of ``assets``), if the command has
    lineage."""
    if lineage is None:
        return None

    def after(result: dg.ExecuteInProcessResult) -> None:
        error = None if result.success else run_failure(result)
        lineage.finished(instance, result.run_id, sync_db, assets, error)

    return after


def _refused(
    sync_db: SyncDatabaseResource,
    supplier: SupplierResource,
    scope: AccountScope,
    trigger_id: str,
    err: SupplierError,
    started: float,
) -> SyncSummary:
    """The summary of a trigger whose supplier failed its city list: its batch FAILED with
    the cause (the alerts see it), no Dagster run."""
    db = SyncDatabase.open(sync_db.db_url)
    try:
        settings = run_settings(sync_db, supplier, GovernanceResource())
        refuse_trigger(db, settings=settings, trigger_id=trigger_id, source="MANUAL", err=err)
        summary = summarize(db, supplier.task_code, trigger_id, time.perf_counter() - started)
    finally:
        db.dispose()
    summary.run_error = describe_error(err)
    _where(summary, supplier, scope)
    return summary


def _where(summary: SyncSummary, supplier: SupplierResource, scope: AccountScope) -> None:
    """What a refused key's or an unreachable supplier's line names: the key's variable, the
    supplier's address."""
    summary.key_setting = api_key_setting(scope)
    base_url = getattr(supplier, "base_url", None)
    if base_url:
        url = urlsplit(base_url)
        port = url.port or (443 if url.scheme == "https" else 80)
        summary.supplier_address = f"{url.hostname}:{port}"


INTERRUPTIONS = frozenset(
    {"DagsterExecutionInterruptedError", "KeyboardInterrupt", "SyncInterrupted"}
)


def was_interrupted(result: dg.ExecuteInProcessResult) -> bool:
    """Whether the run was interrupted (a signal, a termination), not failed: in its step,
    or in Dagster's own work around it (the run then fails or is canceled without a step
    failure)."""
    if any(
        e.step_failure_data.error is not None
        and e.step_failure_data.error.cls_name in INTERRUPTIONS
        for e in result.get_step_failure_events()
    ):
        return True
    if result.dagster_run.status in (dg.DagsterRunStatus.CANCELED, dg.DagsterRunStatus.CANCELING):
        return True
    failure = result.get_run_failure_event()
    message = failure.message if failure is not None else ""
    return any(name in (message or "") for name in INTERRUPTIONS)


@dataclass
class IncrementalSummary:
    """What an incremental run did (one window), for the terminal and for ``--json``."""

    trigger_id: str
    run_success: bool
    batch_id: str = ""
    status: str = ""
    window: dict[str, Any] = field(default_factory=dict)
    cities: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    dagster_run_id: str = ""
    run_error: str = ""
    # the signal that stopped the window (SIGTERM, SIGINT), or "interrupted"
    interrupted: str = ""

    def to_json(self) -> str:
        """The summary as one JSON object."""
        return json.dumps(asdict(self), sort_keys=True, default=str)

    def exit_status(self) -> int:
        """The command's exit status: 0 done, 1 not, 128 + the signal's number when a
        signal stopped it."""
        if self.interrupted:
            return interrupted_status(self.interrupted)
        return 0 if self.problem() is None else 1

    def problem(self) -> str | None:
        """Why the window did not complete, in one line (None: it did)."""
        if self.run_success:
            return None
        if self.interrupted:
            return (
                f"incremental sync interrupted ({self.interrupted}); resume with --trigger-id "
                f"{shlex.quote(self.trigger_id)}"
            )
        return f"incremental sync failed: {self.run_error or 'no reason recorded'}"

    def render(self) -> str:
        """The summary as text for a terminal."""
        if not self.batch_id:
            return f"trigger {self.trigger_id}: no window ({self.run_error})"
        w = self.window
        lines = [
            f"window {self.batch_id}: {self.status}",
            f"watermark {w.get('watermark_before') or '(none: from the last full sync)'} -> "
            f"{w.get('watermark_after') or '(unchanged)'}",
            f"changes {w.get('changes', 0)} in {w.get('pages', 0)} pages: published "
            f"{w.get('published', 0)}, dead letters {w.get('dead_letters', 0)}, skipped "
            f"{w.get('skipped', 0)} (held for review {w.get('held_for_review', 0)})",
            f"cities touched: {len(self.cities)}"
            + (f" ({_fmt(dict(list(self.cities.items())[:8]))})" if self.cities else ""),
            f"elapsed {self.seconds:.1f} s",
        ]
        if w.get("held_window"):
            lines.append(
                "the window's volume was far above its usual: its diffs wait in "
                f"supplier-sync review list --batch {self.batch_id}"
            )
        return "\n".join(lines)


def run_incremental_sync(
    *,
    supplier: SupplierResource,
    sync_db: SyncDatabaseResource | None = None,
    payloads: PayloadStoreResource | None = None,
    config: dict[str, Any] | None = None,
    trigger_id: str | None = None,
    console_log_level: str = "WARNING",
    scope: AccountScope = DEFAULT_SCOPE,
    signals: SignalLog | None = None,
    lineage: CommandLineage | None = None,
) -> IncrementalSummary:
    """Runs one incremental window in a Dagster run (the ``incremental_sync`` job's asset);
    ``signals`` says which signal interrupted it, if one did; the run's OpenLineage events
    go out through ``lineage``."""
    feed = build_hotel_change_feed(scope)
    feed_key = scope.key(CHANGE_FEED.path[-1])

    sync_db = sync_db or SyncDatabaseResource()
    payloads = payloads or PayloadStoreResource()
    task_code = (config or {}).get("task_code") or scope.incremental_task_code
    with dagster_instance() as instance:
        trigger_id = trigger_id or f"cli-{uuid.uuid4().hex[:16]}"
        started = time.perf_counter()
        run_config = _console_config(console_log_level)
        result = dg.materialize(
            [feed],
            instance=instance,
            resources=_run_resources(sync_db, payloads, supplier, scope),
            tags={
                **scope.tags,
                TRIGGER_TAG: trigger_id,
                SOURCE_TAG: "MANUAL",
                TASK_TAG: task_code,
                WORKER_HOST_TAG: this_host(),
            },
            raise_on_error=False,
            run_config=dg.RunConfig(
                ops={feed.op.name: IncrementalConfig(**(config or {}))},
                loggers=run_config.loggers,
            ),
        )
        if (after := _lineage_after(instance, lineage, sync_db, feed.keys)) is not None:
            after(result)
        summary = IncrementalSummary(
            trigger_id=trigger_id,
            run_success=result.success,
            seconds=time.perf_counter() - started,
            dagster_run_id=result.run_id,
            run_error="" if result.success else run_failure(result),
        )
        if not result.success:
            summary.interrupted = (signals.received() if signals else "") or (
                "interrupted" if was_interrupted(result) else ""
            )
        for event in result.get_asset_materialization_events():
            m = event.step_materialization_data.materialization
            values: dict[str, Any] = {k: v.value for k, v in m.metadata.items()}
            if m.asset_key == feed_key:
                summary.window = values
                summary.batch_id = str(values.get("batch_id", ""))
                summary.status = str(values.get("status", ""))
            elif m.partition is not None:
                summary.cities[str(values.get("city", m.partition))] = int(
                    values.get("published", 0)
                )
        if not summary.batch_id:
            db = SyncDatabase.open(sync_db.db_url)
            try:
                batch = _batch_of(db, task_code, trigger_id)
            finally:
                db.dispose()
            if batch is not None:
                summary.batch_id, summary.status = batch.batch_id, batch.status
        return summary


def _add_city_partitions(
    instance: dg.DagsterInstance, cities: Sequence[str], partitions: str = CITY_PARTITIONS
) -> list[str]:
    """Adds the partitions of ``cities`` the instance does not have; returns their keys."""
    keys = [encode_city_key(c) for c in cities]
    existing = set(instance.get_dynamic_partitions(partitions))
    missing = [k for k in keys if k not in existing]
    if missing:
        instance.add_dynamic_partitions(partitions, missing)
    return keys


def _run_resources(
    sync_db: SyncDatabaseResource,
    payloads: PayloadStoreResource,
    supplier: SupplierResource,
    scope: AccountScope = DEFAULT_SCOPE,
) -> dict[str, Any]:
    """The resources of a command-line run (the definitions bind the same keys).

    The ones built from the settings and options hold their values (the API key, the
    URLs with their passwords), not ``dg.EnvVar``: bound as they are, Dagster would store
    those values with the run's job snapshot (as its config defaults, shown in the UI).
    Handed over as objects, they leave no config behind.
    """
    return {
        "sync_db": dg.ResourceDefinition.hardcoded_resource(sync_db),
        "payloads": dg.ResourceDefinition.hardcoded_resource(payloads),
        scope.supplier_key: dg.ResourceDefinition.hardcoded_resource(supplier),
        "governance": GovernanceResource(),
    }


def _console_config(log_level: str) -> dg.RunConfig:
    return dg.RunConfig(loggers={"console": {"config": {"log_level": log_level}}})


def run_failure(result: dg.ExecuteInProcessResult) -> str:
    """Why a run failed, in one line: its first step failure, else the run failure."""
    for event in result.get_step_failure_events():
        data = event.step_failure_data
        if data.user_failure_data is not None and data.user_failure_data.description:
            return _first_line(data.user_failure_data.description)
        if data.error is not None:
            # An exception raised in the asset is the cause of Dagster's wrapper error, and
            # may wrap its own root cause: say what happened, not only the wrapper.
            error = data.error
            while error.cause is not None:
                error = error.cause
            return _first_line(error.message)
    failure = result.get_run_failure_event()
    if failure is not None:
        return _first_line(failure.message or "")
    return ""


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _batch_of(db: SyncDatabase, task_code: str, trigger_id: str) -> Batch | None:
    # The trigger's own batch, or the abandoned batch it adopted and continued.
    with db.engine.connect() as conn:
        return batch_for_trigger(conn, task_code, trigger_id)


def resume_hint(sync_db: SyncDatabaseResource, task_code: str, trigger_id: str) -> str:
    """``"; resume with --trigger-id ID"`` when the trigger has a batch left unfinished
    (RUNNING, PENDING, PARTIAL_FAILED, FAILED); else ``""`` (nothing to resume). Never
    raises: it only adds to a line already said."""
    try:
        db = SyncDatabase.open(sync_db.db_url)
        try:
            batch = _batch_of(db, task_code, trigger_id)
        finally:
            db.dispose()
    except Exception:  # the line says what it can without it
        return ""
    if batch is None or batch.status in ("SUCCESS", "CANCELLED"):
        return ""
    return f"; resume with --trigger-id {shlex.quote(trigger_id)}"


def _report_progress(
    db: SyncDatabase,
    task_code: str,
    trigger_id: str,
    cities: int,
    stop: threading.Event,
    out: TextIO | None,
) -> None:
    if out is None:
        return
    started = time.monotonic()
    tty = out.isatty()
    last = ""
    while not stop.wait(0.5 if tty else 5.0):
        try:
            batch = _batch_of(db, task_code, trigger_id)
        except Exception:  # progress display only
            continue
        if batch is None:
            continue
        elapsed = time.monotonic() - started
        rate = batch.fetched_count / elapsed if elapsed else 0.0
        pct = float(batch.progress_percent)
        width = 30
        bar = "#" * int(width * pct / 100)
        line = (
            f"[{bar:<{width}}] {pct:5.1f}%  cities {batch.shards_done}/{cities}  "
            f"pages {batch.pages_done}  hotels {batch.fetched_count}  {rate:,.0f}/s  "
            f"ETA {time_left(elapsed, pct)}"
        )
        if line != last:
            out.write(("\r" + line) if tty else (line + "\n"))
            out.flush()
            last = line
    if tty and last:
        out.write("\n")


def summarize(db: SyncDatabase, task_code: str, trigger_id: str, seconds: float) -> SyncSummary:
    """The summary of the batch of a trigger, read back from the sync database."""
    batch = _batch_of(db, task_code, trigger_id)
    if batch is None:
        log = schema.trigger_log.c
        with db.engine.connect() as conn:
            reason = conn.execute(
                sa.select(log.reason).where(
                    log.task_code == task_code,
                    log.trigger_id == trigger_id,
                    log.outcome == "SKIPPED",
                )
            ).scalar()
        return SyncSummary(
            "", trigger_id, "NOT_CREATED", False, seconds=seconds, skip_reason=reason or ""
        )
    gated: dict[str, str] = {}
    failed: dict[str, str] = {}
    with db.engine.connect() as conn:
        for shard_key, error_message in _failed_shards(conn, batch.batch_id):
            message = error_message or "no error recorded"
            if message.startswith(GATED_PREFIX):
                gated[shard_key] = message[len(GATED_PREFIX) :]
            else:
                failed[shard_key] = message
        by_code = count_dead_letters(conn, batch.batch_id)
        by_type = _count_diffs(conn, batch.batch_id, schema.diff_log.c.diff_type)
        by_action = _count_diffs(conn, batch.batch_id, schema.diff_log.c.action)
    return SyncSummary(
        batch_id=batch.batch_id,
        trigger_id=trigger_id,
        status=batch.status,
        run_success=False,
        cities=batch.shard_count,
        cities_done=batch.shards_done,
        records=batch.total_count,
        published=batch.success_count,
        dead_letters=batch.failed_count,
        skipped=batch.skipped_count,
        counts_add_up=batch.total_count
        == batch.success_count + batch.failed_count + batch.skipped_count,
        dead_letters_by_code=by_code,
        diffs_by_type=by_type,
        diffs_by_action=by_action,
        seconds=seconds,
        hotels_per_second=batch.total_count / seconds if seconds else 0.0,
        gated_cities=gated,
        failed_cities=failed,
        error=batch.error_message or "",
        cancelled=(batch.error_message or "cancelled") if batch.status == "CANCELLED" else "",
    )


def _failed_shards(conn: sa.Connection, batch_id: str) -> list[tuple[str, str | None]]:
    """(shard key, error message) of a batch's FAILED shards, in creation order: a batch of
    many cities reads only the few that failed."""
    sh = schema.shard.c
    rows = conn.execute(
        sa.select(sh.shard_key, sh.error_message)
        .where(sh.batch_id == batch_id, sh.status == "FAILED")
        .order_by(sh.id)
    ).all()
    return [(str(key), message) for key, message in rows]


def _count_diffs(conn: sa.Connection, batch_id: str, column: sa.Column[Any]) -> dict[str, int]:
    """A batch's diffs counted by ``column`` (their type, or the action taken)."""
    d = schema.diff_log.c
    rows = conn.execute(
        sa.select(column, sa.func.count()).where(d.batch_id == batch_id).group_by(column)
    ).all()
    return {str(value): int(n) for value, n in rows}


DEMO_STATE = "demo_state.json"


def demo_day(advance: bool) -> int:
    """The simulated supplier's day for the next demo run (each successful run moves it on)."""
    path: Path = state_dir() / DEMO_STATE
    state: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    day = int(state.get("next_day", 0))
    if advance:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"next_day": day + 1}))
    return day


def run_replay(
    *,
    supplier: SupplierResource,
    cities: Sequence[str],
    sync_db: SyncDatabaseResource | None = None,
    payloads: PayloadStoreResource | None = None,
    trigger_id: str | None = None,
    console_log_level: str = "WARNING",
    scope: AccountScope = DEFAULT_SCOPE,
    lineage: CommandLineage | None = None,
) -> SyncSummary:
    """Re-materializes normalized_hotels and downstream for ``cities`` from stored raw pages.

    Goes through Dagster like any sync: one run per city (a city need not be next to the
    others in the partition order), every run of the call sharing one replay batch.
    No supplier request is made. ``scope`` is the account whose assets are materialized.
    Each run's OpenLineage events go out through ``lineage`` once it has ended.
    """
    sync_db = sync_db or SyncDatabaseResource()
    payloads = payloads or PayloadStoreResource()
    # Entering the instance makes it the one Dagster reads definitions state from,
    # whatever another instance of this process left behind.
    with dagster_instance() as instance:
        trigger_id = trigger_id or f"cli-{uuid.uuid4().hex[:16]}"
        keys = _add_city_partitions(instance, cities, scope.partitions_name)
        started = time.perf_counter()
        success = True
        run_id = run_error = ""
        selection = [scope.key(k.path[-1]) for k in (NORMALIZED, MAPPINGS, DIFFS, PUBLISHED)]
        after = _lineage_after(instance, lineage, sync_db, selection)
        for key in keys:
            result = dg.materialize(
                [build_city_sync(scope)],
                selection=selection,
                instance=instance,
                partition_key=key,
                resources=_run_resources(sync_db, payloads, supplier, scope),
                tags={**scope.tags, TRIGGER_TAG: trigger_id, SOURCE_TAG: "COMPENSATION"},
                raise_on_error=False,
                run_config=_console_config(console_log_level),
            )
            success = success and result.success
            run_id = result.run_id
            if after is not None:
                after(result)
            if not (result.success or run_error):
                run_error = run_failure(result)
        db = SyncDatabase.open(sync_db.db_url)
        try:
            summary = summarize(
                db, supplier.task_code, f"replay:{trigger_id}", time.perf_counter() - started
            )
        finally:
            db.dispose()
        summary.trigger_id = trigger_id  # what the caller passes to continue it, unprefixed
        summary.run_success = success
        summary.run_error = run_error
        summary.dagster_run_id = run_id
        summary.dagster_home = os.environ.get("DAGSTER_HOME", "")
        return summary
