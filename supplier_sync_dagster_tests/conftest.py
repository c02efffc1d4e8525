"""Shared fixtures: the real servers (MariaDB, Redis, PostgreSQL, RabbitMQ) and a sync
database per test.

Servers are found through ``SUPPLIER_SYNC_TEST_MYSQL_URL`` (default
``mysql+pymysql://root@127.0.0.1:3306``), ``SUPPLIER_SYNC_TEST_REDIS_URL`` (default
``redis://127.0.0.1:6379/15``), ``SUPPLIER_SYNC_TEST_POSTGRES_URL`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``) and ``SUPPLIER_SYNC_TEST_AMQP_URL`` (default
``amqp://guest:guest@127.0.0.1:5672/``). When one cannot be reached the tests that need it skip with
a message saying how to enable them, unless ``SUPPLIER_SYNC_REQUIRE_SERVICES=1`` (set by
``.ci/run``), in which case they fail.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

MYSQL_URL = os.environ.get("SUPPLIER_SYNC_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306")
REDIS_URL = os.environ.get("SUPPLIER_SYNC_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
POSTGRES_URL = os.environ.get(
    "SUPPLIER_SYNC_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
AMQP_URL = os.environ.get("SUPPLIER_SYNC_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def _services_required() -> bool:
    return os.environ.get("SUPPLIER_SYNC_REQUIRE_SERVICES", "") == "1"


def _unavailable(what: str, how: str, err: Exception) -> None:
    msg = f"{what} is not reachable ({type(err).__name__}: {err}). {how}"
    if _services_required():
        pytest.fail(msg + " SUPPLIER_SYNC_REQUIRE_SERVICES=1, so this is an error.", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def mysql_server_url() -> str:
    """URL of a MariaDB/MySQL server (no database selected) the tests may create databases on."""
    try:
        engine = sa.create_engine(MYSQL_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        engine.dispose()
    except Exception as err:  # any driver error means "not reachable" here
        _unavailable(
            "MariaDB/MySQL",
            "Start it (127.0.0.1:3306, root, empty password) or set SUPPLIER_SYNC_TEST_MYSQL_URL.",
            err,
        )
    return MYSQL_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of a Redis server database the tests may flush keys in."""
    import redis

    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
        client.ping()
        client.close()
    except Exception as err:
        _unavailable(
            "Redis",
            "Start it on 127.0.0.1:6379 or set SUPPLIER_SYNC_TEST_REDIS_URL.",
            err,
        )
    return REDIS_URL


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    """URL of a PostgreSQL server's maintenance database (the tests create databases on it)."""
    import psycopg

    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
    except Exception as err:
        _unavailable(
            "PostgreSQL",
            "Start it (127.0.0.1:5432, trust) or set SUPPLIER_SYNC_TEST_POSTGRES_URL.",
            err,
        )
    return POSTGRES_URL


@pytest.fixture
def fresh_postgres_db(postgres_server_url: str) -> Iterator[str]:
    """A new, empty PostgreSQL database for one test; dropped afterwards. Yields its URL."""
    import psycopg

    name = f"sst_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = postgres_server_url.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(postgres_server_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """URL of a RabbitMQ broker the tests may declare exchanges and queues on."""
    import asyncio

    import aio_pika

    async def ping() -> None:
        connection = await aio_pika.connect(AMQP_URL, timeout=3)
        await connection.close()

    try:
        asyncio.run(ping())
    except Exception as err:
        _unavailable(
            "RabbitMQ",
            "Start it (127.0.0.1:5672, guest/guest) or set SUPPLIER_SYNC_TEST_AMQP_URL.",
            err,
        )
    return AMQP_URL


@pytest.fixture
def fresh_mysql_db(mysql_server_url: str) -> Iterator[str]:
    """A new, empty MariaDB database for one test; dropped afterwards. Yields its URL."""
    name = f"sst_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(mysql_server_url)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"))
    try:
        yield f"{mysql_server_url.rstrip('/')}/{name}?charset=utf8mb4"
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


@pytest.fixture(params=["sqlite", "mariadb"])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh, empty sync database URL: a SQLite file, then a MariaDB database."""
    if request.param == "sqlite":
        path = tmp_path_factory.mktemp("syncdb") / "sync.sqlite3"
        return f"sqlite:///{path}"
    return str(request.getfixturevalue("fresh_mysql_db"))
