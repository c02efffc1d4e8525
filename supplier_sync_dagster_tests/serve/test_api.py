"""The read API as a client calls it: search, cache-aside hotel detail, live offer confirmation
against the simulator, errors as JSON; on SQLite and MariaDB."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from supplier_sync_dagster.core.outbox.dispatch import Dispatcher
from supplier_sync_dagster.core.outbox.projections import (
    HOTEL_KEY,
    InProcessHotelCache,
    JsonLinesNotifier,
    Projections,
    SqliteSearchIndex,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.serve.api import REFRESH_EVENT, create_app
from supplier_sync_dagster.simulator import FaultProfile, Simulator
from supplier_sync_dagster_tests.core.sync.test_city import full_sync
from supplier_sync_dagster_tests.helpers import (
    READ_API_HEADERS,
    READ_API_KEY,
    make_simulator,
    stay,
    supplier_client,
)


@dataclass
class Api:
    client: TestClient
    db: SyncDatabase
    sim: Simulator
    projections: Projections


@contextmanager
def served_api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    """The read API with a key (:data:`READ_API_KEY`, sent by its client) over a catalog
    synced from a small simulator, its search index filled: one per test."""
    sim = make_simulator(FaultProfile.clean(), seed=9, n_cities=3, total_hotels=60)
    db = SyncDatabase.open(db_url)
    projections = Projections(
        SqliteSearchIndex(tmp_path / "search.sqlite3"),
        InProcessHotelCache(),
        JsonLinesNotifier(tmp_path / "notifications.jsonl"),
    )
    with sim.client() as http:
        supplier = supplier_client(http)
        full_sync(db, LocalPayloadStore(tmp_path / "payloads"), supplier, "api-test")
        Dispatcher(db, projections).drain()
        app = create_app(
            db=db,
            search=projections.search,
            cache=projections.cache,
            api_keys=[READ_API_KEY],
            supplier=lambda _supplier_id: supplier,
            ttl_seconds=60,
        )
        with TestClient(app, raise_server_exceptions=False, headers=READ_API_HEADERS) as client:
            yield Api(client, db, sim, projections)
    projections.close()
    db.dispose()


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    with served_api(db_url, tmp_path) as served:
        yield served


def a_hotel(db: SyncDatabase) -> dict[str, Any]:
    h, o = schema.platform_hotel.c, schema.platform_offer.c
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.select(h.resource_id, h.name, h.city_code, o.room_code, o.rate_plan_code)
            .select_from(
                schema.platform_hotel.join(schema.platform_offer, o.resource_id == h.resource_id)
            )
            .where(o.active.is_(True), o.available.is_(True))
            .order_by(h.resource_id)
        ).first()
    assert row is not None
    return dict(row._mapping)


def test_search_answers_from_the_projection(api: Api):
    hotel = a_hotel(api.db)
    r = api.client.get(
        "/hotels", params={"q": hotel["name"].split()[0], "city": hotel["city_code"]}
    )
    assert r.status_code == 200
    body = r.json()
    assert body["count"] >= 1 and hotel["resource_id"] in {h["resource_id"] for h in body["hotels"]}
    assert all(h["city_code"] == hotel["city_code"] for h in body["hotels"])
    for params, code in (
        ({}, "INVALID_PARAMETER"),
        ({"city": "X", "limit": "1000"}, "INVALID_PARAMETER"),
        ({"city": "X", "stars": "many"}, "INVALID_PARAMETER"),
        ({"q": "x" * 300}, "INVALID_PARAMETER"),
    ):
        bad = api.client.get("/hotels", params=params)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == code


def test_a_hotel_is_cached_and_the_cache_stage_invalidates_it(api: Api):
    hotel = a_hotel(api.db)
    rid = hotel["resource_id"]
    first = api.client.get(f"/hotels/{rid}")
    assert first.status_code == 200 and first.headers["x-cache"] == "MISS"
    assert first.json()["resource_id"] == rid and first.json()["offers"]
    second = api.client.get(f"/hotels/{rid}")
    assert second.headers["x-cache"] == "HIT" and second.json() == first.json()
    # The outbox's CACHE stage drops the key (as after a publish of a new version).
    api.projections.cache.invalidate([HOTEL_KEY.format(resource_id=rid)])
    assert api.client.get(f"/hotels/{rid}").headers["x-cache"] == "MISS"
    missing = api.client.get("/hotels/987654321")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "HOTEL_NOT_FOUND"
    assert api.client.get("/hotels/not-a-number").status_code == 400


def test_an_offer_is_confirmed_live_and_a_difference_enqueues_one_refresh(api: Api):
    hotel = a_hotel(api.db)
    body = {
        "hotel_id": hotel["resource_id"],
        "room_code": hotel["room_code"],
        "rate_plan_code": hotel["rate_plan_code"],
        **stay(nights=2),
        "guests": 1,
    }
    r = api.client.post("/offers/confirm", json=body)
    assert r.status_code == 200, r.text
    quote = r.json()
    assert r.headers["cache-control"] == "no-store"
    assert quote["price"]["currency"] == quote["catalog"]["currency"]
    assert isinstance(quote["differs_from_catalog"], bool)
    # Make the catalog wrong: the live price now differs for sure.
    o = schema.platform_offer.c
    with api.db.begin() as conn:
        conn.execute(
            sa.update(schema.platform_offer)
            .where(
                o.resource_id == hotel["resource_id"],
                o.room_code == hotel["room_code"],
                o.rate_plan_code == hotel["rate_plan_code"],
            )
            .values(price_amount=1)
        )
    differs = api.client.post("/offers/confirm", json=body).json()
    assert differs["differs_from_catalog"] is True
    again = api.client.post("/offers/confirm", json=body).json()
    assert again["differs_from_catalog"] is True
    # One refresh per published version, whichever quote found the difference first (the
    # simulator's live price drifts now and then, so the first quote may have).
    enqueued = [quote["refresh_enqueued"], differs["refresh_enqueued"], again["refresh_enqueued"]]
    assert enqueued.count(True) == 1 and enqueued[2] is False
    x = schema.outbox.c
    with api.db.engine.connect() as conn:
        refresh = conn.execute(
            sa.select(x.status, x.next_stage).where(
                x.event_type == REFRESH_EVENT, x.aggregate_id == hotel["resource_id"]
            )
        ).all()
    assert [tuple(r) for r in refresh] == [("READY", "NOTIFY")]
    for bad, code in (
        ({**body, "hotel_id": "x"}, "INVALID_PARAMETER"),
        ({**body, "check_out": body["check_in"]}, "INVALID_PARAMETER"),
        ({**body, "guests": 0}, "INVALID_PARAMETER"),
        ([1, 2], "INVALID_BODY"),
    ):
        rejected = api.client.post("/offers/confirm", json=bad)
        assert rejected.status_code == 400 and rejected.json()["error"]["code"] == code
    unknown = api.client.post("/offers/confirm", json={**body, "room_code": "NOPE"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "OFFER_NOT_FOUND"
    garbage = api.client.post(
        "/offers/confirm", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "INVALID_BODY"


def test_errors_are_json_without_stack_traces(api: Api, db_url: str):
    class Broken:
        def search(self, query: Any) -> Any:
            raise RuntimeError("secret internals /etc/passwd")

    app = create_app(db=api.db, search=Broken(), cache=InProcessHotelCache(), api_keys=None)  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/hotels", params={"q": "x"})
        assert r.status_code == 500
        assert r.json() == {
            "error": {"code": "INTERNAL", "message": "an unexpected error; it has been logged"}
        }
        assert "secret" not in r.text and "Traceback" not in r.text
        no_supplier = client.post(
            "/offers/confirm",
            json={
                "hotel_id": 1,
                "room_code": "A",
                "rate_plan_code": "B",
                **stay(),
            },
        )
        assert no_supplier.status_code == 503
        spec = client.get("/openapi.json").json()
        assert spec["openapi"].startswith("3.") and set(spec["paths"]) == {
            "/health",
            "/openapi.json",
            "/hotels",
            "/hotels/{resource_id}",
            "/offers/confirm",
        }
