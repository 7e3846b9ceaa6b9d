"""Renders spot-fleet configs from one set of templates: Ray's AWS cluster launcher and KubeRay.

`hetspot deploy render` and the files shipped in deploy/ both come from these
functions (a test re-renders the shipped files and compares), so they cannot
drift apart. Every node advertises what hetspot's discovery reads: the GPU type
and market as labels (`hetspot/gpu-type`, `hetspot/market`), Ray's own
`accelerator_type:<T>` resource, and on EC2 the instance id and type, read from
the instance metadata service when the node starts. Nothing secret is written:
the Ray auth token travels as a file mount (AWS) or a Kubernetes Secret
reference (KubeRay). Pure: builds dicts and YAML text; no cloud calls.
"""

from __future__ import annotations

import json

import yaml

from orchestrator.deploy.fleet import (
    LABEL_GPU_TYPE,
    LABEL_INSTANCE_ID,
    LABEL_INSTANCE_TYPE,
    LABEL_MARKET,
    LABEL_NODE,
    NodeKind,
    check_region,
    parse_mix,
)

RAY_VERSION = "2.60.0"
# What every node installs: hetspot's dependencies, not hetspot (each job ships its own packages: ray_jobs.py).
NODE_REQUIREMENTS = (f"'ray[default]=={RAY_VERSION}' 'torch>=2.4' 'boto3>=1.34' 'pydantic>=2.6,<3' 'pyyaml>=6' "
                     "'numpy>=1.26' 'safetensors>=0.4' 'typer>=0.12' 'rich>=13'")
DEFAULT_INSTALL = ""  # extra pip requirements for the nodes (AWS), e.g. a hetspot wheel for `hetspot` on the head
DEFAULT_PROFILE = "hetspot-node"  # an IAM instance profile that may read and write the checkpoint bucket
ULIMIT = "ulimit -n 65536;"  # what Ray's launcher puts before `ray start` by default
DEFAULT_IMAGE = "hetspot-ray:0.1.0"  # built from deploy/kuberay/Dockerfile
HEAD_INSTANCE = "m5.2xlarge"  # on demand, no GPU: the controller lives there and must not be preempted
# Fast node-death detection on the head (defaults: about 14 s; these: about 2 s).
HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_timeout_ms": 500}
IMDS = "http://169.254.169.254/latest"


def _group_name(kind: NodeKind) -> str:
    return f"{kind.slug}-spot"


def _worker_labels(kind: NodeKind) -> dict[str, str]:
    return {LABEL_GPU_TYPE: kind.gpu_type, LABEL_MARKET: "spot"}


def _ray_resources(kind: NodeKind) -> dict[str, int]:
    return {"CPU": kind.num_cpus, "GPU": kind.num_gpus, f"accelerator_type:{kind.ray_accelerator}": 1}


# -- AWS: Ray cluster launcher -------------------------------------------------------
def _imds_labels_then(start: str) -> str:
    """A shell line: read this instance's id and type from IMDSv2, then `ray start` with them as labels."""
    get = f'curl -sf -H "X-aws-ec2-metadata-token: $T" {IMDS}/meta-data'
    return (f'T=$(curl -sf -X PUT {IMDS}/api/token -H "X-aws-ec2-metadata-token-ttl-seconds: 300") && '
            f"IID=$({get}/instance-id) && ITYPE=$({get}/instance-type) && "
            f'{start} --labels="{LABEL_INSTANCE_ID}=$IID,{LABEL_INSTANCE_TYPE}=$ITYPE,{LABEL_NODE}=$IID"')


def aws_config(mix: str, region: str = "us-east-1", install: str = DEFAULT_INSTALL,
               cluster_name: str = "hetspot-spot", instance_profile: str = DEFAULT_PROFILE) -> dict:
    """Ray's cluster launcher config. Ray gives its own instance profile to the head only; every node here gets
    `instance_profile` (S3 access for the keepers' uploads and the data), the head included. `max_workers` per
    type is the mix's count and `min_workers` 0: hetspot's own demand (the job's `fleet:`) starts them."""
    kinds = parse_mix(mix)
    check_region(region)
    def profile() -> dict:
        return {"IamInstanceProfile": {"Name": instance_profile}}
    nodes: dict = {"head": {
        "node_config": {"InstanceType": HEAD_INSTANCE} | profile(),
        "resources": {"CPU": 8, "GPU": 0},
        "labels": {LABEL_MARKET: "on-demand", LABEL_NODE: "head"},
        "min_workers": 0, "max_workers": 0,
    }}
    for kind, count in kinds:
        nodes[_group_name(kind)] = {
            "node_config": {"InstanceType": kind.instance_type, "InstanceMarketOptions": {"MarketType": "spot"}}
            | profile(),
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
        "available_node_types": nodes,
        "head_node_type": "head",
        # Token auth: the token the user made with `ray get-auth-token --generate` goes to every node.
        "file_mounts": {"~/.ray/auth_token": "~/.ray/auth_token"},
        "setup_commands": [f"pip install -U {NODE_REQUIREMENTS}" + (f" '{install}'" if install else "")],
        "head_start_ray_commands": [
            "ray stop",
            f"{ULIMIT} {auth} ray start --head --port=6379 --dashboard-host=0.0.0.0 --metrics-export-port=8080 "
            f"--autoscaling-config=~/ray_bootstrap_config.yaml --system-config='{json.dumps(HEALTH)}'",
        ],
        "worker_start_ray_commands": [
            "ray stop",
            f"{ULIMIT} " + _imds_labels_then(f"{auth} ray start --address=$RAY_HEAD_IP:6379 --metrics-export-port=8080"),
        ],
    }


# -- KubeRay ---------------------------------------------------------------------------
PLATFORMS = ("gke", "eks")
DRAIN_DEADLINE_S = 25  # a reclaimed pod's notice to Ray: GKE gives spot VMs 30 s, EKS's spot notice is 2 min
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
    else:
        selector = {"eks.amazonaws.com/capacityType": "SPOT", "node.kubernetes.io/instance-type": kind.instance_type}
    return selector, tolerations


def _on_demand(platform: str) -> dict:
    """The head pod's placement: never a spot node (the controller lives there)."""
    if platform == "eks":
        return {"nodeSelector": {"eks.amazonaws.com/capacityType": "ON_DEMAND"}}
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "cloud.google.com/gke-spot", "operator": "DoesNotExist"}]}]}}}}


def _pod_size(kind: NodeKind, platform: str) -> tuple[int, int]:
    """(CPUs, GiB) a worker pod asks for: what the node's machine type leaves after the kubelet and daemons
    (4 vCPUs and 15% of memory kept back). GKE machines are sized by their own type, not the EC2 instance's."""
    if platform == "gke":
        _, vcpus, gb = kind.gke_machine
        return vcpus - 4, int(gb * 1e9 / 2**30 * 0.85)
    return kind.num_cpus - 4, int(kind.memory_gib * 0.85)


def _container(name: str, image: str, cpu: int, mem_gib: int, gpus: int = 0) -> dict:
    limits = {"cpu": str(cpu), "memory": f"{mem_gib}Gi"} | ({"nvidia.com/gpu": str(gpus)} if gpus else {})
    return {"name": name, "image": image, "resources": {"limits": limits, "requests": dict(limits)}}


def _drain_on_stop() -> dict:
    """A reclaimed pod is a notice, not a crash: before the kubelet stops it, the pod asks Ray to drain its node
    with a deadline (hetspot heeds Ray's drain: it moves the job off the node at a step boundary)."""
    me = "python -c 'import ray; ray.init(address=\"auto\", logging_level=\"ERROR\"); print(ray.get_runtime_context().get_node_id())'"
    return {"preStop": {"exec": {"command": ["/bin/sh", "-c", (
        f"NODE=$({me}) && ray drain-node --node-id \"$NODE\" --reason DRAIN_NODE_REASON_PREEMPTION "
        f"--reason-message pod-terminating --deadline-remaining-seconds {DRAIN_DEADLINE_S}; "
        f"sleep {DRAIN_DEADLINE_S}")]}}}


def kuberay_cluster(mix: str | None = None, platform: str = "gke", image: str = DEFAULT_IMAGE,
                    cluster_name: str = "hetspot-spot") -> dict:
    """A RayCluster as KubeRay (1.5 and later) accepts it: node labels and custom resources in each group's
    top-level `labels` and `resources` fields, token auth through `spec.authOptions` (the operator makes the
    Secret and gives the token to every container, the autoscaler and the RayJob submitter), the head on
    on-demand capacity, workers on spot pools sized from the platform's machine types."""
    from orchestrator.deploy.fleet import DEFAULT_GKE_MIX, DEFAULT_MIX, MixError

    if platform not in PLATFORMS:
        raise MixError(f"--platform {platform!r} must be one of {', '.join(PLATFORMS)}")
    kinds = parse_mix(mix or (DEFAULT_GKE_MIX if platform == "gke" else DEFAULT_MIX))
    head = _container("ray-head", image, 8, 32)
    head["env"] = list(HEALTH_ENV)
    groups = []
    for kind, count in kinds:
        if platform == "gke" and kind.gke_accelerator is None:
            raise MixError(f"--mix: GKE has no {kind.gpu_type} GPUs; render it for --platform eks, or drop it")
        selector, tolerations = _k8s_placement(kind, platform)
        cpus, mem_gib = _pod_size(kind, platform)
        worker = _container("ray-worker", image, cpus, mem_gib, kind.num_gpus)
        worker["lifecycle"] = _drain_on_stop()
        groups.append({
            "groupName": _group_name(kind), "replicas": 0, "minReplicas": 0, "maxReplicas": count,
            "rayStartParams": {},
            "resources": {"CPU": str(cpus), "GPU": str(kind.num_gpus), f"accelerator_type:{kind.ray_accelerator}": "1"},
            "labels": _worker_labels(kind),
            "template": {"spec": {"nodeSelector": selector, "tolerations": tolerations, "containers": [worker],
                                  "terminationGracePeriodSeconds": DRAIN_DEADLINE_S + 5}},
        })
    return {
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": {"name": cluster_name, "labels": {"app.kubernetes.io/part-of": "hetspot"}},
        "spec": {
            "rayVersion": RAY_VERSION, "enableInTreeAutoscaling": True,
            "authOptions": {"mode": "token"},
            "headGroupSpec": {
                "rayStartParams": {"dashboard-host": "0.0.0.0", "metrics-export-port": "8080"},
                "resources": {"GPU": "0"},
                "labels": {LABEL_MARKET: "on-demand", LABEL_NODE: "head"},
                "template": {"spec": {"containers": [head]} | _on_demand(platform)},
            },
            "workerGroupSpecs": groups,
        },
    }


EXAMPLE_JOB = {"name": "tiny-on-kuberay", "model": {"preset": "small"}, "train": {"global_batch": 32, "lr": 0.003},
               "steps": 20}


def kuberay_job(cluster_name: str = "hetspot-spot", job: dict | None = None) -> list[dict]:
    """A RayJob on the RayCluster whose entry point is hetspot's driver itself (`python -m orchestrator.driver`,
    the job spec in its runtime env), submitted by KubeRay's submitter with the cluster's token."""
    from orchestrator.job_spec import parse_job
    from orchestrator.runtime.progress_lines import ENV_ID, ENV_JOB

    spec = parse_job(job or EXAMPLE_JOB, "the RayJob's job")
    runtime_env = {"env_vars": {ENV_JOB: spec.model_dump_json(), ENV_ID: spec.name, "RAY_DEDUP_LOGS": "0"}}
    return [
        {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": spec.name},
         "spec": {"clusterSelector": {"ray.io/cluster": cluster_name},
                  "entrypoint": "python -m orchestrator.driver",
                  "runtimeEnvYAML": yaml.safe_dump(runtime_env, sort_keys=True, width=1 << 20)}},
    ]


def to_yaml(docs: dict | list[dict], command: str) -> str:
    """YAML text with a header naming the command that made it (re-render rather than edit by hand)."""
    docs = docs if isinstance(docs, list) else [docs]
    header = f"# Generated by `{command}`.\n# Edit the templates in orchestrator/deploy/render.py and re-render, not this file.\n"
    return header + "---\n".join(yaml.safe_dump(d, sort_keys=False, width=120) for d in docs)
