"""Re-plans that weigh migration: the planner's top candidates, each with the state it would move.

Pure (the planner and its cost model, no Ray). On every re-plan the controller
asks the planner for its best few plans and `policies` picks by throughput minus
amortized migration cost: after a loss (`choose_replan`, nothing to stay on) and
when nodes join (`consider_joined`, at a step boundary, staying is a candidate).
Migration is start-up (as last measured) plus the time the pull holds training
(`held_s`): each new stage pulls its state from its own node when the running
plan held those layers there ("live"), else from another node ("peer"), over
`bandwidths`; nodes pull at once, the weights before the first step and AdamW's
moments beside it.
"""

from __future__ import annotations

import dataclasses
import logging

from orchestrator.policies import Candidate, ScaleDecision, replan_policy, scale_policy
from planner import ClusterSpec, Plan, PlanningError, evaluate
from planner.specs import ModelSpec, TrainSpec, tokens_per_step

log = logging.getLogger("hetspot.controller")
TOP_K = 4  # candidate plans weighed per re-plan
WEIGHTS_SHARE = 1 / 3  # of the state a restore moves: the master weights; AdamW's two moments are the rest
MOMENTS_SLOWDOWN = 2.0  # the moments share the links with the first step's own traffic: counted at half speed


def joined_nodes(known: set[str] | None, cluster: ClusterSpec) -> tuple[set[str], str]:
    """(the node set to remember, the joined nodes' names or ""): the first call only records."""
    names = {n.name for n in cluster.nodes}
    if known is None:
        return names, ""
    return names, ", ".join(sorted(names - known))


def layer_bytes(model: ModelSpec, train: TrainSpec, layer: int) -> float:
    """State of one extended layer (-1 embedding, L head) as the tiers move it: master weights and AdamW's moments."""
    params = model.embed_params if layer < 0 else model.head_params if layer >= model.num_layers else model.layer_params
    return params * train.state_bytes_per_param


def stage_layers(p: Plan):
    """(node, extended layers) per stage of plan `p`: a pipeline's first stage holds the embedding, its last the head."""
    for pipe in p.pipelines:
        for i, st in enumerate(pipe.stages):
            lo = -1 if i == 0 else st.layer_start
            hi = p.num_layers + 1 if i == len(pipe.stages) - 1 else st.layer_end
            yield st.node, range(lo, hi)


def held_by_node(p: Plan | None) -> dict[str, set[int]]:
    """Per node of plan `p` (None: nothing), the extended layers its stages hold."""
    held: dict[str, set[int]] = {}
    for node, layers in stage_layers(p) if p is not None else ():
        held.setdefault(node, set()).update(layers)
    return held


def node_bytes(p: Plan, model: ModelSpec, train: TrainSpec) -> dict[str, float]:
    """Per node of plan `p`, the state its stages hold (`layer_bytes`)."""
    out: dict[str, float] = {}
    for node, layers in stage_layers(p):
        out[node] = out.get(node, 0.0) + sum(layer_bytes(model, train, x) for x in layers)
    return out


def replicated_off(p: Plan, doomed: set[str]) -> bool:
    """Whether stages off the `doomed` nodes hold every layer the stages on them hold. A stage's TP ranks share
    one node, so a surviving stage holds whole layers: other replicas then cover everything the doomed nodes hold
    at the committed step (data-parallel replicas hold the same state after each step)."""
    held, needed = set(), set()
    for node, layers in stage_layers(p):
        (needed if node in doomed else held).update(layers)
    return needed <= held


def drain_copy_s(p: Plan, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, doomed: set[str]) -> float:
    """Seconds a drain takes to copy the committed step off the `doomed` nodes (state/tiers.py `drain`): none when
    other replicas hold every layer of theirs (`replicated_off`; survivors keep their own state on their own
    node); else the state plane copies every rank's state to keepers off them, each node what its stages hold
    over its own link, at once."""
    if replicated_off(p, doomed):
        return 0.0
    known = {n.name for n in cluster.nodes}
    return max((b / bandwidths(cluster, n if n in known else None)["peer"] for n, b in node_bytes(p, model, train).items()),
               default=0.0)


def node_kind(node) -> str:
    """Nodes of one kind are interchangeable to the cost model: every field but the name and the instance."""
    return node.model_dump_json(exclude={"name", "instance_id"})


def relabel(new: Plan, old: Plan | None, cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> Plan:
    """`new` with its nodes swapped among nodes of the same kind so that stages land where the running plan held
    their layers: the planner names nodes of one kind arbitrarily, so a surviving node would otherwise often be
    handed another node's layers and pull them over its link. The swap changes no estimate (the nodes are alike);
    it only makes more of the migration local. Greedy by bytes kept in place, largest first (AutoHet's
    local-first recovery applied to the placement, not only to the sources)."""
    if old is None:
        return new
    held = held_by_node(old)
    wants: dict[str, list[int]] = {}
    for node, layers in stage_layers(new):
        wants.setdefault(node, []).extend(layers)
    weight = {x: layer_bytes(model, train, x) for x in range(-1, new.num_layers + 1)}
    kinds: dict[str, list[str]] = {}
    for n in cluster.nodes:
        kinds.setdefault(node_kind(n), []).append(n.name)
    rename: dict[str, str] = {}
    for names in kinds.values():
        mine = [n for n in names if n in wants]
        had = [n for n in names if n in held]
        if not mine or not had:
            continue
        pairs = sorted(((sum(weight[x] for x in wants[a] if x in held[b]), a, b) for a in mine for b in had),
                       reverse=True)
        free, got = set(names), {}
        for kept, a, b in pairs:
            if kept > 0 and a not in got and b in free:
                got[a] = b
                free.discard(b)
        for a in [*mine, *(n for n in names if n not in wants)]:  # the rest: a bijection, in place where free
            if a not in got:
                got[a] = a if a in free else min(free)
                free.discard(got[a])
        rename.update({a: b for a, b in got.items() if a != b})
    return renamed(new, rename) if rename else new


def renamed(p: Plan, rename: dict[str, str]) -> Plan:
    """`p` with nodes renamed (one-to-one): stages, their devices, unused devices, host memory."""
    def dev(d: str) -> str:
        node, _, i = d.rpartition("/")
        return f"{rename.get(node, node)}/{i}"

    pipes = [pipe.model_copy(update={"stages": [st.model_copy(update={
        "node": rename.get(st.node, st.node), "devices": [dev(d) for d in st.devices]}) for st in pipe.stages]})
        for pipe in p.pipelines]
    unused = [u.model_copy(update={"device": dev(u.device)}) for u in p.unused]
    est = p.estimate.model_copy(update={"host_gib": {rename.get(n, n): g for n, g in p.estimate.host_gib.items()}}) \
        if p.estimate is not None else None
    return p.model_copy(update={"pipelines": pipes, "unused": unused, "estimate": est})


def node_migration_bytes(old: Plan | None, new: Plan, model: ModelSpec, train: TrainSpec) -> dict[str, dict]:
    """Per node of the new plan, the bytes its stages pull, by tier: "live" where the old plan held the layer
    on that node, else "peer" (another node's live copy or snapshot). Every replica pulls its own."""
    held = held_by_node(old)
    out: dict[str, dict] = {}
    for node, layers in stage_layers(new):
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


def overlap_window_s(p: Plan) -> float:
    """Seconds of a plan's first step that a restore's moments may arrive in unseen: its forward and backward
    (the fastest replica's); the update waits for them, and the gradient sync is not counted as room."""
    return min(p.estimate.pipeline_time_s, default=0.0) if p.estimate is not None else 0.0


def held_s(pulls: list[tuple[float, float]], window_s: float) -> float:
    """Seconds a restore holds training back. `pulls`: per node, the seconds its weights (and whole S3 pieces)
    take and the seconds its moments take. The first step starts once every node has its weights; each node's
    moments follow on its link (workers/actor.py `load_state`): at full speed until the step starts, at
    1 / MOMENTS_SLOWDOWN beside its forward and backward (`window_s`), at full speed again while its update
    waits for the last of them. Never more than pulling every byte first."""
    if not pulls:
        return 0.0
    first = max(w for w, _ in pulls)
    left = [max(0.0, m - (first - w)) for w, m in pulls]
    return first + max(max(0.0, x - window_s / MOMENTS_SLOWDOWN) for x in left)


def pull_held_s(old: Plan | None, new: Plan, model: ModelSpec, train: TrainSpec, bw: dict[str, float]) -> float:
    """`held_s` of the move from `old` to `new` (`node_migration_bytes`), every node at the bandwidths `bw`."""
    pulls = [(WEIGHTS_SHARE * t, (1 - WEIGHTS_SHARE) * t) for t in
             (sum(n / bw[tier] for tier, n in got.items()) for got in node_migration_bytes(old, new, model, train).values())]
    return held_s(pulls, overlap_window_s(new))


def bandwidths(cluster: ClusterSpec, node: str | None = None) -> dict[str, float]:
    """Bytes/s per tier: a node's own keeper, another node over the link (the slowest of the cluster, or
    `node`'s own), S3 at most 1 GB/s."""
    link = (cluster.node(node).inter_node_bw_gb_s if node else min(n.inter_node_bw_gb_s for n in cluster.nodes)) * 1e9
    return {"live": 4 * link, "peer": link, "s3": min(link, 1e9)}


def _candidates(plans: list[Plan], old: Plan | None, model: ModelSpec, train: TrainSpec,
                startup_s: float, bw: dict[str, float]) -> list[Candidate]:
    return [Candidate(f"candidate {i + 1}", p.estimate.tokens_per_s, slowest_pull(old, p, model, train, bw), startup_s,
                      pull_held_s(old, p, model, train, bw)) for i, p in enumerate(plans)]


def _numbers(d: ScaleDecision, cands: list[Candidate], steps_left: int) -> dict:
    return {"predicted_tokens_per_s": {c.name: round(c.tokens_per_s) for c in cands},
            "migration_mib": {c.name: round(sum(c.migration_bytes.values()) / 2**20, 2) for c in cands},
            "finish_s": {k: round(v, 2) for k, v in d.finish_s.items()}, "steps_left": steps_left}


def choose_replan(planner, model: ModelSpec, train: TrainSpec, old: Plan | None, cluster: ClusterSpec,
                  steps_left: int, startup_s: float) -> tuple[Plan, dict]:
    """The re-plan after a loss or a drain: (plan, the numbers for the event). Raises PlanningError."""
    plans = [relabel(p, old, cluster, model, train) for p in planner.candidates(cluster, k=TOP_K)]
    if old is None or len(plans) == 1:
        return plans[0], {}
    bw = bandwidths(cluster)
    cands = _candidates(plans, old, model, train, startup_s, bw)
    d = replan_policy(cands, steps_left * tokens_per_step(model, train.global_batch), bw)
    log.info("re-plan: %s", d.reason)
    return plans[[c.name for c in cands].index(d.chosen)], {"choice": d.reason} | _numbers(d, cands, steps_left)


def consider_joined(planner, model: ModelSpec, train: TrainSpec, running: Plan, cluster: ClusterSpec,
                    steps_left: int, startup_s: float,
                    measured_tokens_per_s: float | None = None) -> tuple[Plan, ScaleDecision, dict] | None:
    """(chosen plan, decision, the numbers for the event), or None when no plan uses the grown cluster.

    `measured_tokens_per_s`, the running plan's throughput as measured, calibrates the predictions: every
    candidate's predicted tokens/s is scaled by measured / predicted for the running plan, so the remaining
    work is weighed at the speed the job really trains (what the cost model leaves out, such as per-step
    overheads that dwarf a small model's compute, then counts for every candidate alike)."""
    try:
        plans = [relabel(p, running, cluster, model, train) for p in planner.candidates(cluster, k=TOP_K)]
        now = evaluate(running, cluster, model, train).tokens_per_s
    except PlanningError as e:
        log.info("nodes joined but no plan uses them: %s", e)
        return None
    bw = bandwidths(cluster)
    cands = _candidates(plans, running, model, train, startup_s, bw)
    scale = measured_tokens_per_s / now if measured_tokens_per_s and now > 0 else 1.0
    cands = [dataclasses.replace(c, tokens_per_s=c.tokens_per_s * scale) for c in cands]
    left = steps_left * tokens_per_step(model, train.global_batch)
    stay = Candidate("running", now * scale, {}, 0.0)
    d = scale_policy(stay, cands, left, bw)
    chosen = plans[[c.name for c in cands].index(d.chosen)] if d.move else running
    extra = {"calibration": round(scale, 6)} if scale != 1.0 else {}
    return chosen, d, _numbers(d, [stay, *cands], steps_left) | extra
