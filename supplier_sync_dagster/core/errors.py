"""Every exception that supplier-sync raises on purpose.

Catch the narrowest class that you can act on; every class carries a message that names
what is wrong and, where it helps, what to do about it.

The tree::

    SupplierSyncError                 base of everything below
    ├── ConfigError                   a setting is missing, malformed or out of range
    ├── DatabaseUnavailable           the sync database cannot be reached or opened
    ├── MigrationError                the schema cannot be brought to the newest version
    │   ├── MigrationChecksumMismatch an applied migration file was edited since
    │   ├── MigrationFailed           a MySQL migration stopped half-way: repair by hand
    │   └── MigrationLocked           another process held the migration lock too long
    ├── NotFound                      a named thing does not exist
    │   ├── UnknownTask
    │   ├── UnknownBatch
    │   ├── UnknownShard
    │   ├── UnknownOutboxEvent
    │   └── ProfileMissing            no city profile was recorded for this batch and city
    ├── TaskDisabled                  a batch was requested for a DISABLED task
    ├── TriggerSkipped                the task's concurrency policy skipped a trigger
    ├── NoBaseline                    an incremental sync has no watermark and no full sync to start from
    ├── InvalidCheckpoint             a checkpoint is malformed (bad JSON, wrong fields, too long)
    ├── InvalidTransition             a state machine refused a move (row not in the expected state)
    │   ├── ReviewStateError          a review is missing or not in the state a decision needs
    │   └── DeadLetterStateError      a dead letter is missing or not in the state a move needs
    ├── CountsDoNotAddUp              a shard's records are not all published, dead-lettered or skipped
    ├── InvalidGateOverride           a quality gate override was refused (unknown check, no who/why)
    ├── PayloadError                  the payload store (raw/normalized bytes) failed
    │   ├── PayloadNotFound           no payload under this reference
    │   └── PayloadCorrupt            stored bytes do not match their hash, or do not decompress
    ├── ProjectionUnavailable         a read model (search index, cache, broker) cannot be reached
    ├── LeaseError                    shard ownership problems
    │   ├── LeaseNotAcquired          the shard is held by a live lease, finished, or was taken first
    │   └── LeaseLost                 a fenced write matched 0 rows: stop, write nothing more
    └── SupplierError                 a call to a supplier's HTTP API failed (never shows the API key)
        ├── SupplierAuthError         401/403: wrong or missing key; never retried, stop the sync
        ├── SupplierBadRequest        400 (or another unexpected 4xx): a bug or bad config; no retry
        ├── SupplierNotFound          404: unknown city or hotel; no retry
        ├── CursorExpired             410 CURSOR_EXPIRED: fall back to page numbers
        ├── CircuitOpen               the supplier's circuit breaker is open: nothing was sent
        ├── RateLimiterUnavailable    the shared rate-limit store (Redis) cannot be reached
        └── RetryBudgetExhausted      retries used up (attempts or total wait) on a transient error
            ├── SupplierRateLimited   still 429 / RATE_LIMITED, or Retry-After beyond the budget
            ├── SupplierUnavailable   5xx, timeouts, connection errors
            └── SupplierProtocolError truncated, non-JSON or malformed bodies
"""

from __future__ import annotations

from typing import Any


class SupplierSyncError(Exception):
    """Base class of every error raised on purpose by supplier-sync."""


class ConfigError(SupplierSyncError):
    """A setting is missing, malformed or out of its allowed range."""


class DatabaseUnavailable(SupplierSyncError):
    """The sync database cannot be reached, opened or authenticated against."""


class MigrationError(SupplierSyncError):
    """The schema cannot be brought to the newest version of ``sql/`` (the message says why)."""


class MigrationChecksumMismatch(MigrationError):
    """A migration file was edited after its version was applied: add a new file instead."""


class MigrationFailed(MigrationError):
    """A migration stopped half-way on MySQL, whose DDL cannot be rolled back.

    The operator undoes (or completes) it by hand, then runs ``supplier-sync db repair``.
    """


class MigrationLocked(MigrationError):
    """Another process held the migration lock for longer than this one would wait."""


class NotFound(SupplierSyncError):
    """A named task, batch or shard does not exist."""


class UnknownTask(NotFound):
    """No `supplier_sync_task` row has this task_code."""


class UnknownBatch(NotFound):
    """No `supplier_sync_batch` row has this batch_id."""


class UnknownShard(NotFound):
    """No `supplier_sync_shard` row has this (batch_id, shard_key)."""


class UnknownOutboxEvent(NotFound):
    """No outbox event has this id."""


class ProfileMissing(NotFound):
    """No `supplier_sync_city_profile` row for this (batch_id, shard_key): not normalized yet."""


class TaskDisabled(SupplierSyncError):
    """A batch was requested for a task whose status is DISABLED."""


class TriggerSkipped(SupplierSyncError):
    """The task's concurrency policy skipped a trigger (e.g. SKIP_IF_RUNNING with a live batch).

    Attributes:
        blocking_batch_id: The batch that made the policy skip it, when there is one.
    """

    def __init__(self, message: str, *, blocking_batch_id: str | None = None) -> None:
        super().__init__(message)
        self.blocking_batch_id = blocking_batch_id


class NoBaseline(SupplierSyncError):
    """An incremental task has no watermark yet and no successful full sync to start from."""


class InvalidCheckpoint(SupplierSyncError):
    """A checkpoint could not be parsed or does not fit its column."""


class InvalidTransition(SupplierSyncError):
    """A guarded state move matched no row: the row was not in the expected state."""


class ReviewStateError(InvalidTransition):
    """A review decision named a review that does not exist or is no longer PENDING."""


class DeadLetterStateError(InvalidTransition):
    """A dead-letter move named a row that does not exist or is not in a state it leaves."""


class CountsDoNotAddUp(SupplierSyncError):
    """Invariant 4 broke: some fetched record ended in no bucket (a bug; nothing is finished)."""


class InvalidGateOverride(SupplierSyncError):
    """A quality gate override was refused: unknown check name, or no operator or reason."""


class PayloadError(SupplierSyncError):
    """The payload store could not store or return a payload."""


class PayloadNotFound(PayloadError):
    """No payload is stored under this reference."""


class PayloadCorrupt(PayloadError):
    """The stored bytes do not decompress or do not match the hash they are keyed by."""


class ProjectionUnavailable(SupplierSyncError):
    """A read model the outbox drives (the search index, the hotel cache, the subscribers'
    broker) cannot be reached or did not confirm: the dispatcher retries the batch later."""


class LeaseError(SupplierSyncError):
    """Base class of shard ownership errors."""


class LeaseNotAcquired(LeaseError):
    """A claim matched no row: a live lease holds the shard, it is finished, or another won.

    Attributes:
        shard: The shard as the claim read it (a ``leases.ShardInfo``), when it did.
    """

    def __init__(self, message: str, shard: Any = None) -> None:
        super().__init__(message)
        self.shard = shard


class LeaseLost(LeaseError):
    """A fenced write matched 0 rows: another worker owns the shard or the batch was cancelled.

    The worker that sees this must stop at once and write nothing more for the shard.
    """


class SupplierError(SupplierSyncError):
    """A call to a supplier's HTTP API failed.

    Messages name the endpoint path and what went wrong, never the API key.

    Attributes:
        status: The HTTP status of the last response, or None when none was received.
        code: The supplier's error code from an ``{"error": {"code", ...}}`` body, if any.
        attempts: How many requests were sent for this call.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        attempts: int = 0,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.attempts = attempts


class SupplierAuthError(SupplierError):
    """401/403: the API key is wrong, missing or not allowed. Never retried: stop the sync, alert."""


class SupplierBadRequest(SupplierError):
    """400 (or another unexpected 4xx): bad parameters, a bug or bad configuration. Not retried."""


class SupplierNotFound(SupplierError):
    """404: the supplier does not know this city or hotel. Not retried."""


class CursorExpired(SupplierError):
    """410 CURSOR_EXPIRED: the pagination cursor is too old; continue by page number."""


class CircuitOpen(SupplierError):
    """The supplier's circuit breaker is open: the request was not sent.

    Attributes:
        retry_in: Seconds until the breaker lets a probe request through.
    """

    def __init__(self, message: str, *, retry_in: float = 0.0) -> None:
        super().__init__(message)
        self.retry_in = retry_in


class RateLimiterUnavailable(SupplierError):
    """The shared rate-limit store (Redis) could not be reached, so no request was sent."""


class RetryBudgetExhausted(SupplierError):
    """A transient error persisted until the retry policy's attempts or total wait ran out.

    Attributes:
        reason: The last retry reason (``"status_503"``, ``"timeout"``, ``"bad_body"``...).
        retry_after: The wait the supplier last asked for (Retry-After), if any.
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        status: int | None = None,
        code: str | None = None,
        attempts: int = 0,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code, attempts=attempts)
        self.reason = reason
        self.retry_after = retry_after


class SupplierRateLimited(RetryBudgetExhausted):
    """Still rate limited (429 / RATE_LIMITED) after retrying, or asked to wait beyond the budget."""


class SupplierUnavailable(RetryBudgetExhausted):
    """5xx answers, timeouts or connection errors persisted after retrying."""


class SupplierProtocolError(RetryBudgetExhausted):
    """The supplier kept sending truncated, non-JSON or malformed bodies."""
