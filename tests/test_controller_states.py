"""The controller's typed states (control/states.py): each carries its own data, and the data goes with it. A
failure exists only while RECOVERING (in `Recovering`), a notice's pre-staged switch only while TRAINING or
DRAINING (in `Training`, then `Draining`), and a queued job's wait in `Queued`."""

import pytest

from orchestrator.control.controller import Controller, State
from orchestrator.control.fakes import FakeClock, FakeInterruptions, FakeNodes, FakeWorkerGroup, MemoryQueue
from orchestrator.control.policy import Policy
from orchestrator.control.protocols import Notice
from orchestrator.control.states import Draining, Queued, Recovering, Training, expect
from orchestrator.errors import WorkerFailure
from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec

pytestmark = pytest.mark.unit
MODEL, TRAIN = ModelSpec.preset("tiny"), TrainSpec(global_batch=8)
BIG = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100-80GB", num_gpus=2),
                         NodeSpec(name="l", gpu_type="L4", num_gpus=2)])


def until(c: Controller, kind: State) -> None:
    while c.state is not kind:
        assert c.step() not in (State.DONE, State.FAILED), c.error


def test_a_failure_is_carried_by_the_recovering_state_and_gone_once_recovered():
    log: list = []
    groups = iter([[2], None])
    c = Controller(MODEL, TRAIN, 4, FakeNodes(BIG, BIG), lambda p: FakeWorkerGroup(p, log, next(groups)))
    until(c, State.RECOVERING)
    rec = expect(c._state, Recovering)
    assert isinstance(rec.failure, WorkerFailure) and rec.failure.kind == "node lost" and rec.detected_s >= 0
    assert c.step() is State.DISCOVERING and not any(isinstance(v, WorkerFailure) for v in vars(c).values())
    assert c.run() is State.DONE and c.progress.restarts == 1


def test_a_staged_switch_lives_in_training_moves_into_draining_and_a_failure_drops_it():
    notice = Notice(node="a", deadline_s=120.0, source="aws")
    log: list = []
    made: list = []

    def group(plan):
        made.append(FakeWorkerGroup(plan, log, [3] if not made else None, stages_switch=True, ready_after=99))
        return made[-1]

    c = Controller(MODEL, TRAIN, 8, FakeNodes(BIG, BIG, BIG), group, policy=Policy(snapshot_every=100),
                   interruptions=FakeInterruptions({2: [notice]}), clock=FakeClock(tick=0.5))
    while not (isinstance(c._state, Training) and c._state.staged is not None):
        assert c.step() not in (State.DONE, State.FAILED, State.RECOVERING, State.DRAINING), c.error
    staged = c._state.staged
    assert "a" not in staged.plan.nodes()  # the next plan, chosen without the doomed node, its workers warming
    assert c.step() is State.RECOVERING  # step 3 fails before the staged switch is ready
    assert c._staged is None and isinstance(c._state, Recovering)  # the staged switch went with TRAINING
    assert c.run() is State.DONE and c.progress.losses == {s: 10.0 - s for s in range(8)}


def test_a_ready_staged_switch_is_carried_into_draining_and_launched_without_planning():
    notice = Notice(node="a", deadline_s=120.0, source="aws")
    log: list = []
    c = Controller(MODEL, TRAIN, 6, FakeNodes(BIG), lambda p: FakeWorkerGroup(p, log, stages_switch=True,
                                                                              ready_after=1),
                   policy=Policy(snapshot_every=100), interruptions=FakeInterruptions({2: [notice]}),
                   clock=FakeClock(tick=0.5))
    until(c, State.DRAINING)
    drain = expect(c._state, Draining)
    assert drain.staged is not None and drain.timeline.staged_s is not None and drain.timeline.switch_s is None
    assert c.step() is State.LAUNCHING and c.plan == drain.staged.plan
    assert c.run() is State.DONE


def test_a_queued_job_carries_what_it_waits_for_and_a_wrong_state_read_is_named():
    class Nothing(FakeNodes):  # every GPU is another job's
        def discover(self) -> ClusterSpec:
            self.held = {"a": {"other-job": 2}}
            return ClusterSpec.model_construct(nodes=[], calibration={})

    clock = FakeClock()
    c = Controller(MODEL, TRAIN, 2, Nothing(BIG), lambda p: FakeWorkerGroup(p, []), clock=clock,
                   sleep=clock.advance, queue=MemoryQueue("me", []), policy=Policy(queue_timeout_s=10.0))
    assert c.step() is State.QUEUED
    q = expect(c._state, Queued)
    assert q.wants == "a free GPU" and q.on == ()
    with pytest.raises(RuntimeError, match="expected state training, in queued"):
        expect(c._state, Training)
    while c.step() is State.QUEUED:
        pass
    assert c.state is State.FAILED and c.exit_code == 2 and "waiting for a free GPU" in c.error
