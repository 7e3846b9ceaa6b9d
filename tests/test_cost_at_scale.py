"""The cost model at scale (planner/at_scale.py): interleaved 1F1B, sequence parallelism and a ZeRO-1 optimizer
each change what they should by the amount their papers give, and bench/calibration.py, fitted on a training
split of published runs, holds every held-out run within 20%."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.at_scale import Layout, estimate_layout
from planner.catalog import gpu_info
from planner.specs import ModelSpec, TrainSpec

ROOT = Path(__file__).resolve().parents[1]
MODEL = ModelSpec(name="t", num_layers=32, hidden_size=4096, num_heads=32, vocab_size=32000, seq_len=2048)
FAST = 1e12  # GB/s: links so fast that only compute and the schedule are left


@pytest.mark.unit
def test_interleaving_shrinks_the_bubble_by_the_number_of_chunks():
    """Narayanan et al. 2021: (p - 1) micro-batch times of bubble become (p - 1) / v."""
    p, m = 8, 16
    train = TrainSpec(global_batch=m)
    one, four = (estimate_layout(Layout("H100-SXM", 1, p, 1, virtual_stages=v, nic_gb_s=FAST, full_recompute=True),
                                 MODEL, train) for v in (1, 4))
    assert one.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert four.bubble == pytest.approx((p - 1) / 4 / (m + (p - 1) / 4))
    # the step is the same per-micro-batch time over m + (p - 1) / v slots (optimizer aside)
    assert (one.step_s / four.step_s) == pytest.approx((m + p - 1) / (m + (p - 1) / 4), rel=5e-3)


@pytest.mark.unit
def test_zero1_splits_the_optimizer_over_the_data_parallel_group():
    train, d = TrainSpec(global_batch=64), 8
    on, off = (estimate_layout(Layout("H100-SXM", 2, 2, d, virtual_stages=1, distributed_optimizer=z,
                                      full_recompute=True), MODEL, train) for z in (True, False))
    params = 16 * MODEL.layer_params / 2 + MODEL.embed_params / 2  # a first-stage device: 16 layers over TP 2
    saved = params * train.optimizer_bytes_per_param * (1 - 1 / d)
    assert (off.mem_gib - on.mem_gib) * 2**30 == pytest.approx(saved, rel=1e-9)


@pytest.mark.unit
def test_sequence_parallelism_splits_the_rest_of_the_activations_over_tp():
    """Korthikanti et al. 2022: 10 + 24/t bytes per element of a layer's activations become 34/t."""
    train, t = TrainSpec(global_batch=8), 4
    sp, no = (estimate_layout(Layout("H100-SXM", t, 2, 1, virtual_stages=1, sequence_parallel=x), MODEL, train)
              for x in (True, False))
    assert sp.recompute_layers == no.recompute_layers == 0
    s, h = MODEL.seq_len, MODEL.hidden_size
    per_layer = s * h * ((10 + (8 + 2 * 2 * 4) / t) - 34 / t)  # GPT: 4h MLP, two ffn-wide tensors (cost.act_units)
    assert (no.mem_gib - sp.mem_gib) * 2**30 == pytest.approx(2 * 16 * per_layer, rel=1e-9)  # 2 in flight, 16 layers


@pytest.mark.unit
def test_recompute_is_the_fewest_layers_that_fit_and_bad_layouts_are_refused():
    big = ModelSpec(name="b", num_layers=8, hidden_size=8192, num_heads=64, vocab_size=32000, seq_len=32768)
    layout = Layout("A100-80GB", 8, 1, 1, micro_batch=8, virtual_stages=1)
    e = estimate_layout(layout, big, TrainSpec(global_batch=8))
    assert e.fits and 0 < e.recompute_layers < 8 and e.mem_gib <= 80
    tighter = estimate_layout(layout, big, TrainSpec(global_batch=8, memory_reserve_gib=20))
    assert tighter.recompute_layers > e.recompute_layers
    with pytest.raises(ValueError, match="virtual_stages=9"):
        estimate_layout(Layout("H100-SXM", 1, 4, 1, virtual_stages=9), MODEL, TrainSpec(global_batch=8))
    with pytest.raises(ValueError, match="not a multiple of dp"):
        estimate_layout(Layout("H100-SXM", 1, 1, 3), MODEL, TrainSpec(global_batch=8))


@pytest.mark.unit
def test_calibration_fitted_on_a_training_split_holds_every_held_out_run_within_20_percent():
    r = subprocess.run([sys.executable, str(ROOT / "bench/calibration.py"), "--json"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)
    rows = t["rows"]
    held = [x for x in rows if x["split"] == "held-out"]
    names = " | ".join(x["name"] for x in held)
    for want in ("Llama 3 405B, 8,192 H100", "Llama 3 405B, 16,384 H100", "GPT 175B, 96 H100", "GPT 175B, 4,608 H100"):
        assert want in names, names
    for g, eff in t["fitted_efficiency"].items():  # each type has its own training rows, none held out
        assert any(x["split"] == "train" and x["gpu_type"] == g for x in rows), g
        assert 0.3 < eff < 0.9, t["fitted_efficiency"]
    bad = [(x["name"], x["ratio"]) for x in held if not abs(x["ratio"] - 1) <= 0.20]
    assert not bad, bad
    assert all(x["source"] and x["fits"] for x in rows)
    # One set of efficiencies: the rows are priced with the catalog's, which is the fit (rounded)
    for g, eff in t["fitted_efficiency"].items():
        assert abs(t["catalog_efficiency"][g] - eff) <= 0.005, (g, eff, t["catalog_efficiency"][g])
        assert t["catalog_efficiency"][g] == gpu_info(g).default_efficiency
    # The A100 runs at 1,000+ GPUs and the H100 runs at 1,000-16,384 GPUs are among those held out
    assert any(x["gpu_type"].startswith("A100") and x["gpus"] >= 1000 for x in held)
    assert any(x["gpu_type"].startswith("H100") and 1000 <= x["gpus"] <= 16384 for x in held)
    planned = t["planned"]  # hetspot's own plans of published set-ups: each row says whether it was fitted
    assert planned and all(x["split"] in ("fitted", "held-out") for x in planned)
    h200 = next(x for x in planned if "H200" in x["name"])  # hetspot's own engine, priced at the H100's figure
    assert h200["split"] == "held-out" and abs(h200["ratio"] - 1) <= 0.15, h200


@pytest.mark.unit
def test_evaluate_and_the_published_layout_model_price_one_layout_alike():
    """`evaluate` (what `plan`, the fleet choice and the simulator use) and planner/at_scale.py (what the
    calibration prices published layouts with) are one cost model: a plan that both can describe (symmetric, no
    recompute or offload), priced by at_scale with its own additions switched off, costs the same step within 2%.
    A second efficiency table, or a term one of them prices differently, fails here."""
    from planner import ClusterSpec, NodeSpec, plan

    cases = [
        ("A100-80GB", 8, 8, 200.0, ModelSpec.preset("175b"), TrainSpec(global_batch=64)),
        ("H200", 1, 1, 50.0, ModelSpec.preset("gpt-1.3b"), TrainSpec(global_batch=8)),
        ("H100-SXM", 8, 2, 50.0, ModelSpec.preset("gpt-1.3b"), TrainSpec(global_batch=64)),
    ]
    for gpu, per_node, nodes, nic, model, train in cases:
        cluster = ClusterSpec(nodes=[NodeSpec(name=f"n{i}", gpu_type=gpu, num_gpus=per_node, inter_node_bw_gb_s=nic)
                                     for i in range(nodes)])
        p = plan(cluster, model, train)
        stages = [st for pipe in p.pipelines for st in pipe.stages]
        assert not any(st.offload.recompute_layers or st.offload.offload_optimizer or st.offload.offload_params
                       for st in stages), "the case must be one both models describe"
        pipe = p.pipelines[0]
        assert all(len(q.stages) == len(pipe.stages) and q.micro_batch_size == pipe.micro_batch_size
                   for q in p.pipelines) and len({st.tp for st in stages}) == 1
        layout = Layout(gpu, pipe.stages[0].tp, len(pipe.stages), len(p.pipelines), micro_batch=pipe.micro_batch_size,
                        virtual_stages=1, sequence_parallel=False, distributed_optimizer=False, tp_overlap=False,
                        nic_gb_s=nic)
        e = estimate_layout(layout, model, train)
        assert e.recompute_layers == 0
        assert e.step_s == pytest.approx(p.estimate.step_time_s, rel=0.02), (gpu, e.step_s, p.estimate.step_time_s)
