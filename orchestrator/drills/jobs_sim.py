"""Several jobs sharing one spot fleet, over a trace of their arrivals and of the fleet's preemptions (no Ray;
pure: the planner and its cost model give each job's tokens/s on each set of nodes).

Two policies replay the same arrivals and fleet changes:

- `fcfs`: first come, first served, as a queue of whole jobs runs (hetspot's queue without priorities): the
  first job in line starts when a plan fits on the free nodes and takes all of them (a hetspot job plans on
  every GPU free to it); a job that loses nodes trains on what it keeps, or goes back to its place in line
  where no plan fits; running jobs grow, in arrival order, into nodes that come free while no job waits.
- `share`: the fleet's share as a choice (control/share.py, the function the live controller's queue uses with
  `runtime.fleet_share: weighted`; after Gavel and Sia): at every arrival, end and fleet change the up nodes go
  to maximise the sum over the jobs present of weight x tokens/s on its nodes / tokens/s on the whole fleet,
  greedily: the increment (1, 2, 4, ... nodes of one type) with the best gain per node goes first, a job's own
  nodes before others'. A new share is taken only when it beats the share kept (less lost nodes) by
  `hysteresis`, so a small gain does not move jobs.

A job whose nodes change pays what hetspot's in-place path costs (recovery_model.Assumptions, measured): a
job that starts, or resumes after it had nothing, waits `startup_s`; one that gains nodes trains on its old
nodes while their workers start (`startup_s`, warm at the join), then stalls `reform_s`; one that only loses
nodes stalls `reform_s` (a yield, through the drain path), plus `detect_s` when the loss was a preemption.
Not modelled: restore bytes (the state of a yielding or resuming job comes from its peers or S3 at the link's
rate; its size is the job's, whatever the policy), and the work since the last step on a preemption.

The score: weighted goodput, the fleets' worth of work done per second, Sum_j w_j x tokens_j / tokens/s_j on the
whole fleet / the trace's length (and unweighted, w_j = 1); and each job's completion time. The weight of a job
is 1 + its priority. Maximising the weighted sum starves a job whose normalised throughput per node is lowest
while others wait (as Gavel's max-sum policy does): its wait shows in the table.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.control.share import Rates, share, weight
from orchestrator.drills.recovery_model import Assumptions
from orchestrator.drills.trace import Trace, fleet_slots, read_yaml
from orchestrator.errors import ConfigError
from planner import ClusterSpec
from planner.specs import PRESETS, ModelSpec, TrainSpec

POLICIES = ("fcfs", "share")


@dataclass(frozen=True)
class SimJob:
    name: str
    arrive_s: float
    model: ModelSpec
    train: TrainSpec
    tokens: float  # the work: tokens to train
    priority: int = 0

    @property
    def weight(self) -> float:
        return weight(self.priority)


def load_jobs(path: str | Path) -> list[SimJob]:
    """A jobs file: `jobs:` a list of {name, arrive_min, model (a preset), global_batch, tokens (billions),
    priority}; each field's error names it (ConfigError: exit 2)."""
    p, data = read_yaml(path, "jobs file", "examples/jobs/")
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list) or not data["jobs"]:
        raise ConfigError(f"{p}: field 'jobs': a list of jobs such as {{name: a, arrive_min: 0, model: 7b, "
                          "global_batch: 256, tokens: 2.0, priority: 0}}")
    out, names = [], set()
    for i, j in enumerate(data["jobs"]):
        where = f"{p}: field 'jobs.{i}"
        if not isinstance(j, dict):
            raise ConfigError(f"{where}': a mapping with name, arrive_min, model, global_batch, tokens")
        unknown = set(j) - {"name", "arrive_min", "model", "global_batch", "tokens", "priority"}
        if unknown:
            raise ConfigError(f"{where}': unknown field(s) {', '.join(sorted(unknown))}")
        name = j.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise ConfigError(f"{where}.name': a name of its own (got {name!r})")
        names.add(name)
        preset = j.get("model")
        if not isinstance(preset, str) or preset.lower() not in PRESETS:
            raise ConfigError(f"{where}.model': a model preset, one of {', '.join(PRESETS)} (got {preset!r})")
        nums = {}
        for key, lo, hi, default in (("arrive_min", 0, 10**6, None), ("global_batch", 1, 65536, None),
                                     ("tokens", 1e-6, 1e6, None), ("priority", 0, 100, 0)):
            v = j.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi or \
                    (key in ("global_batch", "priority") and not isinstance(v, int)):
                raise ConfigError(f"{where}.{key}': a {'whole ' if key in ('global_batch', 'priority') else ''}"
                                  f"number from {lo:g} to {hi:g} (got {v!r})")
            nums[key] = v
        out.append(SimJob(name, float(nums["arrive_min"]) * 60, ModelSpec.preset(preset),
                          TrainSpec(global_batch=nums["global_batch"]), float(nums["tokens"]) * 1e9,
                          nums["priority"]))
    return sorted(out, key=lambda x: (x.arrive_s, x.name))


@dataclass
class JobRun:
    job: SimJob
    nodes: frozenset = frozenset()
    rate: float = 0.0  # tokens/s now (after `busy_until`)
    busy_until: float = 0.0  # no training before (start-up, a re-form)
    next_rate: float | None = None  # a grown set's rate, from `switch_at` (old nodes train meanwhile)
    switch_at: float = math.inf
    done_tokens: float = 0.0
    finished_s: float | None = None
    changes: int = 0
    waited_s: float = 0.0
    started_s: float | None = None

    def advance(self, t0: float, t1: float, stall_s: float) -> None:
        if self.finished_s is not None:
            return
        if not self.nodes:
            self.waited_s += t1 - t0
        if self.switch_at <= t1:  # the grown set's workers are ready: the old nodes trained until then
            self.done_tokens += self.rate * max(0.0, self.switch_at - max(t0, self.busy_until))
            self.busy_until = max(self.busy_until, self.switch_at + stall_s)
            self.rate, self.next_rate, self.switch_at = self.next_rate or 0.0, None, math.inf
        self.done_tokens += self.rate * max(0.0, t1 - max(t0, self.busy_until))

    def left_s(self, now: float) -> float:
        """Seconds to the end at the current rate (inf: not training)."""
        rate = self.rate
        if rate <= 0:
            return math.inf
        return max(now, self.busy_until) - now + (self.job.tokens - self.done_tokens) / rate


@dataclass
class PolicyRun:
    name: str
    jobs: dict[str, JobRun] = field(default_factory=dict)
    moves: int = 0  # node set changes, all jobs


class JobsSim:
    def __init__(self, trace: Trace, fleet: ClusterSpec, jobs: list[SimJob], assumptions: Assumptions | None = None,
                 hysteresis: float = 0.05):
        if not jobs:
            raise ConfigError("no jobs to simulate")
        self.trace, self.fleet, self.jobs = trace, fleet, jobs
        self.a = assumptions or Assumptions()
        self.hysteresis = hysteresis
        self.rates = Rates(fleet, {j.name: (j.model, j.train) for j in jobs})
        self.norm = {j.name: self.rates.norm(j.name) for j in jobs}

    # -- the shared replay ----------------------------------------------------------
    def run(self) -> dict:
        t_start = time.perf_counter()
        changes = fleet_slots(self.trace)
        end = max(self.trace.end_s, changes[-1][0] if changes else 0.0)
        n0 = max(1, self.trace.first_nodes)
        events: list[tuple[float, int, str, object]] = [(t, 0, kind, slots) for t, kind, slots in changes]
        events += [(j.arrive_s, 1, "arrive", j.name) for j in self.jobs if j.arrive_s < end]
        events.sort(key=lambda e: (e[0], e[1]))
        out = {}
        for policy in POLICIES:
            run = PolicyRun(policy)
            up: set[int] = set()
            now = 0.0
            queue = list(events)
            while True:
                nxt = queue[0][0] if queue else end
                done = min(((r.left_s(now) + now, name) for name, r in run.jobs.items()
                            if r.finished_s is None and r.nodes), default=(math.inf, ""))
                switch = min((r.switch_at for r in run.jobs.values()), default=math.inf)
                t = min(nxt, done[0], switch, end)
                for r in run.jobs.values():
                    r.advance(now, t, self.a.reform_s)
                now = t
                if t >= end:
                    break
                if t < min(nxt, done[0]):  # a grown set's workers became ready: its rate changed, nothing else
                    continue
                lost: set[str] = set()
                if done[0] <= nxt:  # a job ends: its nodes come free
                    r = run.jobs[done[1]]
                    r.finished_s, r.done_tokens, r.nodes, r.rate = now, r.job.tokens, frozenset(), 0.0
                else:
                    _, _, kind, what = queue.pop(0)
                    if kind == "arrive":
                        job = next(j for j in self.jobs if j.name == what)
                        run.jobs[job.name] = JobRun(job)
                    else:
                        slots = what if isinstance(what, set) else set()
                        names = {n.name for i, n in enumerate(self.fleet.nodes) if i % n0 in slots}
                        if kind == "remove":
                            up -= slots
                            lost = names
                        else:
                            up |= slots
                up_nodes = frozenset(n.name for i, n in enumerate(self.fleet.nodes) if i % n0 in up)
                self._decide(run, now, up_nodes, lost)
            out[policy] = self._score(run, end)
        return {"hours": end / 3600, "events": len(events), "sim_s": time.perf_counter() - t_start,
                "plans": self.rates.plans, "assumptions": {k: getattr(self.a, k) for k in
                                                           ("startup_s", "reform_s", "detect_s")},
                "hysteresis": self.hysteresis, "policies": out}

    def _score(self, run: PolicyRun, end: float) -> dict:
        jobs = {}
        for j in self.jobs:
            r = run.jobs.get(j.name)
            tokens = r.done_tokens if r else 0.0
            jobs[j.name] = {"priority": j.priority, "arrive_min": j.arrive_s / 60, "tokens": tokens,
                            "done": tokens / j.tokens, "finished_min": None if r is None or r.finished_s is None
                            else r.finished_s / 60, "jct_min": None if r is None or r.finished_s is None
                            else (r.finished_s - j.arrive_s) / 60, "waited_min": (r.waited_s if r else 0.0) / 60,
                            "moves": r.changes if r else 0}
        weighted = sum(j.weight * jobs[j.name]["tokens"] / self.norm[j.name] for j in self.jobs) / end if end else 0
        plain = sum(jobs[j.name]["tokens"] / self.norm[j.name] for j in self.jobs) / end if end else 0
        finished = [j for j in self.jobs if jobs[j.name]["jct_min"] is not None]
        wjct = (sum(j.weight * jobs[j.name]["jct_min"] for j in finished) / sum(j.weight for j in finished)
                if finished else None)
        return {"weighted_goodput": weighted, "goodput": plain, "finished": len(finished), "weighted_jct_min": wjct,
                "moves": run.moves, "jobs": jobs}

    # -- the policies -----------------------------------------------------------------
    def _decide(self, run: PolicyRun, now: float, up: frozenset, lost: set[str]) -> None:
        live = {name: r for name, r in run.jobs.items() if r.finished_s is None}
        kept = {name: r.nodes & up for name, r in live.items()}
        if run.name == "fcfs":
            target = self._fcfs(live, kept, up)
        else:
            target = self._share(live, kept, up)
        for name, r in live.items():
            if target.get(name, frozenset()) != r.nodes:
                self._apply(run, r, target.get(name, frozenset()), now, bool(r.nodes & lost))

    def _fcfs(self, live: dict[str, JobRun], kept: dict[str, frozenset], up: frozenset) -> dict[str, frozenset]:
        target = {name: nodes if self.rates.tps(name, nodes) > 0 else frozenset() for name, nodes in kept.items()}
        free = set(up) - set().union(*target.values()) if target else set(up)
        waiting = [name for name in live if not target[name]]  # in arrival order (jobs arrive in order)
        while waiting and free and self.rates.tps(waiting[0], free) > 0:
            target[waiting.pop(0)] = frozenset(free)
            free = set()
        if not waiting:  # growth into what came free, in arrival order, where it pays
            for name in live:
                if free and target[name] and self.rates.tps(name, target[name] | free) > \
                        self.rates.tps(name, target[name]):
                    target[name] = target[name] | frozenset(free)
                    free = set()
        return target

    def _share(self, live: dict[str, JobRun], kept: dict[str, frozenset], up: frozenset) -> dict[str, frozenset]:
        return share(self.rates, {name: r.job.weight for name, r in live.items()}, up, kept, self.hysteresis)

    def _apply(self, run: PolicyRun, r: JobRun, nodes: frozenset, now: float, preempted: bool) -> None:
        """The job's node set changes: its rate and what the change costs it (the module's docstring)."""
        a = self.a
        rate = self.rates.tps(r.job.name, nodes)
        run.moves += 1
        r.changes += 1
        if not nodes:
            r.nodes, r.rate, r.next_rate, r.switch_at = frozenset(), 0.0, None, math.inf
            return
        kept = nodes & r.nodes
        if not kept or self.rates.tps(r.job.name, kept) <= 0:  # a start, or a resume after it had nothing
            r.busy_until = now + a.startup_s
            if r.started_s is None:
                r.started_s = now
            r.rate, r.next_rate, r.switch_at = rate, None, math.inf
        elif nodes - r.nodes:  # grows (perhaps losing some): new workers start while the kept nodes train
            old = self.rates.tps(r.job.name, kept)
            if preempted:
                r.busy_until = max(r.busy_until, now + a.detect_s + a.reform_s)
            r.rate, r.next_rate, r.switch_at = old, rate, now + a.startup_s
        else:  # only loses nodes: a re-form in place
            r.busy_until = max(r.busy_until, now + a.reform_s + (a.detect_s if preempted else 0.0))
            r.rate, r.next_rate, r.switch_at = rate, None, math.inf
        r.nodes = nodes
