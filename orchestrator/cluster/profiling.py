"""The profiling pass: one actor per GPU type measures what the catalog only guesses.

Each actor runs on a node of its type and measures dense matmul TFLOPS and
host<->device copy bandwidth with torch. The planner takes the matmul result as
a calibrated efficiency (measured / datasheet peak, `ClusterSpec.calibration`),
the same role HexiScale and H2 give their per-device profiles. Fake GPUs (the
embedded test cluster, `ray start --num-gpus` on a CPU machine) have no CUDA
device, so their actors report a skip and the catalog's defaults stay.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("hetspot.profiling")


@dataclass(frozen=True)
class Measurement:
    gpu_type: str
    matmul_tflops: float
    h2d_gb_s: float | None
    d2h_gb_s: float | None
    device: str
    host_adamw_params_per_s: float | None = None  # the node's host AdamW (an offloaded optimizer's), all cores


def _median_time(fn, sync, repeats: int) -> float:
    fn()
    sync()  # warm-up: kernels chosen, memory allocated
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def measure(gpu_type: str, device: str = "cuda", n: int = 4096, copy_mib: int = 256, repeats: int = 5) -> Measurement:
    """Matmul TFLOPS (bf16 on CUDA, fp32 on CPU) and pinned-memory copy bandwidth (CUDA only)."""
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    t = _median_time(lambda: torch.mm(a, b), sync, repeats)
    tflops = 2 * n ** 3 / t / 1e12
    h2d, d2h = copy_gb_s(device, copy_mib, repeats) if cuda else (None, None)
    return Measurement(gpu_type, tflops, h2d, d2h, device, host_adamw_rate() if cuda else None)


def copy_gb_s(device: str, copy_mib: int = 256, repeats: int = 5) -> tuple[float, float]:
    """Host-to-device and device-to-host GB/s of copies from and to pinned host memory (on the CPU a memcpy: what
    the offload engine's copy lanes do there)."""
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    host = torch.empty(copy_mib << 20, dtype=torch.uint8, pin_memory=cuda)
    dev_buf = torch.empty_like(host, device=dev)
    h2d = host.numel() / _median_time(lambda: dev_buf.copy_(host, non_blocking=True), sync, repeats) / 1e9
    d2h = host.numel() / _median_time(lambda: host.copy_(dev_buf, non_blocking=True), sync, repeats) / 1e9
    return h2d, d2h


def host_adamw_rate(params: float = 32e6, repeats: int = 5) -> float:
    """Parameters per second of the fused AdamW an offloaded optimizer runs on the host (workers/adamw.py), on
    this node's CPU: what the planner's `cpu_adam_params_per_s` stands for. On one H200 machine of 16 cores it
    measured 4,566 M params/s against the 1,000 M the planner assumes for a node it has not measured (2026-12-04,
    bench/gpu_check.py), which made it price that machine's offloaded plans 2.3 to 3.7x slower than they ran."""
    import torch

    from workers.adamw import FusedAdamW

    ps = [torch.nn.Parameter(torch.randn(int(params) // 8)) for _ in range(8)]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    opt = FusedAdamW([{"params": ps}], lr=1e-4)
    return params / _median_time(opt.step, lambda: None, repeats)


def host_rates(measurements: list[Measurement]) -> dict[str, float]:
    """Host AdamW parameters per second by GPU type (the node the profiler ran on stands for its type's)."""
    return {m.gpu_type: m.host_adamw_params_per_s for m in measurements if m.host_adamw_params_per_s}


def calibration(measurements: list[Measurement]) -> dict[str, float]:
    """Efficiency per GPU type: measured matmul TFLOPS over the catalog's peak, kept in (0, 1]."""
    from planner.catalog import gpu_info

    out = {}
    for m in measurements:
        peak = gpu_info(m.gpu_type).peak_tflops
        out[m.gpu_type] = round(min(1.0, max(1e-3, m.matmul_tflops / peak)), 4)
    return out


def profile_cluster(nodes, timeout_s: float = 300.0) -> tuple[dict[str, float], dict[str, str], dict[str, float]]:
    """Run one profiling actor per GPU type (on the first node of that type).

    Returns (calibration by type, a note by type: what was measured or why it was skipped, the host AdamW
    rate by type: the planner's `cpu_adam_params_per_s` for that type's nodes).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=1)
    class Profiler:
        def run(self, gpu_type: str):
            import torch

            if not torch.cuda.is_available():
                return None
            return measure(gpu_type)

    first: dict[str, object] = {}
    for n in nodes:
        first.setdefault(n.gpu_type, n)
    actors = {t: Profiler.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)).remote()
              for t, n in first.items() if n.node_id}
    results = {}
    notes = {}
    try:
        refs = {t: a.run.remote(t) for t, a in actors.items()}
        for t, ref in refs.items():
            try:
                results[t] = ray.get(ref, timeout=timeout_s)
            except Exception as e:  # a failed probe keeps the catalog value; the job still runs
                notes[t] = f"profiling failed ({type(e).__name__}); using the catalog"
    finally:
        for a in actors.values():
            ray.kill(a)
    measured = [m for m in results.values() if m is not None]
    for t, m in results.items():
        if m is None:
            notes[t] = "skipped: no CUDA device on the node (fake GPU); using the catalog"
        else:
            bw = f", H2D {m.h2d_gb_s:.1f} GB/s, D2H {m.d2h_gb_s:.1f} GB/s" if m.h2d_gb_s else ""
            adam = f", host AdamW {m.host_adamw_params_per_s / 1e6:,.0f} M params/s" \
                if m.host_adamw_params_per_s else ""
            notes[t] = f"measured {m.matmul_tflops:.1f} TFLOPS{bw}{adam}"
    for t, note in notes.items():
        log.info("profiling %s: %s", t, note)
    return calibration(measured), notes, host_rates(measured)
