"""Brute-force reference planner for the optimality test (lives in tests/, not the package).

It enumerates, independently of planner/search.py and planner/layer_split.py:
every TP degree; every multiset of pipelines, each an *ordered* sequence of TP
groups (all stage orders); every contiguous layer split; every offload mode per
stage (with the fewest recomputed layers that fit, which dominates more
recompute); every micro-batch size; and every split of the global batch.

The objective per pipeline is the same closed form `evaluate` uses. It
decomposes per pipeline, which is exact when gradient-sync bandwidth does not
depend on which node holds which layer: the test draws clusters whose
intra-node and inter-node bandwidths are equal.
"""

from __future__ import annotations

import itertools
import math
from functools import cache

from planner import cost
from planner.specs import ClusterSpec, ModelSpec, TrainSpec

MODES = ((False, False), (True, False), (True, True))


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def _min_recompute(slot, model, train, shape, b, k, opt, params):
    for r in range(shape.num_layers + 1):
        if cost.stage_memory(slot, model, train, shape, b, k, cost.Knobs(r, opt, params)) <= slot.mem_cap_bytes:
            return r
    return None


def best_step_time(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> float:
    return best_plan(cluster, model, train)[0]


def best_plan(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> tuple[float, str]:
    """(best step time, a description of the best layout: TP degree and pipelines as node lists)."""
    bw = cluster.nodes[0].inter_node_bw_gb_s * 1e9
    for n in cluster.nodes:
        assert n.intra_bw_gb_s * 1e9 == bw and n.inter_node_bw_gb_s * 1e9 == bw, "uniform bandwidth required"
    most = max(n.num_gpus for n in cluster.nodes)
    best, where = math.inf, ""
    for tp in [t for t in range(1, most + 1) if model.num_heads % t == 0 and model.ffn % t == 0]:
        kinds = []  # (slot, count) per node
        for node in cluster.nodes:
            if node.num_gpus // tp:
                kinds.append((cost.make_slot(cluster, train, node.name, tp), node.num_gpus // tp))
        if kinds:
            t, layout = _best_for_groups(kinds, model, train, bw)
            if t < best:
                names = [n.name for n in cluster.nodes if n.num_gpus // tp]
                best, where = t, f"tp={tp} pipelines={[[names[k] for k in seq] for seq in layout]}"
    return best, where


def _best_for_groups(kinds, model, train, bw) -> float:
    slots = [s for s, _ in kinds]
    counts = tuple(c for _, c in kinds)
    num_layers, big_b = model.num_layers, train.global_batch

    @cache
    def pipe_time(seq: tuple[int, ...], n: int, num_r: int) -> float:
        """Fastest finish of one pipeline (stage slots by kind index) on n samples."""
        p = len(seq)
        out = math.inf
        for b in range(1, min(n, train.max_micro_batch_size) + 1):
            m = math.ceil(n / b)
            sizes = [b] * (m - 1) + [n - (m - 1) * b]
            for split in _compositions(num_layers, p):
                per_stage = []
                for i, (kind, nl) in enumerate(zip(seq, split, strict=True)):
                    slot = slots[kind]
                    shape = cost.StageShape(nl, i == 0, i == p - 1)
                    k = cost.inflight(i, p, m, "1f1b")
                    opts = []
                    for opt, params in MODES:
                        r = _min_recompute(slot, model, train, shape, b, k, opt, params)
                        if r is None:
                            continue
                        kn = cost.Knobs(r, opt, params)
                        nxt = bw if i + 1 < p else None
                        prv = bw if i > 0 else None
                        ts = [cost.stage_times(slot, model, train, shape, x, k, kn, nxt, prv) for x in sizes]
                        opts.append((kn, ts))
                    if not opts:
                        break
                    per_stage.append((slot, shape, opts))
                else:
                    for choice in itertools.product(*[range(len(o)) for _, _, o in per_stage]):
                        out = min(out, _finish(per_stage, choice, model, train, num_r, bw))
        return out

    def _finish(per_stage, choice, model, train, num_r, bw):
        times = [per_stage[i][2][c][1] for i, c in enumerate(choice)]
        per_mb = [[t[j].fwd_s + t[j].bwd_s for t in times] for j in range(len(times[0]))]
        t_pipe = cost.pipeline_time(per_mb)
        fin = 0.0
        for i, c in enumerate(choice):
            slot, shape, opts = per_stage[i]
            kn, ts = opts[c]
            busy = sum(t.fwd_s + t.bwd_s for t in ts)
            fwd = sum(t.fwd_s for t in ts)
            sync = cost.sync_s(shape.params_per_device(model, slot.tp), train, num_r, bw)
            fin = max(fin, t_pipe + max(0.0, sync - ts[-1].bwd_s) + cost.optimizer_s(slot, model, train, shape, kn, busy, fwd))
        return fin

    # Every ordered pipeline, as a tuple of kind indices, that the group counts allow.
    pipelines = []
    for p in range(1, num_layers + 1):
        for seq in itertools.product(range(len(kinds)), repeat=p):
            if all(seq.count(k) <= counts[k] for k in range(len(kinds))):
                pipelines.append(seq)

    best, best_layout = math.inf, []

    def allocate(chosen: list[tuple[int, ...]]) -> float:
        num_r = len(chosen)
        if num_r > big_b:
            return math.inf
        dp = {0: 0.0}
        for seq in chosen:
            nxt: dict[int, float] = {}
            for s, mx in dp.items():
                for n in range(1, big_b - s + 1):
                    v = max(mx, pipe_time(seq, n, num_r))
                    if v < nxt.get(s + n, math.inf):
                        nxt[s + n] = v
            dp = nxt
        return dp.get(big_b, math.inf)

    def rec(start: int, left: list[int], chosen: list[tuple[int, ...]]):
        nonlocal best, best_layout
        if chosen:
            t = allocate(chosen)
            if t < best:
                best, best_layout = t, list(chosen)
        if len(chosen) >= big_b:
            return
        for idx in range(start, len(pipelines)):
            seq = pipelines[idx]
            need = [seq.count(k) for k in range(len(kinds))]
            if all(a <= b for a, b in zip(need, left, strict=True)):
                chosen.append(seq)
                rec(idx, [b - a for a, b in zip(need, left, strict=True)], chosen)
                chosen.pop()

    rec(0, list(counts), [])
    return best, best_layout
