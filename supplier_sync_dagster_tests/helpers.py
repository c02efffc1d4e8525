"""Helpers shared by every test folder: the simulator factory, its API key and hostile codes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.simulator import (
    HOSTILE_CITY_CODES as SIMULATOR_HOSTILE_CITY_CODES,
)
from supplier_sync_dagster.simulator import (
    FaultProfile,
    Simulator,
    SimulatorConfig,
    running_server,
)

# Not the simulator's default key: a test passes only if the key really travels from its
# configuration (environment, resource, CLI) to the request.
SIM_API_KEY = "test-sim-key"
# A key of the read API (SUPPLIER_SYNC_API_KEYS), and the header that sends it.
READ_API_KEY = "test-read-api-key-0123456789"
READ_API_HEADERS = {"X-Api-Key": READ_API_KEY}

# City codes that break paths, SQL, partition keys and case-insensitive comparisons: the
# simulator's hostile cities plus a few more it does not serve.
HOSTILE_CITY_CODES: tuple[str, ...] = (
    *SIMULATOR_HOSTILE_CITY_CODES,
    "東京都" * 21 + "京",  # 64 characters of non-ASCII
    "%2e%2e%2f",
    "../../etc/passwd",
    "..",
    ".",
    "...",
    "a/b",
    "東京都 ?#%",
    "BKK",
    "bkk",  # differs from BKK only by case: must stay a distinct city
)


def make_simulator(faults: FaultProfile | None = None, **settings: Any) -> Simulator:
    """A simulator that accepts :data:`SIM_API_KEY`.

    Args:
        faults: Its fault profile (clean when None).
        **settings: Any other :class:`SimulatorConfig` field (seed, n_cities, total_hotels...).

    Returns:
        The simulator, not served: use :func:`serve_simulator` or ``sim.transport()``.
    """
    return Simulator(
        SimulatorConfig(api_key=SIM_API_KEY, faults=faults or FaultProfile.clean(), **settings)
    )


@contextmanager
def serve_simulator(
    faults: FaultProfile | None = None, **settings: Any
) -> Iterator[tuple[Simulator, str]]:
    """:func:`make_simulator` served over real HTTP; yields the simulator and its base URL."""
    sim = make_simulator(faults, **settings)
    with running_server(sim) as url:
        yield sim, url


@contextmanager
def mysql_database_pair(server_url: str) -> Iterator[tuple[str, str]]:
    """Two new MariaDB databases, the Dagster instance's and the sync database; dropped on exit.

    Args:
        server_url: The server's URL, without a database.

    Yields:
        The instance's URL (mysql-connector, as dagster-mysql wants) and the sync database's.
    """
    names = (f"sst_dg_{uuid.uuid4().hex[:10]}", f"sst_sync_{uuid.uuid4().hex[:10]}")
    admin = sa.create_engine(server_url)
    with admin.begin() as conn:
        for name in names:
            conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    url = sa.make_url(server_url)
    try:
        yield (
            url.set(drivername="mysql+mysqlconnector", database=names[0]).render_as_string(
                hide_password=False
            ),
            url.set(database=names[1]).render_as_string(hide_password=False) + "?charset=utf8mb4",
        )
    finally:
        with admin.begin() as conn:
            for name in names:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


@contextmanager
def moto_bucket() -> Iterator[tuple[str, str]]:
    """A moto S3 server on loopback with a new bucket (credentials ``testing``).

    Yields:
        The server's endpoint URL and the bucket's name.
    """
    import boto3  # type: ignore[import-untyped]
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    bucket = f"sync-{uuid.uuid4().hex[:10]}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=bucket)
    try:
        yield endpoint, bucket
    finally:
        server.stop()


def stay(nights: int = 1, ahead: int = 14) -> dict[str, str]:
    """``check_in`` ``ahead`` days from today and ``check_out`` ``nights`` later, as a
    confirmation's body gives them (the read API refuses a stay in the past)."""
    check_in = date.today() + timedelta(days=ahead)
    return {
        "check_in": check_in.isoformat(),
        "check_out": (check_in + timedelta(days=nights)).isoformat(),
    }


def supplier_client(http: httpx.Client) -> SupplierClient:
    """The supplier client of the tests' simulator (``supplier_id`` "sim") over ``http``."""
    return SupplierClient(http, api_key=SIM_API_KEY, supplier_id="sim")


class Receiver:
    """An alert webhook or lineage endpoint on loopback: keeps every JSON body and its request's
    path and headers; refuses the next ``refuse`` of them (answering ``refuse_status``); waits
    ``delay`` seconds before answering (a slow endpoint)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.refuse = 0
        self.refuse_status = 503
        self.delay = 0.0
        self.stop = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.requests.append((self.path, dict(self.headers)))
                receiver.stop.wait(receiver.delay)
                if receiver.refuse > 0:
                    receiver.refuse -= 1
                    self.send_response(receiver.refuse_status)
                else:
                    receiver.bodies.append(body)
                    self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @classmethod
    @contextmanager
    def serve(cls) -> Iterator[Receiver]:
        """A receiver listening on loopback until the block ends."""
        r = cls()
        r.thread.start()
        try:
            yield r
        finally:
            r.stop.set()
            r.server.shutdown()
            r.server.server_close()

    def take(self) -> list[tuple[str, str]]:
        """(kind, condition) of the messages received since the last take."""
        got = [(b["alert"]["kind"], b["alert"]["condition"]) for b in self.bodies]
        self.bodies.clear()
        return got


@dataclass(frozen=True)
class Received:
    """A message a test queue received."""

    message_id: str | None
    routing_key: str | None
    type: str | None
    persistent: bool
    headers: dict[str, Any]
    body: dict[str, Any]


class BoundQueue:
    """A queue bound to every routing key of a topic exchange, as a subscriber's would be.

    Declared (with the exchange) when entered, deleted when left; :meth:`drain` reads what it
    holds. Each call uses a connection of its own, so a test needs no event loop.
    """

    def __init__(self, url: str, exchange: str) -> None:
        self.url, self.exchange = url, exchange
        self.name = f"test-{uuid.uuid4().hex[:12]}"

    async def _run(self, work: Callable[[Any], Awaitable[Any]]) -> Any:
        import aio_pika

        connection = await aio_pika.connect(self.url, timeout=5)
        try:
            channel = await connection.channel()
            return await work(channel)
        finally:
            await connection.close()

    def __enter__(self) -> BoundQueue:
        import aio_pika

        async def declare(channel: Any) -> None:
            exchange = await channel.declare_exchange(
                self.exchange, aio_pika.ExchangeType.TOPIC, durable=True
            )
            queue = await channel.declare_queue(self.name, durable=True)
            await queue.bind(exchange, routing_key="#")

        asyncio.run(self._run(declare))
        return self

    def __exit__(self, *exc: object) -> None:
        async def delete(channel: Any) -> None:
            await channel.queue_delete(self.name)

        asyncio.run(self._run(delete))

    def drain(self) -> list[Received]:
        """Every message in the queue now (acknowledged: a second drain sees new ones only)."""
        import aio_pika

        async def get_all(channel: Any) -> list[Received]:
            queue = await channel.declare_queue(self.name, durable=True)
            out: list[Received] = []
            while True:
                message = await queue.get(no_ack=True, fail=False, timeout=5)
                if message is None:
                    return out
                out.append(
                    Received(
                        message_id=message.message_id,
                        routing_key=message.routing_key,
                        type=message.type,
                        persistent=message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT,
                        headers=dict(message.headers or {}),
                        body=json.loads(message.body),
                    )
                )

        return list(asyncio.run(self._run(get_all)))


class TcpProxy:
    """A loopback TCP proxy to a service, that a test can take down and bring back: the
    service "stops" for whoever connects through the proxy (open connections are cut, new
    ones refused) while it keeps running for everyone else. It listens on loopback unless
    told an address (and port) of its own, such as a network namespace's root-side veth."""

    def __init__(
        self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((listen_host, port))
        self.port = int(self._listener.getsockname()[1])
        self._listener.close()
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        """Accepts connections on :attr:`port` again."""
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((self.listen_host, self.port))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()
        return self

    def stop(self) -> None:
        """Refuses new connections and cuts the open ones."""
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def process_state(pid: int) -> str | None:
    """A process's state letter as ``/proc`` shows it (R, S, T stopped, Z a zombie nobody
    reaped), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_http(url: str, proc: Any, *, timeout: float = 60.0) -> None:
    """Waits until ``url`` answers 200, failing early if the server process ``proc`` exits.

    Raises:
        RuntimeError: It did not answer within ``timeout`` seconds, or the process exited.
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _, err = proc.communicate(timeout=10) if proc.poll() is not None else ("", "")
            raise RuntimeError(f"{url} did not answer: {err or 'timeout'}")
        time.sleep(0.2)


def cli_process(*argv: str, env: dict[str, str], **popen: Any) -> Any:
    """``supplier-sync ARGV`` as a process of its own (a user's long-running command), its
    output captured as text; ``popen`` overrides the ``subprocess.Popen`` arguments (output to
    files, ``start_new_session`` for a process group of its own)."""
    import subprocess
    import sys

    options: dict[str, Any] = {
        "env": env,
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "text": True,
        **popen,
    }
    return subprocess.Popen([sys.executable, "-m", "supplier_sync_dagster.cli", *argv], **options)
