"""Who may write what: tasks and their batches (one per trigger, under the task's concurrency
policy), the shard state machine, shard leases with checkpoints and heartbeats, and which
process holds a lease."""
