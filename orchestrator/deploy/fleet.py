"""What a spot fleet is made of: GPU mixes, instance types per GPU type, and the labels hetspot reads.

Pure data and parsing, shared by the AWS and KubeRay renderers (orchestrator/deploy/render.py).
A mix is "a100:2,l4:4,t4:2": for each GPU type (any name the catalog accepts), the
most worker nodes of that type the cluster may hold.
"""

from __future__ import annotations

import re

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

# A region's name as AWS spells it (us-east-1, eu-central-2, ap-southeast-5, us-gov-west-1, cn-north-1).
AWS_REGION = re.compile(r"(us-gov|us-iso[a-z]?|[a-z]{2})-[a-z]+-\d+")


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


def check_region(region: str, own_ami: bool = False) -> str:
    """A region the default AMI resolves in (AWS publishes the Deep Learning AMIs' SSM parameters in its
    commercial regions), or any region with `--ami`."""
    if not AWS_REGION.fullmatch(region):
        raise MixError(f"--region {region!r} is not an AWS region name (like us-east-1 or ap-south-1)")
    if not own_ami and region.startswith(("us-gov", "us-iso", "cn-")):
        raise MixError(f"--region {region}: the default AMI is resolved from AWS's public DLAMI parameter, which "
                       "this partition may not publish; pass --ami with the ami-... id of a GPU AMI there (an "
                       "NVIDIA driver, Docker and the NVIDIA container toolkit)")
    return region
