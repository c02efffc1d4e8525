"""Helpers shared by every test folder: the simulator factory, its API key and hostile codes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.simulator import (
    HOSTILE_CITY_CODES as SIMULATOR_HOSTILE_CITY_CODES,
)
from supplier_sync_dagster.simulator import (
    FaultProfile,
    Simulator,
    SimulatorConfig,
    running_server,
)

# Not the simulator's default key: a test passes only if the key really travels from its
# configuration (environment, resource, CLI) to the request.
SIM_API_KEY = "test-sim-key"

# City codes that break paths, SQL, partition keys and case-insensitive comparisons: the
# simulator's hostile cities plus a few more it does not serve.
HOSTILE_CITY_CODES: tuple[str, ...] = (
    *SIMULATOR_HOSTILE_CITY_CODES,
    "東京都" * 21 + "京",  # 64 characters of non-ASCII
    "%2e%2e%2f",
    "../../etc/passwd",
    "..",
    ".",
    "...",
    "a/b",
    "東京都 ?#%",
    "BKK",
    "bkk",  # differs from BKK only by case: must stay a distinct city
)


def make_simulator(faults: FaultProfile | None = None, **settings: Any) -> Simulator:
    """A simulator that accepts :data:`SIM_API_KEY`.

    Args:
        faults: Its fault profile (clean when None).
        **settings: Any other :class:`SimulatorConfig` field (seed, n_cities, total_hotels...).

    Returns:
        The simulator, not served: use :func:`serve_simulator` or ``sim.transport()``.
    """
    return Simulator(
        SimulatorConfig(api_key=SIM_API_KEY, faults=faults or FaultProfile.clean(), **settings)
    )


@contextmanager
def serve_simulator(
    faults: FaultProfile | None = None, **settings: Any
) -> Iterator[tuple[Simulator, str]]:
    """:func:`make_simulator` served over real HTTP; yields the simulator and its base URL."""
    sim = make_simulator(faults, **settings)
    with running_server(sim) as url:
        yield sim, url


def supplier_client(http: httpx.Client) -> SupplierClient:
    """The supplier client of the tests' simulator (``supplier_id`` "sim") over ``http``."""
    return SupplierClient(http, api_key=SIM_API_KEY, supplier_id="sim")
