"""Diffs held for review: the queue, and approving or rejecting them one by one or in bulk.

The risk policy (``diff.RiskRules``) sends a risky diff (a large price move, a hotel moved
kilometres away, a replaced name, a city's hotels turning INACTIVE at once) to REVIEW
instead of publishing it. :func:`hold_for_review` keeps such a diff with its normalized
hotel, in the transaction that writes the diff log; nothing of it is published.

A review moves through one state machine, every move a guarded UPDATE (``db.guarded_update``)
whose WHERE clause carries the state it requires::

    PENDING --approve--> APPROVED --(a newer version was published meanwhile)--> SUPERSEDED
    PENDING --reject---> REJECTED

Approval publishes the held hotel through ``publish.publish_hotels``, the same
version-guarded path as an automatic publish, in the same transaction as the move: a
review is APPROVED exactly when its hotel was published (or SUPERSEDED when the guard
refused it because something newer is already live).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import ReviewStateError
from supplier_sync_dagster.core.records.diff import Candidate, HotelDiff, diff_id
from supplier_sync_dagster.core.records.mapping import chunks
from supplier_sync_dagster.core.records.publish import publish_hotels
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import Identity, record_actions, require_who_and_why
from supplier_sync_dagster.core.store.db import DbClock, SyncDatabase, guarded_update, insert_ignore

ReviewStatus = Literal["PENDING", "APPROVED", "REJECTED", "SUPERSEDED"]
REVIEW_CHUNK = 500  # reviews decided per transaction


@dataclass(frozen=True)
class Review:
    """A held diff and the decision on it."""

    review_id: str
    batch_id: str
    shard_key: str
    supplier_id: int
    supplier_hotel_id: str
    supplier_version: int
    platform_resource_id: int
    old_publish_version: int | None
    diff_type: str
    risk_level: str
    changed_fields: list[dict[str, Any]]
    status: ReviewStatus
    decided_by: str | None
    decision_reason: str | None
    publish_version: int | None


@dataclass(frozen=True)
class Decision:
    """What a bulk decision did."""

    approved: int = 0
    rejected: int = 0
    published: int = 0
    superseded: int = 0


def hold_for_review(
    conn: Connection,
    clock: DbClock,
    *,
    batch_id: str,
    shard_key: str,
    supplier_id: int,
    items: Sequence[tuple[HotelDiff, Candidate]],
) -> int:
    """Keeps REVIEW diffs with their hotels, in the caller's transaction; returns how many.

    Idempotent: the review id is the diff id, so a re-run of the batch holds nothing twice.
    """
    rows = [
        {
            "review_id": diff_id(batch_id, supplier_id, d.platform_resource_id, d.new_version),
            "supplier_hotel_id": d.supplier_hotel_id,
            "supplier_version": d.new_version,
            "platform_resource_id": d.platform_resource_id,
            "old_publish_version": d.old_publish_version,
            "diff_type": d.diff_type,
            "risk_level": d.risk_level,
            "changed_fields": d.changed_fields,
            "candidate": json.dumps(c.doc, ensure_ascii=False, sort_keys=True),
            "fingerprint": c.fingerprint,
            "raw_payload_ref": c.raw_payload_ref,
            "raw_payload_hash": c.raw_payload_hash,
        }
        for d, c in items
        if d.action == "REVIEW"
    ]
    now = clock.now()
    insert_ignore(
        conn,
        schema.review,
        rows,
        batch_id=batch_id,
        shard_key=shard_key,
        supplier_id=supplier_id,
        status="PENDING",
        created_at=now,
        updated_at=now,
    )
    return len(rows)


def list_reviews(
    conn: Connection,
    *,
    status: ReviewStatus | None = "PENDING",
    batch_id: str | None = None,
    limit: int | None = None,
) -> list[Review]:
    """Reviews, oldest first, filtered by status (None: all) and batch."""
    r = schema.review.c
    query = sa.select(schema.review).order_by(r.id)
    if status is not None:
        query = query.where(r.status == status)
    if batch_id is not None:
        query = query.where(r.batch_id == batch_id)
    if limit is not None:
        query = query.limit(limit)
    return [_review(row._mapping) for row in conn.execute(query)]


def count_reviews(conn: Connection, *, batch_id: str | None = None) -> dict[str, int]:
    """Reviews by status."""
    r = schema.review.c
    query = sa.select(r.status, sa.func.count()).group_by(r.status)
    if batch_id is not None:
        query = query.where(r.batch_id == batch_id)
    return {str(s): int(n) for s, n in conn.execute(query)}


Verdict = Literal["APPROVED", "REJECTED"]


def decide_reviews(
    db: SyncDatabase,
    verdict: Verdict,
    *,
    review_ids: Sequence[str] | None,
    who: str,
    reason: str,
    batch_id: str | None = None,
    identity: Identity | None = None,
) -> Decision:
    """Approves or rejects PENDING reviews.

    An approved review's hotel publishes through the version guard; a rejected review's hotel
    stays as published.

    Args:
        db: The sync database.
        verdict: APPROVED or REJECTED.
        review_ids: The reviews to decide; None decides every PENDING review (of
            ``batch_id`` when given).
        who: Who decided (recorded).
        reason: Why (recorded).
        batch_id: Limits a bulk decision to one batch.
        identity: Who, as the acting process proves it; None: this process's.

    Raises:
        ConfigError: No one decided, or no reason (or either is too long).
        ReviewStateError: A named review does not exist or is not PENDING (nothing of that
            transaction's chunk is decided).
    """
    _require(who, reason)
    decided = published = superseded = 0
    for part in _targets(db, review_ids, batch_id):
        with db.begin() as conn:
            if verdict == "APPROVED":
                p, s = _approve(conn, db.clock, part, who, reason, identity)
                published += p
                superseded += s
            else:
                _move(conn, db.clock, part, "PENDING", "REJECTED", who, reason, identity)
            decided += len(part)
    if verdict == "REJECTED":
        return Decision(rejected=decided)
    return Decision(approved=decided, published=published, superseded=superseded)


# The two verdicts by name, as operators ask for them.
approve_reviews = functools.partial(decide_reviews, verdict="APPROVED")
reject_reviews = functools.partial(decide_reviews, verdict="REJECTED")


def _require(who: str, reason: str) -> None:
    """Every operator action's rule (:func:`require_who_and_why`), said before any work.

    Raises:
        ConfigError: No one, no reason, or either too long.
    """
    require_who_and_why(who, reason)


def _targets(
    db: SyncDatabase, review_ids: Sequence[str] | None, batch_id: str | None
) -> list[Sequence[str]]:
    if review_ids is None:
        with db.engine.connect() as conn:
            ids = [rv.review_id for rv in list_reviews(conn, status="PENDING", batch_id=batch_id)]
    else:
        ids = sorted(set(review_ids))
    return list(chunks(ids, REVIEW_CHUNK))


def _load(conn: Connection, ids: Sequence[str]) -> list[Review]:
    r = schema.review.c
    rows = conn.execute(sa.select(schema.review).where(r.review_id.in_(ids))).all()
    found = {row.review_id for row in rows}
    missing = sorted(set(ids) - found)
    if missing:
        raise ReviewStateError(f"no such review: {', '.join(missing[:10])}")
    return [_review(row._mapping) for row in rows]


def _approve(
    conn: Connection,
    clock: DbClock,
    ids: Sequence[str],
    who: str,
    reason: str,
    identity: Identity | None,
) -> tuple[int, int]:
    """Approves one chunk of reviews and publishes their hotels; returns (published, superseded)."""
    reviews = _load(conn, ids)
    _move(conn, clock, ids, "PENDING", "APPROVED", who, reason, identity)
    by_supplier: dict[int, list[Review]] = {}
    for rv in reviews:
        by_supplier.setdefault(rv.supplier_id, []).append(rv)
    published = superseded = 0
    for supplier_id, group in by_supplier.items():
        p, s = _publish(conn, clock, supplier_id, group)
        published += p
        superseded += s
    return published, superseded


def _move(
    conn: Connection,
    clock: DbClock,
    ids: Sequence[str],
    source: ReviewStatus,
    target: ReviewStatus,
    who: str,
    reason: str,
    identity: Identity | None,
) -> None:
    """The one guarded move of the review state machine (for a set of reviews)."""
    r = schema.review.c
    now = clock.now()
    guarded_update(
        conn,
        sa.update(schema.review)
        .where(r.review_id.in_(ids), r.status == source)
        .values(
            status=target,
            decided_by=who[:128],
            decision_reason=reason[:1024],
            decided_at=now,
            updated_at=now,
        ),
        lambda: ReviewStateError(
            f"{len(ids)} review(s) must all be {source} to become {target}; some are not"
        ),
        expected=len(ids),
    )
    record_actions(
        conn,
        clock,
        action=f"review.{'approve' if target == 'APPROVED' else 'reject'}",
        target_type="review",
        changes=[(i, {"status": source}, {"status": target}) for i in ids],
        actor=who[:64],
        reason=reason[:1024],
        identity=identity,
    )


def _publish(
    conn: Connection, clock: DbClock, supplier_id: int, reviews: Sequence[Review]
) -> tuple[int, int]:
    """Publishes approved reviews; returns (published, superseded)."""
    items: list[tuple[HotelDiff, Candidate]] = []
    docs = _candidates(conn, [rv.review_id for rv in reviews])
    for rv in reviews:
        doc, fingerprint, raw_ref, raw_hash = docs[rv.review_id]
        diff = HotelDiff(
            rv.supplier_hotel_id,
            rv.platform_resource_id,
            rv.old_publish_version,
            None,
            rv.supplier_version,
            rv.diff_type,  # type: ignore[arg-type]
            rv.changed_fields,
            "HIGH",
            "AUTO_PUBLISH",
        )
        items.append((diff, Candidate(doc, fingerprint, raw_ref, raw_hash)))
    # Each review publishes under its own batch id (events name the batch that produced
    # the change); reviews of one call may come from several batches.
    published = superseded = 0
    by_batch: dict[str, list[int]] = {}
    for i, rv in enumerate(reviews):
        by_batch.setdefault(rv.batch_id, []).append(i)
    for batch_id, positions in by_batch.items():
        group = [items[i] for i in positions]
        result = publish_hotels(
            conn,
            clock,
            supplier_id=supplier_id,
            batch_id=batch_id,
            items=group,
        )
        versions = {p.supplier_hotel_id: p.publish_version for p in result.published}
        r = schema.review.c
        stale = []
        for pos in positions:
            rv = reviews[pos]
            if rv.supplier_hotel_id not in versions:
                stale.append(rv.review_id)
                continue
            conn.execute(
                sa.update(schema.review)
                .where(r.review_id == rv.review_id)
                .values(publish_version=versions[rv.supplier_hotel_id])
            )
        if stale:
            why = "a newer version is live"
            _move(conn, clock, stale, "APPROVED", "SUPERSEDED", "system", why, None)
        published += len(versions)
        superseded += len(stale)
    return published, superseded


def _candidates(
    conn: Connection, ids: Sequence[str]
) -> dict[str, tuple[dict[str, Any], str, str | None, str | None]]:
    r = schema.review.c
    out: dict[str, tuple[dict[str, Any], str, str | None, str | None]] = {}
    for row in conn.execute(
        sa.select(
            r.review_id, r.candidate, r.fingerprint, r.raw_payload_ref, r.raw_payload_hash
        ).where(r.review_id.in_(ids))
    ):
        out[row.review_id] = (
            json.loads(row.candidate),
            row.fingerprint,
            row.raw_payload_ref,
            row.raw_payload_hash,
        )
    return out


def _review(m: Any) -> Review:
    fields = m["changed_fields"]
    return Review(
        review_id=m["review_id"],
        batch_id=m["batch_id"],
        shard_key=m["shard_key"],
        supplier_id=int(m["supplier_id"]),
        supplier_hotel_id=m["supplier_hotel_id"],
        supplier_version=int(m["supplier_version"]),
        platform_resource_id=int(m["platform_resource_id"]),
        old_publish_version=m["old_publish_version"],
        diff_type=m["diff_type"],
        risk_level=m["risk_level"],
        changed_fields=json.loads(fields) if isinstance(fields, str) else list(fields),
        status=m["status"],
        decided_by=m["decided_by"],
        decision_reason=m["decision_reason"],
        publish_version=m["publish_version"],
    )
