-- supplier-sync: the audit trail of task settings. A task's concurrency policy, status,
-- cron and gate thresholds change only through `supplier-sync task set` (runs create a
-- missing task and never change one); each changed field is one row: old and new value,
-- who and why. The creation of a task by its first run is recorded as field 'task'.

CREATE TABLE IF NOT EXISTS supplier_sync_task_audit (
    id BIGINT NOT NULL AUTO_INCREMENT,
    task_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    field_name VARCHAR(64) NOT NULL COMMENT 'task/concurrency_policy/status/schedule_type/cron_expr/gate.<threshold>',
    old_value VARCHAR(1024) DEFAULT NULL,
    new_value VARCHAR(1024) DEFAULT NULL,
    changed_by VARCHAR(64) NOT NULL,
    reason VARCHAR(1024) NOT NULL,
    created_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    KEY idx_task_audit_task (task_code, created_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='every change of a task''s settings: who, when, why, old and new value';
