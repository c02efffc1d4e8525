"""Alerts that fire once and clear: conditions, episodes, and their delivery.

:func:`evaluate` judges a task's conditions against its thresholds (one row per task and
name in ``supplier_sync_alert_threshold``; :data:`DEFAULTS` otherwise) and returns the
:class:`Finding` of each condition that holds now:

- ``consecutive_failed_batches``: the task's last N finished batches all failed;
- ``dead_letter_spike``: dead letters of the last 24 h above k × the median of the 7 days
  before (and at least a minimum);
- ``city_emptied``: a city whose previous batch had records returned none in the latest;
- ``reconciliation_diff``: cities still differing from the supplier after a re-pull;
- ``freshness_sla``: cities not synced successfully within the SLA;
- ``stuck_outbox``: outbox events PROCESSING with an expired lease;
- ``rate_limit_storm``: the share of 429 answers of the task's latest run (of the last hour);
- ``breaker_open``: cities of the latest finished batch refused by an open circuit breaker,
  M minutes after the first of them;
- ``supplier_auth_rejected``: the supplier refused the API key (401/403) in the latest
  finished batch (the run stopped, or could not start): at once, a person must fix the key;
- ``supplier_unreachable``: the latest finished batch failed because the supplier could not
  be reached at all (connection refused, DNS, TLS): at once.

:func:`record` turns findings into **episodes** (``supplier_sync_alert``): a condition that
starts is one FIRING row (its ``open_key`` unique while it holds: it fires once, also when
two evaluators race), a condition that holds updates it and sends nothing, a condition that
stops is RESOLVED. Each start and each end is one delivery row; :func:`deliver` sends the
due ones to the :class:`Channel` (a webhook with a Slack-compatible body, or a JSON-lines
file), and a failing channel is retried with backoff later: it never blocks a sync.
"""

from __future__ import annotations

import abc
import json
import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Final, Literal, get_args

import httpx
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import (
    AUTH_REJECTED_CODES,
    UNREACHABLE_CODES,
    ConfigError,
    code_of_description,
)
from supplier_sync_dagster.core.health.metrics import FAILED_BATCH_STATUSES, SyncHealth, sync_health
from supplier_sync_dagster.core.leasing.batches import TERMINAL_BATCH_STATUSES
from supplier_sync_dagster.core.redaction import bounded, redact, register_url
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import Identity, record_actions, require_who_and_why
from supplier_sync_dagster.core.store.db import DbClock, SyncDatabase, insert_ignore

log = logging.getLogger(__name__)

Condition = Literal[
    "consecutive_failed_batches",
    "dead_letter_spike",
    "city_emptied",
    "reconciliation_diff",
    "freshness_sla",
    "stuck_outbox",
    "rate_limit_storm",
    "breaker_open",
    "supplier_auth_rejected",
    "supplier_unreachable",
]
CONDITIONS: Final[tuple[Condition, ...]] = get_args(Condition)

DEFAULTS: Final[Mapping[str, float]] = {
    "consecutive_failed_batches": 3,
    "dead_letter_spike_factor": 3.0,
    "dead_letter_spike_min": 20,
    "reconciliation_diff_cities": 1,
    "freshness_sla_hours": 26.0,
    "stuck_outbox_events": 1,
    "rate_limit_storm_ratio": 0.2,
    "rate_limit_storm_min_requests": 50,
    "breaker_open_minutes": 10.0,
}
"""Every threshold and its default; a task's stored values override them."""

BACKOFF_SECONDS: Final = (10, 30, 60, 300, 900, 3600)
"""Wait before delivery attempt n+1 of a message the channel refused (the last repeats)."""


@dataclass(frozen=True)
class Finding:
    """A condition that holds now.

    Attributes:
        condition: The condition.
        subject: What it is about beyond the task (a city), or "".
        value: The figure that crossed the threshold.
        threshold: The threshold.
        message: What a person reads: the task, the city, the figures.
        run_id: A Dagster run to look at, when one is known.
    """

    condition: Condition
    subject: str
    value: float
    threshold: float
    message: str
    run_id: str | None = None


def thresholds(conn: Connection, task_code: str) -> dict[str, float]:
    """The task's thresholds: the stored ones over :data:`DEFAULTS`."""
    t = schema.alert_threshold.c
    stored = {
        str(n): float(v)
        for n, v in conn.execute(sa.select(t.name, t.value).where(t.task_code == task_code))
    }
    return {**DEFAULTS, **stored}


def set_thresholds(
    db: SyncDatabase,
    task_code: str,
    values: Mapping[str, float],
    *,
    actor: str,
    reason: str,
    identity: Identity | None = None,
) -> dict[str, float]:
    """Changes thresholds of a task, audited (action ``alert.threshold``, one row each, with
    ``identity``, the acting process's when None).

    Raises:
        ConfigError: An unknown name, a negative value, or no actor or reason.
    """
    who, why = require_who_and_why(actor, reason)
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown alert thresholds {unknown}; known: {sorted(DEFAULTS)}")
    if any(v < 0 for v in values.values()):
        raise ConfigError("alert thresholds are not negative")
    t = schema.alert_threshold.c
    with db.begin() as conn:
        before = thresholds(conn, task_code)
        for name, value in sorted(values.items()):
            updated = conn.execute(
                sa.update(schema.alert_threshold)
                .where(t.task_code == task_code, t.name == name)
                .values(value=float(value), updated_by=who, updated_at=db.clock.now())
            ).rowcount
            if not updated:
                conn.execute(
                    sa.insert(schema.alert_threshold).values(
                        task_code=task_code,
                        name=name,
                        value=float(value),
                        updated_by=who,
                        updated_at=db.clock.now(),
                    )
                )
        record_actions(
            conn,
            db.clock,
            action="alert.threshold",
            target_type="task",
            changes=[
                (f"{task_code}:{name}", {name: before[name]}, {name: float(value)})
                for name, value in sorted(values.items())
            ],
            actor=who,
            reason=why,
            identity=identity,
        )
        return thresholds(conn, task_code)


@dataclass(frozen=True)
class Context:
    """What the evaluator knows beyond the sync database (Dagster's own records).

    Attributes:
        reconciliation_remaining: Cities the latest reconciliation found still different
            after a re-pull (None: no reconciliation ran).
        failed_run_id: The latest failed run of the task, for the alert's link.
    """

    reconciliation_remaining: int | None = None
    failed_run_id: str | None = None


def latest_failed_trigger(db: SyncDatabase, task_code: str) -> str | None:
    """The trigger id of the task's latest finished batch when that batch failed (what an
    alert links to the failed run by); None when it succeeded or none finished."""
    b = schema.batch.c
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.select(b.status, b.trigger_id)
            .where(b.task_code == task_code, b.status.in_(TERMINAL_BATCH_STATUSES))
            .order_by(b.created_at.desc(), b.id.desc())
            .limit(1)
        ).first()
    if row is None or row.status not in FAILED_BATCH_STATUSES or not row.trigger_id:
        return None
    return str(row.trigger_id)


def evaluate(
    db: SyncDatabase, health: SyncHealth, *, context: Context = Context()
) -> list[Finding]:
    """The conditions of ``health.task_code`` that hold now (a few bounded queries)."""
    task = health.task_code
    with db.engine.connect() as conn:
        limits = thresholds(conn, task)
        now = health.at
        found: list[Finding] = []
        found += _consecutive_failures(conn, task, limits, context)
        found += _dead_letter_spike(conn, task, now, limits)
        found += _emptied_cities(conn, task, health)
        found += _breaker_open(conn, task, now, limits)
        found += _supplier_refused(conn, task)
        storm = _storm(conn, task, now, limits)
    found += storm
    remaining = context.reconciliation_remaining
    if remaining is not None and remaining >= limits["reconciliation_diff_cities"]:
        found.append(
            Finding(
                "reconciliation_diff",
                "",
                remaining,
                limits["reconciliation_diff_cities"],
                f"task {task}: {remaining} cities still differ from the supplier after a "
                "re-pull (a person must look: see hotel_catalog_reconciliation)",
            )
        )
    sla = limits["freshness_sla_hours"]
    stale = sorted((c for c, lag in health.city_lag_hours.items() if lag > sla))
    if stale:
        found.append(
            Finding(
                "freshness_sla",
                "",
                len(stale),
                sla,
                f"task {task}: {len(stale)} cities not synced within {sla:g} h: "
                + ", ".join(repr(c) for c in stale[:10])
                + (" ..." if len(stale) > 10 else ""),
            )
        )
    if health.outbox_stuck >= max(1.0, limits["stuck_outbox_events"]):
        found.append(
            Finding(
                "stuck_outbox",
                "",
                health.outbox_stuck,
                limits["stuck_outbox_events"],
                f"{health.outbox_stuck} outbox events are PROCESSING with an expired lease "
                "(a dispatcher died); the stuck pass returns them to READY",
            )
        )
    return found


def _consecutive_failures(
    conn: Connection, task: str, limits: Mapping[str, float], context: Context
) -> list[Finding]:
    b = schema.batch.c
    n = max(1, int(limits["consecutive_failed_batches"]))
    statuses = [
        str(s)
        for s in conn.execute(
            sa.select(b.status)
            .where(b.task_code == task, b.status.in_(TERMINAL_BATCH_STATUSES))
            .order_by(b.created_at.desc(), b.id.desc())
            .limit(n)
        ).scalars()
    ]
    if len(statuses) < n or any(s not in FAILED_BATCH_STATUSES for s in statuses):
        return []
    return [
        Finding(
            "consecutive_failed_batches",
            "",
            n,
            n,
            f"task {task}: its last {n} batches failed ({', '.join(statuses)})",
            context.failed_run_id,
        )
    ]


def _dead_letter_spike(
    conn: Connection, task: str, now: datetime, limits: Mapping[str, float]
) -> list[Finding]:
    d = schema.dead_letter.c

    def created(since: datetime, until: datetime) -> int:
        return int(
            conn.execute(
                sa.select(sa.func.count())
                .select_from(schema.dead_letter)
                .where(d.created_at >= since, d.created_at < until, d.task_code == task)
            ).scalar_one()
        )

    day = timedelta(days=1)
    today = created(now - day, now + timedelta(seconds=1))
    before = [created(now - (k + 1) * day, now - k * day) for k in range(1, 8)]
    median = statistics.median(before)
    limit = max(limits["dead_letter_spike_min"], limits["dead_letter_spike_factor"] * median)
    if today <= limit:
        return []
    return [
        Finding(
            "dead_letter_spike",
            "",
            today,
            limit,
            f"task {task}: {today} dead letters in the last 24 h, over {limit:g} "
            f"({limits['dead_letter_spike_factor']:g} x the 7-day median of {median:g})",
        )
    ]


def _emptied_cities(conn: Connection, task: str, health: SyncHealth) -> list[Finding]:
    if health.latest_batch_id is None:
        return []
    p = schema.city_profile.c
    empty = [
        str(c)
        for c in conn.execute(
            sa.select(p.shard_key).where(p.batch_id == health.latest_batch_id, p.record_count == 0)
        ).scalars()
    ]
    out = []
    for city in empty:
        previous = conn.execute(
            sa.select(p.record_count)
            .where(
                p.task_code == task,
                p.shard_key == city,
                p.batch_id != health.latest_batch_id,
            )
            .order_by(p.id.desc())
            .limit(1)
        ).scalar()
        if previous:
            out.append(
                Finding(
                    "city_emptied",
                    city,
                    0,
                    float(previous),
                    f"task {task}: city {city!r} had {previous} hotels and returned none in "
                    f"batch {health.latest_batch_id}",
                )
            )
    return out


def _storm(
    conn: Connection, task: str, now: datetime, limits: Mapping[str, float]
) -> list[Finding]:
    """The task's latest run of the last hour: its share of 429 answers."""
    s = schema.run_stats.c
    latest = conn.execute(
        sa.select(s.requests, s.throttled, s.batch_id)
        .where(s.task_code == task, s.created_at >= now - timedelta(hours=1))
        .order_by(s.id.desc())
        .limit(1)
    ).first()
    if latest is None:
        return []
    requests, throttled = int(latest.requests), int(latest.throttled)
    if requests == 0 or requests < limits["rate_limit_storm_min_requests"]:
        return []
    ratio = throttled / requests
    if ratio < limits["rate_limit_storm_ratio"]:
        return []
    return [
        Finding(
            "rate_limit_storm",
            "",
            round(ratio, 4),
            limits["rate_limit_storm_ratio"],
            f"task {task}: {throttled} of {requests} requests of its latest run (batch "
            f"{latest.batch_id}) were answered 429 ({ratio:.0%}): the rate limit is set above "
            "what the supplier allows",
        )
    ]


def _breaker_open(
    conn: Connection, task: str, now: datetime, limits: Mapping[str, float]
) -> list[Finding]:
    """Cities of the task's latest finished batch refused by an open circuit breaker."""
    sh, b = schema.shard.c, schema.batch.c
    latest = conn.execute(
        sa.select(b.batch_id)
        .where(b.task_code == task, b.status.in_(TERMINAL_BATCH_STATUSES))
        .order_by(b.created_at.desc(), b.id.desc())
        .limit(1)
    ).scalar()
    if latest is None:
        return []
    since, cities = conn.execute(
        sa.select(sa.func.min(sh.updated_at), sa.func.count()).where(
            sh.batch_id == latest,
            sh.status == "FAILED",
            # Either way a city's error names the breaker: the class (older rows), or the
            # breaker's own message (describe_error's ``CODE: message``).
            sa.or_(
                sh.error_message.like("%CircuitOpen%"),
                sh.error_message.like("%circuit breaker for%"),
            ),
        )
    ).one()
    if since is None:
        return []
    minutes = max(0.0, (now - since).total_seconds() / 60)
    if minutes < limits["breaker_open_minutes"]:
        return []
    return [
        Finding(
            "breaker_open",
            "",
            round(minutes, 1),
            limits["breaker_open_minutes"],
            f"task {task}: the supplier's circuit breaker refused batch {latest}: {cities} "
            f"cities failed with CircuitOpen, the first {minutes:.0f} min ago",
        )
    ]


def _supplier_refused(conn: Connection, task: str) -> list[Finding]:
    """The task's latest finished batch, if the supplier refused its API key (any of its
    cities, or its start) or could not be reached at all (its start, or every city)."""
    b, sh = schema.batch.c, schema.shard.c
    latest = conn.execute(
        sa.select(b.batch_id, b.status, b.error_message)
        .where(b.task_code == task, b.status.in_(TERMINAL_BATCH_STATUSES))
        .order_by(sa.func.coalesce(b.finished_at, b.created_at).desc(), b.id.desc())
        .limit(1)
    ).first()
    if latest is None or latest.status not in FAILED_BATCH_STATUSES:
        return []
    failed = conn.execute(
        sa.select(sh.shard_key, sh.error_message)
        .where(sh.batch_id == latest.batch_id, sh.status == "FAILED")
        .order_by(sh.finished_at, sh.id)
    ).all()
    errors = [(None, latest.error_message), *((r.shard_key, r.error_message) for r in failed)]
    found: list[Finding] = []
    refused = [(city, e) for city, e in errors if code_of_description(e) in AUTH_REJECTED_CODES]
    if refused:
        cities = sum(1 for city, _ in refused if city is not None)
        which = f"{cities} cities not synced" if cities else "before it read the city list"
        found.append(
            Finding(
                "supplier_auth_rejected",
                "",
                max(cities, 1),
                1,
                f"task {task}: the supplier refused the API key in batch {latest.batch_id} "
                f"({which}); the sync stops until the key is fixed: {refused[0][1]}",
            )
        )
    down = [(city, e) for city, e in errors if code_of_description(e) in UNREACHABLE_CODES]
    start_failed = code_of_description(latest.error_message) in UNREACHABLE_CODES
    if down and (start_failed or (latest.status == "FAILED" and len(down) == len(failed))):
        found.append(
            Finding(
                "supplier_unreachable",
                "",
                max(len(failed), 1),
                1,
                f"task {task}: the supplier could not be reached (batch {latest.batch_id} "
                f"failed): {down[0][1]}",
            )
        )
    return found


def alert_key(task_code: str, finding: Finding) -> str:
    """The identity of an alert: its condition, task and subject."""
    return f"{finding.condition}/{task_code}/{finding.subject}"[:255]


@dataclass(frozen=True)
class Changes:
    """What :func:`record` did: alerts started and alerts cleared."""

    fired: list[int]
    resolved: list[int]


def record(
    db: SyncDatabase,
    task_code: str,
    findings: Sequence[Finding],
    *,
    evaluated: Sequence[Condition] = CONDITIONS,
    run_url: str | None = None,
) -> Changes:
    """Starts, holds and clears the task's alert episodes from the findings.

    Args:
        db: The sync database.
        task_code: The task judged.
        findings: The conditions that hold now.
        evaluated: The conditions that were judged (an open alert of another condition is
            left alone: it was not looked at).
        run_url: A link for the messages (a Dagster run).
    """
    a = schema.alert.c
    clock = db.clock
    fired: list[int] = []
    resolved: list[int] = []
    with db.begin() as conn:
        open_rows = {
            str(r.alert_key): r
            for r in conn.execute(
                sa.select(a.id, a.alert_key, a.condition_name).where(
                    a.task_code == task_code, a.status == "FIRING"
                )
            )
        }
        now = clock.read(conn)
        holding = {alert_key(task_code, f): f for f in findings}
        for key, f in holding.items():
            if key in open_rows:
                conn.execute(
                    sa.update(schema.alert)
                    .where(a.id == open_rows[key].id)
                    .values(value=f.value, message=bounded(f.message), updated_at=now)
                )
                continue
            insert_ignore(
                conn,
                schema.alert,
                [
                    {
                        "alert_key": key,
                        "open_key": key,
                        "condition_name": f.condition,
                        "task_code": task_code,
                        "subject": f.subject[:128],
                        "status": "FIRING",
                        "value": f.value,
                        "threshold": f.threshold,
                        "message": bounded(f.message),
                        "run_url": _run_url(run_url, f.run_id),
                    }
                ],
                started_at=now,
                updated_at=now,
            )
            new_id = conn.execute(sa.select(a.id).where(a.open_key == key)).scalar_one()
            fired.append(int(new_id))
        for key, row in open_rows.items():
            if key not in holding and row.condition_name in evaluated:
                moved = conn.execute(
                    sa.update(schema.alert)
                    .where(a.id == row.id, a.status == "FIRING")
                    .values(status="RESOLVED", open_key=None, resolved_at=now, updated_at=now)
                ).rowcount
                if moved:
                    resolved.append(int(row.id))
        deliveries = [{"alert_id": i, "kind": "FIRING"} for i in fired] + [
            {"alert_id": i, "kind": "RESOLVED"} for i in resolved
        ]
        insert_ignore(
            conn,
            schema.alert_delivery,
            deliveries,
            status="PENDING",
            attempts=0,
            next_attempt_at=now,
            created_at=now,
        )
    return Changes(fired, resolved)


def _run_url(base: str | None, run_id: str | None) -> str | None:
    if base and run_id:
        return f"{base.rstrip('/')}/runs/{run_id}"[:512]
    return base[:512] if base else None


class Channel(abc.ABC):
    """Where alert messages go."""

    @abc.abstractmethod
    def send(self, message: Mapping[str, Any]) -> None:
        """Sends one message (raises when it was not accepted)."""


class WebhookChannel(Channel):
    """An HTTP webhook taking Slack's incoming-webhook JSON (``text`` plus attachments)."""

    def __init__(self, url: str, *, http: httpx.Client | None = None, timeout: float = 5.0):
        self.url = url
        # The URL is the credential (a Slack webhook's path is its secret): never shown.
        register_url(url, whole_path=True)
        self._http = http or httpx.Client(timeout=timeout)

    def send(self, message: Mapping[str, Any]) -> None:
        """POSTs the message; a non-2xx answer raises."""
        response = self._http.post(self.url, json=dict(message))
        response.raise_for_status()


class FileChannel(Channel):
    """A JSON-lines file (the embedded default)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def send(self, message: Mapping[str, Any]) -> None:
        """Appends the message as one line."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(dict(message), sort_keys=True, default=str) + "\n")


def open_channel(url: str | None, state_dir: Path) -> Channel:
    """The channel of ``SUPPLIER_SYNC_ALERT_URL``: http(s) webhook, file:// path, or the
    state folder's ``alerts.jsonl``."""
    if not url:
        return FileChannel(state_dir / "alerts.jsonl")
    if url.startswith("file://"):
        return FileChannel(Path(url.removeprefix("file://")))
    return WebhookChannel(url)


def message(row: Any, kind: str) -> dict[str, Any]:
    """The Slack-compatible body of one delivery: ``text``, one attachment with fields, and
    the alert itself under ``alert`` for receivers that are not Slack."""
    firing = kind == "FIRING"
    title = f"{'FIRING' if firing else 'RESOLVED'}: {row.condition_name} ({row.task_code}"
    title += f", {row.subject})" if row.subject else ")"
    text = f"{title}\n{row.message}" + (f"\n{row.run_url}" if row.run_url else "")
    fields = [
        {"title": "task", "value": row.task_code, "short": True},
        {"title": "condition", "value": row.condition_name, "short": True},
    ]
    if row.subject:
        fields.append({"title": "city", "value": row.subject, "short": True})
    fields.append(
        {"title": "value", "value": f"{row.value:g} (threshold {row.threshold:g})", "short": True}
    )
    return {
        "text": text,
        "attachments": [
            {
                "color": "danger" if firing else "good",
                "title": title,
                "text": row.message,
                "title_link": row.run_url,
                "fields": fields,
            }
        ],
        "alert": {
            "id": int(row.id),
            "kind": kind,
            "condition": row.condition_name,
            "task": row.task_code,
            "subject": row.subject,
            "value": row.value,
            "threshold": row.threshold,
            "message": row.message,
            "run_url": row.run_url,
            "started_at": _iso(row.started_at),
            "resolved_at": _iso(row.resolved_at),
        },
    }


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


@dataclass(frozen=True)
class Delivered:
    """What :func:`deliver` did."""

    sent: int
    failed: int


def deliver(db: SyncDatabase, channel: Channel, *, limit: int = 100) -> Delivered:
    """Sends the due deliveries, oldest first; a refused one waits for its next attempt.

    Never raises for the channel's failures: they are counted and retried later.
    """
    a, dl = schema.alert.c, schema.alert_delivery.c
    with db.engine.connect() as conn:
        due = conn.execute(
            sa.select(dl.id.label("delivery_id"), dl.kind, dl.attempts, schema.alert)
            .join(schema.alert, a.id == dl.alert_id)
            .where(dl.status == "PENDING", dl.next_attempt_at <= db.clock.now())
            .order_by(dl.id)
            .limit(limit)
        ).all()
    sent = failed = 0
    for row in due:
        try:
            channel.send(message(row, str(row.kind)))
        except Exception as err:  # the channel's trouble: retried, never raised
            failed += 1
            error = bounded(f"{type(err).__name__}: {err}")
            wait = BACKOFF_SECONDS[min(int(row.attempts), len(BACKOFF_SECONDS) - 1)]
            with db.begin() as conn:
                conn.execute(
                    sa.update(schema.alert_delivery)
                    .where(dl.id == row.delivery_id, dl.status == "PENDING")
                    .values(
                        attempts=dl.attempts + 1,
                        next_attempt_at=db.clock.now(wait),
                        last_error=error,
                    )
                )
            log.warning(
                "alert delivery %s failed (next try in %ss): %s", row.delivery_id, wait, error
            )
            continue
        sent += 1
        with db.begin() as conn:
            conn.execute(
                sa.update(schema.alert_delivery)
                .where(dl.id == row.delivery_id, dl.status == "PENDING")
                .values(status="SENT", attempts=dl.attempts + 1, sent_at=db.clock.now())
            )
    return Delivered(sent, failed)


def list_alerts(
    conn: Connection, clock: DbClock, *, days: float = 7.0, include_resolved: bool = True
) -> list[dict[str, Any]]:
    """Open alerts, and those of the last ``days`` days, newest first, with their deliveries."""
    a, dl = schema.alert.c, schema.alert_delivery.c
    where: list[Any] = [sa.or_(a.status == "FIRING", a.started_at >= clock.now(-86400 * days))]
    if not include_resolved:
        where = [a.status == "FIRING"]
    rows = conn.execute(sa.select(schema.alert).where(*where).order_by(a.id.desc())).all()
    deliveries: dict[int, list[dict[str, Any]]] = {}
    ids = [int(r.id) for r in rows]
    if ids:
        for d in conn.execute(
            sa.select(dl.alert_id, dl.kind, dl.status, dl.attempts, dl.last_error, dl.sent_at)
            .where(dl.alert_id.in_(ids))
            .order_by(dl.id)
        ):
            # Rows stored before errors were redacted are shown redacted too.
            deliveries.setdefault(int(d.alert_id), []).append(
                {
                    **{k: v for k, v in d._asdict().items() if k != "alert_id"},
                    "last_error": d.last_error and redact(d.last_error),
                }
            )
    return [
        {
            **{k: v for k, v in r._asdict().items() if k != "open_key"},
            "deliveries": deliveries.get(int(r.id), []),
        }
        for r in rows
    ]


@dataclass(frozen=True)
class Round:
    """One evaluation: what holds, what started or cleared, what was sent."""

    findings: list[Finding]
    changes: Changes
    delivered: Delivered


def check(
    db: SyncDatabase,
    channel: Channel,
    *,
    task_code: str,
    context: Context = Context(),
    dagster_url: str | None = None,
) -> Round:
    """Evaluates the task's conditions, records the episodes and sends what is due."""
    health = sync_health(db, task_code=task_code)
    findings = evaluate(db, health, context=context)
    changes = record(db, task_code, findings, run_url=dagster_url)
    return Round(findings, changes, deliver(db, channel))
