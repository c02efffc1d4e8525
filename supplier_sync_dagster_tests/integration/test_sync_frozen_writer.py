"""The zombie writer: `supplier-sync sync --full` frozen mid-city past its lease, then thawed.

The seed's postmortem (``cas-dedupe-postmortem.md``) is the story: a worker too slow for its
lease is overtaken, another worker rightfully does the work, and the late worker's writes must
match 0 rows and be seen to, instead of silently overwriting what the other one did. Here the
slow worker is a real process: the command runs in its own process group against the simulator
over HTTP with a short lease (``SUPPLIER_SYNC_LEASE_SECONDS``), is frozen with SIGSTOP while a
city is half done (the run's process and its worker processes), stays frozen until every lease of its batch has expired, and a second
``sync --full`` adopts the batch, takes its cities over and completes it. Then SIGCONT: the
frozen process's writes are fenced (LEASE_LOST), it stops with a line saying so and exit
status 1, every table of the sync database reads as it did before the thaw, and each city's
Dagster partition stays materialized.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import batch_liveness
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.dagster_instance.deployment import ASSETS
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.simulator import Simulator
from supplier_sync_dagster_tests.cli.test_main import published, query
from supplier_sync_dagster_tests.helpers import (
    SIM_API_KEY,
    cli_process,
    process_state,
    serve_simulator,
)

LEASE_SECONDS = 6
PAGE_SIZE = 50


@pytest.fixture
def simulator() -> Iterator[tuple[Simulator, str]]:
    with serve_simulator(seed=43, n_cities=6, total_hotels=3000, empty_city_share=0.0) as served:
        yield served


def _group(pgid: int) -> list[int]:
    """The processes of a process group."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
    return pids


def _all_stopped(pgid: int) -> bool:
    states = [process_state(pid) for pid in _group(pgid)]
    return bool(states) and all(s is None or s in "TtZ" for s in states)


def _sqlite_locked(path: Path) -> bool:
    """Whether another connection holds the SQLite file's write lock."""
    conn = sqlite3.connect(path, timeout=0)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.rollback()
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        conn.close()


def _holds_locks(db: SyncDatabase, db_url: str, dagster_home: Path) -> bool:
    """Whether a transaction of the frozen process is open on the sync database (MariaDB) or
    holds a write lock on a SQLite file (the sync database, the Dagster instance): frozen then,
    it would block every other writer, which is SQLite's and InnoDB's doing, not a lease's."""
    files = list(dagster_home.rglob("*.db"))
    if db.dialect == "sqlite":
        files.append(Path(sa.make_url(db_url).database or ""))
    else:
        name = sa.make_url(db_url).database
        with db.engine.connect() as conn:
            open_trx = conn.execute(
                sa.text(
                    "SELECT COUNT(*) FROM information_schema.innodb_trx t JOIN "
                    "information_schema.processlist p ON p.id = t.trx_mysql_thread_id "
                    "WHERE p.db = :db AND p.id <> CONNECTION_ID()"
                ),
                {"db": name},
            ).scalar_one()
        if open_trx:
            return True
    return any(_sqlite_locked(f) for f in files)


def _freeze(proc: Any, db: SyncDatabase, db_url: str, dagster_home: Path) -> None:
    """SIGSTOPs the process group at a moment it holds no database lock."""
    for _ in range(200):
        os.killpg(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while not _all_stopped(proc.pid):
            assert time.monotonic() < deadline, "the process group did not stop"
            time.sleep(0.01)
        if not _holds_locks(db, db_url, dagster_home):
            return
        os.killpg(proc.pid, signal.SIGCONT)
        time.sleep(0.05)
    pytest.fail("the command always held a database lock when frozen")


def _batch_of(db: SyncDatabase, trigger_id: str) -> str | None:
    g = schema.trigger_log.c
    with db.engine.connect() as conn:
        return conn.execute(sa.select(g.batch_id).where(g.trigger_id == trigger_id)).scalar()


def _mid_city(db: SyncDatabase, batch_id: str) -> str | None:
    """The worker of a city of the batch that is half done (pages of it committed, its last
    one not yet), if there is one."""
    s = schema.shard.c
    with db.engine.connect() as conn:
        return conn.execute(
            sa.select(s.worker_id)
            .where(s.batch_id == batch_id, s.status == "RUNNING", s.pages_done > 0)
            .limit(1)
        ).scalar()


def _catalog(db: SyncDatabase) -> dict[str, list[tuple[str, ...]]]:
    """Every row of every table of the sync database, sorted, as text."""
    out = {}
    with db.engine.connect() as conn:
        for table in schema.metadata.sorted_tables:
            rows = conn.execute(sa.select(table)).all()
            out[table.name] = sorted(tuple(repr(v) for v in row) for row in rows)
    return out


def _statuses(dagster_home: Path, codes: list[str]) -> dict[str, dict[str, str]]:
    """Asset -> city -> its partition status as the UI shows it."""
    keys = [encode_city_key(c) for c in codes]
    out: dict[str, dict[str, str]] = {}
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        for asset in ASSETS:
            found = instance.get_status_by_partition(
                dg.AssetKey(asset), keys, DEFAULT_SCOPE.partitions
            )
            out[asset] = {
                code: (s.value if (s := (found or {}).get(key)) is not None else "-")
                for code, key in zip(codes, keys, strict=True)
            }
    return out


def _sync(trigger: str, env: dict[str, str], log: IO[str], *options: str) -> Any:
    return cli_process(
        *f"sync --full --json --page-size {PAGE_SIZE} --trigger-id".split(),
        trigger,
        *options,
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )


def test_a_frozen_sync_is_overtaken_and_every_write_it_attempts_on_waking_is_fenced(
    db_url: str, simulator: tuple[Simulator, str], tmp_path: Path
):
    sim, sim_url = simulator
    dagster_home = tmp_path / "dagster_home"
    dagster_home.mkdir()
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {
        **os.environ,
        "DAGSTER_HOME": str(dagster_home),
        "SUPPLIER_SYNC_HOME": str(tmp_path / "home"),
        "SUPPLIER_SYNC_DB_URL": db_url,
        "SUPPLIER_SYNC_SUPPLIER_URL": sim_url,
        "SUPPLIER_SYNC_SUPPLIER_API_KEY": SIM_API_KEY,
        "SUPPLIER_SYNC_PAYLOAD_URL": f"file://{tmp_path / 'payloads'}",
        "SUPPLIER_SYNC_LEASE_SECONDS": str(LEASE_SECONDS),
    }
    db = SyncDatabase.open(db_url)
    frozen_log, rescue_log = tmp_path / "frozen.log", tmp_path / "rescue.log"
    with frozen_log.open("w") as out:
        # Slow enough to be mid-city when frozen; with worker processes, so that the whole
        # process group freezes, the run's process and its workers.
        frozen = _sync("night", env, out, "--rate-limit", "4", "--processes", "2")
    try:
        deadline = time.monotonic() + 180
        while (batch_id := _batch_of(db, "night")) is None or not _mid_city(db, batch_id):
            assert frozen.poll() is None, frozen_log.read_text()
            assert time.monotonic() < deadline, frozen_log.read_text()
            time.sleep(0.05)
        _freeze(frozen, db, db_url, dagster_home)
        assert _mid_city(db, batch_id)
        # Frozen past its leases and its grace: nobody provably works on the batch now.
        deadline = time.monotonic() + 120
        while True:
            with db.engine.connect() as conn:
                if not batch_liveness(conn, db.clock, batch_id).live:
                    break
            assert time.monotonic() < deadline, "the frozen command's leases never expired"
            time.sleep(0.2)

        with rescue_log.open("w") as out:
            rescue = _sync("rescue", env, out, "--rate-limit", "50")
            assert rescue.wait(timeout=300) == 0, rescue_log.read_text()[-4000:]
        summary = json.loads(rescue_log.read_text().strip().splitlines()[-1])
        assert summary["batch_id"] == batch_id and summary["status"] == "SUCCESS", summary
        before = _catalog(db)

        os.killpg(frozen.pid, signal.SIGCONT)
        status = frozen.wait(timeout=300)
        after = _catalog(db)
    finally:
        if frozen.poll() is None:
            os.killpg(frozen.pid, signal.SIGKILL)
            frozen.wait()
        db.dispose()
    text = frozen_log.read_text(errors="replace")
    g = schema.trigger_log.c
    outcomes = dict(query(db_url, sa.select(g.trigger_id, g.outcome)))
    assert outcomes == {"night": "CREATED", "rescue": "ADOPTED"}
    # Not one row written by the process that woke up after losing its cities, but for the
    # metrics row of its own run: the requests it made before it froze were made.
    stats = schema.run_stats.name
    kept = before.pop(stats)
    added = [row for row in after.pop(stats) if row not in kept]
    assert len(added) == 1 and added[0][3] not in {row[3] for row in kept}, (added, kept)
    changed = {name for name in before if before[name] != after[name]}
    assert not changed, {name: (before[name], after[name]) for name in changed}
    assert published(db_url) == dict(sim.ground_truth().valid)
    # It stopped, saying why, with the exit status of a sync that did not complete.
    assert status == 1, text[-4000:]
    assert "LEASE_LOST" in text, text[-4000:]
    last = text.strip().splitlines()[-1]
    assert "taken over by another worker after this run's leases expired" in last, last
    codes = sim.city_codes()
    truth = {asset: dict.fromkeys(codes, "MATERIALIZED") for asset in ASSETS}
    assert _statuses(dagster_home, codes) == truth
