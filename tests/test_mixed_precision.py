"""bf16 / fp16 mixed precision: fp32 masters, fp32 gradients and AdamW state, compute in 16 bits.
One rank, gloo with world size 1, no Ray.

Tolerance for bf16 against fp32: bf16 keeps 8 significant bits (unit roundoff 2^-8 = 0.39%); every matmul
input, activation and logit is rounded to it, while the update itself runs on fp32 masters, so the two
runs drift apart only through the rounded forward and backward. Over 10 steps of the `small` preset the
per-step losses stay within 2% of the fp32 run's, and the final weights' distance from the fp32 run's
within 25% of how far fp32 training moved them (AdamW divides by sqrt(v), which turns rounding noise in
small gradients into full-size update noise, so weights drift more than losses). Measured at 10 steps in
every offload mode: losses within 0.22%, the loss down 0.26, the weights' distance 6% of the fp32 run's
move. A real bug (a gradient lost in the master copy, a missing cast back, an update on the 16-bit copy)
shows as no training or an error of the size of the update itself. (Ten steps, not twenty: 16-bit matmuls
on a CPU without bf16 instructions run about 8x slower than fp32 ones, and ten steps show the same.)
"""


import pytest
import torch

from planner import ClusterSpec, ModelSpec, NodeSpec, Pipeline, Plan, Stage, TrainSpec, cost
from tests.late_lane import LateWake
from workers.copy_lane import Ticket
from workers.data import make_dataset
from workers.engine import Engine, compute_dtype

pytestmark = pytest.mark.unit
B, MB = 8, 4
STEPS = 10  # of the bf16 and fp32 runs compared (see above)
MODEL = ModelSpec.preset("small")


def _plan(offload: dict, model: ModelSpec = MODEL) -> Plan:
    st = Stage(layer_start=0, layer_end=model.num_layers, gpu_type="A100-80GB", node="a", devices=["a/0"],
               offload=offload)
    return Plan(model_name=model.name, num_layers=model.num_layers, global_batch=B,
                pipelines=[Pipeline(num_samples=B, micro_batch_size=MB, num_micro_batches=B // MB, stages=[st])])


def run(precision: str, dtype: torch.dtype, steps: int, offload: dict | None = None, meter: bool = False,
        setup=None):
    train = TrainSpec(global_batch=B, lr=0.003, precision=precision)
    e = Engine(_plan(offload or {}), 0, MODEL, train, make_dataset("synthetic", MODEL.seq_len, MODEL.vocab_size, 0),
               dtype, meter_memory=meter)
    e.connect_alone(30)
    try:
        if setup:
            setup(e)
        start = {n: q.detach().clone() for n, q in e.opt_params.items()}
        results = [e.step(s) for s in range(steps)]
        e.settle()
        return results, start, {n: q.detach().clone() for n, q in e.opt_params.items()}, e
    finally:
        e.close()


@pytest.fixture(scope="module")
def fp32():
    return run("fp32", torch.float32, STEPS)


@pytest.mark.parametrize("offload",
                         [{}, {"offload_optimizer": True}, {"offload_optimizer": True, "offload_params": True}],
                         ids=["device", "optimizer-offload", "param-offload"])
def test_bf16_trains_like_fp32_within_bf16_tolerance(fp32, offload):
    ref, start, ref_end, _ = fp32
    got, start16, end16, e = run("bf16", torch.bfloat16, STEPS, offload)
    assert all(q.dtype == torch.float32 for q in e.opt_params.values())  # fp32 masters
    assert all(p.dtype == torch.bfloat16 for n, p in e.module.params.items() if p is not e.opt_params[n])
    for n in start:
        torch.testing.assert_close(start16[n], start[n])  # the same fp32 initial weights
    for a, b in zip(got, ref, strict=True):
        assert abs(a.loss - b.loss) <= 0.02 * abs(b.loss), (a.step, a.loss, b.loss)
    assert got[-1].loss < got[0].loss - 0.05  # it trains
    # Over all weights (the attention's k bias has an exactly-zero gradient, so per tensor its fp32 change is
    # noise): the bf16 run's distance from the fp32 weights, against how far fp32 training moved them.
    diff = sum(float((end16[n] - ref_end[n]).pow(2).sum()) for n in start) ** 0.5
    moved = sum(float((ref_end[n] - start[n]).pow(2).sum()) for n in start) ** 0.5
    assert diff <= 0.25 * moved, (diff, moved)


@pytest.mark.parametrize("name,offload", [
    ("none", {}),
    ("recompute", {"recompute_layers": [0, 2, 4]}),
    ("optimizer", {"offload_optimizer": True}),
    ("param+optimizer", {"offload_optimizer": True, "offload_params": True}),
    ("all", {"offload_optimizer": True, "offload_params": True, "recompute_layers": [0, 1, 2, 3, 4]}),
    ("all-prefetch-2", {"offload_optimizer": True, "offload_params": True, "prefetch_depth": 2,
                        "recompute_layers": [0, 1, 2, 3, 4, 5]}),
])
def test_bf16_device_bytes_within_10_percent_of_the_planner(name, offload):
    train = TrainSpec(global_batch=B, lr=0.003, precision="bf16")
    results, _, _, _ = run("bf16", torch.bfloat16, 2, offload, meter=True)
    peak = results[-1].extra["device_peak_bytes"]  # step 2: AdamW state exists
    cluster = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100-80GB", num_gpus=1)])
    slot = cost.make_slot(cluster, train, "a", 1)
    pol = _plan(offload).pipelines[0].stages[0].offload
    want = cost.stage_memory(slot, MODEL, train, cost.StageShape(MODEL.num_layers, True, True), MB, 1, cost.knobs(pol))
    assert abs(peak / want - 1) <= 0.10, (name, peak, want)


@pytest.mark.exclusive
def test_the_measured_peak_does_not_depend_on_when_the_lanes_run(monkeypatch):
    """Late lane threads (each wakes its waiter, then stalls, as on a loaded CI machine) do not raise the metered
    peak of a prefetching, fully offloaded bf16 stage: the planner comparison above measures what an idle machine
    does. Run alone (`exclusive`): beside the parallel suite's load, lateness the simulated stalls do not model
    raised the peak by one to two layers' buffers in 2 of about 8 full runs (5,894,720 and 6,156,864 bytes against
    5,560,384): the engine's peak still depends on thread timing there, which is open work."""
    offload = {"offload_optimizer": True, "offload_params": True, "prefetch_depth": 2,
               "recompute_layers": list(range(MODEL.num_layers))}
    prompt = run("bf16", torch.bfloat16, 2, offload, meter=True)[0][-1].extra["device_peak_bytes"]
    made = Ticket.__init__

    def late(self, event=None, done=False):
        made(self, event, done)
        if not done:
            self.issued = LateWake()

    monkeypatch.setattr(Ticket, "__init__", late)
    late_peaks = [run("bf16", torch.bfloat16, 2, offload, meter=True)[0][-1].extra["device_peak_bytes"]
                  for _ in range(2)]  # (the first run in a process was seen to miss the lag; the second showed it)
    assert late_peaks == [prompt, prompt]


def test_fp16_loss_scale_skips_an_overflowing_step_on_every_rank_and_recovers():
    def huge_scale(e):
        # The scaled gradients overflow fp16 at once: this model's first steps overflow up to a scale of 2^20
        # and train at 2^19, so 2^24 skips five steps and the last three train.
        e.loss_scale = 2.0 ** 24

    got, start, end, e = run("fp16", torch.float16, 8, setup=huge_scale)
    skipped = [r.extra["skipped_update"] for r in got]
    assert skipped[0] and not skipped[-1]  # overflow skipped, then the halved scale trains
    assert got[-1].extra["loss_scale"] < 2.0 ** 24
    assert all(torch.isfinite(q).all() for q in end.values())
    assert any(not torch.equal(end[n], start[n]) for n in end)


def test_precision_picks_the_compute_dtype_per_gpu_type():
    assert compute_dtype("auto", "bf16", "A100-80GB") == "bfloat16"
    assert compute_dtype("auto", "bf16", "T4") == "float16"  # no bf16 on Turing: fp16 with a loss scale
    assert compute_dtype("auto", "fp32", "T4") == "float32"
    assert compute_dtype("float64", "bf16", "H100-SXM") == "float64"  # forced, for equivalence checks


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_policy_counts_the_state_bytes_a_restore_moves(precision, dtype):
    """The bytes the re-plan policy, the drain and the fleet simulator count per layer (migration.layer_bytes)
    are what a worker asks for in a restore: master weights and both AdamW moments, no bf16 working copy."""
    from orchestrator.control.migration import layer_bytes
    from workers.state import needs

    train = TrainSpec(global_batch=B, lr=0.003, precision=precision)
    e = Engine(_plan({}), 0, MODEL, train, make_dataset("synthetic", MODEL.seq_len, MODEL.vocab_size, 0), dtype)
    e.connect_alone(30)
    try:
        asked = sum(n.nbytes for n in needs(e))
    finally:
        e.close()
    assert asked == sum(layer_bytes(MODEL, train, x) for x in range(-1, MODEL.num_layers + 1))


def test_the_engine_names_a_cuda_device_with_its_index(monkeypatch):
    """A tensor on the current CUDA device reports `cuda:0`, and `cuda` compares unequal to it: an engine built
    for `cuda` that kept the bare name found none of its parameters resident, registered no hook moving
    gradients to the masters, and failed its first mixed-precision or offloaded step on the first GPU it met."""
    from workers.engine import resolved_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert torch.device("cuda") != torch.device("cuda", 0)
    assert resolved_device("cuda") == torch.device("cuda", 0)
    assert resolved_device("cuda:1") == torch.device("cuda", 1)
    assert resolved_device("cpu") == torch.device("cpu")
