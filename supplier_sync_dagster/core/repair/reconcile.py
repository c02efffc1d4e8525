"""Reconciliation: the catalog against what the supplier says it holds, city by city.

Silent loss is the failure to fear (a change the feed never showed, a page a walk skipped):
once a day the supplier's own summary of each city (``GET /v1/cities/{code}/summary``:
hotel and active counts, newest ``updated_at``) is compared with the catalog (one grouped
query over the supplier's published hotels, tombstones excluded), and a city that differs
beyond the tolerance is re-pulled by a full sync of exactly that city (the caller launches
it: a Dagster sensor's run requests, or ``supplier-sync reconcile``).

What counts as different (:class:`Tolerance`): the hotel count or the active count apart by
more than ``max(absolute, relative x supplier count)`` (records that break the contract stay
dead letters and never reach the catalog: a few are expected), the catalog's newest
``updated_at`` more than ``max_lag_seconds`` behind the supplier's (changes the feed lost),
or **ahead** of it by more than ``max_ahead_seconds`` (the catalog copies the supplier's
times: a catalog newer than its supplier holds a time the supplier never stated, or hotels
it no longer lists).

A record that breaks the contract is no catalog hotel but still one of the supplier's: a
city whose plain comparison differs is compared again as **the catalog plus its open
dead-letter tickets** (:func:`open_tickets`: status neither RESOLVED nor IGNORED): each
ticketed hotel the catalog lacks counts as a hotel, its bad record's ``status`` and
``updated_at`` (read from its stored raw page) stand in for the catalog's: an unknown
status may be either, an unknown time is at most when the ticket was last written. A city
that differs only by such hotels is **waiting on tickets**: a re-pull would dead-letter the
same records again, so it is not re-pulled and not counted as a difference; the tickets'
fixes close the gap. A catalog ahead of its supplier is judged on the catalog alone (a
ticket never explains a time the supplier never stated). :func:`plan_repull` is the one
rule that turns a reconciliation into re-pulls, remaining differences and cities waiting
on tickets, for the CLI and the Dagster asset alike.

Counts can agree while a hotel is lost: a walk by page numbers under a listing that shifts
skips the hotel at a page boundary while another is added at the end. A city whose last
full sync's walk **drifted** (``supplier_sync_city_walk``: the listing shifted under it, or
it went by page number without the continuity check) is **walked again** (listing pages
only, :data:`REWALK_PAGE_SIZE` hotels a page, nothing stored): a listed hotel that the
catalog lacks, that is no open dead letter or pending review, and that is not newer than the
catalog's newest change of the city (a hotel added since is the change feed's), is a
difference.

Cost: one summary request per city (the supplier's budget: 1,000 cities, 1,000 requests,
made ``threads`` at a time through the client's shared rate limiter) and two queries (the
catalog, the open tickets); a drifted city adds one walk of its listing and a few queries,
a city that differs reads the raw pages of its open tickets.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from supplier_sync_dagster.core.errors import (
    ConfigError,
    PayloadError,
    SupplierError,
    SupplierNotFound,
    UnknownCity,
)
from supplier_sync_dagster.core.records.deadletters import CLOSED_STATUSES, UNKNOWN
from supplier_sync_dagster.core.records.mapping import chunks
from supplier_sync_dagster.core.records.rules import parse_timestamp
from supplier_sync_dagster.core.records.tombstones import TOMBSTONE_FINGERPRINT
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import PayloadStore
from supplier_sync_dagster.core.supplier import CityWalk, SupplierClient, WalkLimits
from supplier_sync_dagster.core.supplier.models import decode_page, page_records
from supplier_sync_dagster.core.sync.replay import stored_city_codes

log = logging.getLogger(__name__)

DEFAULT_THREADS = 4
# Hotels per page when a drifted city is walked again: the most the contract allows.
REWALK_PAGE_SIZE = 500
# Hotel ids per IN (...) of the queries that look listed hotels up.
ID_CHUNK = 500
# A dead-letter ticket in these states is closed; in any other it waits (the one rule of
# what an open ticket is, for the reconciliation and the walk again alike).
CLOSED_TICKETS = CLOSED_STATUSES


@dataclass(frozen=True)
class Tolerance:
    """How far the catalog may be from the supplier's summary before a city is re-pulled.

    Attributes:
        absolute: Hotels (or active hotels) apart that never count as a difference.
        relative: ...nor this share of the supplier's count, whichever is larger.
        max_lag_seconds: The catalog's newest ``updated_at`` may trail the supplier's this long.
        max_ahead_seconds: ...and lead it this long (0: a catalog newer than its supplier at
            all differs).
    """

    absolute: int = 2
    relative: float = 0.02
    max_lag_seconds: float = 6 * 3600.0
    max_ahead_seconds: float = 0.0

    def __post_init__(self) -> None:
        if (
            self.absolute < 0
            or not 0.0 <= self.relative <= 1.0
            or self.max_lag_seconds < 0
            or self.max_ahead_seconds < 0
        ):
            raise ConfigError(
                "reconciliation tolerance needs absolute >= 0, relative in [0, 1], "
                f"max_lag_seconds >= 0 and max_ahead_seconds >= 0; got {self!r}"
            )

    def allows(self, supplier: int, catalog: int) -> bool:
        """Whether two counts are close enough."""
        return abs(supplier - catalog) <= max(self.absolute, self.relative * supplier)


@dataclass(frozen=True)
class CityCounts:
    """One side's numbers for a city."""

    hotels: int = 0
    active: int = 0
    max_updated_at: datetime | None = None


@dataclass(frozen=True)
class CityComparison:
    """A city's supplier summary against the catalog.

    Attributes:
        city_code: The supplier's city code.
        supplier: What the supplier's summary says (None: the summary failed).
        catalog: What the catalog holds.
        reasons: Why the city differs (empty: it does not, within the tolerance), its open
            dead-letter tickets taken into account.
        error: The summary request's (or the re-walk's) error, when it failed.
        rewalked: How the city's last walk drifted, when it was walked again (else None).
        missing: Listed hotels the catalog lacks, found by walking the city again.
        tickets: The hotels with an open dead-letter ticket that the comparison counted
            (only when the catalog alone differs).
        explained: The reasons of the catalog alone that those tickets account for.
    """

    city_code: str
    supplier: CityCounts | None
    catalog: CityCounts
    reasons: tuple[str, ...] = ()
    error: str | None = None
    rewalked: str | None = None
    missing: tuple[str, ...] = ()
    tickets: tuple[str, ...] = ()
    explained: tuple[str, ...] = ()

    @property
    def differs(self) -> bool:
        """Beyond the tolerance: the city should be re-pulled."""
        return bool(self.reasons)

    @property
    def waiting(self) -> bool:
        """The city differs only by hotels with open dead-letter tickets: a re-pull would
        dead-letter them again; fixing the tickets closes the gap."""
        return bool(self.explained) and not self.reasons

    def row(self) -> dict[str, Any]:
        """The comparison as a flat row (tables in metadata, JSON lines)."""
        s = self.supplier
        return {
            "city": self.city_code,
            "supplier_hotels": s.hotels if s else None,
            "catalog_hotels": self.catalog.hotels,
            "supplier_active": s.active if s else None,
            "catalog_active": self.catalog.active,
            "supplier_max_updated_at": _iso(s.max_updated_at) if s else None,
            "catalog_max_updated_at": _iso(self.catalog.max_updated_at),
            "differs": self.differs,
            "reasons": "; ".join(self.reasons),
            "error": self.error or "",
            "rewalked": self.rewalked or "",
            "missing_hotels": len(self.missing),
            "waiting_on_tickets": self.waiting,
            "open_ticket_hotels": len(self.tickets),
            "explained_by_tickets": "; ".join(self.explained),
        }


@dataclass
class Reconciliation:
    """Every city compared, and what it cost.

    Attributes:
        cities: One comparison per city, in the order asked.
        requests: Supplier requests made.
        seconds: Wall time.
    """

    cities: list[CityComparison] = field(default_factory=list)
    requests: int = 0
    seconds: float = 0.0

    @property
    def differing(self) -> list[CityComparison]:
        """The cities beyond the tolerance (to re-pull)."""
        return [c for c in self.cities if c.differs]

    @property
    def waiting(self) -> list[CityComparison]:
        """The cities that differ only by hotels with open dead-letter tickets."""
        return [c for c in self.cities if c.waiting]

    @property
    def failed(self) -> list[CityComparison]:
        """The cities whose summary could not be read (compared next time)."""
        return [c for c in self.cities if c.error is not None]


@dataclass(frozen=True)
class RepullPlan:
    """What a reconciliation leads to: the one rule of the CLI and the Dagster asset.

    Attributes:
        repull: The differing cities to re-pull by a full sync of exactly those cities.
        remaining: Differing cities that the previous reconciliation re-pulled already: a
            re-pull did not fix them, a person must look; not re-pulled again.
        waiting: Cities that differ only by hotels with open dead-letter tickets: not
            re-pulled (the same records would fail again) and not differences.
        hotels_waiting: The ticketed hotels of the waiting cities.
    """

    repull: list[str]
    remaining: list[str]
    waiting: list[str]
    hotels_waiting: int


def plan_repull(
    report: Reconciliation, *, repulled_before: Collection[str] = (), repull: bool = True
) -> RepullPlan:
    """The re-pulls, remaining differences and cities waiting on tickets of ``report``.

    Args:
        report: The reconciliation.
        repulled_before: The cities the previous reconciliation re-pulled (the Dagster
            asset's memory; the CLI, which an operator runs on purpose, has none).
        repull: Whether to re-pull at all (False: report only).
    """
    before = set(repulled_before)
    differing = [c.city_code for c in report.differing]
    waiting = report.waiting
    return RepullPlan(
        repull=[c for c in differing if c not in before] if repull else [],
        remaining=[c for c in differing if c in before],
        waiting=[c.city_code for c in waiting],
        hotels_waiting=sum(len(c.tickets) for c in waiting),
    )


def catalog_counts(db: SyncDatabase, supplier_id: int) -> dict[str, CityCounts]:
    """City -> the catalog's hotels, active hotels and newest ``updated_at`` (one query)."""
    h = schema.platform_hotel.c
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                h.city_code,
                sa.func.count(),
                sa.func.sum(sa.case((h.status == "ACTIVE", 1), else_=0)),
                sa.func.max(h.supplier_updated_at),
            )
            .where(h.supplier_id == supplier_id, h.fingerprint != TOMBSTONE_FINGERPRINT)
            .group_by(h.city_code)
        ).all()
    return {
        str(city): CityCounts(int(n), int(active or 0), _aware(latest))
        for city, n, active, latest in rows
    }


@dataclass(frozen=True)
class OpenTicket:
    """A hotel with an open dead-letter ticket: its newest one, and what the catalog holds.

    Attributes:
        hotel_id: The supplier's hotel id.
        catalog_status: Its status in the catalog (None: the catalog does not hold it).
        payload_ref: The raw page of the ticket's record (None: nothing stored).
        position: The record's place on that page (``record#N``).
        seen_at: When the ticket was last written (the database clock): a record whose own
            ``updated_at`` is unreadable changed no later than that.
    """

    hotel_id: str
    catalog_status: str | None
    payload_ref: str | None
    position: str | None
    seen_at: datetime | None = None


def open_tickets(db: SyncDatabase, supplier_id: int) -> dict[str, list[OpenTicket]]:
    """City -> its hotels with an open dead-letter ticket (status neither RESOLVED nor
    IGNORED; a city's own CITY_FAILED ticket names no hotel and is not one), each once."""
    d, h = schema.dead_letter.c, schema.platform_hotel.c
    columns = (d.supplier_resource_code, d.city_code, d.raw_payload_ref)
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(*columns, d.record_position, d.updated_at)
            .where(
                d.supplier_id == supplier_id,
                d.status.not_in(CLOSED_TICKETS),
                d.supplier_resource_code != UNKNOWN,
                d.city_code.is_not(None),
            )
            .order_by(d.id)
        ).all()
        newest = {str(r.supplier_resource_code): r for r in rows}
        held: dict[str, tuple[str, str]] = {}
        for part in chunks(list(newest), ID_CHUNK):
            for hotel_id, city, status in conn.execute(
                sa.select(h.supplier_hotel_id, h.city_code, h.status).where(
                    h.supplier_id == supplier_id,
                    h.supplier_hotel_id.in_(part),
                    h.fingerprint != TOMBSTONE_FINGERPRINT,
                )
            ):
                held[str(hotel_id)] = (str(city), str(status))
    by_city: dict[str, list[OpenTicket]] = {}
    for hotel_id, r in newest.items():
        city = str(r.city_code)
        catalog = held.get(hotel_id)
        # A catalog hotel of another city is that city's: here the supplier lists it anew.
        status = catalog[1] if catalog is not None and catalog[0] == city else None
        by_city.setdefault(city, []).append(
            OpenTicket(hotel_id, status, r.raw_payload_ref, r.record_position, _aware(r.updated_at))
        )
    return by_city


@dataclass(frozen=True)
class _Side:
    """What one side of a comparison may hold: counts, a range of active hotels, times."""

    label: str
    hotels: int
    active: tuple[int, int]
    newest: datetime | None
    newest_unknown: bool = False


def _reasons(
    supplier: CityCounts, side: _Side, catalog_newest: datetime | None, tolerance: Tolerance
) -> dict[str, str]:
    """Why ``side`` differs from ``supplier``, by aspect (hotels, active, behind, ahead)."""
    reasons = {}
    if not tolerance.allows(supplier.hotels, side.hotels):
        reasons["hotels"] = f"hotels {side.hotels} {side.label}, {supplier.hotels} at the supplier"
    low, high = side.active
    if not tolerance.allows(supplier.active, min(max(supplier.active, low), high)):
        shown = str(low) if low == high else f"{low}-{high}"
        reasons["active"] = f"active {shown} {side.label}, {supplier.active} at the supplier"
    if supplier.max_updated_at is not None:
        newest = side.newest
        behind = None if newest is None else (supplier.max_updated_at - newest).total_seconds()
        if not side.newest_unknown and (behind is None or behind > tolerance.max_lag_seconds):
            reasons["behind"] = (
                f"no hotel {side.label}"
                if behind is None
                else f"the catalog's newest change is {behind:.0f} s behind the supplier's"
            )
        # Ahead: the catalog's own times only (a ticket never explains a time too new).
        ahead = (
            None
            if catalog_newest is None
            else (catalog_newest - supplier.max_updated_at).total_seconds()
        )
        if "behind" not in reasons and ahead is not None and ahead > tolerance.max_ahead_seconds:
            reasons["ahead"] = (
                f"the catalog's newest change is {ahead:.0f} s ahead of the supplier's"
            )
    return reasons


def compare(
    city_code: str, supplier: CityCounts, catalog: CityCounts, tolerance: Tolerance
) -> CityComparison:
    """One city's comparison, with the reasons it differs."""
    side = _Side("in the catalog", catalog.hotels, (catalog.active,) * 2, catalog.max_updated_at)
    reasons = _reasons(supplier, side, catalog.max_updated_at, tolerance)
    return CityComparison(city_code, supplier, catalog, tuple(reasons.values()))


def compare_with_tickets(
    compared: CityComparison,
    tickets: Sequence[OpenTicket],
    tolerance: Tolerance,
    store: PayloadStore | None = None,
) -> CityComparison:
    """``compared`` (of the catalog alone), compared again as the catalog plus the city's
    open dead-letter tickets, when the catalog alone differs (see the module docstring).

    Args:
        compared: The catalog's comparison.
        tickets: The city's hotels with an open ticket.
        tolerance: What counts as different.
        store: The payload store holding the tickets' raw pages (None: every bad record's
            status and time are unknown).
    """
    supplier, catalog = compared.supplier, compared.catalog
    if supplier is None or not compared.differs or not tickets:
        return compared
    plain = _reasons(
        supplier,
        _Side("in the catalog", catalog.hotels, (catalog.active,) * 2, catalog.max_updated_at),
        catalog.max_updated_at,
        tolerance,
    )
    side = _with_tickets(catalog, tickets, store)
    remaining = _reasons(supplier, side, catalog.max_updated_at, tolerance)
    explained = tuple(text for aspect, text in plain.items() if aspect not in remaining)
    return dataclasses.replace(
        compared,
        reasons=tuple(remaining.values()),
        tickets=tuple(sorted(t.hotel_id for t in tickets)),
        explained=explained,
    )


def _with_tickets(
    catalog: CityCounts, tickets: Sequence[OpenTicket], store: PayloadStore | None
) -> _Side:
    """The catalog plus its open tickets: each ticketed hotel it lacks is one more hotel;
    a bad record's status and time stand in for the catalog's (an unknown status: either;
    an unknown time: when its ticket was last written, the latest it can be)."""
    hotels, low, high = catalog.hotels, catalog.active, catalog.active
    newest, unknown = catalog.max_updated_at, False
    pages: dict[str, list[Any]] = {}
    for ticket in tickets:
        active, updated = _ticket_record(store, ticket, pages)
        held = ticket.catalog_status
        if held is None:
            hotels += 1
        was = held == "ACTIVE"
        if active is None:
            low -= int(was)
            high += int(not was)
        else:
            low += int(active) - int(was)
            high += int(active) - int(was)
        updated = updated or ticket.seen_at
        if updated is None:
            unknown = True
        elif newest is None or updated > newest:
            newest = updated
    side = "in the catalog with its open dead letters"
    return _Side(side, hotels, (low, high), newest, unknown)


def _ticket_record(
    store: PayloadStore | None, ticket: OpenTicket, pages: dict[str, list[Any]]
) -> tuple[bool | None, datetime | None]:
    """The bad record's active flag and ``updated_at`` (None: unknown), read from its raw
    page (``pages`` caches the pages read)."""
    position = ticket.position or ""
    if store is None or ticket.payload_ref is None or not position.startswith("record#"):
        return None, None
    records = pages.get(ticket.payload_ref)
    if records is None:
        try:
            records = page_records(decode_page(store.get(ticket.payload_ref)))
        except (PayloadError, ValueError) as err:
            log.warning("ticket of hotel %r: its raw page is unreadable: %s", ticket.hotel_id, err)
            records = []
        pages[ticket.payload_ref] = records
    index = position.removeprefix("record#")
    record = records[int(index)] if index.isdigit() and int(index) < len(records) else None
    if not isinstance(record, dict) or record.get("hotel_id") != ticket.hotel_id:
        return None, None
    status, updated = record.get("status"), record.get("updated_at")
    active = {"ACTIVE": True, "INACTIVE": False}.get(status) if isinstance(status, str) else None
    return active, parse_timestamp(updated) if isinstance(updated, str) else None


def reconcile(
    db: SyncDatabase,
    client: SupplierClient,
    *,
    supplier_id: int,
    cities: Sequence[str] | None = None,
    tolerance: Tolerance | None = None,
    threads: int = DEFAULT_THREADS,
    store: PayloadStore | None = None,
    task_code: str | None = None,
    walk: WalkLimits | None = None,
) -> Reconciliation:
    """Compares every city (or ``cities``) of the supplier with the catalog.

    A city whose summary request fails is reported with its error and not re-pulled (its
    comparison waits for the next pass); a city the supplier does not know (404) has
    nothing at the supplier. A city whose last walk in the full-sync task ``task_code``
    drifted is walked again. A city that differs is compared again with its open
    dead-letter tickets (:func:`compare_with_tickets`).

    Args:
        db: The sync database.
        client: The supplier client (its rate limiter paces the summaries).
        supplier_id: The platform's supplier id.
        cities: The cities to compare; None: the city list that the full-sync task
            ``task_code`` stored last (in ``store``), else the supplier's (one more request).
        tolerance: What counts as different.
        threads: Summary requests in flight.
        store: The payload store holding the stored city lists and the tickets' raw pages.
        task_code: The full-sync task whose stored city list, and whose cities' last
            walks, to use (None: no city is walked again).
        walk: The supplier's walk limits, for walking a city again (always with the
            continuity check).

    Raises:
        UnknownCity: A city of ``cities`` that the supplier does not know (its summary
            answered 404): a code given by a person is checked, not reported as equal.
    """
    began = time.perf_counter()
    tolerance = tolerance or Tolerance()
    limits = dataclasses.replace(walk or WalkLimits(), continuity_check=True)
    before = client.stats().requests
    asked = list(dict.fromkeys(cities)) if cities is not None else None
    codes = asked
    if codes is None and store is not None and task_code is not None:
        codes = stored_city_codes(db, store, task_code=task_code) or None
    if codes is None:
        codes = [c.city_code for c in client.list_cities().data.cities]
    catalog = catalog_counts(db, supplier_id)
    tickets = open_tickets(db, supplier_id)
    drifted = drifted_cities(db, task_code) if task_code is not None else {}
    unknown: list[str] = []

    def one(code: str) -> CityComparison:
        mine = catalog.get(code, CityCounts())
        try:
            s = client.get_city_summary(code).data
        except SupplierNotFound:
            unknown.append(code)
            theirs = CityCounts()
        except SupplierError as err:
            return CityComparison(code, None, mine, (), f"{type(err).__name__}: {err}")
        else:
            theirs = CityCounts(
                s.hotel_count,
                s.active_count if s.active_count is not None else s.hotel_count,
                s.max_updated_at.astimezone(UTC) if s.max_updated_at else None,
            )
        compared = compare_with_tickets(
            compare(code, theirs, mine, tolerance), tickets.get(code, ()), tolerance, store
        )
        if code not in drifted:
            return compared
        return walk_again(
            db, client, compared, supplier_id=supplier_id, drift=drifted[code], limits=limits
        )

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="reconcile") as pool:
        results = list(pool.map(one, codes))
    if asked is not None and unknown:
        raise UnknownCity(_unknown_cities(sorted(unknown), catalog))
    report = Reconciliation(results, client.stats().requests - before, time.perf_counter() - began)
    log.info(
        "reconciled %d cities in %.1f s (%d requests, %d walked again): %d differ, "
        "%d wait on tickets, %d not compared",
        len(results),
        report.seconds,
        report.requests,
        sum(c.rewalked is not None for c in results),
        len(report.differing),
        len(report.waiting),
        len(report.failed),
    )
    return report


def _unknown_cities(codes: Sequence[str], catalog: dict[str, CityCounts]) -> str:
    """The one line that names the cities the supplier does not know."""
    named = ", ".join(repr(c[:64]) for c in codes[:5]) + (", …" if len(codes) > 5 else "")
    held = sum(catalog[c].hotels for c in codes if c in catalog)
    return (
        f"the supplier does not know {'city' if len(codes) == 1 else 'cities'} {named} "
        "(its summary answered 404): nothing to reconcile"
        + (f"; the catalog still holds {held} hotel(s) there" if held else "")
        + "; check the code against the supplier's city list"
    )


def drifted_cities(db: SyncDatabase, task_code: str) -> dict[str, str]:
    """City -> how its walk drifted, for the cities whose last successful walk in the task's
    batches drifted (``supplier_sync_city_walk``)."""
    sh, b, w = schema.shard.c, schema.batch.c, schema.city_walk.c
    latest = (
        sa.select(sh.shard_key, sa.func.max(sh.id).label("shard_id"))
        .join(schema.batch, b.batch_id == sh.batch_id)
        .where(b.task_code == task_code, sh.status == "SUCCESS")
        .group_by(sh.shard_key)
        .subquery()
    )
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(sh.shard_key, w.drift)
            .join(latest, latest.c.shard_id == sh.id)
            .join(
                schema.city_walk,
                sa.and_(w.batch_id == sh.batch_id, w.shard_key == sh.shard_key),
            )
        ).all()
    return {str(city): str(drift) for city, drift in rows}


def walk_again(
    db: SyncDatabase,
    client: SupplierClient,
    compared: CityComparison,
    *,
    supplier_id: int,
    drift: str,
    limits: WalkLimits,
) -> CityComparison:
    """``compared`` with what a new walk of the city's listing finds: its listed hotels that
    the catalog lacks (see the module docstring)."""
    city = compared.city_code
    listed: dict[str, datetime | None] = {}
    try:
        for page in CityWalk(client, city, page_size=REWALK_PAGE_SIZE, limits=limits):
            for record in page.page.hotels:
                hotel_id, updated = record.get("hotel_id"), record.get("updated_at")
                if isinstance(hotel_id, str):
                    listed[hotel_id] = (
                        parse_timestamp(updated) if isinstance(updated, str) else None
                    )
    except SupplierError as err:
        error = f"walking it again after a {drift} walk failed: {type(err).__name__}: {err}"
        return dataclasses.replace(compared, rewalked=drift, error=error)
    newest = compared.catalog.max_updated_at
    held = accounted_for(db, supplier_id, list(listed))
    missing = tuple(
        sorted(
            h
            for h, at in listed.items()
            if h not in held and at is not None and newest is not None and at <= newest
        )
    )
    reasons = compared.reasons
    if missing:
        shown = ", ".join(repr(h[:32]) for h in missing[:3]) + (", …" if len(missing) > 3 else "")
        reasons = (
            *reasons,
            f"{len(missing)} listed hotel(s) not in the catalog ({shown}), walked again after "
            f"a {drift} walk",
        )
    return dataclasses.replace(compared, reasons=reasons, rewalked=drift, missing=missing)


def accounted_for(db: SyncDatabase, supplier_id: int, hotel_ids: Sequence[str]) -> set[str]:
    """Of ``hotel_ids``, those the catalog holds (not tombstoned), or that wait as an open
    dead-letter ticket or a pending review: every other listed hotel is lost."""
    h, d, r = schema.platform_hotel.c, schema.dead_letter.c, schema.review.c
    found: set[str] = set()
    with db.engine.connect() as conn:
        for part in chunks(list(hotel_ids), ID_CHUNK):
            for stmt in (
                sa.select(h.supplier_hotel_id).where(
                    h.supplier_id == supplier_id,
                    h.supplier_hotel_id.in_(part),
                    h.fingerprint != TOMBSTONE_FINGERPRINT,
                ),
                sa.select(d.supplier_resource_code).where(
                    d.supplier_id == supplier_id,
                    d.supplier_resource_code.in_(part),
                    d.status.not_in(CLOSED_TICKETS),
                ),
                sa.select(r.supplier_hotel_id).where(
                    r.supplier_id == supplier_id,
                    r.supplier_hotel_id.in_(part),
                    r.status == "PENDING",
                ),
            ):
                found.update(str(v) for v in conn.execute(stmt).scalars())
    return found


def _aware(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.strftime("%Y-%m-%dT%H:%M:%SZ")


__all__ = [
    "CLOSED_TICKETS",
    "CityComparison",
    "CityCounts",
    "OpenTicket",
    "Reconciliation",
    "RepullPlan",
    "Tolerance",
    "accounted_for",
    "catalog_counts",
    "compare",
    "compare_with_tickets",
    "drifted_cities",
    "open_tickets",
    "plan_repull",
    "reconcile",
    "walk_again",
]
