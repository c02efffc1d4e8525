"""Resources: the sync database (and, with later issues, the supplier and payload store)."""

from __future__ import annotations

import dagster as dg
from pydantic import Field

from supplier_sync_dagster.core.db import SyncDatabase
from supplier_sync_dagster.core.leases import LeaseSettings


class SyncDatabaseResource(dg.ConfigurableResource):
    """The sync database: MySQL/MariaDB in production, a SQLite file by default."""

    db_url: str | None = Field(
        default=None,
        description=(
            "SQLAlchemy URL of the sync database, e.g. mysql+pymysql://user:pw@host:3306/sync. "
            "Pass dg.EnvVar('SUPPLIER_SYNC_DB_URL') in deployments; unset, the run reads "
            "$SUPPLIER_SYNC_DB_URL at run time, else uses the embedded SQLite file."
        ),
    )
    lease_seconds: float = Field(
        default=180.0,
        description="Shard lease duration in seconds (5-1800; 2-5 minutes is typical).",
    )
    heartbeat_seconds: float = Field(
        default=20.0,
        description="Lease renewal interval in seconds (at most a third of the lease).",
    )

    def open(self) -> SyncDatabase:
        """Opens the database (creating missing tables)."""
        return SyncDatabase.open(self.db_url)

    def lease_settings(self) -> LeaseSettings:
        """The configured lease settings, validated."""
        return LeaseSettings(
            lease_seconds=self.lease_seconds, heartbeat_seconds=self.heartbeat_seconds
        )


@dg.definitions
def resources() -> dg.Definitions:
    """Binds the resources under the keys that assets and sensors ask for."""
    return dg.Definitions(resources={"sync_db": SyncDatabaseResource()})
