"""What the controller's states carry while a drain or a move is under way (control/states.py), as typed records
(before, tuples and the keys of a dict in the event log, whose presence drove the logic):

- `Staged`: a notice's next plan, chosen while the doomed nodes still train, its new ranks' workers warming.
- `Joining`: a join's chosen plan, waiting at step boundaries for the joined nodes' warm workers.
- `SwitchTimeline`: a drain's or a move's points in time, from its notice (or decision) to the new plan's first
  step. It fills in the run's event for it (the record a person and bench/ read) as it goes, and the controller
  reads its fields, never the event's keys.
- `Switches`: the controller's record of its switches (`Controller.switch`): the timeline open, the joined nodes
  warmed, a staged drain's latest switch, and the nodes (and GPUs) the running plan was chosen among.

Pure: no Ray, no boto3, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from planner import ClusterSpec, Plan

POINTS = ("staged_s", "ready_s", "switch_s", "snapshot_s", "plan_s", "resumed_s", "first_step_s")


@dataclass(frozen=True)
class Staged:
    plan: Plan
    cluster: ClusterSpec  # what the plan was chosen among
    choice: dict | None  # the re-plan's weighing (control/replan.choose_replan), for the drain's event


@dataclass(frozen=True)
class Joining:
    plan: Plan
    cluster: ClusterSpec


@dataclass
class SwitchTimeline:
    """Seconds since the job started at each point of a switch (None: not reached). A notice's drain has a
    deadline; a join's move has none. `event` is the run's event it writes through to."""

    event: dict[str, Any]
    deadline_s: float | None = None
    staged_s: float | None = None  # the next plan chosen and its warm workers starting (a staged drain)
    ready_s: float | None = None  # those workers (and the drain's keepers) ready
    switch_s: float | None = None  # the old group stops at a step boundary
    snapshot_s: float | None = None  # the doomed nodes' state is out: they may go
    plan_s: float | None = None  # the next plan is chosen
    resumed_s: float | None = None  # the next step starts
    first_step_s: float | None = None  # the new plan's first step is committed
    stall_s: float | None = None  # no step ran from the switch to the resume
    new_workers: int | None = None  # processes the switch starts ahead (warm workers)
    ended: str | None = None  # why it closed without a step on its plan
    _set: set[str] = field(default_factory=set)

    @property
    def kind(self) -> str:
        return str(self.event.get("kind", ""))

    def put(self, key: str, value: Any) -> None:
        """Set a field and write it to the event."""
        setattr(self, key, value)
        self._set.add(key)
        self.event[key] = value

    def mark(self, point: str, now_s: Callable[[], float]) -> bool:
        """Point `point` reached now (`now_s()`, read only when the point is new); True when this closes the
        timeline (the new plan's first step). A staged drain's doomed nodes still train: until its switch, a step
        neither resumes nor is first."""
        if point not in POINTS:
            raise ValueError(f"no point {point!r} in a switch's timeline: one of {', '.join(POINTS)}")
        if point in ("resumed_s", "first_step_s") and self.switch_s is None:
            return False
        if point in self._set:
            return False
        self.put(point, round(now_s(), 3))
        if point != "first_step_s":
            return False
        if self.switch_s is not None and self.resumed_s is not None:  # no step ran in between
            self.put("stall_s", round(self.resumed_s - self.switch_s, 3))
        if self.deadline_s is not None:
            self.event["met_deadline"] = self.snapshot_s is not None and self.snapshot_s <= self.deadline_s
        return True

    def end(self, why: str) -> None:
        """Closed with no step on its plan (the job ended or failed first, or a join gave way): the event keeps
        every key of a timeline's end."""
        if "first_step_s" not in self._set:
            self.put("first_step_s", None)
        if self.deadline_s is not None and "met_deadline" not in self.event:
            self.event["met_deadline"] = self.switch_s is None or (
                self.snapshot_s is not None and self.snapshot_s <= self.deadline_s)
        self.put("ended", why)


@dataclass
class Switches:
    """The controller's switches of plan (`Controller.switch`): the one in progress, what the plan was chosen among."""

    timeline: SwitchTimeline | None = None  # the drain's or move's timeline in progress
    warmed: set[str] = field(default_factory=set)  # joined nodes whose GPUs got warm workers at once
    by: float = 0.0  # a staged drain switches by then whether its workers are ready or not
    known_nodes: set[str] | None = None  # the node set the running plan was chosen for
    known_gpus: dict[str, int] = field(default_factory=dict)  # and each node's GPUs free to the job then
