"""Recovery drills: every scenario in drills/ on the Ray test cluster with moto's S3 server, held to the
job's 1-device run, and a trace drill held to its replayed plans. What needs no Ray (bad scenario and trace files,
the trace mapping, the samples check, the fleet simulator) is tests/test_drill_files.py, a module the other xdist
worker takes beside this one.

A drill passes when its losses match the reference run's (relative 1e-4), every sample of the job is
trained exactly once in the committed steps (as the loss-reporting ranks list them), and the scenario's
`expect:` holds (lost steps, re-plans, drains, bytes restored per tier, ...). Scenarios marked `slow: true`
(the other notice clouds) run with `pytest -m slow`.
"""

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.drills.scenario import load_scenario, scenario_files
from orchestrator.drills.trace import parse_trace

ROOT = Path(__file__).resolve().parent.parent
DRILLS = scenario_files(ROOT / "drills")


# Scenarios the README's own test runs in the default run (tests/test_readme.py: `hetspot drill drills/preempt.yaml`
# exits 0 only when the oracle holds and the scenario's expectations are met): here with the slow tests.
IN_README = {"preempt"}


# Scenarios `make test` runs alone after the parallel part (marker `exclusive`): notice-staged holds a drain to a
# wall-clock deadline through a keeper on a node that joined mid-run. Beside the other worker's Ray heads in CI
# its drain copy to that keeper twice did not land in time (once at the 60 s deadline, once at the state
# plane's 60 s timeout with the deadline at 120 s) while it lands within 1.3-7.8 s alone or beside the planner's
# and the autoscaler's modules here; what stalls it is open (docs/drills.md).
ALONE = {"notice-staged"}


def _param(p: Path):
    slow = yaml.safe_load(p.read_text()).get("slow", False) or p.stem in IN_README
    marks = [pytest.mark.ray] + ([pytest.mark.slow] if slow else []) + (
        [pytest.mark.exclusive] if p.stem in ALONE else [])
    return pytest.param(p, id=p.stem, marks=marks)


@pytest.fixture(scope="module")
def shared():
    """One head-only Ray cluster and one moto S3 server; each drill adds the nodes it needs, and leaves the idle
    ones to the next (runner.Drill._start_nodes, tested below)."""
    import os

    from orchestrator.cluster.embedded import EmbeddedCluster
    from orchestrator.drills.inject import S3Server
    from orchestrator.drills.runner import CREDS
    from planner import ClusterSpec

    for k, v in CREDS.items():
        os.environ.setdefault(k, v)
    ec = EmbeddedCluster(ClusterSpec.model_construct(nodes=[]))
    ec.connect()
    s3 = S3Server()
    yield ec, s3
    s3.stop()
    ec.shutdown()


_REF: dict = {}


def one_device_reference(job) -> list[float]:
    """The losses of the drill's job trained on one device in this process (tests/oracle.py), shared by the drills of
    one job: what a drill's fault-free run of its first plan gives to far below the oracle's 1e-4 (the drills'
    float64), without that run's worker processes. `hetspot drill`'s own reference run is the README test's."""
    from tests.oracle import one_device_losses

    key = (job.model_spec.model_dump_json(), job.train.model_dump_json(), job.data.model_dump_json(),
           job.runtime.dtype, job.steps)
    if key not in _REF:
        _REF[key] = one_device_losses(job, job.steps)
    return _REF[key]


@pytest.mark.ray
@pytest.mark.parametrize("path", [_param(p) for p in DRILLS])
def test_drill_scenario_holds_the_oracle(shared, path):
    from orchestrator.drills.runner import Drill

    ec, s3 = shared
    sc = load_scenario(path)
    result = Drill(sc, cluster=ec, s3=s3).run(reference=one_device_reference(sc.job))
    out = result.to_json()
    assert result.error is None, result.error
    assert result.max_rel_diff <= 1e-4, (result.losses, result.reference)
    assert result.samples["exactly_once"], result.samples
    assert not result.expect_failures, (result.expect_failures, out["recoveries"], out["events"])
    assert result.oracle_holds
    assert out["faults"] and all(f["injected_s"] > 0 for f in out["faults"])  # every fault was injected
    assert out["recoveries"], "a fault with no recovery event"


@pytest.mark.ray
def test_a_shared_cluster_keeps_idle_nodes_declared_alike_and_replaces_the_rest(shared):
    """Drills on one cluster reuse each other's nodes (a node start is a raylet and two agents, about 1.7 s of CPU):
    a node is kept only while no actor holds its resources, and only for a drill that declares it alike; any
    other node goes before a drill starts, so its job sees exactly its first nodes."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from orchestrator.drills.runner import Drill

    ec, s3 = shared
    sc = load_scenario(ROOT / "drills" / "s3-outage.yaml")  # l4-a, t4-b, t4-c; no notice, no joining node
    first = Drill(sc, cluster=ec, s3=s3)
    first._start_nodes()
    ec.nodes["stray"] = ec.add(sc.job.cluster.nodes[0].model_copy(update={"name": "stray"}))
    ids = {n: ec.nodes[n].node_id for n in ec.nodes}

    @ray.remote(num_gpus=1)
    class Holder:
        def ping(self) -> bool:
            return True

    holder = Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ids["t4-b"], soft=False)).remote()
    ray.get(holder.ping.remote(), timeout=60)
    assert ec.idle(list(ec.nodes), wait_s=1.0) == {"l4-a", "t4-c", "stray"}  # t4-b's GPU is held
    ray.kill(holder)
    assert ec.idle(list(ec.nodes)) == {"l4-a", "t4-b", "t4-c", "stray"}
    n, _ = ec.declared["t4-c"]
    ec.declared["t4-c"] = (n.model_copy(update={"market": "on-demand"}), {})  # declared otherwise than the job does
    Drill(sc, cluster=ec, s3=s3)._start_nodes()
    assert set(ec.nodes) == {"l4-a", "t4-b", "t4-c"}  # the stray node went
    assert {n: ec.nodes[n].node_id == ids[n] for n in ec.nodes} == {"l4-a": True, "t4-b": True, "t4-c": False}
    alive = {x["NodeID"] for x in ray.nodes() if x["Alive"]}
    assert ids["stray"] not in alive and ids["t4-c"] not in alive


SMALL_TRACE_JOB = {
    "name": "trace-test",
    "model": {"name": "gpt-trace-test", "num_layers": 4, "hidden_size": 64, "num_heads": 4, "vocab_size": 64,
              "seq_len": 64},
    "train": {"global_batch": 128, "lr": 0.01, "precision": "fp32"},  # every slot gets a share (drills/job-mixed3)
    "runtime": {"dtype": "float64", "emulate_speed": False, "collective_timeout_s": 10, "snapshot_every": 1,
                "scale_check_every": 1},
    "checkpoint": {"uri": "s3://hetspot-drill/trace-test", "s3_every": 5, "keep": 2},
    "steps": 1,
}


@pytest.mark.ray
def test_trace_replay_holds_the_replayed_plans_reference_bit_for_bit(shared):
    """A trace drill (a preemption, then a join) on three test nodes, held to the drill's own plans run without
    faults: the recovery leaves the losses bit for bit as that run, and every sample is seen once."""
    from orchestrator.drills.runner import Drill
    from orchestrator.drills.trace import trace_scenario

    ec, s3 = shared
    tr = parse_trace("\n".join(json.dumps(x) for x in [
        [0, "add", {"nodes": [f"node-{i}" for i in range(6)]}],
        [8000, "remove", {"nodes": ["node-1"]}],
        [16000, "add", {"nodes": ["node-7"], "duration": 8000}],
    ]))
    sc, events = trace_scenario(tr, k=3, time_scale=1.0, job=SMALL_TRACE_JOB)
    assert [e.kind for e in events] == ["preempt", "add-node"]
    lines: list[str] = []
    # the trace's time, and then at least four steps after its last event: a join is weighed once the running
    # plan's speed is measured (three commits into a plan, which a re-plan just before the join restarts), and a
    # slow machine fits fewer steps in 24 s; what is checked is the recovery and the join, not a step count
    r = Drill(sc, cluster=ec, s3=s3, on_line=lines.append, reference="replayed").run(until_s=tr.end_s,
                                                                                       commits_after_faults=4)
    out = r.to_json()
    assert r.error is None, r.error
    assert out["reference_kind"] == "replayed" and len(r.reference) == r.steps
    assert r.max_rel_diff == 0.0, (r.losses, r.reference)
    assert r.samples["exactly_once"], r.samples
    moves = [e["kind"] for e in r.events if e["kind"] in ("re-plan", "scale-up")]
    assert moves[0] == "re-plan", r.events  # the preemption
    (joined,) = next(f for f in r.faults if f["kind"] == "add-node")["nodes"]
    joins = [e for e in r.events if e["kind"] in ("warm-at-join", "scale-up", "scale-up-declined")]
    # the join is used: moved onto at a scale check (the trace's end waits for a chosen move's warm workers,
    # Drill._join_waits), or (on a machine so slow that both events land before the first commit) planned on by the
    # re-plan itself
    assert joined in r.final_nodes, (joined, r.final_nodes, joins)
    # every plan the drill trained under is replayed (three on a machine of ordinary speed: start, after the loss,
    # after the join), and the losses above are bit for bit those of that replay
    plans = {int(m.rsplit(" of ", 1)[1].split()[0]) for m in lines if " on plan " in m}
    assert len(plans) == 1 and any(f"plan {n} of {n}" in m for n in plans for m in lines), lines
    assert r.oracle_holds


@pytest.mark.ray
def test_an_epoch_of_a_sharded_corpus_reads_every_window_once_across_a_replan(shared, tmp_path):
    """drills/preempt.yaml on a corpus of three token shards (400 windows of seq_len + 1 tokens; each shard's tail
    short of a window is not read): a node killed at step 3, in the middle of the first epoch, and the job re-planned
    onto the two nodes left. Over the 768 samples of 6 steps, the first epoch's 400 read every window exactly once and
    the second epoch's 368 read distinct windows in another order; the losses still hold the 1-device oracle."""
    import numpy as np

    from orchestrator.drills.runner import Drill
    from orchestrator.job_spec import DataSpec
    from workers.epochs import EpochOrder

    ec, s3 = shared
    sc = load_scenario(ROOT / "drills" / "preempt.yaml")
    window = sc.job.model_spec.seq_len + 1
    folder = tmp_path / "shards"
    folder.mkdir()
    rng = np.random.default_rng(0)
    lengths = [130 * window + 10, 140 * window + 30, 130 * window]
    for i, n in enumerate(lengths):
        rng.integers(0, sc.job.model_spec.vocab_size, n, dtype=np.uint16).tofile(folder / f"shard-{i:03d}.bin")
    job = sc.job.model_copy(update={"data": DataSpec(kind="tokens", path=str(folder), dtype="uint16")})
    sc = sc.model_copy(update={"job": job})
    result = Drill(sc, cluster=ec, s3=s3).run(reference=one_device_reference(job))
    assert result.error is None and result.oracle_holds, (result.error, result.samples, result.expect_failures)
    assert result.to_json()["recoveries"]  # the kill landed mid-epoch and was recovered from
    order = EpochOrder(lengths, window, seed=0)
    assert order.windows == 400
    read = [order.window_of(i) for s in sorted(result.sample_ranges) for a, n in result.sample_ranges[s]
            for i in range(a, a + n)]
    assert len(read) == 6 * 128
    first, second = read[:400], read[400:]
    assert sorted(first) == list(range(400))  # the first epoch: every window exactly once
    assert len(set(second)) == len(second) and second != [w for w in first[:len(second)]]  # another order


@pytest.mark.ray
def test_the_validation_loss_across_a_replan_is_the_one_device_loss(shared, tmp_path):
    """drills/preempt.yaml with train.eval_every 2 on a token corpus with a tenth held out: three replicas of
    different batch shares evaluate every second step; a node is killed at step 3 and the job goes on with two. Every
    validation loss, before and after the recovery, is the 1-device run's on the same samples (float64)."""
    import numpy as np

    from orchestrator.drills.runner import Drill
    from orchestrator.job_spec import DataSpec
    from tests.oracle import one_device_run

    ec, s3 = shared
    sc = load_scenario(ROOT / "drills" / "preempt.yaml")
    path = tmp_path / "corpus.bin"
    np.random.default_rng(1).integers(0, sc.job.model_spec.vocab_size, 65 * 2000, dtype=np.uint16).tofile(path)
    job = sc.job.model_copy(update={
        "data": DataSpec(kind="tokens", path=str(path), dtype="uint16", val_fraction=0.1),
        "train": sc.job.train.model_copy(update={"eval_every": 2, "eval_samples": 128})})
    sc = sc.model_copy(update={"job": job})
    want: dict = {}
    reference = one_device_run(job, job.steps, want)[0]
    result = Drill(sc, cluster=ec, s3=s3).run(reference=reference)
    assert result.error is None and result.oracle_holds, (result.error, result.samples, result.expect_failures)
    assert result.to_json()["recoveries"]
    assert sorted(result.val_losses) == sorted(want) == [1, 3, 5]
    for s, v in want.items():
        assert abs(result.val_losses[s] - v) <= 1e-9 * abs(v), (s, result.val_losses, want)
