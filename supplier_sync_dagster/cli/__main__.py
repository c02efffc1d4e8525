"""``python -m supplier_sync_dagster.cli``: the ``supplier-sync`` command."""

from supplier_sync_dagster.cli.main import run

run()
