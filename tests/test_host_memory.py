"""Host memory is a constraint: offloaded state must fit the node's RAM, shared by its GPUs.

The plan's host bytes per node (Estimate.host_gib) are held to what the offload engine keeps in host
memory for a small model, measured from its tensors (masters, their gradients, AdamW's moments).
"""

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec, cost, evaluate
from tests.test_offload_engine import POLICIES, TRAIN, one_stage_plan, run

pytestmark = pytest.mark.unit
HETSPOT = str(Path(sys.executable).parent / "hetspot")


def _plan(tmp_path, node: dict) -> subprocess.CompletedProcess:
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump({"model": {"preset": "70b"}, "train": {"global_batch": 8},
                                 "cluster": {"nodes": [node]}}))
    return subprocess.run([HETSPOT, "plan", str(f), "--json"], capture_output=True, text=True, timeout=300)


def test_70b_on_one_t4_needs_host_memory_it_does_not_have(tmp_path):
    r = _plan(tmp_path, {"name": "t4-0", "gpu_type": "T4", "num_gpus": 1})
    msg = " ".join(r.stderr.split())
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "host memory" in msg and "'t4-0'" in msg and "48 GiB" in msg and "host_mem_gib" in msg


def test_70b_on_one_t4_with_2000_gib_plans_within_that_memory(tmp_path):
    import json

    r = _plan(tmp_path, {"name": "t4-0", "gpu_type": "T4", "num_gpus": 1, "host_mem_gib": 2000})
    assert r.returncode == 0, r.stderr
    est = json.loads(r.stdout)["estimate"]
    assert 900 < est["host_gib"]["t4-0"] <= 2000  # 70B params x 16 bytes of offloaded state


def test_a_node_shares_its_host_memory_between_its_gpus():
    one = NodeSpec(name="a", gpu_type="L4", num_gpus=4)
    assert one.host_mem == 192.0  # the L4 default, 48 GiB per GPU
    slot = cost.make_slot(ClusterSpec(nodes=[one.model_copy(update={"host_mem_gib": 100.0})]), TRAIN, "a", 1)
    assert slot.host_cap_bytes == 25.0 * cost.GIB


@pytest.mark.parametrize("name", ["optimizer", "param+optimizer", "all"])
def test_estimated_host_bytes_within_10_percent_of_the_engine(name):
    model = ModelSpec.preset("small")
    off = POLICIES[name](model)
    results, _ = run(model, off, steps=2, dtype=torch.float32)
    measured = results[-1].extra["host_state_bytes"]  # step 2: AdamW's moments exist
    cluster = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100-80GB", num_gpus=1)])
    est = evaluate(one_stage_plan(model, off), cluster, model, TRAIN)
    want = est.host_gib["a"] * cost.GIB
    assert measured > 0 and abs(measured / want - 1) <= 0.10, (measured, want)
    plain, _ = run(model, {}, steps=1, dtype=torch.float32)
    assert plain[-1].extra["host_state_bytes"] == 0
    assert "a" not in evaluate(one_stage_plan(model, {}), cluster, model, TRAIN).host_gib


SIX_B = ModelSpec(name="6b", num_layers=28, hidden_size=4096, num_heads=32, vocab_size=32000, seq_len=2048)
SWEEPS = {
    # 4 GPUs on 3 nodes (two L4s share one), 48 host-RAM triples
    "l4x2+a10g+t4": (lambda a, b, c: [NodeSpec(name="l4", gpu_type="L4", num_gpus=2, host_mem_gib=a),
                                      NodeSpec(name="a10", gpu_type="A10G", num_gpus=1, host_mem_gib=b),
                                      NodeSpec(name="t4", gpu_type="T4", num_gpus=1, host_mem_gib=c)],
                     list(itertools.product([12, 28, 44, 60], [12, 28, 44, 60], [16, 36, 56]))),
    # 4 GPUs on 2 nodes of 2, 49 host-RAM pairs
    "a10gx2+l4x2": (lambda a, b: [NodeSpec(name="a10", gpu_type="A10G", num_gpus=2, host_mem_gib=a),
                                  NodeSpec(name="l4", gpu_type="L4", num_gpus=2, host_mem_gib=b)],
                    list(itertools.product(range(12, 61, 8), range(12, 61, 8)))),
}


def _checked_plan(cluster, model, train):
    """The planner's plan, None where it raises PlanningError; `evaluate` raises if it overflows a node's RAM."""
    from planner import PlanningError, plan

    try:
        got = plan(cluster, model, train)
    except PlanningError:
        return None
    evaluate(got, cluster, model, train)
    return got


@pytest.mark.parametrize("shape", sorted(SWEEPS))
def test_the_planner_finds_a_plan_wherever_one_fits_the_nodes_host_memory(shape):
    """Host memory is a node total: wherever the brute-force witness finder finds a plan that
    evaluate accepts, the planner plans too (before, it gave up on 25 of the 49 pairs of the second sweep
    and 3 of the first's 48 triples, costing each GPU against an even share of its node's RAM)."""
    from tests.host_enum import some_valid_plan

    make, points = SWEEPS[shape]
    train = TrainSpec(global_batch=8)
    missed, witnessed = [], 0
    for point in points:
        cluster = ClusterSpec(nodes=make(*point))
        witness = some_valid_plan(cluster, SIX_B, train)
        got = _checked_plan(cluster, SIX_B, train)
        if witness is not None:
            witnessed += 1
            if got is None:
                missed.append(point)
    assert not missed, f"no plan, though one fits, at host RAM {missed}"
    assert witnessed >= len(points) * 3 // 4  # the sweep spans tight and roomy nodes


def _four_gpu_case(rng):
    """A cluster of 4 GPUs (one to three nodes, 12-120 GiB of host RAM each) and a 2.6-8.2B model of a few
    layers whose optimizer state is most of that RAM: where host memory binds and TP degrees may mix."""
    shapes = [[("L4", 4)], [("A10G", 2), ("L4", 2)], [("L4", 2), ("A10G", 1), ("T4", 1)], [("L4", 3), ("T4", 1)],
              [("A10G", 4)]]
    nodes = [NodeSpec(name=f"n{i}", gpu_type=g, num_gpus=c, host_mem_gib=rng.choice(range(12, 121, 8)))
             for i, (g, c) in enumerate(rng.choice(shapes))]
    h = rng.choice([6144, 8192, 10240])
    model = ModelSpec(name="m", num_layers=rng.choice([2, 3, 4]), hidden_size=h, num_heads=h // 128,
                      vocab_size=32000, seq_len=rng.choice([1024, 2048]))
    return ClusterSpec(nodes=nodes), model, TrainSpec(global_batch=rng.choice([2, 4, 8]), max_micro_batch_size=4)


@pytest.mark.parametrize("node", [("A10G", 100.0), ("L4", 84.0)])
def test_a_plan_whose_stages_mix_tp_degrees_may_pool_the_nodes_host_memory(node):
    """The search over stages of different TP degrees budgeted host RAM per GPU, so on one node of
    4 GPUs it found nothing where a TP1 stage, a TP2 stage and a TP1 stage fit the node's RAM together."""
    from planner import plan
    from tests.enumerator import best_plan

    cluster = ClusterSpec(nodes=[NodeSpec(name="n0", gpu_type=node[0], num_gpus=4, host_mem_gib=node[1])])
    model = ModelSpec(name="m", num_layers=6, hidden_size=10240, num_heads=80, vocab_size=32000, seq_len=2048)
    train = TrainSpec(global_batch=8, max_micro_batch_size=4)
    opt, _ = best_plan(cluster, model, train, host="node")
    assert opt < float("inf")  # a plan exists with host memory as a node total
    got = plan(cluster, model, train)  # raised PlanningError before
    est = evaluate(got, cluster, model, train)  # raises if the node's RAM is overflowed
    assert est.host_gib["n0"] <= node[1]


@pytest.mark.sweep
@pytest.mark.parametrize("cases", [
    range(30),  # `make test`
    pytest.param(range(30, 100), marks=pytest.mark.slow),  # `make test-all`: the 100 clusters of the full sweep
], ids=["cases-0-29", "cases-30-99"])
def test_host_memory_sweep_against_an_exhaustive_search_with_node_totals(cases):
    """100 clusters of 4 GPUs, host RAM of 12-120 GiB per node, against the exhaustive
    enumerator counting host memory per node (tests/enumerator.py, host="node"): the planner plans wherever a
    plan exists, never overflows a node, and every plan is within 1% of the optimum. (Case 78, one A10G node
    of 4 with 52 GiB, was at 0.986: the fastest order of a TP2 and two TP1 stages offloaded more than the node
    holds once its stages shared it, and the order that fits, TP1 then TP2 then TP1, was never offered.) The
    default run takes the first 30 of the same draw, `make test-all` the other 70."""
    import random

    from tests.enumerator import best_plan

    rng = random.Random(1)
    missed, short, exists = [], [], 0
    for k in range(cases.stop):
        cluster, model, train = _four_gpu_case(rng)  # drawn in order: case k is the same in either slice
        if k not in cases:
            continue
        opt, ref = best_plan(cluster, model, train, host="node")
        got = _checked_plan(cluster, model, train)
        if ref is None:
            continue
        exists += 1
        if got is None:
            missed.append(k)
        elif opt / got.estimate.step_time_s < 0.99:
            short.append((k, round(opt / got.estimate.step_time_s, 3)))
    assert exists >= 0.9 * len(cases), exists
    assert not missed, f"no plan where one exists: cases {missed}"
    assert not short, f"below 0.99 of the optimum: {short}"


def test_a_refusal_for_host_memory_names_the_least_ram_that_plans():
    """The refusal named the node's share of all the state offloaded (85 GiB here), where a plan
    exists with half of that. `hetspot plan` now names the least RAM with which the search plans (a bisection):
    the planner plans with it, and the exhaustive enumerator finds no plan with 5% less."""
    import re

    from planner import PlanningError, plan
    from planner.search import Planner
    from tests.enumerator import best_plan

    model = ModelSpec(name="m", num_layers=4, hidden_size=10240, num_heads=80, vocab_size=32000, seq_len=2048)
    train = TrainSpec(global_batch=2, max_micro_batch_size=4)

    def on(gib):
        return ClusterSpec(nodes=[NodeSpec(name="n0", gpu_type="A10G", num_gpus=4, host_mem_gib=gib)])

    planner = Planner(model, train)
    planner.explain = True  # as `hetspot plan` asks
    with pytest.raises(PlanningError) as e:
        planner.plan(on(20))
    msg = str(e.value)
    least = float(re.search(r"node 'n0' needs at least about ([\d,.]+) GiB", msg).group(1).replace(",", ""))
    assert "has 20 GiB" in msg and "host_mem_gib" in msg
    assert least < 60  # not the 85 GiB of everything offloaded
    evaluate(plan(on(least), model, train), on(least), model, train)
    assert best_plan(on(0.95 * least), model, train, host="node")[1] is None
