"""The cost model against published training runs (issue 33).

    python bench/calibration.py            # prints a markdown table (docs/benchmarks.md)

Each row plans a published setup with hetspot's planner (the same GPUs, model shape, sequence length and
global batch) and sets the cost model's prediction beside the published figure: model FLOPs utilisation
(MFU: the model's 6N-style training FLOPs per second over the GPUs' datasheet peak, as both papers and
planner.evaluate count it) or tokens/s per GPU. A row within 15% passes; one outside names the term the
model lacks. The efficiency each GPU type reaches is the catalog's default (planner/catalog.py) unless a
profiling pass on a real cluster measured it (ClusterSpec.calibration, orchestrator/cluster/profiling.py).

The plans are hetspot's own (asymmetric DP/PP/TP with per-stage recompute and offload), not the published
runs' layouts (FSDP in torchtitan; TP8 x PP8 with sequence parallelism in Megatron-LM), so a gap mixes the
efficiency model with what the plan is: the last column says which.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec, plan  # noqa: E402


@dataclass
class Row:
    name: str
    source: str
    cluster: ClusterSpec
    model: ModelSpec
    train: TrainSpec
    metric: str  # "mfu" or "tokens/s/GPU"
    published: float
    lacks: str  # the term the model lacks, if the row misses by more than 15%


def _nodes(gpu: str, per_node: int, count: int, nic_gb_s: float, host_gib: float | None = None) -> ClusterSpec:
    return ClusterSpec(nodes=[NodeSpec(name=f"n{i}", gpu_type=gpu, num_gpus=per_node, inter_node_bw_gb_s=nic_gb_s,
                                       host_mem_gib=host_gib) for i in range(count)])


def _seq(preset: str, seq_len: int) -> ModelSpec:
    return ModelSpec.preset(preset).model_copy(update={"seq_len": seq_len})


ROWS = [
    Row("GPT-3 175B, 64 A100-80GB (8 nodes, 8x 200 Gb/s HDR each)",
        "Korthikanti et al., Reducing Activation Recomputation in Large Transformer Models (MLSys'23), the MFU "
        "table of the Megatron-LM README: 175B at 51.4% MFU (TP8 x PP8, selective recompute, sequence "
        "parallelism, data-parallel size 1); global batch 64 as we read the paper's configuration table",
        _nodes("A100-80GB", 8, 8, 200.0), ModelSpec.preset("175b"), TrainSpec(global_batch=64), "mfu", 0.514,
        "sequence parallelism and selective recompute: the model recomputes whole layers and keeps every "
        "activation of a TP group on each of its GPUs, so it needs PP stages or recompute where Megatron needs "
        "neither"),
    Row("Llama 3.1 8B, 8 H100 (one node), seq 8192, global batch 16",
        "torchtitan docs/performance.md, Table 1: FSDP, bf16, selective activation checkpointing, local batch 2: "
        "5,762 tokens/s per GPU (33-39% MFU with or without torch.compile); H100 at a 500 W limit",
        _nodes("H100-SXM", 8, 1, 50.0), _seq("llama-8b", 8192), TrainSpec(global_batch=16), "tokens/s/GPU",
        5762.0, "the 500 W power limit (the catalog's H100 runs at its 700 W datasheet peak) and FSDP's gathers"),
    Row("GPT 1.3B, one H200, seq 2048, global batch 8 (measured here)",
        "hetspot's own engine on an NVIDIA H200 (driver 580.159.04, torch 2.11.0+cu130), `python "
        "bench/gpu_check.py --steps 8`, session 18 (2026-11-27): one stage holding the whole `gpt-1.3b` preset "
        "in bf16 mixed precision, micro-batch 8, median step 0.294 s after the first, 51.1% MFU of the 989 TFLOPS "
        "bf16 peak (docs/benchmarks.md, GPU runs)",
        _nodes("H200", 1, 1, 50.0), ModelSpec.preset("gpt-1.3b"), TrainSpec(global_batch=8), "mfu", 0.511,
        "H200's own efficiency: it had H100's 0.45 (held to torchtitan's H100 run at a 500 W limit)"),
    Row("Llama 3 8B, 64 A100-80GB (8 nodes), seq 8192, global batch 64",
        "torchtitan docs/performance.md (Llama 3 on 64 A100): FSDP2, local batch 1, selective layer "
        "checkpointing: 2,876 tokens/s per GPU, 56.3% MFU",
        _nodes("A100-80GB", 8, 8, 100.0), _seq("llama-8b", 8192), TrainSpec(global_batch=64), "mfu", 0.563,
        "long-sequence GEMM efficiency: at 8,192 tokens a micro-batch's GEMMs run near peak, past the "
        "catalog's 0.55 default efficiency"),
    Row("Llama 3 70B, 64 A100-80GB (8 nodes), seq 8192, global batch 64",
        "torchtitan docs/performance.md (Llama 3 on 64 A100): FSDP2, local batch 1, full activation "
        "checkpointing: 323 tokens/s per GPU, 50.5% MFU",
        _nodes("A100-80GB", 8, 8, 100.0), _seq("llama-70b", 8192), TrainSpec(global_batch=64), "mfu", 0.505,
        "long-sequence GEMM efficiency (as the row above)"),
    Row("10B GPT on one V100-32GB with optimizer offload (1.5 TB host)",
        "Ren et al., ZeRO-Offload (USENIX ATC'21): 40 TFLOPS on a single V100 for a 10B model (32% of the "
        "125 TFLOPS fp16 peak); shape as we assume it: 50 layers of 4096, seq 1024, batch 32",
        ClusterSpec(nodes=[NodeSpec(name="v", gpu_type="V100-32GB", num_gpus=1, host_mem_gib=1536)]),
        ModelSpec(name="10b", num_layers=50, hidden_size=4096, num_heads=32, vocab_size=50304, seq_len=1024),
        TrainSpec(global_batch=32, precision="fp16"), "mfu", 40.0 / 125.0,
        "the host's AdamW rate (cpu_adam_params_per_s, 1e9 by default; ZeRO-Offload's CPU-Adam on a DGX-2 host)"),
]


def predict(row: Row) -> tuple[float, str]:
    """(predicted metric, the plan in brief)."""
    p = plan(row.cluster, row.model, row.train)
    est = p.estimate
    gpus = sum(st.tp for pp in p.pipelines for st in pp.stages)
    value = est.mfu if row.metric == "mfu" else est.tokens_per_s / gpus
    offload = sum(st.offload.offload_optimizer for pp in p.pipelines for st in pp.stages)
    recompute = sum(bool(st.offload.recompute_layers) for pp in p.pipelines for st in pp.stages)
    shape = (f"{len(p.pipelines)} DP x {len(p.pipelines[0].stages)} PP, TP {p.pipelines[0].stages[0].tp}, "
             f"mb {p.pipelines[0].micro_batch_size}; {recompute} stage(s) recompute, {offload} offload")
    return value, shape


def main() -> None:
    print("| setup | published | hetspot predicts | ratio | within 15% | hetspot's plan "
          "| if not, the term the model lacks |")
    print("|---|---|---|---|---|---|---|")
    for row in ROWS:
        got, shape = predict(row)
        fmt = (lambda v: f"{v * 100:.1f}% MFU") if row.metric == "mfu" else (lambda v: f"{v:,.0f} tok/s/GPU")
        ratio = got / row.published
        ok = abs(ratio - 1) <= 0.15
        print(f"| {row.name} | {fmt(row.published)} | {fmt(got)} | {ratio:.2f} | {'yes' if ok else 'no'} | {shape} | "
              f"{'' if ok else row.lacks} |")
    print("\nSources:\n")
    for row in ROWS:
        print(f"- {row.name}: {row.source}.")


if __name__ == "__main__":
    main()
