"""The plan contract (planner/contract.py) against what the TP runtime actually computes.

Property: for any model shape and TP degree, the contract accepts exactly the
degrees under which every TP rank holds whole heads and the ranks' slices of
every sharded parameter tile the full tensor (workers/model.py's slicing). A
refused degree would drop rows of some weight or split a head, so it cannot
train the 1-device model; accepted degrees train it (checked on Ray in
tests/test_train_ray.py::test_contract_accepted_random_shapes_train_like_one_device).
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import ClusterSpec, ModelSpec, NodeSpec, Pipeline, Plan, Stage, TrainSpec
from planner.contract import check_runtime_plan, plan_problems, tp_problem
from workers.model import all_params

pytestmark = pytest.mark.unit


VOCAB = {"wte.weight", "lm_head.weight", "model.embed_tokens.weight"}  # split by vocabulary rows


def runtime_tiles(model: ModelSpec, tp: int) -> bool:
    """True when TP degree tp splits every sharded parameter exactly and keeps heads whole: the ranks' slices
    tile each tensor, in equal parts (a head or an MLP row split unevenly is another model), except the
    vocabulary's rows, which may end short but leave no rank without one."""
    if model.num_heads // tp * tp != model.num_heads:
        return False
    for spec in all_params(model):
        if spec.shard_dim is None:
            continue
        dim = spec.shape[spec.shard_dim]
        parts = [range(*spec.local_slice(r, tp)[spec.shard_dim].indices(dim)) for r in range(tp)]
        if sorted(i for part in parts for i in part) != list(range(dim)):
            return False
        if spec.name in VOCAB and not all(parts) or spec.name not in VOCAB and len({len(p) for p in parts}) > 1:
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(heads=st.integers(1, 12), head_dim=st.integers(1, 8), ffn=st.integers(4, 300), tp=st.integers(1, 8))
def test_contract_accepts_exactly_what_the_runtime_can_shard(heads, head_dim, ffn, tp):
    m = ModelSpec(num_layers=2, hidden_size=heads * max(head_dim, -(-8 // heads)), num_heads=heads,
                  ffn_size=ffn, vocab_size=32, seq_len=8)
    assert (tp_problem(m, tp) is None) == runtime_tiles(m, tp)


def test_ffn_130_tp4_is_refused_naming_ffn_size():
    m = ModelSpec(num_layers=2, hidden_size=32, num_heads=4, ffn_size=130, vocab_size=64, seq_len=16)
    p = Plan(model_name="m", num_layers=2, global_batch=4, pipelines=[Pipeline(
        num_samples=4, micro_batch_size=4, num_micro_batches=1, stages=[Stage(
            layer_start=0, layer_end=2, gpu_type="A100-80GB", node="a", devices=[f"a/{i}" for i in range(4)])])])
    with pytest.raises(ValueError, match="ffn_size=130"):
        check_runtime_plan(p, m)
    cluster = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100", num_gpus=4)])  # an alias, as job files allow
    problems = plan_problems(p, m, TrainSpec(global_batch=4), cluster)
    assert problems == ["pipeline 0 stage 0 on a has TP degree 4, which does not divide ffn_size=130 "
                        "(a TP rank must hold whole heads and MLP rows)", "device a/0 is a A100-40GB, the plan "
                        "says A100-80GB", "device a/1 is a A100-40GB, the plan says A100-80GB",
                        "device a/2 is a A100-40GB, the plan says A100-80GB",
                        "device a/3 is a A100-40GB, the plan says A100-80GB"]
