"""``sync --full`` sends each run's OpenLineage events (no daemon watches its runs): to an
endpoint on loopback, valid against the spec's schema, a gated city's run with its failed
quality assertions; to the capped file by default; an endpoint that is down or slow never
fails the sync; a bad lineage URL is a one-line error before anything runs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.cli import main as cli
from supplier_sync_dagster.core.lineage.emit import LineageEmitter
from supplier_sync_dagster.core.settings import Settings, env_name
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.simulator import FaultProfile, Simulator, running_server
from supplier_sync_dagster_tests.cli.test_main import query
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, Receiver, free_port, make_simulator
from supplier_sync_dagster_tests.openlineage_schema import validate_run_event

KEY = "lineage-key-0123456789"


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """State and the Dagster instance under the test's folder; no SUPPLIER_SYNC_* leak."""
    for field in Settings.model_fields:
        monkeypatch.delenv(env_name(field), raising=False)
    instance = tmp_path / "dagster_home"
    instance.mkdir()
    (instance / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(instance))
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "home"))
    # main() quietens the supplier client's logger for the process: the test gives it back.
    quietened = logging.getLogger("supplier_sync_dagster.core.supplier")
    monkeypatch.setattr(quietened, "level", quietened.level)
    return tmp_path / "home"


def simulator(**faults: Any) -> Simulator:
    return make_simulator(
        FaultProfile.clean().with_(**faults), seed=51, n_cities=3, total_hotels=300
    )


def sync(db_url: str, sim: Simulator, trigger: str, monkeypatch: pytest.MonkeyPatch) -> int:
    with running_server(sim) as url:
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", url)
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", SIM_API_KEY)
        return cli.main(["--db-url", db_url, "sync", "--full", "--trigger-id", trigger])


def gate_assertions(event: dict[str, Any]) -> list[dict[str, Any]]:
    (listings,) = [d for d in event["inputs"] if d["name"] == "v1/cities/{city_code}/hotels"]
    return list(listings["inputFacets"]["dataQualityAssertions"]["assertions"])


def test_each_run_sends_start_and_its_end_and_a_gated_city_carries_its_failed_check(
    db_url: str, monkeypatch: pytest.MonkeyPatch
):
    sim = simulator(location_rename_from_day=1)
    with Receiver.serve() as receiver:
        monkeypatch.setenv("SUPPLIER_SYNC_LINEAGE_URL", receiver.url.removesuffix("hook"))
        monkeypatch.setenv("SUPPLIER_SYNC_LINEAGE_API_KEY", KEY)
        assert sync(db_url, sim, "day-0", monkeypatch) == 0
        sim.advance_day()  # every record now has `location` instead of `geo`
        assert sync(db_url, sim, "day-1", monkeypatch) == 1
    for body in receiver.bodies:
        validate_run_event(body)
    assert {(path, headers["Authorization"]) for path, headers in receiver.requests} == {
        ("/api/v1/lineage", f"Bearer {KEY}")
    }
    assert [(b["eventType"], b["job"]["name"]) for b in receiver.bodies] == [
        ("START", "full_sync_job"),
        ("COMPLETE", "full_sync_job"),
        ("START", "full_sync_job"),
        ("FAIL", "full_sync_job"),
    ]
    start, complete, _, fail = receiver.bodies
    assert start["run"]["runId"] == complete["run"]["runId"] != fail["run"]["runId"]
    assert start["eventTime"] < complete["eventTime"]
    outputs = {d["name"].rsplit(".", 1)[-1]: d for d in complete["outputs"]}
    hotel_fields = outputs[schema.platform_hotel.name]["facets"]["schema"]["fields"]
    assert [f["name"] for f in hotel_fields] == [c.name for c in schema.platform_hotel.columns]
    assert all(a["success"] for a in gate_assertions(complete))

    failed = [a for a in gate_assertions(fail) if not a["success"]]
    cities = sorted(sim.ground_truth().valid_by_city)
    assert {(a["assertion"], a["params"].get("city")) for a in failed} == {
        ("schema_drift", None),
        *(("schema_drift", c) for c in cities),
    }
    overall = next(a for a in failed if a["name"] == "gate.schema_drift")
    assert overall["actual"] == "3 of 3 cities failed"
    assert fail["run"]["facets"]["errorMessage"]["message"]


def test_without_an_endpoint_the_events_go_to_the_file_in_the_state_folder(
    db_url: str, home: Path, monkeypatch: pytest.MonkeyPatch
):
    assert sync(db_url, simulator(), "night-1", monkeypatch) == 0
    lines = (home / "lineage" / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    for event in events:
        validate_run_event(event)
    assert [e["eventType"] for e in events] == ["START", "COMPLETE"]


def test_the_demo_s_runs_send_their_events_too(db_url: str, home: Path):
    """The README's first command: both demo suppliers' runs, each its own job's events."""
    argv = ["--db-url", db_url, "demo", "--cities", "2", "--hotels", "40", "--second-hotels", "30"]
    assert cli.main(argv) == 0
    lines = (home / "lineage" / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    for event in events:
        validate_run_event(event)
    assert [e["eventType"] for e in events] == ["START", "COMPLETE", "START", "COMPLETE"]
    assert len({e["run"]["runId"] for e in events}) == 2
    assert len({e["job"]["name"] for e in events}) == 2  # one job per supplier account


@pytest.mark.parametrize("endpoint", ["down", "slow"])
def test_an_endpoint_that_is_down_or_slow_loses_the_events_but_not_the_sync(
    db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, endpoint: str
):
    monkeypatch.setenv("SUPPLIER_SYNC_LINEAGE_TIMEOUT_SECONDS", "0.2")
    before = LineageEmitter.lost_in_process
    with Receiver.serve() as receiver, caplog.at_level(logging.WARNING):
        receiver.delay = 60.0
        url = receiver.url if endpoint == "slow" else f"http://127.0.0.1:{free_port()}/"
        monkeypatch.setenv("SUPPLIER_SYNC_LINEAGE_URL", url)
        assert sync(db_url, simulator(), "night-1", monkeypatch) == 0
        delivered = list(receiver.bodies)
    assert delivered == [] and LineageEmitter.lost_in_process == before + 2
    lost = [
        r.getMessage() for r in caplog.records if "lineage event not delivered" in r.getMessage()
    ]
    assert [m.split("(")[1].split(")")[0] for m in lost] == [
        f"{before + 1} lost in this process",
        f"{before + 2} lost in this process",
    ]
    assert len(receiver.requests) == (2 if endpoint == "slow" else 0)


def test_an_incremental_window_is_its_jobs_run_reading_the_change_feed(
    db_url: str, home: Path, monkeypatch: pytest.MonkeyPatch
):
    sim = simulator()
    assert sync(db_url, sim, "night-1", monkeypatch) == 0
    sim.advance_day()
    with running_server(sim) as url:
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", url)
        assert cli.main(["--db-url", db_url, "sync", "--incremental"]) == 0
    lines = (home / "lineage" / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    for event in events:
        validate_run_event(event)
    assert [(e["eventType"], e["job"]["name"]) for e in events] == [
        ("START", "full_sync_job"),
        ("COMPLETE", "full_sync_job"),
        ("START", "incremental_sync"),
        ("COMPLETE", "incremental_sync"),
    ]
    window = events[-1]
    assert [d["name"] for d in window["inputs"]] == ["v1/hotels/changes"]
    assert window["inputs"][0]["inputFacets"]["dataQualityMetrics"]["rowCount"] > 0
    assert [d["name"].rsplit(".", 1)[-1] for d in window["outputs"]][-4:] == [
        "platform_hotel_resource",
        "platform_hotel_offer",
        "supplier_sync_hotel_mapping",
        "supplier_sync_outbox",
    ]


def _events(home: Path) -> list[dict[str, Any]]:
    events = [
        json.loads(line) for line in (home / "lineage" / "events.jsonl").read_text().splitlines()
    ]
    for event in events:
        validate_run_event(event)
    return events


def test_a_replay_and_a_reconciliation_with_its_re_pull_send_their_runs_events(
    db_url: str, home: Path, monkeypatch: pytest.MonkeyPatch
):
    """A replay's runs read the raw snapshot store; a reconciliation is a run of its own job
    reading the city summaries and the catalog, and its re-pull the sync job's run; a
    reconciliation whose supplier cannot be reached ends FAIL with the cause."""
    sim = simulator()
    assert sync(db_url, sim, "night-1", monkeypatch) == 0
    h = schema.platform_hotel.c
    (city,), *_ = query(db_url, sa.select(h.city_code))
    lost = [r for (r,) in query(db_url, sa.select(h.resource_id).where(h.city_code == city))]
    assert cli.main(["--db-url", db_url, "replay", "--city", str(city)]) == 0
    db = SyncDatabase.open(db_url)
    with db.begin() as conn:
        conn.execute(sa.delete(schema.platform_hotel).where(h.resource_id.in_(lost[:9])))
    db.dispose()
    with running_server(sim) as url:
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", url)
        assert cli.main(["--db-url", db_url, "reconcile"]) == 0
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", f"http://127.0.0.1:{free_port()}")
    assert cli.main(["--db-url", db_url, "reconcile", "--no-repull"]) == 1

    events = _events(home)[2:]
    assert [(e["eventType"], e["job"]["name"]) for e in events] == [
        ("START", "full_sync_job"),  # the replay
        ("COMPLETE", "full_sync_job"),
        ("START", "hotel_catalog_reconciliation"),
        ("COMPLETE", "hotel_catalog_reconciliation"),
        ("START", "full_sync_job"),  # the re-pull of the city that lost hotels
        ("COMPLETE", "full_sync_job"),
        ("START", "hotel_catalog_reconciliation"),
        ("FAIL", "hotel_catalog_reconciliation"),
    ]
    replay, _, compared, compared_end, _, repull, _, failed = events
    assert [d["name"] for d in replay["inputs"]] == [
        next(d["name"] for d in repull["outputs"] if d["namespace"].startswith("file"))
    ]
    assert compared["run"]["runId"] == compared_end["run"]["runId"]
    assert {d["name"].rsplit(".", 1)[-1] for d in compared_end["inputs"]} >= {
        "platform_hotel_resource"
    }
    assert compared_end["outputs"] == []
    assert "could not be compared" in failed["run"]["facets"]["errorMessage"]["message"]
