"""Resources: the sync database, the payload store, the supplier and the risk policy (the
outbox's read models are ``outbox.py``'s).

The settings (:mod:`supplier_sync_dagster.core.settings`) are read when the definitions
load; each one that is set reaches its resource as ``dg.EnvVar`` (secrets never land in run
config or the UI). The supplier is its HTTP API or the in-process simulator, chosen then
(:func:`supplier_resource`).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
from pydantic import Field

from supplier_sync_dagster.core.accounts import Account, find_account, load_accounts
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.leasing.leases import LeaseSettings
from supplier_sync_dagster.core.records.diff import RiskRules
from supplier_sync_dagster.core.redaction import MASK, install_log_redaction, redact_url
from supplier_sync_dagster.core.settings import (
    DEFAULT_MAX_CLOCK_SKEW_SECONDS,
    DEFAULT_TASK_CODE,
    Settings,
    StorageSettings,
    env_name,
    load_settings,
)
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import PayloadStore, open_payload_store
from supplier_sync_dagster.core.supplier import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_DECODED_BYTES,
    DEFAULT_REQUEST_DEADLINE,
    CircuitBreaker,
    RateLimiter,
    SupplierClient,
    WalkLimits,
    make_rate_limiter,
    supplier_http_client,
)
from supplier_sync_dagster.core.supplier.governor import CONSERVATIVE_START_RATE, GovernorConfig
from supplier_sync_dagster.core.supplier.walk import (
    DEFAULT_MAX_PAGES,
    DEFAULT_PAGE_SLACK,
    MIN_SLACK_PAGES,
)
from supplier_sync_dagster.core.sync.model import SyncSettings, build_sync_settings
from supplier_sync_dagster.defs.accounts import AccountScope, account_scopes, resources_of

#: The supplier client's bounds: each a resource field, a ``supplier_*`` setting and a field
#: of a supplier in the suppliers file.
CLIENT_LIMITS = ("request_deadline", "max_body_bytes", "max_decoded_bytes")


def setting_field(setting: str, what: str, *, unset: str) -> Any:
    """An optional resource field that a ``SUPPLIER_SYNC_*`` setting fills (as :func:`env_var`):
    its description names the variable and what unset means.

    Args:
        setting: The setting's name (``db_url``...).
        what: What the field is, for the UI.
        unset: What the resource does without it.
    """
    return Field(default=None, description=f"{what} ({env_name(setting)}). Unset: {unset}")


class SyncDatabaseResource(dg.ConfigurableResource):
    """The sync database: MySQL/MariaDB in production, a SQLite file by default."""

    db_url: str | None = setting_field(
        "db_url",
        "SQLAlchemy URL of the sync database, e.g. mysql+pymysql://user:pw@host:3306/sync",
        unset=f"a SQLite file in ${env_name('home')}.",
    )
    lease_seconds: float = Field(
        default=180.0,
        description="Shard lease duration in seconds (5-1800; 2-5 minutes is typical).",
    )
    heartbeat_seconds: float = Field(
        default=20.0,
        description="Lease renewal interval in seconds (at most a third of the lease).",
    )
    max_clock_skew_seconds: float = Field(
        default=DEFAULT_MAX_CLOCK_SKEW_SECONDS,
        description=(
            "How far a supplier record's updated_at may be ahead of this database's clock, in "
            f"seconds ({env_name('max_clock_skew_seconds')}); a record further ahead is a "
            "FUTURE_TIMESTAMP dead letter and no watermark passes the clock plus this."
        ),
    )

    def open(self) -> SyncDatabase:
        """Opens the database (creating missing tables)."""
        # Every job and sensor opens it: from here on the process's log lines (ours, httpx's,
        # Dagster's own and its captured python logs) mask secrets.
        install_log_redaction()
        return SyncDatabase.open(self.db_url)

    @contextmanager
    def opened(self) -> Iterator[SyncDatabase]:
        """The database for the block, its connections closed at the end."""
        db = self.open()
        try:
            yield db
        finally:
            db.dispose()

    def lease_settings(self) -> LeaseSettings:
        """The configured lease settings, validated."""
        return LeaseSettings(
            lease_seconds=self.lease_seconds, heartbeat_seconds=self.heartbeat_seconds
        )


class PayloadStoreResource(dg.ConfigurableResource):
    """Where raw and normalized pages are kept: S3 (or MinIO) or a local folder."""

    url: str | None = setting_field(
        "payload_url",
        "s3://bucket/prefix or file:///path",
        unset=f"a local folder in ${env_name('home')}/payloads.",
    )
    # The S3 settings are dagster-aws's S3Resource's own, flat: a nested S3Resource field
    # would import dagster_aws (and boto3) in every run and command, where only an s3://
    # store needs them.
    s3_endpoint_url: str | None = Field(
        default=None,
        description="S3 endpoint (MinIO or any S3-compatible store). Unset: AWS_ENDPOINT_URL, else AWS.",
    )
    s3_region_name: str | None = Field(default=None, description="S3 region.")
    s3_profile_name: str | None = Field(default=None, description="AWS profile for S3.")
    aws_access_key_id: str | None = Field(
        default=None, description="AWS access key id (a dg.EnvVar). Unset: boto3's own chain."
    )
    aws_secret_access_key: str | None = Field(
        default=None, description="AWS secret access key (a dg.EnvVar)."
    )
    aws_session_token: str | None = Field(default=None, description="AWS session token.")
    s3_max_attempts: int = Field(default=5, description="Attempts per S3 call (boto3 retries).")

    def open(self) -> PayloadStore:
        """The payload store."""

        def s3_client() -> object:
            from dagster_aws.s3 import S3Resource

            return S3Resource(
                endpoint_url=self.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None,
                region_name=self.s3_region_name,
                profile_name=self.s3_profile_name,
                aws_access_key_id=self.aws_access_key_id,
                aws_secret_access_key=self.aws_secret_access_key,
                aws_session_token=self.aws_session_token,
                max_attempts=self.s3_max_attempts,
            ).get_client()

        return open_payload_store(self.url, s3_client_factory=s3_client)


class SupplierResource(dg.ConfigurableResource, abc.ABC):
    """The supplier: what every run needs of it, whichever implementation serves it.

    :meth:`client` yields a :class:`SupplierClient`; an implementation only says how to
    reach the supplier (:meth:`_connection`). The definitions pick one at load time
    (:func:`supplier_resource`).
    """

    redis_url: str | None = setting_field(
        "redis_url", "Redis for the shared rate limit", unset="in-process bucket."
    )
    supplier_id: int = Field(default=1001, description="The platform's id of this supplier.")
    account: str | None = Field(
        default=None,
        description=(
            "The account (supplier.account) when the deployment has several: its own "
            "rate-limit bucket and circuit breakers. Unset: the supplier's one account."
        ),
    )
    task_code: str = Field(default=DEFAULT_TASK_CODE, description="The sync task.")
    rate_limit_rps: float = Field(
        default=50.0, description="Requests per second allowed by the supplier."
    )
    page_size: int = Field(default=100, description="Hotels per page (1-500).")
    rate_governor: str = Field(
        default="fixed",
        description=(
            f"fixed: rate_limit_rps; adaptive: starts there and learns the supplier's limit "
            f"({env_name('rate_governor')})."
        ),
    )
    rate_max: float | None = Field(
        default=None,
        description=f"The most an adaptive rate probes to ({env_name('rate_max')}); unset: 10x.",
    )
    rate_budget: str | None = Field(
        default=None,
        description="Accounts with the same budget share one request budget (one supplier key).",
    )
    rate_state_dir: str | None = Field(
        default=None,
        description="Where an adaptive in-process budget keeps its learnt rate between runs.",
    )
    city_threads: int = Field(
        default=1,
        description=(
            "Cities in flight at once in a run (2: one fetches while another is published). "
            "With several runs on a small machine the threads share one interpreter lock and "
            "use the request budget less well, so 1 is the default."
        ),
    )
    worker_processes: int | None = Field(
        default=None,
        description=(
            "Processes that sync a run's cities, each one city at a time, while the run's own "
            "process reports them to Dagster (a sync is CPU-bound: one per core, plus one for its waits). 0: the run's "
            "own process syncs them (city_threads at once). Unset: one per CPU plus one, at most 4, "
            "when the run's cities hold at least 5,000 hotels, else 0."
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
    walk_max_pages: int = Field(
        default=DEFAULT_MAX_PAGES,
        description=(
            f"The most pages a walk of one city may fetch ({env_name('walk_max_pages')}): the "
            "limit of a city whose size no count states, and a ceiling over any (WALK_RUNAWAY)."
        ),
    )
    walk_page_slack: float = Field(
        default=DEFAULT_PAGE_SLACK,
        description=(
            "Share of a city's expected pages its walk may go past them, at least "
            f"{MIN_SLACK_PAGES} pages ({env_name('walk_page_slack')})."
        ),
    )
    walk_continuity_check: bool = Field(
        default=True,
        description=(
            "Check every page a walk fetches by number for a listing that shifted under it "
            f"({env_name('walk_continuity_check')}; off loses hotels under drift: tests only)."
        ),
    )

    def walk_limits(self) -> WalkLimits:
        """How far a city's walk may go, and whether it checks its pages, validated."""
        return WalkLimits(
            max_pages=self.walk_max_pages,
            page_slack=self.walk_page_slack,
            continuity_check=self.walk_continuity_check,
        )

    request_deadline: float = Field(
        default=DEFAULT_REQUEST_DEADLINE,
        description=(
            "Seconds one request may take in all, connect to last body byte "
            f"({env_name('supplier_request_deadline')})."
        ),
    )
    max_body_bytes: int = Field(
        default=DEFAULT_MAX_BODY_BYTES,
        description=f"Body bytes a response may have on the wire ({env_name('supplier_max_body_bytes')}).",
    )
    max_decoded_bytes: int = Field(
        default=DEFAULT_MAX_DECODED_BYTES,
        description=(
            f"Body bytes a gzip response may inflate to ({env_name('supplier_max_decoded_bytes')})."
        ),
    )

    @abc.abstractmethod
    def _connection(self) -> tuple[httpx.Client, str]:
        """An HTTP client bound to the supplier, and the API key it accepts."""

    def governor_config(self) -> GovernorConfig | None:
        """How the adaptive rate moves; None for a fixed rate.

        Raises:
            ConfigError: ``rate_governor`` is neither fixed nor adaptive, or the rates clash.
        """
        if self.rate_governor == "fixed":
            return None
        if self.rate_governor != "adaptive":
            raise ConfigError(
                f"rate_governor must be fixed or adaptive, got {self.rate_governor!r}"
            )
        start = self.rate_limit_rps
        return GovernorConfig(
            start_rate=start,
            min_rate=min(0.5, start),
            max_rate=self.rate_max if self.rate_max is not None else 10 * start,
        )

    @contextmanager
    def client(self, *, rate_limiter: RateLimiter | None = None) -> Iterator[SupplierClient]:
        """A supplier client for the duration of the block.

        Args:
            rate_limiter: The bucket to pace requests with, shared with another client
                (a worker process's client shares its run's); None makes the key's own.
        """
        install_log_redaction()
        http, key = self._connection()
        # An account's bucket and breakers are its own: another account's 429s or outage
        # never slow it down.
        scope = f"{self.supplier_id}/{self.account}" if self.account else str(self.supplier_id)
        budget = f"{self.supplier_id}/budget/{self.rate_budget}" if self.rate_budget else scope
        try:
            limiter = rate_limiter or make_rate_limiter(
                redis_url=self.redis_url,
                supplier_id=budget,
                api_key=key,
                rate=self.rate_limit_rps,
                burst=1,
                governor=self.governor_config(),
                state_dir=Path(self.rate_state_dir) if self.rate_state_dir else None,
                shared=self.rate_budget is not None,
            )
            yield SupplierClient(
                http,
                api_key=key,
                supplier_id=str(self.supplier_id),
                connect_timeout=self.connect_timeout,
                read_timeout=self.read_timeout,
                **{name: getattr(self, name) for name in CLIENT_LIMITS},
                rate_limiter=limiter,
                breaker=CircuitBreaker(name=f"supplier-{scope}"),
                detail_breaker=CircuitBreaker(name=f"supplier-{scope}/hotels"),
            )
        finally:
            http.close()


class HttpSupplierResource(SupplierResource):
    """The supplier's HTTP API."""

    base_url: str = Field(
        description=f"Supplier API base URL ({env_name('supplier_url')}); an account's whose "
        "userinfo or query holds credentials shows them masked (the suppliers file has them)."
    )
    api_key: str | None = Field(
        default=None,
        description=f"Supplier API key ({env_name('supplier_api_key')}); never logged.",
    )

    def _connection(self) -> tuple[httpx.Client, str]:
        # Every socket wait ends by its deadline; a base URL query goes with every request.
        return supplier_http_client(self._base_url()), self.api_key or ""

    def _base_url(self) -> str:
        """The URL to call: an account's masked one is read from the suppliers file now."""
        if MASK not in self.base_url or self.account is None:
            return self.base_url
        path = load_settings().suppliers_file
        if path is None:
            raise ConfigError(
                f"account {self.account}: its base URL is masked in the resource's config and "
                "no suppliers file is set to read it from"
            )
        url = find_account(load_accounts(path), self.account).base_url
        if url is None:
            raise ConfigError(f"account {self.account} has no base_url in {path}")
        return url


class SimulatedSupplierResource(SupplierResource):
    """The in-process supplier simulator (the embedded default; needs the simulator extra)."""

    sim_seed: int = Field(default=42, description="World seed.")
    sim_cities: int = Field(default=50, description="Number of cities.")
    sim_hotels: int = Field(default=20_000, description="Number of hotels.")
    sim_profile: str = Field(default="flaky", description="Fault profile (clean, flaky, hostile).")
    sim_day: int = Field(default=0, description="The supplier's day.")
    sim_data_profile: str = Field(
        default="standard",
        description="What the hotels look like (standard, or rich: large hotels, long "
        "descriptions, much non-ASCII text).",
    )

    def _connection(self) -> tuple[httpx.Client, str]:
        from supplier_sync_dagster.simulator import FaultProfile, Simulator, SimulatorConfig

        config = SimulatorConfig(
            seed=self.sim_seed,
            n_cities=self.sim_cities,
            total_hotels=self.sim_hotels,
            day=self.sim_day,
            faults=FaultProfile.named(self.sim_profile),
            data_profile=self.sim_data_profile,
        )
        sim = Simulator(config)
        http = httpx.Client(base_url="http://simulator.local", transport=sim.transport())
        return http, config.api_key


def supplier_resource(
    *,
    base_url: str | dg.EnvVar | None,
    api_key: str | dg.EnvVar | None = None,
    **fields: Any,
) -> SupplierResource:
    """The supplier at ``base_url``, else the simulator: the one place that chooses.

    Args:
        base_url: The supplier API base URL (or its ``dg.EnvVar``); None for the simulator.
        api_key: The supplier API key (or its ``dg.EnvVar``), for the HTTP API only.
        **fields: Further :class:`SupplierResource` fields (``redis_url``, ``page_size``...).
    """
    if base_url is None:
        return SimulatedSupplierResource(**fields)
    return HttpSupplierResource(base_url=base_url, api_key=api_key, **fields)


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


def run_settings(
    sync_db: SyncDatabaseResource, supplier: SupplierResource, governance: GovernanceResource
) -> SyncSettings:
    """The settings of a run's sync work: the supplier's task and pages, the leases and the
    clock skew, the risk policy."""
    return build_sync_settings(
        task_code=supplier.task_code,
        supplier_id=supplier.supplier_id,
        page_size=supplier.page_size,
        lease=sync_db.lease_settings(),
        risk_policy=governance.risk_rules(),
        walk=supplier.walk_limits(),
        max_clock_skew_seconds=sync_db.max_clock_skew_seconds,
    )


@dataclass(frozen=True)
class SyncResources:
    """What an account's sync work runs with: the sync database, the payload store, the
    account's supplier and the risk policy."""

    sync_db: SyncDatabaseResource
    payloads: PayloadStoreResource
    supplier: SupplierResource
    governance: GovernanceResource

    @staticmethod
    def keys(scope: AccountScope) -> set[str]:
        """The resource keys an account's asset that does sync work requires."""
        return {"sync_db", "payloads", "governance", scope.supplier_key}

    @classmethod
    def of(cls, context: dg.AssetExecutionContext, scope: AccountScope) -> SyncResources:
        """The run's resources of the account (its asset's :meth:`keys`)."""
        return cls(**resources_of(context, scope, "sync_db", "payloads", "governance"))

    def settings(self) -> SyncSettings:
        """The settings of the run's sync work (:func:`run_settings`)."""
        return run_settings(self.sync_db, self.supplier, self.governance)


def env_var(settings: Settings, name: str) -> dg.EnvVar | None:
    # The variable itself, not its value: secrets never land in run config or the UI.
    return dg.EnvVar(env_name(name)) if getattr(settings, name) is not None else None


def _set(**fields: Any) -> dict[str, Any]:
    # Unset settings leave the resource's own defaults.
    return {name: value for name, value in fields.items() if value is not None}


def governor_fields(settings: Settings, configured_rate: float | None) -> dict[str, Any]:
    """The supplier resource's rate governor fields of the settings (every account's).

    Args:
        settings: The deployment's settings.
        configured_rate: The account's configured rate; None: unset (an adaptive governor
            then starts from a conservative rate).
    """
    if settings.rate_governor != "adaptive":
        return {}
    return _set(
        rate_governor="adaptive",
        rate_max=settings.rate_max,
        rate_state_dir=str(settings.state_dir / "governor"),
        rate_limit_rps=CONSERVATIVE_START_RATE if configured_rate is None else None,
    )


def walk_fields(settings: Settings) -> dict[str, Any]:
    """The supplier resource's walk fields that the settings set (every account's)."""
    return _set(
        walk_max_pages=settings.walk_max_pages,
        walk_page_slack=settings.walk_page_slack,
        walk_continuity_check=settings.walk_continuity_check,
    )


@dg.definitions
def resources() -> dg.Definitions:
    """Binds the resources from the settings, read now (load time); set ones as dg.EnvVar."""
    settings = load_settings()
    return dg.Definitions(
        resources={
            "sync_db": SyncDatabaseResource(
                db_url=env_var(settings, "db_url"),
                max_clock_skew_seconds=settings.max_clock_skew_seconds,
                **lease_fields(settings),
            ),
            "payloads": PayloadStoreResource(url=env_var(settings, "payload_url")),
            **{scope.supplier_key: account_supplier(settings, scope) for scope in account_scopes()},
            "governance": GovernanceResource(),
        }
    )


def lease_fields(settings: StorageSettings) -> dict[str, float]:
    """The sync database resource's lease fields of the settings: the lease, and a renewal
    every sixth of it (two missed renewals still leave it alive), at most every 20 s."""
    lease = settings.lease_seconds
    return {"lease_seconds": lease, "heartbeat_seconds": min(20.0, lease / 6)}


def client_limits(settings: Settings, account: Account | None = None) -> dict[str, Any]:
    """The supplier client's bounds that are set: the account's (its supplier's, in the
    suppliers file), else the deployment's settings; unset ones keep the resource's defaults.

    Args:
        settings: The deployment's settings.
        account: The account of the suppliers file, if any.
    """

    def pick(name: str) -> Any:
        own = getattr(account, name) if account is not None else None
        return own if own is not None else getattr(settings, f"supplier_{name}")

    return _set(**{name: pick(name) for name in CLIENT_LIMITS})


def account_supplier(settings: Settings, scope: AccountScope, **overrides: Any) -> SupplierResource:
    """The supplier resource of one account: the settings' for the default account, else the
    suppliers file's (its key as ``dg.EnvVar`` of the file's ``api_key_env``).

    Args:
        settings: The deployment's settings.
        scope: The account.
        **overrides: Resource fields that replace the account's (a command's options; the
            ``api_key`` a command read from the account's variable).
    """
    account = scope.account
    if account is None:
        return supplier_resource(
            **{
                "base_url": env_var(settings, "supplier_url"),
                "api_key": env_var(settings, "supplier_api_key"),
                "redis_url": env_var(settings, "redis_url"),
                # Numbers, not secrets: their values show in the resource's config.
                **_set(
                    rate_limit_rps=settings.supplier_rate_limit,
                    worker_processes=settings.worker_processes,
                ),
                **walk_fields(settings),
                **governor_fields(settings, settings.supplier_rate_limit),
                **client_limits(settings),
                **overrides,
            }
        )
    simulated = (
        {}
        if account.base_url
        else {
            "sim_seed": account.simulator.seed,
            "sim_cities": account.simulator.cities,
            "sim_hotels": account.simulator.hotels,
            "sim_profile": account.simulator_profile,
        }
    )
    fields: dict[str, Any] = {
        # Masked, so that no credential of the URL lands in run config or the UI (read from
        # the file when the client connects).
        "base_url": account.base_url and redact_url(account.base_url),
        "api_key": dg.EnvVar(account.api_key_env) if account.api_key_env else None,
        "redis_url": env_var(settings, "redis_url"),
        "supplier_id": account.supplier_id,
        "account": account.code,
        "task_code": account.full_task_code,
        "rate_limit_rps": account.rate_limit_rps,
        "page_size": account.page_size,
        "city_threads": account.city_threads,
        **_set(worker_processes=account.worker_processes, rate_budget=account.rate_budget),
        **walk_fields(settings),
        **governor_fields(settings, account.rate_limit_rps),
        **client_limits(settings, account),
        **simulated,
        **overrides,
    }
    if fields["base_url"] is None:
        fields.pop("api_key")
    return supplier_resource(**fields)
