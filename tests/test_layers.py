"""The layers' arrows point one way: no import circle, pure files import no Ray, boto3 or torch.

Reads every module's imports from its source (module level and inside functions
alike), builds the graph of hetspot's own modules, and checks:
  - no circle among hetspot modules;
  - planner/ imports no ray, torch, boto3 (also tests/test_planner_imports.py);
  - the orchestrator's pure decision files import no ray, boto3 or torch;
  - in workers/, only the actor adapter imports ray;
  - planner/ imports nothing of workers/ or orchestrator/, and workers/ nothing of orchestrator/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "workers", "orchestrator")
PURE_ORCHESTRATOR = ["errors", "job_spec", "protocols", "policies", "fakes", "progress_lines",
                     "preemption.failures", "state.snapshots", "controller", "elastic", "drills.scenario",
                     "drills.trace", "drills.fleet"]
SIDE_EFFECT_LIBS = {"ray", "boto3", "botocore", "torch"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Imported modules; `from pkg import mod` counts as `pkg.mod` when that is a module file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if (ROOT / (sub.replace(".", "/") + ".py")).is_file() else node.module)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        graph[name] = {i for i in _imports(path) if i in files and i != name}
    return graph


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                circle = stack[stack.index(m):] + [n, m] if m in stack else [n, m]
                pytest.fail("import circle: " + " -> ".join(circle))
            if m not in state:
                visit(m, stack + [n])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])


def _third_party(module: str) -> set[str]:
    path = ROOT / (module.replace(".", "/") + ".py")
    return {i.split(".")[0] for i in _imports(path)}


@pytest.mark.parametrize("module", [f"orchestrator.{m}" for m in PURE_ORCHESTRATOR])
def test_pure_orchestrator_files_import_no_side_effect_library(module):
    assert not _third_party(module) & SIDE_EFFECT_LIBS, module


def test_in_workers_only_the_actor_adapter_imports_ray():
    users = sorted(_module_name(p) for p in (ROOT / "workers").rglob("*.py") if "ray" in
                   {i.split(".")[0] for i in _imports(p)})
    assert users == ["workers.actor"]


def test_arrows_point_down():
    for name, deps in _graph().items():
        top = name.split(".")[0]
        if top == "planner":
            assert not {d for d in deps if d.split(".")[0] in ("workers", "orchestrator")}, name
        if top == "workers":
            assert not {d for d in deps if d.split(".")[0] == "orchestrator"}, name

