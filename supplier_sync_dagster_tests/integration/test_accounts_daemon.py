"""Two suppliers, two accounts each, synced in parallel through the daemon (issue 21).

The simulator fleet serves both suppliers over real HTTP, each account with its own key,
request budget and fault profile; the suppliers file points the accounts at it. Each
account's full-sync job is launched through the webserver's GraphQL API (one run over all
its cities; one account twice, over two halves), the daemon dequeues the runs under the
``supplier_sync/account`` tag limit, and every run syncs into one MariaDB sync database
through one Redis. Then an account is added to the file and the code location reloaded.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.dagster_instance.deployment import ROOT, DagsterProcesses, profile_env
from supplier_sync_dagster.defs.accounts import ACCOUNT_TAG
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.defs.triggers import TRIGGER_TAG
from supplier_sync_dagster.simulator import (
    AccountSpec,
    FaultProfile,
    SimulatorFleet,
    SupplierSpec,
)
from supplier_sync_dagster.simulator.server import running_fleet_server

RATE = 6.0  # requests/s each account may send (the fleet allows each key a little more)
SUPPLIER_IDS = {"acme": 1001, "globex": 2002}
ACCOUNTS = [("acme", "eu"), ("acme", "us"), ("globex", "main"), ("globex", "asia")]


def _fleet() -> SimulatorFleet:
    def spec(supplier: str, account: str) -> AccountSpec:
        faults: FaultProfile | str = "clean"
        if (supplier, account) == ("globex", "asia"):
            # A hostile account: every record it serves is broken, so its gate stops it.
            faults = FaultProfile.hostile().with_(bad_record_rate=1.0)
        return AccountSpec(
            api_key=f"key-{supplier}-{account}", rate_limit_rps=RATE * 1.2, faults=faults
        )

    return SimulatorFleet.from_spec(
        {
            name: SupplierSpec(
                seed=seed,
                n_cities=8,
                total_hotels=900,
                accounts={a: spec(name, a) for s, a in ACCOUNTS if s == name},
                settings={"empty_city_share": 0.0},
            )
            for name, seed in (("acme", 71), ("globex", 72))
        }
    )


def _suppliers_yaml(url: str, accounts: list[tuple[str, str]]) -> str:
    lines = ["suppliers:"]
    for supplier, sid in SUPPLIER_IDS.items():
        lines += [
            f"  {supplier}:",
            f"    supplier_id: {sid}",
            f"    base_url: {url}/{supplier}",
            "    accounts:",
        ]
        for s, account in accounts:
            if s == supplier:
                lines.append(
                    f"      {account}: {{api_key_env: {s.upper()}_{account.upper()}_KEY, "
                    f"rate_limit_rps: {RATE}, page_size: 50, "
                    # Only the proof's runs: no window, reconciliation or retry on a timer.
                    "schedules: {full: null, incremental: null, reconciliation: null, "
                    "compensation: null}}"
                )
    return "\n".join(lines) + "\n"


@pytest.fixture
def fleet_url() -> Iterator[tuple[SimulatorFleet, str]]:
    sim = _fleet()
    with running_fleet_server(sim) as url:
        yield sim, url


def _wait(instance: dg.DagsterInstance, run_ids: list[str], timeout: float) -> list[dg.RunRecord]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = instance.get_run_records(filters=dg.RunsFilter(run_ids=run_ids))
        if len(records) == len(run_ids) and all(r.dagster_run.is_finished for r in records):
            return list(records)
        time.sleep(1)
    raise TimeoutError(
        f"runs not finished: {[(r.dagster_run.run_id, r.dagster_run.status) for r in records]}"
    )


def test_accounts_sync_in_parallel_each_within_its_budget_and_apart(
    fleet_url: tuple[SimulatorFleet, str],
    fresh_mysql_db: str,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    sim, url = fleet_url
    suppliers = tmp_path / "suppliers.yaml"
    suppliers.write_text(_suppliers_yaml(url, ACCOUNTS))
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    keys = {f"{s.upper()}_{a.upper()}_KEY": f"key-{s}-{a}" for s, a in ACCOUNTS}
    env = profile_env(
        dagster_home=home,
        extra={
            "SUPPLIER_SYNC_SUPPLIERS_FILE": str(suppliers),
            "SUPPLIER_SYNC_DB_URL": fresh_mysql_db,
            "SUPPLIER_SYNC_PAYLOAD_URL": f"file://{tmp_path / 'payloads'}",
            "SUPPLIER_SYNC_REDIS_URL": redis_url,
            "SUPPLIER_SYNC_HOME": str(tmp_path / "home"),
            **keys,
        },
    )
    monkeypatch.setenv("DAGSTER_HOME", str(home))

    # Created here first: the webserver and the daemon must not race to create its storage.
    instance = dg.DagsterInstance.get()
    with DagsterProcesses(env, tmp_path / "logs") as dagster:
        assert {f"{s}__{a}__full_sync_job" for s, a in ACCOUNTS} <= dagster.job_names()
        run_ids: dict[str, list[str]] = {}
        for supplier, account in ACCOUNTS:
            code = f"{supplier}.{account}"
            cities = sorted(
                encode_city_key(c) for c in sim.simulator(supplier, account).city_codes()
            )
            instance.add_dynamic_partitions(f"{supplier}__{account}__city", cities)
            ordered = instance.get_dynamic_partitions(f"{supplier}__{account}__city")
            # acme.eu is launched twice, over two halves, as one batch: its second run waits.
            halves = [ordered[:4], ordered[4:]] if code == "acme.eu" else [ordered]
            for part in halves:
                run_ids.setdefault(code, []).append(
                    dagster.launch_job(
                        f"{supplier}__{account}__full_sync_job",
                        tags={
                            "dagster/asset_partition_range_start": part[0],
                            "dagster/asset_partition_range_end": part[-1],
                            TRIGGER_TAG: f"proof-{code}",
                        },
                    )
                )
        records = _wait(instance, [r for ids in run_ids.values() for r in ids], timeout=420)
        by_id = {r.dagster_run.run_id: r for r in records}

        # Every run carries its account's tag; the hostile account's run failed (gated), the
        # others succeeded.
        for code, ids in run_ids.items():
            for run_id in ids:
                run = by_id[run_id].dagster_run
                assert run.tags[ACCOUNT_TAG] == code
                expected = (
                    dg.DagsterRunStatus.FAILURE
                    if code == "globex.asia"
                    else dg.DagsterRunStatus.SUCCESS
                )
                assert run.status == expected, (code, run.status, dagster.tail("daemon.log"))
        # One run per account at a time, accounts in parallel.
        spans: dict[str, tuple[float, float]] = {}
        for ids in run_ids.values():
            for run_id in ids:
                start, end = by_id[run_id].start_time, by_id[run_id].end_time
                assert start is not None and end is not None, run_id
                spans[run_id] = (start, end)
        first, second = (spans[i] for i in run_ids["acme.eu"])
        assert first[1] <= second[0] or second[1] <= first[0], (first, second)
        others = [spans[run_ids[c][0]] for c in ("acme.us", "globex.main", "globex.asia")]
        overlapping = [
            s for s in others if s[0] < max(first[1], second[1]) and s[1] > min(first[0], second[0])
        ]
        assert overlapping, (spans, "no other account ran while acme.eu did")

        # Adding an account to the file and reloading the code location adds its jobs.
        suppliers.write_text(_suppliers_yaml(url, [*ACCOUNTS, ("globex", "latam")]))
        assert "globex__latam__full_sync_job" not in dagster.job_names()
        dagster.reload_location()
        assert "globex__latam__full_sync_job" in dagster.job_names()

    stats = sim.stats()
    for supplier, account in ACCOUNTS:
        # Within its own budget: its bucket never let it past the supplier's limit.
        assert stats[supplier][account]["rate_limited"] == 0, (supplier, account)
        assert stats[supplier][account]["requests_total"] > 0
    assert sim.refused()["unauthorized"] in ({}, {"acme": 0, "globex": 0})
    db = SyncDatabase.open(fresh_mysql_db)
    try:
        h, b, s, d = (schema.platform_hotel.c, schema.batch.c, schema.shard.c, schema.dead_letter.c)
        with db.engine.connect() as conn:
            batches = {
                r.batch_id: r
                for r in conn.execute(
                    sa.select(b.batch_id, b.task_code, b.trigger_id, b.supplier_id, b.status)
                )
            }
            shards = conn.execute(sa.select(s.batch_id, s.shard_key, s.claim_count)).all()
            hotels = conn.execute(
                sa.select(h.supplier_id, h.supplier_hotel_id, h.supplier_version, h.last_batch_id)
            ).all()
            dead = conn.execute(sa.select(d.supplier_id, d.batch_id)).all()
            marks = conn.execute(sa.select(schema.watermark.c.task_code)).all()
    finally:
        db.dispose()
    # One batch per account (acme.eu's two runs continued one), each its own task.
    assert sorted((x.trigger_id, x.task_code) for x in batches.values()) == sorted(
        (f"proof-{s}.{a}", f"{s}.{a}.full") for s, a in ACCOUNTS
    )
    assert {x.status for x in batches.values() if x.task_code != "globex.asia.full"} == {"SUCCESS"}
    for x in batches.values():
        assert x.supplier_id == SUPPLIER_IDS[x.task_code.split(".")[0]]
    assert {x.claim_count for x in shards} == {1}
    # Each supplier's catalog is its ground truth, once: acme's two accounts are one
    # namespace; globex's hostile account published nothing (its cities are gated).
    for supplier, account in (("acme", "eu"), ("globex", "main")):
        truth = sim.ground_truth(supplier, account)
        sid = SUPPLIER_IDS[supplier]
        found = {x.supplier_hotel_id: x.supplier_version for x in hotels if x.supplier_id == sid}
        assert found == dict(truth.valid), supplier
    # No row of one account carries another's batch.
    for row in hotels:
        assert batches[row.last_batch_id].task_code.startswith(
            "acme." if row.supplier_id == 1001 else "globex."
        )
        assert batches[row.last_batch_id].task_code != "globex.asia.full"
    assert dead and all(batches[x.batch_id].supplier_id == x.supplier_id for x in dead)
    assert {batches[x.batch_id].task_code for x in dead} == {"globex.asia.full"}
    assert marks == []
