-- supplier-sync (SQLite): who really acted (sql/018_audit_identity.sql).

ALTER TABLE supplier_sync_audit ADD COLUMN os_user VARCHAR(64);
ALTER TABLE supplier_sync_audit ADD COLUMN host VARCHAR(255);
ALTER TABLE supplier_sync_audit ADD COLUMN pid INTEGER;
ALTER TABLE supplier_sync_audit ADD COLUMN dagster_run_id VARCHAR(64);
ALTER TABLE supplier_sync_audit ADD COLUMN dagster_user VARCHAR(255);

CREATE INDEX IF NOT EXISTS idx_audit_run ON supplier_sync_audit (dagster_run_id);

ALTER TABLE supplier_sync_task_audit ADD COLUMN os_user VARCHAR(64);
ALTER TABLE supplier_sync_task_audit ADD COLUMN host VARCHAR(255);
ALTER TABLE supplier_sync_task_audit ADD COLUMN pid INTEGER;
ALTER TABLE supplier_sync_task_audit ADD COLUMN dagster_run_id VARCHAR(64);
ALTER TABLE supplier_sync_task_audit ADD COLUMN dagster_user VARCHAR(255);
