"""Drill files and what needs no Ray (the Ray drills are tests/test_drills.py): every fault kind has a scenario in
the default run; bad scenario and trace files exit 2 naming the line; a trace maps to preemptions and joins; the
samples check; the fleet simulator (`hetspot simulate`) and the replayed reference's plan placement.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.drills.results import check_samples
from orchestrator.drills.scenario import load_scenario, scenario_files
from orchestrator.drills.trace import drill_events, fleet_slots, parse_trace

ROOT = Path(__file__).resolve().parent.parent
DRILLS = scenario_files(ROOT / "drills")
HETSPOT = str(Path(sys.executable).parent / "hetspot")


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
    """Warm at join, as the simulator charges it: a rank on a joined node's GPU costs what is left of its
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
    assert got["assumptions"]["recovery"] == "in-place"  # the default strategy's name
    r = subprocess.run([HETSPOT, "simulate", "--trace", str(trace), "--cluster", str(fleet), "--recovery", "resume"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--recovery 'resume': give in-place or restart" in r.stderr
    assert "Traceback" not in r.stderr
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


@pytest.mark.unit
def test_unknown_reference_kind_exits_2(tmp_path):
    r = _run_cli(tmp_path, "t.jsonl", TRACE, ["drill", "--trace", "{}", "--reference", "oracle"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--reference 'oracle'" in r.stderr and "replayed" in r.stderr
