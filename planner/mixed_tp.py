"""Plans whose stages take different TP degrees (AutoHet section 3: one degree per layer across replicas, the degree
free to change from stage to stage), on small clusters."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from planner import cost
from planner.groups import Group, Profile, PSet, by_kind_and_node, host_slot, stage_order
from planner.layer_split import edge_ranges, edge_stages_may_win
from planner.orders import distinct_orders
from planner.scoring import SetCost

MIXED_GPUS = 8  # clusters up to here also try plans whose stages take different TP degrees
MAX_MIXED = 400  # pipeline templates scored per plan at most (in order of their compute bound)
MIXED_ORDERS = 6  # stage orders tried per replicated template


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def profiles(order: list[Group], num_layers: int, edges: bool = False) -> Iterator[tuple[int, ...]]:
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
        for comp in compositions(num_layers, len(runs)):
            if all(n >= k for n, (_, k) in zip(comp, runs, strict=True)):
                prof = tuple(t for n, (t, _) in zip(comp, runs, strict=True) for _ in range(n))
                if prof not in seen:
                    seen.add(prof)
                    yield prof


GroupKey = tuple[str, int]  # (node, TP degree)


class MixedTemplates:
    """Plans whose stages take different TP degrees (AutoHet section 3 keeps one degree per layer across
    replicas; the degree may change from stage to stage): a TP2 stage then a TP1 stage on 3 GPUs of one node, a
    node's 4 GPUs as one TP4 stage ahead of another node's single GPU.

    Templates are multisets of TP groups (node, degree) within every node's GPUs, with at least two degrees,
    tried in order of a bound no plan on them beats (the model's FLOPs over the groups' summed FLOP/s), so the
    search stops at the first template that cannot beat its bound. Each template runs as one pipeline, and as R
    equal replicas (each stage's copies on the template's node where it has room, else on a node of the same
    kind, else on any node with room: replicas of different GPU types), every layer at the degree one profile
    gives it in every replica.

    `host` budgets each node's host RAM among its groups as `make_groups` does: with "pooled" or "first"
    a group may offload into its whole node's RAM, and `share_node_host` settles the plan afterwards.
    """

    def __init__(self, search: SetCost, degrees: list[int], host: str = "even"):
        self.search, self.host = search, host
        cluster, model, train = search.cluster, search.model, search.train
        self.num_layers, self.batch = model.num_layers, train.global_batch
        self.kinds = [(n.name, t) for n in cluster.nodes for t in degrees if t <= n.num_gpus]
        self.slots = {k: cost.make_slot(cluster, train, k[0], k[1]) for k in self.kinds}
        self.budget = {n.name: n.num_gpus for n in cluster.nodes}
        self.work = 3.0 * self.num_layers * self.batch * cost.layer_fwd_flops(model, 1)
        self.edges = edge_stages_may_win(model)
        self._made: dict[tuple, Group] = {}  # one object per group, so its kind is worked out once

    def templates(self) -> list[tuple[float, float, tuple[GroupKey, ...]]]:
        """(bound on any number of copies, bound on one, the template), in order of the first."""
        out: list[tuple[float, float, tuple[GroupKey, ...]]] = []
        gpus = self.search.cluster.num_gpus

        def rec(start: int, left: dict, chosen: list) -> None:
            if len({t for _, t in chosen}) >= 2:
                cap = sum(t * self.slots[(nm, t)].flops_per_gpu for nm, t in chosen)
                most = min(self.batch, gpus // sum(t for _, t in chosen))  # copies that could fit
                out.append((self.work / (cap * most), self.work / cap, tuple(chosen)))
            if len(chosen) == self.num_layers + 2 * self.edges:
                return
            for i in range(start, len(self.kinds)):
                nm, t = self.kinds[i]
                if left[nm] >= t:
                    left[nm] -= t
                    chosen.append(self.kinds[i])
                    rec(i, left, chosen)
                    chosen.pop()
                    left[nm] += t

        rec(0, dict(self.budget), [])
        out.sort(key=lambda x: x[0])
        return out

    def deal(self, pipes: list[list[GroupKey]]) -> PSet:
        """The groups of each pipeline's (node, degree) stages, each node's GPUs taken in order."""
        cluster = self.search.cluster
        taken = {nm: 0 for nm in self.budget}
        out = []
        for pipe in pipes:
            groups = []
            for nm, t in pipe:
                key = (nm, taken[nm], t)
                if key not in self._made:
                    ids = cluster.node(nm).device_ids()
                    self._made[key] = Group(nm, tuple(ids[taken[nm]:taken[nm] + t]),
                                            host_slot(self.slots[(nm, t)], cluster.node(nm), taken[nm], self.host))
                groups.append(self._made[key])
                taken[nm] += t
            out.append(groups)
        return out

    def replicate(self, order: list[GroupKey], copies: int) -> list[list[GroupKey]] | None:
        """`copies` pipelines of `order`'s stages: each copy's stage on the template's node, then on a node of its
        kind, then on any node (replicas of different GPU types under one TP profile); None where one has no room."""
        left = dict(self.budget)
        for nm, t in order:
            left[nm] -= t
        out = [order]
        for _ in range(copies - 1):
            copy = []
            for nm, t in order:
                kind = cost.hardware_id(self.slots[(nm, t)])
                where = [nm] + sorted((o for o in self.budget if o != nm and (o, t) in self.slots),
                                      key=lambda o: (cost.hardware_id(self.slots[(o, t)]) != kind, o))
                pick = next((o for o in where if left[o] >= t), None)
                if pick is None:
                    return None
                left[pick] -= t
                copy.append((pick, t))
            out.append(copy)
        return out

    def one_pipeline(self, groups: list[Group]) -> list[list[Group]]:
        """The template as one pipeline: under an even host split its fastest order is the one to keep. Where a
        stage may offload into its whole node's RAM, the fastest order alone may overflow the node once its
        stages share it (`share_node_host` then drops it), so every distinct order is offered and the caller
        keeps the fastest that settles (the sweep: TP1, TP2, TP1 on one node fits where TP2 first does not)."""
        if self.host == "even":
            return [self.search.best_order(groups, 1, True)]
        return distinct_orders(stage_order(groups), MIXED_ORDERS, by_kind_and_node)


def mixed_sets(search: SetCost, degrees: list[int], bound: float,
               host: str = "even") -> Iterator[tuple[float, PSet, Profile | None]]:
    """`MixedTemplates`' plans that beat `bound`: yields (time, pipelines, profile), the template alone (no
    profile) and as equal replicas under one per-layer TP profile."""
    mt = MixedTemplates(search, degrees, host)
    best = bound
    for floor, lb, template in mt.templates()[:MAX_MIXED]:
        if floor >= best:
            break  # sorted: no later template beats it either, alone or copied
        (groups,) = mt.deal([list(template)])
        if lb < best:
            for order in mt.one_pipeline(groups):
                t, _, _ = search.score([order], True)
                if t < math.inf:
                    best = min(best, t) if host == "even" else best
                    yield t, [order], None
        for copies in range(2, mt.batch + 1):
            if lb / copies >= best:
                continue
            # The replicas share one profile, so their stage order is scored with it (not alone).
            for order in distinct_orders(stage_order(groups), MIXED_ORDERS):
                pipes = mt.replicate([(g.node, g.slot.tp) for g in order], copies)
                if pipes is None:
                    continue
                pset = mt.deal(pipes)
                for prof in profiles(order, mt.num_layers, mt.edges):
                    if search.floor(pset, prof) >= best:
                        continue
                    t, _, _ = search.score(pset, True, prof)
                    if t < math.inf:
                        best = min(best, t)
                        yield t, pset, prof
