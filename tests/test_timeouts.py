"""The controller's waits on its workers are job fields (runtime.timeouts), documented, with the defaults the code
used to hold as literals, and they reach the worker group and the workers' own config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.job_spec import JobSpec, TimeoutSpec

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
JOB = {"model": {"preset": "tiny"}, "train": {"global_batch": 8},
       "cluster": {"nodes": [{"name": "a", "gpu_type": "A100-80GB", "num_gpus": 2}]}}


def test_defaults_are_the_waits_the_code_held():
    t = JobSpec.model_validate(JOB).runtime.timeouts
    assert (t.startup_s, t.commit_s, t.control_s, t.hand_over_s, t.transfer_s) == (120, 60, 60, 30, 300)


def test_every_timeout_is_documented_in_the_job_file_reference():
    doc = (ROOT / "docs/jobfile.md").read_text()
    for name, f in TimeoutSpec.model_fields.items():
        row = re.search(rf"^\| `timeouts\.{name}` \| (\S+) \|", doc, re.M)
        assert row, f"docs/jobfile.md has no row for runtime.timeouts.{name}"
        assert float(row.group(1)) == f.default, name


def test_a_job_files_timeouts_reach_the_worker_group_and_the_workers():
    from orchestrator.runtime.plan_run import PlanRun, worker_config
    from planner import ClusterSpec
    from planner.search import Planner

    job = JobSpec.model_validate(JOB | {"runtime": {"timeouts": {"transfer_s": 900, "control_s": 7}}})
    plan = Planner(job.model_spec, job.train).plan(ClusterSpec.model_validate(JOB["cluster"]))
    run = PlanRun(job, plan)
    assert run.timeouts.transfer_s == 900 and run.timeouts.control_s == 7 and run.timeouts.startup_s == 120
    config = worker_config(job)
    assert (config.transfer_timeout_s, config.control_timeout_s) == (900, 7)
