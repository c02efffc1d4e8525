"""The named misbehaviours (``simulator.modes``), in process and over real HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zlib
from typing import Any

import httpx
import pytest

from supplier_sync_dagster.simulator import FaultProfile, ModeScale, Simulator, running_server
from supplier_sync_dagster.simulator.modes import FUTURE_UPDATED_AT
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, free_port
from supplier_sync_dagster_tests.simulator.helpers import hotels_url, make_sim, walk_pages

KEY = {"X-Api-Key": SIM_API_KEY}


def _moded(*modes: str, cities: tuple[str, ...] = (), **faults: Any) -> tuple[Simulator, str]:
    """A small simulator with ``modes`` on ``cities``, and its largest city."""
    plain = make_sim()
    city = max(plain.city_codes(), key=lambda c: len(plain.ground_truth().listed_by_city[c]))
    profile = FaultProfile(modes=modes, mode_cities=cities or (city,), **faults)
    return make_sim(profile), city


def test_unknown_modes_are_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown fault mode.*slow_body"):
        FaultProfile(modes=("slowly",))


def test_modes_touch_only_their_cities() -> None:
    sim, city = _moded("deep_json")
    other = next(c for c in sim.city_codes() if c != city)
    with sim.client() as c:
        assert c.get(hotels_url(other)).json()["hotels"]
        body = c.get(hotels_url(city)).content
    assert body.count(b"[") >= 100_000


def test_runaway_cursor_gives_a_new_cursor_for_the_same_page_for_ever() -> None:
    sim, city = _moded("runaway_cursor")
    with sim.client() as c:
        first = c.get(hotels_url(city), params={"page_size": 500}).json()
        cursors, ids = [first["next_cursor"]], [h["hotel_id"] for h in first["hotels"]]
        for _ in range(5):
            page = c.get(hotels_url(city), params={"cursor": cursors[-1], "page_size": 500}).json()
            assert [h["hotel_id"] for h in page["hotels"]] == ids
            cursors.append(page["next_cursor"])
    assert None not in cursors and len(set(cursors)) == len(cursors)


def test_cursor_cycle_comes_back_to_a_cursor_it_gave() -> None:
    sim, city = _moded("cursor_cycle")
    with sim.client() as c:
        cursor = c.get(hotels_url(city), params={"page_size": 20}).json()["next_cursor"]
        seen: list[str] = []
        while cursor not in seen:
            assert len(seen) < 100 and cursor is not None
            seen.append(cursor)
            cursor = c.get(hotels_url(city), params={"cursor": cursor, "page_size": 20}).json()[
                "next_cursor"
            ]
    assert len(seen) >= 2  # A -> B -> ... -> A


def test_endless_pages_never_run_empty_and_give_no_totals() -> None:
    sim, city = _moded("endless_pages")
    with sim.client() as c:
        page = c.get(hotels_url(city), params={"page": 10_000, "page_size": 10}).json()
    assert page["hotels"] and page["total"] is None and page["total_pages"] is None
    assert page["next_cursor"] is None


def test_inflating_body_is_a_small_gzip_that_inflates_past_its_size() -> None:
    sim, city = _moded("inflating_body", mode_scale=ModeScale(inflated_body_bytes=20_000_000))
    with sim.client() as c, c.stream("GET", hotels_url(city)) as r:
        wire = b"".join(r.iter_raw())
    assert r.headers["content-encoding"] == "gzip" and len(wire) < 100_000
    inflated = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(wire)
    assert len(inflated) == 20_000_000 and json.loads(inflated)["hotels"] == []


def test_huge_body_is_sent_uncompressed_at_its_size() -> None:
    sim, city = _moded("huge_body", mode_scale=ModeScale(huge_body_bytes=3_000_000))
    with sim.client(headers={"Accept-Encoding": "gzip"}) as c:
        r = c.get(hotels_url(city))
    assert "content-encoding" not in r.headers and len(r.content) == 3_000_000
    assert r.json()["city_code"] == city


def test_bad_bytes_and_future_timestamp_break_the_citys_first_hotel_only() -> None:
    sim, city = _moded("bad_bytes")
    victim = sim.ground_truth().listed_by_city[city][0]
    with sim.client() as c:
        body = c.get(hotels_url(city), params={"page_size": 500}).content
        detail = c.get(f"/v1/hotels/{victim}").content
    assert body.count(b"\xff") == 1 and b"\xff" in detail
    with pytest.raises(UnicodeDecodeError):
        body.decode()
    assert sim.ground_truth().bad == {victim: "INVALID_UTF8"}

    sim, city = _moded("future_timestamp")
    victim = sim.ground_truth().listed_by_city[city][0]
    with sim.client() as c:
        hotels = c.get(hotels_url(city), params={"page_size": 500}).json()["hotels"]
        changes = c.get(
            "/v1/hotels/changes", params={"since": "2020-01-01T00:00:00Z", "limit": 1000}
        ).json()
        summary = c.get(f"/v1/cities/{city}/summary").json()
    dated = {h["hotel_id"]: h["updated_at"] for h in hotels}
    assert dated[victim] == FUTURE_UPDATED_AT
    assert sum(v == FUTURE_UPDATED_AT for v in dated.values()) == 1
    # Ordered by (updated_at, hotel_id): the 2099 record comes last, and a feed asked from
    # 2098 still hands it out.
    assert changes["changes"][-1]["hotel_id"] == victim and changes["next"] is None
    assert summary["max_updated_at"] == FUTURE_UPDATED_AT
    assert sim.ground_truth().bad == {victim: "FUTURE_TIMESTAMP"}
    assert victim not in sim.ground_truth().valid


def test_unauthorized_answers_401_to_the_right_key_and_can_be_switched_off() -> None:
    sim = make_sim(FaultProfile(modes=("unauthorized",)))
    with sim.client() as c:
        r = c.get("/v1/cities")
        assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
        assert c.post("/_sim/modes", params={"names": ""}).status_code == 200
        assert c.get("/v1/cities").status_code == 200
        assert c.post("/_sim/modes", params={"names": "nope"}).status_code == 400
        c.post("/_sim/modes", params={"names": "deep_json,slow_body", "cities": "X"})
        assert c.get("/_sim/modes").json() == {"modes": ["deep_json", "slow_body"], "cities": ["X"]}


def test_drift_loses_a_naive_page_walk_hotels_while_its_counts_stay_equal() -> None:
    sim, city = _moded("drift")
    before = len(sim.ground_truth().listed_by_city[city])
    with sim.client() as c:
        first = c.get(hotels_url(city), params={"page_size": 20}).json()
        expired = c.get(hotels_url(city), params={"cursor": first["next_cursor"], "page_size": 20})
        assert expired.status_code == 410 and expired.json()["error"]["code"] == "CURSOR_EXPIRED"
        seen = {h["hotel_id"] for h in walk_pages(c, city, 20)}
        summary = c.get(f"/v1/cities/{city}/summary").json()
    truth = sim.ground_truth()
    listed = set(truth.listed_by_city[city])
    assert len(listed) == before == summary["hotel_count"]  # one out, one in, per shift
    assert listed - seen  # page numbers skipped hotels that are still listed
    assert set(truth.valid_by_city[city]) <= listed


def test_slow_and_truncated_bodies_over_http() -> None:
    sim, city = _moded("slow_body", mode_scale=ModeScale(slow_body_bytes_per_second=200))
    with running_server(sim) as url, httpx.Client(base_url=url, headers=KEY) as c:
        began = time.monotonic()
        with c.stream("GET", hotels_url(city)) as r:
            assert r.status_code == 200  # headers at once
            got = 0
            for chunk in r.iter_raw():
                got += len(chunk)
                if time.monotonic() - began > 1.0:
                    break
        assert 0 < got < 1000 < int(r.headers["content-length"])
        assert c.get("/v1/cities").status_code == 200  # other endpoints are not slowed

    sim, city = _moded("truncated_body")
    with (
        running_server(sim) as url,
        httpx.Client(base_url=url, headers=KEY) as c,
        pytest.raises(httpx.RemoteProtocolError, match="incomplete|complete message"),
    ):
        c.get(hotels_url(city))


def test_truncated_and_slow_bodies_in_process_behave_as_over_http() -> None:
    sim, city = _moded("truncated_body")
    with sim.client() as c, pytest.raises(httpx.RemoteProtocolError):
        c.get(hotels_url(city))
    sim, city = _moded("slow_body", mode_scale=ModeScale(slow_body_bytes_per_second=100))
    with sim.client() as c, c.stream("GET", hotels_url(city)) as r:
        began, got = time.monotonic(), 0
        for chunk in r.iter_raw():
            got += len(chunk)
            if time.monotonic() - began > 0.5:
                break
    assert got < 200


def test_refused_means_nobody_listens() -> None:
    sim = make_sim(FaultProfile(modes=("refused",)))
    with running_server(sim) as url, pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v1/cities", headers=KEY)
    with sim.client() as c, pytest.raises(httpx.ConnectError):
        c.get("/v1/cities")


def test_simulate_command_serves_a_mode() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "supplier_sync_dagster.cli",
            "simulate",
            "--port",
            str(port),
            "--cities",
            "4",
            "--hotels",
            "200",
            "--api-key",
            SIM_API_KEY,
            "--mode",
            "unauthorized",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/cities", headers=KEY)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        assert r.status_code == 401
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    bad = subprocess.run(
        [sys.executable, "-m", "supplier_sync_dagster.cli", "simulate", "--mode", "slowly"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "unknown fault mode" in bad.stderr and "drift" in bad.stderr


def test_dropped_city_leaves_the_city_list_and_answers_404_for_its_hotels() -> None:
    sim, city = _moded("dropped_city")
    hotel = make_sim().ground_truth().listed_by_city[city][0]
    other = next(c for c in sim.city_codes() if c != city)
    with sim.client() as c:
        listed = [x["city_code"] for x in c.get("/v1/cities").json()["cities"]]
        listing = c.get(hotels_url(city))
        summary = c.get(f"{hotels_url(city)[: -len('/hotels')]}/summary")
        detail = c.get(f"/v1/hotels/{hotel}")
        changes = c.get(
            "/v1/hotels/changes", params={"since": "2020-01-01T00:00:00Z", "limit": 1000}
        ).json()["changes"]
        assert c.get(hotels_url(other)).json()["hotels"]  # the other cities are served
    assert city not in listed and other in listed
    assert listing.status_code == summary.status_code == detail.status_code == 404
    assert listing.json()["error"]["code"] == "CITY_NOT_FOUND"
    assert all(h["city_code"] != city for h in changes)
    truth = sim.ground_truth()
    assert city not in truth.listed_by_city and city not in truth.valid_by_city
    assert hotel not in truth.versions


def test_a_dropped_city_comes_back_when_the_mode_is_switched_off() -> None:
    sim, city = _moded("dropped_city")
    with sim.client() as c:
        assert city not in [x["city_code"] for x in c.get("/v1/cities").json()["cities"]]
        sim.set_modes([])  # the same instant: the cached city list must not be served
        assert city in [x["city_code"] for x in c.get("/v1/cities").json()["cities"]]
        assert c.get(hotels_url(city)).json()["hotels"]
    assert sim.ground_truth().listed_by_city[city]


def test_dropped_city_on_every_city_empties_the_city_list() -> None:
    sim = make_sim(FaultProfile(modes=("dropped_city",)))
    with sim.client() as c:
        body = c.get("/v1/cities").json()
    assert body == {"cities": [], "total": 0}
    assert sim.ground_truth().total == 0


def test_withdrawn_hotel_leaves_the_listing_answers_404_then_comes_back() -> None:
    sim, city = _moded("withdrawn_hotel")
    before = make_sim().ground_truth().listed_by_city[city]
    hotel = before[0]
    with sim.client() as c:
        listing = c.get(hotels_url(city)).json()
        detail = c.get(f"/v1/hotels/{hotel}")
        other = c.get(f"/v1/hotels/{before[1]}")
    assert [h["hotel_id"] for h in listing["hotels"]] == list(before[1:])[: len(listing["hotels"])]
    assert listing["total"] == len(before) - 1
    assert detail.status_code == 404 and other.status_code == 200
    truth = sim.ground_truth()
    assert hotel not in truth.versions and truth.listed_by_city[city] == before[1:]
    sim.set_modes([])
    with sim.client() as c:
        assert c.get(f"/v1/hotels/{hotel}").status_code == 200
    assert hotel in sim.ground_truth().versions


def limited(*modes: str, swing: float = 5.0) -> Simulator:
    return make_sim(
        FaultProfile(modes=modes, mode_scale=ModeScale(limit_swing_seconds=swing)),
        rate_limit_rps=10.0,
        rate_limit_burst=2.0,
    )


def test_undisclosed_limit_tells_nothing_of_the_limit() -> None:
    sim = limited("undisclosed_limit")
    with sim.client() as c:
        answers = [c.get("/v1/cities") for _ in range(3)]
    assert [r.status_code for r in answers] == [200, 200, 429]
    for r in answers:
        assert not [h for h in r.headers if h.lower().startswith("x-ratelimit")]
    assert "retry-after" not in answers[2].headers
    with limited().client() as told:
        assert told.get("/v1/cities").headers["x-ratelimit-limit"] == "2"


def test_limit_swing_halves_then_doubles_back() -> None:
    sim = limited("limit_swing", swing=1.0)
    with sim.client() as c:
        c.get("/v1/cities")  # the swing's clock starts
        time.sleep(1.3)
        halved = c.get("/v1/cities").headers["x-ratelimit-limit"]
        time.sleep(1.0)
        back = c.get("/v1/cities").headers["x-ratelimit-limit"]
    assert (halved, back) == ("1", "2")


def test_shared_limit_spends_half_the_limit_for_an_unseen_account() -> None:
    sim = limited("shared_limit")
    with sim.client() as c:
        c.get("/v1/cities")
        time.sleep(1.0)  # the other account sends 5 requests meanwhile; the bucket holds 2
        first = c.get("/v1/cities")
    # Without it the bucket would be full again (2 tokens, one taken now: 1 left).
    assert first.status_code == 429 or first.headers["x-ratelimit-remaining"] == "0"
