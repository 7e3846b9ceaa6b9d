"""A Plan's geometry in one place, as pure functions (no torch, no Ray): ranks, the layers each stage,
rank and node holds, and the gradient groups.

Ranks are numbered in plan order: pipeline, stage, TP rank. Gradient groups
follow AutoHet's layer-wise sync across asymmetric replicas: intersect all
replicas' stage boundaries into segments; each (segment, TP rank) is one
all-reduce group holding that segment's rank in every replica. The embedding
and the head are pseudo-layers -1 and L, owned by first and last stages.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from planner.plan_types import Plan

EMBED, HEAD = "embed", "head"  # pseudo-layers of parameters: before block 0 and after the last block


def extended_layer(layer: int | str, num_layers: int) -> int:
    """A parameter's layer as an index: -1 for the embedding, num_layers for the head."""
    return -1 if layer == EMBED else num_layers if layer == HEAD else int(layer)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    pipeline: int
    stage: int
    tp_rank: int
    device: str
    node: str


@dataclass(frozen=True)
class GradGroup:
    start: int  # extended layer index, inclusive (-1 = embedding)
    end: int  # exclusive (num_layers + 1 includes the head)
    tp_rank: int
    ranks: tuple[int, ...]


def ranks(plan: Plan) -> list[RankInfo]:
    out: list[RankInfo] = []
    for r, p in enumerate(plan.pipelines):
        for i, st in enumerate(p.stages):
            for k, d in enumerate(st.devices):
                out.append(RankInfo(len(out), r, i, k, d, st.node))
    return out


def stage_ranks(plan: Plan) -> list[list[list[int]]]:
    """[pipeline][stage] -> global ranks of the TP group, in TP order."""
    table, n = [], 0
    for p in plan.pipelines:
        row = []
        for st in p.stages:
            row.append(list(range(n, n + st.tp)))
            n += st.tp
        table.append(row)
    return table


def extended_range(plan: Plan, pipeline: int, stage: int) -> tuple[int, int]:
    """The extended layers [start, end) a stage holds: a pipeline's first stage also holds the embedding (-1), its
    last the head (num_layers), whatever transformer layers they hold (an edge stage may hold none)."""
    p = plan.pipelines[pipeline]
    st = p.stages[stage]
    start = -1 if stage == 0 else st.layer_start
    end = plan.num_layers + 1 if stage == len(p.stages) - 1 else st.layer_end
    return start, end


def stage_layers(plan: Plan) -> Iterator[tuple[str, range]]:
    """(node, range of extended layers) per stage of `plan`, in plan order."""
    for r, pipe in enumerate(plan.pipelines):
        for i, st in enumerate(pipe.stages):
            yield st.node, range(*extended_range(plan, r, i))


def held_by_node(plan: Plan | None) -> dict[str, set[int]]:
    """Per node of `plan` (None: nothing), the extended layers its stages hold."""
    held: dict[str, set[int]] = {}
    for node, layers in stage_layers(plan) if plan is not None else ():
        held.setdefault(node, set()).update(layers)
    return held


def rank_spans(plan: Plan) -> list[tuple[str, int, int]]:
    """(node, first extended layer, end) per rank of `plan`: what each rank's state (and its peer copy) holds."""
    return [(r.node, *extended_range(plan, r.pipeline, r.stage)) for r in ranks(plan)]


def grad_groups(plan: Plan) -> list[GradGroup]:
    cuts = {-1, plan.num_layers + 1}
    for r, p in enumerate(plan.pipelines):
        for i in range(len(p.stages)):
            cuts.update(extended_range(plan, r, i))
    bounds = sorted(cuts)
    table = stage_ranks(plan)
    groups = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        holders = []
        for r, p in enumerate(plan.pipelines):
            i = next(i for i in range(len(p.stages))
                     if extended_range(plan, r, i)[0] <= a < extended_range(plan, r, i)[1])
            holders.append(table[r][i])
        tp = len(holders[0])
        for k in range(tp):
            groups.append(GradGroup(a, b, k, tuple(h[k] for h in holders)))
    return groups


def tp_groups(plan: Plan) -> list[list[int]]:
    return [g for row in stage_ranks(plan) for g in row if len(g) > 1]


def p2p_peers(plan: Plan, pipeline: int, stage: int,
              tp_rank: int) -> tuple[int | None, list[int], int | None, list[int]]:
    """(rank to receive activations from, ranks to send activations to,
        rank to receive gradients from, ranks to send gradients to).

    Activations are replicated across a TP group, so next-stage rank k reads from
    previous-stage rank k mod t_prev; gradients flow back the same way.
    """
    table = stage_ranks(plan)[pipeline]
    recv_act = send_act = recv_grad = None
    send_act, send_grad = [], []
    if stage > 0:
        prev = table[stage - 1]
        recv_act = prev[tp_rank % len(prev)]
        send_grad = [prev[j] for j in range(len(prev)) if j % len(table[stage]) == tp_rank]
    if stage + 1 < len(table):
        nxt = table[stage + 1]
        send_act = [nxt[k] for k in range(len(nxt)) if k % len(table[stage]) == tp_rank]
        recv_grad = nxt[tp_rank % len(nxt)]
    return recv_act, send_act, recv_grad, send_grad
