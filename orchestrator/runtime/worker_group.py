"""`RayWorkerGroup`: the controller's `WorkerGroup` and the state plane's `StateGroup` over a runtime/plan_run.PlanRun.

Every fault arrives as a WorkerFailure. The processes that outlive a group are the recovery strategy's
(state/recovery.py): in place, `retain` has each survivor keep its committed state, `release` hands the survivors
to the strategy's processes (runtime/processes.WorkerPool) and the next group's ranks take them; restart's
processes keep nothing. The group asks the strategy and never which mode runs.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Set
from typing import Any

import ray

from orchestrator.job_spec import JobSpec
from orchestrator.runtime.plan_run import PlanRun
from orchestrator.state.recovery import Recovery, Restart
from planner import layout
from planner.plan_types import Plan
from planner.specs import ClusterSpec, ModelSpec
from workers.transfer import (
    CheckpointLocation,
    Fetch,
    KeptState,
    LoadReport,
    NeedRow,
    ProcessHolding,
    Receipt,
)

log = logging.getLogger("hetspot.runner")


class RayWorkerGroup:
    """The controller's WorkerGroup over a PlanRun; every fault arrives as a WorkerFailure."""

    def __init__(self, job: JobSpec, plan: Plan, on_step: Callable[[int, float, float], None] | None = None,
                 recovery: Recovery | None = None, model: ModelSpec | None = None) -> None:
        self.run = PlanRun(job, plan, model)
        self.recovery: Recovery = recovery or Restart()  # state/recovery.py: InPlace carries a WorkerPool
        self.processes = self.recovery.processes  # the processes that outlive the group (restart: none)
        self.stages_switch = self.recovery.stages_switch  # a notice's switch is pre-staged
        self.plan = plan
        self.on_step = on_step
        self.last_peak_mem = 0
        self.last_stages: list[dict] = []  # per stage of the last step: its compute time and memory
        self.last_samples: list[tuple[int, int]] = []  # (first sample, count) per micro-batch of the last step
        self.real_gpus = False
        self.holds_state = False  # the workers hold the job's state (restored, or trained from step 0)
        self.keepers: list = []  # each rank's peer keeper, as last set
        self.retained: list[KeptState | None] | None = None  # per rank, what `retain` kept
        self.step_times: list[float] = []  # seconds per step trained by this group

    def start(self) -> None:
        """The plan's workers start, each rank taking a kept or warm process on its node where the strategy's
        processes hold one (restart: none)."""
        taken = self.processes.take(self.run.wants())
        try:
            self.run.start(taken)
        except BaseException:  # the processes taken for ranks not reached go back, not astray
            self.processes.give_back([k for k in taken[len(self.run.kept):] if k is not None])
            raise

    @property
    def pids(self) -> list[int]:
        """Per rank: its worker's process id (a kept process keeps its id across plans)."""
        return self.run.pids

    def step(self, step_index: int) -> float:
        r = self.run.run(1, first_step=step_index, on_step=self.on_step)
        self.step_times.append(r.step_time_s[0])
        self.last_peak_mem, self.real_gpus = r.peak_mem_bytes[0], r.real_gpus
        self.last_stages = r.stages[0]
        self.last_samples = r.samples[0]
        return r.losses[0]

    def evaluate(self, batches: int) -> float:
        return self.run.evaluate(batches)

    def export_state(self) -> tuple[dict, float]:
        from workers.state import full_state  # (torch: the controller imports it for this alone)

        return full_state(self.run.export_states())

    # -- the tiered state plane's calls (orchestrator/state/tiers.py); metadata in, metadata out --
    def snapshot(self, step: int, keepers: list, pin: bool = False) -> list:
        """Each rank takes a host clone of its committed shards, then sends it to its keeper on a thread
        beside training; the receipts' ObjectRefs (metadata; waited on only when the copy must be complete)."""
        if keepers != self.keepers:
            self.run._gather([w.set_keeper.remote(k) for w, k in zip(self.run.workers, keepers, strict=True)],
                             "choosing peer keepers",
                             self.run.timeouts.control_s)
            self.keepers = keepers
        # Awaited: an actor with concurrency groups does not promise to run calls in the order sent, and
        # the clone must be of `step`, before the next commit. The transfer itself is not waited for.
        self.run._gather([w.snapshot.remote(step, pin) for w in self.run.workers], f"snapshot of step {step}",
                         self.run.timeouts.control_s)
        return [w.receipt.remote(step) for w in self.run.workers]

    def hand_over(self, keepers: list, timeout_s: float | None = None) -> list[Receipt | None]:
        """Survivors give their committed state to their node's keeper; None for ranks that cannot."""
        refs = [w.hand_over.remote(k) if k is not None else None
                for w, k in zip(self.run.workers, keepers, strict=True)]
        live = [r for r in refs if r is not None]
        ray.wait(live, num_returns=len(live), timeout=self.run.timeouts.hand_over_s if timeout_s is None else timeout_s)
        out = []
        for r in refs:
            try:
                out.append(ray.get(r, timeout=0) if r is not None else None)
            except Exception as e:  # a dead or stuck rank: its state comes from another tier
                log.info("a rank could not hand over its state: %s", type(e).__name__)
                out.append(None)
        return out

    def needs(self) -> list[list[NeedRow]]:
        return self.run._gather([w.needs.remote() for w in self.run.workers], "restore planning",
                                self.run.timeouts.control_s)

    def load(self, per_rank: list[list[Fetch]], step: int, optimizer_steps: float, s3: CheckpointLocation | None,
             overlap: bool = True) -> list[LoadReport]:
        return self.run._gather([w.load_state.remote(step, optimizer_steps, t, s3, overlap)
                                 for w, t in zip(self.run.workers, per_rank, strict=True)], f"restore of step {step}",
                                self.run.timeouts.transfer_s)

    def settle_restore(self, timeout_s: float | None = None) -> None:
        """Wait for the ranks' overlapped restores to finish pulling (a rank that cannot: its state comes from
        another tier)."""
        refs = [w.settle_restore.remote() for w in self.run.workers]
        ray.wait(refs, num_returns=len(refs), timeout=self.run.timeouts.transfer_s if timeout_s is None else timeout_s)

    @property
    def received_bytes(self) -> int:
        return self.run.received_bytes

    def import_state(self, state: dict, optimizer_steps: float) -> None:
        self.run.import_state(state, optimizer_steps)

    def retain(self, step: int | None, avoid: Set[str] = frozenset(),
               grace_s: float | None = None) -> list[KeptState | None]:
        """After a failure or before a move: each survivor off `avoid` keeps committed step `step` in its own
        memory (TrainWorker.retain); per rank what it kept, None for a rank that did not prove it holds exactly
        that step within `grace_s` (dead, still blocked, or mid-update): it is replaced. A failed rank lets go of
        its groups at once (Engine.drop_groups), so a survivor blocked on it is released within milliseconds; the
        grace, by default 3 of the group's step times (2 to 10 s), covers a survivor still computing. Every
        survivor is aborted first (TrainWorker.abort), so one blocked on a live but stalled peer is freed too."""
        if grace_s is None:
            times = sorted(self.step_times[-10:])
            grace_s = min(10.0, max(2.0, 3 * times[len(times) // 2])) if times else 10.0
        mine = [(w, r.node not in avoid) for w, r in zip(self.run.workers, self.run.ranks, strict=True)]
        aborts = [w.abort.remote() for w, keep in mine if keep]  # survivors blocked on a lost peer fail now
        ray.wait(aborts, num_returns=len(aborts), timeout=min(2.0, grace_s))
        refs = [w.retain.remote(step) if keep else None for w, keep in mine]
        live = [r for r in refs if r is not None]
        ray.wait(live, num_returns=len(live), timeout=grace_s)
        out = []
        for i, r in enumerate(refs):
            try:
                out.append(ray.get(r, timeout=0) if r is not None else None)
            except Exception as e:  # a dead or stuck rank: not reused
                log.info("%s is not kept: %s", self.run.names[i], type(e).__name__)
                out.append(None)
        self.retained = out
        return out

    def held(self) -> list[ProcessHolding]:
        """The state kept in worker processes, per process: its rank in this plan (None for an idle kept process),
        node, handle and rows (inventory rows as a keeper's)."""
        kept = self.run.kept or [None] * len(self.run.workers)
        procs: list[tuple[int | None, Any, str]] = [
            (i, w, r.node) for i, (w, r, k) in enumerate(zip(self.run.workers, self.run.ranks, kept, strict=True))
            if k is not None and k.step >= 0]
        procs += [(None, k.actor, k.node) for k in self.processes.holding()]
        names = [self.run.names[i] if i is not None else f"a kept process on {n}" for i, _, n in procs]
        rows = self.run._gather([w.held.remote() for _, w, _ in procs], "listing kept state",
                                self.run.timeouts.control_s, names) if procs else []
        return [ProcessHolding(i, n, w, tuple(r)) for (i, w, n), r in zip(procs, rows, strict=True)]

    def drop_retained(self) -> None:
        """Every rank has committed a step since the restore: the copies its ranks kept go."""
        for w, k in zip(self.run.workers, self.run.kept, strict=False):
            if k is not None:
                w.drop_retained.remote()

    def release(self) -> None:
        """End this group but keep the processes that `retain` kept (in place), for the next plan."""
        self.processes.keep(self.run.shutdown(self.retained))

    def shutdown(self) -> None:
        self.run.shutdown()
        self.processes.end_all()

    # -- warm workers (where processes outlive their group: the strategy's processes; restart's start none) --
    def _busy(self) -> Counter[str]:
        return Counter(r.node for r in self.run.ranks if self.run.workers)

    def prestage(self, plan: Plan) -> int:
        """Before a switch to `plan` (a notice's drain): start a warm worker for each of its ranks on a GPU that no
        process of this job holds now, so the switch itself starts no process; how many were started."""
        want = Counter(r.node for r in layout.ranks(plan))
        return self.processes.warm_up(want, sum(want.values()), self._busy())

    def staged_ready(self) -> bool:
        """Every warm worker has started (a pre-staged switch waits for this, or for its deadline)."""
        return self.processes.warm_ready()

    def warm_joined(self, cluster: ClusterSpec, nodes: Set[str]) -> int:
        """Warm workers on every GPU of `nodes`, which just joined (the controller's warm-at-join): whatever the
        plan does next, a move onto them or the next recovery finds their processes started; how many started."""
        want = Counter({n.name: n.num_gpus for n in cluster.nodes if n.name in nodes})
        return self.processes.warm_up(want, sum(want.values()), self._busy())

    def warm_spares(self, cluster: ClusterSpec) -> int:
        """Standing warm workers (runtime.warm_workers) on GPUs of `cluster` the plan leaves idle; how many were
        started. Warm workers on nodes no longer in `cluster` end."""
        return self.processes.spares(Counter({n.name: n.num_gpus for n in cluster.nodes}),
                                     self.run.job.runtime.warm_workers, self._busy())

    def give_up(self, nodes: Set[str]) -> int:
        """End this job's processes on `nodes`, which no rank uses (warm workers, kept processes no rank took):
        another job asked for their GPUs; how many."""
        return self.processes.give_up(nodes)
