-- supplier-sync (SQLite): incremental sync and tombstones (sql/012_incremental_tombstones.sql).
-- The same version in SQLite's dialect: the tables that core/schema.py creates on SQLite.

CREATE TABLE IF NOT EXISTS supplier_sync_watermark (
    id INTEGER NOT NULL,
    task_code VARCHAR(64) NOT NULL,
    supplier_id BIGINT NOT NULL,
    watermark_at DATETIME NOT NULL,
    watermark_hotel_id VARCHAR(128) NOT NULL,
    batch_id VARCHAR(64),
    created_at DATETIME NOT NULL,
    updated_at DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT uk_watermark_task UNIQUE (task_code)
);

ALTER TABLE platform_hotel_resource ADD COLUMN missing_count INTEGER NOT NULL DEFAULT 0;

ALTER TABLE platform_hotel_resource ADD COLUMN missing_since DATETIME;
