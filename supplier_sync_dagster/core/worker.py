"""The loop that works one claimed shard: fetch a page, commit it with its checkpoint, repeat.

:func:`run_shard` owns the order that makes a sync resumable (invariant 3): each page's
data and the checkpoint past it are written in one transaction, fenced by the lease, so a
crash re-processes at most the page in flight and a lost lease writes nothing. The page
source and the page handler are supplied by the caller: the supplier client and the
pipeline stages in production, synthetic pages in the demonstration.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.batches import Batch
from supplier_sync_dagster.core.errors import LeaseLost
from supplier_sync_dagster.core.leases import Checkpoint, HeartbeatRunner, PageCounts, ShardLease

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedPage:
    """One page as fetched, and the checkpoint that follows it once it is committed.

    Attributes:
        number: The page number fetched (1-based).
        next_checkpoint: Where to resume after this page.
        total_pages: The supplier's page count for the city, when known.
        payload: The exact bytes received.
        records: The page's records, for the handler.
    """

    number: int
    next_checkpoint: Checkpoint
    total_pages: int | None
    payload: bytes
    records: list[Any] = field(default_factory=list)


PageSource = Callable[[Checkpoint], Iterator[FetchedPage]]
"""Yields the pages of a city starting at a checkpoint (page number and/or cursor)."""

PageHandler = Callable[[Connection, FetchedPage], PageCounts]
"""Writes one page's data in the given transaction and says what became of its records."""

OutcomeStatus = Literal["SUCCESS", "FAILED", "LEASE_LOST", "RELEASED"]


@dataclass(frozen=True)
class ShardOutcome:
    """How one run of :func:`run_shard` ended."""

    shard_key: str
    status: OutcomeStatus
    pages: int
    counts: PageCounts
    resumed_from: Checkpoint | None
    batch: Batch | None = None
    error: str | None = None


def run_shard(
    lease: ShardLease,
    source: PageSource,
    handle: PageHandler,
    *,
    on_page: Callable[[FetchedPage, PageCounts], None] | None = None,
) -> ShardOutcome:
    """Works a claimed shard to its end, resuming from the lease's checkpoint.

    A heartbeat thread renews the lease meanwhile. Ends:

    - every page done: the shard finishes SUCCESS;
    - the lease is lost: stop at once, write nothing more (LEASE_LOST);
    - an exception from the source or the handler: the shard finishes FAILED with the
      error, then the exception propagates;
    - interrupted (KeyboardInterrupt, a run terminated from the Dagster UI): the lease is
      released so another worker can resume from the checkpoint without waiting for it
      to expire, then the interruption propagates.
    """
    start = lease.checkpoint or Checkpoint(lease.shard_key)
    resumed_from = lease.checkpoint
    pages = 0
    success = failed = skipped = 0
    with HeartbeatRunner(lease) as heartbeat:
        try:
            for page in source(start):
                heartbeat.check()
                heartbeat.report("PROCESSING", f"city={lease.shard_key} page={page.number}")
                with lease.db.begin() as conn:
                    counts = handle(conn, page)
                    lease.advance(
                        page.next_checkpoint,
                        counts,
                        total_pages=page.total_pages,
                        fetched=len(page.records),
                        message=f"city={lease.shard_key} page={page.number} committed",
                        conn=conn,
                    )
                pages += 1
                success, failed, skipped = (
                    success + counts.success,
                    failed + counts.failed,
                    skipped + counts.skipped,
                )
                if on_page is not None:
                    on_page(page, counts)
                heartbeat.report("FETCHING", f"city={lease.shard_key} page={page.number + 1}")
            heartbeat.check()
            batch = lease.finish("SUCCESS")
            status: OutcomeStatus = "SUCCESS"
            error = None
        except LeaseLost as err:
            log.warning("stopping shard %r: %s", lease.shard_key, err)
            return ShardOutcome(
                lease.shard_key, "LEASE_LOST", pages, PageCounts(success, failed, skipped),
                resumed_from, None, str(err),
            )  # fmt: skip
        except Exception as err:
            message = f"{type(err).__name__}: {err}"
            with contextlib.suppress(LeaseLost):  # if another owns it now, its outcome stands
                lease.finish("FAILED", message)
            raise
        except BaseException:
            if not lease.lost:
                try:
                    lease.release("worker interrupted")
                except Exception as err:  # the lease will expire on its own instead
                    log.warning("could not release shard %r: %s", lease.shard_key, err)
            raise
    return ShardOutcome(
        lease.shard_key, status, pages, PageCounts(success, failed, skipped), resumed_from,
        batch, error,
    )  # fmt: skip
