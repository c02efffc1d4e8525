"""A realistic hotel supplier that speaks ``shared/supplier-api.md``, faults included.

One core object, ``Simulator(config)``, answers requests deterministically from a seed. Use it
in-process (``httpx.Client(transport=sim.transport())``) or over real HTTP (``serve`` for the
CLI, ``running_server`` for tests and benchmarks); both behave the same.

Many suppliers, many accounts: ``SimulatorFleet`` serves several suppliers behind one server,
each reached through several accounts (its own key, rate limit, faults), supplier ``s`` at
``{server}/s`` (``running_fleet_server``, ``serve_fleet``, ``fleet.transport()``); see ``fleet``.

City codes in paths: one path segment, RFC 3986 percent-encoded with nothing but unreserved
characters left as they are (``urllib.parse.quote(code, safe="")``), a code of exactly ``.``
or ``..`` with its dots as ``%2E``; ``encode_city_code`` does it. The server decodes the raw
path, so ``..%2F..%2Fetc`` and ``%2E%2E%2F%2E%2E%2Fetc`` both mean ``../../etc``.

Example:
    >>> from supplier_sync_dagster.simulator import Simulator, SimulatorConfig, FaultProfile
    >>> sim = Simulator(SimulatorConfig(n_cities=5, total_hotels=300, faults=FaultProfile.flaky()))
    >>> truth = sim.ground_truth()  # valid / bad / moved hotels, to check a sync exactly
"""

from __future__ import annotations

from supplier_sync_dagster.simulator import extra  # noqa: F401  (first: checks the extra)
from supplier_sync_dagster.simulator.app import SimulatorApp, create_app
from supplier_sync_dagster.simulator.config import FaultProfile, ModeScale, SimulatorConfig
from supplier_sync_dagster.simulator.core import Dispatcher, SimRequest, SimResponse, Simulator
from supplier_sync_dagster.simulator.data import (
    BAD_RECORD_REASONS,
    GEO_RENAMED_LOCATION,
    HOSTILE_CITY_CODES,
    REQUIRED_FIELDS,
    GroundTruth,
)
from supplier_sync_dagster.simulator.fleet import AccountSpec, SimulatorFleet, SupplierSpec
from supplier_sync_dagster.simulator.paths import decode_segment, encode_city_code
from supplier_sync_dagster.simulator.server import (
    running_fleet_server,
    running_server,
    serve,
    serve_fleet,
)

__all__ = [
    "BAD_RECORD_REASONS",
    "GEO_RENAMED_LOCATION",
    "HOSTILE_CITY_CODES",
    "REQUIRED_FIELDS",
    "AccountSpec",
    "Dispatcher",
    "FaultProfile",
    "GroundTruth",
    "ModeScale",
    "SimRequest",
    "SimResponse",
    "Simulator",
    "SimulatorApp",
    "SimulatorConfig",
    "SimulatorFleet",
    "SupplierSpec",
    "create_app",
    "decode_segment",
    "encode_city_code",
    "running_fleet_server",
    "running_server",
    "serve",
    "serve_fleet",
]
