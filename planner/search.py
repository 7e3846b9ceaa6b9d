"""`plan(cluster, model, train) -> Plan`: hierarchical asymmetric 3D search.

Levels, in the spirit of HexiScale (hierarchical asymmetric partitioning) and
AutoHet (asymmetric 3D parallelism on spot GPUs):
  1. TP degree: a layer must have the same degree in every replica (AutoHet §3),
     any degree that divides the model's heads and ffn (3 and 6 too). Groups are
     GPUs of one type on one node. Each degree is searched on its own; on
     clusters of at most `MIXED_GPUS` GPUs `mixed_sets` also tries stages of
     different degrees (one pipeline, or equal replicas under one per-layer
     TP profile).
  2. Pipelines: which TP groups chain into which replica. Small clusters (at most
     `EXHAUSTIVE_GROUPS` groups) try every multiset of pipelines by GPU kind;
     large ones start from homogeneous pipelines per type at their minimum depth,
     pool the leftovers into mixed pipelines, and improve the depths by
     coordinate descent.
  3. Per pipeline: the layer split by DP with per-stage offload policy
     (planner/layer_split.py), and the micro-batch size.
  4. Samples per replica: min-max allocation of the global batch.
Candidates are ranked by the search's own surrogate, and the best few are
scored by `evaluate` (exact gradient-sync groups); the best estimate wins. On
small clusters (exact mode) the surrogate is the closed form itself: each
layer's sync bandwidth follows from which nodes hold it in every replica, so
the search also deals groups out node by node, tries every order of the nodes
across replicas, and refines the finalists' stage orders together. The
search is deterministic: every loop runs over sorted inputs.

The pieces: TP groups (planner/groups.py), candidate pipeline sets (planner/candidates.py, and
planner/mixed_tp.py for stages of different degrees), stage orders (planner/orders.py), what a set costs
(planner/scoring.py, over the layer DP of planner/layer_split.py), the plan a set makes (planner/assembly.py);
this module runs them for each TP degree and settles the finalists.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterable, Iterator

from planner import cost
from planner.assembly import build_plan, kept_pipelines
from planner.candidates import (
    DEGREE_SLACK,
    EXHAUSTIVE_GROUPS,
    FINALISTS,
    MAX_EXHAUSTIVE_SETS,
    count_sets,
    depth_sets,
    exhaustive_sets,
)
from planner.contract import PlanContractError
from planner.errors import PlanningError
from planner.estimate import evaluate
from planner.groups import (
    HOST_SPLITS,
    Group,
    Profile,
    PSet,
    by_kind_and_node,
    host_never_binds,
    make_groups,
    stage_order,
    tp_candidates,
)
from planner.layer_split import edge_stages_may_win
from planner.mixed_tp import MIXED_GPUS, MIXED_ORDERS, mixed_sets
from planner.offload_policy import share_node_host
from planner.orders import MAX_ORDERS, distinct_orders, node_aligned, node_orders, shape_key
from planner.plan_types import Plan, UnusedDevice
from planner.scoring import SetCost
from planner.specs import ClusterSpec, ModelSpec, NodeSpec, TrainSpec

# A candidate for `evaluate`: (surrogate step time, TP degree (inf: mixed degrees), order found, pipelines, exact
# mode, unused devices, the degree's groups, every layer's TP degree where mixed)
Finalist = tuple[float, float, int, PSet, bool, list[UnusedDevice], list[Group], Profile | None]

EXACT_BATCH = 32
EXACT_LAYERS = 6
POOLED_GPUS = 64  # up to here a plan that needs recompute or offload is also searched with pooled host RAM


def refine_orders(search: SetCost, pset: list[list[Group]], t: float, rounds: int = 3) -> tuple[list, float]:
    """Coordinate descent over each pipeline's stage order, the others held, scored together: where a
    stage sits decides which nodes share each layer's gradient sync, so the best order of one replica
    depends on the others' (small clusters only: every order that differs in a position's kind or node)."""
    for _ in range(rounds):
        improved = False
        for r in range(len(pset)):
            for order in distinct_orders(stage_order(pset[r]), MAX_ORDERS, by_kind_and_node):
                cand = pset[:r] + [order] + pset[r + 1:]
                s, _, _ = search.score(cand, True)
                if s < t * (1 - 1e-12):
                    pset, t, improved = cand, s, True
        if not improved:
            break
    return pset, t


def _exact_scored(search: SetCost, sets: Iterable[PSet]) -> list[tuple[float, int, PSet]]:
    """Exact mode: every variant's lower bound first (`floor` at its fastest sync group's bandwidth, mostly
    cached), then the variants in order of it; each is scored only if its own bound (every group at its own
    ceiling) is below the best FINALISTS scores so far, and the loop stops when the first bound reaches them:
    the same finalists, most variants unscored. Returns (score, order found, set)."""
    bounded: list[tuple[float, int, PSet, tuple[float, ...]]] = []
    for pset in sets:
        pset = [search.best_order(p, len(pset), True) for p in pset]
        for v in {shape_key(v): v for v in (pset, node_aligned(pset), *node_orders(pset))}.values():
            ceiling = search.bw_ceiling(v)
            bounded.append((search.floor(v, bw=max(ceiling)), len(bounded), v, ceiling))
    bounded.sort(key=lambda x: (x[0], x[1]))
    scored: list[tuple[float, int, PSet]] = []
    kept: list[float] = []  # the best FINALISTS scores so far, ascending
    for lb, i, v, ceiling in bounded:
        if lb == math.inf or (len(kept) == FINALISTS and lb >= kept[-1]):
            break
        if len(kept) == FINALISTS and search.floor(v, bw=ceiling) >= kept[-1]:
            continue
        s, _, _ = search.score(v, True)
        if s < math.inf:
            scored.append((s, i, v))
            kept = sorted(kept + [s])[:FINALISTS]
    return scored


def _plain_scored(search: SetCost, sets: Iterable[PSet], exhaustive: bool) -> list[tuple[float, int, PSet]]:
    """Every set scored by the surrogate (outside exact mode), the feasible ones with their order found."""
    scored: list[tuple[float, int, PSet]] = []
    for pset in sets:
        if exhaustive:  # a few stages: their order decides what fits (memory, host RAM) too
            pset = [search.best_order(p, len(pset), False) for p in pset]
        s, _, _ = search.score(pset, False)
        if s < math.inf:
            scored.append((s, len(scored), pset))
    return scored


class Planner:
    """Plans one job's model and training spec, keeping cost caches between calls.

    Re-planning after a preemption reuses every pipeline and stage already
    costed, so it is much faster than the first plan. On large clusters it also
    starts each TP degree's search where the last one settled, and skips the
    degrees whose best plan was more than DEGREE_SLACK times slower than
    the best when the cluster has no GPU type the last one lacked.
    """

    def __init__(self, model: ModelSpec, train: TrainSpec):
        self.model, self.train = model, train
        self._pm_cache: dict = {}
        self._stage_cache: dict = {}
        self._warm: dict[int, dict] = {}  # per TP degree, where the large-cluster search settled last time
        self._last: tuple[frozenset, dict[int, float]] | None = None  # GPU types and best score per degree
        self._last_plan: Plan | None = None  # the last throughput plan: a re-plan may keep its intact pipelines
        self._host = "even"  # how the search budgets each node's host RAM among its groups (make_groups)
        # A refusal for host memory searches for the least RAM that plans (`_least_host`, a few searches more):
        # for a person reading it (`hetspot plan` sets it), not for a re-plan, a fleet search or a sweep.
        self.explain = False
        self.thorough = False  # large clusters: descend from every start (bench/planner.py's longer search)
        self._subplans: dict[str, Plan | None] = {}  # small clusters one node smaller: their best plans
        self._heuristic = False  # the last search took the heuristic one at some TP degree
        self._below = False  # a planner of a cluster one node smaller (`_without_one_node`)

    def sharing_caches(self) -> Planner:
        """A planner for the same job with these cost caches but no memory of earlier plans (no warm start,
        no TP degree skipped): a full search that costs less."""
        other = Planner(self.model, self.train)
        other._pm_cache, other._stage_cache, other._subplans = self._pm_cache, self._stage_cache, self._subplans
        return other

    def plan(self, cluster: ClusterSpec, objective: str = "throughput") -> Plan:
        return self.candidates(cluster, objective, 1)[0]

    def candidates(self, cluster: ClusterSpec, objective: str = "throughput", k: int = FINALISTS,
                   _kinds: bool = True) -> list[Plan]:
        """The best `k` distinct plans the search scored exactly (`evaluate`), best first.

        The controller weighs these on a re-plan by throughput minus the cost of
        moving the job's state onto each (orchestrator/control/replan.py).

        Host memory is a node total, shared by the node's stages. The search costs each stage against its
        GPUs' even share of it; where that finds no plan, or (on up to POOLED_GPUS GPUs) where the best plan
        needs recompute or offload, it searches again with each stage allowed its whole node's RAM, and
        `share_node_host` re-chooses jointly the policies of stages that then overflow a node together.
        """
        with collector_paused():
            return self._ranked(cluster, objective, k, _kinds)

    def _ranked(self, cluster: ClusterSpec, objective: str, k: int, _kinds: bool) -> list[Plan]:
        if objective not in ("throughput", "cost"):
            raise ValueError(f"objective {objective!r} must be 'throughput' or 'cost'")
        if not cluster.nodes:
            raise PlanningError("no GPU node is left in the cluster")
        if objective == "cost" and any(n.price_per_hour is None for n in cluster.nodes):
            missing = [n.name for n in cluster.nodes if n.price_per_hour is None]
            raise PlanningError(f"objective 'cost' needs price_per_hour on every node; missing on {', '.join(missing)}")
        self._heuristic = False
        try:
            found = self._candidates(cluster, objective, k, _kinds)
        except PlanningError:
            found = []
        tight = not found or (cluster.num_gpus <= POOLED_GPUS and any(
            st.offload.offload_optimizer or st.offload.offload_params or st.offload.recompute_layers
            for pipe in found[0].pipelines for st in pipe.stages))
        if _kinds and tight and any(n.num_gpus > 1 for n in cluster.nodes) and \
                not host_never_binds(cluster, self.model, self.train):
            for host in HOST_SPLITS[1:]:
                other = self.sharing_caches()
                other._host = host
                try:
                    more = other._candidates(cluster, objective, k, _kinds)
                except PlanningError:
                    continue
                found += [p for p in more if all(q.pipelines != p.pipelines for q in found)]
        if objective == "throughput" and _kinds and self._heuristic:
            found += [p for p in self._without_one_node(cluster) if all(q.pipelines != p.pipelines for q in found)]
        if objective == "throughput" and _kinds and self._last_plan is not None:
            kept = kept_pipelines(self._last_plan, cluster, self.model, self.train)
            if kept is not None and all(q.pipelines != kept.pipelines for q in found):
                found.append(kept)
        if not found:
            least = self._least_host(cluster, objective) if _kinds and self.explain else None
            raise PlanningError(_no_fit_message(cluster, self.model, self.train, least))
        key = (lambda p: (p.estimate.cost_per_mtok, p.estimate.step_time_s)) if objective == "cost" else \
            (lambda p: p.estimate.step_time_s)
        ranked = sorted(found, key=key)[:k]
        if objective == "throughput" and _kinds:
            self._last_plan = ranked[0]
        return ranked

    def _without_one_node(self, cluster: ClusterSpec) -> list[Plan]:
        """On a small cluster searched heuristically at some TP degree, the best plan of each cluster one node
        smaller (one node of each kind left out), its node idle: what the search finds on the smaller cluster
        stays a candidate on this one, so a node added never gives a plan slower than the search found without
        it (each smaller cluster planned once, `_subplans`, and one level deep: their own smaller ones are not
        searched; an exhaustive search tries every subset of the groups already). Without it a node that takes
        the cluster past the exhaustive search's size hands it to the heuristic one, which can find a plan 1.5x
        slower than the one it had (a 7B on A100 + L4 + T4 + A10G nodes, a T4 node added)."""
        if self._below or not 1 < len(cluster.nodes) <= MONOTONE_NODES or cluster.num_gpus > MONOTONE_GPUS:
            return []
        out = []
        kinds: dict[str, str] = {}
        for n in cluster.nodes:  # interchangeable nodes: leaving out either gives the same plan, renamed
            kinds[n.model_dump_json(exclude={"name"})] = n.name
        for name in kinds.values():
            sub = cluster.without_nodes({name})
            key = sub.model_dump_json()
            if key not in self._subplans:
                other = self.sharing_caches()
                other._below = True  # one level: the smaller cluster's own smaller ones are not searched
                try:
                    self._subplans[key] = other._ranked(sub, "throughput", 1, True)[0]
                except PlanningError:
                    self._subplans[key] = None
            got = self._subplans[key]
            if got is None:
                continue
            p = got.model_copy(deep=True)
            why = "left out: the plan without this node is faster than any the search found with it"
            p.unused = sorted(p.unused + [UnusedDevice(device=d, reason=why) for d in cluster.node(name).device_ids()],
                              key=lambda u: u.device)
            p.estimate = evaluate(p, cluster, self.model, self.train)
            out.append(p)
        return out

    def _least_host(self, cluster: ClusterSpec, objective: str) -> float | None:
        """Where host memory is what a node lacks (the node `_host_short` names), the least RAM on that node with
        which this search finds a plan, to 2% (a bisection of whole searches, on clusters of at most
        LEAST_HOST_GPUS GPUs); None where more RAM there would not make a plan either."""
        short = _host_short(cluster, self.model, self.train)
        if short is None or cluster.num_gpus > LEAST_HOST_GPUS:
            return None
        node, need = short

        def plans(gib: float) -> bool:
            more = cluster.model_copy(update={"nodes": [
                n.model_copy(update={"host_mem_gib": gib}) if n.name == node.name else n for n in cluster.nodes]})
            other = self.sharing_caches()  # explain stays off: no bisection inside the bisection
            try:
                other._ranked(more, objective, 1, True)
            except PlanningError:
                return False
            return True

        lo, hi = node.host_mem, max(need, node.host_mem) * 1.05
        if not plans(hi):
            return None
        while hi - lo > max(1.0, 0.02 * hi):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if plans(mid) else (mid, hi)
        return hi

    def _candidates(self, cluster: ClusterSpec, objective: str, k: int, _kinds: bool) -> list[Plan]:
        model, train = self.model, self.train
        if objective == "cost" and _kinds:
            return self._cheapest_kinds(cluster, k)
        search = SetCost(cluster, model, train, self._pm_cache, self._stage_cache)
        finalists: list[Finalist] = []
        degrees = tp_candidates(cluster, model)
        types = frozenset(n.gpu_type for n in cluster.nodes)
        # A re-plan after a loss (no GPU type the last plan lacked) skips the TP degrees whose best plan was
        # more than DEGREE_SLACK times slower than the best last time: losing nodes does not make TP1
        # for a 175B model 7x faster, and each degree is seconds of search on thousands of GPUs.
        last = self._last if objective == "throughput" and self._last is not None and types <= self._last[0] else None
        best_by_degree: dict[int, float] = {}
        for tp in sorted(degrees, reverse=True):  # high degrees first: on a large model the fast ones
            got, exhaustive = self._degree_finalists(search, tp, last, finalists)
            finalists += got
            if got and not exhaustive:  # a degree searched heuristically: what a re-plan weighs it by
                best_by_degree[tp] = got[0][0]
        if objective == "throughput" and _kinds:
            self._last = (types, best_by_degree) if best_by_degree else None
        if (len(degrees) > 1 and cluster.num_gpus <= MIXED_GPUS and train.global_batch <= EXACT_BATCH
                and model.num_layers <= EXACT_LAYERS):
            finalists += self._mixed_finalists(search, degrees, min((f[0] for f in finalists), default=math.inf))
        # The surrogate ranks candidates across TP degrees; `evaluate` settles the best few.
        finalists.sort(key=lambda f: f[:3])
        return self._settle(search, finalists, objective, k)

    def _degree_finalists(self, search: SetCost, tp: int, last: tuple[frozenset, dict[int, float]] | None,
                          finalists: list[Finalist]) -> tuple[list[Finalist], bool]:
        """One TP degree's best FINALISTS pipeline sets (by the surrogate), as finalists (none where the degree
        makes no group, or a re-plan skips it), and whether its search was exhaustive. `finalists`: the other
        degrees' so far (they bound a descent)."""
        model, train = self.model, self.train
        groups, unused = make_groups(search.cluster, train, tp, self._host)
        if not groups:
            return [], True
        most_stages = model.num_layers + 2 * edge_stages_may_win(model)  # embedding- and head-only stages
        exhaustive = len(groups) <= EXHAUSTIVE_GROUPS and count_sets(groups, most_stages) <= MAX_EXHAUSTIVE_SETS
        self._heuristic |= not exhaustive
        if (not exhaustive and last is not None and tp in last[1]
                and last[1][tp] > DEGREE_SLACK * min(last[1].values())):
            return [], exhaustive
        # Exact mode tries every micro-batch size and allocates samples by DP; it is for small batches.
        exact = exhaustive and train.global_batch <= EXACT_BATCH and model.num_layers <= EXACT_LAYERS
        sets = (exhaustive_sets(groups, most_stages) if exhaustive
                else depth_sets(search, groups, self._warm.setdefault(tp, {}),
                                DEGREE_SLACK * min((f[0] for f in finalists), default=math.inf), self.thorough))
        scored = _exact_scored(search, sets) if exact else _plain_scored(search, sets, exhaustive)
        scored.sort(key=lambda x: (x[0], x[1]))
        top = scored[:FINALISTS]
        if exact:  # the stage orders of the replicas decide together which nodes sync each layer
            refined = sorted([(*refine_orders(search, pset, s), i) for s, i, pset in top], key=lambda x: (x[1], x[2]))
            top = [(s, i, pset) for pset, s, i in refined]
        return [(s, tp, i, pset, exact, unused, groups, None) for s, i, pset in top], exhaustive

    def _mixed_finalists(self, search: SetCost, degrees: list[int], bound: float) -> list[Finalist]:
        """Plans whose stages take different TP degrees (small clusters), as finalists."""
        cluster = search.cluster
        singles = [Group(n.name, (d,), cost.make_slot(cluster, self.train, n.name, 1))
                   for n in cluster.nodes for d in n.device_ids()]
        mixed = sorted(mixed_sets(search, degrees, bound, self._host), key=lambda x: x[0])
        mixed = mixed[:FINALISTS if self._host == "even" else FINALISTS * MIXED_ORDERS]
        # On a tie the plan of one TP degree wins (its degree sorts before inf).
        return [(s, math.inf, i, pset, True, [], singles, prof) for i, (s, pset, prof) in enumerate(mixed)]

    def _settle(self, search: SetCost, finalists: list[Finalist], objective: str, k: int) -> list[Plan]:
        """The best `k` distinct plans among the finalists by `evaluate` (which checks each against the
        contract). Under an even host split every finalist is a plan; under a pooled one some overflow a node
        once settled together and are dropped, so the loop goes on down the list until enough plans are made."""
        cluster, model, train = search.cluster, self.model, self.train
        keep = max(k, FINALISTS)
        ranked: list[tuple[tuple, int, Plan]] = []
        tries = finalists[:keep] if self._host == "even" else finalists[:keep * (MIXED_ORDERS + 1)]
        for _, _, _, pset, exact, unused, groups, prof in tries:
            if len(ranked) >= keep:
                break
            built = build_plan(search, pset, exact, unused, prof)
            if built is None:
                continue
            plan_, used = built
            why = "left out: adding it as a replica or stage does not speed up the step"
            idle = [UnusedDevice(device=d, reason=why) for g in groups if not set(g.devices) & used for d in g.devices]
            plan_.unused = sorted(plan_.unused + idle, key=lambda u: u.device)
            if self._host != "even":  # its stages may overflow a node's RAM together: settle them or drop it
                if not share_node_host(plan_, cluster, model, train):
                    continue
                try:
                    plan_.estimate = evaluate(plan_, cluster, model, train)
                except PlanContractError:
                    continue
            else:
                plan_.estimate = evaluate(plan_, cluster, model, train)
            est = plan_.estimated
            key = (est.cost_per_mtok, est.step_time_s) if objective == "cost" else (est.step_time_s,)
            if all(p.pipelines != plan_.pipelines for _, _, p in ranked):
                ranked.append((key, len(ranked), plan_))
        if not ranked:
            raise PlanningError(_no_fit_message(cluster, model, train))
        return [p for _, _, p in sorted(ranked, key=lambda r: r[:2])[:k]]

    def _cheapest_kinds(self, cluster: ClusterSpec, k: int) -> list[Plan]:
        """$ per token: a kind of node (a GPU type on one market) may be dearer than it is worth, by its price
        or by its expected preemptions (`preemptions_per_hour`); the search also runs without each kind and
        the cheapest plans per token win. The left-out nodes are listed as unused, with the reason."""
        kinds = sorted({(n.gpu_type, n.market) for n in cluster.nodes})
        subsets = [cluster] + ([cluster.without_nodes({n.name for n in cluster.nodes if (n.gpu_type, n.market) == kd})
                                for kd in kinds] if len(kinds) > 1 else [])
        ranked: list[Plan] = []
        for sub in subsets:
            try:
                plans = self.candidates(sub, "cost", k, _kinds=False)
            except PlanningError:
                continue
            gone = [n for n in cluster.nodes if n not in sub.nodes]
            for p in plans:
                if gone:
                    why = (f"left out: cheaper per token without {gone[0].gpu_type} ({gone[0].market}) nodes, "
                           "by price and expected preemptions")
                    gone_devices = [UnusedDevice(device=d, reason=why) for n in gone for d in n.device_ids()]
                    p.unused = sorted(p.unused + gone_devices, key=lambda u: u.device)
                if all(q.pipelines != p.pipelines for q in ranked):
                    ranked.append(p)
        if not ranked:
            raise PlanningError(_no_fit_message(cluster, self.model, self.train))
        ranked.sort(key=lambda p: (p.estimated.cost_per_mtok, p.estimated.step_time_s))
        return ranked[:k]


class CollectionPause:
    """Python's cyclic garbage collector paused and resumed across calls: a search pauses it for its own length
    (`collector_paused`), the controller from a failure to the new group's restore (orchestrator/control/
    controller.py: at 4,096 GPUs the collections over its heap were 0.7 of a recovery's 1.6 s of CPU,
    bench/control_plane.py). Cycles made meanwhile wait for the next collection; reference counting frees the
    rest as usual. A collector someone else disabled is left disabled."""

    def __init__(self) -> None:
        self.paused = False  # this pause disabled the collector (and only then turns it back on)

    def pause(self) -> None:
        if not self.paused and gc.isenabled():
            gc.disable()
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            gc.enable()
            self.paused = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off for the duration of a search. The search allocates hundreds of thousands of short-lived
    objects beside its cost caches, so the collector runs its oldest generation mid-search and walks every cached
    object: at 16,384 GPUs a warm re-plan took 1.22 s of CPU with it and 0.85 s without (medians of 5,
    bench/planner.py's case). The search makes no reference cycles that must be freed before it ends."""
    pause = CollectionPause()
    pause.pause()
    try:
        yield
    finally:
        pause.resume()


def plan(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec, objective: str = "throughput") -> Plan:
    """The best plan the search finds for `objective` ("throughput" or "cost")."""
    return Planner(model, train).plan(cluster, objective)


MONOTONE_NODES, MONOTONE_GPUS = 6, 32  # up to here a plan is never slower than the best one node smaller
LEAST_HOST_GPUS = 16  # up to here a refusal for host memory names the least RAM the search plans with


def _host_short(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> tuple[NodeSpec, float] | None:
    """(node, GiB) of the node whose host memory falls shortest of its share of the model's state offloaded
    over every GPU, or None where every node holds its share."""
    per_param = cost.host_bytes(model, train, cost.StageShape(1, False, False), 1, cost.Knobs(0, True, True)) / \
        max(1.0, model.layer_params)
    short = []
    for n in cluster.nodes:
        need = model.num_params * per_param * n.num_gpus / cluster.num_gpus / cost.GIB
        if need > n.host_mem:
            short.append((need / n.host_mem, n.name, n, need))
    return max(short)[2:] if short else None


def _no_fit_message(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec, least: float | None = None) -> str:
    """Why no plan: the node whose host memory falls shortest, with the least RAM a search planned with where
    one was run (`least`), or else its share of the whole state offloaded; otherwise GPU memory."""
    mem = sum(cluster.node(n.name).num_gpus * (cost.make_slot(cluster, train, n.name, 1).mem_cap_bytes / cost.GIB)
              for n in cluster.nodes)
    short = _host_short(cluster, model, train)
    if short:
        n, need = short
        given = ("as given" if n.host_mem_gib is not None
                 else f"the {n.gpu_type} default of {n.host_mem / n.num_gpus:.0f} GiB per GPU")
        wants = (f"needs at least about {least:,.0f} GiB of host memory (the least with which the search finds a plan)"
                 if least is not None else f"would need about {need:,.0f} GiB of host memory for its share")
        return (f"model {model.name!r} ({model.num_params / 1e9:.2f}B params) does not fit: the GPUs cannot hold it "
                f"even with recompute, and offloading its state needs host memory: node {n.name!r} {wants} and "
                f"has {n.host_mem:,.0f} GiB (host_mem_gib, {given}). "
                "Fix: set host_mem_gib on the node if it has more RAM, add GPUs or nodes, or use a smaller model.")
    return (
        f"model {model.name!r} ({model.num_params / 1e9:.2f}B params, seq_len {model.seq_len}) does not fit on "
        f"this cluster ({cluster.num_gpus} GPUs, {mem:.0f} GiB usable after a {train.memory_reserve_gib} GiB "
        "reserve each) even with recompute and parameter/optimizer offload. Fix: add GPUs with more memory, "
        "use a smaller model or seq_len, or lower train.memory_reserve_gib."
    )
