-- supplier-sync: the catalog as it was at any moment.
-- Every publish version of a hotel (a publish, an unpublish) gets one row in
-- supplier_sync_hotel_version, in the transaction that writes it: when (the database clock),
-- by which batch, from which raw page, what kind of change, and the sha256 of the document
-- published. The documents themselves (the canonical normalized hotel with its rooms and rate
-- plans, zlib-compressed) are stored once per content in supplier_sync_published_document.
-- Versions published before this schema version have no row: their history starts here.

CREATE TABLE IF NOT EXISTS supplier_sync_hotel_version (
    id BIGINT NOT NULL AUTO_INCREMENT,
    resource_id BIGINT NOT NULL COMMENT 'platform resource id',
    publish_version BIGINT NOT NULL,
    published_at DATETIME(6) NOT NULL COMMENT 'database clock',
    change_type VARCHAR(64) NOT NULL COMMENT 'the diff type that produced it, or UNPUBLISHED',
    change_reason VARCHAR(32) DEFAULT NULL COMMENT 'why it was unpublished (missing, not_found)',
    supplier_id BIGINT NOT NULL,
    supplier_hotel_id VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL COMMENT 'supplier hotel id, verbatim',
    supplier_version BIGINT NOT NULL,
    raw_payload_hash VARCHAR(64) DEFAULT NULL COMMENT 'sha256 of the raw page it came from',
    status VARCHAR(16) NOT NULL COMMENT 'ACTIVE/INACTIVE as published',
    batch_id VARCHAR(64) NOT NULL,
    document_hash VARCHAR(64) NOT NULL COMMENT 'sha256 of the canonical document published',
    PRIMARY KEY (id),
    UNIQUE KEY uk_hotel_version (resource_id, publish_version),
    KEY idx_hotel_version_hotel (supplier_id, supplier_hotel_id, publish_version),
    KEY idx_hotel_version_time (published_at),
    KEY idx_hotel_version_document (document_hash)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='every published version of a hotel: when, why, from what';

CREATE TABLE IF NOT EXISTS supplier_sync_published_document (
    id BIGINT NOT NULL AUTO_INCREMENT,
    document_hash VARCHAR(64) NOT NULL COMMENT 'sha256 of the canonical JSON',
    document MEDIUMBLOB NOT NULL COMMENT 'the canonical JSON, zlib-compressed',
    created_at DATETIME(6) NOT NULL,
    last_used_at DATETIME(6) NOT NULL COMMENT 'the last publish that referenced it (pruning)',
    PRIMARY KEY (id),
    UNIQUE KEY uk_published_document (document_hash),
    KEY idx_published_document_used (last_used_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='published hotel documents, stored once per content';
