"""`hetspot simulate --jobs`: several jobs on one fleet over a trace of arrivals and preemptions, first come first
served against the fleet's share chosen for weighted throughput (orchestrator/drills/jobs_sim.py). Pure: no Ray."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.drills.jobs_sim import JobsSim, load_jobs
from orchestrator.drills.recovery_model import Assumptions
from orchestrator.drills.trace import parse_trace
from planner import ClusterSpec, NodeSpec

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent
HETSPOT = str(Path(sys.executable).parent / "hetspot")
FLEET = ClusterSpec(nodes=[NodeSpec(name=f"l4-{i}", gpu_type="L4", num_gpus=1, inter_node_bw_gb_s=3)
                           for i in range(4)])


def trace(*lines) -> object:
    return parse_trace("\n".join(json.dumps(x) for x in lines), "test")


STEADY = trace([0, "add", {"nodes": ["node-0", "node-1", "node-2", "node-3"], "duration": 3_600_000}])


def jobs_file(tmp_path, *jobs) -> Path:
    import yaml

    p = tmp_path / "jobs.yaml"
    p.write_text(yaml.safe_dump({"jobs": list(jobs)}))
    return p


def test_one_job_alone_trains_at_its_rate_after_its_start_up(tmp_path):
    """The replay's arithmetic: one job on a steady fleet trains at the planner's rate for the whole fleet from
    its start-up on; both policies give it every node, and it finishes when its tokens are done."""
    (job,) = load_jobs(jobs_file(tmp_path, {"name": "a", "arrive_min": 0, "model": "gpt-350m", "global_batch": 64,
                                            "tokens": 100.0}))
    a = Assumptions(startup_s=10.0)
    sim = JobsSim(STEADY, FLEET, [job], a)
    out = sim.run()
    rate = sim.norm["a"]
    for p in out["policies"].values():
        assert p["jobs"]["a"]["tokens"] == pytest.approx(rate * (3600 - 10.0), rel=1e-9)
        assert p["weighted_goodput"] == pytest.approx((3600 - 10.0) / 3600, rel=1e-9) and p["moves"] == 1
    short = job.__class__(**(job.__dict__ | {"tokens": rate * 600}))
    done = JobsSim(STEADY, FLEET, [short], a).run()["policies"]["fcfs"]["jobs"]["a"]
    assert done["finished_min"] == pytest.approx((10 + 600) / 60) and done["done"] == pytest.approx(1.0)


def test_the_share_gives_a_later_job_of_higher_priority_gpus_that_first_come_first_served_keeps_from_it(tmp_path):
    """A long job takes the whole fleet; a short job of priority 3 arrives ten minutes later. First come first
    served lets it wait behind the long one for the hour; the share gives it nodes at once (its weight is 4), it
    finishes, and the weighted goodput is higher. The long job keeps nodes meanwhile and trains on."""
    jobs = load_jobs(jobs_file(
        tmp_path, {"name": "long", "arrive_min": 0, "model": "gpt-350m", "global_batch": 64, "tokens": 1000.0},
        {"name": "urgent", "arrive_min": 10, "model": "gpt-350m", "global_batch": 64, "tokens": 0.05,
         "priority": 3}))
    out = JobsSim(STEADY, FLEET, jobs, Assumptions(startup_s=10.0)).run()["policies"]
    assert out["fcfs"]["jobs"]["urgent"]["tokens"] == 0 and out["fcfs"]["jobs"]["urgent"]["waited_min"] > 49
    assert out["share"]["jobs"]["urgent"]["finished_min"] is not None, out["share"]
    assert out["share"]["jobs"]["urgent"]["waited_min"] < 0.1
    assert out["share"]["weighted_goodput"] > out["fcfs"]["weighted_goodput"]
    assert 0 < out["share"]["jobs"]["long"]["tokens"] < out["fcfs"]["jobs"]["long"]["tokens"]


def test_a_preemption_moves_the_nodes_left_and_a_lost_job_waits(tmp_path):
    """Two nodes go mid-trace: each policy's jobs lose what they held there and train on (or wait) with what is
    left; no job trains on a node that is down (its rate drops with the nodes)."""
    t = trace([0, "add", {"nodes": ["node-0", "node-1", "node-2", "node-3"], "duration": 1_800_000}],
              [1_800_000, "remove", {"nodes": ["node-2", "node-3"], "duration": 1_800_000}])
    jobs = load_jobs(jobs_file(
        tmp_path, {"name": "a", "arrive_min": 0, "model": "gpt-350m", "global_batch": 64, "tokens": 1000.0}))
    sim = JobsSim(t, FLEET, jobs, Assumptions(startup_s=10.0, reform_s=1.0, detect_s=0.5))
    out = sim.run()["policies"]
    half = sim.rates.tps("a", {"l4-0", "l4-1"})
    want = sim.norm["a"] * (1800 - 10) + half * (1800 - 1.5)
    for p in out.values():
        assert p["jobs"]["a"]["tokens"] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("field,value,words", [
    ("tokens", -1, ["jobs.0.tokens", "number from"]),
    ("model", "gpt-9000", ["jobs.0.model", "preset"]),
    ("priority", 1.5, ["jobs.0.priority", "whole number"]),
    ("colour", "red", ["jobs.0", "unknown field", "colour"]),
])
def test_a_bad_jobs_file_exits_2_naming_the_field(tmp_path, field, value, words):
    job = {"name": "a", "arrive_min": 0, "model": "gpt-350m", "global_batch": 64, "tokens": 1.0} | {field: value}
    r = subprocess.run([HETSPOT, "simulate", "--trace", str(ROOT / "examples/traces/aws-p3-hh_55_65.jsonl"),
                        "--cluster", str(ROOT / "examples/fleets/a10g-l4-32.yaml"), "--jobs",
                        str(jobs_file(tmp_path, job))], capture_output=True, text=True, timeout=120)
    msg = " ".join(r.stderr.split())
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in msg, (w, msg)


def test_the_shipped_day_of_jobs_on_the_shipped_trace(tmp_path):
    """examples/jobs/team-day.yaml over examples/traces/aws-p3-hh_55_65.jsonl on the 32-GPU fleet, as
    docs/benchmarks.md quotes it: both policies replay the same 6 jobs and events; the tables print."""
    args = [HETSPOT, "simulate", "--trace", str(ROOT / "examples/traces/aws-p3-hh_55_65.jsonl"), "--cluster",
            str(ROOT / "examples/fleets/a10g-l4-32.yaml"), "--jobs", str(ROOT / "examples/jobs/team-day.yaml")]
    r = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["policies"]) == {"fcfs", "share"} and out["hours"] == pytest.approx(1.0)
    for p in out["policies"].values():
        assert len(p["jobs"]) == 6 and 0 < p["goodput"] <= 1.0 + 1e-9
    t = subprocess.run(args, capture_output=True, text=True, timeout=300, env={"COLUMNS": "80", "PATH": ""})
    assert t.returncode == 0 and "vs fcfs" in t.stdout and "1.00x" in t.stdout, t.stderr
    assert max(len(line) for line in t.stdout.splitlines()) <= 80  # the tables fit a terminal
