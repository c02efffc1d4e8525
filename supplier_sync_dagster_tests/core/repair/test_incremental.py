"""Incremental windows over a change feed served by a MockTransport (SQLite and MariaDB).

The feed honours the contract (ordered by ``(updated_at, hotel_id)``, ``next`` until caught
up); a change can be added with an ``updated_at`` earlier than what was already handed out
(late data). The simulator-backed scenario over real HTTP is in ``integration/``.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import NoBaseline, TriggerSkipped
from supplier_sync_dagster.core.leasing.batches import TaskSpec, upsert_task
from supplier_sync_dagster.core.leasing.leases import LeaseSettings, list_shards
from supplier_sync_dagster.core.records.gates import GateThresholds, set_gate_thresholds
from supplier_sync_dagster.core.records.review import approve_reviews
from supplier_sync_dagster.core.repair import incremental
from supplier_sync_dagster.core.repair.incremental import (
    WINDOW_PUBLISH_CHUNK_HOTELS,
    FeedPosition,
    IncrementalSettings,
    Watermark,
    advance_watermark,
    get_watermark,
    quiet_windows,
    run_incremental,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync import stages
from supplier_sync_dagster.core.sync.model import DEFAULT_PUBLISH_CHUNK_HOTELS, SyncSettings
from supplier_sync_dagster.core.sync.stages import _judge_page

T0 = datetime(2026, 11, 20, 10, 0, tzinfo=UTC)
SETTINGS = SyncSettings(
    task_code="full_task",
    supplier_id=1001,
    lease=LeaseSettings(lease_seconds=30, heartbeat_seconds=5),
)
TASK = "incr_task"
SKEW = {"max_clock_skew_seconds": SETTINGS.max_clock_skew_seconds}
_REAL_JUDGE_PAGE = _judge_page


def _ts(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def hotel(num: int, at: float, version: int = 1, **extra: Any) -> dict[str, Any]:
    """A valid hotel record of the contract, changed at ``T0 + at`` seconds."""
    record: dict[str, Any] = {
        "hotel_id": f"H{num:06d}",
        "name": f"Riverside Hotel {num}",
        "city_code": "BKK" if num % 2 else "CNX",
        "country_code": "TH",
        "address": {"line1": f"{num} Charoen Krung Rd", "postal_code": "10500"},
        "geo": {"lat": 13.7234, "lng": 100.5143},
        "star_rating": 4.0,
        "phone": "+66 2 123 4567",
        "facilities": ["wifi"],
        "images": [],
        "rooms": [
            {
                "room_code": "DLX",
                "name": "Deluxe",
                "bed_type": "KING",
                "max_occupancy": 2,
                "rate_plans": [
                    {
                        "code": "BAR",
                        "board": "RO",
                        "refundable": True,
                        "available": True,
                        "price": {"amount": f"{100 + version}.00", "currency": "USD"},
                    }
                ],
            }
        ],
        "status": "ACTIVE",
        "updated_at": _ts(at),
        "version": version,
    }
    record.update(extra)
    return record


class Feed:
    """``GET /v1/hotels/changes`` over a list of records (latest version per hotel)."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self.requests = 0
        self.fail_after: int | None = None  # raise this many requests from now

    def change(self, record: dict[str, Any]) -> None:
        self.records[record["hotel_id"]] = record

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/hotels/changes", request.url
        if self.fail_after is not None:
            if self.fail_after <= 0:
                raise KeyboardInterrupt("killed mid-window")
            self.fail_after -= 1
        self.requests += 1
        params = request.url.params
        since = params["since"]
        after = params.get("after_id") or ""
        limit = int(params["limit"])
        key = (datetime.fromisoformat(since.replace("Z", "+00:00")), after)
        ordered = sorted(
            self.records.values(),
            key=lambda r: (
                datetime.fromisoformat(r["updated_at"].replace("Z", "+00:00")),
                r["hotel_id"],
            ),
        )
        chosen = [
            r
            for r in ordered
            if (datetime.fromisoformat(r["updated_at"].replace("Z", "+00:00")), r["hotel_id"]) > key
        ][:limit]
        rest = len(
            [
                r
                for r in ordered
                if (datetime.fromisoformat(r["updated_at"].replace("Z", "+00:00")), r["hotel_id"])
                > key
            ]
        )
        nxt = (
            {"since": chosen[-1]["updated_at"], "after_id": chosen[-1]["hotel_id"]}
            if chosen and rest > len(chosen)
            else None
        )
        return httpx.Response(200, json={"changes": chosen, "next": nxt})


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


def _start_at(db: SyncDatabase, seconds: float) -> None:
    with db.begin() as conn:
        advance_watermark(
            conn,
            db.clock,
            task_code=TASK,
            supplier_id=1001,
            to=Watermark(T0 + timedelta(seconds=seconds)),
            batch_id="seed",
            **SKEW,
        )


def _run(db, store, client, trigger: str, **settings: Any):
    incremental = IncrementalSettings(
        task_code=TASK, full_task_code="full_task", **{"limit": 3, **settings}
    )
    return run_incremental(
        db,
        store,
        client,
        settings=SETTINGS,
        incremental=incremental,
        trigger_id=trigger,
        source="MANUAL",
        worker_id=f"worker-{trigger}",
    )


def _published(db: SyncDatabase) -> dict[str, int]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return dict(conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version)).all())


def test_a_window_publishes_every_change_and_moves_the_watermark_to_its_last(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed
):
    _start_at(db, 0)
    for n in range(1, 8):
        feed.change(hotel(n, at=n * 10))
    window = _run(db, store, client, "w1")
    assert window.report.status == "SUCCESS"
    assert window.report.records == 7 and window.report.published == 7
    assert window.report.pages_fetched == 3  # 3 + 3 + 1
    assert window.watermark_before == Watermark(T0)
    assert window.watermark_after == Watermark(T0 + timedelta(seconds=70), "H000007")
    assert window.cities == {"BKK": 4, "CNX": 3}
    assert _published(db) == {f"H{n:06d}": 1 for n in range(1, 8)}
    # The batch records where the window began and ended.
    assert window.batch.sync_mode == "INCREMENTAL" and window.batch.status == "SUCCESS"


def test_a_window_at_the_default_publishes_in_larger_transactions_than_a_full_sync(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed
):
    # Each publish call stamps its hotels with its own token, in one transaction: the
    # tokens' groups are the transactions (not the publish times: two forked publishers may
    # read the same microsecond). A window whose settings keep the full sync's default
    # publishes up to WINDOW_PUBLISH_CHUNK_HOTELS a transaction, one set explicitly stays.
    assert WINDOW_PUBLISH_CHUNK_HOTELS > DEFAULT_PUBLISH_CHUNK_HOTELS
    _start_at(db, 0)
    # Forked publishers split a window into equal chunks near the size (4,100 hotels: 4 of
    # 975 and a last one at 1,000 a transaction; 2 of 1,950 at 2,000), one process into
    # chunks of the size.
    count = 2 * WINDOW_PUBLISH_CHUNK_HOTELS + 100
    for n in range(1, count + 1):
        feed.change(hotel(n, at=n))
    window = _run(db, store, client, "w1", limit=1000)
    assert window.report.status == "SUCCESS" and window.report.published == count
    with db.engine.connect() as conn:
        h = schema.platform_hotel.c
        groups = Counter(conn.execute(sa.select(h.publish_token)).scalars())
    assert DEFAULT_PUBLISH_CHUNK_HOTELS < max(groups.values()) <= WINDOW_PUBLISH_CHUNK_HOTELS
    assert sum(groups.values()) == count


def test_a_second_window_rereads_only_the_overlap_and_publishes_only_what_is_new(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed
):
    _start_at(db, 0)
    for n in range(1, 8):
        feed.change(hotel(n, at=n * 100))
    _run(db, store, client, "w1")
    feed.change(hotel(2, at=800, version=2))
    second = _run(db, store, client, "w2", overlap_seconds=150)
    # From 700 - 150 = 550: hotels 6 and 7 again (no-ops) and hotel 2's new version.
    assert second.report.records == 3
    assert second.report.published == 1 and second.report.skipped == 2
    assert second.watermark_after == Watermark(T0 + timedelta(seconds=800), "H000002")
    assert _published(db)["H000002"] == 2
    third = _run(db, store, client, "w3", overlap_seconds=150)
    assert third.report.published == 0
    assert third.watermark_after == second.watermark_after
    assert quiet_windows(db, TASK) == 1  # the third found nothing new


@pytest.mark.parametrize("overlap, lost", [(0, True), (300, False)])
def test_a_change_visible_late_is_found_only_by_looking_back(
    db: SyncDatabase,
    store: LocalPayloadStore,
    client: SupplierClient,
    feed: Feed,
    overlap: float,
    lost: bool,
):
    _start_at(db, 0)
    feed.change(hotel(1, at=100))
    feed.change(hotel(3, at=300))
    _run(db, store, client, "w1", overlap_seconds=overlap)
    # The supplier's replication lag: hotel 2 changed at 200, visible only now.
    feed.change(hotel(2, at=200))
    _run(db, store, client, "w2", overlap_seconds=overlap)
    assert ("H000002" in _published(db)) is not lost


def test_a_window_killed_mid_way_resumes_from_its_checkpoint_and_publishes_each_change_once(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed
):
    _start_at(db, 0)
    for n in range(1, 11):
        feed.change(hotel(n, at=n * 10))
    feed.fail_after = 2  # pages 1 and 2 arrive, the third request kills the worker
    with pytest.raises(KeyboardInterrupt):
        _run(db, store, client, "w1")
    with db.engine.connect() as conn:
        assert get_watermark(conn, TASK) == Watermark(T0)  # not ahead of the catalog
    assert _published(db) == {}
    feed.fail_after = None
    # The worker is gone: once its grace passes, the next trigger adopts the window.
    db.clock.advance(120)
    before = feed.requests
    window = _run(db, store, client, "w2")
    assert window.report.status == "SUCCESS"
    assert window.report.resumed_from_page == 3
    assert feed.requests - before == 2  # pages 3 and 4 only
    assert window.report.published == 10
    assert window.watermark_after == Watermark(T0 + timedelta(seconds=100), "H000010")
    with db.engine.connect() as conn:
        versions = (
            conn.execute(sa.select(schema.platform_hotel.c.publish_version).distinct())
            .scalars()
            .all()
        )
    assert versions == [1]
    shards = list_shards(db, window.batch.batch_id)
    assert [s.status for s in shards] == ["SUCCESS"]


def _volume_thresholds(db: SyncDatabase, **kw: Any) -> None:
    upsert_task(db, TaskSpec(task_code=TASK, supplier_id=1001, sync_mode="INCREMENTAL"))
    with db.begin() as conn:
        set_gate_thresholds(
            conn, db.clock, task_code=TASK, thresholds=GateThresholds(**kw), updated_by="test"
        )


def _changes(feed: Feed, at: float, n: int, every: float) -> float:
    """``n`` new hotels changed ``every`` seconds after ``at``; returns the last time."""
    for _ in range(n):
        at += every
        feed.change(hotel(int(at), at=at))
    return at


def test_a_window_far_above_its_usual_rate_is_held_for_review(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed
):
    _volume_thresholds(db, max_volume_factor=3.0, min_volume_records=5)
    _start_at(db, 0)
    at = 0.0
    for i in range(3):  # three ordinary windows: 2 changes in 20 minutes (6 an hour)
        at = _changes(feed, at, 2, 600)
        assert _run(db, store, client, f"normal{i}", overlap_seconds=0).held is False
    # A busy stretch at the usual rate is no anomaly, however many changes it holds...
    at = _changes(feed, at, 20, 600)
    busy = _run(db, store, client, "busy", overlap_seconds=0)
    assert busy.held is False and busy.report.published == 20
    assert busy.volume is not None and busy.volume.metadata["rate_per_hour"] == 6
    # ...20 changes in 20 seconds (3,600 an hour) are.
    at = _changes(feed, at, 20, 1)
    window = _run(db, store, client, "burst", overlap_seconds=0)
    assert window.held and window.report.held_for_review == 20
    assert window.report.published == 0
    assert window.volume is not None and window.volume.metadata["trailing_median_rate"] == 6
    assert "beyond 3x" in window.volume.description
    # Held is processed: the watermark moved, and a person's approval publishes them.
    assert window.watermark_after is not None
    assert window.watermark_after.updated_at == T0 + timedelta(seconds=at)
    approve_reviews(
        db, review_ids=None, who="ops", reason="a real bulk update", batch_id=window.batch.batch_id
    )
    assert len(_published(db)) == 46


def test_short_quiet_polls_do_not_drag_down_the_baseline_of_a_normal_day(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed
):
    # The case at the defaults (5x, 100 changes): a day of 248 changes, two quiet
    # polls minutes later, a day of 256 changes. By count, the median of (248, 0, 0) is 0
    # and 253 diffs were held; by rate the day sets the baseline.
    _volume_thresholds(db)
    _start_at(db, 0)
    day = 86_400.0
    at = _changes(feed, 0.0, 248, day / 248)
    first = _run(db, store, client, "day1", limit=1000)
    assert first.report.published == 248
    for i in range(2):
        quiet = _run(db, store, client, f"quiet{i}", limit=1000)
        assert quiet.report.published == 0 and not quiet.held
    at = _changes(feed, at, 256, day / 256)
    normal = _run(db, store, client, "day2", limit=1000)
    assert normal.volume is not None and normal.volume.passed, normal.volume
    assert not normal.held and normal.report.published == 256
    assert normal.volume.metadata["windows_in_baseline"] == 3
    # A real spike after them is still held: a day's changes within an hour.
    _changes(feed, at, 300, 10)
    spike = _run(db, store, client, "spike", limit=1000)
    assert spike.held and spike.report.held_for_review == 300


def test_a_bad_record_becomes_a_dead_letter_and_the_rest_publishes(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed
):
    _start_at(db, 0)
    feed.change(hotel(1, at=10))
    feed.change(hotel(2, at=20, geo={"lat": 200.0, "lng": 100.0}))
    feed.change(hotel(3, at=30))
    window = _run(db, store, client, "w1")
    r = window.report
    assert (r.records, r.published, r.dead_letters) == (3, 2, 1)
    assert dict(r.dead_letters_by_code) == {"LAT_OUT_OF_RANGE": 1}
    # A dead letter is processed too: the watermark passes it.
    assert window.watermark_after == Watermark(T0 + timedelta(seconds=30), "H000003")


@pytest.mark.parametrize("processes", [0, 2], ids=["in-process", "forked"])
def test_pages_judged_in_forked_processes_end_as_in_this_one(
    db: SyncDatabase,
    store: LocalPayloadStore,
    client: SupplierClient,
    feed: Feed,
    monkeypatch: pytest.MonkeyPatch,
    processes: int,
):
    # Pages of 3 over 2 processes, and bad records of every kind: each ends in the same
    # place, at the same position of the same raw page, as when this process judges them.
    if not processes:  # a one-CPU machine: the window's own process judges its pages
        monkeypatch.setattr(incremental, "usable_cpus", lambda: 1)
    submitted: list[int] = []
    real = stages.Normalizer._submit

    def counted(self: Any, raw: Any, records: list[Any], *rest: Any) -> None:
        submitted.append(len(records))
        real(self, raw, records, *rest)

    monkeypatch.setattr(stages.Normalizer, "_submit", counted)
    _start_at(db, 0)
    for n in range(1, 21):
        extra: dict[str, Any] = {}
        if n == 4:
            extra = {"geo": {"lat": 200.0, "lng": 100.0}}
        elif n == 8:
            extra = {"name": None}
        elif n == 11:
            extra = {"star_rating": 4.3}
        feed.change(hotel(n, at=n, **extra))
    window = run_incremental(
        db,
        store,
        client,
        settings=replace(SETTINGS, chunk_hotels=4, normalize_processes=processes),
        incremental=IncrementalSettings(task_code=TASK, full_task_code="full_task", limit=3),
        trigger_id="w1",
        source="MANUAL",
        worker_id="worker-w1",
    )
    assert submitted == ([3, 3, 3, 3, 3, 3, 2] if processes else [])
    r = window.report
    assert r.status == "SUCCESS"
    assert (r.records, r.published, r.dead_letters) == (20, 17, 3)
    assert _published(db) == {f"H{n:06d}": 1 for n in range(1, 21) if n not in (4, 8, 11)}
    d = schema.dead_letter.c
    s = schema.snapshot.c
    with db.engine.connect() as conn:
        letters = conn.execute(
            sa.select(d.supplier_resource_code, d.error_code, d.record_position, s.page_number)
            .join_from(schema.dead_letter, schema.snapshot, s.payload_hash == d.raw_payload_hash)
            .where(s.snapshot_type == "RAW")
            .order_by(d.supplier_resource_code)
        ).all()
        normalized = conn.execute(
            sa.select(sa.func.count(), sa.func.sum(s.record_count)).where(
                s.snapshot_type == "NORMALIZED"
            )
        ).one()
    # H000004 is the first record of the second page, H000008 the second of the third, ...
    assert [tuple(row) for row in letters] == [
        ("H000004", "LAT_OUT_OF_RANGE", "record#0", 2),
        ("H000008", "MISSING_REQUIRED_FIELD", "record#1", 3),
        ("H000011", "STAR_RATING_OUT_OF_RANGE", "record#1", 4),
    ]
    assert tuple(normalized) == (7, 17)


def _judge_then_die_on_page_3(raw: Any, records: list[Any], *rest: Any) -> Any:
    """A forked judge that is killed (SIGKILL: no clean-up) when it is given page 3."""
    if raw.page_number == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return _REAL_JUDGE_PAGE(raw, records, *rest)


def test_a_forked_judge_killed_mid_window_loses_nothing_and_the_next_window_finishes_it(
    db: SyncDatabase,
    store: LocalPayloadStore,
    client: SupplierClient,
    feed: Feed,
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(incremental, "usable_cpus", lambda: 2)  # forked judges, any machine
    monkeypatch.setattr(stages, "_judge_page", _judge_then_die_on_page_3)
    settings = replace(SETTINGS, chunk_hotels=4)
    _start_at(db, 0)
    for n in range(1, 21):
        feed.change(hotel(n, at=n))

    def window(trigger: str) -> Any:
        return run_incremental(
            db,
            store,
            client,
            settings=settings,
            incremental=IncrementalSettings(task_code=TASK, full_task_code="full_task", limit=3),
            trigger_id=trigger,
            source="MANUAL",
            worker_id=f"worker-{trigger}",
        )

    # The window's own process survives the judge: it fails the window, with the cause on
    # its shard, and moves nothing.
    with pytest.raises(BrokenProcessPool):
        window("w1")
    k = schema.shard.c
    with db.engine.connect() as conn:
        assert get_watermark(conn, TASK) == Watermark(T0)  # not ahead of the catalog
        ((status, error),) = conn.execute(sa.select(k.status, k.error_message)).all()
    # A dead judge is not the supplier's failure: INTERNAL_ERROR, then what happened.
    assert status == "FAILED" and error.startswith("INTERNAL_ERROR: BrokenProcessPool: "), error
    assert _published(db) == {}  # page 3 never came back: its chunk was not published
    # The next window starts from the watermark at once (no lease to wait for) and
    # publishes every change once; what the failed one stored stays as evidence.
    monkeypatch.setattr(stages, "_judge_page", _REAL_JUDGE_PAGE)
    second = window("w2")
    assert second.report.status == "SUCCESS", second.report
    assert _published(db) == {f"H{n:06d}": 1 for n in range(1, 21)}
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        assert set(conn.execute(sa.select(h.publish_version)).scalars()) == {1}
        assert get_watermark(conn, TASK) == Watermark(T0 + timedelta(seconds=20), "H000020")


def test_without_a_watermark_or_a_full_sync_there_is_nothing_to_start_from(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient
):
    with pytest.raises(NoBaseline, match="sync --full"):
        _run(db, store, client, "w1")


def test_a_second_window_of_the_task_is_refused_while_one_runs(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed
):
    _start_at(db, 0)
    for n in range(1, 8):
        feed.change(hotel(n, at=n * 10))
    feed.fail_after = 1
    with pytest.raises(KeyboardInterrupt):
        _run(db, store, client, "w1")
    feed.fail_after = None
    # The first worker's grace has not passed: its window counts as running.
    with pytest.raises(TriggerSkipped):
        _run(db, store, client, "w2")


def test_the_watermark_never_moves_back():
    db = SyncDatabase.open("sqlite://")
    try:
        late, early = Watermark(T0 + timedelta(seconds=60), "H2"), Watermark(T0, "H9")
        with db.begin() as conn:
            assert advance_watermark(
                conn, db.clock, task_code=TASK, supplier_id=1, to=late, batch_id="b1", **SKEW
            )
            assert not advance_watermark(
                conn, db.clock, task_code=TASK, supplier_id=1, to=early, batch_id="b2", **SKEW
            )
            assert not advance_watermark(
                conn, db.clock, task_code=TASK, supplier_id=1, to=late, batch_id="b3", **SKEW
            )
            assert get_watermark(conn, TASK) == late
    finally:
        db.dispose()


def test_a_feed_position_survives_the_checkpoint_column():
    pos = FeedPosition(
        start=T0,
        since=T0 + timedelta(seconds=5),
        after_id="H1",
        high=Watermark(T0 + timedelta(seconds=5, microseconds=250), "H1"),
        origin=Watermark(T0),
    )
    assert FeedPosition.from_cursor(pos.to_cursor()) == pos
    assert json.loads(pos.to_cursor())["since"] == "2026-11-20T10:00:05Z"


def _forked(**kw: Any) -> SyncSettings:
    """Chunks of 5 published by 2 forked processes (the last chunk by the window's own)."""
    return replace(SETTINGS, publish_chunk_hotels=5, publish_processes=2, **kw)


def _run_forked(db, store, client, trigger: str):
    return run_incremental(
        db,
        store,
        client,
        settings=_forked(),
        incremental=IncrementalSettings(task_code=TASK, full_task_code="full_task", limit=10),
        trigger_id=trigger,
        source="MANUAL",
        worker_id=f"worker-{trigger}",
    )


def test_a_window_publishes_its_chunks_in_forked_processes_and_counts_each_once(
    db: SyncDatabase,
    store: LocalPayloadStore,
    client: SupplierClient,
    feed: Feed,
    monkeypatch: pytest.MonkeyPatch,
):
    forked: list[int] = []
    real = stages._publish_in_processes

    def counted(publisher: Any, parts: Any, *args: Any) -> None:
        forked.append(len(parts))
        real(publisher, parts, *args)

    monkeypatch.setattr(stages, "_publish_in_processes", counted)
    _start_at(db, 0)
    for n in range(1, 43):
        feed.change(hotel(n, at=n))
    first = _run_forked(db, store, client, "f1")
    r = first.report
    assert r.status == "SUCCESS" and (r.records, r.published, r.skipped) == (42, 42, 0)
    assert r.diffs_by_type == {"NEW": 42} and r.diffs_by_action == {"AUTO_PUBLISH": 42}
    assert _published(db) == {f"H{n:06d}": 1 for n in range(1, 43)}
    assert first.watermark_after == Watermark(T0 + timedelta(seconds=42), "H000042")
    assert first.batch.status == "SUCCESS" and first.cities == {"BKK": 21, "CNX": 21}
    assert forked == [8]  # 9 chunks of 5: 8 in the processes, the last one here
    o = schema.outbox.c
    with db.engine.connect() as conn:
        events: dict[str, int] = {
            str(t): int(n)
            for t, n in conn.execute(
                sa.select(o.event_type, sa.func.count()).group_by(o.event_type)
            ).all()
        }
    assert events["HotelResourceUpdated"] == 42
    # A second window: half the hotels changed, the overlap re-reads the rest as no-ops.
    for n in range(1, 43, 2):
        feed.change(hotel(n, at=100 + n, version=2))
    second = run_incremental(
        db,
        store,
        client,
        settings=_forked(),
        incremental=IncrementalSettings(
            task_code=TASK, full_task_code="full_task", limit=10, overlap_seconds=1000
        ),
        trigger_id="f2",
        source="MANUAL",
        worker_id="worker-f2",
    )
    r = second.report
    assert (r.records, r.published, r.skipped) == (42, 21, 21)
    assert r.published + r.dead_letters + r.skipped == r.records
    assert _published(db) == {f"H{n:06d}": 2 if n % 2 else 1 for n in range(1, 43)}


def test_a_window_publishes_its_changes_in_the_catalogs_order_not_the_feeds(
    db: SyncDatabase,
    store: LocalPayloadStore,
    client: SupplierClient,
    feed: Feed,
    monkeypatch: pytest.MonkeyPatch,
):
    """The feed lists changes by time, all over the catalog; the forked processes get
    chunks of neighbouring hotels (ascending resource ids), and the window is the same."""
    seen: list[list[str]] = []
    real = stages._publish_in_processes

    def spied(publisher: Any, parts: Any, *args: Any) -> None:
        seen.extend([c.supplier_hotel_id for c in part] for part in parts)
        real(publisher, parts, *args)

    monkeypatch.setattr(stages, "_publish_in_processes", spied)
    _start_at(db, 0)
    for n in range(1, 43):
        # Hotel 42 changed first, hotel 1 last.
        feed.change(hotel(n, at=43 - n))
    window = _run_forked(db, store, client, "o1")
    assert window.report.status == "SUCCESS" and window.report.published == 42
    assert _published(db) == {f"H{n:06d}": 1 for n in range(1, 43)}
    assert window.watermark_after == Watermark(T0 + timedelta(seconds=42), "H000001")
    m = schema.hotel_mapping.c
    with db.engine.connect() as conn:
        rid = {str(h): int(i) for h, i in conn.execute(sa.select(m.supplier_hotel_id, m.id))}
    order = [rid[h] for part in seen for h in part]
    assert len(seen) == 8 and len(order) > 30
    assert order == sorted(order)


def test_forked_publishers_use_the_mappings_their_parent_made_without_reading_them(
    db: SyncDatabase,
    store: LocalPayloadStore,
    client: SupplierClient,
    feed: Feed,
    tmp_path: Path,
):
    """The window's own process makes every mapping before forking; the processes publish
    with those ids and never query the mapping table (a round trip per chunk on MariaDB)."""
    log = tmp_path / "mapping_reads"
    parent = os.getpid()

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # Forked processes inherit this listener; a file is what they share with the test.
        if statement.lstrip().upper().startswith("SELECT") and "hotel_mapping" in statement:
            with log.open("a") as out:
                out.write(f"{os.getpid()}\n")

    _start_at(db, 0)
    for n in range(1, 43):
        feed.change(hotel(n, at=n))
    sa.event.listen(db.engine, "before_cursor_execute", record)
    try:
        window = _run_forked(db, store, client, "m1")
    finally:
        sa.event.remove(db.engine, "before_cursor_execute", record)
    assert window.report.status == "SUCCESS" and window.report.published == 42
    assert _published(db) == {f"H{n:06d}": 1 for n in range(1, 43)}
    readers = set(log.read_text().split())
    assert readers == {str(parent)}


def test_a_lease_lost_while_forked_processes_publish_stops_the_window(
    db: SyncDatabase,
    store: LocalPayloadStore,
    client: SupplierClient,
    feed: Feed,
    monkeypatch: pytest.MonkeyPatch,
):
    """Another worker takes the window's shard as the forked publishers start: their fenced
    writes fail, the window stops as LEASE_LOST and its watermark stays where it was."""
    start = stages._start_forked_publisher

    def stolen(publisher: Any, parts: Any) -> None:
        start(publisher, parts)
        lease = publisher.lease
        with lease.db.begin() as conn:
            conn.execute(
                sa.update(schema.shard)
                .where(schema.shard.c.id == lease.shard_id)
                .values(worker_id="thief", lease_token="stolen")
            )

    monkeypatch.setattr(stages, "_start_forked_publisher", stolen)
    _start_at(db, 0)
    for n in range(1, 43):
        feed.change(hotel(n, at=n))
    window = _run_forked(db, store, client, "f1")
    assert window.report.status == "LEASE_LOST"
    assert window.watermark_after == Watermark(T0)
    assert len(_published(db)) < 42
    (shard,) = list_shards(db, window.batch.batch_id)
    assert shard.status == "RUNNING" and shard.worker_id == "thief"


# -- a supplier clock ahead of ours ------------------------------------------------------------

FAR_AHEAD = "2099-01-01T00:00:00Z"


def _rfc3339(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _db_now(db: SyncDatabase) -> datetime:
    with db.engine.connect() as conn:
        return db.clock.read_utc(conn)


def _letters(db: SyncDatabase, batch_id: str) -> list[tuple[str, str, str, str]]:
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        return [
            (str(r.supplier_resource_code), str(r.error_code), str(r.error_stage), str(r.status))
            for r in conn.execute(
                sa.select(d.supplier_resource_code, d.error_code, d.error_stage, d.status)
                .where(d.batch_id == batch_id)
                .order_by(d.supplier_resource_code)
            )
        ]


def test_a_change_dated_far_ahead_is_a_dead_letter_and_the_next_window_gets_the_next_change(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed
):
    _start_at(db, 0)
    feed.change(hotel(1, at=10))
    feed.change(hotel(2, at=20))
    feed.change(hotel(3, at=30, updated_at=FAR_AHEAD))
    feed.change(hotel(4, at=40))
    first = _run(db, store, client, "w1")
    r = first.report
    assert r.status == "SUCCESS"
    assert (r.records, r.published, r.dead_letters) == (4, 3, 1)
    assert dict(r.dead_letters_by_code) == {"FUTURE_TIMESTAMP": 1}
    # A supplier-data problem for a person: never retried on its own.
    assert _letters(db, first.batch.batch_id) == [
        ("H000003", "FUTURE_TIMESTAMP", "VALIDATION", "MANUAL_FIX")
    ]
    assert _published(db) == {"H000001": 1, "H000002": 1, "H000004": 1}
    # The window ends at its last change it could publish, not at 2099.
    assert first.watermark_after == Watermark(T0 + timedelta(seconds=40), "H000004")
    skew = timedelta(seconds=SETTINGS.max_clock_skew_seconds)
    assert first.watermark_after.updated_at <= _db_now(db) + skew
    # The supplier moves on: the next window asks from before that change, not from 2098,
    # and publishes the real next one (the record of 2099, read again, is filed again).
    feed.change(hotel(5, at=50))
    second = _run(db, store, client, "w2")
    assert second.report.status == "SUCCESS" and second.report.published == 1
    assert dict(second.report.dead_letters_by_code) == {"FUTURE_TIMESTAMP": 1}
    assert _published(db)["H000005"] == 1 and "H000003" not in _published(db)
    assert second.watermark_after == Watermark(T0 + timedelta(seconds=50), "H000005")


@pytest.mark.parametrize("skew", [SETTINGS.max_clock_skew_seconds, 600.0])
def test_a_change_inside_the_skew_publishes_and_one_beyond_it_is_a_dead_letter(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed, skew: float
):
    _start_at(db, 0)
    # The database's clock decides (a test margin of 2 minutes either side of the skew).
    now = _db_now(db)
    inside = now + timedelta(seconds=skew - 120)
    beyond = now + timedelta(seconds=skew + 120)
    feed.change(hotel(1, at=10))
    feed.change(hotel(2, at=0, updated_at=_rfc3339(inside)))
    feed.change(hotel(3, at=0, updated_at=_rfc3339(beyond)))
    window = run_incremental(
        db,
        store,
        client,
        settings=replace(SETTINGS, max_clock_skew_seconds=skew),
        incremental=IncrementalSettings(task_code=TASK, full_task_code="full_task", limit=3),
        trigger_id="w1",
        source="MANUAL",
        worker_id="worker-w1",
    )
    assert window.report.status == "SUCCESS"
    assert _published(db) == {"H000001": 1, "H000002": 1}
    assert [(h, code) for h, code, _, _ in _letters(db, window.batch.batch_id)] == [
        ("H000003", "FUTURE_TIMESTAMP")
    ]
    assert window.watermark_after == Watermark(inside.replace(microsecond=0), "H000002")


def test_the_watermark_never_passes_the_database_clock_plus_the_skew(db: SyncDatabase):
    far = Watermark(datetime(2099, 1, 1, tzinfo=UTC), "H1")

    def advance_to_far(batch_id: str) -> tuple[datetime, Watermark | None]:
        with db.begin() as conn:
            assert advance_watermark(
                conn,
                db.clock,
                task_code=TASK,
                supplier_id=1,
                to=far,
                batch_id=batch_id,
                max_clock_skew_seconds=600,
            )
            return db.clock.read_utc(conn), get_watermark(conn, TASK)

    now, mark = advance_to_far("b1")
    assert mark is not None
    assert now + timedelta(seconds=590) <= mark.updated_at <= now + timedelta(seconds=600)
    # The database's clock, not this machine's: a day later there, a day further.
    db.clock.advance(86_400)
    _, later = advance_to_far("b2")
    assert later is not None
    assert mark.updated_at + timedelta(seconds=86_000) <= later.updated_at < far.updated_at


def test_a_window_handed_a_change_far_ahead_still_stops_the_watermark_at_the_skew(
    db: SyncDatabase,
    store: LocalPayloadStore,
    client: SupplierClient,
    feed: Feed,
    monkeypatch: pytest.MonkeyPatch,
):
    # Defence in depth: were the window to count the change of 2099 where it ends (its own
    # check switched off here), the watermark still stops at the database clock plus skew.
    far = datetime(2099, 1, 1, tzinfo=UTC)
    monkeypatch.setattr(incremental.ChangeWindow, "latest_time", lambda self: far)
    _start_at(db, 0)
    feed.change(hotel(1, at=10))
    feed.change(hotel(2, at=20, updated_at=FAR_AHEAD))
    window = _run(db, store, client, "w1")
    assert window.report.status == "SUCCESS"
    assert dict(window.report.dead_letters_by_code) == {"FUTURE_TIMESTAMP": 1}
    assert window.watermark_after is not None
    skew = timedelta(seconds=SETTINGS.max_clock_skew_seconds)
    assert window.watermark_after.updated_at <= _db_now(db) + skew


def test_a_window_stops_at_the_first_page_that_reaches_past_the_clock_plus_the_skew(
    db: SyncDatabase, store: LocalPayloadStore, client: SupplierClient, feed: Feed
):
    # A supplier dating a whole backlog ahead: each window reads one page of it, not all.
    _start_at(db, 0)
    feed.change(hotel(1, at=10))
    for n in range(2, 12):
        feed.change(hotel(n, at=0, updated_at=FAR_AHEAD))
    for trigger in ("w1", "w2"):
        before = feed.requests
        window = _run(db, store, client, trigger)  # pages of 3
        assert window.report.status == "SUCCESS"
        assert feed.requests - before == 1
        assert dict(window.report.dead_letters_by_code) == {"FUTURE_TIMESTAMP": 2}
        assert window.watermark_after == Watermark(T0 + timedelta(seconds=10), "H000001")
    assert _published(db) == {"H000001": 1}
