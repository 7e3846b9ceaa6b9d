"""Re-plans that weigh migration: the planner's top candidates, each with the state it would move.

Pure (the planner and its cost model, no Ray). On every re-plan the controller
asks the planner for its best few plans and `policies` picks by throughput minus
amortized migration cost: after a loss (`choose_replan`, nothing to stay on) and
when nodes join (`consider_joined`, at a step boundary, staying is a candidate).
Migration is start-up (as last measured) plus the longest pull of one node: each
new stage pulls its state from its own node when the running plan held those
layers there ("live"), else from another node ("peer"), over `bandwidths`; nodes
pull at once.
"""

from __future__ import annotations

import logging

from orchestrator.policies import Candidate, ScaleDecision, replan_policy, scale_policy
from planner import ClusterSpec, Plan, PlanningError, evaluate
from planner.specs import ModelSpec, TrainSpec, tokens_per_step

log = logging.getLogger("hetspot.controller")
TOP_K = 4  # candidate plans weighed per re-plan


def joined_nodes(known: set[str] | None, cluster: ClusterSpec) -> tuple[set[str], str]:
    """(the node set to remember, the joined nodes' names or ""): the first call only records."""
    names = {n.name for n in cluster.nodes}
    if known is None:
        return names, ""
    return names, ", ".join(sorted(names - known))


def layer_bytes(model: ModelSpec, train: TrainSpec, layer: int) -> float:
    """State of one extended layer (-1 embedding, L head): weights plus AdamW's state."""
    params = model.embed_params if layer < 0 else model.head_params if layer >= model.num_layers else model.layer_params
    return params * (train.param_bytes + train.optimizer_bytes_per_param)


def stage_layers(p: Plan, model: ModelSpec):
    """(node, extended layers) per stage of plan `p`: a pipeline's first stage holds the embedding, its last the head."""
    for pipe in p.pipelines:
        for i, st in enumerate(pipe.stages):
            lo = -1 if i == 0 else st.layer_start
            hi = model.num_layers + 1 if i == len(pipe.stages) - 1 else st.layer_end
            yield st.node, range(lo, hi)


def node_bytes(p: Plan, model: ModelSpec, train: TrainSpec) -> dict[str, float]:
    """Per node of plan `p`, the state its stages hold (weights and AdamW's state)."""
    out: dict[str, float] = {}
    for node, layers in stage_layers(p, model):
        out[node] = out.get(node, 0.0) + sum(layer_bytes(model, train, x) for x in layers)
    return out


def drain_copy_s(p: Plan, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec) -> float:
    """Seconds a drain takes to copy the committed step to keepers off the doomed nodes: the state plane copies
    every rank's state (state/tiers.py `drain`), each node what its stages hold over its own link, at once."""
    known = {n.name for n in cluster.nodes}
    return max((b / bandwidths(cluster, n if n in known else None)["peer"] for n, b in node_bytes(p, model, train).items()),
               default=0.0)


def node_migration_bytes(old: Plan | None, new: Plan, model: ModelSpec, train: TrainSpec) -> dict[str, dict]:
    """Per node of the new plan, the bytes its stages pull, by tier: "live" where the old plan held the layer
    on that node, else "peer" (another node's live copy or snapshot). Every replica pulls its own."""
    held: dict[str, set[int]] = {}
    for node, layers in stage_layers(old, model) if old is not None else ():
        held.setdefault(node, set()).update(layers)
    out: dict[str, dict] = {}
    for node, layers in stage_layers(new, model):
        got = out.setdefault(node, {"live": 0.0, "peer": 0.0})
        for layer in layers:
            got["live" if layer in held.get(node, ()) else "peer"] += layer_bytes(model, train, layer)
    return out


def migration_bytes(old: Plan | None, new: Plan, model: ModelSpec, train: TrainSpec) -> dict[str, float]:
    """The bytes every node of the new plan pulls together, by tier."""
    out = {"live": 0.0, "peer": 0.0}
    for got in node_migration_bytes(old, new, model, train).values():
        for tier, n in got.items():
            out[tier] += n
    return out


def slowest_pull(old: Plan | None, new: Plan, model: ModelSpec, train: TrainSpec, bw: dict[str, float]) -> dict:
    """The bytes by tier of the node that pulls longest: nodes pull at once, each over its own link, so
    the migration lasts as long as its slowest node's pull (not the sum over nodes)."""
    per_node = node_migration_bytes(old, new, model, train)
    return max(per_node.values(), key=lambda b: sum(n / bw[t] for t, n in b.items()), default={})


def bandwidths(cluster: ClusterSpec, node: str | None = None) -> dict[str, float]:
    """Bytes/s per tier: a node's own keeper, another node over the link (the slowest of the cluster, or
    `node`'s own), S3 at most 1 GB/s."""
    link = (cluster.node(node).inter_node_bw_gb_s if node else min(n.inter_node_bw_gb_s for n in cluster.nodes)) * 1e9
    return {"live": 4 * link, "peer": link, "s3": min(link, 1e9)}


def _candidates(plans: list[Plan], old: Plan | None, model: ModelSpec, train: TrainSpec,
                startup_s: float, bw: dict[str, float]) -> list[Candidate]:
    return [Candidate(f"candidate {i + 1}", p.estimate.tokens_per_s, slowest_pull(old, p, model, train, bw), startup_s)
            for i, p in enumerate(plans)]


def _numbers(d: ScaleDecision, cands: list[Candidate], steps_left: int) -> dict:
    return {"predicted_tokens_per_s": {c.name: round(c.tokens_per_s) for c in cands},
            "migration_mib": {c.name: round(sum(c.migration_bytes.values()) / 2**20, 2) for c in cands},
            "finish_s": {k: round(v, 2) for k, v in d.finish_s.items()}, "steps_left": steps_left}


def choose_replan(planner, model: ModelSpec, train: TrainSpec, old: Plan | None, cluster: ClusterSpec,
                  steps_left: int, startup_s: float) -> tuple[Plan, dict]:
    """The re-plan after a loss or a drain: (plan, the numbers for the event). Raises PlanningError."""
    plans = planner.candidates(cluster, k=TOP_K)
    if old is None or len(plans) == 1:
        return plans[0], {}
    bw = bandwidths(cluster)
    cands = _candidates(plans, old, model, train, startup_s, bw)
    d = replan_policy(cands, steps_left * tokens_per_step(model, train.global_batch), bw)
    log.info("re-plan: %s", d.reason)
    return plans[[c.name for c in cands].index(d.chosen)], {"choice": d.reason} | _numbers(d, cands, steps_left)


def consider_joined(planner, model: ModelSpec, train: TrainSpec, running: Plan, cluster: ClusterSpec,
                    steps_left: int, startup_s: float) -> tuple[Plan, ScaleDecision, dict] | None:
    """(chosen plan, decision, the numbers for the event), or None when no plan uses the grown cluster."""
    try:
        plans = planner.candidates(cluster, k=TOP_K)
        now = evaluate(running, cluster, model, train).tokens_per_s
    except PlanningError as e:
        log.info("nodes joined but no plan uses them: %s", e)
        return None
    bw = bandwidths(cluster)
    cands = _candidates(plans, running, model, train, startup_s, bw)
    left = steps_left * tokens_per_step(model, train.global_batch)
    stay = Candidate("running", now, {}, 0.0)
    d = scale_policy(stay, cands, left, bw)
    chosen = plans[[c.name for c in cands].index(d.chosen)] if d.move else running
    return chosen, d, _numbers(d, [stay, *cands], steps_left)
