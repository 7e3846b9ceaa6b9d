"""`plan(cluster, model, train) -> Plan`: hierarchical asymmetric 3D search.

Levels, in the spirit of HexiScale (hierarchical asymmetric partitioning) and
AutoHet (asymmetric 3D parallelism on spot GPUs):
  1. TP degree: a layer must have the same degree in every replica (AutoHet §3),
     any degree that divides the model's heads and ffn (3 and 6 too). Groups are
     GPUs of one type on one node. Each degree is searched on its own; on
     clusters of at most `MIXED_GPUS` GPUs `_mixed_sets` also tries stages of
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
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
from dataclasses import dataclass, replace

from planner import cost
from planner.contract import PlanContractError, tp_problem
from planner.errors import PlanningError
from planner.estimate import evaluate
from planner.layer_split import PipelineModel, allocate_samples, edge_ranges, edge_stages_may_win
from planner.offload_policy import share_node_host, to_policy
from planner.plan_types import Pipeline, Plan, Stage, UnusedDevice
from planner.specs import ClusterSpec, ModelSpec, TrainSpec

EXHAUSTIVE_GROUPS = 8
_POOL = "<pool>"
EXACT_BATCH = 32
EXACT_LAYERS = 6
MAX_ORDERS = 24
MAX_EXHAUSTIVE_SETS = 3000
FINALISTS = 4
POOLED_GPUS = 64  # up to here a plan that needs recompute or offload is also searched with pooled host RAM


@dataclass(frozen=True)
class Group:
    node: str
    devices: tuple[str, ...]
    slot: cost.Slot

    @functools.cached_property
    def kind(self) -> cost.Slot:
        """Every hardware field but the node's name (host memory included): groups of one kind are
        interchangeable."""
        return cost.hardware(self.slot)

    @functools.cached_property
    def kind_id(self) -> int:
        return cost.hardware_id(self.slot)


SMALL_CLUSTER_GPUS = 16  # up to here every TP degree is tried; above, the ones that leave no GPU of a node idle


def tp_candidates(cluster: ClusterSpec, model: ModelSpec) -> list[int]:
    """Degrees that fit a node and divide the model (heads and ffn), powers of two or not: 48 heads on a
    node of 3 GPUs take TP3, and the runtime shards any such degree exactly. On a large cluster a degree
    that is not a power of two is tried only where it divides some node's GPU count (TP3 on 8-GPU nodes
    idles two of each eight, and every extra degree is a whole search more)."""
    most = max(n.num_gpus for n in cluster.nodes)
    small = cluster.num_gpus <= SMALL_CLUSTER_GPUS
    sizes = {n.num_gpus for n in cluster.nodes}
    return [t for t in range(1, most + 1) if tp_problem(model, t) is None
            and (small or t & (t - 1) == 0 or any(g % t == 0 for g in sizes))]


HOST_SPLITS = ("even", "pooled", "first")


def make_groups(cluster: ClusterSpec, train: TrainSpec, tp: int,
                host: str = "even") -> tuple[list[Group], list[UnusedDevice]]:
    """The node's GPUs in TP groups of `tp`. `host`: how the search budgets the node's host RAM (a node
    total) among its groups: "even" gives each GPU its share (every plan fits); "pooled" lets each group
    use all of it (`share_node_host` then settles stages that overflow together); "first" gives all of it
    to the node's first group and none to the others (one stage per node offloads, as much as it needs)."""
    groups, unused = [], []
    for node in cluster.nodes:
        ids = node.device_ids()
        slot = cost.make_slot(cluster, train, node.name, tp)
        full = len(ids) // tp * tp
        for k in range(0, full, tp):
            groups.append(Group(node.name, tuple(ids[k:k + tp]), _host_slot(slot, node, k, host)))
        why = f"node has {node.num_gpus} GPUs; TP degree {tp} leaves it without a group"
        unused += [UnusedDevice(device=d, reason=why) for d in ids[full:]]
    return groups, unused


def _host_never_binds(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> bool:
    """Whether every group's even share of its node's host RAM holds the offloaded state of a stage of the whole
    model (every layer, the embedding and the head), at every TP degree the search tries. Then host memory
    never excludes a policy (offload_policy.fitting_policies is the only place it binds), so the other host
    splits, which only give some groups more and others less, cannot find a better plan: the search skips them."""
    whole = cost.StageShape(model.num_layers, True, True)
    for tp in tp_candidates(cluster, model):
        need = cost.host_bytes(model, train, whole, tp, cost.Knobs(0, True, False))
        groups, _ = make_groups(cluster, train, tp)
        if any(need > g.slot.host_cap_bytes for g in groups):
            return False
    return True


def _host_slot(slot: cost.Slot, node, first_gpu: int, host: str) -> cost.Slot:
    """A group's slot under a host split (HOST_SPLITS): `first_gpu` is where the group starts on its node."""
    if host == "even" or node.num_gpus <= slot.tp:
        return slot
    whole = node.host_mem * cost.GIB / slot.tp
    return replace(slot, host_cap_bytes=whole if host == "pooled" or first_gpu == 0 else 0.0)


def _stage_order(groups: list[Group]) -> list[Group]:
    # The first stage holds the most in-flight activations: give it the most memory.
    return sorted(groups, key=lambda g: (-g.slot.mem_cap_bytes, -g.slot.flops_per_gpu, g.node, g.devices))


class _Search:
    def __init__(self, cluster: ClusterSpec, model: ModelSpec, train: TrainSpec,
                 pm_cache: dict | None = None, stage_cache: dict | None = None):
        self.cluster, self.model, self.train = cluster, model, train
        self._pm_cache: dict[tuple, PipelineModel] = {} if pm_cache is None else pm_cache
        self._stage_cache: dict = {} if stage_cache is None else stage_cache
        self._order_cache: dict[tuple, list[int]] = {}
        self._ceilings: dict[tuple, tuple[float, ...]] = {}
        self._pm_keys: dict[tuple, tuple] = {}
        self._pm_keys_hold: list[list[Group]] = []

    def pipeline_model(self, groups: list[Group], exact: bool, profile: tuple[int, ...] | None = None) -> PipelineModel:
        # The search's groups live as long as it does, so their identities key the cost key (a deep pipeline's
        # key takes a pass over its stages; a re-plan at 16k GPUs asks ten thousand times).
        ids = (tuple(map(id, groups)), exact, profile)
        key = self._pm_keys.get(ids)
        if key is None:
            key = self._pm_keys[ids] = (
                tuple(g.kind_id for g in groups),
                tuple(groups[i].node == groups[i + 1].node for i in range(len(groups) - 1)),
                exact,
                profile,
            )
            self._pm_keys_hold.append(groups)  # the ids stay valid while the key is cached
        if key not in self._pm_cache:
            self._pm_cache[key] = PipelineModel(
                [g.slot for g in groups], self.model, self.train, exact, stage_cache=self._stage_cache,
                profile=profile,
            )
        return self._pm_cache[key]

    def best_order(self, groups: list[Group], num_pipelines: int, exact: bool) -> list[Group]:
        """The stage order that finishes an equal share fastest, over up to MAX_ORDERS distinct orders."""
        if len(groups) == 1:
            return groups
        groups = _stage_order(groups)
        # Groups of one kind on one node are interchangeable: the answer, as positions, holds for any such.
        key = (tuple((g.kind_id, g.node) for g in groups), num_pipelines, exact)
        if key not in self._order_cache:
            n = max(1, self.train.global_batch // num_pipelines)
            bw = self.sync_bw([groups])
            best, best_t = list(range(len(groups))), math.inf
            for cand in _distinct_orders(list(range(len(groups))), MAX_ORDERS, lambda i: groups[i].kind_id):
                f = self.pipeline_model([groups[i] for i in cand], exact).finish(n, num_pipelines, bw)
                if f is not None and f.time_s < best_t * (1 - 1e-12):
                    best, best_t = cand, f.time_s
            self._order_cache[key] = best
        return [groups[i] for i in self._order_cache[key]]

    def sync_bw(self, pset: list[list[Group]]) -> float:
        """One bandwidth for every gradient-sync group: that of a group over all the set's nodes."""
        return cost.sync_group_bw(self.cluster, {g.node for p in pset for g in p})

    def link_vector(self, pset: list[list[Group]], finishes: list) -> tuple[float, ...]:
        """Bandwidth of each gradient-sync group of the plan these splits make, as `evaluate` charges it:
        (embedding, layer 0, ..., layer L-1, LM head); one node's group syncs over its intra-node link, a
        group across nodes at the slowest of their NICs."""
        held = [_group_nodes(groups, f) for groups, f in zip(pset, finishes, strict=True)]
        return tuple(cost.sync_group_bw(self.cluster, {h[x] for h in held}) for x in range(self.model.num_layers + 2))

    def score(self, pset: list[list[Group]], exact: bool,
              profile: tuple[int, ...] | None = None) -> tuple[float, list[int] | None, float | tuple]:
        """Surrogate step time of a pipeline set (inf if infeasible), its samples per pipeline and the sync
        bandwidth it was costed with.

        Outside exact mode every layer syncs at the plan's slowest link. In exact mode (small clusters) the
        splits decide which nodes sync each layer, so the search iterates: split at the slowest link, take
        each group's bandwidth from those splits (`link_vector`), split again with those, until the
        bandwidths the splits imply are the ones they were costed with (the closed form of `evaluate`). A
        round that does not meet that is ranked at its plan's true time (`PipelineModel.time_at` at the
        bandwidths it implies), never at the hoped-for one.
        `profile`: every layer's TP degree, for replicas whose stages take different degrees."""
        if not pset or len(pset) > self.train.global_batch:
            return math.inf, None, 0.0
        pms = [self.pipeline_model(p, exact, profile) for p in pset]
        if not exact:
            bw = self.sync_bw(pset)
            alloc = allocate_samples(pms, self.train.global_batch, exact, bw)
            if alloc is None:
                return math.inf, None, 0.0
            return max(pm.finish(n, len(pset), bw).time_s for pm, n in zip(pms, alloc, strict=True)), alloc, bw
        # From the slowest link for every group, and from each group's fastest (`bw_ceiling`): replicas that
        # split alike at the slow links can settle where a layer's copies sit on different nodes, while at
        # the fast ones they may agree on one node for it (the optimum of the closed form is often there).
        slow = self.sync_bw(pset)
        found = [self._rounds(pset, pms, slow)]
        ceiling = self.bw_ceiling(pset)
        if len(pset) > 1 and any(x != slow for x in ceiling):
            found.append(self._rounds(pset, pms, ceiling))
        return min(found, key=lambda x: x[0])

    def _rounds(self, pset: list[list[Group]], pms: list[PipelineModel],
                bw: float | tuple) -> tuple[float, list[int] | None, float | tuple]:
        """`score`'s fixed-point rounds in exact mode from the bandwidths `bw`."""
        tried: list[tuple[float, list[int] | None, float | tuple]] = []
        prev = bw  # the previous round's bandwidths
        num_groups = self.model.num_layers + 2
        for rnd in range(5):
            if rnd == 4:
                # A last round at the slower of each group's last two links: replicas whose splits disagree
                # where they hoped for the faster link often agree at the slower one.
                was = prev if isinstance(prev, tuple) else (prev,) * num_groups
                now = bw if isinstance(bw, tuple) else (bw,) * num_groups
                bw = tuple(min(x, y) for x, y in zip(now, was, strict=True))
            alloc = allocate_samples(pms, self.train.global_batch, True, bw)
            if alloc is None:
                break
            fins = [pm.finish(n, len(pset), bw) for pm, n in zip(pms, alloc, strict=True)]
            t = max(f.time_s for f in fins)
            implied = self.link_vector(pset, fins)
            if implied == bw or all(x == bw for x in implied):
                return t, alloc, bw  # consistent: the surrogate is the closed form of this plan
            # Not consistent: the round's plan (these splits, built again from `bw`) is charged at the links
            # its splits imply, so a round that hoped for a faster link than it got does not rank above a plan
            # that keeps its promise.
            true_t = max(pm.time_at(f, n, len(pset), implied) for pm, f, n in zip(pms, fins, alloc, strict=True))
            tried.append((true_t, alloc, bw))
            bw, prev = implied, bw
        # Each round's splits may sit near a different agreement: a best-response pass from every one.
        tried += [self._best_response(pset, pms, alloc, bw) for _, alloc, bw in list(tried)]
        # No fixed point in a few rounds: the best round's plan stands, at its true time.
        return min(tried, key=lambda x: x[0], default=(math.inf, None, 0.0))

    def _best_response(self, pset: list[list[Group]], pms: list[PipelineModel], alloc: list[int],
                       bw: float | tuple) -> tuple[float, list[int], list]:
        """One pass over the replicas, each re-split at the links its own stage nodes would give every sync
        group with the other replicas' splits held (the fixed-point rounds cost a layer's sync as if a
        replica's own split did not move it, so a replica that is not the bottleneck can keep breaking the
        others' links). Returns (true time, samples, each replica's bandwidths) like a round of `score`."""
        num_layers, r_all = self.model.num_layers, len(pset)
        fins = [pm.finish(n, r_all, bw) for pm, n in zip(pms, alloc, strict=True)]
        if any(f is None for f in fins):
            return math.inf, alloc, bw
        link = functools.partial(cost.sync_group_bw, self.cluster)
        held = [_group_nodes(g, f) for g, f in zip(pset, fins, strict=True)]
        used: list[tuple] = []
        for r, (groups, pm, n) in enumerate(zip(pset, pms, alloc, strict=True)):
            others = [h for q, h in enumerate(held) if q != r]
            per_stage = tuple(tuple(link({g.node, *(h[x] for h in others)}) for x in range(num_layers + 2))
                              for g in groups)
            f = pm.finish(n, r_all, per_stage)
            if f is None:
                return math.inf, alloc, bw
            fins[r], held[r] = f, _group_nodes(groups, f)
            used.append(per_stage)
        implied = self.link_vector(pset, fins)
        t = max(pm.time_at(f, n, r_all, implied) for pm, f, n in zip(pms, fins, alloc, strict=True))
        return t, alloc, used

    def bw_ceiling(self, pset: list[list[Group]]) -> tuple[float, ...]:
        """The fastest each gradient-sync group of the set can be, however the layers are split (in
        `link_vector`'s order): stage i of a pipeline of p stages can only hold layers i..L-p+i, so layer j's
        copy in each replica sits on one of a few nodes. The group runs on one node's intra-node link only
        if some node is among every replica's candidates, and across nodes at most at the slowest of the
        replicas' best candidate NICs."""
        key = tuple(tuple(g.node for g in p) for p in pset)
        got = self._ceilings.get(key)
        if got is None:
            num_layers = self.model.num_layers
            intra, nic = self._links

            def best(candidates: list[set[str]]) -> float:
                one = [intra[n] for n in set.intersection(*candidates)]
                return max(one + [min(max(nic[n] for n in c) for c in candidates)])

            e = [int(len(p) >= 2 and edge_stages_may_win(self.model)) for p in key]  # edge stages may be empty
            layers = [best([set(p[max(0, j - (num_layers - len(p)) - x):j + 1 + x])
                            for p, x in zip(key, e, strict=True)]) for j in range(num_layers)]
            got = self._ceilings[key] = (best([{p[0]} for p in key]), *layers, best([{p[-1]} for p in key]))
        return got

    @functools.cached_property
    def _links(self) -> tuple[dict[str, float], dict[str, float]]:
        """Per node: its intra-node and its NIC bandwidth (bytes/s)."""
        return ({n.name: n.intra_bw_gb_s * 1e9 for n in self.cluster.nodes},
                {n.name: n.inter_node_bw_gb_s * 1e9 for n in self.cluster.nodes})

    def floor(self, pset: list[list[Group]], profile: tuple[int, ...] | None = None,
              bw: float | tuple[float, ...] | None = None) -> float:
        """A lower bound on the exact-mode step time of a pipeline set in these stage orders: every group
        synced at its `bw_ceiling` (sync only adds to a stage's exposed time, and no split gives it more).
        `bw`: a ceiling already computed, or one bandwidth at least as high (a looser bound that most sets
        share, so it is mostly cached)."""
        pms = [self.pipeline_model(p, True, profile) for p in pset]
        bw = self.bw_ceiling(pset) if bw is None else bw
        alloc = allocate_samples(pms, self.train.global_batch, True, bw)
        if alloc is None:
            return math.inf
        return max(pm.finish(n, len(pset), bw).time_s for pm, n in zip(pms, alloc, strict=True))

    def build(self, pset: list[list[Group]], exact: bool, unused: list[UnusedDevice],
              profile: tuple[int, ...] | None = None) -> Plan | None:
        t, alloc, bw = self.score(pset, exact, profile)
        if alloc is None:
            return None
        pipes = []
        for groups, n in zip(pset, alloc, strict=True):
            f = self.pipeline_model(groups, exact, profile).finish(n, len(pset),
                                                                   bw[len(pipes)] if isinstance(bw, list) else bw)
            stages, at = [], 0
            for g, ch in zip(groups, f.stages, strict=True):
                pol = to_policy(ch.policy, at)
                stages.append(Stage(layer_start=at, layer_end=at + ch.num_layers, gpu_type=g.slot.gpu_type,
                                    node=g.node, devices=list(g.devices), offload=pol))
                at += ch.num_layers
            pipes.append(Pipeline(num_samples=n, micro_batch_size=f.micro_batch_size,
                                  num_micro_batches=f.num_micro_batches, stages=stages))
        used = {d for p in pset for g in p for d in g.devices}
        plan = Plan(model_name=self.model.name, num_layers=self.model.num_layers,
                    global_batch=self.train.global_batch, pipelines=pipes, unused=list(unused))
        return plan, used


def _group_nodes(groups: list[Group], f) -> list[str]:
    """The node that holds this replica's copy of each gradient-sync group under the split `f` (in
    `link_vector`'s order: embedding, layer 0, ..., layer L-1, LM head)."""
    out = [groups[0].node]
    for g, ch in zip(groups, f.stages, strict=True):
        out += [g.node] * ch.num_layers
    return out + [groups[-1].node]


def _node_aligned(pset: list[list[Group]]) -> list[list[Group]]:
    """The same pipelines with the groups of each kind dealt out stage position by stage position, node by
    node: stages that hold the same layers in different replicas then share a node where the kinds allow,
    so their gradient sync stays on its intra-node link (the list order keeps each pipeline's stages on
    one node instead, which favours the point-to-point links)."""
    pools: dict[int, list[Group]] = {}
    for p in pset:
        for g in p:
            pools.setdefault(g.kind_id, []).append(g)
    for gs in pools.values():
        gs.sort(key=lambda g: (g.node, g.devices))
    out: list[list[Group | None]] = [[None] * len(p) for p in pset]
    for pos in range(max(len(p) for p in pset)):
        for r, p in enumerate(pset):
            if pos < len(p):
                out[r][pos] = pools[p[pos].kind_id].pop(0)
    return out  # type: ignore[return-value]


def _refine_orders(search: _Search, pset: list[list[Group]], t: float, rounds: int = 3) -> tuple[list, float]:
    """Coordinate descent over each pipeline's stage order, the others held, scored together: where a
    stage sits decides which nodes share each layer's gradient sync, so the best order of one replica
    depends on the others' (small clusters only: every order that differs in a position's kind or node)."""
    for _ in range(rounds):
        improved = False
        for r in range(len(pset)):
            for order in _distinct_orders(_stage_order(pset[r]), MAX_ORDERS, _by_kind_and_node):
                cand = pset[:r] + [order] + pset[r + 1:]
                s, _, _ = search.score(cand, True)
                if s < t * (1 - 1e-12):
                    pset, t, improved = cand, s, True
        if not improved:
            break
    return pset, t


def _shape_key(pset: list[list[Group]]) -> tuple:
    """What a pipeline set's cost depends on: each stage's kind and node (groups of one kind on one node are
    interchangeable)."""
    return tuple(tuple((g.kind_id, g.node) for g in p) for p in pset)


def _node_orders(pset: list[list[Group]], most_nodes: int = 4) -> list[list[list[Group]]]:
    """Every pipeline's stages in one order of nodes, for each order of the set's nodes (up to `most_nodes`
    of them): replicas that walk the nodes alike keep a layer's copies on one node where they can."""
    nodes = sorted({g.node for p in pset for g in p})
    if len(pset) < 2 or len(nodes) < 2 or len(nodes) > most_nodes:
        return []
    out = []
    for perm in itertools.permutations(nodes):
        rank = {n: i for i, n in enumerate(perm)}
        out.append([sorted(p, key=lambda g: (rank[g.node], g.devices)) for p in pset])
    return out


def _by_kind(g: Group) -> int:
    return g.kind_id


def _by_kind_and_node(g: Group) -> tuple[int, str]:
    return g.kind_id, g.node


def _distinct_orders(groups: list, limit: int, key=_by_kind):
    """Orders of `groups` that differ in some position's `key` (a group's kind by default), in the given
    order first, at most `limit`."""
    out: list[list] = []

    def rec(prefix: list[Group], rest: list[Group]):
        if len(out) >= limit:
            return
        if not rest:
            out.append(list(prefix))
            return
        tried = set()
        for i, g in enumerate(rest):
            k = key(g)
            if k in tried:
                continue
            tried.add(k)
            prefix.append(g)
            rec(prefix, rest[:i] + rest[i + 1:])
            prefix.pop()

    rec([], groups)
    return out


def _exhaustive_sets(groups: list[Group], max_stages: int):
    """Every multiset of pipelines, each a multiset of GPU kinds (groups of one kind are interchangeable)."""
    kinds = sorted({g.kind for g in groups}, key=str)
    pools = [[g for g in groups if g.kind == k] for k in kinds]  # by the kind's index (a Slot hashes slowly)
    counts = [len(pool) for pool in pools]
    vectors = [v for v in itertools.product(*[range(c + 1) for c in counts]) if 0 < sum(v) <= max_stages]
    vectors.sort(reverse=True)

    def rec(start: int, left: list[int], chosen: list[tuple[int, ...]]):
        if chosen:
            yield list(chosen)
        for idx in range(start, len(vectors)):
            v = vectors[idx]
            if all(a <= b for a, b in zip(v, left, strict=True)):
                chosen.append(v)
                yield from rec(idx, [b - a for a, b in zip(v, left, strict=True)], chosen)
                chosen.pop()

    for vs in rec(0, counts, []):
        taken = [0] * len(kinds)
        pset = []
        for v in vs:
            members = []
            for k, c in enumerate(v):
                members += pools[k][taken[k]:taken[k] + c]
                taken[k] += c
            pset.append(_stage_order(members))
        yield pset


def _count_sets(groups: list[Group], max_stages: int) -> int:
    count = 0
    for _ in _exhaustive_sets(groups, max_stages):
        count += 1
        if count > MAX_EXHAUSTIVE_SETS:
            break
    return count


def _heuristic_sets(search: _Search, groups: list[Group], warm: dict | None = None, bound: float = math.inf,
                    thorough: bool = False):
    """Homogeneous pipelines per type at chosen depths, leftovers pooled into mixed pipelines.

    `warm`: the depths this search settled on last time (a re-plan after a loss starts there, not from
    each type's best depth alone; it holds the new ones when the search is done). `bound`: a step time past
    which a second descent is not worth its time (another TP degree already does much better). `thorough`:
    descend from every start, not only the best of each kind (the planner bench's longer search)."""
    by_type: dict[str, list[Group]] = {}
    for g in sorted(groups, key=lambda g: (-g.slot.flops_per_gpu, g.slot.gpu_type, g.node, g.devices)):
        by_type.setdefault(g.slot.gpu_type, []).append(g)
    types = list(by_type)

    def fits(gs: list[Group], p: int) -> bool:
        return search.pipeline_model(gs[:p], False).finish(1) is not None

    p_min = {}
    for t in types:
        gs = by_type[t]
        hi = min(len(gs), search.model.num_layers)
        if not fits(gs, hi):
            p_min[t] = 0
            continue
        lo = 1  # binary search: more stages never need more memory per device
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(gs, mid) else (mid + 1, hi)
        p_min[t] = lo

    # depth[t] > 0: homogeneous pipelines of that many stages; 0: pool the type; -1: leave it idle.
    # The extra key POOL says whether pooled leftovers form mixed pipelines or stay idle.
    def assemble(depth: dict[str, int]) -> list[list[Group]]:
        pset, pool = [], []
        for t in types:
            gs, p = by_type[t], depth[t]
            if p < 0:
                continue
            if p == 0:
                pool += gs
                continue
            full = len(gs) // p * p
            pset += [gs[k:k + p] for k in range(0, full, p)]
            pool += gs[full:]
        if not depth[_POOL]:
            return pset
        return pset + pooled(tuple(_stage_order(pool)))

    pools: dict[tuple[int, ...], list[list[Group]]] = {}  # by the groups' identities (they outlive the search)

    def pooled(pool: tuple[Group, ...]) -> list[list[Group]]:
        """The leftovers' mixed pipelines, each closed as soon as it fits (the descent asks for the same leftovers
        under many depths of the other types: built once)."""
        ids = tuple(map(id, pool))
        got = pools.get(ids)
        if got is None:
            got, current = [], []
            for g in pool:
                current.append(g)
                if len(current) <= search.model.num_layers \
                        and search.pipeline_model(_stage_order(current), False).finish(1) is not None:
                    got.append(_stage_order(current))
                    current = []
            pools[ids] = got
        return [list(p) for p in got]

    def depths(t: str) -> list[int]:
        p, n = p_min[t], len(by_type[t])
        if not p:
            return []
        return sorted({q for q in (p, p + 1, 2 * p, 4 * p, 8 * p, 16 * p) if q <= min(n, search.model.num_layers)})

    def options(t: str) -> list[int]:
        return [0, 1] if t == _POOL else [-1, 0, *depths(t)]

    def alone(t: str, q: int) -> float:
        """Step time of the type's groups alone as equal pipelines of depth q (equal shares)."""
        gs = by_type[t]
        k = min(len(gs) // q, search.train.global_batch)
        pset = [gs[j * q:(j + 1) * q] for j in range(k)]
        f = search.pipeline_model(pset[0], False).finish(math.ceil(search.train.global_batch / k), k,
                                                         search.sync_bw(pset))
        return math.inf if f is None else f.time_s

    # Start each type at the depth that is fastest for it alone (HexiScale: intra-type first).
    keys = types + [_POOL]
    last = (warm or {}).get("depth", {})
    resumed = all(last.get(t) in options(t) for t in types)  # every type where the last search left it
    depth = {t: last[t] if last.get(t) in options(t) else min(depths(t), key=lambda q: alone(t, q), default=0)
             for t in types} | {_POOL: last.get(_POOL, 1)}
    seen: dict[tuple, float] = {}

    def val(d):
        key = tuple(d[t] for t in keys)
        if key not in seen:
            seen[key] = search.score(assemble(d), False)[0]
        return seen[key]

    # Coordinate descent moves one type at a time, so it cannot leave a mix whose slowest NICs pace every
    # replica's gradient sync by dropping two types at once (a 70B on H100 + A100 + L4 + A10G nodes, the L4 and
    # A10G on slow NICs: adding H100 pipelines to an L4 + A10G plan makes it slower, and the fast types alone
    # are 5x faster than either). So it also starts from the fastest types alone: the first j types by FLOP/s
    # at their depths, the others idle, for every j, their leftovers pooled or idle (one short pipeline that
    # must offload its optimizer paces every replica's step); where the best of these beats where the descent
    # from the usual start ended, the descent runs from it too, and the better end wins.
    def descend(depth: dict) -> dict:
        for _ in range(3):
            improved = False
            for t in keys:
                for q in options(t):
                    trial = dict(depth, **{t: q})
                    if val(trial) < val(depth) * (1 - 1e-9):
                        depth, improved = trial, True
            if not improved:
                break
        return depth

    others = [{t: (depth[t] if i < j else -1) for i, t in enumerate(types)} | {_POOL: pool}
              for j in range(1, len(types) + 1) for pool in (1, 0)]
    # Each type at its own best depth makes replicas of unequal lengths, and a descent that moves one type at a
    # time may not get out: the 175B on 1,024 GPUs of six types, 32 nodes lost, ended with both A100 types idle at
    # 69% of the throughput a re-plan warm from the whole cluster found (docs/benchmarks.md, re-plan at scale).
    # So a fresh search also starts from the types at one depth together (each at the least of its depths not
    # below it) and keeps the better end; a resumed search starts where the last one settled instead.
    qs = sorted({p_min[t] for t in types if p_min[t]})  # each type's least depth that fits
    uniform = [{t: next((o for o in depths(t) if o >= q), max(depths(t), default=0)) for t in types} | {_POOL: 1}
               for q in qs]
    ends = [descend(depth)]
    if thorough:
        ends += [descend(d) for d in others + uniform]
    elif not resumed:  # a resumed search had these starts last time
        other = min(others, key=val)
        if val(other) < min(val(ends[0]) * (1 - 1e-9), bound):
            ends.append(descend(other))
        # each descended where it starts ahead of every degree so far: the best start of them is not the best
        # end (1,024 GPUs of six types, the 175B: the start at 112 s a step ends at 56, one at 125 ends at 49)
        ends += [descend(d) for d in uniform if val(d) * DEGREE_SLACK < bound]
    depth = min(ends, key=val)
    if warm is not None:
        warm["depth"] = dict(depth)
    ranked = sorted(seen.items(), key=lambda kv: kv[1])
    for key, v in ranked[:FINALISTS]:
        if v < math.inf:
            yield assemble(dict(zip(keys, key, strict=True)))


DEGREE_SLACK = 1.25  # a TP degree this much slower than the best is not refined, nor searched in a re-plan

MIXED_GPUS = 8  # clusters up to here also try plans whose stages take different TP degrees
MAX_MIXED = 400  # pipeline templates scored per plan at most (in order of their compute bound)
MIXED_ORDERS = 6  # stage orders tried per replicated template


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def _profiles(order: list[Group], num_layers: int, edges: bool = False):
    """Every way to give the layers TP degrees that a pipeline in this stage order can hold: the degrees run
    in the order's sequence (adjacent equal degrees merged), each run at least as many layers as it has
    stages. `edges`: the first or the last stage may hold no layer (the embedding or the head alone), so the
    order without them gives profiles too."""
    seen = set()
    for lo, hi in edge_ranges(len(order), edges):
        inner = order[lo:hi]
        runs: list[list[int]] = []
        for g in inner:
            if runs and runs[-1][0] == g.slot.tp:
                runs[-1][1] += 1
            else:
                runs.append([g.slot.tp, 1])
        for comp in _compositions(num_layers, len(runs)):
            if all(n >= k for n, (_, k) in zip(comp, runs, strict=True)):
                prof = tuple(t for n, (t, _) in zip(comp, runs, strict=True) for _ in range(n))
                if prof not in seen:
                    seen.add(prof)
                    yield prof


def _mixed_sets(search: _Search, degrees: list[int], bound: float, host: str = "even"):
    """Plans whose stages take different TP degrees (AutoHet §3 keeps one degree per layer across replicas;
    the degree may change from stage to stage): a TP2 stage then a TP1 stage on 3 GPUs of one node, a node's
    4 GPUs as one TP4 stage ahead of another node's single GPU.

    Templates are multisets of TP groups (node, degree) within every node's GPUs, with at least two degrees,
    tried in order of a bound no plan on them beats (the model's FLOPs over the groups' summed FLOP/s), so the
    search stops at the first template that cannot beat `bound`. Each template runs as one pipeline, and as R
    equal replicas (each stage's copies on the template's node where it has room, else on a node of the same
    kind, else on any node with room: replicas of different GPU types), every layer at the degree one profile
    gives it in every replica. Yields (time, pipelines, profile).

    `host` budgets each node's host RAM among its groups as `make_groups` does: with "pooled" or "first"
    a group may offload into its whole node's RAM, and `share_node_host` settles the plan afterwards.
    """
    cluster, model, train = search.cluster, search.model, search.train
    num_layers, batch = model.num_layers, train.global_batch
    kinds = [(n.name, t) for n in cluster.nodes for t in degrees if t <= n.num_gpus]
    slots = {k: cost.make_slot(cluster, train, k[0], k[1]) for k in kinds}
    budget = {n.name: n.num_gpus for n in cluster.nodes}
    work = 3.0 * num_layers * batch * cost.layer_fwd_flops(model, 1)
    edges = edge_stages_may_win(model)

    templates: list[tuple[float, float, tuple]] = []

    def rec(start: int, left: dict, chosen: list):
        if len({t for _, t in chosen}) >= 2:
            cap = sum(t * slots[(nm, t)].flops_per_gpu for nm, t in chosen)
            most = min(batch, cluster.num_gpus // sum(t for _, t in chosen))  # copies that could fit
            templates.append((work / (cap * most), work / cap, tuple(chosen)))
        if len(chosen) == num_layers + 2 * edges:
            return
        for i in range(start, len(kinds)):
            nm, t = kinds[i]
            if left[nm] >= t:
                left[nm] -= t
                chosen.append(kinds[i])
                rec(i, left, chosen)
                chosen.pop()
                left[nm] += t

    rec(0, dict(budget), [])
    templates.sort(key=lambda x: x[0])

    made: dict[tuple, Group] = {}  # one object per group, so its kind is worked out once

    def deal(pipes: list[list[tuple[str, int]]]) -> list[list[Group]]:
        taken = {nm: 0 for nm in budget}
        out = []
        for pipe in pipes:
            groups = []
            for nm, t in pipe:
                key = (nm, taken[nm], t)
                if key not in made:
                    ids = cluster.node(nm).device_ids()
                    made[key] = Group(nm, tuple(ids[taken[nm]:taken[nm] + t]),
                                      _host_slot(slots[(nm, t)], cluster.node(nm), taken[nm], host))
                groups.append(made[key])
                taken[nm] += t
            out.append(groups)
        return out

    def replicate(order: list[tuple[str, int]], copies: int) -> list[list[tuple[str, int]]] | None:
        left = dict(budget)
        for nm, t in order:
            left[nm] -= t
        out = [order]
        for _ in range(copies - 1):
            copy = []
            for nm, t in order:
                kind = cost.hardware_id(slots[(nm, t)])
                # The template's node, then nodes of its kind, then any node (replicas of different GPU types
                # under one TP profile).
                where = [nm] + sorted((o for o in budget if o != nm and (o, t) in slots),
                                      key=lambda o: (cost.hardware_id(slots[(o, t)]) != kind, o))
                pick = next((o for o in where if left[o] >= t), None)
                if pick is None:
                    return None
                left[pick] -= t
                copy.append((pick, t))
            out.append(copy)
        return out

    best = bound
    for floor, lb, template in templates[:MAX_MIXED]:
        if floor >= best:
            break  # sorted: no later template beats it either, alone or copied
        (groups,) = deal([list(template)])
        if lb < best:
            # Under an even host split the fastest order is the one to keep. Where a stage may offload into
            # its whole node's RAM, the fastest order alone may overflow the node once its stages share it
            # (`share_node_host` then drops it), so every distinct order is offered and the caller keeps
            # the fastest that settles (the sweep: TP1, TP2, TP1 on one node fits where TP2 first does not).
            orders = [search.best_order(groups, 1, True)] if host == "even" else \
                _distinct_orders(_stage_order(groups), MIXED_ORDERS, _by_kind_and_node)
            for order in orders:
                t, _, _ = search.score([order], True)
                if t < math.inf:
                    best = min(best, t) if host == "even" else best
                    yield t, [order], None
        for copies in range(2, batch + 1):
            if lb / copies >= best:
                continue
            # The replicas share one profile, so their stage order is scored with it (not alone).
            for order in _distinct_orders(_stage_order(groups), MIXED_ORDERS):
                pipes = replicate([(g.node, g.slot.tp) for g in order], copies)
                if pipes is None:
                    continue
                pset = deal(pipes)
                for prof in _profiles(order, num_layers, edges):
                    if search.floor(pset, prof) >= best:
                        continue
                    t, _, _ = search.score(pset, True, prof)
                    if t < math.inf:
                        best = min(best, t)
                        yield t, pset, prof


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
                not _host_never_binds(cluster, self.model, self.train):
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
        kinds: dict[tuple, str] = {}
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
        search = _Search(cluster, model, train, self._pm_cache, self._stage_cache)
        finalists = []
        keep = max(k, FINALISTS)
        degrees = tp_candidates(cluster, model)
        types = frozenset(n.gpu_type for n in cluster.nodes)
        most_stages = model.num_layers + 2 * edge_stages_may_win(model)  # embedding- and head-only stages
        # A re-plan after a loss (no GPU type the last plan lacked) skips the TP degrees whose best plan was
        # more than DEGREE_SLACK times slower than the best last time: losing nodes does not make TP1
        # for a 175B model 7x faster, and each degree is seconds of search on thousands of GPUs.
        last = self._last if objective == "throughput" and self._last is not None and types <= self._last[0] else None
        best_by_degree: dict[int, float] = {}
        for tp in sorted(degrees, reverse=True):  # high degrees first: on a large model the fast ones
            groups, unused = make_groups(cluster, train, tp, self._host)
            if not groups:
                continue
            exhaustive = len(groups) <= EXHAUSTIVE_GROUPS and _count_sets(groups, most_stages) <= MAX_EXHAUSTIVE_SETS
            self._heuristic |= not exhaustive
            if (not exhaustive and last is not None and tp in last[1]
                    and last[1][tp] > DEGREE_SLACK * min(last[1].values())):
                continue
            # Exact mode tries every micro-batch size and allocates samples by DP; it is for small batches.
            exact = exhaustive and train.global_batch <= EXACT_BATCH and model.num_layers <= EXACT_LAYERS
            sets = (_exhaustive_sets(groups, most_stages) if exhaustive
                    else _heuristic_sets(search, groups, self._warm.setdefault(tp, {}),
                                         DEGREE_SLACK * min((f[0] for f in finalists), default=math.inf),
                                         self.thorough))
            scored = []
            if exact:
                # Every variant's lower bound first (`floor` at its fastest sync group's bandwidth, mostly
                # cached), then the variants in order of it; each is scored only if its own bound (every
                # group at its own ceiling) is below the best FINALISTS scores so far, and the loop stops
                # when the first bound reaches them: the same finalists, most variants unscored.
                bounded = []
                for pset in sets:
                    pset = [search.best_order(p, len(pset), exact) for p in pset]
                    for v in {_shape_key(v): v for v in (pset, _node_aligned(pset), *_node_orders(pset))}.values():
                        ceiling = search.bw_ceiling(v)
                        bounded.append((search.floor(v, bw=max(ceiling)), len(bounded), v, ceiling))
                bounded.sort(key=lambda x: (x[0], x[1]))
                kept: list[float] = []  # the best FINALISTS scores so far, ascending
                for lb, i, v, ceiling in bounded:
                    if lb == math.inf or (len(kept) == FINALISTS and lb >= kept[-1]):
                        break
                    if len(kept) == FINALISTS and search.floor(v, bw=ceiling) >= kept[-1]:
                        continue
                    s, _, _ = search.score(v, exact)
                    if s < math.inf:
                        scored.append((s, i, v))
                        kept = sorted(kept + [s])[:FINALISTS]
            else:
                for pset in sets:
                    if exhaustive:  # a few stages: their order decides what fits (memory, host RAM) too
                        pset = [search.best_order(p, len(pset), exact) for p in pset]
                    s, _, _ = search.score(pset, exact)
                    if s < math.inf:
                        scored.append((s, len(scored), pset))
            scored.sort(key=lambda x: (x[0], x[1]))
            top = scored[:FINALISTS]
            if exact:  # the stage orders of the replicas decide together which nodes sync each layer
                top = sorted([(*_refine_orders(search, pset, s), i) for s, i, pset in top], key=lambda x: (x[1], x[2]))
                top = [(s, i, pset) for pset, s, i in top]
            finalists += [(s, tp, i, pset, exact, unused, groups, None) for s, i, pset in top]
            if top and not exhaustive:
                best_by_degree[tp] = top[0][0]
        if objective == "throughput" and _kinds:
            self._last = (types, best_by_degree) if best_by_degree else None
        if (len(degrees) > 1 and cluster.num_gpus <= MIXED_GPUS and train.global_batch <= EXACT_BATCH
                and model.num_layers <= EXACT_LAYERS):
            bound = min((f[0] for f in finalists), default=math.inf)
            singles = [Group(n.name, (d,), cost.make_slot(cluster, train, n.name, 1))
                       for n in cluster.nodes for d in n.device_ids()]
            mixed = sorted(_mixed_sets(search, degrees, bound, self._host), key=lambda x: x[0])
            mixed = mixed[:FINALISTS if self._host == "even" else FINALISTS * MIXED_ORDERS]
            # On a tie the plan of one TP degree wins (its degree sorts before inf).
            finalists += [(s, math.inf, i, pset, True, [], singles, prof) for i, (s, pset, prof) in enumerate(mixed)]
        # The surrogate ranks candidates across TP degrees; `evaluate` settles the best few.
        finalists.sort(key=lambda f: f[:3])
        ranked: list[tuple[tuple, int, Plan]] = []
        # Under an even host split every finalist is a plan; under a pooled one some overflow a node once
        # settled together and are dropped, so the loop goes on down the list until `keep` plans are made.
        tries = finalists[:keep] if self._host == "even" else finalists[:keep * (MIXED_ORDERS + 1)]
        for _, _, _, pset, exact, unused, groups, prof in tries:
            if len(ranked) >= keep:
                break
            plan_, used = search.build(pset, exact, unused, prof)
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
            est = plan_.estimate
            key = (est.cost_per_mtok, est.step_time_s) if objective == "cost" else (est.step_time_s,)
            if all(p.pipelines != plan_.pipelines for _, _, p in ranked):
                ranked.append((key, len(ranked), plan_))
        if not ranked:
            raise PlanningError(_no_fit_message(cluster, model, train))
        return [p for _, _, p in sorted(ranked, key=lambda r: r[:2])[:k]]  # evaluate checked each against the contract


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
        ranked.sort(key=lambda p: (p.estimate.cost_per_mtok, p.estimate.step_time_s))
        return ranked[:k]


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
def collector_paused():
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


def _host_short(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec):
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
