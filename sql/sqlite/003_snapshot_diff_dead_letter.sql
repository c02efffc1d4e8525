-- supplier-sync (SQLite): snapshots, field-level diffs and dead letters
-- (sql/003_snapshot_diff_dead_letter.sql).
-- The same version in SQLite's dialect: the tables that core/schema.py creates on SQLite.
-- SQLite compares text byte for byte (utf8mb4_bin on MySQL), keeps no comments, and
-- auto-increments only an INTEGER PRIMARY KEY (BIGINT on MySQL).

CREATE TABLE IF NOT EXISTS supplier_sync_snapshot (
    id INTEGER NOT NULL,
    snapshot_id VARCHAR(64) NOT NULL,
    batch_id VARCHAR(64) NOT NULL,
    supplier_id BIGINT NOT NULL,
    category_code VARCHAR(32) NOT NULL,
    supplier_resource_code VARCHAR(128),
    supplier_product_code VARCHAR(128),
    shard_key VARCHAR(128),
    page_number INTEGER,
    record_count INTEGER,
    snapshot_type VARCHAR(32) NOT NULL,
    snapshot_version BIGINT NOT NULL,
    payload_ref VARCHAR(512),
    payload_hash VARCHAR(64) NOT NULL,
    created_at DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT uk_snapshot_id UNIQUE (snapshot_id)
);
CREATE INDEX IF NOT EXISTS idx_snapshot_batch ON supplier_sync_snapshot (batch_id, shard_key, snapshot_type);
CREATE INDEX IF NOT EXISTS idx_supplier_object ON supplier_sync_snapshot (supplier_id, supplier_resource_code, supplier_product_code);

CREATE TABLE IF NOT EXISTS supplier_sync_diff_log (
    id INTEGER NOT NULL,
    diff_id VARCHAR(64) NOT NULL,
    batch_id VARCHAR(64) NOT NULL,
    supplier_id BIGINT NOT NULL,
    category_code VARCHAR(32) NOT NULL,
    supplier_resource_code VARCHAR(128),
    supplier_product_code VARCHAR(128),
    platform_resource_id BIGINT,
    spu_id BIGINT,
    sku_id BIGINT,
    offer_id BIGINT,
    old_publish_version BIGINT,
    new_snapshot_version BIGINT NOT NULL,
    shard_key VARCHAR(128),
    diff_type VARCHAR(64) NOT NULL,
    changed_fields JSON NOT NULL,
    risk_level VARCHAR(32) NOT NULL,
    action VARCHAR(64) NOT NULL,
    created_at DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT uk_diff_id UNIQUE (diff_id)
);
CREATE INDEX IF NOT EXISTS idx_action ON supplier_sync_diff_log (action);
CREATE INDEX IF NOT EXISTS idx_diff_batch ON supplier_sync_diff_log (batch_id, shard_key);

CREATE TABLE IF NOT EXISTS supplier_sync_dead_letter (
    id INTEGER NOT NULL,
    dead_letter_id VARCHAR(64) NOT NULL,
    batch_id VARCHAR(64) NOT NULL,
    task_code VARCHAR(64) NOT NULL,
    sync_mode VARCHAR(32) NOT NULL,
    category_code VARCHAR(32) NOT NULL,
    supplier_id BIGINT NOT NULL,
    supplier_resource_code VARCHAR(128),
    supplier_product_code VARCHAR(128),
    platform_resource_id BIGINT,
    spu_id BIGINT,
    sku_id BIGINT,
    offer_id BIGINT,
    error_stage VARCHAR(64) NOT NULL,
    error_type VARCHAR(64) NOT NULL,
    error_code VARCHAR(128) NOT NULL,
    error_message VARCHAR(1024) NOT NULL,
    raw_payload_ref VARCHAR(512),
    raw_payload_hash VARCHAR(64),
    normalized_payload_ref VARCHAR(512),
    status VARCHAR(32) DEFAULT 'PENDING' NOT NULL,
    retry_count INTEGER DEFAULT '0' NOT NULL,
    max_retry_count INTEGER DEFAULT '5' NOT NULL,
    next_retry_at DATETIME,
    last_retry_at DATETIME,
    owner_team VARCHAR(64),
    assignee VARCHAR(64),
    fix_note VARCHAR(1024),
    created_at DATETIME NOT NULL,
    updated_at DATETIME NOT NULL,
    resolved_at DATETIME,
    PRIMARY KEY (id),
    CONSTRAINT uk_dead_letter_id UNIQUE (dead_letter_id),
    CONSTRAINT uk_dedup UNIQUE (batch_id, supplier_id, supplier_resource_code, supplier_product_code, error_stage, raw_payload_hash)
);
CREATE INDEX IF NOT EXISTS idx_category_status ON supplier_sync_dead_letter (category_code, status);
CREATE INDEX IF NOT EXISTS idx_status_next_retry ON supplier_sync_dead_letter (status, next_retry_at);
CREATE INDEX IF NOT EXISTS idx_supplier_status ON supplier_sync_dead_letter (supplier_id, status);
