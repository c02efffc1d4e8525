-- supplier-sync: supplier_product_code held two things that are not product codes. On a
-- snapshot it is what the page derives from (a NORMALIZED page: the sha256 of its raw page;
-- a replayed RAW page: 'replay-of:<batch>'); on a dead letter it is the record's place on
-- its page ('record#N'). Each gets its own name; the values stay as they are.

ALTER TABLE supplier_sync_snapshot
    RENAME COLUMN supplier_product_code TO derived_from,
    RENAME INDEX idx_supplier_object TO idx_snapshot_derived_from;

ALTER TABLE supplier_sync_dead_letter
    RENAME COLUMN supplier_product_code TO record_position;
