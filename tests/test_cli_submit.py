"""`hetspot submit --plan`: a plan that does not match the job fails before any actor starts (exit 2)."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli.main import app
from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec, plan

pytestmark = pytest.mark.unit
runner = CliRunner()

CLUSTER = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100-80GB", num_gpus=2),
                             NodeSpec(name="b", gpu_type="L4", num_gpus=2)])
JOB = {"model": {"preset": "tiny"}, "train": {"global_batch": 8}, "cluster": CLUSTER.model_dump(), "steps": 2}



@pytest.fixture
def files(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(JOB))
    good = plan(CLUSTER, ModelSpec.preset("tiny"), TrainSpec(global_batch=8)).model_dump()
    return job, tmp_path, good


def _submit(job, tmp_path, plan_obj):
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(plan_obj) if not isinstance(plan_obj, str) else plan_obj)
    return runner.invoke(app, ["submit", str(job), "--plan", str(f)])


def _mutate(good, fn):
    p = json.loads(json.dumps(good))
    fn(p)
    return p


def _extra_gpu(p):
    p["pipelines"][0]["stages"][0]["devices"] = ["a/7"]


def _drop_layer(p):
    st = p["pipelines"][0]["stages"][-1]
    st["layer_end"] -= 1


def _tp3(p):
    p["pipelines"] = [{"num_samples": 8, "micro_batch_size": 8, "num_micro_batches": 1, "stages": [
        {"layer_start": 0, "layer_end": 4, "gpu_type": "A100-80GB", "node": "a", "devices": ["a/0", "a/1", "a/2"]}]}]


def _three_pipelines_for_batch_2(p):
    p["global_batch"] = 2
    p["pipelines"] = [{"num_samples": 1, "micro_batch_size": 1, "num_micro_batches": 1, "stages": [
        {"layer_start": 0, "layer_end": 4, "gpu_type": "A100-80GB" if i < 2 else "L4", "node": "a" if i < 2 else "b",
         "devices": [f"a/{i}" if i < 2 else "b/0"]}]} for i in range(3)]


@pytest.mark.parametrize("mutate,needle", [
    (_extra_gpu, "device a/7 is not in the job's cluster"),
    (_drop_layer, "covers layers [0, 3), model has 4"),
    (_tp3, "TP degree 3, which does not divide num_heads=4"),
])
def test_mismatched_plan_fails_before_actors(files, mutate, needle):
    import ray

    job, tmp_path, good = files
    res = _submit(job, tmp_path, _mutate(good, mutate))
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
    assert not ray.is_initialized()  # no cluster, no actor


def test_plan_file_not_json(files):
    job, tmp_path, _ = files
    res = _submit(job, tmp_path, "{not json")
    assert res.exit_code == 2 and "not valid JSON" in res.output


def test_global_batch_smaller_than_pipelines(files):
    job, tmp_path, good = files
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump({**JOB, "train": {"global_batch": 2}}))
    res = _submit(small, tmp_path, _mutate(good, _three_pipelines_for_batch_2))
    assert res.exit_code == 2 and "global batch 2 is smaller than the plan's 3 pipelines" in res.output


def test_inventory_unreachable_address_fails_fast():
    import ray

    res = runner.invoke(app, ["inventory", "--address", "127.0.0.1:1"])
    assert res.exit_code == 2 and "cannot reach a Ray cluster" in res.output
    assert not ray.is_initialized()  # refused by the reachability check, before Ray's own connect and its retries


@pytest.mark.parametrize("args", [
    ["status", "some-job"], ["logs", "some-job"], ["stop", "some-job"], ["list"], ["inventory"],
])
def test_cluster_commands_unreachable_dashboard_exit_2(args):
    res = runner.invoke(app, [*args, "--address", "http://127.0.0.1:1"])
    assert res.exit_code == 2 and "cannot reach" in res.output and "Traceback" not in res.output


def test_submit_to_a_cluster_validates_the_job_first(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "train": {"global_batch": 8, "lr": "fast"}}))
    # the job file is checked before the (unreachable) cluster is contacted
    res = runner.invoke(app, ["submit", str(bad), "--address", "http://127.0.0.1:1"])
    assert res.exit_code == 2 and "field 'train.lr'" in res.output and "cannot reach" not in res.output
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "train": {"global_batch": 8}}))
    res = runner.invoke(app, ["submit", str(ok), "--address", "http://127.0.0.1:1", "--plan", "p.json"])
    assert res.exit_code == 2 and "--plan works for local runs only" in res.output


def test_missing_address_names_the_option():
    res = runner.invoke(app, ["status", "some-job"], env={"HETSPOT_ADDRESS": "", "RAY_API_SERVER_ADDRESS": ""})
    assert res.exit_code == 2 and "--address" in res.output


def test_ffn_130_plan_with_tp4_is_refused_before_any_actor(tmp_path):
    """The defect that trained a different model with exit 0: TP=4 does not divide ffn_size=130."""
    import ray

    job = tmp_path / "ffn.yaml"
    job.write_text(yaml.safe_dump({"model": {"preset": "tiny", "ffn_size": 130}, "train": {"global_batch": 4},
                                   "cluster": {"nodes": [{"name": "a", "gpu_type": "A100-80GB", "num_gpus": 4}]}}))
    p = {"model_name": "tiny", "num_layers": 4, "global_batch": 4, "pipelines": [
        {"num_samples": 4, "micro_batch_size": 4, "num_micro_batches": 1, "stages": [
            {"layer_start": 0, "layer_end": 4, "gpu_type": "A100-80GB", "node": "a",
             "devices": ["a/0", "a/1", "a/2", "a/3"]}]}]}
    res = _submit(job, tmp_path, p)
    assert res.exit_code == 2, res.output
    assert "TP degree 4, which does not divide ffn_size=130" in res.output and "Traceback" not in res.output
    assert not ray.is_initialized()


def test_plan_that_does_not_fit_fails_before_actors(tmp_path):
    """A well-formed plan whose stage cannot hold its state: exit 2 naming the device and its memory, not a
    worker's out-of-memory error later (evaluate refuses plans that cannot run)."""
    import ray

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**JOB, "model": {"preset": "7b"}, "train": {"global_batch": 2}}))
    whole = {"model_name": "7b", "num_layers": 32, "global_batch": 2, "pipelines": [
        {"num_samples": 2, "micro_batch_size": 2, "num_micro_batches": 1, "stages": [
            {"layer_start": 0, "layer_end": 32, "gpu_type": "L4", "node": "b", "devices": ["b/0"]}]}]}
    res = _submit(job, tmp_path, whole)
    assert res.exit_code == 2, res.output
    msg = " ".join(res.output.split())
    assert "does not fit: device b/0 needs" in msg and "has 24" in msg and "Traceback" not in res.output
    assert not ray.is_initialized()


def test_status_shows_where_the_s3_tier_stands(monkeypatch):
    """The upload lag a committed step's row carries (controller_actor) goes through the
    driver's progress line to `hetspot status`."""
    from orchestrator.runtime import ray_jobs
    from orchestrator.runtime.progress_lines import last_progress, progress_line

    row = {"step": 41, "loss": 2.5, "tokens_per_s": 1000.0, "mfu": None, "step_time_s": 0.5, "restarts": 1,
           "device_memory_bytes": 0, "steps": 100, "upload_lag_steps": 3, "upload_backlog": 2, "s3_step": 38,
           "failed_uploads": 1, "s3_no_access": ["node-7"]}
    log = "hetspot: job x\n" + progress_line(row) + "\n"

    class FakeJobs:
        def __init__(self, *args, **kwargs):
            pass

        def status(self, job_id, endpoint_url=None):
            return {"job_id": job_id, "status": "RUNNING", "message": "", "progress": last_progress(log),
                    "phase": "training", "events": []}

    monkeypatch.setattr(ray_jobs, "RayJobs", FakeJobs)
    res = runner.invoke(app, ["status", "job-1", "--address", "http://127.0.0.1:1"])
    assert res.exit_code == 0, res.output
    assert "S3: newest step 38, 3 steps behind, 2 upload(s) in flight or waiting, 1 failed" in res.output
    assert "S3: no write access from node-7" in " ".join(res.output.split())  # a keeper's own check


def test_status_says_which_epoch_the_data_is_in():
    """A row's `epoch` (epochs done after the step: controller_actor, from the corpus's windows) is printed as the
    epoch being read and the fraction of it done."""
    from rich.console import Console

    from orchestrator.cli.tables import print_status

    st = {"job_id": "j", "status": "RUNNING", "message": "", "phase": "training", "events": [],
          "progress": {"step": 41, "loss": 2.5, "tokens_per_s": 1000.0, "mfu": None, "step_time_s": 0.5,
                       "restarts": 0, "steps": 100, "epoch": 2.25}}
    console = Console(record=True, width=200)
    print_status("j", st, console)
    assert "data: epoch 3, 25.0% of it read (2.250 epochs done)" in console.export_text()


def test_an_epoch_is_the_corpus_windows_of_every_shard(tmp_path):
    from workers.data_validation import corpus_windows

    (tmp_path / "a.bin").write_bytes(bytes(2 * (3 * 17 + 5)))  # uint16: 3 windows of 17 and a tail
    (tmp_path / "b.bin").write_bytes(bytes(2 * 16))  # shorter than a window
    assert corpus_windows("tokens", str(tmp_path), 16) == 3
    assert corpus_windows("synthetic", None, 16) is None


def test_status_says_what_a_re_plan_traded():
    """A re-plan event's choice (movement-aware: how much slower, how many fewer bytes) is
    printed under the event by `hetspot status`."""
    from rich.console import Console

    from orchestrator.cli.tables import print_status

    choice = ("candidate 2: 1.0% slower than candidate 1, no byte moved (0.0 MiB against 0.1 for candidate 1; "
              "within the 2% tolerance, runtime.replan_tolerance)")
    st = {"job_id": "j", "status": "RUNNING", "message": "", "phase": "training",
          "events": [{"kind": "re-plan", "at_step": 1, "cause": "step 2 failed: rank 0 died", "t_s": 3.0,
                      "plan_choice": {"choice": choice, "moved_mib": {"candidate 1": 0.1, "candidate 2": 0.0}}}]}
    console = Console(record=True, width=200)
    print_status("j", st, console)
    out = " ".join(console.export_text().split())
    assert "re-plan at step 1: step 2 failed" in out and "chose " + choice in out
