"""Offload benchmark. On this CPU-only machine: CPU AdamW throughput (issue 4, item 5).

    python bench/offload.py [--params 50e6] [--repeats 7]

Compares, on the same parameters (a GPT-shaped set of tensors, fp32):
  torch fused    torch.optim.AdamW(fused=True): what the engine's host optimizer runs
  torch foreach  torch.optim.AdamW(foreach=True)
  hetspot host   workers.engine.offloaded_update: grads device->host, fused AdamW on the
                 host copies, weights host->device (on CPU the "device" is host memory too,
                 so the copies are memcpys)
Reports median params/s over repeats and the ratio to torch fused. The hetspot row times
the update minus the separately measured time to fill the gradients it consumes.
The GPU part of the benchmark (largest trainable model per policy, step time against
the transfer/compute bound, overlap speed-up) needs a CUDA machine and is not here yet.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from workers.engine import offloaded_update  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    params = _tensors(int(args.params))
    n = sum(p.numel() for p in params)
    rows = {}
    for name, kw in (("torch fused", {"fused": True}), ("torch foreach", {"foreach": True})):
        opt = torch.optim.AdamW(params, lr=1e-4, **kw)
        rows[name] = n / _time(opt.step, args.repeats)
    host = {str(i): torch.nn.Parameter(p.detach().clone()) for i, p in enumerate(params)}
    opt = torch.optim.AdamW(list(host.values()), lr=1e-4, fused=True)
    named = [(str(i), p) for i, p in enumerate(params)]

    def step():
        for _, p in named:  # backward would have produced these
            p.grad = torch.full_like(p, 1e-3)
        offloaded_update(named, host, opt, torch.device("cpu"))

    grads_s = _time(lambda: [setattr(p, "grad", torch.full_like(p, 1e-3)) for _, p in named], args.repeats)
    rows["hetspot host update"] = n / max(_time(step, args.repeats) - grads_s, 1e-9)
    print(f"{n / 1e6:.1f} M parameters, {torch.get_num_threads()} threads, median of {args.repeats}\n")
    print("| optimizer | M params/s | vs torch fused |")
    print("|---|---|---|")
    for name, rate in rows.items():
        print(f"| {name} | {rate / 1e6:,.0f} | {rate / rows['torch fused']:.2f}x |")


if __name__ == "__main__":
    main()
