"""planner/ is pure: no ray, torch or boto3, checked by source scan and by a fresh interpreter."""

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
