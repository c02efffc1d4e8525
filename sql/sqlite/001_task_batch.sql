-- supplier-sync (SQLite): tasks, batches and the trigger log (sql/001_task_batch.sql).
-- The same version in SQLite's dialect: the tables that core/schema.py creates on SQLite.
-- SQLite compares text byte for byte (utf8mb4_bin on MySQL), keeps no comments, and
-- auto-increments only an INTEGER PRIMARY KEY (BIGINT on MySQL).

CREATE TABLE IF NOT EXISTS supplier_sync_task (
    id INTEGER NOT NULL,
    task_code VARCHAR(64) NOT NULL,
    supplier_id BIGINT NOT NULL,
    category_code VARCHAR(32) NOT NULL,
    sync_mode VARCHAR(32) NOT NULL,
    data_scope VARCHAR(64) NOT NULL,
    schedule_type VARCHAR(32) NOT NULL,
    cron_expr VARCHAR(64),
    status VARCHAR(32) NOT NULL,
    concurrency_policy VARCHAR(32) NOT NULL,
    last_batch_id VARCHAR(64),
    owner_team VARCHAR(64),
    created_at DATETIME NOT NULL,
    updated_at DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT uk_task_code UNIQUE (task_code)
);
CREATE INDEX IF NOT EXISTS idx_supplier_category ON supplier_sync_task (supplier_id, category_code);

CREATE TABLE IF NOT EXISTS supplier_sync_batch (
    id INTEGER NOT NULL,
    batch_id VARCHAR(64) NOT NULL,
    task_code VARCHAR(64) NOT NULL,
    trigger_source VARCHAR(32) NOT NULL,
    trigger_id VARCHAR(64),
    supplier_id BIGINT NOT NULL,
    category_code VARCHAR(32) NOT NULL,
    sync_mode VARCHAR(32) NOT NULL,
    data_scope VARCHAR(64) NOT NULL,
    city_scope TEXT,
    status VARCHAR(32) NOT NULL,
    sync_batch_version BIGINT NOT NULL,
    start_checkpoint VARCHAR(512),
    end_checkpoint VARCHAR(512),
    shard_count INTEGER DEFAULT '0' NOT NULL,
    shards_done INTEGER DEFAULT '0' NOT NULL,
    pages_done INTEGER DEFAULT '0' NOT NULL,
    fetched_count INTEGER DEFAULT '0' NOT NULL,
    total_count INTEGER DEFAULT '0' NOT NULL,
    success_count INTEGER DEFAULT '0' NOT NULL,
    failed_count INTEGER DEFAULT '0' NOT NULL,
    skipped_count INTEGER DEFAULT '0' NOT NULL,
    current_city_code VARCHAR(64),
    current_page INTEGER,
    progress_percent NUMERIC(5, 2) DEFAULT '0' NOT NULL,
    worker_id VARCHAR(64),
    lease_token VARCHAR(64),
    lease_until DATETIME,
    heartbeat_at DATETIME,
    last_heartbeat_stage VARCHAR(64),
    last_heartbeat_message VARCHAR(512),
    last_checkpoint_at DATETIME,
    created_at DATETIME NOT NULL,
    started_at DATETIME,
    finished_at DATETIME,
    updated_at DATETIME NOT NULL,
    error_message VARCHAR(1024),
    PRIMARY KEY (id),
    CONSTRAINT uk_batch_id UNIQUE (batch_id),
    CONSTRAINT uk_task_trigger UNIQUE (task_code, trigger_id)
);
CREATE INDEX IF NOT EXISTS idx_status_lease ON supplier_sync_batch (status, lease_until);
CREATE INDEX IF NOT EXISTS idx_supplier_time ON supplier_sync_batch (supplier_id, started_at);
CREATE INDEX IF NOT EXISTS idx_task_status ON supplier_sync_batch (task_code, status);

CREATE TABLE IF NOT EXISTS supplier_sync_trigger_log (
    id INTEGER NOT NULL,
    task_code VARCHAR(64) NOT NULL,
    trigger_id VARCHAR(64) NOT NULL,
    trigger_source VARCHAR(32) NOT NULL,
    outcome VARCHAR(32) NOT NULL,
    batch_id VARCHAR(64),
    blocking_batch_id VARCHAR(64),
    reason VARCHAR(512),
    created_at DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT uk_trigger_log UNIQUE (task_code, trigger_id)
);
