"""`fleet: {auto: ...}`: the fleet the planner chooses (planner/fleet.py), asked for and chosen again.

A job file may name its fleet's types or leave the choice to hetspot:

    fleet:
      auto: {catalog: catalog-aws.yaml, objective: cost}   # or throughput, with budget_per_hour

When the job starts, `choose_fleet` picks the instance types and counts with the
best objective for this model (Sailor's co-optimisation of the GPUs to rent and
the plan), and the capacity loop (orchestrator/control/capacity.py) asks the
autoscaler for exactly that fleet: each chosen type with `min_nodes` =
`max_nodes` = its count, so training starts on the fleet the choice was made
for. When a type stays short past `fleet.substitute_after_s` (its spot pool is
dry, or the cloud's quota holds it back), `Rechooser` chooses again among what
is left: the catalog less that type, except for the nodes of it that did come
up. The new fleet replaces the demand; the controller plans on whatever comes,
as it does for every fleet.

The choice is deterministic, so `hetspot submit --address` makes it on the
user's machine first (to report it and fail early with exit 2 when the model
fits no fleet) and the driver makes the same one on the cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from planner.errors import PlanningError
from planner.fleet import Catalog, FleetChoice, choose_fleet

log = logging.getLogger("hetspot.capacity")


def left_after(catalog: Catalog, came: dict[str, int]) -> Catalog | None:
    """The catalog less the GPU types that did not come, except for the nodes of each that did (`came`: GPU
    type -> the most nodes of it ever up). None when nothing is left."""
    types = []
    for t in catalog.types:
        if t.gpu_type not in came:
            types.append(t)
        elif came[t.gpu_type] > 0:
            types.append(t.model_copy(update={"max_nodes": min(t.max_nodes, came[t.gpu_type])}))
    return catalog.model_copy(update={"types": types}) if types else None


def describe(choice: FleetChoice, catalog: Catalog) -> str:
    o = choice.best
    return (" + ".join(f"{n}x {name} ({catalog.type(name).gpu_type})" for name, n in o.fleet)
            + f": ${o.price_per_hour:.2f}/h, {o.tokens_per_s:,.0f} tokens/s, ${o.cost_per_mtok:.3g} per M tokens")


def choose(job: Any, catalog: Catalog | None = None) -> tuple[FleetChoice, Any]:
    """The job's fleet chosen from its catalog (or `catalog`, what is left of it): (the choice, the job's
    FleetSpec with the chosen types). Raises PlanningError when the model fits no fleet."""
    auto = job.fleet.auto
    catalog = catalog or auto.catalog
    choice = choose_fleet(catalog, job.model_spec, job.train, auto.objective, auto.budget_per_hour)
    return choice, job.fleet.chosen(catalog, choice.best.fleet)  # job_spec.FleetSpec.chosen


@dataclass
class Rechooser:
    """Chooses the fleet again when types do not come (Capacity's `rechoose` hook)."""

    job: Any  # job_spec.JobSpec with fleet.auto (control/ does not import the job file's schema)
    history: list[str] = field(default_factory=list)  # each choice, described
    on_new: Callable[[object], None] | None = None  # told each new FleetSpec (the executor learns its node shapes)

    def first(self) -> Any:
        choice, fleet = choose(self.job)
        self.history.append(describe(choice, self.job.fleet.auto.catalog))
        log.info("fleet chosen: %s", self.history[-1])
        return fleet

    def __call__(self, came: dict[str, int]) -> Any:
        """A new FleetSpec among what is left (`came`: each type that did not come -> its nodes that did), or
        None when nothing is left that fits the model (the demand stays; `fleet.wait_s` ends the wait)."""
        left = left_after(self.job.fleet.auto.catalog, came)
        if left is None:
            return None
        try:
            choice, fleet = choose(self.job, left)
        except PlanningError as e:
            log.warning("choosing the fleet again without %s: %s", ", ".join(sorted(came)), e)
            return None
        self.history.append(describe(choice, left))
        log.warning("fleet chosen again without %s: %s", ", ".join(sorted(came)), self.history[-1])
        if self.on_new is not None:
            self.on_new(fleet)
        return fleet
