"""The job controller: an explicit state machine that can be stepped; it executes the policies' decisions.

States (one job):
  [WAITING ->] DISCOVERING -> PLANNING -> LAUNCHING -> TRAINING -> DONE
       ^                         ^            |   \\
       |                         |            |    v  spot notice for a node of the plan
       |                     RECOVERING <-----+  DRAINING: snapshot now, drop the node
       +--------------------------------------------+
  QUEUED: no plan trains on the GPUs free to the job while other jobs hold GPUs of the cluster: the job waits in
  its cluster's queue (`JobQueue`, by priority, then first come first served), looks again every QUEUE_POLL_S and
  goes on to planning when it is first in line and a plan fits; past `queue_timeout_s` it fails with exit code 2
  naming the holders. Without a queue it fails at once. The first in line asks running jobs of lower priority
  for GPUs (`_ask`), or, sharing the fleet by weight, the jobs whose nodes that share gives it (control/share.py);
  an asked job gives nodes back at a step boundary through DRAINING, or, where what it keeps trains no plan,
  suspends (its committed step kept off the GPUs: StatePlane.suspend) and goes to QUEUED. The queue's part of
  the machine is control/queueing.py's (`Queueing`, which the controller inherits).
  WAITING (jobs with a `fleet:`): the fleet's demand stands on Ray's autoscaler (orchestrator/cluster/capacity.py)
  until every type's minimum is up; past `fleet.wait_s` the job fails with exit code 2 naming the missing types.
  The demand stands while the job runs (a preempted node is replaced; a scale check moves onto it) and is
  withdrawn at DONE or FAILED.
  (Waiting is control/capacity_watch.py's part.) A worker failure goes to the failure policy
  (orchestrator/control/failure.py): re-plan (RECOVERING, its state carrying the failure) or abort (FAILED). A
  job started with a user's plan begins at LAUNCHING. Each state is typed with its data (control/states.py); a
  notice's or a join's switch, pre-staged while training goes on, is control/switching.py's part. Every side
  effect sits behind a protocol (orchestrator/control/protocols.py): unit tests drive `step()` with
  orchestrator/control/fakes.py.
Step s is committed when every worker finished its gradient sync for s and was told to apply the update
(two-phase; the worker group does it). The state plane (`StatePlane`: state/tiers.TieredState on Ray,
control/snapshots.MemorySnapshots for fakes) snapshots after steps, salvages survivors' state after a failure
and restores the newest step it can; the job resumes after it: no sample lost or repeated. Joined nodes are
weighed every `scale_check_every` steps (orchestrator/control/replan.py); a joined node's GPUs get warm
workers at the first step boundary that sees it, and a chosen move waits for them while training goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from orchestrator.control.capacity import Capacity
from orchestrator.control.capacity_watch import WatchingCapacity
from orchestrator.control.failure import Replan, failure_policy, loses_a_node
from orchestrator.control.parts import Progress
from orchestrator.control.policy import Policy
from orchestrator.control.protocols import (
    Clock,
    InterruptionSource,
    JobQueue,
    NodeSource,
    NoInterruptions,
    StatePlane,
    SystemClock,
    WorkerGroup,
)
from orchestrator.control.queueing import Queueing, holders
from orchestrator.control.replan import choose_replan
from orchestrator.control.share import FleetShare
from orchestrator.control.snapshots import MemorySnapshots
from orchestrator.control.states import (
    Draining,
    Phase,
    Recovering,
    State,
    Suspension,
    Training,
    expect,
    kind_of,
    present,
)
from orchestrator.control.switching import Switching
from orchestrator.control.timeline import Joining, Staged, SwitchTimeline
from orchestrator.errors import CheckpointError, ResumeError, WorkerFailure, WriterConflict
from planner import ClusterSpec, Plan, PlanningError
from planner.search import CollectionPause, Planner
from planner.specs import ModelSpec, TrainSpec

log = logging.getLogger("hetspot.controller")


RECOVERY = (State.RECOVERING, State.DISCOVERING, State.PLANNING, State.LAUNCHING)  # a failure to the restore


class Controller(Queueing, Switching, WatchingCapacity):
    def __init__(self, model: ModelSpec, train: TrainSpec, steps: int, nodes: NodeSource,
                 make_group: Callable[[Plan], WorkerGroup], *, store: StatePlane | None = None,
                 clock: Clock | None = None, interruptions: InterruptionSource | None = None,
                 policy: Policy | None = None, first_plan: Plan | None = None, user_plan: bool = False,
                 on_phase: Callable[[str], None] | None = None, capacity: Capacity | None = None,
                 sleep: Callable[[float], None] | None = None, queue: JobQueue | None = None) -> None:
        self.model, self.train, self.steps = model, train, steps
        self.policy = policy or Policy()
        self.nodes, self.make_group = nodes, make_group
        self.store = store or MemorySnapshots(self.policy.snapshot_every)
        self.clock, self.interruptions = clock or SystemClock(), interruptions or NoInterruptions()
        # Failures in a row that lost no node with no step committed between them (the failure policy's `stalled`),
        # and the steps committed so far when the last failure came (a count that rollbacks do not lower).
        self._stalled, self._commits, self._commits_at_failure = 0, 0, 0
        self.on_phase = on_phase or (lambda phase: None)
        self.planner = Planner(model, train)  # keeps its cost caches across re-plans
        self.progress = Progress()
        self.cluster: ClusterSpec | None = None
        self.group: WorkerGroup | None = None
        self.error: str | None = None
        self.exit_code = 0  # 1 for a failed job; 2 when the fleet's minimum never came up (a user's fix)
        self.capacity = capacity  # cluster/capacity.Capacity: the fleet's standing demand; None: take what is there
        self.sleep = sleep or time.sleep
        self.doomed: set[str] = set()  # nodes under a notice: left out of every later plan
        self._held: dict[str, dict[str, int]] = {}  # GPUs other jobs hold, as last said in an event
        self.queue = queue  # None: no queue (fail when nothing is free)
        self._queued_at: float | None = None  # when the job entered the queue (None: not queued)
        self._asked_on: dict | None = None  # the holders a queued job last asked lower-priority jobs about
        self._yielded: set[str] = set()  # nodes given back to a higher-priority job: doomed until the drain is done
        self._suspended: str | None = None  # who took its GPUs, while a suspended job waits to resume (no bound)
        self.fleet_share = FleetShare()  # its reading of the weighted share (jobs with runtime.fleet_share: weighted)
        self._share_asked_on: dict | None = None  # the holders a running sharing job last asked for its share
        self._share_read, self._share_keep = False, None  # its last reading: the nodes it keeps (None: no filter)
        self._plan_from = 0  # the first step trained on the running plan (its throughput is measured from there)
        self._known_nodes: set[str] | None = None  # the node set the running plan was chosen for
        self._known_gpus: dict[str, int] = {}  # and each node's GPUs free to the job then (others may free more)
        self._launch_s = 5.0  # the last launch's start-up (placing workers, process group), for migration costs
        self._draining: SwitchTimeline | None = None  # the drain's or move's timeline in progress
        self._warmed: set[str] = set()  # joined nodes whose GPUs got warm workers at once
        self._switch_by: float = 0.0  # a staged drain switches by then whether its workers are ready or not
        self._collection = CollectionPause()  # the garbage collector's, over a recovery
        self.started_at = self.clock.now()
        # A first plan (checked against the job) skips discovery and planning; `user_plan`: from --plan.
        self.plan: Plan | None = first_plan
        self.user_plan = user_plan and first_plan is not None
        self._state: Phase = State.LAUNCHING if first_plan is not None else State.DISCOVERING
        if capacity is not None and first_plan is None:
            self._state = State.WAITING

    # The state machine's invariants, typed: from launch until the group is released there is a group, a plan and
    # the cluster it was chosen for; a drain event is open from a notice until the new plan's first step.
    @property
    def workers(self) -> WorkerGroup:
        return present(self.group, "worker group is running", self.state)

    @property
    def running_plan(self) -> Plan:
        return present(self.plan, "plan is chosen", self.state)

    @property
    def running_cluster(self) -> ClusterSpec:
        return present(self.cluster, "cluster is discovered", self.state)

    @property
    def _timeline(self) -> SwitchTimeline:
        return present(self._draining, "drain is in progress", self.state)

    @property
    def state(self) -> State:
        """The current state's kind (its data: `_state`, control/states.py)."""
        return kind_of(self._state)

    @property
    def _staged(self) -> Staged | None:  # a notice's pre-staged switch, while training on or draining
        return self._state.staged if isinstance(self._state, (Training, Draining)) else None

    @property
    def _join(self) -> Joining | None:  # a join's chosen move, while training on
        return self._state.join if isinstance(self._state, Training) else None

    # -- the state machine -------------------------------------------------------
    def step(self) -> State:
        """Run one transition and return the new state."""
        handler = {
            State.WAITING: self._wait_for_capacity, State.DISCOVERING: self._discover, State.PLANNING: self._plan,
            State.QUEUED: self._queued,
            State.LAUNCHING: self._launch,
            State.TRAINING: self._train, State.RECOVERING: self._recover, State.DRAINING: self._drain,
        }.get(self.state)
        if handler is not None:
            before = self.state
            try:
                self._state = handler()
            except BaseException:
                self._collection.resume()
                raise
            self.progress.history.append(f"{before.value}->{self.state.value}")
            # A failure's recovery runs with the garbage collector paused, up to the new group's restore
            # (planner.search.CollectionPause: at thousands of ranks its collections were a third of the CPU).
            if self.state is State.RECOVERING:
                self._collection.pause()
            elif self.state not in RECOVERY:
                self._collection.resume()
        return self.state

    @property
    def join_pending(self) -> bool:
        """A move onto joined nodes is chosen and waits, at step boundaries, for their warm workers."""
        return self._join is not None

    def finish_after(self, step: int) -> None:  # end once `step` is committed (a trace replay ends with its trace)
        self.steps = max(step, self.progress.committed) + 1

    def run(self) -> State:
        while self.state not in (State.DONE, State.FAILED):
            self.step()
        return self.state

    def _phase(self, phase: str) -> None:
        self.progress.phase = phase
        log.info("phase: %s", phase)
        self.on_phase(phase)

    def _discover(self) -> Phase:
        self._phase("discovering GPUs")
        if self.queue is not None:  # in line from now until its workers hold their GPUs, so that no running job
            self.queue.enter()  # grows or warms workers into the free GPUs it is about to plan on
        found = self.nodes.discover()
        held = self.nodes.held
        if held != self._held:  # GPUs another job holds: named once, and again when that changes
            self._held = held
            if held:
                self._event("held", f"GPUs held by other jobs, left out of the plan: {holders(held)}", held=held)
        if not found.nodes:
            if held and self.queue is not None:
                return self._enqueue("a free GPU")
            return self._fail("no GPU of the cluster is free to this job" + (
                f": {holders(held)} hold them; submit it again when they end" if held else ""))
        self.cluster = self._not_queued_for(found.without_nodes(self.doomed))  # a re-plan keeps to what it had
        self._remember(self.cluster)
        log.info("discovered %d GPUs on %d nodes", self.cluster.num_gpus, len(self.cluster.nodes))
        return State.PLANNING

    def _plan(self) -> Phase:
        self._phase(f"planning on {self.running_cluster.num_gpus} GPUs")
        try:  # a re-plan weighs the planner's top plans by throughput minus migration (orchestrator/control/replan.py)
            self.plan, choice = choose_replan(self.planner, self.model, self.train, self.plan, self.running_cluster,
                                              self.steps - self.progress.committed - 1, self._launch_s,
                                              self.policy.replan_tolerance)
        except PlanningError as e:
            if self.nodes.held and self.queue is not None:  # the GPUs others hold may make one fit
                return self._enqueue(f"more GPUs than the {self.running_cluster.num_gpus} free ({e})")
            return self._fail(f"no plan on the {self.running_cluster.num_gpus} GPUs left: {e}")
        log.info("planned %d pipelines, predicted %.0f tokens/s", len(self.plan.pipelines),
                 self.plan.estimate.tokens_per_s if self.plan.estimate else float("nan"))
        if choice and self.progress.events:
            self.progress.events[-1]["plan_choice"] = choice  # the re-plan's or drain's event
        self._mark("plan_s")
        for u in self.plan.unused:
            log.info("GPU %s left idle: %s", u.device, u.reason)
        return State.LAUNCHING

    def _launch(self) -> Phase:
        try:
            self.store.claim()  # once: one writer per run (a second job of the run stops here, before any worker)
        except WriterConflict as e:
            return self._fail(str(e), exit_code=2)
        except Exception as e:  # noqa: BLE001 - S3 refusing the lock now: each manifest write is still checked
            log.warning("could not take the run's writer lock (%s: %s); going on without it", type(e).__name__, e)
        self._phase(f"placing {len(self.running_plan.devices())} workers and joining their process group")
        self.group = self.make_group(self.running_plan)
        try:
            t0 = self.clock.now()
            self.group.start()
            self._launch_s = self.clock.now() - t0
            self._dequeue()  # its workers hold their GPUs: until now a running job's growth would race it for them
            self._phase("restoring state")
            restored = self.store.restore(self.group, self.doomed)
            step = restored.step if restored else -1
            if step != self.progress.committed:  # back to the restored step after a failure, on after a resume
                self._roll_to(step)
            if restored:
                self.progress.snapshot_step = step
                self._event("restore", f"step {step} from {restored.tier}", **restored.as_dict())
        except WorkerFailure as e:
            return self._decide(e)
        except CheckpointError as e:  # no state to go on from: any plan would fail the same way
            self.group.shutdown()
            # a resume that cannot read its run's steps is the user's to fix (credentials, the bucket): exit 2
            return self._fail(f"restoring state failed: {e}", exit_code=2 if isinstance(e, ResumeError) else 1)
        self._phase("training")
        self._plan_from = self.progress.committed + 2  # the first step on this plan warms up: not measured
        return Training()

    def _eval_step(self, s: int) -> bool:
        """Step s is one the validation loss is evaluated after (every `eval_every`, and the job's last)."""
        every = self.train.eval_every
        return bool(every) and s >= 0 and ((s + 1) % every == 0 or s + 1 == self.steps)

    def _eval_due(self, s: int) -> bool:
        return self._eval_step(s) and s not in self.progress.val_losses

    def _train(self) -> Phase:
        s = self.progress.committed + 1
        if self._eval_due(s - 1):  # an evaluation a failure interrupted: redone on that step's restored weights
            try:
                val = self.progress.val_losses[s - 1] = self.workers.evaluate(self.train.eval_batches)
            except WorkerFailure as e:
                return self._decide(e)
            self._event("evaluation", f"validation loss after step {s - 1}: {val:.4f}, evaluated on its restored "
                        "weights (a failure interrupted the first evaluation)", step=s - 1, val_loss=val)
        if s >= self.steps:
            self.store.flush()  # the last checkpoint upload completes (from the workers' copies) before the end
            self.workers.shutdown()
            self._close_interruptions()
            self._withdraw()
            self._end_drain("the job ended before the switch")
            self.store.release()
            if self.queue is not None:
                self.queue.leave()
            self._phase("done")
            return State.DONE
        lost = self.store.writer_lost()
        if lost is not None:  # another job writes the run now: no step this job trains could be kept
            self.workers.shutdown()
            self.group = None
            return self._fail(f"{lost}; the job stopped after step {self.progress.committed} (the run goes on in "
                              "the job that took it over)", exit_code=2)
        polled, asked = self.interruptions.poll(), self._asked()
        drain = self._heed(polled + (asked if isinstance(asked, list) else []))  # None: no notice for its nodes
        if isinstance(asked, Suspension):
            return self._suspend(asked)
        if drain or (drain is None and self._staged is not None and self._switch_now()):
            return Draining(self._timeline, self._staged)
        try:
            self._mark("resumed_s")
            t0 = self.clock.now()
            if self.progress.startup_s is None:
                self.progress.startup_s = t0 - self.started_at
            loss = self.workers.step(s)
            self.progress.step_time_s[s] = self.clock.now() - t0
            self.progress.committed, self.progress.losses[s] = s, loss
            self._commits += 1
            if self._yielded and self._draining is None and self._staged is None:  # given back: the nodes may
                self.doomed -= self._yielded  # come back to the job once the job that asked ends
                self._yielded = set()
            self.progress.samples[s] = list(getattr(self.group, "last_samples", []))
            self._mark("first_step_s")
            if self.store.after_step(self.workers, s, self.doomed):
                self.progress.snapshot_step = s
            if self._eval_step(s):  # between steps: after the commit
                self.progress.val_losses[s] = self.workers.evaluate(self.train.eval_batches)
            if s == self._plan_from - 1:  # the plan's first step: idle kept processes are gone, their GPUs free
                self.workers.warm_spares(self.cluster or self.nodes.discover().without_nodes(self.doomed))
            # Joins are looked for at every step boundary (their GPUs warm at once), weighed every scale_check_every
            every = self.policy.scale_check_every
            if every and s + 1 < self.steps and self._scale_up((s + 1) % every == 0):
                return State.LAUNCHING
        except WorkerFailure as e:
            return self._decide(e)
        return self._state

    def _recover(self) -> Phase:
        """After a failure the policy re-plans: survivors keep their committed state (tier "live") and their group
        goes; the next launch, on a new plan, restores the newest step the tiers hold and rolls progress to it."""
        rec = expect(self._state, Recovering)
        failure, detected_s = rec.failure, rec.detected_s
        if self.group is not None:
            self._salvage()
            self.group.release()
        self._event("re-plan", str(failure), detected_s=detected_s, failure=failure.kind, nodes=failure.nodes)
        if self.user_plan:
            log.warning("replacing the plan given with --plan by a planner plan on the surviving GPUs "
                        "(--replan-on-loss)")
            self.user_plan = False
        return State.DISCOVERING

    def _roll_to(self, step: int) -> None:  # progress goes on after `step`: later steps are redone, none skipped
        if step < self.progress.committed:
            log.warning("rolling back from step %d to step %d: the steps after it are redone",
                        self.progress.committed, step)
        self.progress.committed = step
        for per_step in ("losses", "val_losses", "step_time_s", "samples"):
            setattr(self.progress, per_step, {k: v for k, v in getattr(self.progress, per_step).items() if k <= step})

    # -- the executor of decisions -------------------------------------------------
    def _decide(self, failure: WorkerFailure) -> Phase:
        detected_s = round(self.clock.now() - self.started_at, 3)  # before salvage and shutdown
        stalled_before = self._stalled if self._commits == self._commits_at_failure else 0
        self._stalled = 0 if loses_a_node(failure) else stalled_before + 1
        self._commits_at_failure = self._commits
        decision = failure_policy(failure, self.progress.restarts, self.policy.max_restarts, self.user_plan,
                                  self.policy.replan_user_plan, self._stalled, self.policy.max_stalled)
        log.warning("worker failure (%s): %s -> %s", failure.kind, failure, type(decision).__name__)
        self._join_dropped("a failure re-planned first")  # (a staged switch goes with TRAINING: a failure
        # re-plans from what is left, and warm workers stay in the pool)
        if isinstance(decision, Replan):
            self.progress.restarts += 1
            return Recovering(failure, detected_s)
        if self.group is not None:
            self.group.shutdown()
        return self._fail(decision.reason)

    def _salvage(self) -> None:  # survivors keep their committed state (tier "live") before their group goes
        try:
            self.store.salvage(self.workers, self.doomed, self.progress.committed)
        except Exception as e:  # the other tiers still hold the state; a failed salvage costs bytes, not the job
            log.warning("salvaging survivors' state failed: %s", e)

    def _event(self, kind: str, cause: str, **extra: Any) -> None:
        self.progress.events.append({"kind": kind, "cause": cause, "at_step": self.progress.committed,
                                     "t_s": round(self.clock.now() - self.started_at, 3)} | extra)

    def _close_interruptions(self) -> None:  # the notice pollers on the nodes
        getattr(self.interruptions, "close", lambda: None)()

    def _fail(self, reason: str, exit_code: int = 1) -> State:
        if self.queue is not None:
            self.queue.leave()
            self._queued_at = None
        self._close_interruptions()
        self._withdraw()
        self.store.release()  # (none held where the claim itself failed)
        self._end_drain(f"the job failed: {reason}")
        self.error, self.exit_code = reason, exit_code
        self._phase("failed")
        log.error("job failed: %s", reason)
        return State.FAILED
