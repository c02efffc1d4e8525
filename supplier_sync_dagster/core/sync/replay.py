"""Replay: run normalization and everything after it again from stored raw pages.

When a normalization or mapping rule is fixed, the records it mishandled are still in the
payload store, byte for byte (invariant 6). A replay is a new batch (trigger
``replay:<id>``, source COMPENSATION) whose RAW snapshot rows point at the stored pages of
each city's latest batch; ``sync_city(fetch=False)`` then normalizes, gates,
diffs and publishes them without a single supplier request. Dead letters of the source
batch whose records now pass are RESOLVED.

A dry run (:func:`dry_run_city`) runs the same stages over the same pages, chunk by chunk,
with a publisher that only diffs against what is published: it writes nothing and reports
what a replay would do.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.leasing.batches import Batch, add_shards, create_batch, get_batch
from supplier_sync_dagster.core.leasing.leases import LeaseSettings
from supplier_sync_dagster.core.records import deadletters
from supplier_sync_dagster.core.records.diff import RiskPolicy, default_risk_policy
from supplier_sync_dagster.core.settings import DEFAULT_MAX_CLOCK_SKEW_SECONDS
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase, insert_ignore
from supplier_sync_dagster.core.store.payloads import PayloadStore
from supplier_sync_dagster.core.sync.model import SyncSettings, build_sync_settings
from supplier_sync_dagster.core.sync.snapshots import RAW, snapshot_id
from supplier_sync_dagster.core.sync.stages import DiffCollector, dry_run_stages

DEFAULT_CHUNK_HOTELS = SyncSettings.chunk_hotels


def latest_raw_batch(db: SyncDatabase, *, task_code: str, city_code: str) -> str | None:
    """The latest batch of the task that stored raw pages for the city (None: never synced)."""
    s, b = schema.snapshot.c, schema.batch.c
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.select(s.batch_id)
            .join(schema.batch, b.batch_id == s.batch_id)
            .where(b.task_code == task_code, s.shard_key == city_code, s.snapshot_type == RAW)
            .order_by(s.id.desc())
            .limit(1)
        ).first()
    return None if row is None else str(row.batch_id)


@dataclass(frozen=True)
class ReplayPlan:
    """A replay batch and, for each of its cities, the batch whose raw pages it replays."""

    batch: Batch
    sources: dict[str, str]
    missing: list[str]  # cities with no stored raw pages: nothing to replay


def prepare_replay(
    db: SyncDatabase, *, task_code: str, trigger_id: str, cities: Sequence[str]
) -> ReplayPlan:
    """Creates (idempotently) the replay batch and points its cities at their stored pages.

    Args:
        db: The sync database.
        task_code: The task whose batches are replayed.
        trigger_id: The replay's idempotency key (a Dagster run id, an operator's id).
        cities: The cities to replay.

    Raises:
        ConfigError: The task's concurrency policy refused the replay batch.
    """
    sources = {}
    missing = []
    for city in cities:
        source = latest_raw_batch(db, task_code=task_code, city_code=city)
        if source is None or source == _replay_batch_id(db, task_code, trigger_id):
            missing.append(city)
        else:
            sources[city] = source
    decision = create_batch(
        db,
        task_code=task_code,
        trigger_id=f"replay:{trigger_id}",
        trigger_source="COMPENSATION",
        adopt=False,  # a replay batch reads stored pages: it never continues a sync batch
    )
    if decision.batch is None:
        raise ConfigError(f"replay refused: {decision.reason}")
    batch_id = decision.batch.batch_id
    if sources:
        add_shards(db, batch_id, list(sources))
    s = schema.snapshot.c
    with db.begin() as conn:
        for city, source in sources.items():
            pages = conn.execute(
                sa.select(
                    s.supplier_id,
                    s.category_code,
                    s.payload_ref,
                    s.payload_hash,
                    s.page_number,
                    s.record_count,
                    s.snapshot_version,
                )
                .where(s.batch_id == source, s.shard_key == city, s.snapshot_type == RAW)
                .order_by(s.id)
            ).all()
            insert_ignore(
                conn,
                schema.snapshot,
                [
                    {
                        "snapshot_id": snapshot_id(batch_id, city, RAW, p.payload_hash),
                        "supplier_id": p.supplier_id,
                        "category_code": p.category_code,
                        "payload_ref": p.payload_ref,
                        "payload_hash": p.payload_hash,
                        "page_number": p.page_number,
                        "record_count": p.record_count,
                        "snapshot_version": p.snapshot_version,
                        # The batch whose fetch stored these bytes (the trace to the supplier).
                        "derived_from": f"replay-of:{source}"[:128],
                    }
                    for p in pages
                ],
                batch_id=batch_id,
                shard_key=city,
                snapshot_type=RAW,
                created_at=db.clock.now(),
            )
        batch = get_batch(conn, batch_id)
    return ReplayPlan(batch, sources, missing)


def _replay_batch_id(db: SyncDatabase, task_code: str, trigger_id: str) -> str | None:
    b = schema.batch.c
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.select(b.batch_id).where(
                b.task_code == task_code, b.trigger_id == f"replay:{trigger_id}"
            )
        ).first()
    return None if row is None else str(row.batch_id)


def resolve_replayed_dead_letters(
    db: SyncDatabase, *, source_batch_id: str, replay_batch_id: str, city_code: str
) -> int:
    """Marks RESOLVED the source batch's dead letters of the city that the replay no longer has.

    A dead letter is identified by its record (raw page hash and place on the page) and its
    stage: when the replay of that page produced no dead letter for the record at that
    stage, the rule that rejected it has been fixed. Returns how many were resolved.
    """
    d, s = schema.dead_letter.c, schema.snapshot.c
    with db.begin() as conn:
        pages = sa.select(s.payload_hash).where(
            s.batch_id == source_batch_id, s.shard_key == city_code, s.snapshot_type == RAW
        )
        # A record the replay refused again updated its ticket (last seen by the replay).
        fixed = [
            int(i)
            for i in conn.execute(
                sa.select(d.id).where(
                    d.raw_payload_hash.in_(pages),
                    d.status.in_(deadletters.OPEN_STATUSES),
                    sa.or_(d.last_batch_id.is_(None), d.last_batch_id != replay_batch_id),
                )
            ).scalars()
        ]
        deadletters.move(
            conn,
            db.clock,
            fixed,
            "resolve",
            fix_note=f"passed on replay in batch {replay_batch_id}"[:1024],
        )
    return len(fixed)


@dataclass
class DryRunReport:
    """What a replay of one city would do, computed without writing anything."""

    city_code: str
    source_batch_id: str | None
    records: int = 0
    dead_letters: int = 0
    dead_letters_by_code: Counter[str] = field(default_factory=Counter)
    diffs_by_type: Counter[str] = field(default_factory=Counter)
    diffs_by_action: Counter[str] = field(default_factory=Counter)
    changes: list[dict[str, Any]] = field(default_factory=list)  # a sample, for people

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values."""
        return {
            "city_code": self.city_code,
            "source_batch_id": self.source_batch_id,
            "records": self.records,
            "dead_letters": self.dead_letters,
            "dead_letters_by_code": dict(self.dead_letters_by_code),
            "diffs_by_type": dict(self.diffs_by_type),
            "diffs_by_action": dict(self.diffs_by_action),
            "changes": self.changes,
        }

    def to_text(self) -> list[str]:
        """The report for people: what the city holds, what a replay would do, the sample."""
        if self.source_batch_id is None:
            return [f"city {self.city_code!r}: no stored raw pages"]
        letters = ""
        if self.dead_letters:
            codes = ", ".join(f"{c} {n}" for c, n in self.dead_letters_by_code.most_common())
            letters = f" ({codes})"
        diffs = ", ".join(f"{t} {n}" for t, n in self.diffs_by_type.most_common()) or "none"
        act = self.diffs_by_action
        lines = [
            f"city {self.city_code!r} (stored pages of batch {self.source_batch_id}): "
            f"{self.records} records, {self.dead_letters} dead letters{letters}",
            f"  diffs: {diffs}; would publish {act.get('AUTO_PUBLISH', 0)}, hold "
            f"{act.get('REVIEW', 0)} for review",
        ]
        changed = sum(n for t, n in self.diffs_by_type.items() if t != "NO_CHANGE")
        if self.changes:
            lines.append(f"  a sample of {len(self.changes)} of the {changed} changes:")
        for c in self.changes:
            fields = c["changed_fields"]
            what = (
                repr(c.get("name"))
                if c["diff_type"] == "NEW"
                else "; ".join(
                    f"{f.get('field')}: {f.get('old')!r} -> {f.get('new')!r}" for f in fields[:3]
                )
                + (f" (+{more} more)" if (more := c.get("fields_changed", 0) - 3) > 0 else "")
            )
            lines.append(
                f"    {c['supplier_hotel_id']} {c['diff_type']} -> {c['action']}: {what}"[:300]
            )
        return lines


def dry_run_city(
    db: SyncDatabase,
    store: PayloadStore,
    *,
    task_code: str,
    supplier_id: int,
    city_code: str,
    city_countries: Mapping[str, str] | None = None,
    risk_policy: RiskPolicy = default_risk_policy,
    max_clock_skew_seconds: float = DEFAULT_MAX_CLOCK_SKEW_SECONDS,
    sample: int = 20,
    chunk_hotels: int = DEFAULT_CHUNK_HOTELS,
) -> DryRunReport:
    """Normalizes, checks and diffs the city's latest stored raw pages; writes nothing.

    It runs the sync's own normalize and publish stages (``stages.dry_run_stages``) with
    a publisher that only diffs: a chunk of ``chunk_hotels`` hotels at a time, as a sync.
    Hotels without a mapping yet are reported as NEW.
    """
    source = latest_raw_batch(db, task_code=task_code, city_code=city_code)
    report = DryRunReport(city_code, source)
    if source is None:
        return report
    settings = build_sync_settings(
        task_code=task_code,
        supplier_id=supplier_id,
        # A dry run reads stored pages only, without a lease.
        page_size=SyncSettings.page_size,
        lease=LeaseSettings(),
        risk_policy=risk_policy,
        max_clock_skew_seconds=max_clock_skew_seconds,
        chunk_hotels=chunk_hotels,
    )
    collector = DiffCollector(db, settings, sample=sample)
    done = dry_run_stages(
        db,
        store,
        batch_id=source,
        city_code=city_code,
        settings=settings,
        publisher=collector,
        city_countries=city_countries,
    )
    report.records = done.records
    report.dead_letters = done.dead_letters
    report.dead_letters_by_code = done.dead_letters_by_code
    report.diffs_by_type = done.diffs_by_type
    report.diffs_by_action = done.diffs_by_action
    report.changes = collector.changes
    return report


CITIES = "CITIES"
_CITY_LIST_KEY = "*"  # the city list belongs to no city; never a shard (shards have type CITY)


def record_city_list(
    db: SyncDatabase, store: PayloadStore, *, batch_id: str, supplier_id: int, raw: bytes
) -> None:
    """Keeps the supplier's city list of a batch (its exact bytes), for replays.

    A replay must not call the supplier, yet the country rule needs each city's country:
    the replay reads it from the list stored by the batch it replays.
    """
    stored = store.put(raw, kind="raw")
    key = f"{batch_id}\0{CITIES}\0{stored.sha256}"
    with db.begin() as conn:
        insert_ignore(
            conn,
            schema.snapshot,
            [
                {
                    "snapshot_id": "cl_" + hashlib.sha256(key.encode()).hexdigest()[:61],
                    "payload_ref": stored.ref,
                    "payload_hash": stored.sha256,
                }
            ],
            batch_id=batch_id,
            supplier_id=supplier_id,
            category_code="HOTEL",
            shard_key=_CITY_LIST_KEY,
            snapshot_type=CITIES,
            snapshot_version=1,
            created_at=db.clock.now(),
        )


def stored_city_countries(
    db: SyncDatabase, store: PayloadStore, *, task_code: str
) -> dict[str, str]:
    """City -> country from the latest city list a batch of the task stored ({} if none)."""
    return {
        str(c["city_code"]): str(c["country_code"])
        for c in _stored_cities(db, store, task_code)
        if c.get("country_code")
    }


def stored_city_codes(db: SyncDatabase, store: PayloadStore, *, task_code: str) -> list[str]:
    """The city codes of the latest city list a batch of the task stored ([] if none)."""
    return [str(c["city_code"]) for c in _stored_cities(db, store, task_code)]


def _stored_cities(db: SyncDatabase, store: PayloadStore, task_code: str) -> list[dict[str, Any]]:
    s, b = schema.snapshot.c, schema.batch.c
    with db.engine.connect() as conn:
        ref = conn.execute(
            sa.select(s.payload_ref)
            .join(schema.batch, b.batch_id == s.batch_id)
            .where(b.task_code == task_code, s.snapshot_type == CITIES)
            .order_by(s.id.desc())
            .limit(1)
        ).scalar()
    if ref is None:
        return []
    body = json.loads(store.get(ref))
    return [c for c in body.get("cities") or () if isinstance(c, dict) and c.get("city_code")]
