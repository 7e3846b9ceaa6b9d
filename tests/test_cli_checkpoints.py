"""`checkpoint:` bad input exits 2 before anything starts; `hetspot checkpoints list|verify|rm` on moto's S3 server."""

import json
import time

import boto3
import pytest
import torch
import yaml
from typer.testing import CliRunner

from orchestrator.cli.main import app
from orchestrator.state.s3_store import S3Checkpoints
from tests.moto_s3 import TEST_ENV, moto_s3
from tests.net import free_port

pytestmark = pytest.mark.unit
runner = CliRunner()
CREDS = TEST_ENV


@pytest.fixture(scope="module")
def endpoint():
    with moto_s3("jobs") as url:
        yield url


def _creds():
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


def _job(tmp_path, checkpoint: dict):
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "train": {"global_batch": 4},
                                 "cluster": {"nodes": [{"name": "a", "gpu_type": "T4", "num_gpus": 1}]},
                                 "checkpoint": checkpoint}))
    return f


def test_bad_checkpoint_sections_exit_2_before_anything_starts(tmp_path, endpoint, monkeypatch):
    import ray

    cases = [
        ({"uri": "s3:/jobs"}, CREDS, "field 'checkpoint.uri'", "s3://BUCKET/PREFIX"),
        ({"uri": "s3://jobs/x", "endpoint_url": "localhost:9"}, CREDS, "field 'checkpoint.endpoint_url'", "http://"),
        ({"uri": "s3://jobs/x", "endpoint_url": f"http://127.0.0.1:{free_port()}"}, CREDS,
         "checkpoint.endpoint_url: cannot reach the S3 endpoint", "check the URL"),
        ({"uri": "s3://no-such-bucket/x", "endpoint_url": endpoint}, CREDS, "bucket 'no-such-bucket' does not exist",
         "aws s3 mb s3://no-such-bucket"),
        ({"uri": "s3://jobs/x", "endpoint_url": endpoint}, {"AWS_EC2_METADATA_DISABLED": "true"},
         "no AWS credentials were found", "AWS_ACCESS_KEY_ID"),
        ({"uri": "s3://jobs/x", "keep": 0}, CREDS, "field 'checkpoint.keep'", "greater than or equal to 1"),
    ]
    for checkpoint, env, needle, fix in cases:
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws profile
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        res = runner.invoke(app, ["submit", str(_job(tmp_path, checkpoint))])
        assert res.exit_code == 2, (checkpoint, res.output)
        assert needle in res.output and fix in res.output and "Traceback" not in res.output, res.output
        assert "testing" not in res.output  # no credential in any message
        assert not ray.is_initialized()  # refused before any Ray cluster or worker started
        assert not ray.is_initialized()


def test_resume_and_existing_steps_are_checked(tmp_path, endpoint, monkeypatch):
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    job = _job(tmp_path, {"uri": "s3://jobs/resume-check", "endpoint_url": endpoint})
    res = runner.invoke(app, ["submit", str(job), "--resume"])
    assert res.exit_code == 2 and "--resume: no complete step under s3://jobs/resume-check" in res.output
    store = S3Checkpoints("s3://jobs/resume-check", client=boto3.client("s3", endpoint_url=endpoint, **_creds()))
    store.save(4, {"w": {"param": torch.ones(2), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}}, 5.0)
    res = runner.invoke(app, ["submit", str(job)])
    assert res.exit_code == 2 and "already holds steps (newest 4); pass --resume to go on from step 5" in res.output
    res = runner.invoke(app, ["submit", str(job), "--resume", "--steps", "5"])  # step 4 is the 5-step job's last
    assert res.exit_code == 2 and "already holds step 4, the job's last of 5; pass --steps above 5" in res.output


def test_checkpoints_list_verify_rm(endpoint, monkeypatch):
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    uri = "s3://jobs/cli"
    store = S3Checkpoints(uri, client=boto3.client("s3", endpoint_url=endpoint, **_creds()))
    for s in (1, 2):
        w = {"param": torch.full((4,), float(s)), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.ones(4)}
        store.save(s, {"w": w}, s)
    store.client.put_object(Bucket="jobs", Key=store._key(3, "units/w.safetensors"), Body=b"half")
    base = ["--endpoint-url", endpoint]
    res = runner.invoke(app, ["checkpoints", "list", uri, *base, "--json"])
    assert res.exit_code == 0, res.output
    assert [(r["step"], r["complete"]) for r in json.loads(res.stdout)] == [(3, False), (2, True), (1, True)]
    res = runner.invoke(app, ["checkpoints", "verify", uri, *base])
    assert res.exit_code == 0 and "step 2: ok" in res.stdout and "step 1: ok" in res.stdout
    key = store.manifest(2)["units"]["w"]["pieces"][0]["key"]
    data = bytearray(store.client.get_object(Bucket="jobs", Key=key)["Body"].read())
    data[-1] ^= 0xFF
    store.client.put_object(Bucket="jobs", Key=key, Body=bytes(data))
    res = runner.invoke(app, ["checkpoints", "verify", uri, *base, "--json"])
    assert res.exit_code == 1
    got = {r["step"]: r for r in json.loads(res.stdout)}
    assert not got[2]["ok"] and key in got[2]["problems"][0] and got[1]["ok"]
    res = runner.invoke(app, ["checkpoints", "rm", uri, *base, "--step", "2"])  # not a terminal: no silent delete
    assert res.exit_code == 2 and "pass --yes" in res.output and store.complete_steps() == [2, 1]
    assert runner.invoke(app, ["checkpoints", "rm", uri, *base, "--step", "2", "--yes"]).exit_code == 0
    assert store.complete_steps() == [1]
    res = runner.invoke(app, ["checkpoints", "rm", uri, *base])
    assert res.exit_code == 2 and "--step N or --all" in res.output
    res = runner.invoke(app, ["checkpoints", "rm", uri, *base, "--step", "9"])
    assert res.exit_code == 2 and "no step 9" in res.output
    res = runner.invoke(app, ["checkpoints", "rm", uri, *base, "--all", "--dry-run"])
    assert res.exit_code == 0 and "would delete 2 step(s)" in res.output and len(store.steps()) == 2
    assert runner.invoke(app, ["checkpoints", "rm", uri, *base, "--all", "--yes"]).exit_code == 0
    assert store.steps() == []
    res = runner.invoke(app, ["checkpoints", "list", "s3://no-such-bucket/x", *base])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_restore_from_flag_is_checked(tmp_path, endpoint):
    job = _job(tmp_path, {"uri": "s3://jobs/restore-from", "endpoint_url": endpoint})
    res = runner.invoke(app, ["submit", str(job), "--restore-from", "tape"])
    assert res.exit_code == 2 and "--restore-from 'tape': use nearest" in res.output and "Traceback" not in res.output
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump({k: v for k, v in yaml.safe_load(job.read_text()).items() if k != "checkpoint"}))
    res = runner.invoke(app, ["submit", str(bare), "--restore-from", "s3"])
    assert res.exit_code == 2 and "--restore-from needs a 'checkpoint:' section" in res.output


def _one_line(res) -> str:
    """The CLI's answer to a user mistake: one line (rich may fold it), no traceback."""
    assert "Traceback" not in res.output and "File \"" not in res.output, res.output
    text = " ".join(res.output.split())
    assert text, "said nothing"
    return text


def test_checkpoint_commands_answer_user_mistakes_in_one_line(tmp_path, endpoint, monkeypatch):
    """Each case exits 2 with one line, or 0 with a clear 'nothing found' line."""
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    base = ["--endpoint-url", endpoint]
    empty = "s3://jobs/nothing-here"
    cases = [  # (argv, exit code, what the line must say)
        (["checkpoints", "verify", empty, *base, "--step", "3"], 2, "no complete step 3 under s3://jobs/nothing-here/"),
        (["checkpoints", "verify", empty, "--endpoint-url", "ftp://127.0.0.1:1"], 2,
         "--endpoint-url 'ftp://127.0.0.1:1' must be an http:// or https:// URL"),
        (["checkpoints", "list", empty, "--endpoint-url", "ftp://x"], 2, "must be an http:// or https:// URL"),
        (["checkpoints", "verify", empty, *base], 0,
         "no complete steps under s3://jobs/nothing-here/: nothing to verify"),
        (["checkpoints", "list", empty, *base], 0, "no steps under s3://jobs/nothing-here/"),
        (["checkpoints", "rm", empty, *base, "--all", "--yes"], 0, "no steps under s3://jobs/nothing-here/: nothing"),
        (["deploy", "render", "--cloud", "aws", "--out", str(tmp_path / "missing" / "x.yaml")], 2,
         "does not exist; create it first"),
        (["deploy", "render", "--cloud", "aws", "--out", str(tmp_path)], 2, "is a directory; name the file"),
    ]
    for argv, code, needle in cases:
        res = runner.invoke(app, argv)
        assert res.exit_code == code, (argv, res.output)
        assert needle in _one_line(res), (argv, res.output)
    assert not (tmp_path / "missing").exists()


def test_checksum_error_says_what_was_read_and_what_the_manifest_says(endpoint):
    store = S3Checkpoints("s3://jobs/checksum", client=boto3.client("s3", endpoint_url=endpoint, **_creds()))
    store.save(1, {"w": {"param": torch.ones(4), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}}, 1.0)
    key = store.manifest(1)["units"]["w"]["pieces"][0]["key"]
    data = bytearray(store.client.get_object(Bucket="jobs", Key=key)["Body"].read())
    data[-1] ^= 0xFF  # same size, other bytes: the old message read "(N bytes, manifest says N)"
    store.client.put_object(Bucket="jobs", Key=key, Body=bytes(data))
    (problem,) = store.verify(1)
    assert "with SHA256" in problem and "the manifest says" in problem
    read, said = problem.split("the manifest says")
    assert read.split("SHA256 ")[1][:12] != said.split("SHA256 ")[1][:12]


def test_a_step_short_of_the_model_fails_verify_and_is_not_exported(tmp_path, endpoint, monkeypatch):
    """Verify exits 1 naming the missing units; export refuses with exit 2."""

    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    from planner.specs import ModelSpec
    from workers.model import all_params

    model = ModelSpec(name="m", num_layers=2, hidden_size=8, num_heads=2, vocab_size=16, seq_len=4)
    store = S3Checkpoints("s3://jobs/half", client=boto3.client("s3", endpoint_url=endpoint, **_creds()))
    units = {p.name: list(p.shape) for p in all_params(model)}
    kept = sorted(units)[:3]  # what two surviving keepers held
    zeros = {n: {k: torch.zeros(units[n]) for k in ("param", "exp_avg", "exp_avg_sq")} for n in kept}
    pieces = {n: [store.put_piece(4, n, tuple((0, d) for d in units[n]), zeros[n])] for n in kept}
    manifest = {"format": "hetspot-checkpoint/2", "step": 4, "optimizer_steps": 5.0, "written_at": time.time(),
                "meta": {"job": "half", "model": model.model_dump()},  # format 2: the model names the units
                "units": {n: {"shape": units[n], "pieces": pieces[n], "bytes": pieces[n][0]["bytes"]} for n in kept}}
    store.client.put_object(Bucket="jobs", Key=store.manifest_key(4), Body=json.dumps(manifest).encode())
    res = runner.invoke(app, ["checkpoints", "verify", "s3://jobs/half", "--endpoint-url", endpoint])
    assert res.exit_code == 1, res.output
    missing = sorted(set(units) - set(kept))
    assert f"lacks {len(missing)} of the model's {len(units)} units" in res.output
    assert all(n in res.output for n in missing)
    res = runner.invoke(app, ["checkpoints", "export", "s3://jobs/half", "--endpoint-url", endpoint,
                              "--out", str(tmp_path / "hf")])
    assert res.exit_code == 2 and "is not whole" in _one_line(res) and not (tmp_path / "hf").exists()


def test_a_prefix_holding_another_jobs_steps_is_refused(tmp_path, endpoint, monkeypatch):
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    store = S3Checkpoints("s3://jobs/taken", client=boto3.client("s3", endpoint_url=endpoint, **_creds()))
    store.save(2, {"w": {"param": torch.ones(2), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}}, 3.0,
               {"job": "someone-else"})
    job = _job(tmp_path, {"uri": "s3://jobs/taken", "endpoint_url": endpoint})
    for extra in ([], ["--resume"]):
        res = runner.invoke(app, ["submit", str(job), *extra])
        text = _one_line(res)
        assert res.exit_code == 2, res.output
        assert "holds steps of job 'someone-else' (newest 2), not of 'hetspot-job'" in text, text
        assert "give this job its own prefix (s3://jobs/hetspot-job)" in text
