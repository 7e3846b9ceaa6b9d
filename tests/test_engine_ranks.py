"""The engine with several ranks, one process each (gloo, no Ray): a Llama whose stages are TP=2 with the
vocabulary-parallel embedding, head and cross-entropy, and replicas of uneven micro-batch counts under 1F1B,
each against the 1-device run; and the point-to-point batches each rank posted are those of its program
(planner/p2p.py), the order the NCCL model check passes."""

import pytest
import torch

from planner import ModelSpec, Pipeline, Plan, Stage, TrainSpec
from planner.p2p import Exchange, program
from tests.ranks import run_ranks

pytestmark = pytest.mark.unit
STEPS = 3


def one_device(model: ModelSpec, train: TrainSpec, eval_batches: int = 0) -> tuple[list[float], dict]:
    from workers.data import SYNTHETIC_HELD_OUT, SyntheticCorpus, make_dataset
    from workers.engine import Engine
    from workers.state import assemble, export_shards

    plan = Plan(model_name=model.name, num_layers=model.num_layers, global_batch=train.global_batch, pipelines=[
        Pipeline(num_samples=train.global_batch, micro_batch_size=train.global_batch, num_micro_batches=1,
                 stages=[Stage(layer_start=0, layer_end=model.num_layers, gpu_type="A100-80GB", node="r",
                               devices=["r/0"])])])
    e = Engine(plan, 0, model, train, make_dataset("synthetic", model.seq_len, model.vocab_size, train.seed),
               torch.float64)
    e.connect_alone(30)
    try:
        losses = [e.step(s).loss for s in range(STEPS)]
        if eval_batches:
            held_out = SyntheticCorpus(model.vocab_size, model.seq_len, train.seed + SYNTHETIC_HELD_OUT)
            losses.append(e.evaluate(held_out, eval_batches))  # (the last entry: the validation loss)
        return losses, assemble([export_shards(e)])
    finally:
        e.close()


def S(a: int, b: int, node: str, tp: int, **offload) -> Stage:
    return Stage(layer_start=a, layer_end=b, gpu_type="A100-80GB", node=node,
                 devices=[f"{node}/{k}" for k in range(tp)], offload=offload)


def assert_like_one_device(plan: Plan, model: ModelSpec, train: TrainSpec) -> dict:
    got = run_ranks(plan, model, train, "float64", STEPS)
    want_losses, want_params = one_device(model, train)
    for a, b in zip(got["losses"], want_losses, strict=True):
        assert abs(a - b) <= 1e-9 * abs(b), (got["losses"], want_losses)
    assert set(got["params"]) == set(want_params)
    for name, p in want_params.items():
        torch.testing.assert_close(got["params"][name], p, msg=name)
    for rank, posted in got["posted"].items():  # what each rank posted is its program's batches, step after step
        batches = [it for it in program(plan, rank) if isinstance(it, Exchange)]
        assert posted == [batches] * STEPS, rank
    return got


def test_llama_tp2_with_a_vocabulary_parallel_head_trains_like_one_device():
    """Two TP=2 stages (embedding with the first, head with the second) and a vocabulary of 61 rows, which two
    ranks split 31 + 30: neither gathers the logits, and the run is the 1-device run's."""
    model = ModelSpec.preset("llama-tiny").model_copy(update={"vocab_size": 61})
    train = TrainSpec(global_batch=6, lr=0.01, precision="fp32")
    plan = Plan(model_name=model.name, num_layers=4, global_batch=6, pipelines=[
        Pipeline(num_samples=6, micro_batch_size=2, num_micro_batches=3, stages=[S(0, 2, "a", 2), S(2, 4, "b", 2)])])
    assert_like_one_device(plan, model, train)


def test_replicas_of_uneven_micro_batch_counts_under_1f1b_train_like_one_device():
    """Three micro-batches of 2, 2 and 1 beside one of 3, each replica two stages deep, TP 1 then 2 in the
    first (the activations fan out to both TP ranks, and their gradients come back from the first)."""
    model = ModelSpec.preset("tiny")
    train = TrainSpec(global_batch=8, lr=0.01, precision="fp32")
    plan = Plan(model_name=model.name, num_layers=4, global_batch=8, pipelines=[
        Pipeline(num_samples=5, micro_batch_size=2, num_micro_batches=3, stages=[S(0, 2, "a", 1), S(2, 4, "b", 2)]),
        Pipeline(num_samples=3, micro_batch_size=3, num_micro_batches=1, stages=[S(0, 2, "c", 1), S(2, 4, "d", 2)]),
    ])
    assert_like_one_device(plan, model, train)


@pytest.mark.parametrize("offload", [{}, {"offload_optimizer": True},
                                     {"offload_optimizer": True, "offload_params": True}],
                         ids=["resident", "optimizer-offload", "params-and-optimizer-offload"])
def test_a_tp2_llama_stage_peaks_within_10_percent_of_the_planner(offload):
    """bf16, as a job trains: each TP rank's device meter (its vocabulary rows of the embedding, head and logits,
    its shards of every block, an offloaded optimizer's ring and staging buffers) against cost.stage_memory."""
    from planner import ClusterSpec, NodeSpec, cost

    model = ModelSpec(name="llama-mem", arch="llama", num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2,
                      ffn_size=352, vocab_size=1024, seq_len=64)
    train = TrainSpec(global_batch=8, lr=0.01, precision="bf16")
    st = S(0, 4, "a", 2, **offload)
    plan = Plan(model_name=model.name, num_layers=4, global_batch=8, pipelines=[
        Pipeline(num_samples=8, micro_batch_size=4, num_micro_batches=2, stages=[st])])
    got = run_ranks(plan, model, train, "bfloat16", 2, meter=True)
    slot = cost.make_slot(ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100-80GB", num_gpus=2)]), train, "a", 2)
    want = cost.stage_memory(slot, model, train, cost.StageShape(4, True, True), 4, 1, cost.knobs(st.offload))
    for rank, peaks in got["peaks"].items():  # step 2: AdamW's moments exist
        assert abs(peaks[-1] / want - 1) <= 0.10, (rank, peaks[-1], want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_tp2_llama_stage_with_a_vocabulary_parallel_head_trains_like_one_device():
    """Both TP ranks on the one GPU (gloo: NCCL refuses two ranks on a device), float64: the vocabulary-parallel
    embedding, head and cross-entropy on CUDA, against the 1-device run on the CPU."""
    model = ModelSpec.preset("llama-tiny").model_copy(update={"vocab_size": 61})
    train = TrainSpec(global_batch=6, lr=0.01, precision="fp32")
    plan = Plan(model_name=model.name, num_layers=4, global_batch=6, pipelines=[
        Pipeline(num_samples=6, micro_batch_size=3, num_micro_batches=2, stages=[S(0, 4, "a", 2)])])
    got = run_ranks(plan, model, train, "float64", STEPS, device="cuda")
    want_losses, want_params = one_device(model, train)
    for a, b in zip(got["losses"], want_losses, strict=True):
        assert abs(a - b) <= 1e-7 * abs(b), (got["losses"], want_losses)
    for name, p in want_params.items():
        torch.testing.assert_close(got["params"][name], p, msg=name)


@pytest.mark.parametrize("offload", [{}, {"offload_optimizer": True, "offload_params": True}],
                         ids=["resident", "params-and-optimizer-offload"])
def test_the_validation_loss_of_replicas_of_pipelines_is_the_one_device_loss(offload):
    """After training, two replicas of two stages each (TP 2 in one, micro-batches of uneven count) evaluate two
    global batches of held-out samples forward only between steps: the replicas' shares add up to the mean loss the
    1-device model gives the same samples, and one rank per replica reports."""
    model = ModelSpec.preset("tiny")
    train = TrainSpec(global_batch=8, lr=0.01, precision="fp32")
    plan = Plan(model_name=model.name, num_layers=4, global_batch=8, pipelines=[
        Pipeline(num_samples=5, micro_batch_size=2, num_micro_batches=3,
                 stages=[S(0, 2, "a", 1, **offload), S(2, 4, "b", 2)]),
        Pipeline(num_samples=3, micro_batch_size=3, num_micro_batches=1, stages=[S(0, 2, "c", 1), S(2, 4, "d", 2)]),
    ])
    got = run_ranks(plan, model, train, "float64", STEPS, eval_batches=2)
    want = one_device(model, train, eval_batches=2)[0][-1]
    assert got["eval_reporting"] == 2 and abs(got["eval"] - want) <= 1e-9 * abs(want), (got["eval"], want)
