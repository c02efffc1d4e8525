-- supplier-sync: batch-level quality gates. Normalization records a profile per batch and
-- city (counts and the top-level fields of the raw records); the gates compare it with the
-- city's previous successful batch. Thresholds are per task; overrides are audited.

CREATE TABLE IF NOT EXISTS supplier_sync_city_profile (
    id BIGINT NOT NULL AUTO_INCREMENT,
    batch_id VARCHAR(64) NOT NULL,
    task_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    shard_key VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL COMMENT 'supplier city code, verbatim',
    record_count INT NOT NULL DEFAULT 0 COMMENT 'records in the city''s raw pages',
    bad_count INT NOT NULL DEFAULT 0 COMMENT 'of which dead-lettered by normalization',
    field_counts JSON DEFAULT NULL COMMENT '{"records": n, "fields": {name: records having it}}, NULL = not profiled',
    created_at DATETIME(6) NOT NULL,
    updated_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_city_profile (batch_id, shard_key),
    KEY idx_profile_task_city (task_code, shard_key)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='what normalization saw per batch and city: the input of the quality gates';

CREATE TABLE IF NOT EXISTS supplier_sync_gate_override (
    id BIGINT NOT NULL AUTO_INCREMENT,
    batch_id VARCHAR(64) NOT NULL,
    shard_key VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    check_name VARCHAR(64) NOT NULL COMMENT 'bad_record_ratio/record_count/schema_drift',
    overridden_by VARCHAR(64) NOT NULL,
    reason VARCHAR(1024) NOT NULL,
    created_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_gate_override (batch_id, shard_key, check_name)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='quality gate overrides: who let a failed check pass, when and why';

CREATE TABLE IF NOT EXISTS supplier_sync_gate_threshold (
    id BIGINT NOT NULL AUTO_INCREMENT,
    task_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    thresholds JSON NOT NULL COMMENT 'GateThresholds fields, missing keys take the defaults',
    updated_by VARCHAR(64) DEFAULT NULL,
    created_at DATETIME(6) NOT NULL,
    updated_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_gate_threshold_task (task_code)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='per-task quality gate thresholds (JSON, missing keys take the defaults)';
