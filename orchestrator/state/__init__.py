"""Training state outside the workers, in tiers (ARCHITECTURE.md, "State and where it lives").

- `tiers.TieredState`: the controller's state plane on Ray (live, peer, S3); metadata only.
- `keeper.Keeper`: one node's host memory for shards, and its S3 uploader.
- `restore_plan`: the pure restore planner (and peer placement).
- `s3_store.S3Checkpoints`: the S3 format (safetensors per unit slice, manifest last).
- `snapshots.MemorySnapshots`: whole-state copies, for the fakes and unit tests.
"""
