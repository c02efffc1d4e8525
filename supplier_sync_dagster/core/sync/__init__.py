"""One city's and one run's sync: ``model`` (the shared types and the one factory of
``SyncSettings``), ``runtime`` (GC tuning, CPUs, the one fork pool), ``fetch`` and
``snapshots`` (pages walked and stored), ``stages`` (normalize, judge, publish), ``gate`` (the
batch gates a city passes), ``city`` (a city under its lease), ``run`` (a run's cities and
workers), ``replay`` (from stored pages) and ``tasks`` (task settings)."""
