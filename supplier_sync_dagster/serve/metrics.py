"""Sync health for Prometheus: ``supplier-sync metrics serve --port N``.

``/metrics`` has no authentication: it listens on loopback (127.0.0.1) unless told another
address, and a remote Prometheus scrapes it through a reverse proxy that authenticates
(``deploy/nginx/supplier-sync.conf``).

A background thread computes :func:`~supplier_sync_dagster.core.health.metrics.sync_health` for
each task every ``interval`` seconds; a scrape reads the cached figures only (so it answers
in milliseconds and never queries the database). Names follow Prometheus conventions: the
``supplier_sync_`` prefix, base units (``_seconds``, ``_ratio``), labels ``task``, ``city``,
``field``, ``status`` and ``class``; ``supplier_sync_health_age_seconds`` says how old the
cached figures are, and ``supplier_sync_health_errors_total`` counts refreshes that failed
(the last good figures stay served).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.health.metrics import SyncHealth, sync_health
from supplier_sync_dagster.core.store.db import SyncDatabase

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"

# value key -> (metric name, help, scale to base units)
GAUGES: dict[str, tuple[str, str, float]] = {
    "batch_success_rate_24h": (
        "supplier_sync_batch_success_ratio",
        "Successful over finished batches of the task, last 24 hours.",
        1.0,
    ),
    "city_success_rate_24h": (
        "supplier_sync_city_success_ratio",
        "Successful over finished cities of the task's batches, last 24 hours.",
        1.0,
    ),
    "batches_failed_24h": (
        "supplier_sync_batches_failed",
        "Failed or partly failed batches of the task, last 24 hours.",
        1.0,
    ),
    "bad_record_ratio": (
        "supplier_sync_bad_record_ratio",
        "Dead-lettered over fetched records of the latest finished batch.",
        1.0,
    ),
    "mapping_failure_rate": (
        "supplier_sync_mapping_failure_ratio",
        "Mapping-stage dead letters over records of the latest finished batch.",
        1.0,
    ),
    "latest_records": (
        "supplier_sync_latest_batch_records",
        "Records fetched by the latest finished batch.",
        1.0,
    ),
    "hotels_per_second": (
        "supplier_sync_latest_batch_hotels_per_second",
        "Hotels published per second by the latest finished batch.",
        1.0,
    ),
    "review_pending": ("supplier_sync_review_pending", "Diffs waiting for review.", 1.0),
    "review_oldest_hours": (
        "supplier_sync_review_oldest_age_seconds",
        "Age of the oldest diff waiting for review.",
        3600.0,
    ),
    "freshness_max_hours": (
        "supplier_sync_freshness_max_seconds",
        "The stalest city: now minus its last successful sync.",
        3600.0,
    ),
    "freshness_p95_hours": (
        "supplier_sync_freshness_p95_seconds",
        "95th percentile over cities of now minus their last successful sync.",
        3600.0,
    ),
    "watermark_lag_hours": (
        "supplier_sync_watermark_lag_seconds",
        "Now minus the incremental watermark (-3600: no watermark yet).",
        3600.0,
    ),
    "outbox_ready": ("supplier_sync_outbox_ready", "Outbox events waiting for a stage.", 1.0),
    "outbox_failed": (
        "supplier_sync_outbox_failed",
        "Outbox events past their retries (an operator retries or cancels them).",
        1.0,
    ),
    "outbox_stuck": (
        "supplier_sync_outbox_stuck",
        "Outbox events PROCESSING with an expired lease (a dispatcher died).",
        1.0,
    ),
    "outbox_lag_p95_seconds": (
        "supplier_sync_outbox_lag_p95_seconds",
        "Publish to search index, 95th percentile of the newest events.",
        1.0,
    ),
    "supplier_requests_24h": (
        "supplier_sync_supplier_requests",
        "Requests sent to the supplier by the task's runs, last 24 hours.",
        1.0,
    ),
    "supplier_429_24h": (
        "supplier_sync_supplier_throttled",
        "429 answers of the supplier to the task's runs, last 24 hours.",
        1.0,
    ),
    "supplier_retries_24h": (
        "supplier_sync_supplier_retries",
        "Retries of the task's runs, last 24 hours.",
        1.0,
    ),
    "supplier_429_ratio_24h": (
        "supplier_sync_supplier_throttled_ratio",
        "429 answers over requests, last 24 hours.",
        1.0,
    ),
    "supplier_429_per_minute_24h": (
        "supplier_sync_supplier_throttled_per_minute",
        "429 answers per minute of syncing, last 24 hours.",
        1.0,
    ),
    "supplier_limiter_wait_seconds_24h": (
        "supplier_sync_supplier_limiter_wait_seconds",
        "Seconds requests waited for the rate limiter, last 24 hours.",
        1.0,
    ),
    "supplier_governed_rate": (
        "supplier_sync_supplier_governed_rate",
        "Requests/s the adaptive rate limiter had learnt by the newest run (-1: fixed rate).",
        1.0,
    ),
    "listing_drifted_cities_24h": (
        "supplier_sync_listing_drifted_cities",
        "Cities whose listing shifted under their walk (or could have, unchecked), last 24 hours.",
        1.0,
    ),
    "listing_unverified_cities_24h": (
        "supplier_sync_listing_unverified_cities",
        "Of those, cities whose walk could not verify the listing: no hotel's absence counted.",
        1.0,
    ),
    "listing_shifts_24h": (
        "supplier_sync_listing_shifts",
        "Shifts of city listings seen under page-number walks, last 24 hours.",
        1.0,
    ),
    "walk_recovered_hotels_24h": (
        "supplier_sync_walk_recovered_hotels",
        "Hotels a walk's verification found that its pages had skipped, last 24 hours.",
        1.0,
    ),
    "dead_letters_oldest_open_hours": (
        "supplier_sync_dead_letters_oldest_open_age_seconds",
        "Age of the oldest open dead letter.",
        3600.0,
    ),
    "dead_letters_created_24h": (
        "supplier_sync_dead_letters_created",
        "Dead letters written in the last 24 hours.",
        1.0,
    ),
    "dead_letter_fix_rate_24h": (
        "supplier_sync_dead_letter_fix_ratio_24h",
        "Resolved over created dead letters, last 24 hours.",
        1.0,
    ),
    "dead_letter_fix_rate_7d": (
        "supplier_sync_dead_letter_fix_ratio_7d",
        "Resolved over created dead letters, last 7 days.",
        1.0,
    ),
}


class HealthCollector(Collector):
    """Serves the cached :class:`SyncHealth` of each task; refreshed by :meth:`refresh`."""

    def __init__(self, db: SyncDatabase, task_codes: Sequence[str]) -> None:
        self.db, self.task_codes = db, list(task_codes)
        self._lock = threading.Lock()
        self._health: dict[str, SyncHealth] = {}
        self._refreshed_at: float | None = None
        self.errors = 0

    def refresh(self) -> None:
        """Computes every task's health (a failure keeps the previous figures)."""
        try:
            fresh = {t: sync_health(self.db, task_code=t) for t in self.task_codes}
        except Exception as err:  # served stale, counted, logged: a scrape never fails
            with self._lock:
                self.errors += 1
            log.warning("sync health refresh failed: %s", err)
            return
        with self._lock:
            self._health, self._refreshed_at = fresh, time.monotonic()

    def collect(self) -> Iterator[Any]:
        """The Prometheus metric families of the cached figures."""
        with self._lock:
            health, refreshed, errors = dict(self._health), self._refreshed_at, self.errors
        age = GaugeMetricFamily(
            "supplier_sync_health_age_seconds", "How old the served figures are."
        )
        age.add_metric([], -1.0 if refreshed is None else time.monotonic() - refreshed)
        yield age
        yield CounterMetricFamily(
            "supplier_sync_health_errors", "Refreshes of the figures that failed.", value=errors
        )
        families = {
            key: GaugeMetricFamily(name, text, labels=["task"])
            for key, (name, text, _) in GAUGES.items()
        }
        city = GaugeMetricFamily(
            "supplier_sync_city_freshness_seconds",
            "Now minus the city's last successful sync.",
            labels=["task", "city"],
        )
        missing = GaugeMetricFamily(
            "supplier_sync_missing_field_ratio",
            "Share of the latest batch's records without the field.",
            labels=["task", "field"],
        )
        by_status = GaugeMetricFamily(
            "supplier_sync_dead_letters", "Dead letters by status.", labels=["status"]
        )
        open_class = GaugeMetricFamily(
            "supplier_sync_dead_letters_open", "Open dead letters by class.", labels=["class"]
        )
        seen_supplier_wide = False
        for task, h in sorted(health.items()):
            values = h.values()
            for key, (_, _, scale) in GAUGES.items():
                if key in values:
                    families[key].add_metric([task], values[key] * scale)
            for name, hours in h.city_lag_hours.items():
                city.add_metric([task, name], hours * 3600)
            for name, rate in h.missing_field_rate.items():
                missing.add_metric([task, name], rate)
            if h.dead_letters is not None and not seen_supplier_wide:
                seen_supplier_wide = True  # dead letters are the supplier's, not a task's
                for status, n in sorted(h.dead_letters.by_status.items()):
                    by_status.add_metric([status], n)
                for cls, n in sorted(h.dead_letters.by_class.items()):
                    open_class.add_metric([cls], n)
        yield from families.values()
        yield from (city, missing, by_status, open_class)


def loopback_only(host: str, port: int) -> bool:
    """Whether listening on ``host`` reaches loopback only (``127.0.0.1``, ``::1``,
    ``localhost``), not other machines (``0.0.0.0``, ``::``, an interface's address).

    Raises:
        ConfigError: ``host`` is no address or name this machine can resolve.
    """
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, ValueError) as err:  # socket.gaierror, an embedded NUL, bad IDNA
        raise ConfigError(f"--host {host!r} is not an address to listen on: {err}") from None
    return all(ipaddress.ip_address(str(sockaddr[0])).is_loopback for *_, sockaddr in found)


def serve(
    db: SyncDatabase,
    task_codes: Sequence[str],
    *,
    port: int,
    host: str = LOOPBACK,
    interval: float = 30.0,
    stop: threading.Event | None = None,
) -> HealthCollector:
    """Serves ``/metrics`` on ``host:port`` (loopback by default: it is unauthenticated) and
    refreshes the figures every ``interval`` seconds until ``stop`` is set (forever without
    one).

    Returns:
        The collector (once ``stop`` is set).

    Raises:
        ConfigError: Nothing can listen on ``host:port`` (taken, or not this machine's).
    """
    registry = CollectorRegistry()
    collector = HealthCollector(db, task_codes)
    collector.refresh()
    registry.register(collector)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        raise ConfigError(f"cannot listen on {host}:{port}: {err}") from None
    stop = stop or threading.Event()
    try:
        while not stop.wait(interval):
            collector.refresh()
    finally:
        server.shutdown()
        thread.join(timeout=5)
    return collector
