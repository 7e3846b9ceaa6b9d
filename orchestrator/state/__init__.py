"""Training state outside the workers: snapshot stores behind the `CheckpointStore` protocol.

Today one store, `snapshots.MemorySnapshots`. The tiered stores (peer keepers, S3)
and the pure restore planner land here (issue: Recovery, part 1).
"""
