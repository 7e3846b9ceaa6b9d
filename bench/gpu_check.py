"""The GPU checklist (`make gpu-check`, docs/gpu.md): what to run on a CUDA machine, in one command.

    python bench/gpu_check.py [--model gpt-1.3b] [--steps 10] [--precision bf16] [--skip-tests] [--json F]

1. the `gpu`-marked tests (`pytest -m gpu`: CUDA equivalence and the device memory meter);
2. `bench/offload.py` (its memory and overlap items run on CUDA when it is present), and the offloaded step of
   item 3's model (optimizer and parameters on the host) against the physical bound
   max(compute, H2D, D2H, CPU AdamW), each term measured on this machine;
3. a single-GPU run of the engine (bf16 mixed precision by default): tokens/s and MFU of one plan stage
   holding the whole model, with the step's FLOPs from the planner's cost model and the catalog's peak for
   this GPU, next to the planner's predicted step time and memory for the same stage; the torch profiler's
   top kernels of one step say where the time goes;
4. the profiling pass (orchestrator/cluster/profiling.py) against the catalog: measured bf16
   matmul TFLOPS and pinned H2D/D2H bandwidth next to the datasheet figures;
5. a cold worker start, to the simulator's `startup_s`: a new Python process importing torch and the
   worker's modules, the CUDA context, item 3's stage built, its state loaded from pinned host memory
   (workers/state.py import_full, the restore path) and its first step.
Each item prints a table and, with `--json`, adds its figures to one JSON file as it ends (a run cut short
keeps what it finished); an item that fails is reported and the next one runs.
Exits 2 on a machine without CUDA (nothing here can be measured on a CPU).

Needs torch, numpy and pydantic (planner/); no Ray, no moto, no boto3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)

import torch  # noqa: E402

from orchestrator.cluster.profiling import host_adamw_rate  # noqa: E402
from planner import ClusterSpec, ModelSpec, NodeSpec, Pipeline, Plan, Stage, TrainSpec, cost  # noqa: E402
from planner.catalog import gpu_info  # noqa: E402

# the files holding `gpu`-marked tests (the rest import Ray or moto), and the pure point-to-point model check
GPU_TESTS = ["tests/test_offload_engine.py", "tests/test_host_sync.py", "tests/test_engine_ranks.py"]
PURE_TESTS = ["tests/test_p2p.py"]
OFFLOAD = {"offload_optimizer": True, "offload_params": True}


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


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_stage(m: ModelSpec, gpu: str, batch: int, offload: dict | None = None) -> Plan:
    st = Stage(layer_start=0, layer_end=m.num_layers, gpu_type=gpu, node="local", devices=["local/0"],
               offload=offload or {})
    return Plan(model_name=m.name, num_layers=m.num_layers, global_batch=batch, pipelines=[
        Pipeline(num_samples=batch, micro_batch_size=batch, num_micro_batches=1, stages=[st])])


def build(m: ModelSpec, gpu: str, batch: int, precision: str, device: str, offload: dict | None = None):
    """One engine stage holding the whole model, connected (gloo, world size 1), as a job's worker builds it."""
    from workers.data import make_dataset
    from workers.engine import DTYPES, Engine, compute_dtype

    train = TrainSpec(global_batch=batch, precision=precision)
    dtype = DTYPES[compute_dtype("auto", precision, gpu)]  # bf16 mixed precision (fp16 on T4/V100), as a job trains
    e = Engine(one_stage(m, gpu, batch, offload), 0, m, train, make_dataset("synthetic", m.seq_len, m.vocab_size, 0),
               dtype, device=device)
    e.connect_alone(120)
    return e


def _step_times(e, steps: int, device: str, sync_debug: str = "off") -> list[float]:
    """Wall time of each step call, back to back as a job runs them: an offloaded stage's host update of one step
    overlaps the next step's forward, which waits for it layer by layer, so each call's time is the step's
    share (each step ends with its one read of the device, and the last update is waited for after the last
    step). With `sync_debug` "error" every step after the first runs under
    `torch.cuda.set_sync_debug_mode("error")`: a host synchronization inside it raises (the warm-up step may
    sync: first-use allocations, cuBLAS handles)."""
    times = []
    _sync(device)
    for s in range(steps):
        t0 = time.perf_counter()
        strict = sync_debug == "error" and s > 0 and device.startswith("cuda")
        if strict:
            torch.cuda.set_sync_debug_mode("error")
        try:
            e.step(s)
        finally:
            if strict:
                torch.cuda.set_sync_debug_mode(0)
        times.append(time.perf_counter() - t0)
    e.settle()
    _sync(device)
    return times


def model_of(name: str) -> ModelSpec:
    """A preset, or `preset:layers`: the preset's shapes at that depth (llama-8b:16, its first 16 layers' worth
    of a model, where the whole one's host state does not fit the machine)."""
    preset, _, layers = name.partition(":")
    m = ModelSpec.preset(preset)
    return m.model_copy(update={"num_layers": int(layers), "name": name}) if layers else m


def predicted(m: ModelSpec, gpu: str, batch: int, precision: str, offload: dict | None = None,
              cpu_adam_params_per_s: float | None = None) -> dict:
    """The planner's cost model for the same stage on this GPU type: step time, device and host memory. With
    `cpu_adam_params_per_s`, the node's host AdamW rate as measured here (a job's profiling would give it)."""
    from planner.estimate import closed_form

    node = {"cpu_adam_params_per_s": cpu_adam_params_per_s} if cpu_adam_params_per_s else {}
    cluster = ClusterSpec(nodes=[NodeSpec(name="local", gpu_type=gpu, num_gpus=1, **node)])
    est = closed_form(one_stage(m, gpu, batch, offload), cluster, m, TrainSpec(global_batch=batch,
                                                                              precision=precision))
    return {"step_s": est.step_time_s, "mem_gib": max(est.memory_gib.values()), "mfu": est.mfu,
            "host_gib": sum(est.host_gib.values()), "bottleneck": est.bottleneck}


def top_kernels(e, step: int, device: str, n: int = 12, stacks: bool = False) -> dict[str, list[dict]]:
    """The torch profiler over one step: the kernels with the most device time, and the host ops with the most
    time of their own (where an offloaded step's host side goes); with `stacks`, the host ops also grouped by
    the hetspot line that called them (`by_caller`)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts, with_stack=stacks) as prof:
        e.step(step)
        e.settle()
        _sync(device)
    ops = [k for k in prof.key_averages() if not k.key.startswith("ProfilerStep")]
    callers: list[dict] = []
    if stacks:  # each op's own host time, charged to the innermost hetspot frame above it (the Python tracer's)
        by: dict[str, list[float]] = {}
        for ev in prof.events():
            if ".py(" in ev.name or ev.name.startswith(("<built-in", "ProfilerStep")):
                continue
            frame, up = "?", ev.cpu_parent
            while up is not None:
                if up.name.startswith(("workers/", "planner/")) or "/workers/" in up.name:
                    frame = up.name.split("/")[-1]
                    break
                up = up.cpu_parent
            got = by.setdefault(f"{ev.name[:40]} <- {frame}", [0.0, 0])
            got[0] += ev.self_cpu_time_total / 1e3
            got[1] += 1
        total_ms = sum(ms for ms, _ in by.values()) or 1.0
        callers = [{"op": key[:90], "ms": ms, "calls": c, "share": ms / total_ms}
                   for key, (ms, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:n]]

    def rows(attr: str) -> list[dict]:
        total = sum(getattr(k, attr, 0.0) for k in ops)
        top = sorted(ops, key=lambda k: getattr(k, attr, 0.0), reverse=True)[:n]
        return [{"op": k.key[:90], "ms": getattr(k, attr) / 1e3, "calls": k.count,
                 "share": getattr(k, attr) / total if total else 0.0} for k in top]

    return {"device": rows("device_time_total" if device.startswith("cuda") else "cpu_time_total"),
            "host_self": rows("self_cpu_time_total"), "by_caller": callers}


def sync_sites(e, step: int, device: str) -> dict:
    """One step under `torch.cuda.set_sync_debug_mode("warn")`: every host synchronization it makes, by the
    hetspot line that made it (the Python stack when the warning is raised). On CPU there is none to find."""
    import traceback
    import warnings

    if not device.startswith("cuda"):
        return {"syncs": 0, "sites": {}}
    sites: dict[str, int] = {}

    def hook(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" not in str(message):  # not the debug mode's own notice that it is a prototype
            return
        stack = traceback.extract_stack()[:-1]
        ours = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack
                if "/workers/" in f.filename or "/planner/" in f.filename]
        if not ours:  # outside hetspot's code (an autograd thread, torch itself): the innermost frames, whatever
            ours = [f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack[-4:]]
        key = " <- ".join(ours[-3:][::-1]) or f"{filename}:{lineno}"
        sites[key] = sites.get(key, 0) + 1

    old = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            e.step(step)
            e.settle()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
    _sync(device)
    return {"syncs": sum(sites.values()), "sites": sites}


def mfu(model_name: str, steps: int, batch: int, precision: str = "bf16", device: str = "cuda",
        gpu: str | None = None, offload: dict | None = None, sync_debug: str = "off",
        cpu_adam_params_per_s: float | None = None) -> dict:
    """Item 3 (and the Llama item, with `offload`): one stage holding the whole model, step time, MFU, peak device
    memory, each beside the planner's; the step's host synchronizations (`sync_sites`) after the timed steps."""
    gpu = gpu or _gpu_type()
    m = model_of(model_name)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    e = build(m, gpu, batch, precision, device, offload)
    build_s = time.perf_counter() - t_build
    try:
        times = _step_times(e, steps, device, sync_debug)
        peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
        syncs = sync_sites(e, steps, device)
        kernels = top_kernels(e, steps + 1, device)
    finally:
        e.close()
    step = statistics.median(times[1:]) if len(times) > 1 else times[0]
    flops = batch * cost.model_flops_per_sample(m) / step
    want = predicted(m, gpu, batch, precision, offload)
    if offload and cpu_adam_params_per_s:
        want["with_measured_host"] = predicted(m, gpu, batch, precision, offload, cpu_adam_params_per_s)
    return {"gpu": gpu, "precision": precision, "model": m.name, "params_b": m.num_params / 1e9, "batch": batch,
            "seq_len": m.seq_len, "step_s": step, "step_times_s": times, "tokens_per_s": batch * m.seq_len / step,
            "tflops": flops / 1e12, "mfu_vs_bf16_peak": flops / (gpu_info(gpu).peak_tflops * 1e12),
            "peak_mem_gib": peak / 2**30, "predicted": want, "top_kernels": kernels, "sync_sites": syncs,
            "offload": offload or {}, "sync_debug": sync_debug, "build_s": build_s,
            "host_state_gib": e.host_state_bytes() / 2**30}


def offload_bound(model_name: str, steps: int, batch: int, precision: str, compute_s: float, h2d_gb_s: float,
                  d2h_gb_s: float, device: str = "cuda", gpu: str | None = None,
                  cpu_adam_params_per_s: float | None = None) -> dict:
    """The offloaded step (optimizer and parameters on the host, prefetch one layer ahead) against
    max(compute, H2D, D2H, CPU AdamW), each term measured on this machine: compute is the resident step of item
    3; the fp32 masters cross H2D twice a step (forward and backward; cast on the device), the gradients cross
    D2H once in fp32 (cast on the device), and the host AdamW updates every parameter at the rate measured
    here. Beside it the bound the update's order allows: the update waits for the step's global norm and its
    commit, so it overlaps the next forward and not this backward (max(compute, AdamW + backward), backward
    taken as two thirds of compute)."""
    gpu = gpu or _gpu_type()
    m = model_of(model_name)
    e = build(m, gpu, batch, precision, device, OFFLOAD)
    try:
        times = _step_times(e, steps, device)
        syncs = sync_sites(e, steps, device)
        profiled = top_kernels(e, steps + 1, device, stacks=True)
        copies = e.lanes.copies() if e.lanes is not None else {}
    finally:
        e.close()
    step = statistics.median(times[1:]) if len(times) > 1 else times[0]
    rate = cpu_adam_params_per_s or host_adamw_rate()  # the profiling pass's measure (a job's planner gets it)
    terms = {"compute_s": compute_s, "h2d_s": 2 * m.num_params * 4 / (h2d_gb_s * 1e9),
             "d2h_s": m.num_params * 4 / (d2h_gb_s * 1e9), "cpu_adamw_s": m.num_params / rate}
    bound = max(terms.values())
    ordered = max(bound, terms["cpu_adamw_s"] + 2 * compute_s / 3)
    return {"model": m.name, "step_s": step, "step_times_s": times, "bound_s": bound, "ratio": step / bound,
            "ordered_bound_s": ordered, "ratio_to_ordered": step / ordered,
            "terms": terms, "host_adamw_params_per_s": rate, "top_ops": profiled, "sync_sites": syncs,
            "copies": copies, "predicted": predicted(m, gpu, batch, precision, OFFLOAD),
            "predicted_with_measured_host": predicted(m, gpu, batch, precision, OFFLOAD, rate)}


COLD = r"""
import json, sys, time
def seg(key, at=None):  # each segment as it ends, so a child cut short still says how far it got
    print("SEG " + json.dumps([key, time.time() if at is None else at]), flush=True)
seg("spawned")
import torch
seg("import_torch")
sys.path.insert(0, sys.argv[1])
from bench.gpu_check import build
from planner import ModelSpec
from workers.state import KEYS, export_shards, import_full
seg("import_hetspot")
dev = sys.argv[5]
if dev.startswith("cuda"):
    torch.zeros(1, device=dev); torch.cuda.synchronize()
seg("cuda_context")
m = ModelSpec.preset(sys.argv[2])
e = build(m, sys.argv[3], int(sys.argv[4]), "bf16", dev)
if dev.startswith("cuda"):
    torch.cuda.synchronize()
seg("stage_built")
e.step(0); e.settle()  # allocates the AdamW state, as a worker that has loaded a step holds it
if dev.startswith("cuda"):
    torch.cuda.synchronize()
built = time.time()
seg("state_allocated", built)
pin = (lambda v: v.pin_memory()) if dev.startswith("cuda") else (lambda v: v)
held = {n: {k: pin(s[k]) for k in KEYS if s[k] is not None}
        for n, s in export_shards(e).items()}  # what a peer or the host would hold (not counted: set-up)
t0 = time.time()
import_full(e, held, 1.0)
if dev.startswith("cuda"):
    torch.cuda.synchronize()
loaded = time.time() - t0 + built
seg("state_loaded", loaded)
t0 = time.time()
e.step(1); e.settle()
if dev.startswith("cuda"):
    torch.cuda.synchronize()
seg("first_step", time.time() - t0 + loaded)
e.close()
"""


def cold_start(model_name: str, batch: int, trials: int, device: str = "cuda", gpu: str | None = None,
               timeout_s: float = 600) -> dict:
    """A worker process from nothing to its first step, in segments (medians over trials), seconds from the
    parent's spawn. The set-up between the state's allocation and its load (exporting and pinning what a peer
    would hold) is not counted: the segments after it are shifted back by it. A child cut short by `timeout_s`
    keeps the segments it reached (`complete` false)."""
    gpu = gpu or _gpu_type()
    runs, complete = [], True
    for _ in range(trials):
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-c", COLD, str(ROOT), model_name, gpu, str(batch), device],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            complete = False
        t = dict(json.loads(ln[4:]) for ln in out.splitlines() if ln.startswith("SEG "))
        if proc.returncode and complete:
            raise RuntimeError(f"the cold-start child failed ({proc.returncode}): {err[-2000:]}")
        runs.append({k: v - t0 for k, v in t.items()})
        if not complete:
            break
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    return {"model": model_name, "trials": len(runs), "complete": complete, "median_s": med, "runs": runs,
            "to_ready_s": med.get("state_loaded"), "to_first_step_s": med.get("first_step")}


def measure_links(gpu: str) -> dict:
    """The profiling pass (matmul, pinned copies) and the host AdamW rate the offload terms use."""
    from orchestrator.cluster.profiling import measure

    got = measure(gpu)
    info = gpu_info(gpu)
    return {"matmul_tflops": got.matmul_tflops, "catalog_peak_tflops": info.peak_tflops,
            "matmul_share_of_peak": got.matmul_tflops / info.peak_tflops, "h2d_gb_s": got.h2d_gb_s,
            "d2h_gb_s": got.d2h_gb_s, "catalog_host_link_gb_s": info.host_link_gb_s,
            "host_adamw_params_per_s": got.host_adamw_params_per_s, "cpus": os.cpu_count()}


def _device() -> dict:
    p = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        driver = "unknown"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"name": torch.cuda.get_device_name(0), "memory_gib": p.total_memory / 2**30, "sms": p.multi_processor_count,
            "driver": driver, "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "commit": commit.stdout.strip() or "unknown (not a git checkout)",
            "command": " ".join(["python", "bench/gpu_check.py", *sys.argv[1:]])}


class Report:
    """The figures so far, written after every item (a run cut short keeps what it finished)."""

    def __init__(self, path: str | None):
        self.path, self.data = path, {}

    def item(self, key: str, fn, *args, **kw):
        print(f"\n== {key}", flush=True)
        t0 = time.perf_counter()
        try:
            self.data[key] = fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - one item's failure is reported and the next item runs
            traceback.print_exc()
            self.data[key] = {"error": f"{type(exc).__name__}: {exc}"}
        self.data.setdefault("seconds", {})[key] = time.perf_counter() - t0
        if self.path:
            Path(self.path).write_text(json.dumps(self.data, indent=1, default=str))
        return self.data[key]


def _run(cmd: list[str], timeout: int) -> dict:
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    out = subprocess.run(cmd, cwd=ROOT, timeout=timeout)
    return {"command": " ".join(cmd[1:]), "returncode": out.returncode}


def _table(header: list[str], rows: list[list[str]]) -> None:
    print("\n| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _ops(rows: list[dict]) -> list[list[str]]:
    return [[f"`{k['op']}`", f"{k['ms']:.2f}", str(k["calls"]), f"{k['share']:.1%}"] for k in rows]


def _mfu_table(r: dict) -> None:
    p = r["predicted"]
    where = "optimizer on the host" if r.get("offload") else "all on the device"
    _table(["GPU", "model", "state", "precision", "params", "step s (planner)", "tokens/s", "TFLOPS",
            "MFU (of bf16 peak)", "peak GiB (planner)"],
           [[r["gpu"], r["model"], where, r["precision"], f"{r['params_b']:.2f}B",
             f"{r['step_s']:.3f} ({p['step_s']:.3f})", f"{r['tokens_per_s']:,.0f}", f"{r['tflops']:.1f}",
             f"{r['mfu_vs_bf16_peak']:.1%}", f"{r['peak_mem_gib']:.1f} ({p['mem_gib']:.1f})"]])
    if "top_kernels" in r:
        _table(["kernel", "ms", "calls", "share"], _ops(r["top_kernels"]["device"]))
    _syncs(r)


def _syncs(r: dict) -> None:
    if "sync_sites" not in r:
        return
    sites = r["sync_sites"].get("sites", {})
    _table([f"host syncs in one step: {sum(sites.values())}", "count"], [[f"`{k}`", str(v)] for k, v in sites.items()])


def _print_header(d: dict) -> None:
    dev = d.get("device", {})
    print(f"{dev.get('name', 'a GPU')} ({dev.get('memory_gib', 0):.1f} GiB, {dev.get('sms', '?')} SMs), driver "
          f"{dev.get('driver', '?')}, CUDA {dev.get('cuda', '?')}, torch {dev.get('torch', '?')}, Python "
          f"{dev.get('python', '?')}, {dev.get('cpus', '?')} CPU cores; {dev.get('date', 'date not recorded')}, "
          f"commit {dev.get('commit', '?')}: `{dev.get('command', 'python bench/gpu_check.py')}`")
    if d.get("transcribed"):
        print(f"\n{d['transcribed']}")


def _print_tables(d: dict) -> None:
    if "step_s" in d.get("mfu", {}):
        _mfu_table(d["mfu"])
    o = d.get("offload", {})
    if "step_s" in o:
        t = o["terms"]
        _table(["offloaded step s", "planner (catalog / measured host)", "compute", "H2D", "D2H", "CPU AdamW", "bound",
                "step / bound", "AdamW + bwd", "step / that"],
               [[f"{o['step_s']:.3f}",
                 f"{o['predicted']['step_s']:.3f} / {o['predicted_with_measured_host']['step_s']:.3f}",
                 f"{t['compute_s']:.3f}", f"{t['h2d_s']:.3f}", f"{t['d2h_s']:.3f}", f"{t['cpu_adamw_s']:.3f}",
                 f"{o['bound_s']:.3f}", f"{o['ratio']:.2f}x", f"{o['ordered_bound_s']:.3f}",
                 f"{o['ratio_to_ordered']:.2f}x"]])
        if "top_ops" in o:
            _table(["offloaded step: host op (own time)", "ms", "calls", "share"], _ops(o["top_ops"]["host_self"]))
            _table(["offloaded step: host op <- hetspot caller", "ms", "calls", "share"],
                   _ops(o["top_ops"]["by_caller"]))
            _table(["offloaded step: kernel", "ms", "calls", "share"], _ops(o["top_ops"]["device"]))
        _syncs(o)
    if "step_s" in d.get("llama", {}):
        _mfu_table(d["llama"])
    for key in ("llama_big",):
        if "step_s" in d.get(key, {}):
            _mfu_table(d[key])
    g = d.get("links", {})
    if "matmul_tflops" in g:
        _table(["bf16 matmul TFLOPS (measured / catalog)", "H2D GB/s", "D2H GB/s", "catalog link GB/s",
                "host AdamW M params/s"],
               [[f"{g['matmul_tflops']:.0f} / {g['catalog_peak_tflops']:.0f}", f"{g['h2d_gb_s']:.1f}",
                 f"{g['d2h_gb_s']:.1f}", f"{g['catalog_host_link_gb_s']:.0f}",
                 f"{g['host_adamw_params_per_s'] / 1e6:,.0f}"]])
    c = d.get("cold_start", {})
    if "median_s" in c:
        _table([f"cold start, s from spawn (median of {c['trials']}{'' if c['complete'] else ', cut short'})", ""],
               [[k, f"{v:.2f}"] for k, v in c["median_s"].items()])


ITEMS = ("tests", "offload_bench", "links", "mfu", "offload", "cold_start", "llama", "llama_big")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-1.3b", help="a preset (1-3B for the MFU item)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"], help="item 3's train.precision")
    ap.add_argument("--items", default=",".join(ITEMS), help=f"which items, comma-separated, of {', '.join(ITEMS)}")
    ap.add_argument("--skip-tests", action="store_true", help="only the measurements (no tests, no offload_bench)")
    ap.add_argument("--sync-debug", default="off", choices=["off", "warn", "error"],
                    help="the timed steps under torch.cuda.set_sync_debug_mode (error: a host sync raises and the item "
                         "has no figures; either way one more step runs under 'warn' and the item fails where it "
                         "synced: `sync_sites`)")
    ap.add_argument("--llama", default="llama-1b", help="the Llama item's preset (its optimizer on the host)")
    ap.add_argument("--llama-big", default="llama-8b:16",
                    help="the second Llama item (preset[:layers]): llama-8b's shapes at the depth whose host state "
                         "(16 bytes a parameter) fits this machine's memory")
    ap.add_argument("--llama-batch", type=int, default=4)
    ap.add_argument("--cold-trials", type=int, default=2, help="item 5's worker starts (0: skip it)")
    ap.add_argument("--cold-timeout", type=float, default=300, help="seconds a cold-start child may take")
    ap.add_argument("--json", help="write the figures here, after every item")
    ap.add_argument("--tables-from", metavar="RUN.json", help="print the tables of a run's --json file (no GPU "
                    "needed: bench/report.py writes docs/benchmarks.md's GPU section with it)")
    args = ap.parse_args()
    if args.tables_from:
        try:
            saved = json.loads(Path(args.tables_from).read_text())
        except (OSError, ValueError) as exc:
            print(f"error: --tables-from {args.tables_from}: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        _print_header(saved)
        _print_tables(saved)
        return
    items = set(args.items.split(","))
    if unknown := items - set(ITEMS):
        print(f"error: --items: unknown {', '.join(sorted(unknown))}; choose from {', '.join(ITEMS)}", file=sys.stderr)
        raise SystemExit(2)
    if args.skip_tests:
        items -= {"tests", "offload_bench"}
    if not torch.cuda.is_available():
        print("error: no CUDA device: the GPU checklist needs one (docs/gpu.md); on this machine run `make test`",
              file=sys.stderr)
        raise SystemExit(2)
    rep = Report(args.json)
    dev = rep.item("device", _device)
    print(dev)
    if "tests" in items:
        rep.item("gpu_tests", _run, [sys.executable, "-m", "pytest", "-q", "-m", "gpu", *GPU_TESTS], 300)
        rep.item("model_check", _run, [sys.executable, "-m", "pytest", "-q", *PURE_TESTS], 120)
    if "offload_bench" in items:
        rep.item("offload_bench", _run, [sys.executable, "bench/offload.py"], 300)
    gpu = _gpu_type()
    links = rep.item("links", measure_links, gpu) if items & {"links", "offload", "llama", "llama_big"} else {}
    rate = links.get("host_adamw_params_per_s")
    r = rep.item("mfu", mfu, args.model, args.steps, args.batch, args.precision, sync_debug=args.sync_debug) \
        if "mfu" in items or "offload" in items else {}
    if "offload" in items and "step_s" in r and "h2d_gb_s" in links:
        rep.item("offload", offload_bound, args.model, max(5, args.steps // 2), args.batch, args.precision,
                 r["step_s"], links["h2d_gb_s"], links["d2h_gb_s"], cpu_adam_params_per_s=rate)
    if "cold_start" in items and args.cold_trials:
        rep.item("cold_start", cold_start, args.model, args.batch, args.cold_trials, timeout_s=args.cold_timeout)
    for key, name in (("llama", args.llama), ("llama_big", args.llama_big)):
        if key in items:
            rep.item(key, mfu, name, max(5, args.steps // 2), args.llama_batch, args.precision,
                     offload={"offload_optimizer": True}, sync_debug=args.sync_debug, cpu_adam_params_per_s=rate)
    _print_tables(rep.data)
    failed = [k for k, v in rep.data.items() if isinstance(v, dict) and ("error" in v or v.get("returncode")
                                                                      or v.get("sync_sites", {}).get("syncs"))]
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
