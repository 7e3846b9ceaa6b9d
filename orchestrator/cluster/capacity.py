"""The fleet's demand on a Ray cluster: `RayAutoscaler` executes orchestrator/control/capacity.py's decisions.

It counts GPU nodes by type (discovery) and states the demand with Ray's
`ray.autoscaler.sdk.request_resources`, one bundle per node, summed over the
cluster's hetspot jobs (`DemandLedger`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from orchestrator.control.capacity import Capacity

log = logging.getLogger("hetspot.capacity")


def ray_capacity(job, now: Callable[[], float], job_id: str = "") -> Capacity:
    """A Capacity that asks the connected Ray cluster's autoscaler for the job's fleet: the types it names, or
    (`fleet.auto`) the fleet chosen from its catalog, chosen again when a type does not come. `job_id` keeps the
    job's demand apart from other jobs' (DemandLedger)."""
    rechoose, fleet = None, job.fleet
    if fleet.auto is not None:
        from orchestrator.control.fleet_choice import Rechooser

        rechoose = Rechooser(job)
        fleet = rechoose.first()
    ray_side = RayAutoscaler(fleet, job_id or job.name)
    if rechoose is not None:
        rechoose.on_new = ray_side.use
    return Capacity(fleet, ray_side.count_up, ray_side.request, now, ray_side.withdraw, rechoose=rechoose)


def unservable(fleet, node_types: dict) -> list[str]:
    """The fleet's types no node type of an autoscaler config (`available_node_types`) can serve: none carries
    the type's `hetspot/gpu-type` label with at least its GPUs per node and room for a node (max_workers > 0).
    Each as a sentence naming the type and what the config has; empty when every type can come."""
    from orchestrator.cluster.labels import LABEL_GPU_TYPE

    out = []
    for t in fleet.types:
        same = {name: nt for name, nt in node_types.items()
                if (nt.get("labels") or {}).get(LABEL_GPU_TYPE) == t.gpu_type}
        fits = [name for name, nt in same.items() if nt.get("resources", {}).get("GPU", 0) >= t.gpus_per_node
                and nt.get("max_workers", 0) > 0]
        if not fits:
            have = ", ".join(f"{name} ({nt.get('resources', {}).get('GPU', 0)} GPUs, at most "
                             f"{nt.get('max_workers', 0)})" for name, nt in sorted(same.items())) or "none"
            out.append(f"{t.gpu_type} nodes of {t.gpus_per_node} GPUs (the cluster's {t.gpu_type} node types: {have})")
    return out


def demand_bundles(demand: dict[str, int], gpus: dict[str, int], resource: dict[str, str]):
    """(bundles, their label selectors) for `request_resources`: one whole node per bundle, of the GPU type's
    resource shape, on a node labelled with exactly that type."""
    from orchestrator.cluster.labels import LABEL_GPU_TYPE

    types = [t for t, n in sorted(demand.items()) for _ in range(n)]
    return ([{"GPU": gpus[t], f"accelerator_type:{resource[t]}": 1} for t in types],
            [{LABEL_GPU_TYPE: t} for t in types])


class RayAutoscaler:
    """The executor on Ray: counts GPU nodes by type (discovery) and states demand with request_resources, one
    bundle per node: its GPUs and the `accelerator_type:<T>` resource its nodes carry (`ray_resource`, default
    the name Ray itself gives that GPU: A100, L4, T4, ...), and a label selector on `hetspot/gpu-type`, so the
    autoscaler launches the flavour asked for where two share Ray's name (A100-40GB and A100-80GB are both
    `A100`: without the selector an A100-80GB demand could start an A100-40GB node)."""

    def __init__(self, fleet, job_id: str):
        self.gpus: dict[str, int] = {}
        self.resource: dict[str, str] = {}
        self.ledger = DemandLedger(job_id)
        self.use(fleet)

    def use(self, fleet) -> None:
        """Know the node shape of each of the fleet's types (a chosen fleet's types change when it is chosen
        again; the old ones are kept for what is still up)."""
        from orchestrator.cluster.node_kinds import NODE_KINDS

        self.gpus |= {t.gpu_type: t.gpus_per_node for t in fleet.types}
        self.resource |= {t.gpu_type: t.ray_resource or (NODE_KINDS[t.gpu_type].ray_accelerator
                                                         if t.gpu_type in NODE_KINDS else t.gpu_type)
                          for t in fleet.types}

    def count_up(self) -> dict[str, int]:
        from orchestrator.cluster.discovery import RayInventory

        counts: dict[str, int] = {}
        for n in RayInventory().discover():
            counts[n.gpu_type] = counts.get(n.gpu_type, 0) + 1
        return counts

    def request(self, demand: dict[str, int]) -> None:
        bundles, selectors = demand_bundles(demand, self.gpus, self.resource)
        log.info("asking the autoscaler for %s", ", ".join(f"{n}x {t}" for t, n in sorted(demand.items()) if n))
        self.ledger.state(bundles, selectors)

    def withdraw(self) -> None:
        self.ledger.withdraw()
        log.info("withdrew the job's demand for GPU nodes: the autoscaler may scale them down (other jobs' demand "
                 "stands)")


class DemandLedger:
    """Every hetspot job's autoscaler demand on one Ray cluster, kept apart, and the cluster's one request their
    sum. Ray's `request_resources` replaces the previous call cluster-wide: a job stating its own fleet alone
    would erase another job's, and its withdrawal would clear both. So each job keeps its bundles under its own
    key in the GCS's key-value store (namespace `hetspot-demand`), and every change re-states the sum of all the
    entries of jobs still alive (an entry whose Ray job is dead, a driver killed before it withdrew, is dropped
    at the next change). Two jobs changing at once each re-read the entries after their request and request
    again until they read what they asked for, so the last request made holds both."""

    NAMESPACE = "hetspot-demand"

    def __init__(self, job_id: str):
        self.job_id = job_id

    def state(self, bundles: list[dict], selectors: list[dict]) -> None:
        import json

        import ray
        from ray.experimental.internal_kv import _internal_kv_put

        entry = {"bundles": bundles, "selectors": selectors, "ray_job": ray.get_runtime_context().get_job_id()}
        _internal_kv_put(self.job_id, json.dumps(entry), namespace=self.NAMESPACE)
        self._request_sum()

    def withdraw(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        _internal_kv_del(self.job_id, namespace=self.NAMESPACE)
        self._request_sum()

    def entries(self) -> dict[str, dict]:
        """job id -> its entry, of jobs whose Ray job is alive (the dead ones' entries deleted)."""
        from orchestrator.cluster.job_entries import live_entries

        return live_entries(self.NAMESPACE, "autoscaler demand")

    def _request_sum(self) -> None:
        from ray.autoscaler.sdk import request_resources

        asked = None
        for _ in range(5):
            entries = self.entries()
            if entries == asked:
                return
            bundles = [b for _, e in sorted(entries.items()) for b in e["bundles"]]
            selectors = [x for _, e in sorted(entries.items()) for x in e["selectors"]]
            request_resources(bundles=bundles, bundle_label_selectors=selectors)
            asked = entries
