-- supplier-sync (SQLite): the outbox becomes a stage machine (sql/011_outbox_stages.sql).
-- SQLite cannot change a column's default or drop an index's columns in place: the table is
-- rebuilt (renamed, created anew, copied, dropped). Rows keep their ids.

ALTER TABLE supplier_sync_outbox RENAME TO supplier_sync_outbox_before_011;

CREATE TABLE supplier_sync_outbox (
    id INTEGER NOT NULL,
    event_id VARCHAR(64) NOT NULL,
    event_type VARCHAR(64) NOT NULL,
    aggregate_type VARCHAR(32) NOT NULL,
    aggregate_id BIGINT NOT NULL,
    aggregate_version BIGINT NOT NULL,
    batch_id VARCHAR(64) NOT NULL,
    payload TEXT NOT NULL,
    status VARCHAR(32) DEFAULT 'READY' NOT NULL,
    current_stage VARCHAR(32) DEFAULT 'PUBLISHED' NOT NULL,
    next_stage VARCHAR(32) DEFAULT 'SEARCH_INDEX' NOT NULL,
    retry_count INTEGER DEFAULT '0' NOT NULL,
    next_attempt_at DATETIME,
    lease_owner VARCHAR(128),
    lease_until DATETIME,
    last_error VARCHAR(1024),
    created_at DATETIME NOT NULL,
    projected_at DATETIME,
    finished_at DATETIME,
    PRIMARY KEY (id),
    CONSTRAINT uk_outbox_event UNIQUE (aggregate_type, aggregate_id, aggregate_version, event_type)
);

INSERT INTO supplier_sync_outbox (
    id, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, batch_id,
    payload, status, current_stage, next_stage, retry_count, next_attempt_at, last_error,
    created_at, finished_at
)
SELECT
    id, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, batch_id,
    payload,
    CASE WHEN status = 'PENDING' THEN 'READY' ELSE status END,
    'PUBLISHED',
    CASE WHEN event_type <> 'HotelResourceUpdated' AND status = 'PENDING' THEN 'NOTIFY'
         ELSE stage END,
    attempts, next_attempt_at, last_error, created_at, dispatched_at
FROM supplier_sync_outbox_before_011;

DROP TABLE supplier_sync_outbox_before_011;

CREATE INDEX IF NOT EXISTS idx_outbox_claim ON supplier_sync_outbox (status, next_stage, id);

CREATE TABLE IF NOT EXISTS supplier_sync_audit (
    id INTEGER NOT NULL,
    action VARCHAR(64) NOT NULL,
    target_type VARCHAR(32) NOT NULL,
    target_id VARCHAR(128) NOT NULL,
    actor VARCHAR(64) NOT NULL,
    reason VARCHAR(1024) NOT NULL,
    before_state TEXT,
    after_state TEXT,
    created_at DATETIME NOT NULL,
    PRIMARY KEY (id)
);

CREATE INDEX IF NOT EXISTS idx_audit_target ON supplier_sync_audit (target_type, target_id, created_at);

CREATE INDEX IF NOT EXISTS idx_audit_time ON supplier_sync_audit (created_at);
