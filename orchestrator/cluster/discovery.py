"""GPU discovery from Ray: each alive GPU node as a `DiscoveredNode`, and the planner's ClusterSpec.

`RayInventory(nodes_fn)`: per alive Ray node, the GPU count, the GPU type (the
`accelerator_type:<T>` resource Ray sets on GPU nodes, or a `hetspot/gpu-type`
/ `ray.io/accelerator-type` label), market, zone, node name, instance type and
id from labels, the address, Ray's node id, and whether its GPUs are fake
(`hetspot/fake-gpu=true`: the embedded and test clusters set it; speed emulation
runs only there). `nodes_fn` defaults to
`ray.nodes`; the CLI passes the dashboard's State API for an http address.
EC2 facts are added by `orchestrator/cluster/ec2.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.cluster.labels import LABEL_FAKE_GPU
from planner.catalog import CATALOG, canonical_gpu_type
from planner.specs import ClusterSpec, NodeSpec


@dataclass(frozen=True)
class DiscoveredNode:
    name: str
    gpu_type: str
    num_gpus: int
    market: str = "on-demand"
    zone: str = ""
    address: str = ""
    instance_id: str | None = None
    instance_type: str | None = None
    gpu_mem_gib: float | None = None
    price_per_hour: float | None = None
    node_id: str = ""  # Ray's node id: placement pins bundles to it (label ray.io/node-id)
    fake: bool = False  # its GPUs are pretend (LABEL_FAKE_GPU): the only nodes where speed is emulated
    num_cpus: int = 0  # the CPUs Ray counts on the node

    def to_spec(self) -> NodeSpec:
        return NodeSpec(name=self.name, gpu_type=self.gpu_type, num_gpus=self.num_gpus,
                        market="spot" if self.market == "spot" else "on-demand", zone=self.zone,
                        price_per_hour=self.price_per_hour, instance_type=self.instance_type,
                        instance_id=self.instance_id)


def catalog_type(gpu_name: str, mem_mib: int | None = None) -> str:
    """Map a vendor GPU name (EC2's GpuInfo, Ray's accelerator type) and memory to a catalog row."""
    name = gpu_name.strip().upper().replace("NVIDIA", "").replace("TESLA", "").strip(" -_")
    gib = (mem_mib or 0) / 1024
    by_memory = {"A100": ("A100-40GB", "A100-80GB", 60), "V100": ("V100-16GB", "V100-32GB", 24)}
    if name in by_memory:
        small, large, cut = by_memory[name]
        return large if gib > cut else small
    if name in ("H100", "H100-SXM", "H100-80GB"):
        return "H100-SXM"
    return canonical_gpu_type(name)


class RayInventory:
    def __init__(self, nodes_fn: Callable[[], list[dict[str, Any]]] | None = None):
        if nodes_fn is None:
            import ray

            nodes_fn = ray.nodes
        self.nodes_fn = nodes_fn

    def discover(self, nodes: list[dict[str, Any]] | None = None) -> list[DiscoveredNode]:
        """The GPU nodes among `nodes` (Ray's node list as already read), or among `nodes_fn()`'s."""
        out = []
        for n in self.nodes_fn() if nodes is None else nodes:
            res, labels = n.get("Resources", {}), n.get("Labels", {}) or {}
            gpus = int(res.get("GPU", 0))
            if not n.get("Alive", True) or gpus == 0:
                continue
            gpu = labels.get("hetspot/gpu-type") or labels.get("ray.io/accelerator-type")
            if gpu is None:
                gpu = next((k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")), None)
            if gpu is None:
                continue  # a GPU node whose type nobody told us; EC2 facts may still name it
            out.append(DiscoveredNode(
                # Several Ray nodes can share one IP (NodeName), so the default name adds a short digest of the
                # id (ids of nodes from one provider can share long prefixes; their digests do not).
                name=labels.get("hetspot/node") or f"{n.get('NodeName', 'node')}-{_short(n['NodeID'])}",
                gpu_type=catalog_type(gpu),
                num_gpus=gpus,
                market=labels.get("hetspot/market") or labels.get("ray.io/market-type", "on-demand").lower(),
                zone=labels.get("ray.io/availability-zone", ""),
                address=n.get("NodeManagerAddress", ""),
                instance_id=labels.get("hetspot/instance-id") or labels.get("ray.io/instance-id"),
                instance_type=labels.get("hetspot/instance-type") or labels.get("ray.io/instance-type"),
                node_id=n["NodeID"],
                fake=labels.get(LABEL_FAKE_GPU) == "true", num_cpus=int(res.get("CPU", 0)),
            ))
        return sorted(out, key=lambda d: d.name)


def _short(node_id: str) -> str:
    import hashlib

    return hashlib.sha256(node_id.encode()).hexdigest()[:6]


def node_ids(nodes_fn: Callable[[], list[dict[str, Any]]] | None = None) -> dict[str, str]:
    """Node name (as discovery names it) -> Ray node id, for the alive GPU nodes."""
    return {d.name: d.node_id for d in RayInventory(nodes_fn).discover()}


def fake_gpu_nodes(nodes_fn: Callable[[], list[dict[str, Any]]] | None = None) -> set[str]:
    """The alive GPU nodes (as discovery names them) whose GPUs say they are fake."""
    return {d.name for d in RayInventory(nodes_fn).discover() if d.fake}


def to_cluster_spec(nodes: list[DiscoveredNode], calibration: dict[str, float] | None = None,
                    host_adamw: dict[str, float] | None = None) -> ClusterSpec:
    """The planner's cluster: the nodes, the profiling pass's matmul efficiency by GPU type, and its measured
    host AdamW rate by GPU type as each such node's `cpu_adam_params_per_s` (else the planner's default)."""
    if not nodes:
        raise ValueError("no GPU nodes found: the cluster has no node with GPUs of a known type")
    rates = host_adamw or {}
    specs = [n.to_spec() for n in nodes]
    specs = [s.model_copy(update={"cpu_adam_params_per_s": rates[s.gpu_type]}) if s.gpu_type in rates else s
             for s in specs]
    return ClusterSpec(nodes=specs, calibration=calibration or {})


def known_types() -> list[str]:
    return sorted(CATALOG)
