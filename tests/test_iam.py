"""deploy/aws/iam/ against Ray's own AWS node provider on moto's EC2 with moto's IAM enforcement on:
credentials holding exactly the shipped head policy create, tag, list and terminate worker instances the way
the head's autoscaler does; the node policy cannot launch (the error names the action) and reaches only the
checkpoint bucket; the head may pass the node role and nothing wider."""

import json
from pathlib import Path

import boto3
import pytest

from tests.moto_s3 import moto_server

pytestmark = pytest.mark.unit
IAM = Path(__file__).resolve().parents[1] / "deploy" / "aws" / "iam"
ACCOUNT = "123456789012"  # moto's
BUCKET = "ckpt"


def policy(role: str) -> dict:
    text = (IAM / f"{role}-policy.json").read_text()
    return json.loads(text.replace("ACCOUNT_ID", ACCOUNT).replace("BUCKET", BUCKET))


@pytest.fixture(scope="module")
def aws():
    """moto's server; an IAM user per role holding exactly that role's policy; a subnet and an image to launch."""
    with moto_server() as url:
        admin = {"endpoint_url": url, "region_name": "us-east-1", "aws_access_key_id": "testing",
                 "aws_secret_access_key": "testing"}
        iam, ec2 = boto3.client("iam", **admin), boto3.client("ec2", **admin)
        keys = {}
        for role in ("head", "node"):
            iam.create_user(UserName=role)
            iam.put_user_policy(UserName=role, PolicyName="hetspot", PolicyDocument=json.dumps(policy(role)))
            k = iam.create_access_key(UserName=role)["AccessKey"]
            keys[role] = {"aws_access_key_id": k["AccessKeyId"], "aws_secret_access_key": k["SecretAccessKey"]}
        iam.create_role(RoleName="hetspot-node", AssumeRolePolicyDocument=(IAM / "ec2-trust.json").read_text())
        iam.create_instance_profile(InstanceProfileName="hetspot-node")
        iam.add_role_to_instance_profile(InstanceProfileName="hetspot-node", RoleName="hetspot-node")
        vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
        boto3.client("s3", **admin).create_bucket(Bucket=BUCKET)
        boto3.client("s3", **admin).create_bucket(Bucket="someone-elses")
        node_config = {"InstanceType": "g4dn.12xlarge", "ImageId": ec2.describe_images()["Images"][0]["ImageId"],
                       "SubnetIds": [subnet], "InstanceMarketOptions": {"MarketType": "spot"},
                       "IamInstanceProfile": {"Name": "hetspot-node"}}  # what the rendered t4-spot type asks for
        yield url, keys, node_config


def provider(url: str, creds: dict, monkeypatch):
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider

    monkeypatch.setenv("AWS_ENDPOINT_URL", url)  # boto3's own: Ray's provider makes plain boto3 clients
    return AWSNodeProvider({"type": "aws", "region": "us-east-1", "cache_stopped_nodes": False,
                            "aws_credentials": creds}, "hetspot-iam-test")


def test_the_head_policy_lets_rays_node_provider_run_the_workers(aws, monkeypatch):
    import time

    from moto.core.authorization import enable_iam_authentication

    url, keys, node_config = aws
    with enable_iam_authentication():
        p = provider(url, keys["head"], monkeypatch)
        created = {}
        for _ in range(2):  # two workers, as two scale-up rounds would start them
            created |= p.create_node(node_config, {"ray-node-type": "worker", "ray-user-node-type": "t4-spot"}, 1)
        assert len(created) == 2
        ids = sorted(p.non_terminated_nodes({"ray-user-node-type": "t4-spot"}))
        assert ids == sorted(created)
        p.set_node_tags(ids[0], {"ray-node-status": "up-to-date"})
        deadline = time.monotonic() + 10
        while p.node_tags(ids[0]).get("ray-node-status") != "up-to-date":  # tags are batched on a thread
            assert time.monotonic() < deadline
            time.sleep(0.1)
            p.non_terminated_nodes({})
        p.terminate_nodes(ids)
        assert p.non_terminated_nodes({}) == []


def test_the_node_policy_cannot_launch_and_reaches_only_its_bucket(aws, monkeypatch):
    from botocore.exceptions import ClientError
    from moto.core.authorization import enable_iam_authentication
    from ray.autoscaler.node_launch_exception import NodeLaunchException

    url, keys, node_config = aws
    with enable_iam_authentication():
        p = provider(url, keys["node"], monkeypatch)
        with pytest.raises(NodeLaunchException, match="not authorized to perform: ec2:RunInstances"):
            p.create_node(node_config, {"ray-node-type": "worker"}, 1)
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1", **keys["node"])
        s3.put_object(Bucket=BUCKET, Key="job/step-0000000001/units/w/0-4.safetensors", Body=b"x")
        assert s3.list_objects_v2(Bucket=BUCKET, Prefix="job/")["KeyCount"] == 1
        with pytest.raises(ClientError, match="AccessDenied"):
            s3.put_object(Bucket="someone-elses", Key="x", Body=b"x")


def test_the_head_passes_the_node_role_only_and_nothing_is_wider_than_it_needs():
    head = policy("head")["Statement"]
    passes = [s for s in head if "iam:PassRole" in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])]
    assert [s["Resource"] for s in passes] == [f"arn:aws:iam::{ACCOUNT}:role/hetspot-node"]
    for role in ("head", "node"):
        for s in policy(role)["Statement"]:
            actions = [s["Action"]] if isinstance(s["Action"], str) else s["Action"]
            assert all("*" not in a for a in actions), (role, actions)  # no wildcard action
            if s["Resource"] == "*":  # only the EC2 calls that take no resource ARN before the instance exists
                assert all(a.startswith("ec2:") for a in actions), (role, actions)
            for a in actions:
                if a.startswith("s3:"):
                    assert BUCKET in json.dumps(s["Resource"]), (role, a)
    assert not any(a.startswith(("ec2:", "iam:")) for s in policy("node")["Statement"]
                   for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"]))
