"""The README's main command (a full sync through Dagster) and the lease demonstration, as a
user runs them; every other subcommand is in test_cli.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from supplier_sync_dagster.cli.lease_demo import run_demo


def test_readme_main_command_syncs_then_publishes_only_changes(tmp_path: Path):
    env = dict(os.environ, SUPPLIER_SYNC_HOME=str(tmp_path / "home"))
    for name in ("SUPPLIER_SYNC_DB_URL", "DAGSTER_HOME", "SUPPLIER_SYNC_PAYLOAD_URL"):
        env.pop(name, None)
    cli = Path(sys.executable).parent / "supplier-sync"
    small = ["demo", "--cities", "8", "--hotels", "1500", "--second-hotels", "300"]
    first = subprocess.run(
        [str(cli), *small], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 0, first.stdout + first.stderr
    assert ": SUCCESS (" in first.stdout and "DOES NOT ADD UP" not in first.stdout
    assert "dead letters by code: " in first.stdout and "NEW" in first.stdout
    # The second supplier syncs through its own account, into the same catalog.
    assert "a second supplier, globex (supplier 2002, account globex.main" in first.stdout
    catalog = next(ln for ln in first.stdout.splitlines() if ln.startswith("one catalog"))
    assert "supplier 1001: " in catalog and "supplier 2002: " in catalog
    assert int(catalog.split("supplier 2002: ")[1].split()[0]) > 200
    second = subprocess.run(
        [str(cli), *small], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "(day 1," in second.stdout
    by_action = next(ln for ln in second.stdout.splitlines() if ln.startswith("diffs by action:"))
    assert "IGNORE" in by_action  # unchanged hotels are not published again
    published = int(second.stdout.split(" = published ")[1].split()[0])
    records = int(second.stdout.split("records ")[1].split()[0])
    assert 0 < published < records / 3  # a day's changes, not the catalog

    hotels = subprocess.run(
        [str(cli), "export", "published", "--format", "jsonl"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert hotels.returncode == 0, hotels.stderr
    rows = [json.loads(line) for line in hotels.stdout.splitlines()]
    assert len(rows) > 1000
    required = {
        "supplier_id",
        "supplier_hotel_id",
        "supplier_version",
        "platform_resource_id",
        "publish_version",
        "name",
        "city_code",
        "offers",
    }
    assert all(required <= set(r) for r in rows)
    assert any(r["publish_version"] == 2 for r in rows)  # changed on day 1
    letters = subprocess.run(
        [str(cli), "export", "dead-letters", "--format", "jsonl"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    dead = [json.loads(line) for line in letters.stdout.splitlines()]
    assert dead and all(
        {"supplier_hotel_id", "error_stage", "error_code", "status"} <= set(d) for d in dead
    )
    assert {d["error_stage"] for d in dead} <= {"ADAPTER", "VALIDATION"}
    assert all(d["error_code"] and d["status"] == "MANUAL_FIX" for d in dead)


def test_lease_demonstration_on_the_embedded_default(tmp_path: Path):
    env = dict(os.environ, SUPPLIER_SYNC_HOME=str(tmp_path / "home"))
    env.pop("SUPPLIER_SYNC_DB_URL", None)
    cli = Path(sys.executable).parent / "supplier-sync"
    proc = subprocess.run(
        [str(cli), "lease-demo"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "KILLED (exit 137)" in proc.stdout
    assert "resuming at page" in proc.stdout
    assert "ALL CHECKS PASSED" in proc.stdout
    # Its own database and payloads, never the catalog's default file.
    own = tmp_path / "home" / "lease-demo" / "sync.sqlite3"
    assert own.exists() and (tmp_path / "home" / "lease-demo" / "payloads").is_dir()
    assert not (tmp_path / "home" / "sync.sqlite3").exists()
    assert f"sync database: sqlite:///{own}" in proc.stdout

    status = subprocess.run(
        [str(cli), "--db-url", f"sqlite:///{own}", "status"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0 and "SUCCESS" in status.stdout


def test_demo_on_mariadb_resumes_the_killed_workers_city(fresh_mysql_db: str):
    report = run_demo(db_url=fresh_mysql_db, echo=False, page_delay=0.02)
    assert report.problems == []
    assert report.crashed_worker_exit == 137
    killed_city = report.shards[0]
    assert killed_city.claim_count == 2  # claimed by A, reclaimed by B after expiry
    assert killed_city.pages_done == report.expected_pages[killed_city.shard_key]
    assert report.snapshot_rows == sum(report.expected_pages.values())
