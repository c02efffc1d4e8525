"""The embedded instance's pooled SQLite storage, through Dagster's own API.

Each test makes an instance from a ``dagster.yaml`` in its folder, as the CLI, the webserver
and the daemon do, and checks what Dagster reads back: per-partition materializations,
check evaluations, planned events and run status; another process's writes on the same
files; Dagster's default storage reading them; the engines closed; a partition's latest
check result read through the index the storage adds, made once when processes race.
"""

import sqlite3
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData as TargetMaterialization,
)
from dagster._core.events import DagsterEventType
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.event_log.schema import AssetCheckExecutionsTable
from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
)
from sqlalchemy.engine import Connection

from supplier_sync_dagster.dagster_instance.deployment import ROOT
from supplier_sync_dagster.dagster_instance.events import (
    CheckTarget,
    check_target,
    latest_evaluation,
    one_event_transaction,
    stored_target,
)
from supplier_sync_dagster.dagster_instance.home import (
    EMBEDDED_DAGSTER_YAML,
    OLD_EMBEDDED_DAGSTER_YAMLS,
    dagster_instance,
)
from supplier_sync_dagster.dagster_instance.storage import (
    CHECK_HISTORY_INDEX,
    DEFAULT_MAX_CACHED_SHARDS,
    EmbeddedDagsterInstance,
    PooledSqliteEventLogStorage,
    PooledSqliteRunStorage,
    StoredMaterializations,
    ensure_check_history_index,
)

PARTITIONS = dg.StaticPartitionsDefinition(["a", "b", "c", "d"])
ASSET = dg.AssetKey("cities")
CHECK = "rows_positive"


with warnings.catch_warnings():
    warnings.simplefilter("ignore", dg.PreviewWarning)  # partitioned checks, as city_sync's
    CHECK_SPEC = dg.AssetCheckSpec(CHECK, asset="cities", partitions_def=PARTITIONS)


@dg.multi_asset(
    specs=[dg.AssetSpec(ASSET, skippable=True)],
    partitions_def=PARTITIONS,
    backfill_policy=dg.BackfillPolicy.single_run(),
    check_specs=[CHECK_SPEC],
    can_subset=True,  # as city_sync: its outputs are optional
)
def cities(context: dg.AssetExecutionContext) -> Iterator[object]:
    """Reports each partition of its range (and its check) as the city_sync step does."""
    for key in context.partition_keys:
        yield dg.AssetMaterialization(ASSET, partition=key, metadata={"rows": len(key)})
        yield dg.AssetCheckEvaluation(asset_key=ASSET, check_name=CHECK, passed=True, partition=key)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A DAGSTER_HOME with the state folder's dagster.yaml."""
    (tmp_path / "dagster.yaml").write_text(EMBEDDED_DAGSTER_YAML)
    return tmp_path


def _pooled(instance: dg.DagsterInstance) -> PooledSqliteEventLogStorage:
    storage = instance.event_log_storage
    assert isinstance(storage, PooledSqliteEventLogStorage)
    return storage


def _materialized(instance: dg.DagsterInstance) -> dict[str, int]:
    """Each partition's latest materialization's ``rows`` metadata."""
    records = instance.fetch_materializations(ASSET, limit=100).records
    seen: dict[str, int] = {}
    for record in reversed(records):
        materialization = record.asset_materialization
        assert materialization is not None and materialization.partition is not None
        rows = materialization.metadata["rows"].value
        assert isinstance(rows, int)
        seen[materialization.partition] = rows
    return seen


def test_the_embedded_yaml_makes_the_pooled_storages(home: Path) -> None:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert isinstance(instance, EmbeddedDagsterInstance)
        assert isinstance(instance.run_storage, PooledSqliteRunStorage)
        storage = _pooled(instance)
        # Dagster's layout under the instance's own folder, as its default storage.
        assert Path(storage.path_for_shard("index")) == home / "history" / "runs" / "index.db"
        assert (home / "history" / "runs.db").exists()
        # The reference a run worker rebuilds its instance from names the same class.
        assert instance.get_ref().custom_instance_class_data is not None


@pytest.mark.parametrize("earlier", [*OLD_EMBEDDED_DAGSTER_YAMLS, None, "edited"])
def test_the_state_folder_s_instance_is_the_embedded_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, earlier: str | None
) -> None:
    monkeypatch.setenv("DAGSTER_HOME", "")  # unset for dagster_instance; restored after
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path))
    config = tmp_path / "dagster_home" / "dagster.yaml"
    config.parent.mkdir()
    edited = EMBEDDED_DAGSTER_YAML.replace("poll_interval_seconds: 5", "poll_interval_seconds: 7")
    if earlier is not None:
        # What an earlier version wrote is replaced; a file someone edited is kept.
        config.write_text(edited if earlier == "edited" else earlier)
    with dagster_instance() as instance:
        assert isinstance(instance, EmbeddedDagsterInstance)
        _pooled(instance)
    assert config.read_text() == (edited if earlier == "edited" else EMBEDDED_DAGSTER_YAML)


def test_the_repository_profile_loads_the_pooled_storages(tmp_path: Path) -> None:
    (tmp_path / "dagster.yaml").write_text((ROOT / "dagster.yaml").read_text())
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        _pooled(instance)
        assert isinstance(instance.run_storage, PooledSqliteRunStorage)


def test_a_ranged_run_stores_and_reads_back_every_partition(home: Path) -> None:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        result = dg.materialize(
            [cities],
            instance=instance,
            tags={ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "d"},
        )
        assert result.success
        run = instance.get_run_by_id(result.run_id)
        assert run is not None and run.status == dg.DagsterRunStatus.SUCCESS
        assert _materialized(instance) == {"a": 1, "b": 1, "c": 1, "d": 1}
        assert instance.get_materialized_partitions(ASSET) == {"a", "b", "c", "d"}
        planned = instance.get_records_for_run(
            result.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED
        ).records
        assert {r.partition_key for r in planned} == {"a", "b", "c", "d"}
        for key in "abcd":  # mirrored in the index shard
            info = instance.event_log_storage.get_latest_planned_materialization_info(ASSET, key)
            assert info is not None and info.run_id == result.run_id
        checks = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(ASSET, CHECK), limit=10
        )
        assert len(checks) == 4
        assert {c.run_id for c in checks} == {result.run_id}
        statuses = [
            r.event_log_entry.dagster_event_type
            for r in instance.fetch_run_status_changes(
                dg.DagsterEventType.RUN_SUCCESS, limit=10
            ).records
        ]
        assert statuses == [dg.DagsterEventType.RUN_SUCCESS]
        # The run's own shard holds its whole log.
        logs = instance.all_logs(result.run_id)
        assert (
            sum(e.dagster_event_type == dg.DagsterEventType.ASSET_MATERIALIZATION for e in logs)
            == 4
        )


def latest_check_query(instance: dg.DagsterInstance, partition: str) -> tuple[str, Any]:
    """The statement and parameters by which Dagster reads the check's latest result on
    ``partition`` (``latest_evaluation``), that result checked on the way."""
    seen: list[tuple[str, Any]] = []

    def listen(*args: Any) -> None:
        statement, parameters = args[2], args[3]
        if statement.lstrip().upper().startswith("SELECT") and (
            "asset_check_executions" in statement
        ):
            seen.append((statement, parameters))

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", listen)
    try:
        found = latest_evaluation(instance, dg.AssetCheckKey(ASSET, CHECK), partition)
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", listen)
    assert found is not None and found.partition == partition
    assert len(seen) == 1
    return seen[0]


def _index_names(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("PRAGMA index_list('asset_check_executions')").fetchall()
    return {row[1] for row in rows}


def test_a_partition_s_latest_check_result_is_read_through_an_index_not_a_sort(
    tmp_path: Path,
) -> None:
    """A run reports again the gates' results of each city an earlier run of the batch
    published: without the index, SQLite sorts every result of the check for each."""
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with dg.DagsterInstance.from_config(str(tmp_path)) as stock:
        assert dg.materialize([cities], instance=stock, partition_key="a").success
    index_db = tmp_path / "history" / "runs" / "index.db"
    assert CHECK_HISTORY_INDEX.name not in _index_names(index_db)
    # The embedded storage adds it to a home Dagster's default storage made.
    (tmp_path / "dagster.yaml").write_text(EMBEDDED_DAGSTER_YAML)
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        tags = {ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "d"}
        assert dg.materialize([cities], instance=instance, tags=tags).success
        assert CHECK_HISTORY_INDEX.name in _index_names(index_db)
        statement, parameters = latest_check_query(instance, "b")
    with sqlite3.connect(index_db) as conn:
        plan = conn.execute("EXPLAIN QUERY PLAN " + statement, parameters).fetchall()
    steps = " / ".join(str(row[-1]) for row in plan)
    assert CHECK_HISTORY_INDEX.name in steps and "TEMP B-TREE" not in steps, steps
    # Dagster's default storage still reads and writes the file.
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with dg.DagsterInstance.from_config(str(tmp_path)) as stock:
        assert dg.materialize([cities], instance=stock, partition_key="c").success
        latest_check_query(stock, "c")


def test_the_check_history_index_is_made_once_by_whichever_process_is_first(
    db_url: str,
) -> None:
    """Two processes opening one database at once both try to make the index: the one
    that loses finds it made."""
    engine, other = sa.create_engine(db_url), sa.create_engine(db_url)
    try:
        assert not ensure_check_history_index(engine)  # no table yet: nothing made
        AssetCheckExecutionsTable.create(engine)
        raced: list[str] = []

        def first(*args: Any) -> None:
            statement = args[2]
            if statement.startswith("CREATE INDEX") and not raced:
                raced.append(statement)
                with other.begin() as conn:
                    conn.exec_driver_sql(statement)

        sa.event.listen(engine, "before_cursor_execute", first)
        assert ensure_check_history_index(engine)
        assert raced  # the other made it between the look and the make
        assert ensure_check_history_index(engine)
        names = [i["name"] for i in sa.inspect(engine).get_indexes("asset_check_executions")]
        assert names.count(CHECK_HISTORY_INDEX.name) == 1
    finally:
        engine.dispose()
        other.dispose()


def _tables(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of a Dagster SQLite shard, by table (the insertion-time defaults left out)."""
    conn = sqlite3.connect(path)
    try:
        out = {}
        for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
            columns = [
                row[1]
                for row in conn.execute(f"PRAGMA table_info({table})")
                if row[1] not in ("create_timestamp", "update_timestamp", "migration_completed")
            ]
            names = ", ".join(f'"{c}"' for c in columns)
            # Names from the file's own schema, not from input.
            query = f'SELECT {names} FROM "{table}" ORDER BY 1'  # noqa: S608
            out[table] = conn.execute(query).fetchall()
        return out
    finally:
        conn.close()


def test_the_fast_store_writes_exactly_what_dagster_s_store_writes(
    home: Path, tmp_path: Path
) -> None:
    """The same events, stored by Dagster's SQLite event log and by the pooled one, leave the
    same rows in every table of the run shard and the index (events, the assets' last
    materialization, check executions, tags)."""
    with dg.DagsterInstance.from_config(str(home)) as instance:
        result = dg.materialize(
            [cities],
            instance=instance,
            tags={ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "c"},
        )
        assert result.success
        events = instance.all_logs(result.run_id)
    kinds = {e.dagster_event_type for e in events if e.dagster_event_type}
    assert {
        DagsterEventType.ASSET_MATERIALIZATION,
        DagsterEventType.ASSET_MATERIALIZATION_PLANNED,
        DagsterEventType.ASSET_CHECK_EVALUATION,
        DagsterEventType.ASSET_CHECK_EVALUATION_PLANNED,
        DagsterEventType.RUN_SUCCESS,
    } <= kinds
    theirs = SqliteEventLogStorage(str(tmp_path / "dagster"))
    ours = PooledSqliteEventLogStorage(str(tmp_path / "pooled"))
    try:
        for event in events:
            theirs.store_event(event)
            ours.store_event(event)
    finally:
        theirs.dispose()
        ours.dispose()
    for shard in ("index.db", f"{result.run_id}.db"):
        expected = _tables(tmp_path / "dagster" / shard)
        assert _tables(tmp_path / "pooled" / shard) == expected
    index = _tables(tmp_path / "dagster" / "index.db")
    assert len(index["asset_check_executions"]) == 3  # one per partition, each judged
    assert all(row[1] for row in index["asset_keys"])  # the last materialization


def test_a_table_found_is_asked_for_once(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    dagster_has_table = SqliteEventLogStorage.has_table

    def has_table(self: SqliteEventLogStorage, table_name: str) -> bool:
        asked.append(table_name)
        return dagster_has_table(self, table_name)

    monkeypatch.setattr(SqliteEventLogStorage, "has_table", has_table)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        storage = _pooled(instance)
        assert not storage.has_table("no_such_table")
        assert not storage.has_table("no_such_table")  # a missing table is asked again
        assert asked.count("no_such_table") == 2
        result = dg.materialize(
            [cities],
            instance=instance,
            tags={ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "d"},
        )
        assert result.success
        # Four check evaluations ask whether the checks' table exists: Dagster opens the
        # index shard once, not per event.
        assert asked.count("asset_check_executions") == 1
        assert (
            len(
                instance.event_log_storage.get_asset_check_execution_history(
                    dg.AssetCheckKey(ASSET, CHECK), limit=10
                )
            )
            == 4
        )
        storage.upgrade()
        assert storage.has_table("asset_check_executions")
        assert asked.count("asset_check_executions") == 2  # asked again after a migration


def test_a_run_s_planned_events_are_stored_in_one_batch_all_or_none(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        storage = _pooled(instance)
        batches: list[int] = []
        real_batch = storage.store_event_batch

        def counted(events: list[object]) -> None:
            batches.append(len(events))
            real_batch(events)  # type: ignore[arg-type]

        monkeypatch.setattr(storage, "store_event_batch", counted)
        result = dg.materialize(
            [cities],
            instance=instance,
            tags={ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "d"},
        )
        assert result.success
        assert batches == [5]  # 4 partitions' planned materializations + the check's plan
        planned = instance.get_records_for_run(
            result.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED
        ).records
        events = [r.event_log_entry for r in planned]
        # A batch that fails half-way leaves nothing behind (Dagster then stores the
        # events one by one, which must not make duplicates).
        real_store = storage.store_event
        calls: list[int] = []

        def failing(event: object) -> None:
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("disk full")
            real_store(event)  # type: ignore[arg-type]

        monkeypatch.setattr(storage, "store_event", failing)
        copies = [e._replace(run_id=result.run_id) for e in events]
        with pytest.raises(RuntimeError, match="disk full"):
            real_batch(copies)
        monkeypatch.setattr(storage, "store_event", real_store)
        again = instance.get_records_for_run(
            result.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED
        ).records
        assert len(again) == len(planned) == 4


@dg.multi_asset(
    specs=[dg.AssetSpec(ASSET, skippable=True)],
    partitions_def=PARTITIONS,
    backfill_policy=dg.BackfillPolicy.single_run(),
    check_specs=[CHECK_SPEC],
    can_subset=True,
)
def grouped_cities(context: dg.AssetExecutionContext) -> Iterator[object]:
    """As city_sync: each partition's events in one transaction, its check on its own write."""
    for key in context.partition_keys:
        with one_event_transaction(context.instance):
            context.log.info(f"city {key}")
            yield dg.AssetMaterialization(ASSET, partition=key, metadata={"rows": len(key)})
            latest = context.instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=ASSET, asset_partitions=[key]), limit=1
            ).records
            assert latest and latest[0].run_id == context.run.run_id  # it reads its own writes
            yield dg.AssetCheckEvaluation(
                asset_key=ASSET,
                check_name=CHECK,
                passed=key != "c",
                partition=key,
                target_materialization_data=TargetMaterialization(
                    run_id=context.run.run_id,
                    storage_id=latest[0].storage_id,
                    timestamp=latest[0].timestamp,
                ),
            )


def test_a_partition_s_events_are_one_transaction_per_shard(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        storage = _pooled(instance)
        blocks: list[int] = []
        real_block = storage.one_transaction

        def counted() -> Any:
            blocks.append(len(commits))  # commits made before the block
            return real_block()

        monkeypatch.setattr(storage, "one_transaction", counted)
        commits: list[object] = []
        real_commit = Connection.commit

        def counting(self: Connection) -> None:
            commits.append(self)
            real_commit(self)

        monkeypatch.setattr(Connection, "commit", counting)
        result = dg.materialize(
            [grouped_cities],
            instance=instance,
            tags={ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "d"},
            raise_on_error=False,
        )
        monkeypatch.setattr(Connection, "commit", real_commit)
        assert result.success
        assert len(blocks) == 5  # the planned events' batch, then one per partition
        # Each partition's block: one commit on the run shard and one on the index (the
        # other events of the run commit on their own, through no Connection.commit).
        assert len(commits) - blocks[1] == 4 * 2
        assert _materialized(instance) == {"a": 1, "b": 1, "c": 1, "d": 1}
        # Every partition's check judged its materialization: the UI's per-partition status.
        checks = storage.get_asset_check_execution_history(dg.AssetCheckKey(ASSET, CHECK), limit=10)
        assert len(checks) == 4
        assert sorted(c.status.value for c in checks) == [
            "FAILED",
            "SUCCEEDED",
            "SUCCEEDED",
            "SUCCEEDED",
        ]
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
        assert {f"city {key}" for key in "abcd"} <= set(logs)


def test_a_block_that_raises_stores_none_of_its_events(home: Path) -> None:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        storage = _pooled(instance)
        seen_inside: list[int] = []
        with pytest.raises(RuntimeError, match="boom"), one_event_transaction(instance):
            instance.report_runless_asset_event(
                dg.AssetMaterialization(ASSET, partition="a", metadata={"rows": 1})
            )
            with one_event_transaction(instance):  # joins the outer block
                instance.report_runless_asset_event(
                    dg.AssetMaterialization(ASSET, partition="b", metadata={"rows": 1})
                )
            seen_inside.append(len(_materialized(instance)))
            raise RuntimeError("boom")
        assert seen_inside == [2]  # the block read its own writes
        assert _materialized(instance) == {}
        assert storage._batch is None  # released: the next event stores on its own
        instance.report_runless_asset_event(
            dg.AssetMaterialization(ASSET, partition="a", metadata={"rows": 1})
        )
        assert set(_materialized(instance)) == {"a"}


def report_city(instance: dg.DagsterInstance, partition: str, rows: int = 1) -> None:
    """One materialization of ``cities`` for ``partition``, outside any run."""
    instance.report_runless_asset_event(
        dg.AssetMaterialization(ASSET, partition=partition, metadata={"rows": rows})
    )


def read_target(instance: dg.DagsterInstance, partition: str) -> CheckTarget:
    """The partition's latest materialization as a check's target, read from the event log."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=ASSET, asset_partitions=[partition]), limit=1
    ).records
    assert records
    return check_target(records[0])


def test_a_stored_materialization_is_known_without_a_read_once_committed(home: Path) -> None:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        other_thread: list[CheckTarget | None] = []
        with one_event_transaction(instance):
            report_city(instance, "a")
            inside = stored_target(instance, ASSET, "a")
            # Not committed yet: another thread does not take it for stored.
            reader = threading.Thread(
                target=lambda: other_thread.append(stored_target(instance, ASSET, "a"))
            )
            reader.start()
            reader.join()
        assert other_thread == [None]
        assert inside is not None and inside == read_target(instance, "a")
        assert stored_target(instance, ASSET, "a") == inside
        # A block that raises stores nothing, and nothing of it is remembered.
        with pytest.raises(RuntimeError, match="boom"), one_event_transaction(instance):
            report_city(instance, "a", rows=2)
            report_city(instance, "b")
            raise RuntimeError("boom")
        assert stored_target(instance, ASSET, "b") is None
        assert stored_target(instance, ASSET, "a") == inside == read_target(instance, "a")
        # Outside a block each event commits on its own: the newer one is remembered.
        report_city(instance, "a", rows=3)
        newer = stored_target(instance, ASSET, "a")
        assert newer == read_target(instance, "a") and newer != inside
        # Only materializations of a partition.
        instance.report_runless_asset_event(dg.AssetObservation(ASSET, partition="c"))
        instance.report_runless_asset_event(dg.AssetMaterialization(dg.AssetKey("whole")))
        assert stored_target(instance, ASSET, "c") is None
        # A wiped event log forgets them.
        instance.wipe()
        assert stored_target(instance, ASSET, "a") is None


def test_dagster_s_stock_storage_remembers_nothing(tmp_path: Path) -> None:
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        assert type(instance.event_log_storage) is SqliteEventLogStorage
        report_city(instance, "a")
        assert stored_target(instance, ASSET, "a") is None


def test_remembered_materializations_are_bounded(home: Path) -> None:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        storage = _pooled(instance)
        storage.stored_materializations = StoredMaterializations(limit=2)
        for partition in "abc":
            report_city(instance, partition)
        assert stored_target(instance, ASSET, "a") is None  # the oldest, dropped
        assert stored_target(instance, ASSET, "c") == read_target(instance, "c")
        assert stored_target(instance, ASSET, "b") == read_target(instance, "b")


def test_dagster_s_default_storage_reads_what_it_wrote_and_back(home: Path) -> None:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        first = dg.materialize([cities], instance=instance, partition_key="a")
    # Dagster's default storage on the same folder (a dagster.yaml naming no storage).
    plain = home / "plain"
    plain.mkdir()
    (plain / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    ref = InstanceRef.from_dir(str(home), config_dir=str(plain))
    with dg.DagsterInstance.from_ref(ref) as default:
        assert type(default.event_log_storage) is SqliteEventLogStorage
        assert default.get_run_by_id(first.run_id) is not None
        assert set(_materialized(default)) == {"a"}
        assert default.all_logs(first.run_id)
        second = dg.materialize([cities], instance=default, partition_key="b")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert set(_materialized(instance)) == {"a", "b"}
        assert instance.get_run_by_id(second.run_id) is not None


_WRITER = textwrap.dedent(
    """
    import sys, time
    import dagster as dg
    home, name, count, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    instance = dg.DagsterInstance.from_config(home)
    run_id = sys.argv[5] if len(sys.argv) > 5 else None
    for i in range(count):
        if run_id:
            instance.report_engine_event(f"{name}-{i}", run_id=run_id, job_name="j")
        else:
            instance.report_runless_asset_event(
                dg.AssetMaterialization("cities", partition=f"{name}-{i}")
            )
    print("written", flush=True)
    time.sleep(hold)  # keeps its pooled connections open, as a long run does
    instance.dispose()
    """
)


def _writer(
    home: Path, name: str, count: int, hold: float = 0.0, run_id: str = ""
) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", _WRITER, str(home), name, str(count), str(hold)]
    return subprocess.Popen([*args, run_id] if run_id else args, stdout=subprocess.PIPE, text=True)


def test_two_processes_write_the_same_instance_at_once(home: Path) -> None:
    # Made first, so that the writers do not race to create the files.
    dg.DagsterInstance.from_config(str(home)).dispose()
    writers = [_writer(home, name, 150) for name in ("p", "q")]
    for writer in writers:
        assert writer.wait(timeout=240) == 0
    with dg.DagsterInstance.from_config(str(home)) as instance:
        partitions = instance.get_materialized_partitions(ASSET)
    assert partitions == {f"{n}-{i}" for n in ("p", "q") for i in range(150)}


def test_a_watcher_sees_another_process_s_events_while_it_writes(home: Path) -> None:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        run = instance.create_run_for_job(dg.GraphDefinition("j").to_job(), run_id=None)
        seen: list[str] = []
        arrived = threading.Event()

        def on_event(entry: dg.EventLogEntry, _cursor: str) -> None:
            seen.append(entry.message)
            if len(seen) >= 20:
                arrived.set()

        instance.watch_event_logs(run.run_id, None, on_event)
        # The writer keeps its connection open for a minute: its commits stay in the WAL.
        writer = _writer(home, "w", 20, hold=60, run_id=run.run_id)
        try:
            assert writer.stdout is not None and writer.stdout.readline() == "written\n"
            assert arrived.wait(timeout=20), seen
            assert writer.poll() is None  # seen before the writer closed its connection
        finally:
            writer.kill()
            writer.wait()
        assert seen[:20] == [f"w-{i}" for i in range(20)]


def test_engines_are_bounded_and_disposed(home: Path) -> None:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        storage = _pooled(instance)
        job = dg.GraphDefinition("j").to_job()
        engines = []
        for _ in range(DEFAULT_MAX_CACHED_SHARDS + 3):
            run = instance.create_run_for_job(job)
            instance.report_engine_event("hello", run)
            engines.append(storage._engine(run.run_id))
        cached = storage.cached_shards()
        assert "index" in cached
        assert len(cached) == DEFAULT_MAX_CACHED_SHARDS + 1
        # Evicted engines closed their connections; kept ones hold one idle connection.
        assert all(engine.pool.checkedin() == 0 for engine in engines[:3])  # type: ignore[attr-defined]
        assert engines[-1].pool.checkedin() == 1  # type: ignore[attr-defined]
        # An evicted shard opens again on demand.
        assert instance.all_logs(storage.get_all_run_ids()[0])
    assert storage.cached_shards() == []
    assert engines[-1].pool.checkedin() == 0  # type: ignore[attr-defined]


@dg.multi_asset(
    specs=[dg.AssetSpec(ASSET, skippable=True)],
    partitions_def=PARTITIONS,
    backfill_policy=dg.BackfillPolicy.single_run(),
    can_subset=True,
    name="half_cities",
)
def half_cities(context: dg.AssetExecutionContext) -> Iterator[dg.AssetMaterialization]:
    """Reports the first half of its range, then fails: city_sync with failed cities."""
    keys = context.partition_keys
    for key in keys[: len(keys) // 2]:
        yield dg.AssetMaterialization(ASSET, partition=key, metadata={"rows": 1})
    raise dg.Failure("the other cities failed")


@pytest.mark.parametrize("subset_in_planned_events", [False, True])
def test_failed_cities_of_a_ranged_run_show_failed_only_with_a_planned_event_each(
    home: Path, monkeypatch: pytest.MonkeyPatch, subset_in_planned_events: bool
) -> None:
    # Why the storage keeps Dagster's default (False) for
    # supports_partition_subset_in_asset_materialization_planned_events: the UI's failed
    # partitions are those with a planned event and no materialization in a FAILURE run,
    # matched on the event's partition column; one planned event for the whole range has none.
    if subset_in_planned_events:
        monkeypatch.setenv("DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS", "1")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        storage = instance.event_log_storage
        assert storage.supports_partition_subset_in_asset_materialization_planned_events is (
            subset_in_planned_events
        )
        result = dg.materialize(
            [half_cities],
            instance=instance,
            tags={ASSET_PARTITION_RANGE_START_TAG: "a", ASSET_PARTITION_RANGE_END_TAG: "d"},
            raise_on_error=False,
        )
        assert not result.success
        planned = instance.get_records_for_run(
            result.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED
        ).records
        assert len(planned) == (1 if subset_in_planned_events else 4)
        status = instance.get_status_by_partition(ASSET, ["a", "b", "c", "d"], PARTITIONS)
        assert status is not None
        assert status["a"] == status["b"] == dg.AssetPartitionStatus.MATERIALIZED
        failed = None if subset_in_planned_events else dg.AssetPartitionStatus.FAILED
        assert status["c"] == status["d"] == failed
