"""Fixtures for the core tests: an opened sync database (SQLite and MariaDB) and batches."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import pytest

from supplier_sync_dagster.core.leasing.batches import Batch, TaskSpec, create_batch, upsert_task
from supplier_sync_dagster.core.store.db import SyncDatabase


@pytest.fixture
def db(db_url: str) -> Iterator[SyncDatabase]:
    """A freshly created sync database, on SQLite and on MariaDB."""
    database = SyncDatabase.open(db_url)
    yield database
    database.dispose()


MakeBatch = Callable[..., Batch]


@pytest.fixture
def make_batch(db: SyncDatabase) -> MakeBatch:
    """Creates a task (a new one unless ``task_code`` is given) and a batch with these shards."""

    def make(
        shard_keys: Sequence[str] = ("BKK", "SIN", "JKT"),
        *,
        task_code: str | None = None,
        policy: str = "SKIP_IF_RUNNING",
        data_scope: str = "RESOURCE",
    ) -> Batch:
        task_code = task_code or f"task_{uuid.uuid4().hex[:12]}"
        upsert_task(
            db,
            TaskSpec(
                task_code=task_code,
                supplier_id=1001,
                concurrency_policy=policy,  # type: ignore[arg-type]
                data_scope=data_scope,  # type: ignore[arg-type]
            ),
        )
        decision = create_batch(
            db,
            task_code=task_code,
            trigger_id=f"test-{uuid.uuid4().hex[:16]}",
            trigger_source="MANUAL",
            shard_keys=list(shard_keys),
        )
        assert decision.batch is not None, decision
        return decision.batch

    return make


T = TypeVar("T")


def run_concurrently(n: int, fn: Callable[[int], T]) -> tuple[list[T], list[BaseException]]:
    """Runs ``fn(0..n-1)`` in n threads released together by a barrier.

    Returns:
        The results, and every exception raised (so a test can assert there were none).
    """
    barrier = threading.Barrier(n)
    results: list[T] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            results.append(fn(i))
        except BaseException as err:  # collected: the test decides what is expected
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results, errors
