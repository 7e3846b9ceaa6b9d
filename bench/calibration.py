"""The cost model against published training runs.

    python bench/calibration.py            # prints two markdown tables (docs/benchmarks.md)
    python bench/calibration.py --json     # the same as JSON (tests/test_cost_at_scale.py reads it)

One cost model, one set of efficiencies: the fraction of peak each GPU type reaches is the catalog's
(planner/catalog.py), which both tables use; the H100 and A100 figures there are the ones this bench fits
(tests/test_cost_at_scale.py fails if they part by more than 0.005).

The first table plans published set-ups with hetspot's planner (the same GPUs, model shape, sequence length
and global batch) and sets its prediction (`evaluate`) beside the published figure: model FLOPs utilisation
(MFU: the model's 6N-style training FLOPs per second over the GPUs' datasheet peak, as both papers and
planner.evaluate count it) or tokens/s per GPU. A row within 15% passes; one outside names the term the
model lacks. Its rows are held out (no efficiency was chosen with them in view) except the V100 one. The
plans are hetspot's own (asymmetric DP/PP/TP with per-stage recompute and offload, plain 1F1B, one optimizer
copy per replica), not the published runs' layouts (FSDP in torchtitan; TP8 x PP8 with sequence parallelism
in Megatron-LM), so a gap mixes the efficiency with what hetspot's engine lacks: the last column says which.

The second table prices the published layouts themselves at scale (planner/at_scale.py: interleaved 1F1B,
sequence parallelism, a ZeRO-1 distributed optimizer, overlapped communication). Each GPU type's efficiency is
fitted on its `train` rows (H100: Megatron-LM's weak-scaling table; A100: the six smallest rows of Megatron-LM's
2021 table), and the `held-out` rows (GPT-3 175B's strong scaling at 96 and 4,608 H100, Llama 3 405B at 8,192
and 16,384 H100, the 2021 table's runs on 1,536 to 3,072 A100) are priced unseen; a held-out row passes within
20%. A profiling pass on a real cluster replaces the catalog's figure for its types (ClusterSpec.calibration,
orchestrator/cluster/profiling.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec, plan  # noqa: E402
from planner.at_scale import Layout, estimate_layout  # noqa: E402
from planner.catalog import gpu_info  # noqa: E402


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
    split: str = "held-out"  # "fitted": the row's GPU efficiency was chosen with it in view


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
        "bench/gpu_check.py --items links,mfu,offload,llama,llama_big --steps 10` (2026-12-04): one stage holding "
        "the whole `gpt-1.3b` preset in bf16 mixed precision, micro-batch 8, median step 0.277 s of 9 after the "
        "first, 54.2% MFU of the 989 TFLOPS bf16 peak (51.1% on 2026-11-27, before the step lost its host "
        "synchronizations; docs/benchmarks.md, GPU runs)",
        _nodes("H200", 1, 1, 50.0), ModelSpec.preset("gpt-1.3b"), TrainSpec(global_batch=8), "mfu", 0.542,
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
        "the host's AdamW rate (cpu_adam_params_per_s, 1e9 by default; ZeRO-Offload's CPU-Adam on a DGX-2 host)",
        "fitted"),
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


@dataclass
class LayoutRow:
    """A published run priced in its own layout (planner/at_scale.py)."""

    name: str
    cite: str  # a key of CITATIONS
    detail: str  # what this row reads from it
    layout: Layout
    model: ModelSpec
    train: TrainSpec
    published: float  # the published utilisation, in `metric`
    split: str  # "train": the efficiency is fitted on it; "held-out": priced with that efficiency, unseen
    metric: str = "mfu"  # or "hfu": recomputed forwards counted as work (Narayanan et al. 2021's "% of peak")

    def predicted(self, e: float | None) -> float:
        return estimate_layout(self.layout, self.model, self.train, e).utilisation(self.metric)


CITATIONS = {
    "megatron-weak": "Megatron-LM README, 'Training Speed and Scalability', the model table (images/model_table.png, "
                     "added with the H100 scaling figures in July 2024, Megatron-Core r0.8.0): GPT models with a "
                     "131,072 vocabulary and 4,096-token sequences on H100, with --overlap-grad-reduce "
                     "--overlap-param-gather --tp-comm-overlap; each row gives heads, hidden size, layers, TP, PP, "
                     "DP, GPUs, batch, TFLOP/s per GPU and MFU",
    "megatron-strong": "Megatron-LM README, 'Training Speed and Scalability': 'We also strong scaled the standard "
                       "GPT-3 model (our version has slightly more than 175 billion parameters due to larger "
                       "vocabulary size) from 96 H100 GPUs to 4608 GPUs, using the same batch size of 1152 sequences "
                       "throughout. [...] a reduction in MFU from 47% to 42%' (images/strong_scaling.png); the "
                       "layout as we read it: the model table's 177B row (TP 8, PP 6), so DP 2 at 96 GPUs and DP 96 "
                       "at 4,608",
    "llama3": "Grattafiori et al., The Llama 3 Herd of Models (2024), Table 4 (also Balaji, SC'24): Llama 3 405B "
              "pre-training at 8,192-token sequences, 16M tokens a batch (2,048 sequences), TP 8, CP 1, PP 16, BF16 "
              "on 700 W H100s over 400 Gb/s RoCE; the paper's pipeline schedule is interleaved (section 3.3.2) but "
              "its depth is not given, so the model takes the fastest that fits",
    "megatron-2021": "Megatron-LM README as of April 2021 (the table image images/cases_april2021.png) and Narayanan "
                     "et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM "
                     "(SC'21), Table 1: GPT models with a 51,200 vocabulary and 2,048-token sequences on Selene "
                     "(8 A100-80GB a node, 8x 200 Gb/s HDR), every layer's activations recomputed, the 'percentage "
                     "of theoretical peak' counting the recomputed forward as work (the paper's 96BslH^2 formula); "
                     "the README gives the model-parallel size, which we split as TP = min(size, 8) (a node) and "
                     "PP = size / 8; attention heads are not given and do not enter the cost; 2021's code had no "
                     "sequence parallelism, no distributed optimizer and no overlapped TP or DP communication",
}


def _megatron(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, dp: int, batch: int, mfu: float,
              split: str, cite: str) -> LayoutRow:
    model = ModelSpec(name=f"megatron-{size.lower()}", num_layers=layers, hidden_size=hidden, num_heads=heads,
                      vocab_size=131072, seq_len=4096)
    return LayoutRow(f"Megatron-LM GPT {size}, {tp * pp * dp:,} H100 (TP {tp}, PP {pp}, DP {dp}, batch {batch})",
                     cite, f"{heads} heads, hidden {hidden}, {layers} layers: {mfu:.0%} MFU",
                     Layout("H100-SXM", tp, pp, dp), model, TrainSpec(global_batch=batch), mfu, split)


def _megatron_2021(size: str, hidden: int, layers: int, mp: int, gpus: int, batch: int, hfu: float, split: str
                   ) -> LayoutRow:
    tp = min(mp, 8)
    pp, dp = mp // tp, gpus // mp
    model = ModelSpec(name=f"megatron-2021-{size.lower()}", num_layers=layers, hidden_size=hidden,
                      num_heads=hidden // 128, vocab_size=51200, seq_len=2048)
    layout = Layout("A100-80GB", tp, pp, dp, sequence_parallel=False, distributed_optimizer=False, tp_overlap=False,
                    full_recompute=True, nic_gb_s=25.0)
    return LayoutRow(f"Megatron-LM (2021) GPT {size}, {gpus:,} A100 (TP {tp}, PP {pp}, DP {dp}, batch {batch})",
                     "megatron-2021", f"hidden {hidden}, {layers} layers: {hfu:.0%} of peak", layout, model,
                     TrainSpec(global_batch=batch), hfu, split, metric="hfu")


# Training split: the weak-scaling table, row for row (heads, hidden, layers, TP, PP, batch, MFU; DP 48 in all).
LAYOUT_ROWS = [
    _megatron(size, heads, hidden, layers, tp, pp, 48, batch, mfu, "train", "megatron-weak")
    for size, heads, hidden, layers, tp, pp, batch, mfu in [
        ("1.7B", 16, 2048, 24, 1, 1, 192, 0.41), ("7.1B", 32, 4096, 30, 2, 1, 192, 0.47),
        ("16B", 48, 6144, 32, 4, 1, 192, 0.49), ("32B", 56, 7168, 48, 8, 1, 192, 0.46),
        ("70B", 64, 8192, 84, 8, 2, 384, 0.42), ("119B", 80, 10240, 92, 8, 4, 768, 0.43),
        ("177B", 96, 12288, 96, 8, 6, 1152, 0.44), ("314B", 128, 16384, 96, 8, 8, 1536, 0.48),
        ("462B", 144, 18432, 112, 8, 16, 3072, 0.47)]
]
# Held out: never seen by the fit.
LAYOUT_ROWS += [
    _megatron("175B", 96, 12288, 96, 8, 6, 2, 1152, 0.47, "held-out", "megatron-strong"),
    _megatron("175B", 96, 12288, 96, 8, 6, 96, 1152, 0.42, "held-out", "megatron-strong"),
]
_LLAMA_405B = ModelSpec(name="llama-3-405b", arch="llama", num_layers=126, hidden_size=16384, num_heads=128,
                        num_kv_heads=8, ffn_size=53248, vocab_size=128256, seq_len=8192)
LAYOUT_ROWS += [
    LayoutRow("Llama 3 405B, 8,192 H100 (TP 8, PP 16, DP 64, seq 8192)", "llama3",
              "8,192 GPUs, DP 64: 430 TFLOPs/GPU, 43% MFU", Layout("H100-SXM", 8, 16, 64), _LLAMA_405B,
              TrainSpec(global_batch=2048), 0.43, "held-out"),
    LayoutRow("Llama 3 405B, 16,384 H100 (TP 8, PP 16, DP 128, seq 8192)", "llama3",
              "16,384 GPUs, DP 128: 400 TFLOPs/GPU, 41% MFU", Layout("H100-SXM", 8, 16, 128), _LLAMA_405B,
              TrainSpec(global_batch=2048), 0.41, "held-out"),
]
# A100: the smaller six train, the four largest (1,536 to 3,072 GPUs, PP 8 to 64) are held out.
LAYOUT_ROWS += [
    _megatron_2021(size, hidden, layers, mp, gpus, batch, hfu, "train" if gpus <= 1024 else "held-out")
    for size, hidden, layers, mp, gpus, batch, hfu in [
        ("1.7B", 2304, 24, 1, 32, 512, 0.44), ("3.6B", 3072, 30, 2, 64, 512, 0.44),
        ("7.5B", 4096, 36, 4, 128, 512, 0.46), ("18B", 6144, 40, 8, 256, 1024, 0.43),
        ("39B", 8192, 48, 16, 512, 1536, 0.44), ("76B", 10240, 60, 32, 1024, 1792, 0.45),
        ("145B", 12288, 80, 64, 1536, 2304, 0.47), ("310B", 16384, 96, 128, 1920, 2160, 0.50),
        ("530B", 20480, 105, 280, 2520, 2520, 0.52), ("1T", 25600, 128, 512, 3072, 3072, 0.52)]
]
HELD_OUT_BAND = 0.20  # within 20% of the published MFU on every held-out row


def fit_efficiency(rows: list[LayoutRow]) -> float:
    """The efficiency (fraction of peak a GEMM reaches) that minimises the squared log ratio of predicted to
    published utilisation over `rows` (golden-section search over 0.2-0.95: the error is unimodal in it)."""
    def err(e: float) -> float:
        return sum(math.log(r.predicted(e) / r.published) ** 2 for r in rows)
    lo, hi, g = 0.2, 0.95, (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = err(a), err(b)
    while hi - lo > 1e-4:
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = err(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = err(b)
    return round((lo + hi) / 2, 4)


def layout_table() -> dict:
    """Fit each GPU type's efficiency on its training rows and price every row with the catalog's (the one the
    planner uses: planner/catalog.py takes the fit, rounded); what the tests and the markdown read."""
    types = dict.fromkeys(r.layout.gpu_type for r in LAYOUT_ROWS)
    fitted = {g: fit_efficiency([r for r in LAYOUT_ROWS if r.split == "train" and r.layout.gpu_type == g])
              for g in types}
    catalog = {g: gpu_info(g).default_efficiency for g in types}
    out = []
    for r in LAYOUT_ROWS:
        eff = catalog[r.layout.gpu_type]
        e = estimate_layout(r.layout, r.model, r.train, eff)
        got = e.utilisation(r.metric)
        plain = estimate_layout(Layout(r.layout.gpu_type, r.layout.tp, r.layout.pp, r.layout.dp, virtual_stages=1,
                                       sequence_parallel=False, distributed_optimizer=False, tp_overlap=False,
                                       full_recompute=r.layout.full_recompute, nic_gb_s=r.layout.nic_gb_s),
                                r.model, r.train, eff)
        ratio = got / r.published
        out.append({"name": r.name, "split": r.split, "gpu_type": r.layout.gpu_type, "gpus": r.layout.gpus,
                    "metric": r.metric, "published": r.published, "predicted": round(got, 4),
                    "ratio": round(ratio, 3), "within": abs(ratio - 1) <= HELD_OUT_BAND,
                    "efficiency": eff, "virtual_stages": e.virtual_stages, "recompute_layers": e.recompute_layers,
                    "bubble": round(e.bubble, 3), "mem_gib": round(e.mem_gib, 1), "fits": e.fits,
                    "plain_1f1b_ratio": round(plain.utilisation(r.metric) / r.published, 3)
                    if plain.fits else None,
                    "source": f"{CITATIONS[r.cite]}; this row: {r.detail}", "cite": r.cite})
    return {"fitted_efficiency": fitted, "catalog_efficiency": catalog, "band": HELD_OUT_BAND, "rows": out}


def print_layout_table(t: dict) -> None:
    fits = ", ".join(f"{g} {t['catalog_efficiency'][g]} (fit {e})" for g, e in t["fitted_efficiency"].items())
    print(f"\nPublished layouts at scale (planner/at_scale.py), priced with the catalog's efficiency per GPU type, "
          f"the one the planner uses, fitted on the type's train rows: {fits}\n")
    print("| setup | split | published | predicted | ratio | within 20% | chunks per device (v) | recompute "
          "layers | bubble | ratio as plain 1F1B (no interleaving, SP, ZeRO-1 or overlap) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in t["rows"]:
        plain = "does not fit" if r["plain_1f1b_ratio"] is None else f"{r['plain_1f1b_ratio']:.2f}"
        unit = "MFU" if r["metric"] == "mfu" else "of peak (HFU)"
        print(f"| {r['name']} | {r['split']} | {r['published']:.0%} {unit} | {r['predicted']:.1%} | {r['ratio']:.2f} | "
              f"{'yes' if r['within'] else 'no'} | {r['virtual_stages']} | {r['recompute_layers']} | "
              f"{r['bubble']:.1%} | {plain} |")
    print("\nSources (each row's own figures are in its name and in `--json`):\n")
    for key in dict.fromkeys(r["cite"] for r in t["rows"]):
        splits = [r["split"] for r in t["rows"] if r["cite"] == key]
        counts = ", ".join(f"{splits.count(x)} {x}" for x in dict.fromkeys(splits))
        print(f"- {counts}: {CITATIONS[key]}.")


def plan_table() -> list[dict]:
    """The first table: each published set-up planned by hetspot's planner (its `evaluate`, the catalog's
    efficiencies)."""
    out = []
    for row in ROWS:
        got, shape = predict(row)
        ratio = got / row.published
        out.append({"name": row.name, "split": row.split, "metric": row.metric, "published": row.published,
                    "predicted": got, "ratio": round(ratio, 3), "within": abs(ratio - 1) <= 0.15, "plan": shape,
                    "lacks": row.lacks, "source": row.source})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print both tables as JSON")
    args = ap.parse_args()
    if args.json:
        print(json.dumps({**layout_table(), "planned": plan_table()}, indent=1))
        return
    print("| setup | split | published | hetspot predicts | ratio | within 15% | hetspot's plan "
          "| if not, the term the model lacks |")
    print("|---|---|---|---|---|---|---|---|")
    for r in plan_table():
        fmt = (lambda v: f"{v * 100:.1f}% MFU") if r["metric"] == "mfu" else (lambda v: f"{v:,.0f} tok/s/GPU")
        print(f"| {r['name']} | {r['split']} | {fmt(r['published'])} | {fmt(r['predicted'])} | {r['ratio']:.2f} | "
              f"{'yes' if r['within'] else 'no'} | {r['plan']} | {'' if r['within'] else r['lacks']} |")
    print("\nSources:\n")
    for row in ROWS:
        print(f"- {row.name}: {row.source}.")
    print_layout_table(layout_table())


if __name__ == "__main__":
    main()
