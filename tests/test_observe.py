"""Metrics rows, profiling calibration, token resolution and progress parsing: pure pieces."""

import json

import pytest

from orchestrator.cluster.profiling import Measurement, calibration, measure
from orchestrator.errors import ConfigError
from orchestrator.runtime.metrics import step_row
from orchestrator.runtime.progress_lines import last_progress
from orchestrator.runtime.ray_jobs import _redact, dashboard_url, resolve_token
from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec, plan
from planner.cost import model_flops_per_sample
from planner.cost import plan_peak_flops as fleet_peak_flops

pytestmark = pytest.mark.unit


def test_step_row_mfu_is_model_flops_over_fleet_peak():
    cluster = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100-80GB", num_gpus=2),
                                 NodeSpec(name="b", gpu_type="T4", num_gpus=1)])
    model = ModelSpec.preset("gpt-125m")
    p = plan(cluster, model, TrainSpec(global_batch=32))
    used = {d for d in p.devices()}
    peak = sum((312e12 if d.startswith("a/") else 65e12) for d in used)
    assert fleet_peak_flops(p) == pytest.approx(peak)
    row = step_row(model, p, 7, 2.5, 0.5, 123, 1)
    assert row["tokens_per_s"] == pytest.approx(32 * model.seq_len / 0.5)
    assert row["mfu"] == pytest.approx(model_flops_per_sample(model) * 32 / 0.5 / peak)
    assert (row["step"], row["loss"], row["device_memory_bytes"], row["restarts"]) == (7, 2.5, 123, 1)


def test_calibration_is_measured_over_peak_and_clamped():
    ms = [Measurement("A100-80GB", 156.0, 20.0, 20.0, "cuda"), Measurement("T4", 500.0, None, None, "cuda")]
    assert calibration(ms) == {"A100-80GB": 0.5, "T4": 1.0}
    ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100-80GB", num_gpus=1)], calibration=calibration(ms))


def test_measure_runs_on_cpu():
    m = measure("A100-80GB", device="cpu", n=128, repeats=2)
    assert m.matmul_tflops > 0 and m.h2d_gb_s is None and m.device == "cpu"


def test_token_sources_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    assert resolve_token() == (None, "none")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("home-token\n")
    assert resolve_token() == ("home-token", "~/.ray/auth_token")
    other = tmp_path / "other"
    other.write_text("path-token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(other))
    assert resolve_token()[0] == "path-token"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "env-token")
    assert resolve_token()[0] == "env-token"
    flag = tmp_path / "flag"
    flag.write_text("flag-token")
    assert resolve_token(str(flag)) == ("flag-token", "--token-file")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_token(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="empty"):
        resolve_token(str(tmp_path / "empty"))


def test_bad_addresses_fail_fast_with_the_fix():
    with pytest.raises(ConfigError, match="dashboard URL"):
        dashboard_url("ftp://x")
    with pytest.raises(ConfigError, match="cannot reach the Ray dashboard"):
        dashboard_url("127.0.0.1:1")


def test_last_progress_and_redaction():
    logs = "\n".join(["noise", "hetspot-progress " + json.dumps({"step": 0}), "(Worker) x",
                      "hetspot-progress " + json.dumps({"step": 1}), "hetspot-progress {broken"])
    assert last_progress(logs) == {"step": 1}
    assert last_progress("nothing") is None
    assert _redact("bad token s3cr3t in Bearer s3cr3t", {"Authorization": "Bearer s3cr3t"}).count("s3cr3t") == 0


def test_progress_rows_survive_another_threads_output_on_their_line():
    """Ray forwards workers' lines into the driver's log from another thread: one may stand before a progress line
    or follow its JSON on the same line (a CI run saw the latter). Every row is still read, once, in order."""
    from orchestrator.runtime.progress_lines import progress_rows

    row = lambda s: "hetspot-progress " + json.dumps({"step": s, "loss": 1.5})  # noqa: E731
    logs = "\n".join([row(0) + "(worker node=n rank=0) step 0: 8 samples", "(worker) partial" + row(1), row(2),
                      "hetspot-progress {broken", "(worker) no newline" + row(3) + row(4), "noise"])
    assert [r["step"] for r in progress_rows(logs)] == [0, 1, 2, 3, 4]
    assert last_progress(row(3) + " trailing text") == {"step": 3, "loss": 1.5}


def test_worker_line_copies_are_dropped_once_each():
    from orchestrator.runtime.progress_lines import dedupe_worker_lines

    w = "(TrainWorker pid=7) 2026-11-23 10:00:00,123 INFO hetspot.worker node=a rank=0 step 1\n"
    other = "(TrainWorker pid=8) 2026-11-23 10:00:00,123 INFO hetspot.worker node=b rank=1 step 1\n"
    text = "hetspot-progress {}\n" + w + other + w + other + "hetspot-progress {}\n"
    assert dedupe_worker_lines(text) == "hetspot-progress {}\n" + w + other + "hetspot-progress {}\n"
    seen: set[str] = set()
    assert dedupe_worker_lines(w, seen) == w and dedupe_worker_lines(w + other, seen) == other


@pytest.mark.unit
def test_the_grafana_dashboard_draws_every_shipped_series_and_no_other():
    """docs/grafana-hetspot.json: every metric an expression names is one hetspot exports (with Ray's `ray_`
    prefix; a histogram's _bucket/_count/_sum), and every exported series is drawn somewhere."""
    import json
    import re
    from pathlib import Path

    from orchestrator.runtime.metrics import GAUGES, RECOVERY, STAGE_GAUGES

    dash = json.loads((Path(__file__).resolve().parents[1] / "docs" / "grafana-hetspot.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    named = {re.sub(r"_(bucket|count|sum)$", "", m) for e in exprs for m in re.findall(r"ray_hetspot_[a-z_]+", e)}
    shipped = {f"ray_{n}" for n, _ in [*GAUGES.values(), *STAGE_GAUGES.values(), RECOVERY]}
    assert named == shipped, (named ^ shipped)
    assert all('job=~"$job"' in e for e in exprs)


@pytest.mark.unit
def test_stage_series_label_each_stage_and_recoveries_are_timed_once_each():
    from orchestrator.runtime.metrics import recovery_seconds, stage_series
    from orchestrator.runtime.plan_run import stage_rows
    from planner import Pipeline, Plan, Stage
    from planner.layout import ranks

    plan = Plan(model_name="m", num_layers=4, global_batch=8, pipelines=[Pipeline(
        num_samples=8, micro_batch_size=4, num_micro_batches=2, stages=[
            Stage(layer_start=0, layer_end=2, gpu_type="A100-80GB", node="a", devices=["a/0", "a/1"]),
            Stage(layer_start=2, layer_end=4, gpu_type="T4", node="t", devices=["t/0"])])])
    rows = stage_rows(plan, ranks(plan), [0.2, 0.3, 0.9], [10, 30, 20])
    assert rows == [{"pipeline": 0, "stage": 0, "gpu_type": "A100-80GB", "node": "a", "time_s": 0.3,
                     "memory_bytes": 30},
                    {"pipeline": 0, "stage": 1, "gpu_type": "T4", "node": "t", "time_s": 0.9, "memory_bytes": 20}]
    series = stage_series({"stages": rows})
    assert ("time_s", {"pipeline": "0", "stage": "1", "gpu_type": "T4", "node": "t"}, 0.9) in series
    events = [{"kind": "re-plan", "detected_s": 10.0}, {"kind": "restore"},
              {"kind": "drain", "stall_s": 0.4}, {"kind": "drain"}]  # the last one not switched yet
    assert recovery_seconds(events, 12.5) == [(0, "re-plan", 2.5), (2, "drain", 0.4)]
