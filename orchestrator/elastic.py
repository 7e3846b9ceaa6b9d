"""Elastic scale-up: when nodes join, the candidate plans and the migration-aware choice between them.

Pure (the planner and its cost model, no Ray): the controller calls
`consider_joined` at a step boundary when the node set grew, and moves only
when `policies.scale_policy` says the new plan finishes the remaining steps
sooner with its migration included: start-up (as last measured) plus the
state the new workers pull, over the slowest node link.
"""

from __future__ import annotations

import logging

from orchestrator.policies import Candidate, ScaleDecision, scale_policy
from planner import ClusterSpec, Plan, PlanningError, evaluate
from planner.specs import ModelSpec, TrainSpec, tokens_per_step

log = logging.getLogger("hetspot.controller")


def joined_nodes(known: set[str] | None, cluster: ClusterSpec) -> tuple[set[str], str]:
    """(the node set to remember, the joined nodes' names or ""): the first call only records."""
    names = {n.name for n in cluster.nodes}
    if known is None:
        return names, ""
    return names, ", ".join(sorted(names - known))


def consider_joined(planner, model: ModelSpec, train: TrainSpec, running: Plan, cluster: ClusterSpec,
                    steps_left: int, startup_s: float) -> tuple[Plan, ScaleDecision, dict] | None:
    """(new plan, decision, the numbers for the event), or None when no plan uses the grown cluster."""
    try:
        new = planner.plan(cluster)
        now = evaluate(running, cluster, model, train).tokens_per_s
    except PlanningError as e:
        log.info("nodes joined but no plan uses them: %s", e)
        return None
    state = 12 * model.num_params  # fp32 weights and AdamW's two moments, pulled by the new workers
    link = min(n.inter_node_bw_gb_s for n in cluster.nodes) * 1e9  # bytes/s
    bandwidth = {"live": 4 * link, "peer": link, "s3": min(link, 1e9)}
    left = steps_left * tokens_per_step(model, train.global_batch)
    d = scale_policy(Candidate("running", now, {}, 0.0),
                     [Candidate("new", new.estimate.tokens_per_s, {"peer": state}, startup_s)], left, bandwidth)
    extra = {"predicted_tokens_per_s": {"running": round(now), "new": round(new.estimate.tokens_per_s)},
             "finish_s": {k: round(v, 2) for k, v in d.finish_s.items()}, "steps_left": steps_left}
    return new, d, extra
