-- supplier-sync: the outbox becomes a stage machine (core/outbox.py). Each event carries
-- the stage it finished last (current_stage) and the one to run next (next_stage), a status
-- (READY, PROCESSING, SUCCEEDED, FAILED, CANCELLED), its retries of the stage, when it is due,
-- the dispatcher's lease (owner, until) and when it was projected and finished (for lag).
-- HotelResourceUpdated runs SEARCH_INDEX -> CACHE -> NOTIFY; the other types NOTIFY only.
-- Events written before are READY at the first stage of their type. Operator actions on the
-- outbox (and later every other one) are recorded in supplier_sync_audit.

ALTER TABLE supplier_sync_outbox
    CHANGE COLUMN stage next_stage VARCHAR(32) NOT NULL DEFAULT 'SEARCH_INDEX',
    CHANGE COLUMN attempts retry_count INT NOT NULL DEFAULT 0,
    CHANGE COLUMN dispatched_at finished_at DATETIME(6) DEFAULT NULL,
    ALTER COLUMN status SET DEFAULT 'READY',
    ADD COLUMN current_stage VARCHAR(32) NOT NULL DEFAULT 'PUBLISHED',
    ADD COLUMN lease_owner VARCHAR(128) DEFAULT NULL,
    ADD COLUMN lease_until DATETIME(6) DEFAULT NULL,
    ADD COLUMN projected_at DATETIME(6) DEFAULT NULL,
    DROP KEY idx_outbox_status,
    ADD KEY idx_outbox_claim (status, next_stage, id);

UPDATE supplier_sync_outbox SET status = 'READY' WHERE status = 'PENDING';

UPDATE supplier_sync_outbox SET next_stage = 'NOTIFY'
    WHERE event_type <> 'HotelResourceUpdated' AND status = 'READY';

CREATE TABLE IF NOT EXISTS supplier_sync_audit (
    id BIGINT NOT NULL AUTO_INCREMENT,
    action VARCHAR(64) NOT NULL COMMENT 'e.g. outbox.retry, outbox.cancel',
    target_type VARCHAR(32) NOT NULL COMMENT 'what was acted on: outbox_event, ...',
    target_id VARCHAR(128) NOT NULL,
    actor VARCHAR(64) NOT NULL,
    reason VARCHAR(1024) NOT NULL,
    before_state TEXT DEFAULT NULL COMMENT 'JSON',
    after_state TEXT DEFAULT NULL COMMENT 'JSON',
    created_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    KEY idx_audit_target (target_type, target_id, created_at),
    KEY idx_audit_time (created_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='every operator action: who, when, what, why, before and after';
