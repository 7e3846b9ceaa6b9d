"""The cluster's job queue, through the controller with fakes: a job that no plan fits on the GPUs free to it,
while other jobs hold the rest, waits in state `queued` (its place in line, what it waits for and who holds it in
its phase and events) instead of failing; it plans when it is first in line and something fits, never before a
job that queued earlier; past `runtime.queue_timeout_s` it fails with exit code 2 naming the field and the
holders; whatever ends it, it leaves the line. The queue on Ray's key-value store is tests/test_free_gpus.py's."""

import pytest

from orchestrator.control.controller import Controller, State
from orchestrator.control.fakes import FakeClock, FakeWorkerGroup, MemoryQueue
from orchestrator.control.policy import Policy
from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec

pytestmark = pytest.mark.unit
MODEL, TRAIN = ModelSpec.preset("tiny"), TrainSpec(global_batch=8)
NONE = ClusterSpec.model_construct(nodes=[], calibration={})
TWO_L4 = ClusterSpec(nodes=[NodeSpec(name="l4-a", gpu_type="L4", num_gpus=2)])
HELD = {"l4-a": {"hetspot-first-1a2b3c4d": 2}}


class SharedNodes:
    """The GPUs free to one job, and who holds the others, as another job (`holder`) takes and frees them."""

    def __init__(self):
        self.holder_running = True

    @property
    def held(self) -> dict:
        return HELD if self.holder_running else {}

    def discover(self) -> ClusterSpec:
        return NONE if self.holder_running else TWO_L4


def job(nodes, queue, clock, steps=3, timeout_s=3600.0, model=MODEL):
    log: list = []
    c = Controller(model, TRAIN, steps, nodes, lambda p: FakeWorkerGroup(p, log), clock=clock,
                   sleep=clock.advance, queue=queue, policy=Policy(queue_timeout_s=timeout_s))
    return c, log


def test_a_job_with_nothing_free_queues_then_trains_when_the_holder_ends():
    nodes, line, clock = SharedNodes(), [], FakeClock()
    c, log = job(nodes, MemoryQueue("second", line), clock)
    for _ in range(5):
        c.step()
    assert c.state == State.QUEUED and line == ["second"] and log == []  # no worker started while it waits
    assert c.progress.phase.startswith("queued (1 in line): waiting for a free GPU; held by l4-a: 2 GPUs "
                                       "(hetspot-first-1a2b3c4d)"), c.progress.phase
    queued = [e for e in c.progress.events if e["kind"] == "queued"]
    assert len(queued) == 1 and queued[0]["position"] == 1 and queued[0]["held"] == HELD, c.progress.events
    nodes.holder_running = False  # the first job ends
    assert c.run() == State.DONE and c.exit_code == 0
    assert line == [] and sorted(c.progress.losses) == [0, 1, 2]
    assert [e["kind"] for e in c.progress.events if e["kind"] in ("queued", "dequeued")] == ["queued", "dequeued"]
    assert {d for d in c.plan.devices()} == {"l4-a/0", "l4-a/1"}


def test_a_job_that_queued_later_waits_behind_the_first_even_with_gpus_free():
    nodes, line, clock = SharedNodes(), [], FakeClock()
    b, _ = job(nodes, MemoryQueue("b", line), clock)
    c, _ = job(nodes, MemoryQueue("c", line), clock)
    for _ in range(3):
        b.step(), c.step()
    assert line == ["b", "c"] and b.state == c.state == State.QUEUED
    assert c.progress.phase.startswith("queued (2 in line, after b)"), c.progress.phase
    nodes.holder_running = False  # GPUs free: only the first in line takes them
    for _ in range(3):
        c.step()
    assert c.state == State.QUEUED and line == ["b", "c"]
    b.step()  # b looks, finds them, and plans
    assert b.state == State.PLANNING
    b.step()
    assert line == ["b", "c"] and b.state == State.LAUNCHING  # its place kept until its workers hold the GPUs
    c.step()
    assert c.state == State.QUEUED
    b.step()
    assert line == ["c"] and b.state == State.TRAINING
    c.step()  # now first in line: it plans on what it finds free (here the fake gives it the same GPUs)
    assert c.state == State.PLANNING


def test_a_plan_that_needs_more_than_is_free_queues_while_others_hold_gpus():
    class Some(SharedNodes):
        def discover(self):
            return TWO_L4 if self.holder_running else ClusterSpec(nodes=[
                NodeSpec(name="l4-a", gpu_type="L4", num_gpus=2), NodeSpec(name="a100", gpu_type="A100-80GB",
                                                                          num_gpus=8)])

    big = ModelSpec.preset("13b")  # needs more than two L4s hold (7b fits them, offloaded)
    nodes, line, clock = Some(), [], FakeClock()
    c, _ = job(nodes, MemoryQueue("big", line), clock, model=big)
    for _ in range(6):
        c.step()
    assert c.state == State.QUEUED and line == ["big"], (c.state, c.error)
    assert "waiting for more GPUs than the 2 free" in c.progress.phase, c.progress.phase
    assert c.progress.history.count("planning->queued") == 1, c.progress.history  # no re-plan on the same GPUs
    nodes.holder_running = False
    c.step(), c.step(), c.step()
    assert c.state == State.TRAINING and line == [], (c.state, c.error)


def test_the_wait_is_bounded_by_queue_timeout_s_exit_2_naming_the_field_and_the_holders():
    nodes, line, clock = SharedNodes(), [], FakeClock()
    c, log = job(nodes, MemoryQueue("patient", line), clock, timeout_s=30.0)
    assert c.run() == State.FAILED and c.exit_code == 2
    assert "runtime.queue_timeout_s" in c.error and "hetspot-first-1a2b3c4d" in c.error, c.error
    assert 30 <= clock.t <= 30 + 2 * 2.0 and line == [] and log == []


def test_without_a_queue_a_job_with_nothing_free_fails_at_once():
    nodes, clock = SharedNodes(), FakeClock()
    c, _ = job(nodes, None, clock)
    assert c.run() == State.FAILED and c.exit_code == 1
    assert "no GPU of the cluster is free to this job: l4-a: 2 GPUs (hetspot-first-1a2b3c4d)" in c.error, c.error


def _one_l4_then_two():
    """A small model on the one L4 GPU free to it; later another job frees the node's second GPU. The fake
    clock's tick makes each step measure 1/1000 of its predicted speed, so a move onto both GPUs pays."""
    from planner import evaluate
    from planner.search import Planner
    from planner.specs import tokens_per_step

    model = ModelSpec(name="m", num_layers=4, hidden_size=32, num_heads=4, vocab_size=64, seq_len=16)
    one = ClusterSpec(nodes=[NodeSpec(name="l4-a", gpu_type="L4", num_gpus=1)])
    two = ClusterSpec(nodes=[NodeSpec(name="l4-a", gpu_type="L4", num_gpus=2)])
    predicted = evaluate(Planner(model, TRAIN).plan(one), one, model, TRAIN).tokens_per_s
    return model, one, two, tokens_per_step(model, TRAIN.global_batch) * 1000 / predicted


class Freed:
    """The GPUs free to the job: `first` until `freed_at` discoveries, then `then` (another job released some)."""

    def __init__(self, first, then, freed_at: int):
        self.first, self.then, self.freed_at, self.calls = first, then, freed_at, 0
        self.held: dict = {}

    def discover(self):
        self.calls += 1
        return self.first if self.calls < self.freed_at else self.then


def test_a_running_job_grows_into_gpus_another_job_frees_in_place():
    """The job trains on the one L4 GPU free to it; another job ends and frees the node's second GPU. At a scale
    check the job weighs the grown node as it weighs a joined one and moves onto both GPUs at a step boundary:
    no step lost or repeated, the event says which GPUs were freed."""
    from orchestrator.control.fakes import FakeWorkerGroup

    model, one, two, tick = _one_l4_then_two()
    log: list = []
    c = Controller(model, TRAIN, 100_000, Freed(one, two, 4), lambda p: FakeWorkerGroup(p, log, stages_switch=True),
                   clock=FakeClock(tick=tick), queue=MemoryQueue("me", []), policy=Policy(scale_check_every=1))
    while not any(e["kind"].startswith("scale-up") and "first_step_s" in e for e in c.progress.events):
        assert c.step() not in (State.DONE, State.FAILED), c.error
    (up,) = [e for e in c.progress.events if e["kind"].startswith("scale-up")]
    assert up["kind"] == "scale-up" and up["freed"] == {"l4-a": 1} and "GPUs freed (l4-a: +1)" in up["cause"], up
    assert sorted(c.plan.devices()) == ["l4-a/0", "l4-a/1"] and c.progress.restarts == 0
    assert sorted(c.progress.losses) == list(range(c.progress.committed + 1))  # every step once


def test_freed_gpus_go_to_the_jobs_waiting_in_the_queue_first():
    """The same freed GPU while another job waits in the cluster's queue: the running job does not weigh it (the
    waiting job, polling, takes it), and trains on where it is."""
    from orchestrator.control.fakes import FakeWorkerGroup

    model, one, two, tick = _one_l4_then_two()
    log: list = []
    c = Controller(model, TRAIN, 12, Freed(one, two, 4), lambda p: FakeWorkerGroup(p, log, stages_switch=True),
                   clock=FakeClock(tick=tick), queue=MemoryQueue("me", ["waiting"]), policy=Policy(scale_check_every=1))
    assert c.run() == State.DONE, c.error
    assert not [e for e in c.progress.events if e["kind"].startswith("scale-up")], c.progress.events
    assert c.plan.devices() == ["l4-a/0"]


@pytest.mark.parametrize("waiting", [[], ["waiting"]])
def test_a_node_another_job_leaves_is_warmed_only_when_no_job_waits_for_it(waiting):
    """Another job ends on a node of which the running job had no GPU free: to the running job that node reads as
    joined. With no job waiting it gets warm workers at once (as a joined node does); while a job waits in the
    queue it is left alone (no warm workers, no move), or the waiting job would plan on GPUs the warm workers take
    a moment later and wait for a placement that cannot come."""
    from orchestrator.control.fakes import FakeWorkerGroup

    model, one, _, tick = _one_l4_then_two()
    left = one.model_copy(update={"nodes": [*one.nodes, NodeSpec(name="a100-a", gpu_type="A100", num_gpus=2)]})
    log: list = []
    c = Controller(model, TRAIN, 12, Freed(one, left, 4), lambda p: FakeWorkerGroup(p, log, stages_switch=True),
                   clock=FakeClock(tick=tick), queue=MemoryQueue("me", waiting), policy=Policy(scale_check_every=1))
    assert c.run() == State.DONE, c.error
    warmed = [e for e in log if e[0] == "warm-joined"]
    if waiting:
        assert not warmed and not [e for e in c.progress.events if e["kind"].startswith(("scale-up", "warm"))]
        assert c.plan.devices() == ["l4-a/0"]
    else:
        assert warmed == [("warm-joined", ["a100-a"])], log
