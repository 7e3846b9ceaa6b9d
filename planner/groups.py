"""TP groups: a node's GPUs in groups of one TP degree, the search's unit of hardware (a group is one stage's GPUs),
and the TP degrees a cluster and a model allow."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from planner import cost
from planner.contract import tp_problem
from planner.plan_types import UnusedDevice
from planner.specs import ClusterSpec, ModelSpec, NodeSpec, TrainSpec


@dataclass(frozen=True)
class Group:
    node: str
    devices: tuple[str, ...]
    slot: cost.Slot

    @functools.cached_property
    def kind(self) -> cost.Slot:
        """Every hardware field but the node's name (host memory included): groups of one kind are
        interchangeable."""
        return cost.hardware(self.slot)

    @functools.cached_property
    def kind_id(self) -> int:
        return cost.hardware_id(self.slot)


PSet = list[list[Group]]  # pipelines (data-parallel replicas), each its stages' groups in order
Profile = tuple[int, ...]  # every layer's TP degree, for replicas whose stages take different degrees

SMALL_CLUSTER_GPUS = 16  # up to here every TP degree is tried; above, the ones that leave no GPU of a node idle


def tp_candidates(cluster: ClusterSpec, model: ModelSpec) -> list[int]:
    """Degrees that fit a node and divide the model (heads and ffn), powers of two or not: 48 heads on a
    node of 3 GPUs take TP3, and the runtime shards any such degree exactly. On a large cluster a degree
    that is not a power of two is tried only where it divides some node's GPU count (TP3 on 8-GPU nodes
    idles two of each eight, and every extra degree is a whole search more)."""
    most = max(n.num_gpus for n in cluster.nodes)
    small = cluster.num_gpus <= SMALL_CLUSTER_GPUS
    sizes = {n.num_gpus for n in cluster.nodes}
    return [t for t in range(1, most + 1) if tp_problem(model, t) is None
            and (small or t & (t - 1) == 0 or any(g % t == 0 for g in sizes))]


HOST_SPLITS = ("even", "pooled", "first")


def make_groups(cluster: ClusterSpec, train: TrainSpec, tp: int,
                host: str = "even") -> tuple[list[Group], list[UnusedDevice]]:
    """The node's GPUs in TP groups of `tp`. `host`: how the search budgets the node's host RAM (a node
    total) among its groups: "even" gives each GPU its share (every plan fits); "pooled" lets each group
    use all of it (`share_node_host` then settles stages that overflow together); "first" gives all of it
    to the node's first group and none to the others (one stage per node offloads, as much as it needs)."""
    groups, unused = [], []
    for node in cluster.nodes:
        ids = node.device_ids()
        slot = cost.make_slot(cluster, train, node.name, tp)
        full = len(ids) // tp * tp
        for k in range(0, full, tp):
            groups.append(Group(node.name, tuple(ids[k:k + tp]), host_slot(slot, node, k, host)))
        why = f"node has {node.num_gpus} GPUs; TP degree {tp} leaves it without a group"
        unused += [UnusedDevice(device=d, reason=why) for d in ids[full:]]
    return groups, unused


def host_never_binds(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> bool:
    """Whether every group's even share of its node's host RAM holds the offloaded state of a stage of the whole
    model (every layer, the embedding and the head), at every TP degree the search tries. Then host memory
    never excludes a policy (offload_policy.fitting_policies is the only place it binds), so the other host
    splits, which only give some groups more and others less, cannot find a better plan: the search skips them."""
    whole = cost.StageShape(model.num_layers, True, True)
    for tp in tp_candidates(cluster, model):
        need = cost.host_bytes(model, train, whole, tp, cost.Knobs(0, True, False))
        groups, _ = make_groups(cluster, train, tp)
        if any(need > g.slot.host_cap_bytes for g in groups):
            return False
    return True


def host_slot(slot: cost.Slot, node: NodeSpec, first_gpu: int, host: str) -> cost.Slot:
    """A group's slot under a host split (HOST_SPLITS): `first_gpu` is where the group starts on its node."""
    if host == "even" or node.num_gpus <= slot.tp:
        return slot
    whole = node.host_mem * cost.GIB / slot.tp
    return replace(slot, host_cap_bytes=whole if host == "pooled" or first_gpu == 0 else 0.0)


def stage_order(groups: list[Group]) -> list[Group]:
    # The first stage holds the most in-flight activations: give it the most memory.
    return sorted(groups, key=lambda g: (-g.slot.mem_cap_bytes, -g.slot.flops_per_gpu, g.node, g.devices))


def by_kind(g: Group) -> int:
    return g.kind_id


def by_kind_and_node(g: Group) -> tuple[int, str]:
    return g.kind_id, g.node
