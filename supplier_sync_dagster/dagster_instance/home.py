"""The local Dagster instance of the command line: ``$DAGSTER_HOME``, or one in the state folder.

When ``DAGSTER_HOME`` is unset, the commands that run Dagster (``demo``, ``sync --full``,
``alerts check``...) use ``$SUPPLIER_SYNC_HOME/dagster_home``, whose ``dagster.yaml`` this
module writes: the embedded storage (:mod:`.storage`), no telemetry, and run monitoring with
the worker health check (:mod:`.run_launcher`), so that ``dagster dev`` on that folder marks a
run of a killed ``sync --full`` FAILURE.
"""

from __future__ import annotations

import os

import dagster as dg

from supplier_sync_dagster.core.store.engine import state_dir

EMBEDDED_DAGSTER_YAML = """\
telemetry:
  enabled: false
instance_class:
  module: supplier_sync_dagster.dagster_instance.storage
  class: EmbeddedDagsterInstance
run_launcher:
  module: supplier_sync_dagster.dagster_instance.run_launcher
  class: LocalRunLauncher
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
  start_timeout_seconds: 180
  cancel_timeout_seconds: 180
  max_resume_run_attempts: 0
  free_slots_after_run_end_seconds: 10
"""
# What earlier versions wrote: replaced, since nobody edited it.
OLD_EMBEDDED_DAGSTER_YAMLS = (
    """\
telemetry:
  enabled: false
instance_class:
  module: supplier_sync_dagster.instance_storage
  class: EmbeddedDagsterInstance
run_launcher:
  module: supplier_sync_dagster.run_launcher
  class: LocalRunLauncher
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
  start_timeout_seconds: 180
  cancel_timeout_seconds: 180
  max_resume_run_attempts: 0
  free_slots_after_run_end_seconds: 10
""",
    "telemetry:\n  enabled: false\n",
    """\
telemetry:
  enabled: false
run_launcher:
  module: supplier_sync_dagster.run_launcher
  class: LocalRunLauncher
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
  start_timeout_seconds: 180
  cancel_timeout_seconds: 180
  max_resume_run_attempts: 0
  free_slots_after_run_end_seconds: 10
""",
)


def dagster_instance() -> dg.DagsterInstance:
    """The local Dagster instance: ``$DAGSTER_HOME``, or one in the state folder."""
    if not os.environ.get("DAGSTER_HOME"):
        home = state_dir() / "dagster_home"
        home.mkdir(parents=True, exist_ok=True)
        config = home / "dagster.yaml"
        if not config.exists() or config.read_text() in OLD_EMBEDDED_DAGSTER_YAMLS:
            config.write_text(EMBEDDED_DAGSTER_YAML)
        os.environ["DAGSTER_HOME"] = str(home)
    return dg.DagsterInstance.get()
