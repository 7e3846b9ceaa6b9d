"""docs/deploy.md's runbooks, offline: every ```bash block marked `# offline` (render, lint, policy files, job
checks) runs in the runbook's order from a fresh copy of the repository, as tests/test_readme.py does for the
README, each command exiting 0. What it renders is then held to Ray's own validator."""

import copy
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_readme import fresh_copy

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def offline_commands() -> list[str]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "deploy.md").read_text(), re.S):
        lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
        if lines and lines[0] == "# offline":
            out += [ln.split("  #")[0].strip() for ln in lines[1:] if not ln.startswith("#")]
    return out


def test_the_runbooks_offline_commands_run_in_order_from_a_fresh_copy(tmp_path):
    cmds = offline_commands()
    tools = {c.split()[0] for c in cmds}
    assert {"hetspot", "hadolint", "python"} <= tools, cmds  # image lint, policy files, render, job check
    assert any(" plan " in f" {c} " for c in cmds) and sum("deploy render" in c for c in cmds) >= 3, cmds
    clone = fresh_copy(tmp_path / "hetspot")
    exe = {"hetspot": str(BIN / "hetspot"), "hadolint": str(BIN / "hadolint"), "python": sys.executable}
    for cmd in cmds:
        argv = shlex.split(cmd)
        r = subprocess.run([exe[argv[0]], *argv[1:]], cwd=clone, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"`{cmd}` exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    from ray.autoscaler._private.util import prepare_config, validate_config

    aws = yaml.safe_load((clone / "my-fleet.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(aws)))
    assert aws["docker"]["image"].endswith("hetspot-node:0.1.0") and aws["setup_commands"] == []
    for name in ("fleet-gke.yaml", "fleet-eks.yaml"):
        kinds = [d["kind"] for d in yaml.safe_load_all((clone / name).read_text()) if d]
        assert kinds == ["RayCluster", "RayJob"], (name, kinds)
