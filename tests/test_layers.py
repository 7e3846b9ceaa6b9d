"""The layers' arrows point one way: no import circle, pure folders import no Ray, boto3 or torch.

Reads every module's imports from its source (module level and inside functions
alike), builds the graph of hetspot's own modules, and checks:
  - no circle among hetspot modules;
  - the pure folders and files (planner/, orchestrator/control/, and the pure files elsewhere, found by
    scanning the folders, not from a hand-kept list) import no ray, torch, boto3;
  - orchestrator/control/ imports nothing of hetspot beyond planner/, orchestrator/errors.py and itself;
  - in workers/, only the actor adapter imports ray;
  - planner/ imports nothing of workers/ or orchestrator/, and workers/ nothing of orchestrator/;
  - inside orchestrator/, no arrow points back up: control/ and state/restore_plan.py import no runtime/,
    cli/ or drills/; runtime/ no cli/; cluster/ no deploy/, cli/ or drills/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "workers", "orchestrator")
PURE_FOLDERS = ("planner", "orchestrator/control")  # every file in them
PURE_FILES = ("orchestrator/errors.py", "orchestrator/job_spec.py", "orchestrator/state/restore_plan.py",
              "orchestrator/runtime/progress_lines.py", "orchestrator/drills/scenario.py",
              "orchestrator/drills/trace.py", "orchestrator/drills/fleet.py")
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


def _third_party(path: Path) -> set[str]:
    return {i.split(".")[0] for i in _imports(path)}


def _pure_files() -> list[str]:
    files = [p for d in PURE_FOLDERS for p in (ROOT / d).rglob("*.py")] + [ROOT / f for f in PURE_FILES]
    return sorted(str(p.relative_to(ROOT)) for p in files)


def test_the_pure_list_is_found_by_scanning_folders():
    files = _pure_files()
    assert "orchestrator/control/controller.py" in files and "orchestrator/control/replan.py" in files
    assert "planner/search.py" in files and len([f for f in files if f.startswith("orchestrator/control/")]) >= 8


@pytest.mark.parametrize("path", _pure_files())
def test_pure_files_import_no_side_effect_library(path):
    assert not _third_party(ROOT / path) & SIDE_EFFECT_LIBS, path


def test_control_imports_only_the_planner_errors_and_itself():
    for name, deps in _graph().items():
        if name.startswith("orchestrator.control."):
            bad = {d for d in deps
                   if not d.startswith(("planner", "orchestrator.control.")) and d != "orchestrator.errors"}
            assert not bad, (name, bad)


def test_no_arrow_points_back_up_inside_the_orchestrator():
    up = {"orchestrator.control.": ("orchestrator.runtime", "orchestrator.cli", "orchestrator.drills",
                                    "orchestrator.state", "orchestrator.cluster", "orchestrator.api",
                                    "orchestrator.driver"),
          "orchestrator.state.restore_plan": ("orchestrator.runtime", "orchestrator.cli", "orchestrator.drills"),
          "orchestrator.runtime.": ("orchestrator.cli", "orchestrator.api", "orchestrator.driver"),
          # the capacity loop and discovery read node kinds and labels from cluster/ itself, not the deploy renderer
          "orchestrator.cluster.": ("orchestrator.deploy", "orchestrator.cli", "orchestrator.drills",
                                    "orchestrator.api", "orchestrator.driver")}
    for name, deps in _graph().items():
        for prefix, banned in up.items():
            if name.startswith(prefix):
                bad = {d for d in deps if d.startswith(banned)}
                assert not bad, (name, bad)


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

