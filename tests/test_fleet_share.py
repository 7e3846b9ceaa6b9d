"""The fleet's share as a choice (control/share.py, runtime.fleet_share: weighted): the nodes go to the jobs that
share so as to maximise their weighted, normalised tokens/s, read alike by every job from the cards on the queue's
board; a waiting job asks for the nodes the share gives it, whatever the priorities, and the asked job gives back,
in place at a step boundary, only what its own reading does not keep. Through two controllers with fakes on one
fleet (tests/test_priorities.py's): every step of both jobs once, in order, from the state the step before left."""

import pytest

from orchestrator.control.controller import Controller, State
from orchestrator.control.fakes import FakeClock, MemoryQueue
from orchestrator.control.policy import Policy
from orchestrator.control.protocols import JobCard
from orchestrator.control.share import FleetShare, Rates, share, value, weight
from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec
from tests.test_priorities import MODEL, TRAIN, Fleet, JobNodes, Placed, assert_every_step_once, kinds, run_until

pytestmark = pytest.mark.unit
L4S = (NodeSpec(name="l4-a", gpu_type="L4", num_gpus=2), NodeSpec(name="l4-b", gpu_type="L4", num_gpus=2))
BIG = TrainSpec(global_batch=64)


def test_the_share_splits_a_fleet_where_a_job_gains_little_from_the_second_node():
    """The tiny model trains barely faster on two nodes than on one (the planner's estimate), so one node each is
    worth nearly twice keeping both with the first job. Alone, it takes the second node only where the gain beats
    the hysteresis (a small gain does not move a job)."""
    fleet = ClusterSpec(nodes=list(L4S))
    rates = Rates(fleet, {"a": (MODEL, TRAIN), "b": (MODEL, BIG)})
    both = frozenset({"l4-a", "l4-b"})
    assert rates.tps("a", both) < 1.1 * rates.tps("a", {"l4-a"})
    got = share(rates, {"a": 1.0, "b": 1.0}, both, {"a": both})
    assert len(got["a"]) == 1 and len(got["b"]) == 1 and got["a"] | got["b"] == both
    assert value(rates, {"a": 1.0, "b": 1.0}, got) > 1.8 * value(rates, {"a": 1.0, "b": 1.0}, {"a": both})
    assert share(rates, {"a": 1.0}, both, {"a": frozenset({"l4-a"})}) == {"a": frozenset({"l4-a"})}  # +3%
    assert share(rates, {"a": 1.0}, both, {"a": frozenset({"l4-a"})}, hysteresis=0.0) == {"a": both}
    assert weight(0) == 1 and weight(4) == 5 and 0 < weight(-3) < 1


def test_every_job_reads_the_same_share_and_nodes_a_first_come_job_holds_stay_out():
    """The waiting job's reading (it holds nothing; the running one's GPUs show as held) and the running job's
    (its own nodes are its plan's) agree; a node a job without a card holds is shared by nobody."""
    fleet = ClusterSpec(nodes=[*L4S, NodeSpec(name="l4-c", gpu_type="L4", num_gpus=2)])
    cards = {"a": JobCard(0, MODEL, TRAIN), "b": JobCard(0, MODEL, BIG)}
    waiting = FleetShare().decide(cards, fleet, {"l4-a": {"a": 2}, "l4-b": {"a": 2}, "l4-c": {"fcfs": 2}}, "b", ())
    running = FleetShare().decide(cards, fleet, {"l4-c": {"fcfs": 2}}, "a", {"l4-a", "l4-b"})
    assert waiting == running and waiting["b"] and waiting["a"]
    assert "l4-c" not in waiting["a"] | waiting["b"]


def sharing_job(fleet: Fleet, name: str, board: dict, line: list, steps: int, train: TrainSpec = TRAIN,
                card: bool = True, model: ModelSpec = MODEL, **policy):
    log: list = []
    clock = FakeClock(tick=0.1)
    queue = MemoryQueue(name, line, 0, board, JobCard(0, model, train) if card else None)
    c = Controller(model, train, steps, JobNodes(fleet, name), lambda p: Placed(fleet, name, p, log), clock=clock,
                   sleep=clock.advance, queue=queue, policy=Policy(**policy))
    return c


def arrive(first_card: bool):
    """`first` trains alone on both L4 nodes; `second`, sharing, arrives and finds nothing free."""
    fleet, board, line = Fleet(*L4S), {}, []
    first = sharing_job(fleet, "first", board, line, 30, card=first_card)
    run_until([first], lambda: first.progress.committed >= 2)
    assert set(first.plan.nodes()) == {"l4-a", "l4-b"}
    second = sharing_job(fleet, "second", board, line, 6, train=BIG)
    return first, second


def test_a_job_arriving_on_a_full_fleet_gets_its_share_in_place_at_equal_priority():
    """Both jobs share by weight at priority 0. The second asks the first for the node the share gives it; the
    first gives it back through the drain path at a step boundary and trains on the other; the second trains on
    the node given; neither loses or repeats a step. (First come, first served would keep the second waiting
    until the first ended: tests/test_priorities.py's equal-priority test.)"""
    first, second = arrive(first_card=True)
    run_until([first, second], lambda: second.state is State.DONE)
    (asked,) = [e for e in second.progress.events if e["kind"] == "asked"]
    given = asked["asked"]["first"]
    assert len(given) == 1 and asked["share"]["second"] == given, asked
    (y,) = [e for e in first.progress.events if e["kind"] == "yield"]
    assert y["share"] and y["nodes"] == given and "weighted share" in y["cause"]
    assert "drain" in kinds(first) and first.progress.restarts == 0
    assert second.plan.nodes() == given and set(first.plan.nodes()) == {"l4-a", "l4-b"} - set(given)
    run_until([first], lambda: first.state is State.DONE)
    assert_every_step_once(first)
    assert_every_step_once(second)


def test_a_first_come_job_declines_the_shares_request():
    """The running job shows no card (runtime.fleet_share: first-come): it keeps its nodes and says why; the
    sharing job waits in the queue until it ends."""
    first, second = arrive(first_card=False)
    run_until([first, second], lambda: second.state is State.DONE)
    assert "asked" not in kinds(second) and "yield" not in kinds(first)  # no card: nothing of its is shared
    assert_every_step_once(first)
    assert_every_step_once(second)
    q = [e for e in second.progress.events if e["kind"] == "dequeued"]
    assert q and second.progress.events.index(q[0]) > 0


def test_a_request_by_the_share_for_what_the_share_keeps_is_declined():
    """A request marked as the share's for nodes that the asked job's own reading keeps with it (here: no other
    job shares) is declined with the reason; the job trains on, every step once."""
    fleet, board = Fleet(*L4S), {}
    c = sharing_job(fleet, "only", board, [], 8)
    run_until([c], lambda: c.progress.committed >= 1)
    MemoryQueue("pushy", [], 0, board).ask("only", ["l4-a"], share=True)
    run_until([c], lambda: c.state is State.DONE)
    (e,) = [e for e in c.progress.events if e["kind"] == "yield-declined"]
    assert "share keeps them" in e["cause"] and e["share"]
    assert_every_step_once(c)


def test_a_running_job_asks_for_its_share_at_a_scale_check_and_grows_into_it_in_place():
    """Three L4 nodes: the tiny model's job holds two (it gains 3% from the second); a larger model's job, which
    gains 72% from a second node, starts on the third, free one. At its scale check it reads the share (one node
    for the tiny model, two for it), asks for the node, gets it through the tiny job's drain at a step boundary,
    and grows into it in place (a joined node to it: warm workers first, then the move). Neither job loses or
    repeats a step, and the tiny job does not grow back into the node it gave."""
    big = ModelSpec(name="big", num_layers=8, hidden_size=1024, num_heads=16, vocab_size=32000, seq_len=512)
    fleet, board, line = Fleet(*L4S, NodeSpec(name="l4-c", gpu_type="L4", num_gpus=2)), {}, []
    fleet.take("other", ["l4-c/0", "l4-c/1"])  # the tiny job plans on l4-a and l4-b
    tiny = sharing_job(fleet, "tiny", board, line, 60, scale_check_every=2)
    run_until([tiny], lambda: tiny.progress.committed >= 2)
    assert set(tiny.plan.nodes()) == {"l4-a", "l4-b"}
    fleet.give_back("other")
    grower = sharing_job(fleet, "grower", board, line, 30, train=BIG, model=big, scale_check_every=2)
    run_until([tiny, grower], lambda: grower.state is State.DONE)
    assert "queued" not in kinds(grower)  # it started on the free node
    (asked,) = [e for e in grower.progress.events if e["kind"] == "asked"]
    assert asked["asked"] == {"tiny": ["l4-b"]} and asked["share"] == {"grower": ["l4-b", "l4-c"], "tiny": ["l4-a"]}
    (y,) = [e for e in tiny.progress.events if e["kind"] == "yield"]
    assert y["share"] and y["nodes"] == ["l4-b"]
    (up,) = [e for e in grower.progress.events if e["kind"] == "scale-up"]
    assert set(grower.plan.nodes()) == {"l4-b", "l4-c"} and grower.progress.restarts == 0, grower.progress.events
    run_until([tiny], lambda: tiny.state is State.DONE)
    assert set(tiny.plan.nodes()) == {"l4-a"} and tiny.progress.restarts == 0
    assert_every_step_once(tiny)
    assert_every_step_once(grower)


def test_gpus_another_job_frees_go_to_the_sharing_job_its_share_gives_them_not_to_the_first_to_look():
    """Both jobs run, each on one L4 node, when a job that does not share ends on the third: the share gives that
    node to the larger model's job, so the tiny job neither warms workers on it nor grows into it, however soon
    it looks; the larger job grows into it in place."""
    big = ModelSpec(name="big", num_layers=8, hidden_size=1024, num_heads=16, vocab_size=32000, seq_len=512)
    fleet, board, line = Fleet(*L4S, NodeSpec(name="l4-c", gpu_type="L4", num_gpus=2)), {}, []
    fleet.take("other", ["l4-b/0", "l4-b/1", "l4-c/0", "l4-c/1"])
    tiny = sharing_job(fleet, "tiny", board, line, 40, scale_check_every=1)
    run_until([tiny], lambda: tiny.progress.committed >= 2)
    fleet.give_back("other", keep=frozenset({"l4-c/0", "l4-c/1"}))
    grower = sharing_job(fleet, "grower", board, line, 24, train=BIG, model=big, scale_check_every=2)
    run_until([grower], lambda: grower.progress.committed >= 1)
    assert tiny.plan.nodes() == ["l4-a"] and grower.plan.nodes() == ["l4-b"]
    fleet.give_back("other")  # l4-c is free: to both jobs it reads as a joined node
    run_until([tiny, grower], lambda: grower.state is State.DONE)
    assert not [e for e in tiny.progress.events if e["kind"] != "held" and "l4-c" in str(e)], tiny.progress.events
    assert set(grower.plan.nodes()) == {"l4-b", "l4-c"} and "scale-up" in kinds(grower)
    assert_every_step_once(grower)
    run_until([tiny], lambda: tiny.state is State.DONE)
    assert_every_step_once(tiny)


def test_a_job_that_does_not_share_declines_a_request_by_the_share():
    """A request marked as the share's reaches a job with runtime.fleet_share: first-come (no card): it keeps its
    nodes and says why, whatever the asker's priority."""
    fleet, board = Fleet(*L4S), {}
    c = sharing_job(fleet, "plain", board, [], 8, card=False)
    run_until([c], lambda: c.progress.committed >= 1)
    MemoryQueue("sharer", [], 9, board, JobCard(9, MODEL, BIG)).ask("plain", ["l4-a"], share=True)
    run_until([c], lambda: c.state is State.DONE)
    (e,) = [e for e in c.progress.events if e["kind"] == "yield-declined"]
    assert "does not share the fleet by weight" in e["cause"] and "yield" not in kinds(c)
    assert_every_step_once(c)
