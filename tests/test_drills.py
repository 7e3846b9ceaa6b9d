"""Recovery drills (issue 13): every scenario in drills/ on the Ray test cluster with moto's S3 server, held to a
run of the same job without faults; bad scenario and trace files; the trace mapping; the samples check.

A drill passes when its losses match the reference run's (relative 1e-4), every sample of the job is
trained exactly once in the committed steps (as the loss-reporting ranks list them), and the scenario's
`expect:` holds (lost steps, re-plans, drains, bytes restored per tier, ...). Scenarios marked `slow: true`
(the other notice clouds) run with `pytest -m slow`.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.drills.results import check_samples
from orchestrator.drills.scenario import load_scenario
from orchestrator.drills.trace import drill_events, fleet_slots, parse_trace

ROOT = Path(__file__).resolve().parent.parent
DRILLS = sorted(p for p in (ROOT / "drills").glob("*.yaml") if not p.name.startswith("job-"))
HETSPOT = str(Path(sys.executable).parent / "hetspot")


# Scenarios the README's own test runs in the default run (tests/test_readme.py: `hetspot drill drills/preempt.yaml`
# exits 0 only when the oracle holds and the scenario's expectations are met): here with the slow tests.
IN_README = {"preempt"}


def _param(p: Path):
    slow = yaml.safe_load(p.read_text()).get("slow", False) or p.stem in IN_README
    return pytest.param(p, id=p.stem, marks=[pytest.mark.ray] + ([pytest.mark.slow] if slow else []))


@pytest.mark.unit
def test_one_scenario_per_fault_kind_and_at_least_one_runs_by_default():
    from orchestrator.drills.scenario import KINDS

    kinds: dict[str, list[bool]] = {}
    for p in DRILLS:
        sc = load_scenario(p)
        for f in sc.faults:
            kinds.setdefault(f.kind, []).append(sc.slow)
    assert set(kinds) == set(KINDS)
    assert all(not all(slow) for slow in kinds.values())  # each kind has a scenario in `make test`
    clouds = {f.cloud for p in DRILLS for f in load_scenario(p).faults if f.kind == "notice"}
    assert clouds == {"aws", "gcp", "azure", "ray"}


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


@pytest.mark.unit
def test_check_samples_finds_repeats_and_gaps():
    ok = {0: [(0, 3), (3, 1)], 1: [(4, 4)]}
    assert check_samples(ok, 2, 4)["exactly_once"]
    assert check_samples({0: [(0, 4)], 1: [(0, 4)]}, 2, 4)["repeated"] == 4  # step 1 re-trained step 0's samples
    got = check_samples({0: [(0, 4)]}, 2, 4)
    assert got["missing"] == 4 and not got["exactly_once"]


TRACE = "\n".join(json.dumps(x) for x in [
    [0, "add", {"nodes": [f"node-{i}" for i in range(8)], "duration": 60000}],
    [60000, "remove", {"nodes": ["node-1", "node-2"], "duration": 60000}],
    [90000, "no-op", {"nodes": []}],
    [120000, "remove", {"nodes": ["node-3"]}],
    [180000, "add", {"nodes": ["node-8", "node-9", "node-10"], "duration": 60000}],
    [240000, "remove", {"nodes": ["node-0", "node-4", "node-5", "node-6", "node-7", "node-8", "node-9"]}],
])


@pytest.mark.unit
def test_trace_maps_every_remove_to_a_preemption_and_every_add_to_a_join():
    tr = parse_trace(TRACE)
    assert tr.first_nodes == 8 and tr.end_s == 240.0 and len(tr.events) == 5
    ev = drill_events(tr, k=4, time_scale=20)
    assert [e.kind for e in ev] == ["preempt", "preempt", "add-node", "preempt"]
    assert [e.t_s for e in ev] == [3.0, 6.0, 9.0, 12.0]
    assert ev[0].slots == (1,)  # node-1 -> slot 1; ceil(2 * 4 / 8) = 1 slot
    assert ev[1].slots == (3,)  # node-3 -> slot 3
    assert ev[2].slots == (1, 3)  # ceil(3 * 4 / 8) = 2 of the down slots come back
    assert ev[3].slots == (0, 1, 2)  # 7 nodes: ceil(7 * 4 / 8) = 4 slots, but the last one stays up
    up = 4
    for e in ev:
        up += len(e.slots) if e.kind == "add-node" else -len(e.slots)
        assert up >= 1  # one node always stays up
    # the fleet mapping: slot = node number mod 8; node-9 and node-10 bring slots 1 and 2 back (slot 0 never went)
    changes = fleet_slots(tr)
    assert changes[1] == (60.0, "remove", {1, 2}) and changes[3] == (180.0, "add", {1, 2})


BAD_SCENARIOS = {
    "unknown-kind": ("faults:\n  - {kind: nuke, at_step: 2, nodes: [a]}\n", ["line 8", "unknown fault kind 'nuke'",
                                                                             "preempt"]),
    "missing-node": ("faults:\n  - {kind: preempt, at_step: 2, nodes: [zz]}\n", ["line 8", "'zz'", "not in the job"]),
    "past-the-end": ("faults:\n  - {kind: preempt, at_step: 9, nodes: [a]}\n",
                     ["line 8", "at_step 9", "last step (3)"]),
    "both-times": ("faults:\n  - {kind: preempt, at_step: 2, at_s: 3, nodes: [a]}\n", ["line 8", "exactly one"]),
    "no-nodes": ("faults:\n  - {kind: preempt, at_step: 2}\n", ["line 8", "needs nodes"]),
    "faults-not-a-list": ("faults: preempt\n", ["faults:"]),
    "bad-expect": ("faults:\n  - {kind: preempt, at_step: 2, nodes: [a]}\nexpect: {bytes: {s3: lots}}\n",
                   ["expect.bytes", "s3: 'lots'", "'>0'"]),
    "steps-zero": ("steps: 0\nfaults:\n  - {kind: preempt, at_step: 1, nodes: [a]}\n", ["steps: 0", "positive"]),
    "unknown-field": ("faults:\n  - {kind: preempt, at_step: 2, nodes: [a], when: soon}\n", ["line 8", "when"]),
}
JOB_HEAD = ("name: bad\njob:\n  model: {preset: tiny}\n  train: {global_batch: 8}\n  steps: 4\n  cluster: {nodes: "
            "[{name: a, gpu_type: L4, num_gpus: 1}, {name: b, gpu_type: T4, num_gpus: 1}]}\n")
BAD_TRACES = {
    "not-json": ('[0, "add", {"nodes": ["node-0"]}]\n[60000, "remove", {nodes}]\n', ["line 2", "not JSON"]),
    "unknown-event": ('[0, "add", {"nodes": ["node-0"]}]\n[60000, "explode", {"nodes": []}]\n',
                      ["line 2", "unknown event 'explode'"]),
    "removes-a-down-node": ('[0, "add", {"nodes": ["node-0", "node-1"]}]\n[60000, "remove", {"nodes": ["node-7"]}]\n',
                            ["line 2", "node-7", "not up"]),
    "time-goes-back": ('[0, "add", {"nodes": ["node-0", "node-1"]}]\n[60000, "remove", {"nodes": ["node-1"]}]\n'
                       '[30000, "add", {"nodes": ["node-1"]}]\n', ["line 3", "goes back"]),
    "not-a-row": ('{"t": 0}\n', ["line 1", "not a trace row"]),
}


def _run_cli(tmp_path, name: str, text: str, args: list[str]) -> subprocess.CompletedProcess:
    f = tmp_path / name
    f.write_text(text)
    return subprocess.run([HETSPOT, *[str(f) if a == "{}" else a for a in args]], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(BAD_SCENARIOS))
def test_bad_scenario_exits_2_naming_the_line(tmp_path, case):
    body, words = BAD_SCENARIOS[case]
    r = _run_cli(tmp_path, f"{case}.yaml", JOB_HEAD + body, ["drill", "{}"])
    msg = " ".join(r.stderr.split())
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(BAD_TRACES))
def test_bad_trace_exits_2_naming_the_line(tmp_path, case):
    body, words = BAD_TRACES[case]
    fleet = str(ROOT / "examples" / "fleets" / "a10g-l4-32.yaml")
    for cmd in (["drill", "--trace", "{}"], ["simulate", "--trace", "{}", "--cluster", fleet]):
        r = _run_cli(tmp_path, f"{case}.jsonl", body, cmd)
        msg = " ".join(r.stderr.split())
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        for w in words:
            assert w in msg, (w, msg)


@pytest.mark.unit
def test_simulate_ranks_the_strategies_and_holds_hetspot_near_the_oracle(tmp_path):
    """A small fleet over the test's own trace: the free re-plan oracle trains the most; hetspot's
    recovery (peers first) beats S3-only checkpoint-restart; every strategy saw the same events."""
    from orchestrator.drills.fleet import Assumptions, FleetSim
    from planner import ClusterSpec, NodeSpec
    from planner.specs import ModelSpec, TrainSpec

    fleet = ClusterSpec(nodes=[NodeSpec(name=f"n{i}", gpu_type=("A100-80GB", "L4", "T4")[i % 3], num_gpus=2,
                                        inter_node_bw_gb_s=10) for i in range(8)])
    tr = parse_trace(TRACE)
    out = FleetSim(tr, fleet, ModelSpec.preset("gpt-350m"), TrainSpec(global_batch=64),
                   Assumptions(ckpt_every_s=120)).run()
    s = out["strategies"]
    assert set(s) == {"hetspot", "oracle", "oracle-startup", "s3-only", "symmetric"}
    assert s["oracle"]["tokens"] >= max(x["tokens"] for x in s.values()) * (1 - 1e-9)
    # the oracle paying start-up: the beginning's, and joined nodes only once their workers would be up
    assert s["oracle-startup"]["tokens"] < s["oracle"]["tokens"] and s["oracle-startup"]["recoveries"] == 0
    assert s["oracle-startup"]["down_s"] == out["assumptions"]["startup_s"]
    assert s["hetspot"]["tokens"] > s["s3-only"]["tokens"]
    assert s["hetspot"]["recoveries"] >= 1 and s["oracle"]["recoveries"] == 0
    assert s["s3-only"]["lost_s"] > s["hetspot"]["lost_s"]  # work since the last checkpoint vs the step in flight
    assert 0 < s["hetspot"]["goodput"] <= 1 and out["events"] == len(fleet_slots(tr))
    assert out["assumptions"]["ckpt_every_s"] == 120


@pytest.mark.unit
def test_simulate_charges_a_drain_when_the_notice_covers_the_copy():
    """With a notice that leaves time to copy the doomed nodes' state off at the next step boundary, hetspot
    redoes no work; without a notice, or when the copy takes longer than the notice, preemptions redo the
    step in flight."""
    from orchestrator.drills.fleet import Assumptions, FleetSim
    from planner import ClusterSpec, NodeSpec
    from planner.specs import ModelSpec, TrainSpec

    def lost(link_gb_s: float, notice_s: float) -> float:
        fleet = ClusterSpec(nodes=[NodeSpec(name=f"n{i}", gpu_type=("A100-80GB", "L4", "T4")[i % 3], num_gpus=2,
                                            inter_node_bw_gb_s=link_gb_s) for i in range(8)])
        out = FleetSim(parse_trace(TRACE), fleet, ModelSpec.preset("gpt-350m"), TrainSpec(global_batch=64),
                       Assumptions(notice_s=notice_s)).run()
        assert out["strategies"]["hetspot"]["recoveries"] >= 1
        return out["strategies"]["hetspot"]["lost_s"]

    assert lost(10, 120) == 0.0  # gpt-350m's state crosses a 10 GB/s link in well under the notice
    assert lost(10, 0) > 0.0
    assert lost(0.01, 120) > 0.0  # 10 MB/s: a node's ~2 GB take minutes, longer than the notice


@pytest.mark.unit
def test_simulate_charges_in_place_recovery_a_re_form_and_restart_a_process_start():
    """In place, a loss that leaves every rank of the new plan on a survivor's GPU costs the re-form; a rank on a
    GPU the old plan did not use starts a process beside it; the restart path starts every process. Over a
    trace, in-place recovery is down for less time and trains more than the restart path, all else equal."""
    from orchestrator.drills.fleet import Assumptions, FleetSim
    from orchestrator.drills.recovery_model import relaunch_s
    from planner import ClusterSpec, NodeSpec
    from planner.specs import ModelSpec, TrainSpec

    a = Assumptions(reform_s=0.5, startup_s=30.0)
    old = _one_gpu_plan(["a", "b", "c"])
    assert relaunch_s(old, _one_gpu_plan(["a", "b"]), {"c"}, a) == 0.5
    assert relaunch_s(old, _one_gpu_plan(["a", "b", "d"]), {"c"}, a) == 30.0  # a process starts on d
    assert relaunch_s(old, _one_gpu_plan(["a", "b"]), {"c"}, Assumptions(recovery="restart", startup_s=30.0)) == 30.0
    from orchestrator.drills.recovery_model import (
        staged_start_s,  # a notice's switch, pre-staged in place
    )

    assert staged_start_s(30.0, 119.0, a) == 0.5  # the process started while the doomed node trained on
    assert staged_start_s(30.0, 10.0, a) == 20.0  # a short notice hides part of it
    assert staged_start_s(30.0, 119.0, Assumptions(recovery="restart", startup_s=30.0)) == 30.0

    fleet = ClusterSpec(nodes=[NodeSpec(name=f"n{i}", gpu_type="L4", num_gpus=2, inter_node_bw_gb_s=10)
                               for i in range(8)])
    runs = {way: FleetSim(parse_trace(TRACE), fleet, ModelSpec.preset("gpt-350m"), TrainSpec(global_batch=64),
                          Assumptions(recovery=way, notice_s=0)).run()["strategies"]["hetspot"]
            for way in ("in-place", "restart")}
    assert runs["in-place"]["recoveries"] >= 1 and runs["in-place"]["down_s"] < runs["restart"]["down_s"]
    assert runs["in-place"]["tokens"] > runs["restart"]["tokens"]


@pytest.mark.unit
def test_simulate_warms_joined_nodes_so_moves_and_recoveries_onto_them_start_no_process():
    """Issue 45, warm at join, as the simulator charges it: a rank on a joined node's GPU costs what is left of its
    start-up at a recovery (nothing once it is up), and a move onto joined nodes waits for them while the old plan
    trains, stalling only the re-form and the restore. Over the test trace (three nodes join, then most of the
    fleet goes), hetspot in place is down for less time and trains more with it than without, and stays below the
    oracle that pays the same start-up."""
    from orchestrator.drills.fleet import Assumptions, FleetSim
    from orchestrator.drills.recovery_model import relaunch_s
    from planner import ClusterSpec, NodeSpec
    from planner.specs import ModelSpec, TrainSpec

    a = Assumptions(reform_s=0.5, startup_s=30.0)
    old = _one_gpu_plan(["a", "b", "c"])
    new = _one_gpu_plan(["a", "b", "d"])
    assert relaunch_s(old, new, {"c"}, a) == 30.0  # d cold: a process start
    assert relaunch_s(old, new, {"c"}, a, warm={"d": 100.0}, now=90.0) == 10.0  # d warming: what is left of it
    assert relaunch_s(old, new, {"c"}, a, warm={"d": 100.0}, now=130.0) == 0.5  # d up: the re-form alone

    fleet = ClusterSpec(nodes=[NodeSpec(name=f"n{i}", gpu_type=("A100-80GB", "L4", "T4")[i % 3], num_gpus=2,
                                        inter_node_bw_gb_s=10) for i in range(11)])
    runs = {warm: FleetSim(parse_trace(TRACE), fleet, ModelSpec.preset("gpt-350m"), TrainSpec(global_batch=64),
                           Assumptions(notice_s=0, warm_at_join=warm)).run()["strategies"] for warm in (False, True)}
    cold, warm = runs[False]["hetspot"], runs[True]["hetspot"]
    assert warm["down_s"] < cold["down_s"] and warm["tokens"] > cold["tokens"]
    assert warm["tokens"] <= runs[True]["oracle-startup"]["tokens"] * (1 + 1e-9)


@pytest.mark.unit
def test_simulate_cli_json_and_bad_fleet(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("fleet:\n  - {gpu_type: L4, nodes: 4, num_gpus: 2}\n  - {gpu_type: T4, nodes: 4, num_gpus: 2}\n")
    r = subprocess.run([HETSPOT, "simulate", "--trace", str(trace), "--cluster", str(fleet), "--model", "gpt-125m",
                        "--global-batch", "64", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["fleet"]["gpus"] == 16 and got["model"] == "gpt-125m" and "detect_s" in got["assumptions"]
    fleet.write_text("fleet:\n  - {gpu_type: L4, nodes: many}\n")
    r = subprocess.run([HETSPOT, "simulate", "--trace", str(trace), "--cluster", str(fleet)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "fleet.0.nodes" in r.stderr and "Traceback" not in r.stderr


def _one_gpu_plan(nodes: list[str], gpu: str = "T4"):
    from planner import Pipeline, Plan, Stage

    return Plan(model_name="m", num_layers=4, global_batch=8, pipelines=[Pipeline(
        num_samples=8 // len(nodes), micro_batch_size=8 // len(nodes), num_micro_batches=1,
        stages=[Stage(layer_start=0, layer_end=4, gpu_type=gpu, node=n, devices=[f"{n}/0"])]) for n in nodes])


@pytest.mark.unit
def test_replayed_reference_segments_the_committed_plans_and_places_them_on_like_nodes():
    """Steps group into runs of one plan; a plan's gone nodes map onto up nodes of the same kind (a node it
    already uses keeps its place), and nodes are added only where too few of a kind are up."""
    from orchestrator.drills.replay import place, plan_segments
    from planner import NodeSpec

    a, ab, bc = _one_gpu_plan(["a"]), _one_gpu_plan(["a", "b"]), _one_gpu_plan(["b", "c"])
    segs = plan_segments({0: a, 1: a, 2: ab, 3: ab, 4: a, 5: bc}, 6)
    assert [(x, y) for x, y, _ in segs] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    with pytest.raises(ValueError, match="step"):
        plan_segments({0: a, 2: a}, 3)
    declared = [NodeSpec(name=n, gpu_type="T4", num_gpus=1) for n in ("a", "b", "c")]
    added, placed = place([a, ab, bc], declared, alive=["b"])
    assert [n.name for n in added] == ["ref0"] and added[0].gpu_type == "T4"
    assert [p.nodes() for p in placed] == [["b"], ["b", "ref0"], ["b", "ref0"]]
    assert placed[2].pipelines[0].stages[0].devices == ["b/0"]  # b kept its place in the third plan
    added, placed = place([ab], declared + [NodeSpec(name="l", gpu_type="L4", num_gpus=1)], alive=["l", "c"])
    assert [n.name for n in added] == ["ref0"] and placed[0].nodes() == ["c", "ref0"]  # an L4 is no T4


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


@pytest.mark.unit
def test_unknown_reference_kind_exits_2(tmp_path):
    r = _run_cli(tmp_path, "t.jsonl", TRACE, ["drill", "--trace", "{}", "--reference", "oracle"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--reference 'oracle'" in r.stderr and "replayed" in r.stderr
