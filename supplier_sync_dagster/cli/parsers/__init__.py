"""The arguments of every ``supplier-sync`` command, a module per command group.

Each module registers its commands on the ``supplier-sync`` subparsers and names, for each,
the handler that runs it (:func:`supplier_sync_dagster.cli.common.handled_by`). These
modules never import a handler: parsing the command line (and ``--help``) costs only what
the options need, and the one command that runs loads its own handler module.
"""
