"""A loopback HTTP server that misbehaves on purpose, for what httpx.MockTransport cannot show:
bodies that trickle, connections cut mid-body, headers that never end, a gzip bomb on the wire.

Each request's path names its misbehaviour (:data:`Hostile.routes`); the server speaks raw
HTTP/1.1 on a socket so that nothing between it and the client tidies the bytes up.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import socketserver
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

CITIES = {"cities": [{"city_code": "BKK", "name": "Bangkok", "country_code": "TH"}], "total": 1}
CITIES_BODY = json.dumps(CITIES).encode()

Route = Callable[[socket.socket], None]


def head(sock: socket.socket, length: int | None, *extra: str, status: str = "200 OK") -> None:
    """Sends a status line and headers (Content-Length when ``length`` is given). The server
    answers one request a connection, so it says so: a client that reused the connection
    would race the close."""
    lines = [f"HTTP/1.1 {status}", "Content-Type: application/json", *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines.append("Connection: close")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())


def trickle(data: bytes, every: float) -> Route:
    """Prompt headers, then the body one byte per ``every`` seconds."""

    def route(sock: socket.socket) -> None:
        head(sock, len(data))
        for i in range(len(data)):
            sock.sendall(data[i : i + 1])
            time.sleep(every)

    return route


def slow_headers(every: float) -> Route:
    """The status line and headers one byte per ``every`` seconds (a body never comes)."""

    def route(sock: socket.socket) -> None:
        text = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Padding: " + b"a" * 10_000
        for i in range(len(text)):
            sock.sendall(text[i : i + 1])
            time.sleep(every)

    return route


def drip_before_timeout(pause: float) -> Route:
    """Prompt headers, then one body byte every ``pause`` seconds: each just inside a read
    timeout a little longer than ``pause``, so only a deadline on the whole request ends it."""

    def route(sock: socket.socket) -> None:
        head(sock, 1000)
        for _ in range(1000):
            time.sleep(pause)
            sock.sendall(b" ")

    return route


def cut(data: bytes, after: int) -> Route:
    """Declares ``len(data)`` bytes, sends ``after`` of them, closes the connection."""

    def route(sock: socket.socket) -> None:
        head(sock, len(data))
        sock.sendall(data[:after])

    return route


def body(data: bytes, *extra: str, declare: bool = True) -> Route:
    """A complete answer (``declare``: with Content-Length, else ended by closing)."""

    def route(sock: socket.socket) -> None:
        head(sock, len(data) if declare else None, *extra)
        sock.sendall(data)

    return route


def endless(chunk: bytes, total: int) -> Route:
    """``total`` bytes of ``chunk`` repeated, with no Content-Length (ended by closing)."""

    def route(sock: socket.socket) -> None:
        head(sock, None)
        sent = 0
        with contextlib.suppress(OSError):  # the client hangs up at its cap
            while sent < total:
                sock.sendall(chunk)
                sent += len(chunk)

    return route


@cache
def gzip_bomb(inflated: int = 300 * 2**20) -> bytes:
    """A gzip body of ``inflated`` zero bytes (a few hundred KB on the wire), made in pieces."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(2**20)
    parts = [packer.compress(zeros) for _ in range(inflated // len(zeros))]
    parts.append(packer.flush())
    return b"".join(parts)


def gzipped(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


class _Handler(socketserver.BaseRequestHandler):
    server: Hostile

    def handle(self) -> None:
        sock: socket.socket = self.request
        if self.server.greeting is not None:
            # Speaks first, whatever the client says (plain HTTP to a TLS handshake).
            with contextlib.suppress(OSError):
                sock.sendall(self.server.greeting)
            return
        received = b""
        while b"\r\n\r\n" not in received:
            data = sock.recv(65536)
            if not data:
                return
            received += data
        path = received.split(b" ", 2)[1].decode()
        self.server.paths.append(path)
        route = self.server.routes.get(path.split("?", 1)[0].rsplit("/v1", 1)[-1])
        with contextlib.suppress(OSError):  # the client gave up: that is the point
            if route is None:
                head(sock, 2, status="404 Not Found")
                sock.sendall(b"{}")
            else:
                route(sock)


class Hostile(socketserver.ThreadingTCPServer):
    """The server; ``routes`` maps a path after ``/v1`` (``/cities``) to its misbehaviour."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, routes: dict[str, Route], greeting: bytes | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routes = routes
        self.greeting = greeting
        self.paths: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/api/"


@contextlib.contextmanager
def serving(routes: dict[str, Route], *, greeting: bytes | None = None) -> Iterator[Hostile]:
    """The server on a free loopback port for the block (``greeting``: sent to every
    connection at once, and nothing else)."""
    server = Hostile(routes, greeting)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def plain(**body_fields: Any) -> bytes:
    """A JSON body."""
    return json.dumps(body_fields).encode()
