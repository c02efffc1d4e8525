"""The types a city's sync shares across its stages, and the one factory of its settings.

:class:`SyncSettings` is what a sync needs to know besides its inputs; every entry point (the
Dagster jobs, the CLI, the demos, the benchmarks) builds it through
:func:`build_sync_settings`, whose deployment-level inputs are required keywords.
:class:`CityReport` is what a city's sync did, stage by stage (:data:`Stage`).
:class:`FetchedPage` and :class:`PageSource` are a shard's pages when they are not a city's
listing (a change feed window, a compensation's dead letters); :class:`Progress` is where a
stage says what it is doing and learns whether it may go on.
"""

from __future__ import annotations

import traceback
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol, TypedDict, Unpack

from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import (
    code_of_description,
    describe_error,
    error_code_of,
)
from supplier_sync_dagster.core.leasing.leases import Checkpoint, LeaseSettings, PageCounts
from supplier_sync_dagster.core.records.diff import RiskPolicy, default_risk_policy
from supplier_sync_dagster.core.records.gates import CityProfile, GateResult
from supplier_sync_dagster.core.records.tombstones import DEFAULT_MISSING_SYNCS, Presence
from supplier_sync_dagster.core.settings import (
    DEFAULT_MAX_CLOCK_SKEW_SECONDS,
    MAX_CLOCK_SKEW_LIMIT_SECONDS,
    require_within,
)
from supplier_sync_dagster.core.supplier import SupplierClient, WalkLimits, WalkStats

# SyncSettings.publish_chunk_hotels unless set.
DEFAULT_PUBLISH_CHUNK_HOTELS = 1000
# SyncSettings.page_size of a sync that walks no city listing (a fixed record, a dry run).
DEFAULT_PAGE_SIZE = 100


@dataclass(frozen=True)
class SyncSettings:
    """What one sync needs to know besides its inputs (built by :func:`build_sync_settings`).

    Attributes:
        task_code: The task being run (dead letters name it).
        supplier_id: The platform's id of the supplier.
        sync_mode: FULL or INCREMENTAL (dead letters name it).
        page_size: Hotels per supplier page (1-500).
        chunk_hotels: Hotels normalized and checked per quality pass (its cost is mostly
            per call), and normalized pages written per flush.
        publish_chunk_hotels: Hotels per map/diff/publish transaction. Each event of a
            chunk carries the transaction's database time and no dispatcher sees it before
            the commit, so the chunk's length is a floor under the search index's lag
            while a sync runs (``bench_dispatch.py --mode with-sync`` measures it). An
            incremental window left at this default publishes
            ``WINDOW_PUBLISH_CHUNK_HOTELS`` instead (``core.repair.incremental``).
        memory_hotels: Normalized hotels of a city kept in memory for publishing; a larger
            city's are read back from its NORMALIZED pages (memory stays bounded).
        lease: Lease duration and heartbeat interval.
        risk_policy: Decides each diff's risk level and action.
        missing_syncs: Complete syncs of a city without a hotel before it is unpublished.
        publish_processes: Forked processes that publish a shard's chunks held in memory
            (all but the last, which finishes the shard here); 0 or 1 publishes them in
            this process. For one large shard (an incremental window): a full sync's cities
            already run in worker processes of their own.
        normalize_processes: Forked processes that normalize and judge a shard's pages
            while this process fetches and stores them (0: this process does). For one
            large shard (an incremental window), as ``publish_processes``.
        max_clock_skew_seconds: How far a record's ``updated_at`` may be ahead of the
            database clock: a record further ahead is a ``FUTURE_TIMESTAMP`` dead letter,
            and an incremental task's watermark never passes the clock plus this.
        walk: How far a city's walk may go, and whether it checks its pages for a listing
            that shifts under it (the supplier's settings: ``core.supplier.walk``).
    """

    task_code: str
    supplier_id: int
    sync_mode: str = "FULL"
    page_size: int = DEFAULT_PAGE_SIZE
    chunk_hotels: int = 2000
    publish_chunk_hotels: int = DEFAULT_PUBLISH_CHUNK_HOTELS
    memory_hotels: int = 5000
    lease: LeaseSettings = field(default_factory=LeaseSettings)
    risk_policy: RiskPolicy = default_risk_policy
    missing_syncs: int = DEFAULT_MISSING_SYNCS
    publish_processes: int = 0
    normalize_processes: int = 0
    walk: WalkLimits = field(default_factory=WalkLimits)
    max_clock_skew_seconds: float = DEFAULT_MAX_CLOCK_SKEW_SECONDS

    def __post_init__(self) -> None:
        require_within(
            "max_clock_skew_seconds", self.max_clock_skew_seconds, 0, MAX_CLOCK_SKEW_LIMIT_SECONDS
        )


class SyncTuning(TypedDict, total=False):
    """The settings a caller may leave at their defaults (see :class:`SyncSettings`)."""

    sync_mode: str
    chunk_hotels: int
    publish_chunk_hotels: int
    memory_hotels: int
    missing_syncs: int
    publish_processes: int
    normalize_processes: int
    walk: WalkLimits


def build_sync_settings(
    *,
    task_code: str,
    supplier_id: int,
    page_size: int,
    lease: LeaseSettings,
    risk_policy: RiskPolicy,
    max_clock_skew_seconds: float,
    **tuning: Unpack[SyncTuning],
) -> SyncSettings:
    """The settings of a sync, as every entry point builds them.

    The deployment's settings (its supplier's page size, its lease settings, its risk
    policy, the clock skew it allows) are required: an entry point that left one out would
    sync with a default that differs from the other entry points' without anyone noticing.

    Args:
        task_code: The task being run.
        supplier_id: The platform's id of the supplier.
        page_size: Hotels per supplier page (the supplier's configured page size).
        lease: The deployment's lease duration and heartbeat interval.
        risk_policy: The deployment's risk policy.
        max_clock_skew_seconds: How far a record's ``updated_at`` may be ahead of the
            database clock (``SUPPLIER_SYNC_MAX_CLOCK_SKEW_SECONDS``).
        **tuning: Settings that keep their defaults unless given (:class:`SyncTuning`).

    Raises:
        ConfigError: ``max_clock_skew_seconds`` is outside its range.
    """
    return SyncSettings(
        task_code,
        supplier_id,
        page_size=page_size,
        lease=lease,
        risk_policy=risk_policy,
        max_clock_skew_seconds=max_clock_skew_seconds,
        **tuning,
    )


Stage = Literal["fetch", "normalize", "publish"]
"""A city's stages as a worker completes them: every page fetched and stored; every record
normalized (or dead-lettered) and checked; mapped, diffed and published."""


@dataclass
class CityReport:
    """What a city's sync did, stage by stage (counts, timings), for metadata and summaries."""

    city_code: str
    status: str = "SUCCESS"
    resumed_from_page: int | None = None
    pages_fetched: int = 0
    records: int = 0
    published: int = 0
    dead_letters: int = 0
    skipped: int = 0
    duplicates: int = 0
    moved: int = 0  # listed in this city but located in another: published under their own
    held_for_review: int = 0
    checks: list[GateResult] = field(default_factory=list)  # the gate's, when it ran
    dead_letters_by_code: Counter[str] = field(default_factory=Counter)
    diffs_by_type: Counter[str] = field(default_factory=Counter)
    diffs_by_action: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # Per stage, the CPU seconds of the threads that did its work (``seconds`` is wall time).
    cpu_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # A failed city's ``CODE: what happened`` (core.errors.describe_error) and its code.
    error: str | None = None
    error_code: str | None = None
    trace: str | None = None  # its traceback, for the run's log (Dagster's, -v)
    stages_done: list[Stage] = field(default_factory=list)  # what this worker completed
    # For the gate: the profile normalization recorded, and whether the city had gate
    # overrides when claimed (None: unknown, read them).
    profile: CityProfile | None = None
    gate_overrides: bool | None = None
    # What the complete listing did to the catalog's presence marks (tombstones).
    presence: Presence | None = None
    # What this claim's walk of the city's listing saw (None: no listing was walked).
    walk: WalkStats | None = None

    def fail(self, err: BaseException, described: str | None = None) -> None:
        """Marks the city FAILED by ``err``: its code, and what happened (``described``,
        when the shard recorded it already)."""
        self.status = "FAILED"
        self.error = described or describe_error(err)
        self.error_code = code_of_description(self.error) or error_code_of(err)
        self.trace = "".join(traceback.format_exception(err))

    @property
    def gate_failures(self) -> list[str]:
        """The checks that stopped the city (failed and not overridden)."""
        return [r.check_name for r in self.checks if not r.passed]

    @property
    def counts(self) -> PageCounts:
        """The shard's outcome counts: published, dead letters, everything else."""
        return PageCounts(success=self.published, failed=self.dead_letters, skipped=self.skipped)


class FetchedPage(NamedTuple):
    """One page of a shard's walk, as the fetch stores and checkpoints it.

    Attributes:
        raw: The page's exact bytes (stored and hashed).
        page_number: Its number in the walk (1-based).
        records: Its records as decoded (non-object entries unwrapped by the client).
        total_pages: The supplier's page count, when it says.
        checkpoint: Where the walk goes on once this page is committed.
    """

    raw: bytes
    page_number: int
    records: list[dict[str, Any]]
    total_pages: int | None
    checkpoint: Checkpoint


class PageSource(Protocol):
    """Where a shard's pages come from when it is not a city listing (a change feed window).

    ``sync_city`` runs the same stages over its pages; the source says where the walk starts
    and goes on, may change the settings publishing runs with once every page is normalized
    (a window far above its usual volume is held for review), and writes its own state in
    the transaction that finishes the shard (an incremental task's watermark).
    """

    def pages(
        self, client: SupplierClient | None, start: Checkpoint | None, shard_key: str
    ) -> Iterator[FetchedPage]:
        """The pages from ``start`` (None: the beginning) on (``client`` None: a source that
        needs no supplier, an operator's fixed record)."""

    def publish_settings(self, report: CityReport, settings: SyncSettings) -> SyncSettings:
        """The settings to publish with, given what fetching and normalizing found."""

    def finish(self, conn: Connection, report: CityReport) -> None:
        """Runs in the transaction that finishes the shard SUCCESS."""


class Progress(Protocol):
    """Where a stage says what it is doing and learns whether it may go on.

    A :class:`HeartbeatRunner` for a sync under a lease; :data:`NO_PROGRESS` for a dry run,
    which holds no lease.
    """

    def check(self) -> None:
        """Raises when the work must stop (the lease is lost)."""

    def report(self, stage: str, message: str = "") -> None:
        """Says what the work is doing now."""


class _NoProgress:
    def check(self) -> None:
        return None

    def report(self, stage: str, message: str = "") -> None:
        return None


NO_PROGRESS: Progress = _NoProgress()
