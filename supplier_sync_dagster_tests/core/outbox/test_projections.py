"""The read models on their real components: the search index in PostgreSQL, the hotel cache
in Redis, subscribers on RabbitMQ; and the dispatcher driving all three from MariaDB."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from collections import Counter
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from supplier_sync_dagster.core.errors import ProjectionUnavailable
from supplier_sync_dagster.core.outbox.dispatch import Dispatcher
from supplier_sync_dagster.core.outbox.machine import outbox_status
from supplier_sync_dagster.core.outbox.projections import (
    CITY_KEY,
    HOTEL_KEY,
    Notification,
    PostgresSearchIndex,
    ProjectionSettings,
    RabbitMqNotifier,
    RedisHotelCache,
    SearchDoc,
    SearchIndex,
    SearchQuery,
    SqliteSearchIndex,
    open_projections,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.core.records.test_catalog import hotel, sync
from supplier_sync_dagster_tests.helpers import BoundQueue


def doc(rid: int, version: int = 1, **changes: object) -> SearchDoc:
    base = dict(
        resource_id=rid,
        publish_version=version,
        supplier_id=1001,
        supplier_hotel_id=f"H{rid}",
        name=f"Hotel {rid}",
        name_local=None,
        address="1 Road",
        postal_code="10500",
        city_code="TYO",
        country_code="JP",
        star_rating=4.0,
        status="ACTIVE",
        lowest_price=Decimal("120.00"),
        currency="JPY",
        lat=35.69,
        lng=139.70,
        published_at=datetime(2026, 12, 1, 10, 0, 0),
    )
    base.update(changes)
    return SearchDoc(**base)  # type: ignore[arg-type]


@pytest.fixture(params=["postgresql", "sqlite"])
def index(request: pytest.FixtureRequest, tmp_path: Path):
    made: SearchIndex
    if request.param == "postgresql":
        made = PostgresSearchIndex(request.getfixturevalue("fresh_postgres_db"))
    else:
        made = SqliteSearchIndex(tmp_path / "search.sqlite3")
    yield made
    made.close()


def test_search_finds_words_in_every_locale_and_filters(index):
    index.upsert(
        [
            doc(
                1,
                name="Shinjuku Granbell Ryokan",
                name_local="新宿グランベルホテル",
                star_rating=4.5,
            ),
            doc(2, name="Shibuya Stream Hotel", name_local="渋谷ストリームホテル", star_rating=3.0),
            doc(3, name="Shinjuku Budget Inn", lowest_price=Decimal("40.00"), star_rating=2.0),
            doc(4, name="Osaka Ryokan", city_code="OSA"),
            doc(5, name="Shinjuku Ryokan Closed", status="INACTIVE"),
        ]
    )
    ids = lambda q: [h.resource_id for h in index.search(q)]  # noqa: E731
    assert ids(SearchQuery(text="shinjuku ryokan", city_code="TYO")) == [1]
    assert ids(SearchQuery(text="ryokan")) == [1, 4]  # the INACTIVE one is left out
    assert ids(SearchQuery(text="ryokan", status=None)) == [1, 4, 5]
    assert ids(SearchQuery(text="新宿")) == [1]  # a two-character word of a local name
    assert ids(SearchQuery(text="ストリーム")) == [2]
    assert ids(SearchQuery(text="shinjuku", min_stars=4)) == [1]
    assert ids(SearchQuery(text="shinjuku", max_price=Decimal("50"))) == [3]
    assert ids(SearchQuery(city_code="OSA")) == [4]
    assert ids(SearchQuery(text="100% '; DROP TABLE hotel_search;--")) == []
    assert ids(SearchQuery(text="nothing-like-this")) == []
    assert index.versions("OSA") == {4: 1}


def test_a_document_never_goes_back_to_an_older_version(index):
    index.upsert([doc(7, 3, name="Newest")])
    index.upsert([doc(7, 2, name="Older")])
    index.upsert([doc(7, 3, name="Newest")])  # the same version again: harmless
    (hit,) = index.search(SearchQuery(text="newest"))
    assert (hit.publish_version, hit.name) == (3, "Newest")
    index.upsert([doc(7, 4, name="Renamed")])
    assert [h.name for h in index.search(SearchQuery(city_code="TYO"))] == ["Renamed"]
    assert index.versions() == {7: 4}


def test_every_field_reaches_the_postgres_index_as_written(fresh_postgres_db: str):
    import psycopg

    from supplier_sync_dagster.core.outbox.projections import _DOC_COLUMNS, SEARCH_TABLE

    written = [
        doc(
            1,
            name='Quote \' "double" back\\slash; -- 100%',
            name_local="新宿 \u00e9\t\n",
            address=None,
            postal_code=None,
            star_rating=None,
            lowest_price=Decimal("12345678.90"),
            published_at=datetime(2026, 12, 1, 10, 0, 0, 123456),
        ),
        doc(2, lowest_price=None, currency=None, star_rating=3.5, lat=-33.8688, lng=151.2093),
    ]
    index = PostgresSearchIndex(fresh_postgres_db)
    try:
        index.upsert(written)
    finally:
        index.close()
    with psycopg.connect(fresh_postgres_db) as conn:
        got = conn.execute(
            f"SELECT {', '.join(_DOC_COLUMNS)} FROM {SEARCH_TABLE} ORDER BY resource_id"  # noqa: S608
        ).fetchall()
    as_read = [
        tuple(
            float(v) if c == "star_rating" and v is not None else v
            for c, v in zip(_DOC_COLUMNS, r, strict=True)
        )
        for r in got
    ]
    assert as_read == [tuple(getattr(d, c) for c in _DOC_COLUMNS) for d in written]


def test_the_search_document_takes_the_lowest_active_available_offer(db: SyncDatabase):
    from supplier_sync_dagster.core.outbox.projections import load_search_docs

    def priced(hid: str, version: int, *plans: tuple[str, bool, str]) -> dict[str, object]:
        made = hotel(hid, version)
        room = made["rooms"][0]
        made["rooms"] = [
            {
                **room,
                "room_code": f"R{i}",
                "rate_plans": [
                    {**room["rate_plans"][0], "code": code, "available": available, "price": price}
                ],
            }
            for i, (code, available, price) in enumerate(plans)
        ]
        return made

    sync(
        db,
        "b1",
        [
            priced(
                "H1", 1, ("BAR", True, "120.50"), ("NRF", True, "99.00"), ("SALE", False, "10.00")
            ),
            priced("H2", 1, ("BAR", False, "80.00")),
        ],
    )
    # Version 2 drops the cheap offer: its old row stays, inactive, and no longer counts.
    sync(db, "b2", [priced("H1", 2, ("BAR", True, "130.00"), ("BB", True, "101.25"))])
    m = schema.hotel_mapping.c
    with db.engine.connect() as conn:
        ids = [
            int(i) for i in conn.execute(sa.select(m.id).order_by(m.supplier_hotel_id)).scalars()
        ]
        docs = load_search_docs(conn, [*ids, 999_999])
    found = [docs[i] for i in sorted(docs)]
    assert [
        (d.supplier_hotel_id, d.publish_version, d.lowest_price, d.currency) for d in found
    ] == [
        ("H1", 2, Decimal("101.25"), "THB"),
        ("H2", 1, None, None),
    ]


def test_an_unreachable_search_index_is_a_projection_error():
    index = PostgresSearchIndex("postgresql://postgres@127.0.0.1:1/nope", connect_timeout=2)
    with pytest.raises(ProjectionUnavailable, match="search index .* unavailable"):
        index.upsert([doc(1)])


def test_the_redis_cache_sets_expires_and_invalidates(redis_url: str):
    cache = RedisHotelCache(redis_url)
    key = f"test:{uuid.uuid4().hex}"
    try:
        cache.set(key, b"value", 60)
        assert cache.get(key) == b"value"
        cache.invalidate([key, f"{key}:missing"])
        assert cache.get(key) is None
        cache.set(key, b"short", 0.05)
        redis.Redis.from_url(redis_url).pexpire(key, 1)
        import time

        time.sleep(0.05)
        assert cache.get(key) is None
    finally:
        cache.close()
    down = RedisHotelCache("redis://127.0.0.1:1/0", socket_timeout=0.5)
    with pytest.raises(ProjectionUnavailable, match="hotel cache .* unavailable"):
        down.invalidate(["x"])


def test_rabbitmq_gets_persistent_messages_keyed_by_event_type_with_the_event_id(
    amqp_url: str,
):
    exchange = f"test.events.{uuid.uuid4().hex[:8]}"
    notes = [
        Notification(
            event_id=f"e{i}",
            event_type="HotelResourceUpdated" if i % 2 else "HotelMappingCreated",
            aggregate_id=i,
            aggregate_version=1,
            batch_id="b1",
            payload=f'{{"resource_id": {i}}}',
        )
        for i in range(50)
    ]
    with BoundQueue(amqp_url, exchange) as queue:
        notifier = RabbitMqNotifier(amqp_url, exchange=exchange)
        try:
            notifier.publish(notes)
        finally:
            notifier.close()
        got = queue.drain()
    assert sorted(m.message_id or "" for m in got) == sorted(n.event_id for n in notes)
    by_id = {m.message_id: m for m in got}
    for n in notes:
        m = by_id[n.event_id]
        assert m.routing_key == n.event_type == m.type
        assert m.persistent
        assert m.headers["aggregate_id"] == n.aggregate_id
        assert m.body == {"resource_id": n.aggregate_id}


@pytest.mark.parametrize(
    ("aggregate_id", "version", "batch_id", "event_id"),
    [
        (1, 1, "b1", "e-1"),
        (300, 40_000, "b_é", "ü" * 10),
        (2**40, 2**33, "", "x"),
        (-5, 70_000, "b" * 300, str(uuid.uuid4())),
    ],
)
def test_a_content_header_frame_is_the_one_pamqp_makes(
    aggregate_id: int, version: int, batch_id: str, event_id: str
):
    from datetime import UTC

    from pamqp import commands, encode, frame, header

    from supplier_sync_dagster.core.outbox.projections import content_header_frame

    at = datetime(2026, 12, 4, 0, 30, 15, tzinfo=UTC)
    note = Notification(
        event_id=event_id,
        event_type="HotelResourceUpdated",
        aggregate_id=aggregate_id,
        aggregate_version=version,
        batch_id=batch_id,
        payload='{"a": 1}',
    )
    props = commands.Basic.Properties(
        content_type="application/json",
        delivery_mode=2,
        message_id=event_id,
        message_type="HotelResourceUpdated",
        timestamp=at,
        headers={"aggregate_id": aggregate_id, "aggregate_version": version, "batch_id": batch_id},
    )
    expected = frame.marshal(header.ContentHeader(0, 8, props), 1)
    assert content_header_frame(note, 8, encode.timestamp(at)) == expected
    decoded = frame.unmarshal(expected)[2]
    assert isinstance(decoded, header.ContentHeader) and decoded.properties.headers is not None
    assert decoded.properties.headers["batch_id"] == batch_id


def test_an_unreachable_broker_is_a_projection_error():
    notifier = RabbitMqNotifier("amqp://guest:guest@127.0.0.1:1/", timeout=2)
    try:
        with pytest.raises(ProjectionUnavailable, match="did not confirm 1"):
            notifier.publish(
                [Notification("e1", "HotelResourceUpdated", 1, 1, "b1", '{"resource_id": 1}')]
            )
    finally:
        notifier.close()


def test_the_dispatcher_drives_postgresql_redis_and_rabbitmq_from_mariadb(
    fresh_mysql_db: str,
    fresh_postgres_db: str,
    redis_url: str,
    amqp_url: str,
    tmp_path: Path,
):
    db = SyncDatabase.open(fresh_mysql_db)
    exchange = f"test.events.{uuid.uuid4().hex[:8]}"
    settings = ProjectionSettings(
        state_dir=tmp_path,
        search_url=fresh_postgres_db,
        cache_url=redis_url,
        amqp_url=amqp_url,
        exchange=exchange,
    )
    projections = open_projections(settings)
    client = redis.Redis.from_url(redis_url)
    try:
        sync(db, "b1", [hotel(f"H{i}", name=f"Shinjuku Ryokan {i}") for i in range(40)])
        client.set(HOTEL_KEY.format(resource_id=1), b"stale")
        client.set(CITY_KEY.format(supplier_id=1001, city_code="BKK"), b"stale list")
        with BoundQueue(amqp_url, exchange) as queue:
            report = Dispatcher(db, projections, batch_size=16).drain()
            got = queue.drain()
        assert report.stages["NOTIFY"].advanced == 120
        status = outbox_status(db)
        assert status.total("SUCCEEDED") == 120 and status.total("READY") == 0
        assert Counter(m.message_id for m in got) == Counter(
            {e: 1 for e in {m.message_id for m in got}}
        )
        assert len(got) == 120
        assert client.get(HOTEL_KEY.format(resource_id=1)) is None
        assert client.get(CITY_KEY.format(supplier_id=1001, city_code="BKK")) is None
        hits = projections.search.search(SearchQuery(text="shinjuku ryokan", limit=100))
        assert len(hits) == 40
    finally:
        client.close()
        projections.close()
        db.dispose()


def test_dispatchers_starting_together_create_the_postgres_schema_once(fresh_postgres_db: str):
    """Each dispatcher opens its own index: on a new database they all create the schema
    at once, and none may fail on the catalog's unique keys (seen with 2 processes)."""
    indexes = [PostgresSearchIndex(fresh_postgres_db) for _ in range(6)]
    start = threading.Barrier(len(indexes))
    errors: list[BaseException] = []

    def first_use(index: PostgresSearchIndex) -> None:
        start.wait()
        try:
            index.versions()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=first_use, args=(i,)) for i in indexes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for index in indexes:
        index.close()
    assert errors == []


def test_the_embedded_projections_import_no_driver_of_a_real_component() -> None:
    """Commands that import the projections (dispatch, outbox, search, serve-api, the Dagster
    definitions) start without PostgreSQL's or Redis's driver: only their targets import it."""
    code = (
        "import pathlib, sys, tempfile\n"
        "import supplier_sync_dagster.core.outbox.projections as p\n"
        "state = pathlib.Path(tempfile.mkdtemp())\n"
        "t = p.open_projections(p.ProjectionSettings(state_dir=state))\n"
        "t.close()\n"
        "print(sorted({'psycopg', 'redis'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
