-- supplier-sync (SQLite): the audit trail of task settings (sql/009_task_audit.sql).
-- The same version in SQLite's dialect: the table that core/schema.py creates on SQLite.

CREATE TABLE IF NOT EXISTS supplier_sync_task_audit (
    id INTEGER NOT NULL,
    task_code VARCHAR(64) NOT NULL,
    field_name VARCHAR(64) NOT NULL,
    old_value VARCHAR(1024),
    new_value VARCHAR(1024),
    changed_by VARCHAR(64) NOT NULL,
    reason VARCHAR(1024) NOT NULL,
    created_at DATETIME NOT NULL,
    PRIMARY KEY (id)
);

CREATE INDEX IF NOT EXISTS idx_task_audit_task ON supplier_sync_task_audit (task_code, created_at);
