"""The controller's states (control/controller.py has the machine; control/timeline.py the records it carries
between step boundaries while a failure, a drain or a move is under way). Pure."""

from __future__ import annotations

import enum
from typing import TypeVar

T = TypeVar("T")


class State(enum.Enum):
    """The controller's states, each one handler (`Controller._handlers`)."""

    WAITING = "waiting"  # a fleet's demand stands on the autoscaler until every type's minimum is up
    QUEUED = "queued"  # no plan fits on the GPUs free to the job; others hold the rest: it waits its turn
    DISCOVERING = "discovering"  # asks the node source which GPU nodes exist now (less the doomed ones)
    PLANNING = "planning"  # the planner's plan for them (after a loss: the top candidates, weighed with migration)
    LAUNCHING = "launching"  # the plan's workers start; the state plane restores the newest step it holds
    TRAINING = "training"  # one committed step per call; snapshots after steps; notices and joins looked at
    RECOVERING = "recovering"  # a failure the policy re-plans: survivors keep their state, their group goes
    DRAINING = "draining"  # a notice leaves time: the committed step is kept off the doomed nodes, then re-plan
    DONE = "done"  # every step committed, the last upload in S3, the fleet's demand withdrawn
    FAILED = "failed"  # the policy aborted (deterministic error, restarts spent) or no plan fits; `error` says why


def present(value: T | None, what: str, state: State) -> T:
    """`value`, which the state machine holds in `state`; its absence is a bug in the controller, said as such."""
    if value is None:
        raise RuntimeError(f"no {what} (state {state.value})")
    return value
