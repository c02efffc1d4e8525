"""Cities the supplier stopped listing retire: out of the active set, their hotels tombstoned.

The supplier's ``/v1/cities`` is the truth of which cities exist. A city that it no longer
lists (and that answers 404, :class:`~supplier_sync_dagster.core.errors.CityNotFound`) is
**retired** rather than failed for ever:

- the caller removes its city partition from the active set (Dagster keeps the history of
  its materializations), so no run asks for it again;
- its published hotels go through the tombstone grace of ``core.records.tombstones``: each
  full batch that sees the city unlisted counts one miss for every hotel of the city, and
  after ``missing_syncs`` of them the hotels are unpublished (INACTIVE, ``HotelUnpublished``);
  the per-city share limit of the tombstones does not apply (the whole city left), the
  guard below does;
- its open city tickets (CITY_FAILED, CITY_NOT_FOUND) are IGNORED: nothing is left to
  retry, and a due CITY_FAILED ticket would ask for a re-sync of the city;
- each retirement is written to the audit trail (``city.retire``), at most once per batch
  and city: a resumed batch does not count its misses twice.

A city that comes back is an ordinary city again: its partition is added back by the
discovery, its hotels' misses are cleared by its next complete listing, and its tombstoned
hotels publish again (their fingerprint is the tombstone's).

Guards: a supplier whose city list is **empty** retires nothing (:class:`EmptyCityList`);
a list that drops more than :func:`retire_limit` of the catalog's cities at once retires
none of them: they are **held**, with one open ``CITY_DROP_HELD`` ticket for a person, until
the supplier lists them again or the operator allows the drop (``allow_mass_drop``). A
partition city without a hotel in the catalog holds nothing, and retires unguarded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import CityNotFound, EmptyCityList
from supplier_sync_dagster.core.records import deadletters
from supplier_sync_dagster.core.records.tombstones import (
    DEFAULT_MISSING_SYNCS,
    TOMBSTONE_FINGERPRINT,
    record_presence,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import record_actions
from supplier_sync_dagster.core.store.db import SyncDatabase

log = logging.getLogger(__name__)

CITY_DROP_HELD = "CITY_DROP_HELD"
"""The code of the one ticket of a mass drop held for a person."""
RETIRE_ACTION = "city.retire"
"""The audit action of a retirement (target ``city``, id ``SUPPLIER:CITY``)."""
ACTOR = "supplier-sync"
MIN_RETIRE = 2
MAX_RETIRE_SHARE = 0.2
_HELD_POSITION = "cities:dropped"
_CITY_TICKETS = (deadletters.CITY_FAILED, CityNotFound.error_code)


def retire_limit(cities: int) -> int:
    """The most cities of a catalog of ``cities`` that may retire in one go."""
    return max(MIN_RETIRE, int(MAX_RETIRE_SHARE * cities))


@dataclass(frozen=True)
class RetirePlan:
    """Which cities retire now, and which a mass drop holds.

    Attributes:
        listed: The supplier's city codes.
        retire: Cities to retire now (the partition cities among them leave the active set).
        held: Cities with hotels in the catalog, unlisted, held by the guard.
        cities: The cities the guard counted (the catalog's and the listed ones).
    """

    listed: frozenset[str]
    retire: tuple[str, ...] = ()
    held: tuple[str, ...] = ()
    cities: int = 0


@dataclass
class Retirement:
    """What :func:`retire_cities` did.

    Attributes:
        retired: Cities retired by this call (those already retired in the batch excluded).
        held: Cities held by the mass-drop guard.
        missing: Hotels that got a miss (still published, in their grace).
        unpublished: Hotels unpublished now.
        tickets_closed: Open city tickets of the retired cities, now IGNORED.
        held_ticket: Whether a CITY_DROP_HELD ticket was opened now.
    """

    retired: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unpublished: list[str] = field(default_factory=list)
    tickets_closed: int = 0
    held_ticket: bool = False


def catalog_cities(conn: Connection, supplier_id: int) -> set[str]:
    """The cities with a published (not tombstoned) hotel of the supplier in the catalog."""
    h = schema.platform_hotel.c
    rows = conn.execute(
        sa.select(h.city_code)
        .where(h.supplier_id == supplier_id, h.fingerprint != TOMBSTONE_FINGERPRINT)
        .distinct()
    )
    return {str(r.city_code) for r in rows if r.city_code is not None}


def plan_retirement(
    db: SyncDatabase,
    *,
    supplier_id: int,
    listed: Iterable[str],
    partitions: Iterable[str] = (),
    allow_mass_drop: bool = False,
) -> RetirePlan:
    """Which cities retire, given the supplier's city list.

    Args:
        db: The sync database.
        supplier_id: The supplier.
        listed: The city codes the supplier lists now.
        partitions: The city codes of the account's partitions (the active set).
        allow_mass_drop: Retire every unlisted city, past the guard (an operator's call).

    Raises:
        EmptyCityList: The supplier lists no city: nothing retires.
    """
    codes = frozenset(listed)
    if not codes:
        raise EmptyCityList(
            "GET /v1/cities listed no city: no city is retired and nothing is synced; "
            "check the supplier's account before the next sync"
        )
    with db.engine.connect() as conn:
        catalog = catalog_cities(conn, supplier_id)
    dropped = sorted(catalog - codes)
    unheld = sorted(set(partitions) - codes - catalog)
    cities = len(catalog | codes)
    if len(dropped) > retire_limit(cities) and not allow_mass_drop:
        return RetirePlan(codes, tuple(unheld), tuple(dropped), cities)
    return RetirePlan(codes, tuple(sorted({*dropped, *unheld})), (), cities)


def retire_cities(
    db: SyncDatabase,
    plan: RetirePlan,
    *,
    supplier_id: int,
    batch_id: str,
    task_code: str,
    sync_mode: str = "FULL",
    missing_syncs: int = DEFAULT_MISSING_SYNCS,
) -> Retirement:
    """Retires ``plan.retire`` against the full batch ``batch_id``, and files the ticket of a
    held drop; one transaction.

    Args:
        db: The sync database.
        plan: From :func:`plan_retirement`.
        supplier_id: The supplier.
        batch_id: The full batch that saw the cities unlisted (an unpublished hotel's
            ``last_batch_id``; one miss per batch and city, none for a city the batch
            synced completely: it was listed then).
        task_code: The batch's task (its tickets name it).
        sync_mode: The batch's mode.
        missing_syncs: Batches without a city before its hotels are unpublished.
    """
    out = Retirement(held=list(plan.held))
    with db.begin() as conn:
        at = db.clock.read(conn)
        for city in plan.retire:
            if _listed_in(conn, batch_id, city) or _retired_in(conn, supplier_id, city, batch_id):
                continue
            presence = record_presence(
                conn,
                db.clock,
                supplier_id=supplier_id,
                city_code=city,
                listed=(),
                batch_id=batch_id,
                at=at,
                missing_syncs=missing_syncs,
                max_share=1.0,
            )
            closed = _close_city_tickets(conn, db, supplier_id, city)
            out.retired.append(city)
            out.missing += presence.missing
            out.unpublished += presence.unpublished
            out.tickets_closed += closed
            after = {
                "batch_id": batch_id,
                "missing": len(presence.missing),
                "unpublished": len(presence.unpublished),
                "tickets_closed": closed,
            }
            record_actions(
                conn,
                db.clock,
                action=RETIRE_ACTION,
                target_type="city",
                changes=[(_target(supplier_id, city), {"listed": True}, after)],
                actor=ACTOR,
                reason="the supplier no longer lists the city",
                identity=None,  # the process that retires: a run's or the sensor's
            )
        if plan.held:
            out.held_ticket = _hold(conn, db, plan, supplier_id, batch_id, task_code, sync_mode)
    if out.retired:
        log.info(
            "retired %d cities no longer listed (%s): %d hotels in grace, %d unpublished",
            len(out.retired),
            ", ".join(out.retired[:10]),
            len(out.missing),
            len(out.unpublished),
        )
    return out


def retired_at(conn: Connection, supplier_id: int | None = None) -> dict[str, datetime]:
    """City -> when it last retired (the supplier's, or every supplier's when None): a city
    retired after its last successful sync is not stale, it is gone."""
    a = schema.audit.c
    out: dict[str, datetime] = {}
    for target, at in conn.execute(
        sa.select(a.target_id, sa.func.max(a.created_at))
        .where(a.target_type == "city", a.action == RETIRE_ACTION)
        .group_by(a.target_id)
    ):
        supplier, _, city = str(target).partition(":")
        if supplier_id is None or supplier == str(supplier_id):
            out[city] = max(at, out.get(city, at))
    return out


def _target(supplier_id: int, city: str) -> str:
    return f"{supplier_id}:{city}"[:128]


def _listed_in(conn: Connection, batch_id: str, city: str) -> bool:
    """Whether the batch synced the city completely: it was listed then, and counts no miss
    (a batch from before the drop, seen by the discovery sensor)."""
    sh = schema.shard.c
    status = conn.execute(
        sa.select(sh.status).where(sh.batch_id == batch_id, sh.shard_key == city)
    ).scalar()
    return status == "SUCCESS"


def _retired_in(conn: Connection, supplier_id: int, city: str, batch_id: str) -> bool:
    """Whether the city was retired against this batch already (its latest retirement)."""
    a = schema.audit.c
    latest = conn.execute(
        sa.select(a.after_state)
        .where(
            a.target_type == "city",
            a.target_id == _target(supplier_id, city),
            a.action == RETIRE_ACTION,
        )
        .order_by(a.id.desc())
        .limit(1)
    ).scalar()
    return latest is not None and json.loads(latest).get("batch_id") == batch_id


def _close_city_tickets(conn: Connection, db: SyncDatabase, supplier_id: int, city: str) -> int:
    """IGNORES the open city tickets of a retired city: nothing is left to retry."""
    d = schema.dead_letter.c
    ids = [
        int(i)
        for i in conn.execute(
            sa.select(d.id).where(
                d.supplier_id == supplier_id,
                d.record_position == deadletters.city_position(city),
                d.error_code.in_(_CITY_TICKETS),
                d.status.in_(deadletters.OPEN_STATUSES),
            )
        ).scalars()
    ]
    return deadletters.move(
        conn, db.clock, ids, "ignore", fix_note="city retired: the supplier no longer lists it"
    )


def _hold(
    conn: Connection,
    db: SyncDatabase,
    plan: RetirePlan,
    supplier_id: int,
    batch_id: str,
    task_code: str,
    sync_mode: str,
) -> bool:
    """Opens the CITY_DROP_HELD ticket of a held drop, unless one is open; True if opened."""
    d = schema.dead_letter.c
    open_one = conn.execute(
        sa.select(d.id)
        .where(
            d.supplier_id == supplier_id,
            d.error_code == CITY_DROP_HELD,
            d.status.in_(deadletters.OPEN_STATUSES),
        )
        .limit(1)
    ).first()
    if open_one is not None:
        return False
    held = ", ".join(plan.held[:20]) + (" ..." if len(plan.held) > 20 else "")
    message = (
        f"the supplier stopped listing {len(plan.held)} cities at once, more than the "
        f"{retire_limit(plan.cities)} allowed: none retired, their hotels "
        f"stay published ({held}); if the drop is real, sync with --retire-dropped-cities"
    )
    # One ticket for the whole drop: a person decides, not one ticket per held city.
    ticket = deadletters.DeadLetter(
        None, "ADAPTER", "NON_RETRYABLE", CITY_DROP_HELD, message, None, None,
        record_position=_HELD_POSITION,
    )  # fmt: skip
    deadletters.record_dead_letters(
        conn,
        db.clock,
        letters=[ticket],
        batch_id=batch_id,
        task_code=task_code,
        sync_mode=sync_mode,
        supplier_id=supplier_id,
    )
    log.warning("%s", message)
    return True


def held_line(held: Collection[str]) -> str:
    """One line for a held drop (the terminal's, the sensor's)."""
    return (
        f"{len(held)} cities no longer listed were held, not retired (too many at once): "
        f"see supplier-sync dead-letters list --code {CITY_DROP_HELD}"
    )


__all__ = [
    "CITY_DROP_HELD",
    "RETIRE_ACTION",
    "RetirePlan",
    "Retirement",
    "catalog_cities",
    "held_line",
    "plan_retirement",
    "retire_cities",
    "retire_limit",
    "retired_at",
]
