"""The job controller: an explicit state machine that can be stepped, policies that decide, an executor.

States (one job):
  DISCOVERING -> PLANNING -> LAUNCHING -> TRAINING -> DONE
                                 ^            |
                                 |            v  worker failure: the policy decides
                             RECOVERING <- (re-plan) | FAILED (abort)

Side effects sit behind two small protocols, so unit tests drive `step()` with
fakes: `NodeSource.discover() -> ClusterSpec` and a `WorkerGroup` built from a
Plan (start, step, export/import state, shutdown). Policies are pure functions
returning decision dataclasses (Ray Train v2's controller does the same); the
controller only executes them and logs the cause.

Committed step: step s is committed when every worker returned its result for
s. A snapshot of the canonical state is kept every `snapshot_every` committed
steps; after a failure the job re-plans on the survivors, restores the newest
snapshot, and resumes at the step after it, so no sample is lost or repeated.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from planner import ClusterSpec, Plan, PlanningError
from planner.search import Planner
from planner.specs import ModelSpec, TrainSpec

log = logging.getLogger("hetspot.controller")


class State(enum.Enum):
    DISCOVERING = "discovering"
    PLANNING = "planning"
    LAUNCHING = "launching"
    TRAINING = "training"
    RECOVERING = "recovering"
    DRAINING = "draining"  # spot-notice drain; entered by the preemption work, not yet here
    DONE = "done"
    FAILED = "failed"


class WorkerFailure(Exception):
    """A worker (or its node) failed; `where` names rank, stage and node."""

    def __init__(self, where: str, cause: str):
        super().__init__(f"{where}: {cause}")
        self.where, self.cause = where, cause


class NodeSource(Protocol):
    def discover(self) -> ClusterSpec: ...


class WorkerGroup(Protocol):
    def start(self) -> None: ...
    def step(self, step_index: int) -> float: ...  # the committed step's loss
    def export_state(self) -> tuple[dict, float]: ...
    def import_state(self, state: dict, optimizer_steps: float) -> None: ...
    def shutdown(self) -> None: ...


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


def failure_policy(failure: WorkerFailure, restarts: int, max_restarts: int) -> Decision:
    """Re-plan on the survivors while restarts remain; then abort with the cause."""
    if restarts >= max_restarts:
        return Abort(f"{failure} (gave up after {restarts} re-plans)")
    return Replan(str(failure))


@dataclass
class Progress:
    committed: int = -1  # last committed step
    losses: dict[int, float] = field(default_factory=dict)
    snapshot: tuple[int, dict, float] | None = None  # (step, state, optimizer steps)
    restarts: int = 0
    step_time_s: dict[int, float] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)  # transitions, for status and tests


class Controller:
    def __init__(self, model: ModelSpec, train: TrainSpec, steps: int, nodes: NodeSource,
                 make_group: Callable[[Plan], WorkerGroup], max_restarts: int = 3, snapshot_every: int = 1):
        self.model, self.train, self.steps = model, train, steps
        self.nodes, self.make_group = nodes, make_group
        self.max_restarts, self.snapshot_every = max_restarts, snapshot_every
        self.planner = Planner(model, train)  # keeps its cost caches across re-plans
        self.state = State.DISCOVERING
        self.progress = Progress()
        self.cluster: ClusterSpec | None = None
        self.plan: Plan | None = None
        self.group: WorkerGroup | None = None
        self.error: str | None = None

    # -- the state machine -------------------------------------------------------
    def step(self) -> State:
        """Run one transition and return the new state."""
        handler = {
            State.DISCOVERING: self._discover, State.PLANNING: self._plan, State.LAUNCHING: self._launch,
            State.TRAINING: self._train, State.RECOVERING: self._recover,
        }.get(self.state)
        if handler is not None:
            before = self.state
            self.state = handler()
            self.progress.history.append(f"{before.value}->{self.state.value}")
        return self.state

    def run(self) -> State:
        while self.state not in (State.DONE, State.FAILED):
            self.step()
        return self.state

    def _discover(self) -> State:
        self.cluster = self.nodes.discover()
        log.info("discovered %d GPUs on %d nodes", self.cluster.num_gpus, len(self.cluster.nodes))
        return State.PLANNING

    def _plan(self) -> State:
        try:
            self.plan = self.planner.plan(self.cluster)
        except PlanningError as e:
            return self._fail(f"no plan on the {self.cluster.num_gpus} GPUs left: {e}")
        log.info("planned %d pipelines, predicted %.0f tokens/s", len(self.plan.pipelines), self.plan.estimate.tokens_per_s)
        return State.LAUNCHING

    def _launch(self) -> State:
        self.group = self.make_group(self.plan)
        try:
            self.group.start()
            if self.progress.snapshot is not None:
                _, state, opt_steps = self.progress.snapshot
                self.group.import_state(state, opt_steps)
        except WorkerFailure as e:
            return self._decide(e)
        return State.TRAINING

    def _train(self) -> State:
        s = self.progress.committed + 1
        if s >= self.steps:
            self.group.shutdown()
            return State.DONE
        try:
            t0 = time.perf_counter()
            loss = self.group.step(s)
            self.progress.step_time_s[s] = time.perf_counter() - t0
            self.progress.committed, self.progress.losses[s] = s, loss
            if (s + 1) % self.snapshot_every == 0:
                state, opt_steps = self.group.export_state()
                self.progress.snapshot = (s, state, opt_steps)
        except WorkerFailure as e:
            return self._decide(e)
        return State.TRAINING

    def _recover(self) -> State:
        # Work after the newest snapshot is not committed any more: roll back to it.
        snap = self.progress.snapshot
        self.progress.committed = snap[0] if snap else -1
        keep = self.progress.committed
        self.progress.losses = {k: v for k, v in self.progress.losses.items() if k <= keep}
        self.progress.step_time_s = {k: v for k, v in self.progress.step_time_s.items() if k <= keep}
        return State.DISCOVERING

    # -- the executor of decisions -------------------------------------------------
    def _decide(self, failure: WorkerFailure) -> State:
        decision = failure_policy(failure, self.progress.restarts, self.max_restarts)
        log.warning("worker failure: %s -> %s", failure, type(decision).__name__)
        if self.group is not None:
            self.group.shutdown()
        if isinstance(decision, Replan):
            self.progress.restarts += 1
            return State.RECOVERING
        return self._fail(decision.reason if isinstance(decision, Abort) else str(failure))

    def _fail(self, reason: str) -> State:
        self.error = reason
        log.error("job failed: %s", reason)
        return State.FAILED
