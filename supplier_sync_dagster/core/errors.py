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
    │   ├── UnknownCity               a city code the supplier does not know
    │   ├── ProfileMissing            no city profile was recorded for this batch and city
    │   ├── NotPublishedThen          a hotel had no published version at the time asked
    │   └── HistoryNotKept            the time asked is before the publish history kept (retention)
    ├── InvalidTimestamp              a time given is not ISO 8601 with a zone, or is in the future
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
    ├── WorkerStartFailed             a run's worker processes could not start: the run stops, nothing failed
    ├── LeaseError                    shard ownership problems
    │   ├── LeaseNotAcquired          the shard is held by a live lease, finished, or was taken first
    │   │   └── ClaimLockHeld         another worker holds the shard's Redis claim lock: not tried
    │   ├── LeaseLost                 a fenced write matched 0 rows: stop, write nothing more
    │   │   └── ClaimLockLost         the Redis claim lock was not renewed: stopped, lease released
    │   └── ClaimLockUnavailable      Redis cannot be reached: the claim lock is skipped, MySQL decides
    └── SupplierError                 a call to a supplier's HTTP API failed (never shows the API key);
        │                             each class names its ``error_code``, the city's or record's code
        ├── SupplierAuthError         401/403: wrong, missing or revoked key; never retried, stop, alert
        ├── SupplierBadRequest        400 (or another unexpected 4xx): a bug or bad config; no retry
        ├── SupplierNotFound          404: unknown city or hotel; no retry
        │   └── CityNotFound          404 on a city: the supplier no longer lists it (it retires)
        ├── EmptyCityList             the supplier's city list is empty: nothing is retired
        ├── CursorExpired             410 CURSOR_EXPIRED: fall back to page numbers
        ├── CircuitOpen               the supplier's circuit breaker is open: nothing was sent
        ├── RateLimiterUnavailable    the shared rate-limit store (Redis) cannot be reached
        ├── RateShareExhausted        a caller's own share of the request budget is used up: nothing sent
        ├── ResponseTooLarge          a body past the byte cap on the wire; never read whole, no retry
        │   └── DecompressionBomb     a body that inflates past the cap after decompression
        ├── WalkRunaway               a city's walk would not end (cursor loop, pages past its size)
        └── RetryBudgetExhausted      retries used up (attempts or total wait) on a transient error
            ├── SupplierRateLimited   still 429 / RATE_LIMITED, or Retry-After beyond the budget
            ├── SupplierUnavailable   5xx answers persisted
            │   ├── SupplierTimeout   the request's total deadline passed (connect, headers and body)
            │   └── SupplierUnreachable  no connection: refused, DNS or TLS failure (``reason`` says)
            └── SupplierProtocolError non-JSON, malformed or too deeply nested bodies
                └── TruncatedBody     the connection closed before the body's end

Outside the tree, a ``BaseException`` like ``KeyboardInterrupt``: ``SyncInterrupted``, a run
told to stop, and its ``SyncCancelled``, a run whose batch was cancelled (nothing to resume). :func:`describe_error` is the one ``CODE: what happened`` line of a failed city.
"""

from __future__ import annotations

from typing import Any, ClassVar


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


class UnknownCity(NotFound):
    """A city code the supplier does not know (its city summary answered 404)."""


class UnknownOutboxEvent(NotFound):
    """No outbox event has this id."""


class ProfileMissing(NotFound):
    """No `supplier_sync_city_profile` row for this (batch_id, shard_key): not normalized yet."""


class NotPublishedThen(NotFound):
    """The hotel had no published version at the time asked (not yet published)."""


class HistoryNotKept(NotFound):
    """The time asked is before the publish history kept for the hotel: pruned by the
    retention setting, or published before the history was recorded."""


class InvalidTimestamp(SupplierSyncError):
    """A time given (``--as-of``, ``as_of``) is not ISO 8601 with a zone, or is in the future
    by the database clock."""


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


class WorkerStartFailed(SupplierSyncError):
    """A run's worker processes could not start (each opens its own connections): the run
    stops, its cities not started stay to resume, none is failed for it."""


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


class ClaimLockHeld(LeaseNotAcquired):
    """Another worker holds the shard's Redis claim lock: the claim did not touch the database."""


class ClaimLockLost(LeaseLost):
    """The shard's Redis claim lock could not be renewed (it expired or another worker holds
    it): the work stops and the database lease is given back, though it was still valid."""


class ClaimLockUnavailable(LeaseError):
    """Redis, which holds the claim locks, cannot be reached: the database alone decides."""


class SupplierError(SupplierSyncError):
    """A call to a supplier's HTTP API failed.

    Messages name the endpoint path and what went wrong, never the API key.

    Attributes:
        status: The HTTP status of the last response, or None when none was received.
        code: The supplier's error code from an ``{"error": {"code", ...}}`` body, if any.
        attempts: How many requests were sent for this call.
        error_code: The precise code a city's failure or a record's dead letter carries
            (``SUPPLIER_TIMEOUT``, ``BODY_TOO_LARGE``...): one per class, or per ``reason``.
    """

    error_code: str = "SUPPLIER_ERROR"

    def __init_subclass__(cls, code: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.error_code = code

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


class SupplierAuthError(SupplierError, code="SUPPLIER_AUTH_REJECTED"):
    """401/403: the API key is wrong, missing or not allowed. Never retried: stop the sync, alert."""


class SupplierBadRequest(SupplierError, code="SUPPLIER_BAD_REQUEST"):
    """400 (or another unexpected 4xx): bad parameters, a bug or bad configuration. Not retried."""


class SupplierNotFound(SupplierError, code="SUPPLIER_NOT_FOUND"):
    """404: the supplier does not know this city or hotel. Not retried."""


class CityNotFound(SupplierNotFound, code="CITY_NOT_FOUND"):
    """404 on a city's listing or summary: the supplier no longer serves the city. Not retried;
    a city its list lacks too is retired (``core.sync.retire``)."""


class EmptyCityList(SupplierError, code="EMPTY_CITY_LIST"):
    """The supplier's city list is empty. A supplier that lost every city is far likelier
    broken than out of business: no city is retired on it, and the sync says so."""


class CursorExpired(SupplierError, code="CURSOR_EXPIRED"):
    """410 CURSOR_EXPIRED: the pagination cursor is too old; continue by page number."""


class CircuitOpen(SupplierError, code="CIRCUIT_OPEN"):
    """The supplier's circuit breaker is open: the request was not sent.

    The message says why the breaker opened (the last failure's code and message), and
    :attr:`error_code` is that failure's code when the breaker knows it (``CONNECTION_REFUSED``,
    ``SUPPLIER_TIMEOUT``...), so a city that fails on an open breaker reports the real cause.

    Attributes:
        retry_in: Seconds until the breaker lets a probe request through.
        cause_code: The error code of the failure that opened the breaker, if known.
    """

    def __init__(
        self, message: str, *, retry_in: float = 0.0, cause_code: str | None = None
    ) -> None:
        super().__init__(message)
        self.retry_in = retry_in
        self.cause_code = cause_code
        if cause_code:
            self.error_code = cause_code


class RateLimiterUnavailable(SupplierError, code="RATE_LIMITER_UNAVAILABLE"):
    """The shared rate-limit store (Redis) could not be reached, so no request was sent."""


class RateShareExhausted(SupplierError, code="RATE_SHARE_EXHAUSTED"):
    """A caller's own share of the supplier's request budget (the read API's offer
    confirmations) has no token within the wait it allows: no request was sent, and the
    syncs' budget was not touched.

    Attributes:
        retry_after: Seconds until the share has a token again.
    """

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RetryBudgetExhausted(SupplierError, code="SUPPLIER_UNAVAILABLE"):
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


class SupplierRateLimited(RetryBudgetExhausted, code="SUPPLIER_RATE_LIMITED"):
    """Still rate limited (429 / RATE_LIMITED) after retrying, or asked to wait beyond the budget."""


class SupplierUnavailable(RetryBudgetExhausted, code="SUPPLIER_UNAVAILABLE"):
    """5xx answers (or a supplier that accepts no connection) persisted after retrying."""


class SupplierProtocolError(RetryBudgetExhausted, code="SUPPLIER_PROTOCOL_ERROR"):
    """The supplier kept sending truncated, non-JSON or malformed bodies.

    A body nested deeper than the JSON decoder's limit (``reason`` ``"json_too_deep"``,
    :attr:`error_code` ``JSON_TOO_DEEP``) is not retried: the same request gets the same body.
    """

    CODES: ClassVar[dict[str, str]] = {"json_too_deep": "JSON_TOO_DEEP"}

    def __init__(self, message: str, *, reason: str, **details: Any) -> None:
        super().__init__(message, reason=reason, **details)
        self.error_code = self.CODES.get(reason, type(self).error_code)


class SupplierTimeout(SupplierUnavailable, code="SUPPLIER_TIMEOUT"):
    """Every attempt ran past the request's total deadline (connect, headers and body together).

    A body that trickles in (a byte a second) ends here too: the deadline is not per chunk.
    """


class SupplierUnreachable(SupplierUnavailable):
    """No connection could be made: refused, the host name does not resolve, or TLS failed.

    ``reason`` is ``"connection_refused"``, ``"dns"``, ``"tls"`` or ``"connection"``, and
    :attr:`error_code` follows it.
    """

    CODES: ClassVar[dict[str, str]] = {
        "connection_refused": "CONNECTION_REFUSED",
        "dns": "DNS_FAILURE",
        "tls": "TLS_FAILURE",
    }

    def __init__(self, message: str, *, reason: str, **details: Any) -> None:
        super().__init__(message, reason=reason, **details)
        self.error_code = self.CODES.get(reason, "SUPPLIER_UNREACHABLE")


class TruncatedBody(SupplierProtocolError, code="TRUNCATED_BODY"):
    """The connection closed before the body's declared end, on every attempt."""


class ResponseTooLarge(SupplierError, code="BODY_TOO_LARGE"):
    """A response body passed the byte cap on the wire; it was not read further. Not retried:
    the same request gets the same body.

    Attributes:
        limit: The cap in bytes.
    """

    def __init__(self, message: str, *, limit: int, status: int | None = None) -> None:
        super().__init__(message, status=status)
        self.limit = limit


class DecompressionBomb(ResponseTooLarge, code="DECOMPRESSION_BOMB"):
    """A compressed body inflated past the cap on decoded bytes; decoding stopped there."""


class WalkRunaway(SupplierError, code="WALK_RUNAWAY"):
    """A city's walk would never end: a cursor seen before (at any distance), a page of hotels
    already seen, or more pages than the city's own counts allow. Nothing more is fetched."""


class SyncInterrupted(BaseException):
    """A run was told to stop (SIGTERM, SIGINT, a termination from the Dagster UI).

    A ``BaseException``, like ``KeyboardInterrupt``: no ``except Exception`` of a city's work
    takes it for the city's failure. The city's lease is released with its checkpoint (the
    page in flight is committed with its checkpoint or not at all), no CITY_FAILED ticket
    is filed, and the run resumes from there.

    Attributes:
        reason: What stopped the run (``"SIGTERM"``, ``"terminated from the Dagster UI"``).
    """

    def __init__(self, reason: str = "interrupted") -> None:
        super().__init__(reason)
        self.reason = reason


class SyncCancelled(SyncInterrupted):
    """A run whose batch was cancelled (CANCEL_PREVIOUS, an operator): it stops like
    :class:`SyncInterrupted`, but its batch is over, so nothing of it is released, resumed or
    waited for.

    Attributes:
        reason: Who or what cancelled it (``"cancelled by trigger night-2 (CANCEL_PREVIOUS)"``).
    """


INTERNAL_ERROR = "INTERNAL_ERROR"
"""The code of a failure that is not a supplier's (a bug, a database or store failure)."""

AUTH_REJECTED_CODES: frozenset[str] = frozenset({SupplierAuthError.error_code})
"""Codes of a supplier that refused the API key: the run stops, an alert fires."""

UNREACHABLE_CODES: frozenset[str] = frozenset(
    {*SupplierUnreachable.CODES.values(), "SUPPLIER_UNREACHABLE"}
)
"""Codes of a supplier that could not be reached at all (refused, DNS, TLS)."""


def error_code_of(err: BaseException) -> str:
    """The precise code a failed city carries: a supplier error's own, else INTERNAL_ERROR."""
    if isinstance(err, SupplierError):
        return str(err.error_code)
    return INTERNAL_ERROR


def root_cause(err: BaseException) -> BaseException:
    """The innermost exception that ``err`` was raised from (``__cause__``, else the
    ``__context__`` it was raised while handling), ``err`` itself when there is none."""
    seen = {id(err)}
    while True:
        inner = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
        if inner is None or id(inner) in seen:
            return err
        seen.add(id(inner))
        err = inner


def describe_error(err: BaseException) -> str:
    """``CODE: what happened`` for a failed city's report, shard and ticket, on one line.

    A supplier error's message names the request; anything else is named by its type. When
    the error was raised from another one, the root cause is added: a wrapper alone does
    not say what went wrong.
    """
    code = error_code_of(err)
    text = _one_line(err) if isinstance(err, SupplierError) else _typed(err)
    cause = root_cause(err)
    if cause is not err:
        text += f" (root cause: {_typed(cause)})"
    # A message that already leads with its code (a walk's rule) is not prefixed twice.
    return text if text.startswith(f"{code}: ") else f"{code}: {text}"


def code_of_description(text: str | None) -> str | None:
    """The code at the start of a :func:`describe_error` text (None: the text has none)."""
    head, sep, _ = (text or "").partition(": ")
    if sep and head and head.replace("_", "").isalnum() and head.upper() == head:
        return head
    return None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _typed(err: BaseException) -> str:
    text = _one_line(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
