"""Helpers of the simulator tests: small worlds and full traversals."""

from __future__ import annotations

from typing import Any

import httpx

from supplier_sync_dagster.simulator import FaultProfile, Simulator, encode_city_code
from supplier_sync_dagster_tests.helpers import make_simulator

SMALL: dict[str, Any] = {"n_cities": 6, "total_hotels": 600}


def make_sim(faults: FaultProfile | None = None, **overrides: Any) -> Simulator:
    """A small simulator (6 cities, 600 hotels) with the given faults and settings."""
    return make_simulator(faults, **{**SMALL, **overrides})


def hotels_url(code: str) -> str:
    """The listing path of a city."""
    return f"/v1/cities/{encode_city_code(code)}/hotels"


def walk_pages(client: httpx.Client, code: str, page_size: int) -> list[dict[str, Any]]:
    """Every hotel of a city, by page numbers (clean supplier: no retries)."""
    out: list[dict[str, Any]] = []
    page = 1
    while True:
        r = client.get(hotels_url(code), params={"page": page, "page_size": page_size})
        assert r.status_code == 200, r.text
        body = r.json()
        out.extend(body["hotels"])
        if not body["hotels"]:
            assert page == body["total_pages"] + 1 or body["total"] == 0
            return out
        page += 1


def walk_cursor(client: httpx.Client, code: str, page_size: int) -> list[dict[str, Any]]:
    """Every hotel of a city, by cursors (clean supplier: no retries)."""
    r = client.get(hotels_url(code), params={"page_size": page_size})
    assert r.status_code == 200, r.text
    body = r.json()
    out = list(body["hotels"])
    while body["next_cursor"] is not None:
        r = client.get(
            hotels_url(code), params={"cursor": body["next_cursor"], "page_size": page_size}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        out.extend(body["hotels"])
    return out


def walk_changes(client: httpx.Client, since: str, limit: int = 200) -> list[dict[str, Any]]:
    """The whole change feed from ``since``, following ``next``."""
    out: list[dict[str, Any]] = []
    params: dict[str, Any] = {"since": since, "limit": limit}
    while True:
        r = client.get("/v1/hotels/changes", params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        out.extend(body["changes"])
        if body["next"] is None:
            return out
        params = {**body["next"], "limit": limit}
