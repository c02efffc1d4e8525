"""Run the simulator as a real HTTP server: blocking (CLI) or in a background thread (tests).

Both forms serve anything with ``Simulator.dispatch``'s signature (``core.Dispatcher``): one
``Simulator`` (``serve``, ``running_server``) or a ``SimulatorFleet`` of several suppliers
(``serve_fleet``, ``running_fleet_server``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from supplier_sync_dagster.simulator.app import create_app
from supplier_sync_dagster.simulator.config import SimulatorConfig
from supplier_sync_dagster.simulator.core import Dispatcher, Simulator
from supplier_sync_dagster.simulator.fleet import SimulatorFleet


def serve(
    config: SimulatorConfig | Simulator,
    host: str = "127.0.0.1",
    port: int = 8080,
    log_level: str = "info",
) -> None:
    """Serve the simulator with uvicorn until interrupted (for ``supplier-sync simulate``).

    Args:
        config: the configuration, or an already built simulator.
        host: interface to bind.
        port: TCP port to bind.
        log_level: uvicorn's log level.
    """
    sim = config if isinstance(config, Simulator) else Simulator(config)
    if sim.refuses_connections:
        # The supplier is down: nothing listens on the port until interrupted.
        threading.Event().wait()
    _serve_forever(sim, host, port, log_level)


def serve_fleet(
    fleet: SimulatorFleet,
    host: str = "127.0.0.1",
    port: int = 8080,
    log_level: str = "info",
) -> None:
    """Serve a fleet of suppliers with uvicorn until interrupted (for a CLI).

    Supplier ``s`` answers at ``http://{host}:{port}/s/v1/...``; see ``fleet``.

    Args:
        fleet: the fleet to serve.
        host: interface to bind.
        port: TCP port to bind.
        log_level: uvicorn's log level.
    """
    _serve_forever(fleet, host, port, log_level)


def _serve_forever(target: Dispatcher, host: str, port: int, log_level: str) -> None:
    uvicorn.run(
        create_app(target),
        host=host,
        port=port,
        log_level=log_level,
        lifespan="off",
        access_log=False,
    )


@contextlib.contextmanager
def running_server(
    sim: Dispatcher, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 10.0
) -> Iterator[str]:
    """Serve ``sim`` over real HTTP in a background thread while the block runs.

    Args:
        sim: what to serve: a ``Simulator``, or anything with its ``dispatch`` (a fleet).
        host: interface to bind (an IP address).
        port: TCP port; 0 picks a free one.
        startup_timeout: seconds to wait for the server to accept connections.

    Yields:
        The base URL, e.g. ``http://127.0.0.1:54321``.

    Raises:
        RuntimeError: the server did not start in time.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    url_host = f"[{host}]" if family == socket.AF_INET6 else host
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    if getattr(sim, "refuses_connections", False):
        # The port was free a moment ago and nobody listens on it: connections are refused.
        sock.close()
        yield f"http://{url_host}:{bound_port}"
        return
    config = uvicorn.Config(
        create_app(sim),
        log_level="warning",
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="sim-uvicorn", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the simulator's HTTP server did not start")
            time.sleep(0.01)
        yield f"http://{url_host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def running_fleet_server(
    fleet: SimulatorFleet, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 10.0
) -> contextlib.AbstractContextManager[str]:
    """Serve a fleet over real HTTP in a background thread while the ``with`` block runs.

    Example:
        >>> with running_fleet_server(fleet) as url:  # doctest: +SKIP
        ...     httpx.get(f"{url}/acme/v1/cities", headers={"X-Api-Key": "acme-basic"})

    Args:
        fleet: the fleet to serve.
        host: interface to bind (an IP address).
        port: TCP port; 0 picks a free one.
        startup_timeout: seconds to wait for the server to accept connections.

    Returns:
        A context manager yielding the server's base URL (``http://127.0.0.1:54321``);
        supplier ``s``'s base URL is that plus ``/s``.
    """
    return running_server(fleet, host=host, port=port, startup_timeout=startup_timeout)
