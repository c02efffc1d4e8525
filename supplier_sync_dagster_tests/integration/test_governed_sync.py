"""A whole ``supplier-sync sync --full`` under the adaptive rate governor, as a user runs it,
against the simulator as a process of its own keeping a limit it never tells
(``undisclosed_limit``): the catalog ends at the ground truth, the supplier answers fewer
than 1 % of the requests it counts with 429, the governor learnt the limit to within a cut
of it, and the city materializations say what the requests cost of the budget. One sync on
SQLite and one on MariaDB; two accounts' syncs at once on one Redis budget (on a fresh
state folder, each opening the new Dagster home)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa

from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.supplier.governor import GovernorConfig
from supplier_sync_dagster.dagster_instance.home import dagster_instance
from supplier_sync_dagster.defs.city_keys import RAW
from supplier_sync_dagster_tests.cli.test_main import (
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    published,
    query,
    run,
)
from supplier_sync_dagster_tests.core.supplier.governor_load import SIM_KEY, simulator
from supplier_sync_dagster_tests.helpers import cli_process, make_simulator

LIMIT = 50.0
CITIES = 6
HOTELS = 5000
PAGE_SIZE = "5"


# The least share of the limit a run's governed rate may end at, once the limit is learnt
# (at least 0.9 of it): a run may end just after a 429, whose decrease keeps a share of it.
_LEAST_END_RATE = 0.9 * GovernorConfig(start_rate=LIMIT).decrease * 0.999


def _raw_metadata() -> list[dict[str, Any]]:
    """The metadata of every ``raw_hotel_snapshots`` materialization."""
    with dagster_instance() as instance:
        records = instance.fetch_materializations(RAW, limit=1000).records
        out = []
        for record in records:
            mat = record.asset_materialization
            assert mat is not None
            out.append({k: v.value for k, v in mat.metadata.items()})
    return out


def _learnt_ceiling(home: Path) -> float:
    """The limit the in-process governor learnt, from the state it keeps between runs."""
    states = list((home / "home").rglob("governor/*"))
    assert len(states) == 1, states
    return float(json.loads(states[0].read_text())["ceiling"])


@pytest.mark.parametrize(
    ("backend", "limit", "hotels"),
    # MariaDB with a lower limit: one sync there on a small machine asks for less than 50/s.
    [("sqlite", LIMIT, HOTELS), pytest.param("mariadb", 25.0, HOTELS, marks=pytest.mark.mariadb)],
)
def test_an_adaptive_sync_full_learns_an_undisclosed_limit_and_ends_at_the_truth(
    backend: str,
    limit: float,
    hotels: int,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    db_url = (
        f"sqlite:///{tmp_path / 'sync.sqlite3'}"
        if backend == "sqlite"
        else str(request.getfixturevalue("fresh_mysql_db"))
    )
    truth = make_simulator(seed=42, n_cities=CITIES, total_hotels=hotels).ground_truth()
    monkeypatch.setenv("SUPPLIER_SYNC_RATE_GOVERNOR", "adaptive")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT", str(limit / 2))
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", SIM_KEY)
    with simulator(limit, "undisclosed_limit", cities=CITIES, hotels=hotels) as url:
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", url)
        argv = ("--db-url", db_url, "sync", "--full", "--page-size", PAGE_SIZE)
        done = run(capsys, *argv, "--json", "--trigger-id", "governed-1")
        seen = httpx.get(f"{url}/_sim/stats").json()
    assert done.code == 0, done
    assert json.loads(done.out)["status"] == "SUCCESS"
    assert published(db_url) == dict(truth.valid)

    requests, refused = seen["requests_total"], seen["responses_429"]
    assert requests > 10 * limit and refused / requests < 0.01, seen
    st = schema.run_stats.c
    (stats,) = query(db_url, sa.select(st.requests, st.throttled, st.governed_rate))
    # The run's own count of its cities' requests is the supplier's (less the city list).
    assert (stats.requests, stats.throttled) == (
        seen["requests_by_endpoint"]["city_hotels"],
        refused,
    )
    ceiling = _learnt_ceiling(tmp_path)
    assert ceiling >= 0.9 * limit, (ceiling, stats, seen)
    assert stats.governed_rate >= _LEAST_END_RATE * limit, (ceiling, stats, seen)
    # The last cities alone do not use the rate: it holds instead of climbing past the limit.
    assert stats.governed_rate <= 1.3 * limit, (ceiling, stats, seen)

    cities = _raw_metadata()
    assert len(cities) == CITIES
    assert sum(m["supplier_requests"] for m in cities) == stats.requests
    assert sum(m["supplier_429"] for m in cities) == refused
    # Paced by the governor: its cities waited for it, each at the rate it had learnt then.
    assert sum(m["rate_limiter_wait_seconds"] for m in cities) > 0
    assert all(m["governed_rate"] > 0 for m in cities), cities


@pytest.mark.parametrize(
    ("backend", "limit"),
    # MariaDB with the lower limit: a limit the two syncs never ask for is never learnt.
    [("sqlite", LIMIT), pytest.param("mariadb", 25.0, marks=pytest.mark.mariadb)],
)
def test_two_accounts_on_one_key_sync_at_once_on_one_redis_budget_and_learn_its_limit(
    backend: str,
    limit: float,
    tmp_path: Path,
    redis_url: str,
    request: pytest.FixtureRequest,
) -> None:
    """Two ``sync --full`` processes of two accounts naming one ``rate_budget`` pace on one
    Redis budget against a limit the supplier keeps for their one key: together they learn it,
    not twice it, and both end at the truth."""
    db_url = (
        f"sqlite:///{tmp_path / 'sync.sqlite3'}"
        if backend == "sqlite"
        else str(request.getfixturevalue("fresh_mysql_db"))
    )
    hotels = HOTELS // 2
    truth = make_simulator(seed=42, n_cities=CITIES, total_hotels=hotels).ground_truth()
    budget = f"k{uuid.uuid4().hex[:12]}"
    with simulator(limit, "undisclosed_limit", cities=CITIES, hotels=hotels) as url:
        accounts = "".join(
            f"      {a}: {{api_key_env: SIM_KEY_ENV, rate_limit_rps: {limit / 4}, "
            f"rate_budget: {budget}}}\n"
            for a in ("eu", "us")
        )
        path = tmp_path / "suppliers.yaml"
        path.write_text(
            f"suppliers:\n  acme:\n    supplier_id: 1001\n    base_url: {url}\n"
            f"    accounts:\n{accounts}"
        )
        env = {
            **os.environ,
            "SIM_KEY_ENV": SIM_KEY,
            "SUPPLIER_SYNC_SUPPLIERS_FILE": str(path),
            "SUPPLIER_SYNC_REDIS_URL": redis_url,
            "SUPPLIER_SYNC_RATE_GOVERNOR": "adaptive",
        }
        argv = ("--db-url", db_url, "sync", "--full", "--page-size", PAGE_SIZE, "--json")
        procs = [cli_process(*argv, "--account", f"acme.{a}", env=env) for a in ("eu", "us")]
        ends = [p.communicate(timeout=600) for p in procs]
        seen = httpx.get(f"{url}/_sim/stats").json()
    for proc, (out, err) in zip(procs, ends, strict=True):
        assert proc.returncode == 0, (out, err)
        assert json.loads(out)["status"] == "SUCCESS", out
    assert published(db_url) == dict(truth.valid)

    requests, refused = seen["requests_total"], seen["responses_429"]
    assert requests > 10 * limit and refused / requests < 0.01, seen
    r = redis.Redis.from_url(redis_url)
    (key,) = r.scan_iter(match=f"*budget/{budget}*:governor")
    ceiling = float(r.hget(key, "ceiling") or 0)
    st = schema.run_stats.c
    rates = [rate for (rate,) in query(db_url, sa.select(st.governed_rate))]
    assert ceiling >= 0.9 * limit and len(rates) == 2, (ceiling, rates, seen)
    assert all(_LEAST_END_RATE * limit <= rate <= 1.3 * limit for rate in rates), (ceiling, rates)
