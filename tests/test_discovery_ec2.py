"""EC2 discovery through boto3 against moto's threaded HTTP server (not in-process patching)."""

import boto3
import pytest

from orchestrator.cluster.discovery import (
    DiscoveredNode,
    RayInventory,
    catalog_type,
    to_cluster_spec,
)
from orchestrator.cluster.ec2 import EC2Facts, FixedPrices
from tests.moto_s3 import moto_server

pytestmark = pytest.mark.unit

# moto's spot prices are a constant, so prices come from this fixture.
PRICES = FixedPrices({"p4d.24xlarge": 9.83, "g5.12xlarge": 2.05, "g4dn.12xlarge": 1.17, "p3dn.24xlarge": 9.36})
FLEET = [  # (instance type, spot?) ; moto has no p3.2/8/16xlarge, p3dn.24xlarge is the p3 family's V100-32GB
    ("p4d.24xlarge", False), ("g5.12xlarge", True), ("g4dn.12xlarge", True), ("p3dn.24xlarge", True),
]
EXPECT = {"p4d.24xlarge": ("A100-40GB", 8, 40.0), "g5.12xlarge": ("A10G", 4, 22.4),
          "g4dn.12xlarge": ("T4", 4, 16.0), "p3dn.24xlarge": ("V100-32GB", 8, 32.0)}


@pytest.fixture(scope="module")
def ec2():
    with moto_server() as url:
        yield boto3.client("ec2", region_name="us-east-1", endpoint_url=url,
                           aws_access_key_id="testing", aws_secret_access_key="testing")


def test_mixed_fleet_maps_to_gpu_types_counts_memory(ec2):
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    ray_nodes = []
    for i, (itype, spot) in enumerate(FLEET):
        extra = {"InstanceMarketOptions": {"MarketType": "spot"}} if spot else {}
        inst = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType=itype, **extra)["Instances"][0]
        # What Ray reports for the node: GPUs and an instance id label; the type comes from EC2.
        ray_nodes.append({"NodeID": f"{i:040x}", "Alive": True, "NodeManagerAddress": f"10.0.0.{i}",
                          "Resources": {"GPU": 1.0, "accelerator_type:L4": 1.0},
                          "Labels": {"hetspot/node": f"node-{i}", "ray.io/instance-id": inst["InstanceId"]}})
    nodes = EC2Facts(ec2, PRICES).enrich(RayInventory(lambda: ray_nodes).discover())
    by_type = {n.instance_type: n for n in nodes}
    assert set(by_type) == set(EXPECT)
    for itype, (gpu, count, mem) in EXPECT.items():
        n = by_type[itype]
        assert (n.gpu_type, n.num_gpus, n.gpu_mem_gib) == (gpu, count, mem), itype
        assert n.market == ("on-demand" if itype == "p4d.24xlarge" else "spot")
        assert n.zone.startswith("us-east-1") and n.price_per_hour == PRICES.price(itype, n.zone)
    spec = to_cluster_spec(nodes)
    assert spec.num_gpus == 24 and {n.gpu_type for n in spec.nodes} == {"A100-40GB", "A10G", "T4", "V100-32GB"}
    # the profiling pass's host AdamW rate (by GPU type) becomes each such node's, the others keep the default
    measured = to_cluster_spec(nodes, {"T4": 0.4}, {"T4": 3.0e9})
    for n in measured.nodes:
        assert n.cpu_adam_params_per_s == (3.0e9 if n.gpu_type == "T4" else spec.nodes[0].cpu_adam_params_per_s)
    assert measured.calibration == {"T4": 0.4}


def test_catalog_names():
    assert catalog_type("A100", 81920) == "A100-80GB"
    assert catalog_type("NVIDIA V100", 16384) == "V100-16GB"
    assert catalog_type("H100", 81920) == "H100-SXM"
    assert catalog_type("L40S") == "L40S"


def test_nodes_without_gpus_or_instance_ids():
    nodes = [{"NodeID": "a" * 40, "Alive": True, "Resources": {"CPU": 4.0}},
             {"NodeID": "b" * 40, "Alive": False, "Resources": {"GPU": 2.0, "accelerator_type:T4": 1.0}},
             {"NodeID": "c" * 40, "Alive": True, "Resources": {"GPU": 2.0, "accelerator_type:T4": 1.0}}]
    found = RayInventory(lambda: nodes).discover()
    assert [(n.gpu_type, n.num_gpus, n.instance_id) for n in found] == [("T4", 2, None)]
    assert EC2Facts(client=None).enrich(found) == found  # fake GPUs: no EC2 call at all
    assert isinstance(found[0], DiscoveredNode)
