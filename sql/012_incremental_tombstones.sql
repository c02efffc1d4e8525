-- supplier-sync: incremental sync and tombstones.
-- An incremental task keeps one watermark: the (updated_at, hotel_id) of the last change it
-- published from the supplier's change feed. It moves only forward, in the transaction that
-- publishes a window's last page; each window reads from the watermark minus an overlap.
-- A published hotel that a complete full sync of its city did not list counts one miss; after
-- enough misses (or a 404 for the hotel) it is unpublished (INACTIVE, never deleted).

CREATE TABLE IF NOT EXISTS supplier_sync_watermark (
    id BIGINT NOT NULL AUTO_INCREMENT,
    task_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    supplier_id BIGINT NOT NULL,
    watermark_at DATETIME(6) NOT NULL COMMENT 'supplier updated_at of the last change published',
    watermark_hotel_id VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL COMMENT 'its hotel id (ties at one updated_at)',
    batch_id VARCHAR(64) DEFAULT NULL COMMENT 'the window that moved it last',
    created_at DATETIME(6) NOT NULL,
    updated_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_watermark_task (task_code)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='per incremental task: how far its change feed is published';

ALTER TABLE platform_hotel_resource
    ADD COLUMN missing_count INT NOT NULL DEFAULT 0 COMMENT 'complete full syncs of its city in a row that did not list it',
    ADD COLUMN missing_since DATETIME(6) DEFAULT NULL COMMENT 'first of those syncs';
