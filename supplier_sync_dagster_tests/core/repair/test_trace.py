"""Trace of a hotel changed over three days (three windows of a change feed): each diff in
order, the bytes of each version re-verified, the supplier's record extracted; a page whose
stored bytes were changed is reported, not trusted (SQLite and MariaDB)."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from supplier_sync_dagster.core.errors import NotFound
from supplier_sync_dagster.core.repair.trace import trace_hotel
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster_tests.core.repair.test_incremental import Feed, _run, _start_at, hotel


@pytest.fixture
def feed() -> Feed:
    return Feed()


@pytest.fixture
def client(feed: Feed) -> Iterator[SupplierClient]:
    with httpx.Client(
        base_url="http://supplier", transport=httpx.MockTransport(feed.handle)
    ) as http:
        yield SupplierClient(http, api_key="k", supplier_id="fake")


@pytest.fixture
def store(tmp_path: Path) -> LocalPayloadStore:
    return LocalPayloadStore(tmp_path / "payloads")


def _three_days(db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed):
    _start_at(db, 0)
    feed.change(hotel(1, at=10, version=1))
    feed.change(hotel(2, at=11, version=1))
    _run(db, store, client, "day1")
    feed.change(hotel(1, at=86_400, version=2))  # the price moves: 101.00 -> 102.00
    _run(db, store, client, "day2")
    feed.change(hotel(1, at=2 * 86_400, version=3, name="Riverside Hotel One"))
    _run(db, store, client, "day3")


def test_trace_shows_each_diff_in_order_and_the_verified_bytes_of_each_version(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed
):
    _three_days(db, store, client, feed)
    t = trace_hotel(db, store, supplier_id=1001, supplier_hotel_id="H000001")
    assert t["published"]["supplier_version"] == 3 and t["published"]["publish_version"] == 3
    assert [(d["diff_type"], d["new_snapshot_version"]) for d in t["diffs"]] == [
        ("NEW", 1),
        ("PRICE_CHANGED", 2),
        ("CONTENT_CHANGED", 3),
    ]
    price = t["diffs"][1]["changed_fields"]
    assert {c["field"] for c in price} == {"rooms[DLX].rate_plans[BAR].price"}
    old, new = price[0]["old"].split(), price[0]["new"].split()
    assert (float(old[0]), old[1], float(new[0]), new[1]) == (101.0, "USD", 102.0, "USD")
    assert [r["verified"] for r in t["raw"]] == [True, True, True]
    assert [r["record"]["version"] for r in t["raw"]] == [1, 2, 3]
    assert t["raw"][2]["record"]["name"] == "Riverside Hotel One"
    assert t["normalized"]["document"]["name"] == "Riverside Hotel One"
    assert [o["price_amount"] for o in t["offers"]] == ["103.0000"]
    # Only the diffs that changed the price.
    only = trace_hotel(
        db, store, supplier_id=1001, supplier_hotel_id="H000001", field="price_amount"
    )
    assert [d["new_snapshot_version"] for d in only["diffs"]] == [2, 3]
    with pytest.raises(NotFound):
        trace_hotel(db, store, supplier_id=1001, supplier_hotel_id="H999999")


def test_changed_bytes_are_reported_not_trusted(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed, tmp_path: Path
):
    _three_days(db, store, client, feed)
    t = trace_hotel(db, store, supplier_id=1001, supplier_hotel_id="H000001")
    ref = t["raw"][1]["payload_ref"]
    path = Path(ref.removeprefix("file://"))
    body = gzip.decompress(path.read_bytes()).replace(b"102.00", b"999.00")
    path.chmod(0o644)
    path.write_bytes(gzip.compress(body))
    again = trace_hotel(db, store, supplier_id=1001, supplier_hotel_id="H000001")
    assert [r["verified"] for r in again["raw"]] == [True, False, True]
    assert "record" not in again["raw"][1] and again["raw"][1]["error"]
