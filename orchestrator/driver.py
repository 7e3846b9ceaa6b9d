"""The controller as a Ray actor, and the job driver that runs it.

`ControllerActor` owns one job's `Controller` (the state machine) inside the
cluster: it discovers nodes, plans, places TrainWorkers, trains, and re-plans
after failures, while the caller only polls `step()`. Each committed step
becomes a row of metrics (loss, tokens/s, MFU, step time, memory), published
through `ray.util.metrics` and, when configured, TensorBoard.

Two callers: `hetspot submit` on the embedded test cluster (orchestrator/api.py)
and `python -m orchestrator.driver`, the entry point that `hetspot submit
--address` hands to Ray Jobs. The driver prints one `hetspot-progress {json}`
line per committed step; `hetspot status` reads the newest one from the logs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable

import ray

from orchestrator.controller import State
from orchestrator.jobfile import JobSpec
from planner import ClusterSpec, Plan

PROGRESS = "hetspot-progress "
ENV_JOB, ENV_STEPS, ENV_ID = "HETSPOT_JOB_SPEC", "HETSPOT_STEPS", "HETSPOT_SUBMISSION_ID"
log = logging.getLogger("hetspot.driver")


class LiveNodes:
    """A running cluster's GPU nodes as Ray reports them, calibrated by the profiling pass once per type."""

    def __init__(self, profile: bool = True):
        self.profile = profile
        self.calibration: dict[str, float] = {}
        self.notes: dict[str, str] = {}

    def discover(self) -> ClusterSpec:
        from orchestrator.discovery import RayInventory, to_cluster_spec
        from orchestrator.profiling import profile_cluster

        nodes = RayInventory().discover()
        new = [n for n in nodes if n.gpu_type not in self.notes]
        if self.profile and new:
            cal, notes = profile_cluster(new)
            self.calibration |= cal
            self.notes |= notes
        return to_cluster_spec(nodes, self.calibration)


def on_head() -> dict:
    """Actor options that keep the controller on the head node: spot workers may vanish, the head stays."""
    return {"resources": {"node:__internal_head__": 0.001}}


@ray.remote(num_cpus=0, max_restarts=0)
class ControllerActor:
    def __init__(self, job_json: str, steps: int, job_id: str, embedded: bool, first_plan_json: str | None = None):
        from orchestrator.api import make_controller
        from orchestrator.observe import StepMetrics, TensorBoardLog
        from orchestrator.ray_group import RayNodes

        self.job = JobSpec.model_validate_json(job_json)
        nodes = RayNodes(self.job.cluster) if embedded else LiveNodes(self.job.runtime.profile)
        first = Plan.model_validate_json(first_plan_json) if first_plan_json else None
        self.controller = make_controller(self.job, steps, nodes=nodes, first_plan=first)
        self.metrics = StepMetrics(job_id)
        self.tb = TensorBoardLog(self.job.runtime.tensorboard_dir) if self.job.runtime.tensorboard_dir else None
        self.reported = -1
        self.plan_seen: Plan | None = None

    def step(self) -> dict:
        """One controller transition; returns the new state and a row per newly committed step."""
        from orchestrator.observe import step_row

        c = self.controller
        state = c.step()
        out: dict = {"state": state.value, "rows": [], "error": c.error}
        if c.plan is not None and c.plan is not self.plan_seen and state == State.TRAINING:
            self.plan_seen = c.plan
            out["plan"] = {"pipelines": len(c.plan.pipelines), "gpus": len(c.plan.devices()),
                           "predicted_tokens_per_s": c.plan.estimate.tokens_per_s if c.plan.estimate else None,
                           "profiling": dict(getattr(c.nodes, "notes", {}))}
        self.reported = min(self.reported, c.progress.committed)  # a rollback re-runs steps
        for s in range(self.reported + 1, c.progress.committed + 1):
            row = step_row(c.model, c.plan, s, c.progress.losses[s], c.progress.step_time_s[s],
                           getattr(c.group, "last_peak_mem", 0), c.progress.restarts)
            self.metrics.record(row)
            if self.tb is not None:
                self.tb.record(row)
            out["rows"].append(row)
        self.reported = c.progress.committed
        if state in (State.DONE, State.FAILED) and self.tb is not None:
            self.tb.close()
        return out

    def summary(self) -> dict:
        c = self.controller
        done = c.progress.committed + 1
        return {"state": c.state.value, "error": c.error, "plan": c.plan.model_dump() if c.plan else None,
                "losses": [c.progress.losses[s] for s in range(done)],
                "step_time_s": [c.progress.step_time_s[s] for s in range(done)],
                "restarts": c.progress.restarts, "history": c.progress.history}


def drive(actor, on_row: Callable[[dict], None] | None = None,
          on_event: Callable[[dict], None] | None = None) -> dict:
    """Poll the controller actor until the job is done or failed; return its summary."""
    while True:
        out = ray.get(actor.step.remote())
        if on_event is not None:
            on_event(out)
        for row in out["rows"]:
            if on_row is not None:
                on_row(row)
        if out["state"] in (State.DONE.value, State.FAILED.value):
            return ray.get(actor.summary.remote())


def main() -> int:
    """Entry point of a Ray Jobs submission (`hetspot submit --address`)."""
    from orchestrator.jobfile import parse_job

    spec = os.environ.get(ENV_JOB)
    if not spec:
        print(f"hetspot driver: {ENV_JOB} is not set; submit jobs with `hetspot submit JOB.yaml --address ...`",
              file=sys.stderr)
        return 2
    job = parse_job(json.loads(spec), "submitted job")
    steps = int(os.environ.get(ENV_STEPS) or job.steps)
    job_id = os.environ.get(ENV_ID, "local")
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.WARNING)
    print(f"hetspot: job {job_id}: {job.name}, {steps} steps, model {job.model_spec.name}", flush=True)
    actor = ControllerActor.options(name=f"hetspot-controller-{job_id}", **on_head()).remote(
        job.model_dump_json(), steps, job_id, False)
    t0 = time.perf_counter()

    def on_event(out: dict) -> None:
        if "plan" in out:
            p = out["plan"]
            print(f"hetspot: training on {p['gpus']} GPUs in {p['pipelines']} pipelines, "
                  f"predicted {p['predicted_tokens_per_s'] or 0:,.0f} tokens/s", flush=True)
            for gpu, note in p["profiling"].items():
                print(f"hetspot: profiling {gpu}: {note}", flush=True)

    def on_row(row: dict) -> None:
        print(PROGRESS + json.dumps(row | {"steps": steps, "elapsed_s": round(time.perf_counter() - t0, 3)}),
              flush=True)

    summary = drive(actor, on_row, on_event)
    if summary["state"] != State.DONE.value:
        print(f"hetspot: job failed: {summary['error']}", file=sys.stderr, flush=True)
        return 1
    print(f"hetspot: done: {len(summary['losses'])} steps, loss {summary['losses'][0]:.4f} -> "
          f"{summary['losses'][-1]:.4f}, {summary['restarts']} re-plans", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
