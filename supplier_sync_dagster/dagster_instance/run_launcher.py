"""The run launcher of both instance profiles: Dagster's default, able to tell a dead worker.

Checked in Dagster 1.13.27's source: ``DefaultRunLauncher`` starts each run in a process
that the code server spawns. If that process dies, the code server marks the run failed
(``DagsterApiServer._check_for_orphaned_runs``), but only while the code server itself
runs: kill both (the OOM killer, a restarted container, ``kill -9`` of a process group)
and the run stays STARTED for ever. Run monitoring alone does not catch it:
``DefaultRunLauncher`` does not implement ``check_run_worker_health``, so the monitoring
daemon only times out runs stuck in STARTING or CANCELING (and runs past
``max_runtime_seconds``). Nor does anything watch a run executed in the process of
``supplier-sync sync --full``, which is simply killed.

:class:`LocalRunLauncher` is ``DefaultRunLauncher`` plus that health check, the same rule
as the shard leases' dead-holder shortcut (``core.processes``): a run whose worker ran on
this host, and whose process provably no longer runs, has FAILED; a worker on another
host, or one not yet known, is presumed to run. Dagster's run monitoring (``run_monitoring``
in ``dagster.yaml``) calls it for every STARTED run and marks a dead one FAILURE.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
from dagster._core.launcher import CheckRunHealthResult, LaunchRunContext, WorkerStatus
from dagster._core.remote_origin import ManagedGrpcPythonEnvCodeLocationOrigin

from supplier_sync_dagster.core.leasing.processes import pid_is_dead_here, this_host

# The host a run's worker process runs on, when known: set by the launcher for workers of
# a code server it started itself, and by the CLI for the run it executes in its process.
WORKER_HOST_TAG = "supplier_sync/worker_host"
# The kind of work of a job's runs: housekeeping (the outbox, health, summaries, retention,
# reconciliation, operator actions) may go to worker hosts of its own, off the city syncs'.
WORK_TAG = "supplier_sync/work"
HOUSEKEEPING_TAGS = {WORK_TAG: "housekeeping"}


class LocalRunLauncher(dg.DefaultRunLauncher):
    """``DefaultRunLauncher`` that reports a run worker of this host that died as FAILED."""

    @property
    def supports_check_run_worker_health(self) -> bool:
        """Run monitoring may ask this launcher whether a run's worker still runs."""
        return True

    def launch_run(self, context: LaunchRunContext) -> None:
        """Launches the run like ``DefaultRunLauncher``, noting the worker's host first.

        A code server started by this process (a ``python_module`` or ``python_file``
        location of the workspace) spawns its run workers on this host.
        """
        origin = context.dagster_run.remote_job_origin
        location = origin.repository_origin.code_location_origin if origin else None
        if isinstance(location, ManagedGrpcPythonEnvCodeLocationOrigin):
            self._instance.add_run_tags(context.dagster_run.run_id, {WORKER_HOST_TAG: this_host()})
        super().launch_run(context)

    def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
        """FAILED when the run's worker process ran on this host and no longer runs."""
        host = run.tags.get(WORKER_HOST_TAG)
        pid = worker_pid(self._instance, run.run_id)
        if host is None or pid is None:
            return CheckRunHealthResult(WorkerStatus.RUNNING, "worker host or pid not known")
        if host != this_host():
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"worker on another host ({host})")
        if pid_is_dead_here(pid):
            return CheckRunHealthResult(
                WorkerStatus.FAILED,
                f"the run worker process {pid} on {host} no longer runs (killed or crashed)",
                run_worker_id=str(pid),
            )
        return CheckRunHealthResult(WorkerStatus.RUNNING, run_worker_id=str(pid))


def worker_pid(instance: dg.DagsterInstance, run_id: str) -> int | None:
    """The pid of the process executing a run, from its engine events; None before it starts.

    Dagster records it when a code server starts the run worker ("Started process for
    run") and when the in-process executor starts ("Executing steps in process"): both
    carry a ``pid`` metadata entry.
    """
    for record in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        event = record.dagster_event
        if event is None:
            continue
        pid: Any = event.engine_event_data.metadata.get("pid")
        if pid is not None:
            try:
                return int(pid.value)
            except (TypeError, ValueError):
                continue
    return None
