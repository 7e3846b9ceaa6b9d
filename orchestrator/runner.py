"""Run a Plan on a connected Ray cluster: place, rendezvous, step, commit, fail fast.

A plain controller loop (the Controller actor with explicit states builds on
it). Placement: one STRICT_PACK placement group per stage (a TP group is one
node), each bundle pinned to the plan's node through Ray's `ray.io/node-id`
label (the node found by its discovery name), one TrainWorker per bundle. Step s is committed once every worker
returned its result for s. The first worker error, or a dead actor, ends the
run at once with a message naming the rank and stage; the remaining actors
are killed so no survivor waits out a collective timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.errors import JobFailed
from orchestrator.jobfile import JobSpec
from planner.catalog import gpu_info
from planner.plan_types import Plan
from workers import layout

log = logging.getLogger("hetspot.runner")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    peak_mem_bytes: list[int] = field(default_factory=list)  # per step, the largest over workers
    tokens_per_s: float = 0.0
    wall_s: float = 0.0


def slowdowns(plan: Plan, emulate: bool) -> dict[str, float]:
    """Per GPU type: how much slower than the plan's fastest type, by catalog TFLOPS."""
    types = {st.gpu_type for p in plan.pipelines for st in p.stages}
    if not emulate:
        return {t: 1.0 for t in types}
    fastest = max(gpu_info(t).peak_tflops for t in types)
    return {t: fastest / gpu_info(t).peak_tflops for t in types}


class PlanRun:
    def __init__(self, job: JobSpec, plan: Plan):
        self.job, self.plan = job, plan
        self.ranks = layout.ranks(plan)
        self.workers: list = []
        self.pgs: list = []

    def start(self, timeout_s: float = 120.0) -> None:
        from workers.actor import TrainWorker

        try:
            self.plan.check_structure()
        except ValueError as e:
            raise JobFailed(f"refusing to start a plan that breaks the plan contract: {e}") from None
        from orchestrator.discovery import node_ids

        ids = node_ids()
        missing = sorted({st.node for p in self.plan.pipelines for st in p.stages} - set(ids))
        if missing:
            raise JobFailed(f"the plan's node(s) {', '.join(missing)} are not alive GPU nodes of this cluster "
                            f"(it has {', '.join(sorted(ids)) or 'none'})")
        slow = slowdowns(self.plan, self.job.runtime.emulate_speed)
        model_json, train_json = self.job.model_spec.model_dump_json(), self.job.train.model_dump_json()
        plan_json = self.plan.model_dump_json()
        for p in self.plan.pipelines:
            for st in p.stages:
                pg = placement_group([{"GPU": 1}] * st.tp, strategy="STRICT_PACK",
                                     bundle_label_selector=[{"ray.io/node-id": ids[st.node]}] * st.tp)
                self.pgs.append(pg)
                for k in range(st.tp):
                    self.workers.append(TrainWorker.options(
                        num_gpus=1,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k),
                    ).remote(plan_json, len(self.workers), model_json, train_json, self.job.data.model_dump(),
                             self.job.runtime.dtype, slow[st.gpu_type], self.job.runtime.log_every,
                             self.job.runtime.meter_memory))
        try:
            ray.get([pg.ready() for pg in self.pgs], timeout=timeout_s)
        except GetTimeoutError:
            raise JobFailed(f"could not place the plan's {len(self.workers)} workers within {timeout_s:.0f} s; "
                            "are the plan's nodes and GPUs in the cluster?") from None
        init = ray.get(self.workers[0].rendezvous_address.remote(), timeout=timeout_s)
        self._gather([w.connect.remote(init, self.job.runtime.collective_timeout_s) for w in self.workers],
                     "start-up", timeout_s)

    def run(self, steps: int, first_step: int = 0,
            on_step: Callable[[int, float, float], None] | None = None) -> TrainResult:
        result = TrainResult()
        t_start = time.perf_counter()
        tokens = self.plan.global_batch * self.job.model_spec.seq_len
        for s in range(first_step, first_step + steps):
            t0 = time.perf_counter()
            outs = self._gather([w.step.remote(s) for w in self.workers], f"step {s}", self.job.runtime.step_timeout_s)
            dt = time.perf_counter() - t0
            loss = sum(o.loss for o in outs if o.loss is not None)
            result.losses.append(loss)
            result.step_time_s.append(dt)
            # the meter's device bytes when on, else the allocator's peak (CUDA) or RSS (CPU)
            result.peak_mem_bytes.append(max(o.extra.get("device_peak_bytes") if self.job.runtime.meter_memory
                                             else o.peak_mem_bytes for o in outs))
            log.info("step %d committed: loss %.4f, %.2f s", s, loss, dt)
            if on_step:
                on_step(s, loss, tokens / dt)
        result.wall_s = time.perf_counter() - t_start
        result.tokens_per_s = tokens * steps / result.wall_s
        return result

    def export_states(self) -> list[dict]:
        return self._gather([w.export_state.remote() for w in self.workers], "state export", 120.0)

    def import_state(self, full: dict, optimizer_steps: float) -> None:
        ref = ray.put(full)
        self._gather([w.import_state.remote(ref, optimizer_steps) for w in self.workers], "state import", 120.0)

    def _gather(self, futures: list, what: str, timeout_s: float) -> list:
        """Results in rank order; the first failure ends the run with the rank's identity."""
        index = {f: i for i, f in enumerate(futures)}
        results: list = [None] * len(futures)
        pending, deadline = list(futures), time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                slow = ", ".join(self._describe(index[f]) for f in pending[:4])
                raise JobFailed(f"{what} did not finish within {timeout_s:.0f} s; still waiting on {slow}")
            f = ready[0]
            try:
                results[index[f]] = ray.get(f)
            except RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                raise JobFailed(f"{what} failed: {cause}") from None
            except RayActorError as e:
                raise JobFailed(f"{what} failed: {self._describe(index[f])} died ({type(e).__name__})") from None
        return results

    def _describe(self, rank: int) -> str:
        r = self.ranks[rank]
        st = self.plan.pipelines[r.pipeline].stages[r.stage]
        return f"rank {rank} (pipeline {r.pipeline}, stage {r.stage}, {st.gpu_type} on {r.node})"

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception as e:  # the cluster may already be gone; record and move on
                log.debug("removing placement group failed: %s", e)
        self.workers, self.pgs = [], []
