"""The controller as a Ray actor (`ControllerActor`), its factory, and the loop that drives it.

`ControllerActor` owns one job's `Controller` inside the cluster, pinned to the
head node (spot workers may vanish, the head stays): it discovers nodes, plans,
places TrainWorkers, trains and re-plans after failures, while the caller only
polls `step()`. Each committed step becomes a metrics row (loss, tokens/s from
the step time, MFU, memory) published through `ray.util.metrics` and, when
configured, TensorBoard, and goes to the job's run record (orchestrator/runtime/run_record.py). The actor is
threaded (two calls at once) so `phase()` answers while a long `step()` (placing workers, restoring state) runs.

Callers: `hetspot submit` on the embedded test cluster (orchestrator/api.py)
and the Ray Jobs entry point (orchestrator/driver.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import ray

from orchestrator.control.capacity import Capacity
from orchestrator.control.controller import Controller, State
from orchestrator.control.policy import Policy
from orchestrator.control.protocols import JobCard, JobQueue, NodeSource, StatePlane
from orchestrator.job_spec import JobSpec
from orchestrator.preemption.ray_notices import RayNotices
from orchestrator.runtime.processes import WorkerPool
from orchestrator.runtime.worker_group import RayWorkerGroup
from orchestrator.state.recovery import recovery
from planner import Plan

if TYPE_CHECKING:
    from orchestrator.state.tiers import TieredState

log = logging.getLogger("hetspot.controller")


def make_controller(job: JobSpec, steps: int, nodes: NodeSource | None = None, first_plan: Plan | None = None,
                    user_plan: bool = False, replan_user_plan: bool = False,
                    on_step: Callable[[int, float, float], None] | None = None,
                    on_phase: Callable[[str], None] | None = None, capacity: Capacity | None = None,
                    checkpoint_run: str | None = None, queue: JobQueue | None = None) -> Controller:
    """A Controller over the connected Ray cluster: one TrainWorker per GPU.

    Nodes default to the job's `cluster:` nodes that Ray reports alive (the embedded cluster); `capacity`
    (cluster/capacity.Capacity) makes it ask the autoscaler for the job's fleet first; `checkpoint_run`: the run
    whose S3 steps the job goes on from (api.check_checkpoint; None: a new run); `queue` (cluster/job_queue): where
    it waits when other jobs hold the GPUs it needs (None: it fails then).
    """
    from orchestrator.cluster.node_sources import DeclaredNodes

    mode = recovery(job.runtime.recovery, WorkerPool(job))  # one strategy for every group of the job: in place,
    # the processes kept across plans live in its pool
    # The plane takes the controller's groups as its StateGroups: every group this controller makes is a
    # RayWorkerGroup, which is both (the one place the two protocols meet)
    store = cast(StatePlane, make_store(job, run_id=checkpoint_run))
    rt = job.runtime
    policy = Policy(max_restarts=rt.max_restarts, max_stalled=rt.max_failures_without_progress,
                    snapshot_every=rt.snapshot_every, scale_check_every=rt.scale_check_every,
                    replan_tolerance=rt.replan_tolerance, queue_timeout_s=rt.queue_timeout_s,
                    replan_user_plan=replan_user_plan)
    model = job.model_spec
    return Controller(model, job.train, steps, nodes or DeclaredNodes(job.cluster),
                      partial(RayWorkerGroup, job, on_step=on_step, recovery=mode, model=model), store=store,
                      policy=policy, first_plan=first_plan, user_plan=user_plan,
                      interruptions=RayNotices(None if rt.notices == "none" else rt.notices, rt.notice_poll_s,
                                               grace_s=rt.notice_grace_s),
                      on_phase=on_phase, capacity=capacity, queue=queue)


def job_card(job: JobSpec) -> JobCard | None:
    """What the job shows the cluster's other jobs where it shares the fleet by weighted throughput."""
    if job.runtime.fleet_share != "weighted":
        return None
    return JobCard(job.runtime.priority, job.model_spec, job.train)


def make_store(job: JobSpec, restore_from: str | None = None, run_id: str | None = None) -> TieredState:
    """The tiered state plane: live and peer tiers always, S3 when the job has a `checkpoint:` section.

    Each S3 manifest names the job (`job`, what a resume and a shared bucket are checked against), the run that
    wrote it (`run_id`: new for a new run, kept by a resume: the store counts, loads and prunes only that run's
    steps) and the model, whose whole unit list every manifest must cover."""
    import uuid

    from orchestrator.state.tiers import TieredState
    from workers.param_specs import all_params

    c = job.checkpoint
    if c is None:
        return TieredState(job.runtime.snapshot_every)
    from orchestrator.state.s3_store import S3Checkpoints

    model = job.model_spec
    from workers.corpus_index import data_digest

    meta = {"job": job.name, "run_id": run_id or uuid.uuid4().hex[:12], "model": model.model_dump(),
            "global_batch": job.train.global_batch, "data": data_digest(job.data.model_dump())}
    return TieredState(job.runtime.snapshot_every, S3Checkpoints.at(c.location), s3_every=c.s3_every, keep=c.keep,
                       meta=meta, restore_from=restore_from or c.restore_from,
                       model_units={p.name: list(p.shape) for p in all_params(model)}, resuming=run_id is not None)


def controller_name(job_id: str) -> str:
    """The controller actor's name (one per job): drills and tests find it with `ray.get_actor`."""
    return f"hetspot-controller-{job_id}"


def on_head() -> dict:
    """Actor options that keep the controller on the head node."""
    return {"resources": {"node:__internal_head__": 0.001}}


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)  # type: ignore[call-overload]  # (Ray's stubs)
class ControllerActor:
    def __init__(self, job_json: str, steps: int, job_id: str, embedded: bool, first_plan_json: str | None = None,
                 user_plan: bool = False, replan_user_plan: bool = False, checkpoint_run: str | None = None):
        from orchestrator.cluster.node_sources import DeclaredNodes, LiveNodes
        from orchestrator.runtime.metrics import StepMetrics, TensorBoardLog

        self.job = JobSpec.model_validate_json(job_json)
        nodes = DeclaredNodes(self.job.cluster) if embedded else LiveNodes(self.job.runtime.profile, job_id)
        first = Plan.model_validate_json(first_plan_json) if first_plan_json else None
        capacity = None
        demand = None if embedded else self.job.demand()  # a real cluster: its fleet, or its cluster: nodes
        if demand is not None:  # ask the autoscaler for them
            import time

            from orchestrator.cluster.capacity import ray_capacity

            capacity = ray_capacity(self.job.model_copy(update={"fleet": demand}), time.monotonic, job_id)
        from orchestrator.cluster.job_queue import RayJobQueue

        self.controller = make_controller(self.job, steps, nodes=nodes, first_plan=first, user_plan=user_plan,
                                          replan_user_plan=replan_user_plan, capacity=capacity,
                                          checkpoint_run=checkpoint_run,
                                          queue=None if embedded  # one job embedded
                                          else RayJobQueue(job_id, self.job.runtime.priority, job_card(self.job)))
        chooser = getattr(capacity, "rechoose", None)
        if capacity is not None and chooser is not None:  # fleet.auto: say which fleet was chosen
            self.controller._event("fleet", f"chose the fleet: {chooser.history[0]}", fleet=dict(
                (t.gpu_type, t.max_nodes) for t in capacity.fleet.types))
        from orchestrator.runtime.run_record import RunRecordWriter, record_location

        ck = self.job.checkpoint
        job_dict = json.loads(job_json)
        index = (job_dict.get("data") or {}).pop("index", None)  # beside the record, not in it (shards: many)
        self.record = RunRecordWriter(record_location(ck.uri if ck else None, job_id),
                                      job_dict, job_id, steps, ck.endpoint_url if ck else None, data_index=index)
        self.metrics = StepMetrics(job_id)
        tb = self.job.runtime.tensorboard_dir
        if tb == "record":  # beside the run record: in its S3 prefix (tensorboardX writes s3:// itself) or folder
            tb = f"{self.record.location}/tensorboard"
            if tb.startswith("s3://") and ck is not None and ck.endpoint_url:
                import os

                os.environ.setdefault("S3_ENDPOINT", ck.endpoint_url)  # tensorboardX's S3 writer reads it
        self.tb = TensorBoardLog(tb) if tb else None
        self.reported = -1
        self.val_reported: set[int] = set()  # steps whose validation loss the metrics and TensorBoard have
        self.windows = _windows(self.job)  # an epoch's samples: each row says how many epochs are done
        self.plan_seen: Plan | None = None
        self.embedded = embedded

    def phase(self) -> str:
        return self.controller.progress.phase

    def step(self) -> dict:
        """One controller transition; returns the new state and a row per newly committed step."""
        from orchestrator.runtime.metrics import step_row

        c = self.controller
        state = c.step()
        out: dict = {"state": state.value, "rows": [], "error": c.error, "phase": c.progress.phase,
                     "events": c.progress.events}
        if c.plan is not None and c.plan is not self.plan_seen and state == State.TRAINING:
            self.plan_seen = c.plan
            self.record.plan(c.plan.model_dump(mode="json"), c.progress.committed + 1)
            out["plan"] = {"pipelines": len(c.plan.pipelines), "gpus": len(c.plan.devices()),
                           "predicted_tokens_per_s": c.plan.estimate.tokens_per_s if c.plan.estimate else None,
                           "unused": [u.model_dump() for u in c.plan.unused],
                           "profiling": dict(getattr(c.nodes, "notes", {}))}
        self.reported = min(self.reported, c.progress.committed)  # a rollback re-runs steps
        lag = c.store.upload_lag(c.progress.committed)
        for s in range(self.reported + 1, c.progress.committed + 1):
            if s not in c.progress.losses:  # committed by an earlier run: a resume starts after its checkpoint
                continue
            row = step_row(c.model, c.running_plan, s, c.progress.losses[s], c.progress.step_time_s[s],
                           c.workers.last_peak_mem, c.progress.restarts, getattr(c.group, "real_gpus", False))
            if self.windows:
                row["epoch"] = round((s + 1) * c.train.global_batch / self.windows, 4)  # epochs done after it
            if s in c.progress.val_losses:  # train.eval_every: the held-out loss after this step
                row["val_loss"] = c.progress.val_losses[s]
                self.val_reported.add(s)
            if s == c.progress.committed:
                row["stages"] = getattr(c.group, "last_stages", [])
                row["peer_step"] = c.progress.snapshot_step  # the newest step copied to a peer keeper (or kept)
            if lag is not None:
                row |= {"upload_lag_steps": lag["lag_steps"], "upload_backlog": lag["backlog"],
                        "s3_step": lag["newest_step"], "failed_uploads": lag["failed"]}
                if lag.get("no_access"):
                    row["s3_no_access"] = lag["no_access"]
            self.metrics.record(row)
            if self.tb is not None:
                self.tb.record(row)
            out["rows"].append(row)
        self.reported = c.progress.committed
        for s, val in c.progress.val_losses.items():  # an evaluation redone after its step's row went out (its
            if s not in self.val_reported:  # event says so): the metrics and TensorBoard get it late, as a point
                self.val_reported.add(s)
                self.metrics.record({"step": s, "val_loss": val})
                if self.tb is not None:
                    self.tb.record({"step": s, "val_loss": val})
        if out["rows"]:  # a recovery ends with the first step committed after it
            self.metrics.recoveries(c.progress.events, c.clock.now() - c.started_at)
        self.record.update(out["rows"], c.progress.events, state.value, c.error, c.clock.now() - c.started_at,
                           c.progress.phase)
        if state in (State.DONE, State.FAILED):
            if self.tb is not None:
                self.tb.close()
            if not self.embedded:
                publish_last_rows()
        return out

    def summary(self) -> dict:
        c = self.controller
        steps = sorted(c.progress.losses)  # a resumed job starts after its checkpoint's step
        return {"state": c.state.value, "error": c.error, "exit_code": c.exit_code,
                "plan": c.plan.model_dump() if c.plan else None,
                "first_step": steps[0] if steps else c.progress.committed + 1,
                "losses": [c.progress.losses[s] for s in steps],
                "samples": [c.progress.samples.get(s, []) for s in steps],  # (first sample, count) each rank trained
                "val_losses": {s: v for s, v in sorted(c.progress.val_losses.items())},
                "step_time_s": [c.progress.step_time_s[s] for s in steps],
                "uploads": [asdict(u) for u in getattr(c.store, "uploads", [])],
                "upload_lag": c.store.upload_lag(c.progress.committed),
                "startup_s": c.progress.startup_s, "restarts": c.progress.restarts, "drains": c.progress.drains,
                "events": c.progress.events, "history": c.progress.history, "run_record": self.record.location}


def _windows(job: JobSpec) -> int | None:
    """The samples of one epoch of the job's corpus (None: synthetic data, or its shards could not be sized now:
    the rows then carry no epoch): from the job's index, else from the shards' sizes now."""
    from workers.corpus_index import training_windows
    from workers.data_validation import corpus_windows

    d = job.data
    if d.index is not None:
        return training_windows(d.model_dump(), job.model_spec.seq_len)
    try:
        windows = corpus_windows(d.kind, d.path, job.model_spec.seq_len, d.dtype, d.endpoint_url)
        return None if windows is None else windows - (0 if d.val_path else int(windows * d.val_fraction))
    except Exception as e:  # noqa: BLE001 - only the progress figure is lost; the workers check the data themselves
        log.warning("could not size the corpus at %s (%s): rows carry no epoch", d.path, e)
        return None


def publish_last_rows() -> None:
    """Keep this process up for one of Ray's metrics exports, so the last step's gauges reach the node's metrics
    agent before the job ends (and its actors with it): a core worker exports its gauges once per
    `metrics_report_interval_ms` (10 s by default, at least 1 s), and a gauge it never exported is lost. The agent
    keeps a finished worker's last export for a while after that, where Prometheus scrapes it."""
    import time

    try:
        interval_s = max(ray._config.metrics_report_interval_ms(), 1000) / 1000
    except Exception:  # (a private accessor: Ray's default if it moves)
        interval_s = 10.0
    time.sleep(interval_s + 0.5)


def drive(actor: Any, on_row: Callable[[dict], None] | None = None, on_event: Callable[[dict], None] | None = None,
          on_phase: Callable[[str], None] | None = None, poll_s: float = 1.0) -> dict:
    """Poll the controller actor until the job is done or failed; return its summary.

    While a transition runs, the actor's phase is read every `poll_s` and each
    new one goes to `on_phase`, so a long start-up is never silent.
    """
    seen = None
    while True:
        ref = actor.step.remote()
        while not ray.wait([ref], timeout=poll_s)[0]:
            phase = ray.get(actor.phase.remote())
            if phase != seen and on_phase is not None:
                on_phase(phase)
            seen = phase
        out = ray.get(ref)
        if out["phase"] != seen and on_phase is not None:
            on_phase(out["phase"])
        seen = out["phase"]
        if on_event is not None:
            on_event(out)
        for row in out["rows"]:
            if on_row is not None:
                on_row(row)
        if out["state"] in (State.DONE.value, State.FAILED.value):
            return ray.get(actor.summary.remote())
