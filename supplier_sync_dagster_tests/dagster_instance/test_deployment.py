"""The daemon entry point: the backfill daemon's tick, which Dagster does not let us configure."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import dagster as dg
import dagster._daemon.cli as daemon_cli
import pytest
from dagster._core.instance.ref import InstanceRef
from dagster._daemon import controller
from dagster._daemon.backfill import execute_backfill_iteration_loop
from dagster._serdes import deserialize_value

from supplier_sync_dagster.cli import main as cli
from supplier_sync_dagster.cli.parsers.servers import BACKFILL_DAEMON_INTERVAL_SECONDS
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.dagster_instance.daemon import (
    BACKFILL_CURSOR_OFFSET,
    BACKFILL_CURSOR_OFFSET_ENV,
    set_backfill_daemon_interval,
)
from supplier_sync_dagster.dagster_instance.deployment import ROOT
from supplier_sync_dagster.dagster_instance.home import EMBEDDED_DAGSTER_YAML
from supplier_sync_dagster.dagster_instance.storage import (
    POOLED_MYSQL_STORAGE,
    EmbeddedDagsterInstance,
    PooledSqliteEventLogStorage,
    PooledSqliteRunStorage,
)


class _Waits(threading.Event):
    """A shutdown event that records how long the loop would sleep, and never sleeps."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0))
        return False


@pytest.fixture
def interval() -> Iterator[None]:
    previous = set_backfill_daemon_interval(BACKFILL_DAEMON_INTERVAL_SECONDS)
    yield
    set_backfill_daemon_interval(previous)


def test_the_backfill_daemon_ticks_at_the_interval_we_set(interval: None) -> None:
    # Dagster's own loop, on an instance with no backfill: it sleeps (interval - its work).
    with dg.DagsterInstance.ephemeral() as instance:
        waits = _Waits()
        loop = execute_backfill_iteration_loop(
            SimpleNamespace(instance=instance),  # type: ignore[arg-type]
            logging.getLogger("test"),
            shutdown_event=waits,
        )
        while len(waits.waits) < 2:  # two ticks, each ending with its sleep
            next(loop)
    tick = BACKFILL_DAEMON_INTERVAL_SECONDS
    assert all(tick - 2 < w <= tick for w in waits.waits), waits.waits


def test_a_non_positive_interval_is_refused(interval: None) -> None:
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="positive"):
            set_backfill_daemon_interval(bad)


def test_the_daemon_command_refuses_a_bad_interval_before_starting(
    capsys: pytest.CaptureFixture[str], interval: None
) -> None:
    # Refused as the command line is read, naming the option and its range.
    with pytest.raises(SystemExit) as exited:
        cli.main(["daemon", "--backfill-interval", "0"])
    assert exited.value.code == 2
    assert "argument --backfill-interval: must be more than 0" in capsys.readouterr().err


def test_supplier_sync_daemon_runs_dagster_daemon_with_its_arguments(
    monkeypatch: pytest.MonkeyPatch, interval: None
) -> None:
    seen: dict[str, Any] = {}

    def fake_main() -> None:
        seen["argv"] = list(sys.argv)
        seen["interval"] = controller.DEFAULT_DAEMON_INTERVAL_SECONDS
        raise SystemExit(0)

    monkeypatch.setattr(daemon_cli, "main", fake_main)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    assert cli.main(["daemon", "--backfill-interval", "7", "-w", "workspace.yaml"]) == 0
    assert seen == {"argv": ["dagster-daemon", "run", "-w", "workspace.yaml"], "interval": 7.0}


@pytest.mark.parametrize("own", [None, "250"], ids=["unset", "set by the user"])
def test_the_backfill_daemon_reads_materializations_again_below_its_cursor(
    monkeypatch: pytest.MonkeyPatch, interval: None, own: str | None
) -> None:
    """A materialization committed after a later one (another host's insert in flight) is
    still counted by the backfill: its cursor is moved back, unless the user chose how far."""
    seen: dict[str, str | None] = {}

    def fake_main() -> None:
        seen["offset"] = os.environ.get(BACKFILL_CURSOR_OFFSET_ENV)
        raise SystemExit(0)

    monkeypatch.setattr(daemon_cli, "main", fake_main)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    if own is None:
        monkeypatch.delenv(BACKFILL_CURSOR_OFFSET_ENV, raising=False)
    else:
        monkeypatch.setenv(BACKFILL_CURSOR_OFFSET_ENV, own)
    assert cli.main(["daemon", "-w", "workspace.yaml"]) == 0
    assert seen == {"offset": own or str(BACKFILL_CURSOR_OFFSET)}


def _daemon_argv(monkeypatch: pytest.MonkeyPatch, home: Path) -> list[str]:
    """What ``supplier-sync daemon`` hands Dagster's daemon with ``DAGSTER_HOME=home``."""
    seen: list[str] = []

    def fake_main() -> None:
        seen.extend(sys.argv)
        raise SystemExit(0)

    monkeypatch.setattr(daemon_cli, "main", fake_main)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    assert cli.main(["daemon", "-w", "workspace.yaml"]) == 0
    return seen


def _daemon_ref(monkeypatch: pytest.MonkeyPatch, home: Path) -> InstanceRef:
    """The ``--instance-ref`` that ``supplier-sync daemon`` hands Dagster's daemon."""
    argv = _daemon_argv(monkeypatch, home)
    assert argv[:3] == ["dagster-daemon", "run", "--instance-ref"]
    assert argv[4:] == ["-w", "workspace.yaml"]
    return deserialize_value(argv[3], InstanceRef)


def test_the_daemon_opens_a_plain_instance_through_the_pooled_storages(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, interval: None
) -> None:
    plain = "telemetry:\n  enabled: false\n"
    (tmp_path / "dagster.yaml").write_text(plain)
    ref = _daemon_ref(monkeypatch, tmp_path)
    with dg.DagsterInstance.from_ref(ref) as instance:
        # The same files, through the pooled storages; a run it launches gets the same ref.
        assert isinstance(instance.event_log_storage, PooledSqliteEventLogStorage)
        assert isinstance(instance.run_storage, PooledSqliteRunStorage)
        assert instance.root_directory == str(tmp_path)
        assert instance.get_ref() == ref
    assert (tmp_path / "dagster.yaml").read_text() == plain  # the user's file, untouched


def test_the_daemon_opens_a_stock_mysql_instance_through_the_pooled_storage(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, interval: None
) -> None:
    stock = "storage:\n  mysql:\n    mysql_url: mysql+mysqlconnector://u@h:3306/d\n"
    (tmp_path / "dagster.yaml").write_text(stock)
    ref = _daemon_ref(monkeypatch, tmp_path)
    # The production profile's storage and instance class on the same database (that it
    # opens and stores there: test_mysql_storage); the user's file untouched.
    assert ref.storage_data is not None
    assert (ref.storage_data.module_name, ref.storage_data.class_name) == POOLED_MYSQL_STORAGE
    assert ref.storage_data.config_dict == {"mysql_url": "mysql+mysqlconnector://u@h:3306/d"}
    assert ref.custom_instance_class_data is not None
    assert ref.custom_instance_class_data.class_name == EmbeddedDagsterInstance.__name__
    assert (tmp_path / "dagster.yaml").read_text() == stock


@pytest.mark.parametrize(
    "yaml",
    [
        "storage:\n  postgres:\n    postgres_url: postgresql://u@h:5432/d\n",
        # The project's own files: pooled already, by their storage and instance class.
        EMBEDDED_DAGSTER_YAML,
        (ROOT / "deploy" / "mysql" / "dagster.yaml").read_text(),
    ],
)
def test_the_daemon_leaves_other_instances_to_dagster(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, interval: None, yaml: str
) -> None:
    (tmp_path / "dagster.yaml").write_text(yaml)
    assert _daemon_argv(monkeypatch, tmp_path) == ["dagster-daemon", "run", "-w", "workspace.yaml"]
    assert _daemon_argv(monkeypatch, tmp_path / "missing")[2:] == ["-w", "workspace.yaml"]


def test_the_asset_daemon_keeps_dagster_s_interval(tmp_path: Path) -> None:
    shutil.copy(ROOT / "dagster.yaml", tmp_path / "dagster.yaml")
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        assert instance.auto_materialize_minimum_interval_seconds == 30
    mysql_profile = (ROOT / "deploy" / "mysql" / "dagster.yaml").read_text()
    assert "auto_materialize:\n  minimum_interval_seconds: 30" in mysql_profile
