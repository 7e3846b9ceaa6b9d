"""Brute-force reference planner for the optimality test (lives in tests/, not the package).

It enumerates, independently of planner/search.py and planner/layer_split.py,
every plan the plan contract allows on the cluster:
  - TP groups of every degree that divides the model (powers of two or not) and
    fits a node, and per stage: a pipeline's stages may take different degrees,
    and a node's GPUs may be cut into groups of different degrees, as long as
    every layer has one degree in every replica that holds it;
  - every multiset of pipelines, each an *ordered* sequence of TP groups named by
    their node and degree (groups of one degree on one node are interchangeable;
    groups on different nodes are not, even of one GPU type, since their links
    differ), within each node's GPU count;
  - every contiguous layer split of every pipeline (where the LM head weighs at least half a layer,
    `edge_stages_may_win`, the first and last stage may hold no layer), chosen jointly: a layer's
    gradient-sync bandwidth depends on which nodes hold it in every replica
    (one node: its intra-node link; several: the slowest of their NICs), and so
    do the embedding's and the LM head's (the nodes of the first and of the last
    stages);
  - every offload mode per stage (with the fewest recomputed layers that fit,
    which dominates more recompute), every micro-batch size, every split of the
    global batch.
The objective is `planner.evaluate`'s closed form, computed here from the cost
model's per-stage functions; `best_plan` also returns the winning Plan so the
test can check that `evaluate` gives it the same time. Host memory is counted
per GPU by default (each GPU's offloaded state within its share of the node's
RAM), the planner's first budget, which binds on none of the optimality test's
small models. With `host="node"` it is a node total, as `evaluate` counts it:
every assignment of offload modes to the plan's stages is tried (a stage's mode
decides its host bytes; its recompute is then the least that fits), and an
assignment counts only where each node's stages together fit its RAM.

`bound`: the caller's time to beat; branches that cannot beat it are cut (the
search stays exhaustive for every plan faster than `bound`). `uniform=True`
keeps to plans of one TP degree (what the planner searched before per-stage TP).
"""

from __future__ import annotations

import itertools
import math
from functools import cache

from planner import cost
from planner.contract import tp_problem
from planner.layer_split import edge_stages_may_win
from planner.offload_policy import to_policy
from planner.plan_types import Pipeline, Plan, Stage
from planner.specs import ClusterSpec, ModelSpec, TrainSpec

MODES = ((False, False), (True, False), (True, True))


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def _splits(total: int, parts: int, edges: bool):
    """Every contiguous split of `total` layers over `parts` stages, each with at least one layer; with
    `edges`, the first and the last stage (of two or more) may also hold none (the embedding or the LM
    head alone)."""
    seen = set()
    for e0, e1 in ((0, 0), (1, 0), (0, 1), (1, 1)) if edges and parts >= 2 else ((0, 0),):
        inner = parts - e0 - e1
        if inner < 1:
            continue
        for c in _compositions(total, inner):
            s = (0,) * e0 + c + (0,) * e1
            if s not in seen:
                seen.add(s)
                yield s


def best_plan(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec, bound: float = math.inf,
              uniform: bool = False, edges: bool | None = None, host: str = "gpu") -> tuple[float, Plan | None]:
    """(best step time, its Plan), or (inf, None) when no plan beats `bound`. `edges`: whether the first and
    last stage may hold no layer (default: where the planner searches such stages, `edge_stages_may_win`)."""
    most = max(n.num_gpus for n in cluster.nodes)
    degrees = [t for t in range(1, most + 1) if tp_problem(model, t) is None]
    best, found = bound, None
    for ds in ([[t] for t in degrees] if uniform else [degrees]):
        t, p = _Enum(cluster, model, train, ds, edge_stages_may_win(model) if edges is None else edges, host).run(best)
        if p is not None and t < best:
            best, found = t, p
    return (best, found) if found is not None else (math.inf, None)


class _Enum:
    def __init__(self, cluster, model, train, degrees, edges: bool, host: str = "gpu"):
        assert host in ("gpu", "node"), host
        self.cluster, self.model, self.train, self.edges, self.host = cluster, model, train, edges, host
        self.nodes = list(cluster.nodes)
        # A group kind: (node index, TP degree).
        self.kinds = [(i, t) for i, n in enumerate(self.nodes) for t in degrees if t <= n.num_gpus]
        self.slots = {k: cost.make_slot(cluster, train, self.nodes[k[0]].name, k[1]) for k in self.kinds}
        self.pipe_time = cache(self._pipe_time)
        self.bw_of = cache(self._bw_of)
        self._choice_cache: dict = {}
        self._stage_cache: dict = {}
        self.hw = [cost.hardware_id(self.slots[k]) for k in self.kinds]
        self.stage_times = cache(lambda *a: cost.stage_times(a[0], model, train, *a[1:]))
        self.stage_memory = cache(lambda *a: cost.stage_memory(a[0], model, train, *a[1:]))
        self.stage_sync = cache(self._stage_sync)

    def _stage_sync(self, params: float, num_r: int, bws: tuple[float, ...]) -> float:
        """A stage's gradient-sync time over its layers' sync bandwidths, summed in layer order (memoized: the
        search scores the same stages in many plans)."""
        return sum(cost.sync_s(params, self.train, num_r, bw) for bw in bws)

    def _bw_of(self, idx: frozenset[int]) -> float:
        slots = [cost.make_slot(self.cluster, self.train, self.nodes[i].name, 1) for i in idx]
        if len(slots) == 1:
            return slots[0].intra_bw
        return min(s.inter_bw for s in slots)

    def _stage_opts(self, seq, split, i, b, m, mode=None):
        """Per offload mode (or only `mode`) that fits stage i at micro-batch b: (knobs, slot, shape, links,
        in-flight)."""
        model, train = self.model, self.train
        p = len(seq)
        slot = self.slots[self.kinds[seq[i]]]
        shape = cost.StageShape(split[i], i == 0, i == p - 1)
        k = cost.inflight(i, p, m, "1f1b")
        nxt = cost.link_bw(slot, self.slots[self.kinds[seq[i + 1]]]) if i + 1 < p else None
        prv = cost.link_bw(slot, self.slots[self.kinds[seq[i - 1]]]) if i > 0 else None
        out = []
        # Per GPU: its share of the node's RAM; as a node total, one stage may at most fill the node.
        cap = slot.host_cap_bytes if self.host == "gpu" else \
            self.nodes[self.kinds[seq[i]][0]].host_mem * cost.GIB / slot.tp
        for opt, params in MODES if mode is None else (mode,):
            kn0 = cost.Knobs(0, opt, params)
            if (opt or params) and cost.host_bytes(model, train, shape, slot.tp, kn0) > cap:
                continue
            for r in range(split[i] + 1):
                kn = cost.Knobs(r, opt, params)
                if self.stage_memory(slot, shape, b, k, kn) <= slot.mem_cap_bytes:
                    out.append((kn, slot, shape, nxt, prv, k))
                    break
        return out

    def choices(self, seq, split, n, b, modes=None):
        # What a pipeline costs depends on its stages' hardware and links, not on their nodes' names.
        sig = []
        for i, g in enumerate(seq):
            slot = self.slots[self.kinds[g]]
            nxt = cost.link_bw(slot, self.slots[self.kinds[seq[i + 1]]]) if i + 1 < len(seq) else None
            sig.append((self.hw[g], nxt, self.host == "node" and self.nodes[self.kinds[g][0]].host_mem))
        key = (tuple(sig), split, n, b, modes)
        got = self._choice_cache.get(key)
        if got is None:
            got = self._choice_cache[key] = self._choices(seq, split, n, b, modes)
        return got

    def _choices(self, seq, split, n, b, modes=None):
        """Every per-stage offload choice at n samples in micro-batches of b, with what its time needs that
        does not depend on the gradient sync: (1F1B time, per stage (optimizer s, last backward s), knobs).
        A stage's choice that is no faster on any micro-batch, no cheaper in optimizer time and no longer
        in its last backward (which hides the sync) than another is dropped."""
        m = math.ceil(n / b)
        stages = []
        for i in range(len(seq)):
            g = seq[i]
            slot = self.slots[self.kinds[g]]
            nxt = cost.link_bw(slot, self.slots[self.kinds[seq[i + 1]]]) if i + 1 < len(seq) else None
            prv = cost.link_bw(slot, self.slots[self.kinds[seq[i - 1]]]) if i > 0 else None
            # A stage's options depend on its hardware, links, layers and position, not on the rest of the
            # pipeline: shared by every pipeline that has such a stage.
            key = (self.hw[g], self.host == "node" and self.nodes[self.kinds[g][0]].host_mem, split[i], i == 0,
                   i == len(seq) - 1, cost.inflight(i, len(seq), m, "1f1b"), nxt, prv, n, b, modes and modes[i])
            opts = self._stage_cache.get(key)
            if opts is None:
                opts = self._stage_cache[key] = self._stage_front(seq, split, i, n, b, m, modes and modes[i])
            if not opts:
                return []
            stages.append(opts)
        return [(cost.pipeline_time([[c[1][j] for c in choice] for j in range(m)]),
                 tuple((c[2], c[3]) for c in choice), tuple(c[0] for c in choice))
                for choice in itertools.product(*stages)]

    def _stage_front(self, seq, split, i, n, b, m, mode):
        """Stage i's offload choices at n samples in micro-batches of b: (knobs, per micro-batch time, optimizer
        s, last backward s), less those another choice is no worse than on every count."""
        sizes = [b] * (m - 1) + [n - (m - 1) * b]
        opts = []
        for kn, slot, shape, nxt, prv, k in self._stage_opts(seq, split, i, b, m, mode):
            ts = [self.stage_times(slot, shape, x, k, kn, nxt, prv) for x in sizes]
            busy = sum(t.fwd_s + t.bwd_s for t in ts)
            fwd = sum(t.fwd_s for t in ts)
            opt = cost.optimizer_s(slot, self.model, self.train, shape, kn, busy, fwd)
            opts.append((kn, [t.fwd_s + t.bwd_s for t in ts], opt, ts[-1].bwd_s))
        return [o for o in opts if not any(
            q is not o and all(x <= y for x, y in zip(q[1], o[1], strict=True)) and q[2] <= o[2] and q[3] >= o[3]
            and (q[1], q[2], q[3]) != (o[1], o[2], o[3]) for q in opts)]

    def _pipe_time(self, seq, split, n, syncs, modes=None):
        """(fastest finish of one pipeline on n samples, (b, m, knobs per stage)); syncs: gradient-sync seconds
        per stage before overlap; `modes`: each stage's offload mode, or None for any."""
        best = (math.inf, None)
        for b in range(1, min(n, self.train.max_micro_batch_size) + 1):
            for t_pipe, extras, knobs in self.choices(seq, split, n, b, modes):
                t = t_pipe + max(max(0.0, sy - bwd) + opt for sy, (opt, bwd) in zip(syncs, extras, strict=True))
                if t < best[0]:
                    best = (t, (b, math.ceil(n / b), knobs))
        return best

    def floor(self, seq, split) -> float:
        """A lower bound on this pipeline's finish at any number of samples and any sync: its 1F1B time for one
        sample (one micro-batch of one, the least memory, so every offload choice that fits more fits it;
        stage times grow with the micro-batch and with recompute). The optimizer's exposed time is left out:
        it can shrink as the compute it hides behind grows."""
        return min((c[0] for c in self.choices(seq, split, 1, 1)), default=math.inf)

    def profile(self, seq, split) -> tuple[int, ...]:
        """The TP degree of every layer under this pipeline's split."""
        return tuple(self.kinds[g][1] for g, nl in zip(seq, split, strict=True) for _ in range(nl))

    def run(self, bound: float) -> tuple[float, Plan | None]:
        num_layers, big_b = self.model.num_layers, self.train.global_batch
        budget = [n.num_gpus for n in self.nodes]

        def usage(seq):
            need = [0] * len(self.nodes)
            for g in seq:
                node, t = self.kinds[g]
                need[node] += t
            return need

        # A pipeline that fits no split with one sample (the least memory: one micro-batch, the fewest in
        # flight) fits none with more, so it is in no plan.
        pipelines = []
        edges = self.edges
        for p in range(1, num_layers + 1 + 2 * edges):
            for seq in itertools.product(range(len(self.kinds)), repeat=p):
                need = usage(seq)
                if any(a > b for a, b in zip(need, budget, strict=True)):
                    continue
                splits = [s for s in _splits(num_layers, p, edges)
                          if self.pipe_time(seq, s, 1, (0.0,) * p)[0] < math.inf]
                if splits:
                    by_profile: dict[tuple, list] = {}
                    for s in splits:
                        by_profile.setdefault(self.profile(seq, s), []).append(s)
                    pipelines.append((seq, need, by_profile, min(self.floor(seq, x) for x in splits)))
        best, found = bound, None
        work = 3.0 * num_layers * big_b * cost.layer_fwd_flops(self.model, 1)
        self.cap = [self.slots[k].tp * self.slots[k].flops_per_gpu for k in self.kinds]

        def score(chosen, splits):
            nonlocal best, found
            num_r = len(chosen)
            holders = [set() for _ in range(num_layers)]
            firsts, lasts = set(), set()
            for seq, split in zip(chosen, splits, strict=True):
                at = 0
                for g, nl in zip(seq, split, strict=True):
                    for layer in range(at, at + nl):
                        holders[layer].add(self.kinds[g][0])
                    at += nl
                firsts.add(self.kinds[seq[0]][0])
                lasts.add(self.kinds[seq[-1]][0])
            bws = [self.bw_of(frozenset(h)) for h in holders]
            embed_bw, head_bw = self.bw_of(frozenset(firsts)), self.bw_of(frozenset(lasts))
            per_pipe = []
            for seq, split in zip(chosen, splits, strict=True):
                syncs, at = [], 0
                for i, nl in enumerate(split):
                    layer_p = self.model.layer_params / self.kinds[seq[i]][1]
                    s = self.stage_sync(layer_p, num_r, tuple(bws[at:at + nl]))
                    tp = self.kinds[seq[i]][1]
                    if i == 0:
                        s += cost.sync_s(cost.embed_params_dev(self.model, tp), self.train, num_r, embed_bw)
                    if i == len(split) - 1:
                        s += cost.sync_s(cost.head_params_dev(self.model, tp), self.train, num_r, head_bw)
                    syncs.append(round(s, 15))
                    at += nl
                per_pipe.append((seq, split, tuple(syncs)))
            for modes in self.mode_choices(per_pipe):
                # Min-max split of the global batch, every pipeline at least one sample.
                dp = {0: (0.0, ())}
                for r, (seq, split, syncs) in enumerate(per_pipe):
                    left = num_r - r - 1
                    nxt = {}
                    for s, (mx, alloc) in dp.items():
                        for n in range(1, big_b - s - left + 1):
                            v = max(mx, self.pipe_time(seq, split, n, syncs, modes[r])[0])
                            if v < best and v < nxt.get(s + n, (math.inf,))[0]:
                                nxt[s + n] = (v, alloc + (n,))
                    dp = nxt
                if big_b in dp and dp[big_b][0] < best:
                    best = dp[big_b][0]
                    found = (per_pipe, dp[big_b][1], modes)

        def rec(cands, left, chosen):
            # No plan on these GPUs beats the model's FLOPs over their summed FLOP/s.
            if chosen and work / sum(self.cap[g] for c in chosen for g in c[0]) < best:
                # Every replica's split must give each layer the same TP degree.
                common = set(chosen[0][2])
                for c in chosen[1:]:
                    common &= set(c[2])
                for prof in sorted(common):
                    options = [[x for x in c[2][prof] if self.floor(c[0], x) < best] for c in chosen]
                    for splits in itertools.product(*options):
                        score([c[0] for c in chosen], splits)
            if len(chosen) >= big_b:
                return
            for idx, pipe in enumerate(cands):
                if pipe[3] >= best:  # no plan with this pipeline beats the best so far
                    continue
                rest = [b - a for a, b in zip(pipe[1], left, strict=True)]
                # Only pipelines that still fit the nodes' GPUs go further down.
                fit = [c for c in cands[idx:] if all(a <= b for a, b in zip(c[1], rest, strict=True))]
                chosen.append(pipe)
                rec(fit, rest, chosen)
                chosen.pop()

        rec(pipelines, budget, [])
        if found is None:
            return math.inf, None
        return best, self._plan(*found)

    def mode_choices(self, per_pipe):
        """Per pipeline, each stage's offload mode (None: any, host memory counted per GPU); as a node total,
        every assignment whose stages fit each node's RAM together."""
        if self.host == "gpu":
            yield (None,) * len(per_pipe)
            return
        stages = []  # (node index, GPUs, shape) per stage
        for seq, split, _ in per_pipe:
            for i, g in enumerate(seq):
                shape = cost.StageShape(split[i], i == 0, i == len(seq) - 1)
                stages.append((self.kinds[g][0], self.kinds[g][1], shape))
        caps = [n.host_mem * cost.GIB for n in self.nodes]
        for assign in itertools.product(MODES, repeat=len(stages)):
            used = [0.0] * len(self.nodes)
            for (node, t, shape), (opt, params) in zip(stages, assign, strict=True):
                if opt or params:
                    used[node] += t * cost.host_bytes(self.model, self.train, shape, t, cost.Knobs(0, opt, params))
            if any(u > c for u, c in zip(used, caps, strict=True)):
                continue
            out, at = [], 0
            for seq, _, _ in per_pipe:
                out.append(tuple(assign[at:at + len(seq)]))
                at += len(seq)
            yield tuple(out)

    def _plan(self, per_pipe, alloc, modes) -> Plan:
        taken = [0] * len(self.nodes)
        pipes = []
        for (seq, split, syncs), n, mode in zip(per_pipe, alloc, modes, strict=True):
            _, (b, m, knobs) = self.pipe_time(seq, split, n, syncs, mode)
            stages, at = [], 0
            for g, nl, kn in zip(seq, split, knobs, strict=True):
                node_i, t = self.kinds[g]
                node = self.nodes[node_i]
                devices = node.device_ids()[taken[node_i]:taken[node_i] + t]
                taken[node_i] += t
                stages.append(Stage(layer_start=at, layer_end=at + nl, gpu_type=node.gpu_type, node=node.name,
                                    devices=devices, offload=to_policy(kn, at)))
                at += nl
            pipes.append(Pipeline(num_samples=n, micro_batch_size=b, num_micro_batches=m, stages=stages))
        return Plan(model_name=self.model.name, num_layers=self.model.num_layers,
                    global_batch=self.train.global_batch, pipelines=pipes)
