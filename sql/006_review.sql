-- supplier-sync: diffs held for review (risk policy action REVIEW) and the decisions on them.
-- A held diff carries its normalized hotel, so approving it publishes exactly what was
-- reviewed, through the same version-guarded path as an automatic publish.

CREATE TABLE IF NOT EXISTS supplier_sync_review (
    id BIGINT NOT NULL AUTO_INCREMENT,
    review_id VARCHAR(64) NOT NULL COMMENT 'the diff_id of the held diff',
    batch_id VARCHAR(64) NOT NULL,
    shard_key VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL COMMENT 'the city being synced',
    supplier_id BIGINT NOT NULL,
    supplier_hotel_id VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    supplier_version BIGINT NOT NULL,
    platform_resource_id BIGINT NOT NULL,
    old_publish_version BIGINT DEFAULT NULL,
    diff_type VARCHAR(64) NOT NULL,
    risk_level VARCHAR(32) NOT NULL,
    changed_fields JSON NOT NULL,
    candidate MEDIUMTEXT NOT NULL COMMENT 'canonical JSON of the normalized hotel',
    fingerprint VARCHAR(64) NOT NULL,
    raw_payload_ref VARCHAR(512) DEFAULT NULL,
    raw_payload_hash VARCHAR(64) DEFAULT NULL,
    status VARCHAR(32) NOT NULL COMMENT 'PENDING/APPROVED/REJECTED/SUPERSEDED',
    decided_by VARCHAR(128) DEFAULT NULL,
    decision_reason VARCHAR(1024) DEFAULT NULL,
    decided_at DATETIME(6) DEFAULT NULL,
    publish_version BIGINT DEFAULT NULL COMMENT 'the version its approval published',
    created_at DATETIME(6) NOT NULL,
    updated_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_review_id (review_id),
    KEY idx_review_status (status, batch_id),
    KEY idx_review_hotel (supplier_id, supplier_hotel_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='diffs held for review and the decisions on them';
