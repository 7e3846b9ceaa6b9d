"""bench/gpu_check.py off the GPU: what can be checked before device time is spent on it. Without CUDA it refuses
in one line (exit 2); it and everything its items import load no Ray, moto or boto3 (a GPU machine may have only
torch, numpy and carried pydantic wheels); and each measuring item runs end to end on the CPU with the `small`
preset, so a broken code path shows here and not in the first minutes of a GPU lease."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_exits_2_in_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "bench/gpu_check.py")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no CUDA device" in r.stderr, r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_it_imports_nothing_a_bare_gpu_machine_lacks():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import bench.gpu_check, workers.engine, workers.state, "
            "orchestrator.cluster.profiling, planner.estimate; "
            "print(sorted(m for m in ('ray', 'moto', 'boto3', 'botocore', 'typer', 'yaml') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_the_measuring_items_run_on_the_cpu():
    sys.path.insert(0, str(ROOT))
    import bench.gpu_check as g

    r = g.mfu("small", 3, 4, "bf16", device="cpu", gpu="H200")
    assert r["step_s"] > 0 and r["predicted"]["step_s"] > 0 and r["top_kernels"]["device"]
    o = g.offload_bound("small", 3, 4, "bf16", r["step_s"], 20.0, 20.0, device="cpu", gpu="H200")
    assert o["bound_s"] == max(o["terms"].values()) and o["ratio"] == o["step_s"] / o["bound_s"]
    assert o["predicted"]["host_gib"] > 0  # the planner's offloaded stage, not the resident one
    c = g.cold_start("small", 4, 1, device="cpu", gpu="H200")  # the restore path (import_full) and a step after it
    seg = c["median_s"]
    assert 0 < seg["import_torch"] <= seg["stage_built"] <= seg["state_allocated"] <= seg["state_loaded"]
    assert seg["state_loaded"] <= seg["first_step"]
