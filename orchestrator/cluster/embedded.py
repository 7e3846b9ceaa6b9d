"""The embedded test cluster: a multi-node `ray.cluster_utils.Cluster` with fake GPUs.

Each job node becomes a Ray node advertising `num_gpus`, the resource
`accelerator_type:<TYPE>` (as Ray sets on real GPU nodes), and labels for GPU
type, market and node name (discovery reads the name from `hetspot/node`), and
`hetspot/fake-gpu=true`: its GPUs are pretend, so speed emulation may run there.
Health checks are tuned so a removed node is declared dead in about a second.
The dashboard binds to 127.0.0.1 only. No log monitor runs: it forwards the
workers' output to drivers, and every driver here connects with
`log_to_driver=False` (the workers' files stay in the session's logs folder),
while it polled every node's log files: 28 of the 1,062 CPU-seconds (2.6%) the
recovery and drill test modules took.
"""

from __future__ import annotations

import logging

from orchestrator.cluster.labels import LABEL_FAKE_GPU
from planner.specs import ClusterSpec

log = logging.getLogger(__name__)

# A killed node's checks fail at once (its port refuses), so it is declared dead within threshold x period,
# about a second. A live node that is slow to answer (a raylet starved beside test suites on two cores) gets a
# second per check: with a 200 ms timeout, new nodes were declared dead within 2 s of registering on a loaded
# machine and their workers died at start-up.
HEALTH = {"health_check_period_ms": 200, "health_check_failure_threshold": 5, "health_check_timeout_ms": 1000,
          "health_check_initial_delay_ms": 0}


class EmbeddedCluster:
    def __init__(self, spec: ClusterSpec, head_cpus: int = 1, object_store_mb: int | None = None):
        from ray.cluster_utils import Cluster

        self.spec = spec
        self.object_store = None if object_store_mb is None else object_store_mb << 20  # Ray's default if None
        self.cluster = Cluster(
            initialize_head=True, connect=False,
            head_node_args={"num_cpus": head_cpus, "num_gpus": 0, "include_dashboard": False,
                            "dashboard_host": "127.0.0.1", "include_log_monitor": False, "_system_config": HEALTH},
        )
        self.nodes = {}
        self.declared: dict[str, tuple] = {}  # node name -> (its NodeSpec, the labels `add` was given)
        for n in spec.nodes:
            self.nodes[n.name] = self.add(n)

    def add(self, n, labels: dict[str, str] | None = None):
        """Start a Ray node for NodeSpec `n`; `labels` adds to hetspot's (e.g. a fake metadata-service URL)."""
        extra = {} if self.object_store is None else {"object_store_memory": self.object_store}
        self.declared[n.name] = (n, labels or {})
        return self.cluster.add_node(
            num_cpus=n.num_gpus, num_gpus=n.num_gpus, **extra,
            resources={f"accelerator_type:{n.gpu_type}": 1},
            labels={"hetspot/gpu-type": n.gpu_type, "hetspot/market": n.market, "hetspot/node": n.name,
                    LABEL_FAKE_GPU: "true"} | (labels or {}),
        )

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name))
        self.declared.pop(name, None)

    def idle(self, names: list[str], wait_s: float = 5.0) -> set[str]:
        """Which of these nodes are up with their CPUs, GPUs and custom resources all free (no actor left on them),
        as Ray reports them within `wait_s` (an actor's resources come back a moment after it is killed)."""
        import time

        import ray
        from ray._private.state import available_resources_per_node

        ids = {self.nodes[n].node_id: n for n in names if n in self.nodes}
        until = time.monotonic() + wait_s
        while True:
            total = {x["NodeID"]: x["Resources"] for x in ray.nodes() if x["Alive"] and x["NodeID"] in ids}
            free = available_resources_per_node()
            idle = {ids[i] for i, res in total.items()
                    if all(free.get(i, {}).get(k, 0.0) >= v for k, v in res.items()
                           if k not in ("memory", "object_store_memory") and not k.startswith("node:"))}
            if idle == set(ids.values()) or time.monotonic() > until:
                return idle
            time.sleep(0.2)

    @property
    def address(self) -> str:
        return self.cluster.address

    def connect(self) -> None:
        import ray

        ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
