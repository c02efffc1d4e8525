-- supplier-sync: city walks whose listing shifted under them.
-- A walk by page numbers can skip a hotel when the listing shifts; the walk checks every
-- such page and verifies a city whose listing it saw shift (core/supplier/walk.py). A city
-- that finishes after such a walk gets one row: how it drifted (SHIFTED: seen and verified;
-- UNVERIFIED: the verification saw a shift too; UNCHECKED: walked by page number without
-- the check). Reconciliation walks these cities again; metrics count them.

CREATE TABLE IF NOT EXISTS supplier_sync_city_walk (
    id BIGINT NOT NULL AUTO_INCREMENT,
    batch_id VARCHAR(64) NOT NULL,
    shard_key VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL COMMENT 'supplier city code, verbatim',
    drift VARCHAR(16) NOT NULL COMMENT 'SHIFTED/UNVERIFIED/UNCHECKED',
    shifts INT NOT NULL DEFAULT 0 COMMENT 'times the listing was seen to shift',
    fallbacks INT NOT NULL DEFAULT 0 COMMENT 'times the walk went on by page number after cursors',
    probes INT NOT NULL DEFAULT 0 COMMENT 'one-hotel requests that checked a page',
    recovered INT NOT NULL DEFAULT 0 COMMENT 'hotels the verification found that the walk had missed',
    requests INT NOT NULL DEFAULT 0 COMMENT 'listing requests of the walk',
    created_at DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uk_city_walk (batch_id, shard_key),
    KEY idx_city_walk_created (created_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='city walks whose listing shifted (or could have, unchecked) under them';
