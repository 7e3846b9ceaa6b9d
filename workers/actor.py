"""TrainWorker: the thin Ray actor around one rank's Engine (one per GPU)."""

from __future__ import annotations

import os
import socket

import ray
import torch

from planner.cost import device_budget_bytes
from planner.plan_types import Plan
from planner.specs import ModelSpec, TrainSpec
from workers.data import make_dataset
from workers.engine import Engine, StepResult
from workers.faults import FaultInjector
from workers.layout import ranks
from workers.logs import structured_logger
from workers.state import export_shards, import_full

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@ray.remote(num_cpus=0)
class TrainWorker:
    def __init__(self, plan_json: str, rank: int, model_json: str, train_json: str, data: dict,
                 dtype: str = "float32", slowdown: float = 1.0, log_every: int = 10, meter_memory: bool = False):
        torch.set_num_threads(1)  # one core per worker: the test machines are small and shared
        model, train = ModelSpec.model_validate_json(model_json), TrainSpec.model_validate_json(train_json)
        dataset = make_dataset(data.get("kind", "synthetic"), model.seq_len, model.vocab_size, train.seed,
                               data.get("path"), data.get("dtype", "uint16"))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        plan = Plan.model_validate_json(plan_json)
        r = ranks(plan)[rank]
        budget = device_budget_bytes(plan.pipelines[r.pipeline].stages[r.stage].gpu_type, train)
        self.engine = Engine(plan, rank, model, train, dataset, DTYPES[dtype], slowdown, device,
                             device_budget_bytes=budget, meter_memory=meter_memory)
        info, st = self.engine.info, self.engine.stage_spec
        self.log = structured_logger("hetspot.worker", node=info.node, rank=rank, pipeline=info.pipeline,
                                     stage=info.stage, tp_rank=info.tp_rank, gpu=st.gpu_type)
        self.log_every = log_every
        self.faults = FaultInjector()

    def rendezvous_address(self) -> str:
        """Rank 0 picks a free port on its node for torch.distributed's TCP rendezvous."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def connect(self, init_method: str, timeout_s: float) -> int:
        self.engine.connect(init_method, timeout_s)
        st = self.engine.stage_spec
        self.log.info("joined world of %d: layers [%d, %d), %d micro-batches, recompute %d layers, "
                      "offload params=%s optimizer=%s", len(self.engine.plan.devices()), st.layer_start,
                      st.layer_end, len(self.engine.pipe.micro_batch_sizes()), len(st.offload.recompute_layers),
                      st.offload.offload_params, st.offload.offload_optimizer)
        return os.getpid()

    def step(self, step_index: int) -> StepResult:
        try:
            r = self.engine.step(step_index, before=self.faults)
        except Exception as e:
            self.log.error("step %d failed: %s", step_index, e)
            raise
        peak, budget = r.extra.get("device_peak_bytes"), r.extra.get("device_budget_bytes")
        if self.engine.meter.enabled and budget and peak > budget:
            self.log.warning("step %d: device peak %.1f MiB is over the budget of %.1f MiB", step_index,
                             peak / 2**20, budget / 2**20)
        if step_index % self.log_every == 0:
            self.log.info("step %d: %d samples, %.3f s, peak memory %.1f MiB", step_index, r.num_samples,
                          r.time_s, r.peak_mem_bytes / 2**20)
        return r

    def inject_fault(self, step_index: int, kind: str = "raise") -> None:
        """Fail this rank at `step_index` (workers/faults.py), for drills and tests."""
        self.faults.fail_at(step_index, kind)

    def export_state(self) -> dict:
        return export_shards(self.engine)

    def import_state(self, full: dict, optimizer_steps: float) -> None:
        import_full(self.engine, full, optimizer_steps)

    def where(self) -> str:
        return self.engine.where

    def close(self) -> None:
        self.engine.close()
