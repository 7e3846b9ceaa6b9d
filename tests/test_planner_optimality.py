"""On small clusters the planner is within 1% of exhaustive enumeration.

The clusters have at most 8 GPUs on up to 4 nodes whose networks differ (each node its own NIC and
intra-node bandwidth), so where each replica's stages sit decides which link every layer's gradient sync
uses; the models have 12, 16, 24 or 48 heads, so TP degrees that are not powers of two (3, 6) divide them.
The reference (tests/enumerator.py) enumerates every plan the contract allows, stages of different TP
degrees included (a layer at one degree in every replica that holds it).
"""

import itertools
import math

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec, evaluate, plan
from planner.baselines import all_baselines
from tests.enumerator import best_plan

pytestmark = pytest.mark.sweep  # pure, but minutes: a sweep over many clusters

TYPES = ["A100-80GB", "A100-40GB", "L4", "T4", "V100-16GB", "H100-SXM"]


@st.composite
def instances(draw):
    types = draw(st.lists(st.sampled_from(TYPES), min_size=1, max_size=3, unique=True))
    nodes, total = [], 0
    for i in range(draw(st.integers(1, 4))):
        gpus = draw(st.integers(1, 4))
        if total + gpus > 8:
            break
        total += gpus
        nodes.append(NodeSpec(name=f"n{i}", gpu_type=draw(st.sampled_from(types)), num_gpus=gpus,
                              intra_node_bw_gb_s=draw(st.sampled_from([None, 16.0, 300.0])),
                              inter_node_bw_gb_s=draw(st.sampled_from([1.0, 3.0, 12.5, 25.0]))))
    heads = draw(st.sampled_from([12, 16, 24, 48]))
    model = ModelSpec(name="t", num_layers=draw(st.integers(2, 4)),
                      hidden_size=heads * draw(st.sampled_from([64, 128])),
                      num_heads=heads, vocab_size=draw(st.sampled_from([32000, 50304])),
                      seq_len=draw(st.sampled_from([1024, 2048, 4096])))
    # Memory pressure varies: small GPUs sometimes need recompute or offload.
    train = TrainSpec(global_batch=draw(st.integers(1, 6)), memory_reserve_gib=draw(st.sampled_from([2.0, 8.0])),
                      max_micro_batch_size=4)
    return ClusterSpec(nodes=nodes), model, train


def _sweep(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# `make test` draws 60 clusters; `make test-all` draws 200 others (the sweep that settled the planner).
@_sweep(60)
@given(instances())
def test_planner_within_one_percent_of_exhaustive(inst):
    _within_one_percent_of_exhaustive(inst)


@pytest.mark.slow
@_sweep(200)
@given(instances())
def test_planner_within_one_percent_of_exhaustive_on_200_other_clusters(inst):
    _within_one_percent_of_exhaustive(inst)


def _within_one_percent_of_exhaustive(inst):
    cluster, model, train = inst
    try:
        mine = plan(cluster, model, train)
        got = mine.estimate.step_time_s
    except ValueError:
        mine, got = None, math.inf
    # Exhaustive below the planner's time (and a hair above it, so the planner's own plan qualifies), over
    # the plans whose every stage holds a layer. The planner also proposes embedding- and head-only stages
    # it may then beat this optimum, never fall short of it by more than 1%. (Over that larger
    # space it is not held to 1%: replicas of different depths around a TP1 head-only stage are missed.)
    best, layout = best_plan(cluster, model, train, bound=got * (1 + 1e-9), edges=False)
    if got == math.inf:
        assert layout is None, f"the planner found nothing, the enumerator found {best:.4g}s"
        return
    edge_stage = any(st.layer_start == st.layer_end for p in mine.pipelines for st in p.stages)
    if layout is None:
        assert edge_stage, "the enumerator's space holds every plan without an edge stage"
        return
    # The enumerator's space holds every plan the planner returns without an edge stage, so it finds one at
    # least as fast...
    assert edge_stage or best <= got * (1 + 1e-9)
    # ... its objective is evaluate's to the last bit ...
    assert evaluate(layout, cluster, model, train).step_time_s == pytest.approx(best, rel=1e-9)
    # ... and the planner is within 1% of it.
    assert 1 / got >= 0.99 * (1 / best), f"planner {got:.4g}s vs exhaustive {best:.4g}s ({layout.pipelines})"


def test_sync_groups_inside_nodes_beat_list_order():
    """The case: 2 nodes x 3 L4 over a 1 GB/s network. Keeping each layer's copies on one node (its
    sync on the intra-node link) beats dealing the GPUs out in list order."""
    nodes = [NodeSpec(name=f"n{i}", gpu_type="L4", num_gpus=3, inter_node_bw_gb_s=1.0) for i in range(2)]
    cluster = ClusterSpec(nodes=nodes)
    model = ModelSpec(name="t", num_layers=4, hidden_size=2048, num_heads=16, vocab_size=32000, seq_len=2048)
    train = TrainSpec(global_batch=6, max_micro_batch_size=4)
    p = plan(cluster, model, train)
    best, layout = best_plan(cluster, model, train)
    assert p.estimate.step_time_s <= best * 1.01
    for layer in range(model.num_layers):  # every layer's replicas sit on one node
        holders = {st.node for pp in p.pipelines for st in pp.stages if st.layer_start <= layer < st.layer_end}
        assert len(holders) == 1 or len(p.pipelines) == 1, (layer, holders)


def test_tp3_is_planned_where_it_divides_the_model():
    """48 heads on one node of 3 L4s: TP3 is a candidate (the runtime shards any degree that divides heads
    and ffn), and the enumerator over every degree agrees with the plan."""
    cluster = ClusterSpec(nodes=[NodeSpec(name="n0", gpu_type="L4", num_gpus=3)])
    model = ModelSpec(name="t", num_layers=2, hidden_size=3072, num_heads=48, vocab_size=50304, seq_len=4096)
    train = TrainSpec(global_batch=1, max_micro_batch_size=4)
    p = plan(cluster, model, train)
    best, _ = best_plan(cluster, model, train)
    assert p.estimate.step_time_s <= best * 1.01
    from planner.search import tp_candidates
    assert 3 in tp_candidates(cluster, model)


def _degrees(p):
    return [[st.tp for st in pp.stages] for pp in p.pipelines]


def test_per_stage_tp_on_one_node_of_three_t4():
    """3 T4s on one node, 16 heads (TP3 cannot split them): a TP1 stage and a TP2 stage beat every plan of one
    degree (three TP1 stages, or TP2 beside an idle GPU), and they are the optimum of the whole space. (With 24
    heads, TP3 over all three is the optimum since the embedding and head are split by vocabulary under TP.)"""
    cluster = ClusterSpec(nodes=[NodeSpec(name="n0", gpu_type="T4", num_gpus=3)])
    model = ModelSpec(name="t", num_layers=4, hidden_size=1536, num_heads=16, vocab_size=32000, seq_len=1024)
    train = TrainSpec(global_batch=4, max_micro_batch_size=4, memory_reserve_gib=2.0)
    p = plan(cluster, model, train)
    uniform, _ = best_plan(cluster, model, train, uniform=True)
    best, _ = best_plan(cluster, model, train)
    assert sorted(_degrees(p)[0]) == [1, 2], _degrees(p)
    assert p.estimate.step_time_s < uniform / 1.05  # 9% faster than the best plan of one degree

    assert p.estimate.step_time_s <= best * 1.01


def test_per_stage_tp_across_two_nodes_beats_every_plan_of_one_degree():
    """A 4-GPU node and a 3-GPU node (3 GB/s NICs): a TP4 stage then a TP3 stage, every layer of one degree
    wherever it is held (the plan contract checks it) with its copies on one node, beating every plan of one
    degree by over 5%. (Before the embedding and head were split by vocabulary under TP, the optimum here was
    two replicas of a TP2 and a TP1 stage, and over 10% ahead.)"""
    nodes = [NodeSpec(name="n0", gpu_type="V100-16GB", num_gpus=4, inter_node_bw_gb_s=3.0, intra_node_bw_gb_s=300.0),
             NodeSpec(name="n1", gpu_type="V100-16GB", num_gpus=3, inter_node_bw_gb_s=3.0, intra_node_bw_gb_s=16.0),
             NodeSpec(name="n2", gpu_type="V100-16GB", num_gpus=1, inter_node_bw_gb_s=3.0, intra_node_bw_gb_s=300.0)]
    # The case was built at the V100's former default efficiency (0.55 of peak; bench/calibration.py holds
    # the catalog's at 0.35 now), so it is pinned there: the property is the search's, not the catalog's.
    cluster = ClusterSpec(nodes=nodes, calibration={"V100-16GB": 0.55})
    model = ModelSpec(name="t", num_layers=4, hidden_size=3072, num_heads=24, vocab_size=50304, seq_len=4096)
    train = TrainSpec(global_batch=6, max_micro_batch_size=4, memory_reserve_gib=8.0)
    p = plan(cluster, model, train)
    uniform, _ = best_plan(cluster, model, train, uniform=True)
    assert all(len(set(d)) > 1 for d in _degrees(p)), _degrees(p)
    p.check_structure()
    for layer in range(model.num_layers):
        holders = {(st.node, st.tp) for pp in p.pipelines for st in pp.stages if st.layer_start <= layer < st.layer_end}
        assert len(holders) == 1, (layer, holders)
    assert p.estimate.step_time_s < uniform / 1.05


@settings(max_examples=40, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(instances())
def test_search_bounds_and_scores_are_honest(inst):
    """The exact search skips a layout when its lower bound (`floor`: every gradient-sync group at the fastest
    link the layout's splits could give it) reaches the best scores so far. A bound above a layout's own
    score would drop plans silently; the looser one-bandwidth bound must not exceed the per-group one. And
    a score is the time `evaluate` gives the plan built from it, even where the replicas' splits never agree
    on the links they hoped for (the round is charged at the links its splits imply)."""
    from planner.assembly import build_plan
    from planner.candidates import exhaustive_sets
    from planner.groups import make_groups
    from planner.orders import node_aligned, node_orders
    from planner.scoring import SetCost

    cluster, model, train = inst
    srch = SetCost(cluster, model, train)
    groups, _ = make_groups(cluster, train, 1)
    for pset in itertools.islice(exhaustive_sets(groups, model.num_layers), 60):
        pset = [srch.best_order(p, len(pset), True) for p in pset]
        for v in (pset, node_aligned(pset), *node_orders(pset)):
            ceiling = srch.bw_ceiling(v)
            assert ceiling == srch.bw_ceiling(v) and len(ceiling) == model.num_layers + 2
            fine, coarse = srch.floor(v, bw=ceiling), srch.floor(v, bw=max(ceiling))
            got, _, _ = srch.score(v, True)
            assert coarse <= fine * (1 + 1e-12) and fine <= got * (1 + 1e-12), (coarse, fine, got)
            if got < math.inf:
                built, _ = build_plan(srch, v, True, [])
                assert evaluate(built, cluster, model, train).step_time_s == pytest.approx(got, rel=1e-9)


def _baseline_losses(gpu: str, num_gpus: int, num_nodes: int, preset: str) -> list[tuple]:
    """The baselines (planner/baselines.py) faster than the planner's plan on `num_nodes` nodes of `num_gpus`."""
    cluster = ClusterSpec(nodes=[NodeSpec(name=f"n{i}", gpu_type=gpu, num_gpus=num_gpus, host_mem_gib=64,
                                          inter_node_bw_gb_s=12.5) for i in range(num_nodes)])
    model, train = ModelSpec.preset(preset), TrainSpec(global_batch=64)
    mine = plan(cluster, model, train).estimate.step_time_s
    return [(gpu, num_gpus, num_nodes, preset, name, round(mine / other.estimate.step_time_s, 4))
            for name, other in all_baselines(cluster, model, train).items()
            if other is not None and mine > other.estimate.step_time_s * (1 + 1e-9)]


@pytest.mark.parametrize("gpu", ["T4", "L4", "A10G", "A100-40GB"])
def test_the_planner_never_loses_to_a_baseline_outside_exact_mode(gpu):
    """Every baseline is a plan the planner could have chosen, so under the same cost model it is never
    faster. Outside exact mode the split is costed at m = p micro-batches; a one-stage pipeline's offload
    is chosen again at the m it runs (`PipelineModel._policies_at`). Without that, micro-batch 16 priced
    parameter offload as if no micro-batch hid its transfers, and the planner lost to data-parallel+offload
    by up to 5% (gpt-350m on one T4: 3.5%). (One node of 4 T4s with gpt-1.3b lost to megatron-symmetric's
    4-stage plan by 2.2% before the offload terms followed the engine: fp32 masters over the link, the update
    hidden behind the next forward only, the first layer's share exposed. It does not now.)"""
    losses = []
    for (num_gpus, num_nodes), preset in itertools.product([(1, 1), (1, 2), (2, 1), (4, 1)], ["gpt-350m", "gpt-1.3b"]):
        losses += _baseline_losses(gpu, num_gpus, num_nodes, preset)
    assert not losses, losses


