"""Training state outside the workers, in tiers (README.md, "When a node is lost").

- `tiers.TieredState`: the controller's state plane (live, peer, S3); metadata only: the front (peer
  snapshots) over `keepers.KeeperSet` (the keepers' lifecycle, calls, inventories), `uploader.Uploader` (the
  S3 tier's thread, eras and pins) and `restore.Restorer` (salvage and the restore loop). It reaches keepers
  through `calls` (Ray's actors, or `calls.LocalCalls` in one process) and workers through the
  `StateGroup` calls (protocols.py), so it runs in unit tests beside `fakes.LocalGroup`. What crosses those
  calls is one typed record per message (workers/transfer.py).
- `keeper.KeeperStore` (`keeper.Keeper` as a Ray actor): one node's host memory for shards, its S3
  uploader, and where bytes move from a keeper to a worker (`get_many`).
- `recovery`: `runtime.recovery` as a strategy the worker groups carry (`InPlace`, `Restart`).
- `restore_plan`: the pure restore planner (and peer placement), and keepers' inventories, kept processes'
  rows and S3 manifests as its holdings, each with its typed source.
- `s3_store.S3Checkpoints`: the S3 format (safetensors per unit slice, manifest last).
"""
