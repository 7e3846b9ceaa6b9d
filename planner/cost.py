"""Cost model: per-stage time and memory, and `evaluate(plan) -> Estimate`.

Everything is a pure function of the specs. The same functions serve the search
(planner/search.py), the closed-form estimate here, and the discrete-event
simulator (planner/simulator.py), so the three cannot drift apart.

Sources for the formulas:
- FLOPs: 2 * params * tokens for the GEMMs plus 4 * s^2 * h per sample for
  attention scores and values; backward = 2x forward (Narayanan et al. 2021).
- Activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation"),
  s*b*h*(10 + 24/t) bytes per layer in 16-bit with TP degree t; fused SDPA removes
  the 5*a*s/h score term. A recomputed layer keeps only its input (s*b*h).
- Layer-wise gradient all-reduce across asymmetric replicas, overlapped with the
  backward of the last micro-batch (AutoHet §4).
- Host offload overlapped across iterations: transfers and the CPU AdamW hide
  behind the stage's compute; only the first layer's update is exposed
  (AutoHete §4, cross-iteration overlap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from planner.catalog import gpu_info
from planner.plan_types import OffloadPolicy, Plan
from planner.specs import ClusterSpec, ModelSpec, NodeSpec, TrainSpec

GIB = float(1 << 30)
RECOVERY_S = 60.0  # a preemption's cost beyond the redone work: detection, new workers, restore (a GPU fleet's order)
_UTIL_HALF_TOKENS = 256.0  # micro-batch tokens at which a GEMM reaches half its peak efficiency


class Knobs(NamedTuple):
    """The offload policy as plain numbers, for the search's hot path."""

    num_recompute: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    prefetch_depth: int = 1


def knobs(policy: OffloadPolicy) -> Knobs:
    return Knobs(len(policy.recompute_layers), policy.offload_optimizer, policy.offload_params, policy.prefetch_depth)


@dataclass(frozen=True)
class Slot:
    """The hardware behind one stage: a TP group of `tp` GPUs on one node."""

    gpu_type: str
    node: str
    tp: int
    flops_per_gpu: float  # peak * efficiency, FLOP/s
    peak_flops_per_gpu: float
    mem_cap_bytes: float  # capacity minus reserve
    mem_bw: float  # bytes/s
    host_link: float  # bytes/s
    intra_bw: float
    inter_bw: float
    cpu_adam_per_gpu: float  # params/s of host AdamW available to one GPU
    host_cap_bytes: float = math.inf  # one GPU's share of its node's host RAM, for offloaded state


def hardware(slot: Slot) -> Slot:
    """The slot without its node's name: what every cost depends on (links come separately)."""
    return replace(slot, node="")


_HARDWARE_IDS: dict[Slot, int] = {}
_SLOT_IDS: dict[Slot, int] = {}  # the same, by the slot itself: `replace` is slow and a re-plan asks per group


def hardware_id(slot: Slot) -> int:
    """`hardware(slot)` as a small int, for the search's cache keys (an int hashes faster than a slot)."""
    got = _SLOT_IDS.get(slot)
    if got is None:
        got = _SLOT_IDS[slot] = _HARDWARE_IDS.setdefault(hardware(slot), len(_HARDWARE_IDS))
    return got


def device_budget_bytes(gpu_type: str, train: TrainSpec) -> float:
    """What the planner lets a stage use on one GPU: its memory minus `train.memory_reserve_gib`."""
    return (gpu_info(gpu_type).mem_gib - train.memory_reserve_gib) * GIB


def peak_flops(gpu_type: str) -> float:
    """Datasheet peak FLOP/s of one GPU (dense bf16, or fp16 where there is no bf16)."""
    return gpu_info(gpu_type).peak_tflops * 1e12


def plan_peak_flops(plan: Plan) -> float:
    """Sum of datasheet peaks over every GPU the plan uses: the MFU denominator."""
    return sum(peak_flops(st.gpu_type) * st.tp for p in plan.pipelines for st in p.stages)


_SLOTS: dict[tuple, Slot] = {}


def make_slot(cluster: ClusterSpec, train: TrainSpec, node_name: str, tp: int) -> Slot:
    node = cluster.node(node_name)
    key = (node, tp, cluster.efficiency(node.gpu_type), train)  # a slot is a function of these alone
    got = _SLOTS.get(key)
    if got is None:
        if len(_SLOTS) > 200_000:
            _SLOTS.clear()
        got = _SLOTS[key] = _make_slot(cluster, train, node, tp)
    return got


def _make_slot(cluster: ClusterSpec, train: TrainSpec, node: NodeSpec, tp: int) -> Slot:
    info = gpu_info(node.gpu_type)
    peak = peak_flops(node.gpu_type)
    return Slot(
        gpu_type=node.gpu_type,
        node=node.name,
        tp=tp,
        flops_per_gpu=peak * cluster.efficiency(node.gpu_type),
        peak_flops_per_gpu=peak,
        mem_cap_bytes=device_budget_bytes(node.gpu_type, train),
        mem_bw=info.mem_bw_gb_s * 1e9,
        host_link=info.host_link_gb_s * 1e9,
        intra_bw=node.intra_bw_gb_s * 1e9,
        inter_bw=node.inter_node_bw_gb_s * 1e9,
        cpu_adam_per_gpu=node.cpu_adam_params_per_s / node.num_gpus,
        host_cap_bytes=node.host_mem * GIB / node.num_gpus,
    )


def sync_group_bw(cluster: ClusterSpec, nodes: set[str]) -> float:
    """A gradient-sync group's bandwidth: its node's intra-node link if it is on one node, else the slowest of
    its nodes' NICs (bytes/s)."""
    if len(nodes) == 1:
        return cluster.node(next(iter(nodes))).intra_bw_gb_s * 1e9
    return min(map(cluster.nics().__getitem__, nodes)) * 1e9


def link_bw(a: Slot, b: Slot) -> float:
    return a.intra_bw if a.node == b.node else min(a.inter_bw, b.inter_bw)


def stage_links(slots: list[Slot]) -> list[tuple[float | None, float | None]]:
    """Per stage of a pipeline: (bandwidth to the next stage, to the previous one); None at the ends."""
    p = len(slots)
    return [(link_bw(slots[i], slots[i + 1]) if i + 1 < p else None,
             link_bw(slots[i], slots[i - 1]) if i > 0 else None) for i in range(p)]


def act_units(model: ModelSpec, tp: int) -> float:
    """A block's stored activations per token, in units of h 16-bit values (Korthikanti et al.'s 10 + 24/t for
    the GPT: 8/t of attention, and 2 bytes per element of each ffn-wide MLP tensor: 2 for GELU, 4 for SwiGLU)."""
    ffn_tensors = 4 if model.arch == "llama" else 2
    return 10 + (8 + 2 * ffn_tensors * model.ffn / model.hidden_size) / tp


def layer_fwd_flops(model: ModelSpec, b: int) -> float:
    h, s = model.hidden_size, model.seq_len
    return b * (2.0 * s * model.matmul_params + 4.0 * s * s * h)


def vocab_rows(model: ModelSpec, tp: int) -> int:
    """Vocabulary rows of the embedding and the head on a TP rank (the largest share): they are split over the
    TP group (Megatron-LM's vocabulary-parallel embedding and head, workers/model.py)."""
    return -(-model.vocab_size // tp)


def embed_params_dev(model: ModelSpec, tp: int) -> int:
    """The embedding's parameters on one TP rank: its vocabulary rows (and the GPT's positions, replicated)."""
    return (vocab_rows(model, tp) + (model.seq_len if model.arch == "gpt" else 0)) * model.hidden_size


def head_params_dev(model: ModelSpec, tp: int) -> int:
    """The head's parameters on one TP rank: its vocabulary rows and the final norm (replicated)."""
    return vocab_rows(model, tp) * model.hidden_size + (2 if model.arch == "gpt" else 1) * model.hidden_size


def head_fwd_flops(model: ModelSpec, b: int, tp: int = 1) -> float:
    """The head's forward FLOPs on one TP rank (its vocabulary rows)."""
    return b * 2.0 * model.seq_len * model.hidden_size * vocab_rows(model, tp)


def model_flops_per_sample(model: ModelSpec) -> float:
    """Training FLOPs of one sample (fwd + bwd, no recompute): the MFU numerator."""
    return 3.0 * (model.num_layers * layer_fwd_flops(model, 1) + head_fwd_flops(model, 1))


def _util(tokens: float) -> float:
    return tokens / (tokens + _UTIL_HALF_TOKENS)


def _allreduce_s(nbytes: float, n: int, bw: float) -> float:
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * nbytes / bw


@dataclass(frozen=True)
class StageShape:
    """What a stage holds, independent of where it runs."""

    num_layers: int
    first: bool
    last: bool

    def params_per_device(self, model: ModelSpec, tp: int) -> float:
        # Embedding and head are split by vocabulary rows over the TP group (workers/model.py does the same).
        return (
            self.num_layers * model.layer_params / tp
            + self.first * embed_params_dev(model, tp)
            + self.last * head_params_dev(model, tp)
        )


@dataclass(frozen=True)
class StageTimes:
    fwd_s: float  # one micro-batch, including the p2p send to the next stage
    bwd_s: float  # one micro-batch, including recompute and the p2p send back
    mem_bytes: float


def stage_times(
    slot: Slot, model: ModelSpec, train: TrainSpec, shape: StageShape, b: int,
    inflight: int, policy: Knobs, p2p_next_bw: float | None, p2p_prev_bw: float | None,
) -> StageTimes:
    """Time of one micro-batch of size b through the stage, and the stage's peak memory."""
    tp, pb = slot.tp, train.param_bytes
    h, s = model.hidden_size, model.seq_len
    n, r = shape.num_layers, policy.num_recompute
    eff = slot.flops_per_gpu * _util(b * s)
    fwd_flops = (n * layer_fwd_flops(model, b) / tp) + shape.last * head_fwd_flops(model, b, tp)
    fwd_c = fwd_flops / eff
    rec_c = r * layer_fwd_flops(model, b) / tp / eff
    act_bytes = s * b * h * pb
    tp_comm = n * 2 * _allreduce_s(act_bytes, tp, slot.intra_bw)
    fwd = fwd_c + tp_comm
    bwd = 2 * fwd_c + rec_c + tp_comm * (1 + r / max(n, 1))
    if policy.offload_params:
        # Weights stream in per micro-batch, once for forward and once for backward, as fp32 masters cast on
        # the device (workers/offload.py ParamStore).
        h2d = shape.params_per_device(model, tp) * train.grad_bytes / slot.host_link
        fwd, bwd = max(fwd, h2d), max(bwd, h2d)
    mem = stage_memory(slot, model, train, shape, b, inflight, policy)
    return with_links(StageTimes(fwd, bwd, mem), model, train, b, p2p_next_bw, p2p_prev_bw)


def with_links(t: StageTimes, model: ModelSpec, train: TrainSpec, b: int, p2p_next_bw: float | None,
               p2p_prev_bw: float | None) -> StageTimes:
    """A stage's times without its links (`stage_times` with both None) plus the p2p sends of one micro-batch's
    activations: to the next stage after forward, to the previous one after backward. The search costs a stage
    once and adds each position's links here."""
    if not (p2p_next_bw or p2p_prev_bw):
        return t
    act_bytes = model.seq_len * b * model.hidden_size * train.param_bytes
    fwd, bwd = t.fwd_s, t.bwd_s
    if p2p_next_bw:
        fwd += act_bytes / p2p_next_bw
    if p2p_prev_bw:
        bwd += act_bytes / p2p_prev_bw
    return StageTimes(fwd, bwd, t.mem_bytes)


def stage_memory(
    slot: Slot, model: ModelSpec, train: TrainSpec, shape: StageShape, b: int,
    inflight: int, policy: Knobs,
) -> float:
    """Peak bytes on one device of the stage (excluding the reserve)."""
    tp, pb = slot.tp, train.param_bytes
    h, s, n = model.hidden_size, model.seq_len, shape.num_layers
    r = policy.num_recompute
    layer_p = model.layer_params / tp
    edge_p = shape.first * embed_params_dev(model, tp) + shape.last * head_params_dev(model, tp)
    p_dev = n * layer_p + edge_p
    # Offloaded parameters: the layers in flight (prefetch_depth ahead of the one computing) in the compute dtype.
    weights = (min(n, policy.prefetch_depth + 1) * layer_p + edge_p) * pb if policy.offload_params else p_dev * pb
    # Offloaded optimizer: gradients stream to the host a layer at a time (workers/offload.py GradStream).
    grads = offload_grad_bytes(model, train, tp, n > 0, shape.first, shape.last) + fetch_staging(model, train, tp) \
        if policy.offload_optimizer else p_dev * train.grad_bytes
    opt = 0.0 if policy.offload_optimizer else p_dev * train.optimizer_bytes_per_param
    full = s * b * h * act_units(model, tp) * pb / 2
    ckpt = s * b * h * pb
    # Recomputed layers are the stage's first ones (policy.to_policy), which backward reaches
    # last: by the time one of them is recomputed, the stored layers above it are freed.
    per_mb = (n - r) * full + r * ckpt
    logits = s * b * vocab_rows(model, tp) * head_bytes(train) if shape.last else 0.0  # this rank's rows
    # Two peaks: forward's end (every stored activation, and the logits with their gradient while the head
    # back-propagates), and a recomputed layer's working set in backward, beside an offloaded layer's gradients
    # in flight, once the head's logits are gone.
    in_bwd = grad_bucket(model, tp, n > 0, shape.first, shape.last) * pb if policy.offload_optimizer else 0.0
    acts = (inflight - 1) * per_mb + max(per_mb + logits, r * ckpt + full + in_bwd if r else 0.0)
    return weights + grads + opt + acts


def head_bytes(train: TrainSpec) -> float:
    """Bytes per logit at the head's backward, the last stage's peak (measured by the engine's device meter):
    the logits in the compute dtype, their fp32 copy (or themselves, at 4 bytes and over), the log-softmax
    cross-entropy saves and two gradients of that size: 14 bytes in bf16/fp16, 16 in fp32."""
    wide = max(train.param_bytes, 4)
    return 3 * wide + train.param_bytes


GRAD_RING = 2  # workers/offload.py GradStream.RING: device buffers of a layer's (or a chunk's) fp32 gradients
OFFLOAD_CHUNK = 1 << 26  # elements an offloaded stage moves in one copy at most (256 MiB of fp32): a layer larger
# than this (a 70B block, a large vocabulary's head) moves in chunks, so the device buffers stay this size


def fetch_staging(model: ModelSpec, train: TrainSpec, tp: int) -> float:
    """Device bytes of the buffer an offloaded stage's masters arrive in, a layer's in one copy, before their
    cast to a 16-bit compute dtype or their scatter into a resident layer's tensors (workers/copy_lane.py
    Lanes.upload: a block's size, at most `OFFLOAD_CHUNK`, reused by every fetch and copy back)."""
    return min(model.layer_params / tp, OFFLOAD_CHUNK) * train.grad_bytes


def grad_bucket(model: ModelSpec, tp: int, has_layers: bool, first: bool, last: bool) -> float:
    """Parameters per device of the largest layer of a stage (a block, the embedding or the head): what an
    offloaded optimizer's gradient stream moves at once (workers/offload.py GradStream)."""
    return max(model.layer_params / tp if has_layers else 0.0,
               embed_params_dev(model, tp) if first else 0.0, head_params_dev(model, tp) if last else 0.0)


def offload_grad_bytes(model: ModelSpec, train: TrainSpec, tp: int, has_layers: bool, first: bool,
                       last: bool) -> float:
    """Device bytes an offloaded optimizer's gradients hold all step: the ring of `GRAD_RING` buffers of the
    stage's largest layer (at most `OFFLOAD_CHUNK` elements) in the masters' dtype, each layer packed and cast
    into them a chunk at a time, then copied to the host.
    (One layer's gradients in the compute dtype live between backward producing them and their packing: a
    transient of backward, `grad_bucket` x param_bytes, counted with a recomputed layer's working set.)"""
    return GRAD_RING * min(grad_bucket(model, tp, has_layers, first, last), OFFLOAD_CHUNK) * train.grad_bytes


def host_bytes(model: ModelSpec, train: TrainSpec, shape: StageShape, tp: int, policy: Knobs) -> float:
    """Host bytes one device's offloaded state takes (workers/engine.py's layout): with the optimizer or the
    parameters offloaded, the masters (fp32 under mixed precision: inside AdamW's bytes), AdamW's moments and
    the gradients accumulated there; pinned on CUDA. 0 without offload."""
    if not (policy.offload_optimizer or policy.offload_params):
        return 0.0
    p = shape.params_per_device(model, tp)
    masters = 0 if train.param_bytes < 4 else train.param_bytes  # mixed: the fp32 master is in the optimizer bytes
    return p * (train.optimizer_bytes_per_param + train.grad_bytes + masters)


def offload_lanes(slot: Slot, train: TrainSpec, offload_params: bool, p: Any) -> tuple[Any, Any, Any]:
    """Seconds per step of an offloaded optimizer's three lanes for `p` parameters per device (a float, or a
    numpy array of them), as workers/offload.py and workers/copy_lane.py move them: d2h, every gradient once in
    the masters' dtype (packed and cast on the device); h2d, a resident layer's new weights back in the masters'
    dtype (cast on the device; fetched parameters come over in `stage_times` instead); cpu, the host AdamW.
    The one model of these copies: the search, the closed form and bench/offload.py read it."""
    gb = train.grad_bytes  # the masters' bytes: fp32 under mixed precision
    d2h = p * gb / slot.host_link
    h2d = 0.0 if offload_params else p * gb / slot.host_link
    return d2h, h2d, p / (slot.cpu_adam_per_gpu * HOST_ADAMW_BESIDE_COPIES)


# The host AdamW runs beside the lanes' copies, which take the same host memory bandwidth: on one H200 machine
# (16 cores, 3,920 M params/s alone; 2026-12-04, bench/gpu_check.py) the offloaded steps of gpt-1.3b and of
# llama-8b's shapes at 16 layers ran their updates at 0.92 and 0.82 of that rate.
HOST_ADAMW_BESIDE_COPIES = 0.85


def first_layer_share(model: ModelSpec, shape: StageShape, tp: int, p: Any) -> Any:
    """The share of a stage's parameters in its first layer, whose update (and copy back) its forward waits for
    before it starts: the embedding's on a first stage (several blocks' worth with a large vocabulary)."""
    first: float
    if shape.first:
        first = embed_params_dev(model, tp)
    elif shape.num_layers:
        first = model.layer_params / tp
    else:
        first = head_params_dev(model, tp)
    return first / p


def optimizer_s(slot: Slot, model: ModelSpec, train: TrainSpec, shape: StageShape,
                policy: Knobs, busy_s: float, fwd_busy_s: float) -> float:
    """Per-step optimizer cost exposed on the device's critical path.

    Offloaded (AutoHete, as workers/offload.py runs it): gradients stream to the host during backward, hidden
    behind it; the host AdamW (and, with resident parameters, the copy of the new weights back) runs layer by
    layer, first layers first, beside the next step's forward. It cannot start earlier: the global-norm clip
    (and an fp16 overflow check) needs every gradient first, and the update waits for the step's commit (a
    failed step must leave the last committed state), so it hides only behind forward compute
    (`fwd_busy_s`). The first layer's share of each lane is exposed: the forward waits for it before it starts.
    """
    p = shape.params_per_device(model, slot.tp)
    pb = train.param_bytes
    if not policy.offload_optimizer:
        return p * 2 * (2 * pb + train.optimizer_bytes_per_param) / slot.mem_bw
    d2h, h2d, cpu = offload_lanes(slot, train, policy.offload_params, p)
    tail = (d2h + cpu + h2d) * first_layer_share(model, shape, slot.tp, p)
    return max(0.0, d2h - (busy_s - fwd_busy_s), max(h2d, cpu) - fwd_busy_s) + tail


def sync_s(params_dev: float, train: TrainSpec, num_replicas: int, bw: float) -> float:
    return _allreduce_s(params_dev * train.grad_bytes, num_replicas, bw)


def pipeline_time(times_per_mb: list[list[float]]) -> float:
    """Closed-form 1F1B time: fill with the first micro-batch, then the slowest stage paces.

    times_per_mb[j][i] = fwd + bwd of micro-batch j on stage i. With m - 1 alike micro-batches and a last one
    (a remainder) this is `closed_form_1f1b`, the form the layer split evaluates.
    """
    first = sum(times_per_mb[0])
    return first + sum(max(t) for t in times_per_mb[1:])


def closed_form_1f1b(sum_t: float, max_t: float, max_t_last: float, sum_t_last: float, m: int) -> float:
    """`pipeline_time` for m - 1 alike micro-batches (per-stage times t) and a last one (t_last):
    sum(t) + (m - 2) max(t) + max(t_last), or sum(t_last) when it is the only one."""
    return sum_t_last if m == 1 else sum_t + (m - 2) * max_t + max_t_last


def inflight(stage_index: int, num_stages: int, num_micro_batches: int, schedule: str) -> int:
    if schedule == "gpipe":
        return num_micro_batches
    return min(num_stages - stage_index, num_micro_batches)
