"""The controller's part for switching plans at a step boundary while training goes on: a notice's drain (the
committed step kept off the doomed nodes, the next plan pre-staged where processes outlive their group), and a
move onto nodes that joined or GPUs another job freed (warm workers first, the move weighed against what it
costs). Each switch's points in time fill in a `SwitchTimeline` (control/timeline.py); the switch a state carries
is `Training.staged`/`Training.join`, then `Draining` (control/states.py), and the handlers here take that
record. What the part keeps between switches is one record, `Controller.switch` (control/timeline.Switches).
`Switching` is inherited by control/controller.Controller; what it reads of the controller is declared in
control/parts.ControllerParts. Pure.
"""

from __future__ import annotations

import logging

from orchestrator.control.drain import drain_copy_s, notice_decision
from orchestrator.control.parts import ControllerParts
from orchestrator.control.replan import choose_replan, consider_joined, joined_nodes
from orchestrator.control.states import Draining, Phase, State, Training, expect
from orchestrator.control.timeline import Joining, Staged, SwitchTimeline
from orchestrator.errors import WorkerFailure
from planner import ClusterSpec, PlanningError
from planner.specs import tokens_per_step

log = logging.getLogger("hetspot.controller")


class Switching(ControllerParts):
    @property
    def _timeline(self) -> SwitchTimeline:
        return self.switch.timeline if self.switch.timeline is not None else self._missing("drain is in progress")

    @property
    def _staged(self) -> Staged | None:  # a notice's pre-staged switch, while training on or draining
        return self._state.staged if isinstance(self._state, (Training, Draining)) else None

    @property
    def _join(self) -> Joining | None:  # a join's chosen move, while training on
        return self._state.join if isinstance(self._state, Training) else None

    @property
    def join_pending(self) -> bool:
        """A move onto joined nodes is chosen and waits, at step boundaries, for their warm workers."""
        return self._join is not None

    def _remember(self, cluster: ClusterSpec) -> None:
        """The nodes, and each one's GPUs free to the job, that the running plan was chosen among."""
        self.switch.known_nodes = {n.name for n in cluster.nodes}
        self.switch.known_gpus = {n.name: n.num_gpus for n in cluster.nodes}

    def _mark(self, point: str) -> None:
        """A point of the current drain's or move's timeline (control/timeline.SwitchTimeline)."""
        open_ = self.switch.timeline
        if open_ is not None and open_.mark(point, lambda: self.clock.now() - self.started_at):
            self.switch.timeline = None  # the new plan's first step: the switch is over

    def _scale_up(self, st: Training, weigh: bool = True) -> bool:
        """Nodes joined: their GPUs get warm workers at once (processes, imports, device context; looked for at
        every step boundary), whatever the choice, while training goes on; the move is weighed every
        scale_check_every steps (`weigh`) and happens at a step boundary only when the new plan finishes sooner,
        migration included, and only once those workers are ready, so the switch is one re-form and starts no
        process (a notice's pre-staged switch does the same). True: switch now."""
        if weigh and self.capacity is not None:  # substitutes for types that stay dry while the job runs
            self._substitutions(self.capacity, self.capacity.tick())
        cluster = self.nodes.discover().without_nodes(self.doomed)
        if self.queue is not None:
            cluster = self._within_share(self._not_queued_for(cluster), weigh)
        known, joined = joined_nodes(self.switch.known_nodes, cluster)
        self.switch.warmed &= known  # a node that left and comes back is warmed again
        fresh = (known - (self.switch.known_nodes or known)) - self.switch.warmed
        if fresh:  # warm at the join, before any decision: a move, or the next recovery, finds them started
            self.switch.warmed |= fresh
            started = self.workers.warm_joined(cluster, fresh)
            if started:
                self._event("warm-at-join", f"nodes joined ({', '.join(sorted(fresh))}): {started} warm worker(s) "
                            "starting", nodes=sorted(fresh), new_workers=started)
        if st.join is not None:  # a move chosen earlier: it goes once its warm workers are ready
            if set(st.join.plan.nodes()) <= known:
                return self._join_ready(st)
            self._join_dropped("a node it needs left before the switch")  # weighed afresh below
        if not weigh:
            return False
        freed = self._freed(cluster)
        what = "; ".join([f"nodes joined ({joined})"] * bool(joined) + [
            "GPUs freed (" + ", ".join(f"{n}: +{k}" for n, k in sorted(freed.items())) + ")"] * bool(freed))
        if st.staged is not None or (what and self.progress.committed < self._plan_from + 1):
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
        self.switch.timeline = SwitchTimeline(self.progress.events[-1])  # switch, resumed, first step, stall
        self.switch.timeline.put("new_workers", self.workers.prestage(new))  # ranks on GPUs no warm worker waits on
        st.join = Joining(new, cluster)
        return self._join_ready(st)

    def _freed(self, cluster: ClusterSpec) -> dict[str, int]:
        """Known nodes with more GPUs free to the job than when the plan was chosen (another job ended or shrank),
        and how many more."""
        return {n.name: n.num_gpus - self.switch.known_gpus[n.name] for n in cluster.nodes
                if n.name in self.switch.known_gpus and n.num_gpus > self.switch.known_gpus[n.name]}

    def _join_ready(self, st: Training) -> bool:
        """A join's move goes at the first step boundary its warm workers are ready at (training goes on meanwhile):
        the committed step stays on its nodes, the group is released and the new plan launches."""
        join = st.join
        if join is None or not self.workers.staged_ready():
            return False
        self.plan, self.cluster = join.plan, join.cluster
        st.join = None
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

    def _heed(self, st: Training, notices: list) -> bool | None:
        """Start a drain for notices on the plan's nodes when the deadline leaves time (drain.notice_decision):
        True: drain now; False: not now (staged, or too close: recovery when the node goes); None: no notice."""
        notices = [n for n in notices if n.node not in self.doomed]  # a source may repeat a notice it gave (a
        # Ray drain is reported at every poll while the node drains); a staged drain already heeds it
        now, used = self.clock.now(), set(self.running_plan.nodes())
        copy_s = lambda doomed: drain_copy_s(self.running_plan, self.model, self.train,  # noqa: E731
                                             self.cluster or self.nodes.discover(), self.doomed | doomed)
        got = notice_decision(notices, used, now, self.policy.drain_margin_s, copy_s)
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
        event = self.progress.events[-1]
        self.switch.timeline = SwitchTimeline(event, deadline_s=event["deadline_s"])
        self.switch.by = now + left - self.policy.drain_margin_s - copy_s(self.doomed)
        return self._stage(st)

    def _stage(self, st: Training) -> bool:
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
                                         self.policy.replan_tolerance)
        except PlanningError:
            return True
        started = self.workers.prestage(plan)
        self.store.prepare_drain(self.workers, self.doomed)
        st.staged = Staged(plan, cluster, choice)
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
        return self.clock.now() + 2 * step_s >= self.switch.by

    def _join_dropped(self, why: str) -> None:
        """A join's move still waiting for its warm workers gives way (to a failure's re-plan or a notice's drain,
        which plan afresh on what is there); its event says so and keeps no step of its own."""
        if self._join is None:
            return
        expect(self._state, Training).join = None
        if self.switch.timeline is not None and self.switch.timeline.kind == "scale-up":
            self.switch.timeline.end(why)
            self.switch.timeline = None

    def _drain(self, st: Draining) -> Phase:
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
        staged = st.staged
        if staged is None:
            return State.DISCOVERING
        self.plan, self.cluster = staged.plan, staged.cluster
        self._remember(self.cluster)
        if staged.choice:
            self._timeline.event["plan_choice"] = staged.choice
        self._mark("plan_s")
        return State.LAUNCHING

    def _end_drain(self, why: str) -> None:
        """A drain still open when the job ends (a staged switch the job finished before) keeps every key of its
        timeline's end: no step ran on its plan (`first_step_s` None), and `ended` says why."""
        if self.switch.timeline is not None:
            self.switch.timeline.end(why)
            self.switch.timeline = None
