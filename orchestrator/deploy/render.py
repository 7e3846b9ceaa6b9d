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
DEFAULT_INSTALL = "hetspot==0.1.0"  # a wheel path or a git URL works too
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
               cluster_name: str = "hetspot-spot") -> dict:
    kinds = parse_mix(mix)
    check_region(region)
    nodes: dict = {"head": {
        "node_config": {"InstanceType": HEAD_INSTANCE},
        "resources": {"CPU": 8, "GPU": 0},
        "labels": {LABEL_MARKET: "on-demand", LABEL_NODE: "head"},
        "min_workers": 0, "max_workers": 0,
    }}
    for kind, count in kinds:
        nodes[_group_name(kind)] = {
            "node_config": {"InstanceType": kind.instance_type, "InstanceMarketOptions": {"MarketType": "spot"}},
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
        "setup_commands": [f"pip install -U '{install}'"],
        "head_start_ray_commands": [
            "ray stop",
            f"{auth} ray start --head --port=6379 --dashboard-host=0.0.0.0 --metrics-export-port=8080 "
            f"--autoscaling-config=~/ray_bootstrap_config.yaml --system-config='{json.dumps(HEALTH)}'",
        ],
        "worker_start_ray_commands": [
            "ray stop",
            _imds_labels_then(f"{auth} ray start --address=$RAY_HEAD_IP:6379 --metrics-export-port=8080"),
        ],
    }


# -- KubeRay ---------------------------------------------------------------------------
PLATFORMS = ("gke", "eks")


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


def _container(name: str, image: str, cpu: int, mem_gib: int, gpus: int = 0) -> dict:
    limits = {"cpu": str(cpu), "memory": f"{mem_gib}Gi"} | ({"nvidia.com/gpu": str(gpus)} if gpus else {})
    return {"name": name, "image": image, "resources": {"limits": limits, "requests": dict(limits)},
            "env": [{"name": "RAY_AUTH_MODE", "value": "token"},
                    {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hetspot-ray-token",
                                                                               "key": "token"}}}]}


def _labels_param(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def kuberay_cluster(mix: str, platform: str = "gke", image: str = DEFAULT_IMAGE,
                    cluster_name: str = "hetspot-spot") -> dict:
    from orchestrator.deploy.fleet import MixError

    if platform not in PLATFORMS:
        raise MixError(f"--platform {platform!r} must be one of {', '.join(PLATFORMS)}")
    kinds = parse_mix(mix)
    head = _container("ray-head", image, 8, 32)
    head["volumeMounts"] = [{"name": "hetspot-job", "mountPath": "/etc/hetspot"}]
    groups = []
    for kind, count in kinds:
        if platform == "gke" and kind.gke_accelerator is None:
            raise MixError(f"--mix: GKE has no {kind.gpu_type} GPUs; render it for --platform eks, or drop it")
        selector, tolerations = _k8s_placement(kind, platform)
        groups.append({
            "groupName": _group_name(kind), "replicas": 0, "minReplicas": 0, "maxReplicas": count,
            "rayStartParams": {"num-gpus": str(kind.num_gpus),
                               "resources": json.dumps(json.dumps({f"accelerator_type:{kind.ray_accelerator}": 1})),
                               "labels": _labels_param(_worker_labels(kind))},
            "template": {"spec": {"nodeSelector": selector, "tolerations": tolerations, "containers": [
                _container("ray-worker", image, kind.num_cpus - 4, int(kind.memory_gib * 0.85), kind.num_gpus)]}},
        })
    return {
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": {"name": cluster_name, "labels": {"app.kubernetes.io/part-of": "hetspot"}},
        "spec": {
            "rayVersion": RAY_VERSION, "enableInTreeAutoscaling": True,
            "headGroupSpec": {
                "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0", "metrics-export-port": "8080",
                                   "system-config": json.dumps(HEALTH),
                                   "labels": _labels_param({LABEL_MARKET: "on-demand", LABEL_NODE: "head"})},
                "template": {"spec": {"containers": [head], "volumes": [
                    {"name": "hetspot-job", "configMap": {"name": "hetspot-job", "optional": True}}]}},
            },
            "workerGroupSpecs": groups,
        },
    }


def kuberay_job(cluster_name: str = "hetspot-spot") -> list[dict]:
    """A ConfigMap holding a job file and a RayJob on the RayCluster that runs `hetspot submit` on its head."""
    job_yaml = ("name: tiny-on-kuberay\nmodel: {preset: small}\ntrain: {global_batch: 32, lr: 0.003}\n"
                "steps: 20\n")
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "hetspot-job"}, "data": {"job.yaml": job_yaml}},
        {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "hetspot-job"},
         "spec": {"clusterSelector": {"ray.io/cluster": cluster_name},
                  "entrypoint": "hetspot submit /etc/hetspot/job.yaml --address http://127.0.0.1:8265 --follow",
                  "shutdownAfterJobFinishes": False}},
    ]


def to_yaml(docs: dict | list[dict], command: str) -> str:
    """YAML text with a header naming the command that made it (re-render rather than edit by hand)."""
    docs = docs if isinstance(docs, list) else [docs]
    header = f"# Generated by `{command}`.\n# Edit the templates in orchestrator/deploy/render.py and re-render, not this file.\n"
    return header + "---\n".join(yaml.safe_dump(d, sort_keys=False, width=120) for d in docs)
