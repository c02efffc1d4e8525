-- supplier-sync (SQLite): city profiles, gate overrides and thresholds (sql/005_quality_gates.sql).
-- The same version in SQLite's dialect: the tables that core/schema.py creates on SQLite.
-- SQLite compares text byte for byte (utf8mb4_bin on MySQL), keeps no comments, and
-- auto-increments only an INTEGER PRIMARY KEY (BIGINT on MySQL).

CREATE TABLE IF NOT EXISTS supplier_sync_city_profile (
    id INTEGER NOT NULL,
    batch_id VARCHAR(64) NOT NULL,
    task_code VARCHAR(64) NOT NULL,
    shard_key VARCHAR(128) NOT NULL,
    record_count INTEGER DEFAULT '0' NOT NULL,
    bad_count INTEGER DEFAULT '0' NOT NULL,
    field_counts JSON,
    created_at DATETIME NOT NULL,
    updated_at DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT uk_city_profile UNIQUE (batch_id, shard_key)
);
CREATE INDEX IF NOT EXISTS idx_profile_task_city ON supplier_sync_city_profile (task_code, shard_key);

CREATE TABLE IF NOT EXISTS supplier_sync_gate_override (
    id INTEGER NOT NULL,
    batch_id VARCHAR(64) NOT NULL,
    shard_key VARCHAR(128) NOT NULL,
    check_name VARCHAR(64) NOT NULL,
    overridden_by VARCHAR(64) NOT NULL,
    reason VARCHAR(1024) NOT NULL,
    created_at DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT uk_gate_override UNIQUE (batch_id, shard_key, check_name)
);

CREATE TABLE IF NOT EXISTS supplier_sync_gate_threshold (
    id INTEGER NOT NULL,
    task_code VARCHAR(64) NOT NULL,
    thresholds JSON NOT NULL,
    updated_by VARCHAR(64),
    created_at DATETIME NOT NULL,
    updated_at DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT uk_gate_threshold_task UNIQUE (task_code)
);
