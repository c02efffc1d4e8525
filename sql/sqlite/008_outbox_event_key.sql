-- supplier-sync (SQLite): the outbox is keyed by what an event is, not by a hash of it
-- (sql/008_outbox_event_key.sql). SQLite cannot drop or add a table's unique constraint in
-- place, so the table is rebuilt: renamed, created anew, copied, dropped. Rows keep their ids.

ALTER TABLE supplier_sync_outbox RENAME TO supplier_sync_outbox_before_008;

CREATE TABLE supplier_sync_outbox (
    id INTEGER NOT NULL,
    event_id VARCHAR(64) NOT NULL,
    event_type VARCHAR(64) NOT NULL,
    aggregate_type VARCHAR(32) NOT NULL,
    aggregate_id BIGINT NOT NULL,
    aggregate_version BIGINT NOT NULL,
    batch_id VARCHAR(64) NOT NULL,
    payload TEXT NOT NULL,
    status VARCHAR(32) DEFAULT 'PENDING' NOT NULL,
    stage VARCHAR(32) DEFAULT 'SEARCH_INDEX' NOT NULL,
    attempts INTEGER DEFAULT '0' NOT NULL,
    next_attempt_at DATETIME,
    last_error VARCHAR(1024),
    created_at DATETIME NOT NULL,
    dispatched_at DATETIME,
    PRIMARY KEY (id),
    CONSTRAINT uk_outbox_event UNIQUE (aggregate_type, aggregate_id, aggregate_version, event_type)
);

INSERT INTO supplier_sync_outbox (
    id, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, batch_id,
    payload, status, stage, attempts, next_attempt_at, last_error, created_at, dispatched_at
)
SELECT
    id, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, batch_id,
    payload, status, stage, attempts, next_attempt_at, last_error, created_at, dispatched_at
FROM supplier_sync_outbox_before_008;

-- Its indexes (idx_outbox_aggregate, idx_outbox_status) go with it.
DROP TABLE supplier_sync_outbox_before_008;

CREATE INDEX IF NOT EXISTS idx_outbox_status ON supplier_sync_outbox (status, next_attempt_at);
