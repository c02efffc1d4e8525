"""Dead letters: every record that could not be published, as a ticket with a state.

The lifecycle (seed §14)::

    PENDING ──start_retry──▶ RETRYING ──resolve──▶ RESOLVED
       │                        │
       │                        ├──retry_failed──▶ FAILED ──start_retry──▶ RETRYING ...
       │                        └──exhaust───────▶ MANUAL_FIX   (past max retries)
       ├──escalate──▶ MANUAL_FIX ──requeue──▶ PENDING  (an operator's retry or fix)
       ├──ignore────▶ IGNORED
       └──merge─────▶ MERGED  (the problem goes on in another ticket; from any open state)

A dead letter is a ticket for one problem: one error code of one subject (a hotel, a city,
or an unreadable record of a page; :func:`subject_key`) of a supplier. While it is open its
``open_slot`` is 1, and a UNIQUE key over (supplier, subject, code, open_slot) allows one
open ticket per problem: :func:`record_dead_letters` updates the open ticket of a problem
seen again (``seen_count``, ``last_seen_at``, the latest payload and batch) instead of
opening another. A ticket is RESOLVED only by a true fix: its hotel published
(:func:`resolve_subjects`, called by the publish path), a newer version of the record
superseding it, the hotel or city gone, a successful re-fetch or re-sync; a retry of a
record still refused leaves it open (the attempt counted).

A row is created PENDING (retryable codes, due after the first backoff) or MANUAL_FIX
(codes that need a person), as :data:`RULES` says; :func:`resolve`, :func:`ignore` and ``merge``
leave every open state. Every later move is one conditional UPDATE through :func:`move`, whose
affected-row count is checked: no status string is written anywhere else.

A dead letter names the stage that refused the record, a precise error code, the message
(with the offending value, truncated) and the raw payload it came from (ref and hash), so
that one record can be replayed later. A ticket keeps the batch and ids of the sight that
opened it (the seed's dedup key ``(batch, supplier, hotel, record position, stage, raw
hash)``) and the latest sight's payload and batch (``last_batch_id``).
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import (
    ConfigError,
    DeadLetterStateError,
    SupplierError,
    SupplierProtocolError,
    SupplierRateLimited,
)
from supplier_sync_dagster.core.records.mapping import chunks
from supplier_sync_dagster.core.records.normalize import ERROR_CODES
from supplier_sync_dagster.core.redaction import bounded
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import Identity, record_actions, require_who_and_why
from supplier_sync_dagster.core.store.db import DbClock, SyncDatabase, guarded_update, insert_ignore

ErrorStage = Literal["ADAPTER", "VALIDATION", "MAPPING", "PUBLISH", "INDEX"]
ErrorType = Literal["RETRYABLE", "NON_RETRYABLE", "MAPPING_REQUIRED", "RISK_BLOCKED"]
# The dedup key cannot rely on NULLs (a UNIQUE key lets NULLs repeat): unreadable ids and
# positions are stored as this marker.
UNKNOWN = "-"

DeadLetterStatus = Literal[
    "PENDING", "RETRYING", "RESOLVED", "FAILED", "MANUAL_FIX", "IGNORED", "MERGED"
]
ErrorClass = Literal["RETRYABLE", "NEEDS_PERSON"]
OPEN_STATUSES: Final[tuple[DeadLetterStatus, ...]] = ("PENDING", "RETRYING", "FAILED", "MANUAL_FIX")
"""States a dead letter can still leave (the rest are final)."""
CLOSED_STATUSES: Final[tuple[DeadLetterStatus, ...]] = ("RESOLVED", "IGNORED", "MERGED")
"""Final states: RESOLVED (a true fix), IGNORED (by an operator), MERGED (the problem goes on
in another ticket: a duplicate, or superseded by a ticket of the record's new problem)."""

Transition = Literal[
    "start_retry", "retry_failed", "exhaust", "escalate", "requeue", "resolve", "ignore", "merge"
]
TRANSITIONS: Final[dict[Transition, tuple[tuple[DeadLetterStatus, ...], DeadLetterStatus]]] = {
    "start_retry": (("PENDING", "FAILED"), "RETRYING"),
    "retry_failed": (("RETRYING",), "FAILED"),
    "exhaust": (("RETRYING",), "MANUAL_FIX"),
    "escalate": (("PENDING", "FAILED"), "MANUAL_FIX"),
    "requeue": (("MANUAL_FIX", "FAILED"), "PENDING"),
    "resolve": (OPEN_STATUSES, "RESOLVED"),
    "ignore": (OPEN_STATUSES, "IGNORED"),
    "merge": (OPEN_STATUSES, "MERGED"),
}
"""Each named move: the states it leaves and the state it enters."""

BACKOFF_SECONDS: Final[tuple[int, ...]] = (60, 300, 1800, 7200, 43200)
"""Wait before retry n+1 (1 min, 5 min, 30 min, 2 h, 12 h; the last repeats), before jitter."""
JITTER: Final = 0.2
"""Each wait is stretched or shrunk by up to this share, so rows failed together spread out."""


FIX_PROTECTED_FIELDS: Final[tuple[str, ...]] = (
    "hotel_id",
    "supplier_hotel_id",
    "supplier_id",
    "version",
    "updated_at",
)
"""The fields of a supplier's record that an operator's fix (:func:`check_fix_patch`) may
not touch: those that decide which hotel a record is (``hotel_id``; ``supplier_hotel_id``
and ``supplier_id`` are the platform's names for it and its supplier) and which of its
versions wins (``version``: the diff's STALE, the publish guard, a batch's highest version
of a hotel; ``updated_at``: the incremental watermark and the future-timestamp check). A fix
that set them could publish a version no genuine one would ever overtake; the supplier's
next version corrects them. Every other field is content, and a fix of it goes through every
check a synced record does."""


def check_fix_patch(patch: Any) -> dict[str, Any]:
    """An operator's fix, checked before anything is read or written: a JSON merge patch
    (an object) that touches none of :data:`FIX_PROTECTED_FIELDS` (setting or removing).

    Raises:
        ConfigError: Not an object, or it touches a protected field (all of them named).
    """
    if not isinstance(patch, dict):
        raise ConfigError("a fix is a JSON object (a merge patch of the supplier's record)")
    touched = [name for name in FIX_PROTECTED_FIELDS if name in patch]
    if touched:
        raise ConfigError(
            f"a fix may not change {', '.join(touched)}: a record's identity and versioning "
            "are the supplier's (its next version corrects them); every other field may change"
        )
    return patch


@dataclass(frozen=True, slots=True)
class Rule:
    """What happens to the dead letters of one error code.

    Attributes:
        error_class: RETRYABLE rows are compensated automatically; NEEDS_PERSON rows go
            straight to MANUAL_FIX.
        owner_team: The team that fixes what compensation cannot.
        max_retries: Automatic attempts before a RETRYABLE row goes to MANUAL_FIX.
    """

    error_class: ErrorClass
    owner_team: str
    max_retries: int = 0


_SUPPLIER_DATA = Rule("NEEDS_PERSON", "supplier-data")
_PRODUCT_SYNC = Rule("NEEDS_PERSON", "product-sync")
_PLATFORM_BUG = Rule("NEEDS_PERSON", "sync-platform")
_TRANSIENT = Rule("RETRYABLE", "sync-platform", len(BACKOFF_SECONDS))

RULES: Final[Mapping[str, Rule]] = {
    # Retryable: the same request or write can succeed later.
    "SUPPLIER_UNAVAILABLE": _TRANSIENT,  # 5xx, timeout, connection error on a one-hotel fetch
    "SUPPLIER_RATE_LIMITED": _TRANSIENT,  # still 429 after the client's own retries
    "SUPPLIER_PROTOCOL_ERROR": _TRANSIENT,  # truncated or non-JSON body
    "MAPPING_CONFLICT": _TRANSIENT,  # another writer allocated the same mapping first
    "PUBLISH_CONFLICT": _TRANSIENT,  # a guarded publish lost a race
    "CITY_FAILED": _TRANSIENT,  # the city stopped mid-way; its records are re-fetched
    # A bug of ours, not the supplier's: kept for a replay after the fix.
    "INTERNAL_ERROR": _PLATFORM_BUG,
    "MALFORMED_DOCUMENT": _PLATFORM_BUG,
    # The supplier no longer serves a city (404, not retried: a city it no longer lists
    # retires), or dropped too many at once for them to retire unseen.
    "CITY_NOT_FOUND": _SUPPLIER_DATA,
    "CITY_DROP_HELD": _SUPPLIER_DATA,
    # The record may be right and the city list wrong: someone maps the city or the hotel.
    "COUNTRY_CITY_MISMATCH": _PRODUCT_SYNC,
    # The supplier's data breaks the contract: the supplier has to correct it (or a `fix`).
    **{
        code: _SUPPLIER_DATA
        for code in (*ERROR_CODES, "MIXED_ROOM_CURRENCY")
        if code not in ("INTERNAL_ERROR",)
    },
}
"""Every error code's class, owner team and retry budget: the one table of rules."""


def rule_for(error_code: str) -> Rule:
    """The rule of ``error_code``; a code without one needs a person of the platform team."""
    return RULES.get(error_code, _PLATFORM_BUG)


def supplier_error_code(err: SupplierError) -> str:
    """The code of a failed single-hotel request (a RETRYABLE rule)."""
    if isinstance(err, SupplierRateLimited):
        return "SUPPLIER_RATE_LIMITED"
    if isinstance(err, SupplierProtocolError):
        return "SUPPLIER_PROTOCOL_ERROR"
    return "SUPPLIER_UNAVAILABLE"


def backoff_seconds(retry_count: int, *, rng: random.Random | None = None) -> float:
    """The wait before the next attempt after ``retry_count`` attempts, with jitter."""
    base = BACKOFF_SECONDS[min(max(retry_count, 0), len(BACKOFF_SECONDS) - 1)]
    return base * (1 + JITTER * (2 * (rng or random).random() - 1))


@dataclass(frozen=True)
class DeadLetter:
    """One failed record."""

    supplier_hotel_id: str | None
    error_stage: ErrorStage
    error_type: ErrorType
    error_code: str
    error_message: str
    raw_payload_ref: str | None
    raw_payload_hash: str | None
    # The record's place on its raw page ('record#N'), part of the dedup key.
    record_position: str | None = None
    normalized_payload_ref: str | None = None
    # The city of the record: the listing's, or the record's own (a change feed).
    city_code: str | None = None
    # The supplier's version of the record, when it could be read.
    record_version: int | None = None


def dead_letter_id(batch_id: str, supplier_id: int, letter: DeadLetter) -> str:
    """The deterministic id of a dead letter: a hash of its dedup key."""
    key = "\0".join(
        (
            batch_id,
            str(supplier_id),
            letter.supplier_hotel_id or UNKNOWN,
            letter.record_position or UNKNOWN,
            letter.error_stage,
            letter.raw_payload_hash or UNKNOWN,
        )
    )
    return "dl_" + hashlib.sha256(key.encode()).hexdigest()[:61]


def subject_key(letter: DeadLetter) -> str:
    """What a dead letter is about: ``hotel:<id>``, ``city:<code>`` (a CITY_FAILED ticket),
    or ``record:<page hash>#<position>`` for a record whose hotel id could not be read."""
    if letter.error_code == CITY_FAILED:
        return city_subject(letter.city_code or UNKNOWN)
    if letter.supplier_hotel_id and letter.supplier_hotel_id != UNKNOWN:
        return hotel_subject(letter.supplier_hotel_id)
    page = letter.raw_payload_hash or UNKNOWN
    return f"record:{page}#{letter.record_position or UNKNOWN}"[:200]


def hotel_subject(hotel_id: str) -> str:
    """The subject key of a hotel's tickets."""
    return f"hotel:{hotel_id}"[:200]


def city_subject(city_code: str) -> str:
    """The subject key of a city's tickets."""
    return f"city:{city_code}"[:200]


def city_position(city_code: str) -> str:
    """The record position of a city's ticket."""
    return f"city:{city_code}"[:128]


def record_dead_letters(
    conn: Connection,
    clock: DbClock,
    *,
    batch_id: str,
    task_code: str,
    sync_mode: str,
    supplier_id: int,
    letters: Sequence[DeadLetter],
    category_code: str = "HOTEL",
) -> None:
    """Records dead letters: one open ticket per problem (supplier, subject, error code).

    A problem without an open ticket gets a new one; a problem seen again updates its open
    ticket: ``seen_count`` + 1 (once per batch: a resumed batch that sees it again counts
    nothing), ``last_seen_at`` (database clock), the latest message, payload, record
    version and batch. Its state, attempts and schedule stay as they were.
    """
    if not letters:
        return
    now = clock.read(conn)
    latest = {(subject_key(x), x.error_code[:128]): x for x in letters}
    existing = _open_tickets(conn, supplier_id, list(latest))
    # The same bad version of a record an operator fixed is the fixed problem, not a new one.
    existing.update(_fixed_tickets(conn, supplier_id, latest, skip=existing))
    fresh = [x for key, x in latest.items() if key not in existing]
    if fresh:
        insert_ignore(
            conn,
            schema.dead_letter,
            [_new_row(batch_id, supplier_id, x, now) for x in fresh],
            batch_id=batch_id,
            task_code=task_code,
            sync_mode=sync_mode,
            category_code=category_code,
            supplier_id=supplier_id,
            created_at=now,
            updated_at=now,
            last_seen_at=now,
            last_batch_id=batch_id,
            open_slot=1,
            seen_count=1,
        )
        # A ticket another writer opened meanwhile (the insert skipped ours) is updated.
        raced = _open_tickets(conn, supplier_id, [k for k in latest if k not in existing])
        existing.update({k: v for k, v in raced.items() if v[1] != batch_id or v[2] != now})
    d = schema.dead_letter.c
    for key, (ticket, last_batch, _seen) in existing.items():
        letter = latest[key]
        conn.execute(
            sa.update(schema.dead_letter)
            .where(d.id == ticket)
            .values(
                seen_count=d.seen_count + (0 if last_batch == batch_id else 1),
                last_seen_at=now,
                last_batch_id=batch_id,
                updated_at=now,
                **_payload(letter),
            )
        )
    _supersede(conn, clock, supplier_id, latest)


def _supersede(
    conn: Connection,
    clock: DbClock,
    supplier_id: int,
    latest: Mapping[tuple[str, str], DeadLetter],
) -> None:
    """Closes (MERGED) the open tickets of an older version of a record whose newer version
    fails with another problem: the newer record's ticket says what is wrong now. Tickets a
    compensation holds are left to it."""
    newest: dict[str, tuple[int, str]] = {}
    for (subject, code), letter in latest.items():
        v = letter.record_version
        if (
            v is not None
            and subject.startswith("hotel:")
            and (subject not in newest or v > newest[subject][0])
        ):
            newest[subject] = (v, code)
    if not newest:
        return
    d = schema.dead_letter.c
    stale: dict[str, list[int]] = {}
    for part in chunks(sorted(newest)):
        for r in conn.execute(
            sa.select(d.id, d.subject_key, d.error_code, d.record_version).where(
                d.supplier_id == supplier_id,
                d.subject_key.in_(part),
                d.open_slot == 1,
                d.status != "RETRYING",
                d.record_version.is_not(None),
            )
        ):
            version, code = newest[str(r.subject_key)]
            if r.error_code != code and int(r.record_version) < version:
                note = f"superseded: version {version} of the record fails with {code}"
                stale.setdefault(note, []).append(int(r.id))
    for note, ids in stale.items():
        move(conn, clock, ids, "merge", fix_note=note)


def _payload(d: DeadLetter) -> dict[str, Any]:
    """The columns a re-seen problem refreshes: what the latest sight of it was."""
    out: dict[str, Any] = {
        "error_message": bounded(d.error_message),
        "raw_payload_ref": d.raw_payload_ref,
        "raw_payload_hash": d.raw_payload_hash or UNKNOWN,
        "record_position": (d.record_position or UNKNOWN)[:128],
        "normalized_payload_ref": d.normalized_payload_ref,
        "record_version": d.record_version,
    }
    if d.city_code is not None:
        out["city_code"] = d.city_code[:64]
    return out


def _new_row(batch_id: str, supplier_id: int, d: DeadLetter, now: datetime) -> dict[str, Any]:
    return {
        "dead_letter_id": dead_letter_id(batch_id, supplier_id, d),
        "supplier_resource_code": (d.supplier_hotel_id or UNKNOWN)[:128],
        "error_stage": d.error_stage,
        "error_type": d.error_type,
        "error_code": d.error_code[:128],
        "subject_key": subject_key(d),
        "city_code": None if d.city_code is None else d.city_code[:64],
        **{k: v for k, v in _payload(d).items() if k != "city_code"},
        **_initial_state(d.error_code, now),
    }


def _open_tickets(
    conn: Connection, supplier_id: int, keys: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], tuple[int, str | None, datetime | None]]:
    """The open tickets of these (subject, code) problems: (id, last batch, last seen)."""
    d = schema.dead_letter.c
    wanted = set(keys)
    out: dict[tuple[str, str], tuple[int, str | None, datetime | None]] = {}
    for part in chunks(sorted({s for s, _ in wanted})):
        for r in conn.execute(
            sa.select(d.id, d.subject_key, d.error_code, d.last_batch_id, d.last_seen_at).where(
                d.supplier_id == supplier_id, d.subject_key.in_(part), d.open_slot == 1
            )
        ):
            key = (str(r.subject_key), str(r.error_code))
            if key in wanted:
                out[key] = (int(r.id), r.last_batch_id, r.last_seen_at)
    return out


def _fixed_tickets(
    conn: Connection,
    supplier_id: int,
    latest: dict[tuple[str, str], DeadLetter],
    *,
    skip: dict[tuple[str, str], Any],
) -> dict[tuple[str, str], tuple[int, str | None, datetime | None]]:
    """The RESOLVED tickets of problems seen again at the very record version they were
    resolved at (an operator's fix of that version published): (id, last batch, last seen).
    A sight of it counts on that ticket, which stays RESOLVED; a newer version that is still
    bad is a new problem."""
    d = schema.dead_letter.c
    wanted = {k: x.record_version for k, x in latest.items() if k not in skip and x.record_version}
    out: dict[tuple[str, str], tuple[int, str | None, datetime | None]] = {}
    for part in chunks(sorted({s for s, _ in wanted})):
        for r in conn.execute(
            sa.select(
                d.id, d.subject_key, d.error_code, d.record_version, d.last_batch_id, d.last_seen_at
            )
            .where(d.supplier_id == supplier_id, d.subject_key.in_(part), d.status == "RESOLVED")
            .order_by(d.id)
        ):
            key = (str(r.subject_key), str(r.error_code))
            if key in wanted and r.record_version == wanted[key]:
                out[key] = (int(r.id), r.last_batch_id, r.last_seen_at)
    return out


def resolve_subjects(
    conn: Connection,
    clock: DbClock,
    *,
    supplier_id: int,
    subjects: Sequence[str],
    batch_id: str,
    note: str,
    gone: bool = False,
) -> int:
    """Closes every open ticket of these subjects, whatever its class: RESOLVED when the
    hotel published (the publish path's hook); IGNORED when ``gone`` (the hotel or city is
    gone: nothing was fixed, so the fix rate does not count it).

    Tickets a compensation of this same batch holds (RETRYING) are left to it: it resolves
    them itself, saying how. A problem this batch saw again is not resolved by it either
    (a page that holds a good and a bad record of the hotel).

    Returns:
        The tickets resolved.
    """
    ids: list[int] = []
    query = _open_of_subjects()
    for part in chunks(sorted(set(subjects))):
        ids += conn.execute(
            query, {"supplier_id": supplier_id, "subjects": part, "batch_id": batch_id}
        ).scalars()
    return move(conn, clock, ids, "ignore" if gone else "resolve", fix_note=note[:1024])


@functools.cache
def _open_of_subjects() -> sa.Select[Any]:
    """The open tickets of some subjects that :func:`resolve_subjects` closes, built once
    (a publish runs it per chunk; the IN list is one expanding parameter)."""
    d = schema.dead_letter.c
    batch_id: Any = sa.bindparam("batch_id")
    return sa.select(d.id).where(
        d.supplier_id == sa.bindparam("supplier_id"),
        d.subject_key.in_(sa.bindparam("subjects", expanding=True)),
        d.open_slot == 1,
        sa.or_(d.last_batch_id.is_(None), d.last_batch_id != batch_id),
        sa.or_(
            d.status != "RETRYING",
            d.retry_batch_id.is_(None),
            d.retry_batch_id != batch_id,
        ),
    )


CITY_FAILED = "CITY_FAILED"
"""A city whose sync stopped mid-way (the supplier failed beyond retries)."""


def record_city_failure(
    db: SyncDatabase,
    *,
    batch_id: str,
    task_code: str,
    sync_mode: str,
    supplier_id: int,
    city_code: str,
    error: str,
    error_code: str = CITY_FAILED,
) -> None:
    """Writes the ticket of a city that failed in a batch (one open ticket per city and
    code): CITY_FAILED by default (retryable: the city is re-synced), or another city code
    such as CITY_NOT_FOUND (its class from :data:`RULES`: a 404 needs a person).

    Args:
        db: The sync database.
        batch_id: The batch the city failed in.
        task_code: The batch's task.
        sync_mode: The batch's mode.
        supplier_id: The supplier.
        city_code: The city.
        error: What failed.
        error_code: The ticket's code.
    """
    rule = rule_for(error_code)
    retryable = rule.error_class == "RETRYABLE"
    message = (
        f"the city's sync stopped: {error}"
        if error_code == CITY_FAILED
        else f"the supplier does not know the city: {error}"
    )
    with db.begin() as conn:
        record_dead_letters(
            conn,
            db.clock,
            batch_id=batch_id,
            task_code=task_code,
            sync_mode=sync_mode,
            supplier_id=supplier_id,
            letters=[
                DeadLetter(
                    None,
                    "ADAPTER",
                    "RETRYABLE" if retryable else "NON_RETRYABLE",
                    error_code,
                    message,
                    None,
                    None,
                    record_position=city_position(city_code),
                    city_code=city_code,
                )
            ],
        )


def _initial_state(error_code: str, now: datetime) -> dict[str, Any]:
    rule = rule_for(error_code)
    if rule.error_class == "RETRYABLE":
        return {
            "status": "PENDING",
            "max_retry_count": rule.max_retries,
            "owner_team": rule.owner_team,
            "next_retry_at": now + timedelta(seconds=backoff_seconds(0)),
        }
    return {
        "status": "MANUAL_FIX",
        "max_retry_count": 0,
        "owner_team": rule.owner_team,
        "next_retry_at": None,
    }


def move(
    conn: Connection,
    clock: DbClock,
    ids: Sequence[int],
    transition: Transition,
    **values: Any,
) -> int:
    """Moves dead letters along one named transition, in one guarded UPDATE.

    Args:
        conn: The caller's transaction (a failed check leaves it to roll back).
        clock: The database clock.
        ids: The rows' ``id`` values.
        transition: The move (:data:`TRANSITIONS`).
        **values: Other columns the move sets (``fix_note``, ``next_retry_at`` ...).

    Returns:
        The number of rows moved (``len(ids)``).

    Raises:
        DeadLetterStateError: Some row does not exist or is not in a state the move leaves.
    """
    unique = sorted(set(ids))
    if not unique:
        return 0
    sources, target = TRANSITIONS[transition]
    d = schema.dead_letter.c
    extra: dict[str, Any] = {"status": target, "updated_at": clock.now(), **values}
    if transition == "start_retry":
        extra.update(retry_count=d.retry_count + 1, last_retry_at=clock.now(), next_retry_at=None)
    elif target in CLOSED_STATUSES:
        # The open slot frees: the problem may open a new ticket if it comes back.
        extra.update(resolved_at=clock.now(), next_retry_at=None, open_slot=None)
    elif target == "MANUAL_FIX":
        extra.update(next_retry_at=None)

    def refused() -> DeadLetterStateError:
        return DeadLetterStateError(
            f"{transition}: some of dead letters {unique[:10]} do not exist "
            f"or are not {'/'.join(sources)}"
        )

    for part in chunks(unique):
        guarded_update(
            conn,
            sa.update(schema.dead_letter)
            .where(d.id.in_(part), d.status.in_(sources))
            .values(**extra),
            refused,
            expected=len(part),
        )
    return len(unique)


def fail_attempt(
    conn: Connection,
    clock: DbClock,
    ids: Sequence[int],
    *,
    error_message: str | None,
    rng: random.Random | None = None,
) -> tuple[int, int]:
    """Ends failed attempts: FAILED with the next backoff, or MANUAL_FIX past max retries.

    ``error_message`` replaces the rows' message (None keeps it: the attempt was a request
    for work elsewhere, such as a city's re-sync).

    Returns:
        (rows rescheduled, rows exhausted).
    """
    d = schema.dead_letter.c
    rows = conn.execute(
        sa.select(d.id, d.retry_count, d.max_retry_count).where(d.id.in_(sorted(set(ids))))
    ).all()
    message: dict[str, Any] = (
        {} if error_message is None else {"error_message": bounded(error_message)}
    )
    exhausted = [int(r.id) for r in rows if r.retry_count >= r.max_retry_count]
    by_count: dict[int, list[int]] = {}
    for r in rows:
        if r.retry_count < r.max_retry_count:
            by_count.setdefault(int(r.retry_count), []).append(int(r.id))
    for count, part in by_count.items():
        move(
            conn,
            clock,
            part,
            "retry_failed",
            **message,
            next_retry_at=clock.now(backoff_seconds(count, rng=rng)),
        )
    move(conn, clock, exhausted, "exhaust", **message)
    if len(rows) != len(set(ids)):
        raise DeadLetterStateError(f"{len(set(ids)) - len(rows)} dead letters do not exist")
    return sum(map(len, by_count.values())), len(exhausted)


def due_for_retry(
    conn: Connection,
    clock: DbClock,
    *,
    limit: int = 100,
    supplier_id: int | None = None,
    cities: bool | None = None,
    task_codes: Sequence[str] = (),
) -> list[int]:
    """Ids of retryable rows whose next attempt is due, oldest due first (seed §14.4).

    Args:
        conn: A connection.
        clock: The database clock.
        limit: At most this many.
        supplier_id: Only this supplier's rows (None: any supplier's).
        cities: True: only CITY_FAILED tickets (a city to re-sync); False: only the others
            (a hotel to re-fetch); None: both.
        task_codes: Only rows these tasks' batches wrote (one account's); empty: any task's.
    """
    d = schema.dead_letter.c
    where = [
        d.status.in_(("PENDING", "FAILED")),
        d.next_retry_at <= clock.now(),
        d.retry_count < d.max_retry_count,
    ]
    if supplier_id is not None:
        where.append(d.supplier_id == supplier_id)
    if cities is not None:
        where.append(d.error_code == CITY_FAILED if cities else d.error_code != CITY_FAILED)
    if task_codes:
        where.append(d.task_code.in_(list(task_codes)))
    return [
        int(i)
        for i in conn.execute(
            sa.select(d.id).where(*where).order_by(d.next_retry_at, d.id).limit(limit)
        ).scalars()
    ]


def count_dead_letters(conn: Connection, batch_id: str) -> dict[str, int]:
    """Dead letters of a batch by error code."""
    rows = conn.execute(
        sa.select(schema.dead_letter.c.error_code, sa.func.count())
        .where(
            sa.or_(
                schema.dead_letter.c.batch_id == batch_id,
                schema.dead_letter.c.last_batch_id == batch_id,
            )
        )
        .group_by(schema.dead_letter.c.error_code)
    )
    return {code: int(n) for code, n in rows}


@dataclass(frozen=True)
class DeadLetterFilter:
    """Which dead letters to list; every field narrows (None: any)."""

    id: int | None = None
    status: str | None = None
    error_code: str | None = None
    error_class: ErrorClass | None = None
    batch_id: str | None = None
    supplier_hotel_id: str | None = None
    city_code: str | None = None
    older_than_hours: float | None = None


def list_dead_letters(
    conn: Connection, clock: DbClock, where: DeadLetterFilter, *, limit: int = 100
) -> list[dict[str, Any]]:
    """Dead letters matching ``where``, newest first, with their rule's class."""
    d = schema.dead_letter.c
    stmt = sa.select(schema.dead_letter).order_by(d.id.desc()).limit(limit)
    if where.id is not None:
        stmt = stmt.where(d.id == where.id)
    if where.status:
        stmt = stmt.where(d.status == where.status)
    if where.error_code:
        stmt = stmt.where(d.error_code == where.error_code)
    if where.error_class:
        codes = [c for c, r in RULES.items() if r.error_class == where.error_class]
        in_rules = d.error_code.in_(list(RULES))
        # Codes without a rule need a person (rule_for's default).
        stmt = stmt.where(
            d.error_code.in_(codes)
            if where.error_class == "RETRYABLE"
            else sa.or_(d.error_code.in_(codes), ~in_rules)
        )
    if where.batch_id:
        stmt = stmt.where(sa.or_(d.batch_id == where.batch_id, d.last_batch_id == where.batch_id))
    if where.supplier_hotel_id:
        stmt = stmt.where(d.supplier_resource_code == where.supplier_hotel_id)
    if where.city_code:
        stmt = stmt.where(d.city_code == where.city_code)
    if where.older_than_hours is not None:
        stmt = stmt.where(d.created_at <= clock.now(-3600 * where.older_than_hours))
    return [
        {**row._asdict(), "error_class": rule_for(row.error_code).error_class}
        for row in conn.execute(stmt)
    ]


def snapshot(conn: Connection, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The operator-facing state of dead letters (an audit row's before and after)."""
    d = schema.dead_letter.c
    cols = (
        d.id,
        d.dead_letter_id,
        d.status,
        d.retry_count,
        d.max_retry_count,
        d.next_retry_at,
        d.fix_note,
    )
    return {
        int(r.id): {k: v for k, v in r._asdict().items() if k != "id"}
        for r in conn.execute(sa.select(*cols).where(d.id.in_(sorted(set(ids)))))
    }


def operator_action(
    conn: Connection,
    clock: DbClock,
    ids: Sequence[int],
    action: Literal["retry", "ignore"],
    *,
    actor: str,
    reason: str,
    identity: Identity | None = None,
) -> int:
    """An operator's ``retry`` (due now, one more attempt) or ``ignore``, audited.

    Args:
        conn: The transaction that makes the change and writes the audit rows.
        clock: The database clock.
        ids: Dead letter ids.
        action: ``retry`` re-queues MANUAL_FIX/FAILED rows, due now, with one more attempt
            in their budget; ``ignore`` closes any open row.
        actor: Who (recorded).
        reason: Why (recorded).
        identity: Who, as the acting process proves it; None: this process's.

    Returns:
        The number of rows moved.

    Raises:
        ConfigError: No actor or reason.
        DeadLetterStateError: A row is missing or not in a state the action leaves.
    """
    who, why = require_who_and_why(actor, reason)
    before = snapshot(conn, ids)
    if action == "retry":
        d = schema.dead_letter.c
        moved = move(
            conn,
            clock,
            ids,
            "requeue",
            next_retry_at=clock.now(),
            max_retry_count=sa.func.greatest(d.max_retry_count, d.retry_count + 1)
            if conn.dialect.name != "sqlite"
            else sa.func.max(d.max_retry_count, d.retry_count + 1),
            assignee=who[:64],
        )
    else:
        moved = move(conn, clock, ids, "ignore", fix_note=f"ignored by {who}: {why}"[:1024])
    after = snapshot(conn, ids)
    record_actions(
        conn,
        clock,
        action=f"dead_letter.{action}",
        target_type="dead_letter",
        changes=[(before[i]["dead_letter_id"], before[i], after[i]) for i in sorted(before)],
        actor=who,
        reason=why,
        identity=identity,
    )
    return moved


@dataclass(frozen=True)
class Summary:
    """The dead letters in numbers (the ``dead_letter_summary`` asset, metrics, alerts).

    Attributes:
        by_status: Rows per status.
        by_code: Open rows per error code.
        by_class: Open rows per error class.
        oldest_open_hours: Age of the oldest open row (0 when none is open).
        created_24h: Rows written in the last 24 hours.
        resolved_24h: Rows resolved (not ignored) in the last 24 hours.
        created_7d: Rows written in the last 7 days.
        resolved_7d: Rows resolved in the last 7 days.
    """

    by_status: dict[str, int]
    by_code: dict[str, int]
    by_class: dict[str, int]
    oldest_open_hours: float
    created_24h: int
    resolved_24h: int
    created_7d: int
    resolved_7d: int

    @property
    def open(self) -> int:
        """Rows in an open state."""
        return sum(n for s, n in self.by_status.items() if s in OPEN_STATUSES)

    @staticmethod
    def rate(resolved: int, created: int) -> float:
        """Resolved ÷ created (1.0 when nothing was created: nothing is waiting)."""
        return 1.0 if created == 0 else round(resolved / created, 4)

    @property
    def fix_rate_24h(self) -> float:
        """The seed's fix rate over the last 24 hours."""
        return self.rate(self.resolved_24h, self.created_24h)

    @property
    def fix_rate_7d(self) -> float:
        """The seed's fix rate over the last 7 days."""
        return self.rate(self.resolved_7d, self.created_7d)


def summarize(conn: Connection, clock: DbClock, *, supplier_id: int | None = None) -> Summary:
    """The dead letters in numbers, in four grouped queries (no row is read one by one)."""
    d = schema.dead_letter.c
    scope = [] if supplier_id is None else [d.supplier_id == supplier_id]
    now = clock.read(conn)
    by_status: dict[str, int] = {}
    by_code: dict[str, int] = {}
    by_class: dict[str, int] = {"RETRYABLE": 0, "NEEDS_PERSON": 0}
    for status, code, n in conn.execute(
        sa.select(d.status, d.error_code, sa.func.count())
        .where(*scope)
        .group_by(d.status, d.error_code)
    ):
        by_status[status] = by_status.get(status, 0) + int(n)
        if status in OPEN_STATUSES:
            by_code[code] = by_code.get(code, 0) + int(n)
            cls = rule_for(code).error_class
            by_class[cls] += int(n)
    oldest = conn.execute(
        sa.select(sa.func.min(d.created_at)).where(d.status.in_(OPEN_STATUSES), *scope)
    ).scalar()
    day, week = now - timedelta(days=1), now - timedelta(days=7)
    created = conn.execute(
        sa.select(
            sa.func.coalesce(sa.func.sum(sa.case((d.created_at >= day, 1), else_=0)), 0),
            sa.func.count(),
        ).where(d.created_at >= week, *scope)
    ).one()
    resolved = conn.execute(
        sa.select(
            sa.func.coalesce(sa.func.sum(sa.case((d.resolved_at >= day, 1), else_=0)), 0),
            sa.func.count(),
        ).where(d.status == "RESOLVED", d.resolved_at >= week, *scope)
    ).one()
    return Summary(
        by_status=by_status,
        by_code=dict(sorted(by_code.items(), key=lambda kv: (-kv[1], kv[0]))),
        by_class=by_class,
        oldest_open_hours=0.0
        if oldest is None
        else round(max((now - oldest).total_seconds(), 0.0) / 3600, 3),
        created_24h=int(created[0]),
        resolved_24h=int(resolved[0]),
        created_7d=int(created[1]),
        resolved_7d=int(resolved[1]),
    )
