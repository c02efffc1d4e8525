"""The stages after the fetch: the publish stage's split of a large shard over forked
processes; a listed record dated ahead of the database clock (SQLite and MariaDB)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import TaskSpec, create_batch, upsert_task
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync.city import sync_city
from supplier_sync_dagster.core.sync.model import CityReport, SyncSettings
from supplier_sync_dagster.core.sync.stages import LAST_CHUNK_HOTELS, split_for_processes
from supplier_sync_dagster_tests.core.records.test_tombstones import SETTINGS, Listing
from supplier_sync_dagster_tests.core.repair.test_incremental import hotel


@pytest.mark.parametrize("hotels", [4001, 5000, 8373, 20000])
def test_split_for_processes_gives_each_process_equal_chunks_and_a_short_last(
    hotels: int,
) -> None:
    cands = list(range(hotels))
    head, last = split_for_processes(cands, 2000, 2)  # type: ignore[arg-type]
    assert [x for part in head for x in part] + list(last) == cands  # each hotel once, in order
    assert 0 < len(last) <= LAST_CHUNK_HOTELS
    assert len(head) % 2 == 0
    sizes = [len(p) for p in head]
    assert max(sizes) - min(sizes) <= 1 or sizes[-1] < sizes[0]
    assert all(1000 <= n <= 3000 for n in sizes[:-1])
    # Each of the two processes publishes the same number of hotels, give or take a chunk's
    # rounding.
    assert abs(sum(sizes[0::2]) - sum(sizes[1::2])) <= max(sizes) // 2


# -- a record dated ahead of the database clock ------------------------------------------------


@pytest.fixture
def listing() -> Listing:
    lst = Listing()
    lst.cities["BKK"] = [hotel(n, at=n, city_code="BKK") for n in range(1, 6)]
    lst.cities["CNX"] = [hotel(10, at=10, city_code="CNX")]
    return lst


@pytest.fixture
def client(listing: Listing) -> Iterator[SupplierClient]:
    with httpx.Client(
        base_url="http://supplier", transport=httpx.MockTransport(listing.handle)
    ) as http:
        yield SupplierClient(http, api_key="k", supplier_id="fake")


def _full_sync(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, settings: SyncSettings
) -> tuple[str, dict[str, CityReport]]:
    upsert_task(db, TaskSpec(task_code=settings.task_code, supplier_id=1001))
    decision = create_batch(
        db,
        task_code=settings.task_code,
        trigger_id=f"t-{uuid.uuid4().hex[:8]}",
        trigger_source="MANUAL",
        shard_keys=["BKK", "CNX"],
    )
    assert decision.batch is not None
    reports = {
        city: sync_city(
            db,
            store,
            client,
            batch=decision.batch,
            city_code=city,
            worker_id="w",
            settings=settings,
        )
        for city in ("BKK", "CNX")
    }
    return decision.batch.batch_id, reports


def _catalog(db: SyncDatabase) -> dict[str, tuple[int, str]]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return {
            str(r.supplier_hotel_id): (int(r.supplier_version), str(r.status))
            for r in conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version, h.status))
        }


def _letters(db: SyncDatabase, batch_id: str) -> list[tuple[str, str, str]]:
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        return [
            (str(r.supplier_resource_code), str(r.error_code), str(r.status))
            for r in conn.execute(
                sa.select(d.supplier_resource_code, d.error_code, d.status).where(
                    d.batch_id == batch_id
                )
            )
        ]


@pytest.mark.parametrize("processes", [0, 2], ids=["in-process", "forked"])
def test_a_listed_record_dated_ahead_of_the_database_clock_is_a_dead_letter_until_it_is_not(
    db: SyncDatabase,
    tmp_path: Path,
    client: SupplierClient,
    listing: Listing,
    processes: int,
):
    store = LocalPayloadStore(tmp_path / "payloads")
    settings = replace(SETTINGS, normalize_processes=processes)
    _full_sync(db, store, client, settings)
    assert _catalog(db)["H000003"] == (1, "ACTIVE")
    with db.engine.connect() as conn:
        now = db.clock.read_utc(conn)
    # The next listing dates hotel 3's new version two hours ahead of the database clock,
    # hotel 4's 2099: with an hour's skew neither publishes, the rest of their city does.
    ahead = (now + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    bkk = listing.cities["BKK"]
    bkk[2] = hotel(3, at=0, version=2, city_code="BKK", updated_at=ahead)
    bkk[3] = hotel(4, at=0, version=2, city_code="BKK", updated_at="2099-01-01T00:00:00Z")
    bkk[4] = hotel(5, at=50, version=2, city_code="BKK")
    batch_id, reports = _full_sync(db, store, client, settings)
    r = reports["BKK"]
    assert r.status == "SUCCESS" and (r.records, r.published, r.dead_letters) == (5, 1, 2)
    assert dict(r.dead_letters_by_code) == {"FUTURE_TIMESTAMP": 2}
    assert sorted(_letters(db, batch_id)) == [
        ("H000003", "FUTURE_TIMESTAMP", "MANUAL_FIX"),
        ("H000004", "FUTURE_TIMESTAMP", "MANUAL_FIX"),
    ]
    # Never published, and what was published stays, listed (not counted missing).
    assert _catalog(db) == {
        "H000001": (1, "ACTIVE"),
        "H000002": (1, "ACTIVE"),
        "H000003": (1, "ACTIVE"),
        "H000004": (1, "ACTIVE"),
        "H000005": (2, "ACTIVE"),
        "H000010": (1, "ACTIVE"),
    }
    assert r.presence is not None and r.presence.missing == []
    # The database's clock decides, not this machine's: three hours later there, hotel 3's
    # version is within the skew and publishes; 2099 still does not.
    db.clock.advance(3 * 3600)
    batch_id, reports = _full_sync(db, store, client, settings)
    assert dict(reports["BKK"].dead_letters_by_code) == {"FUTURE_TIMESTAMP": 1}
    assert _catalog(db)["H000003"] == (2, "ACTIVE") and _catalog(db)["H000004"] == (1, "ACTIVE")


# -- the quality pass over freshly normalized pages: one dead letter per bad record ----------


def test_each_hostile_record_of_a_judged_page_is_one_dead_letter_with_its_code() -> None:
    from supplier_sync_dagster.core.records.normalize import normalize_documents
    from supplier_sync_dagster.core.sync.snapshots import StoredPage
    from supplier_sync_dagster.core.sync.stages import _judge, _Page
    from supplier_sync_dagster_tests.core.records.test_quality import RECORD

    def rec(hotel_id: str, **changes: object) -> dict[str, object]:
        return {**RECORD, "hotel_id": hotel_id, **changes}

    mixed = rec("MIXED")
    mixed["rooms"] = [
        {
            **RECORD["rooms"][0],
            "rate_plans": [
                RECORD["rooms"][0]["rate_plans"][0],
                {
                    **RECORD["rooms"][0]["rate_plans"][1],
                    "price": {"amount": "1", "currency": "USD"},
                },
            ],
        }
    ]
    records: list[object] = [
        rec("OK1", name="Ünïcødé 名 " * 20),
        rec("LOWER", facilities=["İ" * 64]),  # longer than its limit once lower-cased
        rec("LONG", name="n" * 100_000),
        rec("TYPE", version="7"),
        rec("CTRL", name="a\x1b[31mb"),
        mixed,
        rec("ELSEWHERE", country_code="FR"),
        rec("MOVED", city_code="CNX"),
        ["not", "an", "object"],
        rec("OK2", facilities=["ß" * 64]),
    ]
    page = _Page(StoredPage("ref", "hash", 1, len(records)), normalize_documents(records))
    moved, [(kept, letters)] = _judge([page], "BKK", {"BKK": "TH", "CNX": "TH"})
    assert moved == 1
    # A moved hotel is kept: it is published under its own city.
    assert [d["supplier_hotel_id"] for d in kept] == ["OK1", "MOVED", "OK2"]
    assert len(letters) == 7  # one per bad record
    assert {d.record_position: f"{d.supplier_hotel_id}:{d.error_code}" for d in letters} == {
        "record#1": "LOWER:OVERSIZED_STRING",
        "record#2": "LONG:OVERSIZED_STRING",
        "record#3": "TYPE:WRONG_TYPE",
        "record#4": "CTRL:CONTROL_CHARACTERS",
        "record#5": "MIXED:MIXED_ROOM_CURRENCY",
        "record#6": "ELSEWHERE:COUNTRY_CITY_MISMATCH",
        "record#8": "None:NOT_AN_OBJECT",
    }
