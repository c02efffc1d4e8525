-- supplier-sync: resource mappings, the platform's published hotels and offers, and the
-- transactional outbox. Mapping row ids ARE the platform ids: allocated once by the unique
-- key (insert-or-ignore, then read), never by check-then-insert.

CREATE TABLE IF NOT EXISTS supplier_sync_hotel_mapping (
    id BIGINT NOT NULL AUTO_INCREMENT COMMENT 'the platform resource id',
    supplier_id BIGINT NOT NULL,
    supplier_hotel_id VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    created_batch_id VARCHAR(64) NOT NULL,
    created_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_supplier_hotel (supplier_id, supplier_hotel_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='supplier hotel -> platform resource id (the row id)';

CREATE TABLE IF NOT EXISTS supplier_sync_offer_mapping (
    id BIGINT NOT NULL AUTO_INCREMENT COMMENT 'the platform offer id',
    supplier_id BIGINT NOT NULL,
    supplier_hotel_id VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    room_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    rate_plan_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    platform_resource_id BIGINT NOT NULL,
    created_batch_id VARCHAR(64) NOT NULL,
    created_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_supplier_offer (supplier_id, supplier_hotel_id, room_code, rate_plan_code),
    KEY idx_offer_resource (platform_resource_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='supplier room + rate plan -> platform offer id (the row id)';

CREATE TABLE IF NOT EXISTS platform_hotel_resource (
    resource_id BIGINT NOT NULL,
    supplier_id BIGINT NOT NULL,
    supplier_hotel_id VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    supplier_version BIGINT NOT NULL COMMENT 'an older supplier version never overwrites a newer one',
    publish_version BIGINT NOT NULL COMMENT '+1 on every publish',
    fingerprint VARCHAR(64) NOT NULL COMMENT 'sha256 of the canonical normalized hotel',
    name VARCHAR(255) NOT NULL,
    name_local VARCHAR(255) DEFAULT NULL,
    city_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    country_code VARCHAR(2) NOT NULL,
    address_line1 VARCHAR(512) DEFAULT NULL,
    postal_code VARCHAR(32) DEFAULT NULL,
    lat DOUBLE NOT NULL,
    lng DOUBLE NOT NULL,
    star_rating DECIMAL(2,1) DEFAULT NULL,
    phone VARCHAR(32) DEFAULT NULL,
    email VARCHAR(254) DEFAULT NULL,
    facilities TEXT DEFAULT NULL COMMENT 'JSON list',
    images TEXT DEFAULT NULL COMMENT 'JSON list',
    status VARCHAR(16) NOT NULL,
    supplier_updated_at DATETIME(6) NOT NULL,
    raw_payload_ref VARCHAR(512) DEFAULT NULL COMMENT 'the supplier bytes this version came from',
    raw_payload_hash VARCHAR(64) DEFAULT NULL,
    last_batch_id VARCHAR(64) NOT NULL,
    publish_token VARCHAR(64) NOT NULL COMMENT 'which publish call wrote this version',
    published_at DATETIME(6) NOT NULL,
    PRIMARY KEY (resource_id),
    UNIQUE KEY uk_platform_supplier_hotel (supplier_id, supplier_hotel_id),
    KEY idx_platform_city (supplier_id, city_code)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='the platform''s published hotel resources';

CREATE TABLE IF NOT EXISTS platform_hotel_offer (
    offer_id BIGINT NOT NULL,
    resource_id BIGINT NOT NULL,
    room_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    rate_plan_code VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    room_name VARCHAR(255) DEFAULT NULL,
    bed_type VARCHAR(32) DEFAULT NULL,
    max_occupancy INT DEFAULT NULL,
    board VARCHAR(32) DEFAULT NULL,
    refundable BOOL DEFAULT NULL,
    available BOOL NOT NULL,
    price_amount DECIMAL(18,4) NOT NULL,
    currency VARCHAR(3) NOT NULL,
    supplier_version BIGINT NOT NULL,
    publish_version BIGINT NOT NULL,
    active BOOL NOT NULL COMMENT 'false once the supplier stops offering it',
    updated_at DATETIME(6) NOT NULL,
    PRIMARY KEY (offer_id),
    KEY idx_offer_hotel (resource_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='the platform''s published offers (room x rate plan) of hotel resources';

CREATE TABLE IF NOT EXISTS supplier_sync_outbox (
    id BIGINT NOT NULL AUTO_INCREMENT,
    event_id VARCHAR(64) NOT NULL COMMENT 'deterministic: a re-run emits the same id',
    event_type VARCHAR(64) NOT NULL COMMENT 'HotelResourceUpdated/HotelContentChanged/HotelMappingCreated/HotelSearchIndexRefreshRequired',
    aggregate_type VARCHAR(32) NOT NULL,
    aggregate_id BIGINT NOT NULL,
    aggregate_version BIGINT NOT NULL,
    batch_id VARCHAR(64) NOT NULL,
    payload TEXT NOT NULL COMMENT 'JSON',
    status VARCHAR(32) NOT NULL DEFAULT 'PENDING',
    stage VARCHAR(32) NOT NULL DEFAULT 'SEARCH_INDEX',
    attempts INT NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6) DEFAULT NULL,
    last_error VARCHAR(1024) DEFAULT NULL,
    created_at DATETIME(6) NOT NULL,
    dispatched_at DATETIME(6) DEFAULT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_event_id (event_id),
    KEY idx_outbox_status (status, next_attempt_at),
    KEY idx_outbox_aggregate (aggregate_type, aggregate_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='transactional outbox: events written with the publish that caused them';
