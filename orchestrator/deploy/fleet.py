"""What a spot fleet is made of: GPU mixes, instance types per GPU type, and the labels hetspot reads.

Pure data and parsing, shared by the AWS and KubeRay renderers (orchestrator/deploy/render.py).
A mix is "a100:2,l4:4,t4:2": for each GPU type (any name the catalog accepts), the
most worker nodes of that type the cluster may hold.
"""

from __future__ import annotations

from dataclasses import dataclass

# Ray's AWS launcher picks a default Deep Learning AMI per region (its DEFAULT_AMI table);
# these are the regions it knows. Another region needs an ImageId of the user's own.
AWS_REGIONS = ("us-east-1", "us-east-2", "us-west-1", "us-west-2", "ca-central-1", "eu-central-1", "eu-west-1",
               "eu-west-2", "eu-west-3", "sa-east-1", "ap-northeast-1", "ap-northeast-2", "ap-northeast-3",
               "ap-southeast-1", "ap-southeast-2")

# Label keys hetspot's discovery reads (orchestrator/cluster/labels.py, named here for the renderer).
from orchestrator.cluster.labels import (  # noqa: E402, F401
    LABEL_GPU_TYPE,
    LABEL_INSTANCE_ID,
    LABEL_INSTANCE_TYPE,
    LABEL_MARKET,
    LABEL_NODE,
)


@dataclass(frozen=True)
class NodeKind:
    gpu_type: str  # the catalog's name
    instance_type: str  # EC2 (AWS, EKS)
    num_gpus: int
    num_cpus: int
    ray_accelerator: str  # what Ray itself detects: the accelerator_type:<T> resource
    gke_accelerator: str | None  # cloud.google.com/gke-accelerator, None where GKE has no such GPU
    memory_gib: int  # host memory of the instance
    gke_machine: tuple[str, int, int] | None = None  # GKE machine type of the same GPU count: (name, vCPUs, GB)

    @property
    def slug(self) -> str:
        return self.gpu_type.lower().replace("-", "")


# EC2 instance families per GPU type (AWS instance type pages: p5, p4d/p4de, g5, g6, g6e, g4dn, p3).
# GKE machine types (Compute Engine's GPU machine pages: A3 High, A2 Ultra, A2 High, G2; N1 with attached
# T4 and V100): the pod of a group is sized from these, not from the EC2 instance.
NODE_KINDS: dict[str, NodeKind] = {k.gpu_type: k for k in [
    NodeKind("H100-SXM", "p5.48xlarge", 8, 192, "H100", "nvidia-h100-80gb", 2048, ("a3-highgpu-8g", 208, 1872)),
    NodeKind("A100-80GB", "p4de.24xlarge", 8, 96, "A100", "nvidia-a100-80gb", 1152, ("a2-ultragpu-8g", 96, 1360)),
    NodeKind("A100-40GB", "p4d.24xlarge", 8, 96, "A100", "nvidia-tesla-a100", 1152, ("a2-highgpu-8g", 96, 680)),
    NodeKind("L40S", "g6e.12xlarge", 4, 48, "L40S", None, 384),
    NodeKind("A10G", "g5.12xlarge", 4, 48, "A10G", None, 192),
    NodeKind("L4", "g6.12xlarge", 4, 48, "L4", "nvidia-l4", 192, ("g2-standard-48", 48, 192)),
    NodeKind("T4", "g4dn.12xlarge", 4, 48, "T4", "nvidia-tesla-t4", 192, ("n1-standard-48", 48, 180)),
    NodeKind("V100-16GB", "p3.8xlarge", 4, 32, "V100", "nvidia-tesla-v100", 244, ("n1-standard-32", 32, 120)),
]}

# EC2 GPU instance sizes (AWS's instance type pages): name -> (GPU type, GPUs, vCPUs, GiB). A fleet chosen from a
# catalog, or a job's fleet types, render to exactly these instance types (`kinds_for_fleet`).
EC2_SIZES: dict[str, tuple[str, int, int, int]] = {
    "g4dn.xlarge": ("T4", 1, 4, 16), "g4dn.2xlarge": ("T4", 1, 8, 32), "g4dn.12xlarge": ("T4", 4, 48, 192),
    "g4dn.metal": ("T4", 8, 96, 384),
    "g5.xlarge": ("A10G", 1, 4, 16), "g5.2xlarge": ("A10G", 1, 8, 32), "g5.12xlarge": ("A10G", 4, 48, 192),
    "g5.48xlarge": ("A10G", 8, 192, 768),
    "g6.xlarge": ("L4", 1, 4, 16), "g6.2xlarge": ("L4", 1, 8, 32), "g6.12xlarge": ("L4", 4, 48, 192),
    "g6.48xlarge": ("L4", 8, 192, 768),
    "g6e.xlarge": ("L40S", 1, 4, 32), "g6e.12xlarge": ("L40S", 4, 48, 384), "g6e.48xlarge": ("L40S", 8, 192, 1536),
    "p3.2xlarge": ("V100-16GB", 1, 8, 61), "p3.8xlarge": ("V100-16GB", 4, 32, 244),
    "p3.16xlarge": ("V100-16GB", 8, 64, 488),
    "p4d.24xlarge": ("A100-40GB", 8, 96, 1152), "p4de.24xlarge": ("A100-80GB", 8, 96, 1152),
    "p5.48xlarge": ("H100-SXM", 8, 192, 2048),
}


def instance_kind(name: str) -> NodeKind:
    """The node kind of one EC2 instance type (its GPU type's Ray name; no GKE machine)."""
    if name not in EC2_SIZES:
        raise MixError(f"instance type {name!r} is not in hetspot's deploy table; use one of "
                       f"{', '.join(sorted(EC2_SIZES))}")
    gpu, gpus, vcpus, mem = EC2_SIZES[name]
    return NodeKind(gpu, name, gpus, vcpus, NODE_KINDS[gpu].ray_accelerator, None, mem)


def kind_for(gpu_type: str, gpus_per_node: int) -> NodeKind:
    """The node kind serving nodes of `gpus_per_node` GPUs of `gpu_type`: the deploy table's default instance when
    its GPU count matches, else the smallest listed size with that count; MixError when none has it."""
    default = NODE_KINDS.get(gpu_type)
    if default is not None and default.num_gpus == gpus_per_node:
        return default
    sizes = sorted((v[2], k) for k, v in EC2_SIZES.items() if v[0] == gpu_type and v[1] == gpus_per_node)
    if not sizes:
        have = sorted({v[1] for v in EC2_SIZES.values() if v[0] == gpu_type})
        raise MixError(f"no shipped node type serves {gpu_type} nodes of {gpus_per_node} GPUs "
                       + (f"(the deploy table has {gpu_type} nodes of {', '.join(map(str, have))} GPUs): set "
                          "gpus_per_node to one of those" if have else f"(the deploy table has no {gpu_type} "
                          "instance): choose another GPU type"))
    return instance_kind(sizes[0][1])


DEFAULT_MIX = "h100:1,a100:2,a10g:2,l4:4,t4:4"
DEFAULT_GKE_MIX = "h100:1,a100:2,l4:4,t4:4"  # GKE has no A10G


class MixError(ValueError):
    """A --mix that names an unknown GPU type or a bad count; the message says the fix."""


def parse_mix(text: str) -> list[tuple[NodeKind, int]]:
    """`"a100:2,l4:4"` -> [(A100-40GB kind, 2), (L4 kind, 4)], in the order given."""
    out: dict[str, tuple[NodeKind, int]] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, count = part.partition(":")
        if not sep or not count.strip().lstrip("-").isdigit():
            raise MixError(f"--mix entry {part!r} must be GPU_TYPE:NODES, like 'l4:4'")
        try:
            from planner.catalog import (
                canonical_gpu_type,  # the planner: imported when a mix is read, not for --help
            )

            gpu = canonical_gpu_type(name)
        except ValueError as e:
            raise MixError(f"--mix entry {part!r}: {e}") from None
        if gpu not in NODE_KINDS:
            raise MixError(f"--mix entry {part!r}: no spot instance type for {gpu} in hetspot's deploy table; "
                           f"use one of {', '.join(k.lower() for k in NODE_KINDS)}")
        n = int(count)
        if n < 1:
            raise MixError(f"--mix entry {part!r}: the node count must be at least 1 (drop the entry to leave "
                           "the type out)")
        if gpu in out:
            raise MixError(f"--mix names {gpu} twice; give each GPU type once")
        out[gpu] = (NODE_KINDS[gpu], n)
    if not out:
        raise MixError(f"--mix is empty; give GPU_TYPE:NODES pairs, like {DEFAULT_MIX!r}")
    return list(out.values())


def check_region(region: str) -> str:
    if region not in AWS_REGIONS:
        raise MixError(f"--region {region!r} is not one where Ray's AWS launcher has a default AMI; use one of "
                       f"{', '.join(AWS_REGIONS)}, or render for one and set node_config.ImageId yourself")
    return region
