"""Several jobs on one cluster, from one job's side: its place in the cluster's queue (`JobQueue`: by priority,
then first come first served), what it waits for and who holds it, the requests it makes of running jobs of lower
priority (or, where jobs share the fleet by weighted throughput, of the jobs whose GPUs that share gives it:
control/share.py), and how it answers theirs: GPUs given back at a step boundary through the drain path, warm
workers ended, or the whole job suspended to wait its turn again. `Queueing` is the controller's part for it
(control/controller.Controller inherits it); what it keeps is one record, `Controller.place`
(control/parts.QueuePlace); at step boundaries and launches the controller calls into it only where the job has
a queue. Pure: no Ray, no boto3, no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from orchestrator.control.parts import ControllerParts
from orchestrator.control.protocols import JobCard, JobQueue, Notice, YieldRequest
from orchestrator.control.share import Share
from orchestrator.control.states import Phase, Queued, State, Suspension, present
from orchestrator.errors import CheckpointError, WorkerFailure
from planner import ClusterSpec, PlanningError

log = logging.getLogger("hetspot.controller")
QUEUE_POLL_S = 2.0  # a queued job looks at the cluster's free GPUs and its place in line this often
YIELD_S = 120.0  # a job asked for GPUs by a higher-priority one gives them back through a drain with this deadline


class Queueing(ControllerParts):
    """The queue's part of the controller (its attributes: control/parts.ControllerParts)."""

    def _not_queued_for(self, cluster: ClusterSpec) -> ClusterSpec:
        """`cluster` less the GPUs that came free to the job since its plan was chosen (a node that joined, or that
        another job left or shrank on) while jobs wait in the cluster's queue: those are theirs first, so the job
        neither warms workers on them nor grows into them. A node another job leaves is new to this job (it had
        none of its GPUs free), so it reads as joined: without this a waiting job could plan on GPUs that warm
        workers of a running job take a moment later."""
        known = self.switch.known_gpus
        if self.queue is None or self.switch.known_nodes is None:
            return cluster
        new = [n for n in cluster.nodes if n.name not in known or n.num_gpus > known[n.name]]
        if not new or not self.queue.ahead():
            return cluster
        kept = [n.model_copy(update={"num_gpus": min(n.num_gpus, known[n.name])}) for n in cluster.nodes
                if n.name in known]
        return cluster.model_copy(update={"nodes": kept})

    def _held_changed(self, held: dict[str, dict[str, int]]) -> None:
        self.place.held = held
        if held:
            self._event("held", f"GPUs held by other jobs, left out of the plan: {holders(held)}", held=held)

    def _none_free(self, held: dict[str, dict[str, int]]) -> Phase:
        """No GPU of the cluster is free to the job: it waits in the queue where others hold them, else fails."""
        if held and self.queue is not None:
            return self._enqueue("a free GPU")
        return self._fail("no GPU of the cluster is free to this job" + (
            f": {holders(held)} hold them; submit it again when they end" if held else ""))

    def _no_plan(self, e: PlanningError) -> Phase:
        """No plan fits on the GPUs free to the job: it waits in the queue where others hold GPUs, else fails."""
        gpus = self.running_cluster.num_gpus
        if self.nodes.held and self.queue is not None:  # the GPUs others hold may make one fit
            return self._enqueue(f"more GPUs than the {gpus} free ({e})")
        return self._fail(f"no plan on the {gpus} GPUs left: {e}")

    def _enqueue(self, wants: str, on: tuple | None = None) -> Queued:
        """No plan fits on what is free while other jobs hold GPUs: wait in the cluster's queue (its place kept
        when the job was already in it). It plans again when what is free differs from `on` (by default what no
        plan fitted on now)."""
        if on is None:
            on = free_rows(self.cluster) if wants != "a free GPU" else ()
        if self.place.queued_at is None:
            self.place.queued_at = self.clock.now()
            self._line().enter()
            ahead = self._line().ahead()
            self._event("queued", f"waiting for {wants}: {holders(self.nodes.held)} hold the rest",
                        held=self.nodes.held, ahead=ahead, position=len(ahead) + 1)
        return Queued(wants, on)

    def _queued(self, st: Queued) -> Phase:
        """One look, as the queue's first job, at what is free (then on to planning), else wait a poll."""
        now = self.clock.now()
        waited = now - (now if self.place.queued_at is None else self.place.queued_at)
        held = self.nodes.held
        if waited > self.policy.queue_timeout_s and self.place.suspended is None:  # a suspended job was pushed out, not
            # refused: its step is kept and it resumes whenever GPUs come back, however long that takes
            return self._fail(f"queued for {waited:.0f} s waiting for {st.wants}, held by "
                              f"{holders(held) or 'other jobs'}: raise runtime.queue_timeout_s "
                              f"({self.policy.queue_timeout_s:.0f} s) to wait longer, or submit the job when they end",
                              exit_code=2)
        self._line().enter()  # its entry shown alive, its place kept
        ahead = self._line().ahead()
        if not ahead:
            found = self.nodes.discover()
            if found.nodes and free_rows(found.without_nodes(self.doomed)) != st.on:
                self.cluster = found.without_nodes(self.doomed)
                self._remember(self.cluster)
                return State.PLANNING
            held = self.nodes.held
            self._ask(found, held)
        self._phase(f"queued ({len(ahead) + 1} in line{', after ' + ', '.join(ahead) if ahead else ''}): waiting "
                    f"for {st.wants}; held by {holders(held) or 'other jobs'}")  # (a new phase line only when
        # the line or the holders change)
        self.sleep(QUEUE_POLL_S)
        return st

    def _ask(self, free: ClusterSpec, held: dict[str, dict[str, int]]) -> None:
        """The first job in line asks running jobs of lower priority for GPUs (once for each set of holders): the
        fewest nodes' worth, lowest priority first and then the most GPUs, that together with what is free make a
        plan fit. Each asked job gives them back at its next step boundary (`_asked`)."""
        line = self._line()
        if held == self.place.asked_on:
            return
        self.place.asked_on = held
        if self._ask_by_share(held):
            return
        prio = line.priorities()
        lower = sorted((prio[job], -n, node, job) for node, by in held.items() for job, n in by.items()
                       if job in prio and prio[job] < line.priority and node not in self.doomed)
        if not lower:
            return
        whole = self.nodes.whole()
        specs = {n.name: n for n in whole.nodes}
        gpus = {n.name: n.num_gpus for n in free.without_nodes(self.doomed).nodes}
        asks: dict[str, list[str]] = {}
        for _, minus, node, job in lower:
            if node not in specs:
                continue
            gpus[node] = gpus.get(node, 0) - minus
            asks.setdefault(job, []).append(node)
            grown = whole.model_copy(update={"nodes": [
                specs[n].model_copy(update={"num_gpus": min(k, specs[n].num_gpus)})
                for n, k in sorted(gpus.items()) if k > 0 and n in specs]})
            try:
                self.planner.plan(grown)
                break
            except PlanningError:
                continue
        else:
            log.info("no GPUs of lower-priority jobs make a plan fit: waiting")
            return
        for job, nodes in sorted(asks.items()):
            line.ask(job, nodes)
        self._event("asked", f"priority {line.priority}: asked " + "; ".join(
            f"{job} for its GPUs on {', '.join(nodes)}" for job, nodes in sorted(asks.items())), asked=asks)

    def _reading(self, mine: Iterable[str], cards: dict[str, JobCard] | None = None) -> Share | None:
        """The fleet's weighted share as this job reads it now, holding the nodes `mine` (None where the job does
        not share the fleet that way: runtime.fleet_share); `cards`: the board's, where just read."""
        line = self._line()
        if line.card is None:
            return None
        cards = (line.sharing() if cards is None else cards) | {line.job: line.card}
        return self.place.share.decide(cards, self.nodes.whole(), self.nodes.held, line.job, mine, self.doomed)

    def _ask_by_share(self, held: dict[str, dict[str, int]]) -> bool:
        """The first job in line, sharing the fleet by weight: it asks each job that holds GPUs on the nodes the
        share gives it for those, whatever their priorities (False: the share gives it none that others hold)."""
        got = self._reading(())
        return got is not None and self._ask_holders(got, held)

    def _within_share(self, cluster: ClusterSpec, weigh: bool) -> ClusterSpec:
        """A running job that shares the fleet by weight, beside other jobs that do: of what is free to it, the
        nodes its share gives it and its plan's, so that it neither warms workers on nor grows into the rest (a
        choice, not a race). The share is read at a scale check (`weigh`; between them the last reading holds: no
        look at the queue's board at every step), and then, once for each set of holders, it asks the jobs that
        hold nodes its share gives it for them, and grows into them once they are given back."""
        line = self.queue
        if line is None or line.card is None:
            return cluster
        plan = set(self.running_plan.nodes())
        if weigh or not self.place.share_read:
            self.place.share_read, self.place.share_keep = True, None
            cards = line.sharing()
            if set(cards) - {line.job}:  # (alone, it shares with nobody: what is free is its own)
                got = self._reading(plan, cards) or {}
                self.place.share_keep = got.get(line.job, frozenset())
                held = self.nodes.held
                if weigh and held != self.place.share_asked_on:
                    self.place.share_asked_on = held
                    self._ask_holders(got, held)
        if self.place.share_keep is None:
            return cluster
        keep = self.place.share_keep | plan
        return cluster.model_copy(update={"nodes": [n for n in cluster.nodes if n.name in keep]})

    def _ask_holders(self, got: Share, held: dict[str, dict[str, int]]) -> bool:
        """Ask each job that holds GPUs on nodes the share `got` gives this job for them (False: none to ask)."""
        line, mine = self._line(), got.get(self._line().job, frozenset())
        asks: dict[str, list[str]] = {}
        for node in sorted(mine):
            for job in held.get(node, {}):
                asks.setdefault(job, []).append(node)
        if not asks:
            return False
        for job, nodes in sorted(asks.items()):
            line.ask(job, nodes, share=True)
        self._event("asked", f"the fleet's weighted share gives this job {', '.join(sorted(mine))}: asked " + "; ".join(
            f"{job} for its GPUs on {', '.join(nodes)}" for job, nodes in sorted(asks.items())), asked=asks,
            share={job: sorted(nodes) for job, nodes in got.items()})
        return True

    def _share_gives(self, req: YieldRequest) -> tuple[list[str], str | None]:
        """A request by the share: the asked nodes of this job's plan that its own reading of the share does not
        keep here, or why none go."""
        if self._line().card is None:
            return [], "this job does not share the fleet by weight (runtime.fleet_share: first-come)"
        self.nodes.discover()  # who holds what now
        plan = set(self.running_plan.nodes())
        got = self._reading(plan)
        keep = got.get(self._line().job, frozenset()) if got is not None else frozenset()
        nodes = sorted(set(req.nodes) & plan - self.doomed - keep)
        spare = self._give_spare(req, set(req.nodes) - plan - keep)
        # "" where only processes off the plan went: nothing to decline
        return nodes, None if nodes else "" if spare else "the fleet's weighted share keeps them with this job"

    def _asked(self) -> list[Notice] | Suspension:
        """A waiting job of higher priority asks for this job's GPUs on some nodes (read at each step boundary), or
        a job asks by the fleet's weighted share (then what goes is what this job's own reading does not keep:
        `_share_gives`). When a plan trains on what is left, they go back through the drain path, as under a spot
        notice with YIELD_S to go (no step lost; survivors stay in place); else the job suspends (`_suspend`, with
        the `Suspension` returned). A request by priority from a job whose priority is not higher is declined."""
        if self.queue is None:
            return []
        req = self.queue.asked()
        if req is None:
            return []
        if req.share:
            nodes, why = self._share_gives(req)
        else:
            nodes = sorted(set(req.nodes) & set(self.running_plan.nodes()) - self.doomed)
            higher = req.priority > self.queue.priority
            if higher and self._give_spare(req, set(req.nodes) - set(nodes)) and not nodes:
                return []
            why = None if higher and nodes else "none of them are the plan's" if not nodes else \
                f"its priority is not above this job's ({self.queue.priority})"
        if why == "":  # nothing of the plan's asked: what it held there besides ended
            return []
        if why is not None:
            self._event("yield-declined", f"{req.by} (priority {req.priority}) asked for the GPUs on "
                        f"{', '.join(req.nodes)}: {why}", by=req.by, nodes=req.nodes, share=req.share)
            return []
        keep = set(self.running_plan.nodes()) - self.doomed - set(nodes)  # what it holds, less what is asked (the
        # nodes its plan was chosen among but does not use may be another job's by now)
        rest = self.running_cluster.model_copy(update={"nodes": [n for n in self.running_cluster.nodes
                                                                 if n.name in keep]})
        try:
            if not rest.nodes:
                raise PlanningError("no GPU would be left")
            self.planner.plan(rest)
        except PlanningError as e:
            return Suspension(req, nodes, str(e))
        self.place.yielded |= set(nodes)
        how = " by the fleet's weighted share" if req.share else ""
        self._event("yield", f"{req.by} (priority {req.priority}) asked{how} for the GPUs on {', '.join(nodes)}: "
                    "giving them back at a step boundary, training on the rest", by=req.by, nodes=nodes,
                    share=req.share)
        now = self.clock.now()
        return [Notice(n, now + YIELD_S, f"yield to {req.by}") for n in nodes]

    def _give_spare(self, req: YieldRequest, spare: set[str]) -> int:
        """Asked nodes the plan does not use whose GPUs this job holds with warm workers (a join's, or standing
        ones) or with kept processes no rank took (a recovery's, until every rank has committed a step): those
        end, and a join's move still waiting for them gives way; a pre-staged switch's stay (it goes at its
        notice's deadline). How many ended."""
        staged = set(self._staged.plan.nodes()) if self._staged is not None else set()
        spare = spare - staged - self.doomed
        if not spare:
            return 0
        if self._join is not None and spare & set(self._join.plan.nodes()):
            self._join_dropped(f"{req.by} (priority {req.priority}) asked for the GPUs on {', '.join(sorted(spare))}")
        ended = self.workers.give_up(spare)
        if ended:
            self._event("yield-warm", f"{req.by} (priority {req.priority}) asked for the GPUs on "
                        f"{', '.join(sorted(spare))}: {ended} warm worker(s) or kept process(es) there ended, their "
                        "GPUs given back", by=req.by, nodes=sorted(spare), warm=ended)
        return ended

    def _suspend(self, asked: Suspension) -> Phase:
        """Asked for GPUs without which no plan trains: the committed step is kept where no GPU is needed (S3 where
        the run has a bucket), every worker goes, and the job waits in the queue to resume from that step."""
        req, nodes, why = asked.request, asked.nodes, asked.why
        step = self.progress.committed
        self._phase(f"suspending: {req.by} (priority {req.priority}) takes the GPUs on {', '.join(nodes)}")
        try:
            where = self.store.suspend(self.workers, step) if step >= 0 else "nothing to keep"
        except WorkerFailure as e:  # a worker went while its state was kept: recovery, as after any loss
            return self._decide(e)
        except CheckpointError as e:  # nowhere to keep the step: training on is better than losing it
            self._event("suspend-declined", f"could not keep step {step} to give the GPUs back: {e}", by=req.by)
            return self._state
        self.workers.shutdown()
        self.group = None
        self._end_drain("the job was suspended")
        self._event("suspend", f"{req.by} (priority {req.priority}) asked for the GPUs on {', '.join(nodes)} and "
                    f"what would be left trains no plan ({why}): step {step} kept in {where}; waiting to resume",
                    by=req.by, nodes=nodes, step=step, kept=where)
        self.place.suspended = req.by
        return self._enqueue(f"GPUs to resume on ({req.by} took them)", on=())  # any GPUs free to it once it is
        # first in line: plan again

    def _line(self) -> JobQueue:
        return present(self.queue, "queue", self.state)

    def _dequeue(self) -> None:
        """The job's workers hold the GPUs of its plan: it leaves the queue (its event says how long it waited), its
        priority still shown to the jobs that wait. It keeps its place from planning until then, so that no running
        job grows into the GPUs it planned on."""
        if self.queue is None:
            return
        self.queue.hold()
        self.place.suspended = None
        if self.place.queued_at is None:
            return
        self._event("dequeued", f"started on {len(self.running_plan.devices())} GPUs after "
                    f"{self.clock.now() - self.place.queued_at:.1f} s in the queue")
        self.place.queued_at = None


def free_rows(cluster: ClusterSpec | None) -> tuple:
    """A cluster's GPUs as (node, type, count) rows, to tell whether what is free changed."""
    return tuple(sorted((n.name, n.gpu_type, n.num_gpus) for n in cluster.nodes)) if cluster is not None else ()


def holders(held: dict[str, dict[str, int]]) -> str:
    """"l4-a: 2 GPUs (hetspot-b-1a2b3c4d); ..." for a person."""
    return "; ".join(f"{node}: " + ", ".join(f"{c} GPU{'s' if c > 1 else ''} ({who})" for who, c in by.items())
                     for node, by in sorted(held.items()))
