"""Where events go: an HTTP endpoint (a real server on loopback) with its key, else a capped
JSON-lines file; an endpoint that is down, slow or refusing loses the event, counted and
logged, never raised."""

from __future__ import annotations

import json
import logging
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from openlineage.client.event_v2 import RunEvent

from supplier_sync_dagster.core.lineage.emit import LineageConfig, LineageEmitter
from supplier_sync_dagster.core.lineage.events import Places, RunFacts, run_event
from supplier_sync_dagster_tests.helpers import Receiver, free_port
from supplier_sync_dagster_tests.openlineage_schema import validate_run_event

KEY = "lineage-key-0123456789"


def an_event() -> RunEvent:
    where = Places(
        db_url="sqlite:////state/sync.sqlite3",
        payload_url="file:///state/payloads",
        supplier_url=None,
        supplier_id=1001,
        search_url=None,
        search_file=Path("/state/search.sqlite3"),
        amqp_url=None,
        notifications_file=Path("/state/notifications.jsonl"),
    )
    facts = RunFacts(str(uuid.uuid4()), "city_sync", frozenset({"raw_hotel_snapshots"}))
    return run_event("START", facts, where, namespace="supplier_sync", event_time=datetime.now(UTC))


def test_the_file_keeps_whole_events_and_rotates_at_its_cap(tmp_path: Path):
    file = tmp_path / "lineage" / "events.jsonl"
    cap = 64 * 1024
    emitter = LineageEmitter(LineageConfig(url=None, file=file, file_max_bytes=cap))
    for _ in range(200):
        assert emitter.emit(an_event())
    assert (emitter.sent, emitter.failed) == (200, 0)
    rotated = file.with_name("events.jsonl.1")
    assert rotated.exists() and file.stat().st_size <= cap and rotated.stat().st_size <= cap
    for line in file.read_text().splitlines() + rotated.read_text().splitlines():
        validate_run_event(json.loads(line))


def test_the_endpoint_gets_each_event_with_the_key_as_a_bearer_token():
    with Receiver.serve() as receiver:
        emitter = LineageEmitter(
            LineageConfig(url=receiver.url.removesuffix("hook"), file=Path("unused"), api_key=KEY)
        )
        assert emitter.emit(an_event()) and emitter.emit(an_event())
    assert len(receiver.bodies) == 2
    for body in receiver.bodies:
        validate_run_event(body)
    path, headers = receiver.requests[0]
    assert path == "/api/v1/lineage"
    assert headers["Authorization"] == f"Bearer {KEY}"


def test_an_endpoint_that_is_down_or_refuses_loses_the_event_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
):
    down = LineageEmitter(
        LineageConfig(url=f"http://127.0.0.1:{free_port()}/", file=Path("unused"), api_key=KEY)
    )
    before = LineageEmitter.lost_in_process
    with caplog.at_level(logging.WARNING, "supplier_sync_dagster.core.lineage"):
        assert not down.emit(an_event())
        assert not down.emit(an_event())
    assert (down.sent, down.failed, LineageEmitter.lost_in_process) == (0, 2, before + 2)
    assert f"({before + 2} lost in this process)" in caplog.text and KEY not in caplog.text
    with Receiver.serve() as receiver:
        receiver.refuse = 1
        refused = LineageEmitter(LineageConfig(url=receiver.url, file=Path("unused")))
        assert not refused.emit(an_event())
        assert refused.emit(an_event())
    # No retry: the refused event was asked once.
    assert (refused.sent, refused.failed, len(receiver.requests)) == (1, 1, 2)


def test_a_slow_endpoint_is_given_up_on_at_the_timeout_without_a_retry():
    with Receiver.serve() as receiver:
        receiver.delay = 30.0
        slow = LineageEmitter(
            LineageConfig(url=receiver.url, file=Path("unused"), timeout_seconds=0.2)
        )
        assert not slow.emit(an_event())
        assert (slow.failed, len(receiver.requests), receiver.bodies) == (1, 1, [])
