"""Reconciliation against the simulator's city summaries (SQLite and MariaDB): a city that
lost hotels or changes differs, a re-pull of exactly that city makes it equal again; a
catalog ahead of its supplier differs; a city whose walk drifted is walked again, and a
hotel the drift lost is found although every count agrees; a city that differs only by
hotels with open dead-letter tickets waits on them (not re-pulled, not a difference), a
loss on top of them still differs; a city code the supplier does not know is an error."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import UnknownCity
from supplier_sync_dagster.core.leasing.batches import TaskSpec, create_batch, upsert_task
from supplier_sync_dagster.core.records.deadletters import DeadLetter, record_dead_letters
from supplier_sync_dagster.core.records.tombstones import TOMBSTONE_FINGERPRINT
from supplier_sync_dagster.core.repair.reconcile import (
    CityCounts,
    OpenTicket,
    Reconciliation,
    RepullPlan,
    Tolerance,
    accounted_for,
    compare,
    compare_with_tickets,
    drifted_cities,
    plan_repull,
    reconcile,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.supplier import WalkLimits
from supplier_sync_dagster.core.sync.city import sync_city
from supplier_sync_dagster.simulator import FaultProfile, ModeScale, Simulator
from supplier_sync_dagster_tests.core.sync.test_city import SUPPLIER, full_sync, settings
from supplier_sync_dagster_tests.helpers import make_simulator, supplier_client


def _lose(db: SyncDatabase, city: str, n: int) -> list[str]:
    """Deletes ``n`` hotels of ``city`` from the catalog, as a walk that skipped a page would
    never have written them."""
    h = schema.platform_hotel.c
    with db.begin() as conn:
        ids = (
            conn.execute(
                sa.select(h.supplier_hotel_id)
                .where(h.city_code == city)
                .order_by(h.supplier_hotel_id)
                .limit(n)
            )
            .scalars()
            .all()
        )
        conn.execute(sa.delete(schema.platform_hotel).where(h.supplier_hotel_id.in_(ids)))
    return list(ids)


def test_a_city_that_lost_hotels_differs_and_a_repull_makes_it_equal(
    db: SyncDatabase, tmp_path: Path
):
    sim = make_simulator(FaultProfile.clean(), seed=21, n_cities=6, total_hotels=900)
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=httpx.MockTransport(sim.handle)) as http:
        client = supplier_client(http)
        full_sync(db, store, client, "day0")
        first = reconcile(db, client, supplier_id=SUPPLIER)
        assert first.differing == [] and first.failed == []
        assert first.requests == len(first.cities) + 1  # the city list and a summary each
        biggest = max(first.cities, key=lambda c: c.catalog.hotels).city_code
        _lose(db, biggest, 10)
        second = reconcile(db, client, supplier_id=SUPPLIER)
        assert [c.city_code for c in second.differing] == [biggest]
        (diff,) = second.differing
        assert diff.supplier is not None and diff.supplier.hotels - diff.catalog.hotels == 10
        assert "hotels" in diff.reasons[0]
        # The re-pull: a full sync of exactly that city.
        full_sync_cities(db, store, client, "repull", [biggest])
        third = reconcile(db, client, supplier_id=SUPPLIER, cities=[biggest])
        assert third.differing == [] and third.requests == 1


def full_sync_cities(db, store, client, trigger: str, cities: list[str]) -> None:
    upsert_task(db, TaskSpec(task_code="hotel_full", supplier_id=SUPPLIER))
    decision = create_batch(
        db, task_code="hotel_full", trigger_id=trigger, trigger_source="MANUAL", shard_keys=cities
    )
    assert decision.batch is not None
    for city in cities:
        report = sync_city(
            db,
            store,
            client,
            batch=decision.batch,
            city_code=city,
            worker_id="w",
            settings=settings(),
        )
        assert report.status == "SUCCESS", report


def test_the_tolerance_and_the_lag_decide_what_differs():
    now = datetime(2026, 11, 20, tzinfo=UTC)
    tol = Tolerance(absolute=2, relative=0.02, max_lag_seconds=3600)
    same = CityCounts(1000, 990, now)
    assert not compare("A", same, CityCounts(985, 975, now), tol).differs  # within 2%
    assert compare("A", same, CityCounts(970, 975, now), tol).differs  # 30 apart
    assert not compare("B", CityCounts(10, 10, now), CityCounts(8, 8, now), tol).differs
    behind = compare("C", same, CityCounts(1000, 990, now - timedelta(hours=2)), tol)
    assert behind.differs and "behind" in behind.reasons[0]
    ahead = compare("E", same, CityCounts(1000, 990, now + timedelta(seconds=1)), tol)
    assert ahead.reasons == ("the catalog's newest change is 1 s ahead of the supplier's",)
    lenient = Tolerance(max_ahead_seconds=60)
    assert not compare(
        "E", same, CityCounts(1000, 990, now + timedelta(seconds=1)), lenient
    ).differs
    empty = compare("D", same, CityCounts(), tol)
    assert empty.differs and any("no hotel" in r for r in empty.reasons)


def test_a_catalog_newer_than_its_supplier_differs(db: SyncDatabase, tmp_path: Path):
    sim = make_simulator(FaultProfile.clean(), seed=22, n_cities=4, total_hotels=400)
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=httpx.MockTransport(sim.handle)) as http:
        client = supplier_client(http)
        full_sync(db, store, client, "day0")
        assert reconcile(db, client, supplier_id=SUPPLIER).differing == []
        # A change dated ahead of anything the supplier states (a blinded watermark's kind).
        h = schema.platform_hotel.c
        with db.begin() as conn:
            hotel_id, city = conn.execute(
                sa.select(h.supplier_hotel_id, h.city_code).order_by(h.supplier_hotel_id).limit(1)
            ).one()
            conn.execute(
                sa.update(schema.platform_hotel)
                .where(h.supplier_hotel_id == hotel_id)
                .values(supplier_updated_at=datetime(2099, 1, 1))
            )
        report = reconcile(db, client, supplier_id=SUPPLIER)
    assert [c.city_code for c in report.differing] == [city]
    (diff,) = report.differing
    assert len(diff.reasons) == 1 and "ahead of the supplier's" in diff.reasons[0]
    assert diff.row()["catalog_max_updated_at"] == "2099-01-01T00:00:00Z"


def _drift_sim(shifts: int) -> Simulator:
    faults = FaultProfile.clean().with_(modes=("drift",), mode_scale=ModeScale(drift_shifts=shifts))
    sim = make_simulator(faults, seed=23, n_cities=3, total_hotels=450)
    biggest = max(sim.ground_truth().listed_by_city.items(), key=lambda kv: len(kv[1]))[0]
    sim.set_modes(["drift"], [biggest])
    return sim


def _published(db: SyncDatabase) -> set[str]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return set(
            conn.execute(
                sa.select(h.supplier_hotel_id).where(h.fingerprint != TOMBSTONE_FINGERPRINT)
            ).scalars()
        )


@pytest.mark.parametrize("check", [False, True], ids=["unchecked", "checked"])
def test_a_city_whose_walk_drifted_is_walked_again(db: SyncDatabase, tmp_path: Path, check: bool):
    sim = _drift_sim(shifts=6)
    (city,) = sim.modes.cities
    store = LocalPayloadStore(tmp_path / "payloads")
    limits = WalkLimits(continuity_check=check)
    with httpx.Client(base_url="http://sim", transport=httpx.MockTransport(sim.handle)) as http:
        client = supplier_client(http)
        full_sync(db, store, client, "day0", walk=limits, page_size=20)
        truth = sim.ground_truth()
        lost = set(truth.valid) - _published(db)
        assert drifted_cities(db, "hotel_full") == {city: "SHIFTED" if check else "UNCHECKED"}
        report = reconcile(db, client, supplier_id=SUPPLIER, task_code="hotel_full")
    by_city = {c.city_code: c for c in report.cities}
    drifted = by_city[city]
    assert drifted.rewalked == ("SHIFTED" if check else "UNCHECKED")
    assert all(c.rewalked is None for c in report.cities if c.city_code != city)
    # Every count agrees: only the walk again tells a lost hotel.
    assert drifted.supplier is not None
    assert Tolerance().allows(drifted.supplier.hotels, drifted.catalog.hotels)
    if check:
        assert lost == set() and report.differing == []
    else:
        assert lost and set(drifted.missing) == lost
        assert [c.city_code for c in report.differing] == [city]
        assert drifted.reasons == (
            f"{len(lost)} listed hotel(s) not in the catalog ({', '.join(map(repr, sorted(lost)[:3]))}"
            f"{', …' if len(lost) > 3 else ''}), walked again after a UNCHECKED walk",
        )
    # A summary per city, and the pages of the drifted city (500 hotels a page) once more.
    pages = -(-len(truth.listed_by_city[city]) // 500)
    assert report.requests == len(report.cities) + 1 + pages


def test_a_listed_hotel_that_waits_as_a_dead_letter_is_not_missing(
    db: SyncDatabase, tmp_path: Path
):
    sim = _drift_sim(shifts=6)
    (city,) = sim.modes.cities
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=httpx.MockTransport(sim.handle)) as http:
        client = supplier_client(http)
        batch_id, _ = full_sync(
            db, store, client, "day0", walk=WalkLimits(continuity_check=False), page_size=20
        )
        lost = sorted(set(sim.ground_truth().valid) - _published(db))
        assert len(lost) == 2
        letter = DeadLetter(
            lost[0], "VALIDATION", "NON_RETRYABLE", "INVALID_GEO", "lat 200", None, None
        )
        with db.begin() as conn:
            record_dead_letters(
                conn,
                db.clock,
                batch_id=batch_id,
                task_code="hotel_full",
                sync_mode="FULL",
                supplier_id=SUPPLIER,
                letters=[letter],
            )
        assert accounted_for(db, SUPPLIER, lost) == {lost[0]}
        report = reconcile(db, client, supplier_id=SUPPLIER, task_code="hotel_full")
    (drifted,) = report.differing
    assert drifted.city_code == city and drifted.missing == (lost[1],)


# --- open dead-letter tickets: waiting, not differing (issue 40, item 6) ---------------------


def _bad_records_sim() -> Simulator:
    return make_simulator(
        FaultProfile.clean().with_(bad_record_rate=0.03), seed=21, n_cities=6, total_hotels=900
    )


def _open_tickets_by_city(db: SyncDatabase) -> dict[str, set[str]]:
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(d.city_code, d.supplier_resource_code).where(
                d.status.not_in(("RESOLVED", "IGNORED"))
            )
        ).all()
    found: dict[str, set[str]] = {}
    for city, hotel in rows:
        found.setdefault(str(city), set()).add(str(hotel))
    return found


def test_a_city_that_differs_only_by_dead_lettered_hotels_waits_on_them_day_after_day(
    db: SyncDatabase, tmp_path: Path
):
    sim = _bad_records_sim()
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=httpx.MockTransport(sim.handle)) as http:
        client = supplier_client(http)
        for day in range(3):
            full_sync(db, store, client, f"day{day}")
            tickets = _open_tickets_by_city(db)
            # The catalog alone differs for the cities with bad records (the bug: "for good").
            plain = {
                c.city_code
                for c in reconcile(db, client, supplier_id=SUPPLIER, store=store).cities
                if c.explained
            }
            assert plain and plain <= set(tickets)
            report = reconcile(db, client, supplier_id=SUPPLIER, store=store)
            assert report.differing == [] and report.failed == []
            assert {c.city_code for c in report.waiting} == plain
            for c in report.waiting:
                assert set(c.tickets) == tickets[c.city_code]
                assert c.row()["waiting_on_tickets"] is True
                assert c.row()["open_ticket_hotels"] == len(tickets[c.city_code])
                assert any(r.startswith("hotels ") for r in c.explained)
            plan = plan_repull(report)
            assert plan.repull == [] and plan.remaining == []
            assert plan.waiting == [c.city_code for c in report.waiting]
            assert plan.hotels_waiting == sum(len(tickets[c]) for c in plan.waiting)
            sim.advance_day()


def test_tickets_do_not_hide_a_real_loss_and_closed_tickets_do_not_count(
    db: SyncDatabase, tmp_path: Path
):
    sim = _bad_records_sim()
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=httpx.MockTransport(sim.handle)) as http:
        client = supplier_client(http)
        full_sync(db, store, client, "day0")
        waiting = reconcile(db, client, supplier_id=SUPPLIER, store=store).waiting
        city = max(waiting, key=lambda c: len(c.tickets)).city_code
        # A loss on top of the tickets: the city differs, its tickets counted in the reasons.
        lost = _lose(db, city, 10)
        report = reconcile(db, client, supplier_id=SUPPLIER, store=store)
        (diff,) = report.differing
        assert diff.city_code == city and not diff.waiting
        assert any("with its open dead letters" in r for r in diff.reasons), diff.reasons
        assert plan_repull(report).repull == [city]
        full_sync_cities(db, store, client, "repull", [city])
        assert {c.city_code for c in reconcile(db, client, supplier_id=SUPPLIER).waiting} >= {city}
        assert not set(lost) & set(
            reconcile(db, client, supplier_id=SUPPLIER, cities=[city]).cities[0].tickets
        )
        # A closed ticket (ignored, resolved) waits for nothing: the city differs again.
        d = schema.dead_letter.c
        with db.begin() as conn:
            conn.execute(
                sa.update(schema.dead_letter).where(d.city_code == city).values(status="IGNORED")
            )
        again = reconcile(db, client, supplier_id=SUPPLIER, cities=[city], store=store)
    assert [c.city_code for c in again.differing] == [city] and again.waiting == []


def _page_store(tmp_path: Path, records: list[dict[str, object]]) -> tuple[LocalPayloadStore, str]:
    store = LocalPayloadStore(tmp_path / "payloads")
    body = json.dumps({"city_code": "X", "hotels": records}).encode()
    return store, store.put(body, kind="raw").ref


def test_a_bad_record_that_is_the_suppliers_newest_change_explains_the_lag(tmp_path: Path):
    now = datetime(2026, 11, 20, tzinfo=UTC)
    tol = Tolerance(absolute=0, relative=0.0, max_lag_seconds=3600)
    store, ref = _page_store(
        tmp_path,
        [
            {"hotel_id": "H1", "status": "ACTIVE", "updated_at": "2026-11-20T00:00:00Z"},
            {"hotel_id": "H2", "status": "INACTIVE", "updated_at": "2026-11-19T00:00:00Z"},
            {"hotel_id": "H3", "status": "WHATEVER"},
        ],
    )
    supplier = CityCounts(12, 10, now)
    catalog = CityCounts(10, 9, now - timedelta(hours=5))
    plain = compare("X", supplier, catalog, tol)
    assert len(plain.reasons) == 3 and "behind" in plain.reasons[2]
    # H1 (new, active, the newest change) and H2 (new, inactive) close every gap.
    two = [OpenTicket("H1", None, ref, "record#0"), OpenTicket("H2", None, ref, "record#1")]
    waiting = compare_with_tickets(plain, two, tol, store)
    assert waiting.waiting and waiting.reasons == () and waiting.explained == plain.reasons
    assert waiting.tickets == ("H1", "H2")
    # Without the stored page a record's status is unknown (either may hold) and its time
    # at most when its ticket was last written: one written before the supplier's newest
    # change cannot be that change.
    assert compare_with_tickets(plain, two, tol, None).waiting
    written = [replace(t, seen_at=now - timedelta(hours=3)) for t in two]
    stale = compare_with_tickets(plain, written, tol, None)
    assert stale.reasons == ("the catalog's newest change is 10800 s behind the supplier's",)
    assert stale.explained == plain.reasons[:2] and not stale.waiting
    later = [replace(t, seen_at=now + timedelta(minutes=1)) for t in two]
    assert compare_with_tickets(plain, later, tol, None).waiting
    # A ticket of a hotel the catalog holds adds no hotel: the hotel count still differs.
    held = [OpenTicket("H1", "ACTIVE", ref, "record#0"), OpenTicket("H2", None, ref, "record#1")]
    partly = compare_with_tickets(plain, held, tol, store)
    assert partly.differs and not partly.waiting
    assert partly.reasons == (
        "hotels 11 in the catalog with its open dead letters, 12 at the supplier",
        "active 9 in the catalog with its open dead letters, 10 at the supplier",
    )
    assert partly.explained == (plain.reasons[2],)
    # An unknown status (H3) widens the active count; a record whose id does not match its
    # position is not the ticket's and is read as unknown.
    mixed = [OpenTicket("H3", None, ref, "record#2"), OpenTicket("H9", None, ref, "record#0")]
    assert compare_with_tickets(plain, mixed, tol, store).waiting


def test_a_ticket_never_explains_a_catalog_ahead_of_its_supplier(tmp_path: Path):
    now = datetime(2026, 11, 20, tzinfo=UTC)
    store, ref = _page_store(
        tmp_path, [{"hotel_id": "H1", "status": "ACTIVE", "updated_at": "2027-01-01T00:00:00Z"}]
    )
    plain = compare(
        "X",
        CityCounts(10, 10, now),
        CityCounts(9, 9, now + timedelta(hours=1)),
        Tolerance(absolute=0, relative=0.0),
    )
    after = compare_with_tickets(
        plain, [OpenTicket("H1", None, ref, "record#0")], Tolerance(absolute=0, relative=0.0), store
    )
    assert after.differs and after.reasons == (
        "the catalog's newest change is 3600 s ahead of the supplier's",
    )
    # The counts were explained; the time was not.
    assert after.explained and all("ahead" not in r for r in after.explained)
    # A city equal without tickets is not compared again (no ticket is read).
    equal = compare("Y", CityCounts(10, 10, now), CityCounts(10, 10, now), Tolerance())
    assert (
        compare_with_tickets(equal, [OpenTicket("H1", None, ref, "record#0")], Tolerance(), store)
        is equal
    )


def test_a_city_code_the_supplier_does_not_know_is_an_error_naming_it(
    db: SyncDatabase, tmp_path: Path
):
    sim = make_simulator(FaultProfile.clean(), seed=22, n_cities=3, total_hotels=150)
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=httpx.MockTransport(sim.handle)) as http:
        client = supplier_client(http)
        full_sync(db, store, client, "day0")
        known = reconcile(db, client, supplier_id=SUPPLIER).cities[0].city_code
        with pytest.raises(UnknownCity, match="does not know city 'NOPE' ") as err:
            reconcile(db, client, supplier_id=SUPPLIER, cities=["NOPE"])
        assert "404" in str(err.value) and "0 differ" not in str(err.value)
        with pytest.raises(UnknownCity, match=re.escape("""cities 'NOPE', "x'; DROP" (""")):
            reconcile(db, client, supplier_id=SUPPLIER, cities=[known, "NOPE", "x'; DROP", "NOPE"])
        # The supplier's own list: every city is known, nothing to raise.
        assert reconcile(db, client, supplier_id=SUPPLIER).differing == []


def test_the_plan_repulls_a_difference_once_and_then_counts_it_remaining():
    now = datetime(2026, 11, 20, tzinfo=UTC)
    tol = Tolerance()
    differs = compare("A", CityCounts(100, 100, now), CityCounts(50, 50, now), tol)
    equal = compare("B", CityCounts(100, 100, now), CityCounts(100, 100, now), tol)
    waits = replace(
        compare("C", CityCounts(9, 9, now), CityCounts(5, 5, now), tol),
        reasons=(),
        explained=("hotels 5 in the catalog, 9 at the supplier",),
        tickets=("H1", "H2", "H3", "H4"),
    )
    report = Reconciliation([differs, equal, waits])
    assert plan_repull(report) == RepullPlan(["A"], [], ["C"], 4)
    assert plan_repull(report, repulled_before=["A", "C"]) == RepullPlan([], ["A"], ["C"], 4)
    assert plan_repull(report, repull=False) == RepullPlan([], [], ["C"], 4)
