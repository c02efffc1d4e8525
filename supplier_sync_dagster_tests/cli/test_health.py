"""``supplier-sync metrics show|serve`` as a user calls them, after a real ``sync --full`` over
HTTP against a supplier with broken records (SQLite and MariaDB); the served text is parsed
with prometheus_client's own parser."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supplier_sync_dagster_tests.cli.test_main import (
    CONSOLE_SCRIPT,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    run,
    simulator,
    supplier,
    sync,
)
from supplier_sync_dagster_tests.helpers import free_port


def test_metrics_show_and_serve_the_sync_health(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sim = simulator(faults={"bad_record_rate": 0.08, "rate_503": 0.3})
    truth = sim.ground_truth()
    with supplier(sim, monkeypatch):
        summary = sync(capsys, db_url, "--json")
        assert summary.code == 0, summary
    shown = run(capsys, "--db-url", db_url, "metrics", "show", "--json")
    assert shown.code == 0, shown
    health = json.loads(shown.out)
    values = health["values"]
    assert values["batch_success_rate_24h"] == 1.0 and values["city_success_rate_24h"] == 1.0
    records = len(truth.valid) + len(truth.bad)
    assert values["latest_records"] == records
    assert values["bad_record_ratio"] == pytest.approx(len(truth.bad) / records, abs=1e-6)
    assert values["dead_letters_open"] == len(truth.bad)
    assert values["supplier_requests_24h"] > 0 and values["supplier_retries_24h"] > 0
    assert set(health["city_lag_hours"]) == set(truth.listed_by_city)
    assert values["freshness_max_hours"] < 1
    assert health["missing_field_rate"]["hotel_id"] == 0.0
    assert any(rate > 0 for rate in health["missing_field_rate"].values())  # dropped fields
    text = run(capsys, "--db-url", db_url, "metrics", "show")
    assert text.code == 0 and "bad_record_ratio" in text.out

    port = free_port()
    env = dict(os.environ)
    proc = subprocess.Popen(
        [str(CONSOLE_SCRIPT), "--db-url", db_url, "metrics", "serve", "--port", str(port),
         "--host", "127.0.0.1", "--interval", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                began = time.perf_counter()
                body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                scrape = time.perf_counter() - began
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "metrics serve did not answer"
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    families = {f.name: f for f in text_string_to_metric_families(body)}
    task = {"task": "hotel_supplier_full_resource"}

    def value(name: str, **labels: str) -> float:
        for s in families[name].samples:
            if s.labels == labels:
                return float(s.value)
        raise AssertionError(f"{name}{labels} not served: {families[name].samples}")

    assert value("supplier_sync_batch_success_ratio", **task) == 1.0
    assert value("supplier_sync_bad_record_ratio", **task) == pytest.approx(
        values["bad_record_ratio"]
    )
    assert value("supplier_sync_supplier_requests", **task) == values["supplier_requests_24h"]
    assert value("supplier_sync_dead_letters", status="MANUAL_FIX") == len(truth.bad)
    assert value("supplier_sync_dead_letters_open", **{"class": "NEEDS_PERSON"}) == len(truth.bad)
    cities = {s.labels["city"] for s in families["supplier_sync_city_freshness_seconds"].samples}
    assert cities == set(truth.listed_by_city)
    assert value("supplier_sync_health_age_seconds") >= 0
    assert scrape < 1.0  # from cached figures (the benchmark measures it properly)
