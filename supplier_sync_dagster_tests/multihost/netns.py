"""Network namespaces as hosts for tests: a process in one sees only what is forwarded to it.

:class:`Namespace` makes a network namespace with a veth pair in a /24 of its own under
``10.77.0.0/16`` (the root side ``.1``, the namespace side ``.2``) and, on the root side,
TCP forwarders from ``service_address:port`` to ``127.0.0.1:port``: a process started with
``prefix`` reaches MariaDB, Redis, RabbitMQ, PostgreSQL, or any port forwarded (the moto server,
the simulator) at :attr:`Namespace.service_address`, and cannot reach the root namespace's
loopback, where those services listen. Everything is removed on exit, after a failed test too;
names carry the test process's pid, so namespaces a killed test run left behind are removed
by the next one (:func:`remove_stale`).

Needs root and iproute2's ``ip``; without them :func:`require_namespaces` skips the test with a
message, or fails it under ``SUPPLIER_SYNC_REQUIRE_SERVICES=1``.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from supplier_sync_dagster_tests.helpers import TcpProxy

# The ports of the services a host needs: MariaDB, Redis, RabbitMQ, PostgreSQL.
SERVICE_PORTS = (3306, 6379, 5672, 5432)
NETWORK = ipaddress.IPv4Network("10.77.0.0/16")
# Serializes choosing a free /24 and taking it, between test processes.
LOCK_FILE = Path("/tmp/supplier-sync-netns.lock")
NAME_PATTERN = re.compile(r"^ss-[A-Za-z0-9_]+-(?P<pid>\d+)-[0-9a-f]{6}$")


class NamespaceError(RuntimeError):
    """An ``ip`` command that sets up or removes a namespace failed."""


def require_namespaces() -> None:
    """Skips the calling test when network namespaces cannot be made here (not root, or no
    ``ip``), or fails it under ``SUPPLIER_SYNC_REQUIRE_SERVICES=1``."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    if shutil.which("ip") is None:
        missing.append("iproute2's ip command")
    if not missing:
        return
    message = (
        f"network namespaces need {' and '.join(missing)}: run the multi-host tests as root "
        "on Linux with iproute2"
    )
    if os.environ.get("SUPPLIER_SYNC_REQUIRE_SERVICES") == "1":
        pytest.fail(message + " (SUPPLIER_SYNC_REQUIRE_SERVICES=1)")
    pytest.skip(message)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs ``ip ARGS``.

    Raises:
        NamespaceError: It failed (with ``check``), with its message.
    """
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NamespaceError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def namespaces() -> list[str]:
    """The names of this machine's network namespaces."""
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Removes the namespaces of test processes that no longer run; returns their names."""
    removed = []
    for name in namespaces():
        found = NAME_PATTERN.match(name)
        if found is None or _alive(int(found["pid"])):
            continue
        _kill_inside(name)
        ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


class Namespace:
    """A network namespace as a host, for the duration of a ``with`` block.

    Args:
        name: What the namespace is for (letters, digits, underscores); its full name adds
            this process's pid and a random suffix, unique per test run.
        ports: Root-side ports forwarded from the start (default: the services').

    Attributes:
        name: The namespace's full name (``ip netns exec NAME``).
        prefix: The command prefix that runs a program inside it.
        service_address: The root side's address, where forwarded ports are reached from inside.
        address: The namespace side's address.
        root_link: The veth pair's root-side link (``inner_link`` is moved into the namespace).
    """

    def __init__(self, name: str, *, ports: Sequence[int] = SERVICE_PORTS) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_]{1,20}", name):
            raise ValueError(f"namespace name {name!r}: 1-20 letters, digits or underscores")
        token = uuid.uuid4().hex[:6]
        self.name = f"ss-{name}-{os.getpid()}-{token}"
        self.prefix = ["ip", "netns", "exec", self.name]
        self.root_link, self.inner_link = f"vr{token}", f"vn{token}"
        self._ports = tuple(ports)
        self._proxies: dict[int, TcpProxy] = {}
        self.service_address = ""
        self.address = ""

    def __enter__(self) -> Namespace:
        require_namespaces()
        remove_stale()
        try:
            self._create()
            for port in self._ports:
                self.forward(port)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def forward(self, port: int) -> int:
        """Forwards ``service_address:port`` to ``127.0.0.1:port`` of the root namespace.

        Returns:
            The port, for URLs.
        """
        if port not in self._proxies:
            proxy = TcpProxy("127.0.0.1", port, listen_host=self.service_address, port=port)
            self._proxies[port] = proxy.start()
        return port

    def url_host(self, port: int) -> str:
        """``service_address:port`` after forwarding the port: the host part of a URL."""
        return f"{self.service_address}:{self.forward(port)}"

    def run(
        self, *argv: str, env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Runs a program inside the namespace and waits for it, its output captured."""
        return subprocess.run(
            [*self.prefix, *argv], env=env, capture_output=True, text=True, timeout=timeout
        )

    def close(self) -> None:
        """Stops the forwarders, ends the processes still inside, removes the namespace and
        its veth pair; never raises for what is already gone."""
        for proxy in self._proxies.values():
            proxy.stop()
        self._proxies.clear()
        if self.name in namespaces():
            _kill_inside(self.name)
            ip("netns", "del", self.name, check=False)
        ip("link", "del", self.root_link, check=False)

    def _create(self) -> None:
        with _locked():
            subnet = _free_subnet()
            root, inner = subnet[1], subnet[2]
            ip("netns", "add", self.name)
            ip("link", "add", self.root_link, "type", "veth", "peer", "name", self.inner_link)
            ip("addr", "add", f"{root}/{subnet.prefixlen}", "dev", self.root_link)
        ip("link", "set", self.inner_link, "netns", self.name)
        ip("link", "set", self.root_link, "up")
        ip("-n", self.name, "addr", "add", f"{inner}/{subnet.prefixlen}", "dev", self.inner_link)
        ip("-n", self.name, "link", "set", self.inner_link, "up")
        ip("-n", self.name, "link", "set", "lo", "up")
        self.service_address, self.address = str(root), str(inner)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with LOCK_FILE.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of :data:`NETWORK` that no address of the root namespace is in."""
    used = [
        ipaddress.ip_interface(found[1]).network
        for line in ip("-o", "-4", "addr", "show").stdout.splitlines()
        if (found := re.search(r"inet (\S+)", line))
    ]
    for subnet in NETWORK.subnets(new_prefix=24):
        if not any(subnet.overlaps(network) for network in used):
            return subnet
    raise NamespaceError(f"every /24 of {NETWORK} is taken")


def _kill_inside(name: str) -> None:
    """Kills the processes a test started inside the namespace."""
    for pid in ip("netns", "pids", name, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = [
    "SERVICE_PORTS",
    "Namespace",
    "NamespaceError",
    "ip",
    "namespaces",
    "remove_stale",
    "require_namespaces",
]
