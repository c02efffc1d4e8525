"""Fault injection, the rate limiter, counters, and bad data against the ground truth."""

from __future__ import annotations

import email.utils
import json
import threading
import time
from typing import Any

import httpx
import pytest

from supplier_sync_dagster.simulator import BAD_RECORD_REASONS, FaultProfile, Simulator
from supplier_sync_dagster.simulator.ratelimit import TokenBucket
from supplier_sync_dagster_tests.simulator.contract_check import violation
from supplier_sync_dagster_tests.simulator.helpers import hotels_url, make_sim, walk_pages


def _get(sim: Simulator, path: str = "/v1/cities", **params: Any) -> httpx.Response:
    with sim.client() as c:
        return c.get(path, params=params)


def test_429_with_retry_after_in_seconds_and_as_http_date() -> None:
    seconds = make_sim(
        FaultProfile(rate_429=1.0, retry_after_http_date_share=0.0, retry_after_seconds=3)
    )
    r = _get(seconds)
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    dated = make_sim(
        FaultProfile(rate_429=1.0, retry_after_http_date_share=1.0, retry_after_seconds=2)
    )
    r = _get(dated)
    assert r.status_code == 429
    when = email.utils.parsedate_to_datetime(r.headers["retry-after"])
    assert 0 < when.timestamp() - time.time() <= 3.1
    assert dated.stats["faults"] == {"429": 1} and dated.stats["responses_429"] == 1


def test_a_detail_outage_fails_single_hotel_requests_only() -> None:
    sim = make_sim(FaultProfile(detail_outage_rate=1.0))
    city = _get(sim).json()["cities"][0]["city_code"]
    page = _get(sim, hotels_url(city))
    assert page.status_code == 200  # listings work
    hotel = page.json()["hotels"][0]["hotel_id"]
    detail = _get(sim, f"/v1/hotels/{hotel}")
    assert detail.status_code == 503 and "code" in detail.json()["error"]
    assert sim.stats["faults"] == {"503": 1}


@pytest.mark.parametrize(
    ("field", "status", "html"),
    [
        ("rate_500", 500, False),
        ("rate_502_html", 502, True),
        ("rate_503", 503, False),
        ("rate_504", 504, True),
    ],
)
def test_5xx_faults(field: str, status: int, html: bool) -> None:
    sim = make_sim(FaultProfile().with_(**{field: 1.0}))
    responses = [_get(sim) for _ in range(6)]
    assert {r.status_code for r in responses} == {status}
    for r in responses:
        if html:
            assert r.headers["content-type"].startswith("text/html") and b"<html>" in r.content
        else:
            assert "code" in r.json()["error"]
        assert "x-ratelimit-remaining" in r.headers
    if status == 503:
        assert any("retry-after" in r.headers for r in responses)
    assert sum(sim.stats["faults"].values()) == 6


def test_200_with_error_envelope() -> None:
    sim = make_sim(FaultProfile(rate_error_envelope_200=1.0))
    r = _get(sim)
    assert r.status_code == 200
    assert set(r.json()) == {"error"} and r.json()["error"]["code"]


def test_truncated_body_has_valid_headers_and_cut_json() -> None:
    sim = make_sim(FaultProfile(rate_truncated=1.0))
    for accept in ("identity", "gzip"):
        with sim.client() as c:
            r = c.get("/v1/cities", headers={"Accept-Encoding": accept})
        assert r.status_code == 200
        assert int(r.headers["content-length"]) == len(r.read()) or accept == "gzip"
        with pytest.raises(json.JSONDecodeError):
            json.loads(r.content)
    assert sim.stats["faults"]["truncated"] == 2


def test_a_listed_city_whose_hotels_answer_404() -> None:
    codes = make_sim().city_codes()
    sim = make_sim(FaultProfile(unlisted_hotels_city_codes=(codes[0],)))
    with sim.client() as c:
        listed = [x["city_code"] for x in c.get("/v1/cities").json()["cities"]]
        missing = c.get(hotels_url(codes[0]))
        other = c.get(hotels_url(codes[1]))
    assert codes[0] in listed
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "CITY_NOT_FOUND"
    assert other.status_code == 200 and other.json()["hotels"]


def test_an_emptied_city_answers_an_empty_page_and_a_failing_city_503() -> None:
    codes = make_sim().city_codes()
    sim = make_sim(FaultProfile(emptied_city_codes=(codes[0],), failing_city_codes=(codes[1],)))
    with sim.client() as c:
        listed = [x["city_code"] for x in c.get("/v1/cities").json()["cities"]]
        emptied = c.get(hotels_url(codes[0]), params={"page_size": 7})
        failing = c.get(hotels_url(codes[1]))
        other = c.get(hotels_url(codes[2]))
    assert {codes[0], codes[1]} <= set(listed)
    body = emptied.json()
    assert emptied.status_code == 200 and body["hotels"] == [] and body["total"] == 0
    assert body["page_size"] == 7
    assert body["next_cursor"] is None
    assert failing.status_code == 503 and failing.json()["error"]["code"] == "UNAVAILABLE"
    assert other.status_code == 200 and other.json()["hotels"]


def test_slow_response_sleeps() -> None:
    sim = make_sim(FaultProfile(rate_slow=1.0, slow_seconds=0.3))
    started = time.monotonic()
    assert _get(sim).status_code == 200
    assert time.monotonic() - started >= 0.3
    assert sim.stats["faults"] == {"slow": 1}


def test_injected_cursor_expiry() -> None:
    sim = make_sim(FaultProfile(rate_cursor_expired=1.0))
    code = sim.city_codes()[0]
    with sim.client() as c:
        first = c.get(hotels_url(code), params={"page_size": 5}).json()
        r = c.get(hotels_url(code), params={"cursor": first["next_cursor"]})
    assert r.status_code == 410 and r.json()["error"]["code"] == "CURSOR_EXPIRED"


def test_transient_faults_are_per_request_so_retries_succeed() -> None:
    sim = make_sim(FaultProfile(rate_500=0.3, rate_503=0.2))
    statuses = [_get(sim).status_code for _ in range(60)]
    assert statuses.count(200) > 10
    assert statuses.count(500) > 5 and statuses.count(503) > 2
    again = make_sim(FaultProfile(rate_500=0.3, rate_503=0.2))
    assert [_get(again).status_code for _ in range(60)] == statuses, "seeded: same sequence"


def test_duplicate_across_pages() -> None:
    sim = make_sim(FaultProfile(duplicate_across_pages_rate=1.0))
    code = sim.city_codes()[0]
    with sim.client() as c:
        hotels = walk_pages(c, code, 10)
    ids = [h["hotel_id"] for h in hotels]
    assert len(ids) > len(set(ids)), "hotels repeat across pages"
    assert set(ids) == set(sim.ground_truth().listed_by_city[code]), "but none is lost"
    assert sim.stats["faults"]["duplicate_across_pages"] > 0


def test_rate_limiter_answers_429_and_counts() -> None:
    sim = make_sim(rate_limit_rps=2.0, rate_limit_burst=4)
    with sim.client() as c:
        responses = [c.get("/v1/cities") for _ in range(10)]
    codes = [r.status_code for r in responses]
    assert codes[:4] == [200] * 4
    assert codes.count(429) >= 5
    limited = next(r for r in responses if r.status_code == 429)
    assert int(limited.headers["retry-after"]) >= 1
    assert limited.headers["x-ratelimit-limit"] == "4"
    assert limited.headers["x-ratelimit-remaining"] == "0"
    assert limited.json()["error"]["code"] == "RATE_LIMITED"
    stats = sim.stats
    assert stats["rate_limited"] == codes.count(429) == stats["responses_by_status"]["429"]
    assert stats["requests_total"] == 10 and stats["requests_by_endpoint"]["cities"] == 10
    assert stats["bytes_sent"] > 0


def test_rate_limit_is_shared_by_concurrent_callers() -> None:
    sim = make_sim(rate_limit_rps=20.0, rate_limit_burst=5)
    ok = []
    lock = threading.Lock()

    def worker() -> None:
        with sim.client() as c:
            for _ in range(15):
                if c.get("/v1/cities").status_code == 200:
                    with lock:
                        ok.append(time.monotonic())

    started = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    assert len(ok) <= 5 + 20 * elapsed + 1
    assert sim.stats["rate_limited"] == 60 - len(ok)


def test_token_bucket_refills_with_time() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=2.0, burst=2, clock=lambda: now[0])
    assert bucket.acquire().allowed and bucket.acquire().allowed
    refused = bucket.acquire()
    assert not refused.allowed and refused.retry_after == 1 and refused.remaining == 0
    now[0] = 0.5
    assert bucket.acquire().allowed
    assert not bucket.acquire().allowed
    now[0] = 10.0
    assert bucket.peek().remaining == 2 and bucket.peek().reset_seconds == 0


def _served(sim: Simulator) -> dict[str, dict]:
    out: dict[str, dict] = {}
    with sim.client() as c:
        for code in sim.city_codes():
            for h in walk_pages(c, code, 500):
                out[h["hotel_id"]] = h
    return out


def test_bad_records_match_ground_truth_exactly() -> None:
    sim = make_sim(FaultProfile(bad_record_rate=0.25), n_cities=4, total_hotels=1200)
    truth = sim.ground_truth()
    served = _served(sim)
    assert served.keys() == truth.versions.keys()
    verdicts = {hid: violation(rec) for hid, rec in served.items()}
    assert {h: v for h, v in verdicts.items() if v is not None} == dict(truth.bad)
    assert {h for h, v in verdicts.items() if v is None} == truth.valid.keys()
    assert set(truth.bad.values()) == set(BAD_RECORD_REASONS), "every kind of bad record occurs"
    oversized = next(h for h, r in truth.bad.items() if r == "OVERSIZED_STRING")
    assert len(served[oversized]["name"]) >= 100 * 1024
    assert sim.stats["bad_records_served"] == len(truth.bad)
    # Bad data is a property of the data: the same hotels are bad on the next request.
    assert _served(sim) == served


def test_moved_hotels_are_listed_under_their_old_city() -> None:
    sim = make_sim(FaultProfile(moved_hotel_rate=0.1))
    truth = sim.ground_truth()
    assert truth.moved
    served_under: dict[str, str] = {}
    with sim.client() as c:
        for code in sim.city_codes():
            for h in walk_pages(c, code, 500):
                served_under[h["hotel_id"]] = code
                if h["hotel_id"] in truth.moved:
                    assert h["city_code"] == truth.moved[h["hotel_id"]] != code
                else:
                    assert h["city_code"] == code
        for hid, new_city in truth.moved.items():
            assert hid in truth.valid_by_city[new_city]
            assert hid not in truth.valid_by_city[served_under[hid]]
        # Summaries count a moved hotel where it really is.
        for code in sim.city_codes():
            s = c.get(f"/v1/cities/{code}/summary").json()
            assert s["hotel_count"] == len(truth.valid_by_city[code])


def test_geo_renamed_location_from_a_day_on() -> None:
    sim = make_sim(FaultProfile(location_rename_from_day=1), n_cities=2, total_hotels=100)
    code = sim.city_codes()[0]
    with sim.client() as c:
        before = c.get(hotels_url(code), params={"page_size": 5}).json()["hotels"]
        sim.advance_day()
        after = c.get(hotels_url(code), params={"page_size": 5}).json()["hotels"]
    assert all("geo" in h and "location" not in h for h in before)
    assert all("location" in h and "geo" not in h for h in after)
    assert set(sim.ground_truth().bad.values()) == {"GEO_RENAMED_LOCATION"}
    assert not sim.ground_truth(day=0).bad


def test_flaky_profile_can_be_synced_exactly_with_retries() -> None:
    sim = make_sim(
        FaultProfile.flaky().with_(slow_seconds=0.0, bad_record_rate=0.05, moved_hotel_rate=0.02)
    )
    truth = sim.ground_truth()
    seen: dict[str, dict] = {}
    with sim.client() as c:
        for code in sim.city_codes():
            page = 1
            while True:
                for _ in range(50):  # retry transient faults
                    r = c.get(hotels_url(code), params={"page": page, "page_size": 7})
                    try:
                        body = r.json()
                    except json.JSONDecodeError:
                        continue
                    if r.status_code == 200 and "error" not in body:
                        break
                else:
                    pytest.fail("a page never succeeded")
                for h in body["hotels"]:
                    seen[h["hotel_id"]] = h
                if not body["hotels"]:
                    break
                page += 1
    assert seen.keys() == truth.versions.keys()
    assert {h for h, rec in seen.items() if violation(rec) is None} == truth.valid.keys()
    faults = sim.stats["faults"]
    assert len(faults) >= 3, faults  # ~7 % of ~100 requests fail in several ways
