"""The fleet on Ray's real autoscaler: `ray.cluster_utils.AutoscalingCluster`.

The cluster starts with a head and **no GPU node**; its autoscaler (Ray's own, over the fake multi-node
provider, which starts each node as a local `ray start`) knows node types of fake T4, L4 and A10G GPUs, the
A10G pool capped at 0 nodes (a dry spot pool). Jobs go through `hetspot submit --address` and Ray Jobs, as on
a real cluster: hetspot asks the autoscaler for its fleet, waits for the minimum, trains, and withdraws the
demand at the end, after which the autoscaler removes the idle GPU nodes.

The autoscaler is v2, the default of `ray up` since Ray 2.50: it terminates an instance whose Ray node died
and launches a replacement for the standing demand, as on a cloud where the reclaimed instance is gone (v1
over the fake provider keeps a killed node listed and never replaces it). The pip wheel of Ray lacks the base
config `AutoscalingCluster` reads (`fake_multi_node/example.yaml`), so `FleetCluster` gives it one, and v2
reads a `fake_multinode` provider's defaults from that same missing file, so the provider is Ray's fake one
loaded as an external module. `AutoscalingCluster` would run `ray stop --force` (every Ray process of the user)
and take Ray's default ports: `FleetCluster` starts its head on free ports and stops only its own processes
(tests/own_ray.py), so this module runs beside the embedded test clusters, in the other xdist worker.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.oracle import one_device_losses

pytestmark = [pytest.mark.ray, pytest.mark.own_head]
BIN = Path(sys.executable).parent
HETSPOT = str(BIN / "hetspot")
URL = GCS = ""  # the head's dashboard and GCS addresses: its ports are free ones, set by the module's fixture
IDLE_TIMEOUT_S = 6.0
BASE_CONFIG = {  # what fake_multi_node/example.yaml holds, less its node types
    "cluster_name": "hetspot-fleet-test",
    "max_workers": 6,
    "upscaling_speed": 10.0,
    "idle_timeout_minutes": IDLE_TIMEOUT_S / 60,
    # Ray's fake provider, loaded as an external module: autoscaler v2 reads a `fake_multinode` provider's
    # defaults from the example.yaml the wheel lacks, and an external one's from Ray's built-in minimum.
    "provider": {"type": "external",
                 "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
                 "use_node_id_as_ip": True, "disable_node_updaters": True, "disable_launch_config_check": True},
    "auth": {"ssh_user": "ubuntu"},
    "docker": {},
    "head_node_type": "ray.head.default",
    "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
    "rsync_exclude": [], "rsync_filter": [],
    "initialization_commands": [], "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
    "head_start_ray_commands": [], "worker_start_ray_commands": [],
}


def gpu_type_node(gpu: str, max_workers: int, ray_name: str | None = None) -> dict:
    """An autoscaler node type of one fake GPU: the resources and labels a rendered deploy config gives it (Ray's
    own name for the GPU in the resource: `A100` for both A100 flavours)."""
    return {"resources": {"CPU": 1, "GPU": 1, f"accelerator_type:{ray_name or gpu}": 1}, "node_config": {},
            "labels": {"hetspot/gpu-type": gpu, "hetspot/market": "spot"}, "min_workers": 0,
            "max_workers": max_workers}


@pytest.fixture(scope="module")
def fleet_cluster():
    from ray._private.services import get_node_ip_address
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
    from ray.cluster_utils import AutoscalingCluster

    from orchestrator.cluster.embedded import HEALTH
    from tests.net import free_port
    from tests.own_ray import new_mark, new_temp_dir, stop_marked

    global URL, GCS
    home = tempfile.mkdtemp(prefix="hetspot-fleet-home-")
    ray_tmp = new_temp_dir()
    port, dash = free_port(), free_port()
    URL, GCS = f"http://127.0.0.1:{dash}", f"{get_node_ip_address()}:{port}"
    mark = new_mark()

    class FleetCluster(AutoscalingCluster):
        def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **kw):
            cfg = copy.deepcopy(BASE_CONFIG) | kw
            cfg["provider"] = cfg["provider"] | {"gcs_address": GCS}  # the nodes it starts join this head
            if autoscaler_v2:  # what AutoscalingCluster adds for v2
                cfg["provider"] |= {"launch_multiple": True, "head_node_id": FAKE_HEAD_NODE_ID}
            cfg["available_node_types"] = dict(worker_node_types) | {
                "ray.head.default": {"resources": dict(head_resources), "node_config": {}, "max_workers": 0}}
            return cfg

        def start(self, _system_config=None, override_env=None):
            """AutoscalingCluster.start on ports of its own, without its `ray stop --force` first."""
            fd, config = tempfile.mkstemp(suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(self._config, f)
            # A HOME of its own and auth off, as tests/test_real_head.py: a ~/.ray/auth_token of the user's (any
            # `ray.init()` of a local cluster writes one) would have the head ask this module's clients for it.
            env = os.environ | {"HOME": home, "RAY_AUTH_MODE": "disabled",
                                "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1",
                                "RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
                                "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID} | mark
            subprocess.run(
                ["ray", "start", "--head", f"--autoscaling-config={config}", f"--port={port}",
                 f"--dashboard-port={dash}", f"--ray-client-server-port={free_port()}",
                 f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
                 f"--num-cpus={self._head_resources['CPU']}", "--disable-usage-stats", f"--temp-dir={ray_tmp}",
                 "--system-config=" + json.dumps(_system_config, separators=(",", ":"))],
                env=env, check=True, capture_output=True, timeout=180)

        def shutdown(self):
            stop_marked(mark)
            for d in (ray_tmp, home):
                shutil.rmtree(d, ignore_errors=True)

    old_path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{BIN}:{old_path}"  # `ray` (and the jobs' `python`) from this environment, as activated
    c = FleetCluster(head_resources={"CPU": 2},
                     worker_node_types={"t4": gpu_type_node("T4", 2), "l4": gpu_type_node("L4", 1),
                                        "a10g": gpu_type_node("A10G", 0),
                                        "a100-40": gpu_type_node("A100-40GB", 1, "A100"),
                                        "a100-80": gpu_type_node("A100-80GB", 1, "A100")},
                     autoscaler_v2=True)
    try:
        # A metrics export each second, not Ray's 10 s: a job's controller stays up one export at its end
        # (controller_actor.publish_last_rows), 1.5 s a job here rather than 10.5.
        c.start(_system_config=HEALTH | {"metrics_report_interval_ms": 1000})
        yield c
    finally:
        c.shutdown()
        os.environ["PATH"] = old_path


def gpu_nodes() -> dict[str, int]:
    """GPU nodes alive now, per fake type."""
    out: dict[str, int] = {}
    for t in gpu_node_ids().values():
        out[t] = out.get(t, 0) + 1
    return out


def gpu_node_ids() -> dict[str, str]:
    """Alive GPU nodes: Ray node id -> fake GPU type (Ray's state API on the head's dashboard: no driver)."""
    from ray.util.state import list_nodes

    return {n.node_id: n.labels.get("hetspot/gpu-type") for n in
            list_nodes(address=URL, filters=[("state", "=", "ALIVE")], detail=True, raise_on_missing_output=False)
            if n.resources_total.get("GPU")}


def job_file(tmp_path: Path, name: str, fleet: dict, steps: int = 4) -> Path:
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump({
        "name": name,
        "model": {"name": "gpt-fleet", "num_layers": 4, "hidden_size": 32, "num_heads": 4, "vocab_size": 64,
                  "seq_len": 16},
        "train": {"global_batch": 8, "lr": 0.01, "precision": "fp32"},
        "runtime": {"dtype": "float64", "emulate_speed": False, "collective_timeout_s": 20, "snapshot_every": 1},
        "fleet": {"poll_s": 0.5} | fleet, "steps": steps}))
    return f


def hetspot(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    r = subprocess.run([HETSPOT, *args], capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r


def run_job(job: Path, timeout_s: float = 300) -> tuple[dict, str, float]:
    """Submit through Ray Jobs and wait for the end: (status, the driver's log, seconds from submit to the end).
    The wait asks Ray's job client in this process (a `hetspot status` a second would start a Python process a
    second, about 0.7 s of CPU each, beside the other worker's clusters); `hetspot status` reads the end."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    t0 = time.monotonic()
    r = hetspot("submit", str(job), "--address", URL, "--json")
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["job_id"]
    jobs, deadline = JobSubmissionClient(URL), time.monotonic() + timeout_s
    while not (ray_status := jobs.get_job_status(job_id)).is_terminal():
        assert time.monotonic() < deadline, f"{job_id} still {ray_status} after {timeout_s} s"
        time.sleep(0.5)
    took = time.monotonic() - t0
    st = json.loads(hetspot("status", job_id, "--address", URL, "--json").stdout)
    assert st["status"] == JobStatus(ray_status).value, (st, ray_status)
    return st, hetspot("logs", job_id, "--address", URL).stdout, took


def progress(log: str) -> dict[int, float]:
    from orchestrator.runtime.progress_lines import progress_rows

    return {r["step"]: r["loss"] for r in progress_rows(log) if "step" in r}


def wait_gpu_nodes(want: dict[str, int], timeout_s: float) -> float:
    t0 = time.monotonic()
    while gpu_nodes() != want:
        assert time.monotonic() - t0 < timeout_s, f"GPU nodes {gpu_nodes()} are not {want} after {timeout_s} s"
        time.sleep(1.0)
    return time.monotonic() - t0


def test_a_cluster_with_no_gpu_node_brings_up_the_fleet_trains_and_scales_it_down(fleet_cluster, tmp_path):
    """Acceptance 1 and 4: zero GPU nodes at the start; hetspot's demand brings up a T4 and an L4 node through
    the autoscaler, the job trains on them with the 1-device run's losses, and once its demand is withdrawn the
    autoscaler removes both within its idle timeout."""
    assert gpu_nodes() == {}
    fleet = {"types": [{"gpu_type": "T4", "min_nodes": 1, "max_nodes": 1}, {"gpu_type": "L4", "min_nodes": 1,
                                                                           "max_nodes": 1}], "wait_s": 120}
    job = job_file(tmp_path, "fleet-up", fleet)
    st, log, _ = run_job(job)
    assert st["status"] == "SUCCEEDED", log[-3000:]
    assert "waiting for capacity: 0/1 T4 node, 0/1 L4 node" in log, log[-3000:]
    assert "Adding 1 node(s) of type t4" in log and "Adding 1 node(s) of type l4" in log, log[-3000:]  # on demand
    assert "hetspot: training on" in log
    losses = progress(log)
    from orchestrator.job_spec import load_job

    want = one_device_losses(load_job(job), 4)
    assert sorted(losses) == [0, 1, 2, 3]
    for s, w in enumerate(want):
        assert abs(losses[s] - w) <= 1e-4 * abs(w), (losses, want)
    # The demand is withdrawn: the autoscaler terminates the idle nodes at its idle timeout.
    waited = wait_gpu_nodes({}, 60 + IDLE_TIMEOUT_S)
    print(f"GPU nodes gone {waited:.1f} s after the job ended (idle timeout {IDLE_TIMEOUT_S:.0f} s)")


def test_a_dry_pool_is_substituted_after_its_timeout(fleet_cluster, tmp_path):
    """Acceptance 3 (substitutes): the A10G pool is capped at 0 nodes; after `substitute_after_s` hetspot asks
    for a T4 instead, says so in an event, and trains on it."""
    wait_gpu_nodes({}, 60 + IDLE_TIMEOUT_S)
    fleet = {"types": [{"gpu_type": "A10G", "min_nodes": 1, "max_nodes": 1, "substitutes": ["T4"]},
                       {"gpu_type": "T4", "min_nodes": 0, "max_nodes": 1}], "wait_s": 120, "substitute_after_s": 3}
    st, log, _ = run_job(job_file(tmp_path, "fleet-substitute", fleet, steps=2))
    assert st["status"] == "SUCCEEDED", log[-3000:]
    events = [e for e in (st.get("events") or []) if e["kind"] == "substitute"]
    assert events and events[0]["dry"] == "A10G" and events[0]["substitute"] == "T4", st.get("events")
    assert sorted(progress(log)) == [0, 1]


def test_a_chosen_fleet_whose_type_does_not_come_is_chosen_again_among_what_is_left(fleet_cluster, tmp_path):
    """hetspot chooses the fleet from a catalog whose cheapest type per token
    is an A10G instance (its pool capped at 0 nodes); after `substitute_after_s` it chooses again among the
    rest, the autoscaler brings that fleet up, and the job trains on it with the 1-device run's losses."""
    from orchestrator.job_spec import fleet_types, load_job
    from planner.fleet import choose_fleet

    wait_gpu_nodes({}, 60 + IDLE_TIMEOUT_S)
    catalog = {"types": [
        {"name": "a10g.x1", "gpu_type": "A10G", "num_gpus": 1, "price_per_hour": 0.05, "max_nodes": 1},
        {"name": "t4.x1", "gpu_type": "T4", "num_gpus": 1, "price_per_hour": 0.2, "max_nodes": 2},
        {"name": "l4.x1", "gpu_type": "L4", "num_gpus": 1, "price_per_hour": 1.5, "max_nodes": 1}]}
    job = job_file(tmp_path, "fleet-auto", {"auto": {"catalog": catalog}, "wait_s": 120, "substitute_after_s": 3},
                   steps=3)  # the A10G pool is dry by construction (capped at 0 nodes), not by the timeout
    spec = load_job(job)
    cat = spec.fleet.auto.catalog

    def chosen(c) -> dict[str, int]:
        best = choose_fleet(c, spec.model_spec, spec.train, "cost").best.fleet
        return {t.gpu_type: t.max_nodes for t in fleet_types(c, best)}

    assert chosen(cat) == {"A10G": 1}  # the premise: the type that cannot come is the choice
    want = chosen(cat.model_copy(update={"types": cat.types[1:]}))
    st, log, _ = run_job(job)
    assert st["status"] == "SUCCEEDED", log[-3000:]
    events = st.get("events") or []
    assert next(e for e in events if e["kind"] == "fleet")["fleet"] == {"A10G": 1}, events
    # The choice made because the A10G did not come, read by its cause: on a loaded machine a type of the new
    # fleet may start slower than substitute_after_s and be chosen away again later, which is right too.
    after_a10g = [e for e in events if e["kind"] == "rechoose" and e["dry"] == "A10G"]
    assert after_a10g and after_a10g[0]["fleet"] == want, events
    assert any(f"Adding {n} node(s) of type {gpu.lower()}" in log for gpu, n in want.items()), log[-3000:]
    losses = progress(log)
    ref = one_device_losses(spec, 3)
    assert sorted(losses) == [0, 1, 2]
    for s, w in enumerate(ref):
        assert abs(losses[s] - w) <= 1e-4 * abs(w), (losses, ref)


def test_a_minimum_that_never_comes_fails_with_exit_2_naming_the_types_after_the_wait(fleet_cluster, tmp_path):
    """Acceptance 3 (timeout): an A10G minimum with no substitute never comes up; the driver exits 2 after
    `wait_s` (not before) with a message naming A10G."""
    wait_s = 8.0
    fleet = {"types": [{"gpu_type": "A10G", "min_nodes": 1, "max_nodes": 1}], "wait_s": wait_s}
    st, log, took = run_job(job_file(tmp_path, "fleet-dry", fleet))
    assert st["status"] == "FAILED", log[-3000:]
    assert "fleet: the minimum did not come up in 8 s: missing A10G (0 up, min_nodes 1)" in log, log[-3000:]
    assert "exit code 2" in (st["message"] or ""), st["message"]
    phases = [json.loads(line.split(" ", 1)[1]) for line in log.splitlines() if line.startswith("hetspot-phase ")]
    assert phases[-1]["phase"] == "failed" and phases[-1]["elapsed_s"] >= wait_s, phases[-3:]
    assert took >= wait_s




def kill_fake_node(node_id: str) -> int:
    """SIGKILL every process of one fake node, as a reclaimed instance vanishes: the fake provider starts each
    node's processes with `RAY_OVERRIDE_NODE_ID_FOR_TESTING=<its node id>` in their environment (tests/own_ray.py
    finds them, and their descendants, by it). The number of processes killed."""
    from tests.own_ray import stop_marked

    return stop_marked({"RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id})


def test_a_killed_node_is_replaced_by_the_autoscaler_and_the_job_moves_onto_it(fleet_cluster, tmp_path):
    """The job trains on a T4 and an L4 node; the L4 node is killed mid-training. hetspot re-plans
    on the T4; its demand still stands, so the autoscaler replaces the lost node (its liveness check terminates
    the silent instance, then it launches a new L4 for the demand); hetspot's scale-up path moves onto the new
    node. Every committed step's loss equals the 1-device run's, across both plan changes (the same samples
    in the same order). Stopping the job (SIGTERM to the driver) withdraws the demand: the GPU nodes go."""
    wait_gpu_nodes({}, 60 + IDLE_TIMEOUT_S)
    fleet = {"types": [{"gpu_type": "T4", "min_nodes": 1, "max_nodes": 1},
                       {"gpu_type": "L4", "min_nodes": 1, "max_nodes": 1}], "wait_s": 120}
    job = job_file(tmp_path, "fleet-replace", fleet, steps=100_000)  # long enough that moving back pays
    r = hetspot("submit", str(job), "--address", URL, "--json")
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["job_id"]

    from orchestrator.runtime.ray_jobs import RayJobs

    jobs = RayJobs(URL)

    def status() -> dict:  # what `hetspot status --json` prints, asked in this process (not a process a second)
        return jobs.status(job_id)

    def until(what: str, ok, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            st = status()
            if ok(st):
                return st
            assert st["status"] not in ("SUCCEEDED", "FAILED", "STOPPED"), (what, st)
            assert time.monotonic() < deadline, f"not {what} after {timeout_s} s: {st}"
            time.sleep(1.0)

    try:
        until("training", lambda st: (st.get("progress") or {}).get("step", -1) >= 20, 180)
        l4 = [n for n, t in gpu_node_ids().items() if t == "L4"]
        assert len(l4) == 1, gpu_node_ids()
        assert kill_fake_node(l4[0]) > 0
        t_kill = time.monotonic()
        kinds = lambda st: [e["kind"] for e in st.get("events") or []]  # noqa: E731
        st = until("re-planned without the L4", lambda st: "re-plan" in kinds(st), 120)
        st = until("moved onto the replacement", lambda st: "scale-up" in kinds(st), 180)
        moved_s = time.monotonic() - t_kill
        nodes = gpu_node_ids()
        assert sorted(nodes.values()) == ["L4", "T4"] and l4[0] not in nodes, nodes  # a new L4 node
        step = st["progress"]["step"]
        until("training after the move", lambda st: st["progress"]["step"] >= step + 20, 120)
    finally:
        stop = hetspot("stop", job_id, "--address", URL)
    assert stop.returncode == 0, stop.stderr
    deadline = time.monotonic() + 120
    while (st := status())["status"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline, st
        time.sleep(1.0)
    cli = json.loads(hetspot("status", job_id, "--address", URL, "--json").stdout)  # the user's command, at the end
    assert (cli["status"], kinds(cli)) == (st["status"], kinds(st)), (cli, st)
    log = hetspot("logs", job_id, "--address", URL).stdout
    events = st.get("events") or []
    print(f"kill -> moved onto the replacement L4 in {moved_s:.1f} s; events:",
          [(e["kind"], e["cause"][:90]) for e in events])
    # the stop withdrew the demand before Ray's job stop could SIGKILL the driver (ray_jobs.STOP_GRACE_S: with Ray's
    # 3 s, a loaded head killed the driver first and the nodes stayed up for good)
    assert "the demand for GPU nodes is withdrawn" in log, log.splitlines()[-6:]
    losses = progress(log)
    n = max(losses) + 1
    assert sorted(losses) == list(range(n)), "a committed step is missing from the log"
    from orchestrator.job_spec import load_job

    want = one_device_losses(load_job(job), n)
    bad = [(s, losses[s], want[s]) for s in range(n) if abs(losses[s] - want[s]) > 1e-4 * abs(want[s])]
    assert not bad, bad[:5]
    # The stopped driver withdrew the demand: the autoscaler removes both GPU nodes at its idle timeout.
    waited = wait_gpu_nodes({}, 60 + IDLE_TIMEOUT_S)
    print(f"{n} steps matched the 1-device run; GPU nodes gone {waited:.1f} s after the stop")


def test_the_flavour_asked_for_comes_up_where_two_share_rays_gpu_name(fleet_cluster, tmp_path):
    """The autoscaler knows A100-40GB and A100-80GB node types, both advertising Ray's
    `accelerator_type:A100`. A job asking for A100-80GB brings up an A100-80GB node (the demand selects on the
    `hetspot/gpu-type` label) and trains there, never on an A100-40GB, with the 1-device run's losses; a job
    asking for A100-40GB gets that flavour."""
    from orchestrator.job_spec import load_job

    for gpu in ("A100-80GB", "A100-40GB"):
        wait_gpu_nodes({}, 60 + IDLE_TIMEOUT_S)
        job = job_file(tmp_path, f"flavour-{gpu.lower()}", {"types": [{"gpu_type": gpu, "min_nodes": 1,
                                                                      "max_nodes": 1}], "wait_s": 120}, steps=2)
        seen: set[str] = set()
        done = threading.Event()

        def watch(seen=seen, done=done) -> None:  # the GPU nodes up while the job runs, by flavour
            while not done.is_set():
                seen.update(gpu_nodes())
                done.wait(1.0)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            st, log, _ = run_job(job)
        finally:
            done.set()
            watcher.join(timeout=120)
        assert st["status"] == "SUCCEEDED", log[-3000:]
        node_type = "a100-80" if gpu == "A100-80GB" else "a100-40"
        assert f"Adding 1 node(s) of type {node_type}" in log, log[-3000:]
        assert seen == {gpu}, seen  # (the log also replays earlier jobs' autoscaler events: not read for this)
        assert "hetspot: training on 1 GPUs" in log, log[-3000:]  # on the one node that came: the flavour asked
        losses = progress(log)
        ref = one_device_losses(load_job(job), 2)
        for s_, w in enumerate(ref):
            assert abs(losses[s_] - w) <= 1e-4 * abs(w), (losses, ref)


def test_a_job_asks_for_its_cluster_nodes_and_one_asking_for_nothing_exits_2(fleet_cluster, tmp_path):
    """On a cluster with no GPU node, a job with neither `fleet:` nor `cluster:` exits 2
    in one line naming `fleet:` (no traceback); a job whose `cluster:` names a T4 node (and no `fleet:`) asks the
    autoscaler for exactly that, and trains with the 1-device run's losses."""
    from orchestrator.job_spec import load_job

    wait_gpu_nodes({}, 60 + IDLE_TIMEOUT_S)
    base = yaml.safe_load(job_file(tmp_path, "base", {"types": [{"gpu_type": "T4"}]}, steps=2).read_text())
    del base["fleet"]
    bare = tmp_path / "asks-nothing.yaml"
    bare.write_text(yaml.safe_dump(base | {"name": "asks-nothing"}))
    st, log, _ = run_job(bare, timeout_s=120)
    assert st["status"] == "FAILED" and "exit code 2" in (st["message"] or ""), (st, log[-2000:])
    line = next(ln for ln in log.splitlines() if "has no GPU node" in ln)
    assert "add a fleet: section" in line and "Traceback" not in log, log[-2000:]
    declared = tmp_path / "declared.yaml"
    declared.write_text(yaml.safe_dump(base | {"name": "declared", "cluster": {"nodes": [
        {"name": "t4-a", "gpu_type": "T4", "num_gpus": 1}]}}))
    st, log, _ = run_job(declared)
    assert st["status"] == "SUCCEEDED", log[-3000:]
    assert "waiting for capacity: 0/1 T4 node" in log and "Adding 1 node(s) of type t4" in log, log[-3000:]
    losses = progress(log)
    ref = one_device_losses(load_job(declared), 2)
    for s, w in enumerate(ref):
        assert abs(losses[s] - w) <= 1e-4 * abs(w), (losses, ref)
