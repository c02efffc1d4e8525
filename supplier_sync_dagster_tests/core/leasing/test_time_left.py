"""The time left of a sync: "unknown" until it has a pace to judge by, never "nans", in
the CLI's progress line, ``batches`` and the Dagster step's progress log alike."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from supplier_sync_dagster.core.leasing.batches import rate_and_eta, time_left


@pytest.mark.parametrize(
    ("elapsed", "percent", "expected"),
    [
        (0.0, 0.0, "unknown"),
        (12.0, 0.0, "unknown"),
        (12.0, float("nan"), "unknown"),
        (0.0, 50.0, "unknown"),
        (10.0, 50.0, "10s"),
        (30.0, 1.25, "2,370s"),
        (10.0, 100.0, "0s"),
    ],
)
def test_the_eta_is_unknown_until_the_sync_has_a_pace(
    elapsed: float, percent: float, expected: str
):
    assert time_left(elapsed, percent) == expected


def test_a_started_batch_without_progress_shows_an_unknown_eta(make_batch: Any):
    """``batches`` and the Dagster step's progress log say it as the CLI's line does."""
    batch = make_batch()
    now = datetime(2026, 12, 6, 2, 0, tzinfo=UTC)
    started = dataclasses.replace(batch, started_at=now - timedelta(seconds=30))
    assert rate_and_eta(started, now) == "0 hotels/s, ETA unknown"
    halfway = dataclasses.replace(started, progress_percent=Decimal("50.00"), fetched_count=300)
    assert rate_and_eta(halfway, now) == "10 hotels/s, ETA 30s"
