"""Sync health: the numbers operators are judged by, from the sync database.

:func:`sync_health` computes, for one task, in a fixed number of queries that read indexes
and small tables (batches, shards, city profiles, dead letters, reviews, the newest outbox
events, the runs' request counters), never the catalog:

- **success** of the task's batches and of their cities over the last 24 hours;
- **quality** of its latest finished batch: bad-record ratio, mapping failures, and the
  missing-field rate per field (from the city profiles normalization recorded);
- **dead letters** by status and class, the oldest open one and the fix rate (24 h, 7 d);
- the **review queue**: size and age of the oldest pending review;
- **freshness**: per city, now minus its last successful sync (cities of the task's batches
  of the last ``FRESHNESS_WINDOW_DAYS`` days; a city without one counts that long), the
  incremental watermark's lag behind now;
- the **outbox**: READY, FAILED, stuck events, and the publish → search index lag p95 of the
  newest ``OUTBOX_WINDOW`` events;
- the **supplier**: requests, 429 answers (and per minute of syncing), retries and seconds
  waited for the rate limiter of the last 24 hours' runs, the rate an adaptive limiter had
  learnt by the newest of them, and the hotels/s of the latest finished batch;
- **listing drift**: cities of the last 24 hours' batches whose listing shifted under their
  walk (or could have, unchecked), the shifts seen, and the hotels the verification found.

:class:`SyncHealth` flattens them into named numbers (:meth:`SyncHealth.values`): the
``sync_health`` asset's metadata, the Prometheus endpoint and the alert conditions read the
same figures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.leasing.batches import TERMINAL_BATCH_STATUSES
from supplier_sync_dagster.core.outbox.machine import END, Lag
from supplier_sync_dagster.core.records import deadletters
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync.retire import retired_at

FRESHNESS_WINDOW_DAYS = 7
OUTBOX_WINDOW = 10_000
FAILED_BATCH_STATUSES = ("FAILED", "PARTIAL_FAILED")


@dataclass
class ListingWalks:
    """What the city walks of a window saw of listings that shifted under them.

    Attributes:
        drifted_cities: Cities whose walk saw the listing shift.
        unverified_cities: Cities whose shifted walk could not be verified.
        shifts: Shifts seen.
        recovered: Hotels a walk's check or verification found that it would have skipped.
    """

    drifted_cities: int = 0
    unverified_cities: int = 0
    shifts: int = 0
    recovered: int = 0


@dataclass
class SyncHealth:
    """One task's health at one instant (see the module docstring)."""

    task_code: str
    at: datetime
    batches_24h: dict[str, int] = field(default_factory=dict)
    cities_24h: dict[str, int] = field(default_factory=dict)
    latest_batch_id: str | None = None
    latest_batch_status: str | None = None
    latest_records: int = 0
    latest_bad_records: int = 0
    latest_mapping_failures: int = 0
    latest_hotels_per_second: float = 0.0
    missing_field_rate: dict[str, float] = field(default_factory=dict)
    dead_letters: deadletters.Summary | None = None
    review_pending: int = 0
    review_oldest_hours: float = 0.0
    city_lag_hours: dict[str, float] = field(default_factory=dict)
    watermark_lag_hours: float | None = None
    outbox_ready: int = 0
    outbox_failed: int = 0
    outbox_stuck: int = 0
    outbox_lag: Lag = field(default_factory=Lag)
    requests_24h: int = 0
    throttled_24h: int = 0
    retries_24h: int = 0
    sync_seconds_24h: float = 0.0
    limiter_wait_24h: float = 0.0
    walks_24h: ListingWalks = field(default_factory=ListingWalks)
    governed_rate: float | None = None

    @staticmethod
    def _rate(part: int, whole: int) -> float:
        return 0.0 if whole == 0 else round(part / whole, 6)

    @property
    def batch_success_rate_24h(self) -> float:
        """Successful ÷ finished batches of the last 24 hours (1.0 with none finished)."""
        finished = sum(n for s, n in self.batches_24h.items() if s in TERMINAL_BATCH_STATUSES)
        return 1.0 if finished == 0 else self._rate(self.batches_24h.get("SUCCESS", 0), finished)

    @property
    def city_success_rate_24h(self) -> float:
        """Successful ÷ finished cities of those batches (1.0 with none finished)."""
        finished = sum(n for s, n in self.cities_24h.items() if s != "RUNNING" and s != "PENDING")
        return 1.0 if finished == 0 else self._rate(self.cities_24h.get("SUCCESS", 0), finished)

    @property
    def bad_record_ratio(self) -> float:
        """Dead-lettered ÷ records of the latest finished batch."""
        return self._rate(self.latest_bad_records, self.latest_records)

    @property
    def mapping_failure_rate(self) -> float:
        """Mapping-stage dead letters ÷ records of the latest finished batch."""
        return self._rate(self.latest_mapping_failures, self.latest_records)

    @property
    def throttled_ratio_24h(self) -> float:
        """429 answers ÷ requests of the last 24 hours."""
        return self._rate(self.throttled_24h, self.requests_24h)

    def values(self) -> dict[str, float]:
        """Every figure as a named number (one flat namespace; per-field and per-city
        breakdowns are in :attr:`missing_field_rate` and :attr:`city_lag_hours`)."""
        lags = sorted(self.city_lag_hours.values())
        dl = self.dead_letters
        out: dict[str, float] = {
            "batch_success_rate_24h": self.batch_success_rate_24h,
            "city_success_rate_24h": self.city_success_rate_24h,
            "batches_failed_24h": float(
                sum(self.batches_24h.get(s, 0) for s in FAILED_BATCH_STATUSES)
            ),
            "bad_record_ratio": self.bad_record_ratio,
            "mapping_failure_rate": self.mapping_failure_rate,
            "latest_records": float(self.latest_records),
            "hotels_per_second": self.latest_hotels_per_second,
            "review_pending": float(self.review_pending),
            "review_oldest_hours": self.review_oldest_hours,
            "freshness_max_hours": lags[-1] if lags else 0.0,
            "freshness_p95_hours": lags[min(len(lags) - 1, int(0.95 * len(lags)))] if lags else 0.0,
            "watermark_lag_hours": -1.0
            if self.watermark_lag_hours is None
            else self.watermark_lag_hours,
            "outbox_ready": float(self.outbox_ready),
            "outbox_failed": float(self.outbox_failed),
            "outbox_stuck": float(self.outbox_stuck),
            "outbox_lag_p95_seconds": self.outbox_lag.p95 or 0.0,
            "supplier_requests_24h": float(self.requests_24h),
            "supplier_429_24h": float(self.throttled_24h),
            "supplier_retries_24h": float(self.retries_24h),
            "supplier_429_ratio_24h": self.throttled_ratio_24h,
            "supplier_429_per_minute_24h": self._rate(
                60 * self.throttled_24h, round(self.sync_seconds_24h)
            ),
            "supplier_limiter_wait_seconds_24h": self.limiter_wait_24h,
            "supplier_governed_rate": -1.0 if self.governed_rate is None else self.governed_rate,
            "listing_drifted_cities_24h": float(self.walks_24h.drifted_cities),
            "listing_unverified_cities_24h": float(self.walks_24h.unverified_cities),
            "listing_shifts_24h": float(self.walks_24h.shifts),
            "walk_recovered_hotels_24h": float(self.walks_24h.recovered),
        }
        if dl is not None:
            out.update(
                dead_letters_open=float(dl.open),
                dead_letters_open_retryable=float(dl.by_class.get("RETRYABLE", 0)),
                dead_letters_open_needs_person=float(dl.by_class.get("NEEDS_PERSON", 0)),
                dead_letters_oldest_open_hours=dl.oldest_open_hours,
                dead_letters_created_24h=float(dl.created_24h),
                dead_letter_fix_rate_24h=dl.fix_rate_24h,
                dead_letter_fix_rate_7d=dl.fix_rate_7d,
            )
        return out

    def to_json(self) -> dict[str, Any]:
        """Every figure and breakdown as plain JSON values."""
        return {
            "task_code": self.task_code,
            "at": self.at.isoformat(),
            "latest_batch_id": self.latest_batch_id,
            "latest_batch_status": self.latest_batch_status,
            "values": self.values(),
            "batches_24h": dict(self.batches_24h),
            "cities_24h": dict(self.cities_24h),
            "missing_field_rate": dict(self.missing_field_rate),
            "city_lag_hours": dict(self.city_lag_hours),
            "dead_letters_by_status": dict(self.dead_letters.by_status)
            if self.dead_letters
            else {},
            "dead_letters_open_by_code": dict(self.dead_letters.by_code)
            if self.dead_letters
            else {},
        }


def sync_health(db: SyncDatabase, *, task_code: str, supplier_id: int | None = None) -> SyncHealth:
    """The task's health now (see the module docstring): about fifteen bounded queries.

    Args:
        db: The sync database.
        task_code: The (full sync) task.
        supplier_id: Whose dead letters and reviews count (None: every supplier's).
    """
    with db.engine.connect() as conn:
        now = db.clock.read(conn)
        health = SyncHealth(task_code=task_code, at=now)
        _success(conn, health, now)
        _latest(conn, health)
        health.dead_letters = deadletters.summarize(conn, db.clock, supplier_id=supplier_id)
        _reviews(conn, health, now, supplier_id)
        _freshness(conn, health, now, supplier_id)
        _outbox(conn, health, db)
        _supplier(conn, health, now)
        _drift(conn, health, now)
    return health


def _success(conn: Connection, h: SyncHealth, now: datetime) -> None:
    b, sh = schema.batch.c, schema.shard.c
    day = now - timedelta(days=1)
    recent = [b.task_code == h.task_code, b.created_at >= day]
    h.batches_24h = {
        str(s): int(n)
        for s, n in conn.execute(
            sa.select(b.status, sa.func.count()).where(*recent).group_by(b.status)
        )
    }
    h.cities_24h = {
        str(s): int(n)
        for s, n in conn.execute(
            sa.select(sh.status, sa.func.count())
            .join(schema.batch, b.batch_id == sh.batch_id)
            .where(*recent)
            .group_by(sh.status)
        )
    }


def _latest(conn: Connection, h: SyncHealth) -> None:
    b, p, d = schema.batch.c, schema.city_profile.c, schema.dead_letter.c
    latest = conn.execute(
        sa.select(b.batch_id, b.status, b.success_count, b.started_at, b.finished_at)
        .where(b.task_code == h.task_code, b.status.in_(TERMINAL_BATCH_STATUSES))
        .order_by(b.created_at.desc(), b.id.desc())
        .limit(1)
    ).first()
    if latest is None:
        return
    h.latest_batch_id, h.latest_batch_status = str(latest.batch_id), str(latest.status)
    if latest.started_at is not None and latest.finished_at is not None:
        seconds = (latest.finished_at - latest.started_at).total_seconds()
        if seconds > 0:
            h.latest_hotels_per_second = round(int(latest.success_count or 0) / seconds, 1)
    records = 0
    bad = 0
    present: dict[str, int] = {}
    profiled = 0
    for row in conn.execute(
        sa.select(p.record_count, p.bad_count, p.field_counts).where(p.batch_id == latest.batch_id)
    ):
        records += int(row.record_count or 0)
        bad += int(row.bad_count or 0)
        counts = row.field_counts
        if isinstance(counts, str):
            counts = json.loads(counts)
        if isinstance(counts, dict):
            profiled += int(counts.get("records") or 0)
            for name, n in (counts.get("fields") or {}).items():
                present[str(name)] = present.get(str(name), 0) + int(n)
    h.latest_records, h.latest_bad_records = records, bad
    if profiled:
        h.missing_field_rate = {
            name: round(max(0.0, 1 - n / profiled), 6) for name, n in sorted(present.items())
        }
    h.latest_mapping_failures = int(
        conn.execute(
            sa.select(sa.func.count())
            .select_from(schema.dead_letter)
            .where(
                sa.or_(d.batch_id == latest.batch_id, d.last_batch_id == latest.batch_id),
                d.error_stage == "MAPPING",
            )
        ).scalar_one()
    )


def _reviews(conn: Connection, h: SyncHealth, now: datetime, supplier_id: int | None) -> None:
    r = schema.review.c
    where = [r.status == "PENDING"]
    if supplier_id is not None:
        where.append(r.supplier_id == supplier_id)
    n, oldest = conn.execute(
        sa.select(sa.func.count(), sa.func.min(r.created_at)).where(*where)
    ).one()
    h.review_pending = int(n)
    if oldest is not None:
        h.review_oldest_hours = round(max(0.0, (now - oldest).total_seconds()) / 3600, 3)


def _freshness(conn: Connection, h: SyncHealth, now: datetime, supplier_id: int | None) -> None:
    b, sh, w = schema.batch.c, schema.shard.c, schema.watermark.c
    window = now - timedelta(days=FRESHNESS_WINDOW_DAYS)
    last_success: dict[str, datetime | None] = {}
    for city, status, finished in conn.execute(
        sa.select(sh.shard_key, sh.status, sa.func.max(sh.finished_at))
        .join(schema.batch, b.batch_id == sh.batch_id)
        .where(b.task_code == h.task_code, b.created_at >= window)
        .group_by(sh.shard_key, sh.status)
    ):
        last_success.setdefault(str(city), None)
        if status == "SUCCESS" and finished is not None:
            last_success[str(city)] = finished
    # A city the supplier no longer lists is retired, not stale: no freshness alert for it.
    for city, at in retired_at(conn, supplier_id).items():
        if city in last_success and (last_success[city] or at) <= at:
            del last_success[city]
    cap = FRESHNESS_WINDOW_DAYS * 24.0
    h.city_lag_hours = {
        city: cap if at is None else round(min(cap, (now - at).total_seconds() / 3600), 6)
        for city, at in sorted(last_success.items())
    }
    mark = conn.execute(sa.select(sa.func.min(w.watermark_at))).scalar()
    if mark is not None:
        h.watermark_lag_hours = round(max(0.0, (now - mark).total_seconds()) / 3600, 3)


def _outbox(conn: Connection, h: SyncHealth, db: SyncDatabase) -> None:
    o = schema.outbox.c
    for status, n in conn.execute(
        sa.select(o.status, sa.func.count())
        .where(o.status.in_(("READY", "FAILED")))
        .group_by(o.status)
    ):
        if status == "READY":
            h.outbox_ready = int(n)
        else:
            h.outbox_failed = int(n)
    h.outbox_stuck = int(
        conn.execute(
            sa.select(sa.func.count())
            .select_from(schema.outbox)
            .where(o.status == "PROCESSING", o.lease_until < db.clock.now())
        ).scalar_one()
    )
    recent = conn.execute(
        sa.select(o.created_at, o.projected_at)
        # The claim index, in id order: a finished event's next stage is END.
        .where(o.status == "SUCCEEDED", o.next_stage == END)
        .order_by(o.id.desc())
        .limit(OUTBOX_WINDOW)
    ).all()
    h.outbox_lag = Lag.of([(p - c).total_seconds() for c, p in recent if p is not None])


def _supplier(conn: Connection, h: SyncHealth, now: datetime) -> None:
    s = schema.run_stats.c
    recent = (s.task_code == h.task_code, s.created_at >= now - timedelta(days=1))
    requests, throttled, retries, seconds, waited = conn.execute(
        sa.select(
            sa.func.coalesce(sa.func.sum(s.requests), 0),
            sa.func.coalesce(sa.func.sum(s.throttled), 0),
            sa.func.coalesce(sa.func.sum(s.retries), 0),
            sa.func.coalesce(sa.func.sum(s.seconds), 0),
            sa.func.coalesce(sa.func.sum(s.limiter_wait_seconds), 0),
        ).where(*recent)
    ).one()
    h.requests_24h, h.throttled_24h, h.retries_24h = int(requests), int(throttled), int(retries)
    h.sync_seconds_24h, h.limiter_wait_24h = float(seconds), float(waited)
    # The newest run with an adaptive rate: what it had learnt.
    rate = conn.execute(
        sa.select(s.governed_rate)
        .where(*recent, s.governed_rate.is_not(None))
        .order_by(s.created_at.desc(), s.id.desc())
        .limit(1)
    ).scalar()
    h.governed_rate = None if rate is None else float(rate)


def _drift(conn: Connection, h: SyncHealth, now: datetime) -> None:
    w, b = schema.city_walk.c, schema.batch.c
    drifted, unverified, shifts, recovered = conn.execute(
        sa.select(
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(sa.case((w.drift != "SHIFTED", 1), else_=0)), 0),
            sa.func.coalesce(sa.func.sum(w.shifts), 0),
            sa.func.coalesce(sa.func.sum(w.recovered), 0),
        )
        .select_from(schema.city_walk)
        .join(schema.batch, b.batch_id == w.batch_id)
        .where(b.task_code == h.task_code, w.created_at >= now - timedelta(days=1))
    ).one()
    h.walks_24h = ListingWalks(int(drifted), int(unverified), int(shifts), int(recovered))
