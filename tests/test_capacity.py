"""The fleet's capacity decisions (orchestrator/cluster/capacity.py) and the controller's WAITING state, with a
fake autoscaler and clock: demand per type, the progress line, substitutes after a dry spell, the minimum,
the timeout (exit code 2, not before `wait_s`), and the withdrawal at the end."""

import pytest

from orchestrator.control.capacity import Capacity, fleet_demand, missing_minimums
from orchestrator.control.controller import Controller, State
from orchestrator.control.fakes import FakeNodes
from orchestrator.control.fakes import FakeWorkerGroup as FakeGroup
from orchestrator.job_spec import parse_job
from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec

pytestmark = pytest.mark.unit


def fleet(**kw):
    types = kw.pop("types", [{"gpu_type": "A100-80GB", "min_nodes": 1, "max_nodes": 2, "substitutes": ["L4"]},
                             {"gpu_type": "L4", "min_nodes": 0, "max_nodes": 2}])
    return parse_job({"model": {"preset": "tiny"}, "train": {"global_batch": 8},
                      "fleet": {"types": types, "wait_s": 60, "substitute_after_s": 20, "poll_s": 1} | kw}).fleet


class FakeAutoscaler:
    """Nodes come up as a test says; every request and withdrawal is recorded."""

    def __init__(self):
        self.up: dict[str, int] = {}
        self.requests: list[dict[str, int]] = []
        self.withdrawn = 0
        self.t = 0.0

    def capacity(self, f) -> Capacity:
        return Capacity(f, lambda: dict(self.up), self.requests.append, lambda: self.t, self.withdraw)

    def withdraw(self):
        self.withdrawn += 1


def test_demand_readiness_and_the_progress_line():
    a = FakeAutoscaler()
    cap = a.capacity(fleet())
    v = cap.tick()
    assert a.requests == [{"A100-80GB": 2, "L4": 2}] and not v.ready
    assert v.line == "0/2 A100-80GB nodes, 0/2 L4 nodes" and v.missing == {"A100-80GB": 1}
    a.up = {"L4": 2}
    assert not cap.tick().ready and len(a.requests) == 1  # the same demand is not asked again
    a.up = {"L4": 2, "A100-80GB": 1}
    v = cap.tick()
    assert v.ready and v.line == "1/2 A100-80GB nodes, 2/2 L4 nodes"


def test_a_dry_type_is_asked_for_as_its_substitute_after_the_timeout_and_not_before():
    a = FakeAutoscaler()
    cap = a.capacity(fleet(types=[{"gpu_type": "A100-80GB", "min_nodes": 1, "max_nodes": 2, "substitutes": ["L4"]},
                                  {"gpu_type": "L4", "min_nodes": 2, "max_nodes": 2}]))
    a.up = {"L4": 2}
    cap.tick()
    a.t = 19.0
    assert cap.tick().substituted == [] and a.requests[-1] == {"A100-80GB": 2, "L4": 2}
    a.t = 20.0
    v = cap.tick()
    # The dry type is asked for no more than came up (none): a request naming nodes that cannot come would
    # hold back everything else on Ray's autoscaler v2.
    assert v.substituted == [("A100-80GB", "L4", 2)] and a.requests[-1] == {"A100-80GB": 0, "L4": 4}
    assert v.missing == {"A100-80GB": 1} and not v.ready  # L4s beyond their own minimum of 2 ... (none yet)
    a.up = {"L4": 3}
    v = cap.tick()
    assert v.ready and v.missing == {} and v.substituted == []  # ... now stand in for the A100's minimum


def test_minimums_count_a_stand_ins_surplus_once():
    f = fleet(types=[{"gpu_type": "A100-80GB", "min_nodes": 2, "max_nodes": 2, "substitutes": ["L4"]},
                     {"gpu_type": "L4", "min_nodes": 1, "max_nodes": 1}])
    assert missing_minimums(f, {"L4": 2}, {"A100-80GB": "L4"}) == {"A100-80GB": 1}
    assert missing_minimums(f, {"L4": 3}, {"A100-80GB": "L4"}) == {}
    assert missing_minimums(f, {"L4": 3}, {}) == {"A100-80GB": 2}
    assert fleet_demand(f, {"A100-80GB": 1}, {"A100-80GB": "L4"}) == {"A100-80GB": 2, "L4": 2}
    assert fleet_demand(f, {"A100-80GB": 1}, {"A100-80GB": "L4"}, {"A100-80GB": 1}) == {"A100-80GB": 1, "L4": 2}


def test_a_dry_type_without_substitutes_keeps_asking_for_the_nodes_that_came_and_no_more():
    """A type capped below its max_nodes: after substitute_after_s its demand falls to the most nodes of it
    ever up, so a preempted node of it is still replaced."""
    a = FakeAutoscaler()
    cap = a.capacity(fleet(types=[{"gpu_type": "A100-80GB", "min_nodes": 1, "max_nodes": 3},
                                  {"gpu_type": "L4", "min_nodes": 0, "max_nodes": 2}]))
    a.up = {"A100-80GB": 2, "L4": 2}
    cap.tick()
    a.t = 20.0
    assert cap.tick().ready and a.requests[-1] == {"A100-80GB": 2, "L4": 2}
    a.up = {"A100-80GB": 1, "L4": 2}  # one is preempted: the 2 that came are still asked for
    assert cap.tick().ready and a.requests[-1] == {"A100-80GB": 2, "L4": 2} and cap.dry == {"A100-80GB"}


class AllOrNothingAutoscaler(FakeAutoscaler):
    """Ray's autoscaler v2 on a request: it launches for it only when every bundle can be placed (each type
    has a cap, its node type's max_workers)."""

    def __init__(self, caps: dict[str, int]):
        super().__init__()
        self.caps = caps

    def capacity(self, f) -> Capacity:
        def count_up():
            if self.requests and all(n <= self.caps.get(t, 0) for t, n in self.requests[-1].items()):
                self.up = dict(self.requests[-1])
            return dict(self.up)

        return Capacity(f, count_up, self.requests.append, lambda: self.t, self.withdraw)


@pytest.mark.parametrize("capped_first", [True, False])
def test_a_type_that_can_never_come_stops_holding_back_the_others_on_an_all_or_nothing_autoscaler(capped_first):
    """A10G nodes can never come (max_workers 0): while the request names one, nothing comes up. Types go
    dry one at a time; whichever the order, the T4s come up and A10G is no longer asked for."""
    types = [{"gpu_type": "A10G", "min_nodes": 0, "max_nodes": 1}, {"gpu_type": "T4", "min_nodes": 1, "max_nodes": 2}]
    a = AllOrNothingAutoscaler({"A10G": 0, "T4": 2})
    cap = a.capacity(fleet(types=types if capped_first else types[::-1]))
    while not cap.tick().ready:
        assert a.t <= 100, (a.t, a.requests)
        a.t += 1.0
    assert a.up == {"A10G": 0, "T4": 2} and a.requests[-1] == {"A10G": 0, "T4": 2}
    # one dry spell (20 s) and a poll, or two when T4 went dry first
    assert a.t == (21.0 if capped_first else 41.0), a.requests


MODEL, TRAIN = ModelSpec.preset("tiny"), TrainSpec(global_batch=8)
L4S = ClusterSpec(nodes=[NodeSpec(name="l", gpu_type="L4", num_gpus=2)])


def controller(a: FakeAutoscaler, f, steps: int = 3):
    log: list = []
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        a.t += s

    c = Controller(MODEL, TRAIN, steps, FakeNodes(L4S), lambda p: FakeGroup(p, log), capacity=a.capacity(f),
                   sleep=sleep)
    return c, sleeps


def test_the_controller_waits_for_the_minimum_then_trains_and_withdraws_the_demand():
    a = FakeAutoscaler()
    f = fleet(types=[{"gpu_type": "L4", "min_nodes": 1, "max_nodes": 2}])
    c, sleeps = controller(a, f)
    assert c.state == State.WAITING
    assert c.step() == State.WAITING and c.progress.phase == "waiting for capacity: 0/2 L4 nodes"
    a.up = {"L4": 1}
    assert c.step() == State.DISCOVERING
    assert c.run() == State.DONE and sorted(c.progress.losses) == [0, 1, 2]
    assert a.withdrawn == 1 and sleeps == [1.0]


def test_a_minimum_that_never_comes_fails_with_exit_2_naming_the_types_after_wait_s_and_not_before():
    a = FakeAutoscaler()
    c, sleeps = controller(a, fleet())  # both pools stay dry: the L4s asked for instead never come either
    while c.state == State.WAITING:
        c.step()
    assert c.state == State.FAILED and c.exit_code == 2
    assert a.t == 60.0 and sum(sleeps) == 60.0  # failed at wait_s, not before
    assert "fleet: the minimum did not come up in 60 s: missing A100-80GB (0 up, min_nodes 1)" in c.error
    assert a.withdrawn == 1
    assert [e["kind"] for e in c.progress.events] == ["substitute"]  # it tried the L4s at 20 s
    assert c.progress.events[0]["dry"] == "A100-80GB" and c.progress.events[0]["substitute"] == "L4"


@pytest.mark.parametrize("types, needle", [
    ([{"gpu_type": "B300", "max_nodes": 1}], "field 'fleet.types.0.gpu_type': unknown GPU type 'B300'"),
    ([{"gpu_type": "T4", "min_nodes": 3, "max_nodes": 2}], "min_nodes 3 is above max_nodes 2; raise max_nodes"),
    ([{"gpu_type": "T4", "substitutes": ["L4"]}, {"gpu_type": "L4", "substitutes": ["A10G"]},
      {"gpu_type": "A10G", "substitutes": ["T4"]}], "substitutes form a cycle"),
    ([{"gpu_type": "T4", "substitutes": ["L4"]}], "['L4'] are not fleet types; add them to fleet.types"),
    ([{"gpu_type": "T4"}, {"gpu_type": "t4"}], "lists a GPU type twice"),
])
def test_bad_fleets_exit_2_naming_the_field_and_the_fix(tmp_path, types, needle):
    import yaml
    from typer.testing import CliRunner

    from orchestrator.cli.main import app

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "train": {"global_batch": 8},
                                   "cluster": {"nodes": [{"name": "a", "gpu_type": "T4", "num_gpus": 1}]},
                                   "fleet": {"types": types}}))
    res = CliRunner().invoke(app, ["submit", str(job)])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert needle in text and "Traceback" not in text, text
