"""Baseline plans, scored with the same cost model as the planner.

- `megatron_symmetric`: uniform DP x PP x TP over the GPUs in node order, even
  layer split (the depth divides the layer count, as Megatron-LM requires),
  even batch split, one micro-batch size (what a Megatron-LM user sets by hand,
  blind to GPU types).
- `data_parallel_offload`: every GPU a full replica, even batch split, with
  ZeRO-Offload-style optimizer/parameter offload where the model does not fit.
- `best_homogeneous`: the planner itself restricted to the nodes of one GPU type,
  the best type kept.
Each returns a Plan with its estimate, or None if it cannot fit the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from planner import cost
from planner.contract import PlanContractError
from planner.errors import PlanningError
from planner.estimate import evaluate
from planner.groups import Group, make_groups, tp_candidates
from planner.offload_policy import cheapest, fitting_policies, to_policy
from planner.plan_types import Pipeline, Plan, Stage
from planner.search import Planner
from planner.specs import ClusterSpec, ModelSpec, TrainSpec


def _even(total: int, parts: int) -> list[int]:
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]


def _pipeline(groups: list[Group], layer_counts: list[int], n: int, b: int,
              model: ModelSpec, train: TrainSpec) -> Pipeline | None:
    """Stages with the cheapest fitting policy for a fixed split; None if a stage cannot fit."""
    p, m = len(groups), math.ceil(n / b)
    links = cost.stage_links([g.slot for g in groups])
    stages, at = [], 0
    for i, (g, nl) in enumerate(zip(groups, layer_counts, strict=True)):
        shape = cost.StageShape(nl, i == 0, i == p - 1)
        nxt, prv = links[i]
        k = cost.inflight(i, p, m, "1f1b")
        got = cheapest(fitting_policies(g.slot, model, train, shape, b, k, nxt, prv), g.slot, model, train, shape, m)
        if got is None:
            return None
        stages.append(Stage(layer_start=at, layer_end=at + nl, gpu_type=g.slot.gpu_type, node=g.node,
                            devices=list(g.devices), offload=to_policy(got[0], at)))
        at += nl
    return Pipeline(num_samples=n, micro_batch_size=b, num_micro_batches=m, stages=stages)


def _uniform_plan(groups_per_pipe: list[list[Group]], cluster: ClusterSpec, model: ModelSpec,
                  train: TrainSpec, b: int) -> Plan | None:
    d = len(groups_per_pipe)
    if d > train.global_batch or len(groups_per_pipe[0]) > model.num_layers:
        return None
    layers = _even(model.num_layers, len(groups_per_pipe[0]))
    pipes = []
    for groups, n in zip(groups_per_pipe, _even(train.global_batch, d), strict=True):
        pipe = _pipeline(groups, layers, n, min(b, n), model, train)
        if pipe is None:
            return None
        pipes.append(pipe)
    pl = Plan(model_name=model.name, num_layers=model.num_layers, global_batch=train.global_batch, pipelines=pipes)
    try:
        pl.estimate = evaluate(pl, cluster, model, train)
    except PlanContractError:
        return None  # the uniform layout does not fit these GPUs (or their hosts): the baseline has no plan
    return pl


def _best(plans: Sequence[Plan | None]) -> Plan | None:
    ok = [p for p in plans if p is not None]
    return min(ok, key=lambda p: p.estimated.step_time_s) if ok else None


def _micro_batches(train: TrainSpec) -> list[int]:
    return [1 << e for e in range(8) if (1 << e) <= min(train.max_micro_batch_size, train.global_batch)]


def megatron_symmetric(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> Plan | None:
    """Best uniform DP x PP x TP layout; every GPU used where the shape allows."""
    plans: list[Plan] = []
    for tp in tp_candidates(cluster, model):
        groups, _ = make_groups(cluster, train, tp)
        # Megatron-LM's own rule: the pipeline depth divides the layer count (no uneven first or last stage)
        for pp in (d for d in range(1, min(len(groups), model.num_layers) + 1) if model.num_layers % d == 0):
            dp = len(groups) // pp
            if dp == 0:
                continue
            pset = [groups[r * pp:(r + 1) * pp] for r in range(dp)]
            best: float | None = None
            worse = 0
            for b in _micro_batches(train):
                got = _uniform_plan(pset, cluster, model, train, b)
                if got is None:
                    break  # activations grow with the micro-batch: a larger one does not fit either
                plans.append(got)
                if best is None or got.estimated.step_time_s < best:
                    best, worse = got.estimated.step_time_s, 0
                else:
                    worse += 1
                    if worse == 2:  # past the sweet spot between GEMM efficiency and bubble (as the planner)
                        break
    return _best(plans)


def data_parallel_offload(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> Plan | None:
    """Every GPU a replica of the whole model, even batch, offload where needed (ZeRO-Offload)."""
    groups, _ = make_groups(cluster, train, 1)
    groups = groups[: train.global_batch]
    return _best([_uniform_plan([[g] for g in groups], cluster, model, train, b) for b in _micro_batches(train)])


def best_homogeneous(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec, planner: Planner | None = None,
                     full: Plan | None = None) -> Plan | None:
    """The planner on one GPU type's nodes only; the best type wins. `planner`: one whose cost caches to
    share (the same model and training spec); `full`: its throughput plan of the whole cluster, which is the
    answer when the cluster has one GPU type."""
    types = sorted({n.gpu_type for n in cluster.nodes})
    if full is not None and len(types) == 1:
        return full
    # Each type's plan is a search of its own: the planner's cost caches, none of its re-plan shortcuts.
    planner = planner.sharing_caches() if planner is not None else Planner(model, train)
    plans = []
    for gpu_type in types:
        sub = cluster.model_copy(update={"nodes": [n for n in cluster.nodes if n.gpu_type == gpu_type]})
        try:
            plans.append(planner.plan(sub))
        except PlanningError:
            continue
    return _best(plans)


BASELINES = {
    "megatron-symmetric": megatron_symmetric,
    "data-parallel+offload": data_parallel_offload,
    "best-homogeneous": best_homogeneous,
}


def all_baselines(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec, planner: Planner | None = None,
                  full: Plan | None = None) -> dict[str, Plan | None]:
    """Every baseline; `planner` and `full` as in `best_homogeneous` (they only save time)."""
    return {name: fn(cluster, model, train, planner, full) if fn is best_homogeneous else fn(cluster, model, train)
            for name, fn in BASELINES.items()}
