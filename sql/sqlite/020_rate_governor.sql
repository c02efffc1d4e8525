-- supplier-sync (SQLite): what the request budget cost each run (sql/019_rate_governor.sql).

ALTER TABLE supplier_sync_run_stats ADD COLUMN limiter_wait_seconds DOUBLE DEFAULT '0' NOT NULL;
ALTER TABLE supplier_sync_run_stats ADD COLUMN governed_rate DOUBLE;
