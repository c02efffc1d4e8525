"""What follows a publish: the outbox stage machine (``machine``), the dispatchers that drive
it (``dispatch``) and the read models it feeds (``projections``: search index, hotel cache,
subscribers)."""
