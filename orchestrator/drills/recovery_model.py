"""The recovery cost model of `hetspot simulate` (pure): what a re-plan after a preemption costs.

Detection and start-up default to bench/recovery.py's medians on the test cluster;
bytes move by tier (migration.bandwidths, S3 per node at `s3_gb_s`), nodes pull at
once; the weights come before the first step and AdamW's moments beside it, as
the workers restore (migration.held_s); work is redone back to the newest step every
layer is held at.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.control.migration import (
    S3_NODE_GB_S,
    WEIGHTS_SHARE,
    bandwidths,
    held_s,
    layer_bytes,
    layer_sources,
    node_bytes,
    overlap_window_s,
)
from orchestrator.state.recovery import InPlace, Restart, strategy_kind
from planner import ClusterSpec, Plan
from planner.specs import ModelSpec, TrainSpec


@dataclass
class Assumptions:
    detect_s: float = 0.05  # bench/recovery.py: kill to detection, median
    recovery: str = InPlace.name  # runtime.recovery: in-place (survivors re-form) or restart (every process anew)
    reform_s: float = 0.3  # in place: detection to restored minus the restore (bench/recovery.py, median, CPU cluster)
    startup_s: float = 13.0  # a worker process start to ready: the restart path's, and in place that of ranks on
    # GPUs the old plan did not use. Measured on one H200 (2026-12-04, `python bench/gpu_check.py`, its cold
    # start: median of 2): a new process to a gpt-1.3b stage's state loaded from pinned memory, 13.0 s (torch's
    # import 3.8 s, hetspot's 0.4, the CUDA context 0.2, the stage built 6.7, AdamW's state 1.1, the load 0.8); the
    # first step 0.3 s more. Not counted: the NCCL communicator's first use. The CPU test cluster measures 4.3 s
    # (bench/recovery.py, restart path)
    snapshot_every: int = 1  # peer snapshots every k steps (runtime.snapshot_every)
    s3_every: int = 10  # S3 uploads every k steps, a multiple of snapshot_every (checkpoint.s3_every)
    ckpt_every_s: float = 1800.0  # s3-only: a checkpoint every 30 minutes
    s3_gb_s: float = S3_NODE_GB_S  # per node, S3 read and write (orchestrator/control/migration.py: its source)
    overlap: bool = True  # restores bring AdamW's moments beside the first step (workers/actor.py load_state)
    notice_s: float = 120.0  # spot notice before a preemption (AWS's two minutes; 0: none): hetspot drains when
    # the time left at the next step boundary covers the copy (drain.notice_decision); s3-only restarts regardless
    warm_at_join: bool = True  # in place, a joined node's GPUs get worker processes at the join (the controller's
    # warm-at-join): a move onto it waits for them while the old plan trains, and a later recovery finds them started

    def __post_init__(self) -> None:
        strategy_kind(self.recovery)  # a name that is no strategy says which are

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @property
    def strategy(self) -> type[InPlace] | type[Restart]:  # what a recovery's cost depends on, not its name
        return strategy_kind(self.recovery)


def nodes_of(plan: Plan | None) -> set[str]:
    return set(plan.nodes()) if plan is not None else set()


def gpus_by_node(plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in plan.pipelines:
        for st in p.stages:
            out[st.node] = out.get(st.node, 0) + st.tp
    return out


def relaunch_s(old: Plan | None, new: Plan, gone: set[str], a: Assumptions, warm: dict[str, float] | None = None,
               now: float = 0.0) -> float:
    """Seconds from a decision to the new plan's workers joined. Restart: every process starts (`startup_s`). In
    place: survivors re-form (`reform_s`); when the new plan uses more GPUs on a node than the old plan's
    survivors there, those ranks start processes, at once, beside the re-form, unless the node's GPUs are warm
    (`warm`: node -> when its warm workers are ready, from warm-at-join): then only what is left of their start."""
    if not a.strategy.keeps_processes or old is None:
        return a.startup_s
    before = {n: k for n, k in gpus_by_node(old).items() if n not in gone}
    warm = warm or {}
    starts = [max(0.0, warm[n] - now) if n in warm else a.startup_s
              for n, k in gpus_by_node(new).items() if k > before.get(n, 0)]
    return max([a.reform_s, *starts])


def staged_start_s(start_s: float, ahead_s: float, a: Assumptions) -> float:
    """A notice's switch, in place: the processes the new plan needs start at the notice while the doomed nodes
    train on (the controller pre-stages the switch), so of `start_s` only what does not fit in the `ahead_s`
    seconds the notice leaves is charged, and never less than the re-form. The restart path starts its
    processes at the switch: all of `start_s`."""
    if not a.strategy.stages_switch:
        return start_s
    return max(a.reform_s, start_s - max(0.0, ahead_s))


def restore_cost(old: Plan, new: Plan, gone: set[str], cluster: ClusterSpec, model: ModelSpec, train: TrainSpec,
                 a: Assumptions) -> tuple[float, float, dict[str, float]]:
    """(restore seconds, seconds of work redone, bytes by tier) for moving from `old` to `new` after `gone` left.

    Each layer's source: a surviving live holder (the stage's own node: live tier, another: peer), else the
    peer copy of a lost holder (kept on the next node of the old plan in name order, a stand-in for
    peer_placement) when that node survived, else S3. Nodes pull at once, each over its own link (the
    controller's policy assumes the cluster's slowest link for all; migration.bandwidths). With `a.overlap`, the
    restore holds training for `migration.held_s` (S3 pieces come whole before the first step), else until the
    slowest node has every byte.
    """
    ring = sorted(nodes_of(old))
    peer_of = {n: ring[(i + 1) % len(ring)] for i, n in enumerate(ring)}
    per_node: dict[str, tuple[float, float]] = {}  # (seconds before the first step, seconds beside it)
    by_tier = {"live": 0.0, "peer": 0.0, "s3": 0.0}
    redo_steps = 0.5 if gone else 0.0  # a preemption loses the step in flight, on average half done
    for node, layer, tier, redo in layer_sources(old, new, gone, peer_of):
        if redo == "snapshot":  # only a snapshot survived: back to the newest peer snapshot
            redo_steps = max(redo_steps, 0.5 + (a.snapshot_every - 1) / 2)
        elif redo == "s3":
            redo_steps = max(redo_steps, 0.5 + a.s3_every / 2)
        nbytes = layer_bytes(model, train, layer)
        by_tier[tier] += nbytes
        bw = bandwidths(cluster, node) | {"s3": a.s3_gb_s * 1e9}  # each node over its own link
        t = nbytes / bw[tier]
        first = t * WEIGHTS_SHARE if a.overlap and tier != "s3" else t  # S3 pieces come whole
        w, m = per_node.get(node, (0.0, 0.0))
        per_node[node] = (w + first, m + t - first)
    held = held_s(list(per_node.values()), overlap_window_s(new) if a.overlap else 0.0)
    return held, redo_steps * old.estimate.step_time_s, by_tier


def state_io_s(plan: Plan, model: ModelSpec, train: TrainSpec, a: Assumptions) -> float:
    """Every node reads (or writes) its stages' state from S3 at once; the slowest node's time."""
    return max(node_bytes(plan, model, train).values(), default=0.0) / (a.s3_gb_s * 1e9)
