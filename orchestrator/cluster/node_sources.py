"""Node sources for the controller (the `NodeSource` protocol in orchestrator/control/protocols.py).

- `DeclaredNodes`: the job's `cluster:` nodes that Ray still reports alive, with
  the job's specs (bandwidths, prices); used on the embedded test cluster.
- `LiveNodes`: a running cluster's GPU nodes as Ray reports them, each with the GPUs free to this job (other
  jobs' GPUs left out: orchestrator/cluster/holders.py), calibrated by the profiling pass once per GPU type on
  free GPUs only; used by `hetspot submit --address`.

Both say who holds the GPUs they leave out (`held`: node name -> {holder: GPUs}).
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
        self.held: dict[str, dict[str, int]] = {}  # the embedded cluster runs one job

    def discover(self) -> ClusterSpec:
        alive = {n.name for n in RayInventory().discover()}
        self._found = self.declared.model_copy(update={"nodes": [n for n in self.declared.nodes if n.name in alive]})
        return self._found

    def whole(self) -> ClusterSpec:  # one job: what it discovered is all there is
        return getattr(self, "_found", self.declared)


class LiveNodes:
    def __init__(self, profile: bool = True, job: str | None = None):
        self.profile = profile
        self.job = job  # the hetspot job id (None: this process's, holders.job_id)
        self.calibration: dict[str, float] = {}
        self.host_adamw: dict[str, float] = {}  # per GPU type: its nodes' measured host AdamW rate
        self.notes: dict[str, str] = {}  # per GPU type: what profiling measured, or why it skipped
        self.held: dict[str, dict[str, int]] = {}  # node -> {holder: GPUs} not free to this job

    def discover(self) -> ClusterSpec:
        from orchestrator.cluster.holders import ray_free_for_job
        from orchestrator.cluster.profiling import profile_cluster

        everything = RayInventory().discover()
        nodes, self.held = ray_free_for_job(everything, self.job)
        self._everything = everything
        if not nodes:  # every GPU is another's: the controller says whose
            return ClusterSpec.model_construct(nodes=[], calibration={})
        # the profiling pass pins one GPU of a node of each type: a free one (a node left here has one free)
        new = [n for n in nodes if n.gpu_type not in self.notes]
        if self.profile and new:
            cal, notes, rates = profile_cluster(new)
            self.calibration |= cal
            self.notes |= notes
            self.host_adamw |= rates
        return to_cluster_spec(nodes, self.calibration, self.host_adamw)

    def whole(self) -> ClusterSpec:
        """Every GPU node seen at the last discovery with all its GPUs, whoever holds them (a waiting job weighs
        what lower-priority jobs could give back), calibrated as far as profiling got."""
        everything = getattr(self, "_everything", [])
        if not everything:
            return ClusterSpec.model_construct(nodes=[], calibration={})
        return to_cluster_spec(everything, self.calibration, self.host_adamw)
