"""From a scored pipeline set to a `Plan`, and the plan a re-plan after a loss can always fall back on (the last one
less its broken pipelines)."""

from __future__ import annotations

import math

from planner.estimate import evaluate
from planner.groups import Profile, PSet
from planner.offload_policy import to_policy
from planner.plan_types import Pipeline, Plan, Stage, UnusedDevice
from planner.scoring import SetCost, done
from planner.specs import ClusterSpec, ModelSpec, TrainSpec


def build_plan(search: SetCost, pset: PSet, exact: bool, unused: list[UnusedDevice],
               profile: Profile | None = None) -> tuple[Plan, set[str]] | None:
    """The plan of a scored pipeline set, and the devices it uses (None if the set does not train)."""
    t, alloc, bw = search.score(pset, exact, profile)
    if alloc is None:
        return None
    pipes: list[Pipeline] = []
    for groups, n in zip(pset, alloc, strict=True):
        f = done(search.pipeline_model(groups, exact, profile).finish(
            n, len(pset), bw[len(pipes)] if isinstance(bw, list) else bw))
        stages, at = [], 0
        for g, ch in zip(groups, f.stages, strict=True):
            pol = to_policy(ch.policy, at)
            stages.append(Stage(layer_start=at, layer_end=at + ch.num_layers, gpu_type=g.slot.gpu_type,
                                node=g.node, devices=list(g.devices), offload=pol))
            at += ch.num_layers
        pipes.append(Pipeline(num_samples=n, micro_batch_size=f.micro_batch_size,
                              num_micro_batches=f.num_micro_batches, stages=stages))
    used = {d for p in pset for g in p for d in g.devices}
    plan = Plan(model_name=search.model.name, num_layers=search.model.num_layers,
                global_batch=search.train.global_batch, pipelines=pipes, unused=list(unused))
    return plan, used


def kept_pipelines(last: Plan, cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> Plan | None:
    """The obvious re-plan after a loss: `last` with every pipeline that lost a GPU dropped and the global batch
    shared among the rest in proportion to what each trained (each was balanced to finish with the others, so
    they still do), micro-batch sizes and splits unchanged. None where no pipeline lost anything (not a loss),
    none is left, or the result does not fit (more micro-batches in flight where a pipeline had fewer than its
    stages). The search can miss it: a re-plan searches the survivors afresh, and on a large cluster its
    heuristic sets need not include the old pipelines (94.2% of the throughput kept where dropping
    the broken pipeline keeps 96.3%), so `Planner` adds it to the re-plan's candidates, and a re-plan is never
    worse than it. It also moves no state."""
    known = {d: n.gpu_type for n in cluster.nodes for d in n.device_ids()}
    kept = [p for p in last.pipelines if all(known.get(d) == st.gpu_type for st in p.stages for d in st.devices)]
    if not kept or len(kept) == len(last.pipelines) or len(kept) > train.global_batch:
        return None
    total, batch = sum(p.num_samples for p in kept), train.global_batch
    exact = [batch * p.num_samples / total for p in kept]
    counts = [max(1, math.floor(x)) for x in exact]
    by_remainder = sorted(range(len(kept)), key=lambda i: (counts[i] - exact[i], i))
    i = 0
    while sum(counts) < batch:
        counts[by_remainder[i % len(kept)]] += 1
        i += 1
    while sum(counts) > batch:  # the floor of 1 sample each can overshoot
        r = max((j for j in range(len(kept)) if counts[j] > 1), key=lambda j: counts[j] - exact[j])
        counts[r] -= 1
    ids = {id(p) for p in kept}
    lost = [d for p in last.pipelines if id(p) not in ids for st in p.stages for d in st.devices if d in known]
    why = "its pipeline lost a GPU; the rest of the last plan kept (faster than the re-planned search's best)"
    unused = sorted([u for u in last.unused if u.device in known] + [UnusedDevice(device=d, reason=why) for d in lost],
                    key=lambda u: u.device)

    # The same micro-batch size, a few more micro-batches: sizes the search itself chose. (Keeping the count and
    # growing each micro-batch instead often scores faster, with sizes the search never tries, so such a plan
    # then outranks every plan the search finds on a grown cluster: a node that joins would never be used.)
    pipes = []
    for p, n in zip(kept, counts, strict=True):
        b = min(p.micro_batch_size, n)
        pipes.append(p.model_copy(update={"num_samples": n, "micro_batch_size": b, "num_micro_batches": -(-n // b)}))
    plan = last.model_copy(update={"pipelines": pipes, "unused": unused, "estimate": None})
    try:
        return plan.model_copy(update={"estimate": evaluate(plan, cluster, model, train)})
    except ValueError:  # PlanContractError: it does not fit, or the cluster's nodes changed under it
        return None
