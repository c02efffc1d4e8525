"""The deployment's settings: every ``SUPPLIER_SYNC_*`` environment variable, in one place.

Each field of :class:`Settings` is one variable, named ``SUPPLIER_SYNC_`` + the field name in
capitals (:func:`env_name`); an empty variable counts as unset. Every setting has an embedded
default, so the project runs with no set-up: a SQLite file and a payload folder in the state
folder, the in-process supplier simulator, an in-process rate limiter.

The environment is read when :func:`load_settings` is called, never at import: an entry point
(the command line, the Dagster definitions) reads it once and passes the values on; the core
functions that fall back to it (``SyncDatabase.open(None)``, ``open_payload_store(None)``,
``state_dir()``) read their part, :class:`StorageSettings`, when they are called.

Example:
    >>> settings = load_settings()
    >>> settings.sync_db_url()  # doctest: +SKIP
    'sqlite:////abs/.supplier_sync/sync.sqlite3'
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.leasing.processes import DEFAULT_LEASE_SECONDS
from supplier_sync_dagster.core.redaction import register_secret, register_url

ENV_PREFIX = "SUPPLIER_SYNC_"
# The task that `sync --full`, the Dagster resources and the task commands mean unless told.
DEFAULT_TASK_CODE = "hotel_supplier_full_resource"
# How far a supplier's updated_at may run ahead of the database clock (seconds), unless set,
# and the most it may be set to: a larger skew would let one record blind a watermark longer.
DEFAULT_MAX_CLOCK_SKEW_SECONDS = 3600.0
MAX_CLOCK_SKEW_LIMIT_SECONDS = 7 * 86_400.0

# The supplier contract's limits (shared/supplier-api.md): hotels per page of a city's
# listing, and changes per request of the change feed.
MIN_PAGE_SIZE = 1
MAX_PAGE_SIZE = 500
MIN_CHANGES_LIMIT = 1
MAX_CHANGES_LIMIT = 1000
# The most an incremental window may reach back before its watermark (seconds): a week.
MAX_OVERLAP_SECONDS = 7 * 86_400.0

# The URL settings, each with the schemes it accepts.
_URL_SCHEMES: dict[str, tuple[str, ...]] = {
    "supplier_url": ("http", "https"),
    "redis_url": ("redis", "rediss", "unix"),
    "search_url": ("postgresql", "postgres", "sqlite"),
    "amqp_url": ("amqp", "amqps"),
    "alert_url": ("http", "https", "file"),
    "lineage_url": ("http", "https"),
}
S = TypeVar("S", bound=BaseSettings)
# One read API key: printable ASCII without spaces or commas (the list's separator), long
# enough that guessing is hopeless.
API_KEY_PATTERN = re.compile(r"[!-+\--~]{16,256}")


PositiveRate = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A finite number of requests/s above zero."""


class StorageSettings(BaseSettings):
    """Where state is kept, and how far a stored supplier time may run ahead of its database
    clock: the part of :class:`Settings` that the core's fallbacks and every command that
    opens the sync database read, so that a malformed supplier setting does not stop
    commands that never call the supplier."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="ignore", frozen=True
    )

    home: Path = Field(
        default=Path(".supplier_sync"),
        description="local state folder of the embedded defaults",
    )
    db_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL of the sync database, e.g. "
        "mysql+pymysql://user:pw@host:3306/sync; unset: a SQLite file in the state folder",
    )
    payload_url: str | None = Field(
        default=None,
        description="s3://bucket/prefix or file:///path; unset: the state folder's payloads/",
    )
    max_clock_skew_seconds: float = Field(
        default=DEFAULT_MAX_CLOCK_SKEW_SECONDS,
        ge=0,
        le=MAX_CLOCK_SKEW_LIMIT_SECONDS,
        allow_inf_nan=False,
        description="how far a supplier record's updated_at may be ahead of the sync database's "
        "clock (seconds, 0-604800); a record further ahead is a FUTURE_TIMESTAMP dead letter and "
        "no watermark passes the database clock plus this; unset: 3600",
    )
    lease_seconds: float = Field(
        default=DEFAULT_LEASE_SECONDS,
        ge=5,
        le=1800,
        allow_inf_nan=False,
        description="how long a worker's shard lease lasts without renewal (seconds, 5-1800): "
        "how long a frozen or lost worker's cities wait before another worker takes them over; "
        "renewed every sixth of it, at most every 20 s; unset: 180",
    )

    @property
    def state_dir(self) -> Path:
        """The state folder, absolute."""
        return self.home.resolve()

    def sync_db_url(self) -> str:
        """The sync database URL: ``db_url``, else the SQLite file in the state folder."""
        return self.db_url or f"sqlite:///{self.state_dir / 'sync.sqlite3'}"


class ClaimLockSettings(BaseSettings):
    """Redis, and whether shard claims take a short lock in it first (the claim accelerator):
    the part of :class:`Settings` that a claim reads when its lease settings do not say."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="ignore", frozen=True
    )

    redis_url: str | None = Field(
        default=None,
        description="Redis for the rate limit shared by every worker, the hotel cache and the "
        "claim locks; unset: in-process",
    )
    claim_locks: bool | None = Field(
        default=None,
        description="take a short Redis lock on a shard before its database claim, so that "
        "workers skip shards being taken without a database round trip (needs redis_url; "
        "the database still decides, and the sync goes on without Redis); unset: off",
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        return _with_scheme(value, _URL_SCHEMES["redis_url"])


# How long the publish history keeps versions superseded (days), unless set, and the range.
DEFAULT_HISTORY_RETENTION_DAYS = 400
MAX_HISTORY_RETENTION_DAYS = 3650


class HistorySettings(BaseSettings):
    """How long the catalog's publish history is kept: the part of :class:`Settings` that
    ``history prune`` reads."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="ignore", frozen=True
    )

    history_retention_days: int = Field(
        default=DEFAULT_HISTORY_RETENTION_DAYS,
        ge=1,
        le=MAX_HISTORY_RETENTION_DAYS,
        description="days of publish history kept for as-of answers (1-3650): pruning drops "
        "the versions superseded before the horizon and keeps the one current at it, so "
        "every time inside the window is answered exactly and an earlier one is refused "
        "(HISTORY_NOT_KEPT); unset: 400",
    )


class Settings(HistorySettings, ClaimLockSettings, StorageSettings):
    """The ``SUPPLIER_SYNC_*`` environment, validated; None means unset (the embedded default)."""

    suppliers_file: Path | None = Field(
        default=None,
        description="a suppliers.yaml describing several suppliers and accounts (README, "
        '"Many suppliers, many accounts"); unset: one account, from the supplier_* settings',
    )
    supplier_url: str | None = Field(
        default=None,
        description="the supplier's API base URL; unset: the in-process simulator",
    )
    supplier_api_key: SecretStr | None = Field(
        default=None, description="the supplier API key (never logged); unset: none"
    )
    search_url: str | None = Field(
        default=None,
        description="the hotel search read model: postgresql://user@host:5432/db; unset: a "
        "SQLite FTS5 file in the state folder",
    )
    amqp_url: str | None = Field(
        default=None,
        description="RabbitMQ for subscribers: amqp://user:pw@host:5672/vhost; unset: a "
        "JSON-lines file in the state folder",
    )
    alert_url: str | None = Field(
        default=None,
        description="the alert channel: an http(s):// webhook taking a Slack-compatible JSON "
        "body, or file:///path of a JSON-lines file; unset: alerts.jsonl in the state folder",
    )
    dagster_url: str | None = Field(
        default=None,
        description="the Dagster UI's base URL, for links in alerts; unset: http://localhost:3000",
    )
    supplier_rate_limit: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="requests/s the supplier allows this API key, all workers together; unset: 50",
    )
    supplier_request_deadline: float | None = Field(
        default=None,
        gt=0,
        le=600,
        allow_inf_nan=False,
        description="seconds one supplier request may take in all, connect to last body "
        "byte (each retry has its own); unset: 60",
    )
    supplier_max_body_bytes: int | None = Field(
        default=None,
        ge=1024,
        description="bytes one supplier response body may have on the wire (a larger body, "
        "or Content-Length, is BODY_TOO_LARGE); unset: 8388608 (8 MiB)",
    )
    supplier_max_decoded_bytes: int | None = Field(
        default=None,
        ge=1024,
        description="bytes one gzip-encoded supplier response may inflate to (past it: "
        "DECOMPRESSION_BOMB); unset: 16777216 (16 MiB)",
    )
    worker_processes: int | None = Field(
        default=None,
        ge=0,
        description="processes that sync a run's cities (0: the run's own process); unset: "
        "one per CPU plus one, at most 4, for runs of at least 5,000 hotels",
    )
    api_keys: SecretStr | None = Field(
        default=None,
        description="the read API's keys (serve-api), comma-separated: several at once, to "
        "rotate one without downtime; a client sends one as 'Authorization: Bearer <key>' or "
        "'X-Api-Key: <key>'; each 16-256 printable ASCII characters without spaces or commas "
        "(never logged); unset: serve-api refuses to start unless --no-auth on loopback",
    )
    confirm_rate_limit: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="requests/s the read API's offer confirmations may send to one supplier "
        "account, all API processes together, from a bucket of their own beside the syncs' "
        "(a flood of confirmations never spends the syncs' budget; past it: 429); unset: a "
        "tenth of the account's rate limit",
    )
    backfill_cities_per_run: int | None = Field(
        default=None,
        ge=1,
        description="cities per run of a backfill of the city partitions (read when the "
        "definitions load); unset: 1000",
    )

    walk_max_pages: int | None = Field(
        default=None,
        ge=1,
        description="the most pages a walk of one city may fetch: the limit of a city whose "
        "size no count states, and a ceiling over any stated size (WALK_RUNAWAY past it); "
        "unset: 10000",
    )
    walk_page_slack: float | None = Field(
        default=None,
        ge=0,
        le=10,
        allow_inf_nan=False,
        description="share of a city's expected pages (its hotel_count, the pages' total and "
        "total_pages) that its walk may go past them, at least 2 pages (WALK_RUNAWAY past "
        "it); unset: 0.1",
    )
    walk_continuity_check: bool | None = Field(
        default=None,
        description="check every page a walk fetches by number for a listing that shifted "
        "under it (a one-hotel request per page; off loses a hotel under drift: for tests "
        "only); unset: on",
    )
    rate_governor: Literal["fixed", "adaptive"] | None = Field(
        default=None,
        description="how the supplier request rate is set: fixed (the configured rate; 429s "
        "are retried) or adaptive (starts from the configured rate, or 10/s when none is "
        "set, follows the X-RateLimit-* headers, backs off on 429 and probes upward, for "
        "every process of the account together); unset: fixed",
    )
    rate_max: PositiveRate | None = Field(
        default=None,
        description="requests/s an adaptive rate never probes past; unset: ten times the "
        "starting rate",
    )

    lineage_url: str | None = Field(
        default=None,
        description="an OpenLineage HTTP endpoint's base URL (events are POSTed to "
        "<url>/api/v1/lineage, as Marquez takes them); unset: a JSON-lines file in the state "
        "folder (lineage/events.jsonl)",
    )
    lineage_api_key: SecretStr | None = Field(
        default=None,
        description="sent to the lineage endpoint as 'Authorization: Bearer <key>' (never "
        "logged); unset: none",
    )
    lineage_namespace: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        pattern=r"^[!-~]+$",
        description="the OpenLineage namespace of the sync's jobs (printable ASCII, no "
        "spaces); unset: supplier_sync",
    )
    lineage_timeout_seconds: float | None = Field(
        default=None,
        ge=0.1,
        le=30,
        allow_inf_nan=False,
        description="connect and read timeout of one lineage request (0.1-30 s; no retry: a "
        "lost event is counted and logged, never fails the sync); unset: 2",
    )
    lineage_file_max_bytes: int | None = Field(
        default=None,
        ge=65536,
        description="size cap of the lineage file (at least 65536); past it the file moves "
        "to events.jsonl.1, so at most twice this is kept; unset: 67108864 (64 MiB)",
    )

    @field_validator(*(name for name in _URL_SCHEMES if name != "redis_url"))
    @classmethod
    def _url(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _with_scheme(value, _URL_SCHEMES[str(info.field_name)])

    @field_validator("api_keys")
    @classmethod
    def _api_keys(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            split_api_keys(value.get_secret_value())
        return value

    def read_api_keys(self) -> tuple[str, ...]:
        """The read API's keys in clear (for the comparison only); empty when unset."""
        return split_api_keys(self.api_keys.get_secret_value()) if self.api_keys else ()

    def lineage_key(self) -> str | None:
        """The lineage endpoint's API key in clear (for its header only), or None."""
        return self.lineage_api_key.get_secret_value() if self.lineage_api_key else None

    def api_key(self) -> str | None:
        """The supplier API key in clear (for the client's header only), or None."""
        return self.supplier_api_key.get_secret_value() if self.supplier_api_key else None


def env_name(field: str) -> str:
    """The environment variable of a :class:`Settings` field (``db_url`` -> ``SUPPLIER_SYNC_DB_URL``).

    Raises:
        KeyError: ``field`` is not a setting.
    """
    if field not in Settings.model_fields:
        raise KeyError(f"no setting {field!r}; known: {', '.join(Settings.model_fields)}")
    return ENV_PREFIX + field.upper()


def load_settings() -> Settings:
    """Reads the ``SUPPLIER_SYNC_*`` environment now.

    Raises:
        ConfigError: A variable is malformed; one line names each bad variable.
    """
    return _read(Settings)


def load_storage_settings() -> StorageSettings:
    """Reads only where state is kept (the core's fallbacks), now.

    Raises:
        ConfigError: One of these variables is malformed.
    """
    return _read(StorageSettings)


def load_claim_lock_settings() -> ClaimLockSettings:
    """Reads only Redis and the claim accelerator's switch, now.

    Raises:
        ConfigError: One of these variables is malformed.
    """
    return _read(ClaimLockSettings)


def load_history_settings() -> HistorySettings:
    """Reads only the publish history's retention, now.

    Raises:
        ConfigError: The variable is malformed or out of range.
    """
    return _read(HistorySettings)


def _read(part: type[S]) -> S:
    try:
        settings = part()
    except ValidationError as err:
        problems = [
            f"{env_name(str(e['loc'][0]))}: {e['msg'].removeprefix('Value error, ')}"
            if e["loc"]
            else e["msg"]
            for e in err.errors(include_url=False, include_input=False)
        ]
        raise ConfigError("; ".join(problems)) from None
    _register_secrets(settings)
    return settings


def _register_secrets(settings: BaseSettings) -> None:
    """Makes the process mask the secrets the settings hold, wherever they would show."""
    for name in ("db_url", "payload_url", *_URL_SCHEMES):
        url = getattr(settings, name, None)
        # A webhook URL is a credential as a whole: its path is masked too.
        register_url(url, whole_path=name == "alert_url" and str(url).startswith("http"))
    if isinstance(settings, Settings):
        for key in (settings.api_key(), settings.lineage_key(), *settings.read_api_keys()):
            register_secret(key)


def _with_scheme(value: str | None, schemes: tuple[str, ...]) -> str | None:
    if value is None:
        return None
    try:
        parts = urlsplit(value.strip())
    except ValueError as err:
        raise ValueError(f"not a URL ({err})") from None
    if parts.scheme.lower() not in schemes or not (parts.netloc or parts.path):
        # The value is not echoed: a URL may carry a password.
        raise ValueError(f"expected a {' or '.join(s + '://' for s in schemes)} URL")
    return value


def split_api_keys(text: str) -> tuple[str, ...]:
    """The read API keys of a comma-separated list (spaces around a key and empty entries
    are ignored; a key given twice counts once).

    Raises:
        ValueError: A key is malformed, or there is none; the message never shows a key.
    """
    keys = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    if not keys:
        raise ValueError("no key in the comma-separated list")
    for n, key in enumerate(keys, 1):
        if not API_KEY_PATTERN.fullmatch(key):
            # The key is not echoed: it is a secret, however malformed.
            raise ValueError(
                f"key #{n} of {len(keys)} is not 16-256 printable ASCII characters without "
                "spaces or commas"
            )
    return keys


def require_within(name: str, value: float, low: float, high: float) -> None:
    """Refuses a setting outside ``low..high`` (both included), naming it and the range.

    Raises:
        ConfigError: ``value`` is outside the range.
    """
    if not low <= value <= high:
        raise ConfigError(f"{name} must be within {low:g}..{high:g}; got {value!r}")
