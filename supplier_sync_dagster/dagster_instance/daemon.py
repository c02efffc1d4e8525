"""The Dagster daemon in this process, with the backfill daemon ticking at our interval:
what ``supplier-sync daemon`` runs.

Dagster has no setting for the backfill daemon's interval (its own is 30 s, and a launched
backfill's first run waits for that tick), so :func:`set_backfill_daemon_interval` sets the
module constant Dagster reads when the loop starts.

On a user's plain instance (a ``DAGSTER_HOME`` whose ``dagster.yaml`` keeps Dagster's stock
SQLite storage) the daemon opens the same files through the pooled storages
(:func:`.storage.pooled_ref`, passed as Dagster's ``--instance-ref``): the runs it creates
store their planned events (several per city) in one transaction instead of a connection
and a synchronous commit each, and the runs it launches inherit the reference, so their
workers store through the pooled storages too. The ``dagster.yaml`` stays as it is. A stock
dagster-mysql instance (``storage: mysql``) is opened through the production profile's
pooled storage on the same database in the same way.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from dagster._core.instance.ref import InstanceRef
from dagster._daemon import cli as daemon_cli
from dagster._daemon import controller
from dagster._serdes import serialize_value

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.dagster_instance.storage import pooled_ref


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


# Dagster's variable: how many event ids before the newest the backfill daemon reads again
# at each tick, for the materializations stored with lower ids but committed later.
BACKFILL_CURSOR_OFFSET_ENV = "ASSET_BACKFILL_CURSOR_OFFSET"
# Far more ids than all writers can take while one insert of a block is in flight (a block
# of cities' events is a few hundred, a run's plan up to 2,000).
BACKFILL_CURSOR_OFFSET = 10_000


def run_daemon(args: Sequence[str], *, backfill_interval_seconds: float) -> int:
    """``dagster-daemon run ARGS`` with the backfill daemon ticking every
    ``backfill_interval_seconds``: what ``supplier-sync daemon`` runs.

    The backfill daemon reads the materializations stored after its cursor, the newest event
    id it saw. On MySQL an insert takes its ids before it commits, so one in flight while a
    later one commits (several runs' events on several hosts, a block of a run's cities in
    one insert) becomes visible below the cursor: its partitions would never count as
    materialized and the backfill ends COMPLETED_FAILED with every run successful. The
    cursor is therefore moved back by ``BACKFILL_CURSOR_OFFSET`` ids (Dagster's
    ``ASSET_BACKFILL_CURSOR_OFFSET``, unless set); Dagster counts a materialization read
    twice once.

    Returns:
        The daemon's exit status (it runs until it is stopped).
    """
    set_backfill_daemon_interval(backfill_interval_seconds)
    os.environ.setdefault(BACKFILL_CURSOR_OFFSET_ENV, str(BACKFILL_CURSOR_OFFSET))
    ref = daemon_instance_ref()
    own = ["--instance-ref", serialize_value(ref)] if ref is not None else []
    sys.argv = ["dagster-daemon", "run", *own, *args]
    try:
        daemon_cli.main()
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else int(done.code is not None)
    return 0


def daemon_instance_ref() -> InstanceRef | None:
    """The instance the daemon opens instead of Dagster's reading of ``$DAGSTER_HOME``: the
    pooled storages on the same files or database when it is a plain SQLite or a stock
    dagster-mysql instance; None (Dagster's own reading) for any other, or when
    ``DAGSTER_HOME`` is unset or no folder (Dagster then says what is wrong)."""
    home = os.path.expanduser(os.environ.get("DAGSTER_HOME") or "")
    if not os.path.isabs(home) or not os.path.isdir(home):
        return None
    return pooled_ref(InstanceRef.from_dir(home))
