"""The multi-host profile's run launcher: dagster-celery's, able to tell a lost worker host.

Checked in dagster-celery 0.29's source (``dagster_celery/launcher.py``, ``tasks.py``):
``CeleryRunLauncher`` sends each run as one ``execute_job`` task to the broker; a Celery
worker on any host takes it and executes the whole run in its pool process, with the job's
own executor (ours is the in-process one: a run is one step). Two things of it do not
hold on that version, and :class:`HostCeleryRunLauncher` replaces them:

- ``check_run_worker_health`` answers the task's state in the result backend. With the
  default ``rpc://`` backend another process (the monitoring daemon) never sees a state:
  every task is PENDING, which the monitoring daemon takes as a dead worker and fails
  every started run. With a shared backend (Redis), a task whose worker host was killed
  stays STARTED for ever, so its run is never failed. Here a STARTED task asks the worker
  that took it (its node name, recorded with the state) to answer a ping: no answer in
  ``ping_timeout_seconds`` means that host is gone (killed, frozen, cut off), the run has
  FAILED, and the deployment's ``run_retries`` launch it again on a host that answers.
- ``resume_run`` sends the resume task an argument it does not take
  (``execute_job_args_packed`` for ``resume_job_args_packed``), so a resumed run never
  starts: this launcher does not offer resuming (``max_resume_run_attempts: 0``).

And dagster-celery's run task executes the run inside the Celery pool process, a daemonic
process: a run that starts its own worker processes (``SUPPLIER_SYNC_WORKER_PROCESSES``, the
default for large runs) fails every city ("daemonic processes are not allowed to have
children"). The worker app's run task (:func:`register_run_task`, same name and arguments)
executes the run as ``dagster api execute_run`` does, in a child process forked from the pool
process, on the worker host's own instance (its ``DAGSTER_HOME``). The worker's main process
imports the run's code once (:func:`preload_run_code`), so a run no longer starts a new
interpreter that imports Dagster and the project again (seconds per run on a busy host).

:func:`worker_app` is the Celery app of a worker host (``celery -A
supplier_sync_dagster.dagster_instance.celery_worker worker``): the launcher's broker,
backend and queues from the same ``SUPPLIER_SYNC_CELERY_*`` variables, and the run task.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import pkgutil
import signal
import sys
import traceback
from collections.abc import Mapping
from typing import Any, Self

import dagster as dg
from celery import Celery
from dagster._cli.api import execute_run_command
from dagster._config import UserConfigSchema
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus
from dagster._grpc.types import ExecuteRunArgs
from dagster._serdes import ConfigurableClassData, serialize_value, unpack_value
from dagster_celery.config import DEFAULT_CONFIG, TASK_EXECUTE_JOB_NAME
from dagster_celery.launcher import CeleryRunLauncher
from dagster_celery.make_app import make_app
from dagster_celery.tags import DAGSTER_CELERY_QUEUE_TAG, DAGSTER_CELERY_TASK_ID_TAG
from kombu import Queue

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.dagster_instance.run_launcher import HOUSEKEEPING_TAGS

BROKER_ENV = "SUPPLIER_SYNC_CELERY_BROKER_URL"
BACKEND_ENV = "SUPPLIER_SYNC_CELERY_BACKEND_URL"
QUEUE_ENV = "SUPPLIER_SYNC_CELERY_QUEUE"
HOUSEKEEPING_QUEUE_ENV = "SUPPLIER_SYNC_CELERY_HOUSEKEEPING_QUEUE"
QUEUE = "dagster"
DEFAULT_PING_TIMEOUT_SECONDS = 5.0

# A worker host holds only the runs it executes: with early acknowledgement a busy worker
# reserves the next run too, and a host lost while busy takes that run down with it (it
# stays STARTING, never launched). Acknowledged late, a run's message goes back to the queue
# when its host's connection drops; Dagster ignores a second worker of a run that started.
# RabbitMQ's consumer_timeout (30 min by default) must exceed the longest run.
WORKER_CONFIG: dict[str, Any] = {
    **DEFAULT_CONFIG,
    "worker_prefetch_multiplier": 1,
    "task_acks_late": True,
    "task_track_started": True,
    "broker_connection_retry_on_startup": True,
}


class HostCeleryRunLauncher(CeleryRunLauncher):
    """``CeleryRunLauncher`` whose health check pings the worker host that took a run."""

    def __init__(
        self,
        default_queue: str = QUEUE,
        broker: str | None = None,
        backend: str | None = None,
        include: list[str] | None = None,
        config_source: dict[str, Any] | None = None,
        inst_data: ConfigurableClassData | None = None,
        ping_timeout_seconds: float = DEFAULT_PING_TIMEOUT_SECONDS,
        housekeeping_queue: str | None = None,
    ) -> None:
        if backend is None or backend.startswith("rpc"):
            raise ConfigError(
                "HostCeleryRunLauncher needs a result backend every host reads (e.g. "
                f"redis://host:6379/1 in {BACKEND_ENV}), not {backend!r}: with rpc:// run "
                "monitoring sees no task state and fails every run"
            )
        if not 0 < ping_timeout_seconds <= 300:
            raise ConfigError(
                f"ping_timeout_seconds must be in (0, 300], not {ping_timeout_seconds}"
            )
        if housekeeping_queue == default_queue:
            raise ConfigError(
                f"housekeeping_queue {housekeeping_queue!r} is the default queue: name "
                "another one, or leave it unset to run housekeeping on the sync hosts"
            )
        self.ping_timeout_seconds = ping_timeout_seconds
        self.housekeeping_queue = housekeeping_queue or None
        super().__init__(
            default_queue=default_queue,
            broker=broker,
            backend=backend,
            include=include,
            config_source={**WORKER_CONFIG, **(config_source or {})},
            inst_data=inst_data,
        )
        use_queue(self.celery, default_queue, self.housekeeping_queue)

    @classmethod
    def config_type(cls) -> UserConfigSchema:
        """``CeleryRunLauncher``'s fields plus ``ping_timeout_seconds`` and
        ``housekeeping_queue``."""
        base = dict(CeleryRunLauncher.config_type())  # type: ignore[arg-type]
        base["ping_timeout_seconds"] = dg.Field(
            float,
            is_required=False,
            default_value=DEFAULT_PING_TIMEOUT_SECONDS,
            description="How long a worker host may take to answer the health check's ping.",
        )
        base["housekeeping_queue"] = dg.Field(
            dg.Noneable(dg.StringSource),
            is_required=False,
            default_value=None,
            description="The queue of housekeeping runs (outbox, health, summaries, "
            "retention, reconciliation, operator actions); unset: the default queue.",
        )
        return base

    def _launch_celery_task_run(
        self, run: dg.DagsterRun, task_signature: Any, routing_key: str
    ) -> None:
        """Sends a housekeeping run to the housekeeping queue (unless its tags name a queue),
        so that it never waits behind, nor holds up, a host's city syncs."""
        if (
            self.housekeeping_queue is not None
            and DAGSTER_CELERY_QUEUE_TAG not in run.tags
            and all(run.tags.get(k) == v for k, v in HOUSEKEEPING_TAGS.items())
        ):
            routed = {DAGSTER_CELERY_QUEUE_TAG: self.housekeeping_queue}
            self._instance.add_run_tags(run.run_id, routed)
            run = run.with_tags({**run.tags, **routed})
        super()._launch_celery_task_run(run, task_signature, routing_key)

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]
    ) -> Self:
        """The launcher of ``dagster.yaml``'s ``run_launcher.config``."""
        return cls(inst_data=inst_data, **config_value)

    @property
    def supports_resume_run(self) -> bool:
        """dagster-celery's resume task is called with the wrong argument: never resume."""
        return False

    def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
        """FAILED when the task failed, or when the worker host that took it does not answer."""
        task_id = run.tags.get(DAGSTER_CELERY_TASK_ID_TAG)
        if task_id is None:
            return CheckRunHealthResult(WorkerStatus.RUNNING, "no Celery task yet")
        result = self.celery.AsyncResult(task_id)
        state = result.state
        if state == "SUCCESS":
            return CheckRunHealthResult(WorkerStatus.SUCCESS)
        if state == "FAILURE":
            return CheckRunHealthResult(WorkerStatus.FAILED, "the Celery task failed")
        info = result.info if isinstance(result.info, dict) else {}
        node = info.get("hostname")
        if state != "STARTED" or not isinstance(node, str):
            # Queued, or started without a recorded worker: the task's worker is not known.
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"Celery task {state}")
        try:
            answered = worker_answers(self.celery, node, self.ping_timeout_seconds)
        except BrokerUnreachable as err:
            # Which host is lost cannot be told without the broker; the lease stays the authority.
            return CheckRunHealthResult(
                WorkerStatus.RUNNING, f"worker {node} not pinged: {err}", run_worker_id=node
            )
        if answered:
            return CheckRunHealthResult(WorkerStatus.RUNNING, run_worker_id=node)
        return CheckRunHealthResult(
            WorkerStatus.FAILED,
            f"the Celery worker {node} running this run did not answer a ping within "
            f"{self.ping_timeout_seconds:g} s (its host was killed, frozen or cut off)",
            run_worker_id=node,
        )


class BrokerUnreachable(Exception):
    """The broker could not be reached to ping a worker (twice in a row)."""


def worker_answers(app: Celery, node: str, timeout: float) -> bool:
    """True when the Celery worker named ``node`` answers a ping within ``timeout`` s.

    A broker connection that fails (a pooled connection the broker closed, a reset) is
    retried once on a new connection.

    Raises:
        BrokerUnreachable: The broker failed both times.
    """
    with app.connection_for_write() as probe:
        failures = (OSError, *probe.connection_errors, *probe.channel_errors)
    try:
        replies = app.control.ping(destination=[node], timeout=timeout)
    except failures:
        try:  # a pooled connection the broker closed: once more, on a new connection
            with app.connection_for_write() as fresh:
                replies = app.control.ping(destination=[node], timeout=timeout, connection=fresh)
        except failures as err:
            raise BrokerUnreachable(f"the broker failed twice: {err!r}") from err
    return any(node in reply for reply in replies or [])


def use_queue(app: Celery, queue: str, housekeeping: str | None = None) -> None:
    """Routes the run task to ``queue`` (dagster-celery's app knows only ``dagster``): one
    broker can then serve several deployments, each with its own queue and workers. The
    ``housekeeping`` queue is declared too: a worker host consumes the queues its ``-Q``
    names."""
    app.conf.task_queues = [
        Queue(name, routing_key=f"{name}.#", queue_arguments={"x-max-priority": 10})
        for name in (queue, housekeeping)
        if name
    ]
    app.conf.task_default_queue = queue
    app.conf.task_routes = {
        TASK_EXECUTE_JOB_NAME: {"queue": queue, "routing_key": f"{queue}.{TASK_EXECUTE_JOB_NAME}"}
    }


def worker_app(env: Mapping[str, str] | None = None) -> Celery:
    """The Celery app of a worker host: the launcher's broker, backend and queue, the run task.

    Args:
        env: Where ``SUPPLIER_SYNC_CELERY_BROKER_URL``, ``_BACKEND_URL``, ``_QUEUE``
            (unset: ``dagster``) and ``_HOUSEKEEPING_QUEUE`` are read (the process's
            environment by default).

    Raises:
        ConfigError: The broker or the backend is not set.
    """
    source = os.environ if env is None else env
    broker, backend = source.get(BROKER_ENV), source.get(BACKEND_ENV)
    if not broker or not backend:
        raise ConfigError(
            f"a Celery worker host needs {BROKER_ENV} (amqp://user:pw@host:5672//) and "
            f"{BACKEND_ENV} (redis://host:6379/1), the launcher's broker and backend"
        )
    queue = source.get(QUEUE_ENV) or QUEUE
    housekeeping = source.get(HOUSEKEEPING_QUEUE_ENV) or None
    app = make_app(
        app_args={
            "broker": broker,
            "backend": backend,
            "include": [],
            "config_source": WORKER_CONFIG,
            "task_default_queue": queue,
        }
    )
    use_queue(app, queue, housekeeping)
    register_run_task(app)
    return app


def register_run_task(app: Celery) -> Any:
    """Registers the run task of a worker host: the run in a process of its own, forked from
    the pool process (in the worker's session, so the host's signals reach it)."""

    @app.task(bind=True, name=TASK_EXECUTE_JOB_NAME, track_started=True)
    def execute_job(_task: Any, execute_job_args_packed: Any) -> int:
        sent = unpack_value(execute_job_args_packed, as_type=ExecuteRunArgs)
        # This host's instance (DAGSTER_HOME), not the launching host's folders.
        here = ExecuteRunArgs(
            job_origin=sent.job_origin,
            run_id=sent.run_id,
            instance_ref=None,
            set_exit_code_on_failure=True,
        )
        return execute_run_forked(serialize_value(here))

    return execute_job


# What a run executes, loaded by :func:`preload_run_code`: Dagster's run entry point and the
# project's definitions (``defs/``'s modules are found when it runs).
RUN_CODE = ("dagster._cli.api", "supplier_sync_dagster.definitions", "supplier_sync_dagster.defs")


def preload_run_code() -> None:
    """Imports what a run executes (:data:`RUN_CODE` and every module under ``defs/``) once,
    in the worker host's main process: each run's process is forked with them loaded instead
    of importing them again (seconds on a busy host). Nothing is opened: importing reads no
    setting and connects to nothing."""
    for name in RUN_CODE:
        loaded = importlib.import_module(name)
    for module in pkgutil.walk_packages(loaded.__path__, f"{loaded.__name__}."):
        importlib.import_module(module.name)


def execute_run_forked(input_json: str) -> int:
    """Executes a run (``dagster api execute_run``'s arguments) in a child forked from this
    process, and returns its exit code.

    The child is the run's main process: it may start its own worker processes (a Celery
    pool process is daemonic, and multiprocessing refuses children to a daemonic process),
    takes the default signal handlers back from the pool's, and ends without the pool's exit
    handlers.
    """
    pid = os.fork()
    if pid:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    code = 1
    try:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_DFL)
        # The pool process's object (billiard's), as multiprocessing's current process: its
        # daemon flag would refuse the run's worker processes. This child is nobody's daemon.
        current = multiprocessing.current_process()
        if current.daemon:
            current.daemon = False
        code = _execute_run(input_json)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def _execute_run(input_json: str) -> int:
    """``dagster api execute_run INPUT_JSON`` in this process; its exit code."""
    try:
        execute_run_command.callback(input_json=input_json, compressed_input_json=None)  # type: ignore[misc]
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 1
    return 0
