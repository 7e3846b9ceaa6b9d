"""The embedding and the LM head on stages of their own: the search proposes a stage with no
transformer layer where it wins, evaluate agrees, and the plan table says so plainly. The Ray test that
trains such a plan like the 1-device run is tests/test_train_ray.py::test_planner_plan_with_edge_stages...
"""

import pytest
from typer.testing import CliRunner

from orchestrator.cli.main import app
from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec, evaluate, layer_split, plan

pytestmark = pytest.mark.unit

T4S = [NodeSpec(name=f"t4-{i}", gpu_type="T4", num_gpus=1) for i in range(3)]
CASES = {
    # a 256k vocabulary (Gemma's) on two T4 nodes: the head alone outweighs the four layers (at 2,048 tokens a
    # sample the head's backward, 14 bytes a logit, fills a T4 with or without a stage of its own)
    "gpt-256k-vocab-2xT4": (T4S[:2], ModelSpec(name="v256k", num_layers=4, hidden_size=2048, num_heads=16,
                                                vocab_size=256000, seq_len=1024), 8),
    # Llama 3's 128k vocabulary, GQA, on three T4 nodes
    "llama-128k-vocab-3xT4": (T4S, ModelSpec(name="llama-128k", num_layers=4, hidden_size=2048, num_heads=32,
                                             num_kv_heads=4, ffn_size=5632, arch="llama", vocab_size=128256,
                                             seq_len=2048), 8),
}


def _edges(p) -> list[str]:
    out = []
    for pipe in p.pipelines:
        for i, st in enumerate(pipe.stages):
            if st.layer_start == st.layer_end:
                out.append("embedding" if i == 0 else "head")
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_stage_of_its_own_for_the_embedding_or_head_is_chosen_where_it_wins(name, monkeypatch):
    nodes, model, batch = CASES[name]
    cluster, train = ClusterSpec(nodes=nodes), TrainSpec(global_batch=batch)
    got = plan(cluster, model, train)
    assert _edges(got), "want an embedding-only or head-only stage"
    t = evaluate(got, cluster, model, train).step_time_s
    monkeypatch.setattr(layer_split, "EDGE_RATIO", float("inf"))  # the search without edge stages
    without = plan(cluster, model, train)
    assert not _edges(without)
    assert t < 0.97 * evaluate(without, cluster, model, train).step_time_s


def test_a_small_vocabulary_keeps_the_embedding_and_head_with_layers():
    cluster = ClusterSpec(nodes=T4S[:2])
    model = ModelSpec(name="v4k", num_layers=4, hidden_size=2048, num_heads=16, vocab_size=4096, seq_len=2048)
    assert not layer_split.edge_stages_may_win(model)
    assert not _edges(plan(cluster, model, TrainSpec(global_batch=8)))


def test_the_plan_table_names_a_stage_without_layers(tmp_path):
    import yaml

    nodes, model, batch = CASES["gpt-256k-vocab-2xT4"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": model.model_dump(exclude_defaults=True), "train": {"global_batch": batch},
                                   "cluster": {"nodes": [n.model_dump(exclude_defaults=True) for n in nodes]}}))
    res = CliRunner().invoke(app, ["plan", str(job)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "LM head only" in res.output or "embedding only" in res.output
