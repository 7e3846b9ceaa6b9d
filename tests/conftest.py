"""Shared fixtures. Ray tests share one embedded test cluster per module (see tests/test_train_ray.py)."""

import os
import tempfile

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

# hypothesis keeps its files (example database, constants) outside the checkout, not in a `.hypothesis/` folder
# of the user's clone.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(tempfile.gettempdir(), f"hetspot-hypothesis-{os.getuid()}"))


MARKERS = {"unit", "sweep", "ray", "gpu", "slow"}

# Seconds each of the longest modules took in a serial run (session 20's clean-clone rehearsal, 2 cores). `make
# test` runs the suite on two xdist workers (`--dist loadgroup`): every Ray test is in one group, so one worker runs
# the Ray modules one after another (two Ray test clusters side by side on 2 cores each ran over twice as slow, and
# a node's raylet has 30 s to register), while the other worker runs the pure modules, a module at a time, longest
# first. The figures only order; a stale one costs time, never a result.
MODULE_SECONDS: dict[str, float] = {
    "test_recovery_ray.py": 1028, "test_train_ray.py": 618, "test_drills.py": 554, "test_planner_invariants.py": 346,
    "test_planner_optimality.py": 237, "test_resume_and_lost_controller.py": 231, "test_readme.py": 165,
    "test_host_memory.py": 146, "test_fleet_choice.py": 125, "test_s3_hostile.py": 121,
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    """Every test says what it needs (pyproject's markers): a test without one is a collection error. Then the
    xdist groups (the Ray tests together, every other module on its own) and the order: the Ray group first,
    then the longest modules (MODULE_SECONDS), each module's tests in their own order."""
    bare = [it.nodeid for it in items if not {m.name for m in it.iter_markers()} & MARKERS]
    if bare:
        raise RuntimeError(f"tests without a marker ({', '.join(sorted(MARKERS))}): " + ", ".join(bare[:10]))
    first = {}
    for i, it in enumerate(items):
        first.setdefault(it.nodeid.split("::", 1)[0], i)

    def module(it) -> str:
        return it.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]

    def ray(it) -> bool:
        return it.get_closest_marker("ray") is not None

    for it in items:
        it.add_marker(pytest.mark.xdist_group("ray" if ray(it) else module(it)))
    items.sort(key=lambda it: (not ray(it), -MODULE_SECONDS.get(module(it), 0.0),
                               first[it.nodeid.split("::", 1)[0]]))  # stable: a module's tests keep their order
