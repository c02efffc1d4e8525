-- supplier-sync (SQLite): one open dead letter per problem (sql/017_dead_letter_tickets.sql).

ALTER TABLE supplier_sync_dead_letter ADD COLUMN subject_key VARCHAR(200);
ALTER TABLE supplier_sync_dead_letter ADD COLUMN open_slot SMALLINT;
ALTER TABLE supplier_sync_dead_letter ADD COLUMN seen_count INTEGER DEFAULT '1' NOT NULL;
ALTER TABLE supplier_sync_dead_letter ADD COLUMN last_seen_at DATETIME;
ALTER TABLE supplier_sync_dead_letter ADD COLUMN last_batch_id VARCHAR(64);
ALTER TABLE supplier_sync_dead_letter ADD COLUMN record_version BIGINT;

UPDATE supplier_sync_dead_letter
SET subject_key = CASE
        WHEN error_code = 'CITY_FAILED' THEN substr('city:' || COALESCE(city_code, '-'), 1, 200)
        WHEN supplier_resource_code IS NOT NULL AND supplier_resource_code <> '-' THEN 'hotel:' || supplier_resource_code
        ELSE substr('record:' || COALESCE(raw_payload_hash, '-') || '#' || COALESCE(record_position, '-'), 1, 200)
    END,
    open_slot = CASE WHEN status IN ('PENDING', 'RETRYING', 'FAILED', 'MANUAL_FIX') THEN 1 ELSE NULL END,
    last_seen_at = created_at,
    last_batch_id = batch_id;

UPDATE supplier_sync_dead_letter
SET seen_count = (
    SELECT COUNT(*) FROM supplier_sync_dead_letter o
    WHERE o.open_slot = 1
      AND o.supplier_id = supplier_sync_dead_letter.supplier_id
      AND o.subject_key = supplier_sync_dead_letter.subject_key
      AND o.error_code = supplier_sync_dead_letter.error_code
)
WHERE open_slot = 1
  AND id = (
    SELECT MAX(o.id) FROM supplier_sync_dead_letter o
    WHERE o.open_slot = 1
      AND o.supplier_id = supplier_sync_dead_letter.supplier_id
      AND o.subject_key = supplier_sync_dead_letter.subject_key
      AND o.error_code = supplier_sync_dead_letter.error_code
);

UPDATE supplier_sync_dead_letter
SET status = 'MERGED',
    next_retry_at = NULL,
    open_slot = NULL,
    fix_note = 'merged into dead letter #' || (
        SELECT MAX(o.id) FROM supplier_sync_dead_letter o
        WHERE o.open_slot = 1
          AND o.supplier_id = supplier_sync_dead_letter.supplier_id
          AND o.subject_key = supplier_sync_dead_letter.subject_key
          AND o.error_code = supplier_sync_dead_letter.error_code
    )
WHERE open_slot = 1
  AND id < (
    SELECT MAX(o.id) FROM supplier_sync_dead_letter o
    WHERE o.open_slot = 1
      AND o.supplier_id = supplier_sync_dead_letter.supplier_id
      AND o.subject_key = supplier_sync_dead_letter.subject_key
      AND o.error_code = supplier_sync_dead_letter.error_code
);

UPDATE supplier_sync_dead_letter
SET status = 'MERGED'
WHERE status = 'RESOLVED'
  AND fix_note LIKE 're-fetched in batch %: now fails with ' || error_code || ' (dead letter #%';

CREATE UNIQUE INDEX IF NOT EXISTS uk_dead_letter_open ON supplier_sync_dead_letter (supplier_id, subject_key, error_code, open_slot);
