"""The fleet's share between several jobs as a choice, not a race, after Gavel (Narayanan et al., OSDI 2020:
throughput normalised per job, weighted) and Sia (Jayaram Subramanya et al., SOSP 2023: re-decided on every
change, heterogeneity aware).

The nodes go to maximise the sum over the jobs of weight x tokens/s on its nodes / tokens/s on the whole fleet
(the planner's estimate: `Rates`), greedily: the increment (1, 2, 4, ... nodes of one kind) with the best gain per
node goes first, a job's own nodes before others'. A new share is taken only when it beats the share kept (each
job's nodes that are still up) by `hysteresis`, so that a small gain does not move jobs. The weight of a job is
1 + its priority (`weight`). Maximising the weighted sum starves the job whose normalised throughput per node is
lowest while others want the nodes (as Gavel's max-sum policy does).

One function for both users of it: the several-jobs simulator (drills/jobs_sim.py, `hetspot simulate --jobs`)
and the live controller's queue (control/queueing.py, jobs with `runtime.fleet_share: weighted`). Pure: the
planner and its cost model, no Ray.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from orchestrator.control.protocols import JobCard
from planner import ClusterSpec, PlanningError, evaluate
from planner.search import Planner
from planner.specs import ModelSpec, TrainSpec

Share = dict[str, frozenset[str]]  # job -> the nodes it gets


def weight(priority: int) -> float:
    """1 + the priority (a negative priority weighs 1 / (1 - priority): above 0, below the default's 1)."""
    return 1.0 + priority if priority >= 0 else 1.0 / (1.0 - priority)


class Rates:
    """Each job's predicted tokens/s on a set of the fleet's nodes (0 where no plan fits), planned once per job and
    per multiset of node kinds (nodes of one kind are alike to the planner); kept across fleet changes."""

    def __init__(self, fleet: ClusterSpec, jobs: Mapping[str, tuple[ModelSpec, TrainSpec]]):
        self.planners: dict[str, Planner] = {}
        self.specs: dict[str, tuple[ModelSpec, TrainSpec]] = {}
        self._cache: dict[tuple, float] = {}
        self.plans = 0
        self.fleet = fleet
        self.spec = {n.name: n for n in fleet.nodes}
        for name, (model, train) in jobs.items():
            self.add(name, model, train)

    def add(self, job: str, model: ModelSpec, train: TrainSpec) -> None:
        """A job to rate (again where its model or training changed: its cached rates go)."""
        if self.specs.get(job) == (model, train):
            return
        self.specs[job] = (model, train)
        self.planners[job] = Planner(model, train)
        self._cache = {k: v for k, v in self._cache.items() if k[0] != job}

    def on(self, fleet: ClusterSpec) -> None:
        """The fleet now (nodes joined or left): rates of node kinds seen before are kept."""
        self.fleet, self.spec = fleet, {n.name: n for n in fleet.nodes}

    def kind(self, node: str) -> tuple:
        n = self.spec[node]
        return (n.gpu_type, n.num_gpus, n.inter_node_bw_gb_s, n.market)

    def tps(self, job: str, nodes: Iterable[str]) -> float:
        nodes = [n for n in nodes if n in self.spec]
        if not nodes:
            return 0.0
        key = (job, tuple(sorted(Counter(self.kind(n) for n in nodes).items())))
        if key not in self._cache:
            cluster = self.fleet.model_copy(update={"nodes": [self.spec[n] for n in sorted(nodes)]})
            model, train = self.specs[job]
            self.plans += 1
            try:
                self._cache[key] = evaluate(self.planners[job].plan(cluster), cluster, model, train).tokens_per_s
            except PlanningError:
                self._cache[key] = 0.0
        return self._cache[key]

    def norm(self, job: str) -> float:
        """The job's tokens/s on the whole fleet: what its share is measured against (1 where nothing fits)."""
        return self.tps(job, self.spec) or 1.0


def value(rates: Rates, weights: Mapping[str, float], alloc: Mapping[str, Iterable[str]]) -> float:
    """The sum over jobs of weight x tokens/s on its nodes / tokens/s on the whole fleet."""
    return sum(weights[j] * rates.tps(j, nodes) / rates.norm(j) for j, nodes in alloc.items())


def share(rates: Rates, weights: Mapping[str, float], up: Iterable[str], kept: Mapping[str, frozenset[str]],
          hysteresis: float = 0.05) -> Share:
    """The nodes `up` shared among the jobs of `weights` (each job's `kept`: the nodes it holds now, its own
    before others' in the greedy). The share kept (a job's nodes where they still train a plan) unless the new
    one is worth `hysteresis` more, or nobody holds anything."""
    jobs = list(weights)
    alloc: dict[str, set[str]] = {name: set() for name in jobs}
    pool = set(up)
    while pool:
        best: tuple[float, str, list[str]] | None = None
        kinds: dict[tuple, list[str]] = {}
        for n in sorted(pool):
            kinds.setdefault(rates.kind(n), []).append(n)
        for name in jobs:
            base = rates.tps(name, alloc[name])
            w = weights[name] / rates.norm(name)
            mine = kept.get(name, frozenset())
            for names in kinds.values():
                names = sorted(names, key=lambda n: (n not in mine, n))  # its own nodes first
                k = 1
                while True:
                    r = rates.tps(name, alloc[name] | set(names[:k]))
                    if r > base * (1 + 1e-9):
                        score = w * (r - base) / k
                        if best is None or score > best[0]:
                            best = (score, name, names[:k])
                        break
                    if k >= len(names):
                        break
                    k = min(2 * k, len(names))
        if best is None:
            break
        alloc[best[1]] |= set(best[2])
        pool -= set(best[2])
    new = {name: frozenset(nodes) for name, nodes in alloc.items()}
    keep = {name: nodes if rates.tps(name, nodes) > 0 else frozenset()
            for name, nodes in ((j, kept.get(j, frozenset())) for j in jobs)}
    if value(rates, weights, new) > value(rates, weights, keep) * (1 + hysteresis) or not any(keep.values()):
        return new
    return keep


class FleetShare:
    """One job's reading of the fleet's weighted share, live (control/queueing.py): the jobs that show a card
    (control/protocols.JobCard) share the cluster's nodes, less those a job that does not share holds GPUs on and
    those under a notice. Every job that shares reads the same cards and holdings, so each reaches the same
    share; a waiting job asks for the nodes it gets, and an asked job gives back only what its own reading does
    not keep. The rates are kept between readings (one plan per job and per multiset of node kinds)."""

    def __init__(self, hysteresis: float = 0.05):
        self.hysteresis = hysteresis
        self.rates: Rates | None = None

    def decide(self, cards: Mapping[str, JobCard], whole: ClusterSpec, held: Mapping[str, Mapping[str, int]],
               me: str, mine: Iterable[str], doomed: Iterable[str] = ()) -> Share:
        """`held`: node -> {job: GPUs} that other jobs hold (this job's view); `mine`: the nodes this job holds."""
        if self.rates is None:
            self.rates = Rates(whole, {})
        self.rates.on(whole)
        for job, card in cards.items():
            self.rates.add(job, card.model, card.train)
        out = set(doomed) | {node for node, by in held.items() if any(j not in cards for j in by)}
        up = [n.name for n in whole.nodes if n.name not in out]
        kept = {j: frozenset(node for node, by in held.items() if j in by) for j in cards}
        kept[me] = frozenset(mine)
        weights = {j: weight(cards[j].priority) for j in sorted(cards)}
        return share(self.rates, weights, up, kept, self.hysteresis)
