-- supplier-sync: the hotels with misses are found by index (core/tombstones.py reads them
-- for every complete city listing; without it each city's finish scanned the supplier's
-- whole catalog).

CREATE INDEX idx_platform_missing ON platform_hotel_resource (supplier_id, missing_count);
