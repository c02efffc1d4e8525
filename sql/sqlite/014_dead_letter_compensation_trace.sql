-- supplier-sync (SQLite): dead letters that heal, and trace
-- (sql/014_dead_letter_compensation_trace.sql).

ALTER TABLE supplier_sync_dead_letter ADD COLUMN city_code VARCHAR(64);
ALTER TABLE supplier_sync_dead_letter ADD COLUMN retry_batch_id VARCHAR(64);
CREATE INDEX IF NOT EXISTS idx_dead_letter_hotel ON supplier_sync_dead_letter (supplier_id, supplier_resource_code);
CREATE INDEX IF NOT EXISTS idx_dead_letter_retry_batch ON supplier_sync_dead_letter (retry_batch_id);

ALTER TABLE supplier_sync_diff_log ADD COLUMN raw_payload_hash VARCHAR(64);
CREATE INDEX IF NOT EXISTS idx_diff_resource ON supplier_sync_diff_log (supplier_id, supplier_resource_code);

CREATE INDEX IF NOT EXISTS idx_snapshot_payload_hash ON supplier_sync_snapshot (payload_hash);
