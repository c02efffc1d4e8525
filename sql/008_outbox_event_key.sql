-- supplier-sync: the outbox is keyed by what an event is, not by a hash of it.
-- An event is unique per (aggregate, published version, event type); event_id is a hash of
-- exactly that and stays the id consumers deduplicate by. A unique key on the random
-- 64-character hash made every insert land at a random place of a large index; the key
-- on (aggregate_type, aggregate_id, aggregate_version, event_type) grows at its end as
-- resource ids grow, and also serves the look-ups by aggregate that had an index of their own.

ALTER TABLE supplier_sync_outbox
    DROP KEY uk_event_id,
    DROP KEY idx_outbox_aggregate,
    ADD UNIQUE KEY uk_outbox_event (aggregate_type, aggregate_id, aggregate_version, event_type);
