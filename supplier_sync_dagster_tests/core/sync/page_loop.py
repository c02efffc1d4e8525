"""A minimal page loop over a claimed shard, for the lease tests.

The pipeline's fetch stage is the production loop; this one keeps the lease's promises
testable without a supplier: each page's data and the checkpoint past it commit in one
fenced transaction, and :class:`ShardWork` decides how the shard's work ends.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy import Connection

from supplier_sync_dagster.core.leasing.batches import Batch
from supplier_sync_dagster.core.leasing.leases import Checkpoint, PageCounts, ShardLease, ShardWork


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
    """Works a claimed shard page by page to its end, resuming from the lease's checkpoint.

    Each page's data and the checkpoint past it commit in one fenced transaction
    (invariant 3), so a crash re-processes at most the page in flight and a lost lease
    writes nothing. The lease demonstration runs it over synthetic pages; the pipeline's
    fetch stage follows the same order with the supplier's pages.

    Returns:
        SUCCESS once every page is done, or LEASE_LOST (see :class:`ShardWork`).

    Raises:
        Exception: From the source or the handler, after the shard finished FAILED.
        BaseException: An interruption, after the lease was released.
    """
    resumed_from = lease.checkpoint
    pages = 0
    total = PageCounts()
    work = ShardWork(lease)
    with work as heartbeat:
        for page in source(lease.checkpoint or Checkpoint(lease.shard_key)):
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
            total = PageCounts(
                total.success + counts.success,
                total.failed + counts.failed,
                total.skipped + counts.skipped,
            )
            if on_page is not None:
                on_page(page, counts)
            heartbeat.report("FETCHING", f"city={lease.shard_key} page={page.number + 1}")
        heartbeat.check()
        batch = lease.finish("SUCCESS")
        return ShardOutcome(lease.shard_key, "SUCCESS", pages, total, resumed_from, batch)
    return ShardOutcome(
        lease.shard_key, "LEASE_LOST", pages, total, resumed_from, None, str(work.lost)
    )
