"""A run's OpenLineage events from the sync's facts: datasets by where they live (no
credentials), the catalog tables' schemas, and the gates' verdicts read from the sync
database (SQLite and MariaDB), each event valid against the spec's schema."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from openlineage.client.serde import Serde

from supplier_sync_dagster.core.lineage.events import (
    MAX_CITY_ASSERTIONS,
    BatchQuality,
    CityVerdict,
    Places,
    RunFacts,
    batch_quality,
    run_event,
)
from supplier_sync_dagster.core.records.gates import GATED_PREFIX, GateThresholds
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.core.conftest import MakeBatch
from supplier_sync_dagster_tests.openlineage_schema import validate_run_event

RUN_ID = str(uuid.uuid4())
CITY_ASSETS = frozenset({"raw_hotel_snapshots", "normalized_hotels", "published_hotels"})


def places(**changes: Any) -> Places:
    fields: dict[str, Any] = {
        "db_url": "mysql+pymysql://sync:s3cret-pw@db.internal:3306/sync",
        "payload_url": "s3://bucket/payloads",
        "supplier_url": "https://user:pw@api.acme.example/?key=abc",
        "supplier_id": 1001,
        "search_url": "postgresql://search:pw2@pg.internal:5432/search",
        "search_file": Path("/state/search.sqlite3"),
        "amqp_url": "amqp://guest:guest-pw@mq.internal:5672/vhost",
        "notifications_file": Path("/state/notifications.jsonl"),
        **changes,
    }
    return Places(**fields)


def as_json(event: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(Serde.to_json(event))
    validate_run_event(body)
    return body


def event(kind: Any, assets: frozenset[str], **kw: Any) -> dict[str, Any]:
    facts = RunFacts(RUN_ID, "city_sync", assets, "t-1", kw.pop("error", None))
    return as_json(
        run_event(
            kind,
            facts,
            kw.pop("where", places()),
            namespace="supplier_sync",
            event_time=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
            **kw,
        )
    )


def test_the_city_sync_reads_the_listings_and_writes_raw_catalog_and_outbox_without_credentials():
    body = event("START", CITY_ASSETS)
    assert body["eventType"] == "START" and body["run"]["runId"] == RUN_ID
    assert body["job"] == {**body["job"], "namespace": "supplier_sync", "name": "city_sync"}
    assert [(d["namespace"], d["name"]) for d in body["inputs"]] == [
        ("https://api.acme.example", "v1/cities/{city_code}/hotels")
    ]
    assert [(d["namespace"], d["name"]) for d in body["outputs"]] == [
        ("s3://bucket", "payloads/raw"),
        ("mysql://db.internal:3306", "sync.platform_hotel_resource"),
        ("mysql://db.internal:3306", "sync.platform_hotel_offer"),
        ("mysql://db.internal:3306", "sync.supplier_sync_hotel_mapping"),
        ("mysql://db.internal:3306", "sync.supplier_sync_outbox"),
    ]
    text = json.dumps(body)
    for secret in ("s3cret-pw", "pw2", "guest-pw", "abc", "user:pw"):
        assert secret not in text


def test_catalog_tables_carry_their_columns_as_the_schema_facet():
    body = event("COMPLETE", CITY_ASSETS)
    by_name = {d["name"]: d for d in body["outputs"]}
    for table in (schema.platform_hotel, schema.platform_offer, schema.hotel_mapping):
        fields = by_name[f"sync.{table.name}"]["facets"]["schema"]["fields"]
        assert [f["name"] for f in fields] == [c.name for c in table.columns]
        assert all(f["type"] for f in fields)
    assert "schema" not in by_name["sync.supplier_sync_outbox"]["facets"]


def test_the_outbox_dispatch_reads_the_outbox_and_writes_search_and_the_exchange():
    body = event("COMPLETE", frozenset({"hotel_search_projection"}))
    assert [(d["namespace"], d["name"]) for d in body["outputs"]] == [
        ("postgres://pg.internal:5432", "search.public.hotel_search"),
        ("amqp://mq.internal:5672", "exchange/supplier_sync.events"),
    ]
    embedded = event(
        "COMPLETE",
        frozenset({"hotel_search_projection"}),
        where=places(
            search_url=None,
            amqp_url=None,
            db_url="sqlite:////state/sync.sqlite3",
            supplier_url=None,
        ),
    )
    assert [(d["namespace"], d["name"]) for d in embedded["outputs"]] == [
        ("sqlite:/state/search.sqlite3", "hotel_search"),
        ("file", "/state/notifications.jsonl"),
    ]
    assert ("sqlite:/state/sync.sqlite3", "supplier_sync_outbox") in [
        (d["namespace"], d["name"]) for d in embedded["inputs"]
    ]


def test_a_job_without_datasets_still_has_its_run_and_a_failure_its_message():
    body = event("FAIL", frozenset({"sync_health"}), error="boom: the database went away")
    assert body["inputs"] == [] and body["outputs"] == []
    assert body["run"]["facets"]["errorMessage"]["message"] == "boom: the database went away"


def gated_quality(cities: int) -> BatchQuality:
    return BatchQuality(
        batch_id="b1",
        task_code="t",
        status="FAILED",
        cities=cities,
        records=1000,
        bad_records=400,
        gated=tuple(
            CityVerdict(f"C{i}", (("bad_record_ratio", "40.0% > 20.0%"),)) for i in range(cities)
        ),
        thresholds=GateThresholds(),
    )


def test_a_flood_of_gated_cities_is_counted_whole_and_listed_up_to_the_cap():
    body = event("FAIL", CITY_ASSETS, quality=gated_quality(MAX_CITY_ASSERTIONS + 50))
    assertions = body["inputs"][0]["inputFacets"]["dataQualityAssertions"]["assertions"]
    overall = {a["assertion"]: a for a in assertions if a["name"].count(".") == 1}
    assert overall["bad_record_ratio"]["success"] is False
    assert overall["bad_record_ratio"]["actual"].endswith(
        f"{MAX_CITY_ASSERTIONS + 50} of {MAX_CITY_ASSERTIONS + 50} cities failed"
    )
    assert overall["schema_drift"]["success"] and overall["record_count"]["success"]
    assert len([a for a in assertions if a["name"].endswith(".city")]) == MAX_CITY_ASSERTIONS


def test_batch_quality_reads_the_gated_cities_and_the_profiles(
    db: SyncDatabase, make_batch: MakeBatch
):
    batch = make_batch(("BKK", "SIN", "JKT"))
    with db.begin() as conn:
        conn.execute(
            sa.update(schema.batch)
            .where(schema.batch.c.batch_id == batch.batch_id)
            .values(total_count=310, failed_count=52)
        )
        conn.execute(
            sa.update(schema.shard)
            .where(schema.shard.c.batch_id == batch.batch_id, schema.shard.c.shard_key == "BKK")
            .values(
                status="FAILED",
                error_message=GATED_PREFIX + "bad_record_ratio: 50.0% of 100 records > 20.0%",
            )
        )
    assert batch.trigger_id is not None
    quality = batch_quality(db, batch.trigger_id)
    assert quality is not None
    assert (quality.batch_id, quality.cities, quality.records, quality.bad_records) == (
        batch.batch_id,
        3,
        310,
        52,
    )
    assert quality.gated == (
        CityVerdict("BKK", (("bad_record_ratio", "50.0% of 100 records > 20.0%"),)),
    )
    assert batch_quality(db, "no-such-trigger") is None
    body = event("FAIL", CITY_ASSETS, quality=quality)
    facets = body["inputs"][0]["inputFacets"]
    assert facets["dataQualityMetrics"]["rowCount"] == 310
    failed = [a for a in facets["dataQualityAssertions"]["assertions"] if not a["success"]]
    assert {(a["assertion"], a["params"].get("city")) for a in failed} == {
        ("bad_record_ratio", None),
        ("bad_record_ratio", "BKK"),
    }
