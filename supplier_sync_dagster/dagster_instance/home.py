"""The local Dagster instance of the command line: ``$DAGSTER_HOME``, or one in the state folder.

When ``DAGSTER_HOME`` is unset, the commands that run Dagster (``demo``, ``sync --full``,
``alerts check``...) use ``$SUPPLIER_SYNC_HOME/dagster_home``, whose ``dagster.yaml`` this
module writes: the embedded storage (:mod:`.storage`), no telemetry, and run monitoring with
the worker health check (:mod:`.run_launcher`), so that ``dagster dev`` on that folder marks a
run of a killed ``sync --full`` FAILURE.

A ``DAGSTER_HOME`` that has no ``dagster.yaml`` (a folder just made for it) gets the same
file, and one line on stderr says so: without it Dagster warns on every command, prints its
telemetry banner and runs without run monitoring. One that has a ``dagster.yaml`` is the
user's instance, and is left exactly as it is; when it keeps Dagster's stock SQLite storage
or dagster-mysql's, the command opens the same files or database through the pooled storages
(:func:`.storage.pooled_ref`), which add one index to its checks' table and change nothing
else.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg

from supplier_sync_dagster.core.store.engine import state_dir
from supplier_sync_dagster.dagster_instance.storage import local_instance

RUN_MONITORING = """\
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
  start_timeout_seconds: 180
  cancel_timeout_seconds: 180
  max_resume_run_attempts: 0
  free_slots_after_run_end_seconds: 10
"""


def embedded_dagster_yaml(storage: str | None = None, run_launcher: str | None = None) -> str:
    """The embedded home's ``dagster.yaml``: no telemetry; the instance class of the module
    ``storage`` and the run launcher of the module ``run_launcher`` with run monitoring, each
    when named."""
    text = "telemetry:\n  enabled: false\n"
    if storage:
        text += f"instance_class:\n  module: {storage}\n  class: EmbeddedDagsterInstance\n"
    if run_launcher:
        text += f"run_launcher:\n  module: {run_launcher}\n  class: LocalRunLauncher\n"
        text += RUN_MONITORING
    return text


EMBEDDED_DAGSTER_YAML = embedded_dagster_yaml(
    "supplier_sync_dagster.dagster_instance.storage",
    "supplier_sync_dagster.dagster_instance.run_launcher",
)
# What earlier versions wrote (the old module paths; no instance class; telemetry alone):
# replaced, since nobody edited it.
OLD_EMBEDDED_DAGSTER_YAMLS = (
    embedded_dagster_yaml(
        "supplier_sync_dagster.instance_storage", "supplier_sync_dagster.run_launcher"
    ),
    embedded_dagster_yaml(),
    embedded_dagster_yaml(run_launcher="supplier_sync_dagster.run_launcher"),
)


def dagster_instance() -> dg.DagsterInstance:
    """The local Dagster instance: ``$DAGSTER_HOME``, or one in the state folder."""
    given = os.environ.get("DAGSTER_HOME")
    if not given:
        home = state_dir() / "dagster_home"
        home.mkdir(parents=True, exist_ok=True)
        config = home / "dagster.yaml"
        if not config.exists() or config.read_text() in OLD_EMBEDDED_DAGSTER_YAMLS:
            config.write_text(EMBEDDED_DAGSTER_YAML)
        os.environ["DAGSTER_HOME"] = str(home)
    elif settle_dagster_home(Path(given)):
        print(
            f"supplier-sync: DAGSTER_HOME {given} had no dagster.yaml: wrote the project's "
            "instance settings there (embedded storage, run monitoring, no telemetry)",
            file=sys.stderr,
        )
    home_dir = os.path.expanduser(os.environ["DAGSTER_HOME"])
    if not os.path.isabs(home_dir) or not os.path.isdir(home_dir):
        return dg.DagsterInstance.get()  # which says what is wrong with it
    with _opening(home_dir):
        return local_instance(home_dir)


@contextmanager
def _opening(home_dir: str) -> Iterator[None]:
    """Holds this state folder's lock on ``home_dir`` while its instance is opened.

    Opening a new home's storage creates its tables, and two commands doing that at once
    (two accounts' syncs started together on a fresh machine) both try to create them and one
    fails; the lock is a file in the state folder, so a user's Dagster home gets no new file.
    """
    locks = state_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(os.path.realpath(home_dir).encode()).hexdigest()[:16]
    with (locks / f"dagster-home-{digest}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def settle_dagster_home(home: Path) -> bool:
    """Writes the project's ``dagster.yaml`` into an existing ``home`` that has none.

    Never replaces one (not even one written at the same moment by another command: the
    file appears whole, or not at all). A ``home`` that is no folder, or one this process
    may not write, is left to Dagster, which says what it lacks.

    Returns:
        Whether it wrote the file.
    """
    config = home / "dagster.yaml"
    if not home.is_dir() or config.exists():
        return False
    temp = home / f".dagster.yaml.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        with temp.open("x") as out:  # the mode a file of the user's gets (umask)
            out.write(EMBEDDED_DAGSTER_YAML)
        os.link(temp, config)  # fails if the file exists by now: the other one stays
    except OSError:
        return False
    finally:
        temp.unlink(missing_ok=True)
    return True
