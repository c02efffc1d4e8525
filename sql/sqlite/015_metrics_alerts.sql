-- supplier-sync (SQLite): sync health and alerts (sql/015_metrics_alerts.sql).

CREATE TABLE IF NOT EXISTS supplier_sync_run_stats (
	id INTEGER NOT NULL, 
	batch_id VARCHAR(64) NOT NULL, 
	task_code VARCHAR(64) NOT NULL, 
	worker_id VARCHAR(64) NOT NULL, 
	cities INTEGER DEFAULT '0' NOT NULL, 
	records INTEGER DEFAULT '0' NOT NULL, 
	published INTEGER DEFAULT '0' NOT NULL, 
	requests INTEGER DEFAULT '0' NOT NULL, 
	throttled INTEGER DEFAULT '0' NOT NULL, 
	retries INTEGER DEFAULT '0' NOT NULL, 
	seconds DOUBLE DEFAULT '0' NOT NULL, 
	created_at DATETIME NOT NULL, 
	PRIMARY KEY (id)
);
CREATE INDEX IF NOT EXISTS idx_run_stats_batch ON supplier_sync_run_stats (batch_id);
CREATE INDEX IF NOT EXISTS idx_run_stats_task_time ON supplier_sync_run_stats (task_code, created_at);

CREATE TABLE IF NOT EXISTS supplier_sync_alert (
	id INTEGER NOT NULL, 
	alert_key VARCHAR(255) NOT NULL, 
	open_key VARCHAR(255), 
	condition_name VARCHAR(64) NOT NULL, 
	task_code VARCHAR(64) NOT NULL, 
	subject VARCHAR(128) DEFAULT '' NOT NULL, 
	status VARCHAR(16) NOT NULL, 
	value DOUBLE, 
	threshold DOUBLE, 
	message VARCHAR(1024) NOT NULL, 
	run_url VARCHAR(512), 
	started_at DATETIME NOT NULL, 
	resolved_at DATETIME, 
	updated_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uk_alert_open UNIQUE (open_key)
);
CREATE INDEX IF NOT EXISTS idx_alert_status ON supplier_sync_alert (status, started_at);
CREATE INDEX IF NOT EXISTS idx_alert_task ON supplier_sync_alert (task_code, started_at);

CREATE TABLE IF NOT EXISTS supplier_sync_alert_delivery (
	id INTEGER NOT NULL, 
	alert_id BIGINT NOT NULL, 
	kind VARCHAR(16) NOT NULL, 
	status VARCHAR(16) NOT NULL, 
	attempts INTEGER DEFAULT '0' NOT NULL, 
	next_attempt_at DATETIME NOT NULL, 
	last_error VARCHAR(1024), 
	sent_at DATETIME, 
	created_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uk_alert_delivery UNIQUE (alert_id, kind)
);
CREATE INDEX IF NOT EXISTS idx_delivery_due ON supplier_sync_alert_delivery (status, next_attempt_at);

CREATE TABLE IF NOT EXISTS supplier_sync_alert_threshold (
	id INTEGER NOT NULL, 
	task_code VARCHAR(64) NOT NULL, 
	name VARCHAR(64) NOT NULL, 
	value DOUBLE NOT NULL, 
	updated_by VARCHAR(64) NOT NULL, 
	updated_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uk_alert_threshold UNIQUE (task_code, name)
);

CREATE INDEX IF NOT EXISTS idx_dead_letter_created ON supplier_sync_dead_letter (created_at);
