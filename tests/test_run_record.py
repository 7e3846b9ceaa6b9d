"""The run record (orchestrator/runtime/run_record.py): what a job leaves for a user, read by `hetspot status` and
`hetspot plot` without the cluster; in a local folder and in S3 (moto's server), and from a real job on the
embedded cluster."""

import json

import pytest
from typer.testing import CliRunner

from orchestrator.cli.main import app
from orchestrator.runtime.run_record import CHUNK, RECORD, RunRecordWriter, read_record, read_steps
from tests.moto_s3 import moto_s3, use_test_credentials

runner = CliRunner()
JOB = {"name": "rec", "model": {"preset": "tiny"}, "train": {"global_batch": 8}, "steps": 2500}


def _row(s: int, loss: float) -> dict:
    """A committed step's row as the controller gives it (the job's length is the record's, not the row's: a
    `steps` key here once hid a KeyError of `status` on every real local record)."""
    return {"step": s, "loss": loss, "tokens_per_s": 1000.0 + s, "step_time_s": 0.5, "mfu": None, "restarts": 1,
            "peer_step": max(s - 2, 0)}


def write_run(location: str, steps: int, endpoint: str | None = None, clock=None) -> RunRecordWriter:
    """`steps` committed steps with a loss at step 10 (steps 8 and 9 redone after a re-plan); flushed at the end."""
    t = [0.0]
    w = RunRecordWriter(location, JOB, "rec-1", 2500, endpoint, flush_every_s=1e9, clock=clock or (lambda: t[0]))
    w.plan({"pipelines": []}, 0)
    events: list[dict] = []
    for s in range(steps):
        if s == 10:
            events = [{"kind": "re-plan", "cause": "node lost", "at_step": 9, "t_s": 5.2, "detected_s": 5.1}]
            w.update([_row(8, 9.0), _row(9, 8.9)], events, "recovering", None, 5.3)  # redone after a rollback
            w.plan({"pipelines": [1]}, 8)
        w.update([_row(s, 10.0 - s / steps)], events, "training", None, 0.5 * s + (1.0 if s >= 10 else 0.0),
                 "training")
    w.update([], events, "done", None, 0.5 * steps + 1.0, "done")
    return w


@pytest.mark.unit
def test_a_local_run_record_holds_steps_events_plans_and_a_summary(tmp_path):
    where = str(tmp_path / "rec-1")
    write_run(where, 2500)
    rec = read_record(where)
    assert rec["state"] == "done" and rec["job"] == JOB and [p["from_step"] for p in rec["plans"]] == [0, 8]
    assert rec["events"][0]["kind"] == "re-plan" and rec["progress"]["step"] == 2499
    s = rec["summary"]
    assert s["committed_steps"] == 2500 and s["lost_steps"] == 2 and s["re_plans"] == 1 and s["eta_s"] is None
    assert 0 < s["goodput"] <= 1 and s["recovering_s"] > 0
    rows = read_steps(where, rec)
    assert [r["step"] for r in rows] == list(range(2500))  # three chunks, each step once, redone ones replaced
    assert sorted(p.name for p in (tmp_path / "rec-1").iterdir()) == [RECORD] + [
        f"steps-{c:010d}.jsonl" for c in range(0, 2500, CHUNK)]


@pytest.mark.unit
def test_status_reads_the_same_record_for_20_steps_as_for_2000():
    """`hetspot status` on a run record reads one object (record.json), of a size set by the events, not the
    steps: a job of 2,000 committed steps costs what one of 20 does."""
    use_test_credentials()
    with moto_s3("runs") as url:
        sizes, gets = {}, {}
        for steps in (20, 2000):
            where = f"s3://runs/job-{steps}/runs/rec-1"
            write_run(where, steps, url)
            from orchestrator.state.s3_store import new_client

            client = new_client(url)
            sizes[steps] = client.head_object(Bucket="runs", Key=f"job-{steps}/runs/rec-1/{RECORD}")["ContentLength"]
            import orchestrator.state.s3_store as store

            counted = []
            real = store.new_client

            def counting(endpoint_url=None, config=None, real=real, counted=counted):
                c = real(endpoint_url, config)
                c.meta.events.register("before-call.s3.GetObject", lambda **kw: counted.append(1))
                return c

            store.new_client = counting
            try:
                res = runner.invoke(app, ["status", where, "--endpoint-url", url, "--json"])
            finally:
                store.new_client = real
            assert res.exit_code == 0, res.output
            assert json.loads(res.stdout)["summary"]["committed_steps"] == steps
            gets[steps] = len(counted)
        assert gets == {20: 1, 2000: 1}
        assert abs(sizes[2000] - sizes[20]) < 64, sizes  # digits of the step numbers, no more


@pytest.mark.unit
def test_status_history_and_plot_from_a_run_record(tmp_path):
    pytest.importorskip("matplotlib")
    where = str(tmp_path / "rec-1")
    write_run(where, 30)
    res = runner.invoke(app, ["status", where, "--history"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "peer copies: step 27 (2 steps old)" in out  # the newest row's peer_step (write_run: two behind)
    assert "step 30/2500: loss" in out  # the job's length from the record's summary
    assert "30 steps committed, 2470 left" in out and "2 steps redone" in out and "re-plan at step 9" in out
    assert "committed steps" in out and "9.9667" in out  # the history table: step 1's loss
    res = runner.invoke(app, ["status", where, "--history", "--json"])
    assert [r["step"] for r in json.loads(res.stdout)["history"]] == list(range(30))
    png = tmp_path / "loss.png"
    res = runner.invoke(app, ["plot", where, "-o", str(png)])
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.unit
@pytest.mark.parametrize("args,words", [
    (["plot", "hetspot-runs/no-such-run", "-o", "x.png"], ["hetspot-runs/no-such-run", "no run record there"]),
    (["plot", "job-without-slash", "-o", "x.png"], ["not a run record", "--address"]),
    (["status", "hetspot-runs/no-such-run", "--history"], ["no run record there"]),
])
def test_a_missing_run_exits_2_in_one_line(tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    for var in ("HETSPOT_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    msg = " ".join(res.output.split())
    assert all(w in msg for w in words), msg
    assert not (tmp_path / "x.png").exists()


@pytest.mark.unit
def test_status_history_of_a_job_without_a_readable_record_exits_2(monkeypatch):
    from orchestrator.runtime import ray_jobs

    class NoRecord:
        def __init__(self, *args, **kwargs):
            pass

        def status(self, job_id, endpoint_url=None):
            return {"job_id": job_id, "status": "RUNNING", "message": "", "progress": None, "phase": None,
                    "events": []}

    monkeypatch.setattr(ray_jobs, "RayJobs", NoRecord)
    res = runner.invoke(app, ["status", "hetspot-x-1", "--history", "--address", "http://127.0.0.1:1"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "--history: job hetspot-x-1 has no run record" in " ".join(res.output.split())
    res = runner.invoke(app, ["plot", "hetspot-x-1", "-o", "x.png", "--address", "http://127.0.0.1:1"])
    assert res.exit_code == 2 and "hetspot-x-1: this job has no run record" in " ".join(res.output.split())


@pytest.mark.ray
def test_a_job_leaves_a_run_record_in_s3_that_status_and_plot_read_after_the_cluster_is_gone(tmp_path):
    """A local submit with a checkpoint in S3 (moto): once it is done and its cluster shut down, `hetspot status`
    and `hetspot plot` read its run record from S3, as another machine would."""
    pytest.importorskip("matplotlib")
    import yaml

    from orchestrator import api

    use_test_credentials()
    with moto_s3("ckpt") as url:
        job = {"name": "recorded", "model": {"preset": "tiny"}, "train": {"global_batch": 8, "precision": "fp32"},
               "cluster": {"nodes": [{"name": "a", "gpu_type": "L4", "num_gpus": 1}]},
               "runtime": {"emulate_speed": False, "snapshot_every": 1},
               "checkpoint": {"uri": "s3://ckpt/recorded", "endpoint_url": url, "s3_every": 2}, "steps": 4}
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(job))
        result = api.submit_local(path)
        where = result["run_record"]
        assert where.startswith("s3://ckpt/recorded/runs/recorded-")
        res = runner.invoke(app, ["status", where, "--endpoint-url", url, "--history", "--json"])
        assert res.exit_code == 0, res.output
        st = json.loads(res.stdout)
        assert st["status"] == "done" and [r["step"] for r in st["history"]] == [0, 1, 2, 3]
        assert [r["loss"] for r in st["history"]] == result["losses"]
        assert st["summary"]["committed_steps"] == 4 and st["summary"]["lost_steps"] == 0
        res = runner.invoke(app, ["plot", where, "--endpoint-url", url, "-o", str(tmp_path / "loss.png")])
        assert res.exit_code == 0 and (tmp_path / "loss.png").stat().st_size > 10_000, res.output
        from orchestrator.state.s3_store import S3Checkpoints

        assert S3Checkpoints("s3://ckpt/recorded", url).complete_steps() == [3, 1]  # the record is not a step
