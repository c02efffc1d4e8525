"""The services of a multi-host test (``deploy.py`` runs a deployment on them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supplier_sync_dagster_tests.defs.test_city_sync import moto_s3  # noqa: F401
from supplier_sync_dagster_tests.integration.test_webserver_daemon import (  # noqa: F401
    mysql_databases,
)
from supplier_sync_dagster_tests.multihost.deploy import Services


@pytest.fixture
def services(
    mysql_databases: tuple[str, str],  # noqa: F811
    moto_s3: tuple[str, str],  # noqa: F811
    redis_url: str,
    amqp_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Services:
    """Fresh MariaDB databases, a moto S3 bucket, Redis and RabbitMQ for one test."""
    return Services(mysql_databases, moto_s3, redis_url, amqp_url, tmp_path, monkeypatch.setenv)
