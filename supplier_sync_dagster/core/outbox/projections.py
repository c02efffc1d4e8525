"""The read models the outbox drives: the hotel search index, the hotel cache, subscribers.

The catalog (the sync database) is authoritative; each of these is a projection of it that
can be checked against it and repaired, never the other way round. Each target has a real
component and an embedded default with the same behaviour:

- **search index** (the SEARCH_INDEX stage): one document per hotel at its latest publish
  version, full-text over its names and address, filters on city, country, stars, status and
  lowest price. :class:`PostgresSearchIndex` (a ``tsvector`` GIN index for words and a
  ``pg_trgm`` index for substrings, which serve names without spaces, as Japanese or Chinese
  ones are); :class:`SqliteSearchIndex`, FTS5 with the trigram tokenizer, in its own file.
  Both upsert guarded by the publish version: a document never goes back to an older one.
- **hotel cache** (the CACHE stage): the hotel's detail key and its city's list key are
  invalidated. :class:`RedisHotelCache`; :class:`InProcessHotelCache`.
- **subscribers** (the NOTIFY stage): :class:`RabbitMqNotifier` publishes each event to a
  topic exchange (persistent messages, publisher confirms, routing key = event type,
  message id = event id, so consumers deduplicate); :class:`JsonLinesNotifier` appends
  them to a file.

A target that cannot be reached raises :class:`ProjectionUnavailable`: the dispatcher
retries the whole batch later, and the sync goes on publishing meanwhile.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import sqlite3
import struct
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urlsplit

import orjson
import sqlalchemy as sa
from pamqp import body, commands, encode, frame
from pamqp.constants import FRAME_END, FRAME_HEADER
from pamqp.exceptions import UnmarshalingException
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import ConfigError, ProjectionUnavailable
from supplier_sync_dagster.core.redaction import redact
from supplier_sync_dagster.core.store import schema

if TYPE_CHECKING:
    from supplier_sync_dagster.core.settings import Settings
    from supplier_sync_dagster.core.store.db import SyncDatabase

# SQL text below is built from this module's own constant names (tables, columns) only;
# every value is a bound parameter.
SEARCH_TABLE = "hotel_search"
HOTEL_KEY = "supplier_sync:hotel:{resource_id}"
CITY_KEY = "supplier_sync:city:{supplier_id}:{city_code}"
DEFAULT_EXCHANGE = "supplier_sync.events"


@dataclass(frozen=True)
class SearchDoc:
    """A hotel as the search index holds it (from the catalog)."""

    resource_id: int
    publish_version: int
    supplier_id: int
    supplier_hotel_id: str
    name: str
    name_local: str | None
    address: str | None
    postal_code: str | None
    city_code: str
    country_code: str
    star_rating: float | None
    status: str
    lowest_price: Decimal | None
    currency: str | None
    lat: float
    lng: float
    published_at: datetime

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (prices as strings, times in ISO 8601)."""
        out = asdict(self)
        out["lowest_price"] = None if self.lowest_price is None else str(self.lowest_price)
        out["published_at"] = self.published_at.isoformat()
        return out


def load_search_docs(conn: Connection, resource_ids: Sequence[int]) -> dict[int, SearchDoc]:
    """The catalog's current document of each hotel (missing ones are left out), with its
    lowest available active offer: two reads per call, whatever its size."""
    h, o = schema.platform_hotel.c, schema.platform_offer.c
    ids = sorted(set(resource_ids))
    if not ids:
        return {}
    # The lowest offer is picked by the database: a hotel has several rooms times rate
    # plans, and only one row each crosses the wire.
    rank = (
        sa.func.row_number()
        .over(partition_by=o.resource_id, order_by=(o.price_amount, o.currency))
        .label("rank")
    )
    offers = (
        sa.select(o.resource_id, o.price_amount, o.currency, rank)
        .where(o.resource_id.in_(ids), o.active.is_(True), o.available.is_(True))
        .subquery()
    )
    lowest = {
        int(rid): (Decimal(price), str(currency))
        for rid, price, currency in conn.execute(
            sa.select(offers.c.resource_id, offers.c.price_amount, offers.c.currency).where(
                offers.c.rank == 1
            )
        )
    }
    out = {}
    for r in conn.execute(
        sa.select(
            h.resource_id,
            h.publish_version,
            h.supplier_id,
            h.supplier_hotel_id,
            h.name,
            h.name_local,
            h.address_line1,
            h.postal_code,
            h.city_code,
            h.country_code,
            h.star_rating,
            h.status,
            h.lat,
            h.lng,
            h.published_at,
        ).where(h.resource_id.in_(ids))
    ):
        rid = int(r.resource_id)
        price = lowest.get(rid)
        out[rid] = SearchDoc(
            resource_id=rid,
            publish_version=int(r.publish_version),
            supplier_id=int(r.supplier_id),
            supplier_hotel_id=str(r.supplier_hotel_id),
            name=str(r.name),
            name_local=r.name_local,
            address=r.address_line1,
            postal_code=r.postal_code,
            city_code=str(r.city_code),
            country_code=str(r.country_code),
            star_rating=None if r.star_rating is None else float(r.star_rating),
            status=str(r.status),
            lowest_price=None if price is None else price[0].quantize(Decimal("0.01")),
            currency=None if price is None else price[1],
            lat=float(r.lat),
            lng=float(r.lng),
            published_at=r.published_at,
        )
    return out


@dataclass(frozen=True)
class SearchQuery:
    """A search: words (every one must match a name or the address) and filters."""

    text: str = ""
    city_code: str | None = None
    country_code: str | None = None
    min_stars: float | None = None
    status: str | None = "ACTIVE"
    max_price: Decimal | None = None
    limit: int = 20

    def words(self) -> list[str]:
        """The query's words (at most 8, each at most 64 characters)."""
        return [w[:64] for w in re.split(r"\s+", self.text.strip()) if w][:8]


@dataclass(frozen=True)
class SearchHit:
    """A hotel found, with the fields a list shows."""

    resource_id: int
    publish_version: int
    name: str
    name_local: str | None
    city_code: str
    country_code: str
    star_rating: float | None
    status: str
    lowest_price: Decimal | None
    currency: str | None


class SearchIndex(Protocol):
    """The SEARCH_INDEX stage's target."""

    def upsert(self, docs: Sequence[SearchDoc]) -> None:
        """Writes each document unless the index holds a newer publish version of it."""

    def search(self, query: SearchQuery) -> list[SearchHit]:
        """Hotels matching ``query``, best first."""

    def versions(self, city_code: str | None = None) -> dict[int, int]:
        """resource id -> publish version indexed (of one city, or all): for reconciliation."""

    def close(self) -> None:
        """Releases connections."""


# The search table's columns: (name, PostgreSQL type, SQLite type; None: not in that one).
# The first ones are a SearchDoc's fields, in its order; SQLite sorts prices by a number
# kept beside their exact text.
_SEARCH_COLUMNS: tuple[tuple[str, str | None, str | None], ...] = (
    ("resource_id", "BIGINT PRIMARY KEY", "INTEGER PRIMARY KEY"),
    ("publish_version", "BIGINT NOT NULL", "INTEGER NOT NULL"),
    ("supplier_id", "BIGINT NOT NULL", "INTEGER NOT NULL"),
    ("supplier_hotel_id", "TEXT NOT NULL", "TEXT NOT NULL"),
    ("name", "TEXT NOT NULL", "TEXT NOT NULL"),
    ("name_local", "TEXT", "TEXT"),
    ("address", "TEXT", "TEXT"),
    ("postal_code", "TEXT", "TEXT"),
    ("city_code", "TEXT NOT NULL", "TEXT NOT NULL"),
    ("country_code", "TEXT NOT NULL", "TEXT NOT NULL"),
    ("star_rating", "NUMERIC(2, 1)", "REAL"),
    ("status", "TEXT NOT NULL", "TEXT NOT NULL"),
    ("lowest_price", "NUMERIC(18, 2)", "TEXT"),
    ("lowest_price_num", None, "REAL"),
    ("currency", "TEXT", "TEXT"),
    ("lat", "DOUBLE PRECISION NOT NULL", "REAL NOT NULL"),
    ("lng", "DOUBLE PRECISION NOT NULL", "REAL NOT NULL"),
    ("published_at", "TIMESTAMP NOT NULL", "TEXT NOT NULL"),
    ("projected_at", "TIMESTAMP NOT NULL DEFAULT (now() AT TIME ZONE 'utc')", "TEXT NOT NULL"),
)
_DOC_COLUMNS = tuple(f.name for f in fields(SearchDoc))


def _create_table(dialect: int, *extra: str) -> str:
    """The search table's CREATE statement, with the types of ``dialect`` (1: PostgreSQL,
    2: SQLite) and ``extra`` column definitions."""
    columns = [f"{c[0]} {c[dialect]}" for c in _SEARCH_COLUMNS if c[dialect] is not None]
    body = ",\n        ".join([*columns, *extra])
    return f"CREATE TABLE IF NOT EXISTS {SEARCH_TABLE} (\n        {body}\n    )"


_HIT_COLUMNS = (
    "resource_id",
    "publish_version",
    "name",
    "name_local",
    "city_code",
    "country_code",
    "star_rating",
    "status",
    "lowest_price",
    "currency",
)


def _hit(row: Sequence[Any]) -> SearchHit:
    v = dict(zip(_HIT_COLUMNS, row, strict=True))
    price = v["lowest_price"]
    return SearchHit(
        resource_id=int(v["resource_id"]),
        publish_version=int(v["publish_version"]),
        name=str(v["name"]),
        name_local=v["name_local"],
        city_code=str(v["city_code"]),
        country_code=str(v["country_code"]),
        star_rating=None if v["star_rating"] is None else float(v["star_rating"]),
        status=str(v["status"]),
        lowest_price=None if price is None else Decimal(str(price)),
        currency=v["currency"],
    )


# -- PostgreSQL ----------------------------------------------------------------------------

_PG_DDL = (
    "CREATE EXTENSION IF NOT EXISTS pg_trgm",
    _create_table(
        1,
        """names TEXT GENERATED ALWAYS AS (
            lower(name || ' ' || coalesce(name_local, '') || ' ' || coalesce(address, ''))
        ) STORED""",
        """words TSVECTOR GENERATED ALWAYS AS (
            to_tsvector('simple', name || ' ' || coalesce(name_local, '') || ' '
                || coalesce(address, ''))
        ) STORED""",
    ),
    f"CREATE INDEX IF NOT EXISTS {SEARCH_TABLE}_words ON {SEARCH_TABLE} USING GIN (words)",
    f"CREATE INDEX IF NOT EXISTS {SEARCH_TABLE}_names ON {SEARCH_TABLE} "
    "USING GIN (names gin_trgm_ops)",
    f"CREATE INDEX IF NOT EXISTS {SEARCH_TABLE}_city ON {SEARCH_TABLE} "
    "(city_code, status, star_rating)",
    f"CREATE INDEX IF NOT EXISTS {SEARCH_TABLE}_country ON {SEARCH_TABLE} (country_code, status)",
    f"CREATE INDEX IF NOT EXISTS {SEARCH_TABLE}_price ON {SEARCH_TABLE} (city_code, lowest_price)",
)
# The advisory lock key under which the schema is created ("ssearch" in ASCII).
_PG_SCHEMA_LOCK = 0x737365617263
# The batch travels as one JSON array of documents, expanded by the server into rows of
# the table's type: psycopg would otherwise adapt every value of every column in Python.
_PG_UPSERT = (
    f"INSERT INTO {SEARCH_TABLE} ({', '.join(_DOC_COLUMNS)}) "  # noqa: S608 (constant names)
    f"SELECT {', '.join(_DOC_COLUMNS)} FROM json_populate_recordset(NULL::{SEARCH_TABLE}, %s)"
    " ON CONFLICT (resource_id) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in _DOC_COLUMNS[1:])
    + f", projected_at = now() AT TIME ZONE 'utc' WHERE {SEARCH_TABLE}.publish_version"
    " <= EXCLUDED.publish_version"
)


class PostgresSearchIndex:
    """The hotel search read model in PostgreSQL (``postgresql://user@host:5432/db``).

    The table and its indexes are created on first use. One connection, used under a lock:
    each dispatcher thread opens its own index.
    """

    def __init__(self, url: str, *, connect_timeout: float = 5.0) -> None:
        self.url = url
        self._connect_timeout = connect_timeout
        self._conn: Any = None
        self._lock = threading.Lock()

    @contextmanager
    def _cursor(self) -> Iterator[Any]:
        # The driver is imported by the deployments that use it, not by every command that
        # imports this module (the embedded search index needs none).
        import psycopg

        with self._lock:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(
                        self.url, connect_timeout=int(self._connect_timeout)
                    )
                    with self._conn.cursor() as cur:
                        # Dispatcher processes starting together on a new database would
                        # race on CREATE ... IF NOT EXISTS (a unique violation in the
                        # catalog): the schema is made under one lock, held to the commit.
                        cur.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_SCHEMA_LOCK,))
                        for ddl in _PG_DDL:
                            cur.execute(ddl)
                    self._conn.commit()
                with self._conn.cursor() as cur:
                    yield cur
                self._conn.commit()
            except psycopg.OperationalError as err:
                self._drop()
                raise ProjectionUnavailable(
                    f"search index {redact(self.url)} is unavailable: {_first_line(err)}"
                ) from err
            except BaseException:
                if self._conn is not None and not self._conn.closed:
                    self._conn.rollback()
                raise

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # broken already; the next use reconnects
                self._conn.close()
        self._conn = None

    def upsert(self, docs: Sequence[SearchDoc]) -> None:
        """One INSERT ... ON CONFLICT for the whole batch (one JSON array, expanded
        server-side)."""
        if not docs:
            return
        # Prices as decimal strings (exact), times naive UTC as the column holds them.
        batch = orjson.dumps(docs, default=str).decode()
        with self._cursor() as cur:
            cur.execute(_PG_UPSERT, [batch])

    def search(self, query: SearchQuery) -> list[SearchHit]:
        """Every word matches the indexed words or, as a substring, the names and address."""
        where, params = ["TRUE"], []
        for word in query.words():
            where.append("(words @@ plainto_tsquery('simple', %s) OR names LIKE %s)")
            params += [word, f"%{_like_escape(word.lower())}%"]
        where, params = _filters(where, params, query, placeholder="%s")
        rank = "ts_rank(words, plainto_tsquery('simple', %s))"
        sql = (
            f"SELECT {', '.join(_HIT_COLUMNS)} FROM {SEARCH_TABLE} WHERE {' AND '.join(where)} "  # noqa: S608 (constant names)
            f"ORDER BY {rank} DESC, star_rating DESC NULLS LAST, resource_id LIMIT %s"
        )
        with self._cursor() as cur:
            cur.execute(sql, [*params, query.text, query.limit])
            return [_hit(r) for r in cur.fetchall()]

    def versions(self, city_code: str | None = None) -> dict[int, int]:
        """resource id -> publish version indexed."""
        sql = f"SELECT resource_id, publish_version FROM {SEARCH_TABLE}"  # noqa: S608 (constant names)
        with self._cursor() as cur:
            if city_code is None:
                cur.execute(sql)
            else:
                cur.execute(sql + " WHERE city_code = %s", [city_code])
            return {int(r): int(v) for r, v in cur.fetchall()}

    def close(self) -> None:
        """Closes the connection."""
        with self._lock:
            self._drop()


# -- SQLite (the embedded default) -------------------------------------------------------

_SQLITE_DDL = (
    _create_table(2),
    f"CREATE INDEX IF NOT EXISTS {SEARCH_TABLE}_city ON {SEARCH_TABLE} "
    "(city_code, status, star_rating)",
    f"CREATE INDEX IF NOT EXISTS {SEARCH_TABLE}_country ON {SEARCH_TABLE} (country_code, status)",
    f"CREATE INDEX IF NOT EXISTS {SEARCH_TABLE}_price ON {SEARCH_TABLE} "
    "(city_code, lowest_price_num)",
    # rowid = resource id; it keeps its own copy of the text (SQLite 3.40 has no
    # contentless table that deletes).
    f"CREATE VIRTUAL TABLE IF NOT EXISTS {SEARCH_TABLE}_fts USING fts5(names, tokenize='trigram')",
)


class SqliteSearchIndex:
    """The search read model in a SQLite file of its own (the embedded default): FTS5 with
    the trigram tokenizer (any substring of three characters or more; shorter words are
    matched with LIKE)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._conn is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                for ddl in _SQLITE_DDL:
                    conn.execute(ddl)
                conn.commit()
                self._conn = conn
            try:
                yield self._conn
                self._conn.commit()
            except sqlite3.OperationalError as err:
                self._conn.rollback()
                raise ProjectionUnavailable(f"search index {self.path}: {err}") from err
            except BaseException:
                self._conn.rollback()
                raise

    def upsert(self, docs: Sequence[SearchDoc]) -> None:
        """Writes the documents newer than (or as new as) the indexed ones."""
        if not docs:
            return
        with self._connection() as conn:
            ids = [d.resource_id for d in docs]
            known = dict(
                conn.execute(
                    f"SELECT resource_id, publish_version FROM {SEARCH_TABLE} "  # noqa: S608 (constant names)
                    f"WHERE resource_id IN ({','.join('?' * len(ids))})",
                    ids,
                ).fetchall()
            )
            fresh = [d for d in docs if known.get(d.resource_id, -1) <= d.publish_version]
            now = datetime.now(UTC).replace(tzinfo=None).isoformat(" ")
            conn.executemany(
                f"INSERT OR REPLACE INTO {SEARCH_TABLE} ({', '.join(_DOC_COLUMNS)}, "  # noqa: S608 (constant names)
                f"lowest_price_num, projected_at) VALUES ({','.join('?' * (len(_DOC_COLUMNS) + 2))})",
                [
                    (
                        *(_sqlite_value(getattr(d, c)) for c in _DOC_COLUMNS),
                        None if d.lowest_price is None else float(d.lowest_price),
                        now,
                    )
                    for d in fresh
                ],
            )
            conn.executemany(
                f"DELETE FROM {SEARCH_TABLE}_fts WHERE rowid = ?",  # noqa: S608 (constant names)
                # Every fresh one: a row of the text index may outlive its document.
                [(d.resource_id,) for d in fresh],
            )
            conn.executemany(
                f"INSERT INTO {SEARCH_TABLE}_fts (rowid, names) VALUES (?, ?)",  # noqa: S608 (constant names)
                [(d.resource_id, _names(d)) for d in fresh],
            )

    def search(self, query: SearchQuery) -> list[SearchHit]:
        """Every word matches the names or the address (FTS5 for words of three characters
        or more, LIKE for shorter ones)."""
        where, params = ["1"], []
        long_words = [w for w in query.words() if len(w) >= 3]
        short = [w for w in query.words() if len(w) < 3]
        if long_words:
            where.append(
                f"resource_id IN (SELECT rowid FROM {SEARCH_TABLE}_fts WHERE "  # noqa: S608 (constant names)
                f"{SEARCH_TABLE}_fts MATCH ?)"
            )
            params.append(
                " AND ".join('"' + w.lower().replace('"', '""') + '"' for w in long_words)
            )
        for word in short:
            where.append(
                "lower(name || ' ' || coalesce(name_local, '') || ' ' || coalesce(address, ''))"
                " LIKE ? ESCAPE '\\'"
            )
            params.append(f"%{_like_escape(word.lower())}%")
        where, params = _filters(where, params, query, placeholder="?", price="lowest_price_num")
        sql = (
            f"SELECT {', '.join(_HIT_COLUMNS)} FROM {SEARCH_TABLE} WHERE {' AND '.join(where)} "  # noqa: S608 (constant names)
            "ORDER BY star_rating IS NULL, star_rating DESC, resource_id LIMIT ?"
        )
        with self._connection() as conn:
            return [_hit(r) for r in conn.execute(sql, [*params, query.limit]).fetchall()]

    def versions(self, city_code: str | None = None) -> dict[int, int]:
        """resource id -> publish version indexed."""
        sql = f"SELECT resource_id, publish_version FROM {SEARCH_TABLE}"  # noqa: S608 (constant names)
        with self._connection() as conn:
            if city_code is None:
                rows = conn.execute(sql).fetchall()
            else:
                rows = conn.execute(sql + " WHERE city_code = ?", [city_code]).fetchall()
        return {int(r): int(v) for r, v in rows}

    def close(self) -> None:
        """Closes the file."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _names(doc: SearchDoc) -> str:
    return f"{doc.name} {doc.name_local or ''} {doc.address or ''}".lower()


def _sqlite_value(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat(" ")
    return value


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _filters(
    where: list[str],
    params: list[Any],
    query: SearchQuery,
    *,
    placeholder: str,
    price: str = "lowest_price",
) -> tuple[list[str], list[Any]]:
    for column, value in (
        ("city_code", query.city_code),
        ("country_code", query.country_code),
        ("status", query.status),
    ):
        if value:
            where.append(f"{column} = {placeholder}")
            params.append(value)
    if query.min_stars is not None:
        where.append(f"star_rating >= {placeholder}")
        params.append(query.min_stars)
    if query.max_price is not None:
        where.append(f"{price} <= {placeholder}")
        params.append(query.max_price if price == "lowest_price" else float(query.max_price))
    return where, params


# -- the hotel cache -------------------------------------------------------------------------


class HotelCache(Protocol):
    """The CACHE stage's target (and the read API's cache-aside store)."""

    def get(self, key: str) -> bytes | None:
        """The cached value, or None."""

    def set(self, key: str, value: bytes, ttl_seconds: float) -> None:
        """Caches ``value`` for ``ttl_seconds``."""

    def invalidate(self, keys: Sequence[str]) -> None:
        """Drops the keys (missing ones are fine)."""

    def close(self) -> None:
        """Releases connections."""


def hotel_cities(conn: Connection, resource_ids: Sequence[int]) -> dict[int, tuple[int, str]]:
    """resource id -> (supplier id, city code) from the catalog, in one read."""
    h = schema.platform_hotel.c
    ids = sorted(set(resource_ids))
    if not ids:
        return {}
    rows = conn.execute(
        sa.select(h.resource_id, h.supplier_id, h.city_code).where(h.resource_id.in_(ids))
    ).all()
    return {int(r.resource_id): (int(r.supplier_id), str(r.city_code)) for r in rows}


def cache_keys(cities: Mapping[int, tuple[int, str]], resource_ids: Sequence[int]) -> list[str]:
    """Each hotel's detail key, and its city's list key when the catalog knows its city
    (``cities``: :func:`hotel_cities`)."""
    keys = {HOTEL_KEY.format(resource_id=rid) for rid in resource_ids}
    keys |= {CITY_KEY.format(supplier_id=s, city_code=c) for s, c in cities.values()}
    return sorted(keys)


class RedisHotelCache:
    """The hotel cache in Redis (``redis://host:6379/0``)."""

    def __init__(self, url: str, *, socket_timeout: float = 2.0) -> None:
        # The driver is imported by the deployments that use it, not by every command that
        # imports this module (the embedded cache needs none).
        import redis

        self.url = url
        self._client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )
        self._redis_error: type[Exception] = redis.RedisError

    @contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except self._redis_error as err:
            raise ProjectionUnavailable(
                f"hotel cache {redact(self.url)} is unavailable: {_first_line(err)}"
            ) from err

    def get(self, key: str) -> bytes | None:
        """The cached value, or None."""
        with self._guard():
            value = self._client.get(key)
        return value if isinstance(value, bytes) else None

    def set(self, key: str, value: bytes, ttl_seconds: float) -> None:
        """Caches ``value`` for ``ttl_seconds``."""
        with self._guard():
            self._client.set(key, value, px=max(1, int(ttl_seconds * 1000)))

    def invalidate(self, keys: Sequence[str]) -> None:
        """One DEL of every key."""
        if keys:
            with self._guard():
                self._client.delete(*keys)

    def close(self) -> None:
        """Closes the connection pool."""
        self._client.close()


class InProcessHotelCache:
    """The hotel cache in this process (the embedded default): a dict with expiry times."""

    def __init__(self) -> None:
        self._values: dict[str, tuple[float, bytes]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        """The cached value, or None (expired values are dropped)."""
        with self._lock:
            found = self._values.get(key)
            if found is None:
                return None
            if found[0] < time.monotonic():
                del self._values[key]
                return None
            return found[1]

    def set(self, key: str, value: bytes, ttl_seconds: float) -> None:
        """Caches ``value`` for ``ttl_seconds``."""
        with self._lock:
            self._values[key] = (time.monotonic() + ttl_seconds, value)

    def invalidate(self, keys: Sequence[str]) -> None:
        """Drops the keys."""
        with self._lock:
            for key in keys:
                self._values.pop(key, None)

    def close(self) -> None:
        """Nothing to release."""


# -- subscribers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Notification:
    """An event as subscribers receive it."""

    event_id: str
    event_type: str
    aggregate_id: int
    aggregate_version: int
    batch_id: str
    payload: str

    @property
    def routing_key(self) -> str:
        """The topic: the event type."""
        return self.event_type


class Notifier(Protocol):
    """The NOTIFY stage's target."""

    def publish(self, notes: Sequence[Notification]) -> None:
        """Delivers every notification durably before returning, or raises."""

    def close(self) -> None:
        """Releases connections."""


class JsonLinesNotifier:
    """Subscribers' feed as a JSON-lines file (the embedded default): one line per event,
    appended and flushed to disk before :meth:`publish` returns."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def publish(self, notes: Sequence[Notification]) -> None:
        """Appends one line per notification, then fsyncs the file."""
        if not notes:
            return
        lines = "".join(
            json.dumps(
                {
                    "message_id": n.event_id,
                    "routing_key": n.routing_key,
                    "aggregate_id": n.aggregate_id,
                    "aggregate_version": n.aggregate_version,
                    "batch_id": n.batch_id,
                    "payload": json.loads(n.payload),
                },
                sort_keys=True,
            )
            + "\n"
            for n in notes
        )
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(lines)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as err:
                raise ProjectionUnavailable(f"notification file {self.path}: {err}") from err

    def close(self) -> None:
        """Nothing to release."""


# A message's properties, in the order AMQP 0-9-1 writes them (with their flag bits):
# content type (15), headers (13), delivery mode (12), message id (7), timestamp (6), type (5).
_PROPERTY_FLAGS = (1 << 15) | (1 << 13) | (1 << 12) | (1 << 7) | (1 << 6) | (1 << 5)
_CONTENT_TYPE = encode.short_string("application/json")
_PERSISTENT = b"\x02"
_HEADER_KEYS = tuple(
    encode.short_string(k) for k in ("aggregate_id", "aggregate_version", "batch_id")
)


def content_header_frame(note: Notification, body_size: int, stamp: bytes) -> bytes:
    """The content header frame of ``note`` on channel 1: the bytes pamqp's
    ``ContentHeader.marshal`` makes of these properties (``stamp``: the encoded timestamp),
    written directly, since one frame per message is most of what NOTIFY costs a dispatcher."""
    headers = b"".join(
        (
            _HEADER_KEYS[0],
            encode.table_integer(note.aggregate_id),
            _HEADER_KEYS[1],
            encode.table_integer(note.aggregate_version),
            _HEADER_KEYS[2],
            b"S" + encode.long_string(note.batch_id),
        )
    )
    payload = b"".join(
        (
            struct.pack(">HHQH", 60, 0, body_size, _PROPERTY_FLAGS),  # class basic, weight 0
            _CONTENT_TYPE,
            struct.pack(">I", len(headers)),
            headers,
            _PERSISTENT,
            encode.short_string(note.event_id),
            stamp,
            encode.short_string(note.event_type),
        )
    )
    return struct.pack(">BHI", FRAME_HEADER, 1, len(payload)) + payload + bytes((FRAME_END,))


class _AmqpChannel:
    """One AMQP 0-9-1 connection with one channel in confirm mode, over a blocking socket.

    The protocol's frames are made and read by pamqp; what a publisher needs of the protocol
    is here: the handshake (PLAIN login, tuning without heartbeats: a dispatcher either
    publishes or sleeps briefly between rounds), the channel, ``confirm.select``, declaring
    the exchange, and publishing a batch of messages in one write, then reading the broker's
    acks (which may each confirm many) until every message of the batch is confirmed.
    """

    def __init__(self, url: str, exchange: str, timeout: float) -> None:
        parts = urlsplit(url)
        self.exchange = exchange
        self._sock = socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or 5672), timeout=timeout
        )
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = b""
        self._tag = 0  # the last delivery tag published
        self._methods: dict[str, bytes] = {}  # routing key -> its basic.publish frame
        self.frame_max = 131072
        user, password = unquote(parts.username or "guest"), unquote(parts.password or "guest")
        vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
        self._sock.sendall(b"AMQP\x00\x00\x09\x01")
        self._expect(0, commands.Connection.Start)
        self._send(
            0,
            commands.Connection.StartOk(
                client_properties={"product": "supplier-sync"},
                mechanism="PLAIN",
                response=f"\0{user}\0{password}",
            ),
        )
        tune = self._expect(0, commands.Connection.Tune)
        self.frame_max = tune.frame_max or self.frame_max
        self._send(0, commands.Connection.TuneOk(tune.channel_max, self.frame_max, 0))
        self._send(0, commands.Connection.Open(virtual_host=vhost))
        self._expect(0, commands.Connection.OpenOk)
        self._send(1, commands.Channel.Open())
        self._expect(1, commands.Channel.OpenOk)
        self._send(1, commands.Confirm.Select())
        self._expect(1, commands.Confirm.SelectOk)
        self._send(
            1, commands.Exchange.Declare(exchange=exchange, exchange_type="topic", durable=True)
        )
        self._expect(1, commands.Exchange.DeclareOk)

    def _send(self, channel: int, value: Any) -> None:
        self._sock.sendall(frame.marshal(value, channel))

    def _read(self) -> tuple[int, Any]:
        while True:
            if self._buffer:
                try:
                    used, channel, value = frame.unmarshal(self._buffer)
                except UnmarshalingException:
                    used = 0
                if used:
                    self._buffer = self._buffer[used:]
                    return channel, value
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            self._buffer += chunk

    def _expect(self, channel: int, kind: type) -> Any:
        got_channel, value = self._read()
        if isinstance(value, commands.Connection.Close | commands.Channel.Close):
            raise ConnectionError(f"the broker closed: {value.reply_code} {value.reply_text}")
        if got_channel != channel or not isinstance(value, kind):
            raise ConnectionError(f"unexpected {type(value).__name__} instead of {kind.__name__}")
        return value

    def publish(self, notes: Sequence[Notification], timestamp: datetime) -> None:
        """Publishes every note in one write and returns when the broker confirmed all."""
        chunks: list[bytes] = []
        limit = self.frame_max - 8
        stamp = encode.timestamp(timestamp)
        for n in notes:
            payload = n.payload.encode()
            method = self._methods.get(n.routing_key)
            if method is None:  # the same bytes for every message of an event type
                method = self._methods[n.routing_key] = frame.marshal(
                    commands.Basic.Publish(exchange=self.exchange, routing_key=n.routing_key), 1
                )
            chunks.append(method)
            chunks.append(content_header_frame(n, len(payload), stamp))
            for start in range(0, len(payload), limit):
                chunks.append(frame.marshal(body.ContentBody(payload[start : start + limit]), 1))
        first = self._tag + 1
        self._tag += len(notes)
        self._sock.sendall(b"".join(chunks))
        confirmed = first - 1
        nacked = 0
        while confirmed < self._tag:
            channel, value = self._read()
            if isinstance(value, commands.Basic.Ack | commands.Basic.Nack):
                tag = int(value.delivery_tag)
                count = (tag - confirmed) if value.multiple else 1
                if isinstance(value, commands.Basic.Nack):
                    nacked += count
                confirmed = max(confirmed, tag)
            elif isinstance(value, commands.Connection.Close | commands.Channel.Close):
                raise ConnectionError(f"the broker closed: {value.reply_code} {value.reply_text}")
        if nacked:
            raise RuntimeError(f"the broker refused {nacked} of {len(notes)} messages (nack)")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class RabbitMqNotifier:
    """Publishes to a RabbitMQ topic exchange (``amqp://user:pw@host:5672/vhost``).

    The exchange is declared durable; messages are persistent, carry the event id as
    message id and the event type as routing key and type, with the aggregate's id and
    version in their headers. With publisher confirms, :meth:`publish` writes the batch at
    once and returns when the broker has confirmed every message. It speaks AMQP itself over
    a blocking socket (pamqp makes the frames): an asyncio client (aio-pika, aiormq) spent
    four to five times the CPU per message, which made it the dispatcher's bottleneck. A
    connection that fails is dropped; the next batch opens a new one.
    """

    def __init__(
        self, url: str, *, exchange: str = DEFAULT_EXCHANGE, timeout: float = 10.0
    ) -> None:
        self.url = url
        self.exchange_name = exchange
        self.timeout = timeout
        self._channel: _AmqpChannel | None = None
        self._lock = threading.Lock()

    def publish(self, notes: Sequence[Notification]) -> None:
        """Publishes the batch and waits for the broker's confirms."""
        if not notes:
            return
        with self._lock:
            try:
                if self._channel is None:
                    self._channel = _AmqpChannel(self.url, self.exchange_name, self.timeout)
                self._channel.publish(notes, datetime.now(UTC))
            except Exception as err:
                self._reset()
                raise ProjectionUnavailable(
                    f"message broker {redact(self.url)} did not confirm {len(notes)} "
                    f"messages: {type(err).__name__}: {_first_line(err)}"
                ) from err

    def _reset(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def close(self) -> None:
        """Closes the connection."""
        with self._lock:
            self._reset()


# -- choosing the targets ---------------------------------------------------------------------


@dataclass(frozen=True)
class ProjectionSettings:
    """Where the projections live (None: the embedded default in ``state_dir``).

    Attributes:
        state_dir: The local state folder (embedded defaults).
        search_url: ``postgresql://...``; None: ``<state>/search.sqlite3``.
        cache_url: ``redis://...``; None: in-process.
        amqp_url: ``amqp://...``; None: ``<state>/notifications.jsonl``.
        exchange: The RabbitMQ topic exchange.
    """

    state_dir: Path
    search_url: str | None = None
    cache_url: str | None = None
    amqp_url: str | None = None
    exchange: str = DEFAULT_EXCHANGE

    @classmethod
    def from_settings(cls, settings: Settings) -> ProjectionSettings:
        """From the deployment's settings (``SUPPLIER_SYNC_SEARCH_URL``, ``..._REDIS_URL``,
        ``..._AMQP_URL``, the state folder)."""
        return cls(
            state_dir=settings.state_dir,
            search_url=settings.search_url,
            cache_url=settings.redis_url,
            amqp_url=settings.amqp_url,
        )


@dataclass
class Projections:
    """One dispatcher's targets."""

    search: SearchIndex
    cache: HotelCache
    notifier: Notifier

    def close(self) -> None:
        """Closes every target."""
        for target in (self.search, self.cache, self.notifier):
            target.close()


def open_search_index(settings: ProjectionSettings) -> SearchIndex:
    """The search index the settings name."""
    url = settings.search_url
    if url is None:
        return SqliteSearchIndex(settings.state_dir / "search.sqlite3")
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("postgresql", "postgres"):
        return PostgresSearchIndex(url)
    if scheme == "sqlite":
        return SqliteSearchIndex(urlsplit(url).path)
    raise ConfigError(f"search index URL scheme {scheme!r}: expected postgresql:// or sqlite://")


def open_projections(
    settings: ProjectionSettings, *, cache: HotelCache | None = None
) -> Projections:
    """The three targets the settings name (``cache``: share an in-process cache)."""
    if cache is None:
        cache = RedisHotelCache(settings.cache_url) if settings.cache_url else InProcessHotelCache()
    notifier: Notifier
    if settings.amqp_url:
        notifier = RabbitMqNotifier(settings.amqp_url, exchange=settings.exchange)
    else:
        notifier = JsonLinesNotifier(settings.state_dir / "notifications.jsonl")
    return Projections(open_search_index(settings), cache, notifier)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# -- reconciliation: the catalog is authoritative ---------------------------------------------


@dataclass(frozen=True)
class CityDifference:
    """A city whose projection differs from the catalog."""

    city_code: str
    catalog_count: int
    projected_count: int
    catalog_checksum: str
    projected_checksum: str
    missing: int  # in the catalog, not in the projection
    stale: int  # in the projection at an older publish version
    extra: int  # in the projection, not in the catalog


@dataclass
class ReconcileReport:
    """What a reconciliation found and repaired.

    Attributes:
        cities: Cities compared.
        hotels: Hotels in the catalog.
        differences: The cities that differed (before the repair).
        repaired: Hotels re-projected from the catalog (search document and cache keys).
    """

    cities: int = 0
    hotels: int = 0
    differences: list[CityDifference] = field(default_factory=list)
    repaired: int = 0


def _checksum(pairs: Mapping[int, int]) -> str:
    digest = hashlib.sha256()
    for rid in sorted(pairs):
        digest.update(f"{rid}:{pairs[rid]},".encode())
    return digest.hexdigest()[:16]


def reconcile_projection(
    db: SyncDatabase, projections: Projections, *, repair: bool = True, chunk: int = 500
) -> ReconcileReport:
    """Compares, city by city, the catalog's (resource id, publish version) pairs with the
    search index's (count and checksum), and re-projects the hotels that are missing or
    stale there (their search document from the catalog, and their cache keys).

    The catalog is read once in a stream and the index's versions once; the repair goes
    through the same upsert as the SEARCH_INDEX stage (guarded by the publish version).
    """
    h = schema.platform_hotel.c
    catalog: dict[str, dict[int, int]] = {}
    with db.engine.connect() as conn:
        rows = conn.execution_options(stream_results=True, yield_per=10_000).execute(
            sa.select(h.city_code, h.resource_id, h.publish_version)
        )
        for city, rid, version in rows:
            catalog.setdefault(str(city), {})[int(rid)] = int(version)
    indexed = projections.search.versions()
    report = ReconcileReport(cities=len(catalog), hotels=sum(len(p) for p in catalog.values()))
    to_repair: list[int] = []
    for city in sorted(catalog):
        pairs = catalog[city]
        projected = {rid: indexed[rid] for rid in pairs if rid in indexed}
        missing = [rid for rid in pairs if rid not in indexed]
        stale = [rid for rid, v in projected.items() if v < pairs[rid]]
        expected, found = _checksum(pairs), _checksum(projected)
        if missing or stale or expected != found:
            report.differences.append(
                CityDifference(
                    city_code=city,
                    catalog_count=len(pairs),
                    projected_count=len(projected),
                    catalog_checksum=expected,
                    projected_checksum=found,
                    missing=len(missing),
                    stale=len(stale),
                    extra=0,
                )
            )
            to_repair += missing + stale
    known = {rid for pairs in catalog.values() for rid in pairs}
    extra = [rid for rid in indexed if rid not in known]
    if extra:
        report.differences.append(
            CityDifference(
                "(not in the catalog)",
                0,
                len(extra),
                "",
                _checksum({rid: indexed[rid] for rid in extra}),
                0,
                0,
                len(extra),
            )
        )
    if repair and to_repair:
        for start in range(0, len(to_repair), chunk):
            part = to_repair[start : start + chunk]
            with db.engine.connect() as conn:
                docs = load_search_docs(conn, part)
                cities = hotel_cities(conn, part)
            projections.search.upsert(list(docs.values()))
            projections.cache.invalidate(cache_keys(cities, part))
            report.repaired += len(docs)
    return report
