-- supplier-sync: who really acted. Beside the --by an operator declares, every row of the
-- audit trail (supplier_sync_audit) and of a task's change log (supplier_sync_task_audit)
-- records what the acting process can prove: its operating-system user (of its effective
-- uid), host and process id, and when it is a Dagster run, the run's id and the user that
-- Dagster names as its launcher (the run's `user` tag; open-source Dagster sets none).
-- Rows written before this version have NULLs: their identity was not recorded.

ALTER TABLE supplier_sync_audit
    ADD COLUMN os_user VARCHAR(64) DEFAULT NULL COMMENT 'the acting process''s OS user (effective uid)',
    ADD COLUMN host VARCHAR(255) DEFAULT NULL COMMENT 'the acting process''s host name',
    ADD COLUMN pid INT DEFAULT NULL COMMENT 'the acting process''s id',
    ADD COLUMN dagster_run_id VARCHAR(64) DEFAULT NULL COMMENT 'the Dagster run that acted, if any',
    ADD COLUMN dagster_user VARCHAR(255) DEFAULT NULL COMMENT 'the user Dagster names as the run''s launcher, if any',
    ADD KEY idx_audit_run (dagster_run_id);

ALTER TABLE supplier_sync_task_audit
    ADD COLUMN os_user VARCHAR(64) DEFAULT NULL COMMENT 'the acting process''s OS user (effective uid)',
    ADD COLUMN host VARCHAR(255) DEFAULT NULL COMMENT 'the acting process''s host name',
    ADD COLUMN pid INT DEFAULT NULL COMMENT 'the acting process''s id',
    ADD COLUMN dagster_run_id VARCHAR(64) DEFAULT NULL COMMENT 'the Dagster run that acted, if any',
    ADD COLUMN dagster_user VARCHAR(255) DEFAULT NULL COMMENT 'the user Dagster names as the run''s launcher, if any';
