"""The Dagster daemon in this process, with the backfill daemon ticking at our interval:
what ``supplier-sync daemon`` runs.

Dagster has no setting for the backfill daemon's interval (its own is 30 s, and a launched
backfill's first run waits for that tick), so :func:`set_backfill_daemon_interval` sets the
module constant Dagster reads when the loop starts.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dagster._daemon import cli as daemon_cli
from dagster._daemon import controller

from supplier_sync_dagster.core.errors import ConfigError


def set_backfill_daemon_interval(seconds: float) -> float:
    """Sets how often the backfill daemon of this process ticks; returns the previous value.

    Dagster 1.13 has no setting for it: ``execute_backfill_iteration_loop`` reads
    ``dagster._daemon.controller.DEFAULT_DAEMON_INTERVAL_SECONDS`` when the loop starts, so
    this must run before the daemon does. Only the backfill daemon (and the asset daemon
    when ``auto_materialize.minimum_interval_seconds`` is unset; both ``dagster.yaml``
    files set it) reads that constant. ``test_deployment`` fails if Dagster stops reading it.

    Raises:
        ConfigError: ``seconds`` is not a positive, finite number.
    """
    if not 0 < seconds < float("inf"):
        raise ConfigError(
            f"--backfill-interval must be a positive number of seconds, not {seconds}"
        )
    previous = float(controller.DEFAULT_DAEMON_INTERVAL_SECONDS)
    controller.DEFAULT_DAEMON_INTERVAL_SECONDS = seconds  # type: ignore[assignment]
    return previous


def run_daemon(args: Sequence[str], *, backfill_interval_seconds: float) -> int:
    """``dagster-daemon run ARGS`` with the backfill daemon ticking every
    ``backfill_interval_seconds``: what ``supplier-sync daemon`` runs.

    Returns:
        The daemon's exit status (it runs until it is stopped).
    """
    set_backfill_daemon_interval(backfill_interval_seconds)
    sys.argv = ["dagster-daemon", "run", *args]
    try:
        daemon_cli.main()
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else int(done.code is not None)
    return 0
