"""Worker hosts of the multi-host profile, each its own process tree, on this machine.

A :class:`WorkerHost` is one Celery worker of ``deploy/celery/`` (``celery -A
supplier_sync_dagster.dagster_instance.celery_worker worker``) started in a session of its
own, with its own host name (``HOSTNAME``/``POD_NAME``: worker ids and Celery's node name
carry it), its own state folder (``SUPPLIER_SYNC_HOME``) and its own ``DAGSTER_HOME``
holding a copy of the profile's ``dagster.yaml``: everything it shares with other hosts
goes through the services in its environment (MariaDB, RabbitMQ, Redis, S3). ``prefix``
wraps its command (``ip netns exec NS``, from ``netns.py``), so the services' addresses
in ``env`` are whatever that prefix lets the host reach.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from celery import Celery

from supplier_sync_dagster.dagster_instance.celery_launcher import (
    HOUSEKEEPING_QUEUE_ENV,
    QUEUE,
    QUEUE_ENV,
    BrokerUnreachable,
    worker_answers,
    worker_app,
)
from supplier_sync_dagster.dagster_instance.deployment import ROOT

PROFILE_YAML = ROOT / "deploy" / "celery" / "dagster.yaml"


@dataclass
class WorkerHost:
    """One worker host: a Celery worker process tree of its own.

    Attributes:
        name: Its host name (``HOSTNAME``, ``POD_NAME``; Celery node ``supplier-sync@name``).
        root: Its own folder (state folder, Dagster home, log).
        env: The services' settings shared by every host (``SUPPLIER_SYNC_*``, ``AWS_*``,
            ``DAGSTER_MYSQL_URL``); the host adds its own name and folders.
        prefix: What its command is wrapped in (a network namespace), if anything.
        concurrency: Runs it executes at once (Celery pool processes).
        queues: The queues it takes runs from (``celery worker -Q``); None: the sync runs'
            and the housekeeping runs' queues of ``env``.
    """

    name: str
    root: Path
    env: Mapping[str, str]
    prefix: Sequence[str] = ()
    concurrency: int = 1
    queues: Sequence[str] | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def node(self) -> str:
        """Its Celery node name, as run health checks ping it."""
        return f"supplier-sync@{self.name}"

    @property
    def log(self) -> Path:
        """Its worker's output."""
        return self.root / "worker.log"

    def host_env(self) -> dict[str, str]:
        """The environment of its processes: the shared settings plus its own name and folders."""
        dagster_home = self.root / "dagster_home"
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith(("SUPPLIER_SYNC_", "AWS_"))},
            **self.env,
            "HOSTNAME": self.name,
            "POD_NAME": self.name,
            "SUPPLIER_SYNC_HOME": str(self.root / "state"),
            "DAGSTER_HOME": str(dagster_home),
        }

    def start(self) -> WorkerHost:
        """Starts its worker in a new session (its own process group)."""
        dagster_home = self.root / "dagster_home"
        dagster_home.mkdir(parents=True, exist_ok=True)
        (self.root / "state").mkdir(exist_ok=True)
        shutil.copy(PROFILE_YAML, dagster_home / "dagster.yaml")
        command = [
            *self.prefix,
            sys.executable,
            "-m",
            "celery",
            "-A",
            "supplier_sync_dagster.dagster_instance.celery_worker",
            "worker",
            *("-Q", ",".join(self.queues or self.all_queues())),
            *("-n", self.node, "-c", str(self.concurrency)),
            *("--without-gossip", "--without-mingle", "--loglevel", "INFO"),
        ]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env=self.host_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def all_queues(self) -> list[str]:
        """The sync runs' queue and, if the deployment names one, the housekeeping runs'."""
        housekeeping = self.env.get(HOUSEKEEPING_QUEUE_ENV)
        return [self.env.get(QUEUE_ENV, QUEUE), *([housekeeping] if housekeeping else [])]

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Waits until its worker answers a ping.

        Raises:
            RuntimeError: It exited or did not answer in time (with the end of its log).
        """
        app = worker_app(self.env)
        deadline = time.monotonic() + timeout
        try:
            while not answers_yet(app, self.node):
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited: {self.tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} did not answer: {self.tail()}")
        finally:
            app.close()

    def tail(self, chars: int = 3000) -> str:
        """The end of its worker's output."""
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def _signal(self, sig: signal.Signals) -> None:
        """Sends ``sig`` to its process group (every process of its tree that is left)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL to its whole process tree, as a host lost at once."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def freeze(self) -> None:
        """SIGSTOP to its whole process tree: every process of it stops where it is."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT to its whole process tree."""
        self._signal(signal.SIGCONT)


def answers_yet(app: Celery, node: str) -> bool:
    """Whether ``node`` answers a ping; a broker that fails while hosts start is "not yet"."""
    try:
        return worker_answers(app, node, 2.0)
    except BrokerUnreachable:
        time.sleep(1.0)
        return False
