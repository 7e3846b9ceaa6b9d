"""Node sources for the controller (the `NodeSource` protocol in orchestrator/control/protocols.py).

- `DeclaredNodes`: the job's `cluster:` nodes that Ray still reports alive, with
  the job's specs (bandwidths, prices); used on the embedded test cluster.
- `LiveNodes`: a running cluster's GPU nodes as Ray reports them, calibrated by
  the profiling pass once per GPU type; used by `hetspot submit --address`.
"""

from __future__ import annotations

from orchestrator.cluster.discovery import RayInventory, to_cluster_spec
from planner import ClusterSpec


class DeclaredNodes:
    def __init__(self, declared: ClusterSpec | None):
        if declared is None:
            raise ValueError("the job file declares no cluster: add `cluster: {nodes: [...]}` to it, or run on a live "
                             "Ray cluster")
        self.declared = declared
        self.notes: dict[str, str] = {}

    def discover(self) -> ClusterSpec:
        alive = {n.name for n in RayInventory().discover()}
        return self.declared.model_copy(update={"nodes": [n for n in self.declared.nodes if n.name in alive]})


class LiveNodes:
    def __init__(self, profile: bool = True):
        self.profile = profile
        self.calibration: dict[str, float] = {}
        self.host_adamw: dict[str, float] = {}  # per GPU type: its nodes' measured host AdamW rate
        self.notes: dict[str, str] = {}  # per GPU type: what profiling measured, or why it skipped

    def discover(self) -> ClusterSpec:
        from orchestrator.cluster.profiling import profile_cluster

        nodes = RayInventory().discover()
        new = [n for n in nodes if n.gpu_type not in self.notes]
        if self.profile and new:
            cal, notes, rates = profile_cluster(new)
            self.calibration |= cal
            self.notes |= notes
            self.host_adamw |= rates
        return to_cluster_spec(nodes, self.calibration, self.host_adamw)
