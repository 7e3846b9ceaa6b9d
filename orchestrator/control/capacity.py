"""Capacity: the job's fleet (`fleet:` in the job file) as demand on Ray's autoscaler, kept standing.

hetspot asks for the GPUs it plans on instead of waiting for a person to start
them. `Capacity.tick()` looks at how many nodes of each fleet type are up and
decides what to ask for:
  - demand: `max_nodes` nodes of every type, as `request_resources` bundles of
    one whole node each (`{"GPU": gpus_per_node, "accelerator_type:<T>": 1}`:
    the resource Ray sets on a GPU node), so the autoscaler starts them and,
    because the request stands while the job runs, replaces a node that a spot
    preemption took (the controller's scale-up path then moves onto it);
  - dry types: a type that stays short of `max_nodes` for `substitute_after_s`
    (its spot pool is dry, or the autoscaler caps it) is asked for as its first
    substitute instead, for the nodes it lacks, with an event saying so; the
    planner plans on whatever comes. A dry type's own demand falls to the most
    nodes of it that ever came up (so a preempted one is still replaced):
    Ray's autoscaler v2 (the default of `ray up` since Ray 2.50) treats the
    request as one constraint and launches nothing for it while any bundle in
    it cannot be placed, so a request naming nodes that cannot come would hold
    back every other type. For the same reason every short type looks dry at
    once there, so types go dry one at a time (those with substitutes first),
    each restarting the others' clocks, and a type that went dry before
    another is asked for again once (it may have been held back by the other);
  - choosing again (`fleet: {auto: ...}`, orchestrator/control/fleet_choice.py):
    a fleet the planner chose has no substitutes; when one of its types goes
    dry, the `rechoose` hook chooses the fleet again among what is left (the
    catalog less every type that went dry, but for the nodes of it that came)
    and the new fleet's types replace the demand;
  - readiness: every type's `min_nodes` are up (a substitute's nodes beyond its
    own minimum count for the type it stands in for); a fleet whose minimums
    are all 0 is ready with any GPU node. Until then the controller waits in a
    "waiting for capacity: 1/2 A100-80GB nodes, 0/2 T4" phase, and fails after
    `wait_s`, naming the missing types.
`withdraw()` clears the request when the job ends, so the autoscaler scales the
GPU nodes down at its idle timeout. The decisions are plain functions of the
counts and the clock (tests step them with fakes); `RayAutoscaler`
(orchestrator/cluster/capacity.py) is the thin executor on a Ray cluster (Ray's
`ray.autoscaler.sdk.request_resources`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("hetspot.capacity")


@dataclass(frozen=True)
class CapacityView:
    """One look at the cluster against the fleet."""

    up: dict[str, int]  # nodes of each fleet type up now
    demand: dict[str, int]  # nodes of each type asked for
    ready: bool  # every type's minimum is up (substitutes counted)
    missing: dict[str, int]  # per type short of its minimum: the nodes it lacks
    line: str  # "1/2 A100-80GB nodes, 0/2 T4" for a person
    substituted: list[tuple[str, str, int]] = field(default_factory=list)  # new now: (dry type, stand-in, nodes)
    rechosen: str | None = None  # new now: the dry type after which the fleet was chosen again


@dataclass
class Capacity:
    fleet: Any  # job_spec.FleetSpec (control/ does not import the job file's schema)
    count_up: Callable[[], dict[str, int]]  # nodes up per GPU type
    request: Callable[[dict[str, int]], None]  # ask for these nodes per GPU type (replaces the last request)
    now: Callable[[], float]
    withdraw: Callable[[], None] | None = None  # clear the request (the job ended)
    started_s: float | None = None
    short_since: dict[str, float] = field(default_factory=dict)  # types below max_nodes, since when
    stand_ins: dict[str, str] = field(default_factory=dict)  # dry type -> the substitute asked for instead
    peak: dict[str, int] = field(default_factory=dict)  # the most nodes of each type seen up
    dry: set[str] = field(default_factory=set)  # types short of max_nodes past substitute_after_s
    dried: dict[str, int] = field(default_factory=dict)  # how often each type went dry
    asked: dict[str, int] | None = None
    rechoose: Callable[[dict[str, int]], Any] | None = None  # fleet.auto: {dry type: nodes that came}
    # -> a new FleetSpec among what is left, or None

    def tick(self) -> CapacityView:
        """Look, decide substitutions, and (re)state the demand when it changed."""
        now = self.now()
        if self.started_s is None:
            self.started_s = now
        counts = self.count_up()
        up = self._up(counts)
        new = self._dry_spell(up, now)
        rechosen = self._choose_again(new, now) if self.rechoose is not None else None
        if self.rechoose is not None:
            new, up = [], self._up(counts)
        demand = fleet_demand(self.fleet, up, self.stand_ins, {t: self.peak[t] for t in self.dry})
        if demand != self.asked:
            self.request(demand)
            self.asked = demand
        missing = missing_minimums(self.fleet, up, self.stand_ins)
        ready = not missing and (any(up.values()) or any(t.min_nodes for t in self.fleet.types))
        return CapacityView(up, demand, ready, missing, progress_line(self.fleet, up, demand), new, rechosen)

    def _up(self, counts: dict[str, int]) -> dict[str, int]:
        kinds = {t.gpu_type for t in self.fleet.types}
        return {t: 0 for t in kinds} | {k: v for k, v in counts.items() if k in kinds}

    def _choose_again(self, new: list[tuple[str, str, int]], now: float) -> str | None:
        """A type just went dry in a chosen fleet: choose the fleet again among what is left."""
        if not new or self.rechoose is None:
            return None
        fleet = self.rechoose({t: self.peak.get(t, 0) for t in self.dried})
        if fleet is None:
            return None
        self.fleet = fleet
        for t in fleet.types:  # every type of the new fleet: a fresh clock
            self.peak.setdefault(t.gpu_type, 0)
            if t.gpu_type in self.short_since:
                self.short_since[t.gpu_type] = now
        return new[0][0]

    def _dry_spell(self, up: dict[str, int], now: float) -> list[tuple[str, str, int]]:
        """Mark at most one type dry (short of max_nodes past substitute_after_s); return new substitutions."""
        short = []
        for t in self.fleet.types:
            self.peak[t.gpu_type] = max(self.peak.get(t.gpu_type, 0), up[t.gpu_type])
            if up[t.gpu_type] >= t.max_nodes:
                self.short_since.pop(t.gpu_type, None)
            elif t.gpu_type not in self.dry:
                short.append(t)
                self.short_since.setdefault(t.gpu_type, now)
        due = sorted((t for t in short if now - self.short_since[t.gpu_type] >= self.fleet.substitute_after_s),
                     key=lambda t: not t.substitutes)
        if not due:
            return []
        t = due[0]
        log.warning("%s stayed short (%d/%d nodes) for %.0f s: asking for at most the %d that came%s", t.gpu_type,
                    up[t.gpu_type], t.max_nodes, now - self.short_since[t.gpu_type], self.peak[t.gpu_type],
                    f", and for {t.substitutes[0]} instead" if t.substitutes else "")
        self.dry.add(t.gpu_type)
        self.dried[t.gpu_type] = self.dried.get(t.gpu_type, 0) + 1
        for other in list(self.dry - {t.gpu_type}):  # it may have held the others back: ask for them once more
            if self.dried[other] == 1:
                self.dry.discard(other)
        for other in self.fleet.types:  # a fresh chance, now that the request changed
            if other.gpu_type != t.gpu_type and other.gpu_type in self.short_since:
                self.short_since[other.gpu_type] = now
        if self.rechoose is not None:  # a chosen fleet: tick() chooses again
            return [(t.gpu_type, "", t.max_nodes - up[t.gpu_type])]
        if not t.substitutes or t.gpu_type in self.stand_ins:
            return []
        self.stand_ins[t.gpu_type] = t.substitutes[0]
        return [(t.gpu_type, t.substitutes[0], t.max_nodes - up[t.gpu_type])]

    def timed_out(self) -> bool:
        return self.started_s is not None and self.now() - self.started_s >= self.fleet.wait_s


def fleet_demand(fleet: Any, up: dict[str, int], stand_ins: dict[str, str],
                 dry: dict[str, int] | None = None) -> dict[str, int]:
    """Nodes to ask for per type: its max_nodes, or for a dry type the most of it that came up (`dry`), plus
    for each substituted type the nodes it lacks as its stand-in."""
    demand = {t.gpu_type: min(t.max_nodes, (dry or {}).get(t.gpu_type, t.max_nodes)) for t in fleet.types}
    for t in fleet.types:
        sub = stand_ins.get(t.gpu_type)
        if sub is not None:
            demand[sub] += max(0, t.max_nodes - up.get(t.gpu_type, 0))
    return demand


def missing_minimums(fleet: Any, up: dict[str, int], stand_ins: dict[str, str]) -> dict[str, int]:
    """Per type short of min_nodes: the nodes it lacks, after its stand-in's surplus over its own minimum."""
    mins = {t.gpu_type: t.min_nodes for t in fleet.types}
    surplus = {k: max(0, up.get(k, 0) - mins[k]) for k in mins}
    missing = {}
    for t in fleet.types:
        lack = max(0, t.min_nodes - up.get(t.gpu_type, 0))
        sub = stand_ins.get(t.gpu_type)
        if lack and sub is not None:
            used = min(lack, surplus[sub])
            surplus[sub] -= used
            lack -= used
        if lack:
            missing[t.gpu_type] = lack
    return missing


def progress_line(fleet: Any, up: dict[str, int], demand: dict[str, int]) -> str:
    return ", ".join(f"{up.get(t, 0)}/{n} {t} node{'s' if n != 1 else ''}" for t, n in demand.items() if n)


def timeout_message(fleet: Any, view: CapacityView) -> str:
    """The failure after `wait_s`: which types are missing, and what to check."""
    lacks = ", ".join(f"{t} ({view.up.get(t, 0)} up, min_nodes {t_min})" for t, t_min in
                      ((t.gpu_type, t.min_nodes) for t in fleet.types) if t in view.missing)
    return (f"fleet: the minimum did not come up in {fleet.wait_s:.0f} s: missing {lacks}. Check that the "
            "cluster's autoscaler has a node type with that accelerator_type (and max_workers above 0), the "
            "cloud's spot quota, or lower fleet.types[].min_nodes / add substitutes; raise fleet.wait_s to wait longer")
