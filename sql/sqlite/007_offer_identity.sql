-- supplier-sync (SQLite): the platform offer table allocates its own offer ids
-- (sql/007_offer_identity.sql). SQLite can neither change a primary key nor add a unique
-- constraint in place, so the table is rebuilt: renamed, created anew, copied, dropped.
-- Existing offers keep their ids; the INTEGER PRIMARY KEY continues after the largest.

ALTER TABLE platform_hotel_offer RENAME TO platform_hotel_offer_before_007;

CREATE TABLE platform_hotel_offer (
    offer_id INTEGER NOT NULL,
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
    PRIMARY KEY (offer_id),
    CONSTRAINT uk_offer_identity UNIQUE (resource_id, room_code, rate_plan_code)
);

INSERT INTO platform_hotel_offer (
    offer_id, resource_id, room_code, rate_plan_code, room_name, bed_type, max_occupancy,
    board, refundable, available, price_amount, currency, supplier_version, publish_version,
    active, updated_at
)
SELECT
    offer_id, resource_id, room_code, rate_plan_code, room_name, bed_type, max_occupancy,
    board, refundable, available, price_amount, currency, supplier_version, publish_version,
    active, updated_at
FROM platform_hotel_offer_before_007;

-- Its index idx_offer_hotel goes with it.
DROP TABLE platform_hotel_offer_before_007;

DROP TABLE IF EXISTS supplier_sync_offer_mapping;
