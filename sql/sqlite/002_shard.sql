-- supplier-sync (SQLite): shards, each with its own lease and checkpoint (sql/002_shard.sql).
-- The same version in SQLite's dialect: the tables that core/schema.py creates on SQLite.
-- SQLite compares text byte for byte (utf8mb4_bin on MySQL), keeps no comments, and
-- auto-increments only an INTEGER PRIMARY KEY (BIGINT on MySQL).

CREATE TABLE IF NOT EXISTS supplier_sync_shard (
    id INTEGER NOT NULL,
    batch_id VARCHAR(64) NOT NULL,
    shard_type VARCHAR(32) NOT NULL,
    shard_key VARCHAR(128) NOT NULL,
    status VARCHAR(32) NOT NULL,
    checkpoint VARCHAR(1024),
    total_count INTEGER DEFAULT '0' NOT NULL,
    success_count INTEGER DEFAULT '0' NOT NULL,
    failed_count INTEGER DEFAULT '0' NOT NULL,
    skipped_count INTEGER DEFAULT '0' NOT NULL,
    pages_done INTEGER DEFAULT '0' NOT NULL,
    total_pages INTEGER,
    fetched_count INTEGER DEFAULT '0' NOT NULL,
    claim_count INTEGER DEFAULT '0' NOT NULL,
    worker_id VARCHAR(64),
    lease_token VARCHAR(64),
    lease_until DATETIME,
    heartbeat_at DATETIME,
    last_heartbeat_stage VARCHAR(64),
    last_heartbeat_message VARCHAR(512),
    last_checkpoint_at DATETIME,
    error_message VARCHAR(1024),
    created_at DATETIME NOT NULL,
    started_at DATETIME,
    finished_at DATETIME,
    updated_at DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT uk_batch_shard UNIQUE (batch_id, shard_key)
);
CREATE INDEX IF NOT EXISTS idx_lease ON supplier_sync_shard (status, lease_until);
CREATE INDEX IF NOT EXISTS idx_shard_status ON supplier_sync_shard (status);
CREATE INDEX IF NOT EXISTS idx_updated_at ON supplier_sync_shard (updated_at);
