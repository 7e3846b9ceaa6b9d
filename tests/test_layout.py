"""A plan's geometry (planner/layout.py), the one place every layer asks what a stage, rank or node holds:
the embedding belongs to a pipeline's first stage and the head to its last, even when such an edge stage holds
no transformer layer; ranks come in plan order; gradient groups cover every extended layer once per TP rank."""

import pytest

from planner import Pipeline, Plan, Stage, layout

pytestmark = pytest.mark.unit


def stage(a: int, b: int, node: str, tp: int = 1) -> Stage:
    return Stage(layer_start=a, layer_end=b, gpu_type="L4", node=node, devices=[f"{node}/{k}" for k in range(tp)])


def plan(*pipelines: list[Stage], layers: int = 4) -> Plan:
    return Plan(model_name="m", num_layers=layers, global_batch=8, pipelines=[
        Pipeline(num_samples=8 // len(pipelines), micro_batch_size=1, num_micro_batches=8 // len(pipelines), stages=s)
        for s in pipelines])


def test_edge_stages_hold_the_embedding_and_the_head_even_when_empty():
    p = plan([stage(0, 0, "a"), stage(0, 4, "b"), stage(4, 4, "c")])  # embedding alone, every block, head alone
    assert list(layout.stage_layers(p)) == [("a", range(-1, 0)), ("b", range(0, 4)), ("c", range(4, 5))]
    assert layout.held_by_node(p) == {"a": {-1}, "b": {0, 1, 2, 3}, "c": {4}}
    assert layout.rank_spans(p) == [("a", -1, 0), ("b", 0, 4), ("c", 4, 5)]


def test_rank_spans_follow_ranks_in_plan_order_with_tp_groups_and_replicas():
    p = plan([stage(0, 2, "a", tp=2), stage(2, 4, "b")], [stage(0, 4, "c")])
    assert [(r.rank, r.pipeline, r.stage, r.tp_rank, r.node) for r in layout.ranks(p)] == [
        (0, 0, 0, 0, "a"), (1, 0, 0, 1, "a"), (2, 0, 1, 0, "b"), (3, 1, 0, 0, "c")]
    assert layout.rank_spans(p) == [("a", -1, 2), ("a", -1, 2), ("b", 2, 5), ("c", -1, 5)]
    assert layout.held_by_node(p) == {"a": {-1, 0, 1}, "b": {2, 3, 4}, "c": set(range(-1, 5))}
    assert layout.held_by_node(None) == {}


def test_gradient_groups_cover_every_extended_layer_once_per_tp_rank_with_every_holder():
    # replicas split differently (the TP degree of a layer is the same in every replica that holds it)
    p = plan([stage(0, 2, "a", tp=2), stage(2, 4, "b")], [stage(0, 1, "c", tp=2), stage(1, 2, "d", tp=2),
                                                          stage(2, 4, "e")])
    groups = layout.grad_groups(p)
    assert {(g.start, g.end, g.tp_rank, g.ranks) for g in groups} == {
        (-1, 1, 0, (0, 3)), (-1, 1, 1, (1, 4)), (1, 2, 0, (0, 5)), (1, 2, 1, (1, 6)), (2, 5, 0, (2, 7))}
    for tp_rank in (0, 1):
        spans = sorted((g.start, g.end) for g in groups if g.tp_rank == tp_rank)
        covered = [x for a, b in spans for x in range(a, b)]
        assert covered == sorted(set(covered))  # no layer twice
    for g in groups:  # every rank holding the segment (with that TP rank) is in its group
        holders = {r for r, (node, a, b) in enumerate(layout.rank_spans(p))
                   if a <= g.start and g.end <= b and layout.ranks(p)[r].tp_rank == g.tp_rank}
        assert set(g.ranks) == holders, (g, holders)
