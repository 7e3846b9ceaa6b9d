"""A Plan's workers on a connected Ray cluster: place, rendezvous, step, commit, fail fast.

`PlanRun` places one STRICT_PACK placement group per stage (a TP group is one
node), each bundle pinned to the plan's node through Ray's `ray.io/node-id`
label (the node found by its discovery name), and one TrainWorker per bundle.
Step s is two-phase: every worker runs its forward, backward and gradient sync
and returns; only then are all told to commit (apply the optimizer update), so
a failure mid-step leaves every survivor at the last committed step. The first
worker error, dead actor or timeout ends the run at once with a `WorkerFailure`
naming the rank and stage (runtime/detect.py: where a lost node is detected);
the remaining actors are killed so no survivor waits out a collective timeout. runtime/worker_group.RayWorkerGroup
is the controller's `WorkerGroup` over it; the processes a run takes over from an earlier one, or leaves to the next,
are its recovery strategy's (state/recovery.py; on Ray a runtime/processes.WorkerPool).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.control.failure import FailureKind
from orchestrator.errors import WorkerFailure
from orchestrator.job_spec import JobSpec
from orchestrator.runtime.detect import gather
from planner import layout
from planner.catalog import gpu_info
from planner.contract import PlanContractError, check_runtime_plan
from planner.plan_types import Plan
from planner.specs import ModelSpec, tokens_per_step
from workers.transfer import KeptState, payload_bytes

if TYPE_CHECKING:
    from orchestrator.cluster.discovery import DiscoveredNode
    from orchestrator.state.processes import Wants
    from workers.actor import WorkerConfig

log = logging.getLogger("hetspot.runner")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    peak_mem_bytes: list[int] = field(default_factory=list)  # per step, the largest over workers
    stages: list[list[dict]] = field(default_factory=list)  # per step, per stage: its time and memory (`stage_rows`)
    samples: list[list[tuple[int, int]]] = field(default_factory=list)  # per step: (first sample, count) trained
    tokens_per_s: float = 0.0  # from step times, start-up excluded
    wall_s: float = 0.0
    real_gpus: bool = False  # every worker computed on CUDA (else fake GPUs: no MFU)


def slowdowns(plan: Plan, emulate: bool | str, declared: Set[str] = frozenset(),
              fake_nodes: set[str] | None = None) -> tuple[dict[str, float], str | None]:
    """Per node of the plan: how much slower its GPUs run than the fastest type of the plan or of the job's
    declared nodes (so a plan on slow GPUs runs slower than one that adds a fast node later), by catalog TFLOPS;
    and a warning, or None. Emulation runs only on nodes whose GPUs say they are fake (`fake_nodes`, labelled
    `hetspot/fake-gpu=true` by the embedded and test clusters; None: every node): a real GPU runs at its own
    speed whatever the job file says (slowing it would make hetspot lose to every system on real hardware); the
    warning comes only where the job asked for emulation outright (`true`, not the default `auto`)."""
    nodes = {st.node: st.gpu_type for p in plan.pipelines for st in p.stages}
    if not emulate:
        return dict.fromkeys(nodes, 1.0), None
    real = sorted(n for n in nodes if fake_nodes is not None and n not in fake_nodes)
    fastest = max(gpu_info(t).peak_tflops for t in set(nodes.values()) | set(declared))
    out = {n: 1.0 if n in real else fastest / gpu_info(t).peak_tflops for n, t in nodes.items()}
    warning = (f"runtime.emulate_speed is ignored on {', '.join(real)}: its GPUs are real (no "
               "hetspot/fake-gpu=true label), so they run at their own speed; drop emulate_speed from the job "
               "file to silence this") if real and emulate is True else None
    return out, warning


def stage_rows(plan: Plan, ranks: list, time_s: list[float], mem: list[int]) -> list[dict]:
    """Per stage of one step (its TP ranks' slowest time and largest memory), labelled by pipeline, stage, GPU
    type and node: the series that show which stage or GPU type holds a step back."""
    out: dict[tuple[int, int], dict] = {}
    for r, t, m in zip(ranks, time_s, mem, strict=True):
        st = plan.pipelines[r.pipeline].stages[r.stage]
        row = out.setdefault((r.pipeline, r.stage), {"pipeline": r.pipeline, "stage": r.stage, "gpu_type": st.gpu_type,
                                                     "node": r.node, "time_s": 0.0, "memory_bytes": 0})
        row["time_s"], row["memory_bytes"] = max(row["time_s"], t), max(row["memory_bytes"], m or 0)
    return [out[k] for k in sorted(out)]


@dataclass
class Kept:
    """A worker process kept from one plan for the next (in-place recovery), with what it held, or a warm worker."""

    actor: Any  # its TrainWorker handle
    pg: Any  # its placement group (one GPU on its node): removing it would end the process
    node: str
    span: tuple[int, int]  # the extended layers its last stage held
    pid: int
    step: int  # the committed step it keeps in memory (-1: none)
    ready: object = None  # a warm worker's `ready()` answer (its constructor ran); None for a survivor

    @property
    def warm(self) -> bool:
        return self.ready is not None

    def end(self) -> None:
        end_worker(self.actor, self.pg)


def gpu_placement(node_id: str) -> Any:
    """A placement group of one GPU on the node with Ray id `node_id` (one per worker: a kept process keeps it),
    named by the job that holds it, so that another job plans around it (orchestrator/cluster/holders.py)."""
    from orchestrator.cluster.holders import pg_name

    return placement_group([{"GPU": 1}], strategy="STRICT_PACK", bundle_label_selector=[{"ray.io/node-id": node_id}],
                           name=pg_name())


def torch_threads(job: JobSpec, node: DiscoveredNode | None) -> int:
    """CPU threads for a worker on `node` (a DiscoveredNode, or None when unknown): the job's number, or with auto
    the node's CPUs per GPU on a real GPU node (host-side optimizer and data work use them) and 1 on a fake one."""
    want = job.runtime.torch_threads
    if want != "auto":
        return int(want)
    if node is None or node.fake or not node.num_gpus:
        return 1
    return max(1, node.num_cpus // node.num_gpus)


def new_worker(job: JobSpec, pg: Any, plan_json: str | None, rank: int, slowdown: float, threads: int = 1) -> Any:
    """A TrainWorker process in placement group `pg`: rank `rank` of `plan_json`, or warm (no plan) with None."""
    from workers.actor import TrainWorker

    return cast(Any, TrainWorker).options(  # Ray's actor classes are untyped
        num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
    ).remote(plan_json, rank, worker_config(job, threads), slowdown)


def worker_config(job: JobSpec, threads: int = 1) -> WorkerConfig:
    """What every worker of `job` is built with, from the job file (workers/ reads no job file)."""
    from workers.actor import WorkerConfig

    rt = job.runtime
    return WorkerConfig(job.model_spec.model_dump_json(), job.train.model_dump_json(), job.data.model_dump(),
                        rt.dtype, rt.log_every, rt.meter_memory, rt.overlap_grad_sync, threads,
                        control_timeout_s=rt.timeouts.control_s, transfer_timeout_s=rt.timeouts.transfer_s)


def end_worker(actor: Any, pg: Any) -> None:
    ray.kill(actor, no_restart=True)
    try:
        remove_placement_group(pg)
    except Exception as e:  # the cluster may already be gone; record and move on
        log.debug("removing placement group failed: %s", e)


class PlanRun:
    def __init__(self, job: JobSpec, plan: Plan, model: ModelSpec | None = None):
        self.job, self.plan = job, plan
        self.model = model or job.model_spec  # (the job's, built once: `job.model_spec` builds it at each read)
        self.timeouts = job.runtime.timeouts  # how long each kind of call to the workers may take
        self.ranks = layout.ranks(plan)
        self.names = [self._describe(i) for i in range(len(self.ranks))]  # per rank, for a failure's message
        self.nodes = plan.nodes()
        self.workers: list = []
        self.pgs: list = []  # per worker: its placement group (one GPU, pinned to the plan's node)
        self.kept: list[Kept | None] = []  # per worker: the process it was kept from, None if started here
        self.pids: list[int] = []  # per worker: its process id, once joined
        self.received_bytes = 0  # what this process took in from the workers (state stays out of it)

    def wants(self) -> Wants:
        """Per rank: its node and the extended layers it holds (what a kept or warm process is taken by)."""
        spans = layout.rank_spans(self.plan)
        return [(r.node, spans[i][1:]) for i, r in enumerate(self.ranks)]

    def start(self, taken: list[Kept | None] | None = None) -> None:
        """Place the plan's workers and join them in one process group. A rank given a process in `taken` (per
        rank, by the recovery strategy's processes from `wants()`: a kept process or a warm worker) becomes that
        process (`reconfigure`: no process start, no imports, the device context kept); only the other ranks start
        one. Where the start fails, the taken processes of the ranks not reached are `taken[len(self.kept):]`."""
        try:
            check_runtime_plan(self.plan, self.model)
        except PlanContractError as e:
            raise WorkerFailure("start-up", f"refusing to start a plan that breaks the plan contract: {e}",
                                FailureKind.DETERMINISTIC) from None
        from orchestrator.cluster.discovery import RayInventory, node_ids

        found = RayInventory().discover()
        ids = {d.name: d.node_id for d in found}
        by_name = {d.name: d for d in found}
        missing = sorted(set(self.plan.nodes()) - set(ids))
        if missing:
            raise WorkerFailure("start-up", f"the plan's node(s) {', '.join(missing)} are not alive GPU nodes of this "
                                "cluster "
                            f"(it has {', '.join(sorted(ids)) or 'none'})", FailureKind.NODE_LOST)
        declared = {n.gpu_type for n in self.job.cluster.nodes} if self.job.cluster else set()
        slow, warning = slowdowns(self.plan, self.job.runtime.emulate_speed, declared,
                                  {d.name for d in found if d.fake})
        if warning:
            log.warning(warning)
        plan_json = self.plan.model_dump_json()
        taken = taken or [None] * len(self.ranks)  # (a run of its own: every process starts here)
        configured = []  # per rank: its reconfigure (a kept process) or its constructor (a new one) ended
        for p in self.plan.pipelines:
            for st in p.stages:
                for _ in range(st.tp):
                    rank = len(self.workers)
                    kept = taken[rank]
                    self.kept.append(kept)
                    if kept is not None:
                        self.workers.append(kept.actor)
                        self.pgs.append(kept.pg)
                        configured.append(kept.actor.reconfigure.remote(plan_json, rank, slow[st.node]))
                        continue
                    pg = gpu_placement(ids[st.node])
                    self.pgs.append(pg)
                    self.workers.append(new_worker(self.job, pg, plan_json, rank, slow[st.node],
                                                    torch_threads(self.job, by_name.get(st.node))))
                    configured.append(self.workers[-1].ready.remote())
        joined = sum(1 for k in self.kept if k is not None)
        if joined:
            warm = sum(1 for k in self.kept if k is not None and k.ready is not None)
            log.info("%d of %d workers stay in their processes, %d take a warm worker; %d start",
                     joined - warm, len(self.workers), warm, len(self.workers) - joined)
        t0 = time.perf_counter()
        self._await_placement(self.timeouts.startup_s, node_ids)
        # Every rank is configured (a kept process's stage built, a new process's constructor run: imports, the
        # stage) before any rank enters the rendezvous, whose wait is the collective timeout: a process start on a
        # loaded node is bounded by runtime.timeouts.startup_s, not by the collective timeout. In rank order, so a
        # failure names its rank.
        self._gather(configured, "start-up", self.timeouts.startup_s)
        t1 = time.perf_counter()
        init = self._gather([self.workers[0].rendezvous_address.remote()], "start-up", self.timeouts.startup_s)[0]
        self.pids = self._gather([w.connect.remote(init, self.job.runtime.collective_timeout_s)
                                  for w in self.workers], "start-up", self.timeouts.startup_s)
        log.info("workers placed and configured in %.2f s, joined their group in %.2f s", t1 - t0,
                 time.perf_counter() - t1)

    def _await_placement(self, timeout_s: float, node_ids: Callable[[], dict[str, str]]) -> None:
        """Wait for the placement groups; a plan node that dies meanwhile fails the start-up at once (a node
        lost), not after `timeout_s`: its bundles could never be placed."""
        pending = [pg.ready() for pg in self.pgs]
        until = time.monotonic() + timeout_s
        used = set(self.plan.nodes())
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            gone = sorted(used - set(node_ids())) if pending else []
            if gone:
                raise WorkerFailure("start-up", f"node(s) {', '.join(gone)} went while the plan's workers were "
                                    "being placed", FailureKind.NODE_LOST, nodes=gone)
            if pending and time.monotonic() > until:
                raise WorkerFailure("start-up", f"could not place the plan's {len(self.workers)} workers within "
                                    f"{timeout_s:.0f} s (runtime.timeouts.startup_s); are the plan's nodes and "
                                    "GPUs in the cluster?",
                                    FailureKind.TIMEOUT)

    def run(self, steps: int, first_step: int = 0,
            on_step: Callable[[int, float, float], None] | None = None) -> TrainResult:
        result = TrainResult()
        t_start = time.perf_counter()
        tokens = tokens_per_step(self.model, self.plan.global_batch)
        for s in range(first_step, first_step + steps):
            t0 = time.perf_counter()
            outs = self._gather([w.step.remote(s) for w in self.workers], f"step {s}", self.job.runtime.step_timeout_s)
            self._gather([w.commit.remote(s) for w in self.workers], f"commit of step {s}", self.timeouts.commit_s)
            dt = time.perf_counter() - t0
            loss = sum(o.loss for o in outs if o.loss is not None)
            result.losses.append(loss)
            result.samples.append(sorted(tuple(r) for o in outs for r in o.extra.get("samples", [])))
            result.step_time_s.append(dt)
            # the meter's device bytes when on, else the allocator's peak (CUDA) or RSS (CPU)
            metered = self.job.runtime.meter_memory
            mem = [o.extra.get("device_peak_bytes") if metered else o.peak_mem_bytes for o in outs]
            result.peak_mem_bytes.append(max(mem))
            result.stages.append(stage_rows(self.plan, self.ranks, [o.time_s for o in outs], mem))
            result.real_gpus = all(o.extra.get("device") == "cuda" for o in outs)
            log.info("step %d committed: loss %.4f, %.2f s", s, loss, dt)
            if on_step:
                on_step(s, loss, tokens / dt)
        result.wall_s = time.perf_counter() - t_start
        result.tokens_per_s = tokens * steps / sum(result.step_time_s)  # step-time throughput
        return result

    def evaluate(self, batches: int) -> float:
        """The validation loss of the committed weights: every rank's forward-only pass of `batches` global
        batches of held-out samples, the replicas' shares summed (Engine.evaluate)."""
        outs = self._gather([w.evaluate.remote(batches) for w in self.workers], "evaluation",
                            self.job.runtime.step_timeout_s * batches)
        return sum(v for v in outs if v is not None)

    def export_states(self) -> list[dict]:
        return self._gather([w.export_state.remote() for w in self.workers], "state export", self.timeouts.transfer_s)

    def import_state(self, full: dict, optimizer_steps: float) -> None:
        ref = ray.put(full)
        self._gather([w.import_state.remote(ref, optimizer_steps) for w in self.workers], "state import",
                     self.timeouts.transfer_s)

    def _gather(self, futures: list, what: str, timeout_s: float, names: list[str] | None = None) -> list:
        """Results in rank order; the first failure ends the run with the rank's identity and kind (detect.py).
        `names`: the callees', where they are not the ranks in order."""
        results = gather(futures, what, timeout_s, self.names if names is None else names, self.nodes)
        self.received_bytes += sum(payload_bytes(r) for r in results)
        return results

    def _describe(self, rank: int) -> str:
        r = self.ranks[rank]
        st = self.plan.pipelines[r.pipeline].stages[r.stage]
        return f"rank {rank} (pipeline {r.pipeline}, stage {r.stage}, {st.gpu_type} on {r.node})"

    def shutdown(self, keep: list[KeptState | None] | None = None) -> list[Kept]:
        """End the run: every worker, or, with `keep` (per rank: what `retain` kept, None: not kept), all but the
        kept ones, which it returns (for the recovery strategy's processes to keep for the next plan)."""
        spans = layout.rank_spans(self.plan)
        out = []
        for i, (w, pg) in enumerate(zip(self.workers, self.pgs, strict=False)):
            got = keep[i] if keep is not None and i < len(keep) else None
            if got is not None:
                out.append(Kept(w, pg, self.ranks[i].node, spans[i][1:], got.pid, got.step))
            else:
                end_worker(w, pg)
        self.workers, self.pgs, self.kept = [], [], []
        return out
