"""The one adapter to Dagster's internals: the embedded instance's storage, the event
transaction that ``defs/`` may use (``events``), the run launcher, the embedded Dagster home,
the in-process daemon, and the webserver + daemon profiles. Everything outside this package
uses Dagster's public API only; ``test_dagster_internals`` fails when an upgrade breaks it."""
