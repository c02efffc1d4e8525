"""What ``simulate`` does: the supplier simulator served over HTTP until interrupted. Its
arguments: :mod:`supplier_sync_dagster.cli.parsers.servers`."""

from __future__ import annotations

import argparse

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.simulator import FaultProfile, SimulatorConfig, serve

# The options that shape the hotels, each a SimulatorConfig field of the same name.
_DATA_OPTIONS = ("data_profile", "rooms_per_hotel", "description_chars", "non_ascii_share")


def cmd_simulate(args: argparse.Namespace) -> int:
    """``simulate``: serves the simulator (uvicorn) on ``--host``/``--port``."""
    try:
        faults = FaultProfile.named(args.profile)
    except (KeyError, ValueError) as err:
        raise ConfigError(f"unknown fault profile {args.profile!r}: {err}") from None
    if args.hostile_city_codes:
        faults = faults.with_(hostile_city_codes=True)
    cities = tuple(c for c in args.mode_cities.split(",") if c)
    try:
        faults = faults.with_(modes=tuple(args.mode), mode_cities=cities)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        config = SimulatorConfig(
            seed=args.seed,
            n_cities=args.cities,
            total_hotels=args.hotels,
            api_key=args.api_key,
            day=args.day,
            rate_limit_rps=args.rate_limit,
            faults=faults,
            **{name: getattr(args, name) for name in _DATA_OPTIONS},
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    print(
        f"supplier simulator on http://{args.host}:{args.port} ({args.cities} cities, "
        f"{args.hotels} hotels, profile {args.profile}, data profile {args.data_profile}, "
        f"day {args.day}" + (f", modes {', '.join(args.mode)}" if args.mode else "") + ")",
        flush=True,
    )
    serve(config, host=args.host, port=args.port)
    return 0
