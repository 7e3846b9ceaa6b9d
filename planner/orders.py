"""Stage orders: which GPU groups sit at which stage of each replica. Where a stage sits decides its neighbours'
point-to-point links and, on small clusters, which nodes share each layer's gradient sync."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from typing import Any

from planner.groups import Group, by_kind

MAX_ORDERS = 24  # stage orders tried per pipeline at most

def node_aligned(pset: list[list[Group]]) -> list[list[Group]]:
    """The same pipelines with the groups of each kind dealt out stage position by stage position, node by
    node: stages that hold the same layers in different replicas then share a node where the kinds allow,
    so their gradient sync stays on its intra-node link (the list order keeps each pipeline's stages on
    one node instead, which favours the point-to-point links)."""
    pools: dict[int, list[Group]] = {}
    for p in pset:
        for g in p:
            pools.setdefault(g.kind_id, []).append(g)
    for gs in pools.values():
        gs.sort(key=lambda g: (g.node, g.devices))
    out: list[list[Group | None]] = [[None] * len(p) for p in pset]
    for pos in range(max(len(p) for p in pset)):
        for r, p in enumerate(pset):
            if pos < len(p):
                out[r][pos] = pools[p[pos].kind_id].pop(0)
    return out  # type: ignore[return-value]


def shape_key(pset: list[list[Group]]) -> tuple:
    """What a pipeline set's cost depends on: each stage's kind and node (groups of one kind on one node are
    interchangeable)."""
    return tuple(tuple((g.kind_id, g.node) for g in p) for p in pset)


def node_orders(pset: list[list[Group]], most_nodes: int = 4) -> list[list[list[Group]]]:
    """Every pipeline's stages in one order of nodes, for each order of the set's nodes (up to `most_nodes`
    of them): replicas that walk the nodes alike keep a layer's copies on one node where they can."""
    nodes = sorted({g.node for p in pset for g in p})
    if len(pset) < 2 or len(nodes) < 2 or len(nodes) > most_nodes:
        return []
    out = []
    for perm in itertools.permutations(nodes):
        rank = {n: i for i, n in enumerate(perm)}
        out.append([sorted(p, key=lambda g: (rank[g.node], g.devices)) for p in pset])
    return out


def distinct_orders(groups: list, limit: int, key: Callable[[Any], Hashable] = by_kind) -> list[list]:
    """Orders of `groups` that differ in some position's `key` (a group's kind by default), in the given
    order first, at most `limit`."""
    out: list[list] = []

    def rec(prefix: list[Group], rest: list[Group]) -> None:
        if len(out) >= limit:
            return
        if not rest:
            out.append(list(prefix))
            return
        tried = set()
        for i, g in enumerate(rest):
            k = key(g)
            if k in tried:
                continue
            tried.add(k)
            prefix.append(g)
            rec(prefix, rest[:i] + rest[i + 1:])
            prefix.pop()

    rec([], groups)
    return out
