"""What a pipeline set costs: `SetCost` scores a set of pipelines (each a chain of TP groups) by the search's
surrogate, the layer splits and micro-batch sizes of planner/layer_split.py and the min-max allocation of the global
batch over the replicas, with each layer's gradient-sync bandwidth settled in exact mode."""

from __future__ import annotations

import functools
import math

from planner import cost
from planner.groups import Group, Profile, PSet, stage_order
from planner.layer_split import Finish, Links, PipelineModel, SyncBw, allocate_samples, edge_stages_may_win
from planner.orders import MAX_ORDERS, distinct_orders
from planner.specs import ClusterSpec, ModelSpec, TrainSpec


def done(f: Finish | None) -> Finish:
    """A finish the search knows exists (the pipeline took its samples when they were allocated)."""
    if f is None:
        raise AssertionError("a pipeline that took its samples has a finish")
    return f


ReplicaLinks = list[tuple[Links, ...]]  # per replica, per stage, per sync group (`SetCost._best_response`)
Costed = SyncBw | ReplicaLinks  # the bandwidths a score was costed with
Score = tuple[float, list[int] | None, Costed]  # (surrogate step time, samples per pipeline, bandwidths)


class SetCost:
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
        groups = stage_order(groups)
        # Groups of one kind on one node are interchangeable: the answer, as positions, holds for any such.
        key = (tuple((g.kind_id, g.node) for g in groups), num_pipelines, exact)
        if key not in self._order_cache:
            n = max(1, self.train.global_batch // num_pipelines)
            bw = self.sync_bw([groups])
            best, best_t = list(range(len(groups))), math.inf
            for cand in distinct_orders(list(range(len(groups))), MAX_ORDERS, lambda i: groups[i].kind_id):
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
        held = [group_nodes(groups, f) for groups, f in zip(pset, finishes, strict=True)]
        return tuple(cost.sync_group_bw(self.cluster, {h[x] for h in held}) for x in range(self.model.num_layers + 2))

    def score(self, pset: PSet, exact: bool, profile: Profile | None = None) -> Score:
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
            return max(done(pm.finish(n, len(pset), bw)).time_s for pm, n in zip(pms, alloc, strict=True)), alloc, bw
        # From the slowest link for every group, and from each group's fastest (`bw_ceiling`): replicas that
        # split alike at the slow links can settle where a layer's copies sit on different nodes, while at
        # the fast ones they may agree on one node for it (the optimum of the closed form is often there).
        slow = self.sync_bw(pset)
        found: list[Score] = [self._rounds(pset, pms, slow)]
        ceiling = self.bw_ceiling(pset)
        if len(pset) > 1 and any(x != slow for x in ceiling):
            found.append(self._rounds(pset, pms, ceiling))
        return min(found, key=lambda x: x[0])

    def _rounds(self, pset: PSet, pms: list[PipelineModel], bw: float | Links) -> Score:
        """`score`'s fixed-point rounds in exact mode from the bandwidths `bw`."""
        tried: list[tuple[float, list[int], SyncBw]] = []
        prev: float | Links = bw  # the previous round's bandwidths
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
            fins = [done(pm.finish(n, len(pset), bw)) for pm, n in zip(pms, alloc, strict=True)]
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
        responses = [self._best_response(pset, pms, alloc, bw) for _, alloc, bw in tried]
        # No fixed point in a few rounds: the best round's plan stands, at its true time.
        return min([*tried, *responses], key=lambda x: x[0], default=(math.inf, None, 0.0))

    def _best_response(self, pset: PSet, pms: list[PipelineModel], alloc: list[int],
                       bw: SyncBw) -> tuple[float, list[int], Costed]:
        """One pass over the replicas, each re-split at the links its own stage nodes would give every sync
        group with the other replicas' splits held (the fixed-point rounds cost a layer's sync as if a
        replica's own split did not move it, so a replica that is not the bottleneck can keep breaking the
        others' links). Returns (true time, samples, each replica's bandwidths) like a round of `score`."""
        num_layers, r_all = self.model.num_layers, len(pset)
        got = [pm.finish(n, r_all, bw) for pm, n in zip(pms, alloc, strict=True)]
        fins = [f for f in got if f is not None]
        if len(fins) < len(got):
            return math.inf, alloc, bw
        link = functools.partial(cost.sync_group_bw, self.cluster)
        held = [group_nodes(g, f) for g, f in zip(pset, fins, strict=True)]
        used: ReplicaLinks = []
        for r, (groups, pm, n) in enumerate(zip(pset, pms, alloc, strict=True)):
            others = [h for q, h in enumerate(held) if q != r]
            per_stage = tuple(tuple(link({g.node, *(h[x] for h in others)}) for x in range(num_layers + 2))
                              for g in groups)
            f = pm.finish(n, r_all, per_stage)
            if f is None:
                return math.inf, alloc, bw
            fins[r], held[r] = f, group_nodes(groups, f)
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
        return max(done(pm.finish(n, len(pset), bw)).time_s for pm, n in zip(pms, alloc, strict=True))


def group_nodes(groups: list[Group], f: Finish) -> list[str]:
    """The node that holds this replica's copy of each gradient-sync group under the split `f` (in
    `link_vector`'s order: embedding, layer 0, ..., layer L-1, LM head)."""
    out = [groups[0].node]
    for g, ch in zip(groups, f.stages, strict=True):
        out += [g.node] * ch.num_layers
    return out + [groups[-1].node]
