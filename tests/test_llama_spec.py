"""The Llama in the planner: parameter counts of the published shapes, FLOPs per token, TP rules."""

import pytest

from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec, cost, plan
from planner.contract import tp_problem

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("preset,published", [
    ("llama-8b", 8.03e9),  # Meta Llama 3 8B
    ("llama-70b", 70.55e9),  # Meta Llama 3 70B
    ("llama-1b", 1.10e9),  # TinyLlama 1.1B
])
def test_parameter_counts_match_the_published_models(preset, published):
    assert ModelSpec.preset(preset).num_params == pytest.approx(published, rel=0.01)


def test_llama_8b_on_one_h100_plans_with_6n_flops_per_token():
    """The planner plans llama-8b on one H100 (its 128 GB of training state needs offload), and the FLOPs per
    token behind its estimate (MFU x step time x peak / tokens) are within 5% of 6 N."""
    m = ModelSpec.preset("llama-8b")
    train = TrainSpec(global_batch=8)
    p = plan(ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="H100-SXM", num_gpus=1)]), m, train)
    est = p.estimate
    tokens = train.global_batch * m.seq_len
    flops_per_token = est.mfu * est.step_time_s * cost.plan_peak_flops(p) / tokens
    assert flops_per_token == pytest.approx(6 * m.num_params, rel=0.05)
    st = p.pipelines[0].stages[0]
    assert st.offload.offload_optimizer  # 8B x 16 bytes of bf16 training state does not fit in 80 GB


def test_swiglu_and_gqa_terms():
    m = ModelSpec(arch="llama", num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=2, ffn_size=160,
                  vocab_size=100, seq_len=32)
    h, kv = 64, 2 * 8  # two key/value heads of dimension 8
    assert m.layer_params == h * h + 2 * h * kv + h * h + 3 * h * 160 + 2 * h
    assert m.embed_params == 100 * h and m.head_params == 100 * h + h  # no learned positions; RMSNorm has no bias
    assert cost.act_units(m, 1) > cost.act_units(ModelSpec(num_layers=2, hidden_size=64, num_heads=8, ffn_size=160,
                                                           vocab_size=100, seq_len=32), 1)  # SwiGLU keeps more


def test_tp_must_split_key_value_heads_whole():
    m = ModelSpec.preset("llama-tiny")  # 4 query heads, 2 key/value heads
    assert tp_problem(m, 2) is None
    assert "num_kv_heads=2" in tp_problem(m, 4)


def test_kv_heads_must_divide_heads_and_belong_to_llama():
    with pytest.raises(ValueError, match="divisible by num_kv_heads"):
        ModelSpec(arch="llama", num_layers=1, hidden_size=48, num_heads=6, num_kv_heads=4, vocab_size=8, seq_len=8)
    with pytest.raises(ValueError, match="llama field"):
        ModelSpec(num_layers=1, hidden_size=48, num_heads=6, num_kv_heads=2, vocab_size=8, seq_len=8)
