"""What the benchmark scripts of the user's paths share.

Throwaway sync and instance databases, the simulator's pre-warm, the published catalog
checked against the simulator's ground truth, a backfill launched through the webserver and
run by ``supplier-sync daemon``, and what a Dagster instance recorded of a run: its step
intervals and each city's stage seconds from its materialization metadata.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

import httpx
import sqlalchemy as sa

if TYPE_CHECKING:
    import dagster as dg

    from supplier_sync_dagster.dagster_instance.deployment import DagsterProcesses

API_KEY = "bench-key"
MYSQL_URL = "mysql+pymysql://root@127.0.0.1:3306"
STEP_END_EVENTS = ("STEP_SUCCESS", "STEP_FAILURE")


@contextmanager
def mariadb_databases(kinds: Sequence[str], mysql_url: str = MYSQL_URL) -> Iterator[list[str]]:
    """Creates one ``bench_<kind>_<random>`` database per kind; drops them on exit.

    Args:
        kinds: A short word per database (``sync``, ``dg``); none: nothing is created.
        mysql_url: The server's URL, without a database.

    Yields:
        The databases' names, in the order of ``kinds``.
    """
    names = [f"bench_{kind}_{uuid.uuid4().hex[:8]}" for kind in kinds]
    if not names:
        yield names
        return
    admin = sa.create_engine(mysql_url)
    made: list[str] = []
    try:
        with admin.begin() as conn:
            for name in names:
                conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
                made.append(name)
        yield names
    finally:
        with admin.begin() as conn:
            for name in made:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


def mariadb_url(name: str, mysql_url: str = MYSQL_URL) -> str:
    """The SQLAlchemy URL of database ``name`` on the server of ``mysql_url``."""
    return f"{mysql_url.rstrip('/')}/{name}?charset=utf8mb4"


@dataclass(frozen=True)
class World:
    """The simulator's cities as its city list gives them."""

    cities: list[str]
    sizes: dict[str, int]

    @property
    def hotels(self) -> int:
        """Hotels over every city."""
        return sum(self.sizes.values())

    def pages(self, page_size: int) -> int:
        """Pages a full walk requests: at least one per city (an empty city answers one)."""
        return sum(max(1, math.ceil(n / page_size)) for n in self.sizes.values())


def prewarm(url: str, page_size: int, *, rate: float | None = None) -> tuple[World, float]:
    """Walks every page of every city once: the simulator builds hotels on first use.

    Args:
        url: The simulator's base URL.
        page_size: The page size of the walk (the one measured afterwards).
        rate: The simulator's rate limit, if any: the walk paces itself to it.

    Returns:
        The world and the seconds the walk took.
    """
    from supplier_sync_dagster.core.supplier import CityWalk, InProcessTokenBucket, SupplierClient

    began = time.perf_counter()
    with httpx.Client(base_url=url, timeout=60) as http:
        client = SupplierClient(
            http,
            api_key=API_KEY,
            supplier_id="bench",
            rate_limiter=InProcessTokenBucket(rate, 1) if rate else None,
        )
        listed = client.list_cities().data.cities
        world = World(
            cities=[c.city_code for c in listed],
            sizes={c.city_code: int(c.hotel_count or 0) for c in listed},
        )
        for city in world.cities:
            for _ in CityWalk(client, city, page_size=page_size):
                pass
    return world, time.perf_counter() - began


def prewarm_changes(url: str, since: datetime) -> float:
    """Walks the change feed once from ``since``: the simulator builds each changed hotel's
    new version on first use, as :func:`prewarm` has it build the listed ones before a full
    sync is timed.

    Returns:
        The seconds the walk took.
    """
    from supplier_sync_dagster.core.supplier import SupplierClient

    began = time.perf_counter()
    with httpx.Client(base_url=url, timeout=60) as http:
        client = SupplierClient(http, api_key=API_KEY, supplier_id="bench")
        after: str | None = None
        while True:
            page = client.get_changes(since=since, after_id=after, limit=500).data
            if page.next is None or not page.changes:
                break
            since, after = page.next.since, page.next.after_id
    return time.perf_counter() - began


def published_catalog(db_url: str) -> dict[str, int]:
    """The published hotels of a sync database: supplier hotel id -> supplier version."""
    from supplier_sync_dagster.core.store import schema

    engine = sa.create_engine(db_url)
    try:
        h = schema.platform_hotel.c
        with engine.connect() as conn:
            rows = conn.execute(sa.select(h.supplier_hotel_id, h.supplier_version)).all()
    finally:
        engine.dispose()
    return {str(k): int(v) for k, v in rows}


def catalog_problems(published: dict[str, int], valid: dict[str, int]) -> list[str]:
    """How a first sync's published catalog differs from the ground truth (none: equal)."""
    if published == valid:
        return []
    missing = set(valid) - set(published)
    extra = set(published) - set(valid)
    stale = sum(1 for k, v in valid.items() if k in published and published[k] != v)
    return [
        f"published {len(published)} hotels != ground truth {len(valid)} "
        f"(missing {len(missing)}, extra {len(extra)}, other version {stale})"
    ]


def union_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass
class RunSteps:
    """What the instance recorded of some runs: step intervals and each run's last event."""

    steps: list[tuple[float, float]] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)

    @property
    def busy(self) -> float:
        """Seconds during which some step was executing."""
        return union_seconds(self.steps)


def run_steps(instance: dg.DagsterInstance, run_ids: Sequence[str]) -> RunSteps:
    """The step intervals (first STEP_START to last step end) and last event of each run."""
    found = RunSteps()
    for run_id in run_ids:
        records = instance.all_logs(run_id)
        kinds = [
            (r.timestamp, r.dagster_event and r.dagster_event.event_type_value) for r in records
        ]
        start = next((t for t, kind in kinds if kind == "STEP_START"), None)
        stop = next((t for t, kind in reversed(kinds) if kind in STEP_END_EVENTS), None)
        if start is not None and stop is not None:
            found.steps.append((start, stop))
        if records:
            found.ends.append(max(r.timestamp for r in records))
    return found


STAGE_METADATA = {
    "raw_hotel_snapshots": "fetch_seconds",
    "normalized_hotels": "normalize_seconds",
    "published_hotels": "publish_seconds",
}


@dataclass
class CityStages:
    """Each city's stage seconds on an instance, summed, and when each city was in flight.

    Attributes:
        seconds: ``fetch``, ``normalize``, ``publish`` (from each city's materialization
            metadata) and ``city`` (the wall time a run spent on the city), summed over the
            cities: with several cities in flight at once the sums exceed the wall time.
            ``cpu_fetch``, ``cpu_normalize``, ``cpu_publish``: the CPU seconds of each stage
            (``cpu_<stage>_seconds``, measured on the threads that did its work), summed.
        intervals: Per published city, (its published_hotels event's time - its seconds,
            that time): when the city was in flight.
        records: Per published city, its records (in the order of ``intervals``).
    """

    seconds: dict[str, float] = field(default_factory=dict)
    intervals: list[tuple[float, float]] = field(default_factory=list)
    records: list[int] = field(default_factory=list)

    def largest(self, n: int = 3) -> list[tuple[int, float, float]]:
        """The ``n`` largest published cities: (records, start, end), largest first."""
        rows = sorted(zip(self.records, self.intervals, strict=True), reverse=True)[:n]
        return [(r, a, b) for r, (a, b) in rows]

    @property
    def cities(self) -> int:
        """Published cities counted."""
        return len(self.intervals)


def _materializations(instance: dg.DagsterInstance, asset: str) -> Iterator[dg.EventLogRecord]:
    import dagster as dg

    cursor: str | None = None
    while True:
        page = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset)), limit=1000, cursor=cursor
        )
        yield from page.records
        if not page.has_more:
            return
        cursor = page.cursor


def _number(record: dg.EventLogRecord, name: str) -> float:
    mat = record.asset_materialization
    entry = mat.metadata.get(name) if mat is not None else None
    value = entry.value if entry is not None else None
    return float(value) if isinstance(value, int | float) else 0.0


def city_stages(instance: dg.DagsterInstance) -> CityStages:
    """Every city's stage seconds (wall and CPU) and in-flight interval from the instance's
    materializations."""
    found = CityStages(seconds=dict.fromkeys(["fetch", "normalize", "publish", "city"], 0.0))
    for asset, name in STAGE_METADATA.items():
        stage = name.removesuffix("_seconds")
        found.seconds[f"cpu_{stage}"] = 0.0
        for record in _materializations(instance, asset):
            mat = record.asset_materialization
            status = mat.metadata.get("city_status") if mat is not None else None
            if status is not None and status.value == "ALREADY_DONE":
                # Reported from the sync database: another run (which helped) synced it.
                continue
            found.seconds[stage] += _number(record, name)
            found.seconds[f"cpu_{stage}"] += _number(record, f"cpu_{name}")
            if asset == "published_hotels":
                seconds = _number(record, "seconds")
                found.seconds["city"] += seconds
                found.intervals.append((record.timestamp - seconds, record.timestamp))
                found.records.append(int(_number(record, "records")))
    return found


@dataclass
class BackfillResult:
    """A finished backfill of every city, as the instance recorded it (timestamps: epoch s)."""

    backfill_id: str
    status: str
    launched: float
    run_ids: list[str]
    ok_runs: int
    steps: RunSteps
    first_run: float
    shown: int
    own: int

    @property
    def wall(self) -> float:
        """Launch to the last event of the last run."""
        return max(self.steps.ends) - self.launched


def run_backfill(
    dagster: DagsterProcesses,
    instance: dg.DagsterInstance,
    keys: Sequence[str],
    *,
    timeout: float,
    title: str = "bench: every city",
) -> BackfillResult:
    """Launches a backfill of ``keys`` through GraphQL and waits until its runs finish.

    Raises:
        TimeoutError: The backfill did not finish within ``timeout`` seconds.
    """
    import dagster as dg

    from supplier_sync_dagster.defs.partitions import CITY_PARTITIONS

    instance.add_dynamic_partitions(CITY_PARTITIONS, list(keys))
    launched = time.time()
    backfill_id = dagster.launch_backfill(keys, title=title)
    status, runs = dagster.wait_for_backfill(instance, backfill_id, timeout=timeout, poll=2)
    by_backfill = dg.RunsFilter(tags={"dagster/backfill": backfill_id})
    records = instance.get_run_records(filters=by_backfill)
    # The UI's truth: every city is materialized on its own for every asset.
    view = dagster.partitions("published_hotels", keys)
    return BackfillResult(
        backfill_id=backfill_id,
        status=status,
        launched=launched,
        run_ids=[r.run_id for r in runs],
        ok_runs=sum(1 for r in runs if r.status == dg.DagsterRunStatus.SUCCESS),
        steps=run_steps(instance, [r.run_id for r in runs]),
        first_run=min(r.create_timestamp.timestamp() for r in records) - launched,
        shown=len(view.statuses["materialized"]),
        own=sum(1 for k in keys if view.latest.get(k, {}).get("city") is not None),
    )
