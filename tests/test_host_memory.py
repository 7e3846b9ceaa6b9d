"""Host memory is a constraint (issue 15): offloaded state must fit the node's RAM, shared by its GPUs.

The plan's host bytes per node (Estimate.host_gib) are held to what the offload engine keeps in host
memory for a small model, measured from its tensors (masters, their gradients, AdamW's moments).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from planner import ClusterSpec, ModelSpec, NodeSpec, cost, evaluate
from tests.test_offload_engine import POLICIES, TRAIN, one_stage_plan, run

pytestmark = pytest.mark.unit
HETSPOT = str(Path(sys.executable).parent / "hetspot")


def _plan(tmp_path, node: dict) -> subprocess.CompletedProcess:
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump({"model": {"preset": "70b"}, "train": {"global_batch": 8},
                                 "cluster": {"nodes": [node]}}))
    return subprocess.run([HETSPOT, "plan", str(f), "--json"], capture_output=True, text=True, timeout=300)


def test_70b_on_one_t4_needs_host_memory_it_does_not_have(tmp_path):
    r = _plan(tmp_path, {"name": "t4-0", "gpu_type": "T4", "num_gpus": 1})
    msg = " ".join(r.stderr.split())
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "host memory" in msg and "'t4-0'" in msg and "48 GiB" in msg and "host_mem_gib" in msg


def test_70b_on_one_t4_with_2000_gib_plans_within_that_memory(tmp_path):
    import json

    r = _plan(tmp_path, {"name": "t4-0", "gpu_type": "T4", "num_gpus": 1, "host_mem_gib": 2000})
    assert r.returncode == 0, r.stderr
    est = json.loads(r.stdout)["estimate"]
    assert 900 < est["host_gib"]["t4-0"] <= 2000  # 70B params x 16 bytes of offloaded state


def test_a_node_shares_its_host_memory_between_its_gpus():
    one = NodeSpec(name="a", gpu_type="L4", num_gpus=4)
    assert one.host_mem == 192.0  # the L4 default, 48 GiB per GPU
    slot = cost.make_slot(ClusterSpec(nodes=[one.model_copy(update={"host_mem_gib": 100.0})]), TRAIN, "a", 1)
    assert slot.host_cap_bytes == 25.0 * cost.GIB


@pytest.mark.parametrize("name", ["optimizer", "param+optimizer", "all"])
def test_estimated_host_bytes_within_10_percent_of_the_engine(name):
    model = ModelSpec.preset("small")
    off = POLICIES[name](model)
    results, _ = run(model, off, steps=2, dtype=torch.float32)
    measured = results[-1].extra["host_state_bytes"]  # step 2: AdamW's moments exist
    cluster = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100-80GB", num_gpus=1)])
    est = evaluate(one_stage_plan(model, off), cluster, model, TRAIN)
    want = est.host_gib["a"] * cost.GIB
    assert measured > 0 and abs(measured / want - 1) <= 0.10, (measured, want)
    plain, _ = run(model, {}, steps=1, dtype=torch.float32)
    assert plain[-1].extra["host_state_bytes"] == 0
    assert "a" not in evaluate(one_stage_plan(model, {}), cluster, model, TRAIN).host_gib
