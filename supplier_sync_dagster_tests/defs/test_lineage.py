"""The lineage sensors send each run's events from Dagster's record of it (a run of a job,
an ad hoc asset run, a failed one with Dagster's message), the definitions bind the lineage
resource from the settings, and a bad lineage URL stops them loading with a clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.settings import Settings, env_name
from supplier_sync_dagster.defs.city_sync import city_sync
from supplier_sync_dagster.defs.full_sync_schedule import full_sync_job
from supplier_sync_dagster.defs.lineage import (
    LineageResource,
    build_lineage_sensors,
    defs,
    job_name,
)
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    HttpSupplierResource,
    PayloadStoreResource,
    SyncDatabaseResource,
)
from supplier_sync_dagster.simulator import FaultProfile, running_server
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, Receiver, make_simulator
from supplier_sync_dagster_tests.openlineage_schema import validate_run_event


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for field in Settings.model_fields:
        monkeypatch.delenv(env_name(field), raising=False)
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "home"))


def sensor(name: str) -> Any:
    return next(s for s in build_lineage_sensors() if s.name == name)


def test_a_gated_runs_sensors_send_start_and_fail_with_the_failed_check(
    db_url: str, tmp_path: Path
):
    instance = dg.DagsterInstance.ephemeral(tempdir=str(tmp_path / "dagster"))
    sim = make_simulator(
        FaultProfile.clean().with_(bad_record_rate=0.5), seed=81, n_cities=3, total_hotels=300
    )
    city = sim.world.cities[0].code
    instance.add_dynamic_partitions("supplier_city", [encode_city_key(city)])
    sync_db = SyncDatabaseResource(db_url=db_url)
    with running_server(sim) as url:
        # A run of a job of the code location, as the schedule launches it.
        definitions = dg.Definitions(
            assets=[city_sync],
            jobs=[full_sync_job],
            resources={
                "sync_db": sync_db,
                "payloads": PayloadStoreResource(url=f"file://{tmp_path}/payloads"),
                "supplier": HttpSupplierResource(base_url=url, api_key=SIM_API_KEY),
                "governance": GovernanceResource(),
            },
        )
        gated = definitions.resolve_job_def("full_sync_job").execute_in_process(
            instance=instance, partition_key=encode_city_key(city), raise_on_error=False
        )
    assert not gated.success and not gated.dagster_run.asset_selection
    by_type = {e.event_type: e for e in gated.all_events}
    with Receiver.serve() as receiver:
        resources = {"lineage": LineageResource(url=receiver.url), "sync_db": sync_db}
        for name, event_type in (
            ("lineage_on_run_start", dg.DagsterEventType.RUN_START),
            ("lineage_on_run_failure", dg.DagsterEventType.RUN_FAILURE),
        ):
            context = dg.build_run_status_sensor_context(
                sensor_name=name,
                dagster_instance=instance,
                dagster_run=gated.dagster_run,
                dagster_event=by_type[event_type],
                resources=resources,
                repository_def=definitions.get_repository_def(),
            )
            sensor(name)(context)
    for body in receiver.bodies:
        validate_run_event(body)
    start, fail = receiver.bodies
    assert (start["eventType"], fail["eventType"]) == ("START", "FAIL")
    assert start["run"]["runId"] == fail["run"]["runId"] == gated.run_id
    assert start["job"]["name"] == fail["job"]["name"] == "full_sync_job"
    assert fail["run"]["facets"]["errorMessage"]["message"]
    (listings,) = fail["inputs"]
    failed = {
        (a["assertion"], a["params"].get("city"))
        for a in listings["inputFacets"]["dataQualityAssertions"]["assertions"]
        if not a["success"]
    }
    assert failed == {("bad_record_ratio", None), ("bad_record_ratio", city)}


def test_an_ad_hoc_asset_runs_job_is_its_accounts_city_sync_or_its_assets():
    keys = [
        dg.AssetKey(["acme", "eu", "raw_hotel_snapshots"]),
        dg.AssetKey(["acme", "eu", "published_hotels"]),
    ]
    assert job_name("__ASSET_JOB", keys) == "acme__eu__full_sync_job"
    assert job_name("__ASSET_JOB", [dg.AssetKey("sync_health")]) == "sync_health"
    assert job_name("outbox_dispatch_job", keys) == "outbox_dispatch_job"


def test_the_definitions_bind_the_settings_and_refuse_a_bad_lineage_url(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setenv("SUPPLIER_SYNC_LINEAGE_URL", "http://marquez.internal:5000")
    monkeypatch.setenv("SUPPLIER_SYNC_LINEAGE_API_KEY", "lineage-key-0123456789")
    monkeypatch.setenv("SUPPLIER_SYNC_LINEAGE_TIMEOUT_SECONDS", "0.5")
    loaded = defs()
    assert loaded.resources is not None
    lineage = loaded.resources["lineage"]
    assert isinstance(lineage, LineageResource)
    # The URL and key reach the resource as the variables, never as values in its config.
    assert isinstance(lineage.url, dg.EnvVar) and isinstance(lineage.api_key, dg.EnvVar)
    assert lineage.timeout_seconds == 0.5
    assert {s.name for s in loaded.sensors or ()} == {
        "lineage_on_run_start",
        "lineage_on_run_success",
        "lineage_on_run_failure",
        "lineage_on_run_canceled",
    }
    monkeypatch.setenv("SUPPLIER_SYNC_LINEAGE_URL", "marquez.internal:5000")
    with pytest.raises(
        ConfigError, match=r"^SUPPLIER_SYNC_LINEAGE_URL: expected a http:// or https:// URL"
    ):
        defs()
