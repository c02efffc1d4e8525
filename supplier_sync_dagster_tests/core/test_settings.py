"""The settings object: every SUPPLIER_SYNC_* variable, read when asked, defaults, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.settings import (
    DEFAULT_TASK_CODE,
    ENV_PREFIX,
    Settings,
    StorageSettings,
    env_name,
    load_history_settings,
    load_settings,
    load_storage_settings,
)
from supplier_sync_dagster.core.store.engine import resolve_db_url, state_dir
from supplier_sync_dagster.core.store.payloads import LocalPayloadStore, open_payload_store

ALL = [env_name(field) for field in Settings.model_fields]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ALL:
        monkeypatch.delenv(name, raising=False)


def test_each_field_is_one_prefixed_variable():
    assert ALL == [
        "SUPPLIER_SYNC_HOME",
        "SUPPLIER_SYNC_DB_URL",
        "SUPPLIER_SYNC_PAYLOAD_URL",
        "SUPPLIER_SYNC_MAX_CLOCK_SKEW_SECONDS",
        "SUPPLIER_SYNC_LEASE_SECONDS",
        "SUPPLIER_SYNC_REDIS_URL",
        "SUPPLIER_SYNC_CLAIM_LOCKS",
        "SUPPLIER_SYNC_HISTORY_RETENTION_DAYS",
        "SUPPLIER_SYNC_SUPPLIERS_FILE",
        "SUPPLIER_SYNC_SUPPLIER_URL",
        "SUPPLIER_SYNC_SUPPLIER_API_KEY",
        "SUPPLIER_SYNC_SEARCH_URL",
        "SUPPLIER_SYNC_AMQP_URL",
        "SUPPLIER_SYNC_ALERT_URL",
        "SUPPLIER_SYNC_DAGSTER_URL",
        "SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT",
        "SUPPLIER_SYNC_SUPPLIER_REQUEST_DEADLINE",
        "SUPPLIER_SYNC_SUPPLIER_MAX_BODY_BYTES",
        "SUPPLIER_SYNC_SUPPLIER_MAX_DECODED_BYTES",
        "SUPPLIER_SYNC_WORKER_PROCESSES",
        "SUPPLIER_SYNC_API_KEYS",
        "SUPPLIER_SYNC_CONFIRM_RATE_LIMIT",
        "SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN",
        "SUPPLIER_SYNC_WALK_MAX_PAGES",
        "SUPPLIER_SYNC_WALK_PAGE_SLACK",
        "SUPPLIER_SYNC_WALK_CONTINUITY_CHECK",
        "SUPPLIER_SYNC_RATE_GOVERNOR",
        "SUPPLIER_SYNC_RATE_MAX",
        "SUPPLIER_SYNC_LINEAGE_URL",
        "SUPPLIER_SYNC_LINEAGE_API_KEY",
        "SUPPLIER_SYNC_LINEAGE_NAMESPACE",
        "SUPPLIER_SYNC_LINEAGE_TIMEOUT_SECONDS",
        "SUPPLIER_SYNC_LINEAGE_FILE_MAX_BYTES",
    ]
    assert all(name.startswith(ENV_PREFIX) for name in ALL)
    with pytest.raises(KeyError, match="no setting 'nope'"):
        env_name("nope")


def test_defaults_are_the_embedded_ones(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.chdir(tmp_path)
    s = load_settings()
    assert s.home == Path(".supplier_sync")
    assert s.state_dir == tmp_path.resolve() / ".supplier_sync"
    assert s.sync_db_url() == f"sqlite:///{tmp_path.resolve() / '.supplier_sync' / 'sync.sqlite3'}"
    assert (s.db_url, s.payload_url, s.supplier_url, s.redis_url) == (None, None, None, None)
    assert s.supplier_api_key is None and s.api_key() is None
    assert DEFAULT_TASK_CODE == "hotel_supplier_full_resource"


def test_values_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SUPPLIER_SYNC_DB_URL", "mysql+pymysql://u:pw@db:3306/sync")
    monkeypatch.setenv("SUPPLIER_SYNC_PAYLOAD_URL", "s3://bucket/prefix")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", "https://api.example/")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", "s3cret")
    monkeypatch.setenv("SUPPLIER_SYNC_REDIS_URL", "redis://127.0.0.1:6379/2")
    monkeypatch.setenv("SUPPLIER_SYNC_SEARCH_URL", "postgresql://pg@127.0.0.1:5432/search")
    monkeypatch.setenv("SUPPLIER_SYNC_AMQP_URL", "amqp://u:pw@mq:5672/")
    s = load_settings()
    assert s.search_url == "postgresql://pg@127.0.0.1:5432/search"
    assert s.amqp_url == "amqp://u:pw@mq:5672/"
    assert s.state_dir == tmp_path / "home"
    assert s.sync_db_url() == "mysql+pymysql://u:pw@db:3306/sync"
    assert s.payload_url == "s3://bucket/prefix"
    assert s.supplier_url == "https://api.example/"
    assert s.api_key() == "s3cret"
    assert s.redis_url == "redis://127.0.0.1:6379/2"
    assert "s3cret" not in repr(s)  # the key never shows in a log line


def test_rate_limit_and_worker_processes(monkeypatch: pytest.MonkeyPatch):
    assert (load_settings().supplier_rate_limit, load_settings().worker_processes) == (None, None)
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT", "12.5")
    monkeypatch.setenv("SUPPLIER_SYNC_WORKER_PROCESSES", "0")
    s = load_settings()
    assert (s.supplier_rate_limit, s.worker_processes) == (12.5, 0)
    for name, bad in [
        ("SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT", "0"),
        ("SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT", "inf"),
        ("SUPPLIER_SYNC_WORKER_PROCESSES", "-1"),
        ("SUPPLIER_SYNC_WORKER_PROCESSES", "two"),
        ("SUPPLIER_SYNC_BACKFILL_CITIES_PER_RUN", "0"),
    ]:
        with monkeypatch.context() as m:
            m.setenv(name, bad)
            message = str(pytest.raises(ConfigError, load_settings).value)
        assert message.startswith(f"{name}: ") and "\n" not in message


def test_walk_limits(monkeypatch: pytest.MonkeyPatch):
    s = load_settings()
    assert (s.walk_max_pages, s.walk_page_slack, s.walk_continuity_check) == (None, None, None)
    monkeypatch.setenv("SUPPLIER_SYNC_WALK_MAX_PAGES", "500")
    monkeypatch.setenv("SUPPLIER_SYNC_WALK_PAGE_SLACK", "0.5")
    monkeypatch.setenv("SUPPLIER_SYNC_WALK_CONTINUITY_CHECK", "0")
    s = load_settings()
    assert (s.walk_max_pages, s.walk_page_slack, s.walk_continuity_check) == (500, 0.5, False)
    for name, bad in [
        ("SUPPLIER_SYNC_WALK_MAX_PAGES", "0"),
        ("SUPPLIER_SYNC_WALK_PAGE_SLACK", "-0.1"),
        ("SUPPLIER_SYNC_WALK_PAGE_SLACK", "nan"),
        ("SUPPLIER_SYNC_WALK_CONTINUITY_CHECK", "maybe"),
    ]:
        with monkeypatch.context() as m:
            m.setenv(name, bad)
            message = str(pytest.raises(ConfigError, load_settings).value)
        assert message.startswith(f"{name}: ") and "\n" not in message


def test_the_supplier_clients_bounds(monkeypatch: pytest.MonkeyPatch):
    s = load_settings()
    unset = (s.supplier_request_deadline, s.supplier_max_body_bytes, s.supplier_max_decoded_bytes)
    assert unset == (None, None, None)
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_REQUEST_DEADLINE", "2.5")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_MAX_BODY_BYTES", "1048576")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_MAX_DECODED_BYTES", "4194304")
    s = load_settings()
    assert (
        s.supplier_request_deadline,
        s.supplier_max_body_bytes,
        s.supplier_max_decoded_bytes,
    ) == (2.5, 2**20, 4 * 2**20)
    for name, bad in [
        ("SUPPLIER_SYNC_SUPPLIER_REQUEST_DEADLINE", "0"),
        ("SUPPLIER_SYNC_SUPPLIER_REQUEST_DEADLINE", "60s"),
        ("SUPPLIER_SYNC_SUPPLIER_REQUEST_DEADLINE", "nan"),
        ("SUPPLIER_SYNC_SUPPLIER_REQUEST_DEADLINE", "3600"),
        ("SUPPLIER_SYNC_SUPPLIER_MAX_BODY_BYTES", "8MB"),
        ("SUPPLIER_SYNC_SUPPLIER_MAX_BODY_BYTES", "12"),
        ("SUPPLIER_SYNC_SUPPLIER_MAX_DECODED_BYTES", "-1"),
    ]:
        with monkeypatch.context() as m:
            m.setenv(name, bad)
            message = str(pytest.raises(ConfigError, load_settings).value)
        assert message.startswith(f"{name}: ") and "\n" not in message


@pytest.mark.parametrize(
    ("field", "unset", "good", "bad"),
    [
        # The clock skew: an hour unless set, within a week.
        ("max_clock_skew_seconds", 3600.0, ("0", "120.5"), ("-1", "604801", "an hour")),
        # The shard lease: three minutes unless set, within 5-1800 s.
        ("lease_seconds", 180.0, ("5", "6", "1800"), ("4.9", "1801", "3 minutes")),
    ],
)
def test_a_seconds_setting_has_its_default_and_its_bounds(
    monkeypatch: pytest.MonkeyPatch,
    field: str,
    unset: float,
    good: tuple[str, ...],
    bad: tuple[str, ...],
):
    name = env_name(field)
    assert getattr(load_storage_settings(), field) == unset
    for value in good:
        monkeypatch.setenv(name, value)
        assert getattr(load_settings(), field) == float(value)
    for value in (*bad, "nan", "inf"):
        monkeypatch.setenv(name, value)
        message = str(pytest.raises(ConfigError, load_storage_settings).value)
        assert message.startswith(f"{name}: "), message
        assert "\n" not in message


def test_an_empty_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch):
    for name in ALL:
        monkeypatch.setenv(name, "")
    s = load_settings()
    assert s == Settings(home=Path(".supplier_sync"))
    assert s.supplier_url is None and s.api_key() is None


def test_read_when_asked(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", "http://first")
    first = load_settings()
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", "http://second")
    assert first.supplier_url == "http://first"  # an object read once does not change
    assert load_settings().supplier_url == "http://second"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SUPPLIER_SYNC_SUPPLIER_URL", "api.example.com"),
        ("SUPPLIER_SYNC_SUPPLIER_URL", "ftp://api.example.com"),
        ("SUPPLIER_SYNC_REDIS_URL", "localhost:6379"),
        ("SUPPLIER_SYNC_REDIS_URL", "http://user:pw@redis:6379"),
        ("SUPPLIER_SYNC_SEARCH_URL", "mysql://user:pw@db/search"),
        ("SUPPLIER_SYNC_AMQP_URL", "http://user:pw@mq:5672"),
        ("SUPPLIER_SYNC_LINEAGE_URL", "amqp://user:pw@marquez:5000"),
        ("SUPPLIER_SYNC_LINEAGE_URL", "marquez:5000/api/v1/lineage"),
        ("SUPPLIER_SYNC_RATE_GOVERNOR", "learning"),
        ("SUPPLIER_SYNC_RATE_GOVERNOR", "Adaptive "),
        ("SUPPLIER_SYNC_RATE_MAX", "0"),
        ("SUPPLIER_SYNC_RATE_MAX", "inf"),
    ],
)
def test_a_bad_value_is_one_clear_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith(f"{name}: ") and "\n" not in message
    if name.endswith("_URL"):
        assert "://" in message  # says what is expected
    assert "pw@" not in message  # and does not echo a value that may hold a password


def test_two_bad_values_are_named_on_one_line(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", "nope")
    monkeypatch.setenv("SUPPLIER_SYNC_REDIS_URL", "nope")
    message = str(pytest.raises(ConfigError, load_settings).value)
    assert "SUPPLIER_SYNC_SUPPLIER_URL" in message and "SUPPLIER_SYNC_REDIS_URL" in message
    assert "\n" not in message


def test_core_fallbacks_read_the_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "home"))
    assert state_dir() == tmp_path / "home"
    assert resolve_db_url() == f"sqlite:///{tmp_path / 'home' / 'sync.sqlite3'}"
    store = open_payload_store()
    assert isinstance(store, LocalPayloadStore)
    assert store.root == (tmp_path / "home" / "payloads").resolve()


def test_a_bad_supplier_setting_does_not_stop_the_storage_fallbacks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", "supplier.test")
    assert load_storage_settings().state_dir == tmp_path / "home"
    assert resolve_db_url() == f"sqlite:///{tmp_path / 'home' / 'sync.sqlite3'}"
    assert set(StorageSettings.model_fields) < set(Settings.model_fields)
    with pytest.raises(ConfigError, match="SUPPLIER_SYNC_SUPPLIER_URL"):
        load_settings()


def test_the_lineage_settings_and_their_bounds(monkeypatch: pytest.MonkeyPatch):
    unset = load_settings()
    assert (unset.lineage_url, unset.lineage_key(), unset.lineage_namespace) == (None, None, None)
    good = {
        "SUPPLIER_SYNC_LINEAGE_URL": "https://marquez.internal:5000",
        "SUPPLIER_SYNC_LINEAGE_API_KEY": "lineage-key-0123456789",
        "SUPPLIER_SYNC_LINEAGE_NAMESPACE": "prod/supplier_sync",
        "SUPPLIER_SYNC_LINEAGE_TIMEOUT_SECONDS": "0.5",
        "SUPPLIER_SYNC_LINEAGE_FILE_MAX_BYTES": "65536",
    }
    for name, value in good.items():
        monkeypatch.setenv(name, value)
    s = load_settings()
    assert s.lineage_key() == "lineage-key-0123456789" and "0123456789" not in repr(s)
    assert (s.lineage_timeout_seconds, s.lineage_file_max_bytes) == (0.5, 65536)
    for name, value in (
        ("SUPPLIER_SYNC_LINEAGE_TIMEOUT_SECONDS", "0.05"),
        ("SUPPLIER_SYNC_LINEAGE_TIMEOUT_SECONDS", "31"),
        ("SUPPLIER_SYNC_LINEAGE_NAMESPACE", "two words"),
        ("SUPPLIER_SYNC_LINEAGE_FILE_MAX_BYTES", "1000"),
    ):
        monkeypatch.setenv(name, value)
        message = str(pytest.raises(ConfigError, load_settings).value)
        assert message.startswith(f"{name}: ") and "\n" not in message
        monkeypatch.setenv(name, good[name])


def test_history_retention_is_days_within_range(monkeypatch: pytest.MonkeyPatch):
    assert load_history_settings().history_retention_days == 400
    monkeypatch.setenv("SUPPLIER_SYNC_HISTORY_RETENTION_DAYS", "30")
    assert load_settings().history_retention_days == 30
    for bad in ("0", "3651", "2.5", "a year"):
        monkeypatch.setenv("SUPPLIER_SYNC_HISTORY_RETENTION_DAYS", bad)
        with pytest.raises(ConfigError, match="SUPPLIER_SYNC_HISTORY_RETENTION_DAYS"):
            load_history_settings()


def test_the_rate_governor_is_fixed_unless_told(monkeypatch: pytest.MonkeyPatch):
    assert (load_settings().rate_governor, load_settings().rate_max) == (None, None)
    monkeypatch.setenv("SUPPLIER_SYNC_RATE_GOVERNOR", "adaptive")
    monkeypatch.setenv("SUPPLIER_SYNC_RATE_MAX", "400")
    assert (load_settings().rate_governor, load_settings().rate_max) == ("adaptive", 400.0)
