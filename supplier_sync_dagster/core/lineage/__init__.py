"""Lineage for services that speak OpenLineage (Marquez, DataHub, a warehouse's catalog).

- ``events``: a run's OpenLineage events built from the sync's facts: the datasets its job
  reads and writes (the supplier's city listings, the raw snapshot store, the catalog
  tables with their schemas, the outbox, the search projection, the subscribers'
  exchange) and the quality gates' verdicts on what it fetched.
- ``emit``: where the events go: an HTTP endpoint, else a size-capped JSON-lines file in the
  state folder; a failing or slow endpoint is counted and logged, never raised.

Plain Python: the Dagster glue (``defs/lineage.py``) says which run did what.
"""
