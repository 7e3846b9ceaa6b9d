"""Renders spot-fleet configs from one set of templates: Ray's AWS cluster launcher and KubeRay.

`hetspot deploy render` and the files shipped in deploy/ both come from these
functions (a test re-renders the shipped files and compares), so they cannot
drift apart. Every node advertises what hetspot's discovery reads: the GPU type
and market as labels (`hetspot/gpu-type`, `hetspot/market`), Ray's own
`accelerator_type:<T>` resource, and on EC2 the instance id and type, read from
the instance metadata service when the node starts. Every node runs one image
(deploy/image/Dockerfile: Ray's GPU image, torch's CUDA build, hetspot): the
KubeRay pods directly, the AWS nodes through the launcher's `docker:` section on
a GPU AMI whose host supplies only the driver, so nothing is installed at
launch. Nothing secret is written: the Ray auth token travels as a file mount
(AWS) or a Kubernetes Secret reference (KubeRay); S3 access is an instance
profile per role (AWS, deploy/aws/iam/) or a service account (KubeRay: IRSA or
Workload Identity), or a named Secret. Pure: builds dicts and YAML text; no
cloud calls.
"""

from __future__ import annotations

import json

import yaml

from orchestrator.deploy.fleet import (
    LABEL_GPU_TYPE,
    LABEL_MARKET,
    LABEL_NODE,
    NodeKind,
    check_region,
    parse_mix,
)
from orchestrator.deploy.image import IMAGE_TORCH, ecr_login

RAY_VERSION = "2.60.0"
DEFAULT_IMAGE = "hetspot-node:0.1.0"  # built from deploy/image/Dockerfile and pushed to the user's registry
HEAD_PROFILE = "hetspot-head"  # may start, tag, list and stop the workers, pass the node role (deploy/aws/iam/)
NODE_PROFILE = "hetspot-node"  # may read and write the checkpoint bucket, nothing else
# The Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04): a current NVIDIA driver (H100/p5 and L4/g6
# need one newer than Ray's default DLAMI's CUDA 11.2), Docker and the NVIDIA container toolkit; everything else is
# in the image. EC2 resolves AWS's public SSM parameter at launch (`resolve:ssm:`, RunInstances), so every region
# gets its current build; the head's policy may read it. Parameter name as AWS's DLAMI documentation gives it,
# checked 2026-11-26 (not resolved from here: no network); `--ami` names another.
DEFAULT_AMI = "resolve:ssm:/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
ULIMIT = "ulimit -n 65536;"  # what Ray's launcher puts before `ray start` by default
HEAD_INSTANCE = "m5.2xlarge"  # on demand, no GPU: the controller lives there and must not be preempted
HEAD_POD = (6, 24)  # KubeRay's head container: (CPUs, GiB), to fit the head pool's 8-vCPU, 32 GiB machine
# Fast node-death detection on the head (defaults: about 14 s; these: about 2 s). Opt-in (--fast-health-checks):
# measured on one host only, and on a busy multi-host network a late answer would declare a live node dead.
HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_timeout_ms": 500}
# The seconds a spot pod has between its notice and its end, per platform: GKE gives spot pods 15 s by default
# (node pools may be configured for more: --grace-s); an EC2 spot notice comes two minutes ahead.
PLATFORM_GRACE_S = {"gke": 15, "eks": 120}
NOTICES = {"gke": "gcp", "eks": "aws"}  # the metadata service a platform's pods poll for their node's notice


def _group_name(kind: NodeKind) -> str:
    """`l4-spot` for the deploy table's node of a GPU type; `l4-g6-xlarge-spot` for another size of it."""
    from orchestrator.deploy.fleet import NODE_KINDS

    if NODE_KINDS.get(kind.gpu_type) == kind:
        return f"{kind.slug}-spot"
    return f"{kind.slug}-{kind.instance_type.replace('.', '-')}-spot"


def _worker_labels(kind: NodeKind) -> dict[str, str]:
    return {LABEL_GPU_TYPE: kind.gpu_type, LABEL_MARKET: "spot"}


def _ray_resources(kind: NodeKind) -> dict[str, int]:
    return {"CPU": kind.num_cpus, "GPU": kind.num_gpus, f"accelerator_type:{kind.ray_accelerator}": 1}


# -- AWS: Ray cluster launcher -------------------------------------------------------
# Inside the image: hetspot reads this instance's id and type from IMDSv2 and prints `--labels=...` for `ray start`
# (orchestrator/cluster/node_labels.py); the container shares the host's network, so IMDS is one hop away.
NODE_LABELS = "$(python -m orchestrator.cluster.node_labels)"


def check_image_runs(kinds: list[tuple[NodeKind, int]], torch_build: str) -> None:
    """MixError naming the fix where the image's torch build has no kernels for a GPU type of the mix."""
    from orchestrator.deploy.fleet import MixError
    from orchestrator.deploy.image import TORCH_ARCHES, image_problem

    if torch_build not in TORCH_ARCHES:
        raise MixError(f"--torch-build {torch_build!r} must be one of {', '.join(TORCH_ARCHES)} (the CUDA build of "
                       "torch the image installs: deploy/image/Dockerfile's TORCH_INDEX)")
    for kind, _ in kinds:
        problem = image_problem(kind.gpu_type, torch_build)
        if problem:
            raise MixError(f"--mix: {problem}")


def aws_config(mix: str | list[tuple[NodeKind, int]], region: str = "us-east-1", image: str = DEFAULT_IMAGE,
               cluster_name: str = "hetspot-spot",
               head_profile: str = HEAD_PROFILE, node_profile: str = NODE_PROFILE, ami: str = DEFAULT_AMI,
               fast_health_checks: bool = False, torch_build: str = IMAGE_TORCH[1]) -> dict:
    """Ray's cluster launcher config. Every node runs `image` through the launcher's `docker:` section on `ami`
    (nothing installed at launch); the head runs with `head_profile` (launch the workers, pass the node role) and
    the workers with `node_profile` (the bucket only): deploy/aws/iam/ has both policies. `max_workers` per type
    is the mix's count and `min_workers` 0: hetspot's own demand (the job's `fleet:` or `cluster:`) starts them.
    `mix` is a --mix string or the node kinds and counts themselves (a job's fleet: `kinds_for_fleet`)."""
    kinds = parse_mix(mix) if isinstance(mix, str) else mix
    check_region(region, ami != DEFAULT_AMI)
    check_image_runs(kinds, torch_build)

    def on(profile: str) -> dict:
        return {"ImageId": ami, "IamInstanceProfile": {"Name": profile}}
    nodes: dict = {"head": {
        "node_config": {"InstanceType": HEAD_INSTANCE} | on(head_profile),
        "resources": {"CPU": 8, "GPU": 0},
        "labels": {LABEL_MARKET: "on-demand", LABEL_NODE: "head"},
        "min_workers": 0, "max_workers": 0,
    }}
    for kind, count in kinds:
        nodes[_group_name(kind)] = {
            "node_config": {"InstanceType": kind.instance_type, "InstanceMarketOptions": {"MarketType": "spot"}}
            | on(node_profile),
            "resources": _ray_resources(kind),
            "labels": _worker_labels(kind),
            "min_workers": 0, "max_workers": count,
        }
    auth = "RAY_AUTH_MODE=token"
    return {
        "cluster_name": cluster_name,
        "max_workers": sum(n for _, n in kinds),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 10,
        "provider": {"type": "aws", "region": region, "cache_stopped_nodes": False},
        "auth": {"ssh_user": "ubuntu"},
        # The workers' GPUs reach the container by --gpus (Docker's own flag, through the NVIDIA container toolkit
        # the AMI has), not by Ray finding `nvidia-container-runtime` in `docker info`; the head has no GPU.
        "docker": {"image": image, "container_name": "ray_container", "pull_before_run": True,
                   "run_options": ["--ulimit nofile=65536:65536"], "worker_run_options": ["--gpus all"],
                   "disable_automatic_runtime_detection": True},
        "available_node_types": nodes,
        "head_node_type": "head",
        # Token auth: the token the user made with `ray get-auth-token --generate` goes to every node.
        "file_mounts": {"~/.ray/auth_token": "~/.ray/auth_token"},
        # On the host, before Ray's `docker pull`: a login to the image's private ECR registry (none for a public
        # image; orchestrator/deploy/image.py)
        "initialization_commands": ecr_login(image),
        "setup_commands": [],  # nothing installed at launch: the image holds Ray, torch and hetspot
        "head_start_ray_commands": [
            "ray stop",
            f"{ULIMIT} {auth} ray start --head --port=6379 --dashboard-host=0.0.0.0 --metrics-export-port=8080 "
            "--autoscaling-config=~/ray_bootstrap_config.yaml"
            + (f" --system-config='{json.dumps(HEALTH)}'" if fast_health_checks else ""),
        ],
        "worker_start_ray_commands": [
            "ray stop",
            f"{ULIMIT} {auth} ray start --address=$RAY_HEAD_IP:6379 --metrics-export-port=8080 {NODE_LABELS}",
        ],
    }


# -- KubeRay ---------------------------------------------------------------------------
# gke: GKE spot node pools; eks: EKS managed node groups; eks-karpenter: EKS with Karpenter or Auto Mode (their
# nodes carry karpenter.sh/capacity-type, not the managed groups' eks.amazonaws.com/capacityType).
PLATFORMS = ("gke", "eks", "eks-karpenter")
SERVICE_ACCOUNT = "hetspot"  # bound to a cloud role for S3 (IRSA on EKS, Workload Identity on GKE): docs/deploy.md
# KubeRay joins rayStartParams into `ray start --k=v ...` inside `bash -c` without quoting, so no value may carry
# spaces, quotes, braces or commas; the head's health-check tuning goes in as Ray's RAY_<name> config variables.
HEALTH_ENV = [{"name": f"RAY_{k}", "value": str(v)} for k, v in HEALTH.items()]


def _k8s_placement(kind: NodeKind, platform: str) -> tuple[dict, list[dict]]:
    """(nodeSelector, tolerations) for a spot node pool of this GPU type."""
    tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if platform == "gke":
        selector = {"cloud.google.com/gke-spot": "true", "cloud.google.com/gke-accelerator": kind.gke_accelerator}
        tolerations.append({"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                            "effect": "NoSchedule"})
    elif platform == "eks-karpenter":
        selector = {"karpenter.sh/capacity-type": "spot", "node.kubernetes.io/instance-type": kind.instance_type}
    else:
        selector = {"eks.amazonaws.com/capacityType": "SPOT", "node.kubernetes.io/instance-type": kind.instance_type}
    return selector, tolerations


def _on_demand(platform: str) -> dict:
    """The head pod's placement: never a spot node (the controller lives there)."""
    if platform == "eks":
        return {"nodeSelector": {"eks.amazonaws.com/capacityType": "ON_DEMAND"}}
    if platform == "eks-karpenter":
        return {"nodeSelector": {"karpenter.sh/capacity-type": "on-demand"}}
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "cloud.google.com/gke-spot", "operator": "DoesNotExist"}]}]}}}}


def _pod_size(kind: NodeKind, platform: str) -> tuple[int, int]:
    """(CPUs, GiB) a worker pod asks for: what the node's machine type leaves after the kubelet and daemons
    (4 vCPUs and 15% of memory kept back). GKE machines are sized by their own type, not the EC2 instance's."""
    if platform == "gke":
        _, vcpus, gb = kind.gke_machine
        return vcpus - 4, int(gb * 1e9 / 2**30 * 0.85)
    return kind.num_cpus - 4, int(kind.memory_gib * 0.85)


def _container(name: str, image: str, cpu: int, mem_gib: int, gpus: int = 0, s3_secret: str | None = None) -> dict:
    limits = {"cpu": str(cpu), "memory": f"{mem_gib}Gi"} | ({"nvidia.com/gpu": str(gpus)} if gpus else {})
    out = {"name": name, "image": image, "resources": {"limits": limits, "requests": dict(limits)}}
    if s3_secret:  # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for an S3-compatible store)
        out["envFrom"] = [{"secretRef": {"name": s3_secret}}]
    return out


def _pod(platform: str, s3_secret: str | None) -> dict:
    """What every pod of the cluster shares: the service account its S3 access comes from (unless a Secret
    carries keys instead)."""
    return {} if s3_secret else {"serviceAccountName": SERVICE_ACCOUNT}


def kuberay_cluster(mix: str | None = None, platform: str = "gke", image: str = DEFAULT_IMAGE,
                    cluster_name: str = "hetspot-spot", grace_s: int | None = None, s3_secret: str | None = None,
                    fast_health_checks: bool = False, torch_build: str = IMAGE_TORCH[1]) -> dict:
    """A RayCluster as KubeRay (1.5.1 and later) accepts it: node labels and custom resources in each group's
    top-level `labels` and `resources` fields, token auth through `spec.authOptions` (the operator makes the
    Secret and gives the token to every container, the autoscaler and the RayJob submitter), the autoscaler v2
    with its options spelled out, the head on on-demand capacity, workers on spot pools sized from the platform's
    machine types, `restartPolicy: Never` (a failed Ray container is replaced, not restarted in place, as the v2
    autoscaler requires), a grace period the platform gives (`grace_s`; hetspot drains through the node's notice,
    not a preStop hook that would fire on every scale-down), and S3 access from a service account or a Secret."""
    from orchestrator.deploy.fleet import DEFAULT_GKE_MIX, DEFAULT_MIX, MixError

    if platform not in PLATFORMS:
        raise MixError(f"--platform {platform!r} must be one of {', '.join(PLATFORMS)}")
    grace = PLATFORM_GRACE_S["gke" if platform == "gke" else "eks"] if grace_s is None else grace_s
    kinds = parse_mix(mix or (DEFAULT_GKE_MIX if platform == "gke" else DEFAULT_MIX))
    check_image_runs(kinds, torch_build)
    # the head pool's machine (HEAD_MACHINE: 8 vCPUs, 32 GiB) holds the head, the operator's autoscaler sidecar
    # and the node agents (orchestrator/deploy/machines.py)
    head = _container("ray-head", image, HEAD_POD[0], HEAD_POD[1], s3_secret=s3_secret)
    if fast_health_checks:
        head["env"] = list(HEALTH_ENV)
    groups = []
    for kind, count in kinds:
        if platform == "gke" and kind.gke_accelerator is None:
            raise MixError(f"--mix: GKE has no {kind.gpu_type} GPUs; render it for --platform eks, or drop it")
        selector, tolerations = _k8s_placement(kind, platform)
        cpus, mem_gib = _pod_size(kind, platform)
        worker = _container("ray-worker", image, cpus, mem_gib, kind.num_gpus, s3_secret)
        groups.append({
            "groupName": _group_name(kind), "replicas": 0, "minReplicas": 0, "maxReplicas": count,
            "rayStartParams": {},
            "resources": {"CPU": str(cpus), "GPU": str(kind.num_gpus), f"accelerator_type:{kind.ray_accelerator}": "1"},
            "labels": _worker_labels(kind),
            "template": {"spec": _pod(platform, s3_secret) | {
                "nodeSelector": selector, "tolerations": tolerations, "containers": [worker],
                "restartPolicy": "Never", "terminationGracePeriodSeconds": grace}},
        })
    return {
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": {"name": cluster_name, "labels": {"app.kubernetes.io/part-of": "hetspot"}},
        "spec": {
            "rayVersion": RAY_VERSION, "enableInTreeAutoscaling": True,
            "autoscalerOptions": {"version": "v2", "upscalingMode": "Default", "idleTimeoutSeconds": 600,
                                  "resources": {"limits": {"cpu": "500m", "memory": "512Mi"},
                                                "requests": {"cpu": "500m", "memory": "512Mi"}}},
            "authOptions": {"mode": "token"},
            "headGroupSpec": {
                "rayStartParams": {"dashboard-host": "0.0.0.0", "metrics-export-port": "8080"},
                "resources": {"GPU": "0"},
                "labels": {LABEL_MARKET: "on-demand", LABEL_NODE: "head"},
                "template": {"spec": _pod(platform, s3_secret) | {"containers": [head]} | _on_demand(platform)},
            },
            "workerGroupSpecs": groups,
        },
    }


# The wait covers a scale from zero: a spot node's start, and the image's pull (about 15 GB) on it.
EXAMPLE_JOB = {"name": "tiny-on-kuberay", "model": {"preset": "small"}, "train": {"global_batch": 32, "lr": 0.003},
               "steps": 20, "fleet": {"types": [{"gpu_type": "L4", "min_nodes": 1, "max_nodes": 1}], "wait_s": 1800}}


def example_job(platform: str = "gke", grace_s: int | None = None) -> dict:
    """The RayJob's job: it asks the autoscaler for its own GPUs (`fleet:`) and heeds its node's spot notices,
    with the deadline the platform gives (GKE's notice carries none: `notice_grace_s`)."""
    grace = PLATFORM_GRACE_S["gke" if platform == "gke" else "eks"] if grace_s is None else grace_s
    cloud = NOTICES["gke" if platform == "gke" else "eks"]
    return EXAMPLE_JOB | {"runtime": {"notices": cloud} | ({"notice_grace_s": grace} if cloud == "gcp" else {})}


def kuberay_job(cluster_name: str = "hetspot-spot", job: dict | None = None, platform: str = "gke",
                grace_s: int | None = None) -> list[dict]:
    """A RayJob on the RayCluster whose entry point is hetspot's driver itself (`python -m orchestrator.driver`,
    the job spec in its runtime env), submitted by KubeRay's submitter with the cluster's token."""
    from orchestrator.job_spec import parse_job
    from orchestrator.runtime.progress_lines import ENV_ID, ENV_JOB
    from orchestrator.runtime.ray_jobs import STOP_GRACE_S

    spec = parse_job(job or example_job(platform, grace_s), "the RayJob's job")
    # Only what the job sets: the defaults are those of the hetspot the image runs (a sample rendered before a
    # default changed still means what it says, and reads as the job file it came from). A stopped RayJob's driver
    # has STOP_GRACE_S to withdraw its fleet's demand before Ray kills it (orchestrator/runtime/ray_jobs.py).
    runtime_env = {"env_vars": {ENV_JOB: spec.model_dump_json(exclude_defaults=True), ENV_ID: spec.name,
                                "RAY_DEDUP_LOGS": "0", "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_S)}}
    return [
        {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": spec.name},
         "spec": {"clusterSelector": {"ray.io/cluster": cluster_name},
                  "entrypoint": "python -m orchestrator.driver",
                  "runtimeEnvYAML": yaml.safe_dump(runtime_env, sort_keys=True, width=1 << 20)}},
    ]


def to_yaml(docs: dict | list[dict], command: str) -> str:
    """YAML text with a header naming the command that made it (re-render rather than edit by hand)."""
    docs = docs if isinstance(docs, list) else [docs]
    header = (f"# Generated by `{command}`.\n"
              "# Edit the templates in orchestrator/deploy/render.py and re-render, not this file.\n")
    return header + "---\n".join(yaml.safe_dump(d, sort_keys=False, width=120) for d in docs)
