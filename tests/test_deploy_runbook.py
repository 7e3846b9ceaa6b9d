"""docs/deploy.md's AWS runbook from an empty account, offline: every ```bash block marked `# offline` (render,
lint, policy files, job checks) or `# moto` (the AWS CLI calls and create.sh) runs in the runbook's order from a
fresh copy of the repository, each command exiting 0, the `# moto` ones against moto's server (IAM, ECR, S3,
EC2), with ACCOUNT and REGION replaced as a user replaces them. What it renders is then held to Ray's own
validator, the account holds what `create.sh` promises (EC2's spot service-linked role, the two roles and
profiles; a second run changes nothing), and the walk ends as a cluster's first scale-up does: Ray's own AWS
node provider, with credentials holding exactly the head's policy as `create.sh` put it (moto enforcing IAM),
launches a spot worker of the rendered config, its instance profile the node's."""

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
import yaml

from tests.moto_s3 import moto_server
from tests.test_readme import fresh_copy

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ACCOUNT, REGION = "123456789012", "us-east-1"  # moto's account


def runbook_commands(kinds: tuple[str, ...] = ("# offline", "# moto")) -> list[tuple[str, str]]:
    """(kind, command) of the marked blocks, in the runbook's order."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "deploy.md").read_text(), re.S):
        lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
        if lines and lines[0] in kinds:
            out += [(lines[0], ln.split("  #")[0].strip()) for ln in lines[1:] if not ln.startswith("#")]
    return out


def offline_commands() -> list[str]:
    return [c for _, c in runbook_commands(("# offline",))]


def test_the_runbook_from_an_empty_account_runs_in_order_and_ends_with_a_spot_worker(tmp_path):
    cmds = runbook_commands()
    tools = {c.split()[0] for _, c in cmds}
    assert {"hetspot", "hadolint", "python", "aws", "deploy/aws/iam/create.sh"} <= tools, cmds
    assert any(" plan " in f" {c} " for _, c in cmds) and sum("deploy render" in c for _, c in cmds) >= 3, cmds
    order = [c.split()[0] if c.split()[0] != "aws" else " ".join(c.split()[:3]) for _, c in cmds]
    assert order.index("aws ecr create-repository") < order.index("deploy/aws/iam/create.sh") < \
        next(i for i, (_, c) in enumerate(cmds) if "deploy render --cloud aws" in c)
    clone = fresh_copy(tmp_path / "hetspot")
    exe = {"hetspot": str(BIN / "hetspot"), "hadolint": str(BIN / "hadolint"), "python": sys.executable}
    with moto_server() as url:
        env = os.environ | {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY":
                            "testing", "AWS_DEFAULT_REGION": REGION, "PATH": f"{BIN}:{os.environ['PATH']}"}
        for kind, cmd in cmds:
            argv = shlex.split(cmd.replace("ACCOUNT", ACCOUNT).replace("REGION", REGION))
            if argv[0] in exe:
                argv[0] = exe[argv[0]]
            elif argv[0].endswith(".sh"):
                argv = ["sh", *argv]
            r = subprocess.run(argv, cwd=clone, capture_output=True, text=True, timeout=600,
                               env=env if kind == "# moto" else os.environ)
            assert r.returncode == 0, f"`{cmd}` exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        admin = {"endpoint_url": url, "region_name": REGION, "aws_access_key_id": "testing",
                 "aws_secret_access_key": "testing"}
        iam = boto3.client("iam", **admin)
        spot = iam.list_roles(PathPrefix="/aws-service-role/spot.amazonaws.com/")["Roles"]  # EC2's spot role
        assert len(spot) == 1 and "spot.amazonaws.com" in json.dumps(spot[0]["AssumeRolePolicyDocument"])
        again = subprocess.run(["sh", "deploy/aws/iam/create.sh", "my-ckpt", "my-data"], cwd=clone, env=env,
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and "AWSServiceRoleForEC2Spot: already there" in again.stdout, again.stderr
        fleet = yaml.safe_load((clone / "my-fleet.yaml").read_text())
        launch_a_spot_worker(fleet, iam, admin, url)
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(fleet)))
    image = f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/hetspot-node:0.1.0"
    assert fleet["docker"]["image"] == image and fleet["setup_commands"] == []
    assert fleet["initialization_commands"] == [  # the nodes log in to the private registry before Ray's pull
        f"aws ecr get-login-password --region us-east-1 | docker login --username AWS --password-stdin "
        f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com"]
    for name in ("fleet-gke.yaml", "fleet-eks.yaml"):
        kinds = [d["kind"] for d in yaml.safe_load_all((clone / name).read_text()) if d]
        assert kinds == ["RayCluster", "RayJob"], (name, kinds)


def launch_a_spot_worker(fleet: dict, iam, admin: dict, url: str) -> None:
    """Ray's AWSNodeProvider with the head's policy (read back from the role create.sh made) launches a worker of
    the rendered spot type; moto enforces the policy's actions (tests/test_iam.py checks its resources and
    conditions). moto cannot resolve the rendered `resolve:ssm:` image, so the launch names one of moto's."""
    from moto.core.authorization import enable_iam_authentication
    from ray.autoscaler._private.aws import utils as ray_aws_utils
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider

    head = iam.get_role_policy(RoleName="hetspot-head", PolicyName="hetspot")["PolicyDocument"]
    head = head if isinstance(head, dict) else json.loads(head)
    assert iam.get_instance_profile(InstanceProfileName="hetspot-node")["InstanceProfile"]["Roles"][0][
        "RoleName"] == "hetspot-node"
    iam.create_user(UserName="head")
    iam.put_user_policy(UserName="head", PolicyName="hetspot", PolicyDocument=json.dumps(head))
    key = iam.create_access_key(UserName="head")["AccessKey"]
    creds = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
    ec2 = boto3.client("ec2", **admin)
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
    name, worker = next((n, t) for n, t in fleet["available_node_types"].items() if n != fleet["head_node_type"])
    assert worker["node_config"]["ImageId"].startswith("resolve:ssm:/aws/service/deeplearning/")
    launch = worker["node_config"] | {"ImageId": ec2.describe_images()["Images"][0]["ImageId"], "SubnetIds": [subnet]}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", url)  # Ray's provider makes plain boto3 clients
        ray_aws_utils.resource_cache.cache_clear()
        ray_aws_utils.client_cache.cache_clear()
        with enable_iam_authentication():
            p = AWSNodeProvider(fleet["provider"] | {"aws_credentials": creds}, fleet["cluster_name"])
            created = p.create_node(launch, {"ray-node-type": "worker", "ray-user-node-type": name}, 1)
            (node_id,) = created
            assert p.non_terminated_nodes({"ray-user-node-type": name}) == [node_id]
    (inst,) = [i for r in ec2.describe_instances(InstanceIds=[node_id])["Reservations"] for i in r["Instances"]]
    assert inst["InstanceLifecycle"] == "spot" and inst["InstanceType"] == worker["node_config"]["InstanceType"]
    assert inst["IamInstanceProfile"]["Arn"].endswith("instance-profile/hetspot-node")


def test_the_kuberay_runbook_says_what_each_platform_needs_without_contradicting_itself():
    """The lines of docs/deploy.md a person follows on EKS and GKE: IRSA makes the `hetspot` service account (so
    the runbook creates none by hand), the pods reach IMDS through the setting each node provisioner has, and the
    head pool's machine is named per platform (tests/test_deploy_image.py fits the head to it)."""
    text = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    assert "eksctl create iamserviceaccount --name hetspot" in text and "kubectl create serviceaccount" not in text
    assert "metadataOptions.httpPutResponseHopLimit: 2" in text and "EC2NodeClass" in text
    assert "`e2-standard-8` on GKE, `m5.2xlarge` on EKS" in text
