"""Brute-force reference planner for the optimality test (lives in tests/, not the package).

It enumerates, independently of planner/search.py and planner/layer_split.py,
every plan of one TP degree per plan:
  - every TP degree that divides the model (powers of two or not) and fits a node;
  - every multiset of pipelines, each an *ordered* sequence of TP groups named by
    their node (groups on one node are interchangeable; groups on different nodes
    are not, even of one GPU type, since their links differ);
  - every contiguous layer split of every pipeline, chosen jointly: a layer's
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
per GPU (each GPU's offloaded state within its share of the node's RAM), as the
planner does.

`bound`: the caller's time to beat; branches that cannot beat it are cut (the
search stays exhaustive for every plan faster than `bound`).
"""

from __future__ import annotations

import itertools
import math
from functools import cache

from planner import cost
from planner.contract import tp_problem
from planner.offload_policy import to_policy
from planner.plan_types import Pipeline, Plan, Stage
from planner.specs import ClusterSpec, ModelSpec, TrainSpec

MODES = ((False, False), (True, False), (True, True))


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def best_plan(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec,
              bound: float = math.inf) -> tuple[float, Plan | None]:
    """(best step time, its Plan), or (inf, None) when no plan beats `bound`."""
    best, best_plan_ = bound, None
    most = max(n.num_gpus for n in cluster.nodes)
    for tp in range(1, most + 1):
        if tp_problem(model, tp) is not None:
            continue
        nodes = [n for n in cluster.nodes if n.num_gpus // tp]
        if not nodes:
            continue
        t, p = _Enum(cluster, model, train, tp, nodes).run(best)
        if p is not None and t < best:
            best, best_plan_ = t, p
    return (best, best_plan_) if best_plan_ is not None else (math.inf, None)


class _Enum:
    def __init__(self, cluster, model, train, tp, nodes):
        self.cluster, self.model, self.train, self.tp, self.nodes = cluster, model, train, tp, nodes
        self.slots = [cost.make_slot(cluster, train, n.name, tp) for n in nodes]
        self.counts = [n.num_gpus // tp for n in nodes]
        self.pipe_time = cache(self._pipe_time)

    def bw_of(self, idx: frozenset[int]) -> float:
        if len(idx) == 1:
            return self.slots[next(iter(idx))].intra_bw
        return min(self.slots[i].inter_bw for i in idx)

    def _stage_opts(self, seq, split, i, b, m):
        """Per offload mode that fits stage i at micro-batch b: (knobs, {size: StageTimes})."""
        model, train = self.model, self.train
        p = len(seq)
        slot = self.slots[seq[i]]
        shape = cost.StageShape(split[i], i == 0, i == p - 1)
        k = cost.inflight(i, p, m, "1f1b")
        nxt = cost.link_bw(slot, self.slots[seq[i + 1]]) if i + 1 < p else None
        prv = cost.link_bw(slot, self.slots[seq[i - 1]]) if i > 0 else None
        out = []
        for opt, params in MODES:
            kn0 = cost.Knobs(0, opt, params)
            if (opt or params) and cost.host_bytes(model, train, shape, self.tp, kn0) > slot.host_cap_bytes:
                continue
            for r in range(split[i] + 1):
                kn = cost.Knobs(r, opt, params)
                if cost.stage_memory(slot, model, train, shape, b, k, kn) <= slot.mem_cap_bytes:
                    out.append((kn, slot, shape, nxt, prv, k))
                    break
        return out

    def _pipe_time(self, seq, split, n, num_r, syncs):
        """(fastest finish of one pipeline on n samples, (b, m, knobs per stage)); syncs: gradient-sync seconds
        per stage before overlap."""
        best = (math.inf, None)
        for b in range(1, min(n, self.train.max_micro_batch_size) + 1):
            m = math.ceil(n / b)
            sizes = [b] * (m - 1) + [n - (m - 1) * b]
            stages = []
            for i in range(len(seq)):
                opts = []
                for kn, slot, shape, nxt, prv, k in self._stage_opts(seq, split, i, b, m):
                    ts = [cost.stage_times(slot, self.model, self.train, shape, x, k, kn, nxt, prv) for x in sizes]
                    busy = sum(t.fwd_s + t.bwd_s for t in ts)
                    fwd = sum(t.fwd_s for t in ts)
                    extra = max(0.0, syncs[i] - ts[-1].bwd_s) + cost.optimizer_s(
                        slot, self.model, self.train, shape, kn, busy, fwd)
                    opts.append((kn, [t.fwd_s + t.bwd_s for t in ts], extra))
                if not opts:
                    break
                stages.append(opts)
            else:
                for choice in itertools.product(*stages):
                    t_pipe = cost.pipeline_time([[c[1][j] for c in choice] for j in range(m)])
                    t = t_pipe + max(c[2] for c in choice)
                    if t < best[0]:
                        best = (t, (b, m, tuple(c[0] for c in choice)))
        return best

    def run(self, bound: float) -> tuple[float, Plan | None]:
        num_layers, big_b = self.model.num_layers, self.train.global_batch
        k = len(self.nodes)
        pipelines = [seq for p in range(1, num_layers + 1) for seq in itertools.product(range(k), repeat=p)
                     if all(seq.count(j) <= self.counts[j] for j in range(k))]
        best, found = bound, None
        layer_p = self.model.layer_params / self.tp

        def score(chosen, splits):
            nonlocal best, found
            num_r = len(chosen)
            holders = [set() for _ in range(num_layers)]
            firsts, lasts = set(), set()
            for seq, split in zip(chosen, splits, strict=True):
                at = 0
                for node, nl in zip(seq, split, strict=True):
                    for layer in range(at, at + nl):
                        holders[layer].add(node)
                    at += nl
                firsts.add(seq[0])
                lasts.add(seq[-1])
            bws = [self.bw_of(frozenset(h)) for h in holders]
            embed_bw, head_bw = self.bw_of(frozenset(firsts)), self.bw_of(frozenset(lasts))
            per_pipe = []
            for seq, split in zip(chosen, splits, strict=True):
                syncs, at = [], 0
                for i, nl in enumerate(split):
                    s = sum(cost.sync_s(layer_p, self.train, num_r, bws[layer]) for layer in range(at, at + nl))
                    if i == 0:
                        s += cost.sync_s(self.model.embed_params, self.train, num_r, embed_bw)
                    if i == len(split) - 1:
                        s += cost.sync_s(self.model.head_params, self.train, num_r, head_bw)
                    syncs.append(round(s, 15))
                    at += nl
                per_pipe.append((seq, split, tuple(syncs)))
            # Min-max split of the global batch, every pipeline at least one sample.
            dp = {0: (0.0, ())}
            for r, (seq, split, syncs) in enumerate(per_pipe):
                left = num_r - r - 1
                nxt = {}
                for s, (mx, alloc) in dp.items():
                    for n in range(1, big_b - s - left + 1):
                        v = max(mx, self.pipe_time(seq, split, n, num_r, syncs)[0])
                        if v < best and v < nxt.get(s + n, (math.inf,))[0]:
                            nxt[s + n] = (v, alloc + (n,))
                dp = nxt
            if big_b in dp and dp[big_b][0] < best:
                best = dp[big_b][0]
                found = (per_pipe, dp[big_b][1])

        def rec(start, left, chosen):
            if chosen:
                for splits in itertools.product(*[list(_compositions(num_layers, len(s))) for s in chosen]):
                    score(chosen, splits)
            if len(chosen) >= big_b:
                return
            for idx in range(start, len(pipelines)):
                seq = pipelines[idx]
                need = [seq.count(j) for j in range(k)]
                if all(a <= b for a, b in zip(need, left, strict=True)):
                    chosen.append(seq)
                    rec(idx, [b - a for a, b in zip(need, left, strict=True)], chosen)
                    chosen.pop()

        rec(0, list(self.counts), [])
        if found is None:
            return math.inf, None
        return best, self._plan(*found)

    def _plan(self, per_pipe, alloc) -> Plan:
        num_r = len(per_pipe)
        taken = [0] * len(self.nodes)
        pipes = []
        for (seq, split, syncs), n in zip(per_pipe, alloc, strict=True):
            _, (b, m, knobs) = self.pipe_time(seq, split, n, num_r, syncs)
            stages, at = [], 0
            for node_i, nl, kn in zip(seq, split, knobs, strict=True):
                node = self.nodes[node_i]
                g = taken[node_i]
                taken[node_i] += 1
                devices = node.device_ids()[g * self.tp:(g + 1) * self.tp]
                stages.append(Stage(layer_start=at, layer_end=at + nl, gpu_type=node.gpu_type, node=node.name,
                                    devices=devices, offload=to_policy(kn, at)))
                at += nl
            pipes.append(Pipeline(num_samples=n, micro_batch_size=b, num_micro_batches=m, stages=stages))
        return Plan(model_name=self.model.name, num_layers=self.model.num_layers,
                    global_batch=self.train.global_batch, pipelines=pipes)
