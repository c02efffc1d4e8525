"""Where a run's OpenLineage events go, through the ``openlineage-python`` client.

An HTTP endpoint (``lineage_url``: Marquez's ``/api/v1/lineage``, or any OpenLineage HTTP
receiver) when one is configured, with an optional API key sent as a bearer token; else a
JSON-lines file in the state folder, one event a line, rotated to ``<file>.1`` when it would
pass its size cap (at most twice the cap on disk).

Lineage is a by-product of the sync: an endpoint that is down, slow or refusing never fails
or holds up the sync. Each request has a bounded timeout and no retry; a failed event is
counted (:attr:`LineageEmitter.failed`) and logged, never raised.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from openlineage.client import OpenLineageClient
from openlineage.client.client import Event
from openlineage.client.serde import Serde
from openlineage.client.transport import Transport
from openlineage.client.transport.http import ApiKeyTokenProvider, HttpConfig, HttpTransport
from openlineage.client.transport.transport import Config

from supplier_sync_dagster.core.redaction import redact_url

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 2.0
DEFAULT_FILE_MAX_BYTES = 64 * 1024 * 1024
# Where the file transport writes, under the state folder.
LINEAGE_FILE = Path("lineage") / "events.jsonl"


@dataclass(frozen=True)
class LineageConfig:
    """Where events go.

    Attributes:
        url: The OpenLineage HTTP endpoint's base URL; None: the file.
        api_key: Sent as ``Authorization: Bearer <key>`` to the endpoint (never logged).
        endpoint: The path under ``url`` that takes events.
        timeout_seconds: Connect and read timeout of one request.
        file: The JSON-lines file of the embedded default.
        file_max_bytes: The file's size cap; past it the file is rotated to ``<file>.1``.
    """

    url: str | None
    file: Path
    api_key: str | None = None
    endpoint: str = "api/v1/lineage"
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    file_max_bytes: int = DEFAULT_FILE_MAX_BYTES


class RotatingFileConfig(Config):
    """The bounded file transport's settings."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes


class RotatingFileTransport(Transport):
    """Appends each event as one JSON line; a line that would take the file past its cap
    first moves the file to ``<file>.1`` (replacing the older one)."""

    kind = "supplier_sync_rotating_file"
    config_class = RotatingFileConfig

    def __init__(self, config: RotatingFileConfig) -> None:
        self.path = config.path
        self.max_bytes = config.max_bytes
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        """Writes the event (processes that share the folder append whole lines)."""
        line = (Serde.to_json(event) + "\n").encode("utf-8")
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(line) > self.max_bytes:
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            with self.path.open("ab") as out:
                out.write(line)


class LineageEmitter:
    """Sends events; counts and logs what fails instead of raising.

    Attributes:
        sent: Events delivered.
        failed: Events lost (the endpoint down, slow or refusing; the file not writable).
        lost_in_process: Events every emitter of this process lost (a command or sensor
            makes one emitter per event; the log says this count).
    """

    lost_in_process = 0
    _lost_lock = threading.Lock()

    def __init__(self, config: LineageConfig) -> None:
        self.config = config
        self.sent = 0
        self.failed = 0
        self.where = redact_url(config.url) if config.url else str(config.file)
        self._client = OpenLineageClient(transport=self._transport(config))

    @staticmethod
    def _transport(config: LineageConfig) -> Transport:
        if config.url is None:
            return RotatingFileTransport(RotatingFileConfig(config.file, config.file_max_bytes))
        http = HttpConfig(
            url=config.url,
            endpoint=config.endpoint,
            timeout=config.timeout_seconds,
            # One attempt: the next run's events come soon, the sync must not wait.
            retry={"total": 0, "connect": 0, "read": 0, "status": 0, "redirect": 0},
        )
        if config.api_key:
            http.auth = ApiKeyTokenProvider({"api_key": config.api_key})
        return HttpTransport(http)

    def emit(self, event: Event) -> bool:
        """Sends one event; False (counted, logged) when it could not be delivered."""
        try:
            self._client.emit(event)
        except Exception as err:
            self.failed += 1
            with LineageEmitter._lost_lock:
                LineageEmitter.lost_in_process += 1
                lost = LineageEmitter.lost_in_process
            log.warning(
                "lineage event not delivered to %s (%d lost in this process): %s",
                self.where,
                lost,
                type(err).__name__ + ": " + str(err)[:300],
            )
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        """Releases the transport's connections."""
        try:
            self._client.close(timeout=0)
        except Exception:
            log.debug("closing the lineage transport failed", exc_info=True)
