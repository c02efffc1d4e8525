"""A user's plain Dagster instance (a ``dagster.yaml`` keeping Dagster's stock SQLite storage),
opened by the command line through the pooled storages on the same files.

What is promised: the user's ``dagster.yaml`` is not touched; what a run stores is read back
by a stock ``DagsterInstance`` on the same folder exactly as if Dagster's storage had written
it (per-partition materializations with their metadata, check results per partition, the
run's status); an instance with any other storage opens as Dagster opens it. A block of
events (a city's) commits at its end: a process killed inside a block leaves every earlier
block stored and none of that block's events, and the files readable.
"""

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage
from dagster._core.storage.runs.sqlite.sqlite_run_storage import SqliteRunStorage
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
)

from supplier_sync_dagster.dagster_instance.events import one_event_transaction, pooled_events
from supplier_sync_dagster.dagster_instance.home import dagster_instance
from supplier_sync_dagster.dagster_instance.storage import (
    EmbeddedDagsterInstance,
    PooledSqliteEventLogStorage,
    PooledSqliteRunStorage,
    pooled_ref,
)
from supplier_sync_dagster_tests.dagster_instance.test_storage import (
    ASSET,
    CHECK,
    PARTITIONS,
    cities,
)

PLAIN_YAML = "telemetry:\n  enabled: false\n"


@pytest.fixture
def plain_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's DAGSTER_HOME: a stock ``dagster.yaml`` naming no storage."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(PLAIN_YAML)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


def check_results(instance: dg.DagsterInstance) -> dict[str, str]:
    """Partition -> the status of its evaluation of the check."""
    checks = instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(ASSET, CHECK), limit=100
    )
    return {str(c.partition): c.status.value for c in checks}


def per_partition(instance: dg.DagsterInstance) -> dict[str, object]:
    """Partition -> the ``rows`` metadata of its latest materialization."""
    records = instance.fetch_materializations(ASSET, limit=100).records
    out: dict[str, object] = {}
    for record in records:
        m = record.asset_materialization
        assert m is not None and m.partition is not None
        out.setdefault(m.partition, m.metadata["rows"].value)
    return out


def test_a_plain_instance_runs_on_the_pooled_storages_and_dagster_reads_it_back(
    plain_home: Path,
) -> None:
    with dagster_instance() as instance:
        assert isinstance(instance, EmbeddedDagsterInstance)
        assert isinstance(instance.event_log_storage, PooledSqliteEventLogStorage)
        assert isinstance(instance.run_storage, PooledSqliteRunStorage)
        result = dg.materialize(
            [cities],
            instance=instance,
            tags={ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "c"},
        )
        assert result.success
    assert (plain_home / "dagster.yaml").read_text() == PLAIN_YAML
    assert (plain_home / "history" / "runs" / "index.db").exists()  # Dagster's own layout
    # Dagster's own instance on the folder, as the user's webserver opens it.
    with dg.DagsterInstance.from_config(str(plain_home)) as stock:
        assert type(stock) is dg.DagsterInstance
        assert type(stock.event_log_storage) is SqliteEventLogStorage
        assert type(stock.run_storage) is SqliteRunStorage
        run = stock.get_run_by_id(result.run_id)
        assert run is not None and run.status == dg.DagsterRunStatus.SUCCESS
        assert per_partition(stock) == {"a": 1, "b": 1, "c": 1}
        assert check_results(stock) == {"a": "SUCCEEDED", "b": "SUCCEEDED", "c": "SUCCEEDED"}
        # And a run of Dagster's own storage is read by the next command's pooled one.
        later = dg.materialize([cities], instance=stock, partition_key="d")
    with dagster_instance() as instance:
        assert instance.get_run_by_id(later.run_id) is not None
        assert set(per_partition(instance)) == {"a", "b", "c", "d"}


def test_storage_sqlite_with_its_own_folder_is_pooled_there(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (tmp_path / "dagster.yaml").write_text(f"storage:\n  sqlite:\n    base_dir: {elsewhere}\n")
    ref = pooled_ref(InstanceRef.from_dir(str(tmp_path)))
    assert ref is not None
    with dg.DagsterInstance.from_ref(ref) as instance:
        storage = instance.event_log_storage
        assert isinstance(storage, PooledSqliteEventLogStorage)
        assert Path(storage.path_for_shard("index")).parent == elsewhere / "history" / "runs"


@pytest.mark.parametrize(
    "yaml",
    [
        # Any storage but Dagster's stock SQLite storage and dagster-mysql's (whose pooled
        # opening test_mysql_storage checks) opens as Dagster opens it.
        "storage:\n  postgres:\n    postgres_url: postgresql://u@h:5432/d\n",
        "run_storage:\n  module: dagster._core.storage.runs\n  class: SqliteRunStorage\n"
        "  config:\n    base_dir: /tmp/x\n",
        "storage:\n  sqlite:\n    base_dir:\n      env: SOME_DAGSTER_FOLDER\n",
    ],
)
def test_other_storages_are_left_to_dagster(tmp_path: Path, yaml: str) -> None:
    (tmp_path / "dagster.yaml").write_text(yaml)
    assert pooled_ref(InstanceRef.from_dir(str(tmp_path))) is None


class UsersInstance(dg.DagsterInstance):
    """A user's own instance class."""

    @classmethod
    def config_schema(cls) -> dict[str, object]:
        """No settings."""
        return {}

    @staticmethod
    def config_defaults(base_dir: str) -> object:
        """Dagster's."""
        return InstanceRef.config_defaults(base_dir)


def test_a_user_s_own_instance_class_is_kept(tmp_path: Path) -> None:
    (tmp_path / "dagster.yaml").write_text(
        f"instance_class:\n  module: {__name__}\n  class: UsersInstance\n"
    )
    ref = pooled_ref(InstanceRef.from_dir(str(tmp_path)))
    assert ref is not None
    with dg.DagsterInstance.from_ref(ref) as instance:
        assert type(instance) is UsersInstance
        assert isinstance(instance.event_log_storage, PooledSqliteEventLogStorage)


_KILLED_IN_A_BLOCK = textwrap.dedent(
    """
    import sys, time
    import dagster as dg
    from supplier_sync_dagster.dagster_instance.events import one_event_transaction
    from supplier_sync_dagster.dagster_instance.home import dagster_instance
    instance = dagster_instance()
    for block, keys in enumerate((["a", "b"], ["c", "d"])):
        with one_event_transaction(instance):
            for key in keys:
                instance.report_runless_asset_event(
                    dg.AssetMaterialization("cities", partition=key, metadata={"rows": 1})
                )
            if block == 1:
                print("inside", flush=True)
                time.sleep(60)
        print("committed", flush=True)
    """
)


def test_a_process_killed_inside_a_block_keeps_every_earlier_block(plain_home: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_IN_A_BLOCK],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "DAGSTER_HOME": str(plain_home)},
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "committed"
    assert child.stdout.readline().strip() == "inside"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    with dg.DagsterInstance.from_config(str(plain_home)) as stock:
        assert type(stock.event_log_storage) is SqliteEventLogStorage
        assert per_partition(stock) == {"a": 1, "b": 1}
        stock.report_runless_asset_event(
            dg.AssetMaterialization(ASSET, partition="e", metadata={"rows": 1})
        )
        assert set(per_partition(stock)) == {"a", "b", "e"}
    assert (plain_home / "dagster.yaml").read_text() == PLAIN_YAML


SEEN: list[tuple[str, bool, set[str]]] = []


@dg.multi_asset(
    specs=[dg.AssetSpec(ASSET, skippable=True)],
    partitions_def=PARTITIONS,
    backfill_policy=dg.BackfillPolicy.single_run(),
    can_subset=True,
)
def worker_cities(context: dg.AssetExecutionContext) -> Iterator[dg.AssetMaterialization]:
    """As the city_sync step of a run worker: pooled events, a block per partition; notes what
    another process's stock instance sees while the block is open."""
    with pooled_events(context.instance):
        for key in context.partition_keys:
            with one_event_transaction(context.instance):
                yield dg.AssetMaterialization(ASSET, partition=key, metadata={"rows": 2})
                storage = context.instance.event_log_storage
                with dg.DagsterInstance.from_config(os.environ["DAGSTER_HOME"]) as other:
                    SEEN.append(
                        (
                            key,
                            isinstance(storage, PooledSqliteEventLogStorage),
                            set(per_partition(other)),
                        )
                    )
    assert type(context.instance.event_log_storage) is SqliteEventLogStorage


def test_a_run_worker_s_step_stores_through_the_pooled_log_of_a_stock_instance(
    plain_home: Path,
) -> None:
    SEEN.clear()
    # A run worker's instance: Dagster's, from the user's dagster.yaml.
    with dg.DagsterInstance.from_config(str(plain_home)) as instance:
        assert type(instance.event_log_storage) is SqliteEventLogStorage
        result = dg.materialize(
            [worker_cities],
            instance=instance,
            tags={ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "d"},
        )
        assert result.success
        assert type(instance.event_log_storage) is SqliteEventLogStorage
    # Each partition's event was in its open block, unseen by others; then all of them.
    assert [
        ("a", True, set()),
        ("b", True, {"a"}),
        ("c", True, {"a", "b"}),
        ("d", True, {"a", "b", "c"}),
    ] == SEEN
    with dg.DagsterInstance.from_config(str(plain_home)) as stock:
        assert per_partition(stock) == {"a": 2, "b": 2, "c": 2, "d": 2}
        run = stock.get_run_by_id(result.run_id)
        assert run is not None and run.status == dg.DagsterRunStatus.SUCCESS
    assert (plain_home / "dagster.yaml").read_text() == PLAIN_YAML


def test_other_instances_keep_their_event_log(plain_home: Path) -> None:
    with dagster_instance() as instance:
        before = instance.event_log_storage
        with pooled_events(instance):
            assert instance.event_log_storage is before
