"""`hetspot plan`: tables, --json, and bad input with exit code 2 and no traceback."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli.main import app

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

JOB = {
    "name": "t",
    "model": {"preset": "gpt-350m"},
    "train": {"global_batch": 32},
    "cluster": {"nodes": [
        {"name": "a", "gpu_type": "A100-80GB", "num_gpus": 2, "price_per_hour": 8.0},
        {"name": "l", "gpu_type": "L4", "num_gpus": 4, "price_per_hour": 1.4},
    ]},
}


def _write(tmp_path, data) -> str:
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(f)


def test_plan_json_has_plan_estimate_baselines(tmp_path):
    res = runner.invoke(app, ["plan", _write(tmp_path, JOB), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) >= {"plan", "estimate", "baselines"}
    assert sum(p["num_samples"] for p in out["plan"]["pipelines"]) == 32
    assert set(out["baselines"]) == {"megatron-symmetric", "data-parallel+offload", "best-homogeneous"}
    assert out["estimate"]["cost_per_mtok"] > 0
    for b in out["baselines"].values():
        assert b is None or b["speedup"] >= 1.0 - 1e-9  # never below a baseline


def test_plan_table_for_people(tmp_path):
    res = runner.invoke(app, ["plan", _write(tmp_path, JOB)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for text in ("pipe", "A100-80GB", "L4", "Estimate", "tokens/s", "megatron-symmetric", "speedup"):
        assert text in res.stdout


BAD = [
    ({**JOB, "trian": {"global_batch": 8}}, "trian"),
    ({**JOB, "cluster": {"nodes": [{"name": "a", "gpu_type": "Q9000", "num_gpus": 1}]}}, "unknown GPU type"),
    ({**JOB, "model": {"name": "x", "num_layers": 2, "hidden_size": 16384, "num_heads": 64, "vocab_size": 32000,
                       "seq_len": 131072},
      "cluster": {"nodes": [{"name": "t", "gpu_type": "T4", "num_gpus": 1}]}}, "does not fit"),
    ("model: {preset: tiny\n", "not valid YAML"),
    ({**JOB, "train": {"global_batch": 0}}, "train.global_batch"),
    ({**JOB, "cluster": None}, "no 'cluster:' section"),
]


@pytest.mark.parametrize("data,needle", BAD)
def test_bad_input_exit_2_no_traceback(tmp_path, data, needle):
    res = runner.invoke(app, ["plan", _write(tmp_path, data)])
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert "Traceback" not in res.output


def test_real_console_script_bad_input(tmp_path):
    exe = Path(sys.executable).parent / "hetspot"
    res = subprocess.run([str(exe), "plan", str(tmp_path / "nope.yaml")], capture_output=True, text=True)
    assert res.returncode == 2
    assert "does not exist" in res.stderr and "Traceback" not in res.stderr


def test_objective_cost_needs_prices(tmp_path):
    job = {**JOB, "cluster": {"nodes": [{"name": "a", "gpu_type": "A100-80GB", "num_gpus": 2}]}}
    res = runner.invoke(app, ["plan", _write(tmp_path, job), "--objective", "cost"])
    assert res.exit_code == 2 and "price_per_hour" in res.output


@pytest.mark.parametrize("columns", ["80", None])
def test_mixed_cluster_plan_is_never_cut_when_piped_or_narrow(columns):
    """Piped (no terminal) or at COLUMNS=80, no cell is cut with an ellipsis; offload cells are compact
    and their reasons are numbered notes under the table."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | ({"COLUMNS": columns} if columns else {})
    hetspot = str(Path(sys.executable).parent / "hetspot")
    r = subprocess.run([hetspot, "plan", str(ROOT / "examples/mixed-cluster.yaml")], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout, r.stdout
    assert "opt→host" in r.stdout or "rc " in r.stdout or "none" in r.stdout
    if "[1]" in r.stdout:  # a reason cited in a cell is printed once below the table
        assert "\n[1] " in r.stdout
    if columns == "80":  # the tables fit and no name is broken mid-word
        assert max(len(line) for line in r.stdout.splitlines()) <= 80
        assert "A100-80GB" in r.stdout and "a100-0" in r.stdout


def test_the_fleet_table_fits_80_columns_without_breaking_an_instance_type():
    """At 80 columns the fleet choice's table wraps cells between words, so an instance type such as
    g4dn.12xlarge is printed whole."""
    res = runner.invoke(app, ["plan", str(ROOT / "examples/risk-cost.yaml"), "--fleet", "auto", "--catalog",
                              str(ROOT / "examples/catalog-aws.yaml")], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.stdout.splitlines()) <= 80
    for name in ("g6.xlarge", "g6e.12xlarge", "g4dn.12xlarge"):
        assert name in res.stdout, res.stdout


def test_one_name_per_knob_the_old_spelling_is_read_with_a_warning(tmp_path):
    """checkpoint.peer_every, the previous release's name of runtime.snapshot_every, is read for one release with
    a FutureWarning naming the new spelling; both given and different is refused (exit 2, naming both)."""
    from orchestrator.job_spec import parse_job

    old = {**JOB, "checkpoint": {"uri": "s3://bucket/j", "peer_every": 2, "s3_every": 4}}
    with pytest.warns(FutureWarning, match="runtime: {snapshot_every: 2}"):
        job = parse_job(old)
    assert job.runtime.snapshot_every == 2 and job.checkpoint.s3_every == 4
    both = {**old, "runtime": {"snapshot_every": 3}}
    with pytest.warns(FutureWarning, match="peer_every"):  # read, warned about, then refused
        res = runner.invoke(app, ["plan", _write(tmp_path, both)])
    assert res.exit_code == 2 and "checkpoint.peer_every is the old name of runtime.snapshot_every" in res.output
    # what a user sees: one line naming the file and the field, no library internals
    import subprocess
    import sys
    from pathlib import Path

    path = _write(tmp_path, old)
    r = subprocess.run([str(Path(sys.executable).with_name("hetspot")), "plan", path, "--json"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"warning: {path}: checkpoint.peer_every is now runtime.snapshot_every"), lines
    assert "pydantic" not in r.stderr and ".py:" not in r.stderr


def test_s3_every_counts_steps_and_must_fall_on_snapshots(tmp_path):
    bad = {**JOB, "runtime": {"snapshot_every": 5}, "checkpoint": {"uri": "s3://bucket/j", "s3_every": 12}}
    res = runner.invoke(app, ["plan", _write(tmp_path, bad)])
    assert res.exit_code == 2 and "checkpoint.s3_every (12) counts steps" in res.output and "use 10" in res.output
    assert "Traceback" not in res.output


def test_version_and_short_help():
    from importlib.metadata import version

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"hetspot {version('hetspot')}"
    for args in (["-h"], ["plan", "-h"], ["submit", "-h"]):
        res = runner.invoke(app, args, prog_name="hetspot")
        assert res.exit_code == 0 and "Usage: hetspot" in res.output, (args, res.output)


def test_address_comes_from_the_environment_flags_win_and_a_missing_one_exits_2(monkeypatch, tmp_path):
    import re

    from orchestrator import api

    raw = runner.invoke(app, ["status", "-h"], prog_name="hetspot", terminal_width=200).output
    out = " ".join(re.sub(r"[│╭╮╰╯─]", " ", raw).split())
    assert "env var: HETSPOT_ADDRESS, RAY_API_SERVER_ADDRESS" in out, out
    assert "[required]" not in out.split("--address <str>")[1].split(" --")[0], out  # the job id is; not this
    for var in ("HETSPOT_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    res = runner.invoke(app, ["status", "job-1"])
    assert res.exit_code == 2 and "--address is needed" in res.output and "Traceback" not in res.output
    seen = []
    monkeypatch.setattr(api, "inventory", lambda *a: seen.append(a) or {"nodes": [], "gpus_by_type": {}})
    monkeypatch.setenv("HETSPOT_ADDRESS", "http://head:8265")
    runner.invoke(app, ["inventory", "--job", "job.yaml", "--json"])
    runner.invoke(app, ["inventory", "--json"])
    runner.invoke(app, ["inventory", "--address", "http://other:8265", "--json"])
    assert [a[:2] for a in seen] == [(None, "job.yaml"), ("http://head:8265", None), ("http://other:8265", None)]


def test_help_does_not_import_the_planner():
    """`hetspot --help` stays quick: the planner (and its pydantic models) load only for a command that plans."""
    code = ("import sys; sys.argv = ['hetspot', '--help']\nfrom orchestrator.cli.main import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('PLANNER', sorted(m for m in sys.modules if m == 'planner' or m.startswith('planner.')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "PLANNER []", r.stdout[-500:]


def test_the_cost_objective_compares_dollars_per_million_tokens():
    """Under --objective cost the baselines are compared on what the objective weighs ($ per million tokens),
    not tokens/s, and the plan chosen for cost is no dearer than any baseline under the same cost model."""
    job = str(ROOT / "examples" / "risk-cost.yaml")
    res = runner.invoke(app, ["plan", job, "--objective", "cost", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    mine = out["estimate"]["cost_per_mtok"]
    fits = {n: b for n, b in out["baselines"].items() if b is not None}
    assert out["objective"] == "cost" and fits
    for name, b in fits.items():
        assert mine <= b["estimate"]["cost_per_mtok"] * (1 + 1e-9), (name, mine, b["estimate"]["cost_per_mtok"])
    table = " ".join(runner.invoke(app, ["plan", job, "--objective", "cost"], terminal_width=200).output.split())
    assert "$ per M tokens" in table and "hetspot saves" in table and "hetspot speedup" not in table
    assert f"${mine:.4f}" in table


def test_stop_reports_as_json(monkeypatch):
    from orchestrator.runtime import ray_jobs

    class FakeJobs:
        def __init__(self, *a, **kw):
            pass

        def stop(self, job_id):
            return job_id == "running-1"

    monkeypatch.setattr(ray_jobs, "RayJobs", FakeJobs)
    for job_id, stopped in (("running-1", True), ("done-2", False)):
        res = runner.invoke(app, ["stop", job_id, "--address", "http://127.0.0.1:1", "--json"])
        assert res.exit_code == 0 and json.loads(res.output) == {"job_id": job_id, "stopped": stopped}


_UNSET_DURING_PARSE = """
import os, sys
import numpy  # noqa: F401 (its import puts and unsets OPENBLAS_MAIN_FREE through os.putenv, outside os.environ)
from typer.testing import CliRunner
from orchestrator.cli.main import app
unset = []
sys.addaudithook(lambda event, args: unset.append(os.fsdecode(args[0])) if event == "os.unsetenv" else None)
CliRunner().invoke(app, ["plan", "examples/mixed-cluster.yaml"])
print(sorted(set(unset)))
"""


def test_no_environment_variable_vanishes_while_the_cli_parses():
    """typer adds PYDANTIC_DISABLE_PLUGINS while it parses and deletes it after, where it was unset: a thread that
    reads the whole environment meanwhile (botocore does, on each new client) fails with KeyError (a killer thread in
    tests/test_resume_and_lost_controller.py did, in CI). tests/conftest.py sets it beforehand; then no variable is
    deleted (Python's audit event os.unsetenv), and without it one is, which shows the guard is needed."""
    for guarded in (False, True):
        env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
        if guarded:
            env["PYDANTIC_DISABLE_PLUGINS"] = os.environ["PYDANTIC_DISABLE_PLUGINS"]
        out = subprocess.run([sys.executable, "-c", _UNSET_DURING_PARSE], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        unset = ast.literal_eval(out.stdout.strip().splitlines()[-1])
        assert unset == ([] if guarded else ["PYDANTIC_DISABLE_PLUGINS"]), (guarded, unset)
