"""EC2 facts through boto3: instance type, GPU model/count/memory, lifecycle, zone and spot price.

`EC2Facts(client, prices)` enriches discovered nodes that carry an instance id:
the instance type, GPU model/count/memory (`describe_instance_types`),
lifecycle (spot or on-demand) and zone (`describe_instances`), and the hourly
price from a `SpotPrices` source (boto3's `describe_spot_price_history`, or a
fixed table). Fake GPUs (the embedded test cluster) carry no instance id and
skip EC2. boto3 clients are passed in, so tests use moto's HTTP server.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from orchestrator.cluster.discovery import DiscoveredNode, catalog_type


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
