"""The whole Definitions object loads, with its resources and sensors."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from supplier_sync_dagster import definitions
from supplier_sync_dagster.dagster_instance.run_launcher import WORK_TAG
from supplier_sync_dagster.definitions import defs
from supplier_sync_dagster.defs.resources import SyncDatabaseResource


def test_definitions_load_and_validate():
    # Loading reads the definitions state of the current instance: a test's own, so that an
    # instance another test entered and disposed is not the one read.
    with dg.instance_for_test():
        _check(defs())


def _check(loaded: dg.Definitions) -> None:
    assert isinstance(loaded, dg.Definitions)
    dg.Definitions.validate_loadable(loaded)
    assert loaded.resources is not None and loaded.sensors is not None
    assert isinstance(loaded.resources["sync_db"], SyncDatabaseResource)
    assert {s.name for s in loaded.sensors} >= {
        "shard_stall_sensor",
        "city_discovery_sensor",
        "reconciliation_repull_sensor",
        "dead_letter_city_resync_sensor",
        "alert_sensor",
        "alert_on_run_failure",
        "lineage_on_run_start",
        "lineage_on_run_success",
        "lineage_on_run_failure",
        "lineage_on_run_canceled",
    }
    assert loaded.schedules is not None
    assert {s.name for s in loaded.schedules} == {
        "catalog_reconciliation_schedule",
        "dead_letter_compensation_schedule",
        "dead_letter_summary_schedule",
        "history_retention_schedule",
        "incremental_sync_schedule",
        "nightly_full_sync",
        "outbox_dispatch_schedule",
        "projection_reconciliation_schedule",
        "sync_health_schedule",
    }
    repo = loaded.get_repository_def()  # resolves every definition and its resource requirements
    assert repo.has_job("full_sync_job") and repo.has_job("outbox_dispatch_job")
    assert repo.has_job("incremental_sync") and repo.has_job("history_retention_job")
    assert repo.has_job("compensate_dead_letters") and repo.has_job("summarize_dead_letters")
    keys = {k.to_user_string() for k in repo.asset_graph.get_all_asset_keys()}
    assert keys >= {
        "raw_hotel_snapshots",
        "normalized_hotels",
        "hotel_mappings",
        "hotel_diffs",
        "published_hotels",
        "hotel_search_projection",
        "hotel_search_reconciliation",
        "hotel_change_feed",
        "hotel_catalog_reconciliation",
        "dead_letter_compensation",
        "dead_letter_summary",
        "sync_health",
        "publish_history_retention",
    }
    graph = repo.asset_graph
    assert dg.AssetKey("hotel_diffs") in graph.get(dg.AssetKey("published_hotels")).parent_keys
    # Lineage: catalog -> search.
    projection = graph.get(dg.AssetKey("hotel_search_projection"))
    assert dg.AssetKey("published_hotels") in projection.parent_keys


def test_housekeeping_jobs_and_only_they_are_tagged_as_such():
    """The multi-host launcher sends these to the housekeeping queue; syncs stay on theirs."""
    with dg.instance_for_test():
        repo = defs().get_repository_def()
    work = {job.name: job.tags.get(WORK_TAG) for job in repo.get_all_jobs()}
    housekeeping = {name for name, kind in work.items() if kind == "housekeeping"}
    assert housekeeping >= {
        "outbox_dispatch_job",
        "projection_reconciliation_job",
        "summarize_dead_letters",
        "history_retention_job",
        "sync_health_job",
        "catalog_reconciliation_job",
        "dead_letter_retry",
        "review_approve",
    }
    syncs = {"full_sync_job", "incremental_sync", "compensate_dead_letters"}
    assert syncs <= set(work) and not syncs & housekeeping
    assert set(work.values()) <= {"housekeeping", None}


def test_a_backfill_runs_its_cities_per_run_as_set(monkeypatch: pytest.MonkeyPatch):
    """One run per 1,000 cities by default; ``SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN`` is read
    when the definitions load."""

    def policy() -> dg.BackfillPolicy | None:
        with dg.instance_for_test():
            repo = defs().get_repository_def()
        node = repo.asset_graph.get(dg.AssetKey("published_hotels"))
        return node.backfill_policy

    assert policy() == dg.BackfillPolicy.multi_run(max_partitions_per_run=1000)
    monkeypatch.setenv("SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN", "25")
    assert policy() == dg.BackfillPolicy.multi_run(max_partitions_per_run=25)


def test_the_definitions_are_dagster_s_folder_loader_s_without_the_component_types():
    """``defs()`` skips only the installed component types' description that
    ``dg.load_from_defs_folder`` adds for the UI: every definition is the same."""
    with dg.instance_for_test():
        ours = defs()
        theirs = dg.load_from_defs_folder(path_within_project=Path(definitions.__file__).parent)
    assert "plugin_component_types_json" in (theirs.metadata or {})
    assert "plugin_component_types_json" not in (ours.metadata or {})
    assert ours.component_tree is not None
    mine, stock = ours.get_repository_def(), theirs.get_repository_def()
    assert mine.asset_graph.get_all_asset_keys() == stock.asset_graph.get_all_asset_keys()
    assert {j.name for j in mine.get_all_jobs()} == {j.name for j in stock.get_all_jobs()}
    assert {s.name for s in mine.sensor_defs} == {s.name for s in stock.sensor_defs}
    assert {s.name for s in mine.schedule_defs} == {s.name for s in stock.schedule_defs}
    assert set(ours.resources or {}) == set(theirs.resources or {})
    assert type(ours.executor) is type(theirs.executor)
