"""`evaluate(plan, cluster, model, train) -> Estimate`: the closed-form step time of a Plan.

Per replica the 1F1B time comes from `cost.pipeline_time`; each device then adds
its exposed layer-wise gradient sync (AutoHet §4) and its optimizer cost
(on-device, or host-offloaded with AutoHete's cross-iteration overlap). The
step ends when the last device finishes. The simulator in planner/simulator.py
replays the same per-stage times event by event to check the closed form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner import cost
from planner.contract import PlanContractError, plan_problems
from planner.plan_types import Estimate, Pipeline, Plan
from planner.specs import ClusterSpec, ModelSpec, TrainSpec, tokens_per_step


@dataclass
class StageProfile:
    slot: cost.Slot
    shape: cost.StageShape
    times: list[cost.StageTimes]  # per micro-batch
    sync_s: float = 0.0
    opt_s: float = 0.0

    @property
    def busy_s(self) -> float:
        return sum(t.fwd_s + t.bwd_s for t in self.times)

    @property
    def fwd_busy_s(self) -> float:
        return sum(t.fwd_s for t in self.times)


def profile_pipeline(
    pipe: Pipeline, cluster: ClusterSpec, model: ModelSpec, train: TrainSpec
) -> list[StageProfile]:
    slots = [cost.make_slot(cluster, train, st.node, st.tp) for st in pipe.stages]
    p = len(slots)
    out = []
    sizes = pipe.micro_batch_sizes()
    links = cost.stage_links(slots)
    for i, st in enumerate(pipe.stages):
        shape = cost.StageShape(st.num_layers, i == 0, i == p - 1)
        nxt, prv = links[i]
        k = cost.inflight(i, p, pipe.num_micro_batches, pipe.schedule)
        cache: dict[int, cost.StageTimes] = {}
        times = []
        for b in sizes:
            if b not in cache:
                cache[b] = cost.stage_times(slots[i], model, train, shape, b, k, cost.knobs(st.offload), nxt, prv)
            times.append(cache[b])
        # Memory peaks at the largest micro-batch.
        out.append(StageProfile(slots[i], shape, times))
    return out


def _sync_bandwidths(plan: Plan, cluster: ClusterSpec) -> dict[tuple[int | str, int], float]:
    """Bandwidth of each (layer, tp rank) gradient group, and of the embedding's ("embed", 0) and the LM
    head's ("head", 0): intra-node if one node, else the slowest NIC."""
    nodes: dict[tuple, set[str]] = {}
    for p in plan.pipelines:
        for i, st in enumerate(p.stages):
            for layer in range(st.layer_start, st.layer_end):
                for k in range(st.tp):
                    nodes.setdefault((layer, k), set()).add(st.node)
            # The embedding's group is every replica's first stage, the LM head's every last stage.
            if i == 0:
                nodes.setdefault(("embed", 0), set()).add(st.node)
            if i == len(p.stages) - 1:
                nodes.setdefault(("head", 0), set()).add(st.node)
    return {key: cost.sync_group_bw(cluster, names) for key, names in nodes.items()}


def profile_plan(plan: Plan, cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> list[list[StageProfile]]:
    """Per replica, per stage: times, exposed sync and optimizer cost."""
    num_r = len(plan.pipelines)
    bws = _sync_bandwidths(plan, cluster)
    profiles = []
    for pipe in plan.pipelines:
        prof = profile_pipeline(pipe, cluster, model, train)
        for st, sp in zip(pipe.stages, prof, strict=True):
            layer_p = model.layer_params / st.tp
            sync = sum(cost.sync_s(layer_p, train, num_r, bws[(layer, 0)])
                       for layer in range(st.layer_start, st.layer_end))
            if sp.shape.first:
                sync += cost.sync_s(cost.embed_params_dev(model, st.tp), train, num_r, bws[("embed", 0)])
            if sp.shape.last:
                sync += cost.sync_s(cost.head_params_dev(model, st.tp), train, num_r, bws[("head", 0)])
            sp.sync_s = max(0.0, sync - sp.times[-1].bwd_s)
            sp.opt_s = cost.optimizer_s(sp.slot, model, train, sp.shape, cost.knobs(st.offload), sp.busy_s,
                                          sp.fwd_busy_s)
        profiles.append(prof)
    return profiles


def pipeline_closed_form(prof: list[StageProfile]) -> float:
    per_mb = [[sp.times[j].fwd_s + sp.times[j].bwd_s for sp in prof] for j in range(len(prof[0].times))]
    return cost.pipeline_time(per_mb)


def estimate_from_profiles(
    plan: Plan, profiles: list[list[StageProfile]], pipe_times: list[float],
    cluster: ClusterSpec, model: ModelSpec, train: TrainSpec,
) -> Estimate:
    step = 0.0
    worst: tuple[str, float, StageProfile | None, int] = ("", 0.0, None, 0)
    memory: dict[str, float] = {}
    host: dict[str, float] = {}  # GiB of offloaded state per node (its GPUs' workers share the node's RAM)
    oom = []
    for r, (pipe, prof, t_pipe) in enumerate(zip(plan.pipelines, profiles, pipe_times, strict=True)):
        for i, (st, sp) in enumerate(zip(pipe.stages, prof, strict=True)):
            finish = t_pipe + sp.sync_s + sp.opt_s
            if finish > step:
                step, worst = finish, (f"pipeline {r} stage {i} ({st.gpu_type} on {st.node})", t_pipe, sp, r)
            mem = max(t.mem_bytes for t in sp.times)
            for d in st.devices:
                memory[d] = round(mem / cost.GIB + train.memory_reserve_gib, 3)
            shape = cost.StageShape(st.num_layers, i == 0, i == len(pipe.stages) - 1)
            host[st.node] = host.get(st.node, 0.0) + len(st.devices) * cost.host_bytes(
                model, train, shape, st.tp, cost.knobs(st.offload)) / cost.GIB
            if mem > sp.slot.mem_cap_bytes:
                oom.append(f"device {st.devices[0]} needs {memory[st.devices[0]]:,.1f} GiB with the "
                           f"{train.memory_reserve_gib} GiB reserve and has {cost.gpu_info(st.gpu_type).mem_gib:,.0f}")
    where, t_pipe, slowest, r = worst
    assert slowest is not None, "a plan has at least one stage"
    sp = slowest
    terms = {
        "compute": sp.busy_s,
        "pipeline bubble": t_pipe - sp.busy_s,
        "gradient sync": sp.sync_s,
        "optimizer/offload": sp.opt_s,
    }
    kind = max(terms, key=lambda k: terms[k])
    bottleneck = f"out of memory: {'; '.join(oom)}" if oom else f"{kind} on {where}"
    tokens = tokens_per_step(model, plan.global_batch)
    mfu = plan.global_batch * cost.model_flops_per_sample(model) / (step * cost.plan_peak_flops(plan))
    return Estimate(
        step_time_s=step,
        tokens_per_s=tokens / step,
        mfu=mfu,
        memory_gib=memory,
        bottleneck=bottleneck,
        pipeline_time_s=pipe_times,
        sync_time_s=max(sp.sync_s for prof in profiles for sp in prof),
        cost_per_mtok=_cost_per_mtok(plan, cluster, step, tokens),
        preemption_loss=preemption_loss(plan, cluster, step),
        host_gib={n: round(g, 3) for n, g in host.items() if g},
    )


def preemption_loss(plan: Plan, cluster: ClusterSpec, step_s: float) -> float:
    """Expected share of wall time lost to preemptions (AutoHet's observation: on spot GPUs the cheapest
    plan per hour can be the dearest per token once recoveries are paid): every preemption of a node the
    plan uses costs cost.RECOVERY_S plus half a step of redone work. Capped at 1."""
    used = plan.nodes()
    per_hour = sum(cluster.node(n).preemptions_per_hour for n in used)
    return min(1.0, per_hour * (cost.RECOVERY_S + step_s / 2) / 3600.0)


def _cost_per_mtok(plan: Plan, cluster: ClusterSpec, step_s: float, tokens: int) -> float | None:
    """Hourly price of every node the plan touches, per million tokens trained (idle GPUs still bill, and the
    time lost to expected preemptions trains nothing)."""
    used = plan.nodes()
    prices = [cluster.node(n).price_per_hour for n in used]
    priced = [p for p in prices if p is not None]
    if len(priced) < len(prices):
        return None
    dollars_per_s = sum(priced) / 3600.0
    kept = 1.0 - preemption_loss(plan, cluster, step_s)
    return math.inf if kept <= 0 else dollars_per_s * step_s / tokens * 1e6 / kept


def closed_form(plan: Plan, cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> Estimate:
    """The closed form on any structurally sound plan, fitting or not (a plan out of memory says so in its
    bottleneck): for studying the cost model itself (tests/test_cost_model.py). Plans go through `evaluate`."""
    profiles = profile_plan(plan, cluster, model, train)
    return estimate_from_profiles(plan, profiles, [pipeline_closed_form(p) for p in profiles], cluster, model, train)


def evaluate(plan: Plan, cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> Estimate:
    """Closed-form estimate of one training step of `plan` (the planner's objective).

    Raises PlanContractError (a ValueError) for a plan the job cannot run, instead of giving it a time:
    one that breaks the plan contract (layers not covered, devices or batch that do not match the job,
    a TP degree that does not divide the model), or whose stages do not fit their GPUs' memory or their
    nodes' host memory.
    """
    problems = plan_problems(plan, model, train, cluster)
    if problems:
        raise PlanContractError("the plan cannot run: " + "; ".join(problems))
    est = closed_form(plan, cluster, model, train)
    short = [f"node {n} needs {g:,.1f} GiB of host memory for offloaded state and has {cluster.node(n).host_mem:,.0f} "
             "(host_mem_gib)" for n, g in est.host_gib.items() if g > cluster.node(n).host_mem]
    oom = est.bottleneck.removeprefix("out of memory: ") if est.bottleneck.startswith("out of memory") else ""
    if oom or short:
        raise PlanContractError("the plan does not fit: " + "; ".join(([oom] if oom else []) + short) +
                                ". Fix: more recompute or offload on those stages, fewer layers on them, or smaller "
                                "micro-batches; `hetspot plan` only emits plans that fit")
    return est
