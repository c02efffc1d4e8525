"""``GET /hotels/{id}?as_of=TIME`` from ``serve-api`` as a process (SQLite and MariaDB): the
hotel and its offers as published then (never from the cache), 400 for a malformed or future
time, 404 for a hotel unknown then, 410 before the history kept, 401 without a key."""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from supplier_sync_dagster.core.records.history import prune_history
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.cli.test_main import (
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
)
from supplier_sync_dagster_tests.core.records.test_history import sync_days
from supplier_sync_dagster_tests.helpers import READ_API_HEADERS, READ_API_KEY
from supplier_sync_dagster_tests.security.test_api import serve_api_process


def _z(at: datetime) -> str:
    return at.isoformat() + "Z"


def _expected(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The offers a served document sells, as the API shows them."""
    return sorted(
        (
            {
                "room_code": room["room_code"],
                "rate_plan_code": plan["code"],
                "room_name": room["name"],
                "board": plan["board"],
                "refundable": plan["refundable"],
                "available": plan["available"],
                "price": str(Decimal(plan["price"]).quantize(Decimal("0.01"))),
                "currency": plan["currency"],
            }
            for room in doc["rooms"]
            for plan in room["rate_plans"]
        ),
        key=lambda o: (o["room_code"], o["rate_plan_code"]),
    )


def test_a_hotel_as_of_a_time_is_what_was_published_then(db_url: str, tmp_path: Path):
    db = SyncDatabase.open(db_url)
    try:
        week = sync_days(db, tmp_path, hotels=40, gap=timedelta(0))
        with db.engine.connect() as conn:
            m = schema.hotel_mapping.c
            ids = dict(conn.execute(sa.select(m.supplier_hotel_id, m.id)).all())
    finally:
        db.dispose()
    d1, d2, d3 = week.days
    hid = next(h for h in d1.served if h in d2.served and d1.served[h] != d2.served[h])
    env = dict(os.environ)
    env["SUPPLIER_SYNC_API_KEYS"] = READ_API_KEY
    with serve_api_process(db_url, env) as (base, _):
        url = f"{base}/hotels/{ids[hid]}"

        def get(as_of: str, headers: dict[str, str] = READ_API_HEADERS) -> httpx.Response:
            return httpx.get(url, params={"as_of": as_of}, headers=headers)

        # A caller without a key, or with a wrong one, learns nothing of any time.
        for headers in ({}, {"X-Api-Key": READ_API_KEY + "x"}):
            r = get(_z(d1.at), headers)
            assert r.status_code == 401 and "offers" not in r.text

        for day in (d1, d2):
            r = get(_z(day.at))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["name"] == day.served[hid]["name"]
            assert body["status"] == day.served[hid]["status"]
            assert body["offers"] == _expected(day.served[hid])
            assert body["publish_version"] == day.number
            assert r.headers["cache-control"] == "no-store" and "x-cache" not in r.headers
            assert "supplier_hotel_id" not in body and "supplier_id" not in body
        # The same instant with an offset; the current detail is a different (cached) answer.
        shifted = (d1.at + timedelta(hours=-5)).isoformat() + "-05:00"
        assert get(shifted).json() == get(_z(d1.at)).json()
        assert httpx.get(url, headers=READ_API_HEADERS).headers["x-cache"] in ("HIT", "MISS")

        # Withdrawn on day 2: unpublished, nothing sold; served again on day 3.
        gone = f"{base}/hotels/{ids[week.withdrawn]}"
        tomb = httpx.get(gone, params={"as_of": _z(d2.at)}, headers=READ_API_HEADERS).json()
        assert tomb["status"] == "INACTIVE" and tomb["offers"] == []
        back = httpx.get(gone, params={"as_of": _z(d3.at)}, headers=READ_API_HEADERS).json()
        assert back["offers"] == _expected(d3.served[week.withdrawn])

        for bad in ("", "yesterday", "2026-12-01", "2026-12-01T10:00:00", "2026-02-30T00:00Z"):
            r = get(bad)
            assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_PARAMETER", bad
        assert get("2999-01-01T00:00:00Z").status_code == 400
        before = get(_z(d1.at - timedelta(days=1)))
        assert before.status_code == 404 and before.json()["error"]["code"] == "HOTEL_NOT_FOUND"
        unknown = httpx.get(
            f"{base}/hotels/{max(ids.values()) + 1000}",
            params={"as_of": _z(d3.at)},
            headers=READ_API_HEADERS,
        )
        assert unknown.status_code == 404

        # Pruned with the horizon now: day 1's version of a hotel changed since is gone.
        db = SyncDatabase.open(db_url)
        try:
            db.clock.advance(86_400)
            assert prune_history(db, retention_days=1).versions > 0
        finally:
            db.dispose()
        r = get(_z(d1.at))
        assert r.status_code == 410 and r.json()["error"]["code"] == "HISTORY_NOT_KEPT"
        assert get(_z(d3.at)).json()["offers"] == _expected(d3.served[hid])
