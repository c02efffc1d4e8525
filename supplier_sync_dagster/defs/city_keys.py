"""The city chain's asset keys and the stages that materialize them.

The city sync materializes them (``city_sync.py``, its events in ``city_events.py``); the
read models, reconciliation, health and compensation sit downstream of ``published_hotels``.
Keys here are the default account's; an account's own are ``scope.key(key.path[-1])``.
"""

import dagster as dg

from supplier_sync_dagster.core.sync.model import Stage
from supplier_sync_dagster.defs.accounts import DEFAULT_SCOPE

GROUP = DEFAULT_SCOPE.group
RAW = dg.AssetKey("raw_hotel_snapshots")
NORMALIZED = dg.AssetKey("normalized_hotels")
MAPPINGS = dg.AssetKey("hotel_mappings")
DIFFS = dg.AssetKey("hotel_diffs")
PUBLISHED = dg.AssetKey("published_hotels")
# Judged for every city by the sync_health asset (health.py), declared with the city assets.
FRESHNESS_CHECK = "city_freshness"

STAGE_ASSETS: dict[Stage, tuple[dg.AssetKey, ...]] = {
    "fetch": (RAW,),
    "normalize": (NORMALIZED,),
    "publish": (MAPPINGS, DIFFS, PUBLISHED),
}
