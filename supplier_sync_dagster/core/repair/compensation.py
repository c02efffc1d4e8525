"""Compensation: retryable dead letters healed without an operator.

A compensation run takes the supplier's due retryable dead letters (``deadletters.
due_for_retry``: PENDING or FAILED, ``next_retry_at`` passed, attempts left), re-fetches each
hotel once (``GET /v1/hotels/{id}``) and runs it through the stages of a sync: raw snapshot,
normalize, quality, mapping, diff and risk, publish with its outbox events. It is one batch
of the compensation task (sync mode REFRESH, SKIP_IF_RUNNING: one run at a time) with one
shard, :data:`COMPENSATION_SHARD`, whose pages (:class:`DeadLetterPages`) are groups of
re-fetched hotels; each page's bytes are the supplier's detail responses, byte for byte,
in one JSON document (``{"details": [<response>, ...]}``), stored and hashed like any page.

Each claimed dead letter ends one way (a named transition of ``core.deadletters``):

- **resolve**: its hotel was re-fetched and went through the stages (published, unchanged,
  held for review); or a newer version of the hotel was published after the dead letter was
  last seen; or the supplier answered 404 (the hotel is gone for certain, and unpublished as
  a tombstone).
- **retry_failed** / **exhaust** too when the re-fetched record is refused again with the
  same problem: the ticket stays open, the attempt counted, and no second ticket is opened.
- **merge** when it is refused with another problem: that problem's ticket goes on.
- **retry_failed** (FAILED, with the next backoff) or **exhaust** (MANUAL_FIX, past its
  retries) when the request failed again.

A killed run leaves its claimed rows RETRYING with ``retry_batch_id``: the next run adopts
the abandoned batch (the task's policy) and resumes from the shard's checkpoint; rows of a
batch that ended without finishing its shard are released (FAILED, due now).

CITY_FAILED tickets (a city whose sync stopped) are not hotels to re-fetch: a due one counts
an attempt and its city is handed back (:attr:`CompensationReport.resync_cities`) for a full
sync of exactly those cities (Dagster's ``dead_letter_city_resync_sensor``, or the CLI);
:func:`resolve_synced_cities` resolves the ticket once a sync of the city succeeded.

An operator's fix (:func:`fix_dead_letter`) runs the same stages over the dead letter's
stored record with a JSON merge patch, in a batch of its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import (
    ConfigError,
    DeadLetterStateError,
    NotFound,
    SupplierError,
    SupplierNotFound,
)
from supplier_sync_dagster.core.leasing.batches import (
    TERMINAL_BATCH_STATUSES,
    Batch,
    TaskSpec,
    TriggerSource,
    create_batch,
    get_batch,
    start_batch,
)
from supplier_sync_dagster.core.leasing.leases import Checkpoint, LeaseSettings
from supplier_sync_dagster.core.records import deadletters
from supplier_sync_dagster.core.records.diff import RiskPolicy
from supplier_sync_dagster.core.records.mapping import chunks
from supplier_sync_dagster.core.records.normalize import canonical_dumps
from supplier_sync_dagster.core.records.tombstones import TOMBSTONE_FINGERPRINT, unpublish_missing
from supplier_sync_dagster.core.settings import DEFAULT_TASK_CODE
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import Identity, record_actions, require_who_and_why
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import PayloadStore
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.supplier.models import DETAILS_KEY, decode_page, page_records
from supplier_sync_dagster.core.sync.city import sync_city
from supplier_sync_dagster.core.sync.model import (
    DEFAULT_PAGE_SIZE,
    CityReport,
    FetchedPage,
    PageSource,
    SyncSettings,
    build_sync_settings,
)
from supplier_sync_dagster.core.sync.replay import stored_city_countries
from supplier_sync_dagster.core.sync.tasks import ensure_task, open_task

log = logging.getLogger(__name__)

COMPENSATION_SHARD = "dead-letters"
"""The one shard of a compensation batch: its claimed dead letters' hotels."""
DEFAULT_COMPENSATION_TASK = "hotel_supplier_compensation"
DEFAULT_LIMIT = 10_000
DEFAULT_PAGE_HOTELS = 100
DEFAULT_FETCH_THREADS = 8


@dataclass(frozen=True)
class CompensationSettings:
    """How a compensation run works.

    Attributes:
        task_code: The compensation task (its batches, its one-at-a-time policy).
        full_task_code: The full sync task whose stored city list gives cities' countries.
        limit: Due dead letters claimed per run at most (oldest due first).
        page_hotels: Hotels re-fetched per page (one stored page, one checkpoint).
        fetch_threads: Detail requests in flight at once (the rate limiter still applies).
        owned_tasks: The tasks whose dead letters this compensation heals (an account's,
            when a supplier is reached through several); empty: every task of the supplier.
    """

    task_code: str = DEFAULT_COMPENSATION_TASK
    full_task_code: str = DEFAULT_TASK_CODE
    limit: int = DEFAULT_LIMIT
    page_hotels: int = DEFAULT_PAGE_HOTELS
    fetch_threads: int = DEFAULT_FETCH_THREADS
    owned_tasks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("limit", "page_hotels", "fetch_threads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1; got {getattr(self, name)!r}")

    def task(self, supplier_id: int) -> TaskSpec:
        """The compensation task as its first run (or an operator's first fix) creates it."""
        return TaskSpec(task_code=self.task_code, supplier_id=supplier_id, sync_mode="REFRESH")


@dataclass
class CompensationReport:
    """What one compensation run did.

    Attributes:
        batch: Its batch (None: nothing was due, no batch was made).
        claimed: Dead letters it took (RETRYING under its batch), resumed ones included.
        released: RETRYING rows of ended batches given back (FAILED, due now).
        newer: Resolved without a request: a newer version had been published since.
        resolved: Resolved after the re-fetch went through the stages.
        refused_again: Of those, hotels whose record now fails with a new dead letter.
        gone: Resolved because the supplier answered 404 (unpublished).
        rescheduled: Requests that failed again, due after the next backoff.
        exhausted: Requests that failed again past the row's retries (MANUAL_FIX).
        report: The shard's report (stages, counts, seconds), when it ran.
        errors: Failed requests by dead-letter code.
        cities_synced: CITY_FAILED tickets resolved: a sync of their city succeeded since.
        resync_cities: Cities of due CITY_FAILED tickets: the caller re-syncs them (a
            full sync of exactly those cities); the next run resolves their tickets.
        resync_tickets: Those tickets' ids by city.
    """

    batch: Batch | None = None
    claimed: int = 0
    released: int = 0
    newer: int = 0
    resolved: int = 0
    refused_again: int = 0
    gone: int = 0
    rescheduled: int = 0
    exhausted: int = 0
    report: CityReport | None = None
    errors: dict[str, int] = field(default_factory=dict)
    cities_synced: int = 0
    resync_cities: list[str] = field(default_factory=list)
    resync_tickets: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values."""
        out: dict[str, Any] = {
            "batch_id": None if self.batch is None else self.batch.batch_id,
            "batch_status": None if self.batch is None else self.batch.status,
            "claimed": self.claimed,
            "released": self.released,
            "newer": self.newer,
            "resolved": self.resolved,
            "refused_again": self.refused_again,
            "gone": self.gone,
            "rescheduled": self.rescheduled,
            "exhausted": self.exhausted,
            "errors": dict(self.errors),
            "cities_synced": self.cities_synced,
            "resync_cities": list(self.resync_cities),
        }
        if self.report is not None:
            out["published"] = self.report.published
            out["seconds"] = {k: round(v, 3) for k, v in self.report.seconds.items()}
        return out


def compensate(
    db: SyncDatabase,
    store: PayloadStore,
    client: SupplierClient,
    *,
    settings: SyncSettings,
    compensation: CompensationSettings = CompensationSettings(),
    trigger_id: str,
    source: TriggerSource = "COMPENSATION",
    worker_id: str,
    charge_cities: bool = True,
) -> CompensationReport:
    """Runs one compensation of the supplier's due retryable dead letters.

    Args:
        db: The sync database.
        store: The payload store.
        client: The supplier client (one detail request per hotel).
        settings: Tuning and the risk policy (task code and mode become the compensation
            task's; ``supplier_id`` says whose dead letters are taken).
        compensation: The run's own settings.
        trigger_id: The batch's idempotency key (a schedule tick, a run id, a CLI trigger).
        source: Where the trigger came from.
        worker_id: This worker's id.
        charge_cities: Count the re-sync attempt on the due CITY_FAILED tickets now (their
            caller re-syncs every city listed); False leaves it to the caller, which charges
            (:func:`charge_city_attempts`) the tickets of the cities it did retry
            (:attr:`CompensationReport.resync_tickets`).

    Raises:
        TaskDisabled: The compensation task is DISABLED.
        TriggerSkipped: Another compensation of the task is running.
    """
    task_code = compensation.task_code
    open_task(
        db, compensation.task(settings.supplier_id), trigger_id=trigger_id, run="compensation run"
    )
    out = CompensationReport()
    owned = compensation.owned_tasks
    out.released = release_ended(db, supplier_id=settings.supplier_id, task_codes=owned)
    out.cities_synced = resolve_synced_cities(
        db, supplier_id=settings.supplier_id, task_codes=owned
    )
    out.resync_tickets = due_city_tickets(db, supplier_id=settings.supplier_id, task_codes=owned)
    out.resync_cities = list(out.resync_tickets)
    if charge_cities:
        charge_city_attempts(db, [i for ids in out.resync_tickets.values() for i in ids])
    with db.engine.connect() as conn:
        due = deadletters.due_for_retry(
            conn,
            db.clock,
            limit=compensation.limit,
            supplier_id=settings.supplier_id,
            cities=False,
            task_codes=owned,
        )
        unfinished = _unfinished_claims(conn, task_code)
    if not due and not unfinished:
        return out
    decision = create_batch(
        db,
        task_code=task_code,
        trigger_id=trigger_id,
        trigger_source=source,
        worker_id=worker_id,
        lease_seconds=settings.lease.lease_seconds,
    )
    batch = start_batch(db, decision, [COMPENSATION_SHARD], skipped="compensation skipped")
    batch_id = batch.batch_id
    if decision.outcome == "CREATED":
        out.newer = _claim(db, batch_id, due)
    with db.engine.connect() as conn:
        out.claimed = _count_claimed(conn, batch_id)
    pages = DeadLetterPages(db, batch_id, settings.supplier_id, compensation, out)
    out.report = _sync_shard(
        db, store, client, batch, COMPENSATION_SHARD, pages, settings, compensation, worker_id
    )
    with db.engine.connect() as conn:
        out.batch = get_batch(conn, batch_id)
    return out


def resolve_synced_cities(
    db: SyncDatabase, *, supplier_id: int, task_codes: Sequence[str] = ()
) -> int:
    """Resolves the open CITY_FAILED tickets whose city a later sync of their task finished.

    A ticket is one failed city (seen failing by one or more batches); the sync that heals
    it is any SUCCESS shard of that city, of a batch of the same task no older than the one
    that last saw it fail, finished after it was last seen (the batch itself resumed, a re-execution, a
    re-sync, the next night).
    """
    d, sh, b = schema.dead_letter.c, schema.shard.c, schema.batch.c
    seen = sa.func.coalesce(d.last_seen_at, d.created_at).label("seen")
    with db.engine.connect() as conn:
        tickets = conn.execute(
            sa.select(d.id, d.city_code, d.task_code, seen, b.created_at.label("since"))
            .join(schema.batch, b.batch_id == sa.func.coalesce(d.last_batch_id, d.batch_id))
            .where(
                d.supplier_id == supplier_id,
                d.error_code == deadletters.CITY_FAILED,
                d.status.in_(deadletters.OPEN_STATUSES),
                *([d.task_code.in_(list(task_codes))] if task_codes else []),
            )
        ).all()
        healed: dict[str, list[int]] = {}
        for t in tickets:
            batches = sa.select(b.batch_id).where(
                b.task_code == t.task_code, b.created_at >= t.since
            )
            by = conn.execute(
                sa.select(sh.batch_id)
                .where(
                    sh.shard_key == t.city_code,
                    sh.status == "SUCCESS",
                    sh.finished_at > t.seen,
                    sh.batch_id.in_(batches),
                )
                .limit(1)
            ).scalar()
            if by is not None:
                healed.setdefault(f"the city synced in batch {by}", []).append(int(t.id))
    if healed:
        with db.begin() as conn:
            for note, ids in healed.items():
                deadletters.move(conn, db.clock, ids, "resolve", fix_note=note[:1024])
    return sum(map(len, healed.values()))


def due_city_tickets(
    db: SyncDatabase, *, supplier_id: int, task_codes: Sequence[str] = ()
) -> dict[str, list[int]]:
    """The due CITY_FAILED tickets by city (nothing is charged: see
    :func:`charge_city_attempts`)."""
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        ids = deadletters.due_for_retry(
            conn, db.clock, limit=1000, supplier_id=supplier_id, cities=True, task_codes=task_codes
        )
        out: dict[str, list[int]] = {}
        for part in chunks(ids):
            for r in conn.execute(sa.select(d.id, d.city_code).where(d.id.in_(part))):
                if r.city_code:
                    out.setdefault(str(r.city_code), []).append(int(r.id))
    return dict(sorted(out.items()))


def charge_city_attempts(db: SyncDatabase, ids: Sequence[int]) -> int:
    """Counts a re-sync attempt on CITY_FAILED tickets still due (RETRYING then FAILED with
    the next backoff, MANUAL_FIX past their retries); :func:`resolve_synced_cities` resolves
    those whose city synced. Tickets no longer due (resolved meanwhile) are left alone.

    Returns:
        The tickets charged.
    """
    d = schema.dead_letter.c
    with db.begin() as conn:
        due = [
            int(i)
            for part in chunks(sorted(set(ids)))
            for i in conn.execute(
                sa.select(d.id).where(d.id.in_(part), d.status.in_(("PENDING", "FAILED")))
            ).scalars()
        ]
        if due:
            deadletters.move(conn, db.clock, due, "start_retry")
            deadletters.fail_attempt(conn, db.clock, due, error_message=None)
    return len(due)


def request_city_resyncs(
    db: SyncDatabase, *, supplier_id: int, task_codes: Sequence[str] = ()
) -> list[str]:
    """Counts an attempt on each due CITY_FAILED ticket and returns their cities to re-sync
    (the Dagster path: its sensor launches a run for every city listed)."""
    due = due_city_tickets(db, supplier_id=supplier_id, task_codes=task_codes)
    charge_city_attempts(db, [i for ids in due.values() for i in ids])
    return list(due)


def release_ended(db: SyncDatabase, *, supplier_id: int, task_codes: Sequence[str] = ()) -> int:
    """Gives back RETRYING rows whose compensation batch ended without them (FAILED, due now).

    A batch that is still unfinished keeps its rows: the next run adopts it and resumes.
    """
    d, b = schema.dead_letter.c, schema.batch.c
    with db.begin() as conn:
        ids = [
            int(i)
            for i in conn.execute(
                sa.select(d.id)
                .outerjoin(schema.batch, b.batch_id == d.retry_batch_id)
                .where(
                    d.supplier_id == supplier_id,
                    d.status == "RETRYING",
                    sa.or_(b.batch_id.is_(None), b.status.in_(TERMINAL_BATCH_STATUSES)),
                    *([d.task_code.in_(list(task_codes))] if task_codes else []),
                )
            ).scalars()
        ]
        deadletters.move(
            conn,
            db.clock,
            ids,
            "retry_failed",
            next_retry_at=db.clock.now(),
            error_message="released: the compensation run that took it ended without it",
        )
    return len(ids)


def _unfinished_claims(conn: Connection, task_code: str) -> int:
    d, b = schema.dead_letter.c, schema.batch.c
    return int(
        conn.execute(
            sa.select(sa.func.count())
            .select_from(schema.dead_letter)
            .join(schema.batch, b.batch_id == d.retry_batch_id)
            .where(
                d.status == "RETRYING",
                b.task_code == task_code,
                b.status.not_in(TERMINAL_BATCH_STATUSES),
            )
        ).scalar_one()
    )


def _count_claimed(conn: Connection, batch_id: str) -> int:
    d = schema.dead_letter.c
    return int(
        conn.execute(sa.select(sa.func.count()).where(d.retry_batch_id == batch_id)).scalar_one()
    )


def _claim(db: SyncDatabase, batch_id: str, due: Sequence[int], *, attempts: int = 3) -> int:
    """Takes the due rows for the batch (RETRYING); rows whose hotel was published after
    they were written are resolved instead. Returns how many were resolved so."""
    for attempt in range(attempts):
        try:
            with db.begin() as conn:
                newer = _published_since(conn, due)
                for note, ids in newer.items():
                    deadletters.move(conn, db.clock, ids, "resolve", fix_note=note[:1024])
                resolved = {i for ids in newer.values() for i in ids}
                deadletters.move(
                    conn,
                    db.clock,
                    [i for i in due if i not in resolved],
                    "start_retry",
                    retry_batch_id=batch_id,
                )
                return len(resolved)
        except DeadLetterStateError:
            # An operator moved one of them between the read and the claim: read again.
            if attempt == attempts - 1:
                raise
            with db.engine.connect() as conn:
                d = schema.dead_letter.c
                due = [
                    int(i)
                    for i in conn.execute(
                        sa.select(d.id).where(
                            d.id.in_(list(due)), d.status.in_(("PENDING", "FAILED"))
                        )
                    ).scalars()
                ]
    return 0


def _published_since(conn: Connection, ids: Sequence[int]) -> dict[str, list[int]]:
    """Of the dead letters ``ids``, those whose hotel was published after they were written,
    grouped by the note that says so."""
    d, h = schema.dead_letter.c, schema.platform_hotel.c
    out: dict[str, list[int]] = {}
    for part in chunks(sorted(set(ids))):
        rows = conn.execute(
            sa.select(d.id, h.last_batch_id, h.supplier_version)
            .join(
                schema.platform_hotel,
                sa.and_(
                    h.supplier_id == d.supplier_id,
                    h.supplier_hotel_id == d.supplier_resource_code,
                ),
            )
            .where(
                d.id.in_(part),
                h.published_at > sa.func.coalesce(d.last_seen_at, d.created_at),
                h.fingerprint != TOMBSTONE_FINGERPRINT,
            )
        )
        for r in rows:
            note = (
                f"a newer version (supplier version {r.supplier_version}) was published "
                f"since, by batch {r.last_batch_id}"
            )
            out.setdefault(note, []).append(int(r.id))
    return out


@dataclass
class _Claimed:
    id: int
    hotel_id: str


class DeadLetterPages:
    """The page source of a compensation batch (``core.sync.model.PageSource``).

    Its pages are the batch's claimed dead letters in id order, ``page_hotels`` hotels at a
    time (a hotel of several dead letters is fetched once); the checkpoint's cursor is the
    last dead letter id a page covered. Failed requests end their rows' attempt at once, in
    their own transaction; rows whose hotel was fetched are resolved in the transaction that
    finishes the shard (:meth:`finish`), once their hotels are published.
    """

    def __init__(
        self,
        db: SyncDatabase,
        batch_id: str,
        supplier_id: int,
        settings: CompensationSettings,
        out: CompensationReport,
    ) -> None:
        self.db, self.batch_id, self.supplier_id = db, batch_id, supplier_id
        self.settings, self.out = settings, out

    def pages(
        self, client: SupplierClient | None, start: Checkpoint | None, shard_key: str
    ) -> Iterator[FetchedPage]:
        """The re-fetched hotels, a page at a time, from the checkpoint on."""
        if client is None:
            raise ValueError("compensation needs a supplier client")
        after = 0
        number = 1
        if start is not None and start.cursor is not None:
            after = int(json.loads(start.cursor)["after_id"])
            number = start.page
        claimed = self._claimed(after)
        groups = _pages_of(claimed, self.settings.page_hotels)
        if not groups:
            groups = [[]]
        with ThreadPoolExecutor(
            max_workers=self.settings.fetch_threads, thread_name_prefix="compensate"
        ) as pool:
            for k, group in enumerate(groups):
                hotels = list(dict.fromkeys(c.hotel_id for c in group))
                results = list(pool.map(lambda h: _fetch_one(client, h), hotels))
                raws: list[bytes] = []
                records: list[dict[str, Any]] = []
                failed: dict[str, list[int]] = {}
                gone: list[str] = []
                by_hotel: dict[str, list[int]] = {}
                for c in group:
                    by_hotel.setdefault(c.hotel_id, []).append(c.id)
                for hotel, result in zip(hotels, results, strict=True):
                    if isinstance(result, SupplierNotFound):
                        gone.append(hotel)
                    elif isinstance(result, SupplierError):
                        failed.setdefault(_error_text(result), []).extend(by_hotel[hotel])
                        code = deadletters.supplier_error_code(result)
                        self.out.errors[code] = self.out.errors.get(code, 0) + 1
                    else:
                        raw, record = result
                        raws.append(raw)
                        records.append(record)
                self._end_attempts(failed, gone, by_hotel)
                last = group[-1].id if group else after
                done = k == len(groups) - 1
                yield FetchedPage(
                    b'{"' + DETAILS_KEY.encode() + b'":[' + b",".join(raws) + b"]}",
                    number,
                    records,
                    None,
                    Checkpoint(
                        shard_key,
                        page=number + 1,
                        cursor=json.dumps({"after_id": last}),
                        last_supplier_hotel_id=hotels[-1] if hotels else None,
                        done=done,
                    ),
                )
                number += 1

    def _claimed(self, after: int) -> list[_Claimed]:
        d = schema.dead_letter.c
        with self.db.engine.connect() as conn:
            return [
                _Claimed(int(r.id), str(r.supplier_resource_code))
                for r in conn.execute(
                    sa.select(d.id, d.supplier_resource_code)
                    .where(
                        d.retry_batch_id == self.batch_id,
                        d.status == "RETRYING",
                        d.id > after,
                    )
                    .order_by(d.id)
                )
            ]

    def _end_attempts(
        self, failed: dict[str, list[int]], gone: list[str], by_hotel: dict[str, list[int]]
    ) -> None:
        """Ends the attempts whose request failed, and resolves the hotels that are gone."""
        if not failed and not gone:
            return
        db = self.db
        with db.begin() as conn:
            for message, ids in failed.items():
                moved, exhausted = deadletters.fail_attempt(
                    conn, db.clock, ids, error_message=message
                )
                self.out.rescheduled += moved
                self.out.exhausted += exhausted
            if gone:
                unpublish_missing(
                    conn,
                    db.clock,
                    supplier_id=self.supplier_id,
                    supplier_hotel_ids=gone,
                    batch_id=self.batch_id,
                    at=db.clock.read(conn),
                )
                ids = [i for h in gone for i in by_hotel[h]]
                deadletters.move(
                    conn,
                    db.clock,
                    ids,
                    "resolve",
                    fix_note=f"the supplier no longer has the hotel (404), batch {self.batch_id}",
                )
                self.out.gone += len(ids)

    def publish_settings(self, report: CityReport, settings: SyncSettings) -> SyncSettings:
        """Compensation publishes with the sync's own settings."""
        return settings

    def finish(self, conn: Connection, report: CityReport) -> None:
        """Ends the attempts whose hotel was re-fetched: resolved when the record went
        through the stages, still open (the attempt counted) when it is refused again with
        the same problem, MERGED into the new ticket when it is refused with another."""
        d, f = schema.dead_letter.c, schema.diff_log.c
        rows = conn.execute(
            sa.select(d.id, d.supplier_resource_code, d.last_batch_id).where(
                d.retry_batch_id == self.batch_id, d.status == "RETRYING"
            )
        ).all()
        if not rows:
            return
        hotels = sorted({str(r.supplier_resource_code) for r in rows})
        refused: dict[str, tuple[int, str]] = {}
        actions: dict[str, str] = {}
        for part in chunks(hotels):
            for letter in conn.execute(
                sa.select(d.id, d.supplier_resource_code, d.error_code).where(
                    d.last_batch_id == self.batch_id,
                    d.supplier_resource_code.in_(part),
                    d.open_slot == 1,
                )
            ):
                refused[str(letter.supplier_resource_code)] = (
                    int(letter.id),
                    str(letter.error_code),
                )
            for diff in conn.execute(
                sa.select(f.supplier_resource_code, f.action).where(
                    f.batch_id == self.batch_id, f.supplier_resource_code.in_(part)
                )
            ):
                actions[str(diff.supplier_resource_code)] = str(diff.action)
        still_bad: list[int] = []
        merged: dict[str, list[int]] = {}
        notes: dict[str, list[int]] = {}
        for r in rows:
            hotel = str(r.supplier_resource_code)
            if r.last_batch_id == self.batch_id:
                still_bad.append(int(r.id))  # the re-fetched record has the same problem
            elif hotel in refused:
                new_id, code = refused[hotel]
                note = f"re-fetched in batch {self.batch_id}: now fails with {code} (dead letter #{new_id})"
                merged.setdefault(note[:1024], []).append(int(r.id))
            elif hotel in actions:
                note = f"re-fetched and published in batch {self.batch_id} ({actions[hotel]})"
                notes.setdefault(note[:1024], []).append(int(r.id))
            else:
                note = f"re-fetched in batch {self.batch_id}: unchanged"
                notes.setdefault(note[:1024], []).append(int(r.id))
        clock = self.db.clock
        for note, ids in notes.items():
            deadletters.move(conn, clock, ids, "resolve", fix_note=note)
        for note, ids in merged.items():
            deadletters.move(conn, clock, ids, "merge", fix_note=note)
        if still_bad:
            moved, exhausted = deadletters.fail_attempt(conn, clock, still_bad, error_message=None)
            self.out.rescheduled += moved
            self.out.exhausted += exhausted
        self.out.refused_again += len(still_bad) + sum(map(len, merged.values()))
        self.out.resolved += sum(map(len, notes.values()))


def _pages_of(claimed: list[_Claimed], size: int) -> list[list[_Claimed]]:
    """Claimed rows cut into pages of at most ``size`` distinct hotels."""
    pages: list[list[_Claimed]] = []
    current: list[_Claimed] = []
    hotels: set[str] = set()
    for c in claimed:
        if c.hotel_id not in hotels and len(hotels) >= size:
            pages.append(current)
            current, hotels = [], set()
        current.append(c)
        hotels.add(c.hotel_id)
    if current:
        pages.append(current)
    return pages


def _fetch_one(
    client: SupplierClient, hotel_id: str
) -> tuple[bytes, dict[str, Any]] | SupplierError:
    try:
        fetched = client.get_hotel(hotel_id)
    except SupplierError as err:
        return err
    return fetched.raw, fetched.data


def _error_text(err: SupplierError) -> str:
    return f"{deadletters.supplier_error_code(err)}: {type(err).__name__}: {err}"[:1024]


_SIGHTING = (
    "error_message",
    "raw_payload_ref",
    "raw_payload_hash",
    "record_position",
    "normalized_payload_ref",
    "record_version",
    "seen_count",
    "last_seen_at",
    "last_batch_id",
    "updated_at",
)
"""The columns a problem seen again rewrites (``deadletters.record_dead_letters``)."""

FIX_SHARD = "operator-fix"
"""The one shard of an operator's fix: the patched record."""


@dataclass(frozen=True)
class FixOutcome:
    """What became of an operator's fix.

    Attributes:
        accepted: The patched record passed every check (published, unchanged or held for
            review); the dead letter is RESOLVED.
        batch_id: The fix's batch (its RAW page is the patched record).
        action: The diff's action when accepted (AUTO_PUBLISH, REVIEW, IGNORE ...).
        error_code: Why the patched record was refused (the dead letter stays as it was).
        error_message: The refusal's message.
    """

    accepted: bool
    batch_id: str
    action: str | None = None
    error_code: str | None = None
    error_message: str | None = None


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge key by key, ``null`` removes, the rest replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def stored_record(store: PayloadStore, row: Any) -> Any:
    """The supplier's record of a dead letter, read from its stored raw page.

    Raises:
        ConfigError: The dead letter has no stored record (a failed request has none).
    """
    position = str(row.record_position or "")
    if not row.raw_payload_ref or not position.startswith("record#"):
        raise ConfigError(
            f"dead letter {row.id} has no stored record to patch ({row.error_code}): "
            "use `dead-letters retry` to fetch the hotel again"
        )
    records = page_records(decode_page(store.get(row.raw_payload_ref)))
    index = int(position.removeprefix("record#"))
    if index >= len(records):
        raise ConfigError(f"dead letter {row.id}: its page has no record #{index}")
    return records[index]


def fix_dead_letter(
    db: SyncDatabase,
    store: PayloadStore,
    *,
    dead_letter: int,
    patch: Any,
    actor: str,
    reason: str,
    lease: LeaseSettings,
    risk_policy: RiskPolicy,
    max_clock_skew_seconds: float,
    compensation: CompensationSettings = CompensationSettings(),
    worker_id: str,
    identity: Identity | None = None,
) -> FixOutcome:
    """An operator's fix: the dead letter's record with a JSON merge patch, through every stage.

    The patched record is a page of its own batch (the compensation task's, trigger
    ``fix:<id>:<patch hash>``), normalized, checked, diffed and published like any record:
    a fix cannot bypass governance, nor touch the record's identity or versioning
    (``deadletters.FIX_PROTECTED_FIELDS``). Accepted, the dead letter is RESOLVED; refused,
    it stays as it was and the refusal (the new error code) is returned. Either way one
    audit row says who, why, the patch and the outcome. The sync settings are those of the dead
    letter's own task and supplier, with the deployment's ``lease``, ``risk_policy`` and
    ``max_clock_skew_seconds``; the audit row's proven identity is ``identity`` (the acting
    process's when None).

    Raises:
        ConfigError: No actor or reason, a patch that is not an object or touches an
            identity or versioning field (``deadletters.FIX_PROTECTED_FIELDS``: checked
            first, before anything is read), or a dead letter without a stored record.
        NotFound: No dead letter has this id.
        DeadLetterStateError: The dead letter is closed (RESOLVED or IGNORED).
        TriggerSkipped: A compensation run holds the task; try again when it ends.
    """
    patch = deadletters.check_fix_patch(patch)
    who, why = require_who_and_why(actor, reason)
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        row = conn.execute(sa.select(schema.dead_letter).where(d.id == dead_letter)).first()
    if row is None:
        raise NotFound(f"no dead letter has id {dead_letter}")
    settings = build_sync_settings(
        task_code=str(row.task_code),
        supplier_id=int(row.supplier_id),
        page_size=DEFAULT_PAGE_SIZE,  # a fixed record walks no city listing
        lease=lease,
        risk_policy=risk_policy,
        max_clock_skew_seconds=max_clock_skew_seconds,
    )
    if row.status not in deadletters.OPEN_STATUSES:
        raise DeadLetterStateError(f"dead letter {dead_letter} is {row.status}: nothing to fix")
    record = merge_patch(stored_record(store, row), patch)
    hotel_id = str(row.supplier_resource_code)
    if not isinstance(record, dict) or record.get("hotel_id") != hotel_id:
        raise ConfigError(f"a fix must keep the record's hotel_id ({hotel_id!r})")
    body = b'{"' + DETAILS_KEY.encode() + b'":[' + canonical_dumps(record) + b"]}"
    digest = hashlib.sha256(body + who.encode()).hexdigest()[:16]
    task_code = compensation.task_code
    ensure_task(
        db,
        compensation.task(settings.supplier_id),
        created_by=who,
        reason="created by the first operator fix, with the default settings",
    )
    decision = create_batch(
        db,
        task_code=task_code,
        trigger_id=f"fix:{dead_letter}:{digest}"[:64],
        trigger_source="MANUAL",
        worker_id=worker_id,
        adopt=False,
    )
    batch = start_batch(db, decision, [FIX_SHARD], skipped="fix not run")
    batch_id = batch.batch_id
    source = _PatchedRecord(
        db, batch_id, row, body, record, who=who, why=why, patch=patch, identity=identity
    )
    report = _sync_shard(
        db, store, None, batch, FIX_SHARD, source, settings, compensation, worker_id
    )
    if source.outcome is None:
        raise RuntimeError(f"fix batch {batch_id} ended {report.status}: {report.error or ''}")
    return replace(source.outcome, batch_id=batch_id)


def _sync_shard(
    db: SyncDatabase,
    store: PayloadStore,
    client: SupplierClient | None,
    batch: Batch,
    shard: str,
    source: PageSource,
    settings: SyncSettings,
    compensation: CompensationSettings,
    worker_id: str,
) -> CityReport:
    """The stages of a sync over the one shard of a compensation's or a fix's batch."""
    return sync_city(
        db,
        store,
        client,
        batch=batch,
        city_code=shard,
        worker_id=worker_id,
        settings=replace(settings, task_code=compensation.task_code, sync_mode="REFRESH"),
        city_countries=stored_city_countries(db, store, task_code=compensation.full_task_code),
        source=source,
    )


class _PatchedRecord:
    """The page source of a fix: one page, the patched record; :meth:`finish` decides."""

    def __init__(
        self,
        db: SyncDatabase,
        batch_id: str,
        row: Any,
        body: bytes,
        record: dict[str, Any],
        *,
        who: str,
        why: str,
        patch: dict[str, Any],
        identity: Identity | None,
    ) -> None:
        self.db, self.batch_id, self.row, self.body, self.record = db, batch_id, row, body, record
        self.who, self.why, self.patch, self.identity = who, why, patch, identity
        self.outcome: FixOutcome | None = None

    def pages(
        self, client: SupplierClient | None, start: Checkpoint | None, shard_key: str
    ) -> Iterator[FetchedPage]:
        yield FetchedPage(
            self.body,
            1,
            [self.record],
            1,
            Checkpoint(shard_key, page=2, cursor=None, last_supplier_hotel_id=None, done=True),
        )

    def publish_settings(self, report: CityReport, settings: SyncSettings) -> SyncSettings:
        return settings

    def finish(self, conn: Connection, report: CityReport) -> None:
        d, f = schema.dead_letter.c, schema.diff_log.c
        row, clock = self.row, self.db.clock
        batch_id = self.batch_id
        hotel = str(row.supplier_resource_code)
        refused = conn.execute(
            sa.select(d.id, d.error_code, d.error_message).where(
                d.last_batch_id == batch_id, d.supplier_resource_code == hotel, d.open_slot == 1
            )
        ).first()
        before = deadletters.snapshot(conn, [row.id])[row.id]
        if refused is not None and int(refused.id) == int(row.id):
            # Refused with the same problem: the ticket stays as it was, not as the patched
            # record (which is no sight of the supplier's) left it.
            conn.execute(
                sa.update(schema.dead_letter)
                .where(d.id == row.id)
                .values({c: getattr(row, c) for c in _SIGHTING})
            )
            self.outcome = FixOutcome(
                False, batch_id, error_code=refused.error_code, error_message=refused.error_message
            )
            outcome = f"refused: {refused.error_code}"
        elif refused is not None:
            # The attempt is on record (audit); one open ticket per bad record stays.
            deadletters.move(
                conn,
                clock,
                [int(refused.id)],
                "ignore",
                fix_note=f"a refused fix of dead letter #{row.id} by {self.who}"[:1024],
            )
            self.outcome = FixOutcome(
                False, batch_id, error_code=refused.error_code, error_message=refused.error_message
            )
            outcome = f"refused: {refused.error_code}"
        else:
            action = conn.execute(
                sa.select(f.action).where(f.batch_id == batch_id, f.supplier_resource_code == hotel)
            ).scalar()
            note = f"fixed by {self.who}: {self.why}; batch {batch_id} ({action or 'unchanged'})"
            if before["status"] in deadletters.OPEN_STATUSES:
                deadletters.move(conn, clock, [row.id], "resolve", fix_note=note[:1024])
            else:  # the publish of the fixed record resolved it already
                conn.execute(
                    sa.update(schema.dead_letter).where(d.id == row.id).values(fix_note=note[:1024])
                )
            self.outcome = FixOutcome(True, batch_id, action=action)
            outcome = f"accepted: {action or 'unchanged'}"
        after = deadletters.snapshot(conn, [row.id])[row.id]
        record_actions(
            conn,
            clock,
            action="dead_letter.fix",
            target_type="dead_letter",
            changes=[
                (
                    row.dead_letter_id,
                    before,
                    {**after, "patch": self.patch, "outcome": outcome, "batch_id": batch_id},
                )
            ],
            actor=self.who,
            reason=self.why,
            identity=self.identity,
        )
