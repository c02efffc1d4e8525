-- supplier-sync: dead letters that heal, and a trace from a published field to the supplier's
-- bytes.
-- A dead letter names the city its record belongs to (operators filter by it) and, while a
-- compensation batch is re-fetching its hotel, that batch (a killed compensation is resumed
-- or released by it). Each diff names the raw page its new version came from, so that
-- `trace` finds the bytes of every version of a hotel; the lookups by hotel are indexed.

ALTER TABLE supplier_sync_dead_letter
    ADD COLUMN city_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin DEFAULT NULL COMMENT 'the city of its record (listing city, or the record''s own)',
    ADD COLUMN retry_batch_id VARCHAR(64) DEFAULT NULL COMMENT 'the compensation batch of its latest attempt',
    ADD INDEX idx_dead_letter_hotel (supplier_id, supplier_resource_code),
    ADD INDEX idx_dead_letter_retry_batch (retry_batch_id);

ALTER TABLE supplier_sync_diff_log
    ADD COLUMN raw_payload_hash VARCHAR(64) DEFAULT NULL COMMENT 'sha256 of the raw page the new version came from',
    ADD INDEX idx_diff_resource (supplier_id, supplier_resource_code);

CREATE INDEX idx_snapshot_payload_hash ON supplier_sync_snapshot (payload_hash);
