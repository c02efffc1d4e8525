"""The ``supplier-sync`` command line.

- ``main``: the entry point (parse, load the command's handler, exit codes, logging,
  start-up and exit of the console script).
- ``parsers/``: each command group's arguments, and the handler each command names; light,
  so that parsing and ``--help`` import no handler.
- ``common``: what parsers and handlers share (argument types, JSON output, error lines,
  the sync database's lifetime); ``resources``: the Dagster resources the handlers build.
- One handler module per command group (``sync``, ``batches``, ``db``, ``governance``,
  ``operators``, ``outbox``, ``health``, ``accounts``, ``simulate``, ``daemon``), and one for
  a group's commands that import what the others do without (``repair``, ``serve_api``,
  ``accounts_check``); ``sync_runner`` and ``lease_demo`` do the work of the syncs and of
  the lease demo.
"""
