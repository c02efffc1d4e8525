-- supplier-sync (SQLite): supplier_product_code becomes derived_from on snapshots and
-- record_position on dead letters (sql/010_split_product_code.sql). SQLite renames no
-- index, so the snapshot index is made again under its new name.

ALTER TABLE supplier_sync_snapshot RENAME COLUMN supplier_product_code TO derived_from;

DROP INDEX IF EXISTS idx_supplier_object;

CREATE INDEX IF NOT EXISTS idx_snapshot_derived_from ON supplier_sync_snapshot (supplier_id, supplier_resource_code, derived_from);

ALTER TABLE supplier_sync_dead_letter RENAME COLUMN supplier_product_code TO record_position;
