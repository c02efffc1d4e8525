"""Fixtures of the simulator tests: a small clean world and an in-process client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from supplier_sync_dagster.simulator import Simulator
from supplier_sync_dagster_tests.simulator.helpers import make_sim


@pytest.fixture(scope="module")
def clean_sim() -> Simulator:
    """A clean simulator shared by a module's read-only tests."""
    return make_sim()


@pytest.fixture
def client(clean_sim: Simulator) -> Iterator[httpx.Client]:
    """An in-process client of ``clean_sim`` carrying the API key."""
    with clean_sim.client() as c:
        yield c
