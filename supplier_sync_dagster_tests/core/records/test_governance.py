"""Governance end to end: row-level dead letters, blocking gates, risk review and replay.

The simulator runs over real HTTP with its bad-record kinds, moved hotels and hostile city
codes; every test runs on SQLite and on MariaDB.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import ReviewStateError
from supplier_sync_dagster.core.leasing.batches import TaskSpec, create_batch, upsert_task
from supplier_sync_dagster.core.records.diff import HotelDiff, RiskRules
from supplier_sync_dagster.core.records.gates import (
    GateThresholds,
    override_gate,
    set_gate_thresholds,
)
from supplier_sync_dagster.core.records.review import approve_reviews, list_reviews, reject_reviews
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore, PayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync.city import sync_city
from supplier_sync_dagster.core.sync.gate import PipelineGate as Gate
from supplier_sync_dagster.core.sync.gate import gate_for_pipeline
from supplier_sync_dagster.core.sync.model import CityReport
from supplier_sync_dagster.core.sync.replay import (
    dry_run_city,
    prepare_replay,
    resolve_replayed_dead_letters,
)
from supplier_sync_dagster.simulator import FaultProfile, Simulator, running_server
from supplier_sync_dagster_tests.core.sync.test_city import (
    SUPPLIER,
    published,
    settings,
)
from supplier_sync_dagster_tests.helpers import make_simulator, supplier_client

TASK = "hotel_full"


@contextmanager
def served(sim: Simulator) -> Iterator[SupplierClient]:
    with running_server(sim) as url, httpx.Client(base_url=url) as http:
        yield supplier_client(http)


def sync_all(
    db: SyncDatabase,
    store: PayloadStore,
    client: SupplierClient,
    trigger: str,
    *,
    gate: Gate | None = None,
    countries: dict[str, str] | None = None,
    cities: list[str] | None = None,
) -> tuple[str, dict[str, CityReport]]:
    upsert_task(
        db, TaskSpec(task_code=TASK, supplier_id=SUPPLIER, concurrency_policy="CANCEL_PREVIOUS")
    )
    listing = client.list_cities().data.cities
    if countries is None:
        countries = {c.city_code: c.country_code for c in listing if c.country_code}
    cities = cities or [c.city_code for c in listing]
    decision = create_batch(
        db, task_code=TASK, trigger_id=trigger, trigger_source="MANUAL", shard_keys=cities
    )
    assert decision.batch is not None
    reports = {
        city: sync_city(
            db,
            store,
            client,
            batch=decision.batch,
            city_code=city,
            worker_id="w1",
            settings=settings(),
            gate=gate,
            city_countries=countries,
        )
        for city in cities
    }
    return decision.batch.batch_id, reports


def published_cities(db: SyncDatabase) -> dict[str, str]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return dict(conn.execute(sa.select(h.supplier_hotel_id, h.city_code)).all())


def letter_rows(db: SyncDatabase, batch_id: str) -> list[Any]:
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(
                    d.supplier_resource_code,
                    d.error_stage,
                    d.error_type,
                    d.error_code,
                    d.error_message,
                    d.raw_payload_ref,
                    d.raw_payload_hash,
                    d.status,
                ).where(d.batch_id == batch_id)
            )
        )


def test_full_sync_dead_letters_carry_expected_codes_and_moved_hotels_are_routed(
    db: SyncDatabase, tmp_path: Path
):
    sim = make_simulator(
        FaultProfile.flaky().with_(
            rate_slow=0.0, bad_record_rate=0.06, moved_hotel_rate=0.05, hostile_city_codes=True
        ),
        seed=11,
        n_cities=8,
        total_hotels=1200,
    )
    truth = sim.ground_truth()
    assert truth.moved and truth.bad
    store = LocalPayloadStore(tmp_path / "payloads")
    with served(sim) as client:
        batch_id, reports = sync_all(db, store, client, "day-0", gate=gate_for_pipeline())
    assert all(r.status == "SUCCESS" for r in reports.values()), [
        (c, r.status, r.error) for c, r in reports.items()
    ]
    now = published(db)
    assert now == truth.valid
    rows = letter_rows(db, batch_id)
    codes = {r.supplier_resource_code: r.error_code for r in rows}
    assert set(codes) == set(truth.bad)
    for hid, reason in truth.bad.items():
        assert codes[hid] == reason.split(":")[0], (hid, reason, codes[hid])
    assert not set(codes) & set(now)
    assert all(r.raw_payload_ref and len(r.raw_payload_hash) == 64 for r in rows)
    assert all(len(r.error_message) <= 1024 for r in rows)
    # A moved hotel is published once, under the city it is really in.
    cities = published_cities(db)
    for hid, home in truth.moved.items():
        if hid in truth.valid:
            assert cities[hid] == home
    assert sum(r.moved for r in reports.values()) >= 1


def test_a_wrong_country_mapping_is_a_mapping_required_dead_letter(
    db: SyncDatabase, tmp_path: Path
):
    sim = make_simulator(seed=5, n_cities=4, total_hotels=300)
    store = LocalPayloadStore(tmp_path / "payloads")
    with served(sim) as client:
        listing = client.list_cities().data.cities
        countries = {c.city_code: c.country_code or "" for c in listing}
        city = next(c.city_code for c in listing if c.hotel_count)
        countries[city] = "AQ" if countries[city] != "AQ" else "FR"
        batch_id, reports = sync_all(db, store, client, "day-0", countries=countries)
    rows = [r for r in letter_rows(db, batch_id) if r.error_code == "COUNTRY_CITY_MISMATCH"]
    assert len(rows) == reports[city].dead_letters > 0
    assert {r.error_stage for r in rows} == {"VALIDATION"}
    assert {r.error_type for r in rows} == {"MAPPING_REQUIRED"}
    assert reports[city].published == 0
    assert all(r.published > 0 for c, r in reports.items() if c != city and r.records)


def _day(seed: int, day: int, **faults: Any) -> Simulator:
    return make_simulator(
        FaultProfile.clean().with_(**faults), seed=seed, n_cities=5, total_hotels=600, day=day
    )


def test_half_bad_city_fails_its_gate_publishes_nothing_then_an_override_publishes(
    db: SyncDatabase, tmp_path: Path
):
    store = LocalPayloadStore(tmp_path / "payloads")
    checks: dict[str, list[Any]] = {}
    gate = gate_for_pipeline(on_results=lambda b, c, results: checks.__setitem__(c, results))
    with served(_day(21, 0)) as client:
        _, day0 = sync_all(db, store, client, "day-0", gate=gate)
    assert all(r.status == "SUCCESS" for r in day0.values())
    before = published(db)

    sim = _day(21, 1, bad_record_rate=0.5)
    truth = sim.ground_truth()
    with served(sim) as client:
        batch_id, day1 = sync_all(db, store, client, "day-1", gate=gate)
        gated = [c for c, r in day1.items() if r.status == "GATED"]
        assert gated and gated == [c for c, r in day1.items() if r.records]
        for city in gated:
            assert day1[city].published == 0 and "bad_record_ratio" in day1[city].gate_failures
            failed = {r.check_name: r for r in checks[city] if not r.passed}
            meta = failed["bad_record_ratio"].metadata
            assert meta["ratio"] > 0.2 and meta["max_bad_ratio"] == 0.2 and meta["bad"] > 0
        assert published(db) == before  # nothing of the gated cities reached the catalog

        city = gated[0]
        with db.begin() as conn:
            done = override_gate(
                conn,
                db.clock,
                batch_id=batch_id,
                shard_key=city,
                check_name="bad_record_ratio",
                who="alice",
                reason="supplier confirmed a partial outage; valid rows are fine",
            )
        assert done.overridden_by == "alice"
        _, again = sync_all(db, store, client, "day-1", gate=gate, cities=[city])
    assert again[city].status == "SUCCESS"
    assert again[city].published > 0
    valid_here = truth.valid_by_city[city]
    now = published(db)
    assert {h: now[h] for h in valid_here} == dict(valid_here)
    assert next(r for r in checks[city] if r.check_name == "bad_record_ratio").overridden


class _EmptyCity(httpx.BaseTransport):
    """Forwards to the simulator over HTTP, except that one city suddenly lists nothing."""

    def __init__(self, url: str, city: str) -> None:
        self.inner = httpx.HTTPTransport()
        self.url = httpx.URL(url)
        self.city = city

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.startswith("/v1/cities/") and path.endswith("/hotels"):
            code = httpx.URL(request.url).path.split("/")[3]
            if code == self.city:
                body = {"hotels": [], "page": 1, "page_size": 50, "total": 0, "total_pages": 0}
                return httpx.Response(200, json=body)
        forwarded = request.url.copy_with(
            scheme=self.url.scheme, host=self.url.host, port=self.url.port
        )
        proxied = httpx.Request(request.method, forwarded, headers=request.headers)
        response = self.inner.handle_request(proxied)
        response.read()
        return response


def test_a_city_that_suddenly_returns_nothing_fails_record_count(db: SyncDatabase, tmp_path: Path):
    store = LocalPayloadStore(tmp_path / "payloads")
    gate = gate_for_pipeline()
    sim = _day(31, 0)
    with served(sim) as client:
        _, day0 = sync_all(db, store, client, "day-0", gate=gate)
    city = max(day0, key=lambda c: day0[c].records)
    before = published(db)
    with running_server(sim) as url:
        transport = _EmptyCity(url, city)
        with httpx.Client(base_url="http://supplier.test", transport=transport) as http:
            client = supplier_client(http)
            _, day1 = sync_all(db, store, client, "day-1", gate=gate)
    assert day1[city].status == "GATED", day1[city]
    assert day1[city].records == 0
    assert "record_count" in day1[city].gate_failures
    assert all(r.status == "SUCCESS" for c, r in day1.items() if c != city)
    assert published(db) == before


def test_schema_drift_day_stops_before_flooding_dead_letters(db: SyncDatabase, tmp_path: Path):
    store = LocalPayloadStore(tmp_path / "payloads")
    checks: dict[str, list[Any]] = {}
    gate = gate_for_pipeline(on_results=lambda b, c, results: checks.__setitem__(c, results))
    with served(_day(41, 0, location_rename_from_day=1)) as client:
        _, day0 = sync_all(db, store, client, "day-0", gate=gate)
    assert all(r.status == "SUCCESS" for r in day0.values())
    with served(_day(41, 1, location_rename_from_day=1)) as client:
        batch_id, day1 = sync_all(db, store, client, "day-1", gate=gate)
        busy = [c for c, r in day1.items() if r.records]
        assert busy and all(day1[c].status == "GATED" for c in busy)
        assert all(day1[c].gate_failures == ["schema_drift"] for c in busy)
        assert "location" in (day1[busy[0]].error or "")
        assert letter_rows(db, batch_id) == []  # stopped before normalizing: no flood

        # An operator who has looked lets one city through; its records are dead letters
        # (FIELD_RENAMED) and the ratio gate still holds it, until that is overridden too.
        city = busy[0]
        with db.begin() as conn:
            for check in ("schema_drift", "bad_record_ratio"):
                override_gate(
                    conn,
                    db.clock,
                    batch_id=batch_id,
                    shard_key=city,
                    check_name=check,
                    who="bob",
                    reason="rename confirmed; adapter fix follows",
                )
        _, again = sync_all(db, store, client, "day-1", gate=gate, cities=[city])
    assert again[city].status == "SUCCESS"
    assert {r.error_code for r in letter_rows(db, batch_id)} == {"FIELD_RENAMED"}
    drift = next(r for r in checks[city] if r.check_name == "schema_drift")
    assert drift.overridden
    assert "location" in json.dumps(drift.metadata)


def test_large_price_moves_wait_for_review_and_approval_publishes_them(
    db: SyncDatabase, tmp_path: Path
):
    store = LocalPayloadStore(tmp_path / "payloads")
    sim = make_simulator(
        seed=51, n_cities=5, total_hotels=800, daily_price_change_rate=0.3, price_shock_rate=0.4
    )
    with served(sim) as client:
        sync_all(db, store, client, "day-0")
        sim.advance_day()
        truth = sim.ground_truth()
        assert truth.price_shocks
        batch_id, reports = sync_all(db, store, client, "day-1")
    with db.engine.connect() as conn:
        pending = list_reviews(conn, batch_id=batch_id)
    assert {rv.supplier_hotel_id for rv in pending} == set(truth.price_shocks)
    assert sum(r.held_for_review for r in reports.values()) == len(pending)
    now = published(db)
    assert all(now[h] < truth.valid[h] for h in truth.price_shocks)  # held back
    others = {h: v for h, v in truth.valid.items() if h not in truth.price_shocks}
    assert {h: now[h] for h in others} == others

    first, *rest = pending
    rejected = reject_reviews(db, review_ids=[first.review_id], who="carol", reason="feed error")
    assert rejected.rejected == 1
    with pytest.raises(ReviewStateError):
        approve_reviews(db, review_ids=[first.review_id], who="carol", reason="changed my mind")
    decision = approve_reviews(db, review_ids=None, batch_id=batch_id, who="carol", reason="ok")
    assert decision.approved == decision.published == len(rest)
    now = published(db)
    assert {h: now[h] for h in truth.valid if h != first.supplier_hotel_id} == {
        h: v for h, v in truth.valid.items() if h != first.supplier_hotel_id
    }
    assert now[first.supplier_hotel_id] < truth.valid[first.supplier_hotel_id]
    with db.engine.connect() as conn:
        decided = {rv.review_id: rv for rv in list_reviews(conn, status=None)}
    assert decided[first.review_id].status == "REJECTED"
    assert all(decided[rv.review_id].status == "APPROVED" for rv in rest)
    assert all(decided[rv.review_id].decided_by == "carol" for rv in pending)
    assert all(decided[rv.review_id].publish_version for rv in rest)


def test_replay_after_a_rule_fix_publishes_the_change_without_supplier_requests(
    db: SyncDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import supplier_sync_dagster.core.sync.stages as stages

    store = LocalPayloadStore(tmp_path / "payloads")
    sim = make_simulator(seed=61, n_cities=4, total_hotels=400)
    fixed_rule = stages.normalize_documents

    def buggy_rule(records: Any, **kwargs: Any) -> Any:
        result = fixed_rule(records, **kwargs)
        result.docs = [{**doc, "name": doc["name"].upper()} for doc in result.docs]
        return result

    with served(sim) as client:
        listing = client.list_cities().data.cities
        right = {c.city_code: c.country_code or "" for c in listing}
        city = max(listing, key=lambda c: c.hotel_count or 0).city_code
        other = next(c.city_code for c in listing if c.city_code != city and c.hotel_count)
        wrong = {**right, other: "AQ"}
        monkeypatch.setattr(stages, "normalize_documents", buggy_rule)
        source, _ = sync_all(db, store, client, "day-0", countries=wrong)
        monkeypatch.setattr(stages, "normalize_documents", fixed_rule)
    names = _names(db)
    assert names and all(n == n.upper() for n in names.values())
    mismatched = [r for r in letter_rows(db, source) if r.error_code == "COUNTRY_CITY_MISMATCH"]
    assert mismatched
    requests = sim.stats["requests_total"]

    dry = dry_run_city(
        db, store, task_code=TASK, supplier_id=SUPPLIER, city_code=city, city_countries=right
    )
    assert dry.source_batch_id == source
    assert dry.diffs_by_type["CONTENT_CHANGED"] > 0 and dry.diffs_by_action["AUTO_PUBLISH"] > 0
    assert any(c["field"] == "name" for ch in dry.changes for c in ch["changed_fields"])
    assert _names(db) == names  # a dry run publishes nothing

    plan = prepare_replay(db, task_code=TASK, trigger_id=uuid.uuid4().hex, cities=[city, other])
    assert plan.sources == {city: source, other: source}
    for code in (city, other):
        report = sync_city(
            db,
            store,
            None,
            batch=plan.batch,
            city_code=code,
            worker_id="w2",
            settings=settings(),
            fetch=False,
            city_countries=right,
        )
        assert report.status == "SUCCESS", report
        resolve_replayed_dead_letters(
            db, source_batch_id=source, replay_batch_id=plan.batch.batch_id, city_code=code
        )
    assert sim.stats["requests_total"] == requests  # not one supplier request
    fixed = _names(db)
    changed = [h for h in fixed if fixed[h] != names.get(h)]
    assert changed and all(fixed[h] != fixed[h].upper() for h in changed)
    statuses = {
        r.supplier_resource_code: r.status
        for r in letter_rows(db, source)
        if r.error_code == "COUNTRY_CITY_MISMATCH"
    }
    assert set(statuses.values()) == {"RESOLVED"}
    assert set(statuses) <= set(published(db))


def _names(db: SyncDatabase) -> dict[str, str]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return dict(conn.execute(sa.select(h.supplier_hotel_id, h.name)).all())


def test_per_task_thresholds_change_the_verdict(db: SyncDatabase, tmp_path: Path):
    store = LocalPayloadStore(tmp_path / "payloads")
    with served(_day(71, 0, bad_record_rate=0.1)) as client:
        upsert_task(
            db,
            TaskSpec(task_code=TASK, supplier_id=SUPPLIER, concurrency_policy="CANCEL_PREVIOUS"),
        )
        with db.begin() as conn:
            set_gate_thresholds(
                conn, db.clock, task_code=TASK, thresholds=GateThresholds(max_bad_ratio=0.01)
            )
        _, strict = sync_all(db, store, client, "strict", gate=gate_for_pipeline())
        assert any(r.status == "GATED" for r in strict.values())
        with db.begin() as conn:
            set_gate_thresholds(
                conn, db.clock, task_code=TASK, thresholds=GateThresholds(max_bad_ratio=0.5)
            )
        _, lenient = sync_all(db, store, client, "lenient", gate=gate_for_pipeline())
    assert all(r.status == "SUCCESS" for r in lenient.values())


def _diff(diff_type: str, *changes: tuple[str, Any, Any]) -> HotelDiff:
    return HotelDiff(
        "H1",
        1,
        3,
        7,
        8,
        diff_type,  # type: ignore[arg-type]
        [{"field": f, "old": o, "new": n} for f, o, n in changes],
    )


@pytest.mark.parametrize(
    ("diff", "expected"),
    [
        (_diff("NO_CHANGE"), ("LOW", "IGNORE")),
        (_diff("STALE", ("version", 9, 8)), ("LOW", "IGNORE")),
        (_diff("NEW", ("*", None, "created")), ("LOW", "AUTO_PUBLISH")),
        (
            _diff("PRICE_CHANGED", ("rooms[D].rate_plans[B].price", "100.00 USD", "149.00 USD")),
            ("LOW", "AUTO_PUBLISH"),
        ),
        (
            _diff("PRICE_CHANGED", ("rooms[D].rate_plans[B].price", "100.00 USD", "151.00 USD")),
            ("HIGH", "REVIEW"),
        ),
        (
            _diff("PRICE_CHANGED", ("rooms[D].rate_plans[B].price", "100.00 USD", "49.00 USD")),
            ("HIGH", "REVIEW"),
        ),
        (
            _diff("PRICE_CHANGED", ("rooms[D].rate_plans[B].price", "100.00 USD", "100.00 EUR")),
            ("HIGH", "REVIEW"),
        ),
        (_diff("CONTENT_CHANGED", ("lat", 13.70, 13.71)), ("MEDIUM", "AUTO_PUBLISH")),
        (_diff("CONTENT_CHANGED", ("lat", 13.70, 13.73)), ("HIGH", "REVIEW")),
        (_diff("CONTENT_CHANGED", ("lng", 100.50, 100.53)), ("HIGH", "REVIEW")),
        (
            _diff("CONTENT_CHANGED", ("name", "Riverside Grand", "Riverside Grand Hotel")),
            ("MEDIUM", "AUTO_PUBLISH"),
        ),
        (
            _diff("CONTENT_CHANGED", ("name", "Riverside Grand", "RIVERSIDE  GRAND")),
            ("MEDIUM", "AUTO_PUBLISH"),
        ),
        (
            _diff("CONTENT_CHANGED", ("name", "Riverside Grand", "Casa Blanca Suites")),
            ("HIGH", "REVIEW"),
        ),
        (_diff("STATUS_CHANGED", ("status", "ACTIVE", "INACTIVE")), ("MEDIUM", "AUTO_PUBLISH")),
        (
            _diff("STOCK_CHANGED", ("rooms[D].rate_plans[B].available", True, False)),
            ("LOW", "AUTO_PUBLISH"),
        ),
    ],
)
def test_risk_rules_decide_each_diff(diff: HotelDiff, expected: tuple[str, str]):
    assert RiskRules()(diff) == expected


def test_many_hotels_turning_inactive_at_once_all_go_to_review():
    rules = RiskRules(mass_inactive_share=0.2, mass_inactive_min=5)
    closing = _diff("STATUS_CHANGED", ("status", "ACTIVE", "INACTIVE"))
    calm = _diff("CONTENT_CHANGED", ("email", "a@x.example", "b@x.example"))
    decided = [
        dataclasses.replace(d, risk_level=r, action=a)
        for d in [closing] * 6 + [calm] * 14
        for r, a in [rules(d)]
    ]
    out = rules.escalate(decided)
    assert [d.action for d in out[:6]] == ["REVIEW"] * 6
    assert all(d.action == "AUTO_PUBLISH" for d in out[6:])
    few = rules.escalate(decided[:4] + decided[6:])  # 4 of 18: under both limits
    assert all(d.action == "AUTO_PUBLISH" for d in few)


def test_dry_run_streams_chunks_through_the_sync_stages_and_writes_nothing(
    db: SyncDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import supplier_sync_dagster.core.sync.stages as stages

    store = LocalPayloadStore(tmp_path / "payloads")
    with served(_day(62, 0, bad_record_rate=0.05)) as client:
        _, synced = sync_all(db, store, client, "day-0")
    city = max(synced, key=lambda c: synced[c].records)
    # The next day's pages, fetched and stored but not the ones published: changes to find.
    with served(_day(62, 1, bad_record_rate=0.05)) as client:
        source, _ = sync_all(db, store, client, "day-1", cities=[city])
    whole = dry_run_city(db, store, task_code=TASK, supplier_id=SUPPLIER, city_code=city)

    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement.lstrip().split(None, 1)[0].upper())

    def no_put(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a dry run stored a payload")

    monkeypatch.setattr(store, "put", no_put)
    sizes: list[int] = []
    collector = stages.DiffCollector(db, settings(), sample=20)

    def publisher(chunk: list[Any]) -> Any:
        sizes.append(len(chunk))
        return collector(chunk)

    sa.event.listen(db.engine, "before_cursor_execute", record)
    try:
        chunked = dry_run_city(
            db, store, task_code=TASK, supplier_id=SUPPLIER, city_code=city, chunk_hotels=40
        )
        report = stages.dry_run_stages(
            db,
            store,
            batch_id=source,
            city_code=city,
            settings=dataclasses.replace(settings(), chunk_hotels=40),
            publisher=publisher,
        )
    finally:
        sa.event.remove(db.engine, "before_cursor_execute", record)
    # Only reads (SQLite opens each read with a deferred BEGIN): no INSERT, UPDATE or DELETE.
    assert statements and set(statements) <= {"SELECT", "BEGIN", "PRAGMA"}, set(statements)
    assert len(sizes) > 2 and max(sizes) < 40 + settings().page_size  # a chunk, not the city
    assert report.records == whole.records > 40
    assert report.published + report.dead_letters + report.skipped == report.records
    # Streaming in chunks reports what one pass over the whole city reports.
    assert chunked.to_json() == whole.to_json()
    assert whole.dead_letters and sum(whole.diffs_by_type.values()) > 0
