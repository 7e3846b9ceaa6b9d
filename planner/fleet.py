"""Which spot GPUs to ask for: the fleet and its plan, chosen together under one objective.

Sailor (SOSP'25) co-optimises which GPUs to rent and the parallel plan under a
budget; AutoHet observes that on spot GPUs the cheapest fleet per hour can be the
dearest per token once preemptions are paid. Here a catalog lists instance types
(GPU type and count, host RAM, NIC, price, a preemption rate and its source) with
limits (nodes per type, GPUs per GPU type, how many types one fleet mixes), and
`choose_fleet` picks the fleet and its plan that minimise $ per million tokens
(risk-aware: `evaluate`'s cost_per_mtok charges each expected preemption's
recovery), at or above a throughput floor if one is given (`min_tokens_per_s`:
a deadline for the job's tokens comes to one), or maximise the tokens/s a fleet
delivers after its expected preemptions (`effective_tokens_per_s`, the same risk
model) under a $/h budget: a cheap pool that is taken away every twenty minutes
does not win on its raw speed.

Every candidate fleet is planned by the trusted planner (`Planner`, its cost
caches shared across fleets). The fleets are searched, not enumerated: every
single-type fleet first, then a best-improvement local search (add a node, drop
one, swap one node's type) from the best few, as HexiScale and Sailor prune
their configuration spaces. tests/test_fleet_choice.py holds the result to the
brute-force optimum over small catalogs (every combination of up to three types
and counts within limits).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from planner.catalog import canonical_gpu_type
from planner.errors import PlanningError
from planner.plan_types import Plan
from planner.search import Planner, collector_paused
from planner.specs import ClusterSpec, ModelSpec, NodeSpec, StrictModel, TrainSpec, plain_name

if TYPE_CHECKING:
    from multiprocessing.pool import Pool

Fleet = tuple[tuple[str, int], ...]  # ((instance type name, nodes), ...), sorted by name, counts > 0


class InstanceType(StrictModel):
    """One instance type a cloud rents: its GPUs, host, network, spot price and how often it is taken away."""

    name: str = Field(description="the cloud's instance type name, e.g. g6.12xlarge")
    cloud: str = Field(default="aws", description="aws, gcp, azure, ...: for people")
    gpu_type: str = Field(description="catalog GPU type (planner/catalog.py)")
    num_gpus: int = Field(ge=1, le=64, description="GPUs per instance")
    host_mem_gib: float | None = Field(default=None, gt=0, le=65536, description="host RAM per instance")
    nic_gb_s: float = Field(default=12.5, gt=0, description="network bandwidth per instance, GB/s")
    market: Literal["spot", "on-demand"] = "spot"
    price_per_hour: float = Field(ge=0, description="$/h per instance (spot: a recent price)")
    preemptions_per_hour: float = Field(default=0.0, ge=0, description="expected preemptions per instance-hour")
    rate_source: str = Field(default="", description="where the preemption rate comes from (a trace, an advisor band)")
    price_source: str = Field(default="", description="where the price comes from, and when")
    max_nodes: int = Field(default=4, ge=1, le=1024, description="instances of this type a fleet may hold")

    _known_type = field_validator("gpu_type")(classmethod(lambda cls, v: canonical_gpu_type(v)))

    @field_validator("preemptions_per_hour")
    @classmethod
    def _rate(cls, v: float) -> float:
        if v > 60:
            raise ValueError(f"{v} per hour is above one preemption a minute; give the expected preemptions per "
                             "instance-hour (a spot trace's removals over its node-hours, e.g. 0.13)")
        return v

    _plain_name = field_validator("name")(classmethod(lambda cls, v: plain_name(v, "instance type name")))


class Catalog(StrictModel):
    """The instance types a fleet may draw from, and the limits on drawing."""

    types: list[InstanceType] = Field(min_length=1, description="instance types, each with a price and a rate")
    max_types: int = Field(default=3, ge=1, le=8, description="instance types one fleet may mix")
    quota_gpus: dict[str, int] = Field(default_factory=dict, description="most GPUs of a GPU type in one fleet "
                                       "(a cloud quota), e.g. {L4: 16}")
    one_per_gpu_type: bool = Field(default=False, description="a fleet holds at most one instance type of each GPU "
                                   "type (a job file's fleet: its demand names GPU types, not instance types)")

    @model_validator(mode="after")
    def _check(self) -> Catalog:
        names = [t.name for t in self.types]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"types: {twice} listed twice; give each instance type once")
        for gpu, n in self.quota_gpus.items():
            canonical_gpu_type(gpu)
            if n < 0:
                raise ValueError(f"quota_gpus[{gpu!r}] = {n} must be at least 0")
        return self

    def type(self, name: str) -> InstanceType:
        return next(t for t in self.types if t.name == name)

    def quota(self, gpu_type: str) -> int | None:
        for gpu, n in self.quota_gpus.items():
            if canonical_gpu_type(gpu) == gpu_type:
                return n
        return None

    def allows(self, fleet: Fleet) -> bool:
        if not fleet or len(fleet) > self.max_types:
            return False
        gpus: dict[str, int] = {}
        for name, n in fleet:
            t = self.type(name)
            if not 0 < n <= t.max_nodes or (self.one_per_gpu_type and t.gpu_type in gpus):
                return False
            gpus[t.gpu_type] = gpus.get(t.gpu_type, 0) + n * t.num_gpus
        return all((q := self.quota(g)) is None or n <= q for g, n in gpus.items())

    def price(self, fleet: Fleet) -> float:
        return sum(self.type(name).price_per_hour * n for name, n in fleet)

    def cluster(self, fleet: Fleet) -> ClusterSpec:
        nodes = []
        for name, n in fleet:
            t = self.type(name)
            nodes += [NodeSpec(name=f"{name}-{k}", gpu_type=t.gpu_type, num_gpus=t.num_gpus, market=t.market,
                               price_per_hour=t.price_per_hour, preemptions_per_hour=t.preemptions_per_hour,
                               host_mem_gib=t.host_mem_gib, inter_node_bw_gb_s=t.nic_gb_s, instance_type=name)
                      for k in range(n)]
        return ClusterSpec(nodes=nodes)


def fleet_of(counts: dict[str, int]) -> Fleet:
    return tuple(sorted((k, v) for k, v in counts.items() if v > 0))


@dataclass
class Option:
    """A fleet to request and its plan. `fleet` is what the plan uses (a node the plan would leave idle
    still bills, so it is not requested)."""

    fleet: Fleet
    plan: Plan
    price_per_hour: float
    cost_per_mtok: float
    tokens_per_s: float

    @property
    def effective_tokens_per_s(self) -> float:
        """What the fleet delivers after its expected preemptions (the plan's `preemption_loss`: the share of wall
        time its recoveries take)."""
        return self.tokens_per_s * (1.0 - self.plan.estimated.preemption_loss)

    def describe(self) -> str:
        return " + ".join(f"{n}x {name}" for name, n in self.fleet)


@dataclass
class FleetChoice:
    best: Option
    runners_up: list[Option]  # the next best two distinct fleets
    best_single: Option | None  # the best fleet of one instance type
    objective: str
    budget_per_hour: float | None
    planned: int  # fleets planned by the search
    space: int  # fleets within the limits (what brute force would plan)
    notes: list[str] = field(default_factory=list)


def all_fleets(catalog: Catalog) -> list[Fleet]:
    """Every fleet within the catalog's limits: up to max_types types, 1..max_nodes of each, within quotas."""
    import itertools

    names = sorted(t.name for t in catalog.types)
    out = []
    for k in range(1, min(catalog.max_types, len(names)) + 1):
        for combo in itertools.combinations(names, k):
            for counts in itertools.product(*[range(1, catalog.type(n).max_nodes + 1) for n in combo]):
                f = tuple(zip(combo, counts, strict=True))
                if catalog.allows(f):
                    out.append(f)
    return out


class FleetSearch:
    """Plans candidate fleets (each once) and ranks them by the objective."""

    def __init__(self, catalog: Catalog, model: ModelSpec, train: TrainSpec, objective: str = "cost",
                 budget_per_hour: float | None = None, progress: Callable[[int], None] | None = None,
                 min_tokens_per_s: float | None = None, workers: int = 1):
        if objective not in ("cost", "throughput"):
            raise ValueError(f"objective {objective!r} must be 'cost' or 'throughput'")
        self.catalog, self.model, self.train = catalog, model, train
        self.objective, self.budget, self.floor = objective, budget_per_hour, min_tokens_per_s
        self.progress = progress
        self.workers = max(1, workers)
        self._pool: Pool | None = None
        self._planner = Planner(model, train)
        self._seen: dict[Fleet, Option | None] = {}

    def options(self, fleets: list[Fleet]) -> list[Option | None]:
        """`option` of each fleet. With `workers` > 1 the fleets not planned yet are planned in forked processes
        at once (each fleet's search is independent of the others and of the caches, so the answers, their order
        and the search's path are those of one process)."""
        todo = list(dict.fromkeys(f for f in fleets if f not in self._seen and self.within(f)))
        if self.workers > 1 and len(todo) > 1 and _can_fork():
            if self._pool is None:
                import multiprocessing

                global _FORKED
                _FORKED = self  # the children inherit it (and the caches so far) by fork
                self._pool = multiprocessing.get_context("fork").Pool(self.workers)
            # The largest fleets first (their searches take longest), so no worker is left with one at the end;
            # kept in the given order, as one process would have planned them.
            order = sorted(todo, key=lambda f: -sum(self.catalog.type(t).num_gpus * n for t, n in f) * len(f))
            got = {}
            for i, option in enumerate(self._pool.imap(_option_in_child, order), 1):
                got[order[i - 1]] = option
                if self.progress is not None:
                    self.progress(len(self._seen) + i)
            self._seen.update((f, got[f]) for f in todo)
        return [self.option(f) for f in fleets]

    def close(self) -> None:
        global _FORKED
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None
        if _FORKED is self:
            _FORKED = None

    def within(self, fleet: Fleet) -> bool:
        return self.catalog.allows(fleet) and (self.budget is None or self.catalog.price(fleet) <= self.budget + 1e-9)

    def option(self, fleet: Fleet) -> Option | None:
        """The fleet planned for the objective (None if the model does not fit it, or it is out of limits). Under
        a throughput floor, a fleet whose cheapest plan falls short of it is planned again for throughput: a floor
        one of its plans meets is never refused (the cheapest per token among the plans the search knows that
        meet it: the cost plan if it does, else the fastest)."""
        if fleet in self._seen:
            return self._seen[fleet]
        got = None
        if self.within(fleet):
            got = self._planned(fleet, self.objective)
            if got is not None and not self.meets(got) and self.objective == "cost":
                faster = self._planned(fleet, "throughput")
                if faster is not None and faster.effective_tokens_per_s > got.effective_tokens_per_s:
                    got = faster
        self._seen[fleet] = got
        if self.progress is not None:
            self.progress(len(self._seen))
        return got

    def _planned(self, fleet: Fleet, objective: str) -> Option | None:
        cluster = self.catalog.cluster(fleet)
        try:
            plan = self._planner.sharing_caches().plan(cluster, objective)
        except PlanningError:
            return None
        used: dict[str, int] = {}
        for node in plan.nodes():
            it = cluster.node(node).instance_type
            assert it is not None, "a catalog's cluster names each node's instance type"
            used[it] = used.get(it, 0) + 1
        trimmed = fleet_of(used)  # what the plan uses: a node it would leave idle still bills
        est = plan.estimated  # a catalog's nodes are all priced: every plan has its $ per M tokens
        return Option(trimmed, plan, self.catalog.price(trimmed), est.cost_per_mtok if est.cost_per_mtok is not None
                      else math.inf, est.tokens_per_s)

    def meets(self, o: Option) -> bool:
        return self.floor is None or o.effective_tokens_per_s >= self.floor * (1 - 1e-9)

    def key(self, o: Option) -> tuple:
        if self.objective == "cost":  # a fleet below the floor ranks after every one above it, nearest first
            short = 0.0 if self.floor is None or self.meets(o) else self.floor - o.effective_tokens_per_s
            return (short, o.cost_per_mtok, -o.effective_tokens_per_s, o.fleet)
        return (-o.effective_tokens_per_s, o.cost_per_mtok, o.fleet)

    def _neighbours(self, fleet: Fleet) -> list[Fleet]:
        counts = dict(fleet)
        names = sorted(t.name for t in self.catalog.types)
        out = []
        for name in names:
            up = dict(counts)
            up[name] = up.get(name, 0) + 1
            out.append(fleet_of(up))
            if name in counts:
                down = dict(counts)
                down[name] -= 1
                out.append(fleet_of(down))
                for other in names:
                    if other != name:
                        swap = dict(down)
                        swap[other] = swap.get(other, 0) + 1
                        out.append(fleet_of(swap))
        return [f for f in out if f and self.within(f)]

    def run(self, starts: int = 3) -> FleetChoice:
        singles = [fleet_of({t.name: n}) for t in self.catalog.types for n in range(1, t.max_nodes + 1)]
        # In this process: the mixed fleets' searches reuse what these cost (their single-type subsets), and
        # the workers forked after them inherit it.
        options = [o for o in (self.option(f) for f in singles) if o is not None]
        # Local search from the best few single-type fleets, and from the best fleet of each type.
        ranked = sorted(options, key=self.key)
        by_type: dict[str, Option] = {}
        for o in ranked:
            by_type.setdefault(o.fleet[0][0], o)
        seeds = list(dict.fromkeys([o.fleet for o in ranked[:starts]] + [o.fleet for o in by_type.values()]))
        # Every seed's first step plans all its neighbours: plan them together (in parallel where workers > 1).
        self.options([f for s in seeds if (got := self.option(s)) is not None for f in self._neighbours(got.fleet)])
        for fleet in seeds:
            current: Option | None = self.option(fleet)
            while current is not None:
                better = [o for o in self.options(self._neighbours(current.fleet)) if o is not None]
                step = min(better, key=self.key, default=None)
                if step is None or self.key(step) >= self.key(current):
                    break
                current = step
        found: dict[Fleet, Option] = {}
        for o in sorted((o for o in self._seen.values() if o is not None), key=self.key):
            found.setdefault(o.fleet, o)
        if not found:
            raise PlanningError(self._nothing_fits())
        if not self.meets(next(iter(found.values()))):
            fastest = max(found.values(), key=lambda o: o.effective_tokens_per_s)
            raise PlanningError(f"no fleet found delivers {self.floor:,.0f} tokens/s after its preemptions "
                                f"(--min-tokens-per-s or --deadline-h); the fastest, {fastest.describe()}, delivers "
                                f"{fastest.effective_tokens_per_s:,.0f}: lower the floor, extend the deadline, or "
                                "raise the catalog's max_nodes")
        ranked = list(found.values())
        single = [o for o in ranked if len(o.fleet) == 1]
        return FleetChoice(best=ranked[0], runners_up=ranked[1:3], best_single=single[0] if single else None,
                           objective=self.objective, budget_per_hour=self.budget, planned=len(self._seen),
                           space=len(all_fleets(self.catalog)))

    def _nothing_fits(self) -> str:
        if self.budget is not None:
            cheapest = min(t.price_per_hour for t in self.catalog.types)
            if self.budget < cheapest:
                return (f"budget {self.budget:g} $/h (--budget) is below the cheapest fleet (one instance, "
                        f"${cheapest:g}/h); raise the budget")
            free = FleetSearch(self.catalog, self.model, self.train, self.objective, None).run()
            need = min([free.best, *free.runners_up, *([free.best_single] if free.best_single else [])],
                       key=lambda o: o.price_per_hour)
            return (f"budget {self.budget:g} $/h (--budget): no fleet within it fits model {self.model.name!r}; the "
                    f"cheapest fleet found that does, {need.describe()}, costs ${need.price_per_hour:g}/h; raise "
                    "the budget")
        return (f"model {self.model.name!r} fits no fleet of this catalog within its limits (max_nodes, "
                "quota_gpus, max_types); raise max_nodes, add instance types with more GPU or host memory, or "
                "use a smaller model")


_FORKED: FleetSearch | None = None  # the search whose fleets a forked worker plans


def _can_fork() -> bool:
    """Whether worker processes can be forked here (Linux; elsewhere the fleets are planned in this process)."""
    import multiprocessing
    import sys

    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def _option_in_child(fleet: Fleet) -> Option | None:
    assert _FORKED is not None
    _FORKED.progress = None  # the parent reports progress
    return _FORKED.option(fleet)


def choose_fleet(catalog: Catalog, model: ModelSpec, train: TrainSpec, objective: str = "cost",
                 budget_per_hour: float | None = None,
                 progress: Callable[[int], None] | None = None, min_tokens_per_s: float | None = None,
                 workers: int = 1) -> FleetChoice:
    """The fleet to request and its plan (see the module doc). Raises PlanningError when none fits, or none
    meets `min_tokens_per_s` (effective, after preemptions). `workers`: processes that plan fleets at once
    (forked: for a command line, not inside a Ray driver; the choice is the same for any number)."""
    if min_tokens_per_s is not None and not (math.isfinite(min_tokens_per_s) and min_tokens_per_s > 0):
        raise PlanningError(f"min_tokens_per_s {min_tokens_per_s} must be a positive number of tokens/s")
    if budget_per_hour is not None:
        if not math.isfinite(budget_per_hour) or budget_per_hour <= 0:
            raise PlanningError(f"budget_per_hour {budget_per_hour} must be a positive $/h")
        cheapest = min(t.price_per_hour for t in catalog.types)
        if budget_per_hour < cheapest:
            raise PlanningError(f"budget {budget_per_hour:g} $/h (--budget) is below the cheapest fleet (one instance, "
                                f"${cheapest:g}/h); raise the budget")
    search = FleetSearch(catalog, model, train, objective, budget_per_hour, progress, min_tokens_per_s, workers)
    try:
        with collector_paused():  # once for every fleet's search (each pausing it again would collect in between)
            return search.run()
    finally:
        search.close()
