"""A city's metadata: what its walk saw reaches its raw and published materializations."""

from __future__ import annotations

from supplier_sync_dagster.core.supplier import WalkStats
from supplier_sync_dagster.core.sync.model import CityReport
from supplier_sync_dagster.core.sync.run import CityOutcome
from supplier_sync_dagster.defs.city_events import city_metadata
from supplier_sync_dagster.defs.city_keys import PUBLISHED, RAW


def test_the_walk_s_drift_reaches_the_city_metadata() -> None:
    report = CityReport("BKK", walk=WalkStats(requests=12, probes=4, shifts=1, verified=True))
    meta = city_metadata(CityOutcome(report), "b1")
    assert meta[RAW]["listing_drift"] == "SHIFTED" and meta[RAW]["listing_shifts"] == 1
    assert (meta[RAW]["walk_probes"], meta[RAW]["walk_requests"]) == (4, 12)
    assert meta[PUBLISHED]["listing_drift"] == "SHIFTED"


def test_a_city_that_walked_no_listing_says_nothing_of_drift() -> None:
    meta = city_metadata(CityOutcome(CityReport("BKK")), "b1")
    assert "listing_drift" not in meta[RAW] and "listing_drift" not in meta[PUBLISHED]
    clean = city_metadata(CityOutcome(CityReport("BKK", walk=WalkStats(requests=3))), "b1")
    assert clean[RAW]["listing_drift"] == "none"
