-- supplier-sync: sync health and alerts.
-- Each run records what it asked of the supplier (requests, 429s, retries) and what it
-- published, so that metrics read a few rows instead of the catalog. Alerts are episodes:
-- one row from the moment a condition starts until it clears (open_key is set while it
-- fires, so a condition fires once); each start and each clearing is one delivery to the
-- alert channel, retried until it is sent. Thresholds are per task, changed by operators
-- (audited).

CREATE TABLE IF NOT EXISTS supplier_sync_run_stats (
    id BIGINT NOT NULL AUTO_INCREMENT,
    batch_id VARCHAR(64) NOT NULL,
    task_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    worker_id VARCHAR(64) NOT NULL,
    cities INT NOT NULL DEFAULT 0,
    records INT NOT NULL DEFAULT 0,
    published INT NOT NULL DEFAULT 0,
    requests INT NOT NULL DEFAULT 0,
    throttled INT NOT NULL DEFAULT 0 COMMENT '429 answers',
    retries INT NOT NULL DEFAULT 0,
    seconds DOUBLE NOT NULL DEFAULT 0,
    created_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    KEY idx_run_stats_task_time (task_code, created_at),
    KEY idx_run_stats_batch (batch_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='what each run asked of the supplier and published';

CREATE TABLE IF NOT EXISTS supplier_sync_alert (
    id BIGINT NOT NULL AUTO_INCREMENT,
    alert_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL COMMENT 'condition/task/subject',
    open_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin DEFAULT NULL COMMENT 'alert_key while FIRING, else NULL',
    condition_name VARCHAR(64) NOT NULL,
    task_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    subject VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL DEFAULT '' COMMENT 'a city, or empty',
    status VARCHAR(16) NOT NULL COMMENT 'FIRING or RESOLVED',
    value DOUBLE DEFAULT NULL,
    threshold DOUBLE DEFAULT NULL,
    message VARCHAR(1024) NOT NULL,
    run_url VARCHAR(512) DEFAULT NULL,
    started_at DATETIME(6) NOT NULL,
    resolved_at DATETIME(6) DEFAULT NULL,
    updated_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_alert_open (open_key),
    KEY idx_alert_status (status, started_at),
    KEY idx_alert_task (task_code, started_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='alert episodes: from the start of a condition to its end';

CREATE TABLE IF NOT EXISTS supplier_sync_alert_delivery (
    id BIGINT NOT NULL AUTO_INCREMENT,
    alert_id BIGINT NOT NULL,
    kind VARCHAR(16) NOT NULL COMMENT 'FIRING or RESOLVED',
    status VARCHAR(16) NOT NULL COMMENT 'PENDING or SENT',
    attempts INT NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6) NOT NULL,
    last_error VARCHAR(1024) DEFAULT NULL,
    sent_at DATETIME(6) DEFAULT NULL,
    created_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_alert_delivery (alert_id, kind),
    KEY idx_delivery_due (status, next_attempt_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='each start and end of an alert, to the alert channel';

CREATE TABLE IF NOT EXISTS supplier_sync_alert_threshold (
    id BIGINT NOT NULL AUTO_INCREMENT,
    task_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    name VARCHAR(64) NOT NULL,
    value DOUBLE NOT NULL,
    updated_by VARCHAR(64) NOT NULL,
    updated_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_alert_threshold (task_code, name)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='per task: the thresholds alerts are judged by';

-- Dead letters written per day (the spike alert compares today with the days before).
CREATE INDEX idx_dead_letter_created ON supplier_sync_dead_letter (created_at);
