"""The controller's states, typed, each carrying its own data (Ray Train v2's controller states are the model):

- `State`: the kinds, what `Controller.state` reports and the run's history names.
- `Recovering(failure)`: the failure the policy re-plans after, and when it was detected.
- `Training(staged, join)`: one committed step per call, with the switch that may be pending: a notice's
  pre-staged next plan (`Staged`), or a join's chosen move waiting for its warm workers (`Joining`).
- `Draining(timeline, staged)`: a notice's drain at a step boundary: its switch's timeline and, where it was
  pre-staged, the plan it launches.
- `Queued(wants, on)`: waiting in the cluster's queue for what no free GPUs give (what it waits for, and the free
  GPUs no plan fitted on: it plans again when they change).
- `Suspension`: a yield request answered by giving every GPU back (control/queueing.py).
The other kinds carry nothing. A state's data goes with it: leaving TRAINING for RECOVERING drops the staged
switch, and the failure exists only while recovering. Every state names its kind as `.kind`. Pure.

The machine (control/controller.Controller runs it, one handler per kind):
  [WAITING ->] DISCOVERING -> PLANNING -> LAUNCHING -> TRAINING -> DONE
       ^                         ^            |   \\
       |                         |            |    v  spot notice for a node of the plan
       |                     RECOVERING <-----+  DRAINING: snapshot now, drop the node
       +--------------------------------------------+
  QUEUED: no plan trains on the GPUs free to the job while other jobs hold GPUs of the cluster: the job waits in
  its cluster's queue (`JobQueue`, by priority, then first come first served), looks again every QUEUE_POLL_S and
  goes on to planning when it is first in line and a plan fits; past `queue_timeout_s` it fails with exit code 2
  naming the holders. Without a queue it fails at once. The first in line asks running jobs of lower priority
  for GPUs, or, sharing the fleet by weight, the jobs whose nodes that share gives it (control/share.py); an
  asked job gives nodes back at a step boundary through DRAINING, or, where what it keeps trains no plan,
  suspends (its committed step kept off the GPUs: StatePlane.suspend) and goes to QUEUED (control/queueing.py).
  WAITING (jobs with a `fleet:`): the fleet's demand stands on Ray's autoscaler (orchestrator/cluster/capacity.py)
  until every type's minimum is up; past `fleet.wait_s` the job fails with exit code 2 naming the missing types.
  The demand stands while the job runs (a preempted node is replaced; a scale check moves onto it) and is
  withdrawn at DONE or FAILED (control/capacity_watch.py).
  A worker failure goes to RECOVERING or FAILED by the failure policy (control/failure.py). A job started with a
  user's plan begins at LAUNCHING.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

from orchestrator.control.timeline import Joining, Staged, SwitchTimeline
from orchestrator.errors import WorkerFailure

if TYPE_CHECKING:
    from orchestrator.control.protocols import YieldRequest

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

    kind: State  # itself: every state, with data or without, names its kind as `.kind` (no call to ask it)


for _s in State:
    _s.kind = _s


def present(value: T | None, what: str, state: State) -> T:
    """`value`, which the state machine holds in `state`; its absence is a bug in the controller, said as such."""
    if value is None:
        raise RuntimeError(f"no {what} (state {state.value})")
    return value


@dataclass(frozen=True)
class Recovering:
    failure: WorkerFailure
    detected_s: float  # since the job started
    kind: ClassVar[State] = State.RECOVERING


@dataclass
class Training:
    staged: Staged | None = None  # a notice's next plan, its new ranks' warm workers starting
    join: Joining | None = None  # a join's chosen move, waiting for the joined nodes' warm workers
    kind: ClassVar[State] = State.TRAINING


@dataclass(frozen=True)
class Draining:
    timeline: SwitchTimeline
    staged: Staged | None  # the pre-staged plan it launches (None: it discovers and plans afresh)
    kind: ClassVar[State] = State.DRAINING


@dataclass(frozen=True)
class Queued:
    wants: str  # what it waits for, for its phase and its timeout's message
    on: tuple  # the free GPUs no plan fitted on (planning again waits for a change; empty: any change)
    kind: ClassVar[State] = State.QUEUED


@dataclass(frozen=True)
class Suspension:
    """A higher-priority job asked for GPUs without which no plan trains: every GPU goes back at this boundary."""

    request: YieldRequest
    nodes: list[str]
    why: str


Phase = State | Recovering | Training | Draining | Queued


S = TypeVar("S", Recovering, Training, Draining, Queued)


def expect(phase: Phase, cls: type[S]) -> S:
    """The current state's record, which the state machine holds in this state; another is a bug, said as such."""
    if not isinstance(phase, cls):
        raise RuntimeError(f"expected state {cls.kind.value}, in {phase.kind.value}")
    return phase
