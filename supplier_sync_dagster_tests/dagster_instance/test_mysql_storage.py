"""The production profile's pooled dagster-mysql storage, on MariaDB.

What is promised: ``deploy/mysql/dagster.yaml`` opens :class:`PooledMySQLStorage`; what a run
stores is read back by an instance with dagster-mysql's own ``storage: mysql`` on the same
database (per-partition materializations with their metadata, check results per partition,
the run's status). Outside a block each event is committed as it is stored, as dagster-mysql
does; a block's events are inserted by one statement (never one transaction holding their
ids), before a check target is looked up and when the block ends, even when it raises; a
forked child leaves the parent's pooled connections working; a partition's latest check
result is read through the index the storage adds, and dagster-mysql's storage still works
on the table; a run's planned events are one insert, and stored once even when their asset
and check rows fail to be written.
"""

import gc
import multiprocessing
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import dagster as dg
import pymysql
import pytest
import sqlalchemy as sa
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.events import AssetMaterializationPlannedData
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.event_log.schema import AssetCheckExecutionsTable
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
)
from dagster_mysql import MySQLEventLogStorage

from supplier_sync_dagster.dagster_instance.daemon import daemon_instance_ref
from supplier_sync_dagster.dagster_instance.deployment import ROOT
from supplier_sync_dagster.dagster_instance.events import (
    CheckTarget,
    one_event_transaction,
    stored_target,
)
from supplier_sync_dagster.dagster_instance.mysql_storage import (
    PooledMySQLEventLogStorage,
    PooledMySQLRunStorage,
    PooledMySQLStorage,
)
from supplier_sync_dagster.dagster_instance.storage import (
    CHECK_HISTORY_INDEX,
    POOLED_MYSQL_STORAGE,
    EmbeddedDagsterInstance,
    local_instance,
    pooled_ref,
)
from supplier_sync_dagster_tests.dagster_instance.test_plain_instance import (
    check_results,
    per_partition,
)
from supplier_sync_dagster_tests.dagster_instance.test_storage import (
    ASSET,
    CHECK,
    CHECK_SPEC,
    PARTITIONS,
    cities,
    latest_check_query,
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


@dg.multi_asset(
    specs=[dg.AssetSpec(ASSET, skippable=True)],
    partitions_def=PARTITIONS,
    backfill_policy=dg.BackfillPolicy.single_run(),
    check_specs=[CHECK_SPEC],
    can_subset=True,
)
def checked_cities(context: dg.AssetExecutionContext) -> Iterator[object]:
    """As city_sync: each partition's events in a block, its check judging the materialization
    it just stored (named by the storage, not read back)."""
    for key in context.partition_keys:
        with one_event_transaction(context.instance):
            context.log.info(f"city {key}")
            yield dg.AssetMaterialization(ASSET, partition=key, metadata={"rows": len(key)})
            yield dg.AssetCheckEvaluation(
                asset_key=ASSET,
                check_name=CHECK,
                passed=key != "c",
                partition=key,
                target_materialization_data=stored_target(context.instance, ASSET, key),
            )


@dg.multi_asset(
    specs=[dg.AssetSpec(ASSET, skippable=True)],
    partitions_def=PARTITIONS,
    backfill_policy=dg.BackfillPolicy.single_run(),
    check_specs=[CHECK_SPEC],
    can_subset=True,
)
def grouped_checked_cities(context: dg.AssetExecutionContext) -> Iterator[object]:
    """As city_sync reports cities that finished together: every city's materialization,
    then every city's check, in one block."""
    with one_event_transaction(context.instance):
        for key in context.partition_keys:
            context.log.info(f"city {key}")
            yield dg.AssetMaterialization(ASSET, partition=key, metadata={"rows": len(key)})
        for key in context.partition_keys:
            yield dg.AssetCheckEvaluation(
                asset_key=ASSET,
                check_name=CHECK,
                passed=key != "c",
                partition=key,
                target_materialization_data=stored_target(context.instance, ASSET, key),
            )


def checked_target(instance: dg.DagsterInstance, partition: str) -> CheckTarget | None:
    """The materialization the partition's latest check evaluation judged."""
    records = instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(ASSET, CHECK), limit=1, partition_filter=PartitionKeyFilter(key=partition)
    )
    assert records and records[0].event is not None
    data = records[0].event.dagster_event.event_specific_data  # type: ignore[union-attr]
    assert isinstance(data, dg.AssetCheckEvaluation)
    return data.target_materialization_data


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


@pytest.fixture
def event_inserts() -> Iterator[list[str]]:
    """The INSERT statements into ``event_logs`` that any engine runs meanwhile."""
    seen: list[str] = []

    def listen(*args: Any) -> None:
        statement = str(args[2])
        if statement.lstrip().upper().startswith("INSERT INTO EVENT_LOGS"):
            seen.append(statement)

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", listen)
    yield seen
    sa.event.remove(sa.engine.Engine, "before_cursor_execute", listen)


def test_a_block_inserts_its_events_together_when_it_ends(
    homes: tuple[Path, Path], event_inserts: list[str]
) -> None:
    """No transaction spans a city's events on MySQL (an event's id is allocated when it is
    inserted, so a reader that remembers the highest id it saw would skip events committed
    after a later id of another run): the block's events are one ``INSERT ... RETURNING``,
    committed as that statement ends."""
    ours, stock_home = homes
    with (
        dg.DagsterInstance.from_config(str(ours)) as instance,
        dg.DagsterInstance.from_config(str(stock_home)) as stock,
    ):
        with one_event_transaction(instance):
            for partition in "abc":
                _report(instance, partition)
            assert per_partition(stock) == {}
            assert event_inserts == []
        assert per_partition(stock) == {"a": 1, "b": 1, "c": 1}
        assert len(event_inserts) == 1 and "RETURNING" in event_inserts[0].upper()
        # The asset's own row names the last of them, as after three single events.
        latest = stock.get_latest_materialization_event(ASSET)
        assert latest is not None and latest.dagster_event is not None
        assert latest.dagster_event.partition == "c"
        # Outside a block, each event is stored at once.
        _report(instance, "d")
        assert set(per_partition(stock)) == {"a", "b", "c", "d"}
        assert len(event_inserts) == 2


def test_a_check_target_asked_in_a_block_is_the_materialization_just_kept(
    homes: tuple[Path, Path], event_inserts: list[str]
) -> None:
    ours, stock_home = homes
    with (
        dg.DagsterInstance.from_config(str(ours)) as instance,
        dg.DagsterInstance.from_config(str(stock_home)) as stock,
    ):
        with one_event_transaction(instance):
            report_city(instance, "a")
            report_city(instance, "b", rows=2)
            target = stored_target(instance, ASSET, "a")
            assert len(event_inserts) == 1  # the lookup stored what the block kept
            assert target is not None and target == read_target(stock, "a")
            report_city(instance, "a", rows=3)
        assert stored_target(instance, ASSET, "a") == read_target(stock, "a") != target
        assert per_partition(stock) == {"a": 3, "b": 2}
        assert len(event_inserts) == 2


def test_a_block_that_raises_still_stores_the_events_it_kept(homes: tuple[Path, Path]) -> None:
    ours, stock_home = homes
    with (
        dg.DagsterInstance.from_config(str(ours)) as instance,
        dg.DagsterInstance.from_config(str(stock_home)) as stock,
    ):
        with pytest.raises(RuntimeError, match="city failed"), one_event_transaction(instance):
            _report(instance, "a")
            with one_event_transaction(instance):  # joins the outer block
                _report(instance, "b")
            raise RuntimeError("city failed")
        assert per_partition(stock) == {"a": 1, "b": 1}


def test_a_run_whose_cities_report_in_blocks_reads_back_as_dagster_mysql_s_own(
    homes: tuple[Path, Path], event_inserts: list[str]
) -> None:
    ours, stock_home = homes
    with dg.DagsterInstance.from_config(str(ours)) as instance:
        result = dg.materialize(
            [checked_cities],
            instance=instance,
            tags={ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "c"},
        )
        assert result.success
    with dg.DagsterInstance.from_config(str(stock_home)) as stock:
        assert per_partition(stock) == {"a": 1, "b": 1, "c": 1}
        assert check_results(stock) == {"a": "SUCCEEDED", "b": "SUCCEEDED", "c": "FAILED"}
        for partition in "abc":
            assert checked_target(stock, partition) == read_target(stock, partition)
        logs = stock.all_logs(result.run_id)
        assert [e.user_message for e in logs if e.user_message.startswith("city ")] == [
            "city a",
            "city b",
            "city c",
        ]
    # The run's planned events in one statement; then each city: its log line and
    # materialization in one (stored when its check asks for its target), then its check
    # alone as its block ends.
    assert sum("RETURNING" in s.upper() for s in event_inserts) == 1 + 3


def _commits_of_a_run(home: Path) -> tuple[int, str]:
    """(commits on any engine, run id) of a run of :func:`grouped_checked_cities`."""
    commits: list[object] = []

    def commit(conn: object) -> None:
        commits.append(conn)

    with dg.DagsterInstance.from_config(str(home)) as instance:
        sa.event.listen(sa.engine.Engine, "commit", commit)
        try:
            result = dg.materialize(
                [grouped_checked_cities],
                instance=instance,
                tags={ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "d"},
            )
        finally:
            sa.event.remove(sa.engine.Engine, "commit", commit)
        assert result.success
    return len(commits), result.run_id


def _assert_grouped_run_read_back(stock: dg.DagsterInstance) -> None:
    """A run of :func:`grouped_checked_cities` as dagster-mysql reads it: one materialization
    per city, each city's check result judging it."""
    assert per_partition(stock) == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert check_results(stock) == {
        "a": "SUCCEEDED",
        "b": "SUCCEEDED",
        "c": "FAILED",
        "d": "SUCCEEDED",
    }
    for partition in "abcd":
        assert checked_target(stock, partition) == read_target(stock, partition)


def test_cities_reported_together_are_two_inserts_and_their_asset_rows_one_transaction(
    homes: tuple[Path, Path], event_inserts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, stock_home = homes
    together, _ = _commits_of_a_run(ours)
    # The run's planned events in one statement; four log lines and materializations in
    # one, four checks in another.
    assert sum("RETURNING" in s.upper() for s in event_inserts) == 1 + 2
    with dg.DagsterInstance.from_config(str(stock_home)) as stock:
        _assert_grouped_run_read_back(stock)
        latest = stock.get_latest_materialization_event(ASSET)
        assert latest is not None and latest.dagster_event is not None
        assert latest.dagster_event.partition == "d"
    # The same run with each event stored on its own: a commit per log line, two per
    # materialization and per check (20); together, two inserts and two transactions.
    monkeypatch.setattr(PooledMySQLEventLogStorage, "batched", lambda _self: nullcontext())
    one_by_one, _ = _commits_of_a_run(ours)
    assert one_by_one - together >= 12, (one_by_one, together)


def _child(home: str) -> None:
    """A forked process that ends normally without touching the instance."""


def _collecting_child(home: str) -> None:
    """A forked process that collects its garbage, as a run's worker processes do every few
    seconds: what it dropped of the parent's is finalized now."""
    gc.collect()


@pytest.mark.parametrize("child_does", [_child, _collecting_child])
def test_a_forked_child_leaves_the_parent_s_connections_working(
    homes: tuple[Path, Path], child_does: Callable[[str], None]
) -> None:
    """mysql-connector's socket shuts itself down when it is finalized, and a forked child's
    socket is the parent's: a child must never finalize the parent's connections."""
    ours, _ = homes
    with dg.DagsterInstance.from_config(str(ours)) as instance:
        _report(instance, "a")  # a pooled connection is open now
        for _ in range(2):
            child = multiprocessing.get_context("fork").Process(
                target=child_does, args=(str(ours),)
            )
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


def test_a_table_found_is_not_looked_up_again(homes: tuple[Path, Path]) -> None:
    """Dagster asks whether the checks' table exists at every check evaluation."""
    ours, _ = homes
    statements: list[str] = []

    def listen(*args: Any) -> None:
        statements.append(str(args[2]))

    with dg.DagsterInstance.from_config(str(ours)) as instance:
        storage = instance.event_log_storage
        assert isinstance(storage, PooledMySQLEventLogStorage)
        assert storage.has_table("asset_check_executions")
        sa.event.listen(sa.engine.Engine, "before_cursor_execute", listen)
        try:
            assert storage.has_table("asset_check_executions")
            assert statements == []
            assert not storage.has_table("no_such_table")
            assert statements  # a table not found is asked again
        finally:
            sa.event.remove(sa.engine.Engine, "before_cursor_execute", listen)


def _check_indexes(engine: sa.Engine) -> set[str]:
    return {i["name"] or "" for i in sa.inspect(engine).get_indexes("asset_check_executions")}


def test_a_partition_s_latest_check_result_is_read_through_an_index_not_a_sort(
    homes: tuple[Path, Path],
) -> None:
    """A run reports again the gates' results of each city an earlier run of the batch
    published: without the index, MariaDB reads every result of the check for each, newest
    first, until it meets the partition's."""
    ours, stock_home = homes
    engine = sa.create_engine(sa.make_url(os.environ["DAGSTER_MYSQL_URL"]))
    try:
        with dg.DagsterInstance.from_config(str(stock_home)) as stock:
            assert dg.materialize([cities], instance=stock, partition_key="a").success
        assert CHECK_HISTORY_INDEX.name not in _check_indexes(engine)
        # Other partitions' results, as a backfill of many cities leaves them.
        others = [
            {
                "asset_key": ASSET.to_string(),
                "check_name": CHECK,
                "partition": f"city-{n:05d}",
                "run_id": f"run-{n % 40}",
                "execution_status": "SUCCEEDED",
                "evaluation_event": "{}",
            }
            for n in range(3000)
        ]
        with engine.begin() as conn:
            conn.execute(AssetCheckExecutionsTable.insert(), others)
        # The pooled storage adds it to a database dagster-mysql made.
        with dg.DagsterInstance.from_config(str(ours)) as instance:
            assert CHECK_HISTORY_INDEX.name in _check_indexes(engine)
            tags = {ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "d"}
            assert dg.materialize([checked_cities], instance=instance, tags=tags).success
            statement, parameters = latest_check_query(instance, "b")
        with engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE TABLE asset_check_executions")
            plan = conn.exec_driver_sql("EXPLAIN " + statement, parameters).mappings().one()
        assert plan["key"] == CHECK_HISTORY_INDEX.name and plan["type"] == "ref", dict(plan)
        assert "filesort" not in (plan["Extra"] or ""), dict(plan)
        # dagster-mysql's own storage reads and writes the table as before.
        with dg.DagsterInstance.from_config(str(stock_home)) as stock:
            assert dg.materialize([cities], instance=stock, partition_key="c").success
            latest_check_query(stock, "c")
    finally:
        engine.dispose()


def test_a_check_result_s_update_leaves_the_gaps_beside_it_to_other_runs(
    homes: tuple[Path, Path],
) -> None:
    """With the checks' index, InnoDB finds the row a check's result updates through it; under
    REPEATABLE READ it would lock the gaps beside the row, where another run inserts its
    planned check for a neighbouring partition, and two runs storing their cities' events at
    once deadlocked. The pooled event log's transactions lock only the rows they change."""
    ours, _ = homes
    url = sa.make_url(os.environ["DAGSTER_MYSQL_URL"])
    other = sa.create_engine(url, isolation_level="REPEATABLE READ")
    rows = [
        {
            "asset_key": ASSET.to_string(),
            "check_name": CHECK,
            "partition": f"city-{n:05d}",
            "run_id": f"run-{n // 50}",
            "execution_status": "PLANNED",
            "evaluation_event": "{}",
        }
        for n in range(0, 2000, 2)
    ]
    try:
        with dg.DagsterInstance.from_config(str(ours)) as instance:
            storage = instance.event_log_storage
            assert isinstance(storage, PooledMySQLEventLogStorage)
            with other.begin() as conn:
                conn.execute(AssetCheckExecutionsTable.insert(), rows)
                conn.exec_driver_sql("ANALYZE TABLE asset_check_executions")
            table = AssetCheckExecutionsTable
            with storage.index_connection() as conn:
                # The statement of Dagster's _update_asset_check_evaluation, its row locked.
                updated = conn.execute(
                    table.update()
                    .where(
                        table.c.asset_key == ASSET.to_string(),
                        table.c.check_name == CHECK,
                        table.c.run_id == "run-20",
                        table.c.partition == "city-01000",
                    )
                    .values(execution_status="SUCCEEDED")
                )
                assert updated.rowcount == 1
                # Another run plans its check for the partition next to it (in the gap).
                with other.connect() as neighbour:
                    neighbour.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = 1")
                    neighbour.execute(
                        table.insert(),
                        {**rows[0], "partition": "city-01001", "run_id": "run-other"},
                    )
                    neighbour.commit()
        with other.connect() as conn:
            count = conn.execute(
                sa.select(sa.func.count()).select_from(table).where(table.c.run_id == "run-other")
            ).scalar_one()
        assert count == 1
    finally:
        other.dispose()


def test_a_block_s_asset_rows_chosen_as_a_deadlock_s_victim_are_written_again_once(
    homes: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """InnoDB rolls the victim's transaction back whole: the asset rows, tags and check rows
    of the block are written again, and nothing is written twice."""
    ours, stock_home = homes
    real = PooledMySQLEventLogStorage.store_asset_check_event
    victims: list[str] = []

    def once_a_victim(self: PooledMySQLEventLogStorage, event: Any, event_id: Any) -> None:
        if not victims and event.dagster_event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION:
            victims.append(str(event_id))
            error = pymysql.err.OperationalError(1213, "Deadlock found when trying to get lock")
            raise sa.exc.OperationalError("UPDATE asset_check_executions", {}, error)
        real(self, event, event_id)

    monkeypatch.setattr(PooledMySQLEventLogStorage, "store_asset_check_event", once_a_victim)
    _, run_id = _commits_of_a_run(ours)
    assert len(victims) == 1
    with dg.DagsterInstance.from_config(str(stock_home)) as stock:
        _assert_grouped_run_read_back(stock)
        records = stock.fetch_materializations(ASSET, limit=10).records
        assert sorted(r.partition_key or "" for r in records) == ["a", "b", "c", "d"]
        assert all(r.run_id == run_id for r in records)
    engine = sa.create_engine(sa.make_url(os.environ["DAGSTER_MYSQL_URL"]))
    try:
        with engine.connect() as conn:
            tags = conn.exec_driver_sql(
                "SELECT event_id, `key`, COUNT(*) FROM asset_event_tags GROUP BY event_id, `key`"
            ).all()
            checks = conn.exec_driver_sql(
                "SELECT `partition`, COUNT(*) FROM asset_check_executions GROUP BY `partition`"
            ).all()
    finally:
        engine.dispose()
    assert all(count == 1 for *_, count in tags), tags
    assert sorted(checks) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]


def _ranged_run(instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    """A successful run of :func:`cities` over partitions a to d, as a backfill's run."""
    result = dg.materialize(
        [cities],
        instance=instance,
        tags={ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "d"},
    )
    assert result.success
    return result


def _planned_per_partition(stock: dg.DagsterInstance, run_id: str) -> dict[str, int]:
    """Partition -> the planned materializations of ``ASSET`` the run stored for it."""
    records = stock.event_log_storage.get_records_for_run(
        run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED
    ).records
    out: dict[str, int] = {}
    for record in records:
        planned = record.event_log_entry.get_dagster_event().event_specific_data
        assert isinstance(planned, AssetMaterializationPlannedData)
        out[str(planned.partition)] = out.get(str(planned.partition), 0) + 1
    return out


def _planned_check_rows(run_id: str) -> list[tuple[str, str, int]]:
    """(partition, status, rows) of the run's rows in ``asset_check_executions``."""
    engine = sa.create_engine(sa.make_url(os.environ["DAGSTER_MYSQL_URL"]))
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql(
                "SELECT `partition`, execution_status, COUNT(*) FROM asset_check_executions "
                "WHERE run_id = %s GROUP BY `partition`, execution_status",
                (run_id,),
            ).all()
    finally:
        engine.dispose()
    return sorted((str(p), str(s), int(n)) for p, s, n in rows)


def test_a_run_s_planned_events_are_one_insert_and_dagster_mysql_reads_them(
    homes: tuple[Path, Path], event_inserts: list[str]
) -> None:
    """The profile's instance hands a run's planned events to the storage together, which
    inserts them by one statement and writes their asset and check rows as Dagster's own."""
    ours, stock_home = homes
    with dg.DagsterInstance.from_config(str(ours)) as instance:
        assert isinstance(instance, EmbeddedDagsterInstance)
        result = _ranged_run(instance)
    # The step stores its own events one by one (no block): the one insert is the plan's.
    together = [s for s in event_inserts if "RETURNING" in s.upper()]
    assert len(together) == 1, event_inserts
    with dg.DagsterInstance.from_config(str(stock_home)) as stock:
        assert _planned_per_partition(stock, result.run_id) == {"a": 1, "b": 1, "c": 1, "d": 1}
        info = stock.event_log_storage.get_latest_planned_materialization_info(ASSET)
        assert info is not None and info.run_id == result.run_id
        assert per_partition(stock) == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert _planned_check_rows(result.run_id) == [(p, "SUCCEEDED", 1) for p in "abcd"]


def test_a_planned_batch_whose_rows_fail_is_stored_once(
    homes: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Dagster stores a failed batch's events again one by one: once they are inserted, a
    failure to write their rows is logged, not raised, and the run still completes with each
    check's result stored once."""
    ours, stock_home = homes
    real = PooledMySQLEventLogStorage._store_stored_rows
    failed: list[int] = []

    def rows_fail_once(self: PooledMySQLEventLogStorage, stored: Any) -> None:
        if not failed:
            failed.append(len(stored))
            raise sa.exc.OperationalError("INSERT INTO asset_check_executions", {}, Exception())
        real(self, stored)

    monkeypatch.setattr(PooledMySQLEventLogStorage, "_store_stored_rows", rows_fail_once)
    with dg.DagsterInstance.from_config(str(ours)) as instance:
        result = _ranged_run(instance)
    assert failed == [5]  # four planned materializations and the planned check
    with dg.DagsterInstance.from_config(str(stock_home)) as stock:
        assert _planned_per_partition(stock, result.run_id) == {"a": 1, "b": 1, "c": 1, "d": 1}
        assert per_partition(stock) == {"a": 1, "b": 1, "c": 1, "d": 1}
        assert check_results(stock) == {p: "SUCCEEDED" for p in "abcd"}
    assert _planned_check_rows(result.run_id) == [(p, "SUCCEEDED", 1) for p in "abcd"]
    assert "were not written" in caplog.text


def _mysql_db_yaml() -> str:
    """``storage: mysql`` with ``mysql_db``'s fields, as a user may write it instead of a URL."""
    url = sa.make_url(os.environ["DAGSTER_MYSQL_URL"])
    return (
        "storage:\n  mysql:\n    mysql_db:\n"
        f"      username: {url.username}\n      password: '{url.password or ''}'\n"
        f"      hostname: {url.host}\n      db_name: {url.database}\n"
        f"      port: {url.port or 3306}\n"
    )


@pytest.mark.parametrize("form", ["mysql_url", "mysql_db"])
def test_a_user_s_stock_mysql_instance_is_opened_on_the_pooled_storage(
    homes: tuple[Path, Path],
    event_inserts: list[str],
    form: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``DAGSTER_HOME`` whose ``dagster.yaml`` says ``storage: mysql``, as a user writes it:
    the project's commands and its daemon open it through the production profile's pooled storage and
    instance class, its file unchanged, and dagster-mysql reads back what they stored."""
    _, stock_home = homes
    if form == "mysql_db":
        (stock_home / "dagster.yaml").write_text(_mysql_db_yaml())
    text = (stock_home / "dagster.yaml").read_text()
    assert (PooledMySQLStorage.__module__, PooledMySQLStorage.__name__) == POOLED_MYSQL_STORAGE
    assert pooled_ref(InstanceRef.from_dir(str(stock_home))) is not None
    monkeypatch.setenv("DAGSTER_HOME", str(stock_home))
    daemons = daemon_instance_ref()  # what `supplier-sync daemon` hands Dagster's daemon
    assert daemons is not None
    with dg.DagsterInstance.from_ref(daemons) as instance:
        assert isinstance(instance.event_log_storage, PooledMySQLEventLogStorage)
    with local_instance(str(stock_home)) as instance:
        assert isinstance(instance, EmbeddedDagsterInstance)
        assert isinstance(instance.event_log_storage, PooledMySQLEventLogStorage)
        assert isinstance(instance.run_storage, PooledMySQLRunStorage)
        result = _ranged_run(instance)
    assert (stock_home / "dagster.yaml").read_text() == text
    assert sum("RETURNING" in s.upper() for s in event_inserts) == 1  # the run's plan
    with dg.DagsterInstance.from_config(str(stock_home)) as stock:
        assert type(stock.event_log_storage) is MySQLEventLogStorage
        run = stock.get_run_by_id(result.run_id)
        assert run is not None and run.status == dg.DagsterRunStatus.SUCCESS
        assert _planned_per_partition(stock, result.run_id) == {"a": 1, "b": 1, "c": 1, "d": 1}
        assert per_partition(stock) == {"a": 1, "b": 1, "c": 1, "d": 1}
        assert check_results(stock) == {p: "SUCCEEDED" for p in "abcd"}
