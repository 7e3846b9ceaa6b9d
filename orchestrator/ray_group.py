"""Ray adapters for the controller's protocols: a worker group over PlanRun, nodes from RayInventory."""

from __future__ import annotations

from orchestrator.controller import WorkerFailure
from orchestrator.discovery import RayInventory
from orchestrator.errors import JobFailed
from orchestrator.jobfile import JobSpec
from orchestrator.runner import PlanRun
from planner import ClusterSpec, Plan
from workers.state import full_state


class RayWorkerGroup:
    def __init__(self, job: JobSpec, plan: Plan, on_step=None):
        self.run = PlanRun(job, plan)
        self.on_step = on_step
        self.last_peak_mem = 0

    def start(self) -> None:
        try:
            self.run.start()
        except JobFailed as e:
            raise WorkerFailure("start-up", str(e)) from None

    def step(self, step_index: int) -> float:
        try:
            r = self.run.run(1, first_step=step_index, on_step=self.on_step)
            self.last_peak_mem = r.peak_mem_bytes[0]
            return r.losses[0]
        except JobFailed as e:
            raise WorkerFailure(f"step {step_index}", str(e)) from None

    def export_state(self) -> tuple[dict, float]:
        try:
            return full_state(self.run.export_states())
        except JobFailed as e:
            raise WorkerFailure("snapshot", str(e)) from None

    def import_state(self, state: dict, optimizer_steps: float) -> None:
        try:
            self.run.import_state(state, optimizer_steps)
        except JobFailed as e:
            raise WorkerFailure("restore", str(e)) from None

    def shutdown(self) -> None:
        self.run.shutdown()


class RayNodes:
    """The job's nodes that Ray still reports alive with GPUs (their specs, bandwidths included, from the job)."""

    def __init__(self, declared: ClusterSpec):
        self.declared = declared

    def discover(self) -> ClusterSpec:
        alive = {n.name for n in RayInventory().discover()}
        return self.declared.model_copy(update={"nodes": [n for n in self.declared.nodes if n.name in alive]})
