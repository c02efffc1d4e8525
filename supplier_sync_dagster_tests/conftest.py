"""Shared fixtures: the real servers (MariaDB, Redis) and a sync database per test.

Servers are found through ``SUPPLIER_SYNC_TEST_MYSQL_URL`` (default
``mysql+pymysql://root@127.0.0.1:3306``) and ``SUPPLIER_SYNC_TEST_REDIS_URL`` (default
``redis://127.0.0.1:6379/15``). When one cannot be reached the tests that need it skip with
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
