-- supplier-sync (SQLite): the hotels with misses are found by index (sql/013_tombstone_index.sql).

CREATE INDEX IF NOT EXISTS idx_platform_missing ON platform_hotel_resource (supplier_id, missing_count);
