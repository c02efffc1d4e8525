"""Healing and checking after a sync: compensation of retryable dead letters, incremental
windows from the change feed, reconciliation against the supplier's summaries, trace of a
published field to the supplier's bytes, and exports."""
