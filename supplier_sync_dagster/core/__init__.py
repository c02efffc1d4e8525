"""The sync as plain Python over SQLAlchemy Core; nothing here imports Dagster.

``errors`` (the exception tree), ``settings`` (every ``SUPPLIER_SYNC_*`` variable) and
``accounts`` (the suppliers file) serve every room: ``store`` (where facts are kept),
``leasing`` (who may write a shard), ``records`` (one record's way to the catalog),
``sync`` (one city's and one run's work), ``outbox`` (what follows a publish), ``repair``
(healing and checking afterwards), ``health`` (metrics and alerts) and ``supplier`` (the
supplier's HTTP API).
"""
