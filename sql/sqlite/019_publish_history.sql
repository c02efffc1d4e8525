-- supplier-sync (SQLite): the catalog as it was at any moment (sql/019_publish_history.sql).

CREATE TABLE IF NOT EXISTS supplier_sync_hotel_version (
	id INTEGER NOT NULL, 
	resource_id BIGINT NOT NULL, 
	publish_version BIGINT NOT NULL, 
	published_at DATETIME NOT NULL, 
	change_type VARCHAR(64) NOT NULL, 
	change_reason VARCHAR(32), 
	supplier_id BIGINT NOT NULL, 
	supplier_hotel_id VARCHAR(128) NOT NULL, 
	supplier_version BIGINT NOT NULL, 
	raw_payload_hash VARCHAR(64), 
	status VARCHAR(16) NOT NULL, 
	batch_id VARCHAR(64) NOT NULL, 
	document_hash VARCHAR(64) NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uk_hotel_version UNIQUE (resource_id, publish_version)
);
CREATE INDEX IF NOT EXISTS idx_hotel_version_hotel ON supplier_sync_hotel_version (supplier_id, supplier_hotel_id, publish_version);
CREATE INDEX IF NOT EXISTS idx_hotel_version_time ON supplier_sync_hotel_version (published_at);
CREATE INDEX IF NOT EXISTS idx_hotel_version_document ON supplier_sync_hotel_version (document_hash);

CREATE TABLE IF NOT EXISTS supplier_sync_published_document (
	id INTEGER NOT NULL, 
	document_hash VARCHAR(64) NOT NULL, 
	document BLOB NOT NULL, 
	created_at DATETIME NOT NULL, 
	last_used_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uk_published_document UNIQUE (document_hash)
);
CREATE INDEX IF NOT EXISTS idx_published_document_used ON supplier_sync_published_document (last_used_at);
