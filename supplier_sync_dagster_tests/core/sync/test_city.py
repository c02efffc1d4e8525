"""A city's sync end to end: the simulator over real HTTP, SQLite and MariaDB, ground truth."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import (
    TaskSpec,
    create_batch,
    get_batch,
    upsert_task,
)
from supplier_sync_dagster.core.leasing.leases import (
    LeaseSettings,
    claim_shard,
    get_shard,
    list_shards,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import DbClock, SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore, PayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync import city as city_module
from supplier_sync_dagster.core.sync.city import sync_city
from supplier_sync_dagster.core.sync.model import CityReport, SyncSettings
from supplier_sync_dagster.core.sync.stages import Normalizer
from supplier_sync_dagster.simulator import FaultProfile, Simulator, running_server
from supplier_sync_dagster_tests.core.conftest import run_concurrently
from supplier_sync_dagster_tests.helpers import (
    SIM_API_KEY,
    make_simulator,
    serve_simulator,
    supplier_client,
)

SUPPLIER = 1001


def settings(task_code: str = "hotel_full", **kw: Any) -> SyncSettings:
    return SyncSettings(
        task_code=task_code,
        supplier_id=SUPPLIER,
        page_size=kw.pop("page_size", 50),
        lease=LeaseSettings(lease_seconds=60, heartbeat_seconds=1),
        **kw,
    )


def full_sync(
    db: SyncDatabase,
    store: PayloadStore,
    client: SupplierClient,
    trigger: str,
    *,
    task: str = "hotel_full",
    scope: str = "RESOURCE",
    worker: str = "w1",
    **kw: Any,
) -> tuple[str, list[CityReport]]:
    upsert_task(
        db,
        TaskSpec(
            task_code=task,
            supplier_id=SUPPLIER,
            concurrency_policy="ALLOW_PARALLEL",
            data_scope=scope,  # type: ignore[arg-type]
        ),
    )
    cities = [c.city_code for c in client.list_cities().data.cities]
    decision = create_batch(
        db, task_code=task, trigger_id=trigger, trigger_source="MANUAL", shard_keys=cities
    )
    assert decision.batch is not None, decision
    reports = [
        sync_city(
            db,
            store,
            client,
            batch=decision.batch,
            city_code=city,
            worker_id=worker,
            settings=settings(task_code=task, **kw),
        )
        for city in cities
    ]
    return decision.batch.batch_id, reports


def published(db: SyncDatabase) -> dict[str, int]:
    with db.engine.connect() as conn:
        h = schema.platform_hotel.c
        return dict(conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version)).all())


def dead_letters(db: SyncDatabase, batch_id: str) -> dict[str, str]:
    with db.engine.connect() as conn:
        d = schema.dead_letter.c
        return dict(
            conn.execute(
                sa.select(d.supplier_resource_code, d.error_code).where(d.batch_id == batch_id)
            ).all()
        )


@pytest.fixture
def flaky_sim() -> Iterator[tuple[Simulator, str]]:
    # Slow responses would only slow the test down; every other fault stays on.
    faults = FaultProfile.flaky().with_(rate_slow=0.0, bad_record_rate=0.03)
    with serve_simulator(faults, seed=7, n_cities=10, total_hotels=1500) as served:
        yield served


def test_flaky_full_sync_matches_ground_truth_then_next_day_publishes_changes(
    db: SyncDatabase, tmp_path: Path, flaky_sim: tuple[Simulator, str]
):
    sim, url = flaky_sim
    store = LocalPayloadStore(tmp_path / "payloads")
    truth = sim.ground_truth()
    with httpx.Client(base_url=url) as http:
        client = supplier_client(http)
        batch_id, reports = full_sync(db, store, client, "day-0")
        assert client.stats().retries > 0  # the faults happened and were absorbed

    assert all(r.status == "SUCCESS" for r in reports), [
        (r.city_code, r.status, r.error) for r in reports
    ]
    assert published(db) == truth.valid
    letters = dead_letters(db, batch_id)
    assert set(letters) == set(truth.bad)
    assert not set(letters) & set(published(db))
    assert "MISSING_REQUIRED_FIELD" in letters.values()
    with db.engine.connect() as conn:
        batch = get_batch(conn, batch_id)
    assert batch.status == "SUCCESS"
    assert batch.total_count == batch.success_count + batch.failed_count + batch.skipped_count
    # A bad hotel listed on two pages is two bad records: one dead letter each.
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(sa.func.count())
            .select_from(schema.dead_letter)
            .where(schema.dead_letter.c.batch_id == batch_id)
        ).scalar_one()
    assert batch.failed_count == rows >= len(truth.bad)
    assert batch.success_count == len(truth.valid)
    for shard in list_shards(db, batch_id):
        assert shard.total_count == shard.success_count + shard.failed_count + shard.skipped_count

    # Every published hotel traces back to stored supplier bytes that contain it.
    with db.engine.connect() as conn:
        ref, hid = conn.execute(
            sa.select(
                schema.platform_hotel.c.raw_payload_ref, schema.platform_hotel.c.supplier_hotel_id
            ).limit(1)
        ).one()
    assert hid.encode() in store.get(ref)

    sim.advance_day()
    before = published(db)
    after_truth = sim.ground_truth()
    with httpx.Client(base_url=url) as http:
        batch2, reports2 = full_sync(db, store, supplier_client(http), "day-1")
    now = published(db)
    for hid, version in after_truth.valid.items():
        assert now[hid] == version
    changed = {h for h, v in after_truth.valid.items() if before.get(h) != v}
    with db.engine.connect() as conn:
        d = schema.diff_log.c
        diffs = dict(
            conn.execute(
                sa.select(d.supplier_resource_code, d.diff_type).where(d.batch_id == batch2)
            ).all()
        )
        actions = dict(
            conn.execute(
                sa.select(d.supplier_resource_code, d.action).where(d.batch_id == batch2)
            ).all()
        )
    published_now = {h for h, a in actions.items() if a == "AUTO_PUBLISH"}
    assert changed and published_now == changed
    assert {h for h, ty in diffs.items() if ty == "NEW"} == {h for h in changed if h not in before}
    assert {ty for h, ty in diffs.items() if h not in changed} <= {"NO_CHANGE", "STALE"}
    assert sum(r.published for r in reports2) == len(changed)


@pytest.mark.parametrize("same_batch", [True, False], ids=["one-batch-two-workers", "two-tasks"])
def test_two_syncs_at_once_publish_each_hotel_once(
    db: SyncDatabase, tmp_path: Path, same_batch: bool
):
    sim = make_simulator(seed=3, n_cities=6, total_hotels=600)
    store = LocalPayloadStore(tmp_path / "payloads")

    def run(i: int) -> list[CityReport]:
        # One batch raced by two workers (the shard leases decide), or two tasks whose
        # scopes the policy lets run in parallel (only the publish guard stands between them).
        with httpx.Client(base_url="http://sim", transport=sim.transport()) as http:
            client = supplier_client(http)
            if same_batch:
                return full_sync(db, store, client, "shared", worker=f"w{i}")[1]
            return full_sync(
                db,
                store,
                client,
                f"task-{i}",
                task=f"task_{i}",
                scope=("RESOURCE", "PRODUCT")[i],
                worker=f"w{i}",
            )[1]

    results, errors = run_concurrently(2, run)
    assert not errors, errors
    truth = sim.ground_truth()
    assert published(db) == truth.valid
    with db.engine.connect() as conn:
        h, o = schema.platform_hotel.c, schema.outbox.c
        assert set(conn.execute(sa.select(h.publish_version).distinct()).scalars()) == {1}
        events = conn.execute(
            sa.select(sa.func.count())
            .select_from(schema.outbox)
            .where(o.event_type == "HotelResourceUpdated")
        ).scalar_one()
        mappings = conn.execute(
            sa.select(sa.func.count()).select_from(schema.hotel_mapping)
        ).scalar_one()
    assert events == len(truth.valid) and mappings == len(truth.valid)
    assert sum(r.published for rs in results for r in rs) == len(truth.valid)
    if same_batch:  # every city was worked by exactly one of the two workers
        worked = [r.city_code for rs in results for r in rs if r.status == "SUCCESS"]
        assert sorted(worked) == sorted(set(worked)) and len(worked) == len(truth.listed_by_city)


def test_a_city_publishes_in_transactions_of_publish_chunk_hotels(db: SyncDatabase, tmp_path: Path):
    """Each publish transaction stamps its hotels and events with its one database time, so
    the times' groups are the transactions: none holds more than ``publish_chunk_hotels``."""
    sim = make_simulator(seed=5, n_cities=1, total_hotels=230, empty_city_share=0.0)
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=sim.transport()) as http:
        _, (report,) = full_sync(db, store, supplier_client(http), "t1", publish_chunk_hotels=60)
    assert report.status == "SUCCESS" and report.published == len(sim.ground_truth().valid)
    with db.engine.connect() as conn:
        h, o = schema.platform_hotel.c, schema.outbox.c
        hotels = Counter(conn.execute(sa.select(h.published_at)).scalars())
        events = Counter(
            conn.execute(
                sa.select(o.created_at).where(o.event_type == "HotelResourceUpdated")
            ).scalars()
        )
    assert len(hotels) == math.ceil(report.published / 60) and max(hotels.values()) <= 60
    assert events == hotels


def test_replay_from_stored_raw_pages_never_calls_the_supplier(db: SyncDatabase, tmp_path: Path):
    sim = make_simulator(seed=5, n_cities=4, total_hotels=300)
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=sim.transport()) as http:
        batch_id, _ = full_sync(db, store, supplier_client(http), "first")
    served = sim.stats["requests_total"]
    with db.begin() as conn:  # forget what was published: replay must rebuild it
        for table in (schema.platform_offer, schema.platform_hotel, schema.outbox):
            conn.execute(sa.delete(table))
        conn.execute(
            sa.update(schema.shard)
            .where(schema.shard.c.batch_id == batch_id)
            .values(status="FAILED")
        )
    with db.engine.connect() as conn:
        batch = get_batch(conn, batch_id)
    for shard in list_shards(db, batch_id):
        report = sync_city(
            db,
            store,
            None,
            batch=batch,
            city_code=shard.shard_key,
            worker_id="replayer",
            settings=settings(),
            fetch=False,
        )
        assert report.status == "SUCCESS"
    assert sim.stats["requests_total"] == served
    assert published(db) == sim.ground_truth().valid


def _expected_page_requests(sim: Simulator, page_size: int) -> int:
    truth = sim.ground_truth()
    return sum(max(1, math.ceil(len(ids) / page_size)) for ids in truth.listed_by_city.values())


@pytest.mark.timeout(600)
def test_sigkill_mid_run_then_rerun_reaches_the_same_end_state(db_url: str, tmp_path: Path):
    sim = make_simulator(seed=11, n_cities=12, total_hotels=3000)
    page_size = 25
    env = dict(
        os.environ,
        SUPPLIER_SYNC_HOME=str(tmp_path / "home"),
        DAGSTER_HOME=str(tmp_path / "dagster_home"),
        SUPPLIER_SYNC_DB_URL=db_url,
        SUPPLIER_SYNC_SUPPLIER_API_KEY=SIM_API_KEY,
    )
    env.pop("SUPPLIER_SYNC_PAYLOAD_URL", None)
    (tmp_path / "dagster_home").mkdir()
    cli = str(Path(sys.executable).parent / "supplier-sync")
    trigger = f"kill-{uuid.uuid4().hex[:8]}"
    db = SyncDatabase.open(db_url)
    with running_server(sim) as url:
        env["SUPPLIER_SYNC_SUPPLIER_URL"] = url
        cmd = [
            cli,
            "sync",
            "--full",
            "--json",
            "--trigger-id",
            trigger,
            "--page-size",
            str(page_size),
            "--rate-limit",
            "200",
        ]
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 240
        sh = schema.shard.c
        while True:  # kill in the middle of a city: a shard with pages behind and ahead
            with db.engine.connect() as conn:
                mid_city = conn.execute(
                    sa.select(sa.func.count())
                    .select_from(schema.shard)
                    .where(
                        sh.status == "RUNNING",
                        sh.pages_done >= 2,
                        sh.total_pages >= sh.pages_done + 3,
                    )
                ).scalar_one()
            if mid_city:
                break
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else b""
            assert time.monotonic() < deadline, "the sync made no progress"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        with db.engine.connect() as conn:
            running = conn.execute(
                sa.select(sa.func.count())
                .select_from(schema.shard)
                .where(schema.shard.c.status == "RUNNING")
            ).scalar_one()
        # Normally 1 (killed mid-city, its lease still live); the bound below uses the count.

        again = subprocess.run(
            cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400
        )
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        served = sim.stats["requests_by_endpoint"].get("hotels", 0)
    truth = sim.ground_truth()
    assert published(db) == truth.valid
    assert served - _expected_page_requests(sim, page_size) <= running
    with db.engine.connect() as conn:
        batches = conn.execute(
            sa.select(schema.batch).where(schema.batch.c.trigger_id == trigger)
        ).all()
    assert len(batches) == 1 and batches[0].status == "SUCCESS"  # the re-run continued it
    b = batches[0]
    assert b.total_count == b.success_count + b.failed_count + b.skipped_count
    db.dispose()


def test_helpers_take_the_largest_pending_city_first(db: SyncDatabase):
    """A helper starts the biggest city that no run has started, so the batch ends small."""
    from supplier_sync_dagster.core.sync.city import help_other_workers

    upsert_task(db, TaskSpec(task_code="help", supplier_id=1, concurrency_policy="ALLOW_PARALLEL"))
    cities = ["own", "s1", "big", "s2", "mid", "started"]
    batch = create_batch(
        db, task_code="help", trigger_id="h", trigger_source="BACKFILL", shard_keys=cities
    ).batch
    assert batch is not None
    sh = schema.shard.c
    with db.begin() as conn:
        conn.execute(
            sa.update(schema.shard)
            .where(sh.batch_id == batch.batch_id, sh.shard_key == "started")
            .values(status="RUNNING")
        )
    order: list[str] = []

    def sync_one(city: str) -> CityReport:
        order.append(city)
        with db.begin() as conn:
            conn.execute(
                sa.update(schema.shard)
                .where(sh.batch_id == batch.batch_id, sh.shard_key == city)
                .values(status="SUCCESS")
            )
        return CityReport(city)

    sizes = {"own": 900, "s1": 10, "big": 500, "s2": 20, "mid": 100, "started": 1000}
    help_other_workers(
        db, batch.batch_id, skip={"own"}, sync_one=sync_one, threads=1, hotel_counts=sizes
    )
    assert order == ["big", "mid", "s2", "s1"]


def test_cities_are_synced_largest_first_unknown_sizes_last():
    from supplier_sync_dagster.core.sync.city import largest_first

    order = largest_first(["a", "b", "c", "d", "e"], {"a": 5, "b": 50, "d": 50, "e": 0})
    assert order == ["b", "d", "a", "e", "c"]


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_each_stage_s_cpu_is_counted_on_the_thread_that_does_its_work(
    db: SyncDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The walk's requests run on other threads than the city's, which normalizes each page
    as it arrives: the walk's CPU is the fetch's, a page's normalization is not, and a wait
    is no CPU."""
    walk_threads: set[int] = set()
    real_walk, real_add = city_module.walk, Normalizer.add

    def slow_walk(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for page in real_walk(*args, **kwargs):
            walk_threads.add(threading.get_ident())
            _burn(0.2)
            time.sleep(0.2)
            yield page

    def slow_add(self: Normalizer, *args: Any) -> None:
        _burn(0.3)
        real_add(self, *args)

    monkeypatch.setattr(city_module, "walk", slow_walk)
    monkeypatch.setattr(Normalizer, "add", slow_add)
    sim = make_simulator(seed=5, n_cities=1, total_hotels=150, empty_city_share=0.0)
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=sim.transport()) as http:
        _, (report,) = full_sync(db, store, supplier_client(http), "t1")
    assert report.status == "SUCCESS" and walk_threads and threading.get_ident() not in walk_threads
    pages, cpu = report.pages_fetched, report.cpu_seconds
    assert pages >= 3
    assert 0.2 * pages <= cpu["fetch"] < 0.2 * pages + 0.25 * pages
    assert cpu["normalize"] >= 0.3 * pages
    assert 0 < cpu["publish"] < report.seconds["publish"] + 0.05


def test_a_deadlock_victim_publish_runs_again_and_counts_once(
    db: SyncDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """InnoDB rolls a deadlock's victim back whole: the city's chunk and its finish (the
    miss counts of tombstones, taken in the last chunk's transaction) run again, and the
    counts of the rolled-back attempt are not kept (they must still add up)."""
    from supplier_sync_dagster.core.sync import city

    deadlock = sa.exc.OperationalError(
        "UPDATE platform_hotel_resource ...", {}, Exception(1213, "Deadlock found")
    )
    real = city.record_presence
    victims: list[str] = []

    def presence_once(conn: Any, *args: Any, **kw: Any) -> Any:
        if kw["city_code"] not in victims:
            victims.append(kw["city_code"])
            raise deadlock
        return real(conn, *args, **kw)

    monkeypatch.setattr(city, "record_presence", presence_once)
    sim = make_simulator(seed=5, n_cities=3, total_hotels=300)
    store = LocalPayloadStore(tmp_path / "payloads")
    with httpx.Client(base_url="http://sim", transport=sim.transport()) as http:
        batch_id, reports = full_sync(db, store, supplier_client(http), "deadlocked")
    assert len(victims) == 3 and all(r.status == "SUCCESS" for r in reports)
    assert published(db) == sim.ground_truth().valid
    for r in reports:
        assert r.published + r.dead_letters + r.skipped == r.records
    with db.engine.connect() as conn:
        assert get_batch(conn, batch_id).status == "SUCCESS"
    # The small cities' normalize writes, retried with the chunk, are stored once.
    profiles, normalized, letters = _stored(db, batch_id)
    assert (profiles, letters) == (3, sum(r.dead_letters for r in reports))
    assert normalized == sum(r.pages_fetched for r in reports)


def _small_city_sync(
    db: SyncDatabase, tmp_path: Path, gate: Any
) -> tuple[str, list[CityReport], list[int], Simulator]:
    """Syncs 3 cities of ~80 records (some bad) with ``gate``; counts each city's commits."""

    sim = make_simulator(
        FaultProfile.clean().with_(bad_record_rate=0.1),
        seed=9,
        n_cities=3,
        total_hotels=240,
        zipf_exponent=0.0,
        empty_city_share=0.0,
    )
    store = LocalPayloadStore(tmp_path / "payloads")
    commits: list[int] = []

    def on_commit(*_: Any) -> None:
        commits.append(1)

    sa.event.listen(db.engine, "commit", on_commit)
    cities: list[int] = []

    try:
        with httpx.Client(base_url="http://sim", transport=sim.transport()) as http:
            client = supplier_client(http)
            upsert_task(db, TaskSpec(task_code="hotel_full", supplier_id=SUPPLIER))
            codes = [c.city_code for c in client.list_cities().data.cities]
            decision = create_batch(
                db,
                task_code="hotel_full",
                trigger_id="small",
                trigger_source="MANUAL",
                shard_keys=codes,
            )
            assert decision.batch is not None
            reports = []
            for city in codes:
                before = len(commits)
                reports.append(
                    sync_city(
                        db,
                        store,
                        client,
                        batch=decision.batch,
                        city_code=city,
                        worker_id="w1",
                        settings=settings(page_size=100),
                        gate=gate or (lambda *_: []),
                    )
                )
                cities.append(len(commits) - before)
    finally:
        sa.event.remove(db.engine, "commit", on_commit)
    return decision.batch.batch_id, reports, cities, sim


def _stored(db: SyncDatabase, batch_id: str) -> tuple[int, int, int]:
    """(city profiles, NORMALIZED snapshots, dead letters) of the batch."""
    with db.engine.connect() as conn:
        count = lambda t: conn.execute(  # noqa: E731
            sa.select(sa.func.count()).select_from(t).where(t.c.batch_id == batch_id)
        ).scalar_one()
        normalized = conn.execute(
            sa.select(sa.func.count())
            .select_from(schema.snapshot)
            .where(
                schema.snapshot.c.batch_id == batch_id,
                schema.snapshot.c.snapshot_type == "NORMALIZED",
            )
        ).scalar_one()
        return count(schema.city_profile), normalized, count(schema.dead_letter)


def test_a_small_city_normalizes_and_publishes_in_the_transaction_that_ends_it(
    db: SyncDatabase, tmp_path: Path
):
    """A one-page city commits its claim, its page, and one transaction with its normalized
    page, dead letters, profile, publish and end: nothing of normalize is lost."""
    batch_id, reports, commits, sim = _small_city_sync(db, tmp_path, None)
    assert [r.status for r in reports] == ["SUCCESS"] * 3
    assert all(r.pages_fetched == 1 for r in reports)
    assert commits == [3, 3, 3], commits
    assert published(db) == sim.ground_truth().valid
    letters = sum(r.dead_letters for r in reports)
    assert letters > 0
    assert _stored(db, batch_id) == (3, 3, letters)


def test_a_gated_small_city_keeps_the_profile_and_dead_letters_it_was_judged_on(
    db: SyncDatabase, tmp_path: Path
):
    from supplier_sync_dagster.core.records.gates import GateResult, get_city_profile

    def failing(_db: Any, _batch: str, _city: str, report: CityReport) -> list[GateResult]:
        return [GateResult("bad_record_ratio", False, "ERROR", "too many bad records", {})]

    batch_id, reports, _, _ = _small_city_sync(db, tmp_path, failing)
    assert [r.status for r in reports] == ["GATED"] * 3
    assert published(db) == {}
    letters = sum(r.dead_letters for r in reports)
    assert _stored(db, batch_id) == (3, 3, letters)
    with db.engine.connect() as conn:
        for r in reports:
            profile = get_city_profile(conn, batch_id=batch_id, shard_key=r.city_code)
            assert profile is not None and profile.record_count == r.records
            assert profile.bad_count == r.dead_letters
    assert {s.status for s in list_shards(db, batch_id)} == {"FAILED"}


def test_a_city_that_fails_after_another_worker_took_it_over_files_nothing(
    db: SyncDatabase, tmp_path: Path
):
    """The zombie writer: a worker overtaken mid-city (its lease expired, another worker
    claimed the city) then meets an error. The other worker's outcome stands: the city is
    LEASE_LOST for the stale worker, not FAILED; the shard keeps no error of it and the batch
    gets no CITY_FAILED ticket (the run files one for a FAILED city)."""
    sim = make_simulator(seed=7, n_cities=1, total_hotels=200, empty_city_share=0.0)
    store = LocalPayloadStore(tmp_path / "payloads")
    upsert_task(db, TaskSpec(task_code="hotel_full", supplier_id=SUPPLIER))
    city = sim.city_codes()[0]
    decision = create_batch(
        db, task_code="hotel_full", trigger_id="zombie", trigger_source="MANUAL", shard_keys=[city]
    )
    batch = decision.batch
    assert batch is not None
    later = SyncDatabase(engine=db.engine, clock=DbClock(settings().lease.lease_seconds + 1))
    pages: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if "/hotels" in request.url.path:
            pages.append(request.url.path)
            if len(pages) == 2:
                # Frozen past the lease once page 1 is committed (the walk reads ahead):
                # another worker has the city when this one wakes, and the supplier refuses
                # it (not retried: the city fails at once).
                deadline = time.monotonic() + 30
                while get_shard(db, batch.batch_id, city).pages_done < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                claim_shard(later, batch.batch_id, city, worker_id="w2")
            if len(pages) >= 2:
                return httpx.Response(401, json={"error": "key revoked while frozen"})
        return sim.handle(request)

    with httpx.Client(base_url="http://sim", transport=httpx.MockTransport(handle)) as http:
        report = sync_city(
            db,
            store,
            supplier_client(http),
            batch=batch,
            city_code=city,
            worker_id="w1",
            settings=settings(page_size=50),
        )
    assert report.status == "LEASE_LOST", report
    shard = get_shard(db, batch.batch_id, city)
    assert (shard.status, shard.worker_id, shard.error_message) == ("RUNNING", "w2", None)
    assert dead_letters(db, batch.batch_id) == {}
    assert published(db) == {}
