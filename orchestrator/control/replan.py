"""Where the re-plan is chosen: the planner's top candidates, each with the state it would move.

On every re-plan the controller asks the planner for its best few plans and picks by throughput minus
amortized migration cost (migration.py): after a loss (`choose_replan`, nothing to stay on) and when nodes
join (`consider_joined`, at a step boundary, staying is a candidate; Parcae makes this trade on homogeneous
spot fleets). Migration is start-up (as last measured) plus the time the pull holds training. A new plan's
stages are relabelled onto the nodes that already hold their layers (`relabel`). Pure: the planner and its
cost model, no Ray.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from orchestrator.control.migration import (
    Candidate,
    bandwidths,
    layer_bytes,
    migration_bytes,
    migration_cost_s,
    pull_held_s,
    slowest_pull,
)
from planner import ClusterSpec, Plan, PlanningError, evaluate
from planner.layout import held_by_node, stage_layers
from planner.search import Planner
from planner.specs import ModelSpec, NodeSpec, TrainSpec, tokens_per_step

log = logging.getLogger("hetspot.controller")


TOP_K = 4  # candidate plans weighed per re-plan
TOLERANCE = 0.02  # runtime.replan_tolerance's default: a re-plan may be this much slower to move fewer bytes


@dataclass(frozen=True)
class ScaleDecision:
    chosen: str  # the chosen candidate's name, for the event
    move: bool
    reason: str
    finish_s: dict[str, float]  # per candidate: migration plus the remaining steps, predicted
    plan: Plan | None = None  # the chosen Plan (None: stay on the running one)


def scale_policy(current: Candidate, candidates: list[Candidate], tokens_left: float,
                 bandwidth: dict[str, float]) -> ScaleDecision:
    """Pick the plan that finishes the remaining tokens soonest, migration included.

    Throughput minus amortized migration cost (Parcae makes this trade on
    homogeneous spot fleets): a faster plan is taken only when its predicted
    gain over the remaining work exceeds what moving onto it costs. Pure.
    """
    finish = {c.name: migration_cost_s(c, bandwidth) + tokens_left / c.tokens_per_s
              for c in [current, *candidates] if c.tokens_per_s > 0}
    best = min(finish, key=lambda name: finish[name])
    stay = finish.get(current.name, float("inf"))
    if best == current.name:
        others = [c for c in candidates if c.tokens_per_s > current.tokens_per_s]
        if not others:
            return ScaleDecision(current.name, False, "no candidate plan is faster than the running one", finish)
        c = max(others, key=lambda c: c.tokens_per_s)
        gain = tokens_left / current.tokens_per_s - tokens_left / c.tokens_per_s
        return ScaleDecision(current.name, False, f"{c.name}: predicted gain {gain:.1f} s over the remaining work is "
                             f"below its migration cost {migration_cost_s(c, bandwidth):.1f} s", finish)
    best_speed = next(c for c in candidates if c.name == best).tokens_per_s
    return ScaleDecision(best, True, f"{best}: finishes in {finish[best]:.1f} s (migration "
                         f"{finish[best] - tokens_left / best_speed:.1f} s "
                         f"included) against {stay:.1f} s on the running plan", finish, _plan_of(candidates, best))


def replan_policy(candidates: list[Candidate], tokens_left: float, bandwidth: dict[str, float],
                  tolerance: float = 0.0) -> ScaleDecision:
    """After a loss the running plan is gone: of the planner's top candidates, the one that finishes soonest.

    Throughput minus amortized migration cost, as `scale_policy`, with no plan to stay on: a
    slightly slower plan that keeps layers where their state already is wins near the end of a run.

    Movement-aware (`tolerance` > 0, runtime.replan_tolerance): among the plans within `tolerance` of the fastest
    candidate's throughput, and the soonest-finishing one, the plan whose restore moves the fewest bytes over the
    network (`Candidate.moved_bytes`; what survivors hold in place is not moved), the soonest to finish on a tie.
    Oobleck and Parcae make this trade: a re-plan that re-splits every pipeline to gain 1% moves most of the
    model, where one that keeps the surviving pipelines moves one stage, and every byte moved is time a further
    loss can interrupt. The reason says what was traded.
    """
    finish = {c.name: migration_cost_s(c, bandwidth) + tokens_left / c.tokens_per_s
              for c in candidates if c.tokens_per_s > 0}
    best = min(finish, key=lambda name: finish[name])
    top = max(candidates, key=lambda c: c.tokens_per_s)
    fastest = top.name
    why = "also the fastest" if best == fastest else (
        f"{fastest} is faster but finishes at {finish[fastest]:.1f} s with its migration")
    moved = {c.name: c.moved_bytes for c in candidates if c.name in finish and c.moved_bytes is not None}
    near = [n for n in moved if _of(candidates, n).tokens_per_s >= (1 - tolerance) * top.tokens_per_s or n == best]
    fewest = min(near, key=lambda n: (moved[n], finish[n]), default=None) if tolerance > 0 else None
    if fewest is not None and best in moved and moved[fewest] < moved[best]:
        slower = 1 - _of(candidates, fewest).tokens_per_s / top.tokens_per_s
        fewer = f"{moved[best] / moved[fewest]:.1f}x fewer bytes moved" if moved[fewest] else "no byte moved"
        traded = (f"{fewest}: {slower:.1%} slower than {fastest}, {fewer} ({moved[fewest] / 2**20:,.1f} MiB against "
                  f"{moved[best] / 2**20:,.1f} for {best}; within the {tolerance:.0%} tolerance, "
                  "runtime.replan_tolerance)")
        return ScaleDecision(fewest, True, traded, finish, _plan_of(candidates, fewest))
    return ScaleDecision(best, True, f"{best}: finishes in {finish[best]:.1f} s, migration included ({why})", finish,
                         _plan_of(candidates, best))


def _of(candidates: list[Candidate], name: str) -> Candidate:
    return next(c for c in candidates if c.name == name)


def _plan_of(candidates: list[Candidate], name: str) -> Plan | None:
    return next(c.plan for c in candidates if c.name == name)


def joined_nodes(known: set[str] | None, cluster: ClusterSpec) -> tuple[set[str], str]:
    """(the node set to remember, the joined nodes' names or ""): the first call only records."""
    names = {n.name for n in cluster.nodes}
    if known is None:
        return names, ""
    return names, ", ".join(sorted(names - known))


def node_kind(node: NodeSpec) -> str:
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
        # Bytes each (new node, old node) pair keeps in place, for the pairs sharing a layer only: the pairs of
        # every node with every other of its kind grew with the square of the fleet (the rest keep nothing).
        holders: dict[int, list[str]] = {}
        for b in had:
            for x in held[b]:
                holders.setdefault(x, []).append(b)
        kept_by: dict[tuple[str, str], float] = {}
        for a in mine:
            for x in wants[a]:
                for b in holders.get(x, ()):
                    kept_by[a, b] = kept_by.get((a, b), 0) + weight[x]
        pairs = sorted(((kept, a, b) for (a, b), kept in kept_by.items()), reverse=True)
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


def _candidates(plans: list[Plan], old: Plan | None, model: ModelSpec, train: TrainSpec,
                startup_s: float, bw: dict[str, float]) -> list[Candidate]:
    return [Candidate(f"candidate {i + 1}", p.estimate.tokens_per_s if p.estimate else 0.0,
                      slowest_pull(old, p, model, train, bw), startup_s, pull_held_s(old, p, model, train, bw), p,
                      migration_bytes(old, p, model, train)["peer"])
            for i, p in enumerate(plans)]


def _numbers(d: ScaleDecision, cands: list[Candidate], steps_left: int) -> dict:
    return {"predicted_tokens_per_s": {c.name: round(c.tokens_per_s) for c in cands},
            "migration_mib": {c.name: round(sum(c.migration_bytes.values()) / 2**20, 2) for c in cands},
            "moved_mib": {c.name: round(c.moved_bytes / 2**20, 2) for c in cands if c.moved_bytes is not None},
            "finish_s": {k: round(v, 2) for k, v in d.finish_s.items()}, "steps_left": steps_left}


def choose_replan(planner: Planner, model: ModelSpec, train: TrainSpec, old: Plan | None, cluster: ClusterSpec,
                  steps_left: int, startup_s: float, tolerance: float = TOLERANCE) -> tuple[Plan, dict]:
    """The re-plan after a loss or a drain: (plan, the numbers for the event). Raises PlanningError.
    `tolerance`: how much slower than the fastest candidate a plan that moves fewer bytes may be
    (`replan_policy`; runtime.replan_tolerance)."""
    plans = [relabel(p, old, cluster, model, train) for p in planner.candidates(cluster, k=TOP_K)]
    if old is None or len(plans) == 1:
        return plans[0], {}
    bw = bandwidths(cluster)
    cands = _candidates(plans, old, model, train, startup_s, bw)
    d = replan_policy(cands, steps_left * tokens_per_step(model, train.global_batch), bw, tolerance)
    log.info("re-plan: %s", d.reason)
    if d.plan is None:  # every candidate carries its plan
        raise RuntimeError(f"the re-plan chose {d.chosen}, which carries no plan")
    return d.plan, {"choice": d.reason, "tolerance": tolerance} | _numbers(d, cands, steps_left)


def consider_joined(planner: Planner, model: ModelSpec, train: TrainSpec, running: Plan, cluster: ClusterSpec,
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
    chosen = d.plan if d.move and d.plan is not None else running
    extra = {"calibration": round(scale, 6)} if scale != 1.0 else {}
    return chosen, d, _numbers(d, [stay, *cands], steps_left) | extra
