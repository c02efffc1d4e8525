-- supplier-sync (SQLite): city walks whose listing shifted under them (sql/016_city_walk.sql).

CREATE TABLE IF NOT EXISTS supplier_sync_city_walk (
	id INTEGER NOT NULL, 
	batch_id VARCHAR(64) NOT NULL, 
	shard_key VARCHAR(128) NOT NULL, 
	drift VARCHAR(16) NOT NULL, 
	shifts INTEGER DEFAULT '0' NOT NULL, 
	fallbacks INTEGER DEFAULT '0' NOT NULL, 
	probes INTEGER DEFAULT '0' NOT NULL, 
	recovered INTEGER DEFAULT '0' NOT NULL, 
	requests INTEGER DEFAULT '0' NOT NULL, 
	created_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uk_city_walk UNIQUE (batch_id, shard_key)
);
CREATE INDEX IF NOT EXISTS idx_city_walk_created ON supplier_sync_city_walk (created_at);
