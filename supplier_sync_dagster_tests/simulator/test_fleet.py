"""A fleet of simulated suppliers with several accounts each, over real HTTP and in-process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from supplier_sync_dagster.simulator import (
    HOSTILE_CITY_CODES,
    AccountSpec,
    FaultProfile,
    Simulator,
    SimulatorConfig,
    SimulatorFleet,
    SupplierSpec,
    encode_city_code,
    running_fleet_server,
)
from supplier_sync_dagster_tests.simulator.helpers import hotels_url, make_sim, walk_cursor

# Both acme accounts share the world-shaping faults (hostile city codes): same catalog.
ACME_WORLD = FaultProfile(hostile_city_codes=True)
KEYS = {
    ("acme", "basic"): "acme-basic-key",
    ("acme", "premium"): "acme-premium-key",
    ("globex", "main"): "globex-main-key",
    ("globex", "broken"): "globex-broken-key",
}


def _fleet() -> SimulatorFleet:
    return SimulatorFleet.from_spec(
        {
            "acme": SupplierSpec(
                seed=11,
                n_cities=6,
                total_hotels=600,
                accounts={
                    "basic": AccountSpec(KEYS["acme", "basic"], 1000, faults=ACME_WORLD),
                    "premium": AccountSpec(KEYS["acme", "premium"], None, faults=ACME_WORLD),
                },
            ),
            "globex": SupplierSpec(
                seed=22,
                n_cities=4,
                total_hotels=300,
                accounts={
                    "main": AccountSpec(KEYS["globex", "main"]),
                    "broken": AccountSpec(
                        KEYS["globex", "broken"], faults=FaultProfile(rate_500=1.0)
                    ),
                },
            ),
        }
    )


def _small_fleet(slow_rps: float | None = None) -> SimulatorFleet:
    """Two suppliers x two accounts, tiny catalogs; acme/slow limited to ``slow_rps``."""
    small: dict[str, Any] = {"n_cities": 3, "total_hotels": 60}
    return SimulatorFleet.from_spec(
        {
            "acme": SupplierSpec(
                seed=1,
                accounts={
                    "slow": AccountSpec("acme-slow", slow_rps),
                    "fast": AccountSpec("acme-fast", 1000),
                },
                **small,
            ),
            "globex": SupplierSpec(
                seed=2,
                accounts={"a": AccountSpec("globex-a"), "b": AccountSpec("globex-b")},
                **small,
            ),
        }
    )


@pytest.fixture(scope="module")
def fleet() -> SimulatorFleet:
    return _fleet()


@pytest.fixture(scope="module")
def server(fleet: SimulatorFleet) -> Iterator[str]:
    with running_fleet_server(fleet) as url:
        yield url


def _http(server: str, supplier: str, account: str | None) -> httpx.Client:
    headers = {"X-Api-Key": KEYS[supplier, account]} if account else {}
    return httpx.Client(base_url=f"{server}/{supplier}", headers=headers, timeout=10)


def test_each_account_lists_its_own_catalog(server: str, fleet: SimulatorFleet) -> None:
    seen: dict[str, list[str]] = {}
    for supplier, account in KEYS:
        if (supplier, account) == ("globex", "broken"):
            continue  # every contract request of it is a 500
        with _http(server, supplier, account) as c:
            r = c.get("/v1/cities")
            assert r.status_code == 200, r.text
            codes = [city["city_code"] for city in r.json()["cities"]]
            assert codes == fleet.simulator(supplier, account).city_codes()
            truth = fleet.ground_truth(supplier, account)
            first = codes[0]
            listed = [h["hotel_id"] for h in walk_cursor(c, first, 50)]
            assert listed == list(truth.listed_by_city[first])
        seen[f"{supplier}/{account}"] = codes
    assert seen["acme/basic"] == seen["acme/premium"]
    assert set(HOSTILE_CITY_CODES) <= set(seen["acme/basic"])
    assert seen["acme/basic"] != seen["globex/main"]
    stats = fleet.stats()
    assert set(stats) == {"acme", "globex"}
    assert set(stats["acme"]) == {"basic", "premium"}
    for supplier, account in KEYS:
        if account != "broken":
            assert stats[supplier][account]["requests_by_endpoint"]["cities"] >= 1


def test_the_same_hotel_id_is_the_same_hotel_under_one_supplier(
    server: str, fleet: SimulatorFleet
) -> None:
    acme = fleet.ground_truth("acme", "basic")
    globex = fleet.ground_truth("globex", "main")
    shared_ids = sorted(set(acme.versions) & set(globex.versions))
    assert shared_ids, "both catalogs number their hotels from the same id space"
    with (
        _http(server, "acme", "basic") as basic,
        _http(server, "acme", "premium") as premium,
        _http(server, "globex", "main") as other,
    ):
        for hotel_id in shared_ids[:5]:
            mine = basic.get(f"/v1/hotels/{hotel_id}")
            assert mine.status_code == 200, mine.text
            assert premium.get(f"/v1/hotels/{hotel_id}").json() == mine.json()
            # Another supplier's seed: the same id is another hotel.
            theirs = other.get(f"/v1/hotels/{hotel_id}").json()
            assert theirs["hotel_id"] == hotel_id
            assert (theirs["name"], theirs["geo"]) != (mine.json()["name"], mine.json()["geo"])


def test_a_key_of_another_supplier_is_refused_like_a_wrong_key(
    server: str, fleet: SimulatorFleet
) -> None:
    before = fleet.stats()
    refused = fleet.refused()["unauthorized"]["globex"]
    with httpx.Client(base_url=f"{server}/globex", timeout=10) as c:
        r = c.get("/v1/cities", headers={"X-Api-Key": KEYS["acme", "premium"]})
        missing = c.get("/v1/cities")
    assert r.status_code == 401 and missing.status_code == 401
    # What the single simulator answers to a wrong key, headers included.
    single = make_sim(faults=None)
    with single.client() as own:
        expected = own.get("/v1/cities", headers={"X-Api-Key": "not-the-key"})
    assert (
        r.json()
        == expected.json()
        == {"error": {"code": "UNAUTHORIZED", "message": "missing or wrong X-Api-Key"}}
    )
    for name in ("content-type", "vary", "x-ratelimit-limit", "x-ratelimit-reset"):
        assert r.headers[name] == expected.headers[name], name
    assert r.headers["x-ratelimit-limit"] == r.headers["x-ratelimit-remaining"]
    assert fleet.refused()["unauthorized"]["globex"] == refused + 2
    # No account saw them: nothing counted, no bucket touched.
    after = fleet.stats()
    for account in ("main", "broken"):
        assert (
            after["globex"][account]["requests_total"]
            == before["globex"][account]["requests_total"]
        )


def test_unknown_supplier_is_404(server: str, fleet: SimulatorFleet) -> None:
    before = fleet.refused()["unknown_supplier"]
    key = {"X-Api-Key": KEYS["acme", "basic"]}
    with httpx.Client(base_url=server, headers=key, timeout=10) as c:
        for path in ("/initech/v1/cities", "/v1/cities", "/ACME/v1/cities", "/", "/acme%2Fv1"):
            r = c.get(path)
            assert r.status_code == 404, path
            assert r.json() == {"error": {"code": "NOT_FOUND", "message": "no such supplier"}}
        # The supplier segment is percent-decoded like any other: %61 is "a".
        assert c.get("/%61cme/v1/cities").status_code == 200
    assert fleet.refused()["unknown_supplier"] == before + 5


def test_each_account_has_its_own_rate_limit() -> None:
    fleet = _small_fleet(slow_rps=2)
    slow_statuses: list[int] = []
    fast_statuses: list[int] = []
    with (
        running_fleet_server(fleet) as url,
        httpx.Client(base_url=f"{url}/acme", headers={"X-Api-Key": "acme-slow"}) as slow,
        httpx.Client(base_url=f"{url}/acme", headers={"X-Api-Key": "acme-fast"}) as fast,
    ):
        for _ in range(12):
            slow_statuses.append(slow.get("/v1/cities").status_code)
            fast_statuses.append(fast.get("/v1/cities").status_code)
        limited = slow.get("/v1/cities")
    assert 429 in slow_statuses and slow_statuses[:2] == [200, 200]
    assert set(fast_statuses) == {200}
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    assert limited.headers["x-ratelimit-limit"] == "2"
    stats = fleet.stats()["acme"]
    assert stats["slow"]["rate_limited"] == slow_statuses.count(429) + 1
    assert stats["slow"]["responses_429"] == stats["slow"]["rate_limited"]
    assert stats["fast"]["rate_limited"] == 0 and stats["fast"]["requests_total"] == 12


def test_fleet_wide_advance_day_moves_every_account() -> None:
    fleet = _small_fleet()
    with running_fleet_server(fleet) as url, httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/_sim/advance_day")
        assert r.status_code == 200
        assert r.json() == {
            "acme": {"slow": {"day": 1}, "fast": {"day": 1}},
            "globex": {"a": {"day": 1}, "b": {"day": 1}},
        }
        # A supplier's admin path moves that supplier's accounts only.
        r = c.post("/globex/_sim/advance", params={"seconds": 90})
        assert r.json() == {
            "a": {"day": 1, "now": "2026-11-02T00:01:30Z"},
            "b": {"day": 1, "now": "2026-11-02T00:01:30Z"},
        }
        # A bad request moves no clock at all.
        bad = c.post("/_sim/advance", params={"seconds": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "INVALID_PARAMETER"
        assert c.post("/_sim/rewind").status_code == 404
        stats = c.get("/_sim/stats").json()
        assert {s: {a: v["now"] for a, v in accs.items()} for s, accs in stats.items()} == {
            "acme": {"slow": "2026-11-02T00:00:00Z", "fast": "2026-11-02T00:00:00Z"},
            "globex": {"a": "2026-11-02T00:01:30Z", "b": "2026-11-02T00:01:30Z"},
        }
        assert c.get("/acme/_sim/stats").json()["fast"]["day"] == 1
    assert {
        (s, a): fleet.simulator(s, a).clock for s, accs in fleet.suppliers.items() for a in accs
    } == {
        ("acme", "slow"): 86_400,
        ("acme", "fast"): 86_400,
        ("globex", "a"): 86_490,
        ("globex", "b"): 86_490,
    }
    assert fleet.advance_day(2) == {
        "acme": {"slow": 3, "fast": 3},
        "globex": {"a": 3, "b": 3},
    }
    moved = fleet.advance(60)
    assert {now.isoformat() for accs in moved.values() for now in accs.values()} == {
        "2026-11-04T00:01:00+00:00"
    }
    with pytest.raises(ValueError):
        fleet.advance(-1)
    assert fleet.simulator("acme", "slow").clock == 3 * 86_400 + 60


@pytest.mark.parametrize("code", HOSTILE_CITY_CODES)
def test_hostile_city_codes_survive_the_routing(
    server: str, fleet: SimulatorFleet, code: str
) -> None:
    truth = fleet.ground_truth("acme", "premium")
    with _http(server, "acme", "premium") as c:
        hotels = walk_cursor(c, code, 2)
        assert [h["hotel_id"] for h in hotels] == list(truth.listed_by_city[code])
        assert hotels and all(h["city_code"] == code for h in hotels)
        summary = c.get(f"/v1/cities/{encode_city_code(code)}/summary")
        assert summary.status_code == 200 and summary.json()["city_code"] == code


def test_escaped_slashes_and_dots_reach_the_account_as_sent(server: str) -> None:
    with _http(server, "acme", "basic") as c:
        for raw in ("/v1/cities/..%2F..%2Fetc/summary", "/v1/cities/%2E%2E%2F%2E%2E%2Fetc/summary"):
            r = c.get(raw)
            assert r.status_code == 200 and r.json()["city_code"] == "../../etc", raw
        assert c.get("/v1/cities/a|b/summary").json()["city_code"] == "a|b"


def _timeless(r: httpx.Response) -> Any:
    """The body, its cursor (which carries the real time it was issued at) cut to its form."""
    body = r.json()
    if isinstance(body.get("next_cursor"), str):
        body["next_cursor"] = "<cursor>"
    return body


def test_in_process_transport_answers_as_http(server: str, fleet: SimulatorFleet) -> None:
    city = fleet.simulator("acme", "premium").city_codes()[0]
    premium = KEYS["acme", "premium"]
    cases = [
        ("acme", premium, hotels_url(city) + "?page=2&page_size=7"),
        ("acme", premium, "/v1/hotels/changes?since=2026-10-31T00:00:00Z&limit=5"),
        ("globex", premium, "/v1/cities"),  # another supplier's key: 401
        ("initech", premium, "/v1/cities"),  # unknown supplier: 404
    ]
    for supplier, key, path in cases:
        headers = {"X-Api-Key": key}
        with (
            httpx.Client(base_url=f"{server}/{supplier}", headers=headers) as over_http,
            httpx.Client(
                transport=fleet.transport(), base_url=f"http://fleet/{supplier}", headers=headers
            ) as in_process,
        ):
            wire, local = over_http.get(path), in_process.get(path)
        assert (local.status_code, _timeless(local)) == (wire.status_code, _timeless(wire)), path
        assert local.headers.get("x-ratelimit-limit") == wire.headers.get("x-ratelimit-limit")
    with fleet.client("acme", "premium") as c:
        assert c.get(hotels_url(city), params={"page": 2, "page_size": 7}).status_code == 200


def test_each_account_has_its_own_fault_profile(fleet: SimulatorFleet) -> None:
    with fleet.client("globex", "broken") as broken, fleet.client("globex", "main") as main:
        assert [broken.get("/v1/cities").status_code for _ in range(3)] == [500] * 3
        assert main.get("/v1/cities").status_code == 200
    assert fleet.stats()["globex"]["broken"]["faults"].get("500", 0) >= 3
    assert fleet.stats()["globex"]["main"]["faults"] == {}


def _config(key: str, seed: int = 1) -> SimulatorConfig:
    return SimulatorConfig(seed=seed, n_cities=2, total_hotels=10, api_key=key)


@pytest.mark.parametrize("name", ["Acme", "_sim", "a/b", "", "acme\n", "-acme", "ac me", "é"])
def test_names_must_be_slugs(name: str) -> None:
    with pytest.raises(ValueError, match="slug"):
        SimulatorFleet({name: {"main": _config("k")}})
    with pytest.raises(ValueError, match="slug"):
        SimulatorFleet({"acme": {name: _config("k")}})


def test_invalid_fleets_are_refused() -> None:
    with pytest.raises(ValueError, match="distinct"):
        SimulatorFleet({"acme": {"a": _config("k")}, "globex": {"b": _config("k", seed=2)}})
    with pytest.raises(ValueError, match="distinct"):
        SimulatorFleet({"acme": {"a": _config("k"), "b": _config("k")}})
    with pytest.raises(ValueError, match="no account"):
        SimulatorFleet({"acme": {}})
    with pytest.raises(ValueError, match="at least one supplier"):
        SimulatorFleet({})
    with pytest.raises(ValueError, match="share seed"):
        SimulatorFleet.from_spec(
            {
                "acme": SupplierSpec(seed=5, accounts={"a": AccountSpec("k1")}),
                "globex": SupplierSpec(seed=5, accounts={"a": AccountSpec("k2")}),
            }
        )
    with pytest.raises(ValueError, match="unknown fault profile"):
        AccountSpec("k", faults="wobbly").fault_profile()


def test_from_spec_builds_one_configured_simulator_per_account() -> None:
    fleet = SimulatorFleet.from_spec(
        {
            "acme": SupplierSpec(
                seed=7,
                n_cities=2,
                total_hotels=20,
                settings={"daily_add_rate": 0.0},
                accounts={
                    "a": AccountSpec("k1", 3, faults="flaky"),
                    "b": AccountSpec("k2", rate_limit_burst=4),
                },
            )
        },
        day=2,
    )
    a, b = fleet.simulator("acme", "a"), fleet.simulator("acme", "b")
    assert isinstance(a, Simulator) and fleet.suppliers == {"acme": ("a", "b")}
    assert (a.config.seed, a.config.n_cities, a.config.total_hotels) == (7, 2, 20)
    assert (a.config.api_key, a.config.rate_limit_rps, a.config.faults) == (
        "k1",
        3,
        FaultProfile.flaky(),
    )
    assert (b.config.rate_limit_burst, b.config.faults) == (4, FaultProfile.clean())
    assert a.config.day == b.config.day == 2 and a.config.daily_add_rate == 0.0
    with pytest.raises(KeyError):
        fleet.simulator("acme", "c")
