"""PostgreSQL, Redis and RabbitMQ stopped mid-drain (for the dispatcher: a proxy in front of
each is taken down): events wait and retry, the other stages and the sync keep going, and
everything catches up when the service is back. MariaDB is the sync database."""

from __future__ import annotations

import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from supplier_sync_dagster.core.outbox.dispatch import Dispatcher
from supplier_sync_dagster.core.outbox.machine import STAGE_POLICIES, outbox_status
from supplier_sync_dagster.core.outbox.projections import ProjectionSettings, open_projections
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.core.records.test_catalog import hotel, sync
from supplier_sync_dagster_tests.helpers import BoundQueue, TcpProxy


def _via(url: str, proxy: TcpProxy) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{proxy.port}")
    return parts._replace(netloc=netloc).geturl()


@pytest.mark.parametrize("down", ["SEARCH_INDEX", "CACHE", "NOTIFY"])
def test_a_stage_whose_service_is_down_waits_and_catches_up(
    down: str,
    fresh_mysql_db: str,
    fresh_postgres_db: str,
    redis_url: str,
    amqp_url: str,
    tmp_path: Path,
):
    services = {"SEARCH_INDEX": fresh_postgres_db, "CACHE": redis_url, "NOTIFY": amqp_url}
    target = urlsplit(services[down])
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 0).start()
    urls = {**services, down: _via(services[down], proxy)}
    exchange = f"test.outage.{uuid.uuid4().hex[:8]}"
    db = SyncDatabase.open(fresh_mysql_db)
    projections = open_projections(
        ProjectionSettings(
            state_dir=tmp_path,
            search_url=urls["SEARCH_INDEX"],
            cache_url=urls["CACHE"],
            amqp_url=urls["NOTIFY"],
            exchange=exchange,
        )
    )
    try:
        with BoundQueue(amqp_url, exchange) as queue:
            sync(db, "b1", [hotel(f"O{i}") for i in range(30)])
            d = Dispatcher(db, projections, batch_size=10)
            d.round()  # some events through every stage, the service still up
            proxy.stop()
            d.drain()
            # The sync goes on publishing while the service is down.
            sync(db, "b2", [hotel(f"O{i}", 2, facilities=["wifi"]) for i in range(0, 30, 3)])
            d.drain()
            status = outbox_status(db)
            stuck_at = {stage for (s, stage), n in status.counts.items() if s == "READY" and n}
            assert down in stuck_at
            if down != "NOTIFY":
                # The other event types were notified: they did not wait for the broken stage.
                assert status.counts.get(("READY", "NOTIFY"), 0) == 0
            assert status.total("FAILED") == 0
            proxy.start()
            db.clock.advance(
                max(p.cap_seconds for p in STAGE_POLICIES.values()) * 2
            )  # past every backoff
            d.drain()
            final = outbox_status(db)
            assert final.total("READY") == 0 and final.total("PROCESSING") == 0
            received = queue.drain()
        with db.engine.connect() as conn:
            ids = {r[0] for r in conn.exec_driver_sql("SELECT event_id FROM supplier_sync_outbox")}
            catalog = {
                int(r): int(v)
                for r, v in conn.exec_driver_sql(
                    "SELECT resource_id, publish_version FROM platform_hotel_resource"
                )
            }
        assert {m.message_id for m in received} == ids
        assert projections.search.versions() == catalog
        events = outbox_status(db)
        assert events.total("SUCCEEDED") == len(ids)
    finally:
        proxy.stop()
        projections.close()
        db.dispose()
