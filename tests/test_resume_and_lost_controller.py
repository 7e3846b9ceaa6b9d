"""`--resume` through the CLI a user runs, and a lost controller.

Every run here goes through the same controller actor the CLI and the Ray Jobs
driver use: `hetspot submit` in a subprocess (each starts its own embedded
cluster), the CLI in-process while a thread kills its controller actor, and
`python -m orchestrator.driver` against a test cluster, killed and run again.
S3 is moto's threaded server. The oracle is the same job's uninterrupted 1-device run in this process
(tests/oracle.py): losses agree to 1e-4 relative (float64).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.job_spec import load_job, parse_job
from tests.moto_s3 import TEST_ENV, moto_s3
from tests.oracle import one_device_losses

pytestmark = pytest.mark.ray
HETSPOT = str(Path(sys.executable).parent / "hetspot")
CREDS = TEST_ENV
MODEL = {"name": "gpt-resume", "num_layers": 4, "hidden_size": 32, "num_heads": 4, "vocab_size": 64, "seq_len": 16}


@pytest.fixture(scope="module")
def endpoint():
    with moto_s3("runs") as url:
        yield url


@pytest.fixture(autouse=True)
def creds(monkeypatch):
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)


def job_file(tmp_path: Path, name: str, prefix: str, endpoint: str, nodes: list[dict], steps: int = 10,
             **runtime) -> Path:
    f = tmp_path / f"{name}-{prefix.replace('/', '-')}.yaml"
    f.write_text(yaml.safe_dump({
        "name": name, "model": MODEL, "train": {"global_batch": 8, "lr": 0.01, "precision": "fp32"},
        "cluster": {"nodes": nodes},
        "runtime": {"dtype": "float64", "emulate_speed": False, "collective_timeout_s": 20, "snapshot_every": 1}
        | runtime,
        "checkpoint": {"uri": f"s3://runs/{prefix}", "endpoint_url": endpoint, "s3_every": 1, "keep": 3},
        "steps": steps}))
    return f


def submit(*args: str) -> dict:
    r = subprocess.run([HETSPOT, "submit", *args, "--json"], capture_output=True, text=True, timeout=400,
                       env=os.environ | CREDS)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr
    return json.loads(r.stdout)


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for s, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= 1e-4 * abs(w), (s, got, want)


A100_L4 = [{"name": "a100", "gpu_type": "A100-80GB", "num_gpus": 1}, {"name": "l4", "gpu_type": "L4", "num_gpus": 2}]
T4_H100 = [{"name": "t4-a", "gpu_type": "T4", "num_gpus": 1}, {"name": "t4-b", "gpu_type": "T4", "num_gpus": 1},
           {"name": "h100", "gpu_type": "H100-SXM", "num_gpus": 1}]


def test_resume_on_another_cluster_through_the_cli_matches_an_uninterrupted_run(tmp_path, endpoint):
    """Acceptance 1: `submit JOB --steps 5`, then `submit JOB2 --resume` where JOB2's cluster has other GPU types
    and the plan another layout: exit 0, steps 5-9 match an uninterrupted 10-step run."""
    from planner import Pipeline, Plan, Stage

    def stage(a: int, b: int, gpu: str, node: str) -> Stage:
        return Stage(layer_start=a, layer_end=b, gpu_type=gpu, node=node, devices=[f"{node}/0"])

    # The resumed run's layout: a 2-stage pipeline over the T4s beside a replica on the H100 (asymmetric DP+PP).
    plan2 = Plan(model_name=MODEL["name"], num_layers=4, global_batch=8, pipelines=[
        Pipeline(num_samples=3, micro_batch_size=1, num_micro_batches=3,
                 stages=[stage(0, 2, "T4", "t4-a"), stage(2, 4, "T4", "t4-b")]),
        Pipeline(num_samples=5, micro_batch_size=5, num_micro_batches=1, stages=[stage(0, 4, "H100-SXM", "h100")])])
    (tmp_path / "plan2.json").write_text(plan2.model_dump_json())
    ref = one_device_losses(load_job(job_file(tmp_path, "resumed", "reference", endpoint, A100_L4)), 10)
    first = submit(str(job_file(tmp_path, "resumed", "resumed", endpoint, A100_L4)), "--steps", "5")
    second = submit(str(job_file(tmp_path, "resumed", "resumed", endpoint, T4_H100)), "--resume",
                    "--plan", str(tmp_path / "plan2.json"))
    assert first["first_step"] == 0 and len(first["losses"]) == 5
    assert second["first_step"] == 5 and len(second["losses"]) == 5
    gpus_of = lambda r: {s["gpu_type"] for p in r["plan"]["pipelines"] for s in p["stages"]}  # noqa: E731
    assert gpus_of(first) <= {"A100-80GB", "L4"} and gpus_of(second) == {"T4", "H100-SXM"}
    assert [len(p["stages"]) for p in second["plan"]["pipelines"]] == [2, 1]
    restore = next(e for e in second["events"] if e["kind"] == "restore")
    assert restore["step"] == 4 and restore["tier"] == "s3"
    assert_close(first["losses"] + second["losses"], ref)


def _wait_for_step(uri_prefix: str, endpoint: str, step: int, timeout_s: float = 120) -> None:
    from orchestrator.state.s3_store import S3Checkpoints

    store = S3Checkpoints(f"s3://runs/{uri_prefix}", endpoint)
    deadline = time.monotonic() + timeout_s
    while not store.complete_steps() or store.complete_steps()[0] < step:
        assert time.monotonic() < deadline, f"no step {step} under {uri_prefix} in {timeout_s} s"
        time.sleep(0.2)


def test_a_killed_controller_actor_is_one_line_naming_the_step_and_the_resume_command(tmp_path, endpoint):
    """Acceptance 7 (CLI): the controller actor killed mid-training: exit 1, one line naming the newest
    complete step and the exact --resume command, no traceback; that command then finishes the job."""
    import ray
    from typer.testing import CliRunner

    from orchestrator.cli.main import app
    from orchestrator.runtime.controller_actor import controller_name
    from orchestrator.state.s3_store import S3Checkpoints

    job = job_file(tmp_path, "lost-controller", "lost", endpoint, A100_L4, steps=200)
    killed: list[int] = []

    def killer() -> None:
        _wait_for_step("lost", endpoint, 2)
        ray.kill(ray.get_actor(controller_name("lost-controller")))
        killed.append(S3Checkpoints("s3://runs/lost", endpoint).complete_steps()[0])

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    res = CliRunner().invoke(app, ["submit", str(job)])
    t.join(timeout=60)
    assert killed, "the controller was never killed"
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and "ActorDiedError" not in res.output, res.output
    text = " ".join(res.output.split())
    newest = S3Checkpoints("s3://runs/lost", endpoint).newest_whole()[0]
    assert newest >= killed[0]
    assert f"the job's controller died (its Ray actor died); newest complete step {newest} under s3://runs/lost;" \
           in text, text
    assert f"go on from it with: hetspot submit {job} --resume" in text, text
    assert "error:" in text and text.count("error:") == 1


def _driver(ray_address: str, job: dict, steps: int, job_id: str, resume: bool = False) -> subprocess.Popen:
    from orchestrator.runtime.progress_lines import ENV_ID, ENV_JOB, ENV_RESUME, ENV_STEPS

    env = os.environ | CREDS | {ENV_JOB: parse_job(job).model_dump_json(), ENV_STEPS: str(steps), ENV_ID: job_id,
                                "RAY_ADDRESS": ray_address, "PYTHONUNBUFFERED": "1"}
    if resume:
        env[ENV_RESUME] = "1"
    return subprocess.Popen([sys.executable, "-m", "orchestrator.driver"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _losses(out: str) -> dict[int, float]:
    from orchestrator.runtime.progress_lines import PROGRESS

    return {r["step"]: r["loss"] for r in (json.loads(line[len(PROGRESS):]) for line in out.splitlines()
                                            if line.startswith(PROGRESS))}


def test_a_restarted_driver_resumes_by_itself_from_the_newest_complete_step(tmp_path, endpoint):
    """Acceptance 7 (driver): `python -m orchestrator.driver` killed mid-training (its controller and workers go
    with it), then run again as a RayJob retry or a restarted head would, with no --resume: it goes on from the
    newest complete step (checkpoint.resume: auto) and its losses are the uninterrupted run's."""
    from orchestrator.cluster.embedded import EmbeddedCluster
    from planner import ClusterSpec, NodeSpec

    steps = 60
    spec = yaml.safe_load(job_file(tmp_path, "driven", "driven", endpoint, A100_L4, steps=steps).read_text())
    ec = EmbeddedCluster(ClusterSpec(nodes=[NodeSpec(**n) for n in A100_L4]))
    try:
        first = _driver(ec.address, spec, steps, "first")
        _wait_for_step("driven", endpoint, 0)  # uploads trail training: kill as soon as a step is in S3
        os.killpg(first.pid, signal.SIGKILL)  # the driver process and its controller actor's owner go at once
        first_out, _ = first.communicate(timeout=60)
        done_before = _losses(first_out)
        assert max(done_before) < steps - 1, "the driver finished before it was killed"
        again = _driver(ec.address, spec, steps, "retry")  # a RayJob retry is a new submission of the same job
        out, err = again.communicate(timeout=300)
        assert again.returncode == 0, err[-3000:]
        assert "going on from the newest complete one (checkpoint.resume: auto)" in out, out[-2000:]
        resumed = _losses(out)
        assert resumed and min(resumed) >= 1 and sorted(resumed) == list(range(min(resumed), steps))
        want = one_device_losses(parse_job(spec), steps)
        assert_close([resumed[s] for s in sorted(resumed)], [want[s] for s in sorted(resumed)])
        # resume: never refuses the prefix instead of going on from it
        never = spec | {"checkpoint": spec["checkpoint"] | {"resume": "never"}}
        r = _driver(ec.address, never, steps + 2, "never")
        _, err = r.communicate(timeout=120)
        assert r.returncode == 2 and "already holds steps" in err and "Traceback" not in err, err[-2000:]
    finally:
        ec.shutdown()


def test_an_epoch_reads_every_window_once_across_a_resume_and_a_changed_corpus_is_not_resumed(tmp_path, endpoint):
    """A corpus of three token shards (36 windows of seq_len + 1 tokens, 4.5 steps of 8): `submit --steps 3`, then
    `submit --resume` to step 7, so the resume lands in the middle of the first epoch. The samples the ranks
    trained, counted window by window: the first epoch reads every window exactly once, the second 20 distinct
    windows in another order; the losses are the uninterrupted 1-device run's. Then one shard is rewritten and a
    further --resume exits 2 in one line: the steps were trained on another version of the data."""
    import numpy as np

    from workers.epochs import EpochOrder

    window = MODEL["seq_len"] + 1
    folder = tmp_path / "shards"
    folder.mkdir()
    lengths = [14 * window + 5, 12 * window, 10 * window + 16]
    rng = np.random.default_rng(5)
    for i, n in enumerate(lengths):
        rng.integers(0, MODEL["vocab_size"], n, dtype=np.uint16).tofile(folder / f"shard-{i}.bin")

    def job(steps: int) -> Path:
        f = job_file(tmp_path, "epochs", "epochs", endpoint, A100_L4, steps=steps)
        f.write_text(yaml.safe_dump(yaml.safe_load(f.read_text()) | {
            "data": {"kind": "tokens", "path": str(folder), "dtype": "uint16"}}))
        return f

    first = submit(str(job(3)))
    from orchestrator.runtime.run_record import DATA_INDEX, _Files, read_record

    index = json.loads(_Files(first["run_record"], endpoint).read(DATA_INDEX))  # beside the run record
    assert [(Path(e["path"]).name, e["bytes"]) for e in index["shards"]] == [
        (f"shard-{i}.bin", 2 * n) for i, n in enumerate(lengths)]
    assert "index" not in read_record(first["run_record"], endpoint)["job"]["data"]
    second = submit(str(job(7)), "--resume")
    assert second["first_step"] == 3 and len(first["samples"]) == 3 and len(second["samples"]) == 4
    order = EpochOrder(lengths, window, seed=0)
    assert order.windows == 36
    trained = sorted(i for step in first["samples"] + second["samples"] for a, n in step for i in range(a, a + n))
    assert trained == list(range(7 * 8))  # every sample of 7 steps once, over both runs
    read = [order.window_of(i) for i in trained]
    assert sorted(read[:36]) == list(range(36))  # the first epoch: every window exactly once
    assert len(set(read[36:])) == 20 and read[36:] != read[:20]  # the second: distinct windows, another order
    assert_close(first["losses"] + second["losses"], one_device_losses(load_job(job(7)), 7))

    rng.integers(0, MODEL["vocab_size"], lengths[1], dtype=np.uint16).tofile(folder / "shard-1.bin")
    r = subprocess.run([HETSPOT, "submit", str(job(9)), "--resume"], capture_output=True, text=True, timeout=120,
                       env=os.environ | CREDS)
    text = " ".join(r.stderr.split())
    assert r.returncode == 2 and "Traceback" not in text, text
    assert "holds steps trained on another version of the data" in text and text.count("error:") == 1, text
