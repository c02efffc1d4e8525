"""Suppliers and their accounts, as configuration: the ``suppliers.yaml`` file.

A platform syncs several suppliers, and reaches a supplier through one or more accounts
(markets, contracts), each with its own API key, request budget and schedules. The file
``$SUPPLIER_SYNC_SUPPLIERS_FILE`` describes them; without it the deployment has exactly one
account, configured by the other ``SUPPLIER_SYNC_*`` variables (:data:`DEFAULT_ACCOUNT`).

Example file::

    suppliers:
      acme:                         # a slug: task codes, asset keys and job names use it
        supplier_id: 1001           # the platform's id: the mapping namespace of its hotels
        base_url: https://api.acme.example     # unset: the in-process simulator
        request_deadline: 60                   # the client's bounds (unset: the settings')
        accounts:
          eu:
            api_key_env: ACME_EU_API_KEY       # the variable's NAME, never the key itself
            rate_limit_rps: 20
            page_size: 100
            schedules: {full: "0 2 * * *", incremental: "*/5 * * * *", reconciliation: "30 3 * * *"}
            thresholds: {max_bad_ratio: 0.1}   # gate thresholds, applied by `accounts apply`

What each account owns, and what it shares:

- its own tasks (``acme.eu.full``, ``acme.eu.incremental``, ``acme.eu.compensation``), so
  its batches, shards, watermark, dead letters, gate thresholds and run statistics are
  keyed apart from every other account's;
- its own rate-limit bucket (Redis key from the supplier id, the account and the API key)
  and its own circuit breakers;
- the supplier's mapping namespace (``supplier_id``): the same supplier hotel id seen
  through two accounts of one supplier is one platform resource, while two suppliers
  offering the same real hotel stay two resources (cross-supplier matching would join
  them later, by platform resource, without touching either supplier's namespace).

Nothing here reads the environment at import; :func:`load_accounts` reads the file when it
is called, and an API key is only ever looked up by the resource that sends it. Every reader
(the commands, the read API, the code location's definitions) goes through it, so through
:func:`~supplier_sync_dagster.core.inputs.config_yaml.read_yaml_file`: no anchor, alias or duplicate
key, 1 MiB at most; and every schedule is a cron expression that
:func:`~supplier_sync_dagster.core.inputs.cron.check_cron` accepts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.inputs.config_yaml import read_yaml_file
from supplier_sync_dagster.core.inputs.cron import check_cron
from supplier_sync_dagster.core.records.gates import GateThresholds

SLUG = re.compile(r"^[a-z][a-z0-9_]{0,23}$")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_THRESHOLD_FIELDS = frozenset(GateThresholds.__dataclass_fields__)


def _slug(value: str, what: str) -> str:
    if not SLUG.match(value):
        raise ValueError(
            f"{what} {value!r} is not a slug: a lower-case letter, then up to 23 lower-case "
            "letters, digits or _ (it names tasks, asset keys and jobs)"
        )
    return value


def _cron(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return check_cron(value)
    except ConfigError as err:
        raise ValueError(str(err)) from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SimulatedSupplier(_Strict):
    """The in-process simulator standing in for a supplier without a ``base_url``."""

    seed: int = Field(default=42, description="World seed: one seed, one catalog.")
    cities: int = Field(default=50, ge=1, description="Cities the supplier serves.")
    hotels: int = Field(default=20_000, ge=0, description="Hotels over those cities.")
    profile: Literal["clean", "flaky", "hostile"] = Field(
        default="flaky", description="Fault profile."
    )


class Schedules(_Strict):
    """When an account's jobs run (UTC cron; null: never on a schedule)."""

    full: str | None = Field(default="0 2 * * *", description="The full sync of every city.")
    incremental: str | None = Field(default="*/5 * * * *", description="One change-feed window.")
    reconciliation: str | None = Field(
        default="30 3 * * *", description="Per-city summaries against the catalog."
    )
    compensation: str | None = Field(
        default="*/5 * * * *", description="Retry the account's due dead letters."
    )

    @field_validator("full", "incremental", "reconciliation", "compensation")
    @classmethod
    def _cron_expression(cls, value: str | None) -> str | None:
        return _cron(value)


class AccountConfig(_Strict):
    """One account of a supplier, as written in the file."""

    api_key_env: str | None = Field(
        default=None,
        description="Name of the environment variable holding the API key (never the key).",
    )
    rate_limit_rps: float = Field(
        default=50.0, gt=0, allow_inf_nan=False, description="Requests/s this account may send."
    )
    page_size: int = Field(default=100, ge=1, le=500, description="Hotels per page.")
    worker_processes: int | None = Field(
        default=None, ge=0, description="Processes that sync a run's cities (unset: automatic)."
    )
    rate_budget: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$",
        description="Accounts of the supplier with the same budget share one request budget "
        "(accounts on one supplier key); unset: the account's own.",
    )
    city_threads: int = Field(
        default=1,
        ge=1,
        le=8,
        description=(
            "Cities in flight in a run's process: 2 keeps a rate-limited account's budget "
            "busy while one city is claimed, gated or finished."
        ),
    )
    schedules: Schedules = Field(default_factory=Schedules)
    thresholds: dict[str, float] = Field(
        default_factory=dict,
        description="Gate thresholds of the account's tasks (GateThresholds fields).",
    )
    simulator_profile: Literal["clean", "flaky", "hostile"] | None = Field(
        default=None, description="In-process simulator only: this account's fault profile."
    )

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.match(value):
            # The value is never echoed: what is pasted here is often the key itself.
            raise ValueError(
                "not an environment variable name (A-Z, 0-9, _; if it is the key itself: put "
                "the key in an environment variable and name that variable here)"
            )
        return value

    @field_validator("thresholds")
    @classmethod
    def _thresholds(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - _THRESHOLD_FIELDS)
        if unknown:
            raise ValueError(
                f"unknown threshold {', '.join(unknown)}; known: {', '.join(sorted(_THRESHOLD_FIELDS))}"
            )
        try:
            GateThresholds(**_typed_thresholds(value))
        except (TypeError, ValueError, ConfigError) as err:
            raise ValueError(str(err)) from None
        return value


class SupplierConfig(_Strict):
    """One supplier and its accounts, as written in the file."""

    supplier_id: int = Field(gt=0, description="The platform's id of the supplier.")
    base_url: str | None = Field(
        default=None, description="API base URL; unset: the in-process simulator."
    )
    simulator: SimulatedSupplier = Field(default_factory=SimulatedSupplier)
    request_deadline: float | None = Field(
        default=None,
        gt=0,
        le=600,
        allow_inf_nan=False,
        description="Seconds one request may take in all; unset: the deployment's setting.",
    )
    max_body_bytes: int | None = Field(
        default=None, ge=1024, description="Body bytes on the wire; unset: the setting's."
    )
    max_decoded_bytes: int | None = Field(
        default=None, ge=1024, description="Body bytes after gzip; unset: the setting's."
    )
    accounts: dict[str, AccountConfig] = Field(min_length=1)

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value

    @field_validator("accounts")
    @classmethod
    def _account_names(cls, value: dict[str, AccountConfig]) -> dict[str, AccountConfig]:
        for name in value:
            _slug(name, "account")
        return value


class SuppliersFile(_Strict):
    """The whole file."""

    suppliers: dict[str, SupplierConfig] = Field(min_length=1)

    @field_validator("suppliers")
    @classmethod
    def _supplier_names(cls, value: dict[str, SupplierConfig]) -> dict[str, SupplierConfig]:
        for name in value:
            _slug(name, "supplier")
        return value

    @model_validator(mode="after")
    def _distinct_ids(self) -> SuppliersFile:
        seen: dict[int, str] = {}
        for name, supplier in self.suppliers.items():
            if supplier.supplier_id in seen:
                raise ValueError(
                    f"suppliers {seen[supplier.supplier_id]!r} and {name!r} share supplier_id "
                    f"{supplier.supplier_id}: one id is one mapping namespace"
                )
            seen[supplier.supplier_id] = name
        return self


@dataclass(frozen=True)
class Account:
    """One account of one supplier, resolved: everything a run and its definitions need.

    Attributes:
        supplier: The supplier's slug.
        name: The account's slug (unique within its supplier).
        supplier_id: The platform's id of the supplier (shared by its accounts).
        base_url: The API base URL; None: the in-process simulator.
        api_key_env: The variable holding the API key; None: no key (or the simulator's).
        rate_limit_rps: Requests/s the account may send, all its workers together.
        page_size: Hotels per page.
        worker_processes: Processes that sync a run's cities; None: automatic.
        rate_budget: The request budget it shares with its supplier's other accounts of the
            same budget (one supplier key); None: its own.
        city_threads: Cities in flight in a run's process.
        schedules: When its jobs run.
        thresholds: Gate thresholds given in the file (the rest keep their defaults).
        simulator: The in-process simulator's world (when ``base_url`` is None).
        simulator_profile: The simulator's fault profile for this account.
        request_deadline: Seconds one request to the supplier may take; None: the setting's.
        max_body_bytes: Body bytes on the wire of one response; None: the setting's.
        max_decoded_bytes: Body bytes after gzip of one response; None: the setting's.
    """

    supplier: str
    name: str
    supplier_id: int
    base_url: str | None = None
    api_key_env: str | None = None
    rate_limit_rps: float = 50.0
    page_size: int = 100
    worker_processes: int | None = None
    rate_budget: str | None = None
    city_threads: int = 1
    schedules: Schedules = Schedules()
    thresholds: tuple[tuple[str, float], ...] = ()
    simulator: SimulatedSupplier = SimulatedSupplier()
    simulator_profile: str = "flaky"
    request_deadline: float | None = None
    max_body_bytes: int | None = None
    max_decoded_bytes: int | None = None

    @property
    def code(self) -> str:
        """``supplier.account``: the account's name in tags, logs and the rate-limit key."""
        return f"{self.supplier}.{self.name}"

    @property
    def full_task_code(self) -> str:
        """The task of its full syncs."""
        return f"{self.code}.full"

    @property
    def incremental_task_code(self) -> str:
        """The task of its change-feed windows."""
        return f"{self.code}.incremental"

    @property
    def compensation_task_code(self) -> str:
        """The task of its dead-letter compensation runs."""
        return f"{self.code}.compensation"

    @property
    def task_codes(self) -> tuple[str, str, str]:
        """Every task of the account."""
        return (self.full_task_code, self.incremental_task_code, self.compensation_task_code)

    def gate_thresholds(self) -> GateThresholds:
        """The account's gate thresholds: the file's, over the defaults."""
        return GateThresholds(**_typed_thresholds(dict(self.thresholds)))


def parse_accounts(data: Any, *, source: str = "suppliers file") -> list[Account]:
    """The accounts described by ``data`` (the file's parsed YAML), in file order.

    Raises:
        ConfigError: The data is not a valid suppliers file; one line per problem, each
            naming the field (``suppliers.acme.accounts.eu.rate_limit_rps: ...``).
    """
    try:
        parsed = SuppliersFile.model_validate(data)
    except ValidationError as err:
        problems = [
            f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: "
            f"{e['msg'].removeprefix('Value error, ')}"
            for e in err.errors(include_url=False, include_input=False)
        ]
    else:
        problems = []
    if problems:
        # Raised outside the handler: the ValidationError (which holds the whole input and
        # renders it) is no context of ours for a traceback to format.
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return [
        Account(
            supplier=supplier_name,
            name=account_name,
            supplier_id=supplier.supplier_id,
            base_url=supplier.base_url,
            api_key_env=account.api_key_env,
            rate_limit_rps=account.rate_limit_rps,
            page_size=account.page_size,
            worker_processes=account.worker_processes,
            rate_budget=account.rate_budget,
            city_threads=account.city_threads,
            schedules=account.schedules,
            thresholds=tuple(sorted(_typed_thresholds(account.thresholds).items())),
            simulator=supplier.simulator,
            simulator_profile=account.simulator_profile or supplier.simulator.profile,
            request_deadline=supplier.request_deadline,
            max_body_bytes=supplier.max_body_bytes,
            max_decoded_bytes=supplier.max_decoded_bytes,
        )
        for supplier_name, supplier in parsed.suppliers.items()
        for account_name, account in supplier.accounts.items()
    ]


def load_accounts(path: Path) -> list[Account]:
    """The accounts of the suppliers file at ``path``, read now: the one way every command,
    server and the code location's definitions read the file.

    Raises:
        ConfigError: The file cannot be read, is too large, is not YAML, holds an anchor,
            an alias or a duplicate key, or is not a valid suppliers file (the message names
            the file and the line or field).
    """
    return parse_accounts(read_yaml_file(path, what="suppliers file"), source=str(path))


def find_account(accounts: list[Account], code: str) -> Account:
    """The account named ``supplier.account``.

    Raises:
        ConfigError: No account has that code.
    """
    for account in accounts:
        if account.code == code:
            return account
    known = ", ".join(a.code for a in accounts) or "none"
    raise ConfigError(f"no account {code!r} in the suppliers file; known: {known}")


def _typed_thresholds(values: Mapping[str, float]) -> dict[str, Any]:
    # The file's numbers as GateThresholds declares them (counts are ints).
    types = {name: f.type for name, f in GateThresholds.__dataclass_fields__.items()}
    typed: dict[str, Any] = {}
    for key, value in values.items():
        if types[key] in (int, "int"):
            if float(value) != int(value):
                raise ValueError(f"threshold {key} must be a whole number, got {value!r}")
            typed[key] = int(value)
        else:
            typed[key] = float(value)
    return typed


__all__ = [
    "Account",
    "AccountConfig",
    "Schedules",
    "SimulatedSupplier",
    "SupplierConfig",
    "SuppliersFile",
    "find_account",
    "load_accounts",
    "parse_accounts",
]
