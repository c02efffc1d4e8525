"""Every endpoint of the contract, in-process, on a clean supplier."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest

from supplier_sync_dagster.simulator import FaultProfile, Simulator, encode_city_code
from supplier_sync_dagster_tests.helpers import SIM_API_KEY
from supplier_sync_dagster_tests.simulator.helpers import (
    hotels_url,
    make_sim,
    walk_changes,
    walk_cursor,
    walk_pages,
)

RATE_HEADERS = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset")


def test_cities(client: httpx.Client, clean_sim: Simulator) -> None:
    r = client.get("/v1/cities")
    assert r.status_code == 200
    body = r.json()
    assert body["total"] == len(body["cities"]) == 6
    truth = clean_sim.ground_truth()
    for city in body["cities"]:
        assert set(city) == {"city_code", "name", "country_code", "hotel_count", "updated_at"}
        assert city["hotel_count"] == len(truth.listed_by_city[city["city_code"]])
    assert sum(c["hotel_count"] for c in body["cities"]) == 600


def test_auth_is_required_everywhere(clean_sim: Simulator) -> None:
    code = clean_sim.city_codes()[0]
    with httpx.Client(transport=clean_sim.transport(), base_url="http://sim") as c:
        for headers in ({}, {"X-Api-Key": "wrong"}, {"X-Api-Key": f"{SIM_API_KEY} "}):
            for path in ("/v1/cities", hotels_url(code), "/v1/hotels/H0000000000016"):
                r = c.get(path, headers=headers)
                assert r.status_code == 401
                assert r.json()["error"]["code"] == "UNAUTHORIZED"
                assert all(h in r.headers for h in RATE_HEADERS)
        assert c.get("/v1/cities", headers={"X-Api-Key": SIM_API_KEY}).status_code == 200


@pytest.mark.parametrize("page_size", [1, 7, 100, 500])
def test_page_and_cursor_pagination_cover_each_city_exactly(
    client: httpx.Client, clean_sim: Simulator, page_size: int
) -> None:
    truth = clean_sim.ground_truth()
    for code in clean_sim.city_codes():
        expected = list(truth.listed_by_city[code])
        by_page = [h["hotel_id"] for h in walk_pages(client, code, page_size)]
        by_cursor = [h["hotel_id"] for h in walk_cursor(client, code, page_size)]
        assert by_page == expected
        assert by_cursor == expected
        assert expected == sorted(expected)


def test_page_fields_and_past_the_end(client: httpx.Client, clean_sim: Simulator) -> None:
    code = clean_sim.city_codes()[0]
    body = client.get(hotels_url(code), params={"page": 2, "page_size": 10}).json()
    total = body["total"]
    assert body["page"] == 2 and body["page_size"] == 10
    assert body["total_pages"] == -(-total // 10)
    assert body["next_cursor"] is not None and len(body["hotels"]) == 10
    last = client.get(hotels_url(code), params={"page": body["total_pages"], "page_size": 10})
    assert last.json()["next_cursor"] is None
    past = client.get(hotels_url(code), params={"page": 10_000, "page_size": 10})
    assert past.status_code == 200 and past.json()["hotels"] == []
    assert past.json()["next_cursor"] is None
    default = client.get(hotels_url(code)).json()
    assert default["page"] == 1 and default["page_size"] == 100


@pytest.mark.parametrize(
    "params",
    [
        {"page_size": 0},
        {"page_size": 501},
        {"page_size": "ten"},
        {"page": 0},
        {"page": -1},
        {"page": 1, "cursor": "abc"},
        {"cursor": "not-a-cursor"},
    ],
)
def test_bad_listing_parameters_give_400(
    client: httpx.Client, clean_sim: Simulator, params: dict
) -> None:
    r = client.get(hotels_url(clean_sim.city_codes()[0]), params=params)
    assert r.status_code == 400
    assert r.json()["error"]["code"] in ("INVALID_PARAMETER", "INVALID_CURSOR")


def test_cursor_of_another_city_or_tampered_is_refused(
    client: httpx.Client, clean_sim: Simulator
) -> None:
    a, b = clean_sim.city_codes()[:2]
    cursor = client.get(hotels_url(a), params={"page_size": 2}).json()["next_cursor"]
    r = client.get(hotels_url(b), params={"cursor": cursor})
    assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_CURSOR"
    tampered = cursor[:-2] + ("AA" if cursor[-2:] != "AA" else "BB")
    assert client.get(hotels_url(a), params={"cursor": tampered}).status_code == 400


def test_unknown_city_hotel_and_path_give_404(client: httpx.Client) -> None:
    for path in (
        "/v1/cities/NOPE/hotels",
        "/v1/cities/NOPE/summary",
        "/v1/hotels/H9999999999999",
        "/v1/hotels/not-an-id",
        "/v1/hotels/%2E%2E%2Fetc",
        "/v2/cities",
        "/v1/cities/x/y/hotels",
    ):
        r = client.get(path)
        assert r.status_code == 404, path
        assert "code" in r.json()["error"]


def test_wrong_method_gives_405(client: httpx.Client) -> None:
    assert client.post("/v1/cities").status_code == 405
    assert client.get("/v1/offers/confirm").status_code == 405


def test_cursor_expiry_gives_410() -> None:
    sim = make_sim(FaultProfile(cursor_ttl_seconds=0.0))
    with sim.client() as c:
        code = sim.city_codes()[0]
        first = c.get(hotels_url(code), params={"page_size": 5}).json()
        r = c.get(hotels_url(code), params={"cursor": first["next_cursor"], "page_size": 5})
        assert r.status_code == 410
        assert r.json()["error"]["code"] == "CURSOR_EXPIRED"
        # Page numbers still work (the client's fallback).
        assert c.get(hotels_url(code), params={"page": 2, "page_size": 5}).status_code == 200
    assert sim.stats["faults"]["cursor_expired_ttl"] == 1


def test_cursor_is_stable_under_inserts_and_deletes() -> None:
    sim = make_sim(n_cities=2, total_hotels=2000, daily_add_rate=0.05, daily_remove_rate=0.05)
    code = sim.city_codes()[0]
    with sim.client() as c:
        first = c.get(hotels_url(code), params={"page_size": 100}).json()
        last_seen = first["hotels"][-1]["hotel_id"]
        sim.advance_day()
        rest: list[str] = []
        body = {"next_cursor": first["next_cursor"]}
        while body["next_cursor"] is not None:
            body = c.get(
                hotels_url(code), params={"cursor": body["next_cursor"], "page_size": 100}
            ).json()
            rest.extend(h["hotel_id"] for h in body["hotels"])
    now = sim.ground_truth().listed_by_city[code]
    assert rest == [h for h in now if h > last_seen], "continues right after the last hotel seen"
    assert any(h not in sim.ground_truth(0).versions for h in rest), "inserts were picked up"


def test_gzip_when_asked(client: httpx.Client, clean_sim: Simulator) -> None:
    code = clean_sim.city_codes()[0]
    r = client.get(hotels_url(code), params={"page_size": 50}, headers={"Accept-Encoding": "gzip"})
    assert r.headers["content-encoding"] == "gzip"
    assert len(r.json()["hotels"]) == 50  # httpx decoded it
    plain = client.get(
        hotels_url(code), params={"page_size": 50}, headers={"Accept-Encoding": "identity"}
    )
    assert "content-encoding" not in plain.headers
    raw = clean_sim.handle(
        httpx.Request(
            "GET",
            f"http://sim{hotels_url(code)}?page_size=50",
            headers={"X-Api-Key": SIM_API_KEY, "Accept-Encoding": "gzip"},
        )
    )
    # The wire bytes really are gzip and smaller than the JSON they carry.
    assert isinstance(raw.stream, httpx.SyncByteStream)
    wire = b"".join(raw.stream)
    unzipped = json.loads(gzip.decompress(wire))
    expected = plain.json()
    unzipped.pop("next_cursor"), expected.pop("next_cursor")  # they carry their issue time
    assert unzipped == expected
    assert len(wire) < len(plain.content) / 2


def test_hotel_detail_matches_the_listing(client: httpx.Client, clean_sim: Simulator) -> None:
    code = clean_sim.city_codes()[1]
    listed = client.get(hotels_url(code), params={"page_size": 3}).json()["hotels"]
    for rec in listed:
        assert client.get(f"/v1/hotels/{rec['hotel_id']}").json() == rec


def test_summary_matches_ground_truth(client: httpx.Client, clean_sim: Simulator) -> None:
    truth = clean_sim.ground_truth()
    for code in clean_sim.city_codes():
        s = client.get(f"/v1/cities/{encode_city_code(code)}/summary").json()
        ids = truth.valid_by_city[code]
        assert s["city_code"] == code
        assert s["hotel_count"] == len(ids) == s["active_count"] + s["inactive_count"]
        assert s["inactive_count"] == len(truth.inactive & ids.keys())
        hotels = walk_pages(client, code, 500)
        assert s["max_updated_at"] == (max(h["updated_at"] for h in hotels) if hotels else None)


def test_changes_feed_is_ordered_and_complete(client: httpx.Client, clean_sim: Simulator) -> None:
    changes = walk_changes(client, "2000-01-01T00:00:00Z", limit=37)
    keys = [(h["updated_at"], h["hotel_id"]) for h in changes]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)
    assert {h["hotel_id"]: h["version"] for h in changes} == dict(clean_sim.ground_truth().versions)
    # A watermark in the middle returns exactly the tail after it.
    mid = changes[len(changes) // 2]
    tail = walk_changes_after(client, mid["updated_at"], mid["hotel_id"])
    assert [h["hotel_id"] for h in tail] == [
        h["hotel_id"] for h in changes[len(changes) // 2 + 1 :]
    ]
    since_only = client.get(
        "/v1/hotels/changes", params={"since": mid["updated_at"], "limit": 1000}
    )
    assert all(h["updated_at"] >= mid["updated_at"] for h in since_only.json()["changes"])
    assert since_only.json()["next"] is None


def walk_changes_after(client: httpx.Client, since: str, after_id: str) -> list[dict]:
    r = client.get(
        "/v1/hotels/changes", params={"since": since, "after_id": after_id, "limit": 1000}
    )
    assert r.status_code == 200
    return list(r.json()["changes"])


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"since": "yesterday"},
        {"since": "2026-01-01T00:00:00"},
        {"since": "2026-01-01T00:00:00Z", "limit": 0},
        {"since": "2026-01-01T00:00:00Z", "limit": 1001},
        {"since": "2026-01-01T00:00:00Z", "after_id": "x"},
    ],
)
def test_changes_bad_parameters(client: httpx.Client, params: dict) -> None:
    assert client.get("/v1/hotels/changes", params=params).status_code == 400


def test_offer_confirm(client: httpx.Client, clean_sim: Simulator) -> None:
    code = clean_sim.city_codes()[0]
    rec = client.get(hotels_url(code), params={"page_size": 1}).json()["hotels"][0]
    room = rec["rooms"][0]
    plan = room["rate_plans"][0]
    req = {
        "hotel_id": rec["hotel_id"],
        "room_code": room["room_code"],
        "rate_plan_code": plan["code"],
        "check_in": "2026-12-24",
        "check_out": "2026-12-26",
        "guests": 1,
    }
    r = client.post("/v1/offers/confirm", json=req)
    assert r.status_code == 200
    assert r.headers["cache-control"] == "no-store"
    body = r.json()
    assert body["price"]["currency"] == plan["price"]["currency"]
    nightly = float(plan["price"]["amount"])
    assert 2 * nightly * 0.96 <= float(body["price"]["amount"]) <= 2 * nightly * 1.06
    assert body["available"] == (plan["available"] and rec["status"] == "ACTIVE")
    assert body["valid_for_seconds"] == 300 and body["quoted_at"].endswith("Z")
    too_many = client.post("/v1/offers/confirm", json={**req, "guests": room["max_occupancy"] + 1})
    assert too_many.json()["available"] is False
    for bad, status in (
        ({**req, "hotel_id": "H9999999999999"}, 404),
        ({**req, "room_code": "NOPE"}, 404),
        ({**req, "rate_plan_code": "NOPE"}, 404),
        ({**req, "check_out": "2026-12-24"}, 400),
        ({**req, "check_in": "24/12/2026"}, 400),
        ({**req, "guests": 0}, 400),
        ({k: v for k, v in req.items() if k != "room_code"}, 400),
    ):
        assert client.post("/v1/offers/confirm", json=bad).status_code == status, bad
    assert client.post("/v1/offers/confirm", content=b"{not json").status_code == 400


def test_rate_limit_headers_on_every_response(client: httpx.Client) -> None:
    for r in (
        client.get("/v1/cities"),
        client.get("/v1/hotels/nope"),
        client.get("/v1/hotels/changes"),
    ):
        assert all(h in r.headers for h in RATE_HEADERS), r.status_code


def test_admin_paths(clean_sim: Simulator) -> None:
    sim = make_sim()
    with sim.client() as c:
        c.get("/v1/cities")
        stats = c.get("/_sim/stats").json()
        assert stats["requests_total"] == 1 and stats["requests_by_endpoint"] == {"cities": 1}
        assert c.post("/_sim/advance_day").json() == {"day": 1}
        assert sim.day == 1
        assert c.post("/_sim/advance", params={"seconds": 60}).json() == {
            "day": 1,
            "now": "2026-11-02T00:01:00Z",
        }
        assert c.get("/_sim/nope").status_code == 404
    assert json.loads(json.dumps(sim.stats))["day"] == 1
