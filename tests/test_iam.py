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
DATA = "corpus"


def policy(role: str) -> dict:
    text = (IAM / f"{role}-policy.json").read_text()
    return json.loads(text.replace("ACCOUNT_ID", ACCOUNT).replace("DATA_BUCKET", DATA).replace("BUCKET", BUCKET)
                      .replace("REPOSITORY", "hetspot-node"))


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
            if s["Resource"] == "*":  # only the calls that take no resource ARN (EC2's before the instance exists,
                # ECR's login token)
                assert all(a.startswith("ec2:") or a == "ecr:GetAuthorizationToken" for a in actions), (role, actions)
            for a in actions:
                if a.startswith("s3:"):
                    assert BUCKET in json.dumps(s["Resource"]) or (DATA in json.dumps(s["Resource"]) and a in (
                        "s3:ListBucket", "s3:GetObject")), (role, a)  # the data bucket: read only
    assert not any(a.startswith(("ec2:", "iam:")) for s in policy("node")["Statement"]
                   for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"]))


# -- IAM by deletion: every statement is needed by a call the role really makes -----------------------------------
ECR_IMAGE = f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/hetspot-node:0.1.0"


@pytest.fixture(scope="module")
def recorded(aws, tmp_path_factory):
    """Each role's work on moto, every AWS call recorded (tests/iam_policy.py) and turned into the IAM checks AWS
    makes for it. The head: Ray's own AWSNodeProvider filling in the node types and launching, tagging, listing
    and terminating a spot worker of the rendered config (its `resolve:ssm:` image swapped for moto's, and the SSM
    read EC2 makes for the rendered one added), the ECR login and the image's pull, the controller's checkpoint
    work on a versioned bucket (three steps, a keeper's abandoned multipart upload, pruning to one), the data
    check of a sharded corpus, and `inventory`'s spot prices. A node: the ECR login and pull, a keeper's access
    probe, its upload of a multipart piece and a restore's read of it, and the data reads of a step."""
    import numpy as np
    import torch
    import yaml
    from ray.autoscaler._private.aws import utils as ray_aws_utils
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider

    from orchestrator.cli.deploy import render_text
    from orchestrator.cluster.ec2 import Boto3SpotPrices
    from orchestrator.state.s3_store import S3Checkpoints
    from tests.iam_policy import Recorder, checks_of, pull_checks, ssm_check
    from workers.data import TokenFile
    from workers.data_validation import check_data

    url, _, node_config = aws
    admin = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    client = lambda name: boto3.client(name, endpoint_url=url, region_name="us-east-1", **admin)  # noqa: E731
    s3, iam = client("s3"), client("iam")
    s3.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
    s3.create_bucket(Bucket=DATA)
    rng = np.random.default_rng(0)
    for i in range(2):
        s3.put_object(Bucket=DATA, Key=f"tokens/part-{i}.bin", Body=rng.integers(0, 64, 900, dtype=np.uint16).tobytes())
    config = next(yaml.safe_load_all(render_text("aws", mix="t4:1", region="us-east-1", image=ECR_IMAGE)))
    worker = config["available_node_types"]["t4-spot"]
    launch = worker["node_config"] | {"ImageId": node_config["ImageId"], "SubnetIds": node_config["SubnetIds"]}

    def role_of_profile(name: str) -> str:
        return iam.get_instance_profile(InstanceProfileName=name.rsplit("/", 1)[-1])["InstanceProfile"]["Roles"][0][
            "RoleName"]

    def state(seed: int, rows: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {"wte.weight": {k: torch.randn(rows, 64, generator=g) for k in ("param", "exp_avg", "exp_avg_sq")}}

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", url)
        for k, v in admin.items():
            mp.setenv(k.upper(), v)
        ray_aws_utils.resource_cache.cache_clear()
        ray_aws_utils.client_cache.cache_clear()
        with Recorder().recording() as head:
            provider_config = config["provider"] | {"aws_credentials": admin}
            AWSNodeProvider.fillout_available_node_types_resources(config | {"provider": provider_config})
            p = AWSNodeProvider(provider_config, config["cluster_name"])
            created = p.create_node(launch, {"ray-node-type": "worker", "ray-user-node-type": "t4-spot"}, 1)
            p.non_terminated_nodes({})
            p.set_node_tags(next(iter(created)), {"ray-node-status": "up-to-date"})
            p.terminate_nodes(list(created))
            p.non_terminated_nodes({})  # flushes the batched tags
            client("ecr").get_authorization_token()  # `aws ecr get-login-password`
            store = S3Checkpoints(f"s3://{BUCKET}/job", client=s3)
            meta = {"job": "tiny", "run_id": "run-a"}
            for step in (1, 2, 3):
                store.save(step, state(step, 8), float(step), meta)
            with head.aside():
                s3.create_multipart_upload(Bucket=BUCKET, Key=f"{store.step_dir(1)}units/left-by-a-dead-keeper")
            from orchestrator.state.manifest import Identity

            store.keep_newest(1, Identity.of(meta, {"wte.weight": [8, 64]}))
            check_data("tokens", f"s3://{DATA}/tokens/", 16, 64, endpoint_url=url)
            Boto3SpotPrices(client("ec2")).price("g4dn.12xlarge", "us-east-1a")
        out["head"] = [c for call in head.calls for c in checks_of(call, ACCOUNT, role_of_profile)] + [
            ssm_check(worker["node_config"]["ImageId"], "us-east-1", "RunInstances of the rendered config")
        ] + pull_checks(ECR_IMAGE)
        with Recorder().recording() as node:
            client("ecr").get_authorization_token()
            store = S3Checkpoints(f"s3://{BUCKET}/job", client=s3, multipart_bytes=5 << 20)
            assert store.check_write("node-1") is None
            entry = store.put_piece(9, "wte.weight", ((0, 8192), (0, 64)), state(9, 8192)["wte.weight"], "run-a")
            store.read_piece(9, entry)
            gone = store.put_piece(9, "wpe.weight", ((0, 4), (0, 64)), state(9, 4)["wte.weight"], "run-a")
            with node.aside():
                s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": gone["key"]}]})  # a lifecycle rule's
            with pytest.raises(Exception, match="NoSuchKey|missing|gone|not found|404"):  # known missing, not refused
                store.read_piece(9, {k: v for k, v in gone.items() if k != "version"})
            TokenFile(f"s3://{DATA}/tokens/", 16, 64, endpoint_url=url).batch(range(8))
        out["node"] = [c for call in node.calls for c in checks_of(call, ACCOUNT, role_of_profile)] + pull_checks(
            ECR_IMAGE)
        assert any(c.why.endswith("a 404, not a 403") for c in out["node"])  # the missing piece was read as such
        out["calls"] = {"head": head.calls, "node": node.calls}
    return out


@pytest.mark.parametrize("role", ["head", "node"])
def test_the_policy_allows_every_call_the_role_makes_and_each_statement_is_needed(role, recorded):
    """Every IAM check of the role's recorded work passes its policy, evaluated with Action, Resource and
    Condition; and with any one statement deleted, some check fails (moto alone would still pass several of
    these deletions: it checks only the action of the call, never PassRole, resources or conditions)."""
    from tests.iam_policy import allowed

    pol, checks = policy(role), recorded[role]
    denied = [c for c in checks if not allowed(pol, c)]
    assert not denied, (role, denied)
    for i, statement in enumerate(pol["Statement"]):
        less = {"Statement": pol["Statement"][:i] + pol["Statement"][i + 1:]}
        failing = [c for c in checks if not allowed(less, c)]
        assert failing, f"{role}: nothing the role does needs statement {statement['Sid']}; remove it or test it"
    actions = {c.action for c in checks}
    assert {"iam:PassRole", "ssm:GetParameters", "ec2:CreateTags", "s3:DeleteObjectVersion",
            "s3:AbortMultipartUpload", "ecr:BatchGetImage"} <= actions if role == "head" else True


def test_the_checks_honour_resources_and_conditions():
    """What moto cannot show: the head may pass the node role to EC2 only, and the buckets are the named ones."""
    from tests.iam_policy import Check, allowed

    head, node = policy("head"), policy("node")
    ok = Check("iam:PassRole", f"arn:aws:iam::{ACCOUNT}:role/hetspot-node", (("iam:PassedToService",
                                                                                 "ec2.amazonaws.com"),))
    assert allowed(head, ok)
    assert not allowed(head, Check(ok.action, f"arn:aws:iam::{ACCOUNT}:role/admin", ok.context))
    assert not allowed(head, Check(ok.action, ok.resource, (("iam:PassedToService", "lambda.amazonaws.com"),)))
    assert not allowed(head, Check(ok.action, ok.resource))  # no service in the request: the condition fails
    assert allowed(node, Check("s3:GetObject", f"arn:aws:s3:::{DATA}/tokens/a.bin"))
    assert not allowed(node, Check("s3:PutObject", f"arn:aws:s3:::{DATA}/tokens/a.bin"))  # data is read only
    assert not allowed(node, Check("s3:GetObject", "arn:aws:s3:::someone-elses/x"))
    assert not allowed(node, Check("ecr:BatchGetImage", f"arn:aws:ecr:us-east-1:{ACCOUNT}:repository/other"))
