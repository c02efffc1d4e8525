-- supplier-sync (SQLite): diffs held for review and the decisions on them (sql/006_review.sql).
-- The same version in SQLite's dialect: the tables that core/schema.py creates on SQLite.
-- SQLite compares text byte for byte (utf8mb4_bin on MySQL), keeps no comments, and
-- auto-increments only an INTEGER PRIMARY KEY (BIGINT on MySQL).

CREATE TABLE IF NOT EXISTS supplier_sync_review (
    id INTEGER NOT NULL,
    review_id VARCHAR(64) NOT NULL,
    batch_id VARCHAR(64) NOT NULL,
    shard_key VARCHAR(128) NOT NULL,
    supplier_id BIGINT NOT NULL,
    supplier_hotel_id VARCHAR(128) NOT NULL,
    supplier_version BIGINT NOT NULL,
    platform_resource_id BIGINT NOT NULL,
    old_publish_version BIGINT,
    diff_type VARCHAR(64) NOT NULL,
    risk_level VARCHAR(32) NOT NULL,
    changed_fields JSON NOT NULL,
    candidate TEXT NOT NULL,
    fingerprint VARCHAR(64) NOT NULL,
    raw_payload_ref VARCHAR(512),
    raw_payload_hash VARCHAR(64),
    status VARCHAR(32) NOT NULL,
    decided_by VARCHAR(128),
    decision_reason VARCHAR(1024),
    decided_at DATETIME,
    publish_version BIGINT,
    created_at DATETIME NOT NULL,
    updated_at DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT uk_review_id UNIQUE (review_id)
);
CREATE INDEX IF NOT EXISTS idx_review_hotel ON supplier_sync_review (supplier_id, supplier_hotel_id);
CREATE INDEX IF NOT EXISTS idx_review_status ON supplier_sync_review (status, batch_id);
