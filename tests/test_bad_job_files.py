"""Malformed job and plan files: exit 2, one message naming the field or the file, no traceback, no hang.

Each case is a job file given to `hetspot plan` in a subprocess with a time limit, as a user runs it:
a hang fails the test instead of stalling the suite.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit
HETSPOT = str(Path(sys.executable).parent / "hetspot")
GOOD = {"model": {"preset": "tiny"}, "train": {"global_batch": 8},
        "cluster": {"nodes": [{"name": "a", "gpu_type": "A100-80GB", "num_gpus": 2}]}}


def _with(section: str, **fields) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in GOOD.items()}
    out[section] = dict(out.get(section) or {}) | fields
    return out


def _node(**fields) -> dict:
    return GOOD | {"cluster": {"nodes": [GOOD["cluster"]["nodes"][0] | fields]}}


CASES = {
    # (file content: bytes, str or a mapping to dump; words the message must hold)
    "not-utf8": (b"\xff\xfe\x00bad", ["not UTF-8"]),
    "empty": (b"", ["YAML mapping"]),
    "a-list": ("- model\n- train\n", ["YAML mapping"]),
    "yaml-syntax": ("model: {preset: tiny\n", ["not valid YAML"]),
    "deep-yaml": ("a: " + "[" * 5000 + "]" * 5000 + "\n", ["nested too deeply"]),
    "unknown-top-field": (GOOD | {"modle": {}}, ["modle"]),
    "model-a-list": (GOOD | {"model": []}, ["model"]),
    "train-a-string": (GOOD | {"train": "fast"}, ["train"]),
    "unknown-preset": (_with("model", preset="gpt-9000"), ["gpt-9000"]),
    "heads-zero": (_with("model", preset=None, num_layers=2, hidden_size=32, num_heads=0, vocab_size=64, seq_len=16),
                   ["num_heads"]),
    "heads-not-dividing": (_with("model", num_heads=5), ["num_heads"]),
    "layers-huge": (_with("model", num_layers=200000), ["num_layers"]),
    "hidden-huge": (_with("model", hidden_size=10**9), ["hidden_size"]),
    "seq-len-one": (_with("model", seq_len=1), ["seq_len"]),
    "vocab-a-word": (_with("model", vocab_size="many"), ["vocab_size"]),
    "kv-heads-on-gpt": (_with("model", num_kv_heads=2), ["num_kv_heads"]),
    "ffn-zero": (_with("model", ffn_size=0), ["ffn_size"]),
    "batch-bool": (_with("train", global_batch=True), ["global_batch"]),
    "batch-zero": (_with("train", global_batch=0), ["global_batch"]),
    "batch-huge": (_with("train", global_batch=10**9), ["global_batch"]),
    "batch-float": (_with("train", global_batch=8.5), ["global_batch"]),
    "reserve-inf": (_with("train", memory_reserve_gib=float("inf")), ["memory_reserve_gib"]),
    "lr-nan": (_with("train", lr=float("nan")), ["lr"]),
    "lr-negative": (_with("train", lr=-1), ["lr"]),
    "betas-one": (_with("train", betas=[0.9]), ["betas"]),
    "precision-fp8": (_with("train", precision="fp8"), ["precision"]),
    "steps-zero": (GOOD | {"steps": 0}, ["steps"]),
    "recovery-unknown": (_with("runtime", recovery="reboot"), ["recovery", "in-place", "restart"]),
    "timeout-zero": (_with("runtime", timeouts={"transfer_s": 0}), ["transfer_s"]),
    "timeout-unknown": (_with("runtime", timeouts={"restore_s": 5}), ["restore_s"]),
    "warm-workers-negative": (_with("runtime", warm_workers=-1), ["warm_workers", "0"]),
    "warm-workers-too-many": (_with("runtime", warm_workers=65), ["warm_workers", "64"]),
    "warm-workers-text": (_with("runtime", warm_workers="some"), ["warm_workers"]),
    "stall-limit-zero": (_with("runtime", max_failures_without_progress=0), ["max_failures_without_progress", "1"]),
    "gpu-unknown": (_node(gpu_type="B9000"), ["gpu_type"]),
    "gpus-zero": (_node(num_gpus=0), ["num_gpus"]),
    "gpus-bool": (_node(num_gpus=True), ["num_gpus"]),
    "price-negative": (_node(price_per_hour=-1), ["price_per_hour"]),
    "bandwidth-zero": (_node(inter_node_bw_gb_s=0), ["inter_node_bw_gb_s"]),
    "duplicate-nodes": (GOOD | {"cluster": {"nodes": [GOOD["cluster"]["nodes"][0]] * 2}}, ["a"]),
    "no-nodes": (GOOD | {"cluster": {"nodes": []}}, ["nodes"]),
    "data-text-no-path": (GOOD | {"data": {"kind": "text"}}, ["data"]),
}


def _hetspot(*args: str, timeout: float = 30):
    return subprocess.run([HETSPOT, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_job_file_exits_2_with_one_clean_message(tmp_path, name):
    content, words = CASES[name]
    f = tmp_path / "job.yaml"
    if isinstance(content, bytes):
        f.write_bytes(content)
    elif isinstance(content, str):
        f.write_text(content)
    else:
        f.write_text(yaml.safe_dump(content))
    r = _hetspot("plan", str(f))
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-2000:]
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def test_a_directory_as_the_job_path_says_so(tmp_path):
    r = _hetspot("plan", str(tmp_path))
    assert r.returncode == 2 and "is a directory" in r.stderr and "Traceback" not in r.stderr


def test_a_binary_plan_file_exits_2(tmp_path):
    job, plan = tmp_path / "job.yaml", tmp_path / "plan.json"
    job.write_text(yaml.safe_dump(GOOD))
    plan.write_bytes(bytes(range(256)) * 4)
    r = _hetspot("submit", str(job), "--plan", str(plan))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "plan" in r.stderr, r.stderr[-2000:]
