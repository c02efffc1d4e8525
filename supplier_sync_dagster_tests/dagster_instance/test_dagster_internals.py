"""What ``dagster_instance/`` uses of Dagster's private modules, checked one by one.

A Dagster upgrade that renames, removes or re-signs any of it fails here with a message naming
the symbol, before the behaviour tests (``test_storage.py``, ``test_deployment.py``, the
integration tests) fail for a reason that is harder to read. The package outside
``dagster_instance/`` imports no private Dagster module (the last test).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import dagster as dg
import pytest
from dagster._cli import api as dagster_cli_api
from dagster._core.events import DagsterEvent, DagsterEventType, StepMaterializationData
from dagster._core.events.log import EventLogEntry
from dagster._core.execution import asset_backfill
from dagster._core.instance.ref import InstanceRef
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus
from dagster._core.remote_origin import RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.storage.event_log.sqlite.sqlite_event_log import (
    SqliteEventLogStorage,
    SqliteEventLogStorageWatchdog,
)
from dagster._core.storage.runs.sqlite.sqlite_run_storage import SqliteRunStorage
from dagster._core.storage.sqlite_storage import DagsterSqliteStorage
from dagster._daemon import cli as daemon_cli
from dagster._daemon import controller
from dagster._serdes import serialize_value
from dagster_celery import make_app as celery_make_app
from dagster_mysql import utils as mysql_utils

from supplier_sync_dagster.dagster_instance import (
    celery_launcher,
    events,
    mysql_storage,
    run_launcher,
    storage,
)
from supplier_sync_dagster.dagster_instance.daemon import (
    BACKFILL_CURSOR_OFFSET,
    BACKFILL_CURSOR_OFFSET_ENV,
)
from supplier_sync_dagster.dagster_instance.home import EMBEDDED_DAGSTER_YAML

PACKAGE = Path(storage.__file__).resolve().parents[1]
ADAPTER = PACKAGE / "dagster_instance"
VERSION = dg.__version__

# Methods of our subclasses that are our own, not overrides of a Dagster method.
OWN_METHODS: dict[type, set[str]] = {
    storage.PooledSqliteEventLogStorage: {
        "_engine",
        "_store_check_evaluation",
        "one_transaction",
        "cached_shards",
        "_dispose_engines",
    },
    storage.PooledSqliteRunStorage: {"_engine"},
    mysql_storage.PooledMySQLStorage: {"_own"},
    mysql_storage.PooledMySQLEventLogStorage: {
        "batched",
        "flush",
        "forget_blocks",
        "_supports_returning",
        "_store_together",
        "_insert_together",
        "_store_stored_rows",
        "_store_block_rows",
    },
}
# Methods of a custom instance class that Dagster looks up by name (no base defines them),
# and the module whose code calls them.
INSTANCE_HOOKS = {
    "config_schema": "dagster._core.instance.config",
    "config_defaults": "dagster._core.instance.ref",
}
OURS = (
    storage.PooledSqliteEventLogStorage,
    storage.PooledSqliteRunStorage,
    storage.EmbeddedSqliteStorage,
    storage.EmbeddedDagsterInstance,
    storage.WalAwareWatchdog,
    run_launcher.LocalRunLauncher,
    celery_launcher.HostCeleryRunLauncher,
    mysql_storage.PooledMySQLEventLogStorage,
    mysql_storage.PooledMySQLRunStorage,
    mysql_storage.PooledMySQLStorage,
)
# Dagster methods our code calls (not overrides), with the parameters it passes.
CALLED: list[tuple[Any, str, list[str]]] = [
    (SqliteEventLogStorage, "conn_string_for_shard", ["self", "shard_name"]),
    (SqliteEventLogStorage, "_initdb", ["self", "engine"]),
    (SqliteEventLogStorage, "run_connection", ["self", "run_id"]),
    (SqliteEventLogStorage, "index_connection", ["self"]),
    (SqliteEventLogStorage, "index_transaction", ["self"]),
    (SqliteEventLogStorage, "_event_to_row", ["self", "event"]),
    (SqliteEventLogStorage, "_store_asset_event_tags", ["self", "conn", "events", "event_ids"]),
    (SqliteEventLogStorage, "_event_insert_timestamp", ["self", "event"]),
    (SqliteEventLogStorage, "_has_asset_key_index_cols_on_connection", ["self", "conn"]),
    (SqliteEventLogStorage, "store_asset_check_event", ["self", "event", "event_id"]),
    (SqliteEventLogStorage, "end_watch", ["self", "run_id", "handler"]),
    (SqliteEventLogStorageWatchdog, "_process_log", ["self"]),
    (SqliteRunStorage, "from_local", ["cls", "base_dir", "inst_data"]),
    (dg.DagsterInstance, "_get_event_batch_size", ["self"]),
    (InstanceRef, "config_defaults", ["base_dir"]),
    (InstanceRef, "from_dir", ["base_dir"]),
    (SqliteEventLogStorage, "register_instance", ["self", "instance"]),
    (mysql_storage.MySQLEventLogStorage, "prepare_insert_event_batch", ["self", "events"]),
    (mysql_storage.MySQLEventLogStorage, "run_connection", ["self", "run_id"]),
    (mysql_storage.MySQLEventLogStorage, "index_transaction", ["self"]),
    (
        mysql_storage.MySQLEventLogStorage,
        "_store_asset_event_tags",
        ["self", "conn", "events", "event_ids"],
    ),
    (mysql_storage.MySQLEventLogStorage, "store_asset_check_event", ["self", "event", "event_id"]),
    (mysql_utils, "create_mysql_connection", ["engine", "dunder_file", "storage_type_desc"]),
    (mysql_utils, "mysql_url_from_config", ["config_value"]),
    (celery_make_app, "make_app", ["app_args"]),
]


def _private_imports(path: Path) -> Iterator[tuple[str, str | None, int]]:
    """(module, imported name or None, line) of each import of a private Dagster module."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("dagster._"):
                for alias in node.names:
                    yield node.module, alias.name, node.lineno
            elif node.module == "dagster":
                for alias in node.names:
                    if alias.name.startswith("_"):
                        yield f"dagster.{alias.name}", None, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dagster._"):
                    yield alias.name, None, node.lineno


def _adapter_imports() -> list[tuple[str, str | None, str]]:
    return sorted(
        {
            (module, name, f"{path.relative_to(PACKAGE.parent)}:{line}")
            for path in ADAPTER.glob("*.py")
            for module, name, line in _private_imports(path)
        }
    )


@pytest.mark.parametrize(("module", "name", "where"), _adapter_imports())
def test_every_private_name_the_adapter_imports_exists(
    module: str, name: str | None, where: str
) -> None:
    try:
        found = importlib.import_module(module)
    except ImportError as err:
        pytest.fail(f"Dagster {VERSION} has no module {module} ({where} imports it): {err}")
    if name is not None:
        assert hasattr(found, name), f"Dagster {VERSION}: {module}.{name} is gone ({where})"


def _library_bases(cls: type) -> list[type]:
    """The bases of ``cls`` that Dagster (or a library it builds on: watchdog) defines."""
    return [
        base
        for base in cls.__mro__[1:]
        if base is not object and not base.__module__.startswith("supplier_sync_dagster")
    ]


def _params(fn: Any, *, named_only: bool = False) -> list[str]:
    target: Any = fn.fget if isinstance(fn, property) else getattr(fn, "__func__", fn)
    params = inspect.signature(target).parameters.values()
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in params if not (named_only and p.kind in variadic)]


def _overrides(cls: type) -> list[str]:
    own = OWN_METHODS.get(cls, set())
    return [
        name
        for name, value in vars(cls).items()
        if (callable(value) or isinstance(value, (property, classmethod, staticmethod)))
        and name not in own
        and (name == "__init__" or not name.startswith("__"))
    ]


@pytest.mark.parametrize(
    ("cls", "name"),
    [
        (cls, name)
        for cls in OURS
        for name in _overrides(cls)
        if not (cls is storage.EmbeddedDagsterInstance and name in INSTANCE_HOOKS)
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_each_override_still_overrides_a_dagster_method_of_the_same_signature(
    cls: type, name: str
) -> None:
    """An override whose Dagster method was renamed would silently stop being called; one
    whose Dagster method takes other parameters would be called wrongly. An override may add
    parameters of its own after Dagster's (a constructor's options)."""
    ours = inspect.getattr_static(cls, name)
    theirs = next((vars(b)[name] for b in _library_bases(cls) if name in vars(b)), None)
    assert theirs is not None, (
        f"Dagster {VERSION}: no base of {cls.__name__} defines {name} any more, so "
        f"{cls.__module__}.{cls.__name__}.{name} is never called"
    )
    assert type(ours) is type(theirs) or not isinstance(theirs, (property, staticmethod)), (
        f"Dagster {VERSION}: {name} of {cls.__name__}'s base is a {type(theirs).__name__} now"
    )
    expected = _params(theirs, named_only=True)
    assert _params(ours, named_only=True)[: len(expected)] == expected, (
        f"Dagster {VERSION}: {name}{expected} of {cls.__name__}'s base no longer "
        f"matches our override {name}{_params(ours)}"
    )


@pytest.mark.parametrize(("name", "caller"), sorted(INSTANCE_HOOKS.items()))
def test_dagster_still_calls_the_instance_class_hooks(name: str, caller: str) -> None:
    source = inspect.getsource(importlib.import_module(caller))
    assert f"custom_instance_class.{name}(" in source, (
        f"Dagster {VERSION}: {caller} no longer calls a custom instance class's {name}, so "
        f"EmbeddedDagsterInstance.{name} is never called"
    )


@pytest.mark.parametrize(
    ("cls", "name", "params"), CALLED, ids=[f"{c.__name__}.{n}" for c, n, _ in CALLED]
)
def test_each_dagster_method_we_call_keeps_its_parameters(
    cls: Any, name: str, params: list[str]
) -> None:
    method = inspect.getattr_static(cls, name, None)
    assert method is not None, f"Dagster {VERSION}: {cls.__name__}.{name} is gone"
    assert _params(method)[: len(params)] == params, (
        f"Dagster {VERSION}: {cls.__name__}.{name} takes {_params(method)}, not {params}"
    )


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    (tmp_path / "dagster.yaml").write_text(EMBEDDED_DAGSTER_YAML)
    with dg.DagsterInstance.from_config(str(tmp_path)) as made:
        yield made


def test_the_private_attributes_we_read_are_set_by_dagster(instance: dg.DagsterInstance) -> None:
    event_log = instance.event_log_storage
    assert isinstance(event_log, storage.PooledSqliteEventLogStorage)
    for name in ("_db_lock", "_initialized_dbs", "_obs", "_watchers", "_base_dir"):
        assert hasattr(event_log, name), f"Dagster {VERSION}: SqliteEventLogStorage.{name} is gone"
    assert hasattr(instance.run_storage, "_conn_string"), (
        f"Dagster {VERSION}: SqliteRunStorage._conn_string is gone"
    )
    assert isinstance(instance, storage.EmbeddedDagsterInstance)
    assert instance._event_storage is event_log, (
        f"Dagster {VERSION}: DagsterInstance._event_storage is not the event log storage"
    )
    assert hasattr(instance.run_launcher, "_instance"), (
        f"Dagster {VERSION}: a run launcher has no _instance"
    )
    watchdog = storage.WalAwareWatchdog(event_log, "a-run", lambda *_: None, None)
    assert watchdog._log_path == event_log.path_for_shard("a-run"), (
        f"Dagster {VERSION}: SqliteEventLogStorageWatchdog._log_path is not the run's shard"
    )


def test_dagster_s_sqlite_storage_reads_the_attributes_we_set(instance: dg.DagsterInstance) -> None:
    """EmbeddedSqliteStorage sets DagsterSqliteStorage's attributes instead of calling its
    __init__ (which would open Dagster's own storages first)."""
    base_dir = str(Path(instance.root_directory))
    made = storage.EmbeddedSqliteStorage(base_dir)
    try:
        assert isinstance(made, DagsterSqliteStorage)
        for public, private in (
            ("run_storage", "_run_storage"),
            ("event_log_storage", "_event_log_storage"),
            ("schedule_storage", "_schedule_storage"),
        ):
            assert getattr(made, public) is getattr(made, private), (
                f"Dagster {VERSION}: DagsterSqliteStorage.{public} no longer reads {private}"
            )
    finally:
        made.run_storage.dispose()
        made.event_log_storage.dispose()


def test_a_plain_dagster_yaml_still_means_dagster_s_sqlite_storage(tmp_path: Path) -> None:
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    data = InstanceRef.from_dir(str(tmp_path)).storage_data
    assert data is not None
    assert (data.module_name, data.class_name) == storage.STOCK_SQLITE_STORAGE, (
        f"Dagster {VERSION}: a dagster.yaml without storage is {data.class_name} now"
    )
    assert data.config_dict == {"base_dir": str(tmp_path)}


def test_dagster_mysql_s_storages_keep_the_attributes_we_replace() -> None:
    for cls in (mysql_storage.MySQLEventLogStorage, mysql_storage.MySQLRunStorage):
        assert "self._engine = create_engine(" in inspect.getsource(cls.__init__), (
            f"dagster-mysql: {cls.__name__}.__init__ no longer makes self._engine"
        )
    source = inspect.getsource(mysql_storage.DagsterMySQLStorage)
    for name in ("_run_storage", "_event_log_storage", "_schedule_storage", "_inst_data"):
        assert f"self.{name}" in source, f"dagster-mysql: DagsterMySQLStorage.{name} is gone"


def test_the_instance_defaults_we_replace_are_dagster_s_keys(tmp_path: Path) -> None:
    theirs = InstanceRef.config_defaults(str(tmp_path))
    ours = storage.EmbeddedDagsterInstance.config_defaults(str(tmp_path))
    for key in ("storage", "run_storage", "event_log_storage"):
        assert key in theirs, f"Dagster {VERSION}: InstanceRef.config_defaults has no {key!r}"
    assert set(ours) == set(theirs), f"Dagster {VERSION}: default keys {sorted(theirs)}"


def test_an_event_log_record_serializes_as_the_fast_store_writes_it() -> None:
    """``_get_asset_entry_values`` writes ``last_materialization`` from the event's own text."""
    entry = EventLogEntry(
        error_info=None,
        level=20,
        user_message="",
        run_id="a-run",
        timestamp=1.5,
        step_key="city_sync",
        job_name="a_job",
        dagster_event=DagsterEvent(
            DagsterEventType.ASSET_MATERIALIZATION.value,
            "a_job",
            event_specific_data=StepMaterializationData(
                dg.AssetMaterialization("cities", partition="a", metadata={"rows": 1})
            ),
        ),
    )
    record = dg.EventLogRecord(storage_id=7, event_log_entry=entry)
    fast = (
        '{"__class__": "EventLogRecord", "event_log_entry": '
        f'{serialize_value(entry)}, "storage_id": 7}}'
    )
    assert serialize_value(record) == fast, (
        f"Dagster {VERSION}: serialize_value(EventLogRecord) is no longer "
        '{"__class__", "event_log_entry", "storage_id"} with sorted keys'
    )
    assert json.loads(fast)["storage_id"] == 7


def test_a_check_target_is_what_an_evaluation_takes() -> None:
    target = events.CheckTarget(run_id="a-run", storage_id=7, timestamp=1.5)
    evaluation = dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey("cities"),
        check_name="rows_positive",
        passed=True,
        target_materialization_data=target,
    )
    assert evaluation.target_materialization_data == target, (
        f"Dagster {VERSION}: AssetCheckEvaluation drops target_materialization_data"
    )


def _fields(cls: type) -> set[str]:
    return set(getattr(cls, "_fields", ()))


def test_the_run_launcher_s_health_types_are_dagster_s() -> None:
    result = CheckRunHealthResult(WorkerStatus.FAILED, "gone", run_worker_id="42")
    assert (result.status, result.msg, result.run_worker_id) == (WorkerStatus.FAILED, "gone", "42")
    assert {"RUNNING", "FAILED"} <= {s.name for s in WorkerStatus}, (
        f"Dagster {VERSION}: WorkerStatus has no RUNNING or FAILED"
    )
    assert "repository_origin" in _fields(RemoteJobOrigin), (
        f"Dagster {VERSION}: RemoteJobOrigin.repository_origin is gone"
    )
    assert "code_location_origin" in _fields(RemoteRepositoryOrigin), (
        f"Dagster {VERSION}: RemoteRepositoryOrigin.code_location_origin is gone"
    )


def test_the_run_entry_point_a_worker_host_calls_keeps_its_arguments() -> None:
    """``celery_launcher.execute_run_forked`` calls ``dagster api execute_run``'s function."""
    command = dagster_cli_api.execute_run_command
    assert command.callback is not None, f"Dagster {VERSION}: execute_run has no function"
    params = list(inspect.signature(command.callback).parameters)
    assert params == ["input_json", "compressed_input_json"], f"Dagster {VERSION}: {params}"


def test_the_daemon_interval_is_a_module_constant() -> None:
    """``set_backfill_daemon_interval`` sets it (``test_deployment`` checks that the backfill
    daemon reads it)."""
    assert isinstance(controller.DEFAULT_DAEMON_INTERVAL_SECONDS, (int, float)), (
        f"Dagster {VERSION}: dagster._daemon.controller.DEFAULT_DAEMON_INTERVAL_SECONDS is gone"
    )


def test_the_backfill_cursor_moves_back_by_the_offset_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``run_daemon`` sets ``ASSET_BACKFILL_CURSOR_OFFSET``: Dagster's backfill iteration
    reads it for its next cursor (the newest event id less the offset)."""
    event_log = SimpleNamespace(get_maximum_record_id=lambda: 50_000)
    queryer = SimpleNamespace(instance=SimpleNamespace(event_log_storage=event_log))
    monkeypatch.setenv(BACKFILL_CURSOR_OFFSET_ENV, str(BACKFILL_CURSOR_OFFSET))
    cursor = asset_backfill._get_next_latest_storage_id(queryer)  # type: ignore[arg-type]
    assert cursor == 50_000 - BACKFILL_CURSOR_OFFSET, (
        f"Dagster {VERSION}: {BACKFILL_CURSOR_OFFSET_ENV} no longer moves the cursor ({cursor})"
    )


def test_the_daemon_command_is_a_function_of_no_arguments() -> None:
    """``run_daemon`` sets ``sys.argv`` and calls ``dagster._daemon.cli.main()``."""
    main = getattr(daemon_cli, "main", None)
    assert callable(main), f"Dagster {VERSION}: dagster._daemon.cli.main is gone"
    required = [
        p
        for p in inspect.signature(main).parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    assert not required, f"Dagster {VERSION}: dagster._daemon.cli.main() now needs {required}"


def test_no_module_outside_dagster_instance_imports_a_private_dagster_module() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}" + (f".{name}" if name else "")
        for path in sorted(PACKAGE.rglob("*.py"))
        if ADAPTER not in path.parents
        for module, name, line in _private_imports(path)
    ]
    assert not found, (
        "Dagster's private modules are imported only under dagster_instance/, behind "
        f"dagster_instance/events.py: {found}"
    )
