"""The job controller: an explicit state machine that can be stepped; it executes the policies' decisions.

The states, each typed with its data, and the transitions between them: control/states.py. Each state has one
handler, a function of the state's record that returns the next (`Controller.step`); the handlers for the queue
(QUEUED, a yield request, a suspension) are control/queueing.py's, for a notice's drain and a join's move (staged
while training goes on) control/switching.py's, for the fleet's capacity (WAITING) control/capacity_watch.py's,
the job's end (DONE, FAILED, with what it gives back) is control/ending.py's, the held-out loss control/evaluation.py's.
A worker failure goes to the failure policy (control/failure.py): re-plan (RECOVERING, its state carrying the
failure) or abort (FAILED). Every side effect sits behind a protocol (control/protocols.py): unit tests drive
`step()` with control/fakes.py.
Step s is committed when every worker finished its gradient sync for s and was told to apply the update
(two-phase; the worker group does it). The state plane (`StatePlane`: state/tiers.TieredState on Ray,
control/snapshots.MemorySnapshots for fakes) snapshots after steps, salvages survivors' state after a failure
and restores the newest step it can; the job resumes after it: no sample lost or repeated. Joined nodes are
weighed every `scale_check_every` steps (control/replan.py); a joined node's GPUs get warm workers at the first
step boundary that sees it, and a chosen move waits for them while training goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

from orchestrator.control.capacity import Capacity
from orchestrator.control.capacity_watch import WatchingCapacity
from orchestrator.control.ending import Ending
from orchestrator.control.evaluation import Evaluating
from orchestrator.control.failure import Replan, Streak, failure_policy
from orchestrator.control.parts import Progress, QueuePlace
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
from orchestrator.control.queueing import Queueing
from orchestrator.control.replan import choose_replan
from orchestrator.control.snapshots import MemorySnapshots
from orchestrator.control.states import Draining, Phase, Recovering, State, Suspension, Training
from orchestrator.control.switching import Switching
from orchestrator.control.timeline import Switches
from orchestrator.errors import CheckpointError, ResumeError, WorkerFailure, WriterConflict
from planner import ClusterSpec, Plan, PlanningError
from planner.search import CollectionPause, Planner
from planner.specs import ModelSpec, TrainSpec

log = logging.getLogger("hetspot.controller")


RECOVERY = (State.RECOVERING, State.DISCOVERING, State.PLANNING, State.LAUNCHING)  # a failure to the restore


class Controller(Queueing, Switching, WatchingCapacity, Ending, Evaluating):
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
        self.streak = Streak()  # failures in a row with no node lost and no step committed between them
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
        self.queue = queue  # None: no queue (fail when nothing is free)
        self.place = QueuePlace()  # its place in the queue, its requests and its reading of the share
        self._plan_from = 0  # the first step trained on the running plan (its throughput is measured from there)
        self.switch = Switches()  # the switch in progress, the nodes the plan was chosen among
        self._launch_s = 5.0  # the last launch's start-up (placing workers, process group), for migration costs
        self._collection = CollectionPause()  # the garbage collector's, over a recovery
        self.started_at = self.clock.now()
        # A first plan (checked against the job) skips discovery and planning; `user_plan`: from --plan.
        self.plan: Plan | None = first_plan
        self.user_plan = user_plan and first_plan is not None
        self._state: Phase = State.LAUNCHING if first_plan is not None else State.DISCOVERING
        if capacity is not None and first_plan is None:
            self._state = State.WAITING

    # The state machine's invariants, typed: from launch until the group is released there is a group, a plan and
    # the cluster it was chosen for; a drain event is open from a notice until the new plan's first step. Their
    # absence is a bug in the controller, said as such.
    @property
    def workers(self) -> WorkerGroup:
        return self.group if self.group is not None else self._missing("worker group is running")

    @property
    def running_plan(self) -> Plan:
        return self.plan if self.plan is not None else self._missing("plan is chosen")

    @property
    def running_cluster(self) -> ClusterSpec:
        return self.cluster if self.cluster is not None else self._missing("cluster is discovered")

    def _missing(self, what: str) -> NoReturn:
        raise RuntimeError(f"no {what} (state {self.state.value})")

    @property
    def state(self) -> State:
        """The current state's kind (its data: `_state`, control/states.py)."""
        return self._state.kind

    # -- the state machine -------------------------------------------------------
    def step(self) -> State:
        """Run one transition and return the new state: the current state's handler, a function of its record
        (control/states.py), returns the next."""
        handlers: dict[State, Callable[[Any], Phase]] = {
            State.WAITING: self._wait_for_capacity, State.DISCOVERING: self._discover, State.PLANNING: self._plan,
            State.QUEUED: self._queued, State.LAUNCHING: self._launch, State.TRAINING: self._train,
            State.RECOVERING: self._recover, State.DRAINING: self._drain}
        handler = handlers.get(self.state)
        if handler is not None:
            before = self.state
            try:
                self._state = handler(self._state)  # each takes its own record
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

    def _discover(self, st: State) -> Phase:
        self._phase("discovering GPUs")
        if self.queue is not None:  # in line from now until its workers hold their GPUs, so that no running job
            self.queue.enter()  # grows or warms workers into the free GPUs it is about to plan on
        found = self.nodes.discover()
        held = self.nodes.held
        if held != self.place.held:  # GPUs another job holds: named once, and again when that changes
            self._held_changed(held)
        if not found.nodes:
            return self._none_free(held)
        self.cluster = found.without_nodes(self.doomed)  # a re-plan keeps to what it had
        if self.queue is not None:
            self.cluster = self._not_queued_for(self.cluster)
        self._remember(self.cluster)
        log.info("discovered %d GPUs on %d nodes", self.cluster.num_gpus, len(self.cluster.nodes))
        return State.PLANNING

    def _plan(self, st: State) -> Phase:
        self._phase(f"planning on {self.running_cluster.num_gpus} GPUs")
        try:  # a re-plan weighs the planner's top plans by throughput minus migration (orchestrator/control/replan.py)
            self.plan, choice = choose_replan(self.planner, self.model, self.train, self.plan, self.running_cluster,
                                              self.steps - self.progress.committed - 1, self._launch_s,
                                              self.policy.replan_tolerance)
        except PlanningError as e:
            return self._no_plan(e)
        log.info("planned %d pipelines, predicted %.0f tokens/s", len(self.plan.pipelines),
                 self.plan.estimate.tokens_per_s if self.plan.estimate else float("nan"))
        if choice and self.progress.events:
            self.progress.events[-1]["plan_choice"] = choice  # the re-plan's or drain's event
        self._mark("plan_s")
        for u in self.plan.unused:
            log.info("GPU %s left idle: %s", u.device, u.reason)
        return State.LAUNCHING

    def _launch(self, st: State) -> Phase:
        try:
            self.store.claim()  # once: one writer per run (a second job of the run stops here, before any worker)
        except WriterConflict as e:
            return self._fail(str(e), exit_code=2)
        self._phase(f"placing {len(self.running_plan.devices())} workers and joining their process group")
        self.group = self.make_group(self.running_plan)
        try:
            t0 = self.clock.now()
            self.group.start()
            self._launch_s = self.clock.now() - t0
            if self.queue is not None:  # its workers hold their GPUs: until now a running job's growth would race
                self._dequeue()  # it for them
            self._phase("restoring state")
            restored = self.store.restore(self.group, self.doomed)
            step = restored.step if restored else -1
            if step != self.progress.committed:  # back to the restored step after a failure, on after a resume
                self.progress.roll_to(step)
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

    def _train(self, st: Training) -> Phase:
        s = self.progress.committed + 1
        if self.train.eval_every and (failed := self._redo_interrupted(s)) is not None:  # (control/evaluation.py)
            return failed
        if s >= self.steps:
            return self._done()
        lost = self.store.writer_lost()
        if lost is not None:  # another job writes the run now: no step this job trains could be kept
            return self._taken_over(lost)
        polled, asked = self.interruptions.poll(), self._asked() if self.queue is not None else []
        notices = polled + (asked if isinstance(asked, list) else [])
        drain = self._heed(st, notices) if notices else None  # None: no notice for its nodes
        if isinstance(asked, Suspension):
            return self._suspend(asked)
        if drain or (drain is None and st.staged is not None and self._switch_now()):
            return Draining(self._timeline, st.staged)
        try:
            self._mark("resumed_s")
            t0 = self.clock.now()
            if self.progress.startup_s is None:
                self.progress.startup_s = t0 - self.started_at
            loss = self.workers.step(s)
            self.progress.step_time_s[s] = self.clock.now() - t0
            self.progress.committed, self.progress.losses[s] = s, loss
            self.streak.commits += 1
            if self.place.yielded and self.switch.timeline is None and st.staged is None:  # given back: the nodes may
                self.doomed -= self.place.yielded  # come back to the job once the job that asked ends
                self.place.yielded = set()
            self.progress.samples[s] = list(getattr(self.group, "last_samples", []))
            self._mark("first_step_s")
            if self.store.after_step(self.workers, s, self.doomed):
                self.progress.snapshot_step = s
            if self.train.eval_every:  # between steps: after the commit
                self._evaluate_after(s)
            if s == self._plan_from - 1:  # the plan's first step: idle kept processes are gone, their GPUs free
                self.workers.warm_spares(self.cluster or self.nodes.discover().without_nodes(self.doomed))
            # Joins are looked for at every step boundary (their GPUs warm at once), weighed every scale_check_every
            every = self.policy.scale_check_every
            if every and s + 1 < self.steps and self._scale_up(st, (s + 1) % every == 0):
                return State.LAUNCHING
        except WorkerFailure as e:
            return self._decide(e)
        return st

    def _recover(self, st: Recovering) -> Phase:
        """After a failure the policy re-plans: survivors keep their committed state (tier "live") and their group
        goes; the next launch, on a new plan, restores the newest step the tiers hold and rolls progress to it."""
        failure, detected_s = st.failure, st.detected_s
        if self.group is not None:
            self.store.salvage(self.group, self.doomed, self.progress.committed)  # (tier live; a failure is said)
            self.group.release()
        self._event("re-plan", str(failure), detected_s=detected_s, failure=failure.kind, nodes=failure.nodes)
        if self.user_plan:
            log.warning("replacing the plan given with --plan by a planner plan on the surviving GPUs "
                        "(--replan-on-loss)")
            self.user_plan = False
        return State.DISCOVERING

    def _decide(self, failure: WorkerFailure) -> Phase:
        """A worker failure, by the failure policy (control/failure.py): RECOVERING, carrying it, or FAILED."""
        detected_s = round(self.clock.now() - self.started_at, 3)  # before salvage and shutdown
        decision = failure_policy(failure, self.progress.restarts, self.policy.max_restarts, self.user_plan,
                                  self.policy.replan_user_plan, self.streak.failed(failure), self.policy.max_stalled)
        log.warning("worker failure (%s): %s -> %s", failure.kind, failure, type(decision).__name__)
        if self._join is not None:  # (a staged switch goes with TRAINING: a failure re-plans from what is left,
            self._join_dropped("a failure re-planned first")  # and warm workers stay in the pool)
        if isinstance(decision, Replan):
            self.progress.restarts += 1
            return Recovering(failure, detected_s)
        if self.group is not None:
            self.group.shutdown()
        return self._fail(decision.reason)

    def _event(self, kind: str, cause: str, **extra: Any) -> None:
        self.progress.events.append({"kind": kind, "cause": cause, "at_step": self.progress.committed,
                                     "t_s": round(self.clock.now() - self.started_at, 3)} | extra)
