"""The Ray Jobs entry point: `python -m orchestrator.driver` (what `hetspot submit --address` runs).

It reads the validated job spec from its environment, starts the controller
actor on the head and drives it, printing a `hetspot-phase {json}` line at each
phase change and a `hetspot-progress {json}` line per committed step
(orchestrator/runtime/progress_lines.py); `hetspot status` reads the newest of each.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import ray

from orchestrator.control.controller import State
from orchestrator.runtime.controller_actor import ControllerActor, controller_name, drive, on_head
from orchestrator.runtime.progress_lines import (
    ENV_ID,
    ENV_JOB,
    ENV_RESUME,
    ENV_STEPS,
    events_line,
    phase_line,
    progress_line,
)

EVENTS_EVERY = 50  # steps between repeats of the events line; a status reads the last 3,000 log lines


def _print(line: str, err: bool = False) -> None:
    """One write for the line and its newline: Ray's log forwarding prints workers' lines from another thread of
    this process, and `print` writes the newline apart, so a worker's line could land inside a progress line."""
    stream = sys.stderr if err else sys.stdout
    stream.write(line + "\n")
    stream.flush()


def main() -> int:
    from orchestrator.errors import ConfigError
    from orchestrator.job_spec import parse_job

    spec = os.environ.get(ENV_JOB)
    if not spec:
        _print(f"hetspot driver: {ENV_JOB} is not set; submit jobs with `hetspot submit JOB.yaml --address ...`", True)
        return 2
    try:
        job = parse_job(json.loads(spec), "submitted job")
    except ConfigError as e:
        _print(f"hetspot driver: {e}", True)
        return 2
    resume = os.environ.get(ENV_RESUME) == "1"
    try:  # the data and the bucket are reached from the cluster: check them here, before any worker starts
        from orchestrator.api import check_checkpoint, check_data

        job = check_data(job, "submitted job")  # with its corpus index, taken here on the cluster
        steps = int(os.environ.get(ENV_STEPS) or job.steps)
        resumed = check_checkpoint(job, "submitted job", resume, steps, auto=True)
    except ConfigError as e:
        _print(f"hetspot driver: {e}", True)
        return 2
    bad = _unservable(job)
    if bad:
        _print(f"hetspot driver: the cluster's autoscaler cannot start what the job asks for: {'; '.join(bad)}; "
               "change the job's fleet: or render the cluster for it (hetspot deploy render --from-job)", True)
        return 2
    job_id = os.environ.get(ENV_ID, "local")
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.WARNING)
    if job.demand() is None and not any(n.get("Alive") and n.get("Resources", {}).get("GPU") for n in ray.nodes()):
        _print("hetspot driver: the cluster has no GPU node and the job asks for none: add a fleet: section (the "
               "GPU types to ask Ray's autoscaler for, docs/jobfile.md) or a cluster: section naming the nodes "
               "it needs", True)
        return 2
    _withdraw_on_stop(job, job_id)
    _print(f"hetspot: job {job_id}: {job.name}, {steps} steps, model {job.model_spec.name}")
    if resumed and not resume:
        _print(f"hetspot: {job.checkpoint.uri} holds this job's steps: going on from the newest complete one "
               "(checkpoint.resume: auto)")
    actor = ControllerActor.options(name=controller_name(job_id), **on_head()).remote(
        job.model_dump_json(), steps, job_id, False, checkpoint_run=resumed)
    t0 = time.perf_counter()

    printed: list = []

    def on_event(out: dict) -> None:
        if out["events"] != printed:
            printed[:] = json.loads(json.dumps(out["events"]))
            _print(events_line(printed))
        if "plan" in out:
            p = out["plan"]
            _print(f"hetspot: training on {p['gpus']} GPUs in {p['pipelines']} pipelines, "
                   f"predicted {p['predicted_tokens_per_s'] or 0:,.0f} tokens/s")
            for u in p["unused"]:
                _print(f"hetspot: GPU {u['device']} left idle: {u['reason']}")
            for gpu, note in p["profiling"].items():
                _print(f"hetspot: profiling {gpu}: {note}")

    def on_row(row: dict) -> None:
        _print(progress_line(row | {"steps": steps, "elapsed_s": round(time.perf_counter() - t0, 3)}))
        if printed and row["step"] % EVENTS_EVERY == 0:  # within any tail `hetspot status` reads (ray_jobs.tail)
            _print(events_line(printed))

    from ray.exceptions import RayActorError

    try:
        summary = drive(actor, on_row, on_event, lambda ph: _print(phase_line(ph, time.perf_counter() - t0)))
    except RayActorError:
        _withdraw(job, job_id)
        _print("hetspot: job failed: the job's controller died; run the driver again (a RayJob retry or a restarted "
               "head does) and it goes on from the newest complete step (checkpoint.resume: auto)", True)
        return 1
    if summary["state"] != State.DONE.value:
        _print(f"hetspot: job failed: {summary['error']}", True)
        return summary.get("exit_code") or 1
    _print(f"hetspot: done: {len(summary['losses'])} steps, loss {summary['losses'][0]:.4f} -> "
           f"{summary['losses'][-1]:.4f}, {summary['restarts']} re-plans; run record: {summary['run_record']}")
    return 0


def _unservable(job) -> list[str]:
    """What of the job's demand the cluster's autoscaler config (a `ray up` head's ~/ray_bootstrap_config.yaml)
    has no node type for; empty when it serves all, or when there is no such file (KubeRay, a hand-made cluster)."""
    from pathlib import Path

    demand = job.demand()
    path = Path(os.environ.get("HETSPOT_AUTOSCALER_CONFIG", "~/ray_bootstrap_config.yaml")).expanduser()
    if demand is None or not demand.types or not path.is_file():
        return []
    import yaml

    from orchestrator.cluster.capacity import unservable

    try:
        types = (yaml.safe_load(path.read_text()) or {}).get("available_node_types") or {}
    except (OSError, yaml.YAMLError):
        return []
    return unservable(demand, types)


def _withdraw(job, job_id: str) -> None:
    """Clear the job's demand on the autoscaler (the controller does at its end; this covers a driver stopped
    or left without its controller), so the GPU nodes can go; other jobs' demand stands."""
    if job.demand() is None:
        return
    from orchestrator.cluster.capacity import RayAutoscaler

    try:
        RayAutoscaler(job.demand(), job_id).withdraw()
    except Exception as e:  # the stop goes on; say that nodes may stay up
        _print(f"hetspot: could not withdraw the demand for GPU nodes ({e}); scale them down by hand", True)


def _withdraw_on_stop(job, job_id: str) -> None:
    """`hetspot stop` (Ray Jobs) ends the driver with SIGTERM: withdraw the fleet's demand first."""
    import signal

    def stop(signum, frame):
        _withdraw(job, job_id)
        _print("hetspot: stopped; the demand for GPU nodes is withdrawn", True)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


if __name__ == "__main__":
    sys.exit(main())
