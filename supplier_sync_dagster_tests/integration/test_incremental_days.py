"""Days of incremental sync over the simulator on real HTTP (SQLite and MariaDB).

A full sync on day 0; then a window every three hours through days 1-3 while the supplier's
changes happen through the day, a fifth of them visible up to four minutes late; one window
is a ``supplier-sync sync --incremental`` process killed with SIGKILL mid-window, which the
next window resumes; then one reconciliation, whose re-pulls unpublish the hotels the
supplier removed. At the end the catalog is the supplier's ground truth. Without the overlap
window the same days lose changes (so this test can fail).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.leases import LeaseSettings
from supplier_sync_dagster.core.repair.incremental import IncrementalSettings, run_incremental
from supplier_sync_dagster.core.repair.reconcile import Tolerance, reconcile
from supplier_sync_dagster.core.settings import DEFAULT_TASK_CODE
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore
from supplier_sync_dagster.core.sync.model import SyncSettings
from supplier_sync_dagster.core.sync.run import RunRequest, plan_run, run_cities
from supplier_sync_dagster.simulator import FaultProfile, Simulator
from supplier_sync_dagster_tests.helpers import (
    SIM_API_KEY,
    cli_process,
    serve_simulator,
    supplier_client,
)

SETTINGS = SyncSettings(
    task_code=DEFAULT_TASK_CODE,
    supplier_id=1001,
    page_size=100,
    lease=LeaseSettings(lease_seconds=30, heartbeat_seconds=2),
)
POLL_SECONDS = 3 * 3600
LATE_MAX = 240


def _world(**extra: Any) -> dict[str, Any]:
    return {
        "seed": 33,
        "n_cities": 6,
        "total_hotels": 1500,
        "late_arrival_rate": 0.2,
        "late_max_seconds": LATE_MAX,
        "daily_remove_rate": 0.01,
        **extra,
    }


def _faults() -> FaultProfile:
    return FaultProfile.flaky().with_(rate_slow=0.0)


def _full_sync(
    db: SyncDatabase,
    store: LocalPayloadStore,
    http: httpx.Client,
    trigger: str,
    cities: list[str] | None = None,
) -> None:
    client = supplier_client(http)
    codes = cities or [c.city_code for c in client.list_cities().data.cities]
    request = RunRequest(trigger_id=trigger, source="MANUAL", cities=codes)
    plan = plan_run(db, store, client, request, SETTINGS)
    outcomes = list(run_cities(db, store, client, plan, request, SETTINGS, worker_id="tester"))
    assert {o.status for o in outcomes} <= {"SUCCESS", "ALREADY_DONE"}, [
        (o.city_code, o.status, o.report.error) for o in outcomes
    ]


def _window(
    db: SyncDatabase, store: LocalPayloadStore, http: httpx.Client, trigger: str, overlap: float
) -> Any:
    return run_incremental(
        db,
        store,
        supplier_client(http),
        settings=SETTINGS,
        incremental=IncrementalSettings(overlap_seconds=overlap, limit=100),
        trigger_id=trigger,
        source="CRON",
        worker_id="tester",
    )


def _catalog(db: SyncDatabase) -> dict[str, tuple[int, str]]:
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        return {
            r.supplier_hotel_id: (r.supplier_version, r.status)
            for r in conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version, h.status))
        }


def _lost(db: SyncDatabase, sim: Simulator) -> dict[str, tuple[int | None, int]]:
    """Valid hotels whose published version is not the supplier's."""
    catalog = _catalog(db)
    truth = sim.ground_truth()
    return {
        h: (catalog.get(h, (None, ""))[0], v)
        for h, v in truth.valid.items()
        if catalog.get(h, (None, ""))[0] != v
    }


def _kill_mid_window(db_url: str, url: str, tmp_path: Path) -> None:
    """``supplier-sync sync --incremental`` as a process, killed once a page is checkpointed."""
    env = {
        **os.environ,
        "SUPPLIER_SYNC_HOME": str(tmp_path / "home"),
        "DAGSTER_HOME": str(tmp_path / "dagster_home"),
        "SUPPLIER_SYNC_PAYLOAD_URL": f"file://{tmp_path}/payloads",
        "SUPPLIER_SYNC_SUPPLIER_URL": url,
        "SUPPLIER_SYNC_SUPPLIER_API_KEY": SIM_API_KEY,
    }
    (tmp_path / "dagster_home").mkdir(exist_ok=True)
    (tmp_path / "dagster_home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    proc = cli_process(
        "--db-url",
        db_url,
        "sync",
        "--incremental",
        # Pages of 5 at 2 requests/s: the window (~17 changes) has pages left after its first
        # checkpoint for over a second, so the kill lands mid-window even on a loaded machine
        # (with pages of 20 the whole window was one page, and a slow poll missed it).
        "--changes-limit",
        "5",
        "--rate-limit",
        "2",
        env=env,
    )
    db = SyncDatabase.open(db_url)
    sh, b = schema.shard.c, schema.batch.c
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            with db.engine.connect() as conn:
                pages = conn.execute(
                    sa.select(sh.pages_done)
                    .join(schema.batch, b.batch_id == sh.batch_id)
                    .where(b.sync_mode == "INCREMENTAL", sh.status == "RUNNING")
                ).scalar()
            if pages:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        db.dispose()


def test_three_days_of_windows_with_late_changes_and_a_kill_end_at_the_ground_truth(
    db_url: str, tmp_path: Path
):
    db = SyncDatabase.open(db_url)
    store = LocalPayloadStore(tmp_path / "payloads")
    try:
        with (
            serve_simulator(_faults(), **_world()) as (sim, url),
            httpx.Client(base_url=url) as http,
        ):
            _full_sync(db, store, http, "day0")
            resumed = None
            for step in range(1, 3 * 24 * 3600 // POLL_SECONDS + 1):
                sim.advance(POLL_SECONDS)
                if step == 10:
                    _kill_mid_window(db_url, url, tmp_path)
                    # The killed worker's lease and grace expire (the database's clock).
                    db.clock.advance(120)
                    window = _window(db, store, http, f"w{step}", 300)
                    resumed = window.report.resumed_from_page
                else:
                    window = _window(db, store, http, f"w{step}", 300)
                assert window.report.status == "SUCCESS", window.report.error
            assert resumed is not None and resumed > 1  # the next window took the killed one over
            # Every change, late ones included, is published: nothing lost.
            assert _lost(db, sim) == {}
            truth = sim.ground_truth()
            removed = set(_catalog(db)) - set(truth.versions)
            assert removed  # the supplier removed hotels; the feed never says so
            # One reconciliation: what differs is re-pulled, which unpublishes the removed.
            with httpx.Client(base_url=url) as rec:
                report = reconcile(
                    db,
                    supplier_client(rec),
                    supplier_id=SETTINGS.supplier_id,
                    tolerance=Tolerance(absolute=0, relative=0.0, max_lag_seconds=0),
                )
            differing = [c.city_code for c in report.differing]
            assert differing
            _full_sync(db, store, http, "repull", differing)
            catalog = _catalog(db)
            assert {h for h in removed if catalog[h][1] != "INACTIVE"} == set()
            assert _lost(db, sim) == {}
            for h in truth.valid:
                assert catalog[h][1] == ("INACTIVE" if h in truth.inactive else "ACTIVE"), h
            d = schema.dead_letter.c
            with db.engine.connect() as conn:
                lettered = set(conn.execute(sa.select(d.supplier_resource_code)).scalars())
            assert set(truth.bad) <= lettered
            # The watermark did not run ahead of the supplier's clock.
            w = schema.watermark.c
            with db.engine.connect() as conn:
                mark = conn.execute(sa.select(w.watermark_at)).scalar_one()
            assert mark <= sim.now().replace(tzinfo=None)
    finally:
        db.dispose()


@pytest.mark.parametrize("overlap, loses", [(0, True), (LATE_MAX + 60, False)])
def test_without_the_overlap_window_the_same_days_lose_late_changes(
    tmp_path: Path, overlap: float, loses: bool
):
    db = SyncDatabase.open(f"sqlite:///{tmp_path / 'sync.sqlite3'}")
    store = LocalPayloadStore(tmp_path / "payloads")
    # A busier day than above, polled every 20 minutes: a change every couple of minutes and
    # half of them late, so that late ones often land just behind a watermark.
    world = _world(daily_price_change_rate=0.3, late_arrival_rate=0.5)
    try:
        with (
            serve_simulator(_faults(), **world) as (sim, url),
            httpx.Client(base_url=url) as http,
        ):
            _full_sync(db, store, http, "day0")
            for step in range(1, 24 * 3):
                sim.advance(1200)
                assert _window(db, store, http, f"w{step}", overlap).report.status == "SUCCESS"
            lost = _lost(db, sim)
        if loses:
            assert lost  # late changes behind the watermark were never seen
            assert all(old is not None and old < new for old, new in lost.values())
        else:
            assert lost == {}
    finally:
        db.dispose()
