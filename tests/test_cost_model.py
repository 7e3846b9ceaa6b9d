"""The closed-form step time agrees with the discrete-event 1F1B simulator, and the model's basics hold."""

import random

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from planner import (
    ClusterSpec,
    ModelSpec,
    NodeSpec,
    Pipeline,
    Plan,
    Stage,
    TrainSpec,
    evaluate,
    plan,
)
from planner.estimate import closed_form
from planner.schedule import op_order
from planner.simulator import simulate, simulate_pipeline

pytestmark = pytest.mark.unit

TYPES = ["A100-80GB", "H100-SXM", "L4", "T4", "V100-32GB", "A10G", "MI300X"]


def _random_plan(rng: random.Random) -> tuple[ClusterSpec, ModelSpec, TrainSpec, Plan]:
    nodes = [NodeSpec(name=f"n{i}", gpu_type=rng.choice(TYPES), num_gpus=rng.choice([1, 2, 4, 8]),
                      inter_node_bw_gb_s=rng.choice([3.0, 12.5, 50.0])) for i in range(rng.randint(1, 6))]
    cluster = ClusterSpec(nodes=nodes)
    model = ModelSpec(name="m", num_layers=rng.randint(4, 24), hidden_size=rng.choice([512, 1024, 2048]),
                      num_heads=8, vocab_size=32000, seq_len=rng.choice([512, 1024, 2048]))
    devices = [(n.name, n.gpu_type, d) for n in nodes for d in n.device_ids()]
    rng.shuffle(devices)
    num_pipes = rng.randint(1, min(4, len(devices)))
    pipes, total = [], 0
    for r in range(num_pipes):
        take = devices[r::num_pipes][: rng.randint(1, min(4, model.num_layers))]
        cuts = sorted(rng.sample(range(1, model.num_layers), len(take) - 1))
        bounds = [0, *cuts, model.num_layers]
        stages = [Stage(layer_start=bounds[i], layer_end=bounds[i + 1], gpu_type=t, node=n, devices=[d])
                  for i, (n, t, d) in enumerate(take)]
        n_samples = rng.randint(1, 32)
        b = rng.randint(1, n_samples)
        pipes.append(Pipeline(num_samples=n_samples, micro_batch_size=b, num_micro_batches=-(-n_samples // b),
                              stages=stages))
        total += n_samples
    train = TrainSpec(global_batch=total, memory_reserve_gib=0)
    return cluster, model, train, Plan(model_name="m", num_layers=model.num_layers, global_batch=total, pipelines=pipes)


@settings(max_examples=300, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31))
def test_closed_form_never_below_simulator_on_arbitrary_plans(seed):
    # Any valid plan, however unbalanced: the closed form is an upper bound of the schedule.
    cluster, model, train, p = _random_plan(random.Random(seed))
    closed = closed_form(p, cluster, model, train).step_time_s  # fitting or not: the schedule's bound
    simulated = simulate(p, cluster, model, train).step_time_s
    assert closed >= simulated * (1 - 1e-9)


def test_1f1b_order_and_uniform_pipeline():
    assert op_order(0, 3, 4, "1f1b") == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert op_order(2, 3, 4, "1f1b") == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    # Uniform stages: (m + p - 1) * (f + b), the textbook 1F1B makespan.
    fwd = [[1.0] * 8 for _ in range(4)]
    bwd = [[2.0] * 8 for _ in range(4)]
    assert simulate_pipeline(fwd, bwd) == pytest.approx((8 + 4 - 1) * 3.0)


def test_more_memory_pressure_means_more_offload():
    cluster = ClusterSpec(nodes=[NodeSpec(name="t", gpu_type="T4", num_gpus=1)])
    model = ModelSpec.preset("gpt-1.3b")
    p = plan(cluster, model, TrainSpec(global_batch=4))
    st0 = p.pipelines[0].stages[0]
    # 1.3B params x 16 bytes does not fit a 16 GB T4: the optimizer must leave the device.
    assert st0.offload.offload_optimizer
    assert p.estimate.memory_gib["t/0"] <= 16.0


def test_mfu_and_tokens_consistent():
    cluster = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="H100-SXM", num_gpus=8)])
    model, train = ModelSpec.preset("gpt-1.3b"), TrainSpec(global_batch=64)
    est = plan(cluster, model, train).estimate
    assert est.tokens_per_s == pytest.approx(64 * model.seq_len / est.step_time_s)
    assert 0.05 < est.mfu < 0.6


def test_offloaded_optimizer_hides_behind_the_next_forward_only():
    """The host AdamW waits for the step's commit (and the clip coefficient), so it overlaps only the next
    forward, clipped or not; gradients and a resident layer's new weights move in the masters' dtype (fp32).
    Offloaded parameters need no copy-back of the new weights."""
    from planner import cost

    cluster = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="T4", num_gpus=1, cpu_adam_params_per_s=1e8)])
    model = ModelSpec.preset("gpt-125m")
    shape = cost.StageShape(model.num_layers, True, True)
    clip, no_clip = TrainSpec(global_batch=8), TrainSpec(global_batch=8, grad_clip=None)
    slot = cost.make_slot(cluster, clip, "a", 1)
    p = shape.params_per_device(model, 1)
    d2h = h2d = p * 4 / slot.host_link  # fp32 masters and gradients, cast on the device
    cpu = p / (slot.cpu_adam_per_gpu * cost.HOST_ADAMW_BESIDE_COPIES)
    busy, fwd = 5.0, 0.5  # cpu (~1.4 s) fits in the step but not in its forward
    assert fwd < cpu < busy
    kn = cost.Knobs(0, True, False)
    first = cost.embed_params_dev(model, 1) / p  # the forward waits for the embedding's update first
    tail = (d2h + cpu + h2d) * first
    assert cost.optimizer_s(slot, model, clip, shape, kn, busy, fwd) == pytest.approx(cpu - fwd + tail)
    assert cost.optimizer_s(slot, model, no_clip, shape, kn, busy, fwd) == pytest.approx(cpu - fwd + tail)
    with_params = cost.Knobs(0, True, True)
    assert cost.optimizer_s(slot, model, clip, shape, with_params, busy, fwd) == pytest.approx(
        cpu - fwd + (d2h + cpu) * first)


@pytest.mark.parametrize("gpu_type,preset,clip", [("T4", "7b", 1.0), ("L4", "7b", None), ("A100-80GB", "7b", 1.0)])
def test_search_step_time_unrolls_the_cost_model_exactly(gpu_type, preset, clip):
    """The search's hot loop (PipelineModel._time) inlines cost.optimizer_s and cost.sync_s: it must give the
    same time as the cost model's functions, for resident and offloaded optimizers, with and without clipping."""
    from planner import cost
    from planner.layer_split import PipelineModel

    cluster = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type=gpu_type, num_gpus=4),
                                 NodeSpec(name="b", gpu_type=gpu_type, num_gpus=4)])
    model, train = ModelSpec.preset(preset), TrainSpec(global_batch=64, grad_clip=clip)
    slots = [cost.make_slot(cluster, train, "a", 1)] * 2 + [cost.make_slot(cluster, train, "b", 1)] * 2
    pm = PipelineModel(slots, model, train, exact=False)
    seen_offload = set()
    for n, b, replicas in ((64, 2, 3), (37, 4, 2), (5, 1, 1)):
        m = -(-n // b)
        stages = pm.split(b, m)
        assert stages is not None
        seen_offload |= {ch.policy.offload_optimizer for ch in stages}
        last_b = n - (m - 1) * b
        last_t = [ch.times if last_b == b else pm._last_times(i, ch, last_b, m) for i, ch in enumerate(stages)]
        full = [ch.times.fwd_s + ch.times.bwd_s for ch in stages]
        last = [t.fwd_s + t.bwd_s for t in last_t]
        t_pipe = sum(last) if m == 1 else sum(full) + (m - 2) * max(full) + max(last)
        want = 0.0
        for i, ch in enumerate(stages):
            shape = pm._shape(i, ch.num_layers)
            busy, fwd = (m - 1) * full[i] + last[i], (m - 1) * ch.times.fwd_s + last_t[i].fwd_s
            opt = cost.optimizer_s(slots[i], model, train, shape, ch.policy, busy, fwd)
            sync = cost.sync_s(shape.params_per_device(model, 1), train, replicas, 12.5e9)
            want = max(want, t_pipe + max(0.0, sync - last_t[i].bwd_s) + opt)
        assert pm._time(stages, n, b, m, replicas, 12.5e9) == pytest.approx(want, rel=1e-12)
    if gpu_type == "T4":
        assert True in seen_offload  # the offloaded branch is exercised


def test_evaluate_refuses_plans_that_cannot_run():
    """A plan that leaves layers out, or does not fit its GPUs' or its node's host memory, gets an error that
    names the problem, not a step time."""
    from planner import OffloadPolicy, PlanContractError

    model = ModelSpec.preset("7b")
    cluster = ClusterSpec(nodes=[NodeSpec(name="t", gpu_type="T4", num_gpus=1, host_mem_gib=64)])
    train = TrainSpec(global_batch=1)

    def one_stage(layers: int, **offload) -> Plan:
        st = Stage(layer_start=0, layer_end=layers, gpu_type="T4", node="t", devices=["t/0"],
                   offload=OffloadPolicy(recompute_layers=list(range(layers)), **offload))
        return Plan(model_name=model.name, num_layers=model.num_layers, global_batch=1,
                    pipelines=[Pipeline(num_samples=1, micro_batch_size=1, num_micro_batches=1, stages=[st])])

    with pytest.raises(PlanContractError, match=r"covers layers \[0, 2\), model has 32"):
        evaluate(one_stage(2), cluster, model, train)
    with pytest.raises(PlanContractError, match=r"does not fit: device t/0 needs .* GiB .* has 16"):
        evaluate(one_stage(32), cluster, model, train)  # 7B's weights alone are 13 GiB, AdamW's 4x more
    with pytest.raises(PlanContractError, match=r"node t needs .* GiB of host memory .* has 64"):
        evaluate(one_stage(32, offload_optimizer=True, offload_params=True), cluster, model, train)
    roomy = ClusterSpec(nodes=[cluster.nodes[0].model_copy(update={"host_mem_gib": 2000})])
    est = evaluate(one_stage(32, offload_optimizer=True, offload_params=True), roomy, model, train)
    assert est.step_time_s > 0 and 64 < est.host_gib["t"] < 2000


def test_fewest_recomputed_layers_match_a_linear_walk():
    """`_min_recompute` bisects (memory falls with each recomputed layer up to n - 1, and all n is tried on its
    own): it must find the same fewest layers as trying 0, 1, ..., n in turn."""
    from planner import cost
    from planner.offload_policy import _min_recompute

    rng = random.Random(0)
    checked = 0
    for _ in range(600):
        model = ModelSpec.preset(rng.choice(["gpt-1.3b", "7b", "13b", "70b"]))
        train = TrainSpec(global_batch=64, memory_reserve_gib=rng.choice([0.0, 2.0, 8.0]))
        tp = rng.choice([1, 2, 4, 8])
        cluster = ClusterSpec(nodes=[NodeSpec(name="n", gpu_type=rng.choice(["T4", "L4", "A100-40GB", "H100-SXM"]),
                                              num_gpus=8)])
        slot = cost.make_slot(cluster, train, "n", tp)
        n = rng.randint(1, 12)
        shape = cost.StageShape(n, rng.random() < 0.3, rng.random() < 0.3)
        b, k = rng.choice([1, 2, 4, 8, 16]), rng.randint(1, 16)
        for opt, params in ((False, False), (True, False), (True, True)):
            walk = next((r for r in range(n + 1) if cost.stage_memory(
                slot, model, train, shape, b, k, cost.Knobs(r, opt, params)) <= slot.mem_cap_bytes), None)
            assert _min_recompute(slot, model, train, shape, b, k, opt, params) == walk
            checked += walk not in (None, 0)
    assert checked > 100  # most draws need some recompute, so the bisection is exercised


def test_layer_split_vectors_equal_the_scalar_cost_model_to_the_bit():
    """The split's cost vectors are computed for every layer count at once in numpy
    (offload_policy.fitting_by_layers and cheapest_by_layers): each count's cheapest policy, its times, memory
    and stage cost must be exactly those of the scalar path (fitting_policies, cost.with_links, cheapest), for
    every offload mode, recompute, host-memory limit, link and precision, so the vectorized search plans what
    the scalar one would."""
    from planner import cost
    from planner.offload_policy import _MODES, cheapest, cheapest_by_layers, fitting_by_layers, fitting_policies

    rng = random.Random(3)
    seen = set()
    for _ in range(250):
        heads = rng.choice([12, 16, 32, 48])
        model = ModelSpec(name="t", num_layers=rng.randint(1, 40), hidden_size=heads * rng.choice([64, 128]),
                          num_heads=heads, vocab_size=rng.choice([32000, 50304, 128256]),
                          seq_len=rng.choice([512, 1024, 2048, 4096]), arch=rng.choice(["gpt", "llama"]))
        train = TrainSpec(global_batch=64, memory_reserve_gib=rng.choice([2.0, 8.0]),
                          precision=rng.choice(["fp32", "bf16", "fp16"]), grad_clip=rng.choice([None, 1.0]))
        gpus = rng.choice([1, 2, 4, 8])
        node = NodeSpec(name="n", gpu_type=rng.choice(TYPES[:6]), num_gpus=gpus,
                        host_mem_gib=rng.choice([None, 8, 16, 48, 200]), intra_node_bw_gb_s=rng.choice([None, 16.0]))
        tp = rng.choice([t for t in (1, 2, 4, 8) if t <= gpus and heads % t == 0])
        slot = cost.make_slot(ClusterSpec(nodes=[node]), train, "n", tp)
        first, last = rng.random() < 0.3, rng.random() < 0.3
        b, k, m = rng.choice([1, 2, 4, 8, 16]), rng.randint(1, 8), rng.randint(1, 16)
        nxt, prev = rng.choice([None, 1e9, 3e10]), rng.choice([None, 2e9, 5e10])
        fitting = fitting_by_layers(slot, model, train, first, last, b, k, model.num_layers)
        mode, rec, fwd, bwd, mem, val = cheapest_by_layers(fitting, slot, model, train, b, m, nxt, prev)
        for x, n in enumerate(range(1, model.num_layers + 1)):
            shape = cost.StageShape(n, first, last)
            cands = [(kn, cost.with_links(t, model, train, b, nxt, prev))
                     for kn, t in fitting_policies(slot, model, train, shape, b, k, None, None)]
            want = cheapest(cands, slot, model, train, shape, m)
            if mode[x] == -2:  # left to the scalar path
                continue
            if want is None:
                assert mode[x] == -1
                continue
            got = (cost.Knobs(int(rec[x]), *_MODES[mode[x]]),
                   cost.StageTimes(float(fwd[x]), float(bwd[x]), float(mem[x])), float(val[x]))
            assert got == want, (n, got, want)
            seen.add((int(mode[x]), int(rec[x]) > 0))
    assert {(0, False), (0, True), (1, False), (2, False), (2, True)} <= seen  # every mode, with and without recompute
