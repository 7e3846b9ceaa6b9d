"""Discrete-event simulator of one training step of a Plan.

Each stage runs its micro-batch operations in 1F1B order (warm-up forwards,
alternating forward/backward, cool-down backwards) or GPipe order. An operation
starts when its stage is free and its input has arrived: a forward needs the
previous stage's forward of the same micro-batch, a backward the next stage's
backward. The per-operation times come from planner.cost, so this checks the
closed form in planner.estimate against an explicit schedule.
"""

from __future__ import annotations

from planner.estimate import estimate_from_profiles, profile_plan
from planner.plan_types import Estimate, Plan
from planner.schedule import op_order
from planner.specs import ClusterSpec, ModelSpec, TrainSpec


def simulate_pipeline(fwd: list[list[float]], bwd: list[list[float]], schedule: str = "1f1b") -> float:
    """fwd[i][j], bwd[i][j]: time of micro-batch j on stage i. Returns the makespan."""
    p, m = len(fwd), len(fwd[0])
    orders = [op_order(i, p, m, schedule) for i in range(p)]
    pos = [0] * p
    free = [0.0] * p
    end: dict[tuple[str, int, int], float] = {}
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(p):
            while pos[i] < len(orders[i]):
                kind, j = orders[i][pos[i]]
                if kind == "F":
                    dep = end.get(("F", i - 1, j)) if i > 0 else 0.0
                    dur = fwd[i][j]
                else:
                    dep = end.get(("B", i + 1, j)) if i < p - 1 else end.get(("F", i, j))
                    dur = bwd[i][j]
                if dep is None:
                    break
                start = max(free[i], dep)
                free[i] = end[(kind, i, j)] = start + dur
                pos[i] += 1
                remaining -= 1
                progressed = True
        assert progressed, "schedule deadlocked"  # programmer invariant: orders are consistent
    return max(free)


def simulate(plan: Plan, cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> Estimate:
    """Estimate of `plan` with each replica's pipeline time taken from the event simulation."""
    profiles = profile_plan(plan, cluster, model, train)
    times = []
    for pipe, prof in zip(plan.pipelines, profiles, strict=True):
        fwd = [[t.fwd_s for t in sp.times] for sp in prof]
        bwd = [[t.bwd_s for t in sp.times] for sp in prof]
        times.append(simulate_pipeline(fwd, bwd, pipe.schedule))
    return estimate_from_profiles(plan, profiles, times, cluster, model, train)
