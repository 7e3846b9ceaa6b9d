"""Decisions and the pure policies that make them; the controller only executes them.

Ray Train v2's controller does the same: a failure policy returns a decision
dataclass, the controller applies it and logs the cause. No Ray, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.errors import WorkerFailure
from orchestrator.preemption.failures import is_transient


@dataclass(frozen=True)
class Continue:
    pass


@dataclass(frozen=True)
class Replan:
    reason: str


@dataclass(frozen=True)
class Abort:
    reason: str


Decision = Continue | Replan | Abort


def failure_policy(failure: WorkerFailure, restarts: int, max_restarts: int,
                   user_plan: bool = False, replan_user_plan: bool = False) -> Decision:
    """Re-plan after a transient loss while restarts remain; abort on a deterministic error at once.

    A user-supplied plan is replaced by a planner plan only when the user said so
    (`hetspot submit --plan P --replan-on-loss`).
    """
    if not is_transient(failure.kind):
        return Abort(f"{failure} (an error that any plan would hit again: not re-planning)")
    if restarts >= max_restarts:
        return Abort(f"{failure} (gave up after {restarts} re-plans)")
    if user_plan and not replan_user_plan:
        return Abort(f"{failure} (the job runs the plan given with --plan; pass --replan-on-loss to let "
                     "hetspot re-plan on the surviving GPUs)")
    return Replan(str(failure))
