"""Servers: the read API (hotels from the search index and the cache, offers confirmed live)
and the Prometheus exporter of sync health."""
