"""TrainWorker: the thin Ray actor around one rank's Engine (one per GPU)."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray
import torch

from planner.catalog import gpu_info
from planner.cost import device_budget_bytes
from planner.layout import ranks
from planner.plan_types import Plan
from planner.specs import ModelSpec, TrainSpec
from workers.data import make_dataset
from workers.engine import Engine, StepResult
from workers.faults import FaultInjector
from workers.logs import structured_logger
from workers.state import (
    MOMENTS,
    export_shards,
    import_full,
    import_moments,
    import_pieces,
    needs,
    to_numpy,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(runtime_dtype: str, precision: str, gpu_type: str) -> str:
    """The stage's compute dtype: runtime.dtype when forced, else train.precision's; bf16 becomes fp16 (with a
    loss scale) on a GPU type without bf16 (T4, V100: the catalog's `bf16`)."""
    if runtime_dtype != "auto":
        return runtime_dtype
    if precision == "bf16":
        return "bfloat16" if gpu_info(gpu_type).bf16 else "float16"
    return {"fp16": "float16", "fp32": "float32", "fp64": "float64"}[precision]


@ray.remote(num_cpus=0, concurrency_groups={"control": 1, "snapshot": 1})
class TrainWorker:
    """One rank. `step` and `commit` run in order on the default thread; `hand_over` runs on a
    "control" thread so a survivor blocked in a collective on a dead peer can still give up
    its committed state (which a pending, uncommitted step has not touched), and `receipt`
    on a thread of its own, so a copy to a peer keeper completes beside the next steps.
    `state_lock` keeps a commit from changing the state while `hand_over` copies it."""

    def __init__(self, plan_json: str, rank: int, model_json: str, train_json: str, data: dict,
                 dtype: str = "float32", slowdown: float = 1.0, log_every: int = 10, meter_memory: bool = False,
                 overlap_sync: bool = True):
        torch.set_num_threads(1)  # one core per worker: the test machines are small and shared
        model, train = ModelSpec.model_validate_json(model_json), TrainSpec.model_validate_json(train_json)
        dataset = make_dataset(data.get("kind", "synthetic"), model.seq_len, model.vocab_size, train.seed,
                               data.get("path"), data.get("dtype", "uint16"), data.get("endpoint_url"))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        plan = Plan.model_validate_json(plan_json)
        r = ranks(plan)[rank]
        budget = device_budget_bytes(plan.pipelines[r.pipeline].stages[r.stage].gpu_type, train)
        dtype = compute_dtype(dtype, train.precision, plan.pipelines[r.pipeline].stages[r.stage].gpu_type)
        self.engine = Engine(plan, rank, model, train, dataset, DTYPES[dtype], slowdown, device,
                             device_budget_bytes=budget, meter_memory=meter_memory, overlap_sync=overlap_sync)
        info, st = self.engine.info, self.engine.stage_spec
        self.log = structured_logger("hetspot.worker", node=info.node, rank=rank, pipeline=info.pipeline,
                                     stage=info.stage, tp_rank=info.tp_rank, gpu=st.gpu_type)
        self.log_every = log_every
        self.faults = FaultInjector()
        self.state_lock = threading.Lock()
        self.puts: dict = {}  # step -> (host clone of the shards, pin) waiting to go to the keeper
        self.keeper = None
        self.puts_ready = threading.Condition()
        self._restore_pool: ThreadPoolExecutor | None = None

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
        """Forward, backward and gradient sync of a step; the update waits for `commit`."""
        try:
            r = self.engine.step(step_index, before=self.faults, commit=False)
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

    def commit(self, step_index: int) -> None:
        with self.state_lock:
            self.engine.commit(step_index)

    def set_keeper(self, keeper) -> None:
        """The keeper this rank's peer snapshots go to (set apart from `snapshot`: an actor handle in a
        call's arguments can hold that call back behind later ones)."""
        self.keeper = keeper

    def snapshot(self, step_index: int, pin: bool = False) -> None:
        """Take a host clone of this rank's shards of committed step `step_index` for its keeper.

        It runs on the training thread between commits (the caller waits for it, so the clone
        is of that step); the transfer to the keeper goes on in `receipt`, beside the next steps."""
        if self.engine.committed_step != step_index:
            raise RuntimeError(f"{self.engine.where}: snapshot of step {step_index}, but step "
                               f"{self.engine.committed_step} is the committed one")
        with self.puts_ready:
            self.puts[step_index] = (to_numpy(export_shards(self.engine)), pin)
            self.puts_ready.notify_all()

    @ray.method(concurrency_group="snapshot")
    def receipt(self, step_index: int, timeout_s: float = 120.0) -> dict | None:
        """The keeper's receipt for the copy of `step_index` (metadata), once it is there; None if never started."""
        with self.puts_ready:
            if not self.puts_ready.wait_for(lambda: step_index in self.puts, timeout=timeout_s):
                return None
            shards, pin = self.puts.pop(step_index)
        return ray.get(self.keeper.put.remote("peer", step_index, self.engine.rank, shards, pin), timeout=timeout_s)

    @ray.method(concurrency_group="control")
    def hand_over(self, keeper) -> dict | None:
        """After a failure: give the committed state to this node's keeper (tier "live"), and wait until it is there."""
        with self.state_lock:
            step = self.engine.committed_step
            if step < 0:
                return None
            shards = to_numpy(export_shards(self.engine))
        ray.get(keeper.put.remote("live", step, self.engine.rank, shards), timeout=60)
        return {"rank": self.engine.rank, "step": step}

    def needs(self) -> list[dict]:
        return needs(self.engine)

    def load_state(self, step: int, optimizer_steps: float, transfers: list[tuple], s3: tuple | None,
                   overlap: bool = True) -> dict:
        """Pull this rank's state of `step` from keepers and load it (the restore planner's transfers).

        `transfers`: [(unit, region, keeper, request)], the request as `Keeper.get_many` takes it
        (a shard it holds, or an S3 piece it reads for this node). With `overlap`, keepers send the
        master weights now and AdamW's moments (two thirds of the bytes) on a thread beside the first
        step's forward and backward, which do not read them; the step waits for them before its
        update (priority by when each tensor is needed, after AutoHete's scheduled offload). S3 pieces
        come whole. Returns the bytes per tier, those still coming included (the thread checks them),
        or {"error": ...} when an S3 object fails its checksum.
        """
        t0 = time.perf_counter()
        self.engine.await_restore(raise_error=False)  # a half-done earlier restore is superseded by this one
        self.engine.incomplete = None
        split = overlap and optimizer_steps > 0  # no moments before the first update
        got, nbytes, deferred = self._pull(transfers, step, s3, ("param",) if split else None)
        if "error" in got:
            return {"error": got["error"], "bytes": nbytes}
        t1 = time.perf_counter()
        import_pieces(self.engine, self._pieces(transfers, got), optimizer_steps)
        self.engine.committed_step = step
        rest = [t for t in transfers if t[3][0] != "s3"] if any(deferred.values()) else []
        if rest:
            self.engine.restoring = self._pool().submit(self._load_moments, step, optimizer_steps, rest, deferred)
        return {"bytes": {t: nbytes[t] + deferred[t] for t in nbytes}, "pull_s": t1 - t0,
                "import_s": time.perf_counter() - t1, "deferred_bytes": sum(deferred.values())}

    def _pull(self, transfers: list[tuple], step: int, s3: tuple | None, keys: tuple[str, ...] | None):
        """({transfer index: tensors} or {"error"}, bytes read per tier, bytes of the other keys per tier)."""
        by_keeper: dict = {}
        for i, (_, _, keeper, request) in enumerate(transfers):
            by_keeper.setdefault(keeper, []).append((i, request))
        futures = [(reqs, k.get_many.remote([r for _, r in reqs], step, s3, keys)) for k, reqs in by_keeper.items()]
        nbytes, deferred = {"live": 0, "peer": 0, "s3": 0}, {"live": 0, "peer": 0, "s3": 0}
        got: dict = {}
        for reqs, fut in futures:
            answers = ray.get(fut, timeout=300)
            if answers and "error" in answers[0]:
                return {"error": answers[0]["error"]}, nbytes, deferred
            for (i, _), a in zip(reqs, answers, strict=True):
                got[i] = a["tensors"]
                nbytes[a["tier"]] += a["bytes"]
                deferred[a["tier"]] += a.get("deferred", 0)
        return got, nbytes, deferred

    @staticmethod
    def _pieces(transfers: list[tuple], got: dict) -> dict[str, list]:
        pieces: dict[str, list] = {}
        for i, (unit, region, _, _) in enumerate(transfers):
            pieces.setdefault(unit, []).append((region, got[i]))
        return pieces

    def _load_moments(self, step: int, optimizer_steps: float, transfers: list[tuple], expect: dict) -> float:
        """The overlapped half of `load_state` (on its thread): the moments, checked against what the keepers
        said they would send."""
        t0 = time.perf_counter()
        got, nbytes, _ = self._pull(transfers, step, None, MOMENTS)
        if nbytes != expect:
            raise RuntimeError(f"{self.engine.where}: the moments of step {step} came as {nbytes} bytes by tier, "
                               f"not the {expect} announced")
        import_moments(self.engine, self._pieces(transfers, got), optimizer_steps)
        return time.perf_counter() - t0

    def _pool(self) -> ThreadPoolExecutor:
        if self._restore_pool is None:
            self._restore_pool = ThreadPoolExecutor(1, thread_name_prefix="hetspot-restore")
        return self._restore_pool

    @ray.method(concurrency_group="control")
    def settle_restore(self) -> bool:
        """Wait for an overlapped restore's moments (before their source keepers are cleared); False: they failed."""
        try:
            self.engine.await_restore()
            return True
        except Exception as e:
            self.log.warning("the overlapped restore failed: %s", e)
            return False

    def inject_fault(self, step_index: int, kind: str = "raise") -> None:
        """Fail this rank at `step_index` (workers/faults.py), for drills and tests."""
        self.faults.fail_at(step_index, kind)

    def export_state(self) -> dict:
        return export_shards(self.engine)

    def import_state(self, full: dict, optimizer_steps: float, step: int = -1) -> None:
        import_full(self.engine, full, optimizer_steps)
        self.engine.committed_step = step

    def where(self) -> str:
        return self.engine.where

    def close(self) -> None:
        self.engine.close()
