"""``supplier-sync accounts`` and ``--account`` as a user calls them: two suppliers, two
accounts each, over the simulator fleet on real HTTP, on SQLite and MariaDB."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.simulator import AccountSpec, SimulatorFleet, SupplierSpec
from supplier_sync_dagster.simulator.server import running_fleet_server
from supplier_sync_dagster_tests.cli.test_main import (  # noqa: F401  (cli_home: an autouse fixture)
    assert_one_line_error,
    cli_home,
    query,
    run,
)
from supplier_sync_dagster_tests.helpers import (
    READ_API_HEADERS,
    READ_API_KEY,
    cli_process,
    free_port,
    stay,
    wait_for_http,
)

KEYS = {
    ("acme", "eu"): "k-acme-eu",
    ("acme", "us"): "k-acme-us",
    ("globex", "main"): "k-globex-main",
    ("globex", "asia"): "k-globex-asia",
}


def fleet() -> SimulatorFleet:
    def accounts(supplier: str) -> dict[str, AccountSpec]:
        return {a: AccountSpec(api_key=k) for (s, a), k in KEYS.items() if s == supplier}

    return SimulatorFleet.from_spec(
        {
            "acme": SupplierSpec(seed=51, n_cities=3, total_hotels=300, accounts=accounts("acme")),
            "globex": SupplierSpec(
                seed=52, n_cities=3, total_hotels=240, accounts=accounts("globex")
            ),
        },
        late_arrival_rate=0.0,
    )


@contextmanager
def suppliers_file(
    sim: SimulatorFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    with running_fleet_server(sim) as url:
        lines = ["suppliers:"]
        for supplier, sid in (("acme", 1001), ("globex", 2002)):
            lines += [
                f"  {supplier}:",
                f"    supplier_id: {sid}",
                f"    base_url: {url}/{supplier}",
            ]
            lines.append("    accounts:")
            for (s, account), key in KEYS.items():
                if s == supplier:
                    env = f"{s}_{account}_KEY".upper()
                    monkeypatch.setenv(env, key)
                    lines.append(f"      {account}: {{api_key_env: {env}, rate_limit_rps: 500}}")
        lines.append("      # (thresholds below)")
        path = tmp_path / "suppliers.yaml"
        path.write_text(
            "\n".join(lines).replace(
                "api_key_env: ACME_EU_KEY, rate_limit_rps: 500",
                "api_key_env: ACME_EU_KEY, rate_limit_rps: 500, thresholds: {quiet_windows: 3}",
            )
            + "\n"
        )
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIERS_FILE", str(path))
        yield path


def test_accounts_sync_apart_into_one_catalog_per_supplier(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    db_url: str,
):
    sim = fleet()
    with suppliers_file(sim, tmp_path, monkeypatch):
        listed = run(capsys, "accounts", "list", "--json")
        assert listed.code == 0, listed
        rows = [json.loads(line) for line in listed.out.splitlines()]
        assert [r["account"] for r in rows] == ["acme.eu", "acme.us", "globex.main", "globex.asia"]
        assert rows[0]["api_key"] == "ACME_EU_KEY (set)" and "k-acme-eu" not in listed.out
        applied = run(capsys, "accounts", "apply", "--db-url", db_url, "--by", "t", "--reason", "r")
        assert applied.code == 0, applied
        assert "acme.eu.incremental: gate.quiet_windows 12 -> 3" in applied.out
        assert "4 accounts, 12 tasks" in applied.out

        for code in ("acme.eu", "acme.us", "globex.main"):
            out = run(capsys, "--db-url", db_url, "sync", "--full", "--account", code, "--json")
            assert out.code == 0, out
        stats = sim.stats()
        # Each account's requests carried its own key: none was refused or throttled.
        assert sim.refused()["unauthorized"] in ({}, {"acme": 0, "globex": 0})
        for supplier, account in (("acme", "eu"), ("acme", "us"), ("globex", "main")):
            assert stats[supplier][account]["requests_total"] > 0
            assert stats[supplier][account]["responses_429"] == 0
        assert stats["globex"]["asia"]["requests_total"] == 0

        # A replay of an account's city: its task's stored pages, its assets, no request.
        city = sim.simulator("globex", "main").city_codes()[0]
        replayed = run(
            capsys,
            "--db-url",
            db_url,
            "replay",
            "--account",
            "globex.main",
            "--city",
            city,
            "--json",
        )
        assert replayed.code == 0, replayed
        assert json.loads(replayed.out.splitlines()[-1])["status"] == "SUCCESS", replayed
        assert (
            sim.stats()["globex"]["main"]["requests_total"]
            == stats["globex"]["main"]["requests_total"]
        )
        mixed = run(
            capsys,
            "--db-url",
            db_url,
            "replay",
            "--account",
            "globex.main",
            "--task",
            "acme.eu.full",
            "--city",
            city,
        )
        assert "is not account globex.main's full-sync task" in assert_one_line_error(mixed, code=2)

        sim.advance_day()
        window = run(capsys, "--db-url", db_url, "sync", "--incremental", "--account", "acme.eu")
        assert window.code == 0, window
        recon = run(
            capsys, "--db-url", db_url, "reconcile", "--account", "globex.main", "--no-repull"
        )
        assert recon.code == 0, recon
        unknown = run(capsys, "--db-url", db_url, "sync", "--full", "--account", "acme.xx")
        assert "no account 'acme.xx'" in assert_one_line_error(unknown, code=2)

    h, b, w = schema.platform_hotel.c, schema.batch.c, schema.watermark.c
    catalog = query(db_url, sa.select(h.supplier_id, h.supplier_hotel_id, h.supplier_version))
    # acme.us re-saw acme.eu's hotels: one resource per supplier hotel, at day 1's versions.
    acme_truth = sim.ground_truth("acme", "eu")
    acme = {r.supplier_hotel_id: r.supplier_version for r in catalog if r.supplier_id == 1001}
    assert {k: acme.get(k) for k in acme_truth.valid} == dict(acme_truth.valid)
    globex_truth = sim.ground_truth("globex", "main", day=0)
    globex = {r.supplier_hotel_id: r.supplier_version for r in catalog if r.supplier_id == 2002}
    assert globex == dict(globex_truth.valid)
    tasks = {r.task_code for r in query(db_url, sa.select(b.task_code))}
    assert tasks == {"acme.eu.full", "acme.us.full", "globex.main.full", "acme.eu.incremental"}
    marks = query(db_url, sa.select(w.task_code))
    assert [m.task_code for m in marks] == ["acme.eu.incremental"]
    # Every row a batch wrote names a batch of that supplier's accounts only.
    owner = dict(query(db_url, sa.select(b.batch_id, b.task_code)))
    for row in query(db_url, sa.select(h.supplier_id, h.last_batch_id)):
        assert owner[row.last_batch_id].startswith(
            "acme." if row.supplier_id == 1001 else "globex."
        )


def test_accounts_check_loads_the_definitions_and_names_a_bad_field(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    with suppliers_file(fleet(), tmp_path, monkeypatch) as path:
        checked = run(capsys, "accounts", "check", "--json")
        assert checked.code == 0, checked
        result = json.loads(checked.out)
        assert result["accounts"] == ["acme.eu", "acme.us", "globex.main", "globex.asia"]
        assert result["jobs"] >= 4 * 5
        path.write_text(path.read_text().replace("supplier_id: 2002", "supplier_id: 1001"))
        bad = run(capsys, "accounts", "list")
        line = assert_one_line_error(bad, code=2)
        assert "'acme' and 'globex' share supplier_id 1001" in line and str(path) in line


def test_metrics_and_alerts_judge_every_accounts_task(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    db_url: str,
):
    SyncDatabase.open(db_url).dispose()  # metrics only reads: the database must be there
    with suppliers_file(fleet(), tmp_path, monkeypatch):
        shown = run(capsys, "--db-url", db_url, "metrics", "show", "--json")
        assert shown.code == 0, shown
        tasks = [json.loads(line)["task_code"] for line in shown.out.splitlines()]
        assert tasks == [f"{s}.{a}.full" for s, a in KEYS]
        checked = run(capsys, "--db-url", db_url, "alerts", "check", "--json")
        assert checked.code == 0, checked
        rounds = [json.loads(line) for line in checked.out.splitlines()]
        assert [r["task"] for r in rounds] == tasks
        one = run(capsys, "--db-url", db_url, "alerts", "check", "--task", "acme.us.full")
        assert one.code == 0 and one.out.startswith("acme.us.full: "), one
        unnamed = run(capsys, "--db-url", db_url, "alerts", "thresholds")
        line = assert_one_line_error(unnamed, code=2)
        assert "name the task with --task" in line and "globex.asia.full" in line
        named = run(
            capsys, "--db-url", db_url, "alerts", "thresholds", "--task", "acme.eu.full", "--json"
        )
        assert named.code == 0 and "freshness_sla_hours" in named.out, named
        # A command that calls a supplier never falls back to the SUPPLIER_SYNC_SUPPLIER_*
        # one in a deployment of accounts: it asks which account.
        for argv in (("sync", "--full"), ("reconcile",), ("dead-letters", "compensate")):
            line = assert_one_line_error(run(capsys, "--db-url", db_url, *argv), code=2)
            assert "name one with --account" in line, argv
        healed = run(
            capsys,
            "--db-url",
            db_url,
            "dead-letters",
            "compensate",
            "--account",
            "acme.eu",
            "--json",
        )
        assert healed.code == 0, healed
        assert json.loads(healed.out)["claimed"] == 0


def test_serve_api_confirms_each_suppliers_offers_with_its_own_account(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
):
    """With a suppliers file, an offer is confirmed through an account of its hotel's
    supplier (the first one listed whose key is set), never another supplier's."""

    db_url = f"sqlite:///{tmp_path / 'sync.sqlite3'}"
    sim = fleet()
    with suppliers_file(sim, tmp_path, monkeypatch):
        for code in ("acme.eu", "globex.main"):
            assert run(capsys, "--db-url", db_url, "sync", "--full", "--account", code).code == 0
        # globex.main's key is gone from serve-api's environment: globex.asia confirms.
        env = {k: v for k, v in os.environ.items() if k != "GLOBEX_MAIN_KEY"}
        env["SUPPLIER_SYNC_API_KEYS"] = READ_API_KEY
        offers = query(
            db_url,
            sa.text(
                "SELECT h.supplier_id, min(h.resource_id) AS rid FROM platform_hotel_resource h "
                "GROUP BY h.supplier_id ORDER BY h.supplier_id"
            ),
        )
        picks = {}
        for row in offers:
            picks[row.supplier_id] = query(
                db_url,
                sa.text(
                    "SELECT resource_id, room_code, rate_plan_code FROM platform_hotel_offer "
                    "WHERE resource_id = :rid AND active = 1 ORDER BY offer_id LIMIT 1"
                ).bindparams(rid=row.rid),
            )[0]
        before = sim.stats()
        port = free_port()
        proc = cli_process("--db-url", db_url, "serve-api", "--port", str(port), env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for_http(f"{base}/health", proc)
            for sid in (1001, 2002):
                offer = picks[sid]
                quote = httpx.post(
                    f"{base}/offers/confirm",
                    json={
                        "hotel_id": offer.resource_id,
                        "room_code": offer.room_code,
                        "rate_plan_code": offer.rate_plan_code,
                        **stay(),
                        "guests": 1,
                    },
                    headers=READ_API_HEADERS,
                    timeout=30,
                )
                assert quote.status_code == 200, quote.text
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
    after = sim.stats()
    used = {
        (s, a)
        for s in after
        for a in after[s]
        if after[s][a]["requests_total"] > before[s][a]["requests_total"]
    }
    assert used == {("acme", "eu"), ("globex", "asia")}, (used, err)
    assert "GLOBEX_MAIN_KEY is not set" in err
