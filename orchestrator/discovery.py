"""GPU discovery: Ray's view of the cluster, plus EC2 facts through boto3, as a planner ClusterSpec.

Side effects sit behind small sources so tests can swap them:
- `RayInventory(nodes_fn)`: per alive Ray node, the GPU count, the GPU type (the
  `accelerator_type:<T>` resource Ray sets on GPU nodes, or a `hetspot/gpu-type`
  / `ray.io/accelerator-type` label), market, zone, node name, instance type and
  id from labels, the address and Ray's node id. `nodes_fn` defaults to
  `ray.nodes`; the CLI passes the dashboard's State API for an http address.
- `EC2Facts(client, prices)`: for nodes with an instance id, the instance type,
  GPU model/count/memory (`describe_instance_types`), lifecycle (spot or
  on-demand) and zone (`describe_instances`), and the hourly price from a
  `SpotPrices` source (boto3's `describe_spot_price_history`, or a fixture).
Fake GPUs (the embedded test cluster) carry no instance id and skip EC2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

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

    def discover(self) -> list[DiscoveredNode]:
        out = []
        for n in self.nodes_fn():
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
                # Several Ray nodes can share one IP (NodeName), so the default name adds the id.
                name=labels.get("hetspot/node") or f"{n.get('NodeName', 'node')}-{n['NodeID'][:6]}",
                gpu_type=catalog_type(gpu),
                num_gpus=gpus,
                market=labels.get("hetspot/market") or labels.get("ray.io/market-type", "on-demand").lower(),
                zone=labels.get("ray.io/availability-zone", ""),
                address=n.get("NodeManagerAddress", ""),
                instance_id=labels.get("hetspot/instance-id") or labels.get("ray.io/instance-id"),
                instance_type=labels.get("hetspot/instance-type") or labels.get("ray.io/instance-type"),
                node_id=n["NodeID"],
            ))
        return sorted(out, key=lambda d: d.name)


class SpotPrices(Protocol):
    def price(self, instance_type: str, zone: str) -> float | None: ...


class FixedPrices:
    """Prices from a table {(instance_type, zone) or instance_type: $/h} (tests, or a pinned price sheet)."""

    def __init__(self, table: dict):
        self.table = table

    def price(self, instance_type: str, zone: str) -> float | None:
        return self.table.get((instance_type, zone), self.table.get(instance_type))


class Boto3SpotPrices:
    """The newest spot price per (instance type, zone) from describe_spot_price_history."""

    def __init__(self, client):
        self.client = client

    def price(self, instance_type: str, zone: str) -> float | None:
        kwargs = {"InstanceTypes": [instance_type], "ProductDescriptions": ["Linux/UNIX"], "MaxResults": 20}
        if zone:
            kwargs["AvailabilityZone"] = zone
        rows = self.client.describe_spot_price_history(**kwargs).get("SpotPriceHistory", [])
        rows.sort(key=lambda r: r["Timestamp"], reverse=True)
        return float(rows[0]["SpotPrice"]) if rows else None


class EC2Facts:
    def __init__(self, client, prices: SpotPrices | None = None):
        self.client = client
        self.prices = prices

    def enrich(self, nodes: list[DiscoveredNode]) -> list[DiscoveredNode]:
        ids = [n.instance_id for n in nodes if n.instance_id]
        if not ids:
            return nodes
        instances = {}
        for page in self.client.get_paginator("describe_instances").paginate(InstanceIds=ids):
            for res in page["Reservations"]:
                for inst in res["Instances"]:
                    instances[inst["InstanceId"]] = inst
        types = sorted({i["InstanceType"] for i in instances.values()})
        gpu_info = {t["InstanceType"]: t.get("GpuInfo") for t in
                    self.client.describe_instance_types(InstanceTypes=types)["InstanceTypes"]}
        return [self._enrich_one(n, instances.get(n.instance_id), gpu_info) for n in nodes]

    def _enrich_one(self, node: DiscoveredNode, inst: dict | None, gpu_info: dict) -> DiscoveredNode:
        if inst is None:
            return node
        itype = inst["InstanceType"]
        zone = inst.get("Placement", {}).get("AvailabilityZone", node.zone)
        market = "spot" if inst.get("InstanceLifecycle") == "spot" else "on-demand"
        info = gpu_info.get(itype) or {}
        gpus = info.get("Gpus") or []
        updates: dict[str, Any] = {"instance_type": itype, "zone": zone, "market": market}
        if gpus:
            g = gpus[0]
            mem = g.get("MemoryInfo", {}).get("SizeInMiB")
            updates |= {"gpu_type": catalog_type(g["Name"], mem), "num_gpus": int(g["Count"]),
                        "gpu_mem_gib": round(mem / 1024, 1) if mem else None}
        if self.prices is not None:
            updates["price_per_hour"] = self.prices.price(itype, zone)
        return replace(node, **updates)


def node_ids(nodes_fn: Callable[[], list[dict[str, Any]]] | None = None) -> dict[str, str]:
    """Node name (as discovery names it) -> Ray node id, for the alive GPU nodes."""
    return {d.name: d.node_id for d in RayInventory(nodes_fn).discover()}


def to_cluster_spec(nodes: list[DiscoveredNode], calibration: dict[str, float] | None = None) -> ClusterSpec:
    if not nodes:
        raise ValueError("no GPU nodes found: the cluster has no node with GPUs of a known type")
    return ClusterSpec(nodes=[n.to_spec() for n in nodes], calibration=calibration or {})


def known_types() -> list[str]:
    return sorted(CATALOG)
