-- supplier-sync: what the request budget cost each run. Beside its requests and 429s, a run
-- records the seconds its requests waited for the rate limiter and, when the rate adapts to
-- the supplier (SUPPLIER_SYNC_RATE_GOVERNOR=adaptive), the requests/s it had learnt at the
-- end. Rows written before this version have 0 and NULL.

ALTER TABLE supplier_sync_run_stats
    ADD COLUMN limiter_wait_seconds DOUBLE NOT NULL DEFAULT 0 COMMENT 'seconds requests waited for the rate limiter',
    ADD COLUMN governed_rate DOUBLE DEFAULT NULL COMMENT 'requests/s an adaptive rate had learnt; NULL: fixed rate';
