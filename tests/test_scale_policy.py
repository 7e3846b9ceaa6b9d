"""The migration-aware re-plan and scale-up policies: pure, plain numbers in, a decision and its reason out."""

import json

import pytest

from orchestrator.control.migration import Candidate, migration_bytes, migration_cost_s
from orchestrator.control.replan import replan_policy, scale_policy
from planner import ClusterSpec, ModelSpec, NodeSpec, Pipeline, Plan, Stage, TrainSpec
from planner.search import Planner

pytestmark = pytest.mark.unit
BW = {"live": 10e9, "peer": 1e9, "s3": 0.1e9}
NOW = Candidate("running", 1000.0, {}, 0.0)


def test_faster_plan_is_taken_when_the_gain_pays_for_the_move():
    fast = Candidate("with-h100", 3000.0, {"peer": 2e9}, 5.0)  # 5 s start-up + 2 s of transfers
    d = scale_policy(NOW, [fast], tokens_left=1e6, bandwidth=BW)
    assert d.move and d.chosen == "with-h100"
    assert d.finish_s["running"] == pytest.approx(1000.0) and d.finish_s["with-h100"] == pytest.approx(7 + 1e6 / 3000)


def test_faster_plan_is_declined_near_the_end_with_the_numbers():
    fast = Candidate("with-h100", 3000.0, {"peer": 2e9}, 5.0)
    d = scale_policy(NOW, [fast], tokens_left=6000.0, bandwidth=BW)  # 6 s left; gain 4 s < cost 7 s
    assert not d.move and d.chosen == "running"
    assert "gain 4.0 s" in d.reason and "migration cost 7.0 s" in d.reason


def test_among_candidates_the_soonest_finish_wins_not_the_fastest():
    fastest = Candidate("everything", 4000.0, {"s3": 10e9}, 5.0)  # 100 s of S3 reads
    local = Candidate("same-nodes", 3000.0, {"live": 1e9}, 5.0)
    d = scale_policy(NOW, [fastest, local], tokens_left=1e6, bandwidth=BW)
    assert d.chosen == "same-nodes"
    assert migration_cost_s(fastest, BW) == pytest.approx(105.0)


def test_no_faster_candidate_stays():
    d = scale_policy(NOW, [Candidate("slower", 500.0, {}, 1.0)], tokens_left=1e6, bandwidth=BW)
    assert not d.move and "no candidate plan is faster" in d.reason


def test_replan_picks_the_soonest_finish_among_top_candidates():
    """After a loss there is no plan to stay on: near the end a slower plan that keeps layers where their
    state is wins; with much work left the fastest wins."""
    fastest = Candidate("candidate 1", 3000.0, {"peer": 20e9}, 5.0)  # 20 s of transfers from other nodes
    local = Candidate("candidate 2", 2500.0, {"live": 20e9}, 5.0)  # 2 s from its own node's keeper
    near_end = replan_policy([fastest, local], tokens_left=30_000, bandwidth=BW)
    assert near_end.chosen == "candidate 2" and "candidate 1 is faster" in near_end.reason
    assert near_end.finish_s["candidate 1"] == pytest.approx(25 + 10)
    assert near_end.finish_s["candidate 2"] == pytest.approx(7 + 12)
    assert replan_policy([fastest, local], tokens_left=1e8, bandwidth=BW).chosen == "candidate 1"


def test_a_movement_aware_replan_trades_a_little_throughput_for_fewer_bytes_moved():
    """With much work left the fastest plan finishes soonest, so without a tolerance it wins
    however much it moves; within the tolerance (2%) the plan moving the fewest bytes over the network wins, and
    the reason says what was traded. A plan outside the tolerance is not taken for its bytes."""
    resplit = Candidate("candidate 1", 3000.0, {"peer": 4e9}, 5.0, moved_bytes=40e9)  # every pipeline re-split
    kept = Candidate("candidate 2", 2958.0, {"peer": 0.4e9}, 5.0, moved_bytes=4e9)  # 1.4% slower, one stage moves
    idle = Candidate("candidate 3", 2800.0, {}, 5.0, moved_bytes=0.0)  # 6.7% slower, nothing moves
    cands = [resplit, kept, idle]
    assert replan_policy(cands, tokens_left=1e9, bandwidth=BW).chosen == "candidate 1"  # tolerance 0: soonest
    d = replan_policy(cands, tokens_left=1e9, bandwidth=BW, tolerance=0.02)
    assert d.chosen == "candidate 2" and d.plan is None  # the candidates here carry no Plan
    assert "1.4% slower than candidate 1" in d.reason and "10.0x fewer bytes moved" in d.reason
    assert replan_policy(cands, tokens_left=1e9, bandwidth=BW, tolerance=0.1).chosen == "candidate 3"
    # near the end the soonest finish already moves the least: the tolerance changes nothing
    assert replan_policy(cands, tokens_left=1e4, bandwidth=BW, tolerance=0.02).chosen == \
        replan_policy(cands, tokens_left=1e4, bandwidth=BW).chosen


MODEL, TRAIN = ModelSpec.preset("tiny"), TrainSpec(global_batch=8)
TWO = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100-80GB", num_gpus=2),
                         NodeSpec(name="l", gpu_type="L4", num_gpus=2)])


def _one_stage(node: str, replicas: int = 1) -> Plan:
    return Plan(model_name=MODEL.name, num_layers=MODEL.num_layers, global_batch=8, pipelines=[
        Pipeline(num_samples=8 // replicas, micro_batch_size=8 // replicas, num_micro_batches=1,
                 stages=[Stage(layer_start=0, layer_end=MODEL.num_layers, gpu_type="L4", node=node,
                               devices=[f"{node}/{i}"])])
        for i in range(replicas)])


def test_migration_bytes_by_where_the_running_plan_held_each_layer():
    full = MODEL.num_params * TRAIN.state_bytes_per_param
    assert migration_bytes(_one_stage("l"), _one_stage("l"), MODEL, TRAIN) == {"live": full, "peer": 0.0}
    assert migration_bytes(_one_stage("a"), _one_stage("l"), MODEL, TRAIN) == {"live": 0.0, "peer": full}
    assert migration_bytes(_one_stage("a"), _one_stage("l", 2), MODEL, TRAIN)["peer"] == 2 * full  # each replica pulls


def test_planner_candidates_are_distinct_best_first_and_the_first_is_the_plan():
    planner = Planner(MODEL, TRAIN)
    got = planner.candidates(TWO, k=4)
    assert len(got) >= 2 and len({json.dumps(p.model_dump()["pipelines"]) for p in got}) == len(got)
    times = [p.estimate.step_time_s for p in got]
    assert times == sorted(times)
    assert got[0].pipelines == planner.plan(TWO).pipelines


def test_controller_replan_records_the_weighed_candidates():
    from orchestrator.control.controller import Controller, State
    from orchestrator.control.fakes import FakeNodes, FakeWorkerGroup
    from orchestrator.control.policy import Policy

    log: list = []
    fails = [[2]]
    c = Controller(MODEL, TRAIN, 4, FakeNodes(TWO, TWO),
                   lambda p: FakeWorkerGroup(p, log, fails.pop(0) if fails else None),
                   policy=Policy(snapshot_every=1))
    first = None
    while c.state != State.DONE:
        c.step()
        first = first or c.plan
    ev = next(e for e in c.progress.events if e["kind"] == "re-plan")
    choice = ev["plan_choice"]
    assert len(choice["predicted_tokens_per_s"]) >= 2
    assert set(choice["finish_s"]) == set(choice["predicted_tokens_per_s"])
    assert min(choice["finish_s"], key=choice["finish_s"].get) in choice["choice"]
    assert c.plan.pipelines == first.pipelines  # same nodes survive: the plan whose state is all local wins


def test_nodes_pull_at_once_so_migration_lasts_as_long_as_the_slowest_node():
    """Two replicas on two nodes each pull a whole copy: the migration takes one node's pull, not two."""
    from orchestrator.control.migration import slowest_pull

    full = MODEL.num_params * TRAIN.state_bytes_per_param
    two_nodes = Plan(model_name=MODEL.name, num_layers=MODEL.num_layers, global_batch=8, pipelines=[
        _one_stage("a").pipelines[0].model_copy(update={"num_samples": 4, "micro_batch_size": 4}),
        _one_stage("l").pipelines[0].model_copy(update={"num_samples": 4, "micro_batch_size": 4})])
    assert migration_bytes(None, two_nodes, MODEL, TRAIN)["peer"] == 2 * full  # in all
    bw = {"live": 4e9, "peer": 1e9, "s3": 1e9}
    assert slowest_pull(None, two_nodes, MODEL, TRAIN, bw) == {"live": 0.0, "peer": full}  # per node, at once
    kept = slowest_pull(_one_stage("a"), two_nodes, MODEL, TRAIN, bw)
    assert kept == {"live": 0.0, "peer": full}  # node a reads its own layers live; node l pulls over the network


def test_a_drain_copies_nothing_when_other_replicas_hold_the_doomed_layers():
    """Replicas on a and l: either may go with nothing copied (the other holds every layer). One pipeline split
    over a and l: each node holds layers no one else does, so a drain copies every node's state over its link."""
    from orchestrator.control.drain import drain_copy_s, replicated_off
    from orchestrator.control.migration import node_bytes

    two_nodes = Plan(model_name=MODEL.name, num_layers=MODEL.num_layers, global_batch=8, pipelines=[
        _one_stage(n).pipelines[0].model_copy(update={"num_samples": 4, "micro_batch_size": 4}) for n in "al"])
    half = MODEL.num_layers // 2
    split = Plan(model_name=MODEL.name, num_layers=MODEL.num_layers, global_batch=8, pipelines=[Pipeline(
        num_samples=8, micro_batch_size=8, num_micro_batches=1,
        stages=[Stage(layer_start=a, layer_end=b, gpu_type="L4", node=n, devices=[f"{n}/0"])
                for n, a, b in (("a", 0, half), ("l", half, MODEL.num_layers))])])
    assert replicated_off(two_nodes, {"a"}) and replicated_off(two_nodes, {"l"})
    assert not replicated_off(two_nodes, {"a", "l"}) and not replicated_off(split, {"a"})
    assert drain_copy_s(two_nodes, MODEL, TRAIN, TWO, {"a"}) == 0.0
    link = min(n.inter_node_bw_gb_s for n in TWO.nodes) * 1e9
    most = max(node_bytes(split, MODEL, TRAIN).values())
    assert drain_copy_s(split, MODEL, TRAIN, TWO, {"a"}) == pytest.approx(most / link)
    assert drain_copy_s(two_nodes, MODEL, TRAIN, TWO, {"a", "l"}) > 0.0  # both replicas doomed: the whole copy


def test_relabel_keeps_surviving_nodes_on_the_layers_they_hold():
    """Five L4 nodes, one pipeline of two stages per pair of nodes. After node n0 goes, the re-plan's nodes are
    named arbitrarily by the planner (here: rotated on purpose); relabel swaps nodes of the kind so that every
    survivor keeps its own layers: only the node taking n0's place pulls, and the estimate is unchanged."""
    from orchestrator.control.migration import migration_bytes, slowest_pull
    from orchestrator.control.replan import relabel, renamed
    from planner import evaluate

    model = ModelSpec.preset("gpt-350m")
    train = TrainSpec(global_batch=16)
    nodes = [NodeSpec(name=f"n{i}", gpu_type="L4", num_gpus=1, inter_node_bw_gb_s=10) for i in range(5)]
    half = model.num_layers // 2

    def pipelines(pairs):
        return Plan(model_name=model.name, num_layers=model.num_layers, global_batch=16, pipelines=[Pipeline(
            num_samples=8, micro_batch_size=4, num_micro_batches=2, stages=[
                Stage(layer_start=a, layer_end=b, gpu_type="L4", node=n, devices=[f"{n}/0"])
                for n, a, b in ((first, 0, half), (second, half, model.num_layers))]) for first, second in pairs])

    old = pipelines([("n0", "n1"), ("n2", "n3")])
    survivors = ClusterSpec(nodes=nodes[1:])
    new = pipelines([("n4", "n1"), ("n2", "n3")])  # the best re-plan: n4 takes n0's stage
    new.estimate = evaluate(new, survivors, model, train)
    rotated = renamed(new, {"n1": "n2", "n2": "n3", "n3": "n4", "n4": "n1"})  # as the planner might name them
    rotated.estimate = evaluate(rotated, survivors, model, train)
    got = relabel(rotated, old, survivors, model, train)
    got.check_structure()
    assert evaluate(got, survivors, model, train).step_time_s == pytest.approx(new.estimate.step_time_s)
    assert migration_bytes(old, got, model, train)["peer"] == migration_bytes(old, new, model, train)["peer"]
    assert migration_bytes(old, rotated, model, train)["peer"] > 2 * migration_bytes(old, got, model, train)["peer"]
    assert [st.node for p in got.pipelines for st in p.stages if st.node != "n4"] == ["n1", "n2", "n3"]
    bw = {"live": 40e9, "peer": 10e9, "s3": 1e9}
    assert slowest_pull(old, got, model, train, bw) == slowest_pull(old, new, model, train, bw)
    assert relabel(new, None, survivors, model, train) is new  # a first plan: nothing to keep

    class Rotating:  # a planner whose one candidate names the nodes as `rotated` does
        def candidates(self, cluster, k):
            return [rotated]

    from orchestrator.control.replan import choose_replan
    assert choose_replan(Rotating(), model, train, old, survivors, 100, 4.3)[0].pipelines == got.pipelines


def test_a_restore_holds_training_for_the_weights_and_any_moments_the_first_step_cannot_hide():
    """The weights come before the first step, AdamW's moments beside it (at half speed: the step's own traffic
    shares the link); training waits for the slowest node's weights, plus whatever of any node's moments are
    still to come when the step's forward and backward are done, and never longer than for every byte."""
    from orchestrator.control.migration import MOMENTS_SLOWDOWN, held_s, pull_held_s, slowest_pull
    from planner import evaluate

    assert held_s([], 5.0) == 0.0
    assert held_s([(2.0, 4.0), (3.0, 1.0)], window_s=10.0) == 3.0  # every moment in the window
    assert held_s([(2.0, 4.0), (3.0, 1.0)], window_s=0.0) == 6.0  # none hidden: as if every byte came first
    # node 1 has 3 s of moments left when the step starts; 4 s of window at half speed take 2 of them
    assert held_s([(2.0, 4.0), (3.0, 1.0)], window_s=4.0) == pytest.approx(3.0 + 3 - 4 / MOMENTS_SLOWDOWN)

    bw = {"live": 4e9, "peer": 1e9, "s3": 1e9}
    new = _one_stage("l")
    new.estimate = evaluate(new, TWO, MODEL, TRAIN)
    whole = sum(n / bw[t] for t, n in slowest_pull(None, new, MODEL, TRAIN, bw).items())
    window = new.estimate.pipeline_time_s[0]
    expect = held_s([(whole / 3, 2 * whole / 3)], window)
    assert pull_held_s(None, new, MODEL, TRAIN, bw) == pytest.approx(expect)
    assert whole / 3 <= expect <= whole  # a third of the bytes hold the step back; the rest hide in part or in all


def test_the_policy_charges_the_held_restore_time_where_it_is_known():
    slow = Candidate("c", 3000.0, {"peer": 30e9}, 5.0)  # 30 s of transfers at 1 GB/s
    assert migration_cost_s(slow, BW) == pytest.approx(35.0)
    held = Candidate("c", 3000.0, {"peer": 30e9}, 5.0, restore_s=10.0)
    assert migration_cost_s(held, BW) == pytest.approx(15.0)


def test_the_running_plans_measured_throughput_calibrates_the_scale_up_decision():
    """A small model on fake GPUs: the cost model predicts microseconds per step, so moving onto a joined L4
    never pays by the predictions alone. Measured at 1/1000 of its predicted speed (per-step overheads the
    model leaves out), the remaining work is long enough that it does; the event carries the factor."""
    from orchestrator.control.replan import consider_joined

    model = ModelSpec(name="m", num_layers=4, hidden_size=32, num_heads=4, vocab_size=64, seq_len=16)
    train = TrainSpec(global_batch=8)
    t4 = NodeSpec(name="t4", gpu_type="T4", num_gpus=1)
    both = ClusterSpec(nodes=[t4, NodeSpec(name="l4", gpu_type="L4", num_gpus=1)])
    planner = Planner(model, train)
    running = Planner(model, train).plan(ClusterSpec(nodes=[t4]))
    _, d, extra = consider_joined(planner, model, train, running, both, 100_000, 3.0)
    assert not d.move and "below its migration cost" in d.reason and "calibration" not in extra
    predicted = extra["predicted_tokens_per_s"]["running"]
    _, d, extra = consider_joined(planner, model, train, running, both, 100_000, 3.0, predicted / 1000)
    assert d.move and extra["calibration"] == pytest.approx(1e-3, rel=1e-2)
    assert extra["predicted_tokens_per_s"]["running"] == pytest.approx(predicted / 1000, rel=1e-2)


def test_a_node_joining_before_the_running_plan_is_measured_is_weighed_once_it_is():
    """The L4 joins one step after the job starts on a T4 (as a replacement node does right after a re-plan):
    the controller waits for two measured steps before weighing it, so the decision is calibrated (the model's
    predictions alone decline it) and the job moves."""
    from orchestrator.control.controller import Controller, State
    from orchestrator.control.fakes import FakeClock, FakeNodes, FakeWorkerGroup
    from orchestrator.control.policy import Policy
    from planner import evaluate
    from planner.specs import tokens_per_step

    model = ModelSpec(name="m", num_layers=4, hidden_size=32, num_heads=4, vocab_size=64, seq_len=16)
    train = TrainSpec(global_batch=8)
    t4 = ClusterSpec(nodes=[NodeSpec(name="t4", gpu_type="T4", num_gpus=1)])
    both = ClusterSpec(nodes=[*t4.nodes, NodeSpec(name="l4", gpu_type="L4", num_gpus=1)])
    predicted = evaluate(Planner(model, train).plan(t4), t4, model, train).tokens_per_s
    tick = tokens_per_step(model, train.global_batch) * 1000 / predicted  # each step measures 1/1000 of it
    log: list = []
    c = Controller(model, train, 100_000, FakeNodes(t4, t4, both), lambda p: FakeWorkerGroup(p, log),
                   clock=FakeClock(tick=tick), policy=Policy(scale_check_every=1))
    while c.state != State.DONE and not any(e["kind"].startswith("scale-up") for e in c.progress.events):
        c.step()
    ev = next(e for e in c.progress.events if e["kind"].startswith("scale-up"))
    assert ev["kind"] == "scale-up" and ev["at_step"] == 2, ev
    assert ev["calibration"] == pytest.approx(1e-3, rel=1e-2)


def test_a_joined_node_is_warmed_at_once_and_the_move_waits_for_its_workers_while_training_goes_on():
    """The L4's GPU gets a warm worker the moment the controller sees it, before the
    running plan is measured or the move is weighed; the move, once chosen, goes at the first step boundary its
    worker is ready at, training on the T4 in between (the fake group asserts every step runs
    once, in order), and the scale-up event carries the switch's timeline (its stall: the re-form alone)."""
    from orchestrator.control.controller import Controller, State
    from orchestrator.control.fakes import FakeClock, FakeNodes, FakeWorkerGroup
    from orchestrator.control.policy import Policy
    model, train, t4, both, tick = _t4_job_an_l4_joins()
    log: list = []
    groups: list[FakeWorkerGroup] = []

    def make(plan):
        groups.append(FakeWorkerGroup(plan, log, stages_switch=True, ready_after=3))
        return groups[-1]

    c = Controller(model, train, 100_000, FakeNodes(t4, t4, both), make, clock=FakeClock(tick=tick),
                   policy=Policy(scale_check_every=1))
    while c.state != State.DONE and not (c.state == State.LAUNCHING and c.progress.events):
        c.step()
    kinds = [e["kind"] for e in c.progress.events]
    assert kinds == ["warm-at-join", "scale-up"], kinds
    warm, up = c.progress.events
    assert warm["nodes"] == ["l4"] and warm["new_workers"] == 1 and warm["at_step"] == 1  # seen after step 1
    assert ("warm-joined", ["l4"]) in log and len(groups) == 1  # warmed while the first group trains
    assert up["at_step"] == 2  # weighed a step later, once two steps of the running plan were measured
    # the move waited for the warm worker (the fake is ready at its fourth look): steps 3-5 trained on the T4
    assert c.progress.committed == 5 and c.state == State.LAUNCHING and "l4" in c.plan.nodes()
    while "first_step_s" not in up:
        c.step()
    assert len(groups) == 2 and log.index(("warm-joined", ["l4"])) < log.index(("start", 2))
    assert up["switch_s"] <= up["resumed_s"] <= up["first_step_s"] and up["stall_s"] >= 0
    assert c.progress.committed == 6 and c.progress.restarts == 0


def test_a_move_waiting_for_its_warm_workers_is_dropped_when_a_node_it_needs_leaves():
    """The L4 joins, the move onto it is chosen and waits for its worker; the L4 goes before the worker is up
    (no failure: the running plan never used it). The move is dropped, not launched onto a node that is gone:
    the scale-up event ends with no step of its own, and the T4 trains on without a re-plan."""
    from orchestrator.control.controller import Controller, State
    from orchestrator.control.fakes import FakeClock, FakeNodes, FakeWorkerGroup
    from orchestrator.control.policy import Policy
    model, train, t4, both, tick = _t4_job_an_l4_joins()
    log: list = []
    c = Controller(model, train, 8, FakeNodes(t4, t4, both, both, t4), lambda p: FakeWorkerGroup(
        p, log, stages_switch=True, ready_after=5), clock=FakeClock(tick=tick),
        policy=Policy(scale_check_every=1))
    assert c.run() == State.DONE, c.error
    up = next(e for e in c.progress.events if e["kind"] == "scale-up")
    assert up["ended"] == "a node it needs left before the switch" and up["first_step_s"] is None
    assert "switch_s" not in up and c.plan.nodes() == ["t4"] and c.progress.restarts == 0
    assert sorted(c.progress.losses) == list(range(8))


def _t4_job_an_l4_joins():
    """A small model on one T4, an L4 that joins, and the fake clock's tick per reading that makes each step measure
    1/1000 of its predicted speed (so the move onto the L4 pays, as in the calibration test above)."""
    from planner import evaluate
    from planner.specs import tokens_per_step

    model = ModelSpec(name="m", num_layers=4, hidden_size=32, num_heads=4, vocab_size=64, seq_len=16)
    train = TrainSpec(global_batch=8)
    t4 = ClusterSpec(nodes=[NodeSpec(name="t4", gpu_type="T4", num_gpus=1)])
    both = ClusterSpec(nodes=[*t4.nodes, NodeSpec(name="l4", gpu_type="L4", num_gpus=1)])
    predicted = evaluate(Planner(model, train).plan(t4), t4, model, train).tokens_per_s
    return model, train, t4, both, tokens_per_step(model, train.global_batch) * 1000 / predicted
