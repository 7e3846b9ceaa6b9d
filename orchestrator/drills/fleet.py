"""Goodput of a training job over a spot trace at fleet scale, without Ray (pure: planner and cost model).

The trace's nodes map onto the fleet's (orchestrator/drills/trace.py `fleet_slots`).
At every event four strategies act on the same cluster, and between events each
trains at its plan's predicted tokens/s (planner.evaluate):

- `hetspot`: on a preemption that hits its plan, re-plan among the planner's top
  candidates with the migration-aware policy (orchestrator/control/replan.py); the
  recovery costs detection + start-up + the restore (the bytes each new stage
  pulls, by tier, over that tier's bandwidth: live from its own node, peer from
  a surviving holder, S3 only for layers no survivor or peer copy holds; the
  weights before the first step, AdamW's moments beside it: migration.held_s) + the
  work since the newest step every layer is held at (the step in flight; a peer
  snapshot interval when a layer's only copies were peers; an S3 interval when
  S3 is needed). On a join it moves only when that finishes the trace's
  remaining work sooner (`consider_joined`).
  In place, a joined node's GPUs get worker processes at the join (warm-at-join): a move onto it goes
  `startup_s` later, the old plan training meanwhile, and stalls only the re-form and the restore; a later
  recovery onto a warm node pays what is left of its start, not a new one (`Assumptions.warm_at_join`).
- `oracle`: at every event, for free, the faster of the planner's best plan and the running plan where its
  nodes survived (the planner's search is not exact on large fleets, so its best is not always the bound).
- `oracle-startup`: the same, but it pays what no system can avoid: the start-up at the beginning, and a
  joined node only counts `startup_s` after it joins (then the oracle re-plans again, for free).
- `s3-only`: checkpoint-restart as Ray Train and SkyPilot run it: a checkpoint
  to S3 every `ckpt_every_s` (training waits for the write), and on a
  preemption that hits the plan, detection + start-up + every node reading its
  state from S3 + the work since the last checkpoint; joins are used at the next
  restart only. It plans with hetspot's planner, so the difference is recovery.
- `symmetric`: the Megatron-style symmetric plan (planner/baselines.py), with
  hetspot's recovery, so the difference is planning.

Detection and start-up default to bench/recovery.py's medians on the test
cluster; every assumption is returned with the result and printed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from orchestrator.control.drain import drain_copy_s
from orchestrator.control.replan import choose_replan, consider_joined
from orchestrator.drills.recovery_model import (
    Assumptions,
    gpus_by_node,
    nodes_of,
    relaunch_s,
    restore_cost,
    staged_start_s,
    state_io_s,
)
from orchestrator.drills.trace import Trace, fleet_slots
from planner import ClusterSpec, Plan, PlanningError, evaluate
from planner.baselines import megatron_symmetric
from planner.search import Planner
from planner.specs import ModelSpec, TrainSpec, tokens_per_step

STRATEGIES = ("hetspot", "oracle", "oracle-startup", "s3-only", "symmetric")
DRAIN_MARGIN_S = 1.0  # the controller's drain margin (Controller.drain_margin_s)


@dataclass
class Run:
    name: str
    plan: Plan | None = None
    tokens: float = 0.0
    useful_s: float = 0.0
    down_s: float = 0.0  # recovering, restarting or writing checkpoints
    lost_s: float = 0.0  # training redone
    recoveries: int = 0
    busy_until: float = 0.0  # no training before this (a recovery in progress)
    last_ckpt: float = 0.0
    pending: bool = False  # s3-only: joined nodes wait for the next restart
    warm: dict[str, float] = field(default_factory=dict)  # hetspot: joined nodes' warm workers, ready at
    switch: tuple[float, Plan | None, float] | None = None  # (at, plan, stall) a move waiting for its workers;
    # the oracle-startup's plan None: re-plan on the nodes ready then
    timeline: list[tuple[float, float, float]] = field(default_factory=list)  # (t, tokens/s, tokens so far)

    @property
    def tps(self) -> float:
        return self.plan.estimate.tokens_per_s if self.plan is not None else 0.0


class FleetSim:
    def __init__(self, trace: Trace, fleet: ClusterSpec, model: ModelSpec, train: TrainSpec,
                 assumptions: Assumptions | None = None):
        self.trace, self.fleet, self.model, self.train = trace, fleet, model, train
        self.a = assumptions or Assumptions()
        self.planner = Planner(model, train)
        self._cands: dict[tuple, list[Plan] | PlanningError] = {}
        self._sym: dict[frozenset, Plan | None] = {}
        self._layout: Plan | None | bool = None
        self._now: ClusterSpec | None = None  # the cluster after the latest event
        self._joined_at: dict[str, float] = {}  # when each node joined (-inf: with the first nodes)
        self._end, self._tok = 0.0, 0  # the trace's end and the tokens of a step (set by `run`)

    def _cluster(self, up_slots: set[int]) -> ClusterSpec | None:
        n0 = max(1, self.trace.first_nodes)
        nodes = [n for j, n in enumerate(self.fleet.nodes) if j % n0 in up_slots]
        return self.fleet.model_copy(update={"nodes": nodes}) if nodes else None

    def candidates(self, cluster: ClusterSpec, objective: str = "throughput", k: int = 4) -> list[Plan]:
        """The planner's top plans for these nodes, searched once per node set: the oracle, s3-only and
        hetspot's re-plan and join policies (handed this object as their planner) share one search."""
        key = (frozenset(n.name for n in cluster.nodes), objective, k)
        if key not in self._cands:
            try:
                self._cands[key] = self.planner.candidates(cluster, objective, k)
            except PlanningError as e:
                self._cands[key] = e
        got = self._cands[key]
        if isinstance(got, PlanningError):
            raise got
        return got

    def _best(self, cluster: ClusterSpec) -> Plan | None:
        try:
            return self.candidates(cluster)[0]
        except PlanningError:
            return None

    def symmetric(self, cluster: ClusterSpec) -> Plan | None:
        """The fleet's Megatron-style layout, elastic in data parallelism only: the replicas whose nodes are all
        up, the global batch split evenly over them (None: no replica whole)."""
        if self._layout is None:
            self._layout = megatron_symmetric(self.fleet, self.model, self.train) or False
        if not self._layout:
            return None
        key = frozenset(n.name for n in cluster.nodes)
        if key not in self._sym:
            whole = [p for p in self._layout.pipelines if all(st.node in key for st in p.stages)]
            self._sym[key] = None
            if whole and len(whole) <= self.train.global_batch:
                q, r = divmod(self.train.global_batch, len(whole))
                pipes = []
                for i, p in enumerate(whole):
                    n = q + (i < r)
                    b = min(p.micro_batch_size, n)
                    pipes.append(p.model_copy(update={"num_samples": n, "micro_batch_size": b,
                                                      "num_micro_batches": -(-n // b)}))
                plan = self._layout.model_copy(update={"pipelines": pipes, "unused": []})
                try:
                    plan.estimate = evaluate(plan, cluster, self.model, self.train)
                    self._sym[key] = plan
                except (PlanningError, ValueError):
                    pass  # the larger per-replica batch does not fit: no symmetric plan on these nodes
        return self._sym[key]

    def run(self) -> dict:
        t_start = time.perf_counter()
        changes = fleet_slots(self.trace)
        end = max(self.trace.end_s, changes[-1][0] if changes else 0.0)
        runs = {name: Run(name) for name in STRATEGIES}
        self._end, self._tok = end, tokens_per_step(self.model, self.train.global_batch)
        up: set[int] = set()
        now = 0.0
        tok = self._tok
        for t, kind, slots in changes:
            for r in runs.values():
                self._advance(r, now, t)
            now = t
            gone_slots = slots if kind == "remove" else set()
            up = up - slots if kind == "remove" else up | slots
            cluster = self._cluster(up)
            gone = {n.name for j, n in enumerate(self.fleet.nodes) if j % max(1, self.trace.first_nodes) in gone_slots}
            names = {n.name for n in cluster.nodes} if cluster is not None else set()
            first = t == changes[0][0]  # the first nodes' start-up is every strategy's start
            self._joined_at = {n: self._joined_at.get(n, -float("inf") if first else t) for n in names}
            self._now = cluster
            left_s = max(0.0, end - t)
            for r in runs.values():
                r.timeline.append((t, r.tps if r.busy_until <= t else 0.0, r.tokens))  # before: lost work shows
                self._act(r, t, kind, cluster, gone, left_s, tok)
                r.timeline.append((t, r.tps if r.busy_until <= t else 0.0, r.tokens))
        for r in runs.values():
            self._advance(r, now, end)
            r.timeline.append((end, r.tps, r.tokens))
        hours = end / 3600
        return {
            "hours": hours, "events": len(changes), "sim_s": time.perf_counter() - t_start,
            "event_times": [(t, k) for t, k, _ in changes[1:]],
            "assumptions": self.a.as_dict(),
            "strategies": {r.name: {"tokens": r.tokens, "goodput": r.useful_s / end if end else 0.0,
                                    "recoveries": r.recoveries, "down_s": r.down_s, "lost_s": r.lost_s,
                                    "final_tokens_per_s": r.tps, "timeline": r.timeline} for r in runs.values()},
        }

    def _advance(self, r: Run, t0: float, t1: float) -> None:
        """Train from t0 to t1 at the plan's rate, after any recovery; s3-only writes its checkpoints. A switch
        waiting for its workers (`Run.switch`) goes when they are ready, if that is before t1."""
        while r.switch is not None and r.switch[0] < t1:
            at, plan, stall = r.switch
            r.switch = None
            at = max(t0, at)
            self._train(r, t0, at)
            t0 = at
            if plan is None:  # the oracle-startup: joined nodes are ready now
                self._oracle_startup(r, at)
            else:  # hetspot: the warm workers are ready; the re-form and the restore stall training
                self._charge(r, at, 0.0, stall, plan)
                r.warm = {n: w for n, w in r.warm.items() if n not in nodes_of(plan)}  # they are ranks now
                if self._now is not None and r.warm:  # nodes that joined while it waited are weighed next
                    self._join(r, at, self._now, max(0.0, self._end - at), self._tok)
            r.timeline.append((at, r.tps if r.busy_until <= at else 0.0, r.tokens))
        self._train(r, t0, t1)

    def _train(self, r: Run, t0: float, t1: float) -> None:
        if r.plan is None:
            return
        start = max(t0, r.busy_until)
        if start >= t1:
            return
        if start > t0:  # a recovery ended between events: training resumes here
            r.timeline.append((start, r.tps, r.tokens))
        span = t1 - start
        if r.name == "s3-only":
            write = state_io_s(r.plan, self.model, self.train, self.a)
            n = int((t1 - r.last_ckpt) // self.a.ckpt_every_s)
            if n:
                r.last_ckpt += n * self.a.ckpt_every_s
                span = max(0.0, span - n * write)
                r.down_s += n * write
        r.useful_s += span
        r.tokens += span * r.tps

    def _act(self, r: Run, now: float, kind: str, cluster: ClusterSpec | None, gone: set[str], left_s: float,
             tok: int) -> None:
        if cluster is None:
            r.plan = None
            return
        if r.plan is None:  # the first add: start
            r.plan = self._first(r, cluster)
            start = self.a.startup_s if r.name != "oracle" else 0.0
            r.busy_until = now + start  # after an empty fleet too, not only at the trace's beginning
            r.down_s += start
            return
        if r.name == "oracle":  # the faster of the planner's best and the running plan where it survived, free
            best, alive = self._best(cluster), {n.name for n in cluster.nodes}
            keep = r.plan if nodes_of(r.plan) <= alive else None
            r.plan = max((p for p in (best, keep) if p is not None), key=lambda p: p.estimate.tokens_per_s,
                         default=None)
            return
        if r.name == "oracle-startup":
            self._oracle_startup(r, now)
            return
        if r.name == "hetspot" and self._warms():
            r.warm = {n: w for n, w in r.warm.items() if n not in gone}
            if kind == "add":
                joined = {n for n, at in self._joined_at.items() if at == now and n not in nodes_of(r.plan)}
                r.warm |= {n: now + self.a.startup_s for n in joined}
            if r.switch is not None and r.switch[1] is not None and gone & nodes_of(r.switch[1]):
                r.switch = None  # the move waited for a node that went: the re-plan below decides afresh
        if kind == "add":
            self._join(r, now, cluster, left_s, tok)
            return
        if not gone & nodes_of(r.plan):
            return  # the plan's nodes all survived
        r.switch = None  # a failure re-plans from what is left (the controller drops a waiting move)
        old = r.plan
        if r.name == "s3-only":
            new = self._best(cluster)
            if new is None:
                r.plan = None
                return
            cost = self.a.detect_s + self.a.startup_s + state_io_s(new, self.model, self.train, self.a)
            self._charge(r, now, max(0.0, now - r.last_ckpt), cost, new)
            r.last_ckpt = r.busy_until  # the restart's state is the checkpoint's
            return
        if r.name == "symmetric":
            new = self.symmetric(cluster)
        else:
            steps_left = int(left_s * old.estimate.tokens_per_s / tok)
            try:
                new, _ = choose_replan(self, self.model, self.train, old, cluster, steps_left,
                                       relaunch_s(old, old, gone, self.a) if r.name == "hetspot" else self.a.startup_s)
            except PlanningError:
                new = None
        if new is None:
            r.plan = None
            return
        # A spot notice arrives at a random point of the step in flight; the controller sees it at the next
        # boundary and drains when the time left covers copying the step to keepers off the doomed nodes
        # (drain.notice_decision; no copy when other replicas hold their layers): the share q of the step's
        # phases where that holds is charged a drain, the rest a failure. A drain redoes nothing and reads
        # nothing from S3.
        copy_s = drain_copy_s(old, self.model, self.train, self.fleet, gone)
        step = old.estimate.step_time_s
        q = min(1.0, max(0.0, (self.a.notice_s - DRAIN_MARGIN_S - copy_s) / step)) if self.a.notice_s > 0 else 0.0
        start_s = relaunch_s(old, new, gone, self.a, r.warm, now) if r.name == "hetspot" else self.a.startup_s
        staged = staged_start_s(start_s, self.a.notice_s - DRAIN_MARGIN_S - copy_s, self.a) \
            if r.name == "hetspot" else start_s  # in place, a notice's new processes start while training goes on
        drain_s = copy_s + staged + restore_cost(old, new, set(), cluster, self.model, self.train, self.a)[0]
        restore_s, redo_s, _ = restore_cost(old, new, gone, cluster, self.model, self.train, self.a)
        fail_s = self.a.detect_s + start_s + restore_s
        self._charge(r, now, (1 - q) * redo_s, q * drain_s + (1 - q) * fail_s, new)
        r.warm = {n: w for n, w in r.warm.items() if n not in nodes_of(new)}  # its warm workers are ranks now

    def _charge(self, r: Run, now: float, redo_s: float, down_s: float, new: Plan) -> None:
        """A recovery at `now`: `redo_s` of training at the old rate is lost, then `down_s` without training."""
        redo_s = min(redo_s, r.useful_s)
        r.tokens -= redo_s * r.tps
        r.useful_s -= redo_s
        r.lost_s += redo_s
        r.down_s += down_s
        r.busy_until = max(r.busy_until, now) + down_s
        r.recoveries += 1
        r.plan = new

    def _join(self, r: Run, now: float, cluster: ClusterSpec, left_s: float, tok: int) -> None:
        """hetspot: move when it finishes the rest sooner (consider_joined); symmetric: when its plan is faster
        and the move pays for itself; s3-only: at its next restart."""
        if r.name == "s3-only":
            return
        if r.name == "symmetric":
            new = self.symmetric(cluster)
            if new is None:
                return
            move_s = self.a.startup_s + restore_cost(r.plan, new, set(), cluster, self.model, self.train, self.a)[0]
            if left_s * r.tps < (left_s - move_s) * new.estimate.tokens_per_s:
                self._charge(r, now, 0.0, move_s, new)
            return
        steps_left = int(left_s * r.tps / tok)
        if self._warms():  # warm at join: the move waits for the joined GPUs' workers while the old plan trains
            if r.switch is not None:
                return  # a move already waits for its workers; the controller weighs joins after it
            got = consider_joined(self, self.model, self.train, r.plan, cluster, steps_left, self.a.reform_s)
            if got is not None and got[1].move:
                new = got[0]
                # the controller pre-stages the move (workers for every rank no process holds), so it goes when the
                # last of them is up: a joined node's when its warm workers are, any other's a start-up from now
                before, after = gpus_by_node(r.plan), gpus_by_node(new)
                at = max([r.warm.get(n, now + self.a.startup_s) for n, k in after.items() if k > before.get(n, 0)],
                         default=now)
                stall = self.a.reform_s + restore_cost(r.plan, new, set(), cluster, self.model, self.train, self.a)[0]
                r.switch = (at, new, stall)
            return
        got = consider_joined(self, self.model, self.train, r.plan, cluster, steps_left, self.a.startup_s)
        if got is not None and got[1].move:
            move_s = relaunch_s(r.plan, got[0], set(), self.a) + restore_cost(
                r.plan, got[0], set(), cluster, self.model, self.train, self.a)[0]
            self._charge(r, now, 0.0, move_s, got[0])

    def _warms(self) -> bool:
        return self.a.strategy.keeps_processes and self.a.warm_at_join

    def _oracle_startup(self, r: Run, now: float) -> None:
        """The oracle that pays joined nodes' start-up: the faster of the planner's best on the nodes whose
        workers are up (joined at least `startup_s` ago) and the running plan where it survived, free; it looks
        again when the next joined node is ready."""
        cluster = self._now
        if cluster is None:
            r.plan, r.switch = None, None
            return
        ready_at = {n.name: self._joined_at.get(n.name, 0.0) + self.a.startup_s for n in cluster.nodes}
        up = [n for n in cluster.nodes if ready_at[n.name] <= now + 1e-9]
        best = self._best(cluster.model_copy(update={"nodes": up})) if up else None
        keep = r.plan if r.plan is not None and nodes_of(r.plan) <= set(ready_at) else None
        r.plan = max((p for p in (best, keep) if p is not None), key=lambda p: p.estimate.tokens_per_s, default=None)
        later = [t for t in ready_at.values() if t > now + 1e-9]
        r.switch = (min(later), None, 0.0) if later else None

    def _first(self, r: Run, cluster: ClusterSpec) -> Plan | None:
        if r.name == "symmetric":
            return self.symmetric(cluster)
        return self._best(cluster)
