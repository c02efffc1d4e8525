"""A thin ASGI application around ``Simulator.dispatch``, for uvicorn.

It serves anything with that ``dispatch`` (a ``core.Dispatcher``): one ``Simulator``, or a
``SimulatorFleet`` of several suppliers. It passes the raw request path
(``scope["raw_path"]``) to the core, so percent-encoded slashes and dots in city codes survive
exactly (see ``paths``). The core runs in a worker
thread so that generating a big city never stalls the event loop; slow faults sleep with
``asyncio.sleep`` and hold no thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import quote

from supplier_sync_dagster.simulator.core import Dispatcher, SimRequest, SimResponse, body_chunks

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class SimulatorApp:
    """ASGI 3 application serving one ``Dispatcher`` (a simulator or a fleet)."""

    def __init__(self, sim: Dispatcher) -> None:
        """Wrap a simulator or a fleet.

        Args:
            sim: what answers the requests (its ``dispatch`` runs in a worker thread).
        """
        self.sim = sim

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI connection scope (``http``; ``lifespan`` is acknowledged)."""
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw_path = scope.get("raw_path")
        if not raw_path:
            # Servers without raw_path lose the difference between "/" and "%2F".
            raw_path = quote(scope["path"], safe="/").encode("ascii")
        raw_path = raw_path.split(b"?", 1)[0]
        headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])
        }
        request = SimRequest(
            scope["method"], raw_path, scope.get("query_string", b""), headers, b"".join(chunks)
        )
        resp = await asyncio.to_thread(self.sim.dispatch, request)
        if resp.delay:
            await asyncio.sleep(resp.delay)
        out_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers]
        out_headers.append((b"content-length", str(len(resp.body)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": out_headers})
        if resp.trickle is None and resp.cut_at is None:
            await send({"type": "http.response.body", "body": resp.body})
            return
        await _send_slowly_or_cut(resp, receive, send)


async def _send_slowly_or_cut(resp: SimResponse, receive: Receive, send: Send) -> None:
    """Send a body that trickles or stops short; a body cut short ends the connection (the
    server closes it when the application returns before the declared length)."""
    gone = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.ensure_future(watch())
    try:
        body = resp.body if resp.cut_at is None else resp.body[: resp.cut_at]
        for chunk, pause in body_chunks(body, resp.trickle):
            if pause:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(gone.wait(), pause)
            if gone.is_set():
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if resp.cut_at is None:
            await send({"type": "http.response.body", "body": b""})
    finally:
        watcher.cancel()


def create_app(sim: Dispatcher) -> SimulatorApp:
    """The ASGI application for ``sim`` (a ``Simulator`` or a ``SimulatorFleet``)."""
    return SimulatorApp(sim)
