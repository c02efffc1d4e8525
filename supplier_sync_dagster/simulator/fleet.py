"""Several simulated suppliers, each reached through several accounts, behind one server.

A ``SimulatorFleet`` maps supplier name -> account name -> ``SimulatorConfig``; every account
is its own ``Simulator``, so it has its own ``api_key``, its own rate limit (per key, as a
real supplier enforces it), its own fault profile and its own catalog.

Accounts and suppliers:
    The accounts of ONE supplier are that supplier seen through different contracts
    (a cheap key with a low rate limit, a premium one, a second region...). They normally
    share the supplier's ``seed``, ``n_cities`` and ``total_hotels`` so that the same
    ``hotel_id`` means the same hotel under every account; the world-shaping fault settings
    (``bad_record_rate``, ``moved_hotel_rate``, ``location_rename_from_day``,
    ``hostile_city_codes``) change records too, so keep them equal across the accounts when
    that sameness matters, and vary only the transient faults and the rate limit. Two
    suppliers are two catalogs: give them different seeds (``from_spec`` insists on it).
    Every key of the fleet is distinct, so a key names exactly one account.

Routing (over HTTP with ``server.running_fleet_server`` or in-process with ``transport()``):
    * ``/{supplier}/v1/...``: the account of ``supplier`` whose key is in ``X-Api-Key``
      answers with the rest of the raw path, percent-encoding untouched. A supplier's base
      URL for a client is thus ``{server}/{supplier}``. A key of no account of that supplier
      gets the single simulator's ``401 UNAUTHORIZED``; an unknown supplier ``404 NOT_FOUND``.
    * ``/{supplier}/_sim/...``: the simulator's admin paths (``GET stats``,
      ``POST advance?seconds=N``, ``POST advance_day``), applied to every account of the
      supplier; the answer maps account -> what that account's simulator answered.
    * ``/_sim/...``: the same for every account of every supplier (supplier -> account ->
      answer), so the whole fleet's clock moves together. ``GET /_sim/refused`` counts the
      requests no account saw (unknown supplier, unknown key).

Names are slugs (``[a-z0-9][a-z0-9_-]*``), so none can be confused with ``_sim``.

Example:
    >>> fleet = SimulatorFleet.from_spec({
    ...     "acme": SupplierSpec(seed=1, n_cities=5, total_hotels=300, accounts={
    ...         "basic": AccountSpec("acme-basic", rate_limit_rps=2),
    ...         "premium": AccountSpec("acme-premium", rate_limit_rps=50, faults="flaky"),
    ...     }),
    ...     "globex": SupplierSpec(seed=2, accounts={"main": AccountSpec("globex-key")}),
    ... })  # doctest: +SKIP
"""

from __future__ import annotations

import datetime as dt
import hmac
import json
import re
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import httpx

from supplier_sync_dagster.simulator import paths
from supplier_sync_dagster.simulator.config import FaultProfile, SimulatorConfig
from supplier_sync_dagster.simulator.core import (
    SimRequest,
    SimResponse,
    Simulator,
    error_body,
    handle_httpx,
)
from supplier_sync_dagster.simulator.data import GroundTruth
from supplier_sync_dagster.simulator.ratelimit import Decision, RateLimiter

_SLUG = re.compile(r"[a-z0-9][a-z0-9_-]*")
_ADMIN = b"_sim"
_JSON = ("content-type", "application/json")
_T = TypeVar("_T")


def _check_slug(kind: str, name: object) -> str:
    if not isinstance(name, str) or _SLUG.fullmatch(name) is None:
        raise ValueError(f"{kind} name {name!r} is not a slug ([a-z0-9][a-z0-9_-]*)")
    return name


def _json_response(obj: Any) -> SimResponse:
    return SimResponse(200, [_JSON], json.dumps(obj, ensure_ascii=False).encode())


@dataclass(frozen=True)
class AccountSpec:
    """One account (contract) with a supplier, for ``SimulatorFleet.from_spec``.

    Attributes:
        api_key: its ``X-Api-Key`` (distinct from every other key of the fleet).
        rate_limit_rps: its rate limit in requests per second; ``None``: unlimited.
        rate_limit_burst: its bucket size; ``None``: one second worth of the rate.
        faults: its fault profile, or the name of a preset (``clean``, ``flaky``,
            ``hostile``).
    """

    api_key: str
    rate_limit_rps: float | None = None
    rate_limit_burst: float | None = None
    faults: FaultProfile | str = "clean"

    def fault_profile(self) -> FaultProfile:
        """The fault profile, a preset's name resolved.

        Raises:
            ValueError: ``faults`` names no preset.
        """
        return FaultProfile.named(self.faults) if isinstance(self.faults, str) else self.faults


@dataclass(frozen=True)
class SupplierSpec:
    """One supplier's catalog and its accounts, for ``SimulatorFleet.from_spec``.

    Attributes:
        seed: the supplier's seed, shared by all its accounts (its catalog).
        accounts: account name -> account.
        n_cities: cities of the catalog.
        total_hotels: hotels of the catalog on day 0.
        settings: any other ``SimulatorConfig`` field, the same for every account
            (``day``, ``daily_price_change_rate``...).
    """

    seed: int
    accounts: Mapping[str, AccountSpec]
    n_cities: int = 50
    total_hotels: int = 20_000
    settings: Mapping[str, Any] = field(default_factory=dict)

    def configs(self, **shared: Any) -> dict[str, SimulatorConfig]:
        """Account name -> its ``SimulatorConfig``.

        Args:
            **shared: ``SimulatorConfig`` fields for every account, under ``settings``.

        Returns:
            One config per account, in the order of ``accounts``.
        """
        base = {
            **shared,
            **self.settings,
            "seed": self.seed,
            "n_cities": self.n_cities,
            "total_hotels": self.total_hotels,
        }
        return {
            name: SimulatorConfig(
                **{
                    **base,
                    "api_key": account.api_key,
                    "rate_limit_rps": account.rate_limit_rps,
                    "rate_limit_burst": account.rate_limit_burst,
                    "faults": account.fault_profile(),
                }
            )
            for name, account in self.accounts.items()
        }


class SimulatorFleet:
    """Several simulated suppliers with several accounts each; see the module docstring.

    Thread-safe; admin operations (advance, advance_day) of the fleet run one at a time,
    each over every account in turn (a request arriving meanwhile can see some accounts
    moved and others not yet, as a request crossing midnight at a real supplier would).
    """

    def __init__(self, suppliers: Mapping[str, Mapping[str, SimulatorConfig]]) -> None:
        """Build one ``Simulator`` per account.

        Args:
            suppliers: supplier name -> account name -> that account's configuration.

        Raises:
            ValueError: no supplier, a supplier without accounts, a name that is not a slug,
                or two accounts with the same ``api_key``.
        """
        if not suppliers:
            raise ValueError("a fleet needs at least one supplier")
        owners: dict[str, str] = {}
        for supplier, accounts in suppliers.items():
            _check_slug("supplier", supplier)
            if not accounts:
                raise ValueError(f"supplier {supplier!r} has no account")
            for account, config in accounts.items():
                _check_slug("account", account)
                owner = owners.setdefault(config.api_key, f"{supplier}/{account}")
                if owner != f"{supplier}/{account}":
                    raise ValueError(
                        f"account {supplier}/{account} has the api_key of {owner}: "
                        "every key of a fleet must be distinct"
                    )
        self._sims: dict[str, dict[str, Simulator]] = {
            supplier: {account: Simulator(config) for account, config in accounts.items()}
            for supplier, accounts in suppliers.items()
        }
        self._keys: dict[str, list[tuple[bytes, Simulator]]] = {
            supplier: [(sim.config.api_key.encode(), sim) for sim in sims.values()]
            for supplier, sims in self._sims.items()
        }
        # A key of no account has no bucket: answer with what a fresh one shows, as the
        # single simulator does, taking the supplier's first account as the reference.
        self._refusal_limits: dict[str, Decision] = {}
        for supplier, sims in self._sims.items():
            first = next(iter(sims.values())).config
            limiter = RateLimiter(first.rate_limit_rps, first.rate_limit_burst)
            self._refusal_limits[supplier] = limiter.peek("")
        self._admin_lock = threading.Lock()
        self._refused_lock = threading.Lock()
        self._unknown_supplier = 0
        self._unauthorized: Counter[str] = Counter()

    @classmethod
    def from_spec(cls, suppliers: Mapping[str, SupplierSpec], **shared: Any) -> SimulatorFleet:
        """The common fleet: per supplier a seed and a catalog size, per account a key, a
        rate limit and a fault profile.

        Args:
            suppliers: supplier name -> its spec.
            **shared: ``SimulatorConfig`` fields for every account of every supplier
                (``epoch``, ``day``...); a supplier's ``settings`` override them.

        Returns:
            The fleet.

        Raises:
            ValueError: two suppliers share a seed, or as ``SimulatorFleet(...)``.
        """
        seeds: dict[int, str] = {}
        for name, spec in suppliers.items():
            other = seeds.setdefault(spec.seed, name)
            if other != name:
                raise ValueError(
                    f"suppliers {other!r} and {name!r} share seed {spec.seed}: "
                    "two suppliers are two catalogs"
                )
        return cls({name: spec.configs(**shared) for name, spec in suppliers.items()})

    # -- access -----------------------------------------------------------------------------

    @property
    def suppliers(self) -> dict[str, tuple[str, ...]]:
        """Supplier name -> its account names, in declaration order."""
        return {supplier: tuple(accounts) for supplier, accounts in self._sims.items()}

    def simulator(self, supplier: str, account: str) -> Simulator:
        """The simulator behind one account.

        Raises:
            KeyError: no such supplier or account.
        """
        try:
            return self._sims[supplier][account]
        except KeyError:
            raise KeyError(f"the fleet has no account {supplier}/{account}") from None

    def ground_truth(self, supplier: str, account: str, day: int | None = None) -> GroundTruth:
        """What a perfect sync of one account ends with; see ``Simulator.ground_truth``.

        Args:
            supplier: the supplier.
            account: the account.
            day: describe the start of this day; ``None``: the account's current instant.
        """
        return self.simulator(supplier, account).ground_truth(day)

    def stats(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Supplier -> account -> that simulator's ``stats`` (requests, 429s, faults...).

        Requests no account saw (unknown supplier or key) are in ``refused()`` instead.
        """
        return {
            supplier: {account: sim.stats for account, sim in accounts.items()}
            for supplier, accounts in self._sims.items()
        }

    def refused(self) -> dict[str, Any]:
        """Requests answered by the fleet itself, before any account.

        Returns:
            ``{"unknown_supplier": n, "unauthorized": {supplier: n}}``: 404s for an unknown
            supplier, and per supplier the 401s for a key of none of its accounts.
        """
        with self._refused_lock:
            return {
                "unknown_supplier": self._unknown_supplier,
                "unauthorized": {s: self._unauthorized[s] for s in self._sims},
            }

    def reset_stats(self) -> None:
        """Set every account's counters and the fleet's own back to zero."""
        for accounts in self._sims.values():
            for sim in accounts.values():
                sim.reset_stats()
        with self._refused_lock:
            self._unknown_supplier = 0
            self._unauthorized.clear()

    # -- time -------------------------------------------------------------------------------

    def advance(self, seconds: int) -> dict[str, dict[str, dt.datetime]]:
        """Move every account's clock ``seconds`` forward; see ``Simulator.advance``.

        Returns:
            Supplier -> account -> its new current instant.

        Raises:
            ValueError: ``seconds`` is negative (no clock moved).
        """
        if seconds < 0:
            raise ValueError("advance needs seconds >= 0")
        return self._on_every_account(lambda sim: sim.advance(seconds))

    def advance_day(self, days: int = 1) -> dict[str, dict[str, int]]:
        """Move every account's clock to the start of its day ``day + days``.

        Returns:
            Supplier -> account -> its new current day.

        Raises:
            ValueError: ``days`` is less than 1 (no clock moved).
        """
        if days < 1:
            raise ValueError("advance_day needs days >= 1")
        return self._on_every_account(lambda sim: sim.advance_day(days))

    def _on_every_account(self, act: Callable[[Simulator], _T]) -> dict[str, dict[str, _T]]:
        """Supplier -> account -> what ``act`` returned for its simulator (under the admin lock)."""
        with self._admin_lock:
            return {
                supplier: {account: act(sim) for account, sim in accounts.items()}
                for supplier, accounts in self._sims.items()
            }

    # -- transports -------------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        """Answer an ``httpx`` request in-process (sleeping for the slow fault)."""
        return handle_httpx(self, request)

    def transport(self) -> httpx.MockTransport:
        """An ``httpx`` transport that calls the fleet in-process (base URL: any host)."""
        return httpx.MockTransport(self.handle)

    def client(self, supplier: str, account: str, **kwargs: Any) -> httpx.Client:
        """An in-process ``httpx.Client`` of one account: its supplier's base URL, its key.

        Raises:
            KeyError: no such supplier or account.
        """
        sim = self.simulator(supplier, account)
        headers = {"X-Api-Key": sim.config.api_key, **kwargs.pop("headers", {})}
        return httpx.Client(
            transport=self.transport(),
            base_url=f"http://fleet/{supplier}",
            headers=headers,
            **kwargs,
        )

    # -- dispatch ---------------------------------------------------------------------------

    def dispatch(self, request: SimRequest) -> SimResponse:
        """Route one request to its account (see the module docstring) and answer it."""
        segments = paths.split_raw_path(request.raw_path)
        if segments[0] == _ADMIN:
            if segments[1:] == [b"refused"] and request.method == "GET":
                return _json_response(self.refused())
            return self._broadcast(request, self._sims)
        supplier = self._supplier_named(segments[0])
        if supplier is None:
            with self._refused_lock:
                self._unknown_supplier += 1
            return SimResponse(404, [_JSON], error_body("NOT_FOUND", "no such supplier"))
        # Rejoined from the raw segments: the account sees every escape as it was sent.
        rest = replace(request, raw_path=b"/" + b"/".join(segments[1:]))
        if segments[1:2] == [_ADMIN]:
            return self._broadcast(rest, self._sims[supplier])
        key = request.headers.get("x-api-key", "").encode()
        sim = None
        for account_key, candidate in self._keys[supplier]:
            # Every key is compared, so the time taken says nothing about which matched.
            if hmac.compare_digest(account_key, key) and sim is None:
                sim = candidate
        if sim is None:
            with self._refused_lock:
                self._unauthorized[supplier] += 1
            return self._unauthorized_response(supplier)
        return sim.dispatch(rest)

    def _supplier_named(self, raw: bytes) -> str | None:
        try:
            name = paths.decode_segment(raw)
        except paths.PathError:
            return None
        return name if name in self._sims else None

    def _unauthorized_response(self, supplier: str) -> SimResponse:
        limits = self._refusal_limits[supplier]
        return SimResponse(
            401,
            [
                _JSON,
                ("vary", "Accept-Encoding"),
                ("x-ratelimit-limit", str(limits.limit)),
                ("x-ratelimit-remaining", str(limits.remaining)),
                ("x-ratelimit-reset", str(limits.reset_seconds)),
            ],
            error_body("UNAUTHORIZED", "missing or wrong X-Api-Key"),
        )

    def _broadcast(
        self,
        request: SimRequest,
        targets: Mapping[str, Simulator] | Mapping[str, Mapping[str, Simulator]],
    ) -> SimResponse:
        """Send one admin request to every simulator of ``targets``; answers keyed alike.

        Every simulator validates the same request the same way, so an error (400, 404)
        comes from the first one, before any clock moved; it is returned as it is.
        """
        with self._admin_lock:
            answers = self._broadcast_locked(request, targets)
        return answers if isinstance(answers, SimResponse) else _json_response(answers)

    def _broadcast_locked(
        self,
        request: SimRequest,
        targets: Mapping[str, Simulator] | Mapping[str, Mapping[str, Simulator]],
    ) -> SimResponse | dict[str, Any]:
        answers: dict[str, Any] = {}
        for name, target in targets.items():
            if isinstance(target, Simulator):
                resp = target.dispatch(request)
                if resp.status != 200:
                    return resp
                answers[name] = json.loads(resp.body)
            else:
                nested = self._broadcast_locked(request, target)
                if isinstance(nested, SimResponse):
                    return nested
                answers[name] = nested
        return answers
