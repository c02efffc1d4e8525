"""Resources: the sync database, the payload store, the supplier and the risk policy.

Each setting has an embedded default, so the project runs with no set-up: a SQLite file,
a local payload folder, the in-process supplier simulator, an in-process rate limiter.
Deployments set the environment variables below; ``definitions`` passes each one that is
set as ``dg.EnvVar`` (secrets never land in run config or the UI).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
import httpx
from dagster_aws.s3 import S3Resource
from pydantic import Field

from supplier_sync_dagster.core.db import SyncDatabase
from supplier_sync_dagster.core.diff import RiskRules
from supplier_sync_dagster.core.leases import LeaseSettings
from supplier_sync_dagster.core.payloads import PayloadStore, open_payload_store
from supplier_sync_dagster.core.supplier import (
    CircuitBreaker,
    SupplierClient,
    make_rate_limiter,
)

ENV_VARS = {
    "db_url": "SUPPLIER_SYNC_DB_URL",
    "payload_url": "SUPPLIER_SYNC_PAYLOAD_URL",
    "supplier_url": "SUPPLIER_SYNC_SUPPLIER_URL",
    "api_key": "SUPPLIER_SYNC_SUPPLIER_API_KEY",
    "redis_url": "SUPPLIER_SYNC_REDIS_URL",
}


class SyncDatabaseResource(dg.ConfigurableResource):
    """The sync database: MySQL/MariaDB in production, a SQLite file by default."""

    db_url: str | None = Field(
        default=None,
        description=(
            "SQLAlchemy URL of the sync database, e.g. mysql+pymysql://user:pw@host:3306/sync "
            "(SUPPLIER_SYNC_DB_URL). Unset: a SQLite file in $SUPPLIER_SYNC_HOME."
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


class PayloadStoreResource(dg.ConfigurableResource):
    """Where raw and normalized pages are kept: S3 (or MinIO) or a local folder."""

    url: str | None = Field(
        default=None,
        description=(
            "s3://bucket/prefix or file:///path (SUPPLIER_SYNC_PAYLOAD_URL). Unset: a local "
            "folder in $SUPPLIER_SYNC_HOME/payloads."
        ),
    )
    s3: S3Resource = Field(
        default_factory=S3Resource,
        description="dagster-aws S3 resource used for s3:// URLs (endpoint from AWS_ENDPOINT_URL).",
    )

    def open(self) -> PayloadStore:
        """The payload store."""

        def s3_client() -> object:
            endpoint = self.s3.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
            return self.s3.model_copy(update={"endpoint_url": endpoint}).get_client()

        return open_payload_store(self.url, s3_client_factory=s3_client)


class SupplierResource(dg.ConfigurableResource):
    """The supplier's HTTP API, or the in-process simulator when no URL is set."""

    base_url: str | None = Field(
        default=None,
        description="Supplier API base URL (SUPPLIER_SYNC_SUPPLIER_URL). Unset: the in-process simulator.",
    )
    api_key: str | None = Field(
        default=None, description="Supplier API key (SUPPLIER_SYNC_SUPPLIER_API_KEY); never logged."
    )
    redis_url: str | None = Field(
        default=None,
        description="Redis for the shared rate limit (SUPPLIER_SYNC_REDIS_URL). Unset: in-process bucket.",
    )
    supplier_id: int = Field(default=1001, description="The platform's id of this supplier.")
    task_code: str = Field(default="hotel_supplier_full_resource", description="The sync task.")
    rate_limit_rps: float = Field(
        default=50.0, description="Requests per second allowed by the supplier."
    )
    page_size: int = Field(default=100, description="Hotels per page (1-500).")
    city_threads: int = Field(
        default=1,
        description=(
            "Cities in flight at once in a run (2: one fetches while another is published). "
            "With several runs, 2 use the request budget less well (the threads share one "
            "interpreter lock), so 1 is the default."
        ),
    )
    help_other_runs: bool = Field(
        default=True,
        description=(
            "A run that has synced its cities goes on with cities of the same batch that "
            "other runs have not started, so the request budget is not left unused."
        ),
    )
    connect_timeout: float = Field(default=5.0, description="Connect timeout in seconds.")
    read_timeout: float = Field(default=30.0, description="Read timeout in seconds.")
    sim_seed: int = Field(default=42, description="Embedded simulator: world seed.")
    sim_cities: int = Field(default=50, description="Embedded simulator: number of cities.")
    sim_hotels: int = Field(default=20_000, description="Embedded simulator: number of hotels.")
    sim_profile: str = Field(
        default="flaky", description="Embedded simulator: fault profile (clean, flaky)."
    )
    sim_day: int = Field(default=0, description="Embedded simulator: the supplier's day.")

    @contextmanager
    def client(self) -> Iterator[SupplierClient]:
        """A supplier client for the duration of the block."""
        if self.base_url:
            http = httpx.Client(base_url=self.base_url)
            key = self.api_key or ""
        else:
            from supplier_sync_dagster.simulator import FaultProfile, Simulator, SimulatorConfig

            config = SimulatorConfig(
                seed=self.sim_seed,
                n_cities=self.sim_cities,
                total_hotels=self.sim_hotels,
                day=self.sim_day,
                faults=FaultProfile.named(self.sim_profile),
            )
            sim = Simulator(config)
            http = httpx.Client(base_url="http://simulator.local", transport=sim.transport())
            key = config.api_key
        limiter = make_rate_limiter(
            redis_url=self.redis_url,
            supplier_id=str(self.supplier_id),
            api_key=key,
            rate=self.rate_limit_rps,
            burst=1,
        )
        try:
            yield SupplierClient(
                http,
                api_key=key,
                supplier_id=str(self.supplier_id),
                connect_timeout=self.connect_timeout,
                read_timeout=self.read_timeout,
                rate_limiter=limiter,
                breaker=CircuitBreaker(name=f"supplier-{self.supplier_id}"),
            )
        finally:
            http.close()


class GovernanceResource(dg.ConfigurableResource):
    """The risk policy: which diffs publish on their own and which wait for review.

    Gate thresholds are per task in the sync database (``supplier-sync gate thresholds``).
    """

    price_move_ratio: float = Field(
        default=0.5,
        description="Largest relative move of an offer's price that publishes without review.",
    )
    coordinate_move_km: float = Field(
        default=2.0, description="Largest move of a hotel's position (km) without review."
    )
    name_similarity_min: float = Field(
        default=0.5,
        description="Smallest similarity (0-1) of old and new name without review (else: replaced).",
    )
    mass_inactive_share: float = Field(
        default=0.2,
        description="Share of a chunk's hotels turning INACTIVE at once that sends them to review.",
    )
    mass_inactive_min: int = Field(
        default=5, description="Fewest hotels turning INACTIVE at once for the mass rule."
    )

    def risk_rules(self) -> RiskRules:
        """The configured risk policy."""
        return RiskRules(
            price_move_ratio=self.price_move_ratio,
            coordinate_move_km=self.coordinate_move_km,
            name_similarity_min=self.name_similarity_min,
            mass_inactive_share=self.mass_inactive_share,
            mass_inactive_min=self.mass_inactive_min,
        )


def _env(name: str) -> dg.EnvVar | None:
    # Read when Definitions are built (load time), never at import.
    return dg.EnvVar(ENV_VARS[name]) if os.environ.get(ENV_VARS[name]) else None


@dg.definitions
def resources() -> dg.Definitions:
    """Binds the resources; each environment variable that is set is passed as dg.EnvVar."""
    return dg.Definitions(
        resources={
            "sync_db": SyncDatabaseResource(db_url=_env("db_url")),
            "payloads": PayloadStoreResource(url=_env("payload_url")),
            "supplier": SupplierResource(
                base_url=_env("supplier_url"), api_key=_env("api_key"), redis_url=_env("redis_url")
            ),
            "governance": GovernanceResource(),
        }
    )
