"""planner/ is pure: no ray, torch or boto3, checked by source scan and by a fresh interpreter; and the controller's
side of a job imports no torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
FORBIDDEN = {"ray", "torch", "boto3", "botocore"}
PLANNER = Path(__file__).resolve().parents[1] / "planner"


def test_planner_source_imports_nothing_forbidden():
    for path in PLANNER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_importing_planner_loads_no_forbidden_module():
    code = ("import sys, planner, planner.baselines, planner.simulator; "
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r}); "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PLANNER.parent)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_controllers_side_loads_no_torch():
    """The job's controller runs in a Ray worker process of its own and creates the TrainWorker actors: importing
    it, the worker actor's module (to create them), the step's record (which it reads every step) and the model's
    unit list (its state plane's) loads no torch (2.4 s of CPU a job before)."""
    code = ("import sys; import orchestrator.runtime.controller_actor, orchestrator.state.tiers; "
            "from workers.actor import TrainWorker, WorkerConfig; from workers.transfer import StepResult; "
            "from workers.param_specs import all_params; from planner import ModelSpec; "
            "n = len(all_params(ModelSpec.preset('tiny'))); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'); print(n, bad[:3]); "
            "sys.exit(1 if bad or not n else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PLANNER.parent)
    assert res.returncode == 0, res.stdout + res.stderr
