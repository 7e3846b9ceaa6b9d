"""Several jobs' autoscaler demand on one Ray cluster: Ray's `request_resources` replaces the previous request
cluster-wide, so each hetspot job keeps its own demand (orchestrator/cluster/capacity.py `DemandLedger`) and the
cluster's request is their sum. Read back here from the GCS, where the autoscaler reads it: a second job's
demand does not erase the first's, one job's withdrawal leaves the other's standing, and a driver that died
without withdrawing loses its demand at the next change."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")  # not a head nearby
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def requested(gcs_address: str) -> list[tuple[str, int]]:
    """The cluster's resource request where the autoscaler reads it: (the bundle's accelerator, how many). With
    autoscaler v2 (a `ray up` cluster's default) the GCS's cluster resource constraint; on a plain local cluster,
    v1's key-value channel, where `request_resources` writes then."""
    import json
    from collections import Counter

    from ray.autoscaler.v2.utils import is_autoscaler_v2

    def kind(bundle) -> str:
        return next(k.split(":", 1)[1] for k in bundle if k.startswith("accelerator_type:"))

    if not is_autoscaler_v2():
        from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
        return sorted(Counter(kind(b) for b in json.loads(raw or "[]")).items())
    from ray._raylet import GcsClient
    from ray.autoscaler.v2.sdk import get_cluster_resource_state

    state = get_cluster_resource_state(GcsClient(address=gcs_address))
    return sorted((kind(r.request.resources_bundle), r.count) for c in state.cluster_resource_constraints
                  for r in c.resource_requests)


def test_each_jobs_demand_stands_beside_the_others_and_goes_with_its_job_alone(cluster):
    from orchestrator.cluster.capacity import RayAutoscaler
    from orchestrator.job_spec import FleetSpec

    def fleet(gpu: str, n: int) -> FleetSpec:
        return FleetSpec(types=[{"gpu_type": gpu, "gpus_per_node": 4, "min_nodes": 1, "max_nodes": n}])

    a, b = RayAutoscaler(fleet("L4", 2), "job-a"), RayAutoscaler(fleet("T4", 3), "job-b")
    a.request({"L4": 2})
    assert requested(cluster) == [("L4", 2)]
    b.request({"T4": 3})
    assert requested(cluster) == [("L4", 2), ("T4", 3)]  # the second job's request kept the first's
    a.request({"L4": 1})  # a job that shrinks its own demand changes its own only
    assert requested(cluster) == [("L4", 1), ("T4", 3)]
    a.withdraw()
    assert requested(cluster) == [("T4", 3)]  # the first job's end left the second's demand standing
    # a driver that states demand and dies without withdrawing (killed): its entry goes at the next change
    code = (f"import ray; ray.init(address='{cluster}', logging_level='ERROR'); "
            "from orchestrator.cluster.capacity import RayAutoscaler; from orchestrator.job_spec import FleetSpec; "
            "RayAutoscaler(FleetSpec(types=[{'gpu_type': 'A10G', 'gpus_per_node': 4, 'min_nodes': 1, "
            "'max_nodes': 1}]), 'job-ghost').request({'A10G': 1})")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert ("A10G", 1) in requested(cluster)  # stated while its driver lived
    b.request({"T4": 2})
    assert requested(cluster) == [("T4", 2)]
    b.withdraw()
    assert requested(cluster) == []
