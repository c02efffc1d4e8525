"""The catalog as it was at any moment (issue 44), on SQLite and MariaDB: over three simulated
days with changes, the hotel as published at sampled times (at each day's end, and between two
versions) equals the hotel the simulator served then; a hotel the supplier withdraws on day 2
(tombstoned) and serves again on day 3; pruning keeps every answer inside the window exact and
refuses the ones before it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import HistoryNotKept, NotPublishedThen
from supplier_sync_dagster.core.records.history import (
    UNPUBLISHED,
    HotelKey,
    list_versions,
    prune_history,
    version_as_of,
)
from supplier_sync_dagster.core.records.normalize import (
    NormalizedHotel,
    normalize_record,
    to_primitive,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.simulator import FaultProfile, Simulator
from supplier_sync_dagster_tests.core.sync.test_city import SUPPLIER, full_sync
from supplier_sync_dagster_tests.helpers import make_simulator, supplier_client

# Between two days' syncs the database clock moves this far: every day's versions are apart.
GAP = timedelta(hours=1)


@dataclass
class Day:
    """A day's sync: when it had published (database clock) and what the simulator served
    then (each hotel's normalized document)."""

    number: int
    at: datetime
    served: dict[str, dict[str, Any]]
    gap: timedelta = GAP

    @property
    def between(self) -> datetime:
        """A time after this day's versions and before the next day's."""
        return self.at + self.gap / 2


@dataclass
class Week:
    sim: Simulator
    days: list[Day]
    withdrawn: str  # the hotel the supplier withdrew on day 2
    store: LocalPayloadStore


def served_now(sim: Simulator) -> dict[str, dict[str, Any]]:
    """What the simulator serves now, as each valid hotel's normalized document (the bytes of
    its one-hotel answer, through the project's normalizer)."""
    out = {}
    with sim.client() as http:
        for hid in sim.ground_truth().valid:
            r = http.get(f"/v1/hotels/{hid}")
            assert r.status_code == 200, r.text
            hotel = normalize_record(json.loads(r.content))
            assert isinstance(hotel, NormalizedHotel), hotel
            out[hid] = to_primitive(hotel)
    return out


def sync_days(
    db: SyncDatabase, tmp_path: Path, *, hotels: int = 150, days: int = 3, gap: timedelta = GAP
) -> Week:
    """Full syncs of a changing simulator on ``days`` days; on day 2 the supplier withdraws
    the largest city's first hotel (``withdrawn_hotel``), on day 3 it serves it again.

    Between two days the database clock of ``db`` moves ``gap`` on (zero: only real time
    passes, for another process's clock to agree).
    """
    sim = make_simulator(
        FaultProfile.clean().with_(bad_record_rate=0.0),
        seed=44,
        n_cities=3,
        total_hotels=hotels,
        empty_city_share=0.0,
        daily_price_change_rate=0.3,
        daily_content_change_rate=0.1,
        daily_status_change_rate=0.05,
        daily_add_rate=0.05,
        daily_remove_rate=0.0,
        late_arrival_rate=0.0,
    )
    truth = sim.ground_truth()
    city = max(truth.listed_by_city, key=lambda c: len(truth.listed_by_city[c]))
    withdrawn = truth.listed_by_city[city][0]
    assert withdrawn in truth.valid
    store = LocalPayloadStore(tmp_path / "payloads")
    week = Week(sim, [], withdrawn, store)
    for number in range(1, days + 1):
        if number > 1:
            sim.advance_day()
        sim.set_modes(["withdrawn_hotel"] if number == 2 else [], [city])
        served = served_now(sim)
        with sim.client() as http:
            _, reports = full_sync(db, store, supplier_client(http), f"day-{number}")
        assert all(r.status == "SUCCESS" for r in reports), reports
        with db.engine.connect() as conn:
            at = db.clock.read(conn)
        week.days.append(Day(number, at, served, gap))
        db.clock.advance(gap.total_seconds())
    return week


def as_of(db: SyncDatabase, hotel: str, at: datetime) -> dict[str, Any]:
    with db.engine.connect() as conn:
        return version_as_of(
            conn, HotelKey(supplier_id=SUPPLIER, supplier_hotel_id=hotel), at
        ).document


def test_as_of_answers_what_the_simulator_served_then_and_pruning_keeps_the_window(
    db: SyncDatabase, tmp_path: Path
):
    week = sync_days(db, tmp_path)
    d1, d2, d3 = week.days
    hotels = set().union(*(d.served for d in week.days))
    changed = {h for h in d1.served if h in d2.served and d1.served[h] != d2.served[h]}
    added = set(d2.served) - set(d1.served) - {week.withdrawn}
    assert len(changed) > 10 and added, (len(changed), added)

    # At each day's end and between two versions: exactly what the simulator served then.
    for day in week.days:
        for at in (day.at, day.between):
            for hid, doc in day.served.items():
                assert as_of(db, hid, at) == doc, (day.number, at, hid)
    # Before its first publish a hotel is unknown: not an older or a newer hotel.
    for hid in added:
        with pytest.raises(NotPublishedThen):
            as_of(db, hid, d1.between)
    with pytest.raises(NotPublishedThen):
        as_of(db, next(iter(d1.served)), d1.at - timedelta(hours=1))

    # Withdrawn on day 2: unpublished (INACTIVE, nothing sold); served again on day 3.
    gone = week.withdrawn
    assert gone not in d2.served and gone in d1.served and gone in d3.served
    tomb = as_of(db, gone, d2.at)
    assert tomb["status"] == "INACTIVE" and tomb["rooms"] == []
    assert {k: v for k, v in tomb.items() if k not in ("status", "rooms")} == {
        k: v for k, v in d1.served[gone].items() if k not in ("status", "rooms")
    }
    assert as_of(db, gone, d3.at) == d3.served[gone]
    with db.engine.connect() as conn:
        versions = list_versions(conn, HotelKey(supplier_id=SUPPLIER, supplier_hotel_id=gone))
    assert [(v["change_type"], v["change_reason"]) for v in versions][1:] == [
        (UNPUBLISHED, "not_found"),
        (versions[2]["change_type"], None),
    ]
    assert [v["publish_version"] for v in versions] == [1, 2, 3]

    # Every version recorded is one the catalog published: the rows match the hotels' counts.
    with db.engine.connect() as conn:
        h = schema.platform_hotel.c
        current = dict(conn.execute(sa.select(h.supplier_hotel_id, h.publish_version)).all())
        v = schema.hotel_version.c
        recorded: dict[str, int] = dict(
            conn.execute(
                sa.select(v.supplier_hotel_id, sa.func.count()).group_by(v.supplier_hotel_id)
            ).all()
        )
    assert recorded == current and set(current) == hotels

    # Prune with the horizon between day 2's versions and day 3's.
    with db.engine.connect() as conn:
        now = db.clock.read(conn)
    db.clock.advance((d2.between + timedelta(days=1) - now).total_seconds())
    with db.engine.connect() as conn:
        before = {
            hid: list_versions(conn, HotelKey(supplier_id=SUPPLIER, supplier_hotel_id=hid))
            for hid in hotels
        }
    report = prune_history(db, retention_days=1, chunk=7)
    assert d2.between <= report.horizon < d3.at - GAP / 4
    superseded = sum(
        1
        for vs in before.values()
        for a, b in zip(vs, vs[1:], strict=False)
        if b["published_at"] <= report.horizon
    )
    assert report.versions == superseded > 0 and report.documents > 0
    # Inside the window: unchanged answers. Before it: the same answer or HISTORY_NOT_KEPT.
    for day in (d2, d3):
        for hid, doc in day.served.items():
            assert as_of(db, hid, day.between if day is d2 else day.at) == doc
    refused = 0
    for hid, doc in d1.served.items():
        try:
            assert as_of(db, hid, d1.at) == doc, hid
        except HistoryNotKept:
            refused += 1
    assert refused >= len(changed)
    # The documents left are exactly those of the versions left.
    with db.engine.connect() as conn:
        d = schema.published_document.c
        kept = set(conn.execute(sa.select(d.document_hash)).scalars())
        used = set(conn.execute(sa.select(v.document_hash).distinct()).scalars())
    assert kept == used
