"""The supplier's typed Hotel model takes its lengths and ranges from core/rules."""

from __future__ import annotations

import copy
from typing import Any

import pydantic
import pytest

from supplier_sync_dagster.core.records import rules
from supplier_sync_dagster.core.supplier.models import Hotel
from supplier_sync_dagster_tests.core.records.test_normalize import EXAMPLE


def _with(field: str, value: Any) -> dict[str, Any]:
    record = copy.deepcopy(EXAMPLE)
    record[field] = value
    return record


@pytest.mark.parametrize(
    ("field", "limit"),
    [
        ("hotel_id", "hotel_id"),
        ("name", "name"),
        ("name_local", "name"),
        ("city_code", "city_code"),
        ("phone", "phone"),
    ],
)
def test_hotel_lengths_are_the_rules_limits(field: str, limit: str) -> None:
    size = rules.LIMITS[limit]
    Hotel.model_validate(_with(field, "1" * size))
    with pytest.raises(pydantic.ValidationError):
        Hotel.model_validate(_with(field, "1" * (size + 1)))


def test_hotel_ranges_are_the_rules_ranges() -> None:
    Hotel.model_validate(_with("geo", {"lat": rules.LAT_MAX, "lng": rules.LNG_MIN}))
    with pytest.raises(pydantic.ValidationError):
        Hotel.model_validate(_with("geo", {"lat": rules.LAT_MAX + 1, "lng": 0}))
    with pytest.raises(pydantic.ValidationError):
        Hotel.model_validate(_with("version", rules.MAX_VERSION + 1))
