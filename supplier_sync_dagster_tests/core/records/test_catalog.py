"""Mappings, diffs, version-guarded publish with outbox events, and dead letters."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.records.deadletters import (
    DeadLetter,
    count_dead_letters,
    record_dead_letters,
)
from supplier_sync_dagster.core.records.diff import (
    Candidate,
    RiskPolicy,
    active_offers,
    collapse_duplicates,
    compute_diffs,
    default_risk_policy,
    record_diffs,
)
from supplier_sync_dagster.core.records.mapping import (
    CHUNK,
    ensure_hotel_mappings,
)
from supplier_sync_dagster.core.records.publish import (
    offer_deactivation,
    prepare_publish,
    publish_hotels,
    stale_offer_deactivation,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.core.conftest import run_concurrently

SUPPLIER = 1001


def hotel(hid: str, version: int = 1, **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "supplier_hotel_id": hid,
        "name": f"Hotel {hid}",
        "name_local": None,
        "city_code": "BKK",
        "country_code": "TH",
        "address_line1": "1 Road",
        "postal_code": "10500",
        "lat": 13.7234,
        "lng": 100.5143,
        "star_rating": "4.5",
        "phone_e164": "+6621234567",
        "email": None,
        "facilities": ["wifi", "pool"],
        "images": [],
        "rooms": [
            {
                "room_code": "DLX",
                "name": "Deluxe King",
                "bed_type": "KING",
                "max_occupancy": 2,
                "rate_plans": [
                    {
                        "code": "BAR",
                        "board": "RO",
                        "refundable": True,
                        "available": True,
                        "price": "120.50",
                        "currency": "THB",
                    },
                    {
                        "code": "NRF",
                        "board": "BB",
                        "refundable": False,
                        "available": True,
                        "price": "99.00",
                        "currency": "THB",
                    },
                ],
            }
        ],
        "status": "ACTIVE",
        "updated_at": f"2026-11-{version:02d}T10:00:00Z",
        "version": version,
    }
    doc.update(changes)
    return doc


def cand(doc: dict[str, Any]) -> Candidate:
    fp = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    return Candidate(doc, fp, raw_payload_ref="file:///raw/x.json.gz", raw_payload_hash="a" * 64)


def map_in(conn: Connection, db: SyncDatabase, batch_id: str, cands: list[Candidate]):
    """The candidates' mappings (with the published versions), made inside ``conn``."""
    return ensure_hotel_mappings(
        conn,
        db.clock,
        supplier_id=SUPPLIER,
        batch_id=batch_id,
        hotel_ids=[c.supplier_hotel_id for c in cands],
    )


def sync_in(
    conn: Connection,
    db: SyncDatabase,
    batch_id: str,
    docs: list[dict[str, Any]],
    policy: RiskPolicy = default_risk_policy,
):
    """Maps, diffs, records and publishes a list of hotels inside ``conn``'s transaction."""
    cands = collapse_duplicates([cand(d) for d in docs])
    maps = ensure_hotel_mappings(
        conn,
        db.clock,
        supplier_id=SUPPLIER,
        batch_id=batch_id,
        hotel_ids=[c.supplier_hotel_id for c in cands],
    )
    diffs = compute_diffs(conn, cands, maps.resource_ids, policy=policy)
    record_diffs(
        conn, db.clock, batch_id=batch_id, shard_key="BKK", supplier_id=SUPPLIER, diffs=diffs
    )
    by_id = {c.supplier_hotel_id: c for c in cands}
    result = publish_hotels(
        conn,
        db.clock,
        supplier_id=SUPPLIER,
        batch_id=batch_id,
        items=[(d, by_id[d.supplier_hotel_id]) for d in diffs],
    )
    return diffs, result


def sync(db: SyncDatabase, batch_id: str, docs: list[dict[str, Any]]):
    """:func:`sync_in` in a transaction of its own."""
    with db.begin() as conn:
        return sync_in(conn, db, batch_id, docs)


def rows(db: SyncDatabase, table: sa.Table, *where: Any) -> list[dict[str, Any]]:
    with db.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sa.select(table).where(*where))]


def test_mappings_are_allocated_once_even_under_concurrent_batches(db: SyncDatabase):
    ids = [f"H{i:04d}" for i in range(300)] + ["../../etc", "x'; DROP TABLE t;--", "h0001"]

    def allocate(i: int) -> dict[str, int]:
        with db.begin() as conn:
            return ensure_hotel_mappings(
                conn, db.clock, supplier_id=SUPPLIER, batch_id=f"b{i}", hotel_ids=ids
            ).resource_ids

    results, errors = run_concurrently(6, allocate)
    assert not errors, errors
    assert all(r == results[0] for r in results)
    assert len(set(results[0].values())) == len(ids)  # 'H0001' and 'h0001' are two hotels
    assert len(rows(db, schema.hotel_mapping)) == len(ids)
    with db.begin() as conn:
        again = ensure_hotel_mappings(
            conn, db.clock, supplier_id=SUPPLIER, batch_id="later", hotel_ids=ids[:5]
        )
    assert again.created == frozenset() and again.resource_ids == {
        h: results[0][h] for h in ids[:5]
    }


def test_mappings_say_which_hotels_are_published_only_when_asked(db: SyncDatabase):
    sync(db, "b1", [hotel("H1", 1), hotel("H2", 1)])
    ids = ["H1", "H2", "H3"]
    with db.begin() as conn:
        full = ensure_hotel_mappings(
            conn, db.clock, supplier_id=SUPPLIER, batch_id="b2", hotel_ids=ids
        )
        bare = ensure_hotel_mappings(
            conn, db.clock, supplier_id=SUPPLIER, batch_id="b2", hotel_ids=ids, published=False
        )
    assert full.published == {full.resource_ids["H1"], full.resource_ids["H2"]}
    assert bare.published == frozenset()
    assert bare.resource_ids == full.resource_ids and bare.created == full.created == {"H3"}


def test_new_then_no_change_then_each_kind_of_change(db: SyncDatabase):
    diffs, res = sync(db, "b1", [hotel("H1"), hotel("H2"), hotel("H3"), hotel("H4"), hotel("H5")])
    assert {d.diff_type for d in diffs} == {"NEW"} and len(res.published) == 5
    assert {p.publish_version for p in res.published} == {1}

    diffs, res = sync(db, "b2", [hotel("H1"), hotel("H2"), hotel("H3"), hotel("H4"), hotel("H5")])
    assert {d.diff_type for d in diffs} == {"NO_CHANGE"} and res.published == []
    assert {d.action for d in diffs} == {"IGNORE"}

    price = hotel("H1", 2)
    price["rooms"][0]["rate_plans"][0]["price"] = "150.00"
    stock = hotel("H2", 2)
    stock["rooms"][0]["rate_plans"][1]["available"] = False
    content = hotel("H3", 2, name="Hotel H3 Riverside", facilities=["wifi", "pool", "spa"])
    status = hotel("H4", 2, status="INACTIVE")
    same_fields = hotel("H5", 2)  # only version and updated_at moved
    diffs, res = sync(db, "b3", [price, stock, content, status, same_fields])
    by = {d.supplier_hotel_id: d for d in diffs}
    assert by["H1"].diff_type == "PRICE_CHANGED"
    assert by["H1"].changed_fields == [
        {"field": "rooms[DLX].rate_plans[BAR].price", "old": "120.5 THB", "new": "150.00 THB"}
    ]
    assert by["H2"].diff_type == "STOCK_CHANGED"
    assert by["H3"].diff_type == "CONTENT_CHANGED"
    assert {c["field"] for c in by["H3"].changed_fields} == {"name", "facilities"}
    assert by["H4"].diff_type == "STATUS_CHANGED"
    assert by["H5"].diff_type == "NO_CHANGE"
    assert {p.supplier_hotel_id for p in res.published} == {"H1", "H2", "H3", "H4"}
    assert {p.publish_version for p in res.published} == {2}
    logged = rows(db, schema.diff_log, schema.diff_log.c.batch_id == "b3")
    assert {r["supplier_resource_code"]: r["diff_type"] for r in logged} == {
        k: v.diff_type for k, v in by.items()
    }
    assert logged[0]["shard_key"] == "BKK"


def test_older_version_never_overwrites_newer(db: SyncDatabase):
    sync(db, "b1", [hotel("H1", 5, name="Newest name")])
    diffs, res = sync(db, "b2", [hotel("H1", 3, name="Old name")])
    assert diffs[0].diff_type == "STALE" and diffs[0].action == "IGNORE"
    assert res.published == []
    # Even forced through publish (a stale diff that slipped past), the SQL guard holds.
    stale = hotel("H1", 4, name="Older name")
    with db.begin() as conn:
        _, res = sync_in(conn, db, "b3", [stale], policy=lambda d: ("LOW", "AUTO_PUBLISH"))
    assert res.published == [] and res.not_newer == ["H1"] and res.events == 0
    (row,) = rows(db, schema.platform_hotel)
    assert (row["name"], row["supplier_version"], row["publish_version"]) == ("Newest name", 5, 1)


def test_duplicates_in_one_batch_collapse_to_highest_version(db: SyncDatabase):
    diffs, res = sync(
        db, "b1", [hotel("H1", 2, name="v2"), hotel("H1", 3, name="v3"), hotel("H1", 1)]
    )
    assert len(diffs) == 1 and diffs[0].new_version == 3
    (row,) = rows(db, schema.platform_hotel)
    assert row["name"] == "v3" and row["supplier_version"] == 3


def test_offers_follow_the_published_version_and_events_are_one_transaction(db: SyncDatabase):
    sync(db, "b1", [hotel("H1")])
    first = {r["rate_plan_code"]: r["offer_id"] for r in rows(db, schema.platform_offer)}
    v2 = hotel("H1", 2)
    v2["rooms"][0]["rate_plans"] = [v2["rooms"][0]["rate_plans"][0] | {"price": "130.00"}]
    sync(db, "b2", [v2])
    offers = {r["rate_plan_code"]: r for r in rows(db, schema.platform_offer)}
    assert offers["BAR"]["active"] and str(offers["BAR"]["price_amount"]).startswith("130")
    assert not offers["NRF"]["active"]  # the supplier stopped offering it
    assert offers["BAR"]["publish_version"] == 2
    assert {k: r["offer_id"] for k, r in offers.items()} == first
    events = rows(db, schema.outbox)
    kinds = sorted((e["aggregate_version"], e["event_type"]) for e in events)
    assert kinds == [
        (1, "HotelContentChanged"),
        (1, "HotelMappingCreated"),
        (1, "HotelResourceUpdated"),
        (2, "HotelContentChanged"),
        (2, "HotelResourceUpdated"),
    ]
    # Each event is READY for the first stage of its chain (core/outbox/machine.py).
    assert {
        (e["event_type"], e["status"], e["current_stage"], e["next_stage"]) for e in events
    } == {
        ("HotelContentChanged", "READY", "PUBLISHED", "NOTIFY"),
        ("HotelMappingCreated", "READY", "PUBLISHED", "NOTIFY"),
        ("HotelResourceUpdated", "READY", "PUBLISHED", "SEARCH_INDEX"),
    }
    # A publish that fails after writing rolls back its events with it.
    v3 = hotel("H1", 3, name="never published")
    try:
        with db.begin() as conn:
            sync_in(conn, db, "b3", [v3])
            raise RuntimeError("crash before commit")
    except RuntimeError:
        pass
    assert len(rows(db, schema.outbox)) == len(events)
    assert rows(db, schema.platform_hotel)[0]["supplier_version"] == 2


def _stale_offer_updates(db: SyncDatabase) -> list[str]:
    """Collects the stale-offer UPDATEs that ``db``'s engine sends (start the listener)."""
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE PLATFORM_HOTEL_OFFER"):
            seen.append(statement)

    sa.event.listen(db.engine, "before_cursor_execute", before)
    return seen


def test_a_diff_says_whether_the_new_version_drops_an_active_offer(db: SyncDatabase):
    sync(db, "b1", [hotel(h) for h in ("H1", "H2", "H3", "H4")])
    repriced = hotel("H1", 2)
    repriced["rooms"][0]["rate_plans"][0]["price"] = "150.00"
    grown = hotel("H2", 2)
    grown["rooms"].append(copy.deepcopy(grown["rooms"][0]) | {"room_code": "STD"})
    one_plan = hotel("H3", 2)
    one_plan["rooms"][0]["rate_plans"] = one_plan["rooms"][0]["rate_plans"][1:]
    no_room = hotel("H4", 2, rooms=[])
    with db.begin() as conn:
        cands = [cand(d) for d in (repriced, grown, one_plan, no_room, hotel("H5"))]
        maps = map_in(conn, db, "b2", cands)
        diffs = compute_diffs(conn, cands, maps.resource_ids)
    assert {d.supplier_hotel_id: d.drops_offers for d in diffs} == {
        "H1": False,
        "H2": False,
        "H3": True,
        "H4": True,
        "H5": True,  # new: nothing compared (and nothing to deactivate)
    }


def test_a_diff_reads_the_published_form_only_of_a_changed_hotel(db: SyncDatabase):
    """New, stale and unchanged hotels are decided by their versions and fingerprints; the
    published row and offers are read, and compared, only for a hotel whose fingerprint
    differs (also at the same supplier version: a normalization fix replayed)."""
    sync(db, "b1", [hotel("H1"), hotel("H2"), hotel("H3", 5), hotel("H4")])
    repriced = hotel("H2", 2)
    repriced["rooms"][0]["rate_plans"][0]["price"] = "150.00"
    cands = [
        cand(hotel("H1")),  # unchanged
        cand(repriced),
        cand(hotel("H3", 4, name="older")),  # stale
        cand(hotel("H4", facilities=["wifi"])),  # same version, other fingerprint
        cand(hotel("H5")),  # new
    ]
    statements: list[str] = []

    def before(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    with db.begin() as conn:
        maps = map_in(conn, db, "b2", cands)
        rid = maps.resource_ids
        assert set(maps.versions) == maps.published == {rid[h] for h in ("H1", "H2", "H3", "H4")}
        assert maps.versions[rid["H3"]][:2] == (5, 1)
        assert maps.versions[rid["H1"]][2] == cands[0].fingerprint
        sa.event.listen(db.engine, "before_cursor_execute", before)
        try:
            given = compute_diffs(conn, cands, rid, published=maps.versions)
            read = compute_diffs(conn, cands, rid)
        finally:
            sa.event.remove(db.engine, "before_cursor_execute", before)
    for diffs in (given, read):
        assert [(d.diff_type, d.action) for d in diffs] == [
            ("NO_CHANGE", "IGNORE"),
            ("PRICE_CHANGED", "AUTO_PUBLISH"),
            ("STALE", "IGNORE"),
            ("CONTENT_CHANGED", "AUTO_PUBLISH"),
            ("NEW", "AUTO_PUBLISH"),
        ]
        assert [(d.old_publish_version, d.old_supplier_version) for d in diffs] == [
            (1, 1),
            (1, 1),
            (1, 5),
            (1, 1),
            (None, None),
        ]
    assert given == read
    # With the versions given: the changed hotels' rows and their offers; otherwise the
    # versions are read first.
    assert len(statements) == 2 + 3
    assert "fingerprint" in statements[2] and "name" not in statements[2]


def test_a_publish_deactivates_offers_only_of_hotels_that_dropped_one(db: SyncDatabase):
    """The stale-offer UPDATE runs for the hotels whose diff saw an offer go, not for every
    hotel published again; the catalog ends the same."""
    sync(db, "b1", [hotel(f"H{i}") for i in range(4)])
    seen = _stale_offer_updates(db)
    repriced = [hotel(f"H{i}", 2, name=f"renamed {i}") for i in range(3)]
    sync(db, "b2", repriced)
    assert seen == []
    dropped = hotel("H3", 2)
    dropped["rooms"][0]["rate_plans"] = dropped["rooms"][0]["rate_plans"][:1]
    sync(db, "b3", [hotel("H0", 3, name="again"), dropped])
    assert len(seen) == 1
    (h3,) = rows(db, schema.platform_hotel, schema.platform_hotel.c.supplier_hotel_id == "H3")
    offers = {
        (r["resource_id"], r["rate_plan_code"]): (r["active"], r["publish_version"])
        for r in rows(db, schema.platform_offer)
    }
    rid3 = h3["resource_id"]
    assert offers.pop((rid3, "NRF")) == (False, 1)
    assert offers.pop((rid3, "BAR")) == (True, 2)
    assert all(active for active, _ in offers.values())


def test_a_hotel_published_in_between_still_loses_the_offers_the_later_version_lacks(
    db: SyncDatabase,
):
    """A diff that saw no offer dropped was computed against one version; when another
    publish of the hotel commits before this one writes, the offers that version added
    and this one lacks are deactivated all the same."""
    sync(db, "b1", [hotel("H1")])
    grown = hotel("H1", 2)
    grown["rooms"][0]["rate_plans"].append(grown["rooms"][0]["rate_plans"][0] | {"code": "PKG"})
    later = hotel("H1", 3, facilities=["wifi"])  # BAR and NRF, as version 1
    with db.begin() as conn:
        cands = [cand(later)]
        maps = ensure_hotel_mappings(
            conn, db.clock, supplier_id=SUPPLIER, batch_id="b3", hotel_ids=["H1"]
        )
        (diff,) = compute_diffs(conn, cands, maps.resource_ids)
    assert diff.old_publish_version == 1 and not diff.drops_offers
    assert diff.action == "AUTO_PUBLISH"
    sync(db, "b2", [grown])  # commits in between: version 2 adds PKG
    with db.begin() as conn:
        res = publish_hotels(
            conn, db.clock, supplier_id=SUPPLIER, batch_id="b3", items=[(diff, cands[0])]
        )
    assert [p.publish_version for p in res.published] == [3]
    offers = {
        r["rate_plan_code"]: (r["active"], r["publish_version"])
        for r in rows(db, schema.platform_offer)
    }
    assert offers == {"BAR": (True, 3), "NRF": (True, 3), "PKG": (False, 2)}


def test_an_offer_keeps_its_id_for_good(db: SyncDatabase):
    """The offer table allocates an offer's id once, under (hotel, room, rate plan)."""
    sync(db, "b1", [hotel("H1"), hotel("H2")])
    first = {
        (r["resource_id"], r["rate_plan_code"]): r["offer_id"]
        for r in rows(db, schema.platform_offer)
    }
    assert len(first) == len(set(first.values())) == 4
    paused = hotel("H1", 2)
    paused["rooms"][0]["rate_plans"] = paused["rooms"][0]["rate_plans"][:1]
    sync(db, "b2", [paused])
    sync(db, "b3", [hotel("H1", 3, name="Hotel H1 again")])
    now = {(r["resource_id"], r["rate_plan_code"]): r for r in rows(db, schema.platform_offer)}
    assert {k: r["offer_id"] for k, r in now.items()} == first
    h1 = {r["rate_plan_code"]: r for r in now.values() if r["publish_version"] == 3}
    assert set(h1) == {"BAR", "NRF"} and all(r["active"] for r in h1.values())


def test_offer_lookups_by_hotel_read_the_identity_index(db: SyncDatabase):
    """Loading and deactivating a chunk's offers never scans the table (MariaDB plans).

    With an IN list past 200 values MariaDB sizes the ranges from index statistics; while
    the offer table grew they lagged and every chunk's lookup became a full scan. The
    statements force the index, so the plan does not depend on statistics at all.
    """
    sync(db, "b1", [hotel(f"H{i}") for i in range(30)])
    ids = sorted({r["resource_id"] for r in rows(db, schema.platform_offer)})
    # Past eq_range_index_dive_limit (200); a chunk stays below 1000 (see mapping.CHUNK).
    for extra in (300, CHUNK - len(ids)):
        many = ids + list(range(10**9, 10**9 + extra))
        deactivate = offer_deactivation(many, db.clock.now())
        stale = stale_offer_deactivation(many, db.clock.now())
        with db.engine.connect() as conn:
            for stmt in (active_offers(many), deactivate, stale):
                sql = str(
                    stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True})
                )
                if db.engine.dialect.name == "sqlite":
                    steps = " ".join(
                        str(r[-1]) for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}")
                    )
                    assert "SCAN platform_hotel_offer" not in steps, steps
                    continue
                plan = [
                    dict(r)
                    for r in conn.exec_driver_sql(f"EXPLAIN {sql}").mappings()
                    if r["table"] == "platform_hotel_offer"
                ]
                assert [(r["type"] in ("range", "ref"), r["key"]) for r in plan] == [
                    (True, schema.OFFER_IDENTITY)
                ], plan
            assert len(conn.execute(active_offers(many)).all()) == 60


def test_rows_prepared_before_a_concurrent_publish_carry_the_versions_written(db: SyncDatabase):
    """Rows are built before the publish transaction for the expected versions; a publish
    of the same hotel in between moves them, and the written versions win."""
    sync(db, "b1", [hotel("H1")])
    v3 = cand(hotel("H1", 3, facilities=["wifi", "pool", "spa"]))
    with db.begin() as conn:
        maps = ensure_hotel_mappings(
            conn, db.clock, supplier_id=SUPPLIER, batch_id="b3", hotel_ids=["H1"]
        )
    with db.engine.connect() as conn:
        diffs = compute_diffs(conn, [v3], maps.resource_ids)
    items = [(diffs[0], v3)]
    plan = prepare_publish(supplier_id=SUPPLIER, batch_id="b3", items=items)
    assert plan.expected[diffs[0].platform_resource_id] == (2, 3)

    # Lands in between: publish version 2.
    _, between = sync(db, "b2", [hotel("H1", 2, facilities=["wifi"])])
    assert [p.publish_version for p in between.published] == [2]

    with db.begin() as conn:
        res = publish_hotels(
            conn,
            db.clock,
            supplier_id=SUPPLIER,
            batch_id="b3",
            items=items,
            plan=plan,
        )
    assert [(p.publish_version, p.supplier_version) for p in res.published] == [(3, 3)]
    (row,) = rows(db, schema.platform_hotel)
    assert (json.loads(row["facilities"]), row["publish_version"]) == (["wifi", "pool", "spa"], 3)
    live = rows(db, schema.platform_offer, schema.platform_offer.c.active.is_(True))
    assert {o["publish_version"] for o in live} == {3}
    events = rows(db, schema.outbox, schema.outbox.c.batch_id == "b3")
    assert events and {e["aggregate_version"] for e in events} == {3}
    assert all(json.loads(e["payload"])["publish_version"] == 3 for e in events)


def test_concurrent_publishes_of_the_same_data_publish_once(db: SyncDatabase):
    docs = [hotel(f"H{i}") for i in range(50)]

    def run(i: int) -> int:
        return len(sync(db, f"b{i}", copy.deepcopy(docs))[1].published)

    counts, errors = run_concurrently(4, run)
    assert not errors, errors
    assert sum(counts) == 50  # each hotel published by exactly one of the runs
    assert len(rows(db, schema.platform_hotel)) == 50
    assert {r["publish_version"] for r in rows(db, schema.platform_hotel)} == {1}
    assert len(rows(db, schema.outbox, schema.outbox.c.event_type == "HotelResourceUpdated")) == 50
    assert len(rows(db, schema.hotel_mapping)) == 50


def test_dead_letters_are_idempotent_and_counted(db: SyncDatabase):
    letters = [
        DeadLetter(
            "H1",
            "ADAPTER",
            "NON_RETRYABLE",
            "MISSING_REQUIRED_FIELD",
            "name is missing",
            "file:///raw/p1.json.gz",
            "b" * 64,
        ),
        DeadLetter(
            None,
            "ADAPTER",
            "NON_RETRYABLE",
            "NOT_AN_OBJECT",
            "record is 42",
            "file:///raw/p1.json.gz",
            "b" * 64,
        ),
        DeadLetter(
            "H2",
            "VALIDATION",
            "NON_RETRYABLE",
            "LAT_OUT_OF_RANGE",
            "lat 200.0",
            "file:///raw/p1.json.gz",
            "b" * 64,
        ),
    ]
    for _ in range(2):
        with db.begin() as conn:
            record_dead_letters(
                conn,
                db.clock,
                batch_id="b1",
                task_code="t",
                sync_mode="FULL",
                supplier_id=SUPPLIER,
                letters=letters,
            )
    with db.engine.connect() as conn:
        assert count_dead_letters(conn, "b1") == {
            "MISSING_REQUIRED_FIELD": 1,
            "NOT_AN_OBJECT": 1,
            "LAT_OUT_OF_RANGE": 1,
        }
    stored = rows(db, schema.dead_letter)
    assert {(r["status"], r["owner_team"]) for r in stored} == {("MANUAL_FIX", "supplier-data")}
    assert all(r["raw_payload_ref"] == "file:///raw/p1.json.gz" for r in stored)
