"""Test doubles shared by the supplier client tests: a fake clock and scripted transports."""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from supplier_sync_dagster.core.supplier import CircuitBreaker, RetryPolicy, SupplierClient

API_KEY = "sk-live-0123456789abcdef-SECRET"
BASE_URL = "https://supplier.test/api/"


@dataclass
class FakeClock:
    """Monotonic time that only moves when someone sleeps (or the test advances it)."""

    now: float = 1000.0
    sleeps: list[float] = field(default_factory=list)
    wall_offset: float = 1_800_000_000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.wall_offset + self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds


Handler = Callable[[httpx.Request], httpx.Response]


class Script:
    """A transport handler that answers with a fixed sequence of responses (or exceptions)."""

    def __init__(self, *steps: httpx.Response | Exception | Handler) -> None:
        self.steps = list(steps)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if not self.steps:
            raise AssertionError(f"unexpected request #{len(self.requests)}: {request.url}")
        step = self.steps.pop(0)
        if isinstance(step, Exception):
            if isinstance(step, httpx.RequestError):
                step.request = request
            raise step
        if isinstance(step, httpx.Response):
            return step
        return step(request)


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, content=json.dumps(body).encode(), headers=headers)


def error_response(
    status: int, code: str, message: str = "", headers: dict[str, str] | None = None
) -> httpx.Response:
    return json_response(status, {"error": {"code": code, "message": message}}, headers)


CITIES = {"cities": [{"city_code": "BKK", "name": "Bangkok", "country_code": "TH"}], "total": 1}


def make_client(
    handler: Handler,
    *,
    clock: FakeClock | None = None,
    retry: RetryPolicy | None = None,
    breaker: CircuitBreaker | None = None,
    **kwargs: Any,
) -> tuple[SupplierClient, FakeClock]:
    clock = clock or FakeClock()
    http = httpx.Client(base_url=BASE_URL, transport=httpx.MockTransport(handler))
    client = SupplierClient(
        http,
        api_key=API_KEY,
        supplier_id="acme",
        retry=retry or RetryPolicy(max_attempts=5, base_delay=0.5, max_delay=8, max_total_wait=60),
        breaker=breaker
        or CircuitBreaker(name="acme", failure_threshold=50, monotonic=clock.monotonic),
        sleep=clock.sleep,
        monotonic=clock.monotonic,
        wall_clock=clock.wall,
        rng=random.Random(7),
        **kwargs,
    )
    return client, clock


def hotel(hotel_id: str, city: str = "BKK") -> dict[str, Any]:
    return {
        "hotel_id": hotel_id,
        "name": f"Hotel {hotel_id}",
        "city_code": city,
        "country_code": "TH",
        "geo": {"lat": 13.7, "lng": 100.5},
        "status": "ACTIVE",
        "updated_at": "2026-11-20T10:00:00Z",
        "version": 1,
    }


class FakeCatalog:
    """An in-memory supplier for one city that serves pages by number and by cursor.

    Cursors encode the last hotel id of their page, so they survive inserts and deletes.
    ``expire`` lists the 1-based indexes of cursor requests answered 410 CURSOR_EXPIRED;
    ``on_request`` runs before each request is answered (to mutate the data mid-walk).
    """

    def __init__(
        self,
        ids: Iterable[str],
        *,
        city: str = "BKK",
        cursors: bool = True,
        expire: Iterable[int] = (),
        on_request: Callable[[FakeCatalog, httpx.Request], None] | None = None,
    ) -> None:
        self.ids = sorted(ids)
        self.city = city
        self.cursors = cursors
        self.expire = set(expire)
        self.on_request = on_request
        self.requests: list[httpx.Request] = []
        self.cursor_requests = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.on_request is not None:
            self.on_request(self, request)
        size = int(request.url.params.get("page_size", "100"))
        total_pages = max(1, -(-len(self.ids) // size))
        cursor = request.url.params.get("cursor")
        if cursor is not None:
            self.cursor_requests += 1
            if self.cursor_requests in self.expire:
                return error_response(410, "CURSOR_EXPIRED", "cursor too old")
            after = base64.urlsafe_b64decode(cursor.encode()).decode()
            chunk = [i for i in self.ids if i > after][:size]
            page_no: int | None = None
        else:
            page_no = int(request.url.params.get("page", "1"))
            chunk = self.ids[(page_no - 1) * size : page_no * size]
        is_last = not chunk or chunk[-1] == self.ids[-1]
        next_cursor = (
            base64.urlsafe_b64encode(chunk[-1].encode()).decode()
            if self.cursors and chunk and not is_last
            else None
        )
        body = {
            "city_code": self.city,
            "page": page_no,
            "page_size": size,
            "total": len(self.ids),
            "total_pages": total_pages,
            "next_cursor": next_cursor,
            "hotels": [hotel(i, self.city) for i in chunk],
        }
        return json_response(200, body)


def ids(n: int, start: int = 1) -> list[str]:
    return [f"H{i:06d}" for i in range(start, start + n)]
