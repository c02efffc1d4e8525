"""The whole Definitions object loads, with its resources and sensors."""

from __future__ import annotations

import dagster as dg

from supplier_sync_dagster.definitions import defs
from supplier_sync_dagster.defs.resources import SyncDatabaseResource


def test_definitions_load_and_validate():
    loaded = defs()
    assert isinstance(loaded, dg.Definitions)
    dg.Definitions.validate_loadable(loaded)
    assert loaded.resources is not None and loaded.sensors is not None
    assert isinstance(loaded.resources["sync_db"], SyncDatabaseResource)
    assert {s.name for s in loaded.sensors} >= {"shard_stall_sensor"}
    loaded.get_repository_def()  # resolves every definition and its resource requirements
