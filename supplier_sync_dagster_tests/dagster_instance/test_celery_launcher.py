"""The multi-host launcher's health check, its config and the worker app, on RabbitMQ and Redis.

The check reads the task state that every host shares (Redis) and pings the worker that
took the run: a run whose worker does not answer is FAILED, where dagster-celery's own
launcher calls it running for ever. ``multihost/`` runs the whole profile.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import dagster as dg
import pytest
from dagster._core.launcher import WorkerStatus
from dagster_celery.launcher import CeleryRunLauncher
from dagster_celery.tags import DAGSTER_CELERY_QUEUE_TAG, DAGSTER_CELERY_TASK_ID_TAG

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.dagster_instance.celery_launcher import (
    BACKEND_ENV,
    BROKER_ENV,
    HOUSEKEEPING_QUEUE_ENV,
    QUEUE_ENV,
    BrokerUnreachable,
    HostCeleryRunLauncher,
    execute_run_forked,
    worker_answers,
    worker_app,
)
from supplier_sync_dagster.dagster_instance.run_launcher import HOUSEKEEPING_TAGS

pytestmark = pytest.mark.redis


@pytest.fixture
def launcher(amqp_url: str, redis_url: str) -> Iterator[HostCeleryRunLauncher]:
    made = HostCeleryRunLauncher(
        default_queue=f"sst-{uuid.uuid4().hex[:8]}",
        broker=amqp_url,
        backend=redis_url,
        ping_timeout_seconds=1,
    )
    yield made
    made.celery.close()


def run_with_task() -> tuple[dg.DagsterRun, str]:
    """A run launched as a Celery task (its id, with no state recorded yet)."""
    task_id = uuid.uuid4().hex
    return dg.DagsterRun(
        job_name="j", run_id=uuid.uuid4().hex, tags={DAGSTER_CELERY_TASK_ID_TAG: task_id}
    ), task_id


def test_a_started_run_whose_worker_does_not_answer_is_failed(launcher: HostCeleryRunLauncher):
    run, task_id = run_with_task()
    node = f"supplier-sync@gone-{uuid.uuid4().hex[:6]}"
    launcher.celery.backend.store_result(task_id, {"hostname": node, "pid": 4242}, "STARTED")

    checked = launcher.check_run_worker_health(run)
    assert checked.status == WorkerStatus.FAILED
    assert node in (checked.msg or "")
    # dagster-celery's own launcher, on the same state, calls the run healthy for ever.
    stock = CeleryRunLauncher.check_run_worker_health(launcher, run)
    assert stock.status == WorkerStatus.RUNNING


def test_a_broker_connection_that_fails_once_is_retried_on_a_new_one(
    launcher: HostCeleryRunLauncher, monkeypatch: pytest.MonkeyPatch
):
    node = f"supplier-sync@gone-{uuid.uuid4().hex[:6]}"
    calls: list[str] = []
    real_ping = launcher.celery.control.ping

    def reset_once(*args: object, **kwargs: object) -> object:
        calls.append(node)
        if len(calls) == 1:
            raise ConnectionResetError(104, "Connection reset by peer")
        return real_ping(*args, **kwargs)

    monkeypatch.setattr(launcher.celery.control, "ping", reset_once)
    assert worker_answers(launcher.celery, node, 0.5) is False  # asked again: nobody there
    assert len(calls) == 2


def test_a_broker_that_keeps_failing_leaves_the_run_running(
    launcher: HostCeleryRunLauncher, monkeypatch: pytest.MonkeyPatch
):
    run, task_id = run_with_task()
    node = f"supplier-sync@far-{uuid.uuid4().hex[:6]}"
    launcher.celery.backend.store_result(task_id, {"hostname": node, "pid": 4242}, "STARTED")

    def reset(*args: object, **kwargs: object) -> object:
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(launcher.celery.control, "ping", reset)
    with pytest.raises(BrokerUnreachable, match="failed twice"):
        worker_answers(launcher.celery, node, 0.5)
    # Without the broker no host can be called lost: the run is not failed for it.
    checked = launcher.check_run_worker_health(run)
    assert checked.status == WorkerStatus.RUNNING
    assert node in (checked.msg or "") and "not pinged" in (checked.msg or "")


def test_task_states_map_to_worker_states(launcher: HostCeleryRunLauncher):
    finished = {"SUCCESS": WorkerStatus.SUCCESS, "FAILURE": WorkerStatus.FAILED}
    for state, expected in finished.items():
        run, task_id = run_with_task()
        launcher.celery.backend.store_result(
            task_id, 0 if state == "SUCCESS" else RuntimeError("x"), state
        )
        assert launcher.check_run_worker_health(run).status == expected, state
    # Queued (no state yet): running, where the stock launcher's UNKNOWN fails the run.
    queued, _ = run_with_task()
    assert launcher.check_run_worker_health(queued).status == WorkerStatus.RUNNING
    assert (
        CeleryRunLauncher.check_run_worker_health(launcher, queued).status == WorkerStatus.UNKNOWN
    )
    untagged = dg.DagsterRun(job_name="j", run_id=uuid.uuid4().hex)
    assert launcher.check_run_worker_health(untagged).status == WorkerStatus.RUNNING


def test_the_launcher_refuses_a_backend_other_hosts_cannot_read(amqp_url: str):
    for backend in (None, "rpc://"):
        with pytest.raises(ConfigError, match="result backend every host reads"):
            HostCeleryRunLauncher(broker=amqp_url, backend=backend)
    with pytest.raises(ConfigError, match="ping_timeout_seconds"):
        HostCeleryRunLauncher(
            broker=amqp_url, backend="redis://127.0.0.1:6379/15", ping_timeout_seconds=0
        )


def test_resuming_is_not_offered(launcher: HostCeleryRunLauncher):
    # dagster-celery's resume_run sends its task an argument the task does not take.
    assert CeleryRunLauncher.supports_resume_run.fget(launcher) is True  # type: ignore[attr-defined]
    assert launcher.supports_resume_run is False


def test_the_launcher_is_read_from_the_profile_config(amqp_url: str, redis_url: str):
    config = {
        "broker": amqp_url,
        "backend": redis_url,
        "default_queue": "q1",
        "ping_timeout_seconds": 2.5,
    }
    made = HostCeleryRunLauncher.from_config_value(None, config)  # type: ignore[arg-type]
    try:
        assert made.ping_timeout_seconds == 2.5
        assert made.celery.conf.task_acks_late is True
        assert made.celery.conf.worker_prefetch_multiplier == 1
        assert made.celery.conf.task_routes["execute_job"]["queue"] == "q1"
    finally:
        made.celery.close()
    fields = HostCeleryRunLauncher.config_type()
    assert isinstance(fields, dict)
    assert {"broker", "backend", "ping_timeout_seconds"} <= set(fields)


def test_the_worker_app_takes_the_launcher_s_settings(amqp_url: str, redis_url: str):
    app = worker_app({BROKER_ENV: amqp_url, BACKEND_ENV: redis_url, QUEUE_ENV: "q2"})
    try:
        assert "execute_job" in app.tasks
        assert [q.name for q in app.conf.task_queues] == ["q2"]
        assert app.conf.task_acks_late is True
    finally:
        app.close()
    with pytest.raises(ConfigError, match=BROKER_ENV):
        worker_app({BACKEND_ENV: redis_url})


class _Signature:
    """A run task's signature that records where it was sent instead of sending it."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def apply_async(self, **kwargs: Any) -> Any:
        self.sent.append(kwargs)
        return SimpleNamespace(task_id=uuid.uuid4().hex)


@pytest.mark.parametrize("housekeeping_queue", [True, False], ids=["own-queue", "unset"])
def test_housekeeping_runs_go_to_their_own_queue_and_the_syncs_stay_on_theirs(
    amqp_url: str, redis_url: str, housekeeping_queue: bool
):
    queue = f"sst-{uuid.uuid4().hex[:8]}"
    own = f"{queue}-housekeeping" if housekeeping_queue else None
    launcher = HostCeleryRunLauncher(
        default_queue=queue, broker=amqp_url, backend=redis_url, housekeeping_queue=own
    )
    cases = {
        "housekeeping": (HOUSEKEEPING_TAGS, own or queue),
        "sync": ({}, queue),
        # A queue the run names itself wins (dagster-celery's own tag).
        "named": ({**HOUSEKEEPING_TAGS, DAGSTER_CELERY_QUEUE_TAG: "chosen"}, "chosen"),
    }
    try:
        with dg.instance_for_test() as instance:
            launcher.register_instance(instance)
            for name, (tags, expected) in cases.items():
                run = instance.add_run(
                    dg.DagsterRun(job_name=name, run_id=uuid.uuid4().hex, tags=tags)
                )
                signature = _Signature()
                launcher._launch_celery_task_run(run, signature, "execute_job")
                (sent,) = signature.sent
                assert (sent["queue"], sent["routing_key"]) == (
                    expected,
                    f"{expected}.execute_job",
                ), name
                stored = instance.get_run_by_id(run.run_id)
                assert stored is not None
                assert stored.tags.get(DAGSTER_CELERY_QUEUE_TAG) == tags.get(
                    DAGSTER_CELERY_QUEUE_TAG, own if name == "housekeeping" else None
                ), name
    finally:
        launcher.celery.close()
    with pytest.raises(ConfigError, match="is the default queue"):
        HostCeleryRunLauncher(
            default_queue=queue, broker=amqp_url, backend=redis_url, housekeeping_queue=queue
        )


def test_the_worker_app_declares_the_housekeeping_queue(amqp_url: str, redis_url: str):
    env = {BROKER_ENV: amqp_url, BACKEND_ENV: redis_url, QUEUE_ENV: "q3"}
    app = worker_app({**env, HOUSEKEEPING_QUEUE_ENV: "q3-housekeeping"})
    try:
        assert [q.name for q in app.conf.task_queues] == ["q3", "q3-housekeeping"]
        assert app.conf.task_routes["execute_job"]["queue"] == "q3"
    finally:
        app.close()


def test_a_forked_run_that_cannot_start_exits_1_and_this_process_goes_on(
    capfd: pytest.CaptureFixture[str],
):
    """The run's child says why on its stderr; its exit code is the task's result."""
    assert execute_run_forked("not the arguments of a run") == 1
    assert "Traceback" in capfd.readouterr().err
    assert execute_run_forked("not the arguments of a run") == 1  # the caller is unharmed
