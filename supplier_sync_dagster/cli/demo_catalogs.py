"""The catalogs the demos filled: ``demo`` and ``lease-demo`` write simulated hotels, and do
so only into a sync database that is empty or that a demo filled before, never into an
operator's catalog.

A demo that starts on an empty database records it in ``$SUPPLIER_SYNC_HOME/demo_catalogs.json``
(:data:`RECORD_NAME`); a later demo run accepts a recorded database, and refuses any other
that holds tasks or hotels, with one line, before it writes anything.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import sqlalchemy as sa

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.settings import load_storage_settings
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.engine import check_db_url, missing_sqlite_file

RECORD_NAME = "demo_catalogs.json"
# The tables whose rows make a catalog someone's: its tasks and its published hotels.
_OWNED_TABLES = (schema.task, schema.platform_hotel)


def record_path() -> Path:
    """The record of the catalogs demos filled: ``$SUPPLIER_SYNC_HOME/demo_catalogs.json``."""
    return load_storage_settings().state_dir / RECORD_NAME


def catalog_key(url: str) -> str:
    """What names the database of ``url`` in the record, whatever its driver or password
    (a SQLite file by its absolute path; a server's by user, host, port and database)."""
    parsed = check_db_url(url)
    if parsed.get_backend_name() == "sqlite":
        return f"sqlite:///{Path(parsed.database or ':memory:').resolve()}"
    # MySQL and MariaDB: the same server whichever name (and driver) the URL uses.
    where = f"{parsed.host or ''}:{parsed.port or 3306}/{parsed.database or ''}"
    return f"mysql://{parsed.username or ''}@{where}"


def recorded_catalogs() -> list[str]:
    """The catalogs demos filled, as :func:`catalog_key` names them.

    Raises:
        ConfigError: The record is not the JSON this module writes.
    """
    path = record_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} is not a record of demo catalogs ({err})") from None
    catalogs = data.get("catalogs") if isinstance(data, dict) else None
    if not isinstance(catalogs, list) or not all(isinstance(c, str) for c in catalogs):
        raise ConfigError(f"{path} is not a record of demo catalogs (no list of catalogs)")
    return catalogs


def _record(key: str) -> None:
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    catalogs = sorted({*recorded_catalogs(), key})
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_text(json.dumps({"catalogs": catalogs}, indent=2) + "\n", encoding="utf-8")
    os.replace(scratch, path)  # a reader sees the old record or the new one, never half


def holds_catalog(url: str) -> bool:
    """Whether the database of ``url`` holds a task or a hotel. It is read only: a missing
    SQLite file is not created, and no migration is applied."""
    if missing_sqlite_file(url) is not None:
        return False
    db = SyncDatabase.open(url, create_schema=False)
    try:
        with db.engine.connect() as conn:
            present = set(sa.inspect(conn).get_table_names())
            return any(
                conn.execute(sa.select(sa.literal(1)).select_from(table).limit(1)).first()
                is not None
                for table in _OWNED_TABLES
                if table.name in present
            )
    finally:
        db.dispose()


def claim_demo_catalog(url: str, *, command: str) -> None:
    """Lets a demo write into the database of ``url``: one a demo filled before, or an
    empty one (recorded now as the demo's).

    Args:
        url: The database the demo would write into.
        command: The demo's command, for the error (``lease-demo``).

    Raises:
        ConfigError: The database holds a catalog that no demo filled.
    """
    key = catalog_key(url)
    if key in recorded_catalogs():
        return
    if holds_catalog(url):
        safe_url = check_db_url(url).render_as_string(hide_password=True)
        raise ConfigError(
            f"{command} writes simulated hotels and will not touch {safe_url}: it holds a "
            f"catalog no demo filled (demos fill only an empty database or one recorded in "
            f"{record_path()}); give it --db-url of an empty database"
        )
    _record(key)
