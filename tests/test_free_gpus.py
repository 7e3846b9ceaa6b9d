"""Several jobs on one cluster: a job plans on the GPUs free to it, never on GPUs another job holds.

Pure: the placement group table and Ray's available resources read into (free GPUs per node, who holds the rest).
On a local Ray cluster: another hetspot job's placement groups and a plain actor's GPU are left out of what
`LiveNodes` discovers, the job's own placement groups are not, and the controller names the holders in an
event, or fails at once, naming them, where nothing is free (it used to plan on the other job's GPUs and wait
out five placement timeouts, about 16 minutes)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from orchestrator.cluster.holders import OTHER, free_for_job, job_of, pg_name


@dataclass(frozen=True)
class Node:
    name: str
    node_id: str
    num_gpus: int


def _pg(name: str, node: str, gpus: int, state: str = "CREATED") -> dict:
    return {"name": name, "state": state, "bundles": {i: {"GPU": 1.0} for i in range(gpus)},
            "bundles_to_node_id": {i: node for i in range(gpus)}}


@pytest.mark.unit
def test_a_gpu_is_free_to_a_job_when_nobody_else_holds_it():
    assert job_of(pg_name("hetspot-b-1234")) == "hetspot-b-1234" and job_of("someone-else") is None
    nodes = [Node("a", "ida", 4), Node("b", "idb", 2), Node("c", "idc", 2), Node("d", "idd", 1)]
    table = {"1": _pg("hetspot:job-b:x1", "ida", 2), "2": _pg("hetspot:me:x2", "ida", 1),
             "3": _pg("hetspot:job-b:x3", "idc", 2), "4": _pg("hetspot:job-c:x4", "idd", 1, state="REMOVED"),
             "5": _pg("not-hetspot", "idb", 1)}
    # Ray's view: on a, 1 GPU neither reserved nor used; b: one in an unnamed group, 1 free; c: none; d: 1
    available = {"ida": {"GPU": 1.0}, "idb": {"GPU": 1.0}, "idc": {}, "idd": {"GPU": 1.0}}
    free, held = free_for_job(nodes, "me", table, available)
    assert {n.name: n.num_gpus for n in free} == {"a": 2, "b": 1, "d": 1}  # a: its own 1 + the free 1; c: none left
    assert held == {"a": {"job-b": 2}, "b": {OTHER: 1}, "c": {"job-b": 2}}
    # without Ray's available view, only other hetspot jobs' groups are subtracted
    free, held = free_for_job(nodes, "me", table, None)
    assert {n.name: n.num_gpus for n in free} == {"a": 2, "b": 2, "d": 1} and held == {"a": {"job-b": 2},
                                                                                      "c": {"job-b": 2}}


@pytest.mark.unit
def test_the_controller_names_the_holders_and_fails_at_once_when_nothing_is_free():
    from orchestrator.control.controller import Controller, State
    from orchestrator.control.fakes import FakeNodes, FakeWorkerGroup
    from planner import ClusterSpec, ModelSpec, TrainSpec

    nodes = FakeNodes(ClusterSpec.model_construct(nodes=[], calibration={}))
    nodes.held = {"l4-a": {"hetspot-first-1a2b3c4d": 2}}
    log: list = []
    c = Controller(ModelSpec.preset("tiny"), TrainSpec(global_batch=4), 3, nodes, lambda p: FakeWorkerGroup(p, log))
    assert c.run() == State.FAILED
    assert "no GPU of the cluster is free to this job: l4-a: 2 GPUs (hetspot-first-1a2b3c4d)" in c.error, c.error
    held = [e for e in c.progress.events if e["kind"] == "held"]
    assert held and held[0]["held"] == {"l4-a": {"hetspot-first-1a2b3c4d": 2}}, c.progress.events
    assert log == []  # no worker was started


@pytest.fixture(scope="module")
def local_ray():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, num_gpus=4, resources={"accelerator_type:L4": 1}, include_dashboard=False,
             logging_level="ERROR")
    yield ray
    ray.shutdown()


def settled(nodes, gpus: int, timeout_s: float = 30.0):
    """`nodes.discover()` once Ray's view of available resources has caught up (the raylets report them to the
    GCS every few hundred milliseconds, later on a loaded machine) with `gpus` free, else the last view."""
    deadline = time.monotonic() + timeout_s
    while (cluster := nodes.discover()).num_gpus != gpus and time.monotonic() < deadline:
        time.sleep(0.2)
    return cluster


@pytest.mark.ray
def test_live_discovery_leaves_out_another_jobs_gpus_and_keeps_its_own(local_ray):
    from ray.util.placement_group import placement_group, remove_placement_group

    from orchestrator.cluster.node_sources import LiveNodes
    from orchestrator.runtime.plan_run import gpu_placement

    ray = local_ray
    nodes = LiveNodes(profile=False, job="me")
    assert nodes.discover().num_gpus == 4 and nodes.held == {}
    other = placement_group([{"GPU": 1}, {"GPU": 1}], name=pg_name("hetspot-first-1a2b3c4d"))
    ray.get(other.ready(), timeout=30)
    own = gpu_placement(ray.get_runtime_context().get_node_id())  # named by this process's job: "local" here
    ray.get(own.ready(), timeout=30)
    found = LiveNodes(profile=False, job="local")
    cluster = settled(found, 2)
    assert cluster.num_gpus == 2, cluster  # its own group's GPU and the one nobody holds
    assert list(found.held.values()) == [{"hetspot-first-1a2b3c4d": 2}]

    @ray.remote(num_gpus=1, num_cpus=0)
    class Holder:
        def ping(self) -> int:
            return 1

    h = Holder.remote()
    ray.get(h.ping.remote(), timeout=30)
    found = LiveNodes(profile=False, job="local")
    assert settled(found, 1).num_gpus == 1  # its own group's GPU only
    assert list(found.held.values()) == [{OTHER: 1, "hetspot-first-1a2b3c4d": 2}]
    everyone_else = LiveNodes(profile=False, job="another")
    assert everyone_else.discover().nodes == [] and list(everyone_else.held.values()) == [
        {OTHER: 1, "hetspot-first-1a2b3c4d": 2, "local": 1}]
    # the profiling pass pins a GPU only where one is free to the job: none here, so it never waits for one (its
    # probe's timeout is 300 s); with the holder gone it profiles the freed GPU (a fake one: skipped, at once)
    t0 = time.monotonic()
    profiled = LiveNodes(profile=True, job="another")
    assert profiled.discover().nodes == [] and profiled.notes == {}
    ray.kill(h)
    while not (found := profiled.discover()).nodes and time.monotonic() - t0 < 30:  # Ray frees it soon after
        time.sleep(0.2)
    assert found.num_gpus == 1 and "skipped" in profiled.notes["L4"], profiled.notes
    assert time.monotonic() - t0 < 60
    remove_placement_group(other)
    remove_placement_group(own)


@pytest.mark.ray
def test_the_queue_in_rays_key_value_store_orders_jobs_first_come_and_forgets_a_dead_driver(local_ray):
    """Jobs enter the cluster's queue in turn and see who is ahead; one that leaves lets the next be first; a
    job whose driver died without leaving is dropped by the next reader (a killed `hetspot submit`'s controller
    must not hold the line forever)."""
    import subprocess
    import sys

    from orchestrator.cluster.job_queue import RayJobQueue, waiting

    ray = local_ray
    gcs = ray.get_runtime_context().gcs_address
    gone = subprocess.run([sys.executable, "-c", (
        f"import ray; ray.init(address={gcs!r}, logging_level='ERROR');"
        "from orchestrator.cluster.job_queue import RayJobQueue; RayJobQueue('gone').enter()")],
        capture_output=True, text=True, timeout=120)
    assert gone.returncode == 0, gone.stderr[-2000:]
    from ray.experimental.internal_kv import _internal_kv_get

    from orchestrator.cluster.job_queue import NAMESPACE

    assert _internal_kv_get("gone", namespace=NAMESPACE) is not None  # its entry stays until someone reads the line
    first, second = RayJobQueue("first"), RayJobQueue("second")
    first.enter()
    time.sleep(0.01)
    second.enter()
    second.enter()  # looking again keeps its place
    assert [j for j, _ in waiting()] == ["first", "second"]  # the dead driver's entry is dropped on reading
    assert first.ahead() == [] and second.ahead() == ["first"]
    first.leave()
    assert second.ahead() == [] and [j for j, _ in waiting()] == ["second"]
    second.leave()
    assert waiting() == []


@pytest.mark.ray
def test_a_sharing_jobs_card_and_a_request_by_the_share_go_through_rays_key_value_store(local_ray):
    """A job with runtime.fleet_share: weighted shows its card (priority, model, training) in its entry, running or
    waiting, so another job rates it with the same specs; a first-come job shows none; a request marked as the
    share's arrives marked."""
    from orchestrator.cluster.job_queue import RayJobQueue
    from orchestrator.control.protocols import JobCard
    from orchestrator.job_spec import parse_job

    j = parse_job({"model": {"preset": "small"}, "train": {"global_batch": 16}, "cluster": {"nodes": [
        {"name": "l4-a", "gpu_type": "L4", "num_gpus": 1}]}, "runtime": {"fleet_share": "weighted", "priority": 3}})
    from orchestrator.runtime.controller_actor import job_card

    card = job_card(j)
    assert card == JobCard(3, j.model_spec, j.train)
    assert job_card(j.model_copy(update={"runtime": j.runtime.model_copy(update={"fleet_share": "first-come"})})) \
        is None
    sharer, plain = RayJobQueue("sharer", 3, card), RayJobQueue("plain")
    try:
        sharer.enter()
        plain.enter()
        assert plain.sharing() == {"sharer": card}
        sharer.hold()  # running: still shown
        assert plain.sharing() == {"sharer": card}
        plain.ask("sharer", ["l4-a"], share=True)
        req = sharer.asked()
        assert req is not None and req.share and req.by == "plain" and req.nodes == ["l4-a"]
        plain.ask("sharer", ["l4-a"])
        assert not sharer.asked().share
    finally:
        sharer.leave()
        plain.leave()
    assert plain.sharing() == {}
