-- supplier-sync (SQLite): mappings, the platform's hotels and offers, and the outbox
-- (sql/004_mapping_platform_outbox.sql), as they were before sql/sqlite/007 and 008.
-- The same version in SQLite's dialect: the tables that core/schema.py creates on SQLite.
-- SQLite compares text byte for byte (utf8mb4_bin on MySQL), keeps no comments, and
-- auto-increments only an INTEGER PRIMARY KEY (BIGINT on MySQL).

CREATE TABLE IF NOT EXISTS supplier_sync_hotel_mapping (
    id INTEGER NOT NULL,
    supplier_id BIGINT NOT NULL,
    supplier_hotel_id VARCHAR(128) NOT NULL,
    created_batch_id VARCHAR(64) NOT NULL,
    created_at DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT uk_supplier_hotel UNIQUE (supplier_id, supplier_hotel_id)
);

CREATE TABLE IF NOT EXISTS supplier_sync_offer_mapping (
    id INTEGER NOT NULL,
    supplier_id BIGINT NOT NULL,
    supplier_hotel_id VARCHAR(128) NOT NULL,
    room_code VARCHAR(64) NOT NULL,
    rate_plan_code VARCHAR(64) NOT NULL,
    platform_resource_id BIGINT NOT NULL,
    created_batch_id VARCHAR(64) NOT NULL,
    created_at DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT uk_supplier_offer UNIQUE (supplier_id, supplier_hotel_id, room_code, rate_plan_code)
);
CREATE INDEX IF NOT EXISTS idx_offer_resource ON supplier_sync_offer_mapping (platform_resource_id);

CREATE TABLE IF NOT EXISTS platform_hotel_resource (
    resource_id BIGINT NOT NULL,
    supplier_id BIGINT NOT NULL,
    supplier_hotel_id VARCHAR(128) NOT NULL,
    supplier_version BIGINT NOT NULL,
    publish_version BIGINT NOT NULL,
    fingerprint VARCHAR(64) NOT NULL,
    name VARCHAR(255) NOT NULL,
    name_local VARCHAR(255),
    city_code VARCHAR(64) NOT NULL,
    country_code VARCHAR(2) NOT NULL,
    address_line1 VARCHAR(512),
    postal_code VARCHAR(32),
    lat DOUBLE NOT NULL,
    lng DOUBLE NOT NULL,
    star_rating NUMERIC(2, 1),
    phone VARCHAR(32),
    email VARCHAR(254),
    facilities TEXT,
    images TEXT,
    status VARCHAR(16) NOT NULL,
    supplier_updated_at DATETIME NOT NULL,
    raw_payload_ref VARCHAR(512),
    raw_payload_hash VARCHAR(64),
    last_batch_id VARCHAR(64) NOT NULL,
    publish_token VARCHAR(64) NOT NULL,
    published_at DATETIME NOT NULL,
    PRIMARY KEY (resource_id),
    CONSTRAINT uk_platform_supplier_hotel UNIQUE (supplier_id, supplier_hotel_id)
);
CREATE INDEX IF NOT EXISTS idx_platform_city ON platform_hotel_resource (supplier_id, city_code);

CREATE TABLE IF NOT EXISTS platform_hotel_offer (
    offer_id BIGINT NOT NULL,
    resource_id BIGINT NOT NULL,
    room_code VARCHAR(64) NOT NULL,
    rate_plan_code VARCHAR(64) NOT NULL,
    room_name VARCHAR(255),
    bed_type VARCHAR(32),
    max_occupancy INTEGER,
    board VARCHAR(32),
    refundable BOOLEAN,
    available BOOLEAN NOT NULL,
    price_amount NUMERIC(18, 4) NOT NULL,
    currency VARCHAR(3) NOT NULL,
    supplier_version BIGINT NOT NULL,
    publish_version BIGINT NOT NULL,
    active BOOLEAN NOT NULL,
    updated_at DATETIME NOT NULL,
    PRIMARY KEY (offer_id)
);
CREATE INDEX IF NOT EXISTS idx_offer_hotel ON platform_hotel_offer (resource_id);

CREATE TABLE IF NOT EXISTS supplier_sync_outbox (
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
    CONSTRAINT uk_event_id UNIQUE (event_id)
);
CREATE INDEX IF NOT EXISTS idx_outbox_aggregate ON supplier_sync_outbox (aggregate_type, aggregate_id);
CREATE INDEX IF NOT EXISTS idx_outbox_status ON supplier_sync_outbox (status, next_attempt_at);
