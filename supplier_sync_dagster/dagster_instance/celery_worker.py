"""The Celery app a worker host runs: ``celery -A supplier_sync_dagster.dagster_instance.celery_worker
worker -Q dagster`` (``deploy/celery/``). The celery command imports it by name, so the app is
made when the module is imported, from ``SUPPLIER_SYNC_CELERY_BROKER_URL`` and ``_BACKEND_URL``.
"""

from supplier_sync_dagster.dagster_instance.celery_launcher import preload_run_code, worker_app

app = worker_app()
preload_run_code()
