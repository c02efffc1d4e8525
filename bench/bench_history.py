"""What the publish history costs: bytes per published version, and per million hotels a month.

Run: ``.venv/bin/python bench/bench_history.py [--hotels 5000] [--cities 20] [--days 5]
[--backend sqlite|mariadb] [--retention-days 400]``. The in-process simulator (clean profile,
its default daily rates of price, content and status changes, new and removed hotels) is
synced in full once a simulated day, ``--days + 1`` times, into a throwaway database. Then:

- versions recorded, and the versions per hotel per day after the first sync (the changes);
- bytes per version: the history row with its share of the indexes, and its document
  (zlib-compressed canonical JSON, stored once per content), as the database stores them: on
  MariaDB InnoDB's data and index lengths after ``ANALYZE TABLE``; on SQLite the ``dbstat``
  pages of the two tables and their indexes; beside them the document's compressed and
  uncompressed bytes;
- derived: per million hotels, the first version of each (once), a month of changes, and the
  steady state kept under ``--retention-days`` (the current versions plus the changes of the
  window).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import API_KEY, MYSQL_URL, mariadb_databases, mariadb_url

from supplier_sync_dagster.core.leasing.leases import LeaseSettings
from supplier_sync_dagster.core.records.diff import default_risk_policy
from supplier_sync_dagster.core.settings import (
    DEFAULT_HISTORY_RETENTION_DAYS,
    DEFAULT_MAX_CLOCK_SKEW_SECONDS,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import open_payload_store
from supplier_sync_dagster.core.supplier import SupplierClient
from supplier_sync_dagster.core.sync import run
from supplier_sync_dagster.core.sync.model import build_sync_settings
from supplier_sync_dagster.simulator import FaultProfile, Simulator, SimulatorConfig

_TABLES = (schema.hotel_version.name, schema.published_document.name)
_MIB = 1 << 20


@contextmanager
def _scratch(backend: str) -> Iterator[tuple[str, Path]]:
    """A throwaway sync database URL and payload folder."""
    tmp = Path(tempfile.mkdtemp(prefix="bench_history_"))
    try:
        if backend == "sqlite":
            yield f"sqlite:///{tmp / 'sync.sqlite3'}", tmp / "payloads"
        else:
            with mariadb_databases(["history"], MYSQL_URL) as (name,):
                yield mariadb_url(name, MYSQL_URL), tmp / "payloads"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# What each backend says it stores for the two tables (and their indexes).
_SIZE_SQL = {
    "sqlite": "SELECT SUM(pgsize) FROM dbstat WHERE name IN (SELECT name FROM sqlite_master "
    "WHERE tbl_name IN (:a, :b))",
    "mysql": "SELECT SUM(data_length + index_length) FROM information_schema.tables "
    "WHERE table_schema = DATABASE() AND table_name IN (:a, :b)",
}


def _stored_bytes(db: SyncDatabase) -> int:
    """Bytes the database gives the two history tables and their indexes."""
    dialect = db.engine.dialect.name
    with db.engine.begin() as conn:
        if dialect != "sqlite":
            for table in _TABLES:  # InnoDB's lengths are estimates until analysed
                conn.execute(sa.text(f"ANALYZE TABLE `{table}`"))
        names = dict(zip("ab", _TABLES, strict=True))
        total = conn.execute(sa.text(_SIZE_SQL.get(dialect, _SIZE_SQL["mysql"])), names)
        return int(total.scalar_one() or 0)


def main() -> None:
    """Syncs ``--days + 1`` simulated days and prints the history's cost."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hotels", type=int, default=5000)
    parser.add_argument("--cities", type=int, default=20)
    parser.add_argument("--days", type=int, default=5)
    parser.add_argument("--backend", choices=["sqlite", "mariadb"], default="sqlite")
    parser.add_argument("--retention-days", type=int, default=DEFAULT_HISTORY_RETENTION_DAYS)
    args = parser.parse_args()
    world = {"n_cities": args.cities, "total_hotels": args.hotels}
    sim = Simulator(SimulatorConfig(api_key=API_KEY, faults=FaultProfile.clean(), **world))
    sync = build_sync_settings(
        task_code="bench_history",
        supplier_id=1001,
        page_size=100,
        lease=LeaseSettings(),
        risk_policy=default_risk_policy,
        max_clock_skew_seconds=DEFAULT_MAX_CLOCK_SKEW_SECONDS,
    )
    versions_by_day: list[int] = []
    with (
        _scratch(args.backend) as (url, payloads),
        httpx.Client(base_url="http://simulator.local", transport=sim.transport()) as http,
    ):
        db = SyncDatabase.open(url)
        try:
            client = SupplierClient(http, api_key=API_KEY, supplier_id="1001")
            store = open_payload_store(f"file://{payloads}")
            d = schema.published_document.c
            for day in range(args.days + 1):
                if day:
                    sim.advance_day()
                cities = [c.city_code for c in client.list_cities().data.cities]
                request = run.RunRequest(trigger_id=f"day-{day}", source="MANUAL", cities=cities)
                plan = run.plan_run(db, store, client, request, sync)
                outcomes = run.run_cities(db, store, client, plan, request, sync, worker_id="b")
                failed = [o for o in outcomes if o.status != "SUCCESS"]
                if failed:
                    raise SystemExit(f"day {day}: {len(failed)} cities failed")
                with db.engine.connect() as conn:
                    count = sa.select(sa.func.count()).select_from(schema.hotel_version)
                    versions_by_day.append(int(conn.execute(count).scalar_one()))
            with db.engine.connect() as conn:
                hotels = int(
                    conn.execute(
                        sa.select(sa.func.count()).select_from(schema.platform_hotel)
                    ).scalar_one()
                )
                documents, compressed = conn.execute(
                    sa.select(sa.func.count(), sa.func.sum(sa.func.length(d.document)))
                ).one()
                sample = conn.execute(sa.select(d.document).limit(500)).scalars().all()
            stored = _stored_bytes(db)
        finally:
            db.dispose()
    versions = versions_by_day[-1]
    first = versions_by_day[0]
    per_day = (versions - first) / args.days / hotels
    per_version = stored / versions
    plain = sum(len(zlib.decompress(b)) for b in sample) / len(sample)
    initial = 1e6 * per_version
    month = 1e6 * per_day * 30 * per_version
    steady = 1e6 * (1 + per_day * args.retention_days) * per_version
    print(
        f"{args.backend}: {hotels} hotels, {args.days + 1} syncs a simulated day apart: "
        f"{versions} versions ({first} on the first day), {documents} documents"
    )
    print(
        f"  changes: {per_day:.4f} versions per hotel per day; "
        f"stored: {stored / _MIB:.2f} MiB = {per_version:.0f} bytes per version (row, indexes "
        f"and document); a document {int(compressed) / documents:.0f} bytes compressed, "
        f"{plain:.0f} as JSON"
    )
    print(
        f"  per million hotels: first versions {initial / _MIB / 1024:.2f} GiB once; "
        f"{month / _MIB / 1024:.2f} GiB per month of changes; "
        f"{steady / _MIB / 1024:.2f} GiB kept at {args.retention_days} days of retention"
    )


if __name__ == "__main__":
    main()
