"""`supplier-sync sync --full` killed with SIGKILL at random moments, then run again.

As a user does it: the command runs as its own process against the simulator over HTTP;
it is killed three times once it shows progress, each time after a random delay, then a
new ``sync --full`` (a new trigger id) must adopt the abandoned batch, continue it from its
checkpoints, exit 0, and leave the catalog equal to the simulator's ground truth.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.simulator import Simulator
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, serve_simulator

KILLS = 3
PAGE_SIZE = 100
CITY_THREADS = 2  # the CLI's default: a kill interrupts at most this many cities


@pytest.fixture
def simulator() -> Iterator[tuple[Simulator, str]]:
    with serve_simulator(seed=23, n_cities=40, total_hotels=16_000, empty_city_share=0.0) as served:
        yield served


def _progress(db: SyncDatabase, trigger_id: str) -> int | None:
    """Pages done by the batch this trigger works on, once the trigger has one; else None."""
    g, s = schema.trigger_log.c, schema.shard.c
    with db.engine.connect() as conn:
        batch_id = conn.execute(sa.select(g.batch_id).where(g.trigger_id == trigger_id)).scalar()
        if batch_id is None:
            return None
        pages = sa.select(sa.func.coalesce(sa.func.sum(s.pages_done), 0))
        return int(conn.execute(pages.where(s.batch_id == batch_id)).scalar_one())


def test_sync_killed_three_times_is_adopted_and_ends_at_the_ground_truth(
    db_url: str, simulator: tuple[Simulator, str], tmp_path: Path
):
    sim, sim_url = simulator
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    env = {
        **{k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"},
        "SUPPLIER_SYNC_HOME": str(tmp_path / "home"),
        "SUPPLIER_SYNC_DB_URL": db_url,
        "SUPPLIER_SYNC_SUPPLIER_URL": sim_url,
        "SUPPLIER_SYNC_SUPPLIER_API_KEY": SIM_API_KEY,
        "SUPPLIER_SYNC_PAYLOAD_URL": f"file://{tmp_path / 'payloads'}",
    }
    command = [str(Path(sys.executable).parent / "supplier-sync"), "sync", "--full", "--json"]
    # 20 requests/s: a whole sync takes ~10 s, so that three killed runs leave work over.
    command += ["--rate-limit", "20", "--page-size", str(PAGE_SIZE)]
    db = SyncDatabase.open(db_url)
    logs: list[str] = []
    before = 0
    try:
        for n in range(1, KILLS + 1):
            trigger = f"night-{n}"
            log = tmp_path / f"{trigger}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [*command, "--trigger-id", trigger], env=env, stdout=out, stderr=out
                )
                deadline = time.monotonic() + 120
                # Progress shows: this trigger has its batch and has done pages of its own.
                while (done := _progress(db, trigger)) is None or done <= before:
                    assert proc.poll() is None, f"{trigger} exited early: {log.read_text()}"
                    assert time.monotonic() < deadline, f"no progress: {log.read_text()}"
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 1.5))
                assert proc.poll() is None, f"{trigger} finished before its kill (seed {seed})"
                os.kill(proc.pid, signal.SIGKILL)  # kill -9
                proc.wait(timeout=30)
            before = _progress(db, trigger) or 0
            logs.append(log.read_text(errors="replace")[-2000:])

        final = subprocess.run(
            [*command, "--trigger-id", "night-4"], env=env, capture_output=True, timeout=300
        )
        assert final.returncode == 0, (seed, final.stdout[-3000:], final.stderr[-3000:], logs)
        summary = json.loads(final.stdout)

        g, h, s = schema.trigger_log.c, schema.platform_hotel.c, schema.shard.c
        with db.engine.connect() as conn:
            log_rows = {
                r.trigger_id: (r.outcome, r.batch_id)
                for r in conn.execute(sa.select(g.trigger_id, g.outcome, g.batch_id))
            }
            published = dict(conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version)).all())
            claims = conn.execute(sa.select(sa.func.sum(s.claim_count))).scalar_one()
            shards = conn.execute(sa.select(s.status, sa.func.count()).group_by(s.status)).all()
    finally:
        db.dispose()

    first = log_rows["night-1"]
    assert first[0] == "CREATED", log_rows
    # Every later trigger adopted the one abandoned batch and continued it.
    assert {trigger: row for trigger, row in log_rows.items() if trigger != "night-1"} == {
        f"night-{n}": ("ADOPTED", first[1]) for n in range(2, KILLS + 2)
    }
    assert summary["batch_id"] == first[1] and summary["trigger_id"] == "night-4"
    assert summary["status"] == "SUCCESS" and summary["counts_add_up"], summary
    truth = sim.ground_truth()
    assert published == dict(truth.valid), f"seed {seed}"
    assert dict(shards) == {"SUCCESS": 40}
    assert claims > 40  # cities interrupted by a kill were claimed again, and resumed
    # Resumed from checkpoints: each kill cost at most one page per city in flight.
    refetched = sim.stats["hotels_served"] - truth.total
    assert 0 <= refetched <= KILLS * CITY_THREADS * PAGE_SIZE, (refetched, seed)
