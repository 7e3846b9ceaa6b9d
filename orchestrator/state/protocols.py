"""Every call the state plane (tiers.py) makes of a worker group and of the keepers, as protocols typed with the
records of workers/transfer.py. Each has a Ray implementation and an in-process fake:

- `StateGroup`: runtime/worker_group.RayWorkerGroup; state/fakes.LocalGroup (both recovery paths).
- `StateCalls` (defined in calls.py beside them: keepers.py takes one, and this module imports recovery.py,
  which imports keepers.py): state/calls.RayCalls; state/calls.LocalCalls (keepers as plain `KeeperStore`
  objects).
- `Source`: what a worker pulls pieces from: a keeper (state/keeper.KeeperStore), or a kept worker process
  (workers/actor.TrainWorker; state/fakes.LocalProcess). Reached through a handle: `handle.get_many.remote(...)`.

tests/test_transfer_types.py checks that these calls and their implementations carry typed records, not tuples,
dicts or strings. The model is torchft's transport ABC with its in-process fakes beside it.
"""

from __future__ import annotations

from typing import Protocol

from orchestrator.state.calls import StateCalls  # noqa: F401 - kept beside its implementations (calls.py)
from orchestrator.state.recovery import KeepingGroup, Recovery
from workers.transfer import (
    CheckpointLocation,
    Fetch,
    LoadReport,
    NeedRow,
    Piece,
    PieceRequest,
    Refused,
)


class Source(Protocol):
    def get_many(self, requests: list[PieceRequest], step: int, s3: CheckpointLocation | None = None,
                 keys: tuple[str, ...] | None = None) -> list[Piece | Refused]: ...


class StateGroup(KeepingGroup, Protocol):
    """The worker group's side of the state plane: what the recovery strategies ask of it (KeepingGroup: `plan`,
    `holds_state`, `retain`, `held`, `drop_retained`, `hand_over`), and the rest. Calls that go to keepers return
    answers to wait on (`StateCalls.get`)."""

    recovery: Recovery  # runtime.recovery as a strategy: InPlace (survivors keep processes and state) or Restart

    def snapshot(self, step: int, keepers: list, pin: bool = False) -> list: ...  # per rank: its copy's Receipt
    def needs(self) -> list[list[NeedRow]]: ...
    def load(self, per_rank: list[list[Fetch]], step: int, optimizer_steps: float, s3: CheckpointLocation | None,
             overlap: bool = True) -> list[LoadReport]: ...
    def settle_restore(self, timeout_s: float | None = None) -> None: ...  # an overlapped restore's moments are in
