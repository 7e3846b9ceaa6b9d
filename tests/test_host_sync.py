"""No host synchronization inside a step: the engine reads device values on the host once per step (its loss and
gradient norm, together, at the end) and nowhere else. On a GPU every such read stalls the host until the device
has caught up; the GPU checklist runs the step under `torch.cuda.set_sync_debug_mode("error")`
(tests/test_offload_engine.py's gpu tests), and here, on the CPU, a dispatch mode counts what would sync there:
scalar reads (`.item()`, `float(t)`, `bool(t)`: `aten::_local_scalar_dense`) and copies from a device to the host.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner import ModelSpec, Pipeline, Plan, Stage, TrainSpec
from workers.data import make_dataset
from workers.engine import Engine

pytestmark = pytest.mark.unit
MODEL = ModelSpec.preset("tiny")


class HostReads(TorchDispatchMode):
    """Counts the operations that make a host wait for a device: scalar reads and device-to-host copies."""

    def __init__(self):
        super().__init__()
        self.scalar_reads = self.to_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalar_reads += 1
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device", src.device)
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and torch.device(dst).type == "cpu":
                self.to_host += 1
        return func(*args, **kwargs)


def engine(precision: str, dtype: torch.dtype, offload: dict, device: str = "cpu") -> Engine:
    st = Stage(layer_start=0, layer_end=4, gpu_type="A100-80GB", node="a", devices=["a/0"], offload=offload)
    plan = Plan(model_name="tiny", num_layers=4, global_batch=8, pipelines=[
        Pipeline(num_samples=8, micro_batch_size=2, num_micro_batches=4, stages=[st])])
    e = Engine(plan, 0, MODEL, TrainSpec(global_batch=8, lr=0.01, precision=precision),
               make_dataset("synthetic", MODEL.seq_len, MODEL.vocab_size, 0), dtype, device=device)
    e.connect_alone(30)
    return e


CASES = {
    "fp32, clipped": ("fp32", torch.float32, {}),
    "bf16 masters": ("bf16", torch.bfloat16, {}),
    "fp16 loss scale": ("fp16", torch.float16, {}),
    "bf16, optimizer on the host": ("bf16", torch.bfloat16, {"offload_optimizer": True}),
    "params and optimizer on the host": ("fp32", torch.float32, {"offload_optimizer": True, "offload_params": True}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_read_per_step_and_no_scalar_read_inside_it(name):
    """Four micro-batches: a read per micro-batch's loss and one for the clip (the engine before) make five."""
    e = engine(*CASES[name])
    try:
        for step in range(3):
            before = getattr(e, "host_reads", 0)
            with HostReads() as seen:
                e.step(step)
            reads = seen.scalar_reads + seen.to_host + getattr(e, "host_reads", 0) - before
            assert reads <= 1, (f"step {step}: {seen.scalar_reads} scalar reads, {seen.to_host} device-to-host "
                                f"copies and {getattr(e, 'host_reads', 0) - before} summary reads")
    finally:
        e.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(CASES))
def test_on_cuda_a_step_syncs_the_host_once(name):
    """Every step after the first under `set_sync_debug_mode("error")`: any synchronization but the step's one
    read (which the engine allows itself) raises, and the step fails. The first step may sync (cuBLAS handles,
    first allocations, pinned buffers)."""
    precision, dtype, offload = CASES[name]
    e = engine(precision, dtype, offload, device="cuda")
    try:
        e.step(0)
        e.settle()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in (1, 2):
                e.step(step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        e.settle()
    finally:
        e.close()
