"""The controller's side-effect boundaries as small protocols, each with a shipped fake (orchestrator/control/fakes.py).

- `NodeSource`: which GPU nodes exist now (Ray: cluster/node_sources.py).
- `WorkerGroup`: the workers of one Plan (Ray: worker_group.RayWorkerGroup).
- `StatePlane`: snapshots after steps, salvage after a failure, restore into a new
  group (Ray: state/tiers.TieredState; whole-state copies: control/snapshots.MemorySnapshots).
  The calls TieredState makes of a worker group and of the keepers are state/protocols.py's (`StateGroup`,
  `StateCalls`), typed with the records of workers/transfer.py.
- `InterruptionSource`: spot notices and drains announced ahead of a node's loss.
- `JobQueue`: the jobs of one cluster waiting for GPUs that others hold, by priority and then first come first
  served, and the requests of waiting jobs to running ones of lower priority, or to jobs whose GPUs the fleet's
  weighted share gives the waiting job (control/share.py; Ray: cluster/job_queue.RayJobQueue).
- `Clock`: time, so tests step through deadlines without sleeping.
Pure: no Ray, no boto3, no torch.
"""

from __future__ import annotations

import time
from collections.abc import Set
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from planner import ClusterSpec
from planner.specs import ModelSpec, TrainSpec


class NodeSource(Protocol):
    held: dict[str, dict[str, int]]  # after discover: node -> {holder (another job): GPUs not free to this job}

    def discover(self) -> ClusterSpec: ...  # the GPUs free to this job (no node at all where none is)
    def whole(self) -> ClusterSpec: ...  # after discover: every node with all its GPUs, whoever holds them


class WorkerGroup(Protocol):
    last_peak_mem: int  # largest per-worker device memory of the last step, bytes
    stages_switch: bool  # a notice's switch is pre-staged: processes outlive the group (its recovery strategy's)

    def start(self) -> None: ...
    def step(self, step_index: int) -> float: ...  # the committed step's loss; raises WorkerFailure
    def evaluate(self, batches: int) -> float: ...  # the validation loss of the committed weights (WorkerFailure)
    def export_state(self) -> tuple[Any, float]: ...  # (canonical state, optimizer steps)
    def import_state(self, state: Any, optimizer_steps: float) -> None: ...
    def release(self) -> None: ...  # the group ends; in place, the processes that kept their state stay for the next
    def shutdown(self) -> None: ...  # the group ends with every process
    def prestage(self, plan: Any) -> int: ...  # warm workers for `plan`'s ranks no process holds; how many started
    def staged_ready(self) -> bool: ...  # every warm worker has started
    def warm_joined(self, cluster: ClusterSpec, nodes: Set[str]) -> int: ...  # warm workers on joined nodes' GPUs
    def warm_spares(self, cluster: ClusterSpec) -> int: ...  # standing warm workers on idle GPUs; how many started
    def give_up(self, nodes: Set[str]) -> int: ...  # its processes on `nodes`, which no rank uses (warm workers,
    # kept processes no rank took), end: their GPUs given back to a job that asked; how many


class RestoreResult(Protocol):
    """What a state plane's restore reports (state/tiers: workers.transfer.RestoreReport; snapshots.MemoryRestore)."""

    step: int  # the committed step restored
    tier: str  # the costliest tier it read

    def as_dict(self) -> dict: ...  # for the run's events


class StatePlane(Protocol):
    def claim(self) -> None: ...  # this job as its run's one writer (WriterConflict: another job is)
    def release(self) -> None: ...  # at the job's end
    def writer_lost(self) -> str | None: ...  # why the run's writer lock is no longer this job's (None: it is)
    def after_step(self, group: WorkerGroup, step: int, avoid: set[str]) -> bool: ...  # True: a snapshot was taken
    def drain(self, group: WorkerGroup, step: int, avoid: set[str]) -> None: ...  # state off the `avoid` nodes, now
    def prepare_drain(self, group: WorkerGroup, avoid: set[str]) -> None: ...  # start what that drain copies to
    def drain_ready(self) -> bool: ...  # what prepare_drain started runs
    def salvage(self, group: WorkerGroup, avoid: set[str], step: int | None) -> None: ...  # survivors off `avoid`
    # keep committed step `step`; a salvage that fails is said, not raised (the other tiers hold the state)
    def restore(self, group: WorkerGroup, avoid: set[str]) -> RestoreResult | None: ...
    # None: a fresh start; no source on the `avoid` nodes
    def suspend(self, group: WorkerGroup, step: int) -> str: ...  # `step` kept where no GPU is needed, for a
    # later restore (S3 where there is a bucket, waited for); says where
    def flush(self) -> None: ...  # uploads in flight complete
    def upload_lag(self, committed: int) -> dict | None: ...  # where the S3 tier stands; None: there is none


@dataclass(frozen=True)
class Notice:
    """A node will be taken away: a spot notice, a rebalance recommendation, or a Ray drain."""

    node: str
    deadline_s: float  # on the controller's clock
    source: str  # "aws", "gcp", "azure", "ray-drain", "test"


class InterruptionSource(Protocol):
    def poll(self) -> list[Notice]: ...  # notices that arrived since the last poll


class Clock(Protocol):
    def now(self) -> float: ...


class YieldRequest(NamedTuple):
    """A waiting job of higher priority asks a running one to give back its GPUs on some nodes."""

    by: str  # the asking job
    priority: int  # its priority
    nodes: list[str]  # the nodes whose GPUs it asks this job for
    share: bool = False  # asked by the fleet's weighted share (control/share.py), whatever the priorities


class JobCard(NamedTuple):
    """What a job that shares the fleet by weighted throughput (runtime.fleet_share: weighted) shows the others:
    enough for each of them to rate it on any set of nodes (control/share.Rates) and weigh it."""

    priority: int
    model: ModelSpec
    train: TrainSpec


class JobQueue(Protocol):
    job: str  # this job's id (the holder name its GPUs show under)
    priority: int  # this job's (runtime.priority)
    card: JobCard | None  # this job's card where it shares the fleet by weighted throughput; None: first come

    def enter(self) -> None: ...  # this job waits (again: its place is kept, its entry shown alive)
    def ahead(self) -> list[str]: ...  # the waiting jobs before this one: higher priority first, then first come
    def hold(self) -> None: ...  # this job's workers hold GPUs: it waits no more, its priority stays shown
    def leave(self) -> None: ...  # this job ended: no entry left
    def priorities(self) -> dict[str, int]: ...  # every waiting or running job's priority
    def ask(self, job: str, nodes: list[str], share: bool = False) -> None: ...  # ask `job` for its GPUs on `nodes`
    def sharing(self) -> dict[str, JobCard]: ...  # every waiting or running job that shows a card, by id
    def asked(self) -> YieldRequest | None: ...  # the newest request to this job, read once


class SystemClock:
    now = staticmethod(time.perf_counter)  # (read at every step and event: no Python frame of its own)


class NoInterruptions:
    """No notices: the default where no notice source is configured (runtime.notices: none, no Ray drain)."""

    def poll(self) -> list[Notice]:
        return []
