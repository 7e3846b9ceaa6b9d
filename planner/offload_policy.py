"""Per-stage memory policy: the cheapest offload choice that fits (AutoHete §3).

Candidates, each with the fewest recomputed layers that make it fit:
  1. activations kept, or some layers recomputed;
  2. optimizer state (fp32 master + AdamW moments) in host memory;
  3. parameters in host memory too, prefetched `prefetch_depth` layers ahead.
The winner has the smallest stage cost m * (fwd + bwd) + optimizer time, so a
stage recomputes when recompute is cheaper than host traffic and offloads when
the host link and CPU can hide the work behind its compute.
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import product

import numpy as np

from planner import cost
from planner.estimate import profile_plan
from planner.plan_types import OffloadPolicy, Plan
from planner.specs import ClusterSpec, ModelSpec, TrainSpec

_MODES = ((False, False), (True, False), (True, True))


def _min_recompute(slot: cost.Slot, model: ModelSpec, train: TrainSpec, shape: cost.StageShape, b: int, k: int,
                   opt: bool, params: bool) -> int | None:
    """Fewest recomputed layers for which the stage fits; None if none does."""
    n = shape.num_layers
    mem0 = cost.stage_memory(slot, model, train, shape, b, k, cost.Knobs(0, opt, params))
    if mem0 <= slot.mem_cap_bytes:
        return 0
    full = model.seq_len * b * model.hidden_size * cost.act_units(model, slot.tp) * train.param_bytes / 2
    ckpt = model.seq_len * b * model.hidden_size * train.param_bytes
    saving = k * (full - ckpt)
    if n == 0 or saving <= 0:
        return None
    def fits(r: int) -> bool:
        return cost.stage_memory(slot, model, train, shape, b, k, cost.Knobs(r, opt, params)) <= slot.mem_cap_bytes

    # Each recomputed layer saves at most `saving`, so this is a lower bound. Up to n - 1 recomputed layers,
    # memory only falls with each one more (cost.stage_memory: the stored layers shrink faster than the
    # checkpoints grow), so the fewest that fit there are found by bisection; recomputing all n can cost a
    # checkpoint more than n - 1, so it is tried on its own.
    lo = max(1, math.ceil((mem0 - slot.mem_cap_bytes) / saving))
    if lo <= n - 1 and fits(n - 1):
        hi = n - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
        return lo
    return n if lo <= n and fits(n) else None


def fitting_policies(
    slot: cost.Slot, model: ModelSpec, train: TrainSpec, shape: cost.StageShape, b: int,
    inflight: int, p2p_next_bw: float | None, p2p_prev_bw: float | None,
) -> list[tuple[cost.Knobs, cost.StageTimes]]:
    """Each offload mode with its fewest recomputed layers that fit, and its micro-batch times."""
    out = []
    for opt, params in _MODES:
        if opt and cost.host_bytes(model, train, shape, slot.tp, cost.Knobs(0, opt, params)) > slot.host_cap_bytes:
            continue  # the offloaded state does not fit this GPU's share of its node's host memory
        r = _min_recompute(slot, model, train, shape, b, inflight, opt, params)
        if r is not None:
            kn = cost.Knobs(r, opt, params)
            out.append((kn, cost.stage_times(slot, model, train, shape, b, inflight, kn, p2p_next_bw, p2p_prev_bw)))
    return out


def cheapest(
    candidates: list[tuple[cost.Knobs, cost.StageTimes]], slot: cost.Slot, model: ModelSpec,
    train: TrainSpec, shape: cost.StageShape, num_mb: int,
) -> tuple[cost.Knobs, cost.StageTimes, float] | None:
    """The candidate with the smallest per-step stage cost m * (fwd + bwd) + optimizer time."""
    best = None
    for kn, t in candidates:
        busy = num_mb * (t.fwd_s + t.bwd_s)
        value = busy + cost.optimizer_s(slot, model, train, shape, kn, busy, num_mb * t.fwd_s)
        if best is None or value < best[2] * (1 - 1e-12):
            best = (kn, t, value)
    return best


def fitting_by_layers(slot: cost.Slot, model: ModelSpec, train: TrainSpec, first: bool, last: bool, b: int,
                      inflight: int, num_layers: int) -> _ByLayers:
    """`fitting_policies` without links for every stage of 1..num_layers layers at once: per mode of _MODES,
    whether it fits and its (recomputed layers, fwd, bwd, memory) by layer count; the counts whose fewest
    recomputed layers this closed form does not settle (the caller asks the scalar path); and the optimizer's
    time terms by layer count, for `cheapest_by_layers` (see _ByLayers). The
    formulas are cost.stage_memory's, cost.host_bytes's and cost.stage_times's in the same order of operations,
    so each figure equals the scalar one to the bit (tests/test_cost_model.py compares them)."""
    n = np.arange(1, num_layers + 1)
    tp, pb = slot.tp, train.param_bytes
    h, s = model.hidden_size, model.seq_len
    cap = slot.mem_cap_bytes
    layer_p = model.layer_params / tp
    edge_p = first * cost.embed_params_dev(model, tp) + last * cost.head_params_dev(model, tp)
    p_dev = n * layer_p + edge_p  # cost.stage_memory's
    p_shape = n * model.layer_params / tp + first * cost.embed_params_dev(model, tp) \
        + last * cost.head_params_dev(model, tp)  # params_per_device
    off_grads = cost.offload_grad_bytes(model, train, tp, True, first, last) + cost.fetch_staging(model, train, tp)
    in_bwd = cost.grad_bucket(model, tp, True, first, last) * pb  # cost.stage_memory's, under optimizer offload
    full = s * b * h * cost.act_units(model, tp) * pb / 2
    ckpt = s * b * h * pb
    saving = inflight * (full - ckpt)
    logits = s * b * cost.vocab_rows(model, tp) * cost.head_bytes(train) if last else 0.0
    eff = slot.flops_per_gpu * cost._util(b * s)
    lf = cost.layer_fwd_flops(model, b)
    fwd_c = (n * lf / tp + last * cost.head_fwd_flops(model, b, tp)) / eff
    tp_comm = n * 2 * cost._allreduce_s(s * b * h * pb, tp, slot.intra_bw)
    fwd0 = fwd_c + tp_comm
    bwd0 = 2 * fwd_c + 0.0 + tp_comm * (1 + 0 / n)
    per_mb0 = n * full + 0 * ckpt
    acts0 = (inflight - 1) * per_mb0 + (per_mb0 + logits)
    masters = 0 if pb < 4 else pb
    host_ok = ~(p_shape * (train.optimizer_bytes_per_param + train.grad_bytes + masters) > slot.host_cap_bytes)
    p_pb, p_grad, p_opt = p_dev * pb, p_dev * train.grad_bytes, p_dev * train.optimizer_bytes_per_param
    prefetched = (np.minimum(n, 2) * layer_p + edge_p) * pb  # prefetch_depth 1
    unsettled = np.zeros(num_layers, dtype=bool)
    got = _ByLayers(num_layers)
    for mi, (opt, params) in enumerate(_MODES):
        static = (prefetched if params else p_pb) + (off_grads if opt else p_grad) + (0.0 if opt else p_opt)
        mem = static + acts0
        fits = mem <= cap
        r = np.zeros(num_layers, dtype=np.int64)
        ok = host_ok if opt else None
        if saving > 0 and not fits.all():
            lo = np.maximum(1, np.ceil((mem - cap) / saving)).astype(np.int64)
            r_lo = np.minimum(lo, n)
            per_mb = (n - r_lo) * full + r_lo * ckpt
            mem_lo = static + ((inflight - 1) * per_mb + np.maximum(per_mb + logits,
                                                                     r_lo * ckpt + full + (in_bwd if opt else 0.0)))
            fit_lo = ~fits & (lo <= n) & (mem_lo <= cap)  # the bound is the answer where it fits; lo == n alone
            unsettled |= ~fits & (lo <= n - 1) & ~(mem_lo <= cap) & (host_ok if opt else True)
            r = np.where(fit_lo, lo, 0)
            mem = np.where(fit_lo, mem_lo, mem)
            fits = fits | fit_lo
            rec_c = r * lf / tp / eff
            fwd, bwd = fwd0, 2 * fwd_c + rec_c + tp_comm * (1 + r / n)
        else:
            fwd, bwd = fwd0, bwd0
        if ok is not None:
            fits = fits & ok
        if params:
            h2d = p_shape * train.grad_bytes / slot.host_link  # cost.stage_times's: fp32 masters, cast on the device
            fwd, bwd = np.maximum(fwd, h2d), np.maximum(bwd, h2d)
        if fits.any():
            got.fits[mi], got.rec[mi], got.fwd[mi], got.bwd[mi], got.mem[mi] = fits, r, fwd, bwd, mem
            got.modes[mi] = True
        if opt:
            d2h, h2d, cpu = cost.offload_lanes(slot, train, params, p_shape)
            first_p = cost.embed_params_dev(model, tp) if first else layer_p  # cost.first_layer_share's numerator
            got.d2h[mi - 1], got.lanes[mi - 1] = d2h, np.maximum(h2d, cpu)
            got.tail[mi - 1] = (d2h + cpu + h2d) * (first_p / p_shape)  # cost.first_layer_share
    got.unsettled = unsettled
    got.resident = p_shape * 2 * (2 * pb + train.optimizer_bytes_per_param) / slot.mem_bw  # cost.optimizer_s, kept
    return got


class _ByLayers:
    """`fitting_by_layers`'s result, as (modes, counts) arrays for `cheapest_by_layers`: per mode of _MODES
    (`modes`: whether it fits any count; where it fits none, its row's `fits` are all False) and layer count,
    whether it fits, its fewest recomputed layers, fwd, bwd and memory; the counts the closed form leaves to
    the scalar path (`unsettled`); and what the stage cost needs that depends neither on the links nor on the
    micro-batch count: the resident optimizer's time, and per offloaded mode (the rows of _MODES after the
    first) the optimizer lanes' d2h, max(h2d, cpu) and tail (cost.offload_lanes, cost.first_layer_share)."""

    __slots__ = ("modes", "unsettled", "fits", "rec", "fwd", "bwd", "mem", "resident", "d2h", "lanes", "tail")

    def __init__(self, num_layers: int):
        k, n = len(_MODES), num_layers
        assert [opt for opt, _ in _MODES] == [False] + [True] * (k - 1), "the resident mode comes first"
        self.modes = [False] * k
        self.fits, self.rec = np.zeros((k, n), dtype=bool), np.zeros((k, n), dtype=np.int64)
        self.fwd, self.bwd, self.mem = np.zeros((k, n)), np.zeros((k, n)), np.zeros((k, n))
        self.d2h, self.lanes, self.tail = np.zeros((k - 1, n)), np.zeros((k - 1, n)), np.zeros((k - 1, n))
        self.unsettled, self.resident = np.zeros(n, dtype=bool), np.zeros(n)


def cheapest_by_layers(fitting: _ByLayers, slot: cost.Slot, model: ModelSpec, train: TrainSpec,
                       b: int, num_mb: int, p2p_next_bw: float | None, p2p_prev_bw: float | None,
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`cheapest` over `fitting_by_layers`'s policies with a position's links (cost.with_links) for every layer
    count at once, to the bit as the scalar path. Returns per count (mode index into _MODES, -1 where nothing
    fits, -2 where the scalar path must settle it), recomputed layers, fwd, bwd, memory and stage cost. Every
    mode is costed in one pass over (modes, counts) arrays; the modes are then compared in _MODES's order, a
    later one taken only where it is cheaper by more than 1e-12 (as `cheapest` does)."""
    k = len(fitting.unsettled)
    if not any(fitting.modes):
        return np.full(k, -1), np.zeros(k, dtype=np.int64), np.zeros(k), np.zeros(k), np.zeros(k), np.zeros(k)
    act_bytes = model.seq_len * b * model.hidden_size * train.param_bytes
    fwd, bwd = fitting.fwd, fitting.bwd
    if p2p_next_bw:
        fwd = fwd + act_bytes / p2p_next_bw
    if p2p_prev_bw:
        bwd = bwd + act_bytes / p2p_prev_bw
    busy = num_mb * (fwd + bwd)
    value = np.empty_like(busy)
    value[0] = busy[0] + fitting.resident
    fwd_busy = num_mb * fwd[1:]
    off = busy[1:]
    value[1:] = off + (np.maximum(np.maximum(0.0, fitting.d2h - (off - fwd_busy)), fitting.lanes - fwd_busy)
                       + fitting.tail)
    fits = fitting.fits
    mode = np.where(fits[0], 0, -1)
    v0 = np.where(fits[0], value[0], np.inf)
    for mi in range(1, len(_MODES)):
        take = fits[mi] & ((mode < 0) | (value[mi] < v0 * (1 - 1e-12)))
        mode = np.where(take, mi, mode)
        v0 = np.where(take, value[mi], v0)
    at = (np.maximum(mode, 0), np.arange(k))  # where nothing fits the figures are unread: mode 0's
    return (np.where(fitting.unsettled, -2, mode), fitting.rec[at], fwd[at], bwd[at], fitting.mem[at], v0)


def _cost_of(kn: cost.Knobs, t: cost.StageTimes, slot: cost.Slot, model: ModelSpec, train: TrainSpec,
             shape: cost.StageShape, num_mb: int) -> float:
    """A fitting policy's per-step cost (`cheapest` of it alone)."""
    got = cheapest([(kn, t)], slot, model, train, shape, num_mb)
    assert got is not None, "a fitting policy has a cost"
    return got[2]


def to_policy(kn: cost.Knobs, layer_start: int) -> OffloadPolicy:
    """The Plan's policy for a stage starting at `layer_start` (recompute its first layers)."""
    return OffloadPolicy(
        recompute_layers=list(range(layer_start, layer_start + kn.num_recompute)),
        offload_optimizer=kn.offload_optimizer,
        offload_params=kn.offload_params,
        prefetch_depth=kn.prefetch_depth,
        reason=_reason(kn),
    )


def _reason(kn: cost.Knobs) -> str:
    if kn.offload_params:
        # chosen as the cheapest that fits: either nothing else fits, or its prefetch hides behind enough micro-batches
        return "weights and optimizer in host memory, prefetched: the cheapest choice that fits"
    if kn.offload_optimizer:
        if kn.num_recompute:
            return "needs optimizer offload and recompute to fit"
        return "optimizer offload hides behind compute more cheaply than recompute"
    if kn.num_recompute:
        return f"recomputing {kn.num_recompute} layer(s) is the cheapest way to fit activations"
    return "fits without offload"


JOINT_MOST = 4096  # mode combinations tried per node by `share_node_host` (3 modes per stage: 7 stages)


def share_node_host(plan: Plan, cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> bool:
    """Host memory is a node total: re-choose, jointly, the offload policy of the stages that share a node
    whose offloaded state overflows its RAM (AutoHete's per-stage choice, under one budget per node).

    The search costs each stage against its GPUs' even share of the node's RAM, or against the whole of it
    (`search.Planner.candidates` tries both); a plan of the second kind can overflow where two stages
    offload on one node. Every combination of the overflowing node's stages' fitting modes (each with its
    fewest recomputed layers) is tried, and the one with the smallest summed stage cost within the node's
    RAM wins. Edits `plan` in place; True if every node now fits."""
    profiles = profile_plan(plan, cluster, model, train)
    where: dict[str, list] = {}
    for pipe, prof in zip(plan.pipelines, profiles, strict=True):
        links = cost.stage_links([sp.slot for sp in prof])
        for i, (st, sp) in enumerate(zip(pipe.stages, prof, strict=True)):
            k = cost.inflight(i, len(pipe.stages), pipe.num_micro_batches, pipe.schedule)
            where.setdefault(st.node, []).append((pipe, st, sp, k, links[i]))
    for node, stages in sorted(where.items()):
        cap = cluster.node(node).host_mem * cost.GIB

        def used(kns: list[cost.Knobs], stages: list = stages) -> float:
            return sum(len(st.devices) * cost.host_bytes(model, train, sp.shape, st.tp, kn)
                       for (_, st, sp, _, _), kn in zip(stages, kns, strict=True))

        if used([cost.knobs(st.offload) for _, st, _, _, _ in stages]) <= cap:
            continue
        options = []
        for pipe, _, sp, k, (nxt, prv) in stages:
            whole = replace(sp.slot, host_cap_bytes=cap)
            b = pipe.micro_batch_size
            cands = fitting_policies(whole, model, train, sp.shape, b, k, nxt, prv)
            options.append([(_cost_of(kn, t, whole, model, train, sp.shape, pipe.num_micro_batches), kn)
                            for kn, t in cands])
        if not all(options) or math.prod(len(o) for o in options) > JOINT_MOST:
            return False
        best = None
        for combo in product(*options):
            kns = [kn for _, kn in combo]
            if used(kns) <= cap:
                value = sum(v for v, _ in combo)
                if best is None or value < best[0]:
                    best = (value, kns)
        if best is None:
            return False
        for (_, st, _, _, _), kn in zip(stages, best[1], strict=True):
            st.offload = to_policy(kn, st.layer_start)
    return True
