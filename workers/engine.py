"""The training engine of one rank: builds its stage from the Plan and runs steps.

No Ray here (workers/actor.py wraps it). The same code runs gloo on CPU and
NCCL on CUDA. A step of the global batch:
  1. this replica's contiguous sample range, split into micro-batches;
  2. the stage's 1F1B (or GPipe) order from planner.schedule, with p2p
     activations forward and activation gradients back;
  3. each replica back-propagates sum(loss_i over its samples) / global_batch;
  4. gradients are sum-all-reduced per (segment, TP rank) group (AutoHet
     layer-wise sync across asymmetric replicas, planner/layout.py);
  5. global-norm clipping that counts every parameter element exactly once;
  6. AdamW (fused on CPU and CUDA).
So every plan computes the same step as one device, up to reduction order.

A stage's offload policy (AutoHete; workers/offload.py) changes where state
lives, not what is computed: recomputed layers run under non-reentrant
checkpointing; with optimizer offload the fp32 masters and AdamW state live on
the host, gradients stream there during backward, and a per-layer host AdamW
runs on a thread, first layers first, overlapping the next step's forward; with
parameter offload block weights visit the device only while their layer
computes, prefetched `prefetch_depth` layers ahead.
"""

from __future__ import annotations

import contextlib
import resource
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from planner import layout
from planner.catalog import gpu_info
from planner.contract import check_runtime_plan
from planner.cost import OFFLOAD_CHUNK
from planner.layout import extended_layer
from planner.p2p import Exchange, eval_program, program
from planner.plan_types import Plan
from planner.specs import ModelSpec, TrainSpec
from workers.copy_lane import Lanes
from workers.data import Dataset
from workers.engine_parts import grad as grad_of
from workers.grad_sync import GradSync
from workers.model import Stage
from workers.offload import DeviceMeter, GradStream, HostLayers, LayerwiseUpdate, ParamStore
from workers.optim_state import OptimizerState
from workers.transfer import StepError, StepResult  # noqa: F401 (re-exported: with the other records, torch-free)

ABORT_TAG = 999_983  # the receives that close a group's pairs (abort_groups); steps use tags below 2 x micro-batches


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(runtime_dtype: str, precision: str, gpu_type: str) -> str:
    """The stage's compute dtype: runtime.dtype when forced, else train.precision's; bf16 becomes fp16 (with a
    loss scale) on a GPU type without bf16 (T4, V100: the catalog's `bf16`)."""
    if runtime_dtype != "auto":
        return runtime_dtype
    if precision == "bf16":
        return "bfloat16" if gpu_info(gpu_type).bf16 else "float16"
    return {"fp16": "float16", "fp32": "float32", "fp64": "float64"}[precision]


def resolved_device(device: str) -> torch.device:
    """The device with its index: a tensor on the current CUDA device reports `cuda:0`, never `cuda`, and the
    two compare unequal, so the engine's tests of where a tensor lives (which parameters are resident, what the
    device meter counts) need the index spelled out."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


class Engine(GradSync, OptimizerState):
    def __init__(self, plan: Plan, rank: int, model: ModelSpec, train: TrainSpec, dataset: Dataset,
                 dtype: torch.dtype = torch.float32, slowdown: float = 1.0, device: str = "cpu",
                 device_budget_bytes: float | None = None, meter_memory: bool = False,
                 overlap_update: bool = True, overlap_sync: bool = True, backend: str | None = None):
        self.device_budget, self.meter_memory = device_budget_bytes, meter_memory
        self.backend = backend  # torch.distributed's; None: NCCL on CUDA, gloo on the CPU (tests put two ranks on
        # one GPU with gloo, which NCCL refuses)
        self.overlap_update, self.overlap_sync = overlap_update, overlap_sync
        check_runtime_plan(plan, model)  # the plan contract (planner/contract.py), checked on every rank
        self.plan, self.rank, self.model, self.train, self.data = plan, rank, model, train, dataset
        self.dtype, self.slowdown, self.device = dtype, slowdown, resolved_device(device)
        # Mixed precision (train.precision bf16 or fp16): the stage computes in `dtype`; fp32 masters,
        # fp32 gradient accumulation and reduction, and AdamW on the masters (the planner's model:
        # 2-byte weights, 4-byte gradients, 12 bytes of optimizer state per parameter). fp16, on GPUs
        # without bf16 (T4, V100), adds a dynamic loss scale.
        self.mixed = dtype in (torch.bfloat16, torch.float16)
        self.loss_scale = 2.0 ** 16 if dtype == torch.float16 else 1.0
        self._good_steps, self._skip = 0, False
        self.info = layout.ranks(plan)[rank]
        self.pipe = plan.pipelines[self.info.pipeline]
        self.stage_spec = self.pipe.stages[self.info.stage]
        self.first = self.info.stage == 0
        self.last = self.info.stage == len(self.pipe.stages) - 1
        self.where = (f"rank {rank} (pipeline {self.info.pipeline}, stage {self.info.stage}, "
                      f"TP rank {self.info.tp_rank}, {self.stage_spec.gpu_type} on {self.info.node})")
        self.tp_group, self.grad_groups = None, []
        self._groups_lock, self._aborted = threading.Lock(), False
        self.committed_step = -1  # the newest step whose update is applied (set by restores too)
        self.updating = False  # inside an update: a failure now leaves state that is no step's (never reused)
        self._pending: int | None = None  # a step synced and clipped, waiting for commit()

    # -- set-up --------------------------------------------------------------
    def connect(self, init_method: str, timeout_s: float = 60.0, store: dist.Store | None = None) -> None:
        """Join the job's process group and build every group the plan needs (all ranks, same order); with
        `store` (every rank's, rank 0's the server) the rendezvous goes through it instead of `init_method`."""
        world = len(self.plan.devices())
        backend = self.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timeout = timedelta(seconds=timeout_s)
        rendezvous = {"init_method": init_method} if store is None else {"store": store}
        if not dist.is_initialized():
            # torch names a group by a per-process counter (its rendezvous keys are "<name>/..."), which only
            # destroying the world resets. An init_process_group that failed (a rank that never came) advances it
            # and leaves no world to destroy: a kept process would then name its next world "1" while a fresh
            # peer names it "0", each waiting on keys the other never writes, every re-plan after. Every
            # process starts a world's names at 0.
            dist.distributed_c10d._world.group_count = 0
        dist.init_process_group(backend, **rendezvous, rank=self.rank, world_size=world, timeout=timeout)
        self.tp_group = None
        for ranks in layout.tp_groups(self.plan):
            g = dist.new_group(ranks, timeout=timeout)
            if self.rank in ranks:
                self.tp_group = g
        self.grad_groups = []
        for gg in layout.grad_groups(self.plan):
            g = dist.new_group(list(gg.ranks), timeout=timeout) if len(gg.ranks) > 1 else None
            if self.rank in gg.ranks and g is not None:
                self.grad_groups.append((gg, g))
        self._build()

    def connect_alone(self, timeout_s: float = 60.0) -> None:
        """Join a world of one (a bench, a test, the 1-device oracle) through a rendezvous store served here, on
        a port the store binds and holds: a port found free, let go and bound again later can be taken meanwhile
        by another process (gloo's pair sockets take ephemeral ports), which failed the start with EADDRINUSE."""
        if len(self.plan.devices()) != 1:
            raise ValueError(f"connect_alone is for a one-device plan; this one has {len(self.plan.devices())}")
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        self.connect("", timeout_s, store=store)

    def _build(self) -> None:
        st = self.stage_spec
        master = torch.float32 if self.mixed else self.dtype
        self.module = Stage(self.model, st.layer_start, st.layer_end, self.first, self.last,
                            self.info.tp_rank, st.tp, self.tp_group, self.train.seed, master,
                            frozenset(st.offload.recompute_layers)).to(self.device)
        # Optimizer offload (AutoHete): master weights, gradients and AdamW state live in host memory, a flat
        # buffer per layer (pinned on CUDA; workers/offload.py HostLayers); the device keeps working copies. The
        # host copies are the optimizer's parameters, so export/import and the update read them.
        self.offload_opt = st.offload.offload_optimizer or st.offload.offload_params
        self.separate = self.offload_opt or self.mixed  # masters apart from the compute copies
        pin = self.device.type == "cuda"
        n_layers = self.model.num_layers
        self.host: HostLayers | None = None
        self.lanes: Lanes | None = None
        if self.offload_opt:
            by_layer: dict[int, list[tuple[str, torch.Tensor]]] = {}
            for n, p in self.module.params.items():
                by_layer.setdefault(extended_layer(self.module.specs[n].layer, n_layers), []).append((n, p))
            self.host = HostLayers(by_layer, pin)
            block = max((self.host.size(layer) for layer in self.host.spans if 0 <= layer < n_layers), default=0)
            self.lanes = Lanes(self.device, min(block or self.model.layer_params // st.tp, OFFLOAD_CHUNK),
                               lambda t: self.meter.track(t))
            self.opt_params = {n: self.host.params[n] for n in self.module.params}
        else:
            self.opt_params = {n: torch.nn.Parameter(p.detach().clone()) if self.mixed else p
                               for n, p in self.module.params.items()}
        if self.mixed:  # the stage's working copies in the compute dtype, cast from the fp32 masters
            with torch.no_grad():
                for p in self.module.params.values():
                    p.data = p.data.to(self.dtype)
        self.meter = DeviceMeter(self.device_budget, self.meter_memory, self.device)
        self.store: ParamStore | None = None
        if st.offload.offload_params:
            # Parameter offload: block weights leave the device; the module reads them through the store.
            assert self.host is not None and self.lanes is not None  # (parameter offload offloads the optimizer)
            blocks = {n for n, spec in self.module.specs.items() if isinstance(spec.layer, int)}
            for n in blocks:
                self.module.params[n] = self.opt_params[n]
                self.module.register_parameter(n.replace(".", "__"), self.opt_params[n])
            self.store = ParamStore(self.host, list(range(st.layer_start, st.layer_end)), self.device,
                                    st.offload.prefetch_depth, self.meter, self.lanes, self.dtype)
            self.module.store = self.store
        fetched = {n for ns in self.store.names.values() for n in ns} if self.store is not None else set()
        self.resident = {n: p for n, p in self.module.params.items() if p.device == self.device and n not in fetched}
        self.updater = None
        self.grads: GradStream | None = None
        self.program = program(self.plan, self.rank)  # compute operations and the batches of sends and receives
        self.posted: list[Exchange] = []  # the step's batches, in the order posted (tests hold them to the program)
        self.host_reads = 0  # reads of device values on the host: one per step (`_read_summary`)
        self._plan_sync()
        if self.offload_opt:
            assert self.host is not None and self.lanes is not None  # (built above)
            # Gradients stream to the host a layer at a time as backward produces them (GradStream); the host
            # optimizer runs per layer on the cpu lane, first layers first (LayerwiseUpdate).
            self.grads = GradStream(self.host, self.lanes, self.device, self.meter,
                                    {n for n in self.module.params if self._counted(n)}, self.layer_groups, pin)
            for n, p in self.resident.items():
                p.register_post_accumulate_grad_hook(self._to_stream(n))
            self.resident_by_layer: dict[int, list[str]] = {}
            for n in self.resident:
                self.resident_by_layer.setdefault(self.grads.layer[n], []).append(n)
            self.updater = LayerwiseUpdate(
                [(layer, [self.host.params[n] for n, *_ in spans]) for layer, spans in sorted(self.host.spans.items())],
                self._adamw, self._copy_back, self.overlap_update, self.lanes.cpu, self.grads.ready)
            self.module.before_layer = self.updater.wait
            if self.store is not None:
                self.store.updated, self.store.stream = self.updater.updated, self.grads
            self.optimizer = None
        else:
            if self.mixed:  # gradients go to the fp32 masters on the device as backward produces them
                for n, p in self.resident.items():
                    p.register_post_accumulate_grad_hook(self._grad_to_master(self.opt_params[n]))
            self.optimizer = self._adamw(list(self.opt_params.values()))
        self.meter.set_static(self._device_state())
        self._moments_counted = False  # AdamW's moments join the meter's static state after the first step
        self.restoring: Future | None = None  # an overlapped restore's second half (AdamW's moments), in flight
        self.incomplete: str | None = None  # why that half failed: this rank's state is not a step's, nor exported

    def close(self) -> None:
        updater, store = getattr(self, "updater", None), getattr(self, "store", None)
        lanes = getattr(self, "lanes", None)
        if updater is not None:
            updater.join()
        if store is not None:
            store.close()
        if lanes is not None:
            lanes.close()
        self.drop_groups()

    def drop_groups(self) -> None:
        """Let go of this rank's process groups, after a failed step or before the process joins another plan's:
        their pairs are closed first (`abort_groups`), so a peer blocked on this rank fails at once instead of
        at the collective timeout, then the groups are destroyed. The module keeps its tensors; it cannot run a
        TP step until rebuilt."""
        with self._groups_lock:
            self._abort_locked()
            self.tp_group, self.grad_groups = None, []
            self.buckets, self._inflight = [], []
            for h in getattr(self, "_sync_hooks", ()):
                h.remove()
            self._sync_hooks = []
            if self.built:
                self.module.tp_group = None
            if dist.is_initialized():
                dist.destroy_process_group()
        # No gc.collect() here: the pairs are closed already, and a full collection costs 0.1-0.4 s of every
        # survivor's recovery on the test machines (Python's own collector frees the groups' objects later).

    def abort_groups(self) -> None:
        """Make every operation of this rank's groups fail now, from any thread: an in-place recovery's way to free
        a survivor blocked in a receive or a collective on a lost peer (torchft aborts its process groups alike).
        NCCL aborts its communicators. Gloo has no abort that wakes a pending receive (`abort` and `shutdown`
        leave it waiting) and does not close a group's pairs while anything refers to it, but a receive that
        times out closes its pair: one 1 ms receive from each member, on a tag no step uses, closes them all.
        Both ends' pending operations then fail, so the peers blocked on this rank are freed too."""
        with self._groups_lock:
            self._abort_locked()

    def _abort_locked(self) -> None:
        if not dist.is_initialized() or self._aborted:
            return
        self._aborted = True
        if self.device.type == "cuda":
            dist.distributed_c10d._abort_process_group()
            return
        groups = [None, *([self.tp_group] if self.tp_group is not None else []), *(g for _, g in self.grad_groups)]
        for g in groups:
            me, size = dist.get_rank(g), dist.get_world_size(g)
            for r in range(size):
                if r == me:
                    continue
                try:
                    w = dist.irecv(torch.empty(1), group=g, group_src=r, tag=ABORT_TAG)
                    if w is not None:
                        w.wait(timeout=timedelta(milliseconds=1))
                except Exception:  # noqa: BLE001 - the timeout (or an already closed pair) is the point
                    pass

    # -- one step -------------------------------------------------------------
    def step(self, step_index: int, before: Callable[[int], None] | None = None, commit: bool = True) -> StepResult:
        """One step. `before(step_index)` runs first, inside the step (fault injection hooks in here).

        With `commit=False` the step stops after the gradient sync and clipping: the
        optimizer update waits for `commit()`, which the controller sends once every
        rank has finished the step (two-phase commit, as torchft's `should_commit`).
        Until then the parameters and optimizer state are the last committed step's,
        so a failure mid-step leaves every survivor holding exactly that state.
        """
        try:
            if before is not None:
                before(step_index)
            result = self._step(step_index)
            if commit:
                self.commit(step_index)
            return result
        except Exception as e:  # re-raised with the rank's identity; the controller decides
            raise StepError(f"{self.where} failed at step {step_index}: {type(e).__name__}: {e}",
                            type(e).__name__) from e

    def commit(self, step_index: int, during: Callable[[int], None] | None = None) -> None:
        """Apply the optimizer update of `step_index`, whose gradients are synced and clipped. `during(step_index)`
        runs once the update has changed the state (fault injection: a failure there leaves state no step's)."""
        if self._pending != step_index:
            raise RuntimeError(f"{self.where}: commit of step {step_index}, but the step ready to commit is "
                               f"{self._pending}")
        self.updating = True
        self._update()
        if during is not None:
            during(step_index)
        self.updating = False
        self._pending = None
        self.committed_step = step_index

    def _step(self, step_index: int) -> StepResult:
        t0 = time.perf_counter()
        self.meter.reset_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        big_b = self.plan.global_batch
        sizes = self.pipe.micro_batch_sizes()
        starts = self._starts(step_index)
        reads = self.first or self.last  # only these stages consume tokens (inputs, targets); middle ones never read
        if reads and hasattr(self.data, "prefetch"):  # remote data: this step's micro-batches and the next step's,
            self.data.prefetch([range(a, a + n) for a, n in zip(starts, sizes, strict=True)]  # read ahead of use
                               + [range(a + big_b, a + big_b + n) for a, n in zip(starts, sizes, strict=True)])
        saved: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        sent: dict[tuple[str, int], torch.Tensor] = {}  # what this rank's next batch sends
        got: dict[tuple[str, int], torch.Tensor] = {}  # what its batches received
        # The loss stays on the device, summed over micro-batches, until the step's one read (no host sync
        # inside a step: a read per micro-batch would stall the device each time).
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        last_b = max(i for i, item in enumerate(self.program) if not isinstance(item, Exchange) and item[0] == "B")
        self.sync_trace, self._final_bwd, self.posted = [], False, []
        self._count = dict(self._left)
        backwards = 0
        with self.meter.tracking():  # device-side bytes as they live (CPU accounting)
            for i, item in enumerate(self.program):
                if isinstance(item, Exchange):  # sends and receives posted together (planner/p2p.py)
                    self._exchange(item, sizes, sent, got)
                    continue
                kind, j = item
                self._final_bwd = i == last_b
                t_op = time.perf_counter()
                if kind == "F":
                    tokens = self._tokens(starts[j], sizes[j]) if reads else None
                    if self.first:
                        assert tokens is not None  # (the first stage reads the batch)
                        inp = tokens[:, :-1]
                    else:
                        inp = got.pop(("act", j)).requires_grad_()
                    with self._saved_hooks():
                        out = self.module(inp)
                    if self.last:
                        assert tokens is not None  # (the last stage reads the batch)
                        out = self.module.loss_sum(out, tokens[:, 1:]) / big_b
                        loss_sum += out.detach()
                        if self.loss_scale != 1.0:  # fp16: gradients scaled up past fp16's underflow
                            out = out * self.loss_scale
                    else:
                        sent[("act", j)] = out.detach().contiguous()
                    saved[j] = (inp, out, None)
                else:
                    inp, out, _ = saved.pop(j)
                    grad = None if self.last else got.pop(("grad", j))
                    if self.store is not None:
                        self.store.phase = "bwd"
                    if self.grads is not None:
                        self.grads.begin(backwards, len(sizes))
                    backwards += 1
                    out.backward(grad)
                    out = grad = None  # the micro-batch's graph (and a checkpoint's leftovers) go now
                    if not self.first:
                        sent[("grad", j)] = grad_of(inp).contiguous()
                    inp = None
                    if self.store is not None:
                        self.store.end_backward()
                        self.store.phase = "fwd"
                self._emulate_slowdown(time.perf_counter() - t_op)
        self._final_bwd = False
        if self.store is not None:
            self.store.drain()
        if self.grads is not None:  # offloaded: synced and normed on the way to the host, a layer at a time
            local_sq = self.grads.finish()
        else:
            self._sync_grads()
            local_sq = self._local_norm_sq() if self.needs_norm else loss_sum.new_zeros(())
        self._scales(local_sq)
        waited = self.await_restore()
        report = self.last and self.info.tp_rank == 0
        loss, norm_sq = self._read_summary(loss_sum)
        self._after_read(norm_sq)
        self._pending = step_index
        return StepResult(step_index, self.rank, loss if report else None, self.pipe.num_samples,
                          time.perf_counter() - t0, self._peak_mem(),
                          {"device_state_bytes": self.device_state_bytes(), "device_peak_bytes": self.meter.peak,
                           "host_state_bytes": self.host_state_bytes(),
                           "device_budget_bytes": self.device_budget,
                           "h2d_fetches": self.store.fetches if self.store is not None else 0,
                           "loss_scale": self.loss_scale, "skipped_update": self._skip,
                           "restore_wait_s": waited,
                           "device": self.device.type,
                           # the sample ranges whose loss this rank computed: drills check each is seen once
                           "samples": [[a, n] for a, n in zip(starts, sizes, strict=True)] if report else []})

    def evaluate(self, data: Dataset, batches: int) -> float | None:
        """The mean loss of samples [0, batches x global_batch) of `data` (a held-out set) under the current
        weights, forward only, between steps: each pipeline its share of each global batch in its micro-batches,
        exactly as a step splits one (planner/p2p.py `eval_program` posts the activations). Returns this rank's
        share of the mean (its pipeline's sum over the whole count) on a last stage's TP rank 0, else None; the
        shares add up to the loss the 1-device model gives the same samples. One host read."""
        self.settle()  # an overlapped host update of the last step lands first: the weights are that step's
        big_b = self.plan.global_batch
        sizes = self.pipe.micro_batch_sizes()
        items = eval_program(self.plan, self.rank)
        reads = self.first or self.last
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for b in range(batches):
                starts = self._starts(b)
                sent: dict[tuple[str, int], torch.Tensor] = {}
                got: dict[tuple[str, int], torch.Tensor] = {}
                for item in items:
                    if isinstance(item, Exchange):
                        self._exchange(item, sizes, sent, got)
                        continue
                    _, j = item
                    tokens = self._tokens_of(data, starts[j], sizes[j]) if reads else None
                    inp = tokens[:, :-1] if tokens is not None and self.first else got.pop(("act", j))
                    with self._saved_hooks():
                        out = self.module(inp)
                    if self.last:
                        assert tokens is not None  # (the last stage reads the batch)
                        total += self.module.loss_sum(out, tokens[:, 1:]).double() / (big_b * batches)
                    else:
                        sent[("act", j)] = out.contiguous()
        if self.store is not None:
            self.store.drain()
        value = float(total.cpu())  # the pass's one read
        return value if self.last and self.info.tp_rank == 0 else None

    def _starts(self, batch: int) -> list[int]:
        """The first sample of each of this pipeline's micro-batches in global batch `batch` (a step's index)."""
        sizes = self.pipe.micro_batch_sizes()
        start = batch * self.plan.global_batch + self.plan.sample_offsets()[self.info.pipeline]
        return [start + sum(sizes[:j]) for j in range(len(sizes))]

    def _tokens(self, start: int, n: int) -> torch.Tensor:
        return self._tokens_of(self.data, start, n)

    def _tokens_of(self, data: Dataset, start: int, n: int) -> torch.Tensor:
        """A micro-batch's tokens on the device: through pinned memory and an asynchronous copy on CUDA (a
        copy from pageable memory would make the host wait for it)."""
        t = data.batch(range(start, start + n))
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _exchange(self, ex: Exchange, sizes: list[int], sent: dict, got: dict) -> None:
        """One batch of sends and receives, posted together and waited for (planner/p2p.py says why: under NCCL
        a send completes only when its receive is posted, so a pair posted apart can wait on each other). A
        wait on NCCL orders the compute stream after the batch and returns; on gloo it blocks."""
        ops, h, seq = [], self.model.hidden_size, self.model.seq_len
        for op in ex.ops:
            key, tag = (op.kind, op.micro_batch), 2 * op.micro_batch + (op.kind == "grad")
            if op.op == "send":
                ops.append(dist.P2POp(dist.isend, sent[key], op.peer, tag=tag))
            else:
                got[key] = torch.empty(sizes[op.micro_batch], seq, h, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, got[key], op.peer, tag=tag))
        self.posted.append(ex)
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for op in ex.ops:
            if op.op == "send":
                sent.pop((op.kind, op.micro_batch), None)

    def _local_norm_sq(self) -> torch.Tensor:
        """This rank's share of the global gradient norm's square, on the device (GradSync `_norm_sq`)."""
        return self._norm_sq([grad_of(p) for n, p in self.grad_params.items() if self._counted(n)])

    def _read_summary(self, loss_sum: torch.Tensor) -> tuple[float, float]:
        """The step's one read of device values on the host: its loss and its global gradient norm squared,
        copied together after everything else of the step is queued. Counted (`host_reads`): a test holds the
        step to one read and no other scalar read (tests/test_host_sync.py)."""
        self.host_reads += 1
        norm_sq = self._norm_sq_all if self._norm_sq_all is not None else loss_sum.new_zeros(())
        summary = torch.stack([loss_sum, norm_sq.to(loss_sum.dtype)])
        # The step's one intended synchronization: allowed under torch.cuda.set_sync_debug_mode, which the GPU
        # checks set to "error" around whole steps so that any other one fails them.
        mode = torch.cuda.get_sync_debug_mode() if self.device.type == "cuda" else 0
        if mode:
            torch.cuda.set_sync_debug_mode(0)
        try:
            loss, sq = summary.cpu().tolist()
        finally:
            if mode:
                torch.cuda.set_sync_debug_mode(mode)
        return loss, sq

    def _saved_hooks(self):
        return self.store.hooks() if self.store is not None else contextlib.nullcontext()

    def settle(self) -> None:
        """Wait for an overlapped host update and an overlapped restore to finish (before reading or replacing
        state)."""
        if self.updater is not None:
            self.updater.join()
        self.await_restore()
        if self.incomplete:
            raise RuntimeError(f"{self.where}: its state is incomplete (an overlapped restore failed: "
                               f"{self.incomplete})")

    def await_restore(self, raise_error: bool = True) -> float:
        """Wait for the moments of an overlapped restore (workers/state.py `import_moments`); the seconds waited.
        A failed pull raises here, inside the step that needs them, so the controller treats it as any failure."""
        if self.restoring is None:
            return 0.0
        t0, fut = time.perf_counter(), self.restoring
        try:
            fut.result()
        except Exception as e:
            self.incomplete = f"{type(e).__name__}: {e}"
            if raise_error:
                raise
        finally:
            self.restoring = None
        return time.perf_counter() - t0

    def _emulate_slowdown(self, busy_s: float) -> None:
        # Fake GPUs of a slower type run the same math, then wait out the speed gap.
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * busy_s)

    def _peak_mem(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

