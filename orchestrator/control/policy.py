"""The controller's policy knobs, passed whole (runtime/controller_actor.make_controller reads them from the job's
`runtime:` section; docs/jobfile.md says what each does). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.control.replan import TOLERANCE


@dataclass(frozen=True)
class Policy:
    max_restarts: int = 100  # re-plans after failures before the job gives up (runtime.max_restarts)
    max_stalled: int = 5  # failures in a row losing no node, no step between (max_failures_without_progress)
    snapshot_every: int = 1  # steps between peer snapshots (the whole-state fake's, MemorySnapshots)
    drain_margin_s: float = 1.0  # a notice drains only when its copy fits with this to spare
    scale_check_every: int = 0  # steps between weighings of joined nodes and freed GPUs (0: never)
    replan_tolerance: float = TOLERANCE  # how much throughput a re-plan may give for fewer bytes moved
    queue_timeout_s: float = 3600.0  # how long a job waits in the cluster's queue for its GPUs
    replan_user_plan: bool = False  # a plan given with --plan is replaced after a node loss (--replan-on-loss)
