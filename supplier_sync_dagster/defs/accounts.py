"""Each account's namespace in Dagster, and the definitions built once per account.

Without a suppliers file the deployment has one account (:data:`DEFAULT_SCOPE`) and its
definitions keep their plain names (``published_hotels``, ``full_sync_job``,
``supplier_city``, the ``supplier`` resource). With ``$SUPPLIER_SYNC_SUPPLIERS_FILE`` every
account gets its own:

- assets keyed under ``[supplier, account]`` (``acme/eu/published_hotels``), so the lineage
  shows each account's chain apart, all of them feeding the one catalog
  (``platform_hotel_catalog``) and its search projection;
- city partitions ``acme__eu__city``, jobs, schedules and sensors named ``acme__eu__...``;
- a supplier resource ``supplier__acme__eu`` with its own key (``dg.EnvVar`` of the file's
  ``api_key_env``), rate limit and page size;
- the run tag ``supplier_sync/account: acme.eu`` on every run its jobs, schedules, sensors
  and the command line start, which ``dagster.yaml`` limits to one run at a time per value,
  while ``max_concurrent_runs`` caps all accounts together;
- its own concurrency pool ``supplier_api__acme__eu`` for its supplier steps (an asset
  backfill launched from the UI carries no account tag: its runs' steps queue on the
  account's pool, never on another account's).

Each concept module (``city_sync.py``, ``incremental_sync.py``...) builds its definitions for
a scope with a cached ``build_*`` function, keeps the default account's as module-level names
(tests and the command line use them), and hands the loader ``per_account(build)``.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import dagster as dg

from supplier_sync_dagster.core.accounts import Account, load_accounts
from supplier_sync_dagster.core.repair.compensation import DEFAULT_COMPENSATION_TASK
from supplier_sync_dagster.core.repair.incremental import DEFAULT_INCREMENTAL_TASK
from supplier_sync_dagster.core.settings import DEFAULT_TASK_CODE, load_settings
from supplier_sync_dagster.defs.partitions import CITY_PARTITIONS, encode_city_key

F = TypeVar("F", bound=Callable[..., Any])
# The schedules a suppliers file sets per account (``schedules:``).
ScheduleName = Literal["full", "incremental", "reconciliation", "compensation"]
ACCOUNT_TAG = "supplier_sync/account"
GROUP = "supplier_sync"
CATALOG = dg.AssetKey("platform_hotel_catalog")


@dataclass(frozen=True)
class AccountScope:
    """Where one account's definitions live: names, keys, partitions, tasks.

    Attributes:
        account: The account from the suppliers file; None for the deployment's one
            account configured by the ``SUPPLIER_SYNC_*`` settings (plain names).
    """

    account: Account | None = None

    @property
    def is_default(self) -> bool:
        """The one account of a deployment without a suppliers file."""
        return self.account is None

    @property
    def code(self) -> str:
        """``supplier.account`` (``default`` for the default account)."""
        return "default" if self.account is None else self.account.code

    @property
    def prefix(self) -> list[str]:
        """The asset key prefix: ``[supplier, account]``, none for the default account."""
        return [] if self.account is None else [self.account.supplier, self.account.name]

    def key(self, name: str) -> dg.AssetKey:
        """The account's asset key of ``name``."""
        return dg.AssetKey([*self.prefix, name])

    def name(self, base: str) -> str:
        """The account's name of a job, schedule, sensor or op: ``acme__eu__<base>``."""
        return base if self.account is None else "__".join([*self.prefix, base])

    @property
    def group(self) -> str:
        """The asset group of the account's chain."""
        return GROUP if self.account is None else self.name("sync")

    @property
    def partitions_name(self) -> str:
        """The name of the account's dynamic city partitions."""
        return CITY_PARTITIONS if self.account is None else self.name("city")

    @property
    def partitions(self) -> dg.DynamicPartitionsDefinition:
        """The account's city partitions (the cities its supplier serves it)."""
        return dg.DynamicPartitionsDefinition(name=self.partitions_name)

    @property
    def supplier_key(self) -> str:
        """The resource key of the account's supplier."""
        return "supplier" if self.account is None else "__".join(["supplier", *self.prefix])

    @property
    def pool(self) -> str:
        """The concurrency pool of the account's supplier steps: ``supplier_api`` for the
        default account, ``supplier_api__acme__eu`` for an account (one account's runs never
        take another's slots)."""
        return "__".join(["supplier_api", *self.prefix])

    @property
    def full_task_code(self) -> str:
        """The task of the account's full syncs."""
        return DEFAULT_TASK_CODE if self.account is None else self.account.full_task_code

    @property
    def incremental_task_code(self) -> str:
        """The task of the account's change-feed windows."""
        return (
            DEFAULT_INCREMENTAL_TASK if self.account is None else self.account.incremental_task_code
        )

    @property
    def compensation_task_code(self) -> str:
        """The task of the account's dead-letter compensation runs."""
        return (
            DEFAULT_COMPENSATION_TASK
            if self.account is None
            else self.account.compensation_task_code
        )

    def cron(self, schedule: ScheduleName, default: str) -> str | None:
        """The cron of the account's ``schedule``: ``default`` for the default account, the
        suppliers file's for an account (None: that schedule is off)."""
        return default if self.account is None else getattr(self.account.schedules, schedule)

    def on_schedule(self, schedule: ScheduleName) -> bool:
        """Whether the account has its ``schedule`` (the suppliers file may turn it off)."""
        return self.account is None or getattr(self.account.schedules, schedule) is not None

    @property
    def tags(self) -> dict[str, str]:
        """Run tags of every run of the account (its concurrency limit's key)."""
        return {} if self.account is None else {ACCOUNT_TAG: self.account.code}

    def new_city_keys(self, instance: dg.DagsterInstance, cities: Iterable[str]) -> list[str]:
        """The partition keys of the supplier city codes ``cities`` that are not yet city
        partitions of the account."""
        known = set(instance.get_dynamic_partitions(self.partitions_name))
        return [key for key in (encode_city_key(c) for c in cities) if key not in known]

    def add_cities(self, instance: dg.DagsterInstance, cities: Iterable[str]) -> None:
        """Makes the supplier city codes ``cities`` city partitions of the account (a run
        reports on a city's partition only once it exists)."""
        new = self.new_city_keys(instance, cities)
        if new:
            instance.add_dynamic_partitions(self.partitions_name, new)


DEFAULT_SCOPE = AccountScope()


def account_scopes() -> list[AccountScope]:
    """The deployment's accounts, read now: the suppliers file's, else the default one.

    Raises:
        ConfigError: The settings or the suppliers file are malformed (naming the field).
    """
    path = load_settings().suppliers_file
    if path is None:
        return [DEFAULT_SCOPE]
    try:
        stat = path.stat()
    except OSError:
        return list(_scopes_of(path, 0, -1))  # load_accounts names the problem
    # Every definitions module asks; a changed file (a reload) is read again.
    return list(_scopes_of(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _scopes_of(path: Path, _mtime_ns: int, _size: int) -> tuple[AccountScope, ...]:
    return tuple(AccountScope(a) for a in load_accounts(path))


def per_account(build: Callable[[AccountScope], dg.Definitions]) -> dg.Definitions:
    """``build`` for every account of the deployment, merged."""
    return dg.Definitions.merge(*(build(scope) for scope in account_scopes()))


def resources_of(context: Any, scope: AccountScope, *names: str) -> dict[str, Any]:
    """The run's resources ``names`` and the account's supplier (as ``supplier``), for an
    asset built for an account (its ``required_resource_keys``)."""
    found = {name: getattr(context.resources, name) for name in names}
    found["supplier"] = getattr(context.resources, scope.supplier_key)
    return found


def with_resource_key(fn: F, param: str, key: str) -> F:
    """``fn`` with its resource parameter ``param`` renamed ``key``, for Dagster's decorators.

    A sensor or schedule names its resources by its parameters, and an account's supplier
    resource is ``supplier__acme__eu``: the function is written with ``supplier`` and
    handed to the decorator under the account's key.
    """
    if param == key:
        return fn
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def renamed(*args: Any, **kwargs: Any) -> Any:
        kwargs[param] = kwargs.pop(key)
        return fn(*args, **kwargs)

    renamed.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[
            p.replace(name=key) if p.name == param else p for p in signature.parameters.values()
        ]
    )
    renamed.__annotations__ = {
        (key if name == param else name): value for name, value in typing.get_type_hints(fn).items()
    }
    return renamed  # type: ignore[return-value]


def cached(
    build: Callable[[AccountScope], dg.Definitions],
) -> Callable[[AccountScope], dg.Definitions]:
    """``build``, once per scope: a scope's definitions are the same objects every time."""
    return functools.cache(build)
