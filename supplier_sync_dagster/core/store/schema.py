"""The sync database schema as SQLAlchemy Core metadata.

This is the same schema as the numbered MySQL DDL in ``sql/`` and its SQLite twin in
``sql/sqlite/``, which :mod:`supplier_sync_dagster.core.store.migrations` applies; a test migrates a
fresh MariaDB and a fresh SQLite database and compares each with this metadata, so they cannot
drift. A change to the schema is a new numbered file in both folders and the same change here.

Codes that come from suppliers or triggers (task codes, trigger ids, city codes, hotel ids)
use a binary collation on MySQL: ``'a'`` and ``'A'`` or ``'e'`` and ``'é'`` are different
cities, and a case- or accent-insensitive unique key would merge them.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.schema import SchemaItem

metadata = sa.MetaData()

_MYSQL = ("mysql", "mariadb")


def _ts() -> sa.types.TypeEngine[Any]:
    """DATETIME with microseconds on MySQL; lease arithmetic needs sub-second precision."""
    t: sa.types.TypeEngine[Any] = sa.DateTime()
    for name in _MYSQL:
        t = t.with_variant(mysql.DATETIME(fsp=6), name)
    return t


def _code(length: int) -> sa.types.TypeEngine[str]:
    """A VARCHAR compared byte for byte (utf8mb4_bin) on MySQL."""
    t: sa.types.TypeEngine[str] = sa.String(length)
    for name in _MYSQL:
        t = t.with_variant(mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin"), name)
    return t


def _big_id() -> sa.types.TypeEngine[int]:
    # SQLite only auto-increments an INTEGER PRIMARY KEY, not a BIGINT one.
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _counter(name: str) -> sa.Column[int]:
    """A count that starts at zero."""
    return sa.Column(name, sa.Integer, nullable=False, server_default="0")


def _task_scope() -> tuple[sa.Column[Any], ...]:
    """What a task syncs; its batches copy it, so a batch says what it covered."""
    return (
        sa.Column("supplier_id", sa.BigInteger, nullable=False),
        sa.Column("category_code", sa.String(32), nullable=False),
        sa.Column("sync_mode", sa.String(32), nullable=False),
        sa.Column("data_scope", sa.String(64), nullable=False),
    )


def _record_counts() -> tuple[sa.Column[int], ...]:
    """A batch's or shard's records; ``total = success + failed + skipped`` (no silent loss)."""
    return tuple(
        _counter(name) for name in ("total_count", "success_count", "failed_count", "skipped_count")
    )


def _lease() -> tuple[sa.Column[Any], ...]:
    """Who holds a batch or shard and until when, and what its last heartbeat and checkpoint said."""
    return (
        sa.Column("worker_id", sa.String(64)),
        sa.Column("lease_token", sa.String(64)),
        sa.Column("lease_until", _ts()),
        sa.Column("heartbeat_at", _ts()),
        sa.Column("last_heartbeat_stage", sa.String(64)),
        sa.Column("last_heartbeat_message", sa.String(512)),
        sa.Column("last_checkpoint_at", _ts()),
    )


def _run_times() -> tuple[sa.Column[Any], ...]:
    """When a batch or shard was created, started, finished and last written."""
    return (
        sa.Column("created_at", _ts(), nullable=False),
        sa.Column("started_at", _ts()),
        sa.Column("finished_at", _ts()),
        sa.Column("updated_at", _ts(), nullable=False),
    )


def _platform_ids() -> tuple[sa.Column[int], ...]:
    """The platform entities a supplier record maps to (NULL until it is mapped)."""
    return tuple(
        sa.Column(name, sa.BigInteger)
        for name in ("platform_resource_id", "spu_id", "sku_id", "offer_id")
    )


def _raw_page() -> tuple[sa.Column[str], ...]:
    """The raw page a record came from: where its bytes are stored, and their sha256."""
    return (
        sa.Column("raw_payload_ref", sa.String(512)),
        sa.Column("raw_payload_hash", sa.String(64)),
    )


def _identity() -> tuple[sa.Column[Any], ...]:
    """What the acting process can prove about who acted (``core.store.audit.Identity``);
    NULL in rows written before it was recorded."""
    return (
        sa.Column("os_user", sa.String(64)),
        sa.Column("host", sa.String(255)),
        sa.Column("pid", sa.Integer),
        sa.Column("dagster_run_id", sa.String(64)),
        sa.Column("dagster_user", sa.String(255)),
    )


def _table(name: str, *items: SchemaItem, comment: str) -> sa.Table:
    return sa.Table(
        name,
        metadata,
        sa.Column("id", _big_id(), primary_key=True, autoincrement=True),
        *items,
        comment=comment,
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


task = _table(
    "supplier_sync_task",
    sa.Column("task_code", _code(64), nullable=False),
    *_task_scope(),
    sa.Column("schedule_type", sa.String(32), nullable=False),
    sa.Column("cron_expr", sa.String(64)),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("concurrency_policy", sa.String(32), nullable=False),
    sa.Column("last_batch_id", sa.String(64)),
    sa.Column("owner_team", sa.String(64)),
    sa.Column("created_at", _ts(), nullable=False),
    sa.Column("updated_at", _ts(), nullable=False),
    sa.UniqueConstraint("task_code", name="uk_task_code"),
    sa.Index("idx_supplier_category", "supplier_id", "category_code"),
    comment="supplier sync task definitions",
)

batch = _table(
    "supplier_sync_batch",
    sa.Column("batch_id", sa.String(64), nullable=False),
    sa.Column("task_code", _code(64), nullable=False),
    sa.Column("trigger_source", sa.String(32), nullable=False),
    sa.Column("trigger_id", _code(64)),
    *_task_scope(),
    # JSON list of the shard keys this batch covers; NULL means every city of the supplier.
    sa.Column("city_scope", sa.Text),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("sync_batch_version", sa.BigInteger, nullable=False),
    sa.Column("start_checkpoint", sa.String(512)),
    sa.Column("end_checkpoint", sa.String(512)),
    _counter("shard_count"),
    _counter("shards_done"),
    _counter("pages_done"),
    _counter("fetched_count"),
    *_record_counts(),
    sa.Column("current_city_code", _code(64)),
    sa.Column("current_page", sa.Integer),
    sa.Column("progress_percent", sa.Numeric(5, 2), nullable=False, server_default="0"),
    *_lease(),
    *_run_times(),
    sa.Column("error_message", sa.String(1024)),
    sa.UniqueConstraint("batch_id", name="uk_batch_id"),
    sa.UniqueConstraint("task_code", "trigger_id", name="uk_task_trigger"),
    sa.Index("idx_task_status", "task_code", "status"),
    sa.Index("idx_status_lease", "status", "lease_until"),
    sa.Index("idx_supplier_time", "supplier_id", "started_at"),
    comment="supplier sync batches (one per trigger)",
)

trigger_log = _table(
    "supplier_sync_trigger_log",
    sa.Column("task_code", _code(64), nullable=False),
    sa.Column("trigger_id", _code(64), nullable=False),
    sa.Column("trigger_source", sa.String(32), nullable=False),
    sa.Column("outcome", sa.String(32), nullable=False),
    sa.Column("batch_id", sa.String(64)),
    sa.Column("blocking_batch_id", sa.String(64)),
    sa.Column("reason", sa.String(512)),
    sa.Column("created_at", _ts(), nullable=False),
    sa.UniqueConstraint("task_code", "trigger_id", name="uk_trigger_log"),
    comment="every trigger decision: CREATED, SKIPPED, with the reason",
)

shard = _table(
    "supplier_sync_shard",
    sa.Column("batch_id", sa.String(64), nullable=False),
    sa.Column("shard_type", sa.String(32), nullable=False),
    sa.Column("shard_key", _code(128), nullable=False),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("checkpoint", sa.String(1024)),
    *_record_counts(),
    _counter("pages_done"),
    sa.Column("total_pages", sa.Integer),
    _counter("fetched_count"),
    _counter("claim_count"),
    *_lease(),
    sa.Column("error_message", sa.String(1024)),
    *_run_times(),
    sa.UniqueConstraint("batch_id", "shard_key", name="uk_batch_shard"),
    sa.Index("idx_shard_status", "status"),
    sa.Index("idx_lease", "status", "lease_until"),
    sa.Index("idx_updated_at", "updated_at"),
    comment="supplier sync shards (one per batch and city)",
)

snapshot = _table(
    "supplier_sync_snapshot",
    sa.Column("snapshot_id", sa.String(64), nullable=False),
    sa.Column("batch_id", sa.String(64), nullable=False),
    sa.Column("supplier_id", sa.BigInteger, nullable=False),
    sa.Column("category_code", sa.String(32), nullable=False),
    sa.Column("supplier_resource_code", _code(128)),
    # NORMALIZED: the sha256 of its raw page; a replayed RAW page: 'replay-of:<batch>'.
    sa.Column("derived_from", _code(128)),
    sa.Column("shard_key", _code(128)),
    sa.Column("page_number", sa.Integer),
    sa.Column("record_count", sa.Integer),
    sa.Column("snapshot_type", sa.String(32), nullable=False),
    sa.Column("snapshot_version", sa.BigInteger, nullable=False),
    sa.Column("payload_ref", sa.String(512)),
    sa.Column("payload_hash", sa.String(64), nullable=False),
    sa.Column("created_at", _ts(), nullable=False),
    sa.UniqueConstraint("snapshot_id", name="uk_snapshot_id"),
    sa.Index("idx_snapshot_batch", "batch_id", "shard_key", "snapshot_type"),
    sa.Index("idx_snapshot_derived_from", "supplier_id", "supplier_resource_code", "derived_from"),
    sa.Index("idx_snapshot_payload_hash", "payload_hash"),
    comment="raw and normalized supplier payload snapshots",
)

diff_log = _table(
    "supplier_sync_diff_log",
    sa.Column("diff_id", sa.String(64), nullable=False),
    sa.Column("batch_id", sa.String(64), nullable=False),
    sa.Column("supplier_id", sa.BigInteger, nullable=False),
    sa.Column("category_code", sa.String(32), nullable=False),
    sa.Column("supplier_resource_code", _code(128)),
    sa.Column("supplier_product_code", _code(128)),
    *_platform_ids(),
    sa.Column("old_publish_version", sa.BigInteger),
    sa.Column("new_snapshot_version", sa.BigInteger, nullable=False),
    sa.Column("shard_key", _code(128)),
    sa.Column("diff_type", sa.String(64), nullable=False),
    sa.Column("changed_fields", sa.JSON, nullable=False),
    sa.Column("risk_level", sa.String(32), nullable=False),
    sa.Column("action", sa.String(64), nullable=False),
    sa.Column("created_at", _ts(), nullable=False),
    # The raw page its new version came from (``trace`` reads the bytes of each version).
    sa.Column("raw_payload_hash", sa.String(64)),
    sa.UniqueConstraint("diff_id", name="uk_diff_id"),
    sa.Index("idx_diff_batch", "batch_id", "shard_key"),
    sa.Index("idx_action", "action"),
    sa.Index("idx_diff_resource", "supplier_id", "supplier_resource_code"),
    comment="field-level differences between normalized and published data",
)

dead_letter = _table(
    "supplier_sync_dead_letter",
    sa.Column("dead_letter_id", sa.String(64), nullable=False),
    sa.Column("batch_id", sa.String(64), nullable=False),
    sa.Column("task_code", _code(64), nullable=False),
    sa.Column("sync_mode", sa.String(32), nullable=False),
    sa.Column("category_code", sa.String(32), nullable=False),
    sa.Column("supplier_id", sa.BigInteger, nullable=False),
    sa.Column("supplier_resource_code", _code(128)),
    # The record's place on its raw page ('record#N'): two bad records of a page stay two.
    sa.Column("record_position", _code(128)),
    *_platform_ids(),
    sa.Column("error_stage", sa.String(64), nullable=False),
    sa.Column("error_type", sa.String(64), nullable=False),
    sa.Column("error_code", sa.String(128), nullable=False),
    sa.Column("error_message", sa.String(1024), nullable=False),
    *_raw_page(),
    sa.Column("normalized_payload_ref", sa.String(512)),
    sa.Column("status", sa.String(32), nullable=False, server_default="PENDING"),
    _counter("retry_count"),
    sa.Column("max_retry_count", sa.Integer, nullable=False, server_default="5"),
    sa.Column("next_retry_at", _ts()),
    sa.Column("last_retry_at", _ts()),
    sa.Column("owner_team", sa.String(64)),
    sa.Column("assignee", sa.String(64)),
    sa.Column("fix_note", sa.String(1024)),
    sa.Column("created_at", _ts(), nullable=False),
    sa.Column("updated_at", _ts(), nullable=False),
    sa.Column("resolved_at", _ts()),
    sa.Column("city_code", _code(64)),
    # The compensation batch of its latest attempt (a killed one is resumed or released).
    sa.Column("retry_batch_id", sa.String(64)),
    # One ticket per problem: hotel:<id>, city:<code> or record:<page hash>#<position>.
    sa.Column("subject_key", _code(200)),
    # 1 while open, NULL once closed: uk_dead_letter_open allows one open ticket per problem
    # (NULLs never collide in a UNIQUE key, on MariaDB as on SQLite).
    sa.Column("open_slot", sa.SmallInteger().with_variant(mysql.TINYINT(), *_MYSQL)),
    sa.Column("seen_count", sa.Integer, nullable=False, server_default="1"),
    sa.Column("last_seen_at", _ts()),
    sa.Column("last_batch_id", sa.String(64)),
    sa.Column("record_version", sa.BigInteger),
    sa.UniqueConstraint("dead_letter_id", name="uk_dead_letter_id"),
    sa.UniqueConstraint(
        "batch_id",
        "supplier_id",
        "supplier_resource_code",
        "record_position",
        "error_stage",
        "raw_payload_hash",
        name="uk_dedup",
    ),
    # A unique index (not a table constraint), as sql/sqlite/017 can add one in place.
    sa.Index(
        "uk_dead_letter_open",
        "supplier_id",
        "subject_key",
        "error_code",
        "open_slot",
        unique=True,
    ),
    sa.Index("idx_status_next_retry", "status", "next_retry_at"),
    sa.Index("idx_dead_letter_hotel", "supplier_id", "supplier_resource_code"),
    sa.Index("idx_dead_letter_retry_batch", "retry_batch_id"),
    sa.Index("idx_dead_letter_created", "created_at"),
    sa.Index("idx_supplier_status", "supplier_id", "status"),
    sa.Index("idx_category_status", "category_code", "status"),
    comment="dead letters: every record that could not be published, with its state",
)


hotel_mapping = _table(
    "supplier_sync_hotel_mapping",
    # id is the platform resource id: allocated once, by the unique key, never reused.
    sa.Column("supplier_id", sa.BigInteger, nullable=False),
    sa.Column("supplier_hotel_id", _code(128), nullable=False),
    sa.Column("created_batch_id", sa.String(64), nullable=False),
    sa.Column("created_at", _ts(), nullable=False),
    sa.UniqueConstraint("supplier_id", "supplier_hotel_id", name="uk_supplier_hotel"),
    comment="supplier hotel -> platform resource id (the row id)",
)

platform_hotel = sa.Table(
    "platform_hotel_resource",
    metadata,
    sa.Column("resource_id", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("supplier_id", sa.BigInteger, nullable=False),
    sa.Column("supplier_hotel_id", _code(128), nullable=False),
    sa.Column("supplier_version", sa.BigInteger, nullable=False),
    sa.Column("publish_version", sa.BigInteger, nullable=False),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("name", sa.String(255), nullable=False),
    sa.Column("name_local", sa.String(255)),
    sa.Column("city_code", _code(64), nullable=False),
    sa.Column("country_code", sa.String(2), nullable=False),
    sa.Column("address_line1", sa.String(512)),
    sa.Column("postal_code", sa.String(32)),
    sa.Column("lat", sa.Double, nullable=False),
    sa.Column("lng", sa.Double, nullable=False),
    sa.Column("star_rating", sa.Numeric(2, 1)),
    sa.Column("phone", sa.String(32)),
    sa.Column("email", sa.String(254)),
    sa.Column("facilities", sa.Text),
    sa.Column("images", sa.Text),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("supplier_updated_at", _ts(), nullable=False),
    *_raw_page(),
    sa.Column("last_batch_id", sa.String(64), nullable=False),
    sa.Column("publish_token", sa.String(64), nullable=False),
    sa.Column("published_at", _ts(), nullable=False),
    # Tombstones: complete full syncs of its city in a row that did not list the hotel.
    sa.Column("missing_count", sa.Integer, nullable=False, server_default=sa.text("0")),
    sa.Column("missing_since", _ts()),
    sa.UniqueConstraint("supplier_id", "supplier_hotel_id", name="uk_platform_supplier_hotel"),
    sa.Index("idx_platform_city", "supplier_id", "city_code"),
    sa.Index("idx_platform_missing", "supplier_id", "missing_count"),
    comment="the platform's published hotel resources",
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)

# Snapshot types: a page as the supplier sent it, and the documents normalized from it.
RAW = "RAW"
NORMALIZED = "NORMALIZED"

# The offer identity index: lookups of a hotel's offers read it (``db.use_index``).
OFFER_IDENTITY = "uk_offer_identity"

platform_offer = sa.Table(
    "platform_hotel_offer",
    metadata,
    # The offer id is allocated once by the table itself, under the unique key of the
    # (hotel, room, rate plan) it stands for: this table is the offer mapping.
    sa.Column("offer_id", _big_id(), primary_key=True, autoincrement=True),
    sa.Column("resource_id", sa.BigInteger, nullable=False),
    sa.Column("room_code", _code(64), nullable=False),
    sa.Column("rate_plan_code", _code(64), nullable=False),
    sa.Column("room_name", sa.String(255)),
    sa.Column("bed_type", sa.String(32)),
    sa.Column("max_occupancy", sa.Integer),
    sa.Column("board", sa.String(32)),
    sa.Column("refundable", sa.Boolean),
    sa.Column("available", sa.Boolean, nullable=False),
    sa.Column("price_amount", sa.Numeric(18, 4), nullable=False),
    sa.Column("currency", sa.String(3), nullable=False),
    sa.Column("supplier_version", sa.BigInteger, nullable=False),
    sa.Column("publish_version", sa.BigInteger, nullable=False),
    sa.Column("active", sa.Boolean, nullable=False),
    sa.Column("updated_at", _ts(), nullable=False),
    sa.UniqueConstraint("resource_id", "room_code", "rate_plan_code", name=OFFER_IDENTITY),
    comment="the platform's published offers (room x rate plan) of hotel resources",
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)

outbox = _table(
    "supplier_sync_outbox",
    sa.Column("event_id", sa.String(64), nullable=False),
    sa.Column("event_type", sa.String(64), nullable=False),
    sa.Column("aggregate_type", sa.String(32), nullable=False),
    sa.Column("aggregate_id", sa.BigInteger, nullable=False),
    sa.Column("aggregate_version", sa.BigInteger, nullable=False),
    sa.Column("batch_id", sa.String(64), nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
    # The stage machine (core/outbox/machine.py, sql/011): the stage done last, the one to run,
    # the status, the stage's retries, when it is due, the dispatcher's lease.
    sa.Column("status", sa.String(32), nullable=False, server_default="READY"),
    sa.Column("current_stage", sa.String(32), nullable=False, server_default="PUBLISHED"),
    sa.Column("next_stage", sa.String(32), nullable=False, server_default="SEARCH_INDEX"),
    _counter("retry_count"),
    sa.Column("next_attempt_at", _ts()),
    sa.Column("lease_owner", sa.String(128)),
    sa.Column("lease_until", _ts()),
    sa.Column("last_error", sa.String(1024)),
    sa.Column("created_at", _ts(), nullable=False),
    sa.Column("projected_at", _ts()),
    sa.Column("finished_at", _ts()),
    # One event of a type per published version of an aggregate; event_id hashes exactly
    # this key. Keyed by it rather than by the hash, inserts append (sql/008).
    sa.UniqueConstraint(
        "aggregate_type", "aggregate_id", "aggregate_version", "event_type", name="uk_outbox_event"
    ),
    sa.Index("idx_outbox_claim", "status", "next_stage", "id"),
    comment="transactional outbox: events written with the publish that caused them",
)

audit = _table(
    "supplier_sync_audit",
    sa.Column("action", sa.String(64), nullable=False),
    sa.Column("target_type", sa.String(32), nullable=False),
    sa.Column("target_id", sa.String(128), nullable=False),
    sa.Column("actor", sa.String(64), nullable=False),
    sa.Column("reason", sa.String(1024), nullable=False),
    sa.Column("before_state", sa.Text),
    sa.Column("after_state", sa.Text),
    sa.Column("created_at", _ts(), nullable=False),
    *_identity(),
    sa.Index("idx_audit_target", "target_type", "target_id", "created_at"),
    sa.Index("idx_audit_time", "created_at"),
    sa.Index("idx_audit_run", "dagster_run_id"),
    comment="every operator action: who, when, what, why, before and after",
)

city_profile = _table(
    "supplier_sync_city_profile",
    sa.Column("batch_id", sa.String(64), nullable=False),
    sa.Column("task_code", _code(64), nullable=False),
    sa.Column("shard_key", _code(128), nullable=False),
    _counter("record_count"),
    _counter("bad_count"),
    # {"records": n, "fields": {name: records having it}}; NULL: the fields were not profiled.
    sa.Column("field_counts", sa.JSON(none_as_null=True)),
    sa.Column("created_at", _ts(), nullable=False),
    sa.Column("updated_at", _ts(), nullable=False),
    sa.UniqueConstraint("batch_id", "shard_key", name="uk_city_profile"),
    sa.Index("idx_profile_task_city", "task_code", "shard_key"),
    comment="what normalization saw per batch and city: the input of the quality gates",
)

gate_override = _table(
    "supplier_sync_gate_override",
    sa.Column("batch_id", sa.String(64), nullable=False),
    sa.Column("shard_key", _code(128), nullable=False),
    sa.Column("check_name", sa.String(64), nullable=False),
    sa.Column("overridden_by", sa.String(64), nullable=False),
    sa.Column("reason", sa.String(1024), nullable=False),
    sa.Column("created_at", _ts(), nullable=False),
    sa.UniqueConstraint("batch_id", "shard_key", "check_name", name="uk_gate_override"),
    comment="quality gate overrides: who let a failed check pass, when and why",
)

gate_threshold = _table(
    "supplier_sync_gate_threshold",
    sa.Column("task_code", _code(64), nullable=False),
    sa.Column("thresholds", sa.JSON, nullable=False),
    sa.Column("updated_by", sa.String(64)),
    sa.Column("created_at", _ts(), nullable=False),
    sa.Column("updated_at", _ts(), nullable=False),
    sa.UniqueConstraint("task_code", name="uk_gate_threshold_task"),
    comment="per-task quality gate thresholds (JSON, missing keys take the defaults)",
)

review = _table(
    "supplier_sync_review",
    sa.Column("review_id", sa.String(64), nullable=False),
    sa.Column("batch_id", sa.String(64), nullable=False),
    sa.Column("shard_key", _code(128), nullable=False),
    sa.Column("supplier_id", sa.BigInteger, nullable=False),
    sa.Column("supplier_hotel_id", _code(128), nullable=False),
    sa.Column("supplier_version", sa.BigInteger, nullable=False),
    sa.Column("platform_resource_id", sa.BigInteger, nullable=False),
    sa.Column("old_publish_version", sa.BigInteger),
    sa.Column("diff_type", sa.String(64), nullable=False),
    sa.Column("risk_level", sa.String(32), nullable=False),
    sa.Column("changed_fields", sa.JSON, nullable=False),
    sa.Column("candidate", sa.Text().with_variant(mysql.MEDIUMTEXT(), *_MYSQL), nullable=False),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    *_raw_page(),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("decided_by", sa.String(128)),
    sa.Column("decision_reason", sa.String(1024)),
    sa.Column("decided_at", _ts()),
    sa.Column("publish_version", sa.BigInteger),
    sa.Column("created_at", _ts(), nullable=False),
    sa.Column("updated_at", _ts(), nullable=False),
    sa.UniqueConstraint("review_id", name="uk_review_id"),
    sa.Index("idx_review_status", "status", "batch_id"),
    sa.Index("idx_review_hotel", "supplier_id", "supplier_hotel_id"),
    comment="diffs held for review and the decisions on them",
)

task_audit = _table(
    "supplier_sync_task_audit",
    sa.Column("task_code", _code(64), nullable=False),
    sa.Column("field_name", sa.String(64), nullable=False),
    sa.Column("old_value", sa.String(1024)),
    sa.Column("new_value", sa.String(1024)),
    sa.Column("changed_by", sa.String(64), nullable=False),
    sa.Column("reason", sa.String(1024), nullable=False),
    sa.Column("created_at", _ts(), nullable=False),
    *_identity(),
    sa.Index("idx_task_audit_task", "task_code", "created_at"),
    comment="every change of a task's settings: who, when, why, old and new value",
)

watermark = _table(
    "supplier_sync_watermark",
    sa.Column("task_code", _code(64), nullable=False),
    sa.Column("supplier_id", sa.BigInteger, nullable=False),
    sa.Column("watermark_at", _ts(), nullable=False),
    sa.Column("watermark_hotel_id", _code(128), nullable=False),
    sa.Column("batch_id", sa.String(64)),
    sa.Column("created_at", _ts(), nullable=False),
    sa.Column("updated_at", _ts(), nullable=False),
    sa.UniqueConstraint("task_code", name="uk_watermark_task"),
    comment="per incremental task: how far its change feed is published",
)

run_stats = _table(
    "supplier_sync_run_stats",
    sa.Column("batch_id", sa.String(64), nullable=False),
    sa.Column("task_code", _code(64), nullable=False),
    sa.Column("worker_id", sa.String(64), nullable=False),
    _counter("cities"),
    _counter("records"),
    _counter("published"),
    _counter("requests"),
    _counter("throttled"),
    _counter("retries"),
    sa.Column("seconds", sa.Double, nullable=False, server_default="0"),
    sa.Column("created_at", _ts(), nullable=False),
    sa.Column("limiter_wait_seconds", sa.Double, nullable=False, server_default="0"),
    sa.Column("governed_rate", sa.Double),
    sa.Index("idx_run_stats_task_time", "task_code", "created_at"),
    sa.Index("idx_run_stats_batch", "batch_id"),
    comment="what each run asked of the supplier and published",
)

alert = _table(
    "supplier_sync_alert",
    sa.Column("alert_key", _code(255), nullable=False),
    # The alert key while the condition holds, NULL once it cleared: one open episode each.
    sa.Column("open_key", _code(255)),
    sa.Column("condition_name", sa.String(64), nullable=False),
    sa.Column("task_code", _code(64), nullable=False),
    sa.Column("subject", _code(128), nullable=False, server_default=""),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("value", sa.Double),
    sa.Column("threshold", sa.Double),
    sa.Column("message", sa.String(1024), nullable=False),
    sa.Column("run_url", sa.String(512)),
    sa.Column("started_at", _ts(), nullable=False),
    sa.Column("resolved_at", _ts()),
    sa.Column("updated_at", _ts(), nullable=False),
    sa.UniqueConstraint("open_key", name="uk_alert_open"),
    sa.Index("idx_alert_status", "status", "started_at"),
    sa.Index("idx_alert_task", "task_code", "started_at"),
    comment="alert episodes: from the start of a condition to its end",
)

alert_delivery = _table(
    "supplier_sync_alert_delivery",
    sa.Column("alert_id", sa.BigInteger, nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    _counter("attempts"),
    sa.Column("next_attempt_at", _ts(), nullable=False),
    sa.Column("last_error", sa.String(1024)),
    sa.Column("sent_at", _ts()),
    sa.Column("created_at", _ts(), nullable=False),
    sa.UniqueConstraint("alert_id", "kind", name="uk_alert_delivery"),
    sa.Index("idx_delivery_due", "status", "next_attempt_at"),
    comment="each start and end of an alert, to the alert channel",
)

alert_threshold = _table(
    "supplier_sync_alert_threshold",
    sa.Column("task_code", _code(64), nullable=False),
    sa.Column("name", sa.String(64), nullable=False),
    sa.Column("value", sa.Double, nullable=False),
    sa.Column("updated_by", sa.String(64), nullable=False),
    sa.Column("updated_at", _ts(), nullable=False),
    sa.UniqueConstraint("task_code", "name", name="uk_alert_threshold"),
    comment="per task: the thresholds alerts are judged by",
)

city_walk = _table(
    "supplier_sync_city_walk",
    sa.Column("batch_id", sa.String(64), nullable=False),
    sa.Column("shard_key", _code(128), nullable=False),
    # SHIFTED (seen and verified), UNVERIFIED, UNCHECKED: core/supplier/walk.py, Drift.
    sa.Column("drift", sa.String(16), nullable=False),
    *(_counter(name) for name in ("shifts", "fallbacks", "probes", "recovered", "requests")),
    sa.Column("created_at", _ts(), nullable=False),
    sa.UniqueConstraint("batch_id", "shard_key", name="uk_city_walk"),
    sa.Index("idx_city_walk_created", "created_at"),
    comment="city walks whose listing shifted (or could have, unchecked) under them",
)

hotel_version = _table(
    "supplier_sync_hotel_version",
    *(sa.Column(name, sa.BigInteger, nullable=False) for name in ("resource_id", "supplier_id")),
    sa.Column("supplier_hotel_id", _code(128), nullable=False),
    *(
        sa.Column(name, sa.BigInteger, nullable=False)
        for name in ("publish_version", "supplier_version")
    ),
    # ACTIVE/INACTIVE as published; the diff type that produced the version, or UNPUBLISHED
    # (a tombstone, with why: change_reason); the batch; the raw page and the document.
    *(
        sa.Column(name, sa.String(length), nullable=not required)
        for name, length, required in (
            ("status", 16, True),
            ("change_type", 64, True),
            ("change_reason", 32, False),
            ("batch_id", 64, True),
            ("raw_payload_hash", 64, False),
            ("document_hash", 64, True),
        )
    ),
    sa.Column("published_at", _ts(), nullable=False),
    sa.UniqueConstraint("resource_id", "publish_version", name="uk_hotel_version"),
    *(
        sa.Index(f"idx_hotel_version_{name}", *columns)
        for name, columns in (
            ("hotel", ("supplier_id", "supplier_hotel_id", "publish_version")),
            ("time", ("published_at",)),
            ("document", ("document_hash",)),
        )
    ),
    comment="every published version of a hotel: when, why, from what",
)

published_document = _table(
    "supplier_sync_published_document",
    # The canonical JSON, zlib-compressed, under its sha256: once per content (versions
    # share it).
    sa.Column(
        "document", sa.LargeBinary().with_variant(mysql.MEDIUMBLOB(), *_MYSQL), nullable=False
    ),
    sa.Column("document_hash", sa.String(64), nullable=False),
    sa.Column("created_at", _ts(), nullable=False),
    sa.Column("last_used_at", _ts(), nullable=False),
    sa.UniqueConstraint("document_hash", name="uk_published_document"),
    sa.Index("idx_published_document_used", "last_used_at"),
    comment="published hotel documents, stored once per content",
)
