"""An HTTP transport whose every socket wait ends by the request's total deadline.

httpx's timeouts apply per operation: a read timeout of 30 s lets a body that trickles in at a
byte a second run for ever, and the timeout httpcore reads once per phase cannot be shortened
while a response is read. :class:`BoundedTransport` is httpx's own transport (an httpcore
connection pool) over a network backend whose connect, TLS handshake, write and every read
waits at most until the deadline of the request in flight, which :func:`deadline_scope` sets
for the calling thread (the client sets it around each attempt): past it, a read raises
``httpx.ReadTimeout`` at once.

Name resolution (``getaddrinfo``) is the operating system's and keeps the resolver's own
timeouts. Requests sent through a proxy that httpx mounts from the environment do not go
through this transport; the client's checks between body chunks still bound them.
"""

from __future__ import annotations

import contextlib
import contextvars
import ssl
import time
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore
import httpx

#: httpx's own default pool limits.
DEFAULT_LIMITS = httpx.Limits(
    max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0
)

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "supplier_request_deadline", default=None
)

# httpcore's errors as httpx's, most specific first (as httpx's own transport maps them).
_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


@contextlib.contextmanager
def deadline_scope(seconds: float) -> Iterator[None]:
    """Bounds every socket wait of this thread's requests in the block to ``seconds`` from now.

    Args:
        seconds: The time the block's requests may take, connect to last body byte.
    """
    token = _DEADLINE.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _bounded(timeout: float | None, error: type[Exception]) -> float | None:
    """``timeout`` cut to the time left before the deadline; ``error`` once none is left."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("the request's total deadline passed")
    return left if timeout is None else min(timeout, left)


@contextlib.contextmanager
def _as_httpx() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for source, target in _ERRORS:
            if isinstance(exc, source):
                raise target(str(exc)) from exc
        raise


class _Stream(httpcore.NetworkStream):
    """A connection whose waits end by the deadline of the request using it."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, bounded))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    """The standard library's sockets, each wait bounded by the request's deadline."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _Stream(self._inner.connect_tcp(host, port, bounded, local_address, socket_options))

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _Stream(self._inner.connect_unix_socket(path, bounded, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _Body(httpx.SyncByteStream):
    def __init__(self, inner: Iterable[bytes]) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        with _as_httpx():
            yield from self._inner

    def close(self) -> None:
        close = getattr(self._inner, "close", None)
        if close is not None:
            with _as_httpx():
                close()


def supplier_http_client(
    base_url: str, *, transport: httpx.BaseTransport | None = None
) -> httpx.Client:
    """The HTTP client of a supplier at ``base_url``: each endpoint's path joins onto the base
    URL's path, and the base URL's query (a token some suppliers authenticate by) goes with
    every request, beside the request's own parameters.

    httpx would append a path to the query of a base URL that has one
    (``?token=abc/v1/cities``); this client keeps the two apart.

    Args:
        base_url: The supplier API's base URL, as configured.
        transport: The transport; None: a :class:`BoundedTransport`.
    """
    url = httpx.URL(base_url)
    return httpx.Client(
        base_url=url.copy_with(query=None, fragment=None),
        params=url.params,
        transport=transport or BoundedTransport(),
    )


class BoundedTransport(httpx.BaseTransport):
    """httpx's HTTP/1.1 transport, each request's socket waits bounded by its deadline.

    Pass it as ``httpx.Client(transport=BoundedTransport())``; outside a
    :func:`deadline_scope` it behaves like ``httpx.HTTPTransport()``.
    """

    def __init__(
        self,
        *,
        verify: ssl.SSLContext | str | bool = True,
        limits: httpx.Limits = DEFAULT_LIMITS,
    ) -> None:
        """Create a transport.

        Args:
            verify: TLS verification, as httpx's ``verify`` (a context, a CA bundle, a flag).
            limits: Connection pool limits, as httpx's.
        """
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_Backend(),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """Send one request (httpx's transport interface)."""
        assert isinstance(request.stream, httpx.SyncByteStream)
        url = request.url
        target = httpcore.URL(
            scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
        )
        core_request = httpcore.Request(
            request.method,
            target,
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _as_httpx():
            response = self._pool.handle_request(core_request)
        assert isinstance(response.stream, Iterable)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_Body(response.stream),
            extensions=response.extensions,
        )

    def close(self) -> None:
        """Close every pooled connection."""
        self._pool.close()
