"""supplier-sync: keeps a travel platform's hotel catalog in step with its suppliers.

``core/`` holds the logic, ``defs/`` the Dagster definitions (``definitions.py`` composes
them), ``dagster_instance/`` the adapter to Dagster's internals, ``serve/`` the servers,
``cli/`` the command and ``simulator/`` a supplier to sync from.
"""
