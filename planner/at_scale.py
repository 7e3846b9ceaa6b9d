"""The cost model for the symmetric layouts large published runs use: interleaved 1F1B, sequence parallelism
and a ZeRO-1 distributed optimizer.

hetspot's own search prices the plans its engine runs (asymmetric replicas, uneven splits, plain 1F1B, one
optimizer copy per replica: planner/cost.py). The runs people publish at thousands of GPUs use three things
more, and priced without them their plans come out half as fast as they ran (Llama 3 405B at 16,384 H100:
0.40 of its published MFU). This module prices such a layout from the same primitives as cost.py (the FLOPs
of a layer and of the head, the micro-batch GEMM efficiency `_util`, the ring all-reduce, Korthikanti et
al.'s activation bytes, the per-type efficiency of the catalog) and adds:

- **Interleaved 1F1B** (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", section 2.2.2): each device holds `v` model chunks; the bubble shrinks from
  (p - 1) to (p - 1) / v micro-batch times, and each micro-batch crosses v times as many stage boundaries.
- **Sequence parallelism** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models"): the layer norms' and dropouts' activations are split over the TP group too
  (34/t bytes per element instead of 10 + 24/t); TP's all-reduces become a reduce-scatter and an all-gather
  of the same volume.
- **A ZeRO-1 distributed optimizer** (Rajbhandari et al. 2020, ZeRO stage 1; Megatron-LM's
  `--use-distributed-optimizer`): optimizer state split over the data-parallel group; gradients
  reduce-scattered (fp32) and parameters all-gathered (16-bit) instead of one all-reduce, both overlapped
  with compute except the last micro-batch's share.
- **Communication overlap**: TP collectives overlapped with the GEMMs (Megatron-LM's `--tp-comm-overlap`)
  leave only what exceeds the compute they hide behind; pipeline sends are asynchronous.

Activation recompute is chosen as hetspot's planner chooses it: the fewest recomputed layers per stage that
fit the device (the first stage holds the most micro-batches in flight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner import cost
from planner.catalog import gpu_info
from planner.specs import ModelSpec, TrainSpec


@dataclass(frozen=True)
class Layout:
    """A symmetric published layout: every replica alike, every stage alike (the last one also holds the head)."""

    gpu_type: str
    tp: int
    pp: int
    dp: int
    micro_batch: int = 1
    virtual_stages: int | None = None  # interleaved 1F1B: model chunks per device (1: plain 1F1B; None: the
    # fastest that fits, among the divisors of a stage's layers, as a tuned run would pick it)
    sequence_parallel: bool = True
    distributed_optimizer: bool = True  # ZeRO-1 over the data-parallel group
    tp_overlap: bool = True  # TP collectives overlapped with the GEMMs
    full_recompute: bool = False  # every layer recomputed (Narayanan et al. 2021's runs); else the fewest that fit
    nic_gb_s: float = 50.0  # one GPU's share of its node's network (rail-optimized: a 400 Gb/s NIC per GPU)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class LayoutEstimate:
    step_s: float
    mfu: float
    hfu: float  # hardware FLOPs utilisation: recomputed forwards counted too (Narayanan et al. 2021's figure)
    tokens_per_s: float
    virtual_stages: int
    recompute_layers: int  # per stage (the first stage's: it holds the most micro-batches in flight)
    bubble: float  # the pipeline's idle share of the step
    mem_gib: float  # the first stage's peak per device
    fits: bool  # False: even with every layer recomputed the first stage overflows its GPU

    def utilisation(self, metric: str) -> float:
        """"mfu", or "hfu" (recomputed forwards counted as work)."""
        return self.hfu if metric == "hfu" else self.mfu


def estimate_layout(layout: Layout, model: ModelSpec, train: TrainSpec, efficiency: float | None = None
                    ) -> LayoutEstimate:
    """One training step of `layout` (train.global_batch samples), at the GPU type's catalog efficiency unless
    `efficiency` is given (bench/calibration.py fits it on a training split of published runs)."""
    d, b = layout.dp, layout.micro_batch
    if train.global_batch % (d * b):
        raise ValueError(f"global batch {train.global_batch} is not a multiple of dp x micro-batch ({d} x {b})")
    n = math.ceil(model.num_layers / layout.pp)  # the busiest stage's layers
    if layout.virtual_stages is not None:
        if not 1 <= layout.virtual_stages <= n:
            raise ValueError(f"virtual_stages={layout.virtual_stages}: a stage of {n} layers takes 1 to {n} chunks")
        return _estimate(layout, layout.virtual_stages, model, train, efficiency)
    found = [_estimate(layout, v, model, train, efficiency) for v in range(1, n + 1) if n % v == 0]
    return min(found, key=lambda e: (not e.fits, e.step_s))


def _estimate(layout: Layout, v: int, model: ModelSpec, train: TrainSpec, efficiency: float | None
              ) -> LayoutEstimate:
    info = gpu_info(layout.gpu_type)
    t, p, d, b = layout.tp, layout.pp, layout.dp, layout.micro_batch
    m = train.global_batch // (d * b)
    eff = info.default_efficiency if efficiency is None else efficiency
    peak = cost.peak_flops(layout.gpu_type)
    flops = peak * eff * cost._util(b * model.seq_len)
    h, s, pb = model.hidden_size, model.seq_len, train.param_bytes
    n = math.ceil(model.num_layers / p)
    layer_f = cost.layer_fwd_flops(model, b) / t / flops
    head_f = cost.head_fwd_flops(model, b) / t / flops  # vocab-parallel head (Megatron-LM shards it over TP)
    # TP: two collectives per layer in forward and two in backward, of one micro-batch's activations (with
    # sequence parallelism a reduce-scatter and an all-gather: the same volume as cost.py's all-reduce)
    act = s * b * h * pb
    tp_c = 2 * cost._allreduce_s(act, t, info.intra_node_bw_gb_s * 1e9)
    # Memory of a first-stage device: 16-bit weights, fp32 gradients, the optimizer split over dp with ZeRO-1
    params = n * model.layer_params / t + model.embed_params / t
    static = params * (pb + train.grad_bytes) + params * train.optimizer_bytes_per_param / (
        d if layout.distributed_optimizer else 1)
    units = 34.0 / t if layout.sequence_parallel else cost.act_units(model, t)
    full = s * b * h * units * pb / 2  # a layer's stored activations for one micro-batch (cost.stage_memory's)
    ckpt = s * b * h * pb / (t if layout.sequence_parallel else 1)  # a recomputed layer keeps its input
    # in flight on the first device: p micro-batches under 1F1B; interleaved, its warm-up runs (p - 1) / v more
    # chunks' worth (Narayanan et al. 2021, section 2.2.2)
    inflight = min(m, p) * (1 + ((p - 1) / (p * v) if v > 1 else 0.0))
    budget = cost.device_budget_bytes(layout.gpu_type, train)
    r = n if layout.full_recompute else next(
        (r for r in range(n + 1) if static + inflight * ((n - r) * full + r * ckpt) <= budget), n)
    mem = static + inflight * ((n - r) * full + r * ckpt)
    tp_exposed = n * tp_c
    if layout.tp_overlap:  # hidden behind the layer's GEMMs, up to their length
        tp_exposed = n * max(0.0, tp_c - layer_f)
    fwd = n * layer_f + tp_exposed
    bwd = 2 * n * layer_f + r * layer_f + tp_exposed * (1 + r / n)
    per_mb = fwd + bwd + 3 * head_f  # the last stage paces: its layers and the head
    # pipeline sends, each way per chunk boundary: one micro-batch's activations, each TP rank sending its 1/t
    # over its own NIC (Narayanan et al. 2021, section 4.1, the scatter/gather optimization; with SP they are
    # split already)
    p2p = 2 * v * act / t / (layout.nic_gb_s * 1e9) if p > 1 else 0.0
    bubble_mb = (p - 1) / v
    pipe = (m + bubble_mb) * (per_mb + p2p)
    # Data parallel, overlapped as Megatron-LM's --overlap-grad-reduce / --overlap-param-gather do: the fp32
    # gradients' reduce-scatter (or all-reduce, without ZeRO-1) under the last micro-batch's backward, the
    # 16-bit parameters' all-gather under the next step's first forwards (up to p before a first backward)
    dp_exposed = 0.0
    if d > 1:
        bw = layout.nic_gb_s * 1e9
        if layout.distributed_optimizer:
            rs = (d - 1) / d * params * train.grad_bytes / bw
            ag = (d - 1) / d * params * pb / bw
        else:
            rs, ag = cost.sync_s(params, train, d, bw), 0.0
        dp_exposed = max(0.0, rs - bwd) + max(0.0, ag - min(m, p) * fwd)
    opt_s = params / (d if layout.distributed_optimizer else 1) * 2 * (2 * pb + train.optimizer_bytes_per_param) \
        / (info.mem_bw_gb_s * 1e9)
    step = pipe + dp_exposed + opt_s
    mfu = cost.model_flops_per_sample(model) * train.global_batch / step / (peak * layout.gpus)
    recomputed = r / n * model.num_layers * cost.layer_fwd_flops(model, 1) * train.global_batch
    hfu = mfu + recomputed / step / (peak * layout.gpus)
    return LayoutEstimate(step_s=step, mfu=mfu, hfu=hfu, tokens_per_s=train.global_batch * s / step, virtual_stages=v,
                          recompute_layers=r, bubble=bubble_mb / (m + bubble_mb), mem_gib=mem / cost.GIB,
                          fits=mem <= budget)
