"""What the parts of the controller share: the run's `Progress`, the queue's record (`QueuePlace`), and the
attributes and methods control/controller.Controller defines that its parts (control/queueing.py `Queueing`,
control/switching.py `Switching`, control/ending.py `Ending`, control/evaluation.py `Evaluating`,
control/capacity_watch.py) read, declared once for the type checker. torchtitan keeps such parts as components of
one trainer; this is their common view of the controller (as workers/engine_parts.py is of a rank's Engine). Pure
(its one side effect is a log line: a roll back to a restored step is said).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from orchestrator.control.share import FleetShare

if TYPE_CHECKING:
    from orchestrator.control.capacity import Capacity, CapacityView
    from orchestrator.control.policy import Policy
    from orchestrator.control.protocols import Clock, InterruptionSource, JobQueue, NodeSource, StatePlane, WorkerGroup
    from orchestrator.control.states import Phase, State
    from orchestrator.control.timeline import Joining, Staged, Switches, SwitchTimeline
    from orchestrator.errors import WorkerFailure
    from planner import ClusterSpec, Plan
    from planner.search import Planner
    from planner.specs import ModelSpec, TrainSpec

log = logging.getLogger("hetspot.controller")


@dataclass
class Progress:
    committed: int = -1  # last committed step
    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)  # after step s (train.eval_every): held-out loss
    snapshot_step: int | None = None  # newest step whose state is in the store
    restarts: int = 0
    drains: int = 0
    step_time_s: dict[int, float] = field(default_factory=dict)
    startup_s: float | None = None  # from the controller's start to the first step's start
    phase: str = "discovering"  # what the job is doing now, for people
    history: list[str] = field(default_factory=list)  # transitions, for status and tests
    events: list[dict] = field(default_factory=list)  # re-plans and drains with their cause
    samples: dict[int, list] = field(default_factory=dict)  # per committed step: (first sample, count) trained

    def roll_to(self, step: int) -> None:
        """Progress goes on after `step` (a restored step): later steps are redone, none skipped."""
        if step < self.committed:
            log.warning("rolling back from step %d to step %d: the steps after it are redone", self.committed, step)
        self.committed = step
        for per_step in ("losses", "val_losses", "step_time_s", "samples"):
            setattr(self, per_step, {k: v for k, v in getattr(self, per_step).items() if k <= step})


@dataclass
class QueuePlace:
    """One job's dealings with the cluster's queue, kept by its controller (`Controller.place`)."""

    queued_at: float | None = None  # when the job entered the queue (None: not queued)
    asked_on: dict | None = None  # the holders a queued job last asked lower-priority jobs about
    yielded: set[str] = field(default_factory=set)  # nodes given back to another job: doomed until the drain is done
    suspended: str | None = None  # who took its GPUs, while a suspended job waits to resume (no bound)
    share: FleetShare = field(default_factory=FleetShare)  # its reading of the weighted share (fleet_share: weighted)
    share_asked_on: dict | None = None  # the holders a running sharing job last asked for its share
    share_read: bool = False  # its share was read since the plan began (between scale checks the reading holds)
    share_keep: frozenset[str] | None = None  # the last reading: the nodes it keeps (None: no filter)
    held: dict[str, dict[str, int]] = field(default_factory=dict)  # GPUs other jobs hold, as last said in an event


class ControllerParts:
    # set in Controller.__init__ (what each is: there)
    model: ModelSpec
    train: TrainSpec
    steps: int
    policy: Policy
    planner: Planner
    nodes: NodeSource
    store: StatePlane
    clock: Clock
    sleep: Callable[[float], None]
    capacity: Capacity | None
    queue: JobQueue | None
    progress: Progress
    started_at: float
    _state: Phase
    plan: Plan | None
    cluster: ClusterSpec | None
    group: WorkerGroup | None
    doomed: set[str]
    switch: Switches
    _launch_s: float
    _plan_from: int
    place: QueuePlace
    interruptions: InterruptionSource
    error: str | None
    exit_code: int

    if TYPE_CHECKING:  # the controller's and its parts', each defined once
        @property
        def state(self) -> State: ...
        @property
        def workers(self) -> WorkerGroup: ...
        @property
        def running_plan(self) -> Plan: ...
        @property
        def running_cluster(self) -> ClusterSpec: ...
        @property
        def _timeline(self) -> SwitchTimeline: ...
        @property
        def _staged(self) -> Staged | None: ...
        @property
        def _join(self) -> Joining | None: ...
        def _missing(self, what: str) -> NoReturn: ...  # raises: a bug in the controller, said as such
        def _phase(self, phase: str) -> None: ...
        def _event(self, kind: str, cause: str, **extra: Any) -> None: ...
        def _fail(self, reason: str, exit_code: int = 1) -> State: ...
        def _decide(self, failure: WorkerFailure) -> Phase: ...
        def _substitutions(self, capacity: Capacity, view: CapacityView) -> None: ...
        def _remember(self, cluster: ClusterSpec) -> None: ...
        def _mark(self, point: str) -> None: ...
        def _join_dropped(self, why: str) -> None: ...
        def _end_drain(self, why: str) -> None: ...
        def _withdraw(self) -> None: ...
        def _not_queued_for(self, cluster: ClusterSpec) -> ClusterSpec: ...
        def _within_share(self, cluster: ClusterSpec, weigh: bool) -> ClusterSpec: ...
