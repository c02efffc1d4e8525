-- supplier-sync: tasks, batches and the trigger log.
-- MySQL 8 / MariaDB 10.6+, InnoDB, utf8mb4. Codes that come from suppliers or triggers use
-- utf8mb4_bin: 'a' and 'A' (or 'e' and 'é') are different codes. Times are UTC, DATETIME(6).
-- Must match supplier_sync_dagster/core/schema.py (a test compares them).

CREATE TABLE IF NOT EXISTS supplier_sync_task (
    id BIGINT NOT NULL AUTO_INCREMENT,
    task_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    supplier_id BIGINT NOT NULL,
    category_code VARCHAR(32) NOT NULL,
    sync_mode VARCHAR(32) NOT NULL COMMENT 'FULL/INCREMENTAL/PUSH/REFRESH',
    data_scope VARCHAR(64) NOT NULL COMMENT 'RESOURCE/PRODUCT/OFFER/STOCK_PRICE',
    schedule_type VARCHAR(32) NOT NULL COMMENT 'CRON/MANUAL/PUSH',
    cron_expr VARCHAR(64) DEFAULT NULL,
    status VARCHAR(32) NOT NULL COMMENT 'ENABLED/DISABLED',
    concurrency_policy VARCHAR(32) NOT NULL COMMENT 'SKIP_IF_RUNNING/CANCEL_PREVIOUS/ALLOW_PARALLEL',
    last_batch_id VARCHAR(64) DEFAULT NULL,
    owner_team VARCHAR(64) DEFAULT NULL,
    created_at DATETIME(6) NOT NULL,
    updated_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_task_code (task_code),
    KEY idx_supplier_category (supplier_id, category_code)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='supplier sync task definitions';

CREATE TABLE IF NOT EXISTS supplier_sync_batch (
    id BIGINT NOT NULL AUTO_INCREMENT,
    batch_id VARCHAR(64) NOT NULL,
    task_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    trigger_source VARCHAR(32) NOT NULL COMMENT 'CRON/MANUAL/COMPENSATION/SENSOR/BACKFILL',
    trigger_id VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin DEFAULT NULL COMMENT 'idempotency key of the trigger',
    supplier_id BIGINT NOT NULL,
    category_code VARCHAR(32) NOT NULL,
    sync_mode VARCHAR(32) NOT NULL,
    data_scope VARCHAR(64) NOT NULL,
    city_scope TEXT DEFAULT NULL COMMENT 'JSON list of shard keys, NULL = every city',
    status VARCHAR(32) NOT NULL COMMENT 'PENDING/RUNNING/SUCCESS/PARTIAL_FAILED/FAILED/CANCELLED',
    sync_batch_version BIGINT NOT NULL,
    start_checkpoint VARCHAR(512) DEFAULT NULL,
    end_checkpoint VARCHAR(512) DEFAULT NULL,
    shard_count INT NOT NULL DEFAULT 0,
    shards_done INT NOT NULL DEFAULT 0,
    pages_done INT NOT NULL DEFAULT 0,
    fetched_count INT NOT NULL DEFAULT 0 COMMENT 'records fetched so far (progress)',
    total_count INT NOT NULL DEFAULT 0,
    success_count INT NOT NULL DEFAULT 0,
    failed_count INT NOT NULL DEFAULT 0,
    skipped_count INT NOT NULL DEFAULT 0,
    current_city_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin DEFAULT NULL,
    current_page INT DEFAULT NULL,
    progress_percent DECIMAL(5,2) NOT NULL DEFAULT 0.00,
    worker_id VARCHAR(64) DEFAULT NULL,
    lease_token VARCHAR(64) DEFAULT NULL,
    lease_until DATETIME(6) DEFAULT NULL,
    heartbeat_at DATETIME(6) DEFAULT NULL,
    last_heartbeat_stage VARCHAR(64) DEFAULT NULL,
    last_heartbeat_message VARCHAR(512) DEFAULT NULL,
    last_checkpoint_at DATETIME(6) DEFAULT NULL,
    created_at DATETIME(6) NOT NULL,
    started_at DATETIME(6) DEFAULT NULL,
    finished_at DATETIME(6) DEFAULT NULL,
    updated_at DATETIME(6) NOT NULL,
    error_message VARCHAR(1024) DEFAULT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_batch_id (batch_id),
    UNIQUE KEY uk_task_trigger (task_code, trigger_id),
    KEY idx_task_status (task_code, status),
    KEY idx_status_lease (status, lease_until),
    KEY idx_supplier_time (supplier_id, started_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='supplier sync batches (one per trigger)';

CREATE TABLE IF NOT EXISTS supplier_sync_trigger_log (
    id BIGINT NOT NULL AUTO_INCREMENT,
    task_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    trigger_id VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    trigger_source VARCHAR(32) NOT NULL,
    outcome VARCHAR(32) NOT NULL COMMENT 'CREATED/SKIPPED',
    batch_id VARCHAR(64) DEFAULT NULL,
    blocking_batch_id VARCHAR(64) DEFAULT NULL,
    reason VARCHAR(512) DEFAULT NULL,
    created_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_trigger_log (task_code, trigger_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='every trigger decision: CREATED, SKIPPED, with the reason';
