"""Batch-level quality gates: whether a city of a batch may publish at all (invariant 5).

Row-level problems end as dead letters; these gates look at a city of a batch as a whole,
after normalization and before anything is published, and compare it with the city's
previous successful batch of the same task:

- ``bad_record_ratio``: the share of the city's records that normalization dead-lettered.
- ``record_count``: the number of records against the previous successful batch: a drop
  beyond a threshold fails, and so does zero records when there were some ("success with 0
  rows" is a failure), whatever the other thresholds say.
- ``schema_drift``: top-level fields of the raw records that appeared or disappeared: a
  field that most previous records had and almost no current record has (``geo`` renamed
  to ``location`` overnight), or the reverse. Counting the records that carry each field
  tells a rare optional field from one that is gone.

Normalization records a :class:`CityProfile` per (batch, city): record and dead-letter
counts and :class:`FieldCounts` built by :func:`profile_records` on every page.
:func:`evaluate_gates` turns two profiles and the task's :class:`GateThresholds` into one
:class:`GateResult` per check, each with metadata saying what was measured and against
what. An operator who has looked can let a failed check pass with :func:`override_gate`,
which is recorded (who, when, why); the check then counts as passed, marked overridden.

Plain Python over SQLAlchemy Core; the Dagster asset checks and a city's sync (its gate,
``core.sync.gate``) call these functions.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from typing import Any, Literal, get_args

import sqlalchemy as sa
from sqlalchemy.dialects.mysql import insert as mysql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import (
    ConfigError,
    CountsDoNotAddUp,
    InvalidGateOverride,
    ProfileMissing,
    UnknownBatch,
    UnknownShard,
)
from supplier_sync_dagster.core.leasing.batches import get_task
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import (
    Identity,
    record_actions,
    refuse_control_characters,
)
from supplier_sync_dagster.core.store.db import DbClock, SyncDatabase, insert_ignore
from supplier_sync_dagster.core.store.engine import db_now

log = logging.getLogger(__name__)

CheckName = Literal["bad_record_ratio", "record_count", "schema_drift", "change_volume"]
# The checks of a city of a full sync; ``change_volume`` judges an incremental window.
CHECK_NAMES: tuple[CheckName, ...] = get_args(CheckName)[:3]
Severity = Literal["ERROR", "WARN"]

# A profile stores at most this many distinct fields (the most frequent ones) and names of
# at most this length: a broken feed with random keys must not grow the row without bound.
MAX_PROFILE_FIELDS = 1000
MAX_FIELD_NAME = 200
# Field names listed in a description (metadata lists them all).
_NAMES_IN_DESCRIPTION = 10


@dataclass
class FieldCounts:
    """How many raw records carried each top-level field.

    Attributes:
        records: Records profiled (raw records that are JSON objects).
        fields: Field name -> number of those records that have the field.
    """

    records: int = 0
    fields: dict[str, int] = field(default_factory=dict)

    def add(self, records: Iterable[Any]) -> FieldCounts:
        """Counts the top-level keys of ``records`` (dicts; anything else is not profiled).

        Returns:
            This object, for chaining.
        """
        # Records of one supplier share a handful of key sets: counting the key tuples in C
        # and expanding each distinct tuple once is cheaper than counting every key.
        shapes = Counter([tuple(r) for r in records if isinstance(r, dict)])
        counts = self.fields
        for shape, n in shapes.items():
            self.records += n
            for name in shape:
                key = name if isinstance(name, str) else str(name)
                counts[key] = counts.get(key, 0) + n
        return self

    def merge(self, other: FieldCounts) -> FieldCounts:
        """Adds another page's counts to these; returns this object."""
        self.records += other.records
        counts = self.fields
        for name, n in other.fields.items():
            counts[name] = counts.get(name, 0) + n
        return self

    def ratio(self, name: str) -> float:
        """The share of profiled records that have the field (0.0 when none was profiled)."""
        return self.fields.get(name, 0) / self.records if self.records else 0.0

    def to_json(self) -> dict[str, Any]:
        """The stored form: ``{"records": n, "fields": {...}}``, capped in size."""
        items = sorted(self.fields.items(), key=lambda kv: (-kv[1], kv[0]))
        kept: dict[str, int] = {}
        for name, n in items[:MAX_PROFILE_FIELDS]:
            short = name[:MAX_FIELD_NAME]
            kept[short] = max(kept.get(short, 0), n)
        out: dict[str, Any] = {"records": self.records, "fields": kept}
        if len(items) > MAX_PROFILE_FIELDS:
            out["omitted_fields"] = len(items) - MAX_PROFILE_FIELDS
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FieldCounts:
        """Reads the stored form back."""
        return cls(
            records=int(data.get("records", 0)),
            fields={str(k): int(v) for k, v in (data.get("fields") or {}).items()},
        )


def profile_records(records: Iterable[Any]) -> FieldCounts:
    """Counts the top-level field names of raw supplier records (one page, typically).

    Cheap enough to run on every page of a sync (``bench/bench_gates.py``).
    Pages are combined with :meth:`FieldCounts.merge`.

    Args:
        records: Decoded raw records; those that are not JSON objects are not profiled.

    Returns:
        The number of profiled records and, per field, how many of them have it.
    """
    return FieldCounts().add(records)


@dataclass(frozen=True)
class GateThresholds:
    """A task's quality gate thresholds (stored per task, see :func:`set_gate_thresholds`).

    Attributes:
        max_bad_ratio: ``bad_record_ratio`` fails when dead letters / records exceed this.
        max_count_drop: ``record_count`` fails when the count fell by more than this share of
            the previous successful batch's count (0.5: more than half of it is gone).
        min_previous_records: The drop rule applies only when the previous batch had at
            least this many records (small cities swing). Zero records after some fails anyway.
        drift_present_ratio: A field counts as "present" in a batch when at least this share
            of its records have it.
        drift_absent_ratio: ...and as "absent" when fewer than this share have it.
            ``schema_drift`` fails for a field present before and absent now (disappeared),
            or absent before and present now (appeared).
        max_volume_factor: An incremental window whose change rate (changes per hour of
            feed) is more than this many times the time-weighted median rate of its task's
            latest windows (``change_volume``) is held for review.
        min_volume_records: ...if it has at least this many records (quiet hours swing).
        quiet_windows: This many successful incremental windows in a row without a change
            raise the ``no_changes`` alert.
    """

    max_bad_ratio: float = 0.2
    max_count_drop: float = 0.5
    min_previous_records: int = 10
    drift_present_ratio: float = 0.9
    drift_absent_ratio: float = 0.1
    max_volume_factor: float = 5.0
    min_volume_records: int = 100
    quiet_windows: int = 12

    def __post_init__(self) -> None:
        for name in (
            "max_bad_ratio",
            "max_count_drop",
            "drift_present_ratio",
            "drift_absent_ratio",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0.0 <= value <= 1.0
            ):
                raise ConfigError(
                    f"gate threshold {name} must be a number in [0, 1]; got {value!r}"
                )
            object.__setattr__(self, name, float(value))
        factor = self.max_volume_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor >= 1.0:
            raise ConfigError(f"gate threshold max_volume_factor must be >= 1; got {factor!r}")
        object.__setattr__(self, "max_volume_factor", float(factor))
        for name, least in (
            ("min_previous_records", 0),
            ("min_volume_records", 0),
            ("quiet_windows", 1),
        ):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < least:
                raise ConfigError(f"gate threshold {name} must be an integer >= {least}; got {n!r}")
        if self.drift_absent_ratio >= self.drift_present_ratio:
            raise ConfigError(
                "gate threshold drift_absent_ratio must be below drift_present_ratio; got "
                f"{self.drift_absent_ratio} and {self.drift_present_ratio}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The thresholds as a plain mapping (the stored JSON)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GateThresholds:
        """Builds thresholds from a mapping; missing keys take the defaults.

        Raises:
            ConfigError: An unknown key or a value out of range.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown gate threshold(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**data)


@dataclass(frozen=True)
class CityProfile:
    """What normalization saw of one city in one batch."""

    batch_id: str
    task_code: str
    shard_key: str
    record_count: int
    bad_count: int
    field_counts: FieldCounts | None
    """None: the fields were not profiled (schema drift cannot be measured)."""
    updated_at: datetime | None = None


@dataclass(frozen=True)
class GateOverride:
    """An operator's decision to let a failed check of a city of a batch pass."""

    batch_id: str
    shard_key: str
    check_name: str
    overridden_by: str
    reason: str
    created_at: datetime


@dataclass(frozen=True)
class GateCheck:
    """One check of one city of a batch: what an operator's override names."""

    batch_id: str
    shard_key: str
    check_name: str


@dataclass(frozen=True)
class GateResult:
    """The outcome of one check for one city of one batch.

    Attributes:
        check_name: ``bad_record_ratio``, ``record_count`` or ``schema_drift``.
        passed: True when the check passed, or failed and was overridden.
        severity: How a failure counts (ERROR: blocking).
        description: One line for people: the measurement, the baseline and the verdict.
        metadata: What was measured and against what (plain JSON-able values).
        overridden: The check failed and an override lets it pass.
        override: The override of this check, if one exists (also when not needed).
    """

    check_name: CheckName
    passed: bool
    severity: Severity
    description: str
    metadata: dict[str, Any]
    overridden: bool = False
    override: GateOverride | None = None


def _upsert(
    conn: Connection,
    clock: DbClock,
    table: sa.Table,
    values: Mapping[str, Any],
    keys: Sequence[str],
) -> None:
    """Inserts a row stamped ``created_at`` and ``updated_at`` with the database's time, or
    rewrites every column but the key columns and ``created_at``."""
    params = {f"new_{name}": value for name, value in values.items()}
    params["now_us"] = round(clock.offset_seconds * 1_000_000)
    conn.execute(
        _upsert_statement(conn.dialect.name, table.name, tuple(values), tuple(keys)), params
    )


@functools.cache
def _upsert_statement(
    dialect: str, table_name: str, columns: tuple[str, ...], keys: tuple[str, ...]
) -> Any:
    """:func:`_upsert`'s statement, every value a parameter (``:new_<column>``, and the
    clock's offset ``:now_us``): built once, as every city's profile runs it."""
    table = schema.metadata.tables[table_name]
    now = db_now(sa.bindparam("now_us", type_=sa.BigInteger()))
    row: dict[str, Any] = {
        name: sa.bindparam(f"new_{name}", type_=table.c[name].type) for name in columns
    }
    row |= {"created_at": now, "updated_at": now}
    update = [c for c in row if c not in keys and c != "created_at"]
    if dialect == "sqlite":
        ins = sqlite_insert(table).values(row)
        return ins.on_conflict_do_update(
            index_elements=list(keys), set_={c: ins.excluded[c] for c in update}
        )
    mins = mysql_insert(table).values(row)
    return mins.on_duplicate_key_update({c: mins.inserted[c] for c in update})


def record_city_profile(
    conn: Connection,
    clock: DbClock,
    *,
    batch_id: str,
    task_code: str,
    shard_key: str,
    record_count: int,
    bad_count: int,
    field_counts: FieldCounts | None,
) -> None:
    """Records (or rewrites) the profile of a city of a batch; a re-run writes the same row.

    Call it in the transaction that finishes normalization of the city, with counts over
    all of the city's pages (also pages normalized by an earlier attempt).

    Args:
        conn: Connection in the caller's write transaction.
        clock: The database clock.
        batch_id: The batch.
        task_code: The batch's task.
        shard_key: The city code, verbatim.
        record_count: Records in the city's raw pages.
        bad_count: Of which normalization dead-lettered.
        field_counts: Top-level fields of the raw records; None when not profiled.

    Raises:
        CountsDoNotAddUp: A count is negative, or more records are bad than exist (a bug).
    """
    if record_count < 0 or bad_count < 0 or bad_count > record_count:
        raise CountsDoNotAddUp(
            f"city profile of {shard_key!r}: {bad_count} bad of {record_count} records"
        )
    _upsert(
        conn,
        clock,
        schema.city_profile,
        {
            "batch_id": batch_id,
            "shard_key": shard_key,
            "task_code": task_code,
            "record_count": record_count,
            "bad_count": bad_count,
            "field_counts": field_counts.to_json() if field_counts is not None else None,
        },
        ("batch_id", "shard_key"),
    )


def _profile(row: sa.Row[*tuple[Any, ...]]) -> CityProfile:
    fc = row.field_counts
    return CityProfile(
        batch_id=row.batch_id,
        task_code=row.task_code,
        shard_key=row.shard_key,
        record_count=int(row.record_count),
        bad_count=int(row.bad_count),
        field_counts=FieldCounts.from_json(fc) if fc is not None else None,
        updated_at=row.updated_at,
    )


_PROFILE_COLUMNS = (
    schema.city_profile.c.batch_id,
    schema.city_profile.c.task_code,
    schema.city_profile.c.shard_key,
    schema.city_profile.c.record_count,
    schema.city_profile.c.bad_count,
    schema.city_profile.c.field_counts,
    schema.city_profile.c.updated_at,
)


def get_city_profile(conn: Connection, *, batch_id: str, shard_key: str) -> CityProfile | None:
    """The recorded profile of a city of a batch, or None when there is none yet."""
    p = schema.city_profile.c
    row = conn.execute(
        sa.select(*_PROFILE_COLUMNS).where(p.batch_id == batch_id, p.shard_key == shard_key)
    ).first()
    return _profile(row) if row is not None else None


def previous_profile(
    conn: Connection, *, task_code: str, shard_key: str, before_batch_id: str
) -> CityProfile | None:
    """The baseline: the profile of the city in the latest earlier batch of the task whose
    shard for the city finished SUCCESS.

    Batches are ordered by creation (their row id). Failed, gated, cancelled or unfinished
    shards are never a baseline, nor are batches of other tasks or batches without a profile.

    Raises:
        UnknownBatch: ``before_batch_id`` does not exist.
    """
    b, p = schema.batch.c, schema.city_profile.c
    current_id = conn.execute(sa.select(b.id).where(b.batch_id == before_batch_id)).scalar()
    if current_id is None:
        raise UnknownBatch(f"unknown batch {before_batch_id!r}")
    row = conn.execute(
        _finished_earlier(sa.select(*_PROFILE_COLUMNS), task_code, current_id)
        .where(p.shard_key == shard_key)
        .order_by(b.id.desc())
        .limit(1)
    ).first()
    return _profile(row) if row is not None else None


def _finished_earlier(query: sa.Select[Any], task_code: str, current_id: int) -> sa.Select[Any]:
    """``query`` over the task's city profiles in batches before ``current_id`` whose shard
    for the city finished SUCCESS: the candidates for a city's baseline."""
    b, s, p = schema.batch.c, schema.shard.c, schema.city_profile.c
    return query.select_from(
        schema.city_profile.join(schema.batch, b.batch_id == p.batch_id).join(
            schema.shard, sa.and_(s.batch_id == p.batch_id, s.shard_key == p.shard_key)
        )
    ).where(
        p.task_code == task_code,
        b.task_code == task_code,
        b.id < current_id,
        s.status == "SUCCESS",
    )


@dataclass(frozen=True)
class BatchBaselines:
    """What every city of a batch is gated against, read once per batch in a process.

    Attributes:
        task_code: The batch's task.
        previous: City -> its profile in the latest earlier batch of the task whose shard
            for the city finished SUCCESS (:func:`previous_profile`, for every city at once).
    """

    task_code: str
    previous: Mapping[str, CityProfile]


_BASELINES_KEPT = 8
_baselines: dict[str, BatchBaselines] = {}
_baselines_lock = threading.Lock()


def batch_baselines(db: SyncDatabase, batch_id: str) -> BatchBaselines:
    """The batch's task and every city's baseline; read on first use, then kept in this
    process (for the few latest batches; batch ids are never reused).

    A batch's baselines are earlier batches' finished shards, and its cities are gated
    within minutes of each other: they are read once per batch, not once per city.

    Raises:
        UnknownBatch: The batch does not exist.
    """
    found = _baselines.get(batch_id)
    if found is not None:
        return found
    b, p = schema.batch.c, schema.city_profile.c
    with db.engine.connect() as conn:
        row = conn.execute(sa.select(b.id, b.task_code).where(b.batch_id == batch_id)).first()
        if row is None:
            raise UnknownBatch(f"unknown batch {batch_id!r}")
        current_id, task_code = int(row.id), str(row.task_code)
        latest = (
            _finished_earlier(
                sa.select(p.shard_key, sa.func.max(b.id).label("batch_row")), task_code, current_id
            )
            .group_by(p.shard_key)
            .subquery()
        )
        earlier = schema.batch.alias("earlier")
        rows = conn.execute(
            sa.select(*_PROFILE_COLUMNS).select_from(
                latest.join(earlier, earlier.c.id == latest.c.batch_row).join(
                    schema.city_profile,
                    sa.and_(p.batch_id == earlier.c.batch_id, p.shard_key == latest.c.shard_key),
                )
            )
        ).all()
    made = BatchBaselines(task_code, {r.shard_key: _profile(r) for r in rows})
    with _baselines_lock:
        while len(_baselines) >= _BASELINES_KEPT:
            del _baselines[next(iter(_baselines))]
        _baselines[batch_id] = made
    return made


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _ratio(x: float) -> float:
    return round(x, 6)


_NO_EARLIER_BATCH = (
    "no earlier successful batch of this task for this city (first batch: no baseline)"
)


def _no_baseline(
    check_name: CheckName, description: str, meta: dict[str, Any], severity: Severity = "ERROR"
) -> GateResult:
    """A check that passes: there is nothing yet to measure against."""
    return GateResult(check_name, True, severity, description, {**meta, "baseline": "none"})


def check_bad_record_ratio(current: CityProfile, thresholds: GateThresholds) -> GateResult:
    """``bad_record_ratio``: dead letters / records against ``max_bad_ratio``."""
    records, bad = current.record_count, current.bad_count
    ratio = bad / records if records else 0.0
    passed = ratio <= thresholds.max_bad_ratio
    verdict = "within" if passed else "above"
    return GateResult(
        "bad_record_ratio",
        passed,
        "ERROR",
        f"{bad} of {records} records dead-lettered ({_pct(ratio)}), {verdict} the limit of "
        f"{_pct(thresholds.max_bad_ratio)}",
        {
            "records": records,
            "bad": bad,
            "ratio": _ratio(ratio),
            "max_bad_ratio": thresholds.max_bad_ratio,
        },
    )


def check_record_count(
    current: CityProfile, previous: CityProfile | None, thresholds: GateThresholds
) -> GateResult:
    """``record_count``: records against the previous successful batch of the city."""
    cur = current.record_count
    meta: dict[str, Any] = {
        "current_records": cur,
        "max_count_drop": thresholds.max_count_drop,
        "min_previous_records": thresholds.min_previous_records,
    }
    if previous is None:
        return _no_baseline("record_count", f"{cur} records; {_NO_EARLIER_BATCH}", meta)
    prev = previous.record_count
    drop = (prev - cur) / prev if prev else 0.0
    meta.update(previous_batch_id=previous.batch_id, previous_records=prev, drop=_ratio(drop))
    against = f"the {prev} of batch {previous.batch_id}"
    if prev > 0 and cur == 0:
        meta["rule"] = "zero_after_nonzero"
        return GateResult(
            "record_count", False, "ERROR", f"0 records where there were {against}", meta
        )
    if prev < thresholds.min_previous_records:
        meta["rule"] = "baseline_too_small"
        return GateResult(
            "record_count",
            True,
            "ERROR",
            f"{cur} records against {against}: fewer than "
            f"{thresholds.min_previous_records} before, the drop rule does not apply",
            meta,
        )
    meta["rule"] = "drop"
    passed = drop <= thresholds.max_count_drop
    change = f"{_pct(drop)} fewer" if drop >= 0 else f"{_pct(-drop)} more"
    verdict = "within" if passed else "beyond"
    return GateResult(
        "record_count",
        passed,
        "ERROR",
        f"{cur} records, {change} than {against}; {verdict} the limit of a "
        f"{_pct(thresholds.max_count_drop)} drop",
        meta,
    )


@dataclass(frozen=True)
class WindowVolume:
    """An incremental window's volume: its changes and the stretch of the feed they came from.

    Attributes:
        records: Changes the window read.
        seconds: Feed time the window covered: from where it began reading (its watermark
            minus the overlap) to the newest change it read; a window that found nothing
            newer than its watermark covered its overlap only.
    """

    records: int
    seconds: float

    @property
    def hours(self) -> float:
        """The covered feed time in hours (at least :data:`MIN_WINDOW_SECONDS`)."""
        return max(self.seconds, MIN_WINDOW_SECONDS) / 3600.0

    @property
    def rate(self) -> float:
        """Changes per hour of feed."""
        return self.records / self.hours


MIN_WINDOW_SECONDS = 1.0
"""A window is at least this long: its changes share its watermark's second at worst."""
MIN_BASELINE_WINDOWS = 3
"""Earlier windows a ``change_volume`` baseline needs..."""
MIN_BASELINE_SECONDS = 3600.0
"""...and the feed time they must cover together: a few short polls are no baseline."""
MIN_BASELINE_RATE = 1.0
"""Changes per hour the baseline counts as at least (a silent feed's limit is not zero)."""


def weighted_median(pairs: Sequence[tuple[float, float]]) -> float:
    """The median of ``(value, weight)`` pairs: the value at half of the total weight (the
    mean of the two values around an exact half). Zero weights count for nothing.

    Raises:
        ValueError: No pair has a positive weight.
    """
    ordered = sorted((v, w) for v, w in pairs if w > 0)
    total = sum(w for _, w in ordered)
    if not ordered:
        raise ValueError("a weighted median needs a positive weight")
    seen = 0.0
    for i, (value, weight) in enumerate(ordered):
        seen += weight
        if math.isclose(seen, total / 2) and i + 1 < len(ordered):
            return (value + ordered[i + 1][0]) / 2
        if seen > total / 2:
            return value
    return ordered[-1][0]


def check_change_volume(
    window: WindowVolume, history: Sequence[WindowVolume], thresholds: GateThresholds
) -> GateResult:
    """``change_volume``: an incremental window's change **rate** (changes per hour of the
    feed it covered) against the time-weighted median rate of its task's latest windows.

    A supplier that suddenly reports a large share of its catalog as changed is more often
    broken (a re-import, a bulk edit gone wrong) than busy: such a window is held for review
    rather than published. WARN severity: the window is processed, its diffs wait for a
    person (``supplier-sync review``).

    Windows differ in length (a poll minutes after the last one, a day's window, a backlog
    after an outage), so their counts are not comparable; their rates are. Each earlier
    window weighs as much as the feed time it covered: two quiet polls of a few minutes do
    not drag down the baseline that a day's window set. (Per time of day would need weeks of
    history in each hour's bucket, and a poll's window need not fit in one bucket.) The
    baseline needs :data:`MIN_BASELINE_WINDOWS` windows covering
    :data:`MIN_BASELINE_SECONDS` together; a window under ``min_volume_records`` passes (quiet
    hours swing).

    Args:
        window: The window judged.
        history: The task's latest successful windows (newest first).
        thresholds: The task's thresholds.
    """
    covered = sum(w.seconds for w in history)
    meta: dict[str, Any] = {
        "records": window.records,
        "window_hours": round(window.hours, 4),
        "rate_per_hour": round(window.rate, 3),
        "max_volume_factor": thresholds.max_volume_factor,
        "min_volume_records": thresholds.min_volume_records,
        "windows_in_baseline": len(history),
        "baseline_hours": round(covered / 3600.0, 4),
    }
    if len(history) < MIN_BASELINE_WINDOWS or covered < MIN_BASELINE_SECONDS:
        return _no_baseline(
            "change_volume",
            f"{window.records} changes; the earlier windows ({len(history)}, "
            f"{covered / 3600.0:.2f} h of feed) are fewer than {MIN_BASELINE_WINDOWS} or "
            f"cover less than {MIN_BASELINE_SECONDS / 3600.0:g} h (no baseline yet)",
            meta,
            "WARN",
        )
    median = weighted_median([(w.rate, w.hours) for w in history])
    limit = max(median, MIN_BASELINE_RATE) * thresholds.max_volume_factor
    meta.update(trailing_median_rate=round(median, 3), limit_rate=round(limit, 3))
    said = (
        f"{window.records} changes in {window.hours:.2f} h of feed ({window.rate:.1f}/h) "
        f"against a time-weighted median of {median:.1f}/h over {len(history)} windows "
        f"({covered / 3600.0:.1f} h)"
    )
    if window.records < thresholds.min_volume_records:
        return GateResult(
            "change_volume",
            True,
            "WARN",
            f"{said}: under {thresholds.min_volume_records} changes, the volume rule does not "
            "apply",
            meta,
        )
    passed = window.rate <= limit
    verdict = "within" if passed else "beyond"
    return GateResult(
        "change_volume",
        passed,
        "WARN",
        f"{said}: {verdict} {thresholds.max_volume_factor:g}x",
        meta,
    )


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_NAMES_IN_DESCRIPTION])
    more = len(names) - _NAMES_IN_DESCRIPTION
    return shown + (f" and {more} more" if more > 0 else "")


def check_schema_drift(
    current: CityProfile, previous: CityProfile | None, thresholds: GateThresholds
) -> GateResult:
    """``schema_drift``: top-level fields that appeared or disappeared since the baseline."""
    meta: dict[str, Any] = {
        "drift_present_ratio": thresholds.drift_present_ratio,
        "drift_absent_ratio": thresholds.drift_absent_ratio,
    }
    if previous is None:
        return _no_baseline("schema_drift", _NO_EARLIER_BATCH, meta)
    meta["previous_batch_id"] = previous.batch_id
    cur, prev = current.field_counts, previous.field_counts
    if cur is None or prev is None or cur.records == 0 or prev.records == 0:
        which = "this batch" if cur is None or cur.records == 0 else f"batch {previous.batch_id}"
        meta["baseline"] = "not measurable"
        return GateResult(
            "schema_drift",
            True,
            "ERROR",
            f"not measured: no profiled records in {which}",
            meta,
        )
    present, absent = thresholds.drift_present_ratio, thresholds.drift_absent_ratio
    appeared: list[str] = []
    disappeared: list[str] = []
    ratios: dict[str, dict[str, float]] = {}
    for name in sorted(set(cur.fields) | set(prev.fields)):
        p, c = prev.ratio(name), cur.ratio(name)
        if p >= present and c < absent:
            disappeared.append(name)
        elif c >= present and p < absent:
            appeared.append(name)
        else:
            continue
        ratios[name] = {"previous": _ratio(p), "current": _ratio(c)}
    meta.update(
        previous_records=prev.records,
        current_records=cur.records,
        fields_appeared=appeared,
        fields_disappeared=disappeared,
        field_ratios=ratios,
    )
    if not appeared and not disappeared:
        return GateResult(
            "schema_drift",
            True,
            "ERROR",
            f"same top-level fields as batch {previous.batch_id} "
            f"({len(cur.fields)} now, {len(prev.fields)} before)",
            meta,
        )
    parts = []
    if disappeared:
        parts.append(f"fields disappeared: {_names(disappeared)}")
    if appeared:
        parts.append(f"fields appeared: {_names(appeared)}")
    return GateResult(
        "schema_drift",
        False,
        "ERROR",
        "; ".join(parts) + f" (vs batch {previous.batch_id}; present means in >= "
        f"{_pct(present)} of records, absent in < {_pct(absent)})",
        meta,
    )


def apply_override(result: GateResult, override: GateOverride | None) -> GateResult:
    """``result``, passed and marked overridden when it failed and ``override`` exists."""
    if override is None:
        return result
    meta = {
        **result.metadata,
        "overridden_by": override.overridden_by,
        "override_reason": override.reason,
        "overridden_at": override.created_at.isoformat(),
    }
    if result.passed:
        return GateResult(
            result.check_name, True, result.severity, result.description, meta, False, override
        )
    return GateResult(
        result.check_name,
        True,
        result.severity,
        f"{result.description} [failed; overridden by {override.overridden_by} at "
        f"{override.created_at.isoformat(sep=' ', timespec='seconds')}: {override.reason}]",
        meta,
        True,
        override,
    )


def evaluate_gates(
    conn: Connection,
    *,
    batch_id: str,
    task_code: str,
    shard_key: str,
    thresholds: GateThresholds,
    current: CityProfile | None = None,
) -> list[GateResult]:
    """Runs every check for a city of a batch against its previous successful batch.

    Args:
        conn: A connection (reads only).
        batch_id: The batch being gated.
        task_code: Its task (baselines come from the same task only).
        shard_key: The city code, verbatim.
        thresholds: The task's thresholds (:func:`get_gate_thresholds`).
        current: The profile to judge; None reads the recorded one.

    Returns:
        One result per check, in the order of :data:`CHECK_NAMES`. A failed check that has
        an override is returned passed, with ``overridden`` set.

    Raises:
        ProfileMissing: ``current`` is None and no profile was recorded for the city.
        UnknownBatch: The batch does not exist.
    """
    if current is None:
        current = get_city_profile(conn, batch_id=batch_id, shard_key=shard_key)
        if current is None:
            raise ProfileMissing(
                f"no city profile for {shard_key!r} in batch {batch_id}: "
                "normalization has not recorded one"
            )
    previous = previous_profile(
        conn, task_code=task_code, shard_key=shard_key, before_batch_id=batch_id
    )
    overrides = list_overrides(conn, batch_id=batch_id, shard_key=shard_key)
    return judge_profile(current, previous, thresholds, overrides)


def judge_profile(
    current: CityProfile,
    previous: CityProfile | None,
    thresholds: GateThresholds,
    overrides: Iterable[GateOverride],
) -> list[GateResult]:
    """Every check of a full sync's city: ``current`` against ``previous`` (None: no
    baseline), a failed check with an override returned passed (:func:`apply_override`)."""
    by_check = {o.check_name: o for o in overrides}
    results = [
        check_bad_record_ratio(current, thresholds),
        check_record_count(current, previous, thresholds),
        check_schema_drift(current, previous, thresholds),
    ]
    return [apply_override(r, by_check.get(r.check_name)) for r in results]


def check_first_pages(
    db: SyncDatabase,
    *,
    batch_id: str,
    task_code: str,
    shard_key: str,
    pages: Sequence[FieldCounts],
    overrides: bool | None = None,
) -> GateResult | None:
    """Schema drift judged on a city's first pages, before anything is normalized.

    A renamed field changes every record, so the first pages show it; the full check after
    normalization still judges every record.

    Args:
        db: The sync database.
        batch_id: The batch being synced.
        task_code: The task (its previous batch of the city is the reference).
        shard_key: The city.
        pages: The fields of the records of the city's first pages, one count per page.
        overrides: Whether the city had quality gate overrides in the batch when it was
            claimed (None: not known, they are read).

    Returns:
        The failed ``schema_drift`` result that stops the city, or None (no drift, no
        baseline, nothing to judge, or the check is overridden).
    """
    # The baseline first: read once per batch, and most cities of a first sync have none.
    previous = batch_baselines(db, batch_id).previous.get(shard_key)
    if previous is None or previous.field_counts is None:
        return None
    sample = FieldCounts()
    for counted in pages:
        sample.merge(counted)
    if sample.records == 0:
        return None
    with db.engine.connect() as conn:
        if overrides is not False and any(
            o.check_name == "schema_drift"
            for o in list_overrides(conn, batch_id=batch_id, shard_key=shard_key)
        ):
            return None
        thresholds = get_gate_thresholds(conn, task_code)
    current = CityProfile(batch_id, task_code, shard_key, sample.records, 0, sample)
    result = check_schema_drift(current, previous, thresholds)
    if result.passed:
        return None
    return GateResult(
        "schema_drift",
        False,
        result.severity,
        f"{result.description} (first {len(pages)} pages)",
        {**result.metadata, "stopped": "first pages"},
    )


def _check_text(name: str, value: Any, max_len: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidGateOverride(f"a gate override needs a non-empty {name}; got {value!r}")
    value = value.strip()
    if len(value) > max_len:
        raise InvalidGateOverride(
            f"a gate override's {name} has at most {max_len} characters; got {len(value)}"
        )
    try:
        refuse_control_characters(f"a gate override's {name}", value)
    except ConfigError as err:
        raise InvalidGateOverride(str(err)) from None
    return value


def override_gate(
    conn: Connection,
    clock: DbClock,
    *,
    batch_id: str,
    shard_key: str,
    check_name: str,
    who: str,
    reason: str,
    identity: Identity | None = None,
) -> GateOverride:
    """Lets a check of a city of a batch pass, recording who did it, when and why.

    Idempotent: the first override of a (batch, city, check) is kept; calling again returns
    it unchanged. Re-running the city then publishes if no other check fails.

    Args:
        conn: Connection in the caller's write transaction.
        clock: The database clock (the override's time).
        batch_id: The batch.
        shard_key: The city code, verbatim.
        check_name: One of :data:`CHECK_NAMES`.
        who: The operator (at most 64 characters).
        reason: Why the city may publish (at most 1024 characters).
        identity: Who, as the acting process proves it; None: this process's.

    Returns:
        The override as stored.

    Raises:
        InvalidGateOverride: Unknown check name, or an empty or over-long who or reason.
        UnknownShard: The batch has no shard for this city.
    """
    if check_name not in CHECK_NAMES:
        raise InvalidGateOverride(
            f"unknown quality gate check {check_name!r}; known: {', '.join(CHECK_NAMES)}"
        )
    who = _check_text("who", who, 64)
    reason = _check_text("reason", reason, 1024)
    s = schema.shard.c
    found = conn.execute(
        sa.select(s.id).where(s.batch_id == batch_id, s.shard_key == shard_key)
    ).first()
    if found is None:
        raise UnknownShard(f"batch {batch_id!r} has no shard {shard_key!r}")
    insert_ignore(
        conn,
        schema.gate_override,
        [
            {
                "batch_id": batch_id,
                "shard_key": shard_key,
                "check_name": check_name,
                "overridden_by": who,
                "reason": reason,
            }
        ],
        created_at=clock.now(),
    )
    (override,) = (
        o
        for o in list_overrides(conn, batch_id=batch_id, shard_key=shard_key)
        if o.check_name == check_name
    )
    if (override.overridden_by, override.reason) == (who, reason):
        # The first override of this check (a repeat keeps it, and records nothing).
        record_actions(
            conn,
            clock,
            action="gate.override",
            target_type="gate_check",
            changes=[
                (
                    f"{batch_id}/{shard_key}/{check_name}",
                    {"overridden": False},
                    {"overridden": True, "at": override.created_at},
                )
            ],
            actor=who,
            reason=reason,
            identity=identity,
        )
    log.warning(
        "quality gate %s of city %r in batch %s overridden by %s: %s",
        check_name,
        shard_key,
        batch_id,
        override.overridden_by,
        override.reason,
    )
    return override


def override_gate_check(
    db: SyncDatabase,
    check: GateCheck,
    *,
    who: str,
    reason: str,
    identity: Identity | None = None,
) -> GateOverride:
    """An operator's override (:func:`override_gate`) in a transaction of its own, as the
    ``gate override`` command and the ``gate_override`` job make it.

    Raises:
        InvalidGateOverride: Unknown check name, or an empty or over-long who or reason.
        UnknownShard: The batch has no shard for this city.
    """
    with db.begin() as conn:
        return override_gate(
            conn, db.clock, **asdict(check), who=who, reason=reason, identity=identity
        )


def list_overrides(
    conn: Connection, *, batch_id: str, shard_key: str | None = None
) -> list[GateOverride]:
    """The overrides of a batch (of one city when ``shard_key`` is given), by city and check."""
    o = schema.gate_override.c
    stmt = sa.select(
        o.batch_id, o.shard_key, o.check_name, o.overridden_by, o.reason, o.created_at
    ).where(o.batch_id == batch_id)
    if shard_key is not None:
        stmt = stmt.where(o.shard_key == shard_key)
    rows = conn.execute(stmt.order_by(o.shard_key, o.check_name)).all()
    return [GateOverride(**row._mapping) for row in rows]


def set_gate_thresholds(
    conn: Connection,
    clock: DbClock,
    *,
    task_code: str,
    thresholds: GateThresholds,
    updated_by: str | None = None,
) -> None:
    """Stores a task's gate thresholds, replacing earlier ones.

    Raises:
        UnknownTask: No task has this code.
    """
    get_task(conn, task_code)
    _upsert(
        conn,
        clock,
        schema.gate_threshold,
        {
            "task_code": task_code,
            "thresholds": thresholds.to_dict(),
            "updated_by": updated_by[:64] if updated_by else None,
        },
        ("task_code",),
    )


def get_gate_thresholds(conn: Connection, task_code: str) -> GateThresholds:
    """A task's gate thresholds: the stored ones, with defaults for what is not stored.

    Raises:
        ConfigError: The stored thresholds are malformed or out of range.
    """
    g = schema.gate_threshold.c
    stored = conn.execute(sa.select(g.thresholds).where(g.task_code == task_code)).scalar()
    if stored is None:
        return GateThresholds()
    if not isinstance(stored, Mapping):
        raise ConfigError(f"gate thresholds of task {task_code!r} are not a JSON object")
    try:
        return GateThresholds.from_dict(stored)
    except ConfigError as err:
        raise ConfigError(f"gate thresholds of task {task_code!r}: {err}") from None


# A gated city's shard is FAILED (a re-run after an override continues it) with this
# prefix on its error message, which tells it from a city that failed (the CLI summary).
GATED_PREFIX = "quality gate: "


def failure_reason(results: Iterable[GateResult]) -> str | None:
    """One line naming every failed check and why, or None when all passed.

    The one place that turns results into text: a city report's error, and after
    :data:`GATED_PREFIX` the gated shard's error message (:func:`gated_checks` reads it).
    """
    failed = [f"{r.check_name}: {r.description}" for r in results if not r.passed]
    return " | ".join(failed) if failed else None


def gated_checks(message: str | None) -> list[tuple[str, str]] | None:
    """The failed checks a shard's error message names, as (check name, description).

    A shard's error message is all that another process (the CLI, a summary) has of the
    gate that stopped a city before it had a profile; this reads what
    :func:`failure_reason` wrote. Returns None when the message is not a gate's.
    """
    if message is None or not message.startswith(GATED_PREFIX):
        return None
    parts = (part.partition(":") for part in message[len(GATED_PREFIX) :].split(" | "))
    return [(name.strip(), why.strip()) for name, _, why in parts]


def gate_check_names(reason: str) -> list[str]:
    """The checks a gate's reason names: ``"check: why | check: why"`` -> ``[check, ...]``."""
    return [name for name, _ in gated_checks(GATED_PREFIX + reason) or ()]
