"""TrainWorker: the thin Ray actor around one rank's Engine (one per GPU).

The module imports no torch: the controller imports it to create workers, and its process needs none of the
worker's side (torch was 2.4 s of CPU of every job's controller start, on the test machines). What a worker's
methods use from torch and the engine they import where they run, in the worker's process, and `__init__` imports
them all first (so a worker pays them where it always did, and no two of its threads import a module at once).
"""

from __future__ import annotations

import os
import threading
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import ray

from planner.cost import device_budget_bytes
from planner.layout import ranks
from planner.plan_types import Plan
from planner.specs import ModelSpec, TrainSpec
from workers.faults import FaultInjector
from workers.logs import structured_logger
from workers.s3_data import CacheConfig
from workers.transfer import (
    CheckpointLocation,
    Fetch,
    HeldRow,
    KeptState,
    LoadReport,
    NeedRow,
    Piece,
    PieceRequest,
    Receipt,
    Refused,
    StepResult,
    Tier,
)

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from workers.data import Dataset
    from workers.engine import Engine


def _warm_up(device: str) -> None:
    """What a process pays once, before its first stage: the device context, and a first backward and fused
    optimizer update on it (workers/adamw.py: torch's kernel, without torch.optim's import of torch._dynamo)."""
    import torch

    from workers.adamw import FusedAdamW

    p = torch.nn.Parameter(torch.zeros(1, device=device))
    opt = FusedAdamW([{"params": [p]}], lr=1e-3)
    p.sum().backward()
    opt.step()


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker of a job is built with, passed whole (runtime/worker_group.py makes it from the job
    file: its model, train and data sections and the runtime settings a worker reads)."""

    model_json: str
    train_json: str
    data: dict = field(default_factory=dict)  # the job's data section (kind, path, dtype, cache, ...)
    dtype: str = "auto"  # runtime.dtype
    log_every: int = 10  # runtime.log_every
    meter_memory: bool = False  # runtime.meter_memory
    overlap_sync: bool = True  # runtime.overlap_grad_sync
    threads: int = 1  # runtime.torch_threads, resolved for the node
    control_timeout_s: float = 60.0  # runtime.timeouts.control_s: a keeper's receipt of a copy
    transfer_timeout_s: float = 300.0  # runtime.timeouts.transfer_s: a restore's pull from one source


@ray.remote(num_cpus=0, concurrency_groups={"control": 1, "snapshot": 1, "serve": 1})  # type: ignore[call-overload]
class TrainWorker:
    """One rank. `step` and `commit` run in order on the default thread; `hand_over` runs on a
    "control" thread so a survivor blocked in a collective on a dead peer can still give up
    its committed state (which a pending, uncommitted step has not touched), and `receipt`
    on a thread of its own, so a copy to a peer keeper completes beside the next steps.
    `state_lock` keeps a commit from changing the state while `hand_over` copies it.

    In-place recovery (runtime.recovery: in-place) keeps the process across plans: `retain` keeps the
    committed state and lets go of the stage and its groups, `reconfigure` makes the process a rank of the
    next plan, and `get_many` (on the "serve" thread) hands the kept state to ranks that need it. The restore's
    own work (what is kept, the pull, the overlapped load) is workers/restore.py's; this is its Ray adapter."""

    def __init__(self, plan_json: str | None, rank: int, config: WorkerConfig, slowdown: float = 1.0):
        import torch
        import torch.distributed  # noqa: F401

        import workers.engine  # noqa: F401  (every module a method imports, imported before any runs on a thread)
        from workers.data import make_datasets
        from workers.restore import Kept, Restore

        torch.set_num_threads(config.threads)  # the node's CPUs per GPU (runtime.torch_threads; 1 on test nodes)
        self.model = ModelSpec.model_validate_json(config.model_json)
        self.train = TrainSpec.model_validate_json(config.train_json)
        data = config.data
        # the training set (held-out windows left out), of the shards the job indexed at submit
        self.dataset = make_datasets(data, self.model.seq_len, self.model.vocab_size, self.train.seed,
                                     CacheConfig.from_data(data))[0]
        self.held_out: Dataset | None = None  # the validation set, made at the first evaluation
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.config = config
        self.log_every = config.log_every
        self.faults = FaultInjector()
        self.state_lock = threading.Lock()
        self.puts: dict = {}  # step -> [(host clone of the shards, pin, keeper)] waiting to go, in the order taken
        self.keeper: Any = None  # this node's KeeperStore handle
        self.puts_ready = threading.Condition()
        self.kept = Kept()  # committed state kept for the next plan (in place)
        # the worker half of restores (workers/restore.py)
        self.restores = Restore(self.kept, ray.get, config.transfer_timeout_s)
        self.engine: Engine | None = None
        self.rendezvous: TCPStore | None = None  # rank 0's: the group's rendezvous store, served here
        self.log = structured_logger("hetspot.worker", rank=rank)
        if plan_json is None:  # a warm worker: imports done and the device context made, in no group yet
            _warm_up(self.device)
            return
        self._configure(plan_json, rank, slowdown)

    @property
    def running(self) -> Engine:
        """This rank's engine (a warm worker, or a kept one between plans, has none)."""
        if self.engine is None:
            raise RuntimeError(f"worker process {os.getpid()} is no rank of a plan now")
        return self.engine

    def ready(self) -> int:
        """This process's id, once its constructor has run (a warm worker is then ready for `reconfigure`)."""
        return os.getpid()

    def _configure(self, plan_json: str, rank: int, slowdown: float) -> None:
        from workers.engine import DTYPES, Engine, compute_dtype

        plan = Plan.model_validate_json(plan_json)
        r = ranks(plan)[rank]
        gpu = plan.pipelines[r.pipeline].stages[r.stage].gpu_type
        dtype = compute_dtype(self.config.dtype, self.train.precision, gpu)
        self.engine = Engine(plan, rank, self.model, self.train, self.dataset, DTYPES[dtype], slowdown, self.device,
                             device_budget_bytes=device_budget_bytes(gpu, self.train),
                             meter_memory=self.config.meter_memory, overlap_sync=self.config.overlap_sync)
        info, st = self.engine.info, self.engine.stage_spec
        self.log = structured_logger("hetspot.worker", node=info.node, rank=rank, pipeline=info.pipeline,
                                     stage=info.stage, tp_rank=info.tp_rank, gpu=st.gpu_type)

    def reconfigure(self, plan_json: str, rank: int, slowdown: float) -> int:
        """Become `rank` of another plan in this same process (in-place recovery): the process, its imports and
        its device context stay; the stage is built anew at `connect`, and the state it held before comes from
        `kept` (0 bytes moved) through the restore like any other source. Returns the process id."""
        if self.engine is not None:
            self._close_engine()
        self._configure(plan_json, rank, slowdown)
        return os.getpid()

    def _close_engine(self) -> None:
        try:
            self.running.close()
        except Exception as e:  # a failed overlapped update: this engine's state is not used again
            self.log.warning("closing the old stage: %s", e)
        self.engine = None

    def rendezvous_address(self) -> str:
        """Rank 0 serves the group's rendezvous store on its node, on a port the store binds itself and holds:
        a port found free, let go and bound again later could be taken meanwhile by another process on the node
        (gloo's pair sockets take ephemeral ports), which failed the start-up with EADDRINUSE."""
        from torch.distributed import TCPStore

        ip = ray.util.get_node_ip_address()
        self.rendezvous = TCPStore(ip, 0, None, True, timedelta(seconds=60), wait_for_workers=False)
        return f"tcp://{ip}:{self.rendezvous.port}"

    def connect(self, init_method: str, timeout_s: float) -> int:
        """Join the group whose rendezvous store rank 0 serves at `init_method` (its own store on rank 0)."""
        from torch.distributed import TCPStore

        timeout = timedelta(seconds=timeout_s)
        if self.running.rank == 0 and self.rendezvous is not None:
            store = self.rendezvous
            store.set_timeout(timeout)
        else:  # a kept process that served an earlier group's store and is not rank 0 now lets it go
            host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
            store, self.rendezvous = TCPStore(host, int(port), None, False, timeout), None
        self.running.connect(init_method, timeout_s, store=store)
        st = self.running.stage_spec
        self.log.info("joined world of %d: layers [%d, %d), %d micro-batches, recompute %d layers, "
                      "offload params=%s optimizer=%s", len(self.running.plan.devices()), st.layer_start,
                      st.layer_end, len(self.running.pipe.micro_batch_sizes()), len(st.offload.recompute_layers),
                      st.offload.offload_params, st.offload.offload_optimizer)
        return os.getpid()

    def step(self, step_index: int) -> StepResult:
        """Forward, backward and gradient sync of a step; the update waits for `commit`."""
        try:
            r = self.running.step(step_index, before=self.faults, commit=False)
        except Exception as e:
            self.log.error("step %d failed: %s", step_index, e)
            self._let_go(e)
            raise
        peak, budget = r.extra.get("device_peak_bytes"), r.extra.get("device_budget_bytes")
        if self.running.meter.enabled and budget and peak is not None and peak > budget:
            self.log.warning("step %d: device peak %.1f MiB is over the budget of %.1f MiB", step_index,
                             peak / 2**20, budget / 2**20)
        if step_index % self.log_every == 0:
            self.log.info("step %d: %d samples, %.3f s, peak memory %.1f MiB", step_index, r.num_samples,
                          r.time_s, r.peak_mem_bytes / 2**20)
        return r

    def evaluate(self, batches: int) -> float | None:
        """The validation loss's share of this rank (Engine.evaluate) on the job's held-out data, made at the
        first call (data.val_fraction or data.val_path; synthetic data: another seed's samples)."""
        from workers.data import make_datasets

        if self.held_out is None:
            data = self.config.data
            _, self.held_out = make_datasets(data, self.model.seq_len, self.model.vocab_size, self.train.seed,
                                             CacheConfig.from_data(data), validation=True)
        assert self.held_out is not None  # (made above: make_datasets with validation gives one or raises)
        try:
            return self.running.evaluate(self.held_out, batches)
        except Exception as e:
            self.log.error("evaluation failed: %s", e)
            self._let_go(e)
            raise

    def _let_go(self, e: BaseException | None) -> None:
        """After a failed step: drop this rank's process groups, so peers blocked on it in a collective fail now
        (Engine.drop_groups); the failed step's frames, which hold its pending sends, are cleared first."""
        while e is not None:
            traceback.clear_frames(e.__traceback__)
            e = e.__cause__ or e.__context__
        self.running.drop_groups()

    def commit(self, step_index: int) -> None:
        with self.state_lock:
            self.running.commit(step_index, during=self.faults.during_update)

    def set_keeper(self, keeper) -> None:
        """The keeper this rank's peer snapshots go to (set apart from `snapshot`: an actor handle in a
        call's arguments can hold that call back behind later ones)."""
        self.keeper = keeper

    def snapshot(self, step_index: int, pin: bool = False) -> None:
        """Take a host clone of this rank's shards of committed step `step_index` for its keeper.

        It runs on the training thread between commits (the caller waits for it, so the clone
        is of that step); the transfer to the keeper goes on in `receipt`, beside the next steps."""
        from workers import state

        if self.running.committed_step != step_index:
            raise RuntimeError(f"{self.running.where}: snapshot of step {step_index}, but step "
                               f"{self.running.committed_step} is the committed one")
        with self.puts_ready:  # one entry per call, each to the keeper set when it was taken: a drain's copy of a
            # step whose regular copy has not gone yet is a second entry, not the first one replaced (its receipt
            # then found nothing to send and waited out its timeout, and the drain with it)
            self.puts.setdefault(step_index, []).append((state.to_numpy(state.export_shards(self.running)), pin,
                                                         self.keeper))
            self.puts_ready.notify_all()

    @ray.method(concurrency_group="snapshot")
    def receipt(self, step_index: int, timeout_s: float | None = None) -> Receipt | None:
        """The keeper's receipt for the copy of `step_index` (metadata), once it is there; None if never started.
        Each wait (for the copy, for the keeper) lasts up to `timeout_s` (default runtime.timeouts.control_s)."""
        timeout_s = self.config.control_timeout_s if timeout_s is None else timeout_s
        with self.puts_ready:
            if not self.puts_ready.wait_for(lambda: bool(self.puts.get(step_index)), timeout=timeout_s):
                return None
            shards, pin, keeper = self.puts[step_index].pop(0)  # the oldest copy of the step: receipts come in
            if not self.puts[step_index]:  # the order their snapshots were taken
                del self.puts[step_index]
        if keeper is None:
            raise RuntimeError(f"{self.running.where}: a snapshot of step {step_index} but no keeper (set_keeper)")
        receipt: Receipt = ray.get(keeper.put.remote(Tier.PEER, step_index, self.running.rank, shards, pin),
                                   timeout=timeout_s)
        return receipt

    @ray.method(concurrency_group="control")
    def hand_over(self, keeper) -> Receipt | None:
        """After a failure: give the committed state to this node's keeper (tier "live"), and wait until it is there."""
        from workers import state

        with self.state_lock:
            step = self.running.committed_step
            if step < 0:
                return None
            shards = state.to_numpy(state.export_shards(self.running))
        got: Receipt | None = ray.get(keeper.put.remote(Tier.LIVE, step, self.running.rank, shards),
                                      timeout=self.config.control_timeout_s)
        return got

    @ray.method(concurrency_group="control")
    def abort(self) -> None:
        """Make this rank's pending receive or collective fail now (Engine.abort_groups), so its default thread is
        free for `retain` (in-place recovery: the controller aborts every survivor once a failure is seen)."""
        e = self.engine
        if e is not None:
            e.abort_groups()

    def retain(self, step: int | None) -> KeptState | None:
        """After a failure (in-place recovery): keep committed step `step` in this process for the next plan
        (workers/restore.py `Kept.keep` says which step a rank may keep), and let go of this plan's stage and
        groups. None: this process is not to be reused (the group replaces it)."""
        try:
            with self.state_lock:
                self.kept.keep(self.engine, step)
        except Exception as err:  # an overlapped update or restore failed: its state is no step's
            self.log.warning("not kept for the next plan: %s", err)
            self.kept.state = None
        if self.engine is not None:
            self._close_engine()
        return self.kept.report()

    def held(self) -> list[HeldRow]:
        """What `retain` kept, as a keeper's inventory rows (a source for the restore planner)."""
        return self.kept.rows()

    @ray.method(concurrency_group="serve")
    def get_many(self, requests: list[PieceRequest], step: int, s3: CheckpointLocation | None = None,
                 keys: tuple[str, ...] | None = None) -> list[Piece | Refused]:
        """The kept state's regions, as a keeper answers them (tier live: another worker's memory); served on
        a thread of its own, so ranks restoring at once read each other's kept state."""
        return self.kept.answer(requests, step, keys, Tier.LIVE)

    def drop_retained(self) -> None:
        """The state kept for a restore is no longer needed (every rank committed a step since)."""
        self.kept.state = None

    def needs(self) -> list[NeedRow]:
        from workers import state

        return state.needs(self.running)

    def load_state(self, step: int, optimizer_steps: float, transfers: list[Fetch], s3: CheckpointLocation | None,
                   overlap: bool = True) -> LoadReport:
        """Pull this rank's state of `step` from its sources and load it (workers/restore.py `Restore.load`)."""
        return self.restores.load(self.running, step, optimizer_steps, transfers, s3, overlap)

    @ray.method(concurrency_group="control")
    def settle_restore(self) -> bool:
        """Wait for an overlapped restore's moments (before their source keepers are cleared); False: they failed."""
        try:
            self.running.await_restore()
            return True
        except Exception as e:
            self.log.warning("the overlapped restore failed: %s", e)
            return False

    def inject_fault(self, step_index: int, kind: str = "raise") -> None:
        """Fail this rank at `step_index` (workers/faults.py), for drills and tests."""
        self.faults.fail_at(step_index, kind)

    def export_state(self) -> dict:
        from workers import state

        return state.export_shards(self.running)

    def import_state(self, full: dict, optimizer_steps: float, step: int = -1) -> None:
        from workers import state

        state.import_full(self.running, full, optimizer_steps)
        self.running.committed_step = step

    def where(self) -> str:
        return self.running.where

    def close(self) -> None:
        self.running.close()
