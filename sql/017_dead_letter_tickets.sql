-- supplier-sync: one open dead letter per problem.
-- A dead letter is a ticket for one problem (error code) of one subject (a hotel, a city,
-- or an unreadable record of a page) of a supplier. While it is open, open_slot is 1 and
-- the unique key uk_dead_letter_open lets no second open ticket exist for the same problem
-- (a closed ticket's open_slot is NULL, and NULLs never collide in a UNIQUE key): a sync
-- that sees the problem again updates the open ticket (seen_count, last_seen_at, the latest
-- payload and batch) instead of opening another one.
-- Open duplicates written before this version are merged into the newest of them (the
-- others end MERGED, naming it), and the "resolutions" that were a re-fetch refused again
-- with the same code end MERGED too: neither fixed anything, and the fix rate counts only
-- RESOLVED tickets.

ALTER TABLE supplier_sync_dead_letter
    ADD COLUMN subject_key VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin DEFAULT NULL COMMENT 'hotel:<id>, city:<code> or record:<page hash>#<position>',
    ADD COLUMN open_slot TINYINT DEFAULT NULL COMMENT '1 while open (PENDING/RETRYING/FAILED/MANUAL_FIX), NULL once closed',
    ADD COLUMN seen_count INT NOT NULL DEFAULT 1 COMMENT 'syncs that saw the problem',
    ADD COLUMN last_seen_at DATETIME(6) DEFAULT NULL COMMENT 'when a sync last saw it (database clock)',
    ADD COLUMN last_batch_id VARCHAR(64) DEFAULT NULL COMMENT 'the batch that last saw it',
    ADD COLUMN record_version BIGINT DEFAULT NULL COMMENT 'the supplier version of the record last seen, when readable';

UPDATE supplier_sync_dead_letter
SET subject_key = CASE
        WHEN error_code = 'CITY_FAILED' THEN LEFT(CONCAT('city:', COALESCE(city_code, '-')), 200)
        WHEN supplier_resource_code IS NOT NULL AND supplier_resource_code <> '-' THEN CONCAT('hotel:', supplier_resource_code)
        ELSE LEFT(CONCAT('record:', COALESCE(raw_payload_hash, '-'), '#', COALESCE(record_position, '-')), 200)
    END,
    open_slot = CASE WHEN status IN ('PENDING', 'RETRYING', 'FAILED', 'MANUAL_FIX') THEN 1 ELSE NULL END,
    last_seen_at = created_at,
    last_batch_id = batch_id;

UPDATE supplier_sync_dead_letter d
JOIN (
    SELECT supplier_id, subject_key, error_code, MAX(id) AS keep_id, COUNT(*) AS n
    FROM supplier_sync_dead_letter
    WHERE open_slot = 1
    GROUP BY supplier_id, subject_key, error_code
    HAVING COUNT(*) > 1
) g ON d.supplier_id = g.supplier_id AND d.subject_key = g.subject_key AND d.error_code = g.error_code
SET d.seen_count = CASE WHEN d.id = g.keep_id THEN g.n ELSE d.seen_count END,
    d.status = CASE WHEN d.id = g.keep_id THEN d.status ELSE 'MERGED' END,
    d.fix_note = CASE WHEN d.id = g.keep_id THEN d.fix_note ELSE CONCAT('merged into dead letter #', g.keep_id) END,
    d.next_retry_at = CASE WHEN d.id = g.keep_id THEN d.next_retry_at ELSE NULL END,
    d.open_slot = CASE WHEN d.id = g.keep_id THEN 1 ELSE NULL END
WHERE d.open_slot = 1;

UPDATE supplier_sync_dead_letter
SET status = 'MERGED'
WHERE status = 'RESOLVED'
  AND fix_note LIKE CONCAT('re-fetched in batch %: now fails with ', error_code, ' (dead letter #%');

CREATE UNIQUE INDEX uk_dead_letter_open ON supplier_sync_dead_letter (supplier_id, subject_key, error_code, open_slot);
