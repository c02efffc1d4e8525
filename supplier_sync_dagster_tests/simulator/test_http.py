"""The simulator over real HTTP (uvicorn on 127.0.0.1, a free port)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from supplier_sync_dagster.simulator import (
    HOSTILE_CITY_CODES,
    FaultProfile,
    Simulator,
    encode_city_code,
    running_server,
)
from supplier_sync_dagster_tests.helpers import SIM_API_KEY
from supplier_sync_dagster_tests.simulator.helpers import hotels_url, make_sim, walk_cursor


@pytest.fixture(scope="module")
def hostile_sim() -> Simulator:
    return make_sim(FaultProfile(hostile_city_codes=True))


@pytest.fixture(scope="module")
def base_url(hostile_sim: Simulator) -> Iterator[str]:
    with running_server(hostile_sim) as url:
        yield url


@pytest.fixture
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, headers={"X-Api-Key": SIM_API_KEY}, timeout=10) as c:
        yield c


def test_cities_over_http(http: httpx.Client, hostile_sim: Simulator) -> None:
    r = http.get("/v1/cities")
    assert r.status_code == 200
    assert r.headers["content-encoding"] == "gzip"  # httpx asks for it by default
    codes = [c["city_code"] for c in r.json()["cities"]]
    assert codes == hostile_sim.city_codes()
    assert set(HOSTILE_CITY_CODES) <= set(codes)


@pytest.mark.parametrize("code", HOSTILE_CITY_CODES)
def test_hostile_codes_round_trip(http: httpx.Client, hostile_sim: Simulator, code: str) -> None:
    truth = hostile_sim.ground_truth()
    hotels = walk_cursor(http, code, 2)
    assert [h["hotel_id"] for h in hotels] == list(truth.listed_by_city[code])
    assert hotels and all(h["city_code"] == code for h in hotels)
    summary = http.get(f"/v1/cities/{encode_city_code(code)}/summary").json()
    assert summary["city_code"] == code
    assert summary["hotel_count"] == len(hotels)


def test_dots_may_be_literal_or_encoded(http: httpx.Client) -> None:
    # httpx would collapse a literal "../" itself, so these paths are sent as raw bytes.
    for raw in (
        "/v1/cities/..%2F..%2Fetc/summary",
        "/v1/cities/%2E%2E%2F%2E%2E%2Fetc/summary",
        "/v1/cities/%2e%2e%2f%2e%2e%2fetc/summary",
    ):
        body = http.get(raw).json()
        assert body["city_code"] == "../../etc", raw
    assert http.get("/v1/cities/a...b/summary").json()["city_code"] == "a...b"
    assert http.get("/v1/cities/a%2E%2E%2Eb/summary").json()["city_code"] == "a...b"
    assert http.get("/v1/cities/a|b/summary").json()["city_code"] == "a|b"


def test_ambiguous_or_malformed_segments(base_url: str) -> None:
    host, port = base_url.removeprefix("http://").split(":")

    def raw_get(target: str) -> tuple[int, bytes]:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(
                f"GET {target} HTTP/1.1\r\nHost: x\r\nX-Api-Key: {SIM_API_KEY}\r\nConnection: close\r\n\r\n".encode()
            )
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        status = int(data.split(b" ", 2)[1])
        return status, data.split(b"\r\n\r\n", 1)[1]

    # A literal "../../etc" is three segments, never the city "../../etc".
    status, _ = raw_get("/v1/cities/../../etc/summary")
    assert status == 404
    status, body = raw_get("/v1/cities/../summary")
    assert status == 400 and json.loads(body)["error"]["code"] == "INVALID_CITY_CODE"
    assert raw_get("/v1/cities/%zz/summary")[0] == 400
    assert raw_get("/v1/cities/%FF%FE/summary")[0] == 400


def test_stats_advance_day_and_advance_over_http(base_url: str) -> None:
    sim = make_sim()
    with running_server(sim) as url, httpx.Client(base_url=url) as c:
        assert c.get("/v1/cities").status_code == 401
        stats = c.get("/_sim/stats").json()
        assert stats["unauthorized"] == 1 and stats["responses_by_status"] == {"401": 1}
        assert c.post("/_sim/advance_day").json() == {"day": 1}
        advanced = c.post("/_sim/advance", params={"seconds": 3600 + 5})
        assert advanced.status_code == 200
        assert advanced.json() == {"day": 1, "now": "2026-11-02T01:00:05Z"}
        assert c.post("/_sim/advance", params={"seconds": "soon"}).status_code == 400
        assert c.get("/_sim/stats").json()["now"] == "2026-11-02T01:00:05Z"
    assert sim.day == 1 and sim.clock == 86_400 + 3605


def test_slow_fault_trips_a_client_read_timeout_then_a_retry_succeeds() -> None:
    sim = make_sim(FaultProfile(rate_slow=0.5, slow_seconds=1.0))
    outcomes: list[int | str] = []
    with (
        running_server(sim) as url,
        httpx.Client(
            base_url=url, headers={"X-Api-Key": SIM_API_KEY}, timeout=httpx.Timeout(5.0, read=0.3)
        ) as c,
    ):
        for _ in range(8):
            try:
                outcomes.append(c.get("/v1/cities").status_code)
            except httpx.ReadTimeout:
                outcomes.append("timeout")
    assert "timeout" in outcomes and 200 in outcomes


def test_truncated_body_over_http() -> None:
    sim = make_sim(FaultProfile(rate_truncated=1.0))
    with (
        running_server(sim) as url,
        httpx.Client(base_url=url, headers={"X-Api-Key": SIM_API_KEY}) as c,
    ):
        r = c.get(hotels_url(sim.city_codes()[0]), params={"page_size": 20})
        assert r.status_code == 200
        with pytest.raises(json.JSONDecodeError):
            r.json()


def test_server_shuts_down_cleanly() -> None:
    sim = make_sim()
    with running_server(sim) as url:
        assert httpx.get(f"{url}/v1/cities", headers={"X-Api-Key": SIM_API_KEY}).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v1/cities", timeout=2)
