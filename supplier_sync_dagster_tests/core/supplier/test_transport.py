"""BoundedTransport: httpx's transport, every socket wait ended by the request's deadline."""

from __future__ import annotations

import time

import httpx
import pytest

from supplier_sync_dagster.core.supplier import BoundedTransport, deadline_scope
from supplier_sync_dagster_tests.core.supplier.hostile_server import (
    CITIES_BODY,
    body,
    closed_port,
    serving,
    trickle,
)


def test_it_speaks_http_inside_and_outside_a_deadline() -> None:
    with (
        serving({"/cities": body(CITIES_BODY, "X-Extra: 1")}) as server,
        httpx.Client(base_url=server.url, transport=BoundedTransport()) as http,
    ):
        for _ in range(3):
            with deadline_scope(5.0):
                response = http.get("v1/cities")
            assert response.status_code == 200 and response.content == CITIES_BODY
            assert response.headers["X-Extra"] == "1"
        # Outside a deadline scope it is httpx's transport as usual.
        assert http.get("v1/cities").content == CITIES_BODY
    assert len(server.paths) == 4


def test_a_read_waits_no_longer_than_the_deadline() -> None:
    with (
        serving({"/cities": trickle(CITIES_BODY, every=0.5)}) as server,
        httpx.Client(base_url=server.url, transport=BoundedTransport(), timeout=30) as http,
    ):
        began = time.monotonic()
        with deadline_scope(1.0), pytest.raises(httpx.ReadTimeout):
            http.get("v1/cities")
        assert time.monotonic() - began <= 1.5


def test_a_deadline_already_passed_fails_before_connecting() -> None:
    with httpx.Client(
        base_url=f"http://127.0.0.1:{closed_port()}/", transport=BoundedTransport()
    ) as http:
        with deadline_scope(-1.0), pytest.raises(httpx.ConnectTimeout):
            http.get("v1/cities")
        with pytest.raises(httpx.ConnectError):  # the scope ended with its block
            http.get("v1/cities")
