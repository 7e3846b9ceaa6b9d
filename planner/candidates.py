"""Candidate pipeline sets for one TP degree: every multiset of pipelines by GPU kind on small clusters, and a
coordinate descent over per-type pipeline depths on large ones (HexiScale: homogeneous pipelines per type first,
the leftovers pooled into mixed ones)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from planner.groups import Group, PSet, stage_order
from planner.scoring import SetCost

EXHAUSTIVE_GROUPS = 8
FINALISTS = 4  # candidates of each TP degree (and of mixed degrees) kept for `evaluate` to settle
MAX_EXHAUSTIVE_SETS = 3000
_POOL = "<pool>"
DEGREE_SLACK = 1.25  # a TP degree this much slower than the best is not refined, nor searched in a re-plan


def exhaustive_sets(groups: list[Group], max_stages: int) -> Iterator[PSet]:
    """Every multiset of pipelines, each a multiset of GPU kinds (groups of one kind are interchangeable)."""
    kinds = sorted({g.kind for g in groups}, key=str)
    pools = [[g for g in groups if g.kind == k] for k in kinds]  # by the kind's index (a Slot hashes slowly)
    counts = [len(pool) for pool in pools]
    vectors = [v for v in itertools.product(*[range(c + 1) for c in counts]) if 0 < sum(v) <= max_stages]
    vectors.sort(reverse=True)

    def rec(start: int, left: list[int], chosen: list[tuple[int, ...]]) -> Iterator[list[tuple[int, ...]]]:
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
            pset.append(stage_order(members))
        yield pset


def count_sets(groups: list[Group], max_stages: int) -> int:
    count = 0
    for _ in exhaustive_sets(groups, max_stages):
        count += 1
        if count > MAX_EXHAUSTIVE_SETS:
            break
    return count


Depths = dict[str, int]  # per GPU type: > 0 pipelines of that many stages, 0 pooled, -1 idle; _POOL: 1 or 0


class DepthSearch:
    """Homogeneous pipelines per type at chosen depths, leftovers pooled into mixed pipelines: a coordinate
    descent over the types' depths from a few starts, each set scored by `SetCost` (memoised by its depths)."""

    def __init__(self, search: SetCost, groups: list[Group]):
        self.search = search
        self.by_type: dict[str, list[Group]] = {}
        for g in sorted(groups, key=lambda g: (-g.slot.flops_per_gpu, g.slot.gpu_type, g.node, g.devices)):
            self.by_type.setdefault(g.slot.gpu_type, []).append(g)
        self.types = list(self.by_type)
        self.keys = self.types + [_POOL]
        self.p_min = {t: self._least_depth(self.by_type[t]) for t in self.types}
        self.seen: dict[tuple, float] = {}
        self._pools: dict[tuple[int, ...], list[list[Group]]] = {}  # by the groups' identities (they outlive it)

    def _fits(self, gs: list[Group], p: int) -> bool:
        return self.search.pipeline_model(gs[:p], False).finish(1) is not None

    def _least_depth(self, gs: list[Group]) -> int:
        """The fewest stages of these groups that hold the model (0: none does)."""
        hi = min(len(gs), self.search.model.num_layers)
        if not self._fits(gs, hi):
            return 0
        lo = 1  # binary search: more stages never need more memory per device
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._fits(gs, mid) else (mid + 1, hi)
        return lo

    def assemble(self, depth: Depths) -> PSet:
        pset, pool = [], []
        for t in self.types:
            gs, p = self.by_type[t], depth[t]
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
        return pset + self._pooled(pool)

    def _pooled(self, pool: list[Group]) -> PSet:
        """The leftovers' mixed pipelines, in stage order, each closed as soon as it fits (the descent asks for
        the same leftovers, listed alike, under many depths of the other types: built once)."""
        ids = tuple(map(id, pool))
        got = self._pools.get(ids)
        if got is None:
            got, current = [], []
            for g in stage_order(pool):  # a run of groups in stage order is in stage order
                current.append(g)
                if len(current) <= self.search.model.num_layers \
                        and self.search.pipeline_model(list(current), False).finish(1) is not None:
                    got.append(current)
                    current = []
            self._pools[ids] = got
        return [list(p) for p in got]

    def depths(self, t: str) -> list[int]:
        p, n = self.p_min[t], len(self.by_type[t])
        if not p:
            return []
        return sorted({q for q in (p, p + 1, 2 * p, 4 * p, 8 * p, 16 * p)
                       if q <= min(n, self.search.model.num_layers)})

    def options(self, t: str) -> list[int]:
        return [0, 1] if t == _POOL else [-1, 0, *self.depths(t)]

    def alone(self, t: str, q: int) -> float:
        """Step time of the type's groups alone as equal pipelines of depth q (equal shares)."""
        gs, batch = self.by_type[t], self.search.train.global_batch
        k = min(len(gs) // q, batch)
        pset = [gs[j * q:(j + 1) * q] for j in range(k)]
        f = self.search.pipeline_model(pset[0], False).finish(math.ceil(batch / k), k, self.search.sync_bw(pset))
        return math.inf if f is None else f.time_s

    def val(self, d: Depths) -> float:
        key = tuple(d[t] for t in self.keys)
        if key not in self.seen:
            self.seen[key] = self.search.score(self.assemble(d), False)[0]
        return self.seen[key]

    def descend(self, depth: Depths) -> Depths:
        """Coordinate descent: each type's depth in turn, kept where it lowers the step, up to three rounds."""
        for _ in range(3):
            improved = False
            for t in self.keys:
                for q in self.options(t):
                    trial = dict(depth, **{t: q})
                    if self.val(trial) < self.val(depth) * (1 - 1e-9):
                        depth, improved = trial, True
            if not improved:
                break
        return depth

    def start(self, last: Depths) -> tuple[Depths, bool]:
        """Each type at the depth that is fastest for it alone (HexiScale: intra-type first), or where the last
        search left it; and whether every type was resumed."""
        resumed = all(last.get(t) in self.options(t) for t in self.types)
        depth = {t: last[t] if last.get(t) in self.options(t) else
                 min(self.depths(t), key=lambda q: self.alone(t, q), default=0) for t in self.types}
        return depth | {_POOL: last.get(_POOL, 1)}, resumed

    def fastest_alone(self, depth: Depths) -> list[Depths]:
        """Coordinate descent moves one type at a time, so it cannot leave a mix whose slowest NICs pace every
        replica's gradient sync by dropping two types at once (a 70B on H100 + A100 + L4 + A10G nodes, the L4 and
        A10G on slow NICs: adding H100 pipelines to an L4 + A10G plan makes it slower, and the fast types alone
        are 5x faster than either). So it also starts from the fastest types alone: the first j types by FLOP/s
        at their depths, the others idle, for every j, their leftovers pooled or idle (one short pipeline that
        must offload its optimizer paces every replica's step)."""
        return [{t: (depth[t] if i < j else -1) for i, t in enumerate(self.types)} | {_POOL: pool}
                for j in range(1, len(self.types) + 1) for pool in (1, 0)]

    def one_depth(self) -> list[Depths]:
        """Each type at its own best depth makes replicas of unequal lengths, and a descent that moves one type
        at a time may not get out: the 175B on 1,024 GPUs of six types, 32 nodes lost, ended with both A100 types
        idle at 69% of the throughput a re-plan warm from the whole cluster found (docs/benchmarks.md, re-plan at
        scale). So a fresh search also starts from the types at one depth together, for each type's least depth
        that fits (every type at the least of its depths not below it)."""
        qs = sorted({self.p_min[t] for t in self.types if self.p_min[t]})
        return [{t: next((o for o in self.depths(t) if o >= q), max(self.depths(t), default=0))
                 for t in self.types} | {_POOL: 1} for q in qs]


def depth_sets(search: SetCost, groups: list[Group], warm: dict | None = None, bound: float = math.inf,
               thorough: bool = False) -> Iterator[PSet]:
    """The best FINALISTS pipeline sets a descent over per-type depths scored (`DepthSearch`).

    `warm`: the depths this search settled on last time (a re-plan after a loss starts there, not from
    each type's best depth alone; it holds the new ones when the search is done). `bound`: a step time past
    which a second descent is not worth its time (another TP degree already does much better). `thorough`:
    descend from every start, not only the best of each kind (the planner bench's longer search)."""
    ds = DepthSearch(search, groups)
    depth, resumed = ds.start((warm or {}).get("depth", {}))
    others, uniform = ds.fastest_alone(depth), ds.one_depth()
    ends = [ds.descend(depth)]
    if thorough:
        ends += [ds.descend(d) for d in others + uniform]
    elif not resumed:  # a resumed search had these starts last time
        # the best of the fastest types alone, where it beats where the usual start's descent ended
        other = min(others, key=ds.val)
        if ds.val(other) < min(ds.val(ends[0]) * (1 - 1e-9), bound):
            ends.append(ds.descend(other))
        # each one-depth start descended where it starts ahead of every degree so far: the best start of them is
        # not the best end (1,024 GPUs of six types, the 175B: the start at 112 s a step ends at 56, one at 125
        # ends at 49)
        ends += [ds.descend(d) for d in uniform if ds.val(d) * DEGREE_SLACK < bound]
    depth = min(ends, key=ds.val)
    if warm is not None:
        warm["depth"] = dict(depth)
    ranked = sorted(ds.seen.items(), key=lambda kv: kv[1])
    for key, v in ranked[:FINALISTS]:
        if v < math.inf:
            yield ds.assemble(dict(zip(ds.keys, key, strict=True)))
