"""A multi-host deployment for one test: fresh MariaDB databases (the Dagster instance's and
the sync database), payloads in S3 (a moto server), the rate bucket and Celery results in
Redis, runs through RabbitMQ on a queue of the test's own, the simulator over real HTTP
counting each page request, and a control host (webserver + daemon) on the profile of
``deploy/celery/``. Worker hosts are started by the tests (``hosts.py``).
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import dagster as dg
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.dagster_instance.deployment import (
    DagsterProcesses,
    migrate_instance,
    profile_env,
)
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.simulator import Simulator
from supplier_sync_dagster.simulator.core import SimRequest, SimResponse
from supplier_sync_dagster.simulator.server import running_server
from supplier_sync_dagster_tests.cli.test_main import query
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, make_simulator
from supplier_sync_dagster_tests.multihost.hosts import PROFILE_YAML, WorkerHost


class PageCounter:
    """Serves a simulator and counts each city page request by its exact query."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self._lock = threading.Lock()
        self.pages: Counter[tuple[str, str]] = Counter()

    def dispatch(self, request: SimRequest) -> SimResponse:
        """Answers as the simulator does, counting ``/v1/cities/{city}/hotels`` requests."""
        parts = request.raw_path.decode("ascii", "replace").strip("/").split("/")
        if len(parts) == 4 and parts[:2] == ["v1", "cities"] and parts[3] == "hotels":
            asked = "&".join(
                f"{k}={v}" for k, v in sorted(parse_qsl(request.query.decode("ascii", "replace")))
            )
            with self._lock:
                self.pages[(parts[2], asked)] += 1
        return self.sim.dispatch(request)

    def refetched(self) -> Counter[str]:
        """City (as on the wire) -> how many of its page requests repeated an earlier one."""
        with self._lock:
            extra: Counter[str] = Counter()
            for (city, _), count in self.pages.items():
                if count > 1:
                    extra[city] += count - 1
            return extra


@dataclass
class Deployment:
    """A running deployment: services, simulator and control host; worker hosts on demand.

    Attributes:
        env: The settings every host shares (services, supplier, profile).
        dagster: The control host's webserver and daemon.
        sim: The simulator (its ground truth).
        counter: Its page requests.
        keys: Every city's partition key, added to the instance.
        root: The test's folder (one sub-folder per host).
    """

    env: dict[str, str]
    dagster: DagsterProcesses
    sim: Simulator
    counter: PageCounter
    keys: list[str]
    root: Path
    workers: list[WorkerHost] = field(default_factory=list)

    @property
    def instance(self) -> dg.DagsterInstance:
        """The Dagster instance (this process's ``DAGSTER_HOME`` is the control host's)."""
        return dg.DagsterInstance.get()


# The moto server logs every request of every host.
logging.getLogger("werkzeug").setLevel(logging.WARNING)


@dataclass(frozen=True)
class Services:
    """What a deployment runs on (a test's: the fixtures of ``conftest.py``; a benchmark's:
    ``helpers.mysql_database_pair`` and ``helpers.moto_bucket``).

    Attributes:
        databases: The Dagster instance's and the sync database's URLs (fresh, MariaDB).
        s3: The moto server's endpoint and a fresh bucket.
        redis_url: Redis (rate bucket, Celery results).
        amqp_url: RabbitMQ (Celery broker).
        root: The test's folder.
        setenv: Sets a variable of this process (to point it at the control host's
            instance): ``monkeypatch.setenv`` in a test.
    """

    databases: tuple[str, str]
    s3: tuple[str, str]
    redis_url: str
    amqp_url: str
    root: Path
    setenv: Callable[[str, str], None]


@contextmanager
def deployment(
    services: Services,
    *,
    settings: dict[str, str],
    hosts: Sequence[str],
    runs_per_host: int = 1,
    namespaces: bool = False,
    queues: Mapping[str, Sequence[str]] | None = None,
    **simulator: Any,
) -> Iterator[Deployment]:
    """A deployment of the celery profile for one test (see the module's docstring).

    Args:
        services: The test's services.
        settings: Further settings of every host (``SUPPLIER_SYNC_*``).
        hosts: The worker hosts' names: started while the control host starts, each
            answering its ping once this yields, killed when it ends.
        runs_per_host: Runs each worker host executes at once (``celery worker -c``).
        namespaces: Each worker host in a network namespace of its own (``netns.py``),
            reaching every service, the simulator and S3 only through its forwarders.
        queues: The queues a host takes runs from, by host name (``"sync"``, its
            ``SUPPLIER_SYNC_CELERY_QUEUE``, and ``"housekeeping"``); unset: both.
        **simulator: The simulator's settings (seed, n_cities, total_hotels...).
    """
    dagster_url, sync_url = services.databases
    # As deploy/celery/supplier-sync.env: MariaDB ends a transaction left idle (a frozen
    # host's) once its lease has expired, so its row locks do not block the hosts left.
    idle = settings.get("SUPPLIER_SYNC_LEASE_SECONDS", "180")
    sync_url += f"&init_command=SET+SESSION+idle_transaction_timeout%3D{idle}"
    endpoint, bucket = services.s3
    redis_url, amqp_url, root = services.redis_url, services.amqp_url, services.root
    queue = f"sst-{uuid.uuid4().hex[:10]}"
    sim = make_simulator(**simulator)
    counter = PageCounter(sim)
    home = root / "control" / "dagster_home"
    home.mkdir(parents=True)
    shutil.copy(PROFILE_YAML, home / "dagster.yaml")
    with running_server(counter) as sim_url:
        env = {
            "DAGSTER_MYSQL_URL": dagster_url,
            "SUPPLIER_SYNC_DB_URL": sync_url,
            "SUPPLIER_SYNC_SUPPLIER_URL": sim_url,
            "SUPPLIER_SYNC_SUPPLIER_API_KEY": SIM_API_KEY,
            "SUPPLIER_SYNC_PAYLOAD_URL": f"s3://{bucket}/supplier-sync",
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "SUPPLIER_SYNC_REDIS_URL": redis_url,
            "SUPPLIER_SYNC_CELERY_BROKER_URL": amqp_url,
            "SUPPLIER_SYNC_CELERY_BACKEND_URL": redis_url,
            "SUPPLIER_SYNC_CELERY_QUEUE": queue,
            "SUPPLIER_SYNC_CELERY_HOUSEKEEPING_QUEUE": f"{queue}-housekeeping",
            **settings,
        }
        control = profile_env(
            dagster_home=home,
            extra={
                **env,
                "HOSTNAME": "control",
                "POD_NAME": "control",
                "SUPPLIER_SYNC_HOME": str(root / "control" / "state"),
            },
        )
        for name in ("DAGSTER_HOME", "DAGSTER_MYSQL_URL", *env):
            services.setenv(name, control[name])
        migrate_instance(control)
        keys = [encode_city_key(code) for code in sim.city_codes()]
        dg.DagsterInstance.get().add_dynamic_partitions("supplier_city", keys)
        stack = ExitStack()
        workers = []
        for name in hosts:
            prefix: Sequence[str] = ()
            host_env: Mapping[str, str] = env
            if namespaces:
                # Imported here: it needs pytest (to skip without root), a benchmark does not.
                from supplier_sync_dagster_tests.multihost.netns import Namespace

                ns = stack.enter_context(Namespace(name.replace("-", "_")))
                prefix, host_env = ns.prefix, through(env, ns.url_host)
            named = {"sync": queue, "housekeeping": env["SUPPLIER_SYNC_CELERY_HOUSEKEEPING_QUEUE"]}
            own = [named[q] for q in (queues or {}).get(name, ())] or None
            workers.append(
                WorkerHost(name, root / "hosts" / name, host_env, prefix, runs_per_host, own)
            )
        try:
            for worker in workers:
                worker.start()
            with DagsterProcesses(control, root / "control" / "logs") as dagster:
                for worker in workers:
                    worker.wait_ready()
                yield Deployment(env, dagster, sim, counter, keys, root, workers)
        finally:
            for worker in workers:
                worker.kill()
            stack.close()


LOOPBACK = re.compile(r"127\.0\.0\.1:(\d+)")


def through(env: Mapping[str, str], url_host: Callable[[int], str]) -> dict[str, str]:
    """``env`` with each ``127.0.0.1:port`` replaced by ``url_host(port)`` (a namespace's
    forwarder of that port)."""
    return {k: LOOPBACK.sub(lambda m: url_host(int(m.group(1))), v) for k, v in env.items()}


def shard_rows(db_url: str) -> list[sa.Row[Any]]:
    """Every shard: key, status, claims, its last worker."""
    s = schema.shard.c
    return query(db_url, sa.select(s.shard_key, s.status, s.claim_count, s.worker_id))


def catalog(db_url: str) -> dict[str, int]:
    """The published catalog: supplier hotel id -> version."""
    h = schema.platform_hotel.c
    rows = query(db_url, sa.select(h.supplier_hotel_id, h.supplier_version))
    return {row.supplier_hotel_id: row.supplier_version for row in rows}


def host_of(worker_id: str | None, hosts: Sequence[str]) -> str:
    """The host named in a worker id (``supplier-sync-<host>-<pid>-<start>``)."""
    for name in hosts:
        if worker_id and worker_id.startswith(f"supplier-sync-{name}-"):
            return name
    return f"unknown ({worker_id})"
