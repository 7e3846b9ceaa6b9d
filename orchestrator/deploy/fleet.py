"""What a spot fleet is made of: GPU mixes, instance types per GPU type, and the labels hetspot reads.

Pure data and parsing, shared by the AWS and KubeRay renderers (orchestrator/deploy/render.py).
A mix is "a100:2,l4:4,t4:2": for each GPU type (any name the catalog accepts), the
most worker nodes of that type the cluster may hold.
"""

from __future__ import annotations

# The labels hetspot's discovery reads and the node kinds it knows live in orchestrator/cluster/ (the capacity
# loop reads them too); they are named here for the renderer.
from orchestrator.cluster.labels import (  # noqa: F401
    LABEL_GPU_TYPE,
    LABEL_INSTANCE_ID,
    LABEL_INSTANCE_TYPE,
    LABEL_MARKET,
    LABEL_NODE,
)
from orchestrator.cluster.node_kinds import EC2_SIZES, NODE_KINDS, NodeKind  # noqa: F401

# Ray's AWS launcher picks a default Deep Learning AMI per region (its DEFAULT_AMI table);
# these are the regions it knows. Another region needs an ImageId of the user's own.
AWS_REGIONS = ("us-east-1", "us-east-2", "us-west-1", "us-west-2", "ca-central-1", "eu-central-1", "eu-west-1",
               "eu-west-2", "eu-west-3", "sa-east-1", "ap-northeast-1", "ap-northeast-2", "ap-northeast-3",
               "ap-southeast-1", "ap-southeast-2")



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
