"""`fleet: {auto: ...}` in the job file: the planner's fleet, asked for, and chosen again.

With a fake autoscaler and clock (as tests/test_capacity.py): the job's fleet is the one `choose_fleet`
picks from its catalog; when a chosen type does not come within `substitute_after_s`, the demand becomes the
best fleet among what is left, which must equal `choose_fleet` on the catalog less that type (but for the
nodes of it that came). tests/test_fleet_autoscaler.py runs the same on Ray's real autoscaler.
"""

import json

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli.main import app
from orchestrator.control.capacity import Capacity
from orchestrator.control.controller import Controller, State
from orchestrator.control.fakes import FakeNodes
from orchestrator.control.fakes import FakeWorkerGroup as FakeGroup
from orchestrator.control.fleet_choice import Rechooser, left_after
from orchestrator.job_spec import fleet_types, load_job, parse_job
from planner import ClusterSpec, NodeSpec
from planner.fleet import Catalog, all_fleets, choose_fleet
from tests.test_capacity import AllOrNothingAutoscaler, FakeAutoscaler

pytestmark = pytest.mark.unit

CATALOG = {"types": [  # the A10G type is the cheapest per token; L4 comes in two sizes
    {"name": "a10g.x1", "gpu_type": "A10G", "num_gpus": 1, "price_per_hour": 0.1, "max_nodes": 2},
    {"name": "t4.x1", "gpu_type": "T4", "num_gpus": 1, "price_per_hour": 0.3, "max_nodes": 2},
    {"name": "l4.x1", "gpu_type": "L4", "num_gpus": 1, "price_per_hour": 0.5, "max_nodes": 2},
    {"name": "l4.x4", "gpu_type": "L4", "num_gpus": 4, "price_per_hour": 1.9, "max_nodes": 1}]}


def job(auto: dict | None = None, **fleet):
    return parse_job({"model": {"preset": "tiny"}, "train": {"global_batch": 8},
                      "fleet": {"auto": {"catalog": CATALOG} | (auto or {}), "wait_s": 60, "substitute_after_s": 20,
                                "poll_s": 1} | fleet})


def best_of(catalog: Catalog, j) -> dict[str, int]:
    """What the chosen fleet asks for, per GPU type: choose_fleet on `catalog` directly."""
    fleet = choose_fleet(catalog, j.model_spec, j.train, j.fleet.auto.objective, j.fleet.auto.budget_per_hour)
    return {t.gpu_type: t.max_nodes for t in fleet_types(catalog, fleet.best.fleet)}


def auto_capacity(a: FakeAutoscaler, j) -> Capacity:
    chooser = Rechooser(j)
    cap = a.capacity(chooser.first())
    cap.rechoose = chooser
    return cap


def test_a_job_files_catalog_path_is_read_relative_to_it_and_holds_one_instance_type_per_gpu_type(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "cat.yaml").write_text(yaml.safe_dump(CATALOG))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "model": {"preset": "tiny"}, "train": {"global_batch": 8},
        "fleet": {"auto": {"catalog": "sub/cat.yaml", "objective": "throughput", "budget_per_hour": 2}}}))
    j = load_job(tmp_path / "job.yaml")
    cat = j.fleet.auto.catalog
    assert [t.name for t in cat.types] == ["a10g.x1", "t4.x1", "l4.x1", "l4.x4"] and cat.one_per_gpu_type
    assert j.fleet.types == [] and j.fleet.auto.budget_per_hour == 2
    # Every fleet the search may choose holds one instance type per GPU type (the demand names GPU types).
    for f in all_fleets(cat):
        gpus = [cat.type(name).gpu_type for name, _ in f]
        assert len(gpus) == len(set(gpus)), f
    free = cat.model_copy(update={"one_per_gpu_type": False})
    assert len(all_fleets(free)) > len(all_fleets(cat))
    # It survives the trip to the driver (the job goes as JSON).
    assert type(j).model_validate_json(j.model_dump_json()).fleet.auto.catalog == cat


def test_the_demand_is_the_chosen_fleet_and_a_type_that_does_not_come_is_chosen_around():
    """The first demand is choose_fleet's fleet (each type's min = max = its count). A10G never comes (an
    all-or-nothing autoscaler with no A10G node): after substitute_after_s the fleet is chosen again, and the
    new demand equals choose_fleet on the catalog less A10G. The new fleet then comes up and is ready."""
    j = job()
    first = best_of(j.fleet.auto.catalog, j)
    assert "A10G" in first  # the premise: the cheap type is chosen
    a = AllOrNothingAutoscaler({"A10G": 0, "T4": 2, "L4": 2})
    cap = auto_capacity(a, j)
    v = cap.tick()
    assert a.requests == [first] and not v.ready
    assert all(t.min_nodes == t.max_nodes for t in cap.fleet.types)
    a.t = 19.0
    assert cap.tick().rechosen is None and len(a.requests) == 1  # not before the dry spell is over
    a.t = 20.0
    v = cap.tick()
    without = j.fleet.auto.catalog.model_copy(update={"types": [t for t in j.fleet.auto.catalog.types
                                                                if t.gpu_type != "A10G"]})
    assert v.rechosen == "A10G" and v.substituted == []
    assert a.requests[-1] == best_of(without, j) and "A10G" not in a.requests[-1], a.requests
    a.t = 21.0
    assert cap.tick().ready and a.up == a.requests[-1]
    assert len(cap.rechoose.history) == 2 and "a10g" not in cap.rechoose.history[1]


def test_the_nodes_of_a_short_type_that_came_stay_in_the_next_choice():
    """Two A10G nodes chosen (the most tokens/s within $0.6/h), one came: the fleet is chosen again with at
    most that one A10G node."""
    j = job(auto={"objective": "throughput", "budget_per_hour": 0.6})
    cat = j.fleet.auto.catalog
    assert best_of(cat, j).get("A10G") == 2  # the premise
    a = FakeAutoscaler()
    cap = auto_capacity(a, j)
    a.up = {"A10G": 1}
    cap.tick()
    a.t = 20.0
    v = cap.tick()
    left = left_after(cat, {"A10G": 1})
    assert [t.max_nodes for t in left.types if t.gpu_type == "A10G"] == [1]
    assert v.rechosen == "A10G" and a.requests[-1] == best_of(left, j)
    assert left_after(cat, {t.gpu_type: 0 for t in cat.types}) is None  # nothing left: no new choice


def test_nothing_left_that_fits_keeps_the_demand_and_the_wait_ends_with_exit_2():
    j = job(auto={"catalog": {"types": CATALOG["types"][:1]}})
    a = FakeAutoscaler()
    cap = auto_capacity(a, j)
    nodes = FakeNodes(ClusterSpec(nodes=[NodeSpec(name="x", gpu_type="A10G", num_gpus=1)]))
    c = Controller(j.model_spec, j.train, 3, nodes,
                   lambda p: FakeGroup(p, []), capacity=cap, sleep=lambda s: setattr(a, "t", a.t + s))
    while c.state == State.WAITING:
        c.step()
    assert c.state == State.FAILED and c.exit_code == 2 and "missing A10G" in c.error
    assert [e["kind"] for e in c.progress.events] == []


def test_the_controller_says_when_it_chose_again_and_trains_on_what_came():
    j = job()
    a = AllOrNothingAutoscaler({"A10G": 0, "T4": 2, "L4": 2})
    cap = auto_capacity(a, j)
    nodes = ClusterSpec(nodes=[NodeSpec(name="t", gpu_type="T4", num_gpus=1),
                               NodeSpec(name="l", gpu_type="L4", num_gpus=1)])
    c = Controller(j.model_spec, j.train, 3, FakeNodes(nodes), lambda p: FakeGroup(p, []), capacity=cap,
                   sleep=lambda s: setattr(a, "t", a.t + s))
    assert c.run() == State.DONE and sorted(c.progress.losses) == [0, 1, 2]
    ev = [e for e in c.progress.events if e["kind"] == "rechoose"]
    assert len(ev) == 1 and ev[0]["dry"] == "A10G" and "chose the fleet again among what is left" in ev[0]["cause"]
    assert ev[0]["fleet"] == a.requests[-1]


def test_plan_on_a_job_with_fleet_auto_shows_the_chosen_fleet(tmp_path):
    (tmp_path / "cat.yaml").write_text(yaml.safe_dump(CATALOG))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "model": {"preset": "tiny"}, "train": {"global_batch": 8}, "fleet": {"auto": {"catalog": "cat.yaml"}}}))
    res = CliRunner().invoke(app, ["plan", str(tmp_path / "job.yaml"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    j = load_job(tmp_path / "job.yaml")
    want = choose_fleet(j.fleet.auto.catalog, j.model_spec, j.train, "cost").best.fleet
    assert [(r["type"], r["nodes"]) for r in out["fleet"]["options"][0]["fleet"]] == list(want)
    assert out["fleet"]["options"][0]["label"] == "chosen"


@pytest.mark.parametrize("fleet, needle", [
    ({"auto": {"catalog": CATALOG}, "types": [{"gpu_type": "T4"}]}, "give fleet.types (the GPU types to ask for) or "
     "fleet.auto (choose them from a catalog), one of the two"),
    ({}, "one of the two"),
    ({"auto": {"catalog": "nope.yaml"}}, "field 'fleet.auto.catalog': the catalog file 'nope.yaml'"),
    ({"auto": {"catalog": {"types": [CATALOG["types"][0] | {"price_per_hour": -1}]}}},
     "fleet.auto.catalog.types.0.price_per_hour"),
    ({"auto": {"catalog": CATALOG, "budget_per_hour": 0.05}}, "budget_per_hour 0.05 is below the cheapest fleet"),
    ({"auto": {"catalog": CATALOG, "objective": "speed"}}, "fleet.auto.objective"),
])
def test_bad_auto_fleets_exit_2_naming_the_field(tmp_path, fleet, needle):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "train": {"global_batch": 8}, "fleet": fleet}))
    for cmd in (["plan", str(job_file)], ["submit", str(job_file), "--address", "http://127.0.0.1:1"]):
        res = CliRunner().invoke(app, cmd)
        text = " ".join(res.output.split())
        assert res.exit_code == 2 and needle in text and "Traceback" not in text, (cmd, text)


def test_submit_fails_early_when_the_model_fits_no_fleet_of_the_catalog(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump({"model": {"preset": "70b"}, "train": {"global_batch": 8},
                                        "fleet": {"auto": {"catalog": {"types": CATALOG["types"][:2]}}}}))
    res = CliRunner().invoke(app, ["submit", str(job_file), "--address", "http://127.0.0.1:1"])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "field 'fleet.auto'" in text and "fits no fleet" in text, text
