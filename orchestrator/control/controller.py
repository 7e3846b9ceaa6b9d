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
  for GPUs (`_ask`); an asked job gives nodes back at a step boundary through DRAINING, or, where what it keeps
  trains no plan, suspends (its committed step kept off the GPUs: StatePlane.suspend) and goes to QUEUED. The
  queue's part of the machine is control/queueing.py's (`Queueing`, which the controller inherits).
  WAITING (jobs with a `fleet:`): the fleet's demand stands on Ray's autoscaler (orchestrator/cluster/capacity.py)
  until every type's minimum is up; past `fleet.wait_s` the job fails with exit code 2 naming the missing types.
  The demand stands while the job runs (a preempted node is replaced; a scale check moves onto it) and is
  withdrawn at DONE or FAILED.
  A worker failure goes to the failure policy (orchestrator/control/failure.py): re-plan (RECOVERING) or abort
  (FAILED). A job started with a user's plan begins at LAUNCHING. Every side effect sits behind a protocol
  (orchestrator/control/protocols.py): unit tests drive `step()` with orchestrator/control/fakes.py.
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
from dataclasses import dataclass, field
from typing import Any

from orchestrator.control.capacity import Capacity, CapacityView
from orchestrator.control.drain import drain_copy_s, notice_decision
from orchestrator.control.failure import Replan, failure_policy, loses_a_node
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
from orchestrator.control.replan import TOLERANCE, choose_replan, consider_joined, joined_nodes
from orchestrator.control.snapshots import MemorySnapshots
from orchestrator.control.states import State, present
from orchestrator.control.timeline import Joining, Recovering, Staged, SwitchTimeline
from orchestrator.errors import CheckpointError, ResumeError, WorkerFailure, WriterConflict
from planner import ClusterSpec, Plan, PlanningError
from planner.search import CollectionPause, Planner
from planner.specs import ModelSpec, TrainSpec, tokens_per_step

log = logging.getLogger("hetspot.controller")


RECOVERY = (State.RECOVERING, State.DISCOVERING, State.PLANNING, State.LAUNCHING)  # a failure to the restore


@dataclass
class Progress:
    committed: int = -1  # last committed step
    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)  # after step s (train.eval_every): held-out loss
    snapshot_step: int | None = None  # newest step whose state is in the store
    restarts: int = 0
    drains: int = 0
    step_time_s: dict[int, float] = field(default_factory=dict)
    startup_s: float | None = None  # from the controller's start to the first step's start
    phase: str = "discovering"  # what the job is doing now, for people
    history: list[str] = field(default_factory=list)  # transitions, for status and tests
    events: list[dict] = field(default_factory=list)  # re-plans and drains with their cause
    samples: dict[int, list] = field(default_factory=dict)  # per committed step: (first sample, count) trained


class Controller(Queueing):
    def __init__(self, model: ModelSpec, train: TrainSpec, steps: int, nodes: NodeSource,
                 make_group: Callable[[Plan], WorkerGroup], *, store: StatePlane | None = None,
                 clock: Clock | None = None, interruptions: InterruptionSource | None = None,
                 first_plan: Plan | None = None, user_plan: bool = False, replan_user_plan: bool = False,
                 max_restarts: int = 100, max_stalled: int = 5, snapshot_every: int = 1, drain_margin_s: float = 1.0,
                 on_phase: Callable[[str], None] | None = None, scale_check_every: int = 0,
                 capacity: Capacity | None = None, sleep: Callable[[float], None] | None = None,
                 replan_tolerance: float = TOLERANCE, queue: JobQueue | None = None, queue_timeout_s: float = 3600.0,
                 ) -> None:
        self.model, self.train, self.steps = model, train, steps
        self.replan_tolerance = replan_tolerance  # how much throughput a re-plan may give for fewer bytes moved
        self.nodes, self.make_group = nodes, make_group
        self.store = store or MemorySnapshots(snapshot_every)
        self.clock, self.interruptions = clock or SystemClock(), interruptions or NoInterruptions()
        self.max_restarts, self.snapshot_every, self.replan_user_plan = max_restarts, snapshot_every, replan_user_plan
        # Failures in a row that lost no node with no step committed between them (the failure policy's `stalled`),
        # and the steps committed so far when the last failure came (a count that rollbacks do not lower).
        self.max_stalled, self._stalled, self._commits, self._commits_at_failure = max_stalled, 0, 0, 0
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
        self.queue, self.queue_timeout_s = queue, queue_timeout_s  # None: no queue (fail when nothing is free)
        self._queued_at: float | None = None  # when the job entered the queue (None: not queued)
        self._queued_why = ""  # what the queued job waits for, for its phase and its timeout's message
        self._queued_on: tuple = ()  # the free GPUs no plan fitted on (planning again waits for a change)
        self._asked_on: dict | None = None  # the holders a queued job last asked lower-priority jobs about
        self._yielded: set[str] = set()  # nodes given back to a higher-priority job: doomed until the drain is done
        self._suspend_for: tuple | None = None  # (request, nodes, why): give every GPU back at this step boundary
        self._suspended: str | None = None  # who took its GPUs, while a suspended job waits to resume (no bound)
        self.drain_margin_s, self.scale_check_every = drain_margin_s, scale_check_every  # 0: never look for joins
        self._failure: Recovering | None = None  # the failure being recovered from
        self._plan_from = 0  # the first step trained on the running plan (its throughput is measured from there)
        self._known_nodes: set[str] | None = None  # the node set the running plan was chosen for
        self._known_gpus: dict[str, int] = {}  # and each node's GPUs free to the job then (others may free more)
        self._launch_s = 5.0  # the last launch's start-up (placing workers, process group), for migration costs
        self._draining: SwitchTimeline | None = None  # the drain's or move's timeline in progress
        self._staged: Staged | None = None  # a notice's next plan, its new workers warming
        self._join: Joining | None = None  # a join's chosen plan, waiting for the joined nodes' warm workers
        self._warmed: set[str] = set()  # joined nodes whose GPUs got warm workers at once
        self._switch_by: float = 0.0  # a staged drain switches by then whether its workers are ready or not
        self._collection = CollectionPause()  # the garbage collector's, over a recovery
        self.started_at = self.clock.now()
        # A first plan (checked against the job) skips discovery and planning; `user_plan`: from --plan.
        self.plan: Plan | None = first_plan
        self.user_plan = user_plan and first_plan is not None
        self.state = State.LAUNCHING if first_plan is not None else State.DISCOVERING
        if capacity is not None and first_plan is None:
            self.state = State.WAITING

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
                self.state = handler()
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

    def _wait_for_capacity(self) -> State:
        """One look at the fleet against its minimums; the demand is (re)stated when it changed."""
        capacity = present(self.capacity, "fleet's capacity is watched", self.state)
        view = capacity.tick()
        self._substitutions(capacity, view)
        if view.ready:
            log.info("capacity: %s", view.line)
            return State.DISCOVERING
        if capacity.timed_out():
            from orchestrator.control.capacity import timeout_message

            return self._fail(timeout_message(capacity.fleet, view), exit_code=2)
        self._phase(f"waiting for capacity: {view.line}")
        self.sleep(capacity.fleet.poll_s)
        return State.WAITING

    def _substitutions(self, capacity: Capacity, view: CapacityView) -> None:
        if view.rechosen is not None:
            self._event("rechoose", f"{view.rechosen} stayed short of its nodes for "
                        f"{capacity.fleet.substitute_after_s:.0f} s: chose the fleet again among what is left: "
                        + ", ".join(f"{n}x {t}" for t, n in view.demand.items() if n),
                        dry=view.rechosen, fleet=dict(view.demand))
        for dry, sub, n in view.substituted:
            self._event("substitute", f"{dry} stayed short of its max_nodes for "
                        f"{capacity.fleet.substitute_after_s:.0f} s: asking for {n} {sub} node(s) instead",
                        dry=dry, substitute=sub, nodes=n)

    def _discover(self) -> State:
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

    def _plan(self) -> State:
        self._phase(f"planning on {self.running_cluster.num_gpus} GPUs")
        try:  # a re-plan weighs the planner's top plans by throughput minus migration (orchestrator/control/replan.py)
            self.plan, choice = choose_replan(self.planner, self.model, self.train, self.plan, self.running_cluster,
                                              self.steps - self.progress.committed - 1, self._launch_s,
                                              self.replan_tolerance)
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

    def _launch(self) -> State:
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
        return State.TRAINING

    def _eval_step(self, s: int) -> bool:
        """Step s is one the validation loss is evaluated after (every `eval_every`, and the job's last)."""
        every = self.train.eval_every
        return bool(every) and s >= 0 and ((s + 1) % every == 0 or s + 1 == self.steps)

    def _eval_due(self, s: int) -> bool:
        return self._eval_step(s) and s not in self.progress.val_losses

    def _train(self) -> State:
        s = self.progress.committed + 1
        if self._eval_due(s - 1):  # an evaluation a failure interrupted: redone on that step's restored weights
            try:
                self.progress.val_losses[s - 1] = self.workers.evaluate(self.train.eval_batches)
            except WorkerFailure as e:
                return self._decide(e)
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
        drain = self._heed(self.interruptions.poll() + self._asked())  # None: no notice for the plan's nodes
        if self._suspend_for is not None:
            return self._suspend()
        if drain or (drain is None and self._staged is not None and self._switch_now()):
            return State.DRAINING
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
            if self.scale_check_every and s + 1 < self.steps and self._scale_up((s + 1) % self.scale_check_every == 0):
                return State.LAUNCHING
        except WorkerFailure as e:
            return self._decide(e)
        return State.TRAINING

    def _scale_up(self, weigh: bool = True) -> bool:
        """Nodes joined: their GPUs get warm workers at once (processes, imports, device context; looked for at
        every step boundary), whatever the choice, while training goes on; the move is weighed every
        scale_check_every steps (`weigh`) and happens at a step boundary only when the new plan finishes sooner,
        migration included, and only once those workers are ready, so the switch is one re-form and starts no
        process (a notice's pre-staged switch does the same). True: switch now."""
        if weigh and self.capacity is not None:  # substitutes for types that stay dry while the job runs
            self._substitutions(self.capacity, self.capacity.tick())
        cluster = self._not_queued_for(self.nodes.discover().without_nodes(self.doomed))
        known, joined = joined_nodes(self._known_nodes, cluster)
        self._warmed &= known  # a node that left and comes back is warmed again
        fresh = (known - (self._known_nodes or known)) - self._warmed
        if fresh:  # warm at the join, before any decision: a move, or the next recovery, finds them started
            self._warmed |= fresh
            started = self.workers.warm_joined(cluster, fresh)
            if started:
                self._event("warm-at-join", f"nodes joined ({', '.join(sorted(fresh))}): {started} warm worker(s) "
                            "starting", nodes=sorted(fresh), new_workers=started)
        if self._join is not None:  # a move chosen earlier: it goes once its warm workers are ready
            if set(self._join.plan.nodes()) <= known:
                return self._join_ready()
            self._join_dropped("a node it needs left before the switch")  # weighed afresh below
        if not weigh:
            return False
        freed = self._freed(cluster)
        what = "; ".join([f"nodes joined ({joined})"] * bool(joined) + [
            "GPUs freed (" + ", ".join(f"{n}: +{k}" for n, k in sorted(freed.items())) + ")"] * bool(freed))
        if self._staged is not None or (what and self.progress.committed < self._plan_from + 1):
            return False  # weighed once the running plan's speed is measured (2 steps): predictions alone mislead
        self._remember(cluster)
        if joined:  # standing warm workers on GPUs the plan leaves idle (runtime.warm_workers)
            self.workers.warm_spares(cluster)
        got = what and consider_joined(self.planner, self.model, self.train, self.running_plan, cluster,
                                       self.steps - self.progress.committed - 1, self._launch_s,
                                       self._measured_tokens_per_s())
        if not got:
            return False
        new, d, extra = got
        log.info("%s: %s, %s", what, "moving" if d.move else "staying", d.reason)
        self._event("scale-up" if d.move else "scale-up-declined", f"{what}: {d.reason}", **extra,
                    **({"freed": freed} if freed else {}))
        if not d.move:
            return False
        self._draining = SwitchTimeline(self.progress.events[-1])  # switch, resumed, first step, stall
        self._draining.put("new_workers", self.workers.prestage(new))  # ranks on GPUs no warm worker waits on
        self._join = Joining(new, cluster)
        return self._join_ready()

    def _remember(self, cluster: ClusterSpec) -> None:
        """The nodes, and each one's GPUs free to the job, that the running plan was chosen among."""
        self._known_nodes = {n.name for n in cluster.nodes}
        self._known_gpus = {n.name: n.num_gpus for n in cluster.nodes}

    def _freed(self, cluster: ClusterSpec) -> dict[str, int]:
        """Known nodes with more GPUs free to the job than when the plan was chosen (another job ended or shrank),
        and how many more."""
        return {n.name: n.num_gpus - self._known_gpus[n.name] for n in cluster.nodes
                if n.name in self._known_gpus and n.num_gpus > self._known_gpus[n.name]}

    def _join_ready(self) -> bool:
        """A join's move goes at the first step boundary its warm workers are ready at (training goes on meanwhile):
        the committed step stays on its nodes, the group is released and the new plan launches."""
        if self._join is None or not self.workers.staged_ready():
            return False
        self.plan, self.cluster, self._join = self._join.plan, self._join.cluster, None
        self._mark("ready_s")
        self._mark("switch_s")
        self.store.drain(self.workers, self.progress.committed, set())  # the committed step, kept on its nodes
        self.workers.release()
        return True

    def _measured_tokens_per_s(self) -> float | None:
        """The running plan's tokens/s over its last (up to) 10 steps, as measured; None before 2 steps."""
        steps = [s for s in range(self._plan_from, self.progress.committed + 1) if s in self.progress.step_time_s]
        times = sorted(self.progress.step_time_s[s] for s in steps[-10:])
        if len(times) < 2 or times[len(times) // 2] <= 0:
            return None
        return tokens_per_step(self.model, self.train.global_batch) / times[len(times) // 2]

    def _heed(self, notices: list) -> bool | None:
        """Start a drain for notices on the plan's nodes when the deadline leaves time (drain.notice_decision):
        True: drain now; False: not now (staged, or too close: recovery when the node goes); None: no notice."""
        notices = [n for n in notices if n.node not in self.doomed]  # a source may repeat a notice it gave (a
        # Ray drain is reported at every poll while the node drains); a staged drain already heeds it
        now, used = self.clock.now(), set(self.running_plan.nodes())
        copy_s = lambda doomed: drain_copy_s(self.running_plan, self.model, self.train,  # noqa: E731
                                             self.cluster or self.nodes.discover(), self.doomed | doomed)
        got = notice_decision(notices, used, now, self.drain_margin_s, copy_s)
        if got is None:
            return None
        drain, mine, left = got
        nodes, sources = ", ".join(sorted({n.node for n in mine})), ", ".join(sorted({n.source for n in mine}))
        if not drain:
            log.warning("notice for %s (%s) with %.1f s left: too close to drain, falling back to recovery when "
                        "the node goes", nodes, sources, left)
            self._event("notice-too-close", f"notice for {nodes} ({sources}) with {left:.1f} s left", nodes=nodes)
            return False
        self.doomed |= {n.node for n in mine}
        self._join_dropped("a notice came first")
        self._event("drain", f"notice for {nodes} ({sources})", nodes=nodes, notice_s=round(now - self.started_at, 3),
                    deadline_s=round(now + left - self.started_at, 3))
        self._draining = SwitchTimeline(self.progress.events[-1], deadline_s=self.progress.events[-1]["deadline_s"])
        self._switch_by = now + left - self.drain_margin_s - copy_s(self.doomed)
        return self._stage()

    def _stage(self) -> bool:
        """Pre-stage a notice's switch while the doomed nodes still train: choose the next plan now, warm its new
        ranks' workers (processes that no survivor provides) and start the keepers the drain will copy the
        doomed nodes' state to (when no other replica holds it); the switch waits for them at step boundaries
        (`_switch_now`), then re-forms the groups once. True: switch now (nothing to wait for, the restart path,
        or no plan: PLANNING then says why)."""
        if not self.workers.stages_switch:
            return True
        cluster = self.nodes.discover().without_nodes(self.doomed)
        try:
            plan, choice = choose_replan(self.planner, self.model, self.train, self.plan, cluster,
                                         self.steps - self.progress.committed - 1, self._launch_s,
                                         self.replan_tolerance)
        except PlanningError:
            return True
        started = self.workers.prestage(plan)
        self.store.prepare_drain(self.workers, self.doomed)
        self._staged = Staged(plan, cluster, choice)
        self._timeline.put("new_workers", started)
        self._mark("staged_s")
        return self._switch_now()

    def _switch_now(self) -> bool:
        """A staged switch goes at this step boundary when its warm workers and keepers are ready, or when another step
        might not end before the deadline leaves time to drain (the switch then starts what is not ready)."""
        times = sorted(self.progress.step_time_s[s] for s in list(self.progress.step_time_s)[-5:])
        step_s = times[len(times) // 2] if times else 0.0
        if self.workers.staged_ready() and self.store.drain_ready():
            self._mark("ready_s")
            return True
        return self.clock.now() + 2 * step_s >= self._switch_by

    def _join_dropped(self, why: str) -> None:
        """A join's move still waiting for its warm workers gives way (to a failure's re-plan or a notice's drain,
        which plan afresh on what is there); its event says so and keeps no step of its own."""
        if self._join is None:
            return
        self._join = None
        if self._draining is not None and self._draining.kind == "scale-up":
            self._draining.end(why)
            self._draining = None

    def _mark(self, point: str) -> None:
        """A point of the current drain's or move's timeline (control/timeline.SwitchTimeline)."""
        if self._draining is not None and self._draining.mark(point, lambda: self.clock.now() - self.started_at):
            self._draining = None  # the new plan's first step: the switch is over

    def _drain(self) -> State:
        """At a step boundary before the deadline: snapshot the committed step, then re-plan without the node."""
        self._phase(f"draining {', '.join(sorted(self.doomed))}")
        self._mark("switch_s")
        try:
            if self.progress.committed >= 0:
                self.store.drain(self.workers, self.progress.committed, self.doomed)
                self.progress.snapshot_step = self.progress.committed
        except WorkerFailure as e:
            return self._decide(e)
        self.workers.release()
        self._mark("snapshot_s")  # the doomed node's state is out: it may go now
        self.progress.drains += 1
        if self._staged is None:
            return State.DISCOVERING
        staged, self._staged = self._staged, None
        self.plan, self.cluster = staged.plan, staged.cluster
        self._remember(self.cluster)
        if staged.choice:
            self._timeline.event["plan_choice"] = staged.choice
        self._mark("plan_s")
        return State.LAUNCHING

    def _recover(self) -> State:
        """After a failure the policy re-plans: survivors keep their committed state (tier "live") and their group
        goes; the next launch, on a new plan, restores the newest step the tiers hold and rolls progress to it."""
        if self._failure is None:
            raise RuntimeError("recovering without a failure")
        failure, detected_s = self._failure.failure, self._failure.detected_s
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
    def _decide(self, failure: WorkerFailure) -> State:
        detected_s = round(self.clock.now() - self.started_at, 3)  # before salvage and shutdown
        stalled_before = self._stalled if self._commits == self._commits_at_failure else 0
        self._stalled = 0 if loses_a_node(failure) else stalled_before + 1
        self._commits_at_failure = self._commits
        decision = failure_policy(failure, self.progress.restarts, self.max_restarts, self.user_plan,
                                  self.replan_user_plan, self._stalled, self.max_stalled)
        log.warning("worker failure (%s): %s -> %s", failure.kind, failure, type(decision).__name__)
        self._staged = None  # a failure re-plans from what is left (warm workers stay in the pool)
        self._join_dropped("a failure re-planned first")
        if isinstance(decision, Replan):
            self.progress.restarts += 1
            self._failure = Recovering(failure, detected_s)
            return State.RECOVERING
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

    def _withdraw(self) -> None:  # the job's demand goes, so the autoscaler can scale its GPU nodes down
        if self.capacity is not None and self.capacity.withdraw is not None:
            try:
                self.capacity.withdraw()
            except Exception as e:  # the job's outcome stands; an idle node costs money, so say so
                log.warning("could not withdraw the demand for GPU nodes (%s): scale them down by hand", e)

    def _end_drain(self, why: str) -> None:
        """A drain still open when the job ends (a staged switch the job finished before) keeps every key of its
        timeline's end: no step ran on its plan (`first_step_s` None), and `ended` says why."""
        if self._draining is not None:
            self._draining.end(why)
            self._draining = None

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
