"""Priorities between the jobs of one cluster, through two controllers with fakes sharing one fleet: a waiting job
of higher priority asks a running one of lower priority for GPUs; that job gives them back at a step boundary
through the drain path and trains on the rest, or, where the rest trains no plan, is suspended (its committed
step kept), waits in the queue and resumes from that step once the GPUs come back. The property: every step of
both jobs runs exactly once, in order, from the state the step before it left (the fake worker group's loss is
a pure function of the steps applied, and it asserts each step follows the last one applied)."""

import pytest

from orchestrator.control.controller import Controller, State
from orchestrator.control.fakes import FakeClock, FakeWorkerGroup, MemoryQueue
from orchestrator.control.policy import Policy
from orchestrator.errors import WorkerFailure
from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec

pytestmark = pytest.mark.unit
MODEL = ModelSpec(name="m", num_layers=4, hidden_size=32, num_heads=4, vocab_size=64, seq_len=16)
TRAIN = TrainSpec(global_batch=8)


class Fleet:
    """The cluster's GPUs, each free or held by one job (its workers' placement)."""

    def __init__(self, *nodes: NodeSpec):
        self.nodes = {n.name: n for n in nodes}
        self.owner: dict[tuple[str, int], str] = {}

    def take(self, job: str, devices: list[str]) -> None:
        for d in devices:
            node, idx = d.rsplit("/", 1)
            held = self.owner.get((node, int(idx)))
            if held not in (None, job):
                raise WorkerFailure(f"rank on {d}", f"GPU held by {held}", "timeout")
        for d in devices:
            node, idx = d.rsplit("/", 1)
            self.owner[(node, int(idx))] = job

    def give_back(self, job: str, keep: frozenset = frozenset()) -> None:
        self.owner = {k: v for k, v in self.owner.items() if v != job or f"{k[0]}/{k[1]}" in keep}


class JobNodes:
    """One job's view of the fleet: the GPUs free to it (free, or its own), and who holds the others."""

    def __init__(self, fleet: Fleet, job: str):
        self.fleet, self.job, self.held = fleet, job, {}

    def discover(self) -> ClusterSpec:
        free, self.held = [], {}
        for name, n in self.fleet.nodes.items():
            others: dict[str, int] = {}
            for (node, _), who in self.fleet.owner.items():
                if node == name and who != self.job:
                    others[who] = others.get(who, 0) + 1
            if others:
                self.held[name] = others
            if n.num_gpus - sum(others.values()) > 0:
                free.append(n.model_copy(update={"num_gpus": n.num_gpus - sum(others.values())}))
        return ClusterSpec.model_construct(nodes=free, calibration={})

    def whole(self) -> ClusterSpec:
        return ClusterSpec(nodes=list(self.fleet.nodes.values()))


class Placed(FakeWorkerGroup):
    """A fake worker group whose workers hold their plan's GPUs in the fleet. As on Ray in place, a released
    group's processes stay (holding their GPUs) until the next group starts: then those it does not use go."""

    def __init__(self, fleet: Fleet, job: str, plan, log: list):
        super().__init__(plan, log, stages_switch=True)
        self.fleet, self.job = fleet, job

    def start(self) -> None:
        self.fleet.take(self.job, self.plan.devices())
        self.fleet.give_back(self.job, keep=frozenset(self.plan.devices()))
        super().start()

    def release(self) -> None:  # the processes stay for the next group
        self.log.append(("release",))

    def shutdown(self) -> None:
        self.fleet.give_back(self.job)
        super().shutdown()


def job(fleet: Fleet, name: str, priority: int, board: dict, line: list, steps: int):
    log: list = []
    clock = FakeClock()
    c = Controller(MODEL, TRAIN, steps, JobNodes(fleet, name), lambda p: Placed(fleet, name, p, log), clock=clock,
                   sleep=clock.advance, queue=MemoryQueue(name, line, priority, board))
    return c, log


def run_until(jobs, done, limit=2000):
    for _ in range(limit):
        if done():
            return
        for c in jobs:
            if c.state not in (State.DONE, State.FAILED):
                c.step()
    raise AssertionError([(c.state, c.progress.phase, c.error) for c in jobs])


def pair(first: tuple, second: tuple, head_start: int, *nodes: NodeSpec):
    """Two jobs, each (name, priority, steps), on one fleet (one 2-GPU L4 node unless `nodes`): the first trains
    `head_start` steps alone, then both step in turn until the second is done. Each job with its log."""
    fleet = Fleet(*(nodes or (NodeSpec(name="l4-a", gpu_type="L4", num_gpus=2),)))
    board: dict = {}
    line: list = []
    a = job(fleet, *first[:2], board, line, steps=first[2])
    run_until([a[0]], lambda: a[0].progress.committed >= head_start)
    b = job(fleet, *second[:2], board, line, steps=second[2])
    run_until([a[0], b[0]], lambda: b[0].state is State.DONE)
    return a, b


def assert_every_step_once(c: Controller) -> None:
    assert c.state is State.DONE, c.error
    assert c.progress.losses == {s: 10.0 - s for s in range(c.steps)}, c.progress.losses
    assert c.progress.restarts == 0, c.progress.events  # no placement failed: nobody planned on another's GPUs


def kinds(c: Controller) -> list[str]:
    return [e["kind"] for e in c.progress.events]


def test_a_higher_priority_job_takes_a_node_from_a_lower_one_which_trains_on_in_place():
    """Low trains on two nodes; high, submitted later, finds nothing free and asks low for one node; low gives it
    back at a step boundary through a drain and trains on the other; high trains on the node given. Neither job
    loses or repeats a step."""
    (low, _), (high, _) = pair(("low", 0, 40), ("high", 5, 6), 3, NodeSpec(name="l4-a", gpu_type="L4", num_gpus=2),
                               NodeSpec(name="l4-b", gpu_type="L4", num_gpus=2))
    assert "queued" not in kinds(low)
    asked = [e for e in high.progress.events if e["kind"] == "asked"]
    assert asked and asked[0]["asked"] == {"low": ["l4-a"]}, high.progress.events
    assert "queued" in kinds(high) and "dequeued" in kinds(high)
    assert set(high.plan.nodes()) == {"l4-a"}
    (y,) = [e for e in low.progress.events if e["kind"] == "yield"]
    assert y["by"] == "high" and y["nodes"] == ["l4-a"]
    (d,) = [e for e in low.progress.events if e["kind"] == "drain"]
    assert "yield to high" in d["cause"] and d["first_step_s"] is not None, d
    assert set(low.plan.nodes()) == {"l4-b"} and low.progress.restarts == 0  # (and l4-a before: its yield)
    run_until([low], lambda: low.state is State.DONE)
    assert_every_step_once(low)
    assert_every_step_once(high)
    assert "l4-a" not in low.doomed  # given back, not lost: it may come back to low once high ended


def test_a_job_asked_for_all_it_needs_is_suspended_and_resumes_from_its_step():
    """Low trains on the one node; high asks for it. What low would keep trains no plan, so low keeps its
    committed step, gives every GPU back and waits in the queue; high trains and ends; low resumes from the step
    it kept, every step once."""
    (low, low_log), (high, _) = pair(("low", 0, 12), ("high", 5, 5), head_start=4)
    (s,) = [e for e in low.progress.events if e["kind"] == "suspend"]
    assert s["by"] == "high" and s["kept"] == "memory" and s["step"] >= 4, s
    assert low.state is State.QUEUED or low.progress.committed > s["step"]
    run_until([low], lambda: low.state is State.DONE)
    assert_every_step_once(low)
    assert_every_step_once(high)
    assert ("import", s["step"] + 1) in low_log  # resumed from the state the kept step left
    assert kinds(low).count("queued") == 1 and kinds(low).count("dequeued") == 1


def test_equal_priorities_never_take_gpus_from_each_other():
    """Two jobs of one priority: the second waits in the queue until the first ends, asking nothing."""
    (first, _), (second, _) = pair(("first", 3, 8), ("second", 3, 4), head_start=1)
    assert "asked" not in kinds(second) and not {"yield", "suspend"} & set(kinds(first))
    assert_every_step_once(first)
    assert_every_step_once(second)
    assert second.progress.events[[e["kind"] for e in second.progress.events].index("dequeued")]["t_s"] >= 0


def test_a_request_from_a_job_of_no_higher_priority_is_declined():
    fleet = Fleet(NodeSpec(name="l4-a", gpu_type="L4", num_gpus=2))
    board: dict = {}
    c, _ = job(fleet, "mid", 2, board, [], steps=6)
    run_until([c], lambda: c.progress.committed >= 1)
    MemoryQueue("pushy", [], 2, board).ask("mid", ["l4-a"])
    run_until([c], lambda: c.state is State.DONE)
    (e,) = [e for e in c.progress.events if e["kind"] == "yield-declined"]
    assert "not above" in e["cause"] and "suspend" not in kinds(c)
    assert_every_step_once(c)


def test_gpus_a_lower_job_holds_only_with_warm_workers_are_given_back_by_ending_them():
    """Low trains on l4-z and holds l4-a's GPUs with warm workers only (a join's, or standing ones). High asks for
    l4-a (it holds no plan's rank): low ends those warm workers at its next step boundary, with no drain and no
    re-plan, and high trains there. Before, low declined ("none of them are the plan's") and high waited."""
    fleet = Fleet(NodeSpec(name="l4-a", gpu_type="L4", num_gpus=2), NodeSpec(name="l4-z", gpu_type="L4", num_gpus=2))
    board: dict = {}
    line: list = []
    groups: list[Placed] = []

    class Warm(Placed):  # workers on its plan's GPUs, and warm ones on l4-a once it trains
        def give_up(self, nodes) -> int:
            mine = [k for k, who in self.fleet.owner.items() if who == self.job and k[0] in nodes
                    and f"{k[0]}/{k[1]}" not in self.plan.devices()]
            for k in mine:
                del self.fleet.owner[k]
            super().give_up(nodes)
            return len(mine)

    log: list = []
    clock = FakeClock()

    def make(plan):
        groups.append(Warm(fleet, "low", plan, log))
        return groups[-1]

    low = Controller(MODEL, TRAIN, 30, JobNodes(fleet, "low"), make, clock=clock, sleep=clock.advance,
                     queue=MemoryQueue("low", line, 0, board))
    fleet.take("other", ["l4-a/0", "l4-a/1"])  # l4-a is another job's while low plans: low trains on l4-z
    run_until([low], lambda: low.progress.committed >= 1)
    assert set(low.plan.nodes()) == {"l4-z"}
    fleet.give_back("other")
    fleet.take("low", ["l4-a/0", "l4-a/1"])  # low's warm workers take l4-a's GPUs
    high, _ = job(fleet, "high", 5, board, line, steps=4)
    run_until([low, high], lambda: high.state is State.DONE)
    assert high.plan.nodes() == ["l4-a"]
    (w,) = [e for e in low.progress.events if e["kind"] == "yield-warm"]
    assert w["by"] == "high" and w["nodes"] == ["l4-a"] and w["warm"] == 2, w
    assert not {"yield", "yield-declined", "drain", "suspend"} & set(kinds(low)), low.progress.events
    assert ("give-up", ["l4-a"]) in log
    run_until([low], lambda: low.state is State.DONE)
    assert_every_step_once(low)
    assert_every_step_once(high)


def test_a_suspended_job_waits_past_its_queue_timeout_and_resumes():
    """`runtime.queue_timeout_s` bounds a job's wait for GPUs it was never given; a suspended job was pushed out
    (its step kept), so it waits for the asker however long that trains, then resumes from its step. Low's bound
    is 5 s; high trains 40 steps while low polls the queue every 2 s of its clock."""
    fleet = Fleet(NodeSpec(name="l4-a", gpu_type="L4", num_gpus=2))
    board: dict = {}
    line: list = []
    log: list = []
    clock = FakeClock()
    low = Controller(MODEL, TRAIN, 12, JobNodes(fleet, "low"), lambda p: Placed(fleet, "low", p, log), clock=clock,
                     sleep=clock.advance, queue=MemoryQueue("low", line, 0, board), policy=Policy(queue_timeout_s=5.0))
    run_until([low], lambda: low.progress.committed >= 3)
    high, _ = job(fleet, "high", 5, board, line, steps=40)
    run_until([low, high], lambda: high.state is State.DONE)
    (s,) = [e for e in low.progress.events if e["kind"] == "suspend"]
    assert clock.t - next(e["t_s"] for e in low.progress.events if e["kind"] == "queued") > 5.0  # past its bound
    assert low.state is not State.FAILED, low.error
    run_until([low], lambda: low.state is State.DONE)
    assert_every_step_once(low)
    assert_every_step_once(high)
    assert ("import", s["step"] + 1) in log
