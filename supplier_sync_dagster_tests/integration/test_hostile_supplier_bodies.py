"""A supplier whose bodies are hostile (the simulator's modes ``slow_body``, ``inflating_body``,
``huge_body``, ``deep_json``, ``truncated_body`` and ``bad_bytes`` on one city), through
``supplier-sync sync --full`` as a user runs it, over HTTP, on SQLite and MariaDB.

The command ends by itself within its deadlines, exits non-zero with one line naming the
cause, files the city's CITY_FAILED ticket and leaves no batch RUNNING; every valid hotel of
the other cities is published and nothing of the hostile city is. A page with one hotel whose
name is not UTF-8 costs that hotel only: an ``INVALID_UTF8`` dead letter, the rest published.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.simulator import Simulator, running_server
from supplier_sync_dagster_tests.cli.test_main import (  # noqa: F401  (cli_home: an autouse fixture)
    assert_one_line_error,
    cli_home,
    published,
    query,
    run,
    simulator,
    supplier,
    sync,
)
from supplier_sync_dagster_tests.helpers import SIM_API_KEY

DEADLINE = 1.0
"""The request deadline the tests set (``SUPPLIER_SYNC_SUPPLIER_REQUEST_DEADLINE``)."""

# mode -> (what the one line names, the most the command may take in seconds). A slow or cut
# body is retried by the default policy (6 attempts, backoff up to 15.5 s in all); the others
# are refused at once.
FAILING: dict[str, tuple[tuple[str, ...], float]] = {
    "slow_body": (("SUPPLIER_TIMEOUT: ", "1 s request deadline"), 6 * DEADLINE + 15.5 + 30),
    "truncated_body": (("TRUNCATED_BODY: ", "body cut short"), 15.5 + 30),
    "inflating_body": (("DECOMPRESSION_BOMB: ", "body inflates past the 16,777,216 byte cap"), 30),
    "huge_body": (("BODY_TOO_LARGE: ", "over the 8,388,608 byte cap"), 30),
    "deep_json": (("JSON_TOO_DEEP: ", "nests deeper than 1024 levels"), 30),
}


def _world(mode: str) -> tuple[Simulator, str, dict[str, int], set[str]]:
    """A small world with ``mode`` on its first city: the simulator, that city, the valid
    hotels of the other cities (id -> version) and the hostile city's hotels."""
    sim = simulator(n_cities=4, total_hotels=400, late_arrival_rate=0.0)
    truth = sim.ground_truth()
    city = next(c for c, ids in truth.listed_by_city.items() if ids)
    sim.set_modes([mode], [city])
    truth = sim.ground_truth()
    hostile = set(truth.listed_by_city[city])
    others = {h: v for h, v in truth.valid.items() if h not in hostile}
    assert others
    return sim, city, others, hostile


@contextmanager
def _serving(sim: Simulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The simulator over HTTP, the client's deadline short."""
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_REQUEST_DEADLINE", str(DEADLINE))
    server_log = logging.getLogger("uvicorn.error")
    quiet = logging.Filter("nothing")  # the server would log each answer the client hung up on
    with supplier(sim, monkeypatch):
        server_log.addFilter(quiet)
        try:
            yield
        finally:
            server_log.removeFilter(quiet)


def _shards_and_tickets(db_url: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    b, sh, d = schema.batch.c, schema.shard.c, schema.dead_letter.c
    batches = query(db_url, sa.select(b.status))
    assert batches and all(status != "RUNNING" for (status,) in batches), batches
    shards = query(db_url, sa.select(sh.shard_key, sh.status).order_by(sh.shard_key))
    letters = query(db_url, sa.select(d.city_code, d.error_code).order_by(d.id))
    return [(str(k), str(s)) for k, s in shards], [(str(c), str(e)) for c, e in letters]


@pytest.mark.parametrize("mode", list(FAILING))
def test_a_hostile_body_fails_its_city_in_time_naming_the_cause(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db_url: str, mode: str
):
    names, most = FAILING[mode]
    sim, city, others, hostile = _world(mode)
    with _serving(sim, monkeypatch):
        began = time.monotonic()
        outcome = sync(capsys, db_url)
        took = time.monotonic() - began
    line = assert_one_line_error(outcome)
    assert took < most, f"{mode}: {took:.1f} s"
    assert f"1 city of 4 failed ('{city}'" in line or f"({city!r}" in line, line
    for name in names:
        assert name in line, line
    pub = published(db_url)
    assert {h: pub.get(h) for h in others} == others
    assert not hostile & set(pub)
    shards, letters = _shards_and_tickets(db_url)
    assert dict(shards)[city] == "FAILED"
    assert all(status == "SUCCESS" for key, status in shards if key != city)
    assert letters == [(city, "CITY_FAILED")]


def test_one_hotel_with_bytes_that_are_not_utf8_costs_that_hotel_only(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db_url: str
):
    sim, city, _, _ = _world("bad_bytes")
    truth = sim.ground_truth()
    (bad,) = [h for h, why in truth.bad.items() if why == "INVALID_UTF8"]
    with _serving(sim, monkeypatch):
        outcome = sync(capsys, db_url, "--json")
    assert outcome.code == 0, outcome
    summary: dict[str, Any] = json.loads(outcome.out)
    assert summary["status"] == "SUCCESS" and summary["counts_add_up"]
    assert summary["dead_letters_by_code"] == {"INVALID_UTF8": 1}
    assert summary["records"] == summary["published"] + summary["dead_letters"] + summary["skipped"]
    assert published(db_url) == dict(truth.valid)
    assert bad not in truth.valid
    d = schema.dead_letter.c
    (letter,) = query(
        db_url, sa.select(d.supplier_resource_code, d.error_code, d.city_code, d.error_message)
    )
    assert letter[:3] == (bad, "INVALID_UTF8", city)
    assert letter[3].startswith("name holds bytes that are not UTF-8 (0xFF)")
    # The page's bytes are stored as received, and read again the same way: a replay (no
    # supplier) finds the same records, the same dead letter, the rest unchanged.
    dry = run(capsys, "--db-url", db_url, "replay", "--city", city, "--dry-run", "--json")
    assert dry.code == 0, dry
    (report,) = [json.loads(line) for line in dry.lines]
    assert report["records"] == len(truth.listed_by_city[city])
    assert report["dead_letters"] == 1
    assert report["diffs_by_type"] == {"NO_CHANGE": len(truth.listed_by_city[city]) - 1}


# --- memory -----------------------------------------------------------------------------------


def _peak_rss_of_a_sync(sim: Simulator, db_url: str, home: Path) -> tuple[int, str, float]:
    """``supplier-sync sync --full`` in its own process: exit status, stderr, peak RSS (MiB).

    The peak is the process's own high-water mark (``VmHWM``, which its exec starts afresh),
    read until it exits: ``ru_maxrss`` would count the test process it was forked from.
    """
    with running_server(sim) as url:
        env = {
            **os.environ,
            "SUPPLIER_SYNC_SUPPLIER_URL": url,
            "SUPPLIER_SYNC_SUPPLIER_API_KEY": SIM_API_KEY,
            "SUPPLIER_SYNC_SUPPLIER_REQUEST_DEADLINE": str(DEADLINE),
            "SUPPLIER_SYNC_HOME": str(home),
        }
        child = subprocess.Popen(
            [sys.executable, "-m", "supplier_sync_dagster.cli", "--db-url", db_url]
            + ["sync", "--full", "--processes", "0"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        peak = [0]
        watcher = threading.Thread(target=_watch_high_water, args=(child, peak), daemon=True)
        watcher.start()
        _, err = child.communicate()
        watcher.join(timeout=5)
    return child.returncode, err.decode(), peak[0] / 1024


def _watch_high_water(child: subprocess.Popen[bytes], peak: list[int]) -> None:
    """Keeps ``peak[0]`` at the child's ``VmHWM`` (KiB) while it runs."""
    status = Path(f"/proc/{child.pid}/status")
    while child.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak[0] = max(peak[0], int(line.split()[1]))
        except (OSError, ValueError):
            return
        time.sleep(0.02)


@pytest.mark.parametrize("mode", ["inflating_body", "huge_body"])
def test_a_bomb_or_a_huge_page_leaves_the_sync_in_bounded_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str
):
    sim, _, _, _ = _world(mode)
    code, err, peak = _peak_rss_of_a_sync(sim, f"sqlite:///{tmp_path / 'sync.sqlite3'}", tmp_path)
    assert code == 1, err
    assert ("DECOMPRESSION_BOMB: " if mode == "inflating_body" else "BODY_TOO_LARGE: ") in err
    assert peak < 512, f"{mode}: peak RSS {peak:.0f} MiB"
