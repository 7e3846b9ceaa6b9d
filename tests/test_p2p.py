"""The pipeline's point-to-point traffic under NCCL's rules (planner/p2p.py), checked without a GPU: every
schedule x stages 1-8 x micro-batches 1-16 x TP fan patterns between stages, asymmetric replicas side by side
and edge stages; and the order the engine posted before batching, which the check finds deadlocked."""

import random

import pytest

from planner import Pipeline, Plan, Stage
from planner.p2p import Exchange, P2POp, check, check_plan, eval_program, legacy_program, program, stage_program

pytestmark = pytest.mark.unit

# TP degrees of consecutive stages: equal, fan-out, fan-in, and degrees that do not divide each other
PATTERNS = {"all-1": [1], "all-2": [2], "fan-out 1,2,4": [1, 2, 4], "fan-in 4,2,1": [4, 2, 1],
            "3,2 (no divisor)": [3, 2], "2,3,1": [2, 3, 1]}


def pipeline(num_stages: int, mbs: int, schedule: str, tps: list[int], node: str, layers: int) -> Pipeline:
    cuts = [round(i * layers / num_stages) for i in range(num_stages + 1)]  # stages of no layers where p > layers
    stages = [Stage(layer_start=cuts[i], layer_end=cuts[i + 1], gpu_type="A100-80GB", node=f"{node}{i}",
                    devices=[f"{node}{i}/{k}" for k in range(tps[i % len(tps)])]) for i in range(num_stages)]
    return Pipeline(num_samples=mbs, micro_batch_size=1, num_micro_batches=mbs, schedule=schedule, stages=stages)


def plan_of(*pipes: Pipeline, layers: int) -> Plan:
    return Plan(model_name="m", num_layers=layers, global_batch=sum(p.num_samples for p in pipes),
                pipelines=list(pipes))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_every_stage_count_and_micro_batch_count_completes(schedule, pattern):
    for stages in range(1, 9):
        for mbs in range(1, 17):
            p = plan_of(pipeline(stages, mbs, schedule, PATTERNS[pattern], "n", 8), layers=8)
            found = check_plan(p)
            assert found is None, f"{stages} stages, {mbs} micro-batches:\n{found}"


def test_asymmetric_replicas_side_by_side_complete():
    """Replicas of different depths, micro-batch counts, schedules and TP patterns in one world (and edge
    stages of no layers: 8 stages over 4 layers)."""
    rng = random.Random(7)
    for _ in range(150):
        pipes = [pipeline(rng.randint(1, 8), rng.randint(1, 16), rng.choice(["1f1b", "gpipe"]),
                          rng.choice(list(PATTERNS.values())), f"r{i}-", 4) for i in range(rng.randint(2, 3))]
        found = check_plan(plan_of(*pipes, layers=4))
        assert found is None, found


def test_the_engines_former_order_deadlocks_under_nccl():
    """Before batching, the engine posted an isend after each forward and then blocked on the next receive:
    two stages of 1F1B with two micro-batches already hang: rank 0 waits to send activation 1 while rank 1 waits
    to send gradient 0, each before the receive the other needs."""
    p = plan_of(pipeline(2, 2, "1f1b", [1], "n", 2), layers=2)
    found = check_plan(p, legacy_program)
    assert found is not None and found.kind == "deadlock"
    assert dict(found.blocked) == {0: ("send act[1] -> rank 1",), 1: ("send grad[0] -> rank 0",)}
    assert check_plan(p) is None  # the same plan, batched


def test_the_former_order_hangs_on_most_of_the_grid():
    hung = [(s, m) for s in range(2, 9) for m in range(2, 17)
            if check_plan(plan_of(pipeline(s, m, "1f1b", [1], "n", 8), layers=8), legacy_program)]
    assert len(hung) == 7 * 15  # every 1F1B pipeline of 2+ stages and 2+ micro-batches


def test_the_check_reports_a_mismatched_pair_and_an_unpaired_batch():
    send = Exchange((P2POp("send", 1, "act", 0),), None)
    assert check({0: [send], 1: [Exchange((P2POp("recv", 0, "act", 1),), ("F", 1))]}).kind == "mismatch"
    stuck = check({0: [send], 1: []})
    assert stuck.kind == "deadlock" and stuck.blocked == ((0, ("send act[0] -> rank 1",)),)


def test_a_boundary_posts_the_sends_before_it_and_the_receive_after_it_together():
    prog = stage_program([("F", 0), ("F", 1), ("B", 0), ("B", 1)], None, [5], 5, [])
    batches = [it for it in prog if isinstance(it, Exchange)]
    assert [b.ops for b in batches] == [
        (P2POp("send", 5, "act", 0),),
        (P2POp("send", 5, "act", 1), P2POp("recv", 5, "grad", 0)),  # send_forward_recv_backward
        (P2POp("recv", 5, "grad", 1),),
    ]
    assert program(plan_of(pipeline(1, 3, "1f1b", [2], "n", 2), layers=2), 0) == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]  # one stage: no traffic


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_the_forward_only_evaluation_completes_on_every_stage_and_micro_batch_count(pattern):
    """A validation pass (`eval_program`: forwards only, each boundary's send posted with the next receive) passes
    the NCCL model check on the same grid as a step, and beside asymmetric replicas."""
    for stages in range(1, 9):
        for mbs in range(1, 17):
            p = plan_of(pipeline(stages, mbs, "1f1b", PATTERNS[pattern], "n", 8), layers=8)
            found = check_plan(p, eval_program)
            assert found is None, f"{stages} stages, {mbs} micro-batches:\n{found}"
    rng = random.Random(11)
    for _ in range(50):
        pipes = [pipeline(rng.randint(1, 8), rng.randint(1, 16), "1f1b", rng.choice(list(PATTERNS.values())),
                          f"r{i}-", 4) for i in range(rng.randint(2, 3))]
        assert check_plan(plan_of(*pipes, layers=4), eval_program) is None
