"""Offload benchmark. On a CPU-only machine it runs the CPU parts; the GPU part needs CUDA.

    python bench/offload.py [--params 50e6] [--repeats 7] [--steps 6]

1. CPU optimizer: AdamW params/s on the same GPT-shaped fp32 tensors:
     torch fused     torch.optim.AdamW(fused=True)
     torch foreach   torch.optim.AdamW(foreach=True)
     hetspot update  the engine's update under offload: fused AdamW on the host master
                     weights (gradients already streamed there during backward)
     + copy-back     the same plus copying the weights back to resident device copies
                     (optimizer offload without parameter offload; a memcpy on CPU)
2. Memory: for each offload policy, the engine's measured peak of device-resident bytes
   (DeviceMeter, one rank of the `small` GPT) against the planner's `cost.stage_memory`.
3. Overlap: step time with parameter offload, prefetching one layer ahead on the copy lane
   (a thread on CPU, a CUDA stream on GPU), against serial fetching (prefetch depth 0); and
   the host AdamW run layer by layer on a thread, first layers first, overlapping the next
   step's forward (AutoHete's cross-iteration overlap), against updating before the step ends.
Medians over repeats. The GPU items of the issue (largest GPT per policy under a 16 GB cap,
step time against the transfer bound) need a CUDA device and are skipped without one.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from planner import ClusterSpec, ModelSpec, NodeSpec, Pipeline, Plan, Stage, TrainSpec, cost  # noqa: E402
from workers.data import make_dataset  # noqa: E402
from workers.engine import Engine  # noqa: E402


def _tensors(total: int, hidden: int = 1024) -> list[torch.Tensor]:
    out, n = [], 0
    while n < total:
        for shape in ((3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden), (hidden,)):
            t = torch.nn.Parameter(torch.randn(shape) * 0.02)
            t.grad = torch.randn(shape) * 1e-3
            out.append(t)
            n += t.numel()
    return out


def _time(fn, repeats: int) -> float:
    fn()  # warm-up: allocates optimizer state
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_optimizer(total: float, repeats: int) -> None:
    params = _tensors(int(total))
    n = sum(p.numel() for p in params)
    rows = {}
    for name, kw in (("torch fused", {"fused": True}), ("torch foreach", {"foreach": True})):
        opt = torch.optim.AdamW(params, lr=1e-4, **kw)
        rows[name] = n / _time(opt.step, repeats)
    host = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for h, p in zip(host, params, strict=True):
        h.grad = p.grad.clone()
    opt = torch.optim.AdamW(host, lr=1e-4, fused=True)
    rows["hetspot update (host masters)"] = n / _time(opt.step, repeats)
    device = [p.detach().clone() for p in params]

    def with_copy_back():
        opt.step()
        with torch.no_grad():
            for d, h in zip(device, host, strict=True):
                d.copy_(h)

    rows["hetspot update + copy-back"] = n / _time(with_copy_back, repeats)
    print(f"## CPU optimizer: {n / 1e6:.1f} M parameters, {torch.get_num_threads()} threads, median of {repeats}\n")
    print("| optimizer | M params/s | vs torch fused |")
    print("|---|---|---|")
    for name, rate in rows.items():
        print(f"| {name} | {rate / 1e6:,.0f} | {rate / rows['torch fused']:.2f}x |")


TRAIN = TrainSpec(global_batch=8, lr=0.01, precision="fp32")


def _engine(model: ModelSpec, offload: dict, meter: bool, mb: int = 4) -> Engine:
    st = Stage(layer_start=0, layer_end=model.num_layers, gpu_type="A100-80GB", node="a", devices=["a/0"],
               offload=offload)
    plan = Plan(model_name=model.name, num_layers=model.num_layers, global_batch=TRAIN.global_batch,
                pipelines=[Pipeline(num_samples=8, micro_batch_size=mb, num_micro_batches=8 // mb, stages=[st])])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    e = Engine(plan, 0, model, TRAIN, make_dataset("synthetic", model.seq_len, model.vocab_size, 0),
               torch.float32, device=device, meter_memory=meter)
    e.connect_alone(60)
    return e


def memory(steps: int) -> None:
    model = ModelSpec.preset("small")
    L = list(range(model.num_layers))
    slot = cost.make_slot(ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100-80GB", num_gpus=1)]), TRAIN, "a", 1)
    shape = cost.StageShape(model.num_layers, True, True)
    print(f"\n## Device memory by policy: `small` GPT ({model.num_params / 1e6:.2f} M params), micro-batch 4, fp32\n")
    print("| policy | measured peak MiB | planner MiB | measured / planner |")
    print("|---|---|---|---|")
    for name, off in (("none", {}), ("recompute 3 of 6", {"recompute_layers": L[:3]}),
                      ("optimizer offload", {"offload_optimizer": True}),
                      ("params + optimizer", {"offload_optimizer": True, "offload_params": True}),
                      ("all (recompute 6)",
                       {"offload_optimizer": True, "offload_params": True, "recompute_layers": L})):
        e = _engine(model, off, meter=True)
        try:
            peak = [e.step(s).extra["device_peak_bytes"] for s in range(steps)][-1]
        finally:
            e.close()
        want = cost.stage_memory(slot, model, TRAIN, shape, 4, 1, cost.knobs(e.stage_spec.offload))
        print(f"| {name} | {peak / 2**20:.2f} | {want / 2**20:.2f} | {peak / want:.3f} |")


def _step_times(e: Engine, n: int) -> list[float]:
    """Wall time per step call; an overlapped host update is paid inside the next call's forward."""
    out = []
    for s in range(n):
        t0 = time.perf_counter()
        e.step(s)
        out.append(time.perf_counter() - t0)
    e.settle()
    return out[1:]


def host_update_overlap(steps: int, repeats: int) -> None:
    model = ModelSpec(name="wide", num_layers=8, hidden_size=512, num_heads=8, vocab_size=256, seq_len=64)
    print(f"\n## Host AdamW: layer-wise with cross-iteration overlap vs serial "
          f"({model.num_params / 1e6:.1f} M params)\n")
    print("| policy | serial step s | overlapped step s | speed-up |")
    print("|---|---|---|---|")
    for name, off in (("optimizer offload", {"offload_optimizer": True}),
                      ("params + optimizer", {"offload_optimizer": True, "offload_params": True})):
        t = {}
        for overlap_update in (False, True):
            e = _engine(model, off, meter=False)
            e.updater.overlap = overlap_update
            try:
                t[overlap_update] = statistics.median(_step_times(e, steps * repeats))
            finally:
                e.close()
        print(f"| {name} | {t[False]:.3f} | {t[True]:.3f} | {t[False] / t[True]:.2f}x |")


def overlap(steps: int, repeats: int) -> None:
    model = ModelSpec(name="wide", num_layers=8, hidden_size=512, num_heads=8, vocab_size=256, seq_len=64)
    print(f"\n## Parameter offload: prefetch vs serial fetch ({model.num_params / 1e6:.1f} M params, "
          f"{'CUDA' if torch.cuda.is_available() else 'CPU, copy lane = a thread'})\n")
    print("| fetch | median step s | speed-up |")
    print("|---|---|---|")
    base = None
    for name, depth in (("serial (depth 0)", 0), ("prefetch 1 layer ahead", 1), ("prefetch 2 layers ahead", 2)):
        e = _engine(model, {"offload_optimizer": True, "offload_params": True, "prefetch_depth": depth}, meter=False)
        try:
            times = _step_times(e, steps * repeats)
        finally:
            e.close()
        t = statistics.median(times)
        base = base or t
        print(f"| {name} | {t:.3f} | {base / t:.2f}x |")


def against_the_model(steps: int) -> None:
    """The offloaded step of the engine against the planner's estimate and against the physical bound, each from
    this machine's own terms: the resident step (compute), the copy lanes' bandwidth and the host AdamW rate.
    The planner's estimate is its cost model (cost.offload_lanes, cost.optimizer_s, the fetches of
    cost.stage_times) with those terms in place of the catalog's; the bound is max(compute, H2D, D2H, AdamW)."""
    from orchestrator.cluster.profiling import copy_gb_s, host_adamw_rate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = ModelSpec(name="wide", num_layers=8, hidden_size=512, num_heads=8, vocab_size=256, seq_len=64)
    h2d_gb_s, d2h_gb_s = copy_gb_s(device)
    rate = host_adamw_rate()
    e = _engine(model, {}, meter=False, mb=8)
    try:
        compute = statistics.median(_step_times(e, steps + 2))
    finally:
        e.close()
    slot = dataclasses.replace(
        cost.make_slot(ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100-80GB", num_gpus=1)]), TRAIN, "a", 1),
        host_link=min(h2d_gb_s, d2h_gb_s) * 1e9, cpu_adam_per_gpu=rate)
    shape = cost.StageShape(model.num_layers, True, True)
    p = shape.params_per_device(model, 1)
    print(f"\n## The offloaded step: engine, planner, bound ({model.num_params / 1e6:.1f} M params, one micro-batch "
          f"of 8, fp32, {device}; H2D {h2d_gb_s:.1f} GB/s, D2H {d2h_gb_s:.1f} GB/s, host AdamW "
          f"{rate / 1e6:,.0f} M params/s, resident step {compute:.3f} s)\n")
    print("| policy | engine step s | planner s | bound s | engine / planner | engine / bound | copies a step |")
    print("|---|---|---|---|---|---|---|")
    for name, off in (("optimizer offload", {"offload_optimizer": True}),
                      ("params + optimizer", {"offload_optimizer": True, "offload_params": True})):
        e = _engine(model, off, meter=False, mb=8)
        try:
            before = e.lanes.copies()
            times = _step_times(e, steps + 2)
            after = e.lanes.copies()
        finally:
            e.close()
        step = statistics.median(times)
        kn = cost.knobs(e.stage_spec.offload)
        d2h, h2d, cpu = cost.offload_lanes(slot, TRAIN, kn.offload_params, p)
        fetch = p * TRAIN.grad_bytes / slot.host_link if kn.offload_params else 0.0
        fwd, bwd = max(compute / 3, fetch), max(2 * compute / 3, fetch)
        planner = fwd + bwd + cost.optimizer_s(slot, model, TRAIN, shape, kn, fwd + bwd, fwd)
        bound = max(compute, h2d + 2 * fetch, d2h, p / rate)
        per = {k: (after[k] - before[k]) / (steps + 2) for k in after}
        print(f"| {name} | {step:.3f} | {planner:.3f} | {bound:.3f} | {step / planner:.2f} | {step / bound:.2f}x | "
              f"H2D {per['h2d']:.0f}, D2H {per['d2h']:.0f} ({model.num_layers + 2} layers) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    cpu_optimizer(args.params, args.repeats)
    memory(args.steps)
    overlap(args.steps, args.repeats)
    host_update_overlap(args.steps, args.repeats)
    against_the_model(args.steps)


if __name__ == "__main__":
    main()
