"""Many suppliers, many accounts: definitions generated from the suppliers file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.accounts import load_accounts
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.settings import load_settings
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.definitions import defs
from supplier_sync_dagster.defs.accounts import ACCOUNT_TAG, CATALOG, AccountScope, account_scopes
from supplier_sync_dagster.defs.city_discovery_sensor import build_city_discovery_sensor
from supplier_sync_dagster.defs.city_sync import build_city_sync
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SupplierResource,
    SyncDatabaseResource,
    account_supplier,
)
from supplier_sync_dagster.simulator import Simulator, SimulatorConfig

SUPPLIERS = """
suppliers:
  acme:
    supplier_id: 1001
    simulator: {seed: 11, cities: 4, hotels: 160, profile: clean}
    accounts:
      eu: {api_key_env: ACME_EU_KEY, rate_limit_rps: 20}
      us:
        rate_limit_rps: 7
        page_size: 50
        city_threads: 2
        schedules: {incremental: null, compensation: null, full: "15 1 * * *"}
  globex:
    supplier_id: 2002
    simulator: {seed: 12, cities: 4, hotels: 160, profile: clean}
    accounts:
      main: {}
      asia: {simulator_profile: hostile}
"""
ACCOUNTS = ["acme.eu", "acme.us", "globex.main", "globex.asia"]


@pytest.fixture
def suppliers_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name in ("SUPPLIER_SYNC_SUPPLIER_URL", "SUPPLIER_SYNC_REDIS_URL", "SUPPLIER_SYNC_DB_URL"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "suppliers.yaml"
    path.write_text(SUPPLIERS)
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIERS_FILE", str(path))
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "home"))
    yield path


def test_each_account_has_its_own_jobs_assets_partitions_and_supplier(suppliers_file: Path):
    with dg.instance_for_test():
        loaded = defs()
    dg.Definitions.validate_loadable(loaded)
    repo = loaded.get_repository_def()
    keys = {k.to_user_string() for k in repo.asset_graph.get_all_asset_keys()}
    for code in ACCOUNTS:
        prefix = code.replace(".", "/")
        names = code.replace(".", "__")
        assert {f"{prefix}/{a}" for a in ("raw_hotel_snapshots", "published_hotels")} <= keys
        assert f"{prefix}/hotel_change_feed" in keys and f"{prefix}/sync_health" in keys
        for job in ("full_sync_job", "catalog_reconciliation_job", "compensate_dead_letters"):
            assert repo.has_job(f"{names}__{job}")
            assert repo.get_job(f"{names}__{job}").tags[ACCOUNT_TAG] == code
        assert f"{names}__city_discovery_sensor" in {s.name for s in repo.sensor_defs}
    # No account is the unnamed default any more; the catalog is the one shared sink.
    assert "published_hotels" not in keys and not repo.has_job("full_sync_job")
    graph = repo.asset_graph
    assert {k.to_user_string() for k in graph.get(CATALOG).parent_keys} == {
        f"{c.replace('.', '/')}/published_hotels" for c in ACCOUNTS
    }
    projection = graph.get(dg.AssetKey("hotel_search_projection"))
    assert projection.parent_keys == {CATALOG}
    schedules = {s.name: s for s in repo.schedule_defs}
    assert "acme__us__incremental_sync_schedule" not in schedules  # null: never scheduled
    assert "acme__us__dead_letter_compensation_schedule" not in schedules
    assert schedules["acme__eu__dead_letter_compensation_schedule"].cron_schedule == "*/5 * * * *"
    assert schedules["acme__us__nightly_full_sync"].cron_schedule == "15 1 * * *"
    assert schedules["acme__eu__incremental_sync_schedule"].cron_schedule == "*/5 * * * *"
    resources = loaded.resources or {}
    eu, us = resources["supplier__acme__eu"], resources["supplier__acme__us"]
    assert isinstance(eu, SupplierResource) and isinstance(us, SupplierResource)
    assert (eu.supplier_id, eu.account, eu.task_code, eu.rate_limit_rps) == (
        1001,
        "acme.eu",
        "acme.eu.full",
        20,
    )
    assert (us.rate_limit_rps, us.page_size, us.city_threads) == (7, 50, 2)
    assert eu.city_threads == 1
    assert "supplier" not in resources


def test_a_bad_suppliers_file_stops_the_load_naming_the_field(
    suppliers_file: Path,
):
    suppliers_file.write_text(SUPPLIERS.replace("rate_limit_rps: 7", "rate_limit_rps: fast"))
    with dg.instance_for_test(), pytest.raises(Exception) as caught:
        defs()
    # Dagster wraps it in the tree of the defs folder; the cause is ours, naming the field.
    err: BaseException | None = caught.value
    while err is not None and not isinstance(err, ConfigError):
        err = err.__cause__ or err.__context__
    assert err is not None, caught.value
    assert f"{suppliers_file}: suppliers.acme.accounts.us.rate_limit_rps" in str(err)


def _resources(tmp_path: Path, scope: AccountScope) -> dict[str, object]:
    return {
        "sync_db": SyncDatabaseResource(db_url=f"sqlite:///{tmp_path / 'sync.sqlite3'}"),
        "payloads": PayloadStoreResource(url=f"file://{tmp_path / 'payloads'}"),
        "governance": GovernanceResource(),
        scope.supplier_key: account_supplier(load_settings(), scope),
    }


def test_accounts_sync_apart_into_one_catalog_per_supplier(suppliers_file: Path, tmp_path: Path):
    scopes = {s.code: s for s in account_scopes()}
    cities = {}
    for seed in (11, 12):
        world = Simulator(SimulatorConfig(seed=seed, n_cities=4, total_hotels=160))
        truth = world.ground_truth()
        city = max(world.city_codes(), key=lambda c: len(truth.valid_by_city.get(c, {})))
        cities[seed] = (city, len(truth.valid_by_city[city]))
    published: dict[str, int] = {}
    with dg.instance_for_test() as instance:
        for code in ("acme.eu", "acme.us", "globex.main"):
            scope = scopes[code]
            key = encode_city_key(cities[11 if code.startswith("acme") else 12][0])
            instance.add_dynamic_partitions(scope.partitions_name, [key])
            result = dg.materialize(
                [build_city_sync(scope)],
                partition_key=key,
                resources=_resources(tmp_path, scope),
                instance=instance,
                tags={"supplier_sync/trigger_id": f"t-{code}"},
            )
            assert result.success
            mats = result.asset_materializations_for_node(scope.name("city_sync"))
            assert {m.asset_key for m in mats} >= {scope.key("published_hotels")}
            assert all(m.partition == key for m in mats)
    db = SyncDatabase.open(f"sqlite:///{tmp_path / 'sync.sqlite3'}")
    try:
        with db.engine.connect() as conn:
            b, h = schema.batch.c, schema.platform_hotel.c
            tasks = dict(conn.execute(sa.select(b.trigger_id, b.task_code)).all())
            for code in ("acme.eu", "acme.us", "globex.main"):
                published[code] = conn.execute(
                    sa.select(sa.func.count()).where(
                        h.last_batch_id.in_(
                            sa.select(b.batch_id).where(b.task_code == f"{code}.full")
                        )
                    )
                ).scalar_one()
            by_supplier: dict[int, int] = dict(
                conn.execute(
                    sa.select(h.supplier_id, sa.func.count()).group_by(h.supplier_id)
                ).all()
            )
    finally:
        db.dispose()
    assert tasks == {f"t-{c}": f"{c}.full" for c in ("acme.eu", "acme.us", "globex.main")}
    expected = cities[11][1]
    # acme's two accounts see one hotel as one platform resource: us re-saw eu's hotels
    # unchanged (nothing newly published), while globex's are its own resources.
    assert by_supplier[1001] == expected and published["acme.eu"] == expected
    assert published["acme.us"] == 0
    assert by_supplier[2002] == published["globex.main"] == cities[12][1]


def test_discovery_adds_the_accounts_own_partitions(suppliers_file: Path, tmp_path: Path):
    scope = {s.code: s for s in account_scopes()}["globex.main"]
    sensor = build_city_discovery_sensor(scope)
    resources = {
        scope.supplier_key: account_supplier(load_settings(), scope),
        "sync_db": SyncDatabaseResource(db_url=f"sqlite:///{tmp_path / 'sync.db'}"),
    }
    with (
        dg.instance_for_test() as instance,
        dg.build_sensor_context(instance=instance, resources=resources) as ctx,
    ):
        result = sensor(ctx)
    assert isinstance(result, dg.SensorResult)
    (request,) = result.dynamic_partitions_requests or []
    assert request.partitions_def_name == "globex__main__city" and len(request.partition_keys) == 4


def test_every_account_has_its_own_rate_limit_bucket(suppliers_file: Path, redis_url: str):
    settings = load_settings()
    buckets = set()
    for scope in account_scopes():
        resource = account_supplier(settings, scope).model_copy(update={"redis_url": redis_url})
        with resource.client() as client:
            buckets.add(getattr(client.rate_limiter, "key", None))
    assert None not in buckets and len(buckets) == len(ACCOUNTS)
    assert len(load_accounts(suppliers_file)) == len(ACCOUNTS)
