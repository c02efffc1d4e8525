-- supplier-sync: the platform offer table allocates its own offer ids.
-- An offer id was allocated in supplier_sync_offer_mapping (supplier, hotel, room, rate plan)
-- and then written to platform_hotel_offer: two rows with two unique keys per offer. The
-- offer table now allocates the id itself, once, under the unique key of the offer's
-- identity (platform hotel, room, rate plan); the platform hotel comes from the hotel
-- mapping. Existing offers keep their ids; new ones continue after the largest.
-- Offer mappings that were never published had no visible id and are dropped with the table.

ALTER TABLE platform_hotel_offer
    MODIFY offer_id BIGINT NOT NULL AUTO_INCREMENT,
    ADD UNIQUE KEY uk_offer_identity (resource_id, room_code, rate_plan_code),
    DROP KEY idx_offer_hotel;

DROP TABLE IF EXISTS supplier_sync_offer_mapping;
