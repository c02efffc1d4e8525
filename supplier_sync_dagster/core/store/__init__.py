"""Where the sync's facts are kept: the sync database (``engine``: URLs, backends, the
database clock's query; ``db``: the opened database and its clock; ``schema`` and
``migrations``: its tables and their numbered DDL), the payload store of raw and normalized
pages, and the audit trail of operator actions."""
