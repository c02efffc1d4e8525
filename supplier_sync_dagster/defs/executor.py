"""The executor: steps run in the run's own process.

A city_sync run is one step, so a step subprocess (the multiprocess executor's default)
would only add its start-up (a new interpreter importing Dagster) to every run of a backfill.
"""

import dagster as dg


@dg.definitions
def executor() -> dg.Definitions:
    """Runs every job, the implicit asset job included, with the in-process executor."""
    return dg.Definitions(executor=dg.in_process_executor)
