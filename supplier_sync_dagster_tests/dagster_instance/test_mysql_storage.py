"""The production profile's pooled dagster-mysql storage, on MariaDB.

What is promised: ``deploy/mysql/dagster.yaml`` opens :class:`PooledMySQLStorage`; what a run
stores is read back by an instance with dagster-mysql's own ``storage: mysql`` on the same
database (per-partition materializations with their metadata, check results per partition,
the run's status). Each event is committed as it is stored, as dagster-mysql does; a forked
child leaves the parent's pooled connections working.
"""

import multiprocessing
import shutil
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
)
from dagster_mysql import MySQLEventLogStorage

from supplier_sync_dagster.dagster_instance.deployment import ROOT
from supplier_sync_dagster.dagster_instance.events import one_event_transaction, stored_target
from supplier_sync_dagster.dagster_instance.mysql_storage import (
    PooledMySQLEventLogStorage,
    PooledMySQLRunStorage,
    PooledMySQLStorage,
)
from supplier_sync_dagster_tests.dagster_instance.test_plain_instance import (
    check_results,
    per_partition,
)
from supplier_sync_dagster_tests.dagster_instance.test_storage import (
    ASSET,
    cities,
    read_target,
    report_city,
)

STOCK_YAML = "storage:\n  mysql:\n    mysql_url:\n      env: DAGSTER_MYSQL_URL\n"


@pytest.fixture
def homes(
    fresh_mysql_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, Path]]:
    """(the production profile's home, a home with dagster-mysql's own storage), one database."""
    url = sa.make_url(fresh_mysql_db).set(drivername="mysql+mysqlconnector", query={})
    monkeypatch.setenv("DAGSTER_MYSQL_URL", url.render_as_string(hide_password=False))
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    ours.mkdir()
    stock.mkdir()
    shutil.copy(ROOT / "deploy" / "mysql" / "dagster.yaml", ours / "dagster.yaml")
    (stock / "dagster.yaml").write_text(STOCK_YAML)
    yield ours, stock


def _report(instance: dg.DagsterInstance, partition: str) -> None:
    instance.report_runless_asset_event(
        dg.AssetMaterialization(ASSET, partition=partition, metadata={"rows": 1})
    )


def test_the_profile_runs_on_the_pooled_storage_and_dagster_mysql_reads_it(
    homes: tuple[Path, Path],
) -> None:
    ours, stock_home = homes
    with dg.DagsterInstance.from_config(str(ours)) as instance:
        assert isinstance(instance.event_log_storage, PooledMySQLEventLogStorage)
        assert isinstance(instance.run_storage, PooledMySQLRunStorage)
        assert isinstance(instance.get_ref().storage, PooledMySQLStorage)
        result = dg.materialize(
            [cities],
            instance=instance,
            tags={ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "c"},
        )
        assert result.success
    with dg.DagsterInstance.from_config(str(stock_home)) as stock:
        assert type(stock.event_log_storage) is MySQLEventLogStorage
        run = stock.get_run_by_id(result.run_id)
        assert run is not None and run.status == dg.DagsterRunStatus.SUCCESS
        assert per_partition(stock) == {"a": 1, "b": 1, "c": 1}
        assert check_results(stock) == {"a": "SUCCEEDED", "b": "SUCCEEDED", "c": "SUCCEEDED"}


def test_a_block_stores_each_event_at_once(homes: tuple[Path, Path]) -> None:
    """No transaction spans a city's events on MySQL: an event's id is allocated when it is
    inserted, so a reader that remembers the highest id it saw (the backfill daemon) would
    skip events committed after a later id of another run."""
    ours, stock_home = homes
    with (
        dg.DagsterInstance.from_config(str(ours)) as instance,
        dg.DagsterInstance.from_config(str(stock_home)) as stock,
    ):
        seen: list[set[str]] = []
        with one_event_transaction(instance):
            _report(instance, "a")
            seen.append(set(per_partition(stock)))
            _report(instance, "b")
            seen.append(set(per_partition(stock)))
        assert seen == [{"a"}, {"a", "b"}]


def _child(home: str) -> None:
    """A forked process that ends normally without touching the instance."""


def test_a_forked_child_leaves_the_parent_s_connections_working(
    homes: tuple[Path, Path],
) -> None:
    ours, _ = homes
    with dg.DagsterInstance.from_config(str(ours)) as instance:
        _report(instance, "a")  # a pooled connection is open now
        for _ in range(2):
            child = multiprocessing.get_context("fork").Process(target=_child, args=(str(ours),))
            child.start()
            child.join(timeout=60)
            assert child.exitcode == 0
            _report(instance, "b")
        assert set(per_partition(instance)) == {"a", "b"}


def test_the_pooled_event_log_remembers_what_it_stored_and_dagster_mysql_does_not(
    homes: tuple[Path, Path],
) -> None:
    ours, stock_home = homes
    with dg.DagsterInstance.from_config(str(ours)) as instance:
        report_city(instance, "a")
        first = stored_target(instance, ASSET, "a")
        assert first is not None and first == read_target(instance, "a")
        report_city(instance, "a", rows=2)
        assert stored_target(instance, ASSET, "a") == read_target(instance, "a") != first
        assert stored_target(instance, ASSET, "b") is None
    with dg.DagsterInstance.from_config(str(stock_home)) as stock:
        report_city(stock, "b")
        assert stored_target(stock, ASSET, "b") is None
