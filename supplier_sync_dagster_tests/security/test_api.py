"""Issue 41's probes of the read API, each played as an attacker would and answered safely.

``supplier-sync serve-api`` runs as a process for authentication and the body limits (and, on
MariaDB with Redis and a PostgreSQL search index, for the flood of confirmations, the integer
and text probes); the rest goes through Starlette's TestClient on SQLite and MariaDB.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa
from starlette.testclient import TestClient

from supplier_sync_dagster.cli.serve_api import confirm_client
from supplier_sync_dagster.core.errors import (
    CircuitOpen,
    ConfigError,
    ProjectionUnavailable,
    RateShareExhausted,
    SupplierAuthError,
    SupplierBadRequest,
    SupplierNotFound,
    SupplierTimeout,
    SupplierUnavailable,
)
from supplier_sync_dagster.core.outbox.projections import HOTEL_KEY, InProcessHotelCache
from supplier_sync_dagster.core.settings import load_settings
from supplier_sync_dagster.core.supplier import InProcessTokenBucket, ShareLimiter, bucket_key
from supplier_sync_dagster.core.supplier.ratelimit import DEFAULT_KEY_PREFIX
from supplier_sync_dagster.defs.resources import supplier_resource
from supplier_sync_dagster.serve.api import (
    MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    PUBLIC_HOTEL_FIELDS,
    create_app,
)
from supplier_sync_dagster.simulator import FaultProfile, Simulator, SimulatorConfig
from supplier_sync_dagster_tests.cli.test_main import (  # noqa: F401 (cli_home: an autouse fixture)
    assert_one_line_error,
    cli_home,
    query,
    run,
    simulator,
    supplier,
    sync,
)
from supplier_sync_dagster_tests.helpers import (
    READ_API_HEADERS,
    READ_API_KEY,
    cli_process,
    free_port,
    stay,
    wait_for_http,
)
from supplier_sync_dagster_tests.serve.test_api import Api, a_hotel, served_api

OTHER_KEY = "another-read-api-key-9876543210"
SUPPLIER_PRIVATE = ("supplier_id", "supplier_hotel_id")
BIG_IDS = (2**63, 10**20, 0, -1)


# --- the TestClient probes (SQLite and MariaDB) ---------------------------------------------


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    with served_api(db_url, tmp_path) as served:
        yield served


def _confirm_body(api: Api, **changes: Any) -> dict[str, Any]:
    hotel = a_hotel(api.db)
    return {
        "hotel_id": hotel["resource_id"],
        "room_code": hotel["room_code"],
        "rate_plan_code": hotel["rate_plan_code"],
        **stay(),
        "guests": 1,
        **changes,
    }


def _assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["code"] == code, body
    assert "Traceback" not in response.text
    return dict(body["error"])


def test_a_hotel_and_search_results_show_only_the_platforms_fields(api: Api):
    hotel = a_hotel(api.db)
    rid = hotel["resource_id"]
    detail = api.client.get(f"/hotels/{rid}")
    assert detail.status_code == 200
    body = detail.json()
    assert set(body) - {"offers"} <= set(PUBLIC_HOTEL_FIELDS)
    assert body["resource_id"] == rid and body["name"] == hotel["name"]
    found = api.client.get("/hotels", params={"city": hotel["city_code"]}).json()
    assert found["count"] >= 1
    for shown in (detail.text, json.dumps(found)):
        for private in SUPPLIER_PRIVATE:
            assert f'"{private}"' not in shown
    for h in found["hotels"]:
        assert set(h) <= set(PUBLIC_HOTEL_FIELDS)
    # A document cached before the fields were enforced (a rolling upgrade) is not served.
    key = HOTEL_KEY.format(resource_id=rid)
    api.projections.cache.set(key, json.dumps({"supplier_id": 1001}).encode(), 60)
    rebuilt = api.client.get(f"/hotels/{rid}")
    assert rebuilt.headers["x-cache"] == "MISS" and "supplier_id" not in rebuilt.text


def test_integers_past_64_bits_are_400_in_the_path_the_query_and_the_body(api: Api):
    for big in BIG_IDS:
        _assert_error(api.client.get(f"/hotels/{big}"), 400, "INVALID_PARAMETER")
        confirm = api.client.post("/offers/confirm", json=_confirm_body(api, hotel_id=big))
        _assert_error(confirm, 400, "INVALID_PARAMETER")
    _assert_error(api.client.get("/hotels/" + "9" * 50), 400, "INVALID_PARAMETER")
    for params in (
        {"city": "X", "limit": str(2**63)},
        {"city": "X", "limit": str(10**20)},
        {"city": "X", "limit": "9" * 5000},
        {"city": "X", "stars": "1e400"},
        {"city": "X", "max_price": str(10**20)},
        {"city": "X", "max_price": "NaN"},
    ):
        _assert_error(api.client.get("/hotels", params=params), 400, "INVALID_PARAMETER")
    for guests in (2**63, 10**20, 1.5, True):
        confirm = api.client.post("/offers/confirm", json=_confirm_body(api, guests=guests))
        _assert_error(confirm, 400, "INVALID_PARAMETER")
    # The largest id is a fine question: there is no such hotel.
    _assert_error(api.client.get(f"/hotels/{2**63 - 1}"), 404, "HOTEL_NOT_FOUND")


def test_nul_noncharacters_and_bad_utf8_in_a_search_are_400_never_a_path(api: Api):
    for q in ("\x00", "spa\x00", "\ufffe", "\uffff", "\ufdd0", "\U0010ffff", "\x1b[31m"):
        r = api.client.get("/hotels", params={"q": q})
        _assert_error(r, 400, "INVALID_PARAMETER")
    # A lone surrogate cannot be UTF-8: its bytes arrive as the replacement character.
    for raw in ("%ED%A0%80", "%FF", "%00"):
        _assert_error(api.client.get(f"/hotels?q={raw}"), 400, "INVALID_PARAMETER")
    _assert_error(api.client.get("/hotels", params={"city": "a\x00"}), 400, "INVALID_PARAMETER")

    class Broken:
        def search(self, query: Any) -> Any:
            raise ProjectionUnavailable(
                "search index /srv/secret/search.sqlite3: sqlite3.OperationalError: "
                "unterminated string"
            )

    app = create_app(
        db=api.db,
        search=Broken(),  # type: ignore[arg-type]
        cache=InProcessHotelCache(),
        api_keys=[READ_API_KEY],
    )
    with TestClient(app, raise_server_exceptions=False, headers=READ_API_HEADERS) as client:
        r = client.get("/hotels", params={"q": "spa"})
        _assert_error(r, 503, "READ_MODEL_UNAVAILABLE")
        assert "/srv" not in r.text and "sqlite" not in r.text.lower()


def test_confirmation_dates_are_checked_by_the_database_clock(api: Api):
    today = date.today()
    for check_in, check_out in (
        (today - timedelta(days=3), today + timedelta(days=1)),  # in the past
        (today + timedelta(days=5), today + timedelta(days=5)),  # no night
        (today + timedelta(days=5), today + timedelta(days=4)),  # out before in
        (today + timedelta(days=5), today + timedelta(days=36)),  # 31 nights
        (today + timedelta(days=800), today + timedelta(days=801)),  # years ahead
    ):
        body = _confirm_body(api, check_in=check_in.isoformat(), check_out=check_out.isoformat())
        _assert_error(api.client.post("/offers/confirm", json=body), 400, "INVALID_PARAMETER")
    for bad in ("2026-1-1", "20301224", "2030-02-30", 20301224, None, "2030-12-24T00:00"):
        body = _confirm_body(api, check_in=bad)
        _assert_error(api.client.post("/offers/confirm", json=body), 400, "INVALID_PARAMETER")
    body = _confirm_body(api, **stay(ahead=5))
    assert api.client.post("/offers/confirm", json=body).status_code == 200
    # Ten days on by the database's clock, that check-in is in the past: the API's clock is
    # the database's, not the web server's.
    api.db.clock.advance(10 * 86_400)
    error = _assert_error(api.client.post("/offers/confirm", json=body), 400, "INVALID_PARAMETER")
    assert "past" in error["message"]


def test_deep_or_malformed_json_is_400_not_500(api: Api):
    json_headers = {"Content-Type": "application/json"}
    body = _confirm_body(api)
    for depth in (MAX_JSON_DEPTH + 1, 2_000):
        deep = "[" * depth + "]" * depth
        r = api.client.post(
            "/offers/confirm", content=deep[:MAX_BODY_BYTES].encode(), headers=json_headers
        )
        _assert_error(r, 400, "INVALID_BODY")
    nested = json.dumps({**body, "guests": 1, "extra": [[[[[[[[[1]]]]]]]]]})
    _assert_error(
        api.client.post("/offers/confirm", content=nested, headers=json_headers),
        400,
        "INVALID_BODY",
    )
    # Brackets inside strings are text, not nesting.
    texty = json.dumps({**body, "note": "[" * 100})
    assert (
        api.client.post("/offers/confirm", content=texty, headers=json_headers).status_code == 200
    )
    for raw in (b"{not json", b"\xff\xfe", b"", b'{"hotel_id": 1e400}', b"[1, 2]"):
        r = api.client.post("/offers/confirm", content=raw, headers=json_headers)
        assert r.status_code == 400 and r.json()["error"]["code"] in {
            "INVALID_BODY",
            "INVALID_PARAMETER",
        }


def test_a_form_or_text_post_cannot_confirm(api: Api):
    body = _confirm_body(api)
    before = api.sim.stats["requests_total"]
    for r in (
        api.client.post("/offers/confirm", data={k: str(v) for k, v in body.items()}),
        api.client.post("/offers/confirm", files={"f": ("a.json", json.dumps(body))}),
        api.client.post(
            "/offers/confirm", content=json.dumps(body), headers={"Content-Type": "text/plain"}
        ),
        api.client.post("/offers/confirm", content=json.dumps(body)),
    ):
        _assert_error(r, 415, "UNSUPPORTED_MEDIA_TYPE")
    assert api.sim.stats["requests_total"] == before  # the supplier was never asked
    charset = {"Content-Type": "application/json; charset=utf-8"}
    ok = api.client.post("/offers/confirm", content=json.dumps(body), headers=charset)
    assert ok.status_code == 200, ok.text


SECRET_TEXT = "SUPPLIER-INTERNAL-TRACE-77f3 db=core-eu-2 token=abc"


@pytest.mark.parametrize(
    ("failure", "status", "code", "retry_after"),
    [
        (SupplierNotFound(f"404 {SECRET_TEXT}", status=404), 404, "OFFER_UNAVAILABLE", None),
        (SupplierBadRequest(f"400 {SECRET_TEXT}", status=400), 502, "CONFIRMATION_FAILED", None),
        (SupplierAuthError(f"401 {SECRET_TEXT}", status=401), 502, "CONFIRMATION_FAILED", None),
        (
            SupplierUnavailable(f"503 {SECRET_TEXT}", reason="status_503", retry_after=30),
            502,
            "CONFIRMATION_FAILED",
            None,
        ),
        (
            SupplierTimeout(f"timeout {SECRET_TEXT}", reason="timeout"),
            504,
            "CONFIRMATION_TIMEOUT",
            None,
        ),
        (
            CircuitOpen(f"open after {SECRET_TEXT}", retry_in=2.5),
            503,
            "CONFIRMATION_UNAVAILABLE",
            "3",
        ),
        (RateShareExhausted(f"share {SECRET_TEXT}", retry_after=7.2), 429, "RATE_LIMITED", "8"),
    ],
)
def test_a_suppliers_error_text_is_logged_never_forwarded(
    api: Api,
    caplog: pytest.LogCaptureFixture,
    failure: Exception,
    status: int,
    code: str,
    retry_after: str | None,
):
    class Failing:
        def confirm_offer(self, **_: Any) -> Any:
            raise failure

    app = create_app(
        db=api.db,
        search=api.projections.search,
        cache=api.projections.cache,
        api_keys=[READ_API_KEY],
        supplier=lambda _sid: Failing(),  # type: ignore[arg-type,return-value]
    )
    with TestClient(app, raise_server_exceptions=False, headers=READ_API_HEADERS) as client:
        r = client.post("/offers/confirm", json=_confirm_body(api))
    _assert_error(r, status, code)
    assert "INTERNAL-TRACE" not in r.text and "core-eu" not in r.text and "token" not in r.text
    assert r.headers.get("retry-after") == retry_after
    assert SECRET_TEXT in caplog.text  # for the operator, in the server's log


@pytest.mark.parametrize("store", ["in-process", "redis"])
def test_a_flood_of_confirmations_leaves_the_syncs_bucket_its_tokens(
    api: Api, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, store: str
):
    redis_url = str(request.getfixturevalue("redis_url")) if store == "redis" else None
    monkeypatch.delenv("SUPPLIER_SYNC_CONFIRM_RATE_LIMIT", raising=False)
    # The simulator world the catalog was synced from, as the syncs' resource sees it; an
    # account of its own keeps the Redis keys apart from every other test's.
    resource = supplier_resource(
        base_url=None,
        redis_url=redis_url,
        account=f"flood-{uuid.uuid4().hex[:8]}",
        rate_limit_rps=2.0,
        sim_seed=9,
        sim_cities=3,
        sim_hotels=60,
        sim_profile="clean",
    )
    body = _confirm_body(api)
    with resource.client() as syncs, contextlib.ExitStack() as stack:
        confirming = confirm_client(stack, resource, load_settings())
        assert confirming.rate_limiter is not syncs.rate_limiter
        app = create_app(
            db=api.db,
            search=api.projections.search,
            cache=api.projections.cache,
            api_keys=[READ_API_KEY],
            supplier=lambda _sid: confirming,
        )
        with TestClient(app, raise_server_exceptions=False, headers=READ_API_HEADERS) as client:
            started = time.monotonic()
            answers = [client.post("/offers/confirm", json=body) for _ in range(30)]
            elapsed = time.monotonic() - started
        statuses = [r.status_code for r in answers]
        # The share is a tenth of 2/s with a burst of one: one confirmation goes through,
        # the others are answered 429 at once, not queued.
        assert statuses[0] == 200 and statuses.count(200) <= 1 + int(elapsed * 0.2) + 1
        assert statuses.count(429) >= 25, statuses
        assert all(r.headers["retry-after"] for r in answers if r.status_code == 429)
        assert elapsed < 20
        # The syncs' bucket (burst 1) still has its token: the flood never touched it.
        sync_bucket = syncs.rate_limiter
        assert sync_bucket is not None and sync_bucket.try_acquire() == 0.0  # type: ignore[attr-defined]


def test_an_empty_key_list_is_refused_never_an_open_api(api: Api):
    with pytest.raises(ConfigError, match="no API key"):
        create_app(
            db=api.db, search=api.projections.search, cache=api.projections.cache, api_keys=[]
        )
    # Open only when said so: then the description declares no security either.
    app = create_app(
        db=api.db, search=api.projections.search, cache=api.projections.cache, api_keys=None
    )
    with TestClient(app) as client:
        assert client.get("/openapi.json").json()["security"] == []
        assert (
            client.get("/hotels", params={"city": a_hotel(api.db)["city_code"]}).status_code == 200
        )
    assert api.client.get("/openapi.json").json()["security"] == [{"bearer": []}, {"apiKey": []}]
    keyless = TestClient(api.client.app)
    _assert_error(keyless.get("/hotels", params={"city": "X"}), 401, "UNAUTHORIZED")


def test_a_share_waits_a_little_then_refuses_without_taking_a_token():
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    bucket = InProcessTokenBucket(2.0, 1.0, monotonic=lambda: now[0], sleep=sleep)
    share = ShareLimiter(bucket, name="confirm", max_wait=0.5, sleep=sleep)
    assert share.acquire() == 0.0  # the burst
    assert share.acquire() == pytest.approx(0.5) and slept == [pytest.approx(0.5)]
    slow = ShareLimiter(bucket, name="confirm", max_wait=0.1, sleep=sleep)
    with pytest.raises(RateShareExhausted) as refused:
        slow.acquire()
    assert refused.value.retry_after == pytest.approx(0.5) and len(slept) == 1
    now[0] += 0.5  # the token it did not take is there
    assert slow.acquire() == 0.0


# --- serve-api as a process ----------------------------------------------------------------


@contextlib.contextmanager
def serve_api_process(
    db_url: str, env: dict[str, str], *extra: str, options: Sequence[str] = ()
) -> Iterator[tuple[str, Any]]:
    """``supplier-sync [OPTIONS] --db-url DB_URL serve-api [EXTRA]`` as a process on a free
    port: its base URL and the process, whose ``output`` is (stdout, stderr) once stopped."""
    port = free_port()
    argv = (*options, "--db-url", db_url, "serve-api", "--port", str(port), *extra)
    proc = cli_process(*argv, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_http(f"{base}/health", proc)
        yield base, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.output = proc.communicate(timeout=30)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _post_streamed(
    base: str, total: int, headers: dict[str, str], *, declared: bool = False
) -> tuple[bytes, int, int]:
    """POSTs a body of ``total`` bytes on a raw socket while reading the answer: chunked,
    or (``declared``) with its Content-Length and no byte of it sent.

    Returns:
        The answer's bytes, the bytes sent when it began, and the bytes sent in all.
    """
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    framing = f"Content-Length: {total}" if declared else "Transfer-Encoding: chunked"
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(
        f"POST /offers/confirm HTTP/1.1\r\nHost: {host}\r\n{framing}\r\n{head}\r\n".encode()
    )
    if declared:
        total = 0
    sent = [0]
    answer: list[bytes] = []
    answered_at: list[int] = []

    def read() -> None:
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                if not answer:
                    answered_at.append(sent[0])
                answer.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    chunk = b"%x\r\n" % 65536 + b" " * 65536 + b"\r\n"
    with contextlib.suppress(OSError):
        while sent[0] < total:
            sock.sendall(chunk)
            sent[0] += 65536
    reader.join(10)
    sock.close()
    return b"".join(answer), (answered_at or [sent[0]])[0], sent[0]


def catalog_offer(capsys: pytest.CaptureFixture[str], db_url: str) -> tuple[int, dict[str, Any]]:
    """A catalog synced and dispatched: one hotel's resource id, with its city and the body
    that confirms one of its offers."""
    assert sync(capsys, db_url).code == 0
    assert run(capsys, "--db-url", db_url, "dispatch", "--once").code == 0
    row = query(
        db_url,
        sa.text(
            "SELECT h.resource_id, h.city_code, o.room_code, o.rate_plan_code "
            "FROM platform_hotel_resource h JOIN platform_hotel_offer o "
            "ON o.resource_id = h.resource_id WHERE o.active = 1 AND o.available = 1 "
            "ORDER BY 1 LIMIT 1"
        ),
    )[0]
    body = {
        "hotel_id": row.resource_id,
        "room_code": row.room_code,
        "rate_plan_code": row.rate_plan_code,
        **stay(),
        "guests": 1,
    }
    return row.resource_id, {"city": row.city_code, "body": body}


def test_serve_api_process_asks_for_a_key_refuses_forms_and_large_bodies(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    db_url = f"sqlite:///{tmp_path / 'sync.sqlite3'}"
    sim = simulator(total_hotels=60)
    with supplier(sim, monkeypatch):
        rid, found = catalog_offer(capsys, db_url)
        body = found["body"]
        env = dict(os.environ)
        env["SUPPLIER_SYNC_API_KEYS"] = f" {READ_API_KEY}, {OTHER_KEY} ,"
        with serve_api_process(db_url, env) as (base, proc):
            # Open: the health route and the description, which documents every limit.
            assert httpx.get(f"{base}/health").json() == {"status": "ok"}
            spec = httpx.get(f"{base}/openapi.json").json()
            assert set(spec["components"]["securitySchemes"]) == {"bearer", "apiKey"}
            confirm = spec["paths"]["/offers/confirm"]["post"]
            assert {"401", "413", "415", "400", "429"} <= set(confirm["responses"])
            assert confirm["x-max-body-bytes"] == MAX_BODY_BYTES
            assert str(MAX_BODY_BYTES) in confirm["requestBody"]["description"]
            q = spec["paths"]["/hotels"]["get"]["parameters"][0]
            assert q["name"] == "q" and q["schema"]["maxLength"] == 256
            rid_schema = spec["paths"]["/hotels/{resource_id}"]["get"]["parameters"][0]["schema"]
            assert rid_schema["maximum"] == 2**63 - 1

            # No key, a wrong one, a near miss: 401 with a challenge, nothing of the data.
            detail = f"{base}/hotels/{rid}"
            for headers, invalid in (
                ({}, False),
                ({"Authorization": "Bearer"}, False),
                ({"Authorization": f"Basic {READ_API_KEY}"}, False),
                ({"Authorization": "Bearer wrong-key-wrong-key-wrong"}, True),
                ({"X-Api-Key": READ_API_KEY[:-1]}, True),
                ({"X-Api-Key": READ_API_KEY + "x"}, True),
                ({"X-Api-Key": READ_API_KEY.upper()}, True),
            ):
                for r in (
                    httpx.get(detail, headers=headers),
                    httpx.get(f"{base}/hotels", params={"city": found["city"]}, headers=headers),
                    httpx.post(f"{base}/offers/confirm", json=body, headers=headers),
                ):
                    _assert_error(r, 401, "UNAUTHORIZED")
                    challenge = r.headers["www-authenticate"]
                    assert challenge.startswith("Bearer realm=")
                    assert ('error="invalid_token"' in challenge) is invalid
                    assert "resource_id" not in r.text
            # Either key, either header style.
            for headers in (
                {"Authorization": f"Bearer {READ_API_KEY}"},
                {"authorization": f"bearer {OTHER_KEY}"},
                {"X-Api-Key": OTHER_KEY},
                {"X-Api-Key": READ_API_KEY},
            ):
                assert httpx.get(detail, headers=headers).status_code == 200
            good = {"X-Api-Key": READ_API_KEY}

            # A browser's form post, or text: 415, the supplier never asked.
            before = sim.stats["requests_total"]
            for r in (
                httpx.post(
                    f"{base}/offers/confirm",
                    data={k: str(v) for k, v in body.items()},
                    headers=good,
                ),
                httpx.post(
                    f"{base}/offers/confirm",
                    content=json.dumps(body),
                    headers={**good, "Content-Type": "text/plain"},
                ),
            ):
                _assert_error(r, 415, "UNSUPPORTED_MEDIA_TYPE")
            assert sim.stats["requests_total"] == before

            # 200 MB announced: refused by its Content-Length before a byte of it is read.
            json_type = {**good, "Content-Type": "application/json"}
            answer, _, _ = _post_streamed(base, 200 * 2**20, json_type, declared=True)
            assert answer.startswith(b"HTTP/1.1 413") and b"BODY_TOO_LARGE" in answer
            # 200 MB streamed with no length: answered 413 early, never held in memory.
            rss = _rss_kib(proc.pid)
            answer, answered_at, sent = _post_streamed(base, 200 * 2**20, json_type)
            assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
            assert answered_at < 32 * 2**20 and sent < 100 * 2**20, (answered_at, sent)
            assert _rss_kib(proc.pid) - rss < 32 * 1024
            # A body within the limit but not JSON, and one that is: the API still answers.
            _assert_error(
                httpx.post(
                    f"{base}/offers/confirm",
                    content=b"x" * (MAX_BODY_BYTES + 1),
                    headers={**good, "Content-Type": "application/json"},
                ),
                413,
                "BODY_TOO_LARGE",
            )
            ok = httpx.post(f"{base}/offers/confirm", json=body, headers=good, timeout=30)
            assert ok.status_code == 200, ok.text


def test_serve_api_will_not_start_open_unless_told_on_loopback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("SUPPLIER_SYNC_API_KEYS", raising=False)
    line = assert_one_line_error(run(capsys, "serve-api"), code=2)
    assert "SUPPLIER_SYNC_API_KEYS" in line and "--no-auth" in line
    for host in ("0.0.0.0", "192.168.1.10", "::"):
        line = assert_one_line_error(run(capsys, "serve-api", "--no-auth", "--host", host), code=2)
        assert "loopback" in line
    monkeypatch.setenv("SUPPLIER_SYNC_API_KEYS", READ_API_KEY)
    line = assert_one_line_error(run(capsys, "serve-api", "--no-auth"), code=2)
    assert READ_API_KEY not in line
    # A malformed key is named by its place in the list, never echoed.
    for keys, leak in (
        ("shortKEYzz", "shortKEYzz"),
        (f"{READ_API_KEY},has SPACEKEY in it ok", "SPACEKEY"),
        (f"{READ_API_KEY},ключ-ключ-ключ-ключ-KEY", "ключ"),
        (",", ","),
    ):
        monkeypatch.setenv("SUPPLIER_SYNC_API_KEYS", keys)
        line = assert_one_line_error(run(capsys, "serve-api"), code=2)
        assert "SUPPLIER_SYNC_API_KEYS" in line and READ_API_KEY not in line
        assert leak == "," or leak not in line


def test_serve_api_process_on_mariadb_redis_and_postgres_search(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fresh_mysql_db: str,
    redis_url: str,
    fresh_postgres_db: str,
):
    """The integer, text and date probes against the production stores, and a flood of
    confirmations that spends its own share in Redis, never the syncs' bucket."""
    # A supplier key of this test's own: the syncs' bucket key in Redis is this test's only.
    key = f"sim-{uuid.uuid4().hex}"
    sim = Simulator(
        SimulatorConfig(
            api_key=key, faults=FaultProfile.clean(), seed=51, n_cities=3, total_hotels=60
        )
    )
    monkeypatch.setenv("SUPPLIER_SYNC_SEARCH_URL", fresh_postgres_db)
    with supplier(sim, monkeypatch):
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", key)
        rid, found = catalog_offer(capsys, fresh_mysql_db)
        body = found["body"]
        env = dict(os.environ)
        env.update(
            SUPPLIER_SYNC_API_KEYS=READ_API_KEY,
            SUPPLIER_SYNC_REDIS_URL=redis_url,
            SUPPLIER_SYNC_CONFIRM_RATE_LIMIT="0.2",
        )
        syncs_key = bucket_key(DEFAULT_KEY_PREFIX, "1001", key)
        share_key = bucket_key(f"{DEFAULT_KEY_PREFIX}:share:confirm", "1001", key)
        store = redis.Redis.from_url(redis_url)
        store.delete(syncs_key, share_key)
        with (
            serve_api_process(fresh_mysql_db, env) as (base, _proc),
            httpx.Client(base_url=base, headers=READ_API_HEADERS, timeout=30) as client,
        ):
            found_hotels = client.get("/hotels", params={"city": found["city"]})
            assert found_hotels.status_code == 200 and found_hotels.json()["count"] >= 1
            assert all(set(h) <= set(PUBLIC_HOTEL_FIELDS) for h in found_hotels.json()["hotels"])
            detail = client.get(f"/hotels/{rid}")
            assert detail.status_code == 200
            assert not any(f'"{p}"' in detail.text for p in SUPPLIER_PRIVATE)
            for q in ("a\x00b", "\ufffe", "\U0001fffe"):
                r = client.get("/hotels", params={"q": q})
                _assert_error(r, 400, "INVALID_PARAMETER")
                assert "postgres" not in r.text.lower() and "/" not in r.json()["error"]["message"]
            for big in BIG_IDS:
                _assert_error(client.get(f"/hotels/{big}"), 400, "INVALID_PARAMETER")
                r = client.post("/offers/confirm", json={**body, "hotel_id": big})
                _assert_error(r, 400, "INVALID_PARAMETER")
            _assert_error(
                client.get("/hotels", params={"city": "X", "limit": str(10**20)}),
                400,
                "INVALID_PARAMETER",
            )
            past = {**body, "check_in": (date.today() - timedelta(days=2)).isoformat()}
            _assert_error(client.post("/offers/confirm", json=past), 400, "INVALID_PARAMETER")
            deep = "[" * 5000 + "]" * 5000
            r = client.post(
                "/offers/confirm", content=deep, headers={"Content-Type": "application/json"}
            )
            _assert_error(r, 400, "INVALID_BODY")

            # The flood: the share (0.2/s, one token) lets one through, then 429 at once.
            before = sim.stats["requests_total"]
            statuses = [client.post("/offers/confirm", json=body).status_code for _ in range(20)]
            assert statuses[0] == 200 and statuses.count(429) >= 18, statuses
            assert sim.stats["requests_total"] - before <= 2
        # The confirmations spent their share's key; the syncs' bucket was never touched.
        assert store.exists(share_key) and not store.exists(syncs_key)
        store.close()
