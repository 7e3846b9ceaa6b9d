"""The GPU checklist (`make gpu-check`, docs/gpu.md): what to run on a CUDA machine, in one command.

    python bench/gpu_check.py [--model gpt-1.3b] [--steps 10] [--precision bf16] [--skip-tests]

1. the `gpu`-marked tests (`pytest -m gpu`: CUDA equivalence and the device memory meter);
2. `bench/offload.py` (its GPU section runs when CUDA is present);
3. a single-GPU run of the engine (bf16 mixed precision by default): tokens/s and MFU of one plan stage
   holding the whole model,
   with the step's FLOPs from the planner's cost model and the catalog's peak for this GPU;
4. the profiling pass (orchestrator/cluster/profiling.py) against the catalog: measured bf16
   matmul TFLOPS and pinned H2D/D2H bandwidth next to the datasheet figures.
Prints one table per item; paste them into docs/benchmarks.md with the device named.
Exits 2 on a machine without CUDA (nothing here can be measured on a CPU).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)

import torch  # noqa: E402

from planner import ModelSpec, Pipeline, Plan, Stage, TrainSpec, cost  # noqa: E402
from planner.catalog import gpu_info  # noqa: E402


def _gpu_type() -> str:
    """The catalog type of this CUDA device, from its name and memory (e.g. 'NVIDIA H100 80GB HBM3' -> H100-SXM)."""
    name = torch.cuda.get_device_name(0).upper()
    big = torch.cuda.get_device_properties(0).total_memory > 50 * 2**30
    by_name = {"H200": "H200", "H100": "H100-PCIe" if "PCIE" in name else "H100-SXM",
               "A100": "A100-80GB" if big else "A100-40GB", "V100": "V100-32GB" if big else "V100-16GB",
               "L40S": "L40S", "L4": "L4", "A10G": "A10G", "T4": "T4"}
    for key, gpu in by_name.items():  # in this order: "L40S" before "L4"
        if key in name:
            return gpu
    raise SystemExit(f"unknown GPU {name!r}: add it to planner/catalog.py to measure MFU against its peak")


def mfu(model_name: str, steps: int, batch: int, precision: str = "bf16") -> dict:
    from workers.actor import DTYPES, compute_dtype
    from workers.data import make_dataset
    from workers.engine import Engine

    gpu = _gpu_type()
    m = ModelSpec.preset(model_name)
    train = TrainSpec(global_batch=batch, precision=precision)
    st = Stage(layer_start=0, layer_end=m.num_layers, gpu_type=gpu, node="local", devices=["local/0"])
    plan = Plan(model_name=m.name, num_layers=m.num_layers, global_batch=batch, pipelines=[
        Pipeline(num_samples=batch, micro_batch_size=batch, num_micro_batches=1, stages=[st])])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dtype = DTYPES[compute_dtype("auto", precision, gpu)]  # bf16 mixed precision (fp16 on T4/V100), as a job trains
    e = Engine(plan, 0, m, train, make_dataset("synthetic", m.seq_len, m.vocab_size, 0), dtype, device="cuda")
    e.connect(f"tcp://127.0.0.1:{port}", 120)
    try:
        times = []
        for s in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            e.step(s)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    finally:
        e.close()
    step = statistics.median(times[1:]) if len(times) > 1 else times[0]
    flops = batch * cost.model_flops_per_sample(m) / step
    return {"gpu": gpu, "precision": precision, "model": m.name, "params_b": m.num_params / 1e9, "step_s": step,
            "tokens_per_s": batch * m.seq_len / step, "tflops": flops / 1e12,
            "mfu_vs_bf16_peak": flops / (gpu_info(gpu).peak_tflops * 1e12)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-1.3b", help="a preset (1-3B for the MFU item)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"], help="item 3's train.precision")
    ap.add_argument("--skip-tests", action="store_true", help="only the measurements (items 3 and 4)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device: the GPU checklist needs one (docs/gpu.md); on this machine run `make test`",
              file=sys.stderr)
        raise SystemExit(2)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if not args.skip_tests:
        for cmd in ([sys.executable, "-m", "pytest", "-q", "-m", "gpu"], [sys.executable, "bench/offload.py"]):
            print(f"\n$ {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True)
    r = mfu(args.model, args.steps, args.batch, args.precision)
    print("\n| GPU | model | precision | params | step s | tokens/s | TFLOPS | MFU (of bf16 peak) |\n"
          "|---|---|---|---|---|---|---|---|")
    print(f"| {r['gpu']} | {r['model']} | {r['precision']} | {r['params_b']:.2f}B | {r['step_s']:.3f} "
          f"| {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {r['mfu_vs_bf16_peak']:.1%} |")
    from orchestrator.cluster.profiling import measure

    got = measure(r["gpu"])
    info = gpu_info(r["gpu"])
    print("\n| GPU | bf16 matmul TFLOPS (measured / catalog) | H2D GB/s | D2H GB/s |\n|---|---|---|---|")
    print(f"| {r['gpu']} | {got.matmul_tflops:.0f} / {info.peak_tflops:.0f} | {got.h2d_gb_s:.1f} "
          f"| {got.d2h_gb_s:.1f} |")


if __name__ == "__main__":
    main()
